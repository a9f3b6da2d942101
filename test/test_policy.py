"""Policies and checkpoints. Models are tiny random configs of the real architectures."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import (
    CELL_EMBEDDING_STD,
    FastDropout,
    SequencePolicy,
    StridedSelfAttention,
    pack_kept,
)
from sps_driving.core.policies.checkpoint import load_policy, save_policy
from sps_driving.core.policies.positional_transformer import PositionalGridPolicy, PositionalSequencePolicy
from sps_driving.core.policies.registry import build_policy
from sps_driving.core.policies.transformer import GridPolicy, TableSequencePolicy
from sps_driving.core.resources import package_path
from sps_driving.core.selection import PatchSelector, SelectionConfig

GRID = PatchGrid(3, 5)  # non-square on purpose
D, P = 8, 6
TINY = {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0}
TINY_POSITIONAL = {**TINY, "reduce": 3}
# Checkpoints of architecture "transformer" written before the positional transformer existed, with
# the inputs they were given and the outputs they gave then (written by
# test/data/transformer_checkpoints/README.md's recipe).
OLD_CHECKPOINTS = Path(__file__).parent / "data" / "transformer_checkpoints"


def config(variant="sps", rate=0.5, max_steering_rad=0.5, architecture=None):
    """A tiny policy config; without an architecture, one of a checkpoint that records none (a transformer)."""
    recorded = {"architecture": architecture, "policy": TINY_POSITIONAL} if architecture == "positional_transformer" else {}
    return {
        "backbone": {"name": "test-random"},
        "grid": {"rows": GRID.rows, "cols": GRID.cols},
        "descriptor_dim": D,
        "selection": SelectionConfig(variant, rate, 0).to_dict(),
        "policy": TINY,
        "output": {"max_steering_rad": max_steering_rad},
        **recorded,
    }


def position_table():
    return np.random.default_rng(1).normal(size=(GRID.n, P)).astype(np.float32)


def make(variant="sps", **kwargs):
    torch.manual_seed(0)
    return build_policy(config(variant, **kwargs), position_table())


def descriptor_statistics():
    """Per-channel (mean, std) [D] far from (0, 1), as foundation-model descriptors' are."""
    rng = np.random.default_rng(5)
    return rng.normal(scale=5.0, size=D).astype(np.float32), np.exp(rng.normal(scale=1.5, size=D)).astype(np.float32)


def positional(variant="spps"):
    """A tiny positional transformer with non-trivial input statistics."""
    model = make(variant, architecture="positional_transformer")
    model.set_input_statistics(*descriptor_statistics())
    return model.eval()


def descriptors_like_statistics(shape, seed=0):
    mean, std = descriptor_statistics()
    return torch.from_numpy((np.random.default_rng(seed).normal(size=shape) * std + mean).astype(np.float32))


def test_variant_picks_the_architecture():
    assert isinstance(make("sps"), GridPolicy) and isinstance(make("threshold"), GridPolicy)
    assert isinstance(make("spps"), TableSequencePolicy) and isinstance(make("mspps"), TableSequencePolicy)
    assert not isinstance(make("sps"), SequencePolicy)
    with pytest.raises(ValueError, match="position"):
        build_policy(config("spps"))
    for variant in ("sps", "threshold"):
        assert isinstance(make(variant, architecture="positional_transformer"), PositionalGridPolicy)
    for variant in ("spps", "mspps"):  # its cells are its own: no backbone position table needed
        assert isinstance(build_policy(config(variant, architecture="positional_transformer")), PositionalSequencePolicy)
    assert isinstance(make("spps", architecture="positional_transformer"), SequencePolicy)
    with pytest.raises(ValueError, match="policy settings must be exactly"):
        build_policy({**config(), "policy": {**TINY, "widht": 3}})
    with pytest.raises(ValueError, match="max_steering_rad"):
        build_policy({**config(), "output": {}})
    with pytest.raises(ValueError, match="grid"):
        build_policy({k: v for k, v in config().items() if k != "grid"})


