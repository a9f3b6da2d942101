"""The relative-query policy (core/policies/relative_query.py), the grid MLP's canvas and the wider view
(core/view.py, sim.config.widen_view). Models are tiny random configs of the real architectures
(and a tiny training run on a small synthetic cache)."""

import copy
import json

import numpy as np
import pytest
import torch
from samples import TINY_SETTINGS, tiny_dinov2_policy, tiny_policy

from sps_driving.core.grid import PatchGrid
from sps_driving.core.image import patch_rectangles
from sps_driving.core.policies.blocks import pack_kept
from sps_driving.core.policies.checkpoint import load_policy, save_policy
from sps_driving.core.policies.registry import PolicyArchitecture, build_policy
from sps_driving.core.selection import PatchSelector, SelectionConfig
from sps_driving.core.state import STATE_NAMES
from sps_driving.core.view import grid_center, widen_extraction, wider_grid, window_origin

WINDOW = PatchGrid(4, 6)  # the grid the policies are built on (their training grid)
BIG = PatchGrid(12, 16)  # a larger grid the window's block is placed in
D = 8
ORIGINS = ((1, 2), (6, 9))  # two places of the block's first cell in BIG
STATE = {"speed_mps": 7.0, "target_speed_mps": 9.0}


def policy_config(name, grid, variant="sps", **settings):
    architecture = PolicyArchitecture(name, {**TINY_SETTINGS[name], **settings}, 0.5)
    return architecture.config(grid, D, SelectionConfig(variant, 0.5, 0), backbone="test-random")


def statistics():
    """Per-channel (mean, std) [D] far from (0, 1), as foundation-model descriptors' are."""
    rng = np.random.default_rng(5)
    return rng.normal(scale=5.0, size=D).astype(np.float32), np.exp(rng.normal(scale=1.5, size=D)).astype(np.float32)


def make(name, grid, variant="sps", **settings):
    torch.manual_seed(0)
    model = build_policy(policy_config(name, grid, variant, **settings))
    model.set_input_statistics(*statistics())
    return model.eval()


def descriptors(shape, seed=0):
    mean, std = statistics()
    return torch.from_numpy((np.random.default_rng(seed).normal(size=shape) * std + mean).astype(np.float32))


def block():
    """A window-sized block of descriptors [rows, cols, D] and which of its patches are kept."""
    keep = np.random.default_rng(1).random((WINDOW.rows, WINDOW.cols)) < 0.6
    return descriptors((WINDOW.rows, WINDOW.cols, D), 2), torch.from_numpy(keep)


def placed(origin, values, keep, grid=BIG):
    """`values` and `keep` put in `grid` with their first cell at `origin`; nothing else is kept."""
    grids = torch.zeros(1, grid.rows, grid.cols, D)
    mask = torch.zeros(1, grid.rows, grid.cols, dtype=torch.bool)
    rows, cols = keep.shape
    grids[0, origin[0]:origin[0] + rows, origin[1]:origin[1] + cols] = values * keep[..., None]
    mask[0, origin[0]:origin[0] + rows, origin[1]:origin[1] + cols] = keep
    return grids.reshape(1, grid.n, D), mask.reshape(1, grid.n)


def centre_of_block(origin):
    return origin[0] + grid_center(WINDOW)[0], origin[1] + grid_center(WINDOW)[1]


@torch.no_grad()
def test_moving_a_block_and_the_roi_centre_together_moves_the_per_position_outputs_by_as_much():
    model = make("relative_query", WINDOW)
    values, keep = block()
    maps, actions = [], []
    for origin in ORIGINS:
        model.set_view(BIG, center=centre_of_block(origin))
        packed = pack_kept(*placed(origin, values, keep))
        features = model.queries(*packed)[0]  # [Q, W], query q at cell model.query_cells[q] of BIG
        per_cell = torch.zeros(BIG.rows, BIG.cols, features.shape[-1])
        per_cell[model.query_cells[:, 0], model.query_cells[:, 1]] = features
        maps.append(per_cell)
        actions.append(model(*packed))
    dr, dc = (b - a for a, b in zip(*ORIGINS))
    shifted = torch.zeros_like(maps[0])
    shifted[dr:, dc:] = maps[0][:BIG.rows - dr, :BIG.cols - dc]
    assert maps[0].abs().sum() > 0 and torch.allclose(maps[1], shifted, atol=1e-5)
    assert torch.allclose(actions[0], actions[1], atol=1e-5)


