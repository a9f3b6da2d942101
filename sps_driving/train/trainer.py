"""`sps-driving train --cache CACHE --out models/NAME`: train a driving policy with SPS.

One readable loop. Every epoch, every training frame gets a fresh patch selection (SPS section
3.3) applied to its cached dense descriptor grid: zeros at the dropped patches for grid policies,
only the kept tokens with their original positions for sequence policies. The policy also reads
the frame's state inputs (`state_inputs`: the car's speed, the cruise target speed; see
sps_driving.core.state), standardized with training statistics kept in the checkpoint; frames the
cache has no such state for are left out, and a cache without it at all is refused. The loss is
L2 (MSE) on (steering rad, throttle), each over its training-target variance; Adam at lr 1e-3 and
ReduceLROnPlateau with patience 10, as the paper. The validation criterion (early stopping, the
plateau scheduler, the best checkpoint) weighs the same standardized errors by
`criterion_weights` (by default the loss weights, without the throttle when the policy does not
read both speeds: see `criterion_weights`); each epoch also records both validation errors as
fractions of the validation targets' variance. A patch policy trains on windows of frames instead,
with a loss on every readout (sps_driving.train.windows).

Validation is deterministic: each validation frame's selection is the replayable one decided by
the selection seed and the frame's stamp (what the car would select), so a saved checkpoint
reproduces its recorded validation loss.

A token-dropping cache (meta token_dropping: DINOv2 with tokens kept, `extract --keep-rate R`)
holds each patch's descriptor as computed with its group of k kept patches: a policy trains on it
at selection rate R (sps or spps), each frame's selection in each epoch one of its groups drawn
at random, and validation reads group 0, which is the extraction's selection seed's choice at the
frame's stamp (`CacheSelection`). The split holds out whole sources (episodes / bags) when
the cache has several, else the last frames in time.

Outputs (only process 0 writes):
  OUT/policy.safetensors, OUT/config.json       the best checkpoint (lowest validation loss)
  OUT/last/...                                  the latest epoch, plus train_state.json and
                                                train_state.safetensors (optimizer, scheduler,
                                                epoch, early-stop counters) for --resume

Multi-process: `torchrun --nproc_per_node=2 -m sps_driving.cli train ...` runs DistributedData
Parallel (gloo on CPU, nccl on GPU); each process takes `batch_size` frames per step from a
DistributedSampler. Random draws (sampler order, selections, augmentation) are seeded from
(seed, epoch, rank), so a resumed run continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm import tqdm

from sps_driving.core.history import PATCH_POLICY, HistorySettings, policy_selector
from sps_driving.core.policies.checkpoint import load_policy, read_policy_config, save_policy
from sps_driving.core.policies.patch_policy import PatchPolicy
from sps_driving.core.policies.registry import (
    ARCHITECTURES,
    POSITION_TABLE_ARCHITECTURE,
    SETTING_DEFAULTS,
    TRAINABLE_ARCHITECTURES,
    PolicyArchitecture,
    architecture_of,
    build_policy,
    check_architecture,
    state_inputs_of,
)
from sps_driving.core.policies.relative_query import READOUTS
from sps_driving.core.resources import config_path, recorded_path, repository_path
from sps_driving.core.selection import PatchSelector, SelectionConfig
from sps_driving.core.state import STATE_INPUTS, STATE_NAMES, check_state_names
from sps_driving.core.view import view_record
from sps_driving.train.cache import FeatureCache
from sps_driving.train.distributed import Processes, start_processes
from sps_driving.train.orbital_augment import OrbitalAugmenter
from sps_driving.train.windows import TrainingWindows, window_validation_errors

TRAIN_CONFIG = config_path("train.yaml")
LAST_DIR = "last"
# The last epoch's four files are written into a staging folder and swapped in by two renames, so a
# kill at any moment leaves one whole epoch: `last`, or (between the renames) the one before it.
STAGING_DIR, PREVIOUS_DIR = "last.partial", "last.previous"
STATE_JSON = "train_state.json"
STATE_TENSORS = "train_state.safetensors"
# Settings a resumed run may change; every other one must match the run it continues.
RESUMABLE_CHANGES = {"epochs", "early_stop_patience", "num_workers", "device", "resume", "out"}

DescriptorTransform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
# Times a named phase of a training step (`with clock("forward"): ...`); bench --train passes one.
PhaseClock = Callable[[str], contextlib.AbstractContextManager]


def UNTIMED(phase: str) -> contextlib.AbstractContextManager:  # noqa: N802 - a constant clock
    return contextlib.nullcontext()


@dataclass
class TrainConfig:
    """Training settings. Their defaults, with units, are config/train.yaml's `train:` section:
    make one with `from_yaml`, which puts the command line's choices on top."""

    cache: str | list  # one feature cache directory, or several trained on as one
    out: str
    variant: str
    rate: float
    seed: int
    keep_probability: list | None
    state_inputs: list
    architecture: str
    width: int
    reduce: int
    depth: int
    heads: int
    mlp_ratio: float
    dropout: float
    max_steering_rad: float
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    plateau_patience: int
    plateau_factor: float
    min_lr: float
    early_stop_patience: int
    loss_weights: list
    criterion_weights: list | None  # None: `criterion_weights` decides
    validation_fraction: float
    num_workers: int
    device: str
    # Loss weight of intervention frames; the default is for settings recorded before it (a DAgger run's).
    intervention_weight: float = 1.0
    # The patch policy's window (sps_driving.core.history); the defaults are for settings recorded before it.
    window_frames: int = 4
    frame_stride_s: float = 0.1
    stride_tolerance_s: float = 0.015
    max_gap_s: float = 0.5
    shared_selection: bool = False
    # Policy settings added later (their defaults: what runs recorded before them meant).
    canvas: list | None = None  # mlp: [rows, cols] patches of the canvas its weights are laid out on; None: the grid
    state_to_head: bool = False  # mlp: the standardized state inputs also reach the output head directly
    query_stride: int = 1  # relative_query: queries at every query_stride-th row and column of the grid
    readout: str = "flatten"  # relative_query: flatten | pool
    # Manifold augmentation (sps_driving.train.orbital_augment): the fraction of the patches of training
    # frames with orbital states resampled from their Manifold of this rank and cap; 0 = off.
    orbital_fraction: float = 0.0
    orbital_rank: int = 4
    orbital_cap: float = 2.0
    resume: bool = False  # a run mode, not a setting: --resume

    def __post_init__(self) -> None:
        check_architecture(self.architecture, self.selection())  # and the variant, rate, seed, keep_probability
        for name in ("width", "reduce", "depth", "heads", "epochs", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if "heads" in ARCHITECTURES[self.architecture] and self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        if not (self.lr >= 0 and self.weight_decay >= 0 and self.min_lr >= 0 and 0 < self.plateau_factor < 1):
            raise ValueError("need lr, weight_decay, min_lr >= 0 and 0 < plateau_factor < 1")
        if not (0 <= self.dropout < 1 and self.max_steering_rad > 0):
            raise ValueError("need 0 <= dropout < 1 and max_steering_rad > 0")
        if not (0.0 <= self.orbital_fraction <= 1.0 and self.orbital_rank >= 1 and self.orbital_cap > 0):
            raise ValueError(f"need 0 <= orbital_fraction <= 1, orbital_rank >= 1 and orbital_cap > 0, got "
                             f"{self.orbital_fraction}, {self.orbital_rank}, {self.orbital_cap}")
        if not (math.isfinite(self.intervention_weight) and self.intervention_weight >= 0):
            raise ValueError(f"intervention_weight must be a finite number >= 0, got {self.intervention_weight}")
        for name in ("loss_weights", "criterion_weights"):
            if getattr(self, name) is None and name == "criterion_weights":
                continue
            weights = np.asarray(getattr(self, name), dtype=np.float64)
            if weights.shape != (2,) or not np.all(np.isfinite(weights)) or np.any(weights < 0) or not weights.any():
                raise ValueError(f"{name} must be two finite non-negative numbers, not both 0, got {getattr(self, name)}")
        check_state_names(self.state_inputs)
        if self.architecture == PATCH_POLICY:  # refuses a window it cannot form
            HistorySettings(self.window_frames, self.frame_stride_s, self.stride_tolerance_s, self.max_gap_s)

    @classmethod
    def from_yaml(cls, path=TRAIN_CONFIG, **overrides) -> TrainConfig:
        """The `train:` section of config/train.yaml, with `overrides` (None values ignored) on top."""
        section = (yaml.safe_load(Path(path).read_text()) or {}).get("train", {})
        section.update({k: v for k, v in overrides.items() if v is not None})
        fields = dataclasses.fields(cls)
        unknown = set(section) - {f.name for f in fields}
        if unknown:
            raise ValueError(f"unknown training settings {sorted(unknown)} (from {path} or the command line)")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in section]
        if missing:
            raise ValueError(f"training settings {missing} are missing: {path} has no value for them")
        return cls(**section)

    def selection(self) -> SelectionConfig:
        return SelectionConfig(self.variant, self.rate, self.seed, self.keep_probability)

    def policy_settings(self) -> dict:
        """The settings of this architecture's policy (the checkpoint's "policy"), without the ones
        added later while they are at the value checkpoints without them mean."""
        defaults = SETTING_DEFAULTS.get(self.architecture, {})
        return {key: getattr(self, key) for key in ARCHITECTURES[self.architecture]
                if key not in defaults or getattr(self, key) != defaults[key]}

    def policy_architecture(self) -> PolicyArchitecture:
        return PolicyArchitecture(self.architecture, self.policy_settings(), self.max_steering_rad)