@pytest.mark.parametrize("architecture", [None, "positional_transformer"])
@pytest.mark.parametrize("variant", ["sps", "spps"])
def test_outputs_are_bounded_even_for_huge_inputs(variant, architecture):
    model = make(variant, max_steering_rad=0.3, architecture=architecture).eval()
    grids = torch.randn(4, GRID.n, D) * 1e4
    keep = torch.rand(4, GRID.n) < 0.5
    keep[:, 0] = True
    with torch.no_grad():
        for p in model.head.parameters():
            p.mul_(100)
        out = model.forward_selected(grids, keep)
    assert out.shape == (4, 2) and torch.isfinite(out).all()
    assert out[:, 0].abs().max() <= 0.3 and out[:, 1].abs().max() <= 1.0
    assert out[:, 0].abs().max() > 0.2, "the tanh range is actually used"


def test_pack_kept_gathers_kept_patches_in_index_order():
    grids = torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)
    keep = torch.tensor([[False, True, False, True], [True, False, False, False]])
    descriptors, indices, padding = pack_kept(grids, keep)
    assert indices.tolist() == [[1, 3], [0, 0]]
    assert padding.tolist() == [[False, False], [False, True]]
    assert descriptors[..., 0].tolist() == [[1.0, 3.0], [4.0, 0.0]]


def test_sequence_policy_uses_original_positions_and_ignores_token_order_and_padding():
    model = make("spps").eval()
    rng = np.random.default_rng(0)
    desc = torch.from_numpy(rng.normal(size=(1, 4, D)).astype(np.float32))
    idx = torch.tensor([[0, 3, 7, 12]])
    with torch.no_grad():
        base = model(desc, idx)
        shuffled = model(desc[:, [2, 0, 3, 1]], idx[:, [2, 0, 3, 1]])
        moved = model(desc, torch.tensor([[1, 3, 7, 12]]))
        padded = model(
            torch.cat([desc, torch.randn(1, 3, D)], 1),
            torch.cat([idx, torch.tensor([[5, 6, 8]])], 1),
            torch.tensor([[False] * 4 + [True] * 3]),
        )
    torch.testing.assert_close(shuffled, base, atol=1e-6, rtol=0)
    torch.testing.assert_close(padded, base, atol=1e-6, rtol=0)
    assert (moved - base).abs().max() > 1e-4, "a token's position embedding comes from its original index"


def test_a_positional_sequence_policy_reads_where_each_token_is():
    model = positional("spps")
    desc = descriptors_like_statistics((1, 5, D))
    idx = torch.tensor([[0, 3, 7, 12, 14]])
    order = [3, 0, 4, 1, 2]
    with torch.no_grad():
        base = model(desc, idx)
        both_permuted = model(desc[:, order], idx[:, order])
        positions_permuted = model(desc, idx[:, order])
        padded = model(torch.cat([desc, descriptors_like_statistics((1, 2, D), seed=1)], 1),
                       torch.cat([idx, torch.tensor([[5, 6]])], 1), torch.tensor([[False] * 5 + [True] * 2]))
        padded_batch = model(torch.cat([desc, desc]), torch.cat([idx, idx[:, order]]))
    torch.testing.assert_close(both_permuted, base, atol=1e-6, rtol=0)
    torch.testing.assert_close(padded, base, atol=1e-6, rtol=0)
    torch.testing.assert_close(padded_batch[1:], positions_permuted, atol=1e-6, rtol=0)
    # the same things seen at other places: a clearly different command (steering bound 0.5 rad)
    assert (positions_permuted - base).abs().max() > 1e-2, "the output depends on where each token is"
    with torch.no_grad():  # and not only through the readout's cells: the encoder sees the cell embeddings
        model.cell_embedding.zero_()
        without_cells = model(desc, idx)
    assert (without_cells - base).abs().max() > 1e-3