@pytest.mark.parametrize("architecture, variant, moves_with_the_block", [
    ("relative_query", "sps", True), ("relative_query", "spps", True), ("relative_query", "threshold", True),
    ("positional_transformer", "sps", False), ("positional_transformer", "spps", False), ("mlp", "sps", False)])
@torch.no_grad()
def test_only_the_relative_policy_gives_the_same_action_for_the_block_moved_with_the_centre(architecture, variant,
                                                                                           moves_with_the_block):
    """The same test for every policy; the ones that read absolute cells must fail it."""
    values, keep = block()
    model = make(architecture, WINDOW if architecture == "relative_query" else BIG, variant)
    actions = []
    for origin in ORIGINS:
        if architecture == "relative_query":
            model.set_view(BIG, center=centre_of_block(origin))
        actions.append(model.forward_selected(*placed(origin, values, keep)))
    same = torch.allclose(actions[0], actions[1], atol=1e-5)
    assert same == moves_with_the_block, (actions, architecture)
    if not moves_with_the_block:
        assert (actions[0] - actions[1]).abs().max() > 1e-3


@torch.no_grad()
def test_the_centre_is_the_roi_centre_whichever_patches_sps_kept():
    grid = PatchGrid(8, 8)
    model = make("relative_query", grid)
    selector = PatchSelector(SelectionConfig("sps", 0.3, 0), grid)
    grids = descriptors((1, grid.n, D), 3)
    expected_cells = torch.round(model.query_offsets + torch.tensor(grid_center(grid))).long()
    centroids = set()
    for stamp in range(40):
        keep = torch.from_numpy(selector.stamp_masks([stamp]))
        out = model.forward_selected(grids, keep)
        assert model.center.tolist() == list(grid_center(grid)) and torch.equal(model.query_cells, expected_cells)
        centroids.add(tuple(np.round(grid.coords[keep[0].numpy()].mean(axis=0), 3)))
        if stamp == 0:  # had the centre moved (by one cell, say), the output would show it
            model.set_view(grid, center=(grid_center(grid)[0] + 1, grid_center(grid)[1]))
            assert (model.forward_selected(grids, keep) - out).abs().max() > 1e-4
            model.set_view(grid)
    assert len(centroids) > 30, "the kept patches' centroid moves with every draw"


@torch.no_grad()
def test_permuting_the_kept_tokens_changes_nothing():
    model = make("relative_query", WINDOW, "spps", readout="flatten")
    keep = torch.from_numpy(np.random.default_rng(4).random((3, WINDOW.n)) < np.array([[0.3], [0.6], [0.9]]))
    packed = pack_kept(descriptors((3, WINDOW.n, D), 5), keep)
    out, features = model(*packed), model.queries(*packed)
    order = torch.stack([torch.randperm(packed[0].shape[1], generator=torch.Generator().manual_seed(row)) for row in range(3)])
    shuffled = [torch.gather(t, 1, order if t.ndim == 2 else order[..., None].expand_as(t)) for t in packed]
    assert torch.allclose(model(*shuffled), out, atol=1e-6)
    assert torch.allclose(model.queries(*shuffled), features, atol=1e-5)


