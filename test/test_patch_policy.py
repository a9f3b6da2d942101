"""The patch policy (block-causal, over the kept patches of the last frames) and its frame history.

Models are tiny random configs of the real architecture (width 16, one layer, 3 x 4 grid, D = 8),
with input statistics far from (0, 1) as foundation-model descriptors' are; caches are tiny
synthetic ones (test_trainer.make_cache)."""

import json

import numpy as np
import pytest
import torch
from test_trainer import make_cache

from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import (
    FrameHistory,
    HistorySettings,
    SharedWindowSelector,
    frame_windows,
    policy_selector,
    window_coverage,
)
from sps_driving.core.policies.checkpoint import DrivingPolicy, load_policy, save_policy
from sps_driving.core.policies.patch_policy import PatchPolicy, window_tensors
from sps_driving.core.policies.registry import PolicyArchitecture, build_policy
from sps_driving.core.policies.streaming import StreamingPolicy
from sps_driving.core.selection import PatchSelector, SelectionConfig, kept_count
from sps_driving.train.cache import FeatureCache, FeatureCacheWriter
from sps_driving.train.trainer import TrainConfig, evaluate_checkpoint, loss_scale, split_frames, train
from sps_driving.train.windows import window_table

GRID = PatchGrid(3, 4)
D = 8
STRIDE_NS = 100_000_000
CAMERA_NS = 33_333_333  # the car's camera: 30 Hz
T0 = 1_700_000_000_000_000_000
TINY = {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 3, "window_frames": 3,
        "frame_stride_s": 0.1, "stride_tolerance_s": 0.015, "max_gap_s": 0.5, "shared_selection": False}
STATE = ("speed_mps", "target_speed_mps")
INF = float("-inf")


def make_policy(state_inputs=STATE, rate=0.5, seed=0, **settings) -> DrivingPolicy:
    config = PolicyArchitecture("patch_policy", {**TINY, **settings}, 0.5).config(
        GRID, D, SelectionConfig("sps", rate, seed), backbone="test-random", state_inputs=state_inputs)
    torch.manual_seed(seed)
    module = build_policy(config)
    rng = np.random.default_rng(seed)
    module.set_input_statistics(rng.normal(3.0, 2.0, D), rng.uniform(0.5, 4.0, D))
    if state_inputs:
        module.state.set_statistics([8.0] * len(state_inputs), [2.0] * len(state_inputs))
    return DrivingPolicy(module, config)


def frame(rng, kept, speed=7.0):
    """(descriptors [k, D], sorted indices [k], state vector) of a random frame keeping `kept` patches."""
    indices = np.sort(rng.choice(GRID.n, kept, replace=False)).astype(np.int64)
    return rng.normal(3.0, 2.0, (kept, D)).astype(np.float32), indices, np.array([speed, 9.0], dtype=np.float32)


def readouts(policy: DrivingPolicy, window) -> torch.Tensor:
    with torch.no_grad():
        return policy.module.forward_windows(*window_tensors(window, D, "cpu"))[0]


# ---- the mask -----------------------------------------------------------------------------------


def token_frames(block_sizes) -> torch.Tensor:
    """int64 [S]: the frame index of every token when frame f brings block_sizes[f] tokens."""
    return torch.repeat_interleave(torch.arange(len(block_sizes)), torch.as_tensor(block_sizes))


def block_causal_mask(frames: torch.Tensor) -> torch.Tensor:
    """The mask written out: float [S, S], M[q, k] = 0 where frame(k) <= frame(q), else -inf."""
    allowed = frames.unsqueeze(0) <= frames.unsqueeze(1)
    return torch.zeros(allowed.shape).masked_fill(~allowed, INF)


def test_the_mask_is_block_causal_for_frames_of_different_kept_counts():
    # Three frames keeping 2, 0 and 1 patches: blocks of 3, 1 and 2 tokens (readout first).
    frames = token_frames([3, 1, 2])
    assert frames.tolist() == [0, 0, 0, 1, 2, 2]
    o = 0.0
    expected = torch.tensor([
        # keys: f0  f0   f0   f1   f2   f2        queries
        [o, o, o, INF, INF, INF],  # f0 readout
        [o, o, o, INF, INF, INF],  # f0 patch
        [o, o, o, INF, INF, INF],  # f0 patch
        [o, o, o, o, INF, INF],    # f1 readout
        [o, o, o, o, o, o],        # f2 readout
        [o, o, o, o, o, o],        # f2 patch
    ])
    assert torch.equal(block_causal_mask(frames), expected)
    two = block_causal_mask(token_frames([2, 4]))
    assert torch.equal(two, torch.tensor([[o, o, INF, INF, INF, INF]] * 2 + [[o] * 6] * 4))