# ---- data split and loss ----------------------------------------------------------------------


def split_frames(cache: FeatureCache, validation_fraction: float) -> tuple[np.ndarray, np.ndarray, dict]:
    """Deterministic (train, validation) frame indices and a record of the rule used.

    Several sources: the last ceil(fraction * sources) source names in sorted order are held out
    (at least one, never all). One source: the last ceil(fraction * frames) frames by stamp.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    present = sorted({cache.sources[i] for i in np.unique(cache.source_ids)})
    if len(present) >= 2:
        held_out = present[len(present) - min(len(present) - 1, max(1, math.ceil(validation_fraction * len(present)))):]
        held_ids = [cache.sources.index(name) for name in held_out]
        is_val = np.isin(cache.source_ids, held_ids)
        rule = {"by": "source", "validation_fraction": validation_fraction, "validation_sources": held_out}
    else:
        if len(cache) < 2:
            raise ValueError(f"feature cache {cache.name} has {len(cache)} frame(s); training needs at least 2")
        count = min(len(cache) - 1, max(1, math.ceil(validation_fraction * len(cache))))
        by_time = np.argsort(cache.stamps, kind="stable")
        is_val = np.zeros(len(cache), dtype=bool)
        is_val[by_time[len(cache) - count:]] = True
        rule = {"by": "frames", "validation_fraction": validation_fraction, "validation_sources": []}
    train_idx, val_idx = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    rule.update(train_frames=int(len(train_idx)), validation_frames=int(len(val_idx)))
    return train_idx, val_idx, rule


def frames_with_state(cache: FeatureCache, names, frames: np.ndarray) -> np.ndarray:
    """The `frames` whose state inputs `names` the cache knows (finite)."""
    return frames[np.isfinite(cache.state_values(names)[frames]).all(axis=1)] if names else frames


def check_cache_state(cache: FeatureCache, names) -> int:
    """Frames lacking one of the state inputs `names`; ValueError when the cache lacks one entirely."""
    known = np.isfinite(cache.state_values(names))
    absent = [name for column, name in enumerate(names) if not known[:, column].any()]
    if absent:
        wanted = "; ".join(f"{n} ({STATE_INPUTS[n].unit}, from {' or '.join(t for t, _ in STATE_INPUTS[n].sources)})"
                           for n in absent)
        raise ValueError(
            f"feature cache {cache.name} has no {wanted}: extracted before state inputs were stored, or from "
            f"recordings without those topics. Re-extract it (`sps-driving extract`), or train without them "
            f"(`--state-inputs` with no names, or state_inputs: [] in the training config)")
    return int((~known.all(axis=1)).sum()) if names else 0


# Smallest target spread used to standardize an output: below it the output is treated as constant.
MIN_TARGET_STD = 1e-3


def target_std(targets: np.ndarray) -> list:
    """Per-output standard deviation of the training targets (steering rad, throttle), floored."""
    return [max(float(v), MIN_TARGET_STD) for v in np.asarray(targets, dtype=np.float64).std(axis=0)]


def loss_scale(loss_weights, target_std) -> list:
    """Weights of the squared errors: each output's weight over its target variance.

    Expert steering spreads ~0.02 rad and throttle ~0.1, so raw squared errors would let the
    throttle drown the steering; standardized, both count as the user's weights say.
    """
    return [float(w) / float(s) ** 2 for w, s in zip(loss_weights, target_std)]


def l2_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-frame weighted mean squared error over (steering, throttle): [B]."""
    return ((prediction - target) ** 2 * weights).mean(dim=1)


