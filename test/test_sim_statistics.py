"""Statistics of closed-loop scores: the hierarchical paired bootstrap on synthetic evaluations
whose true difference is known."""

import numpy as np
import pytest
from scipy import stats

from sps_driving.sim.statistics import paired_difference, score_interval, unpaired_difference

SCENARIOS, LAYOUTS = 8, 20


def evaluation(rng, difference, seeds=3, seed_sd=0.02, shared_sd=0.2, noise_sd=0.08):
    """Scores of methods A and B over scenarios x layouts x training seeds: a scenario and a layout
    effect both methods share, a per-checkpoint effect of each method, per-episode noise; A is
    better than B by `difference` in expectation."""
    scenario = rng.normal(0, 0.1, SCENARIOS)
    layout = rng.normal(0, shared_sd, (SCENARIOS, LAYOUTS))
    checkpoint_a, checkpoint_b = rng.normal(0, seed_sd, seeds), rng.normal(0, seed_sd, seeds)
    a, b = {}, {}
    for i in range(SCENARIOS):
        for j in range(LAYOUTS):
            for k in range(seeds):
                shared = 0.5 + scenario[i] + layout[i, j]
                a[(f"s{i}", 100 + j, k)] = shared + difference + checkpoint_a[k] + rng.normal(0, noise_sd)
                b[(f"s{i}", 100 + j, k + 10)] = shared + checkpoint_b[k] + rng.normal(0, noise_sd)
    return a, b


def test_the_paired_interval_covers_the_true_difference():
    covered = 0
    for replicate in range(40):
        a, b = evaluation(np.random.default_rng(replicate), 0.1, seed_sd=0.01)
        d = paired_difference(a, b, resamples=2000)
        assert (d.scenarios, d.layouts, d.cells, d.seeds_a, d.seeds_b) == (SCENARIOS, LAYOUTS, SCENARIOS * LAYOUTS, 3, 3)
        assert d.low < d.mean < d.high
        covered += d.low <= 0.1 <= d.high
    # 95% intervals: 39 of these 40 cover it. Checkpoints that differ more are under-covered: with 3
    # of them the seed level is resampled from 3 values (36 of 40 at twice this spread).
    assert covered >= 37


def test_no_difference_gives_an_interval_around_zero_and_a_clear_one_excludes_it():
    a, b = evaluation(np.random.default_rng(7), 0.0)
    d = paired_difference(a, b)
    assert d.low < 0 < d.high
    a, b = evaluation(np.random.default_rng(7), 0.1)
    assert paired_difference(a, b).low > 0


def test_pairing_cancels_what_the_methods_share():
    """Layouts that are hard for both methods: the paired interval is far narrower than the one that
    takes every episode as independent (scipy's two-sample bootstrap)."""
    a, b = evaluation(np.random.default_rng(3), 0.05, seeds=1, seed_sd=0.0, shared_sd=0.25)
    paired = paired_difference(a, b)
    mean, low, high = unpaired_difference(a, b)
    assert mean == pytest.approx(paired.mean)
    assert low <= paired.mean <= high
    assert (paired.high - paired.low) < 0.5 * (high - low)


def test_checkpoints_that_differ_widen_the_interval():
    """The seed level is resampled: checkpoints that disagree make the difference less certain."""
    a, b = evaluation(np.random.default_rng(5), 0.1, seed_sd=0.0)
    alike = paired_difference(a, b)
    a, b = evaluation(np.random.default_rng(5), 0.1, seed_sd=0.1)
    unlike = paired_difference(a, b)
    assert (unlike.high - unlike.low) > 2 * (alike.high - alike.low)


def test_one_level_is_scipys_bootstrap():
    """One scenario, one checkpoint per method: the layouts are the sample, and scipy resamples them."""
    rng = np.random.default_rng(11)
    scores_a, scores_b = rng.uniform(0.3, 1.0, 20), rng.uniform(0.3, 1.0, 20)
    a = {("s", j, 0): float(x) for j, x in enumerate(scores_a)}
    b = {("s", j, None): float(x) for j, x in enumerate(scores_b)}
    d = paired_difference(a, b, seed=4)
    expected = stats.bootstrap((scores_a - scores_b,), np.mean, n_resamples=10_000, method="percentile",
                               rng=np.random.default_rng(4)).confidence_interval
    assert (d.low, d.high) == pytest.approx((expected.low, expected.high))
    assert d.mean == pytest.approx(np.mean(scores_a - scores_b)) and d.wins + d.losses == 20


def test_a_methods_score_interval_over_scenarios_layouts_and_seeds():
    a, _ = evaluation(np.random.default_rng(2), 0.1)
    score = score_interval(a)
    assert score.mean == pytest.approx(np.mean(list(a.values())))
    assert score.low < score.mean < score.high and score.seeds_b == 0
    # Seeded, and keyed rather than ordered: the same scores in another order give the same interval.
    assert score_interval(dict(reversed(list(a.items())))) == score
    assert score_interval({("s", 0, 0): 0.4}).mean == 0.4 and np.isnan(score_interval({("s", 0, 0): 0.4}).low)
    flawless = score_interval({("s", j, 0): 1.0 for j in range(5)})
    assert (flawless.mean, flawless.low, flawless.high) == (1.0, 1.0, 1.0)


def test_only_cells_every_checkpoint_drove_are_compared():
    a, b = evaluation(np.random.default_rng(9), 0.1)
    del a[("s0", 100, 2)]  # one checkpoint of A missed one layout of one scenario
    b = {key: value for key, value in b.items() if key[0] != "s7"}  # B never drove one scenario
    d = paired_difference(a, b)
    assert (d.scenarios, d.cells, d.layouts) == (SCENARIOS - 1, (SCENARIOS - 1) * LAYOUTS - 1, LAYOUTS)
    with pytest.raises(ValueError, match="no \\(scenario, layout\\) cell"):
        paired_difference({("s0", 1, 0): 1.0}, {("s1", 1, 0): 1.0})
