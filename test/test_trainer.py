"""The trainer on small synthetic feature caches (tiny random configs of the real policy architectures)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.train.cache import FeatureCache, FeatureCacheWriter
from sps_driving.train.trainer import TRAIN_CONFIG, TrainConfig, evaluate_checkpoint, l2_loss, loss_scale, split_frames, target_std, train

ROWS, COLS, D = 3, 4, 8
TINY = dict(architecture="transformer", width=16, depth=1, heads=2, dropout=0.0, batch_size=16)


def make_cache(directory, sources=("drive_a", "drive_b", "drive_c", "drive_d"), frames_per_source=24, seed=0,
               with_position_table=True, throttle_from="descriptors", with_state=True):
    """Steering is a smooth function of the descriptors, so a policy can learn it; so is the
    throttle, or, with throttle_from "state", a function of (cruise target - speed) as the
    expert's, which no descriptor shows. Each source has its own cruise target speed."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=D)
    meta = {"backbone": "test-random", "grid": {"rows": ROWS, "cols": COLS}, "descriptor_dim": D}
    table = rng.normal(size=(ROWS * COLS, 5)).astype(np.float32)
    with FeatureCacheWriter(directory, meta, table if with_position_table else None, shard_size=20) as writer:
        for s, source in enumerate(sources):
            target = 8.0 + s % 5
            for i in range(frames_per_source):
                descriptors = rng.normal(size=(ROWS * COLS, D))
                speed = rng.uniform(4.0, 12.0)
                steering = 0.3 * np.tanh(descriptors.mean(0) @ weights)
                throttle = 0.6 * np.tanh((target - speed) / 2 if throttle_from == "state" else 2 * descriptors[:, 0].mean())
                state = {"speed_mps": speed, "target_speed_mps": target} if with_state else None
                writer.add(descriptors, steering, throttle, 10**18 + (s * 1000 + i) * 33_333_333, source, state)
    return directory


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache") / "cache")


def config(cache_dir, out, **kwargs):
    return TrainConfig.from_yaml(cache=str(cache_dir), out=str(out), **{**TINY, **kwargs})


