"""A policy's checkpoint, and a loaded policy.

A checkpoint is a directory with `policy.safetensors` (the module's state dict) and `config.json`
(the policy config, sps_driving.core.policies.registry). `DrivingPolicy` is a loaded one:
descriptors of the kept patches (and the state inputs it reads) in, (steering rad, throttle) out,
as sps_driving.core.topics defines them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import policy_selector
from sps_driving.core.policies.blocks import SequencePolicy
from sps_driving.core.policies.registry import architecture_of, build_policy, state_inputs_of
from sps_driving.core.policies.transformer import TableSequencePolicy
from sps_driving.core.resources import read_format_json
from sps_driving.core.selection import SelectionConfig
from sps_driving.core.state import state_vector
from sps_driving.core.view import WindowSelector

POLICY_FORMAT = "sps_driving.policy/1"
# Occlusion attribution runs its occluded copies of a frame in batches of at most this many grid
# elements (float32: 16 MiB per batch), whatever the grid and the number of kept patches.
ATTRIBUTION_BATCH_ELEMENTS = 1 << 22
WEIGHTS_FILE = "policy.safetensors"
CONFIG_FILE = "config.json"


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_policy(model: nn.Module, config: dict, directory) -> Path:
    """Write `policy.safetensors` + `config.json` into `directory` (created); returns it.

    Each file is replaced atomically, so a reader never sees a half-written checkpoint file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    config = {"format": POLICY_FORMAT, **config}
    if isinstance(model, TableSequencePolicy):
        config["position_dim"] = int(model.position_table.shape[1])
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    text = json.dumps(config, indent=2, allow_nan=False, sort_keys=False)
    _write_atomically(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": POLICY_FORMAT}))
    _write_atomically(directory / CONFIG_FILE, lambda p: p.write_text(text + "\n"))
    return directory


def read_policy_config(directory) -> dict:
    return read_format_json(Path(directory) / CONFIG_FILE, POLICY_FORMAT, "policy config",
                            f"train one with `sps-driving train --out {Path(directory)}` "
                            f"or put its {WEIGHTS_FILE} and {CONFIG_FILE} in that folder")


def timing_copy(checkpoint: Path, folder: Path, rate: float | None = None, tokens: str | None = None) -> Path:
    """A copy of a policy checkpoint at `folder` (made once) with another selection rate and tokens:
    for timing what another rate or token dropping costs (its weights read descriptors they were
    not trained on: its commands mean nothing). The checkpoint's OOD calibration stays behind: it
    was made on the checkpoint's own descriptors, and a runtime refuses it for a copy that drops tokens."""
    from sps_driving.core import ood

    if not folder.exists():
        policy = read_policy_config(checkpoint)
        shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns(ood.META_FILE, ood.TENSORS_FILE))
        copy = {**policy, "selection": {**policy["selection"], "rate": policy["selection"]["rate"] if rate is None else rate},
                "extractor": {**(policy.get("extractor") or {}), **({} if tokens is None else {"tokens": tokens})}}
        (folder / CONFIG_FILE).write_text(json.dumps(copy, indent=1) + "\n")
    return folder


def load_policy(directory, device: str = "cpu", grid: PatchGrid | None = None) -> DrivingPolicy:
    """Load a checkpoint written by `save_policy` (safetensors only) for inference, reading the
    patches of `grid` (default: the grid it was trained on; see DrivingPolicy)."""
    directory = Path(directory)
    config = read_policy_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no policy weights at {weights}: the checkpoint in {directory} is incomplete")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"policy weights {weights} cannot be read: {err}") from err
    try:
        module = build_policy(config)
        module.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"policy weights {weights} do not match {directory / CONFIG_FILE}: {err}") from err
    if not all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point()):
        raise ValueError(f"policy weights {weights} contain NaN or Inf")
    return DrivingPolicy(module, config, directory, device, grid)


