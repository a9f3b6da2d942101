"""Statistics of closed-loop scores, by scipy: a per-scenario 95% t-interval of the mean, and
the paired difference of two methods over the same episodes with a 95% bootstrap interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000


def interval95(values) -> tuple[float, float]:
    """Mean and half-width of the 95% Student t-interval of the mean (0 half-width for one value)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, 0.0
    t = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df=len(values) - 1))
    return mean, t * float(np.std(values, ddof=1)) / math.sqrt(len(values))


@dataclass(frozen=True)
class PairedDifference:
    """Method A minus method B over the same episodes (same scenario, same seed)."""

    mean: float
    low: float  # 95% bootstrap interval of the mean difference (percentile method)
    high: float
    wins: int  # episodes where A scored higher
    losses: int  # episodes where B scored higher
    pairs: int


def paired_difference(a, b, seed: int = 0) -> PairedDifference:
    """A - B over paired scores `a[i]`, `b[i]`; the interval resamples the pairs (seeded, so a
    table rewritten from the same results reads the same)."""
    differences = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if differences.ndim != 1 or len(differences) < 2:
        raise ValueError(f"need at least two paired scores, got {differences.shape}")
    mean = float(differences.mean())
    if np.all(differences == differences[0]):
        low = high = mean  # no spread to resample
    else:
        result = stats.bootstrap((differences,), np.mean, confidence_level=CONFIDENCE, n_resamples=BOOTSTRAP_RESAMPLES,
                                 method="percentile", rng=np.random.default_rng(seed))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
    return PairedDifference(mean, low, high, int(np.sum(differences > 0)), int(np.sum(differences < 0)), len(differences))
