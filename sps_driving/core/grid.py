"""Patch-grid geometry and the locality masks of SPS eq. 1 (Drive-Anywhere masked attention).

Patch index j runs row-major over an H' x W' grid: j = row * cols + col.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

FALLOFFS = ("hard", "exp2", "inverse")


@dataclass(frozen=True)
class PatchGrid:
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise ValueError(f"patch grid must be at least 1x1, got {self.rows}x{self.cols}")

    @property
    def n(self) -> int:
        return self.rows * self.cols

    @cached_property
    def coords(self) -> np.ndarray:
        """[N, 2] (row, col) of every patch."""
        r, c = np.divmod(np.arange(self.n), self.cols)
        return np.stack([r, c], axis=1).astype(np.float64)

    @cached_property
    def distances(self) -> np.ndarray:
        """[N, N] Euclidean distance between patch centres, in patches (d_ij of SPS sec. 3.1)."""
        diff = self.coords[:, None, :] - self.coords[None, :, :]
        return np.sqrt((diff**2).sum(-1))

    def scatter(self, values: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Place [k, D] descriptors at `indices` of an [rows, cols, D] grid, zeros elsewhere (SPS eq. 4)."""
        values = np.asarray(values)
        indices = np.asarray(indices, dtype=np.int64)
        if values.shape[0] != indices.shape[0]:
            raise ValueError(f"{values.shape[0]} descriptors for {indices.shape[0]} indices")
        out = np.zeros((self.n, values.shape[-1]), dtype=values.dtype)
        out[indices] = values
        return out.reshape(self.rows, self.cols, -1)


def patch_masks(grid: PatchGrid, indices: np.ndarray, falloff: str = "hard", alpha: float = 0.0) -> np.ndarray:
    """Masks m^(j) in [0, 1]^N for each patch j in `indices`: [k, N] float32.

    falloff "hard": 1[d_ij <= alpha]; "exp2": 2^-d_ij; "inverse": 1/d_ij (1 at d = 0).
    """
    d = grid.distances[np.asarray(indices, dtype=np.int64)]
    if falloff == "hard":
        m = (d <= alpha).astype(np.float64)
    elif falloff == "exp2":
        m = np.exp2(-d)
    elif falloff == "inverse":
        m = 1.0 / np.maximum(d, 1.0)
    else:
        raise ValueError(f"unknown mask falloff {falloff!r}; expected one of {FALLOFFS}")
    return m.astype(np.float32)


def attention_bias(masks: np.ndarray, suppression: float) -> np.ndarray:
    """The additive logit term (1 - m) * r of SPS eq. 1, for r < 0 (r = -inf is a hard mask).

    Entries with m = 1 get exactly 0 so that r = -inf does not produce 0 * inf = nan.
    """
    if not suppression < 0:
        raise ValueError(f"suppression strength r must be negative, got {suppression}")
    masks = np.asarray(masks, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        bias = (1.0 - masks) * np.float32(suppression)
    return np.where(masks >= 1.0, np.float32(0.0), bias).astype(np.float32)


def token_bias(
    grid: PatchGrid, indices: np.ndarray, falloff: str, alpha: float, suppression: float,
    prefix_tokens: int = 1, prefix_mask: float = 1.0,
) -> np.ndarray:
    """float32 [k, prefix_tokens + N]: SPS eq. 1's (1 - m^(j)) r over a ViT's tokens, the prefix
    (CLS) tokens first with mask value prefix_mask (1 = always attended)."""
    masks = patch_masks(grid, indices, falloff, float(alpha))
    prefix = np.full((len(masks), prefix_tokens), prefix_mask, dtype=np.float32)
    return attention_bias(np.concatenate([prefix, masks], axis=1), float(suppression))