class DrivingPolicy:
    """A loaded policy: descriptors of the kept patches (and the state inputs it reads) in,
    (steering rad, throttle) out.

    `grid` (default: the grid it was trained on) is the grid whose patch indices it reads. A wider
    one (sps_driving.core.view: a wider view) is for the policies that read a window about the
    roi's centre, relative_query and an mlp with a canvas: their selector chooses, as on the
    training grid, among the patches of that window centred on `grid`. Any other policy reads
    patches by their absolute cell of the training grid and refuses another grid (ValueError).
    """

    def __init__(self, module: nn.Module, config: dict, path: Path | None = None, device: str = "cpu",
                 grid: PatchGrid | None = None):
        self.module = module.to(device).eval()
        self.config = config
        self.path = path
        self.device = torch.device(device)
        trained = PatchGrid(int(config["grid"]["rows"]), int(config["grid"]["cols"]))
        self.grid = trained if grid is None else grid
        self.selection = SelectionConfig.from_dict(config["selection"])
        self.descriptor_dim = int(config["descriptor_dim"])
        self.selector = policy_selector(config, trained)
        self.state_inputs = state_inputs_of(config)
        if self.grid != trained:
            if not getattr(self.module, "reads_a_window", False):
                raise ValueError(
                    f"this {architecture_of(config)} policy reads the patches of the {trained.rows}x{trained.cols} grid it was "
                    f"trained on by their absolute cell, not a {self.grid.rows}x{self.grid.cols} grid: give it that grid "
                    f"(the nominal view, or its central window) or retrain it; a relative_query policy or an mlp with a "
                    f"canvas reads its window of a wider grid")
            self.selector = WindowSelector(self.selector, self.grid)
            self.module.set_view(self.grid)

    @property
    def sparse_sequence(self) -> bool:
        return self.selection.sparse_sequence

    def checked_frame(self, descriptors, indices) -> tuple[np.ndarray, np.ndarray]:
        """One frame's descriptors [k, D] (float32) and patch indices [k] (int64) as the policy reads
        them; ValueError for a frame it cannot take."""
        descriptors = np.asarray(descriptors)
        indices = np.asarray(indices)
        if descriptors.ndim != 2 or descriptors.shape[1] != self.descriptor_dim:
            raise ValueError(f"descriptors must be [k, {self.descriptor_dim}], got {descriptors.shape}")
        if indices.ndim != 1 or len(indices) != len(descriptors) or len(indices) == 0:
            raise ValueError(f"need one patch index per descriptor (k >= 1), got {indices.shape} for {descriptors.shape}")
        if not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"patch indices must be integers, got {indices.dtype}")
        if indices.min() < 0 or indices.max() >= self.grid.n or len(np.unique(indices)) != len(indices):
            raise ValueError(f"patch indices must be unique and in [0, {self.grid.n})")
        if not np.issubdtype(descriptors.dtype, np.floating) or not np.all(np.isfinite(descriptors)):
            raise ValueError("descriptors must be finite floating-point numbers (NaN or Inf found)")
        return descriptors.astype(np.float32, copy=False), indices.astype(np.int64, copy=False)

    @torch.no_grad()
    def predict_batch(self, descriptors: Sequence[np.ndarray], indices: Sequence[np.ndarray],
                      states: Sequence[Mapping[str, float] | None] | None = None) -> np.ndarray:
        """[B, 2] (steering rad, throttle) for B frames, each [k_b, D] descriptors at `indices[b]`
        with its state `states[b]` ({name: value} of sps_driving.core.state; a policy without state
        inputs ignores it). ValueError for bad input, a missing or non-finite state among them."""
        if len(descriptors) != len(indices) or len(descriptors) == 0:
            raise ValueError(f"need one index array per frame, got {len(descriptors)} and {len(indices)}")
        frames = [self.checked_frame(d, i) for d, i in zip(descriptors, indices)]
        state = None
        if self.state_inputs:
            if states is None or len(states) != len(frames):
                raise ValueError(f"this policy reads the state inputs {list(self.state_inputs)}: give one state per frame")
            state = torch.from_numpy(np.stack([state_vector(self.state_inputs, s) for s in states])).to(self.device)
        if isinstance(self.module, SequencePolicy):
            length = max(len(i) for _, i in frames)
            batch = np.zeros((len(frames), length, self.descriptor_dim), dtype=np.float32)
            index_batch = np.zeros((len(frames), length), dtype=np.int64)
            padding = np.ones((len(frames), length), dtype=bool)
            for row, (d, i) in enumerate(frames):
                batch[row, : len(i)], index_batch[row, : len(i)], padding[row, : len(i)] = d, i, False
            out = self.module(*(torch.from_numpy(a).to(self.device) for a in (batch, index_batch, padding)), state)
        else:
            grids = np.zeros((len(frames), self.grid.n, self.descriptor_dim), dtype=np.float32)
            for row, (d, i) in enumerate(frames):
                grids[row, i] = d
            out = self.module(torch.from_numpy(grids).to(self.device), state)
        out = out.cpu().numpy().astype(np.float64)
        if not np.all(np.isfinite(out)):
            raise ValueError("policy produced a non-finite command")
        return out

    def predict(self, descriptors: np.ndarray, indices: np.ndarray,
                state: Mapping[str, float] | None = None) -> tuple[float, float]:
        """(steering rad, throttle) for one frame's kept descriptors [k, D] at patch `indices` [k]
        and its `state` ({name: value}, what sps_driving.core.state names; ignored by a policy that
        reads none). A policy with state inputs given no or a non-finite state raises ValueError."""
        steering, throttle = self.predict_batch([descriptors], [indices], [state])[0]
        return float(steering), float(throttle)

    @torch.no_grad()
    def attribution(self, descriptors: np.ndarray, indices: np.ndarray, state: Mapping[str, float] | None = None,
                    batch_elements: int = ATTRIBUTION_BATCH_ELEMENTS) -> np.ndarray:
        """Occlusion attribution of one frame: float32 [k], for each kept patch `indices[i]` the
        change of the steering command (rad) when that patch alone is dropped and the policy sees
        the rest: steering(kept without it) - steering(kept). Dropped as the selection drops it
        (grid policies: zeros at its place; sequence policies: left out of the sequence). The k + 1
        forwards run in batches of at most `batch_elements` grid elements (memory bounded)."""
        descriptors, indices = self.checked_frame(descriptors, indices)
        n, dim = self.grid.n, self.descriptor_dim
        grid = np.zeros((1, n, dim), dtype=np.float32)
        grid[0, indices] = descriptors
        grid = torch.from_numpy(grid).to(self.device)
        # Row 0 keeps every selected patch; row i + 1 drops indices[i] as well.
        keep = np.zeros((len(indices) + 1, n), dtype=bool)
        keep[:, indices] = True
        keep[np.arange(1, len(indices) + 1), indices] = False
        keep = torch.from_numpy(keep).to(self.device)
        state_row = None
        if self.state_inputs:
            state_row = torch.from_numpy(state_vector(self.state_inputs, state)[None]).to(self.device)
        rows = max(1, int(batch_elements) // (n * dim))
        steering = []
        for start in range(0, len(keep), rows):
            masks = keep[start:start + rows]
            batch_state = None if state_row is None else state_row.expand(len(masks), -1)
            steering.append(self.module.forward_selected(grid.expand(len(masks), -1, -1), masks, batch_state)[:, 0])
        steering = torch.cat(steering).cpu().numpy().astype(np.float64)
        if not np.all(np.isfinite(steering)):
            raise ValueError("policy produced a non-finite command")
        return (steering[1:] - steering[0]).astype(np.float32)
