"""Statistics of closed-loop scores over the evaluation's design: scenarios x layouts x training
seeds, with scipy where it has the method.

A method's scores are {(scenario, layout seed, training seed): score}. Every scenario drives the
same layouts, and every checkpoint (one per training seed) drives every (scenario, layout) cell,
so a method's score is the mean over scenarios of the mean over layouts of the mean over its
checkpoints, and two methods pair up cell by cell. Only the cells every checkpoint of the methods
compared has driven are used; the counts reported say how many those were.

Intervals are 95% percentile bootstrap intervals, seeded (a table rewritten from the same rows
reads the same; rows are keyed, never taken in file order). Each replicate resamples, with
replacement and in this order:
  1. the scenarios;
  2. the layouts within each drawn scenario, afresh for every draw of it;
  3. each method's training seeds (its checkpoints), once per replicate: a checkpoint drives every
     cell, so its seed is crossed with scenarios and layouts, and seeds of two methods are not
     paired with each other (seed 0 of one method has nothing in common with seed 0 of another).
With k checkpoints, step 3 draws from k values: it sees (k-1)/k of the seed level's variance,
so with 3 checkpoints that differ much the interval is somewhat too narrow (on synthetic
evaluations, 36 of 40 covered the truth where 38 would be expected); more seeds are the remedy.
A difference of two methods is taken cell by cell (paired): what two methods share (a layout that
is hard for both) cancels. Where only one level varies (one scenario, one checkpoint per method:
the layouts are the sample), scipy.stats.bootstrap does the resampling; where levels nest, scipy
has no resampler and the one here does. Comparing a paired interval with the unpaired one
(`unpaired_difference`, every episode taken as independent) shows what pairing buys.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000

Scores = Mapping[tuple[str, int, Hashable], float]  # (scenario, layout seed, training seed) -> score


@dataclass(frozen=True)
class Estimate:
    """A method's score, or the paired difference of two methods (A - B), with its 95% interval.
    `low` and `high` are NaN where there is nothing to resample (a single cell)."""

    mean: float
    low: float
    high: float
    scenarios: int
    layouts: int  # distinct layout seeds among the cells used
    cells: int  # (scenario, layout) cells used
    seeds_a: int  # training seeds (checkpoints) of method A
    seeds_b: int = 0  # of method B; 0 for a single method's score
    wins: int = 0  # cells where A's mean over its checkpoints beats B's
    losses: int = 0  # cells where B's beats A's


@dataclass(frozen=True)
class _Design:
    """Scores as arrays: per scenario, [layout, training seed] of A (and B)."""

    a: tuple[np.ndarray, ...]
    b: tuple[np.ndarray, ...] | None
    layouts: tuple[tuple[int, ...], ...]


def training_seeds(scores: Scores) -> list:
    return sorted({seed for _, _, seed in scores}, key=repr)


def _design(a: Scores, b: Scores | None) -> _Design:
    """The cells of `a` (and `b`) that every checkpoint of both drove, as arrays, in sorted order."""
    seeds_a, seeds_b = training_seeds(a), training_seeds(b) if b is not None else []
    cells = {(scenario, layout) for scenario, layout, _ in a}
    if b is not None:
        cells &= {(scenario, layout) for scenario, layout, _ in b}
    cells = {c for c in cells if all((*c, s) in a for s in seeds_a) and all((*c, s) in b for s in seeds_b)}
    scenarios = sorted({scenario for scenario, _ in cells})
    layouts = tuple(tuple(sorted(layout for s, layout in cells if s == scenario)) for scenario in scenarios)
    arrays_a = tuple(np.array([[a[(sc, lay, s)] for s in seeds_a] for lay in lays], np.float64) for sc, lays in zip(scenarios, layouts))
    arrays_b = None if b is None else tuple(
        np.array([[b[(sc, lay, s)] for s in seeds_b] for lay in lays], np.float64) for sc, lays in zip(scenarios, layouts))
    return _Design(arrays_a, arrays_b, layouts)


def _cell_values(design: _Design) -> list[np.ndarray]:
    """Per scenario, per layout: A's mean over its checkpoints (minus B's)."""
    values = [x.mean(axis=1) for x in design.a]
    if design.b is not None:
        values = [v - y.mean(axis=1) for v, y in zip(values, design.b)]
    return values


def _hierarchical_replicates(design: _Design, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap replicates of the estimate: scenarios, then layouts within each drawn
    scenario, then each method's checkpoints (see the module docstring)."""

    def seed_weights(arrays):
        k = arrays[0].shape[1]
        return rng.multinomial(k, np.full(k, 1.0 / k), size=resamples) / k  # [replicate, checkpoint]

    weights_a = seed_weights(design.a)
    weights_b = seed_weights(design.b) if design.b is not None else None
    n = len(design.a)
    drawn = rng.integers(n, size=(resamples, n))  # [replicate, position] -> scenario
    total = np.zeros(resamples)
    for position in range(n):
        for scenario in range(n):
            rows = np.flatnonzero(drawn[:, position] == scenario)
            if rows.size == 0:
                continue
            values = weights_a[rows] @ design.a[scenario].T  # [replicate, layout]
            if weights_b is not None:
                values = values - weights_b[rows] @ design.b[scenario].T
            layouts = values.shape[1]
            picks = rng.integers(layouts, size=(rows.size, layouts))
            total[rows] += np.take_along_axis(values, picks, axis=1).mean(axis=1)
    return total / n