def criterion_weights(cfg: TrainConfig, state_names) -> list:
    """The weights of the standardized (steering, throttle) validation errors in the criterion:
    cfg.criterion_weights when set, else the loss weights, with the throttle's at 0 when the
    policy lacks the speed or the cruise target. The expert's throttle tracks (target - speed),
    which no frame shows: on expert drives a policy without them left 0.9-1.1 of the validation
    throttle variance unexplained at 15 epochs on 32 drives (0.8-1.5 on 8), noise that would
    otherwise decide early stopping; with them 0.40, and falling (docs/training.md)."""
    if cfg.criterion_weights is not None:
        return [float(w) for w in cfg.criterion_weights]
    weights = [float(w) for w in cfg.loss_weights]
    if not set(STATE_NAMES) <= set(state_names):
        weights[1] = 0.0
    if not any(weights):
        raise ValueError("the validation criterion would weigh nothing: a policy without state inputs is judged by its "
                         "steering, and loss_weights gives steering 0; set criterion_weights")
    return weights


def criterion(squared_errors, count: int, scale) -> float:
    """The validation criterion: the mean over frames and outputs of the squared errors (summed
    per output over `count` frames) weighted by `scale` (loss_scale of the criterion weights)."""
    return float(np.dot(np.asarray(scale, dtype=np.float64), np.asarray(squared_errors, dtype=np.float64))) / (2 * count)


class CacheSelection:
    """The kept patches [B, N] of cache frames: from a dense cache the selector's (fresh draws for
    training, the replayable per-stamp selection for validation); from a token-dropping cache the
    groups its passes computed (a group of each frame drawn for training, group 0 for validation)."""

    def __init__(self, cache: FeatureCache, selector: PatchSelector):
        self.cache, self.selector = cache, selector
        dropping = cache.token_dropping
        if dropping and not (selector.exact_count and selector.count == int(dropping["kept"])):
            raise ValueError(
                f"cache {cache.name} holds token-dropped descriptors, each computed with {dropping['kept']} of "
                f"{cache.grid.n} patches kept (rate {dropping['rate']:g}): train a policy of selection rate "
                f"{dropping['rate']:g} (variant sps or spps) on it, not {selector.config.variant} at rate {selector.config.rate:g}"
            )

    def training(self, index: torch.Tensor, generator: torch.Generator, device) -> torch.Tensor:
        if self.cache.token_groups is None:
            return self.selector.sample_masks(len(index), generator, device)
        groups = torch.from_numpy(self.cache.token_groups[np.asarray(index)].astype(np.int64)).to(device)
        count = int(self.cache.token_dropping["groups"])
        chosen = torch.randint(count, (len(index), 1), generator=generator, device=generator.device).to(device)
        return groups == chosen

    def validation(self, frames: np.ndarray, device) -> torch.Tensor:
        if self.cache.token_groups is None:
            return torch.from_numpy(self.selector.stamp_masks(self.cache.stamps[frames])).to(device)
        return torch.from_numpy(self.cache.token_groups[frames] == 0).to(device)


