import math

import numpy as np
import pytest
import torch

from sps_driving.core.grid import PatchGrid
from sps_driving.core.selection import PatchSelector, SelectionConfig, kept_count, scaled_keep_probabilities

GRID = PatchGrid(16, 16)
STAMPS = [1_700_000_000_000_000_000 + i * 33_333_333 for i in range(2000)]


def selector(variant="sps", rate=0.5, seed=0, grid=GRID, keep_probability=None):
    return PatchSelector(SelectionConfig(variant, rate, seed, keep_probability), grid)


@pytest.mark.parametrize("variant", ["sps", "spps"])
@pytest.mark.parametrize("rate,grid,expected_k", [
    (0.5, GRID, 128), (0.3, GRID, 77), (0.7, PatchGrid(2, 5), 7), (0.01, PatchGrid(3, 7), 1), (1.0, PatchGrid(3, 7), 21),
])
def test_exact_count_variants_keep_exactly_ceil_rate_times_n(variant, rate, grid, expected_k):
    sel = selector(variant, rate, grid=grid)
    assert sel.count == expected_k
    for stamp in STAMPS[:50]:
        idx = sel.select(stamp)
        assert idx.dtype == np.int64 and len(idx) == expected_k
        assert np.all(np.diff(idx) > 0), "sorted and unique"
        assert idx.min() >= 0 and idx.max() < grid.n
    masks = sel.sample_masks(64, torch.Generator().manual_seed(1))
    assert masks.shape == (64, grid.n) and masks.dtype == torch.bool
    assert torch.all(masks.sum(dim=1) == expected_k)


def test_kept_count_is_sps_k_without_float_error():
    assert [kept_count(r, 256) for r in (1.0, 0.7, 0.5, 0.3)] == [256, 180, 128, 77]
    assert kept_count(0.7, 10) == 7  # 0.7 * 10 is 7.000000000000001 in floating point
    assert kept_count(1e-12, 256) == 1
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="rate"):
            kept_count(bad, 256)


@pytest.mark.parametrize("variant", ["sps", "threshold", "spps", "mspps"])
def test_rate_one_is_the_dense_baseline(variant):
    sel = selector(variant, 1.0, grid=PatchGrid(4, 6))
    assert sel.dense
    np.testing.assert_array_equal(sel.select(123), np.arange(24))
    assert bool(sel.sample_masks(8, torch.Generator().manual_seed(0)).all())


def test_sequence_flag_follows_variant():
    assert [SelectionConfig(v).sparse_sequence for v in ("sps", "threshold", "spps", "mspps")] == [False, False, True, True]


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.0000001, float("nan"), float("inf"), "0.5", None, True])
def test_bad_rate_is_rejected(bad):
    with pytest.raises(ValueError, match="rate"):
        SelectionConfig("sps", bad)


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="variant"):
        SelectionConfig("random")
    with pytest.raises(ValueError, match="seed"):
        SelectionConfig("sps", 0.5, -1)
    with pytest.raises(ValueError, match="only used by the mspps"):
        SelectionConfig("sps", 0.5, 0, [[1.0]])
    with pytest.raises(ValueError, match="2x3"):
        selector("mspps", 0.5, grid=PatchGrid(3, 2), keep_probability=np.ones((2, 3)))
    with pytest.raises(ValueError, match="non-zero"):
        selector("mspps", 0.5, grid=PatchGrid(2, 2), keep_probability=[[1, 0], [0, 0]])
    with pytest.raises(ValueError, match="finite"):
        SelectionConfig("mspps", 0.5, 0, [[1.0, -1.0]])
    with pytest.raises(ValueError, match="unknown selection settings"):
        SelectionConfig.from_dict({"variant": "sps", "ratio": 0.5})
    with pytest.raises(ValueError, match="stamp"):
        selector().select(-5)


def test_config_round_trips_through_dict():
    cfg = SelectionConfig("mspps", 0.3, 7, [[1, 2], [3, 4]])
    assert SelectionConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["keep_probability"] == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("variant", ["sps", "threshold", "spps", "mspps"])
def test_same_seed_and_stamp_give_the_same_subset_and_others_differ(variant):
    a, b = selector(variant, 0.5, seed=3), selector(variant, 0.5, seed=3)
    for stamp in STAMPS[:20]:
        np.testing.assert_array_equal(a.select(stamp), b.select(stamp))
    subsets = {tuple(a.select(stamp)) for stamp in STAMPS[:200]}
    assert len(subsets) == 200, "every frame gets its own subset"
    other_seed = selector(variant, 0.5, seed=4)
    assert not np.array_equal(a.select(STAMPS[0]), other_seed.select(STAMPS[0]))
    # numpy ints (as read from a cache's stamp array) select exactly like Python ints
    np.testing.assert_array_equal(a.select(np.int64(STAMPS[5])), a.select(STAMPS[5]))


