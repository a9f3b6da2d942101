"""Stochastic Patch Selection (SPS section 3.3) and its variants (section 3.4).

Variants (`SelectionConfig.variant`):

- ``"sps"``: exactly k = ceil(rate * N) patch indices (`kept_count`), uniformly without replacement. Dropped
  patches become zeros in the H' x W' x D grid the policy sees (eq. 4).
- ``"threshold"`` (v1): every patch is kept independently with probability ``rate`` (eq. 5), so
  the count fluctuates around rate * N.
- ``"spps"`` (v2): the exact-k subset of ``"sps"``, fed to the policy as a sparse sequence of the
  kept descriptors, each with its original position embedding.
- ``"mspps"`` (v1 + v2): each patch i is kept independently with its own probability p_i taken
  from the ``keep_probability`` matrix [rows][cols], fed as a sparse sequence.

MSPPS scaling: ``keep_probability`` holds relative, non-negative keep weights w_i. The selector
uses p_i = min(1, c * w_i) with the one c > 0 for which sum(p_i) = rate * N, so the expected
keep-rate is exactly ``rate`` whatever the matrix's own scale, the matrix's shape of preference
is kept, and no probability exceeds 1. A matrix whose mean already equals ``rate`` (and has no
entry above 1) is used as is. ``keep_probability=None`` means uniform weights (then MSPPS is v1
with a sparse sequence).

The i.i.d. variants never return an empty subset: if no patch passes, the one closest to
passing (smallest R_i / p_i) is kept, so every frame has at least one descriptor. For N = 256 at
rate 0.3 this happens with probability 0.7^256, i.e. never in practice.

Reproducibility: the subset for a frame is a pure function of (seed, frame stamp in ns), drawn
from numpy's Philox bit generator keyed by a SeedSequence of the two, so a replayed bag selects
the same patches. Training draws fresh selections from a seedable torch.Generator instead
(`PatchSelector.sample_masks`), and validation uses the per-stamp selection (`stamp_masks`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from sps_driving.core.grid import PatchGrid

if TYPE_CHECKING:  # torch is needed for training draws only; the selection node starts without it
    import torch

VARIANTS = ("sps", "threshold", "spps", "mspps")
SPARSE_SEQUENCE_VARIANTS = ("spps", "mspps")
EXACT_COUNT_VARIANTS = ("sps", "spps")

# rate * N is computed in floating point: 0.7 * 10 = 7.000000000000001 must give k = 7, not 8.
_CEIL_SLACK = 1e-9


def kept_count(rate: float, n: int) -> int:
    """k = ceil(rate * N): how many of N patches the exact-count variants keep (at least one)."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"selection rate must be in (0, 1], got {rate}")
    return max(1, min(n, math.ceil(rate * n - _CEIL_SLACK)))