@pytest.mark.parametrize("training", [False, True])
def test_the_encoder_equals_pytorchs_encoder_under_that_mask(training):
    """The policy runs one attention per frame over a prefix of the keys. PyTorch's own encoder,
    given the same layers, the written-out mask and the filler as key padding, must give the same
    tokens and the same gradients: windows of three blocks, filler slots in the first frame of one
    window and an absent last frame in another (dropout off, so that neither draws)."""
    policy = make_policy(depth=2, dropout=0.0).module.train(training)
    block, frames = 4, 3
    torch.manual_seed(5)
    tokens = torch.randn(2, frames * block, TINY["width"])
    filler = torch.zeros(2, frames * block, dtype=torch.bool)
    filler[0, 2:4] = True          # window 0: two filler slots in frame 0
    filler[1, 2 * block:] = True   # window 1: its third frame is absent
    mask = block_causal_mask(token_frames([block] * frames))
    padding = torch.zeros(filler.shape).masked_fill(filler, INF)
    ours_in, theirs_in = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    ours = policy.encode(ours_in, block, filler)
    theirs = policy.encoder(theirs_in, mask=mask, src_key_padding_mask=padding)
    present = ~filler[1, ::block].repeat_interleave(block)  # an absent frame's own rows mean nothing
    assert torch.allclose(ours[0], theirs[0], atol=1e-5, rtol=0)
    assert torch.allclose(ours[1, present], theirs[1, present], atol=1e-5, rtol=0)
    weights = torch.randn(tokens.shape)
    weights[1, ~present] = 0.0
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert torch.allclose(ours_in.grad, theirs_in.grad, atol=1e-5, rtol=0)
    assert (ours[0] - policy.encode(tokens, block, torch.zeros_like(filler))[0]).abs().max() > 1e-4, "filler must count"


# ---- causality ----------------------------------------------------------------------------------


def test_a_readout_sees_its_own_frame_whole_and_earlier_frames_never_later_ones():
    policy = make_policy()
    rng = np.random.default_rng(1)
    window = [frame(rng, k) for k in (5, 3, 6)]  # different kept counts: filler slots in frames 0 and 1
    base = readouts(policy, window)
    for t in range(2):
        later = list(window)
        values, _, state = frame(rng, len(window[t + 1][1]), speed=11.0)
        later[t + 1] = (values, np.sort(rng.choice(GRID.n, len(values), replace=False)), state)  # other patches, other places
        changed = readouts(policy, later)
        assert torch.allclose(changed[: t + 1], base[: t + 1], atol=1e-6, rtol=0), f"frame {t + 1} leaked into readouts 0..{t}"
        assert (changed[t + 1] - base[t + 1]).abs().max() > 1e-4, f"frame {t + 1}'s readout ignores its frame"
    first = list(window)
    first[0] = (window[0][0] + rng.normal(0, 3.0, window[0][0].shape).astype(np.float32), *window[0][1:])
    assert (readouts(policy, first)[-1] - base[-1]).abs().max() > 1e-4, "the newest readout must see frame 0"
    for t in range(3):
        values = window[t][0].copy()
        values[-1] += 5.0  # the last kept patch: after the readout token in the frame's block
        last_patch = list(window)
        last_patch[t] = (values, *window[t][1:])
        assert (readouts(policy, last_patch)[t] - base[t]).abs().max() > 1e-4, "a readout must see all of its frame"


def test_one_frame_window_is_the_single_frame_forward_and_t1_ignores_history():
    rng = np.random.default_rng(2)
    single = make_policy(window_frames=1)
    streaming = StreamingPolicy(single)
    for i in range(6):
        stamp = T0 + i * STRIDE_NS
        values, indices, state = frame(rng, int(rng.integers(2, GRID.n)))
        speeds = {"speed_mps": float(state[0]), "target_speed_mps": float(state[1])}
        assert streaming.step(stamp, values, indices, speeds) == pytest.approx(single.predict(values, indices, speeds), abs=1e-6)
    assert streaming.counts["history_frames"] == 6
    windowed = make_policy()  # T = 3: its newest readout over a window of one frame
    values, indices, state = frame(rng, 4)
    speeds = {"speed_mps": float(state[0]), "target_speed_mps": float(state[1])}
    assert StreamingPolicy(windowed).step(T0, values, indices, speeds) == pytest.approx(
        windowed.predict(values, indices, speeds), abs=1e-6)


