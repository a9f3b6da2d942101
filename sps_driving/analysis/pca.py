"""PCA over feature dimensions of per-patch descriptors (SPS eq. 3, appendix A.1).

A frame's descriptors form an [N, D] matrix F_c (one row per patch). Its cumulative explained
variance E(m) says how many feature directions carry the frame's content; a curve that
saturates for m << D means the patches repeat each other (low-rank redundancy).
Everything here works on one frame at a time or on running sums, so an analysis over
thousands of frames never holds them all in memory.
"""

from __future__ import annotations

import numpy as np


def explained_variance_curve(descriptors: np.ndarray) -> np.ndarray | None:
    """E(m) for m = 1..D of one frame's [N, D] descriptors (eq. 3), 1.0 past the rank.

    Returns None for a frame without variance (all rows equal), where E is undefined.
    """
    x = _as_matrix(descriptors)
    x = x - x.mean(axis=0)
    # The covariance's nonzero eigenvalues are those of the smaller Gram matrix (N x N or D x D),
    # whose symmetric eigensolver is many times faster than an SVD of x; 1/N cancels in the ratio.
    gram = x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x
    eigenvalues = np.clip(np.linalg.eigvalsh(gram)[::-1], 0.0, None)
    return _curve_from_eigenvalues(eigenvalues, x.shape[1])


def curve_from_covariance(covariance: np.ndarray) -> np.ndarray | None:
    """E(m) for m = 1..D from a [D, D] covariance matrix; None when its trace is zero."""
    eigenvalues = np.clip(np.linalg.eigvalsh(covariance)[::-1], 0.0, None)
    return _curve_from_eigenvalues(eigenvalues, covariance.shape[0])


def components_to_reach(curve: np.ndarray, level: float = 0.9) -> int:
    """The smallest m with E(m) >= level (1-based, as components are counted)."""
    if not 0.0 < level <= 1.0:
        raise ValueError(f"explained-variance level must be in (0, 1], got {level}")
    # A hair of slack so that a curve reaching the level exactly in theory is not missed by rounding.
    return int(np.argmax(np.asarray(curve) >= level - 1e-9)) + 1


def top_patch_count(n_patches: int, top_patches: int) -> int:
    """How many highest-norm patches the top-energy analysis keeps: `top_patches` (128 in the
    paper, of 256) when the grid has at least twice that many, else half of the grid."""
    return top_patches if n_patches >= 2 * top_patches else max(n_patches // 2, 1)


def top_norm_rows(descriptors: np.ndarray, count: int) -> np.ndarray:
    """The `count` rows of [N, D] with the largest l2 norm (appendix A.1, top-energy subset)."""
    x = _as_matrix(descriptors)
    norms = np.linalg.norm(x, axis=1)
    keep = np.argsort(-norms, kind="stable")[:count]
    return x[np.sort(keep)]


class CurveAverage:
    """Running mean of per-frame E(m) curves (the paper averages the curve over frames)."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None
        self.frames = 0

    def add(self, curve: np.ndarray) -> None:
        self._sum = curve.astype(np.float64) if self._sum is None else self._sum + curve
        self.frames += 1

    def mean(self) -> np.ndarray:
        if self._sum is None:
            raise ValueError("no frame with variance was added")
        return self._sum / self.frames


class RunningCovariance:
    """Covariance of all descriptor rows seen so far, pooled over frames, in float64.

    Keeps only a count, a [D] sum and a [D, D] sum of outer products around a fixed shift
    (the first row seen), which keeps the subtraction well conditioned for fp16 inputs.
    """

    def __init__(self) -> None:
        self.rows = 0
        self._shift: np.ndarray | None = None
        self._sum: np.ndarray | None = None
        self._outer: np.ndarray | None = None

    def add(self, descriptors: np.ndarray) -> None:
        x = _as_matrix(descriptors)
        if self._shift is None:
            self._shift = x[0].copy()
            self._sum = np.zeros(x.shape[1])
            self._outer = np.zeros((x.shape[1], x.shape[1]))
        elif x.shape[1] != self._shift.shape[0]:
            raise ValueError(f"descriptor dim changed from {self._shift.shape[0]} to {x.shape[1]}")
        shifted = x - self._shift
        self.rows += x.shape[0]
        self._sum += shifted.sum(axis=0)
        self._outer += shifted.T @ shifted

    def covariance(self) -> np.ndarray:
        if self.rows < 2:
            raise ValueError("the covariance needs at least two rows")
        mean = self._sum / self.rows
        return (self._outer - self.rows * np.outer(mean, mean)) / (self.rows - 1)


def _curve_from_eigenvalues(eigenvalues: np.ndarray, dim: int) -> np.ndarray | None:
    total = eigenvalues.sum()
    if not total > 0:
        return None
    curve = np.ones(dim)
    curve[: eigenvalues.shape[0]] = np.cumsum(eigenvalues) / total
    return np.minimum(curve, 1.0)


def _as_matrix(descriptors: np.ndarray) -> np.ndarray:
    x = np.asarray(descriptors, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"descriptors must be an [N, D] matrix, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("descriptors contain non-finite values")
    return x