def test_trained_on_16x16_it_runs_on_16x24_and_gives_its_output_on_the_central_16x16_window(tmp_path):
    path = tiny_policy(tmp_path / "rq", 16, 16, D, architecture="relative_query", state_inputs=STATE_NAMES)
    nominal, wide = load_policy(path), load_policy(path, grid=PatchGrid(16, 24))
    assert wide.grid == PatchGrid(16, 24) and nominal.grid == PatchGrid(16, 16)
    grid = descriptors((16, 24, D), 6).numpy()
    window = np.ascontiguousarray(grid[:, 4:20]).reshape(-1, D)
    for stamp in (1, 2, 3):
        kept, wide_kept = nominal.selector.select(stamp), wide.selector.select(stamp)
        rows, cols = np.divmod(kept, 16)
        assert np.array_equal(wide_kept, rows * 24 + cols + 4), "the same cells of the window, for the same stamp"
        assert wide.predict(grid.reshape(-1, D)[wide_kept], wide_kept, STATE) == pytest.approx(
            nominal.predict(window[kept], kept, STATE), abs=1e-5)
        assert np.allclose(wide.attribution(grid.reshape(-1, D)[wide_kept], wide_kept, STATE),
                           nominal.attribution(window[kept], kept, STATE), atol=1e-5)
    # Given every patch of the wider grid, it reads those of its window only.
    assert wide.predict(grid.reshape(-1, D), np.arange(16 * 24), STATE) == pytest.approx(
        nominal.predict(window, np.arange(256), STATE), abs=1e-5)


def test_an_mlp_with_a_canvas_reads_a_wider_grid_others_refuse_it(tmp_path):
    config = policy_config("mlp", PatchGrid(16, 16), canvas=[16, 24])
    torch.manual_seed(0)
    path = save_policy(build_policy(config), config, tmp_path / "canvas")
    nominal, wide = load_policy(path), load_policy(path, grid=PatchGrid(16, 24))
    grid = descriptors((16, 24, D), 7).numpy()
    window = np.ascontiguousarray(grid[:, 4:20]).reshape(-1, D)
    kept = nominal.selector.select(5)
    assert wide.predict(grid.reshape(-1, D)[wide.selector.select(5)], wide.selector.select(5)) == pytest.approx(
        nominal.predict(window[kept], kept), abs=1e-5)
    # The canvas columns beside the training grid start at zero: the wider grid's outer patches add nothing.
    assert wide.predict(grid.reshape(-1, D), np.arange(16 * 24)) == pytest.approx(nominal.predict(window, np.arange(256)),
                                                                                 abs=1e-5)
    for name in ("mlp", "positional_transformer"):
        path = tiny_policy(tmp_path / name, 16, 16, D, architecture=name)
        with pytest.raises(ValueError, match=f"this {name} policy reads the patches of the 16x16 grid it was trained on"):
            load_policy(path, grid=PatchGrid(16, 24))
    with pytest.raises(ValueError, match="cannot be centred on whole cells"):
        load_policy(tmp_path / "canvas", grid=PatchGrid(16, 30))  # wider than the canvas


@pytest.mark.parametrize("variant", ["sps", "spps"])
def test_a_tiny_training_run_learns_and_its_checkpoint_round_trips(tmp_path, variant):
    from test_trainer import COLS, ROWS, make_cache

    from sps_driving.train.trainer import TrainConfig, evaluate_checkpoint, train

    cache = make_cache(tmp_path / "cache")
    out = tmp_path / "rq"
    summary = train(TrainConfig.from_yaml(cache=str(cache), out=str(out), architecture="relative_query", variant=variant,
                                          width=16, depth=1, heads=2, dropout=0.0, reduce=2, batch_size=16, epochs=6))
    history = [h["validation_loss"] for h in summary["history"]]
    assert min(history) < 0.8 * history[0], f"validation loss should fall: {history}"
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["architecture"] == "relative_query" and recorded["selection"]["variant"] == variant
    assert recorded["policy"] == {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 2,
                                  "query_stride": 1, "readout": "flatten"}
    assert recorded["view"] == {"roi": None, "center_frame": [0.5, 0.5], "center_patch": [(ROWS - 1) / 2, (COLS - 1) / 2]}
    assert evaluate_checkpoint(out) == pytest.approx(recorded["validation_loss"], rel=1e-5)
    policy = load_policy(out)
    values, kept = descriptors((5, D), 8).numpy(), np.array([0, 3, 4, 7, 11])
    grids = torch.zeros(1, ROWS * COLS, D)
    grids[0, kept] = torch.from_numpy(values)
    keep = torch.zeros(1, ROWS * COLS, dtype=torch.bool)
    keep[0, kept] = True
    with torch.no_grad():
        expected = policy.module.forward_selected(grids, keep, torch.tensor([[STATE[n] for n in STATE_NAMES]]))
    assert policy.predict(values, kept, STATE) == pytest.approx(expected[0].tolist(), abs=1e-6)