class SelectedPolicy(nn.Module):
    """Selection applied to dense grids inside forward(), so DistributedDataParallel can wrap it."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return self.policy.forward_selected(grids, keep, state)


@torch.no_grad()
def validation_errors(policy: nn.Module, cache: FeatureCache, frames: np.ndarray, selector: PatchSelector,
                      state_names, batch_size: int, device) -> np.ndarray:
    """float64 [2]: sums of the squared (steering, throttle) errors over `frames`, each with its
    replayable selection and its state inputs `state_names`."""
    if isinstance(policy, PatchPolicy):  # windows of frames, each validation frame read at its newest readout
        return window_validation_errors(policy, cache, frames, selector, state_names, batch_size, device)
    policy.eval()
    total = np.zeros(2)
    states = cache.state_values(state_names) if state_names else None
    selection = CacheSelection(cache, selector)
    with encoder_layers_unfused():
        for start in range(0, len(frames), batch_size):
            batch = frames[start:start + batch_size]
            grids = cache.descriptor_batch(batch).to(device)
            keep = selection.validation(batch, device)
            target = torch.from_numpy(cache.targets[batch]).to(device)
            state = None if states is None else torch.from_numpy(states[batch]).to(device)
            total += ((policy.forward_selected(grids, keep, state) - target) ** 2).double().sum(dim=0).cpu().numpy()
    return total


@contextlib.contextmanager
def encoder_layers_unfused():
    """Inside, torch's transformer layers run their training-mode arithmetic, not their fused
    inference path: on the CPU that path took twice as long for a validation batch of the
    positional transformer (64 frames of 288 tokens, width 64), outputs equal within 3e-8."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def evaluate_checkpoint(policy_dir, cache_dir=None, batch_size: int = 64) -> float:
    """Recompute a checkpoint's validation criterion on its recorded split (the cache it was trained on by default)."""
    policy = load_policy(policy_dir)
    training = policy.config["training"]
    recorded = training["cache"] if isinstance(training["cache"], list) else [training["cache"]]
    cache = FeatureCache(cache_dir or [recorded_path(path) for path in recorded])
    _, val_idx, rule = split_frames(cache, training["split"]["validation_fraction"])
    if rule["validation_sources"] != training["split"]["validation_sources"]:
        raise ValueError(f"cache {cache.name} splits differently from the one {policy_dir} was trained on")
    val_idx = frames_with_state(cache, policy.state_inputs, val_idx)
    # Checkpoints from before criterion_weights judged by the loss weights.
    scale = loss_scale(training.get("criterion_weights", training["loss_weights"]), training["target_std"])
    errors = validation_errors(policy.module, cache, val_idx, policy.selector, policy.state_inputs, batch_size, policy.device)
    return criterion(errors, len(val_idx), scale)


def draw_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


# ---- checkpoints ------------------------------------------------------------------------------


def last_epoch_dir(out: Path) -> Path:
    """OUT/last, put back from OUT/last.previous where a kill fell between the two renames of a save."""
    last, previous = Path(out) / LAST_DIR, Path(out) / PREVIOUS_DIR
    if not last.exists() and previous.is_dir():
        try:
            previous.rename(last)
        except FileNotFoundError:  # another process of the same run put it back first
            pass
    return last


def has_last_epoch(out: Path) -> bool:
    """Whether OUT holds a finished epoch to continue with --resume."""
    return (last_epoch_dir(out) / STATE_JSON).is_file()


def _replace_folder(staging: Path, target: Path) -> None:
    previous = target.with_name(PREVIOUS_DIR)
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


def save_training_state(directory: Path, optimizer, scheduler, state: dict) -> None:
    """Optimizer tensors as safetensors, everything else as JSON: no pickles."""
    optimizer_state = optimizer.state_dict()
    tensors = {
        f"optimizer.{param}.{key}": value.detach().cpu().contiguous()
        for param, entries in optimizer_state["state"].items()
        for key, value in entries.items()
    }
    save_file(tensors, str(directory / STATE_TENSORS))
    record = {**state, "optimizer_param_groups": optimizer_state["param_groups"], "scheduler": scheduler.state_dict()}
    (directory / STATE_JSON).write_text(json.dumps(record, indent=2) + "\n")


def load_training_state(directory: Path, optimizer, scheduler) -> dict:
    for name in (STATE_JSON, STATE_TENSORS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"cannot resume: {directory / name} is missing (was this run started?)")
    record = json.loads((directory / STATE_JSON).read_text())
    entries: dict[int, dict] = {}
    for name, value in load_file(str(directory / STATE_TENSORS)).items():
        _, param, key = name.split(".", 2)
        entries.setdefault(int(param), {})[key] = value
    optimizer.load_state_dict({"state": entries, "param_groups": record.pop("optimizer_param_groups")})
    scheduler.load_state_dict(record.pop("scheduler"))
    return record


# Frames sampled (evenly over the training set) for the per-channel descriptor statistics.
STATISTICS_FRAMES = 2048


