"""Ensembles of trained checkpoints (`sps-driving ensemble`, sps_driving.core.policies.ensemble):
tiny positional transformers with random weights (3x5 grid, 8-d descriptors) as the heads."""

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from sps_driving.cli import main
from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.checkpoint import load_policy, save_policy
from sps_driving.core.policies.ensemble import SequenceEnsemble, head_disagreement
from sps_driving.core.policies.registry import build_policy
from sps_driving.core.selection import PatchSelector, SelectionConfig

GRID = PatchGrid(3, 5)
D = 8
SETTINGS = {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0, "reduce": 3}


def head(tmp_path, seed: int, variant="sps", rate=0.5, max_steering_rad=0.5):
    """A trained-looking checkpoint: a tiny positional transformer with its own weights and input
    statistics, and its training seed as its selection seed, as the trainer records it."""
    import torch

    config = {"backbone": "test-random", "grid": {"rows": GRID.rows, "cols": GRID.cols}, "descriptor_dim": D,
              "selection": SelectionConfig(variant, rate, seed).to_dict(), "state_inputs": ["speed_mps"],
              "architecture": "positional_transformer", "policy": SETTINGS,
              "output": {"max_steering_rad": max_steering_rad}, "training": {"seed": seed}}
    torch.manual_seed(seed)
    module = build_policy(config)
    rng = np.random.default_rng(seed)
    module.set_input_statistics(rng.normal(size=D), np.exp(rng.normal(size=D)))
    module.state.set_statistics(np.array([5.0]), np.array([2.0]))
    return save_policy(module, config, tmp_path / f"{variant}_{rate}_{max_steering_rad}_s{seed}")


def frames(count=4, seed=0):
    rng = np.random.default_rng(seed)
    selector = PatchSelector(SelectionConfig("sps", 0.5, 0), GRID)
    out = []
    for i in range(count):
        indices = np.flatnonzero(selector.select(1_000 + i))
        out.append((rng.normal(size=(len(indices), D)).astype(np.float32) * 3, indices, {"speed_mps": 4.0 + i}))
    return out


@pytest.mark.parametrize("variant", ["sps", "spps"])
def test_an_ensemble_drives_the_mean_of_its_heads_commands_in_every_runtime(tmp_path, variant):
    heads = [head(tmp_path, seed, variant) for seed in (0, 1, 2)]
    assert main(["ensemble", "--out", str(tmp_path / "ens"), *map(str, heads)]) == 0
    ensemble = load_policy(tmp_path / "ens")  # what eval, replay and the policy node load
    loaded = [load_policy(path) for path in heads]
    for descriptors, indices, state in frames():
        commands = np.array([h.predict(descriptors, indices, state) for h in loaded])
        mean = commands.mean(axis=0)
        np.testing.assert_allclose(ensemble.predict(descriptors, indices, state), mean, atol=1e-6)
        assert not np.allclose(loaded[0].predict(descriptors, indices, state), mean, atol=1e-4)  # the heads differ
        # their disagreement, read from the forward that made the command
        assert head_disagreement(ensemble.module) == pytest.approx(commands[:, 0].std(), abs=1e-6)
    assert head_disagreement(loaded[0].module) is None
    ensemble.predict_batch([d for d, _, _ in frames()], [i for _, i, _ in frames()], [s for _, _, s in frames()])
    assert head_disagreement(ensemble.module) is None  # a batch is not one frame
    assert isinstance(ensemble.module, SequenceEnsemble) == (variant == "spps")
    config = json.loads((tmp_path / "ens" / "config.json").read_text())
    assert config["architecture"] == "ensemble" and [m["training"]["seed"] for m in config["members"]] == [0, 1, 2]
    # one selection a frame, drawn at the method's rate with the first head's seed
    assert config["selection"] == loaded[0].config["selection"] != loaded[1].config["selection"]
    weights = load_file(str(tmp_path / "ens" / "policy.safetensors"))
    assert {k.split(".")[1] for k in weights} == {"0", "1", "2"}
    np.testing.assert_array_equal(weights["heads.1.input_proj.weight"].numpy(),
                                  load_file(str(heads[1] / "policy.safetensors"))["input_proj.weight"].numpy())


def test_checkpoints_that_cannot_be_one_policy_are_refused_by_what_differs(tmp_path, capsys):
    first, other_rate, other_bound = head(tmp_path, 0), head(tmp_path, 1, rate=0.3), head(tmp_path, 2, max_steering_rad=0.4)
    assert main(["ensemble", "--out", str(tmp_path / "a"), str(first), str(other_rate)]) == 2
    assert "must share 'selection'" in capsys.readouterr().err
    assert main(["ensemble", "--out", str(tmp_path / "b"), str(first), str(other_bound)]) == 2
    assert "must share 'output'" in capsys.readouterr().err
    assert main(["ensemble", "--out", str(tmp_path / "c"), str(first)]) == 2
    assert "at least two checkpoints" in capsys.readouterr().err
    second = head(tmp_path, 3)
    assert main(["ensemble", "--out", str(tmp_path / "d"), str(first), str(second)]) == 0
    assert main(["ensemble", "--out", str(tmp_path / "e"), str(tmp_path / "d"), str(first)]) == 2
    assert "not ensembles" in capsys.readouterr().err
    assert main(["ensemble", "--out", str(tmp_path / "d"), str(first), str(second)]) == 2  # never over a checkpoint
    assert "exists" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abce")