def _estimate(a: Scores, b: Scores | None, resamples: int, seed: int) -> Estimate:
    design = _design(a, b)
    if not design.a:
        raise ValueError("no (scenario, layout) cell that every checkpoint compared has driven")
    values = _cell_values(design)
    mean = float(np.mean([v.mean() for v in values]))
    flat = np.concatenate(values)
    wins, losses = (int(np.sum(flat > 0)), int(np.sum(flat < 0))) if b is not None else (0, 0)
    seeds_a, seeds_b = design.a[0].shape[1], 0 if design.b is None else design.b[0].shape[1]
    rng = np.random.default_rng(seed)
    if flat.size < 2:
        low = high = float("nan")
    elif np.all(flat == flat[0]) and seeds_a == 1 and seeds_b <= 1:
        low = high = mean  # no spread to resample
    elif len(values) == 1 and seeds_a == 1 and seeds_b <= 1:
        low, high = sample_interval(flat, np.mean, resamples, rng)  # one level: the layouts of one scenario
    else:
        replicates = _hierarchical_replicates(design, resamples, rng)
        tail = 100 * (1 - CONFIDENCE) / 2
        low, high = (float(q) for q in np.percentile(replicates, [tail, 100 - tail]))
    layouts = len({layout for lays in design.layouts for layout in lays})
    return Estimate(mean, low, high, len(values), layouts, int(flat.size), seeds_a, seeds_b, wins, losses)


def sample_interval(values: np.ndarray, statistic, resamples: int, rng: np.random.Generator) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of `statistic` over one sample whose values are
    independent draws (scipy.stats.bootstrap)."""
    result = stats.bootstrap((np.asarray(values),), statistic, confidence_level=CONFIDENCE, n_resamples=resamples,
                             method="percentile", rng=rng)
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def score_interval(scores: Scores, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Estimate:
    """A method's mean score with its 95% bootstrap interval over scenarios x layouts x training seeds."""
    return _estimate(scores, None, resamples, seed)


def paired_difference(a: Scores, b: Scores, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Estimate:
    """Method A minus method B over the (scenario, layout) cells both drove, with the 95% paired
    bootstrap interval over scenarios, layouts and each method's training seeds."""
    return _estimate(a, b, resamples, seed)


def unpaired_difference(a: Scores, b: Scores, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean A - mean B, low, high): the 95% bootstrap interval that takes every episode as an
    independent draw and resamples each method on its own (scipy.stats.bootstrap, two samples).
    It ignores that a checkpoint's episodes share its training: with several checkpoints that
    differ, it is narrower than it should be."""
    a, b = (np.array([scores[k] for k in sorted(scores, key=repr)], np.float64) for scores in (a, b))
    mean = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return mean, float("nan"), float("nan")
    result = stats.bootstrap((a, b), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
                             confidence_level=CONFIDENCE, n_resamples=resamples, method="percentile",
                             rng=np.random.default_rng(seed))
    return mean, float(result.confidence_interval.low), float(result.confidence_interval.high)