def test_an_mlp_on_a_canvas_trains_only_the_weights_of_its_grids_cells(tmp_path):
    from test_trainer import COLS, ROWS, make_cache

    from sps_driving.train.trainer import TrainConfig, train

    cache = make_cache(tmp_path / "cache")
    train(TrainConfig.from_yaml(cache=str(cache), out=str(tmp_path / "mlp"), architecture="mlp", canvas=[ROWS, COLS + 4],
                                width=16, reduce=2, dropout=0.0, batch_size=16, epochs=2))
    policy = load_policy(tmp_path / "mlp")
    assert policy.config["policy"]["canvas"] == [ROWS, COLS + 4]
    weights = policy.module.mlp[1].weight[:, :ROWS * (COLS + 4) * 2].reshape(-1, ROWS, COLS + 4, 2)
    assert (weights[:, :, [0, 1, -2, -1]] == 0).all() and (weights[:, :, 2:-2] != 0).all()


@pytest.mark.parametrize("roi, input_size", [(None, (224, 224)), ([0.4, 0.65, 0.125, 0.875], (168, 336)),
                                             ([0.3, 0.7, 0.1, 0.6], (168, 280))])
def test_the_wider_extraction_puts_the_nominal_patches_in_its_central_window(roi, input_size):
    nominal = PatchGrid(input_size[0] // 14, input_size[1] // 14)
    wide = widen_extraction({"input_size": list(input_size), "roi": roi}, 1.5)
    grid = wider_grid(nominal, 1.5)
    assert wide["input_size"] == [input_size[0], input_size[1] * 3 // 2] == [grid.rows * 14, grid.cols * 14]
    assert (wide["roi"] is None) == (roi is None)
    top, left = window_origin(nominal, grid)
    rows, cols = np.divmod(np.arange(nominal.n), nominal.cols)
    window = (rows + top) * grid.cols + cols + left
    wide_rects = patch_rectangles((280, 672), wide["roi"], wide["input_size"], (grid.rows, grid.cols))[window]
    # The 448 px nominal frame is the middle of the 672 px wide one: 112 px to its left.
    assert np.allclose(wide_rects - [112, 0, 112, 0], patch_rectangles((280, 448), roi, input_size, (nominal.rows, nominal.cols)),
                       atol=1e-6)


def test_the_wider_view_renders_the_nominal_frame_in_its_middle():
    from sps_driving.sim.config import load_sim_config, widen_view
    from sps_driving.sim.render import Renderer
    from sps_driving.sim.scenarios import get_scenario
    from sps_driving.sim.world import World, make_episode

    config = load_sim_config(profile="quick")
    wide = copy.deepcopy(config)
    widen_view(wide, 1.5)
    cam = wide["camera"]
    assert (cam["render_width"], cam["render_height"], cam["view_width_scale"]) == (672, 280, 1.5)
    # Same focal length in px: (width / 2) / tan(hfov / 2) is unchanged.
    focal = [c["render_width"] / 2 / np.tan(np.radians(c["hfov_deg"]) / 2) for c in (config["camera"], cam)]
    assert focal[1] == pytest.approx(focal[0])
    for scenario in ("rural-summer-dry-day-car", "rural-winter-snow-day-animal"):
        frames = []
        for settings in (config, wide):
            renderer = Renderer(settings)
            frames.append(renderer.render(World(settings, make_episode(settings, get_scenario(scenario), 3))))
            renderer.close()
        difference = np.abs(frames[0].astype(int) - frames[1][:, 112:560].astype(int)).max(axis=-1)
        # The rasterizer's edges differ here and there; the frame is the same.
        assert (difference == 0).mean() > 0.8 and (difference > 10).mean() < 0.01, scenario
    with pytest.raises(ValueError, match="even number of px"):
        widen_view(copy.deepcopy(config), 1.001)


def test_eval_drives_the_relative_policy_on_the_nominal_and_the_wider_view(tmp_path):
    """A tiny random relative-query policy over DINOv2 (torch) through `sps-driving eval`, on the
    nominal 448x280 view (16x16 patches) and one 1.5 times as wide (672x280, 16x24); the grid MLP
    is refused the wider one."""
    from sps_driving.cli import main

    policy = tiny_dinov2_policy(tmp_path / "rq", architecture="relative_query")
    torch_backend = tmp_path / "torch.yaml"
    torch_backend.write_text("backend: torch\n")
    args = ["eval", "--policy", str(policy), "--episodes", "1", "--episode-s", "1", "--workers", "1", "--scenarios",
            "rural-summer-dry-day-car", "--backbone-config", str(torch_backend)]
    assert main(args + ["--out", str(tmp_path / "nominal")]) == 0
    assert main(args + ["--view-width-scale", "1.5", "--out", str(tmp_path / "wide")]) == 0
    rows = {name: json.loads((tmp_path / name / "results.jsonl").read_text()) for name in ("nominal", "wide")}
    assert (rows["nominal"]["width"], rows["wide"]["width"]) == (448, 672)
    assert all(r["method"] == "RQ-50" and r["dropped_frames"] == 0 and r["height"] == 280 for r in rows.values())
    mlp = tiny_dinov2_policy(tmp_path / "mlp")
    with pytest.raises(SystemExit, match="this mlp policy reads the patches of the 16x16 grid it was trained on"):
        main(["eval", "--policy", str(mlp), "--view-width-scale", "1.5", "--episodes", "1", "--out", str(tmp_path / "x")])


@pytest.mark.ros
def test_the_policy_node_drives_with_a_relative_policy(tmp_path):
    """The policy node (a real process over DDS; this test plays the extractor, the speed report
    and the cruise target) commands what the core gives for the same kept descriptors."""
    from geometry_msgs.msg import TwistStamped
    from ros_helpers import Probe
    from sensor_msgs.msg import JointState, PointCloud2

    from sps_driving.core import topics
    from sps_driving.ros import msgs
    from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers

    path = tiny_policy(tmp_path / "rq", 8, 8, D, variant="spps", architecture="relative_query", state_inputs=STATE_NAMES)
    policy = load_policy(path)
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(path), "vehicle_backend": "topics"}},
                  log_dir=tmp_path / "logs")
    probe = Probe()
    probe.record(topics.POLICY_COMMAND, JointState, "stream")
    descriptors_out = probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream")
    state_out = {topics.VEHICLE_TWIST: probe.publisher(topics.VEHICLE_TWIST, TwistStamped, "sensor_out"),
                 topics.TARGET_SPEED: probe.publisher(topics.TARGET_SPEED, TwistStamped, "sensor_out")}
    graph.start()
    try:
        wait_for_nodes(probe.node, ["policy"], 60, graph)
        for publisher in (descriptors_out, *state_out.values()):
            wait_for_subscribers(publisher, 1, 60)
        for frame in range(2):
            stamp = 1_700_000_000_000_000_000 + frame * 100_000_000
            for _ in range(3):  # the node reads sensor data best effort
                state_out[topics.VEHICLE_TWIST].publish(msgs.to_ros(msgs.twist_fields(STATE["speed_mps"], stamp)))
                state_out[topics.TARGET_SPEED].publish(msgs.to_ros(msgs.twist_fields(STATE["target_speed_mps"], stamp)))
            probe.spin(0.3)
            kept = policy.selector.select(stamp)
            values = descriptors((len(kept), D), frame).numpy()
            descriptors_out.publish(msgs.descriptors_message(values, kept, stamp, "camera"))

            def command(stamp=stamp):
                return next((m for m in probe.messages(topics.POLICY_COMMAND) if msgs.stamp_ns(m.header) == stamp), None)

            assert probe.spin_until(lambda: command() is not None, 10), f"no command for frame {stamp}"
            assert msgs.command_from_message(command()) == pytest.approx(policy.predict(values, kept, STATE), abs=1e-6)
    finally:
        graph.stop()
        probe.close()