def test_a_positional_transformer_standardizes_with_statistics_saved_in_its_checkpoint(tmp_path):
    mean, std = descriptor_statistics()
    for variant in ("sps", "mspps"):
        model = positional(variant)
        grids = descriptors_like_statistics((4, GRID.n, D), seed=2)
        keep = torch.from_numpy(PatchSelector(SelectionConfig(variant, 0.5, 0), GRID).stamp_masks([1, 2, 3, 4]))
        with torch.no_grad():
            expected = model.forward_selected(grids, keep)
        save_policy(model, config(variant, architecture="positional_transformer"), tmp_path / variant)
        loaded = load_policy(tmp_path / variant)
        assert "position_dim" not in json.loads((tmp_path / variant / "config.json").read_text())
        np.testing.assert_array_equal(loaded.module.input_mean.numpy(), mean)
        np.testing.assert_array_equal(loaded.module.input_std.numpy(), std)
        with torch.no_grad():
            torch.testing.assert_close(loaded.module.forward_selected(grids, keep), expected, atol=1e-6, rtol=0)
            # the statistics are what the inputs are measured by: standardized inputs and unit statistics agree
            loaded.module.set_input_statistics(np.zeros(D), np.ones(D))
            standardized = (grids - torch.from_numpy(mean)) / torch.from_numpy(std)
            if variant == "sps":
                torch.testing.assert_close(loaded.module(standardized), model(grids), atol=1e-5, rtol=0)
            else:
                torch.testing.assert_close(loaded.module(*pack_kept(standardized, keep)), model(*pack_kept(grids, keep)),
                                           atol=1e-5, rtol=0)
            assert (loaded.module.forward_selected(grids, keep) - expected).abs().max() > 1e-3


def test_cell_embeddings_start_on_the_scale_of_the_standardized_tokens():
    """The first transformer's 0.02 position codes were ~1% of its raw-descriptor tokens; the
    positional transformer's are as large as its standardized, LayerNorm'd tokens."""
    def rms(t):
        return float(t.detach().pow(2).mean().sqrt())

    grids = descriptors_like_statistics((8, GRID.n, D), seed=3) * 10  # token norms ~46, as DINOv2's
    scale = float(grids.norm(dim=-1).mean())
    model = positional("sps")
    model.set_input_statistics(grids.mean(dim=(0, 1)).numpy(), grids.std(dim=(0, 1)).numpy())
    with torch.no_grad():
        tokens = model.input_norm(model.input_proj((grids - model.input_mean) / model.input_std))
        ratio = rms(model.cell_embedding) / rms(tokens)
        old = make("sps")
        old_ratio = rms(old.position_embedding) / rms(old.input_proj(grids))
    assert 20 < scale and rms(model.cell_embedding) == pytest.approx(CELL_EMBEDDING_STD, rel=0.3)
    assert 0.5 < ratio < 2.0, ratio
    assert old_ratio < 0.05, old_ratio


@pytest.mark.parametrize("variant", ["sps", "mspps"])
def test_transformer_checkpoints_from_before_the_positional_transformer_give_the_same_outputs(variant):
    recorded = json.loads((OLD_CHECKPOINTS / variant / "config.json").read_text())
    assert recorded["architecture"] == "transformer" and set(recorded["policy"]) == set(TINY)
    policy = load_policy(OLD_CHECKPOINTS / variant)
    assert isinstance(policy.module, GridPolicy if variant == "sps" else TableSequencePolicy)
    io = load_file(str(OLD_CHECKPOINTS / "inputs_outputs.safetensors"))
    keep = io[f"{variant}_keep"]
    with torch.no_grad():
        output = policy.module.forward_selected(io["grids"], keep, io["state"])
    torch.testing.assert_close(output, io[f"{variant}_output"], atol=1e-6, rtol=0)
    # and through the car's per-frame path
    states = [{"speed_mps": float(s[0]), "target_speed_mps": float(s[1])} for s in io["state"]]
    per_frame = [policy.predict(g[k].numpy(), np.flatnonzero(k.numpy()), s) for g, k, s in zip(io["grids"], keep, states)]
    np.testing.assert_allclose(per_frame, io[f"{variant}_output"].numpy(), atol=1e-5)