def descriptor_statistics(cache: FeatureCache, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation [D] of the descriptors of (a sample of) `frames`."""
    sample = np.sort(frames)[np.linspace(0, len(frames) - 1, min(len(frames), STATISTICS_FRAMES)).astype(int)]
    total = np.zeros(cache.descriptor_dim)
    squares = np.zeros(cache.descriptor_dim)
    for start in range(0, len(sample), 256):
        grids = cache.descriptors(sample[start:start + 256]).astype(np.float64)
        total += grids.sum(axis=(0, 1))
        squares += (grids ** 2).sum(axis=(0, 1))
    count = len(sample) * cache.grid.n
    mean = total / count
    return mean, np.sqrt(np.maximum(squares / count - mean ** 2, 0.0))


def _recorded_caches(cache: str | list) -> str | list:
    """The caches as the checkpoint records them: relative to the repository when inside it, so a
    committed checkpoint names no folder of the machine that trained it."""
    paths = [cache] if isinstance(cache, (str, os.PathLike)) else list(cache)
    recorded = [repository_path(path) or str(Path(path).resolve()) for path in paths]
    return recorded if len(recorded) > 1 else recorded[0]


def state_statistics(cache: FeatureCache, names, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-input mean and standard deviation [S] of the state inputs `names` over `frames`."""
    values = cache.state_values(names)[np.sort(frames)].astype(np.float64)
    return values.mean(axis=0), values.std(axis=0)


def policy_config(cfg: TrainConfig, cache: FeatureCache, split: dict, train_idx: np.ndarray, state_names,
                  judged_by: list) -> dict:
    config = cfg.policy_architecture().config(cache.grid, cache.descriptor_dim, cfg.selection(), backbone=cache.backbone,
                                              state_inputs=state_names)
    return {
        **config,
        "extractor": cache.meta.get("extractor"),
        "view": view_record(cache.grid, (cache.meta.get("extractor") or {}).get("roi")),
        "units": {"steering": "front road-wheel angle, rad, left positive", "throttle": "[-1, 1], negative = brake"},
        "training": {
            "cache": _recorded_caches(cfg.cache),
            "cache_frames": len(cache),
            **({"token_dropping": cache.token_dropping} if cache.token_dropping else {}),
            "sources": cache.sources,
            "split": split,
            "loss": "L2 (weighted mean squared error of steering, throttle, each over its training-target variance)",
            "loss_weights": list(cfg.loss_weights),
            "intervention_weight": cfg.intervention_weight,
            "intervention_frames": int(cache.intervention[train_idx].sum()),
            "criterion": "validation early stopping, plateau and best checkpoint: the standardized squared errors "
                         "weighted by criterion_weights",
            "criterion_weights": list(judged_by),
            "target_std": target_std(cache.targets[np.sort(train_idx)]),
            "optimizer": {"name": "Adam", "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            "scheduler": {"name": "ReduceLROnPlateau", "patience": cfg.plateau_patience, "factor": cfg.plateau_factor},
            "batch_size": cfg.batch_size,
        },
    }


def check_init_checkpoint(init_config: dict, cache: FeatureCache, selection: SelectionConfig, path) -> None:
    mismatches = []
    if init_config["grid"] != {"rows": cache.grid.rows, "cols": cache.grid.cols}:
        mismatches.append(f"grid {init_config['grid']} vs the cache's {cache.grid.rows}x{cache.grid.cols}")
    if int(init_config["descriptor_dim"]) != cache.descriptor_dim:
        mismatches.append(f"descriptor_dim {init_config['descriptor_dim']} vs the cache's {cache.descriptor_dim}")
    if init_config.get("backbone") != cache.backbone:
        mismatches.append(f"backbone {init_config.get('backbone')!r} vs the cache's {cache.backbone!r}")
    if SelectionConfig.from_dict(init_config["selection"]).sparse_sequence != selection.sparse_sequence:
        mismatches.append(f"policy kind ({init_config['selection']['variant']}) vs variant {selection.variant}")
    if mismatches:
        raise ValueError(f"cannot fine-tune {path} on {cache.name}: " + "; ".join(mismatches))


# ---- the loop ---------------------------------------------------------------------------------


def train(cfg: TrainConfig, descriptor_transform: DescriptorTransform | None = None,
          init_checkpoint=None) -> dict:
    """Train (or fine-tune from `init_checkpoint`, a policy directory) and return a summary.

    descriptor_transform(grids [B, N, D], generator) -> grids is applied to each training batch
    before the selection (e.g. latent augmentation); validation frames are never transformed.
    With cfg.resume, the run continues from OUT/last (init_checkpoint is then ignored).
    """
    procs = start_processes(cfg.device)
    try:
        return _train(cfg, procs, descriptor_transform, init_checkpoint)
    finally:
        procs.close()


def _training_frames(cfg: TrainConfig, cache: FeatureCache, procs: Processes, init_checkpoint):
    """(training frames, validation frames, the split's record, the state inputs read): the frames
    that have every state input the policy reads (a resumed run or a fine-tune reads what its
    checkpoint reads)."""
    train_idx, val_idx, split = split_frames(cache, cfg.validation_fraction)
    if cfg.resume:
        state_names = state_inputs_of(read_policy_config(last_epoch_dir(cfg.out)))
    elif init_checkpoint is not None:
        state_names = state_inputs_of(read_policy_config(init_checkpoint))
    else:
        state_names = check_state_names(cfg.state_inputs)
    split["frames_without_state"] = check_cache_state(cache, state_names)
    if split["frames_without_state"] and procs.main:
        tqdm.write(f"warning: {split['frames_without_state']} of {len(cache)} frame(s) lack one of the state inputs "
                   f"{list(state_names)}; they are left out of training and validation")
    train_idx, val_idx = frames_with_state(cache, state_names, train_idx), frames_with_state(cache, state_names, val_idx)
    if len(train_idx) == 0 or len(val_idx) == 0:
        raise ValueError(f"no training or no validation frames of {cache.name} have the state inputs {list(state_names)}")
    split.update(train_frames=int(len(train_idx)), validation_frames=int(len(val_idx)))
    return train_idx, val_idx, split, state_names


def _orbital_augmenter(cfg: TrainConfig, cache: FeatureCache, train_idx, config: dict) -> OrbitalAugmenter | None:
    """The orbital augmentation of training batches (validation reads the cache as it is), recorded in `config`."""
    if not cfg.orbital_fraction > 0:
        return None
    if cfg.architecture == "patch_policy":
        raise ValueError("--orbital-fraction augments single frames; the patch policy's windows do not take it")
    augmenter = OrbitalAugmenter(cache, train_idx, cfg.orbital_fraction, cfg.orbital_rank, cfg.orbital_cap)
    config["training"]["orbital_augmentation"] = augmenter.describe()
    return augmenter


def _starting_policy(cfg: TrainConfig, config: dict, cache: FeatureCache, selection, train_idx, state_names,
                     init_checkpoint) -> nn.Module:
    """The policy training starts from: the run's last checkpoint (resume), the one to fine-tune, or a
    fresh one with the training frames' statistics; `config` takes the architecture of the first two."""
    last_dir = Path(cfg.out) / LAST_DIR
    if cfg.resume:
        last_config = read_policy_config(last_dir)
        policy = load_policy(last_dir).module
        config["policy"], config["output"] = last_config["policy"], last_config["output"]
        config["architecture"] = architecture_of(last_config)
        if "init_checkpoint" in last_config["training"]:
            config["training"]["init_checkpoint"] = last_config["training"]["init_checkpoint"]
    elif init_checkpoint is not None:
        init_config = read_policy_config(init_checkpoint)
        check_init_checkpoint(init_config, cache, selection, init_checkpoint)
        policy = load_policy(init_checkpoint).module
        config["policy"], config["output"] = init_config["policy"], init_config["output"]
        config["architecture"] = architecture_of(init_config)
        config["training"]["init_checkpoint"] = str(Path(init_checkpoint).resolve())
    else:
        policy = build_policy(config, cache.position_table())
        if hasattr(policy, "set_input_statistics"):
            policy.set_input_statistics(*descriptor_statistics(cache, train_idx))
        if policy.state is not None:
            policy.state.set_statistics(*state_statistics(cache, state_names, train_idx))
    return policy


def _optimization(cfg: TrainConfig, model: nn.Module):
    """(optimizer, learning-rate scheduler, training state): new, or a resumed run's with its settings checked."""
    last_dir = Path(cfg.out) / LAST_DIR
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=cfg.plateau_factor, patience=cfg.plateau_patience, min_lr=cfg.min_lr
    )
    state = {"epoch": 0, "best_validation_loss": math.inf, "best_epoch": -1, "epochs_without_improvement": 0,
             "history": [], "train_config": dataclasses.asdict(cfg)}
    if cfg.resume:
        state = load_training_state(last_dir, optimizer, scheduler)
        changed = [k for k, v in state["train_config"].items() if k not in RESUMABLE_CHANGES and getattr(cfg, k) != v]
        if changed:
            raise ValueError(f"cannot resume {last_dir} with changed settings: {sorted(changed)}")
        state["train_config"] = dataclasses.asdict(cfg)
    return optimizer, scheduler, state


def _warn_of_unreachable_labels(cache: FeatureCache, config: dict, procs: Processes) -> None:
    max_steer = float(config["output"]["max_steering_rad"])
    unreachable = int(np.sum((np.abs(cache.targets[:, 0]) > max_steer) | (np.abs(cache.targets[:, 1]) > 1.0)))
    if unreachable and procs.main:
        tqdm.write(f"warning: {unreachable} frame(s) have labels beyond the output range "
                   f"(|steering| > {max_steer} rad or |throttle| > 1); the policy cannot reach them")


def _train(cfg: TrainConfig, procs: Processes, descriptor_transform, init_checkpoint) -> dict:
    run = TrainingRun(cfg, procs, descriptor_transform, init_checkpoint)
    epochs = tqdm(range(run.state["epoch"], cfg.epochs), desc="train", unit="epoch", disable=not procs.main,
                  initial=run.state["epoch"], total=cfg.epochs)
    stopped_early = False
    for epoch in epochs:
        loss_sum, frames_seen = run.train_epoch(epoch)
        errors = validation_errors(run.policy, run.cache, run.val_frames, run.selector, run.state_names,
                                   cfg.batch_size, procs.device)
        # One collective for the epoch's sums: the training loss and the validation errors of every process.
        loss_sum, frames_seen, *errors = procs.all_sum(loss_sum, frames_seen, *errors.tolist())
        run.end_epoch(epoch, loss_sum / frames_seen, errors, epochs)
        if run.state["epochs_without_improvement"] >= cfg.early_stop_patience:
            stopped_early = True
            break
    procs.barrier()
    return run.summary(stopped_early)


class TrainingRun:
    """One training run as its settings build it: the cache's frames and their split, the model and its
    optimizer, the batches of an epoch, and the bookkeeping that ends each epoch (state, checkpoints)."""

    def __init__(self, cfg: TrainConfig, procs: Processes, descriptor_transform, init_checkpoint):
        self.cfg, self.procs, self.descriptor_transform = cfg, procs, descriptor_transform
        self.out, self.last_dir = Path(cfg.out), last_epoch_dir(cfg.out)
        if not cfg.resume and (self.last_dir / STATE_JSON).exists():
            raise FileExistsError(f"{self.out} already holds a training run: "
                                  "continue it with --resume or choose another --out")
        self.cache = cache = FeatureCache(cfg.cache)
        variant = cfg.selection()
        if cfg.architecture == POSITION_TABLE_ARCHITECTURE and variant.sparse_sequence and cache.position_table() is None:
            raise ValueError(f"{variant.variant} needs the backbone's position table, and cache {cache.name} has none")
        self.train_idx, self.val_idx, split, self.state_names = _training_frames(cfg, cache, procs, init_checkpoint)
        self.config = policy_config(cfg, cache, split, self.train_idx, self.state_names,
                                    criterion_weights(cfg, self.state_names))
        self.config["training"]["world_size"] = procs.world_size
        self.augmenter = _orbital_augmenter(cfg, cache, self.train_idx, self.config)
        self._build_model(variant, init_checkpoint)
        _warn_of_unreachable_labels(cache, self.config, procs)
        self._build_batches()
        self._build_loss_terms()

    def _build_model(self, variant: SelectionConfig, init_checkpoint) -> None:
        cfg, procs = self.cfg, self.procs
        torch.manual_seed(cfg.seed)  # identical initial weights in every process
        self.policy = _starting_policy(cfg, self.config, self.cache, variant, self.train_idx, self.state_names,
                                       init_checkpoint).to(procs.device)
        self.model = SelectedPolicy(self.policy)
        self.optimizer, self.scheduler, self.state = _optimization(cfg, self.model)
        if procs.world_size > 1:
            device_ids = [procs.device.index] if procs.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)

    def _build_batches(self) -> None:
        cache, policy, procs = self.cache, self.policy, self.procs
        self.selector = policy_selector(self.config, cache.grid)
        self.selection = CacheSelection(cache, self.selector)
        if cache.token_dropping and isinstance(policy, PatchPolicy):
            raise ValueError(f"cache {cache.name} holds token-dropped descriptors; the patch policy's windows draw "
                             "their own selections of dense grids: train it on a dense cache")
        # A patch policy trains on windows of frames (sps_driving.train.windows).
        self.windows = (TrainingWindows(cache, policy, self.selector, self.state_names)
                        if isinstance(policy, PatchPolicy) else None)
        dataset = cache.dataset(self.train_idx) if self.windows is None else self.windows.dataset(self.train_idx)
        self.sampler = DistributedSampler(dataset, num_replicas=procs.world_size, rank=procs.rank, shuffle=True,
                                          seed=self.cfg.seed)
        # Whole batches from the dataset: one read per shard instead of one per frame.
        batches = BatchSampler(self.sampler, batch_size=self.cfg.batch_size, drop_last=False)
        self.loader = DataLoader(dataset, batch_size=None, sampler=batches, num_workers=self.cfg.num_workers)

    def _build_loss_terms(self) -> None:
        cache, device, target_std = self.cache, self.procs.device, self.config["training"]["target_std"]
        self.weights = torch.as_tensor(loss_scale(self.cfg.loss_weights, target_std), dtype=torch.float32,
                                       device=device)
        self.frame_weights = torch.from_numpy(
            np.where(cache.intervention, self.cfg.intervention_weight, 1.0).astype(np.float32))
        self.criterion_scale = loss_scale(self.config["training"]["criterion_weights"], target_std)
        self.states = torch.from_numpy(cache.state_values(self.state_names)) if self.state_names else None
        self.val_frames = self.val_idx[self.procs.rank::self.procs.world_size]
        self.val_variance = np.maximum(cache.targets[self.val_idx].astype(np.float64).var(axis=0),
                                       MIN_TARGET_STD ** 2)

    def train_epoch(self, epoch: int, clock: PhaseClock | None = None) -> tuple[float, int]:
        """One pass over this process's training batches: (sum of the batch losses times their sizes, frames).
        `clock` (bench --train) times its phases; without one nothing is timed."""
        cfg, procs = self.cfg, self.procs
        clock = clock or UNTIMED
        self.sampler.set_epoch(epoch)
        generator = torch.Generator(device=procs.device).manual_seed(draw_seed(cfg.seed, epoch, procs.rank))
        torch.manual_seed(draw_seed(cfg.seed, epoch, procs.rank, 1))  # dropout: a resumed run draws the same
        self.model.train()
        loss_sum, frames_seen = 0.0, 0
        batches = iter(tqdm(self.loader, desc=f"epoch {epoch}", leave=False, disable=not procs.main))
        while True:
            with clock("read"):
                batch = next(batches, None)
            if batch is None:
                break
            grids, target, _, index = batch
            loss = self.batch_loss(grids, target, index, generator, clock)
            with clock("backward"):
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with clock("optimizer"):
                self.optimizer.step()
            loss_sum += float(loss.detach()) * len(grids)
            frames_seen += len(grids)
        return loss_sum, frames_seen

    def batch_loss(self, grids, target, index, generator, clock) -> torch.Tensor:
        device = self.procs.device
        if self.windows is not None:  # a loss on every readout of each window
            with clock("forward"):
                return self.windows.loss(self.model, grids, target, index, generator, self.weights, self.frame_weights,
                                         device, self.descriptor_transform)
        with clock("select"):
            grids, target = grids.to(device), target.to(device)
            frame_states = None if self.states is None else self.states[index].to(device)
            if self.descriptor_transform is not None:
                grids = self.descriptor_transform(grids, generator)
            if self.augmenter is not None:
                grids = self.augmenter(grids, index, generator)
            keep = self.selection.training(index, generator, device)
        with clock("forward"):
            losses = l2_loss(self.model(grids, keep, frame_states), target, self.weights)
            return (losses * self.frame_weights[index].to(device)).mean()

    def end_epoch(self, epoch: int, train_loss: float, errors: list, epochs: tqdm) -> None:
        """Judge the epoch on its validation errors, step the scheduler, keep its record and save checkpoints."""
        val_loss = criterion(errors, len(self.val_idx), self.criterion_scale)
        # Fraction of the validation targets' variance left unexplained (1 = no better than their mean).
        fvu = dict(zip(("steering", "throttle"), (np.asarray(errors) / len(self.val_idx) / self.val_variance).tolist()))
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
            raise FloatingPointError(f"training diverged in epoch {epoch} (non-finite loss); try a lower --lr")
        state = self.state
        self.scheduler.step(val_loss)
        lr = self.optimizer.param_groups[0]["lr"]
        improved = val_loss < state["best_validation_loss"]
        state.update(epoch=epoch + 1)
        state["history"].append({"epoch": epoch, "train_loss": train_loss, "validation_loss": val_loss,
                                 "validation_error_fraction": fvu, "lr": lr})
        if improved:
            state.update(best_validation_loss=val_loss, best_epoch=epoch, epochs_without_improvement=0)
        else:
            state["epochs_without_improvement"] += 1
        if self.procs.main:
            self._save(epoch, val_loss, fvu, improved)
            epochs.set_postfix(train=f"{train_loss:.5f}", val=f"{val_loss:.5f}",
                               best=f"{state['best_validation_loss']:.5f}")
            tqdm.write(f"epoch {epoch}: train {train_loss:.6f}  validation {val_loss:.6f}  (error/variance: steering "
                       f"{fvu['steering']:.3f}, throttle {fvu['throttle']:.3f})  "
                       f"lr {lr:.2e}" + ("  (best)" if improved else ""))

    def _save(self, epoch: int, val_loss: float, fvu: dict, improved: bool) -> None:
        record = {**self.config, "validation_loss": val_loss, "validation_error_fraction": fvu,
                  "provenance": {"epoch": epoch, "created_unix": time.time(), "torch": torch.__version__,
                                 "command": "sps-driving " + shlex.join(sys.argv[1:])}}
        if improved:
            save_policy(self.policy, record, self.out)
        staging = self.out / STAGING_DIR
        shutil.rmtree(staging, ignore_errors=True)
        save_policy(self.policy, record, staging)
        save_training_state(staging, self.optimizer, self.scheduler, self.state)
        _replace_folder(staging, self.last_dir)

    def summary(self, stopped_early: bool) -> dict:
        state = self.state
        return {
            "out": str(self.out),
            "best_validation_loss": state["best_validation_loss"],
            "best_epoch": state["best_epoch"],
            "epochs_run": state["epoch"],
            "stopped_early": stopped_early,
            "train_frames": int(len(self.train_idx)),
            "validation_frames": int(len(self.val_idx)),
            "state_inputs": list(self.state_names),
            "world_size": self.procs.world_size,
            "history": state["history"],
        }


