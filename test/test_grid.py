import math

import numpy as np
import pytest

from sps_driving.core.failures import Failure, FailureThresholds, check_failures
from sps_driving.core.grid import PatchGrid, attention_bias, patch_masks


def test_grid_indices_are_row_major_and_non_square():
    grid = PatchGrid(3, 5)
    assert grid.n == 15
    assert tuple(grid.coords[7]) == (1.0, 2.0)
    assert grid.distances[0, 6] == pytest.approx(math.sqrt(2))


def test_scatter_places_descriptors_and_zeros_elsewhere():
    grid = PatchGrid(2, 3)
    values = np.arange(4, dtype=np.float32).reshape(2, 2) + 1
    out = grid.scatter(values, np.array([5, 1]))
    assert out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out[1, 2], values[0])
    np.testing.assert_array_equal(out[0, 1], values[1])
    assert np.count_nonzero(out) == 4


@pytest.mark.parametrize("falloff", ["hard", "exp2", "inverse"])
def test_masks_are_one_at_the_patch_itself_and_decay(falloff):
    grid = PatchGrid(4, 4)
    m = patch_masks(grid, np.array([0, 5]), falloff, alpha=1.0)
    assert m.shape == (2, 16)
    assert m[0, 0] == 1.0 and m[1, 5] == 1.0
    assert m[0, 15] < m[0, 1] or (falloff == "hard" and m[0, 15] == 0.0)
    assert np.all((m >= 0) & (m <= 1))


def test_hard_mask_cutoff_alpha():
    grid = PatchGrid(3, 3)
    m = patch_masks(grid, np.array([4]), "hard", alpha=1.0)
    assert m.reshape(3, 3).tolist() == [[0, 1, 0], [1, 1, 1], [0, 1, 0]]


def test_attention_bias_matches_eq1_and_handles_infinite_r():
    m = np.array([[1.0, 0.5, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(attention_bias(m, -4.0), [[0.0, -2.0, -4.0]])
    b = attention_bias(m, -math.inf)
    assert b[0, 0] == 0.0 and np.isneginf(b[0, 1]) and np.isneginf(b[0, 2])
    with pytest.raises(ValueError):
        attention_bias(m, 1.0)


def test_failure_rules():
    t = FailureThresholds()
    assert check_failures(t, 0.3, 0.1, 20.0) == []
    assert check_failures(t, -1.9, 0.0) == [Failure.LANE]
    assert check_failures(t, 0.0, 0.0, 0.5) == [Failure.COLLISION]
    assert check_failures(t, 0.0, math.radians(31)) == [Failure.HEADING]
    assert check_failures(t, float("nan"), float("nan"), float("nan")) == []
    with pytest.raises(ValueError):
        FailureThresholds(max_heading_error_rad=float("nan"))
