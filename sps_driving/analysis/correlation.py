"""Patch-wise Pearson correlation of descriptors within a frame (SPS section 4.1, Figure 3b).

Row i of a frame's [N, D] descriptor matrix is patch i; the correlation of rows i and j over
the D feature channels says how much the two patches repeat each other. Pervasive strong
off-diagonal correlation is the cross-patch redundancy SPS exploits.
"""

from __future__ import annotations

import numpy as np


def patch_correlation(descriptors: np.ndarray) -> np.ndarray:
    """[N, N] Pearson correlation between the patches (rows) of [N, D] descriptors.

    A constant row (for instance a patch SPS dropped, all zeros) has no correlation with
    anything: its off-diagonal entries are 0 and its diagonal entry 1.
    """
    x = np.asarray(descriptors, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] < 2:
        raise ValueError(f"descriptors must be an [N, D] matrix with D >= 2, got shape {x.shape}")
    centred = x - x.mean(axis=1, keepdims=True)
    norms = np.linalg.norm(centred, axis=1)
    constant = norms <= 1e-12 * max(1.0, float(np.abs(x).max(initial=0.0)))
    unit = np.where(constant[:, None], 0.0, centred / np.where(constant, 1.0, norms)[:, None])
    corr = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(corr, 1.0)
    return corr


def offdiagonal_abs(corr: np.ndarray) -> np.ndarray:
    """The |r_ij| for i != j, flattened."""
    n = corr.shape[0]
    return np.abs(corr[~np.eye(n, dtype=bool)])


class CorrelationSummary:
    """Per-frame statistics of the off-diagonal correlation, accumulated over frames."""

    def __init__(self, strong_threshold: float) -> None:
        if not 0.0 < strong_threshold < 1.0:
            raise ValueError(f"strong-correlation threshold must be in (0, 1), got {strong_threshold}")
        self.strong_threshold = strong_threshold
        self.mean_abs: list[float] = []
        self.strong_fraction: list[float] = []

    def add(self, corr: np.ndarray) -> None:
        values = offdiagonal_abs(corr)
        if values.size == 0:
            return
        self.mean_abs.append(float(values.mean()))
        self.strong_fraction.append(float((values >= self.strong_threshold).mean()))

    def summary(self) -> dict:
        if not self.mean_abs:
            raise ValueError("no frame with at least two patches was added")
        mean_abs = np.asarray(self.mean_abs)
        return {
            "frames": len(self.mean_abs),
            "mean_abs_offdiagonal": float(mean_abs.mean()),
            "mean_abs_offdiagonal_min": float(mean_abs.min()),
            "mean_abs_offdiagonal_max": float(mean_abs.max()),
            "strong_threshold": self.strong_threshold,
            "strong_fraction_mean": float(np.mean(self.strong_fraction)),
        }
