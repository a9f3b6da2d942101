"""Occlusion attribution of a policy (DrivingPolicy.attribution): per kept patch, the change of the
steering command when that patch alone is dropped."""

import numpy as np
import pytest
import torch
from samples import tiny_policy

from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.state import STATE_NAMES

ROWS, COLS, DIM = 4, 6, 8
STATE = {"speed_mps": 9.0, "target_speed_mps": 10.0}


def frame(policy, count, seed=0):
    rng = np.random.default_rng(seed)
    indices = np.sort(rng.choice(policy.grid.n, size=count, replace=False))
    return rng.standard_normal((count, policy.descriptor_dim)).astype(np.float32), indices


def one_by_one(policy, descriptors, indices, state=None):
    """The definition, one predict per dropped patch."""
    full = policy.predict(descriptors, indices, state)[0]
    return np.array([policy.predict(np.delete(descriptors, i, 0), np.delete(indices, i), state)[0] - full
                     for i in range(len(indices))])


def test_a_policy_that_reads_one_patch_only_is_attributed_to_that_patch(tmp_path):
    policy = load_policy(tiny_policy(tmp_path / "p", ROWS, COLS, DIM, architecture="mlp"))
    reduce = policy.module.reduce.out_features
    watched = 9
    with torch.no_grad():  # the first MLP layer reads only patch 9's reduced channels
        first = policy.module.mlp[1].weight
        first[:, : watched * reduce] = 0.0
        first[:, (watched + 1) * reduce:] = 0.0
        first[:, watched * reduce: (watched + 1) * reduce] *= 20.0  # a clear effect through the small random MLP
    descriptors, indices = frame(policy, 12)
    indices[3] = watched
    indices = np.sort(indices)
    position = int(np.flatnonzero(indices == watched)[0])
    attribution = policy.attribution(descriptors, indices)
    assert attribution.dtype == np.float32 and attribution.shape == (12,)
    assert abs(attribution[position]) > 1e-3
    assert np.abs(np.delete(attribution, position)).max() < 1e-7
    assert int(np.argmax(np.abs(attribution))) == position
    np.testing.assert_allclose(attribution, one_by_one(policy, descriptors, indices), atol=1e-6)


@pytest.mark.parametrize("variant,architecture,state_inputs", [
    ("sps", "mlp", ()), ("sps", "mlp", STATE_NAMES), ("sps", "transformer", ()), ("spps", "transformer", STATE_NAMES),
    ("sps", "positional_transformer", STATE_NAMES), ("mspps", "positional_transformer", STATE_NAMES),
])
def test_batched_occlusion_equals_dropping_each_patch_one_by_one(tmp_path, variant, architecture, state_inputs):
    policy = load_policy(tiny_policy(tmp_path / "p", ROWS, COLS, DIM, variant=variant, architecture=architecture,
                                     state_inputs=state_inputs))
    state = STATE if state_inputs else None
    descriptors, indices = frame(policy, 11, seed=3)
    batched = policy.attribution(descriptors, indices, state)
    expected = one_by_one(policy, descriptors, indices, state)
    assert np.abs(expected).max() > 1e-5, "a random policy's command moves when a patch is dropped"
    np.testing.assert_allclose(batched, expected, atol=2e-6)
    # One occluded copy per batch (the memory bound at its tightest) gives the same numbers.
    np.testing.assert_allclose(policy.attribution(descriptors, indices, state, batch_elements=1), batched, atol=2e-6)


def test_the_cnn_baseline_and_a_single_kept_patch(tmp_path):
    policy = load_policy(tiny_policy(tmp_path / "p", 4, 4, 147, backbone="pixels", architecture="cnn"))
    descriptors, indices = frame(policy, 5, seed=1)
    np.testing.assert_allclose(policy.attribution(descriptors, indices), one_by_one(policy, descriptors, indices), atol=2e-6)
    only = policy.attribution(descriptors[:1], indices[:1])
    with torch.no_grad():  # nothing kept: the policy sees an all-zero grid
        empty = float(policy.module.forward_selected(torch.zeros(1, 16, 147), torch.zeros(1, 16, dtype=torch.bool))[0, 0])
    assert only.shape == (1,) and only[0] == pytest.approx(empty - policy.predict(descriptors[:1], indices[:1])[0], abs=1e-6)


def test_bad_input_is_refused_as_predict_refuses_it(tmp_path):
    policy = load_policy(tiny_policy(tmp_path / "p", ROWS, COLS, DIM, state_inputs=STATE_NAMES))
    descriptors, indices = frame(policy, 4)
    with pytest.raises(ValueError, match="state input"):
        policy.attribution(descriptors, indices)
    with pytest.raises(ValueError, match="unique"):
        policy.attribution(descriptors, np.array([0, 0, 1, 2]), STATE)
