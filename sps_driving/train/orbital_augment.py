"""Manifold augmentation: training patches resampled from their own bounded Manifold (PMTT).

A feature cache extracted with `--orbital-every K` holds, for every K-th frame, the visible
orbital states of each patch (sps_driving.core.orbital). In training, each patch of such a frame
is, with probability `fraction` and independently of every other patch, replaced by a state drawn
from the Manifold fitted to its own visible states: mean + B z with z_k ~ N(0, s_k^2) clipped at
+-cap s_k (s_k: the visible spread along direction k). Every patch draws its own coefficients in
its own directions, so a frame is never moved as a whole (no coherent global shift); frames
without orbital states, and validation frames, are left as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from sps_driving.core.orbital import fit_manifold, resample


class OrbitalAugmenter:
    """augmenter(grids [B, N, D], frame indices [B], generator) -> grids with some patches resampled."""

    def __init__(self, cache, train_frames: np.ndarray, fraction: float, rank: int, cap: float):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"the fraction of patches resampled must be in (0, 1], got {fraction}")
        if not len(cache.orbital_frames):
            raise ValueError(
                f"feature cache {cache.name} holds no orbital states, which Manifold augmentation resamples from: "
                f"extract it with `sps-driving extract --orbital-every K ...`, or train without --orbital-fraction")
        self.frames = np.intersect1d(np.asarray(train_frames, dtype=np.int64), cache.orbital_frames)
        if not len(self.frames):
            raise ValueError(f"none of the {len(train_frames)} training frames of {cache.name} has orbital states "
                             f"(only validation frames do): extract the training drives with --orbital-every")
        views = len(cache.orbital_meta["offsets_px"])
        if not 1 <= rank <= min(views, cache.descriptor_dim):
            raise ValueError(f"the Manifold rank must be in [1, {min(views, cache.descriptor_dim)}] for {views} visible views, got {rank}")
        if not cap > 0:
            raise ValueError(f"the Manifold cap must be positive (a multiple of the visible spread), got {cap}")
        self.cache, self.fraction, self.rank, self.cap = cache, float(fraction), int(rank), float(cap)

    def describe(self) -> dict:
        return {"fraction": self.fraction, "rank": self.rank, "cap": self.cap, "training_frames_with_states": int(len(self.frames)),
                "offsets_px": self.cache.orbital_meta["offsets_px"], "family": self.cache.orbital_meta["family"]}

    def __call__(self, grids: torch.Tensor, frames: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        rows = np.flatnonzero(np.isin(frames.cpu().numpy(), self.frames))
        if not len(rows):
            return grids
        patches = grids.shape[1]
        chosen = torch.rand((len(rows), patches), generator=generator, device=generator.device) < self.fraction
        draws = torch.randn((len(rows), patches, self.rank), generator=generator, device=generator.device, dtype=torch.float64)
        chosen, draws = chosen.cpu().numpy(), draws.cpu().numpy()
        row, patch = np.nonzero(chosen)
        if not len(row):
            return grids
        visible = self.cache.orbital_states(frames.cpu().numpy()[rows])  # [b, V, N, D]
        manifold = fit_manifold(visible[row, :, patch], self.rank, self.cap)
        states = resample(manifold, draws[row, patch])
        grids = grids.clone()
        grids[torch.from_numpy(rows[row]).to(grids.device), torch.from_numpy(patch).to(grids.device)] = (
            torch.from_numpy(states).to(device=grids.device, dtype=grids.dtype))
        return grids