@pytest.mark.parametrize("architecture", [None, "positional_transformer"])
@pytest.mark.parametrize("variant", ["sps", "threshold", "spps", "mspps"])
def test_predict_matches_the_training_forward(tmp_path, variant, architecture):
    model = make(variant, architecture=architecture)
    if architecture:
        model.set_input_statistics(*descriptor_statistics())
    save_policy(model, config(variant, architecture=architecture), tmp_path / "ckpt")
    policy = load_policy(tmp_path / "ckpt")
    selector = PatchSelector(SelectionConfig(variant, 0.5, 0), GRID)
    grids = np.random.default_rng(2).normal(size=(5, GRID.n, D)).astype(np.float32)
    stamps = [10, 20, 30, 40, 50]
    keep = selector.stamp_masks(stamps)
    with torch.no_grad():
        expected = model.eval().forward_selected(torch.from_numpy(grids), torch.from_numpy(keep)).numpy()
    per_frame = np.array([policy.predict(g[np.flatnonzero(k)], np.flatnonzero(k)) for g, k in zip(grids, keep)])
    batched = policy.predict_batch([g[np.flatnonzero(k)] for g, k in zip(grids, keep)], [np.flatnonzero(k) for k in keep])
    np.testing.assert_allclose(per_frame, expected, atol=1e-6)
    np.testing.assert_allclose(batched, expected, atol=1e-6)
    if variant in ("threshold", "mspps"):
        assert len(set(keep.sum(1).tolist())) > 1, "frames of different lengths share one padded batch"


def test_checkpoint_round_trip_keeps_config_and_position_table(tmp_path):
    model = make("mspps")
    cfg = {**config("mspps"), "validation_loss": 0.125, "training": {"cache": "somewhere", "frames": 10}}
    save_policy(model, cfg, tmp_path)
    policy = load_policy(tmp_path)
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["validation_loss"] == 0.125 and recorded["position_dim"] == P
    assert recorded["format"] == "sps_driving.policy/1"
    assert policy.selection == SelectionConfig("mspps", 0.5, 0)
    assert policy.grid == GRID and policy.sparse_sequence
    np.testing.assert_array_equal(policy.module.position_table.numpy(), position_table())
    assert not policy.module.position_table.requires_grad