def test_threshold_mean_keep_rate_and_spread_are_binomial():
    rate, n, frames = 0.3, GRID.n, len(STAMPS)
    counts = np.array([len(selector("threshold", rate).select(s)) for s in STAMPS])
    sigma_frame = math.sqrt(n * rate * (1 - rate))
    # mean of `frames` binomial counts: 5 standard errors
    assert abs(counts.mean() - rate * n) < 5 * sigma_frame / math.sqrt(frames)
    # per-frame spread: the sample std of 2000 draws is within ~1.6% of sigma; allow 10%
    assert counts.std(ddof=1) == pytest.approx(sigma_frame, rel=0.10)
    assert len(set(counts.tolist())) > 10, "the count really fluctuates"
    torch_counts = selector("threshold", rate).sample_masks(frames, torch.Generator().manual_seed(0)).sum(1).double()
    assert abs(torch_counts.mean().item() - rate * n) < 5 * sigma_frame / math.sqrt(frames)
    assert torch_counts.std().item() == pytest.approx(sigma_frame, rel=0.10)


def test_iid_variants_never_return_an_empty_subset():
    sel = selector("threshold", 0.05, grid=PatchGrid(2, 2))  # empty with probability 0.95^4 = 0.81
    assert min(len(sel.select(s)) for s in STAMPS[:300]) == 1
    masks = sel.sample_masks(300, torch.Generator().manual_seed(0))
    assert int(masks.sum(1).min()) == 1


def test_scaled_keep_probabilities_hit_the_rate_and_clip_at_one():
    weights = np.array([10.0, 1.0, 1.0, 2.0, 0.0, 1.0])
    p = scaled_keep_probabilities(weights, 0.5)
    assert p.sum() == pytest.approx(3.0)
    assert p[0] == 1.0, "the dominant weight saturates"
    assert p[4] == 0.0
    assert p[3] == pytest.approx(2 * p[1]), "unsaturated patches keep their relative weights"
    already_scaled = np.array([0.2, 0.4, 0.6, 0.8])
    np.testing.assert_allclose(scaled_keep_probabilities(already_scaled, 0.5), already_scaled)


def test_mspps_follows_the_probability_matrix():
    grid = PatchGrid(4, 8)
    rows = np.linspace(0.1, 1.0, grid.rows)[:, None] * np.ones((1, grid.cols))  # lower rows matter more
    rows[0, :2] = 0.0  # never kept
    sel = selector("mspps", 0.4, grid=grid, keep_probability=rows)
    p = sel.keep_probabilities
    assert p.sum() == pytest.approx(0.4 * grid.n)
    frames = len(STAMPS)
    freq = sel.stamp_masks(STAMPS).mean(0)
    tolerance = 5 * np.sqrt(p * (1 - p) / frames) + 1e-12
    assert np.all(np.abs(freq - p) <= tolerance)
    assert freq[0] == 0.0 and freq[1] == 0.0
    torch_freq = sel.sample_masks(frames, torch.Generator().manual_seed(5)).double().mean(0).numpy()
    assert np.all(np.abs(torch_freq - p) <= tolerance)
    # the matrix's preference shows: the bottom row is kept far more often than the top row
    assert freq[-grid.cols:].mean() > 3 * freq[2:grid.cols].mean()


@pytest.mark.parametrize("variant", ["sps", "threshold"])
def test_gram_identity_of_appendix_a4_eq8(variant):
    """E[(S F)^T (S F)] = m/N F^T F for uniform row sampling (eq. 8); m/N = rate in expectation for v1."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(GRID.n, 16)) @ rng.normal(size=(16, 16))  # correlated descriptor columns
    features -= features.mean(0)
    sel = selector(variant, 0.3)
    expected = (sel.count / GRID.n if sel.exact_count else 0.3) * features.T @ features

    def mean_gram(masks):
        # (S F)^T (S F) = F^T diag(c) F, so its mean over frames is F^T diag(mean c) F
        return features.T @ (masks.mean(0)[:, None] * features)

    for masks in (sel.stamp_masks(STAMPS), sel.sample_masks(len(STAMPS), torch.Generator().manual_seed(2)).numpy()):
        relative = np.linalg.norm(mean_gram(masks) - expected) / np.linalg.norm(expected)
        assert relative < 0.03
    # one single subset is far from the expectation: the identity is about the average
    single = features[sel.select(STAMPS[0])]
    assert np.linalg.norm(single.T @ single - expected) / np.linalg.norm(expected) > 0.1


def test_training_masks_are_fresh_per_frame_and_reproducible_from_the_generator():
    sel = selector("sps", 0.5)
    a = sel.sample_masks(32, torch.Generator().manual_seed(9))
    b = sel.sample_masks(32, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    assert len({tuple(row.tolist()) for row in a}) == 32
    gen = torch.Generator().manual_seed(9)
    first, second = sel.sample_masks(32, gen), sel.sample_masks(32, gen)
    assert not torch.equal(first, second), "each epoch's draw differs"


def test_selection_is_pinned_to_a_stable_stream():
    """Replays must select the same patches on every install: these values are part of the format."""
    stamp = 1_700_000_000_123_456_789
    assert selector("sps", 0.3, seed=7, grid=PatchGrid(4, 5)).select(stamp).tolist() == [2, 3, 5, 14, 17, 18]
    assert selector("threshold", 0.3, seed=7, grid=PatchGrid(4, 5)).select(stamp).tolist() == [
        1, 2, 3, 5, 6, 14, 15, 16, 17, 18, 19]