def test_padded_windows_in_one_batch_equal_each_window_alone():
    policy = make_policy()
    rng = np.random.default_rng(3)
    windows = [[frame(rng, k) for k in counts] for counts in ((4,), (2, 7), (5, 1, 3))]
    length = max(len(f[1]) for w in windows for f in w)
    batch = [np.zeros((3, 3, length, D), np.float32), np.zeros((3, 3, length), np.int64), np.ones((3, 3, length), bool),
             np.zeros((3, 3, 2), np.float32)]
    for b, window in enumerate(windows):
        for f, (values, indices, state) in enumerate(window):
            batch[0][b, f, : len(indices)], batch[1][b, f, : len(indices)] = values, indices
            batch[2][b, f, : len(indices)], batch[3][b, f] = False, state
    with torch.no_grad():
        padded = policy.module.forward_windows(*(torch.from_numpy(a) for a in batch))
    for b, window in enumerate(windows):
        alone = readouts(policy, window)
        assert torch.allclose(padded[b, : len(window)], alone, atol=1e-5, rtol=0), f"window {b}"
    # An episode's start: its first frames are windows of one and two frames.
    episode = windows[2]
    streaming = StreamingPolicy(policy)
    for i, (values, indices, state) in enumerate(episode):
        command = streaming.step(T0 + i * STRIDE_NS, values, indices, {"speed_mps": float(state[0]), "target_speed_mps": 9.0})
        assert command == pytest.approx(readouts(policy, episode[: i + 1])[-1].tolist(), abs=1e-6)


def test_streaming_a_camera_episode_equals_the_batch_forward_over_each_window():
    """30 Hz frames with stamp jitter, one frame lost upstream: every command equals the newest
    readout of that frame's window in one padded batch of dense grids (the training path)."""
    policy = make_policy()
    rng = np.random.default_rng(4)
    count = 24
    stamps = T0 + np.arange(count) * CAMERA_NS + rng.integers(-3_000_000, 3_000_000, count)
    grids = rng.normal(3.0, 2.0, (count, GRID.n, D)).astype(np.float32)
    speeds = rng.uniform(4.0, 12.0, count).astype(np.float32)
    lost = 13
    streaming = StreamingPolicy(policy)
    commands = {}
    for i in range(count):
        if i == lost:
            continue
        indices = policy.selector.select(int(stamps[i]))
        commands[i] = streaming.step(int(stamps[i]), grids[i, indices], indices, {"speed_mps": float(speeds[i]),
                                                                                  "target_speed_mps": 9.0})
    usable = np.arange(count) != lost
    windows = frame_windows(stamps, np.zeros(count), policy.module.history, usable)
    assert windows[20].tolist() == [14, 17, 20] and windows[9].tolist() == [3, 6, 9], "every third camera frame"
    assert windows[16].tolist() == [16, -1, -1], "frame 13 is lost: its slot ends the window"
    windows = windows[usable]  # the lost frame has no window
    present = windows >= 0
    keep = np.zeros((len(windows), 3, GRID.n), bool)
    keep[present] = policy.selector.stamp_masks(stamps[windows[present]])
    state = np.stack([speeds, np.full(count, 9.0, np.float32)], axis=1)[np.maximum(windows, 0)] * present[..., None]
    with torch.no_grad():
        batch = policy.module.forward_selected(torch.from_numpy(grids[np.maximum(windows, 0)]), torch.from_numpy(keep),
                                               torch.from_numpy(state.astype(np.float32)))
    for row, (i, command) in enumerate(commands.items()):
        assert command == pytest.approx(batch[row, present[row].sum() - 1].tolist(), abs=1e-5), f"frame {i}"
    assert streaming.counts["history_missing_frame"] >= 1 and streaming.counts["history_frames"] == count - 1


# ---- the history --------------------------------------------------------------------------------


def settings(frames=3, tolerance_s=0.015, max_gap_s=0.5):
    return HistorySettings(frames, 0.1, tolerance_s, max_gap_s)