# ---- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", required=True, nargs="+", metavar="CACHE",
                        help="feature cache directory (sps-driving extract); several are trained on as one")
    parser.add_argument("--out", required=True, help="checkpoint directory, e.g. models/sps50")
    parser.add_argument("--config", default=str(TRAIN_CONFIG), help="YAML with a `train:` section")
    parser.add_argument("--variant", choices=["sps", "threshold", "spps", "mspps"])
    parser.add_argument("--rate", type=float, help="keep-rate in (0, 1]; 1.0 = dense baseline")
    parser.add_argument("--architecture", choices=TRAINABLE_ARCHITECTURES,
                        help="mlp (default), positional_transformer (spps, mspps), relative_query (patches read by their "
                             "offset from the roi's centre; all variants), transformer (the first one, for comparison), "
                             "cnn (the No-FM baseline, on a pixels-backbone cache), or patch_policy "
                             "(the kept patches of the last frames, block-causal)")
    parser.add_argument("--state-inputs", nargs="*", choices=list(STATE_NAMES), metavar="NAME",
                        help=f"state inputs the policy reads besides the frame ({', '.join(STATE_NAMES)}); "
                             "given with no names: none")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--width", type=int)
    parser.add_argument("--reduce", type=int, help="mlp: channels each patch's descriptor is reduced to; "
                                                   "positional_transformer: channels each token is read out with; "
                                                   "relative_query: channels each query is read out with (readout flatten)")
    parser.add_argument("--canvas", type=int, nargs=2, metavar=("ROWS", "COLS"),
                        help="mlp: lay its weights out on a canvas of this many patches, the grid centred on it")
    parser.add_argument("--state-to-head", action=argparse.BooleanOptionalAction, default=None,
                        help="mlp: the state inputs also reach the output head directly (config/train.yaml)")
    parser.add_argument("--query-stride", type=int, help="relative_query: a query at every Nth row and column")
    parser.add_argument("--readout", choices=READOUTS, help="relative_query: how the head reads the queries")
    parser.add_argument("--depth", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--early-stop-patience", type=int)
    parser.add_argument("--window-frames", type=int, help="patch_policy: frames per window (T), the newest included")
    parser.add_argument("--frame-stride-s", type=float, help="patch_policy: s between a window's frames")
    parser.add_argument("--shared-selection", action=argparse.BooleanOptionalAction, default=None,
                        help="patch_policy: one selection per block of T strides instead of one per frame")
    parser.add_argument("--intervention-weight", type=float,
                        help="loss weight of the frames after a safety driver's override (1: like every frame)")
    parser.add_argument("--orbital-fraction", type=float,
                        help="Manifold augmentation: resample this fraction of the patches of training frames with orbital "
                             "states (extract --orbital-every) from their own bounded Manifold; 0: off")
    parser.add_argument("--validation-fraction", type=float)
    parser.add_argument("--num-workers", type=int)
    parser.add_argument("--device", help="auto, cpu, cuda")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last")


def run(args) -> int:
    overrides = {k: getattr(args, k) for k in (
        "variant", "rate", "architecture", "state_inputs", "seed", "epochs", "batch_size", "lr", "width", "reduce", "depth", "heads",
        "early_stop_patience", "validation_fraction", "num_workers", "device", "intervention_weight", "window_frames",
        "frame_stride_s", "shared_selection", "canvas", "state_to_head", "query_stride", "readout", "orbital_fraction")}
    try:
        cfg = TrainConfig.from_yaml(args.config, cache=args.cache, out=args.out, resume=args.resume or None, **overrides)
        summary = train(cfg)
    except (OSError, ValueError) as error:  # bad settings, missing or damaged cache or checkpoint
        print(f"error: {error}", file=sys.stderr)
        return 2
    if summary["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        print(f"trained {cfg.variant} rate {cfg.rate} {cfg.architecture} on {summary['train_frames']} frames "
              f"({summary['validation_frames']} for validation) in {summary['epochs_run']} epochs"
              f"{' (stopped early)' if summary['stopped_early'] else ''} on {summary['world_size']} process(es); "
              f"best validation loss {summary['best_validation_loss']:.6f} at epoch {summary['best_epoch']}; "
              f"checkpoint {cfg.out}")
        best = summary["history"][summary["best_epoch"]]["validation_error_fraction"] if summary["history"] else None
        if best:
            print(f"state inputs {summary['state_inputs'] or 'none'}; at the best epoch the validation errors are "
                  f"{best['steering']:.3f} (steering) and {best['throttle']:.3f} (throttle) of their variance")
    return 0
