"""Training a patch policy (sps_driving.core.policies.patch_policy) on windows of frames from the feature cache.

Each frame of the cache gets the window the car would give it (`window_table`): its drive's frames
with the policy's state inputs run through `sps_driving.core.history.FrameHistory` in stamp order,
so a window never crosses drives or stamp gaps and never skips a stride slot. A training item is
the window of one frame: the frame and up to T - 1 earlier ones, each with a fresh selection (its
own, or its block's when the policy shares the selection across the window), and the loss is the
mean over every readout of the window of the trainer's standardized L2 loss against that frame's
targets, each frame weighted as the trainer weighs it. Validation reads the newest frame's readout
of each validation frame's window, every frame with its replayable selection (seed and stamp):
the command the car would give.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from sps_driving.core.history import frame_windows
from sps_driving.core.policies.patch_policy import PatchPolicy
from sps_driving.core.selection import PatchSelector
from sps_driving.train.cache import FeatureCache


def window_table(cache: FeatureCache, policy: PatchPolicy, state_names) -> np.ndarray:
    """int64 [frames, T]: every cache frame's window (frame indices, oldest first, -1 after the
    frame itself; rows of frames without the state inputs `state_names` all -1)."""
    usable = np.isfinite(cache.state_values(state_names)).all(axis=1) if state_names else None
    return frame_windows(cache.stamps, cache.source_ids, policy.history, usable)


class WindowDataset(Dataset):
    """Torch view of the windows of some cache frames. A list of items (what a BatchSampler yields,
    with DataLoader(batch_size=None)): dense grids float32 [B, T, N, D] (zeros for absent frames),
    targets float32 [B, T, 2], stamps int64 [B, T] and frame indices int64 [B, T] (-1: absent)."""

    def __init__(self, cache: FeatureCache, windows: np.ndarray, frames: np.ndarray):
        self.cache = cache
        self.windows = np.asarray(windows, dtype=np.int64)
        self.frames = np.asarray(frames, dtype=np.int64)
        if np.any(self.windows[self.frames, 0] < 0):
            raise ValueError("a frame without a window (it lacks the state inputs) cannot be trained on")

    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, items):
        index = self.windows[self.frames[np.atleast_1d(np.asarray(items, dtype=np.int64))]]
        present = index >= 0
        grids = np.zeros((*index.shape, self.cache.grid.n, self.cache.descriptor_dim), dtype=np.float32)
        grids[present] = self.cache.descriptors(index[present])
        targets = np.where(present[..., None], self.cache.targets[np.maximum(index, 0)], 0.0).astype(np.float32)
        stamps = np.where(present, self.cache.stamps[np.maximum(index, 0)], 0)
        return torch.from_numpy(grids), torch.from_numpy(targets), torch.from_numpy(stamps), torch.from_numpy(index)


def window_masks(selector: PatchSelector, stamps: torch.Tensor, present: torch.Tensor, generator: torch.Generator,
                 device, block_ns: int | None) -> torch.Tensor:
    """bool [B, T, N] fresh keep masks for windows of frames stamped `stamps` [B, T] (ns): one
    draw per frame, or per block of `block_ns` when the selection is shared across the window;
    absent frames keep nothing."""
    batch, frames = present.shape
    draws = selector.sample_masks(batch * frames, generator, device).reshape(batch, frames, -1)
    if block_ns is None:
        slot = torch.arange(frames, device=device).expand(batch, -1)
    else:
        blocks = torch.div(stamps.to(device), block_ns, rounding_mode="floor")
        slot = (blocks - blocks[:, :1]).clamp(0, frames - 1)
    masks = torch.gather(draws, 1, slot.unsqueeze(-1).expand(-1, -1, draws.shape[-1]))
    return masks & present.to(device).unsqueeze(-1)


def window_states(states: torch.Tensor | None, index: torch.Tensor, device) -> torch.Tensor | None:
    """[B, T, S] state inputs of windows' frames (zeros for absent frames), from [frames, S]."""
    if states is None:
        return None
    present = (index >= 0).unsqueeze(-1)
    return torch.where(present, states[index.clamp(min=0)], torch.zeros(())).to(device)


class TrainingWindows:
    """The windows a patch policy trains on (module docstring), and its loss."""

    def __init__(self, cache: FeatureCache, policy: PatchPolicy, selector: PatchSelector, state_names):
        self.cache, self.selector = cache, selector
        self.windows = window_table(cache, policy, state_names)
        self.block_ns = policy.history.block_ns if policy.shared_selection else None
        self.states = torch.from_numpy(cache.state_values(state_names)) if state_names else None

    def dataset(self, frames: np.ndarray) -> WindowDataset:
        return WindowDataset(self.cache, self.windows, frames)

    def loss(self, model: nn.Module, grids: torch.Tensor, target: torch.Tensor, index: torch.Tensor,
             generator: torch.Generator, weights: torch.Tensor, frame_weights: torch.Tensor, device,
             descriptor_transform=None) -> torch.Tensor:
        """The mean over every readout of a batch of windows of its frame's weighted L2 loss."""
        present = index >= 0
        grids, target = grids.to(device), target.to(device)
        if descriptor_transform is not None:
            grids = descriptor_transform(grids.flatten(0, 1), generator).unflatten(0, grids.shape[:2])
        stamps = torch.from_numpy(self.cache.stamps)[index.clamp(min=0)]
        keep = window_masks(self.selector, stamps, present, generator, device, self.block_ns)
        prediction = model(grids, keep, window_states(self.states, index, device))
        per_readout = ((prediction - target) ** 2 * weights).mean(dim=2)
        readout_weights = torch.where(present, frame_weights[index.clamp(min=0)], torch.zeros(())).to(device)
        return (per_readout * readout_weights).sum() / present.sum().to(device)


@torch.no_grad()
def window_validation_errors(policy: PatchPolicy, cache: FeatureCache, frames: np.ndarray, selector: PatchSelector,
                             state_names, batch_size: int, device) -> np.ndarray:
    """float64 [2]: sums of the squared (steering, throttle) errors of the newest readout of each of
    `frames`' windows, every frame of a window with its replayable selection (trainer.validation_errors)."""
    policy.eval()
    windows = window_table(cache, policy, state_names)
    states = torch.from_numpy(cache.state_values(state_names)) if state_names else None
    total = np.zeros(2)
    for start in range(0, len(frames), batch_size):
        batch = np.asarray(frames[start:start + batch_size], dtype=np.int64)
        index = windows[batch]
        present = index >= 0
        grids = np.zeros((*index.shape, cache.grid.n, cache.descriptor_dim), dtype=np.float32)
        grids[present] = cache.descriptors(index[present])
        keep = np.zeros((*index.shape, cache.grid.n), dtype=bool)
        keep[present] = selector.stamp_masks(cache.stamps[index[present]])
        index = torch.from_numpy(index)
        prediction = policy.forward_selected(torch.from_numpy(grids).to(device), torch.from_numpy(keep).to(device),
                                             window_states(states, index, device))
        newest = prediction[torch.arange(len(batch)), torch.from_numpy(present.sum(axis=1) - 1)]
        target = torch.from_numpy(cache.targets[batch]).to(device)
        total += ((newest - target) ** 2).double().sum(dim=0).cpu().numpy()
    return total