def test_settings_come_from_config_train_yaml(tmp_path):
    section = yaml.safe_load(TRAIN_CONFIG.read_text())["train"]
    cfg = TrainConfig.from_yaml(cache="c", out="o")
    assert {name: getattr(cfg, name) for name in section} == section
    assert TrainConfig.from_yaml(cache="c", out="o", rate=0.3, epochs=None).rate == 0.3  # None: not given
    with pytest.raises(ValueError, match="unknown training settings \\['learning_rate'\\]"):
        TrainConfig.from_yaml(cache="c", out="o", learning_rate=0.1)
    partial = tmp_path / "train.yaml"
    partial.write_text(yaml.safe_dump({"train": {k: v for k, v in section.items() if k != "lr"}}))
    with pytest.raises(ValueError, match="\\['lr'\\] are missing"):
        TrainConfig.from_yaml(partial, cache="c", out="o")
    for bad, match in [(dict(rate=0.0), "rate"), (dict(architecture="transformer", width=30, heads=4), "multiple of heads"),
                       (dict(loss_weights=[1.0]), "loss_weights"), (dict(batch_size=0), "batch_size"),
                       (dict(plateau_factor=1.0), "plateau_factor")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_yaml(cache="c", out="o", **bad)


def test_split_holds_out_whole_sources_or_the_last_frames(cache_dir, tmp_path):
    cache = FeatureCache(cache_dir)
    train_idx, val_idx, rule = split_frames(cache, 0.25)
    assert rule["by"] == "source" and rule["validation_sources"] == ["drive_d"]
    assert set(cache.source_ids[val_idx]) == {3} and 3 not in set(cache.source_ids[train_idx])
    assert len(train_idx) + len(val_idx) == len(cache)
    _, val_half, rule_half = split_frames(cache, 0.5)
    assert rule_half["validation_sources"] == ["drive_c", "drive_d"] and len(val_half) == 48
    single = FeatureCache(make_cache(tmp_path / "single", sources=("only",), frames_per_source=20))
    train_idx, val_idx, rule = split_frames(single, 0.1)
    assert rule["by"] == "frames" and len(val_idx) == 2
    assert single.stamps[val_idx].min() > single.stamps[train_idx].max(), "validation is the latest frames"
    with pytest.raises(ValueError, match="validation_fraction"):
        split_frames(single, 0.0)


@pytest.mark.parametrize("variant", ["sps", "mspps"])
def test_training_learns_and_the_checkpoint_reproduces_its_validation_loss(cache_dir, tmp_path, variant):
    keep = [[1.0, 2.0, 3.0, 4.0]] * ROWS if variant == "mspps" else None
    summary = train(config(cache_dir, tmp_path / "m", variant=variant, rate=0.5, epochs=6, keep_probability=keep))
    history = [h["validation_loss"] for h in summary["history"]]
    assert summary["epochs_run"] == 6 and len(history) == 6
    assert min(history) < 0.7 * history[0], f"validation loss should fall: {history}"
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["validation_loss"] == pytest.approx(summary["best_validation_loss"], abs=0)
    assert recorded["selection"]["variant"] == variant and recorded["backbone"] == "test-random"
    assert recorded["architecture"] == "transformer"
    assert recorded["policy"] == {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0}
    assert recorded["grid"] == {"rows": ROWS, "cols": COLS} and recorded["descriptor_dim"] == D
    assert recorded["training"]["split"]["validation_sources"] == ["drive_d"]
    # the trainer's own evaluation path and the car's per-frame inference path both reproduce it
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6
    policy = load_policy(tmp_path / "m")
    assert recorded["state_inputs"] == ["speed_mps", "target_speed_mps"]  # config/train.yaml's default
    cache = FeatureCache(cache_dir)
    train_idx, val_idx, _ = split_frames(cache, recorded["training"]["split"]["validation_fraction"])
    assert recorded["training"]["target_std"] == pytest.approx(cache.targets[train_idx].std(axis=0), rel=1e-5)
    scale = np.array(loss_scale(recorded["training"]["loss_weights"], recorded["training"]["target_std"]))
    losses = []
    for index in val_idx:
        frame = cache[index]
        kept = policy.selector.select(frame.stamp_ns)
        prediction = policy.predict(frame.descriptors[kept].astype(np.float32), kept, frame.state)
        losses.append(np.mean(scale * (np.array(prediction) - [frame.steering, frame.throttle]) ** 2))
    assert abs(np.mean(losses) - recorded["validation_loss"]) <= 1e-6
    assert (tmp_path / "m" / "last" / "train_state.json").is_file()


def test_loss_standardizes_each_output_so_small_steering_errors_count():
    rng = np.random.default_rng(0)
    targets = np.stack([rng.normal(0.0, 0.02, 4000), rng.normal(0.1, 0.1, 4000)], axis=1)
    std = target_std(targets)
    assert std == pytest.approx([0.02, 0.1], rel=0.05)
    weights = torch.tensor(loss_scale([1.0, 1.0], std))
    # an error of one spread in either output costs the same; unscaled, steering's would be 25x smaller
    one_spread = l2_loss(torch.tensor([[std[0], 0.0], [0.0, std[1]]]), torch.zeros(2, 2), weights)
    assert float(one_spread[0]) == pytest.approx(float(one_spread[1]), rel=1e-5)
    # a constant output (e.g. throttle held by the expert) is floored, not divided by zero
    assert all(np.isfinite(loss_scale([1.0, 1.0], target_std(np.zeros((10, 2))))))


def test_a_kill_while_an_epoch_is_saved_leaves_a_whole_epoch_to_resume_from(cache_dir, tmp_path):
    from sps_driving.train.trainer import PREVIOUS_DIR, STAGING_DIR, has_last_epoch

    straight = train(config(cache_dir, tmp_path / "straight", epochs=4, dropout=0.1))
    out = tmp_path / "cut"
    train(config(cache_dir, out, epochs=2, dropout=0.1))
    # Killed between the two renames of epoch 3's save: epoch 2 moved aside, epoch 3 staged in part.
    (out / "last").rename(out / PREVIOUS_DIR)
    (out / STAGING_DIR).mkdir()
    (out / STAGING_DIR / "policy.safetensors").write_bytes(b"cut short")
    assert has_last_epoch(out) and not (out / PREVIOUS_DIR).exists()
    assert json.loads((out / "last" / "train_state.json").read_text())["epoch"] == 2
    resumed = train(config(cache_dir, out, epochs=4, dropout=0.1, resume=True))
    assert [h["validation_loss"] for h in resumed["history"]] == [h["validation_loss"] for h in straight["history"]]
    a, b = load_policy(tmp_path / "straight" / "last"), load_policy(out / "last")
    for name, tensor in a.module.state_dict().items():
        assert torch.equal(tensor, b.module.state_dict()[name]), name
    assert not (out / STAGING_DIR).exists() and not (out / PREVIOUS_DIR).exists()


def test_mlp_policy_standardizes_with_training_statistics_and_learns(tmp_path):
    from sps_driving.train.trainer import descriptor_statistics

    cache_dir = make_cache(tmp_path / "cache", frames_per_source=120)
    cfg = TrainConfig.from_yaml(cache=str(cache_dir), out=str(tmp_path / "m"), width=32, reduce=4, batch_size=32, epochs=12, lr=3e-3)
    assert cfg.architecture == "mlp"  # the default
    with pytest.raises(ValueError, match="mlp policy reads the whole grid.*as a sequence"):
        TrainConfig.from_yaml(cache="c", out="o", variant="spps")  # on a zero-filled grid spps would be sps
    summary = train(cfg)
    history = [h["validation_loss"] for h in summary["history"]]
    assert min(history) < 0.7 * history[0], f"validation loss should fall: {history}"
    policy = load_policy(tmp_path / "m")
    cache = FeatureCache(cache_dir)
    train_idx, _, _ = split_frames(cache, 0.1)
    mean, std = descriptor_statistics(cache, train_idx)
    np.testing.assert_allclose(mean, cache.descriptors(train_idx).mean(axis=(0, 1)), atol=1e-5)
    np.testing.assert_allclose(policy.module.input_mean.numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(policy.module.input_std.numpy(), std, atol=1e-6)
    assert abs(evaluate_checkpoint(tmp_path / "m") - json.loads((tmp_path / "m" / "config.json").read_text())["validation_loss"]) <= 1e-6


@pytest.mark.parametrize("architecture", [{}, {"architecture": "positional_transformer", "reduce": 2}])
def test_resume_continues_exactly_like_an_uninterrupted_run(cache_dir, tmp_path, architecture):
    # dropout on: a resumed run must draw the same dropout masks as an uninterrupted one (the
    # positional transformer's are numpy's, seeded from torch's generator: core.policies.blocks.FastDropout)
    straight = train(config(cache_dir, tmp_path / "straight", epochs=4, dropout=0.1, **architecture))
    train(config(cache_dir, tmp_path / "resumed", epochs=2, dropout=0.1, **architecture))
    resumed = train(config(cache_dir, tmp_path / "resumed", epochs=4, dropout=0.1, resume=True, **architecture))
    assert resumed["epochs_run"] == 4
    assert [h["validation_loss"] for h in resumed["history"]] == [h["validation_loss"] for h in straight["history"]]
    a, b = load_policy(tmp_path / "straight" / "last"), load_policy(tmp_path / "resumed" / "last")
    for name, tensor in a.module.state_dict().items():
        assert torch.equal(tensor, b.module.state_dict()[name]), name
    with pytest.raises(ValueError, match="changed settings.*rate"):
        train(config(cache_dir, tmp_path / "resumed", epochs=5, dropout=0.1, rate=0.3, resume=True, **architecture))
    with pytest.raises(FileNotFoundError, match="last"):
        train(config(cache_dir, tmp_path / "never_started", epochs=5, resume=True))
    with pytest.raises(FileExistsError, match="--resume"):
        train(config(cache_dir, tmp_path / "straight", epochs=4))


def test_a_positional_transformer_trains_on_standardized_tokens_without_a_position_table(tmp_path):
    from sps_driving.train.trainer import descriptor_statistics

    cache_dir = make_cache(tmp_path / "cache", frames_per_source=48, with_position_table=False)
    cfg = config(cache_dir, tmp_path / "m", architecture="positional_transformer", reduce=2, variant="spps", epochs=8,
                 lr=3e-3)
    summary = train(cfg)
    history = [h["validation_loss"] for h in summary["history"]]
    assert min(history) < 0.7 * history[0], f"validation loss should fall: {history}"
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["architecture"] == "positional_transformer" and "position_dim" not in recorded
    assert recorded["policy"] == {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 2}
    policy = load_policy(tmp_path / "m")
    cache = FeatureCache(cache_dir)
    train_idx, _, _ = split_frames(cache, 0.1)
    mean, std = descriptor_statistics(cache, train_idx)
    np.testing.assert_allclose(policy.module.input_mean.numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(policy.module.input_std.numpy(), std, atol=1e-6)
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6


def test_command_line_errors_are_reported_not_raised(tmp_path, capsys):
    from sps_driving.cli import main

    assert main(["train", "--cache", str(tmp_path / "missing"), "--out", str(tmp_path / "m")]) == 2
    assert "sps-driving extract" in capsys.readouterr().err


def test_sequence_variants_need_the_backbones_position_table(tmp_path):
    no_table = make_cache(tmp_path / "cache", frames_per_source=4, with_position_table=False)
    with pytest.raises(ValueError, match="position table"):
        train(config(no_table, tmp_path / "m", variant="spps", epochs=1))


def test_early_stopping_and_the_plateau_scheduler(cache_dir, tmp_path):
    # lr 0: the validation loss never improves after epoch 0
    summary = train(config(cache_dir, tmp_path / "m", epochs=50, lr=0.0, early_stop_patience=3, plateau_patience=1))
    assert summary["stopped_early"] and summary["epochs_run"] == 4 and summary["best_epoch"] == 0


def test_descriptor_transform_and_init_checkpoint_for_fine_tuning(cache_dir, tmp_path):
    train(config(cache_dir, tmp_path / "base", epochs=2))
    base_loss = json.loads((tmp_path / "base" / "config.json").read_text())["validation_loss"]
    calls = []

    def transform(grids, generator):
        calls.append(tuple(grids.shape))
        assert isinstance(generator, torch.Generator)
        return grids + 0.01 * torch.randn(grids.shape, generator=generator)

    # lr 0 keeps the weights: the fine-tune starts exactly from the base checkpoint
    summary = train(config(cache_dir, tmp_path / "tuned", epochs=1, lr=0.0, width=32),
                    descriptor_transform=transform, init_checkpoint=tmp_path / "base")
    assert calls and all(shape[1:] == (ROWS * COLS, D) for shape in calls)
    assert summary["best_validation_loss"] == pytest.approx(base_loss, abs=1e-7)
    tuned = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert tuned["policy"]["width"] == 16, "the architecture comes from the checkpoint"
    assert tuned["training"]["init_checkpoint"].endswith("base")
    with pytest.raises(ValueError, match="policy kind"):
        train(config(cache_dir, tmp_path / "bad", epochs=1, variant="spps"), init_checkpoint=tmp_path / "base")


def test_torchrun_two_cpu_processes_train_with_ddp(cache_dir, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "sps_driving.cli", "train", "--cache", str(cache_dir), "--out", str(out), "--epochs", "2",
         "--batch-size", "16", "--width", "16", "--depth", "1", "--heads", "2"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 process(es)" in result.stdout
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["training"]["world_size"] == 2
    state = json.loads((out / "last" / "train_state.json").read_text())
    assert state["epoch"] == 2 and len(state["history"]) == 2
    # the two processes' validation shards add up to the loss a single process computes
    assert abs(evaluate_checkpoint(out) - recorded["validation_loss"]) <= 1e-6


def test_training_on_several_caches_records_them_and_splits_by_prefixed_source(tmp_path):
    first = make_cache(tmp_path / "day1", sources=("drive_a", "drive_b"), frames_per_source=12, seed=1)
    second = make_cache(tmp_path / "day2", sources=("drive_a", "drive_b"), frames_per_source=12, seed=2)
    summary = train(TrainConfig.from_yaml(cache=[str(first), str(second)], out=str(tmp_path / "m"), **TINY, epochs=1,
                                validation_fraction=0.25))
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["training"]["cache"] == [str(first.resolve()), str(second.resolve())]
    assert recorded["training"]["split"]["validation_sources"] == ["day2/drive_b"]
    assert summary["train_frames"] == 36 and summary["validation_frames"] == 12
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6


def test_caches_inside_the_working_directory_are_recorded_relative_to_it(tmp_path, monkeypatch):
    # How a campaign runs its pinned code: from the repository root, on caches under it.
    make_cache(tmp_path / "runs" / "day1", sources=("drive_a", "drive_b"), frames_per_source=12, seed=1)
    monkeypatch.chdir(tmp_path)
    train(TrainConfig.from_yaml(cache=[str(tmp_path / "runs" / "day1")], out="m", **TINY, epochs=1, validation_fraction=0.25))
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["training"]["cache"] == "runs/day1"
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6


def test_a_policy_with_state_inputs_learns_the_throttle_the_frames_cannot_show(tmp_path):
    """Throttle = f(cruise target - speed): with the state the validation throttle error is a small
    fraction of its variance, without it no better than the mean; the state statistics are the
    training frames'."""
    sources = tuple(f"drive_{k}" for k in range(10))
    cache_dir = make_cache(tmp_path / "cache", sources=sources, frames_per_source=40, throttle_from="state")
    common = dict(width=32, reduce=2, batch_size=32, epochs=15, lr=3e-3, validation_fraction=0.2)
    with_state = train(TrainConfig.from_yaml(cache=str(cache_dir), out=str(tmp_path / "with"), **common))
    without = train(TrainConfig.from_yaml(cache=str(cache_dir), out=str(tmp_path / "without"), state_inputs=[], **common))
    to_head = train(TrainConfig.from_yaml(cache=str(cache_dir), out=str(tmp_path / "head"), state_to_head=True, **common))

    def throttle_error(summary):
        return min(h["validation_error_fraction"]["throttle"] for h in summary["history"])

    assert throttle_error(with_state) < 0.4 < 0.8 < throttle_error(without), (throttle_error(with_state), throttle_error(without))
    assert throttle_error(to_head) < 0.4, throttle_error(to_head)
    assert load_policy(tmp_path / "head").config["policy"]["state_to_head"] is True
    policy = load_policy(tmp_path / "with")
    cache = FeatureCache(cache_dir)
    train_idx, _, _ = split_frames(cache, 0.2)
    values = cache.state_values(["speed_mps", "target_speed_mps"])[train_idx]
    np.testing.assert_allclose(policy.module.state.mean.numpy(), values.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(policy.module.state.std.numpy(), values.std(axis=0), rtol=1e-5)
    assert load_policy(tmp_path / "without").state_inputs == ()
    # Judged by what its inputs can predict: the steering only, without the state.
    judged = {name: json.loads((tmp_path / name / "config.json").read_text())["training"]["criterion_weights"]
              for name in ("with", "without")}
    assert judged == {"with": [1.0, 1.0], "without": [1.0, 0.0]}


def test_caches_without_the_state_are_refused_and_frames_without_it_left_out(tmp_path):
    no_state = make_cache(tmp_path / "no_state", frames_per_source=4, with_state=False)
    with pytest.raises(ValueError, match="has no speed_mps .*target_speed_mps .*state_inputs: \\[\\]"):
        train(config(no_state, tmp_path / "m", epochs=1))
    # Two caches as one: the old one's frames lack the state and are left out, counted.
    summary = train(TrainConfig.from_yaml(cache=[str(no_state), str(make_cache(tmp_path / "with_state", frames_per_source=4))],
                                          out=str(tmp_path / "m"), **TINY, epochs=1, validation_fraction=0.25))
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["training"]["split"]["frames_without_state"] == 16
    assert summary["train_frames"] + summary["validation_frames"] == 16
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6
    with pytest.raises(ValueError, match="unknown state inputs"):
        TrainConfig.from_yaml(cache="c", out="o", state_inputs=["gear"])


def test_the_criterion_weights_choose_what_early_stopping_watches(cache_dir, tmp_path):
    summary = train(config(cache_dir, tmp_path / "m", epochs=2, criterion_weights=[1.0, 0.0]))
    recorded = json.loads((tmp_path / "m" / "config.json").read_text())
    assert recorded["training"]["criterion_weights"] == [1.0, 0.0]
    # steering only: the criterion is half the steering error over its training-target variance
    cache = FeatureCache(cache_dir)
    _, val_idx, _ = split_frames(cache, 0.1)
    val_variance = cache.targets[val_idx, 0].astype(np.float64).var()
    epoch = summary["history"][summary["best_epoch"]]
    fraction = epoch["validation_error_fraction"]["steering"]
    expected = 0.5 * fraction * val_variance / recorded["training"]["target_std"][0] ** 2
    assert epoch["validation_loss"] == pytest.approx(expected, rel=1e-5)
    assert abs(evaluate_checkpoint(tmp_path / "m") - recorded["validation_loss"]) <= 1e-6


def test_the_positional_transformer_folds_its_standardization_into_the_projection_without_changing_it():
    from sps_driving.core.grid import PatchGrid
    from sps_driving.core.policies.positional_transformer import PositionalGridPolicy

    torch.manual_seed(0)
    policy = PositionalGridPolicy(PatchGrid(ROWS, COLS), D, width=16, depth=1, heads=2, mlp_ratio=2.0, dropout=0.0,
                                  reduce=2, max_steering_rad=0.5, state_dim=2).eval()
    policy.set_input_statistics(np.full(D, 3.0), np.full(D, 0.5))
    grids, state = 3.0 + torch.randn(5, ROWS * COLS, D), torch.randn(5, 2)
    keep = torch.rand(5, ROWS * COLS) < 0.5
    zeroed = grids * keep.unsqueeze(-1)
    # What it computed before the fold: standardize the zeroed grid, then project.
    explicit = policy.input_norm(policy.input_proj((zeroed - policy.input_mean) / policy.input_std))
    folded = policy.input_norm(policy.standardized_projection(policy.input_proj, grids, keep))
    torch.testing.assert_close(folded, explicit, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(policy.forward_selected(grids, keep, state), policy(zeroed, state), atol=1e-5, rtol=1e-5)