def test_stamps_going_backwards_or_a_long_gap_restart_the_history():
    history = FrameHistory(settings())
    assert [history.push(T0 + i * STRIDE_NS, i) for i in range(4)] == [[0], [0, 1], [0, 1, 2], [1, 2, 3]]
    assert history.push(T0 + 2 * STRIDE_NS, "back") == ["back"], "a stamp jump backwards starts a new history"
    assert history.counts["reset_backwards"] == 1
    assert history.push(T0 + 3 * STRIDE_NS, "next") == ["back", "next"]
    assert history.push(T0 + 3 * STRIDE_NS, "again") == ["again"], "a repeated stamp is not after the last one"
    assert history.push(T0 + 9 * STRIDE_NS, "late") == ["late"] and history.counts["reset_gap"] == 1
    assert history.push(T0 + 10 * STRIDE_NS, "on") == ["late", "on"]
    assert history.counts["short_window"] == 7 and history.counts["missing_frame"] == 0
    assert history.counts["frames"] == 9


def test_a_missing_stride_frame_ends_the_window_and_is_counted():
    history = FrameHistory(settings(frames=4, max_gap_s=1.0))
    for i in (0, 1, 2, 4):  # 3 was dropped upstream, a gap under max_gap_s
        window = history.push(T0 + i * STRIDE_NS, i)
    assert window == [4] and history.counts["missing_frame"] == 1
    assert history.push(T0 + 5 * STRIDE_NS, 5) == [4, 5] and history.counts["missing_frame"] == 2
    # Within the tolerance a frame fills its slot; beyond it, not.
    loose = FrameHistory(settings())
    loose.push(T0, "a")
    assert loose.push(T0 + STRIDE_NS + 14_000_000, "b") == ["a", "b"]
    assert loose.push(T0 + 2 * STRIDE_NS + 14_000_000 + 20_000_000, "c") == ["c"]