@dataclass(frozen=True)
class SelectionConfig:
    variant: str = "sps"
    rate: float = 0.5  # keep-rate in (0, 1]; 1.0 is the dense Drive-Anywhere baseline
    seed: int = 0
    keep_probability: tuple | None = None  # mspps only: [rows][cols] relative keep weights

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown selection variant {self.variant!r}; expected one of {VARIANTS}")
        rate = self.rate
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not (0.0 < float(rate) <= 1.0):
            raise ValueError(f"selection rate must be a number in (0, 1], got {rate!r}")
        object.__setattr__(self, "rate", float(rate))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(f"selection seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        if self.keep_probability is not None:
            if self.variant != "mspps":
                raise ValueError(f"keep_probability is only used by the mspps variant, not {self.variant!r}")
            weights = np.asarray(self.keep_probability, dtype=np.float64)
            if weights.ndim != 2 or weights.size == 0:
                raise ValueError(f"keep_probability must be a [rows][cols] matrix, got shape {weights.shape}")
            if not np.all(np.isfinite(weights)) or np.any(weights < 0) or not np.any(weights > 0):
                raise ValueError("keep_probability entries must be finite, >= 0 and not all zero")
            # A nested tuple keeps the config hashable and frozen; it round-trips through JSON as lists.
            object.__setattr__(self, "keep_probability", tuple(tuple(float(v) for v in row) for row in weights))

    @property
    def sparse_sequence(self) -> bool:
        return self.variant in SPARSE_SEQUENCE_VARIANTS

    @classmethod
    def from_dict(cls, d: dict) -> SelectionConfig:
        unknown = set(d) - {"variant", "rate", "seed", "keep_probability"}
        if unknown:
            raise ValueError(f"unknown selection settings {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.keep_probability is not None:
            d["keep_probability"] = [list(row) for row in self.keep_probability]
        return d


def scaled_keep_probabilities(weights: np.ndarray, rate: float) -> np.ndarray:
    """p_i = min(1, c * w_i) with c chosen so that sum(p) = rate * len(w) (see module docstring)."""
    weights = np.asarray(weights, dtype=np.float64).ravel()
    target = rate * weights.size
    positive = int(np.count_nonzero(weights > 0))
    if positive < target - _CEIL_SLACK:
        raise ValueError(
            f"keep_probability has only {positive} non-zero patches; a keep-rate of {rate} needs "
            f"{target:.1f} on average"
        )
    # Water-filling: saturate the largest weights at p = 1 one by one until c * w fits below 1.
    order = np.argsort(-weights, kind="stable")
    sorted_w = weights[order]
    tail_sums = np.cumsum(sorted_w[::-1])[::-1]  # tail_sums[s] = sum of sorted_w[s:]
    probabilities = np.zeros_like(weights)
    for saturated in range(weights.size + 1):
        remaining = target - saturated
        if remaining <= _CEIL_SLACK:
            probabilities[order[:saturated]] = 1.0
            break
        scale = remaining / tail_sums[saturated]
        if scale * sorted_w[saturated] <= 1.0:
            probabilities[order[:saturated]] = 1.0
            probabilities[order[saturated:]] = scale * sorted_w[saturated:]
            break
    return np.minimum(probabilities, 1.0)


class PatchSelector:
    """Decides which patches of a frame are computed and fed to the policy."""

    def __init__(self, config: SelectionConfig, grid: PatchGrid) -> None:
        self.config = config
        self.grid = grid
        n = grid.n
        self.count = kept_count(config.rate, n)  # k for the exact-count variants
        if config.variant == "mspps" and config.keep_probability is not None:
            weights = np.asarray(config.keep_probability, dtype=np.float64)
            if weights.shape != (grid.rows, grid.cols):
                raise ValueError(
                    f"keep_probability is {weights.shape[0]}x{weights.shape[1]} but the patch grid is "
                    f"{grid.rows}x{grid.cols}"
                )
            self.keep_probabilities = scaled_keep_probabilities(weights, config.rate)
        else:
            self.keep_probabilities = np.full(n, config.rate)

    @property
    def sparse_sequence(self) -> bool:
        return self.config.sparse_sequence

    @property
    def exact_count(self) -> bool:
        return self.config.variant in EXACT_COUNT_VARIANTS

    @property
    def dense(self) -> bool:
        """True when every patch is always kept (rate 1.0): the Drive-Anywhere baseline."""
        return bool(np.all(self.keep_probabilities >= 1.0)) and self.count == self.grid.n

    def frame_rng(self, stamp_ns: int) -> np.random.Generator:
        if isinstance(stamp_ns, bool) or not isinstance(stamp_ns, numbers.Integral) or stamp_ns < 0:
            raise ValueError(f"frame stamp must be a non-negative integer of nanoseconds, got {stamp_ns!r}")
        return np.random.Generator(np.random.Philox(np.random.SeedSequence([self.config.seed, int(stamp_ns)])))

    def select(self, stamp_ns: int) -> np.ndarray:
        """Sorted int64 patch indices (row-major) kept for the frame stamped `stamp_ns`."""
        # Only uniform doubles are drawn (bit-stable across numpy versions, unlike permutation()),
        # so a bag replayed on another install selects the same patches.
        draws = self.frame_rng(stamp_ns).random(self.grid.n)
        if self.exact_count:
            return np.sort(np.argsort(draws, kind="stable")[: self.count]).astype(np.int64)
        keep = draws < self.keep_probabilities
        if not keep.any():
            keep[self._closest_to_passing(draws)] = True
        return np.flatnonzero(keep).astype(np.int64)

    def groups(self, stamp_ns: int) -> np.ndarray:
        """int16 [N]: the frame's patches in floor(N / k) disjoint groups of k (exact-count variants),
        -1 for the N mod k left over. Group 0 is `select(stamp_ns)`, each group is a uniform k-subset
        of the frame's patches, and the groups are the draw's next k patches in turn: a
        token-dropping feature cache computes each group in one pass (sps_driving.train.extract)."""
        if not self.exact_count:
            raise ValueError(f"patch groups of k are drawn for the exact-count variants {EXACT_COUNT_VARIANTS}, "
                             f"not {self.config.variant!r}")
        order = np.argsort(self.frame_rng(stamp_ns).random(self.grid.n), kind="stable")
        groups = np.full(self.grid.n, -1, dtype=np.int16)
        count = self.grid.n // self.count
        groups[order[:count * self.count]] = np.repeat(np.arange(count), self.count)
        return groups

    def _closest_to_passing(self, draws: np.ndarray) -> int:
        with np.errstate(divide="ignore"):
            return int(np.argmin(np.where(self.keep_probabilities > 0, draws / self.keep_probabilities, np.inf)))

    def stamp_masks(self, stamps_ns) -> np.ndarray:
        """bool [B, N] keep masks of `select` for each stamp: the fixed, replayable selection."""
        masks = np.zeros((len(stamps_ns), self.grid.n), dtype=bool)
        for row, stamp in enumerate(stamps_ns):
            masks[row, self.select(int(stamp))] = True
        return masks

    def sample_masks(self, batch_size: int, generator: torch.Generator, device=None) -> torch.Tensor:
        """bool [B, N] fresh keep masks for a training batch, drawn from `generator`.

        Same distribution as `select`, vectorized in torch: one independent draw per frame.
        """
        import torch

        n = self.grid.n
        device = generator.device if device is None else device
        draws = torch.rand(batch_size, n, generator=generator, device=generator.device).to(device)
        if self.exact_count:
            masks = torch.zeros(batch_size, n, dtype=torch.bool, device=device)
            kept = draws.argsort(dim=1)[:, : self.count]
            return masks.scatter_(1, kept, True)
        probabilities = torch.as_tensor(self.keep_probabilities, dtype=draws.dtype, device=device)
        masks = draws < probabilities
        empty = ~masks.any(dim=1)
        if bool(empty.any()):
            ratio = torch.where(probabilities > 0, draws / probabilities, torch.full_like(draws, math.inf))
            rows = torch.nonzero(empty).squeeze(1)
            masks[rows, ratio[rows].argmin(dim=1)] = True
        return masks