def test_predict_rejects_bad_input(tmp_path):
    save_policy(make("sps"), config("sps"), tmp_path)
    policy = load_policy(tmp_path)
    good = np.ones((3, D), np.float32)
    idx = np.array([0, 4, 9])
    steering, throttle = policy.predict(good, idx)
    assert np.isfinite([steering, throttle]).all()
    for bad_desc, bad_idx, match in [
        (np.full((3, D), np.nan, np.float32), idx, "NaN"),
        (np.array([[np.inf] * D] * 3, np.float32), idx, "NaN or Inf"),
        (np.ones((3, D + 1), np.float32), idx, "descriptors must be"),
        (good, np.array([0, 4]), "one patch index"),
        (good, np.array([0, 4, GRID.n]), "in \\[0"),
        (good, np.array([0, 4, 4]), "unique"),
        (good, np.array([0.0, 1.0, 2.0]), "integers"),
        (np.ones((0, D), np.float32), np.array([], np.int64), "k >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            policy.predict(bad_desc, bad_idx)


def test_loading_errors_name_the_path(tmp_path):
    missing = tmp_path / "nothing"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_policy(missing)
    save_policy(make("sps"), config("sps"), tmp_path / "ok")

    corrupt = tmp_path / "corrupt"
    save_policy(make("sps"), config("sps"), corrupt)
    (corrupt / "policy.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="policy.safetensors"):
        load_policy(corrupt)

    mismatched = tmp_path / "mismatched"
    save_policy(make("sps"), config("sps"), mismatched)
    cfg = json.loads((mismatched / "config.json").read_text())
    cfg["policy"]["width"] = 32
    (mismatched / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match"):
        load_policy(mismatched)

    no_weights = tmp_path / "no_weights"
    save_policy(make("sps"), config("sps"), no_weights)
    (no_weights / "policy.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="policy.safetensors"):
        load_policy(no_weights)

    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_policy(tmp_path / "bad_json")


def test_policy_timing_times_the_shipped_architecture_or_the_one_asked_for(capsys):
    from sps_driving.train.policy_timing import main

    small = ["--rows", "2", "--cols", "3", "--descriptor-dim", "4", "--repeats", "1"]
    assert main(small) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("positional_transformer policy (width 64, depth 2, heads 4, mlp_ratio 2.0, dropout 0.1, "
                              "reduce 16; the architecture of models/spps30pt_dinov2)")
    assert "spps  rate 0.3" in printed and printed.count(" ms\n") == 6
    assert main(["--policy", str(package_path("models/sps50_dinov2")), *small]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("mlp policy (width 256, reduce 16, dropout 0.1; the architecture of models/sps50_dinov2)")
    assert "sps   rate 0.3" in printed and printed.count(" ms\n") == 3  # a grid MLP takes no sequence
    assert main(["--architecture", "transformer", "--rows", "2", "--cols", "3", "--descriptor-dim", "4", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("transformer policy") and "spps  rate 0.3" in printed and printed.count(" ms\n") == 6


# ---- state inputs -----------------------------------------------------------------------------

STATE = ("speed_mps", "target_speed_mps")


def state_policy(tmp_path, variant="sps", architecture=None):
    """A tiny policy reading both state inputs (samples.tiny_policy)."""
    from samples import tiny_policy

    path = tiny_policy(tmp_path / f"{variant}_{architecture}", rows=GRID.rows, cols=GRID.cols, dim=D, variant=variant,
                       architecture=architecture, state_inputs=STATE)
    return load_policy(path)


@pytest.mark.parametrize("variant,architecture", [("sps", "mlp"), ("sps", "transformer"), ("spps", None)])
def test_a_policy_with_state_inputs_uses_them_and_refuses_to_drive_without(tmp_path, variant, architecture):
    policy = state_policy(tmp_path, variant, architecture)
    assert policy.state_inputs == STATE
    indices = np.array([0, 4, 9])
    descriptors = np.random.default_rng(3).normal(size=(3, D)).astype(np.float32)
    slow = policy.predict(descriptors, indices, {"speed_mps": 4.0, "target_speed_mps": 10.0})
    fast = policy.predict(descriptors, indices, {"speed_mps": 12.0, "target_speed_mps": 10.0})
    assert np.isfinite(slow).all() and abs(slow[1] - fast[1]) > 1e-3, "the output depends on the speed"
    assert policy.predict(descriptors, indices, {"speed_mps": 4.0, "target_speed_mps": 10.0, "other": 1.0}) == slow
    for bad, match in [(None, "speed_mps"), ({"speed_mps": 4.0}, "target_speed_mps"),
                       ({"speed_mps": float("nan"), "target_speed_mps": 10.0}, "not a finite number"),
                       ({"speed_mps": float("inf"), "target_speed_mps": 10.0}, "not a finite number"),
                       ({"speed_mps": "fast", "target_speed_mps": 10.0}, "speed_mps")]:
        with pytest.raises(ValueError, match=match):
            policy.predict(descriptors, indices, bad)
    batched = policy.predict_batch([descriptors, descriptors], [indices, indices],
                                   [{"speed_mps": 4.0, "target_speed_mps": 10.0}, {"speed_mps": 12.0, "target_speed_mps": 10.0}])
    np.testing.assert_allclose(batched, [slow, fast], atol=1e-6)


def test_state_statistics_round_trip_through_the_checkpoint(tmp_path):
    from sps_driving.core.policies.registry import PolicyArchitecture

    selection = SelectionConfig("sps", 0.5, 0)
    cfg = PolicyArchitecture("cnn", {"width": 8, "dropout": 0.0}, 0.5).config(
        PatchGrid(2, 3), 12, selection, backbone="pixels", state_inputs=["target_speed_mps"])
    torch.manual_seed(0)
    model = build_policy(cfg)
    model.state.set_statistics([9.5], [1.25])
    save_policy(model, cfg, tmp_path / "cnn")
    loaded = load_policy(tmp_path / "cnn")
    assert json.loads((tmp_path / "cnn" / "config.json").read_text())["state_inputs"] == ["target_speed_mps"]
    assert loaded.state_inputs == ("target_speed_mps",)
    assert loaded.module.state.mean.tolist() == [9.5] and loaded.module.state.std.tolist() == [1.25]
    grids = torch.randn(2, 6, 12)
    keep = torch.ones(2, 6, dtype=torch.bool)
    state = torch.tensor([[8.0], [11.0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.module.forward_selected(grids, keep, state), model.eval().forward_selected(grids, keep, state))
    with pytest.raises(ValueError, match="unknown state inputs"):
        build_policy({**cfg, "state_inputs": ["gear"]})


def test_checkpoints_without_state_inputs_load_and_ignore_a_state(tmp_path):
    from samples import tiny_policy

    directory = tiny_policy(tmp_path / "policy")
    config = json.loads((directory / "config.json").read_text())
    del config["state_inputs"]  # written before state inputs existed
    (directory / "config.json").write_text(json.dumps(config))
    older = load_policy(directory)
    assert "state_inputs" not in older.config and older.state_inputs == ()
    assert older.module.state is None
    indices = older.selector.select(0)
    descriptors = np.random.default_rng(0).normal(size=(len(indices), older.descriptor_dim)).astype(np.float32)
    command = older.predict(descriptors, indices)
    assert np.isfinite(command).all()
    assert older.predict(descriptors, indices, {"speed_mps": 3.0, "target_speed_mps": 5.0}) == command


def test_an_mlp_with_the_state_to_head_reads_the_state_through_its_head_and_older_ones_load_unchanged(tmp_path):
    from sps_driving.core.policies.registry import PolicyArchitecture

    selection = SelectionConfig("sps", 0.5, 0)
    settings = {"width": 8, "reduce": 2, "dropout": 0.0}
    grids, keep = torch.randn(2, GRID.n, D), torch.ones(2, GRID.n, dtype=torch.bool)
    state = torch.tensor([[4.0, 10.0], [12.0, 10.0]])

    def saved(name, **extra):
        cfg = PolicyArchitecture("mlp", {**settings, **extra}, 0.5).config(GRID, D, selection, state_inputs=STATE)
        torch.manual_seed(0)
        model = build_policy(cfg)
        save_policy(model, cfg, tmp_path / name)
        return model.eval(), load_policy(tmp_path / name)

    model, loaded = saved("head", state_to_head=True)
    assert loaded.config["policy"]["state_to_head"] is True
    assert model.head.in_features == settings["width"] // 2 + len(STATE)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module.forward_selected(grids, keep, state), model.forward_selected(grids, keep, state))
        # With the hidden layers' share of the head at zero, the output is a function of the state alone.
        model.head.weight[:, : settings["width"] // 2] = 0.0
        out = model.forward_selected(grids, keep, state)
        torch.testing.assert_close(model.forward_selected(torch.randn_like(grids), keep, state), out)
        assert abs(float(out[0, 1] - out[1, 1])) > 1e-4, "the head reads the speed"
    # Without the setting (every checkpoint written before it): the head reads the hidden layers only.
    old, loaded_old = saved("old")
    assert "state_to_head" not in loaded_old.config["policy"] and old.head.in_features == settings["width"] // 2
    with pytest.raises(ValueError, match="needs state inputs"):
        build_policy(PolicyArchitecture("mlp", {**settings, "state_to_head": True}, 0.5).config(GRID, D, selection))


@pytest.mark.parametrize("padding", [None, "bool", "float"])
def test_the_strided_attention_trains_as_the_stock_one(padding):
    """Same outputs and, up to the order of float sums, the same gradients as nn.MultiheadAttention
    in a training step (with the sequence policies' padding masks as bool and as the encoder's -inf
    floats); the same parameters, so checkpoints load either way; built without drawing from the
    random generator; in evaluation too the same outputs as the stock path."""
    torch.manual_seed(3)
    stock = torch.nn.MultiheadAttention(16, 4, batch_first=True).train()
    after_stock = torch.rand(3)
    torch.manual_seed(3)
    strided = StridedSelfAttention.replacing(torch.nn.MultiheadAttention(16, 4, batch_first=True)).train()
    assert torch.equal(torch.rand(3), after_stock)
    assert list(strided.state_dict()) == list(stock.state_dict())
    x = torch.randn(5, 11, 16, requires_grad=True)
    mask = None
    if padding is not None:
        mask = torch.zeros(5, 11, dtype=torch.bool)
        mask[:, 8:], mask[0, 3:] = True, True
        if padding == "float":
            mask = torch.zeros(5, 11).masked_fill(mask, float("-inf"))
    outputs, grads = [], []
    for attention in (stock, strided):
        y = attention(x, x, x, key_padding_mask=mask, need_weights=False)[0]
        outputs.append(y)
        grads.append(torch.autograd.grad((y * torch.linspace(-1, 1, 16)).sum(), [x, *attention.parameters()]))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
    for g_stock, g_strided in zip(*grads):
        assert torch.allclose(g_stock, g_strided, rtol=1e-4, atol=1e-5)
    strided.eval(), stock.eval()
    with torch.no_grad():
        assert torch.allclose(strided(x, x, x, key_padding_mask=mask, need_weights=False)[0],
                              stock(x, x, x, key_padding_mask=mask, need_weights=False)[0], atol=1e-6)


@pytest.mark.parametrize("selection", ["sps", "spps"])
def test_a_positional_transformer_evaluates_as_on_pytorchs_stock_fast_path(selection):
    """Its encoder layers skip PyTorch's inference fast path for the fused attention kernel
    (sps_driving.core.policies.blocks.FusedAttentionEncoderLayer) and give the stock layers'
    commands, for a single frame and for a padded batch."""
    from sps_driving.tools.bench_policy import stock_attention_copy

    model = positional(selection)
    stock = stock_attention_copy(model)
    assert all(type(layer) is torch.nn.TransformerEncoderLayer for layer in stock.encoder.layers)
    torch.manual_seed(0)
    grids = torch.randn(3, GRID.n, D)
    keep = torch.rand(3, GRID.n) < 0.5
    keep[0, : GRID.n // 2] = False  # rows of different lengths: a padded batch for the sequence policy
    with torch.inference_mode():
        for rows in (slice(0, 1), slice(0, 3)):
            fused, reference = (m.forward_selected(grids[rows], keep[rows]) for m in (model, stock))
            assert torch.allclose(fused, reference, atol=1e-5)
    assert stock_attention_copy(make("sps", architecture="mlp")) is None


def test_fast_dropout_drops_a_fraction_p_scales_the_rest_and_follows_torchs_seed():
    dropout = FastDropout(0.1).train()
    x = torch.ones(200_000, requires_grad=True)
    torch.manual_seed(7)
    y = dropout(x)
    kept = y != 0
    # 0.1 of 200,000 drawn: the dropped share is within 5 standard deviations (0.0034) of p.
    assert abs(1.0 - kept.double().mean().item() - 0.1) < 0.0034
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.9))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(grad, y.detach())  # the gradient passes where the value did, scaled alike
    torch.manual_seed(7)
    assert torch.equal(dropout(x), y)  # torch.manual_seed fixes it (a resumed epoch draws the same)
    assert not torch.equal(dropout(x), y)  # and each call draws anew
    assert torch.equal(dropout.eval()(x), x)


def test_a_positional_transformer_trains_with_the_strided_attention_and_fast_dropout():
    model = make("sps", architecture="positional_transformer")
    layers = model.encoder.layers
    assert all(isinstance(layer.self_attn, StridedSelfAttention) for layer in layers)
    assert all(isinstance(getattr(layer, name), FastDropout) for layer in layers
               for name in ("dropout", "dropout1", "dropout2"))