def test_windows_never_cross_sources_or_gaps(tmp_path):
    """Two drives recorded at the same time (equal stamps) and a gap in one of them."""
    stamps = np.concatenate([T0 + np.arange(10) * STRIDE_NS, T0 + np.arange(10) * STRIDE_NS])
    stamps[15:] += 2_000_000_000  # drive b stops for 2 s after its fifth frame
    sources = np.repeat([0, 1], 10)
    windows = frame_windows(stamps, sources, settings())
    for row, window in enumerate(windows):
        members = window[window >= 0]
        assert members[-1] == row and set(sources[members]) == {sources[row]}
        assert np.all(np.diff(stamps[members]) == STRIDE_NS), f"frame {row}: {members}"
    assert windows[15].tolist() == [15, -1, -1] and windows[17].tolist() == [15, 16, 17]
    cache = FeatureCache(make_cache(tmp_path / "cache", sources=("a", "b", "c")))  # frames 33 ms apart
    table = window_table(cache, make_policy().module, STATE)
    present = table >= 0
    assert np.all(cache.source_ids[np.maximum(table, 0)][present] == np.repeat(cache.source_ids[:, None], 3, 1)[present])
    assert np.all(present.sum(axis=1) == np.minimum(np.arange(len(cache)) % 24 // 3 + 1, 3)), "every third frame"


# ---- shared selection and what a window reveals ------------------------------------------------


def test_a_shared_selection_keeps_one_subset_per_block_of_the_window():
    policy = make_policy(shared_selection=True)
    assert isinstance(policy.selector, SharedWindowSelector) and policy.selector.block_ns == 3 * STRIDE_NS
    block = T0 - T0 % (3 * STRIDE_NS)
    subsets = [tuple(policy.selector.select(block + i * STRIDE_NS)) for i in range(6)]
    assert subsets[0] == subsets[1] == subsets[2] != subsets[3] == subsets[4] == subsets[5]
    assert np.array_equal(policy.selector.select(block + STRIDE_NS), PatchSelector(policy.selection, GRID).select(block))
    assert not isinstance(make_policy().selector, SharedWindowSelector)
    assert type(policy_selector({"selection": policy.config["selection"]}, GRID)) is PatchSelector


def test_window_coverage_measures_the_patch_positions_a_window_reveals():
    grid = PatchGrid(16, 16)
    for rate in (0.3, 0.5):
        selector = PatchSelector(SelectionConfig("sps", rate, 0), grid)
        one = window_coverage(selector, settings(frames=1), windows=50)
        assert one == kept_count(rate, grid.n) / grid.n
        four = window_coverage(selector, settings(frames=4), windows=300)
        expected = 1 - (1 - kept_count(rate, grid.n) / grid.n) ** 4  # four independent frames
        assert four == pytest.approx(expected, abs=0.01)
        shared = window_coverage(SharedWindowSelector(selector.config, grid, settings(frames=4).block_ns),
                                 settings(frames=4), windows=300)
        assert one < shared < four - 0.1, "a shared selection reveals one or two subsets per window"


# ---- training -----------------------------------------------------------------------------------


def temporal_cache(directory, sources=6, frames=40, seed=0):
    """Drives of frames 0.1 s apart whose steering is what the PREVIOUS frame shows (a marker in
    descriptor channel 0 of every patch) and whose throttle is what the frame itself shows: a
    window of frames can learn the steering, one frame cannot."""
    rng = np.random.default_rng(seed)
    meta = {"backbone": "test-random", "grid": {"rows": GRID.rows, "cols": GRID.cols}, "descriptor_dim": D}
    with FeatureCacheWriter(directory, meta, shard_size=64) as writer:
        for s in range(sources):
            markers = rng.normal(size=frames)
            for i in range(frames):
                descriptors = rng.normal(size=(GRID.n, D))
                descriptors[:, 0] = markers[i] + 0.1 * rng.normal(size=GRID.n)
                writer.add(descriptors, 0.3 * np.tanh(markers[i - 1] if i else 0.0), 0.6 * np.tanh(markers[i]),
                           T0 + (s * 1000 + i) * STRIDE_NS, f"drive_{s}", {"speed_mps": 8.0 + rng.normal(), "target_speed_mps": 9.0})
    return directory


@pytest.fixture(scope="module")
def temporal(tmp_path_factory):
    return temporal_cache(tmp_path_factory.mktemp("temporal") / "cache")


def config(cache_dir, out, **kwargs):
    return TrainConfig.from_yaml(cache=str(cache_dir), out=str(out), **{
        "architecture": "patch_policy", **TINY, "batch_size": 16, "lr": 3e-3, "validation_fraction": 0.34, **kwargs})


def test_a_window_learns_what_only_an_earlier_frame_shows_and_the_checkpoint_replays_its_validation_loss(temporal, tmp_path):
    steering = {}
    for frames in (1, 3):
        summary = train(config(temporal, tmp_path / f"t{frames}", window_frames=frames, epochs=30))
        history = summary["history"]
        assert history[-1]["train_loss"] < 0.7 * history[0]["train_loss"], f"the training loss should fall: {history}"
        steering[frames] = min(h["validation_error_fraction"]["steering"] for h in history)
    assert steering[3] < 0.3 and steering[1] > 0.8, f"validation steering error / variance: {steering}"
    out = tmp_path / "t3"
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["architecture"] == "patch_policy" and recorded["policy"]["window_frames"] == 3
    assert abs(evaluate_checkpoint(out) - recorded["validation_loss"]) <= 1e-6
    # The car's path: each validation drive streamed frame by frame, each frame with its own selection.
    policy = load_policy(out)
    cache = FeatureCache(temporal)
    _, val_idx, _ = split_frames(cache, recorded["training"]["split"]["validation_fraction"])
    scale = np.array(loss_scale(recorded["training"]["criterion_weights"], recorded["training"]["target_std"]))
    streaming, losses = StreamingPolicy(policy), []
    for index in val_idx[np.lexsort((cache.stamps[val_idx], cache.source_ids[val_idx]))]:
        f = cache[index]
        kept = policy.selector.select(f.stamp_ns)
        command = streaming.step(f.stamp_ns, f.descriptors[kept].astype(np.float32), kept, f.state)
        losses.append(np.mean(scale * (np.array(command) - [f.steering, f.throttle]) ** 2))
    assert abs(np.mean(losses) - recorded["validation_loss"]) <= 1e-6
    drives = len(recorded["training"]["split"]["validation_sources"])
    assert drives >= 2 and streaming.counts["history_reset_gap"] == drives - 1, "each validation drive starts a new history"


def test_a_patch_policy_run_resumes_exactly(temporal, tmp_path):
    cache_dir = temporal
    full = train(config(cache_dir, tmp_path / "full", epochs=4, shared_selection=True))
    train(config(cache_dir, tmp_path / "cut", epochs=2, shared_selection=True))
    resumed = train(config(cache_dir, tmp_path / "cut", epochs=4, shared_selection=True, resume=True))
    assert [h["validation_loss"] for h in resumed["history"]] == [h["validation_loss"] for h in full["history"]]
    assert [h["train_loss"] for h in resumed["history"]] == [h["train_loss"] for h in full["history"]]
    a, b = load_policy(tmp_path / "full" / "last"), load_policy(tmp_path / "cut" / "last")
    for (name, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(x, y), name


def test_torchrun_two_cpu_processes_train_a_patch_policy_with_ddp(temporal, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "ddp"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "sps_driving.cli", "train",
         "--cache", str(temporal), "--out", str(out), "--architecture", "patch_policy", "--window-frames", "3", "--epochs", "2",
         "--batch-size", "16", "--width", "16", "--depth", "1", "--heads", "2", "--reduce", "3", "--validation-fraction", "0.34"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["training"]["world_size"] == 2 and recorded["architecture"] == "patch_policy"
    # the two processes' validation shards add up to the loss a single process computes
    assert abs(evaluate_checkpoint(out) - recorded["validation_loss"]) <= 1e-6


def test_settings_of_a_window_that_cannot_be_formed_are_refused(tmp_path):
    for bad, match in [({"window_frames": 0}, "window_frames"), ({"stride_tolerance_s": 0.06}, "stride_tolerance_s"),
                       ({"max_gap_s": 0.0}, "max_gap_s")]:
        with pytest.raises(ValueError, match=match):
            config("c", tmp_path, **bad)
    policy = make_policy()
    save_policy(policy.module, policy.config, tmp_path / "p")
    reloaded = load_policy(tmp_path / "p")
    assert isinstance(reloaded.module, PatchPolicy) and reloaded.module.history == policy.module.history


def test_the_bench_times_a_patch_policy_command_with_a_full_window(tmp_path, capsys):
    from sps_driving import cli

    flops = {}
    for frames in (1, 3):
        policy = make_policy(state_inputs=(), window_frames=frames)
        save_policy(policy.module, policy.config, tmp_path / f"t{frames}")
        argv = ["bench", "--blip2", "tiny", "--dinov2", "none", "--repeats", "1", "--rates", "0.5", "--naive-rates",
                "--policy", str(tmp_path / f"t{frames}"), "--json"]
        assert cli.main(argv) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["policy_architecture"]["architecture"] == "patch_policy"
        assert result["policy_architecture"]["policy"]["window_frames"] == frames
        (row,) = result["blip2"]["rows"]
        assert row["policy_ms"] > 0
        flops[frames] = row["gflop"]["policy"]
    assert flops[3] > 2.5 * flops[1], f"three frames of tokens per command: {flops}"


def test_the_window_coverage_table(capsys):
    from sps_driving.analysis.window_coverage import main

    assert main(["--rates", "0.5", "--window-frames", "1", "4", "--windows", "100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["grid"] == [12, 24] and result["frame_stride_s"] == 0.1  # the shipped policy's road band, train.yaml's stride
    one, four = result["rows"]
    assert one["independent"] == one["shared"] == 0.5
    assert four["independent"] == pytest.approx(four["independent_expected"], abs=0.02) and four["independent_expected"] == 0.9375
    assert four["shared"] == pytest.approx(0.5 * 1 / 4 + 0.75 * 3 / 4, abs=0.02), "a quarter of the windows see one subset"


def test_evaluation_names_a_patch_policy_by_its_rate_and_window():
    from sps_driving.sim.tables import method_name

    assert method_name(make_policy(window_frames=4).config) == "PP-50-T4"
    assert method_name(make_policy(window_frames=1, rate=0.3).config) == "PP-30-T1"
    assert method_name(make_policy(shared_selection=True, rate=1.0).config) == "PP-100-T3-shared"


def test_eval_drives_a_patch_policy_in_process(tmp_path):
    """`sps-driving eval` (renderer -> DINOv2 -> selection -> the policy's history and windows ->
    vehicle) with a tiny random patch policy over the embedded DINOv2 grid, one short episode."""
    from samples import tiny_dinov2_policy

    from sps_driving.cli import main
    from sps_driving.sim.scenarios import SCENARIO_NAMES

    tiny_dinov2_policy(tmp_path / "policy", architecture="patch_policy", state_inputs=STATE)
    out = tmp_path / "eval"
    assert main(["eval", "--policy", str(tmp_path / "policy"), "--episodes", "1", "--episode-s", "0.5", "--workers", "1",
                 "--out", str(out), "--scenarios", SCENARIO_NAMES[0], "--no-failure-strips"]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["method"] == "PP-50-T3" and row["dropped_frames"] == 0 and row["distance_m"] > 0
