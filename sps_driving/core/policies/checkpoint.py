"""Driving policies over patch descriptors, and their checkpoints.

Transformer policies (architecture "positional_transformer", the one to train): every descriptor
channel standardized with training-set statistics (buffers the trainer sets with
`set_input_statistics`), projected to the model width and LayerNorm'd, plus a learned embedding
of its grid cell at the same scale (unit RMS); a pre-norm transformer encoder; then a per-cell
readout: each token reduced to `reduce` channels and put back at its cell (zeros at cells with no
token), the grid flattened in cell order and read by a two-layer MLP, so every readout weight
knows its cell, as in the grid MLP.

- `PositionalGridPolicy` (SPS, threshold, dense Drive-Anywhere): one token per patch, zeros at
  dropped patches (SPS eq. 4) before the standardization.
- `PositionalSequencePolicy` (SPPS, MSPPS; SPS section 3.4 v2): only the kept descriptors, each
  at its original cell; a batch of different lengths is padded and masked.

The first transformers (architecture "transformer", kept so their checkpoints load and run as
they did) read the raw descriptors, whose norms (~46 for DINOv2) swamp their position codes, and
end in a CLS token; they barely learned where things are (docs/training.md):

- `GridPolicy`: one token per patch, zeros at dropped patches, plus a learned position embedding
  per patch (initialized at 0.02).
- `TableSequencePolicy`: only the kept descriptors, each with its ORIGINAL position embedding
  from the backbone's own table (`PatchExtractor.position_table()`, [N, P], a frozen buffer
  saved in the checkpoint) projected to the model width.

Every policy that reads the kept tokens as a sequence is a `SequencePolicy`.

A grid MLP (architecture "mlp", the trainer's default): `GridMlpPolicy` standardizes each
descriptor channel with training-set statistics, reduces every patch to a few channels, flattens
the grid in patch order (zeros at dropped patches) and reads it with a two-layer MLP; with a
`canvas`, the grid is placed on a larger canvas centred on the roi's centre.

A relative-query policy (architecture "relative_query", sps_driving.core.relative_policy): no
absolute position; the kept tokens read by queries at fixed offsets from the roi's centre, so it
runs on a wider grid (sps_driving.core.view) reading its central window.

And a CNN (architecture "cnn", the No-FM baseline): `CnnPolicy` folds the grid of the `pixels`
backbone (each descriptor its patch's pooled pixels) back into an image, zeros at dropped
patches, and runs a PilotNet-like convolution stack and MLP on it.

And the patch policy (architecture "patch_policy", `sps_driving.core.patch_policy`): the kept
patches of the last T frames under a block-causal mask, one readout per frame.

State inputs (config "state_inputs", names from sps_driving.core.state; none when absent): the
car's speed and the cruise target speed, which the throttle depends on and no frame shows. Each is
standardized with training statistics kept as buffers (`StateStandardizer`, set by the trainer);
the grid MLP concatenates them to its flattened reduced grid (and with state_to_head to the input
of its head), the transformers read them as one more token (a linear embedding of the state
vector), the positional transformers concatenate them to their flattened readout grid and the CNN
concatenates them to its MLP input.

Outputs follow `sps_driving.topics`: steering is the front road-wheel angle in rad (left
positive), bounded to +-max_steering_rad by tanh scaling; throttle is in [-1, 1] (negative is
brake) by tanh (`BoundedHead`, shared by all). Both are finite for finite inputs.

A checkpoint is a directory with `policy.safetensors` (the module's state dict) and
`config.json`. The config (`PolicyArchitecture.config` builds it) records: format, architecture ("transformer" when absent), backbone,
grid {rows, cols}, descriptor_dim D, position_dim P (transformer sequence policies), selection {variant,
rate, seed, keep_probability}, state_inputs [names], policy (transformer: {width, depth, heads, mlp_ratio, dropout};
positional_transformer: {width, depth, heads, mlp_ratio, dropout, reduce}; relative_query: those and {query_stride,
readout}; mlp: {width, reduce, dropout, canvas, state_to_head}; cnn: {width, dropout}; patch_policy: positional_transformer's and its
window's, core.history.WINDOW_SETTINGS), output {max_steering_rad}, and whatever the trainer adds (view: the roi and its
centre, training data, provenance, validation_loss).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from sps_driving.core.backbones.pixels import CHANNELS, pooled_side
from sps_driving.core.backbones.pixels import NAME as PIXELS_BACKBONE
from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import PATCH_POLICY, WINDOW_SETTINGS, policy_selector
from sps_driving.core.selection import SelectionConfig
from sps_driving.core.state import check_state_names, state_vector
from sps_driving.core.view import WindowSelector, window_origin
from sps_driving.resources import read_format_json

POLICY_FORMAT = "sps_driving.policy/1"
# Occlusion attribution runs its occluded copies of a frame in batches of at most this many grid
# elements (float32: 16 MiB per batch), whatever the grid and the number of kept patches.
ATTRIBUTION_BATCH_ELEMENTS = 1 << 22
WEIGHTS_FILE = "policy.safetensors"
CONFIG_FILE = "config.json"
# config "architecture" -> the names of its policy settings (config "policy"; values: config/train.yaml)
TRANSFORMER_SETTINGS = ("width", "depth", "heads", "mlp_ratio", "dropout")
POSITIONAL_TRANSFORMER_SETTINGS = (*TRANSFORMER_SETTINGS, "reduce")
MLP_SETTINGS = ("width", "reduce", "dropout", "canvas", "state_to_head")
CNN_SETTINGS = ("width", "dropout")
# The patch policy (sps_driving.core.patch_policy): a transformer's settings and its window's.
PATCH_POLICY_SETTINGS = (*POSITIONAL_TRANSFORMER_SETTINGS, *WINDOW_SETTINGS)
RELATIVE_QUERY_SETTINGS = (*POSITIONAL_TRANSFORMER_SETTINGS, "query_stride", "readout")  # core/relative_policy.py
ARCHITECTURES = {"positional_transformer": POSITIONAL_TRANSFORMER_SETTINGS, "transformer": TRANSFORMER_SETTINGS,
                 "mlp": MLP_SETTINGS, "cnn": CNN_SETTINGS, PATCH_POLICY: PATCH_POLICY_SETTINGS,
                 "relative_query": RELATIVE_QUERY_SETTINGS}
# Settings added after checkpoints without them were written: the value those checkpoints mean (a
# policy config leaves them out at that value).
SETTING_DEFAULTS = {"mlp": {"canvas": None, "state_to_head": False}}
# The architectures that can read the kept tokens as a sequence (spps, mspps), the one to train
# first; the others read the whole grid with zeros at dropped patches, where spps would equal sps.
SEQUENCE_ARCHITECTURES = ("positional_transformer", "transformer", PATCH_POLICY, "relative_query")
# The architecture whose sequence policies read the backbone's position table.
POSITION_TABLE_ARCHITECTURE = "transformer"
# Checkpoints written before config "architecture" existed are all transformers.
UNRECORDED_ARCHITECTURE = "transformer"
# RMS of a positional transformer's cell embedding at initialization: that of the LayerNorm'd
# tokens it is added to, so where a token is weighs as much as what it shows from the first step.
CELL_EMBEDDING_STD = 1.0
# PilotNet's convolutions (Bojarski et al. 2016): (out channels, kernel px, stride)
PILOTNET_CONVS = ((24, 5, 2), (36, 5, 2), (48, 5, 2), (64, 3, 1), (64, 3, 1))


class BoundedHead(nn.Linear):
    """features [B, F] -> [B, 2]: steering rad in +-max_steering_rad and throttle in [-1, 1], by tanh."""

    def __init__(self, features: int, max_steering_rad: float):
        super().__init__(features, 2)
        if not max_steering_rad > 0:
            raise ValueError(f"max_steering_rad must be positive, got {max_steering_rad}")
        self.max_steering_rad = float(max_steering_rad)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        raw = super().forward(features)
        return torch.stack([self.max_steering_rad * torch.tanh(raw[:, 0]), torch.tanh(raw[:, 1])], dim=1)


class StateStandardizer(nn.Module):
    """State vectors [B, S] standardized with the training set's per-input mean and spread
    (buffers the trainer sets with `set_statistics`, saved with the weights)."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(size))
        self.register_buffer("std", torch.ones(size))

    @torch.no_grad()
    def set_statistics(self, mean: np.ndarray, std: np.ndarray) -> None:
        self.mean.copy_(torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.std.copy_(torch.as_tensor(np.maximum(np.asarray(std, dtype=np.float32), 1e-6)))

    def forward(self, state: torch.Tensor | None) -> torch.Tensor:
        if state is None or state.ndim != 2 or state.shape[1] != self.mean.shape[0]:
            shape = None if state is None else tuple(state.shape)
            raise ValueError(f"this policy reads {self.mean.shape[0]} state input(s) per frame, got {shape}")
        return (state - self.mean) / self.std


def _state_input(module: nn.Module, state_dim: int) -> None:
    """Give `module` its state standardizer (`module.state`, None without state inputs)."""
    module.state = StateStandardizer(state_dim) if state_dim else None


def _with_state(module: nn.Module, features: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """features [B, F], with the standardized state [B, S] appended when the policy reads one."""
    if module.state is None:
        return features
    return torch.cat([features, module.state(state).to(features.dtype)], dim=1)


class _DenseGridInput:
    """Policies that read the whole grid, zeros at dropped patches (SPS eq. 4)."""

    def forward_selected(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Dense grids [B, N, D] and keep masks [B, N] (and states [B, S]): zero the dropped patches."""
        return self(grids * keep.unsqueeze(-1).to(grids.dtype), state)


class SequencePolicy:
    """Policies that read only the kept tokens, each at its original cell (spps, mspps):
    forward(descriptors [B, L, D], indices [B, L], padding [B, L] True at filler slots, state)."""

    def forward_selected(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Dense grids [B, N, D] and keep masks [B, N]: drop the rest, keep original positions (v2)."""
        return self(*pack_kept(grids, keep), state)


class _StandardizedInput:
    """Descriptor channels standardized with the training set's per-channel mean and spread:
    buffers `input_mean`, `input_std` [D] the trainer sets (`set_input_statistics`), saved with the
    weights. A few channels carry most of the variance of foundation-model descriptors (DINOv2
    token norms ~46), and the road geometry lives in the small ones."""

    def _input_statistics(self, descriptor_dim: int) -> None:
        self.register_buffer("input_mean", torch.zeros(descriptor_dim))
        self.register_buffer("input_std", torch.ones(descriptor_dim))

    @torch.no_grad()
    def set_input_statistics(self, mean: np.ndarray, std: np.ndarray) -> None:
        std = np.maximum(np.asarray(std, dtype=np.float32), 1e-6)
        self.input_mean.copy_(torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.input_std.copy_(torch.as_tensor(std))


def _readout_mlp(features: int, width: int, dropout: float) -> list[nn.Module]:
    """The two hidden layers (width, width // 2) that read a flattened grid (and the state)."""
    return [nn.Linear(features, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width // 2), nn.GELU()]


class _TransformerPolicy(nn.Module):
    """CLS token + pre-norm transformer encoder + bounded (steering, throttle) head."""

    def __init__(self, width: int, depth: int, heads: int, mlp_ratio: float, dropout: float, max_steering_rad: float,
                 state_dim: int = 0):
        super().__init__()
        _state_input(self, state_dim)
        # The state token: a linear embedding of the standardized state vector (its bias tells it apart).
        self.state_proj = nn.Linear(state_dim, width) if state_dim else None
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, int(width * mlp_ratio), dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # No nested-tensor fast path: padded batches and single frames must take the same arithmetic.
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = BoundedHead(width, max_steering_rad)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def _encode(self, tokens: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        leading = [self.cls_token.expand(tokens.shape[0], -1, -1)]
        if self.state is not None:
            leading.append(self.state_proj(self.state(state)).unsqueeze(1))
        tokens = torch.cat([*leading, tokens], dim=1)
        if padding is not None:
            padding = torch.cat([torch.zeros_like(padding[:, :1]).expand(-1, len(leading)), padding], dim=1)
        encoded = self.encoder(tokens, src_key_padding_mask=padding)
        return self.head(self.norm(encoded[:, 0]))


class GridPolicy(_DenseGridInput, _TransformerPolicy):
    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, depth: int, heads: int,
                 mlp_ratio: float, dropout: float, max_steering_rad: float, state_dim: int = 0):
        super().__init__(width, depth, heads, mlp_ratio, dropout, max_steering_rad, state_dim)
        self.input_proj = nn.Linear(descriptor_dim, width)
        self.position_embedding = nn.Parameter(torch.zeros(1, grid.n, width))
        nn.init.trunc_normal_(self.position_embedding, std=0.02)

    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        return self._encode(self.input_proj(grids) + self.position_embedding, state=state)


class TableSequencePolicy(SequencePolicy, _TransformerPolicy):
    def __init__(self, position_table: torch.Tensor, descriptor_dim: int, width: int, depth: int, heads: int,
                 mlp_ratio: float, dropout: float, max_steering_rad: float, state_dim: int = 0):
        super().__init__(width, depth, heads, mlp_ratio, dropout, max_steering_rad, state_dim)
        # The backbone's own table: frozen, but saved with the weights so a checkpoint is self-contained.
        self.register_buffer("position_table", position_table.detach().clone().float())
        self.input_proj = nn.Linear(descriptor_dim, width)
        self.position_proj = nn.Linear(position_table.shape[1], width)

    def forward(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        """descriptors [B, L, D] of kept patches `indices` [B, L]; padding [B, L] True at filler slots."""
        tokens = self.input_proj(descriptors) + self.position_proj(self.position_table[indices])
        return self._encode(tokens, padding, state)


class _PositionalTransformer(_StandardizedInput, nn.Module):
    """Standardized, LayerNorm'd tokens plus learned cell embeddings, a pre-norm transformer
    encoder, and a per-cell readout into the bounded (steering, throttle) head (module docstring)."""

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, depth: int, heads: int, mlp_ratio: float,
                 dropout: float, reduce: int, max_steering_rad: float, state_dim: int = 0):
        super().__init__()
        _state_input(self, state_dim)
        self._input_statistics(descriptor_dim)
        self.input_proj = nn.Linear(descriptor_dim, width)
        self.input_norm = nn.LayerNorm(width)
        self.cell_embedding = nn.Parameter(torch.empty(grid.n, width))
        nn.init.trunc_normal_(self.cell_embedding, std=CELL_EMBEDDING_STD, a=-2 * CELL_EMBEDDING_STD,
                              b=2 * CELL_EMBEDDING_STD)
        layer = nn.TransformerEncoderLayer(
            width, heads, int(width * mlp_ratio), dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # No dropout on the attention weights (the feed-forward and residual dropout stay): PyTorch's
        # fused CPU attention takes none, and with it a training step ran ~3x faster (256 tokens).
        layer.self_attn.dropout = 0.0
        # No nested-tensor fast path: padded batches and single frames must take the same arithmetic.
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.reduce = nn.Linear(width, reduce)
        self.mlp = nn.Sequential(*_readout_mlp(grid.n * reduce + state_dim, width, dropout))
        self.head = BoundedHead(width // 2, max_steering_rad)

    def _read(self, descriptors: torch.Tensor, indices: torch.Tensor | None = None, padding: torch.Tensor | None = None,
              state: torch.Tensor | None = None) -> torch.Tensor:
        """descriptors [B, L, D] at cells `indices` [B, L] (None: all N cells in order), padding
        [B, L] True at filler slots (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        tokens = self.input_norm(self.input_proj((descriptors - self.input_mean) / self.input_std))
        tokens = tokens + (self.cell_embedding if indices is None else self.cell_embedding[indices])
        reduced = self.reduce(self.norm(self.encoder(tokens, src_key_padding_mask=padding)))
        if indices is None:
            cells = reduced
        else:  # each token back at its cell; cells without one (dropped patches) and filler slots read zeros
            if padding is not None:
                reduced = reduced.masked_fill(padding.unsqueeze(-1), 0.0)
            cells = reduced.new_zeros(reduced.shape[0], self.cell_embedding.shape[0], reduced.shape[-1])
            cells = cells.scatter_add(1, indices.unsqueeze(-1).expand(-1, -1, reduced.shape[-1]), reduced)
        return self.head(self.mlp(_with_state(self, cells.flatten(1), state)))


class PositionalGridPolicy(_DenseGridInput, _PositionalTransformer):
    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        return self._read(grids, state=state)


class PositionalSequencePolicy(SequencePolicy, _PositionalTransformer):
    def forward(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        """descriptors [B, L, D] of kept patches `indices` [B, L]; padding [B, L] True at filler slots."""
        return self._read(descriptors, indices, padding, state)


class CnnPolicy(_DenseGridInput, nn.Module):
    """The No-FM baseline: a PilotNet-like CNN on the image the `pixels` backbone's grid folds into.

    Each descriptor is its patch's pooled pixels, channel-major [3, p, p] (D = 3 p^2), so the
    [B, rows * cols, D] grid is the image [B, 3, rows p, cols p]; dropped patches are zeros (the
    mean pixel after normalization). PilotNet's five convolutions (ReLU, padded so any grid
    works) and a two-layer MLP of `width` units feed the shared bounded head.
    """

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, dropout: float, max_steering_rad: float,
                 state_dim: int = 0):
        super().__init__()
        _state_input(self, state_dim)
        side = pooled_side(descriptor_dim)
        if side is None:
            raise ValueError(
                f"a cnn policy reads the pixels backbone's pooled patches (D = 3 p^2, e.g. 147 at pixel_pool 2); "
                f"descriptor_dim {descriptor_dim} is not one"
            )
        self.grid, self.side = grid, side
        layers, channels, height, width_px = [], CHANNELS, grid.rows * side, grid.cols * side
        for out_channels, kernel, stride in PILOTNET_CONVS:
            layers += [nn.Conv2d(channels, out_channels, kernel, stride, padding=kernel // 2), nn.ReLU()]
            channels, height, width_px = out_channels, -(-height // stride), -(-width_px // stride)
        self.convs = nn.Sequential(*layers)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(channels * height * width_px + state_dim, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
        )
        self.head = BoundedHead(width, max_steering_rad)

    def grid_image(self, grids: torch.Tensor) -> torch.Tensor:
        """[B, rows * cols, 3 p^2] -> [B, 3, rows p, cols p]: every patch's pixels back in place."""
        rows, cols, side = self.grid.rows, self.grid.cols, self.side
        patches = grids.reshape(grids.shape[0], rows, cols, CHANNELS, side, side)
        return patches.permute(0, 3, 1, 4, 2, 5).reshape(grids.shape[0], CHANNELS, rows * side, cols * side)

    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        image_features = self.mlp[:2](self.convs(self.grid_image(grids)))  # flattened, dropout (not on the state)
        return self.head(self.mlp[2:](_with_state(self, image_features, state)))


class GridMlpPolicy(_DenseGridInput, _StandardizedInput, nn.Module):
    """Every patch's descriptor standardized and reduced to `reduce` channels, the grid flattened
    in patch order (so each weight knows its patch's place), then a two-layer MLP.

    Dropped patches are zeros (SPS eq. 4), as in GridPolicy. The per-channel descriptor mean and
    spread are buffers the trainer sets from the training frames (`set_input_statistics`). For sps
    and threshold; spps and mspps, which feed the kept tokens as a sequence, need a transformer
    (on a zero-filled grid spps would equal sps).

    With a `canvas` (rows, cols >= the grid's): the MLP's weights are laid out on the canvas and
    the grid is placed on it centred on the roi's centre (the grid's), so a wider grid's central
    window (`set_view`) meets the weights its cells were trained with. Canvas cells with no patch
    read zeros; the weights of those the training grid leaves empty start at zero and no training
    frame reaches them, so on a wider grid its outer patches add nothing.
    """

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, reduce: int, dropout: float,
                 max_steering_rad: float, state_dim: int = 0, canvas: PatchGrid | None = None,
                 state_to_head: bool = False):
        super().__init__()
        _state_input(self, state_dim)
        self._input_statistics(descriptor_dim)
        self.reduce = nn.Linear(descriptor_dim, reduce)
        self.canvas = canvas
        cells = grid.n if canvas is None else canvas.n
        self.mlp = nn.Sequential(nn.Flatten(), *_readout_mlp(cells * reduce + state_dim, width, dropout))
        # The state also reaches the head directly: the throttle is close to linear in (target - speed),
        # and as 2 of the first layer's thousands of inputs, beside the selection's noise, it was barely learned.
        if state_to_head and not state_dim:
            raise ValueError("mlp state_to_head needs state inputs (state_inputs is empty)")
        self.state_to_head = bool(state_to_head)
        self.head = BoundedHead(width // 2 + (state_dim if self.state_to_head else 0), max_steering_rad)
        if canvas is not None:
            self.set_view(grid)
            empty = torch.ones(canvas.n, dtype=torch.bool)
            empty[self.slots] = False
            with torch.no_grad():
                self.mlp[1].weight[:, :canvas.n * reduce].view(-1, canvas.n, reduce)[:, empty] = 0.0

    @property
    def reads_a_window(self) -> bool:
        """Whether it can read a wider grid than its training grid (`set_view`): with a canvas."""
        return self.canvas is not None

    def set_view(self, grid: PatchGrid) -> None:
        """Read grids of `grid`'s size from now on, centred on the canvas (canvas only)."""
        if self.canvas is None:
            raise ValueError("an mlp policy without a canvas reads only the grid it was trained on")
        top, left = window_origin(grid, self.canvas)
        rows, cols = np.divmod(np.arange(grid.n), grid.cols)
        slots = torch.from_numpy((rows + top) * self.canvas.cols + cols + left).to(self.reduce.weight.device)
        self.register_buffer("slots", slots, persistent=False)  # canvas cell of each grid patch

    def _reduced(self, grids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """reduce((grids * keep - mean) / std), flattened [B, N * reduce], with the standardization
        folded into the reduction's weights and the mask applied to the reduced channels: the same
        numbers for a fraction of the elementwise work on [B, N, D] (what training waited on)."""
        weight = self.reduce.weight / self.input_std
        bias = self.reduce.bias - weight @ self.input_mean
        projected = grids @ weight.T
        if keep is not None:
            projected = projected * keep.unsqueeze(-1).to(projected.dtype)
        reduced = projected + bias
        if self.canvas is not None:
            reduced = reduced.new_zeros(len(reduced), self.canvas.n, reduced.shape[-1]).index_copy(1, self.slots, reduced)
        return reduced.flatten(1)

    def _read(self, reduced: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        if self.state is None:
            return self.head(self.mlp(reduced))
        standardized = self.state(state).to(reduced.dtype)  # once, for the input and (state_to_head) the head
        hidden = self.mlp(torch.cat([reduced, standardized], dim=1))
        return self.head(torch.cat([hidden, standardized], dim=1) if self.state_to_head else hidden)

    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        return self._read(self._reduced(grids), state)

    def forward_selected(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Dense grids [B, N, D] and keep masks [B, N] (and states [B, S]); as forward on the zeroed grids."""
        return self._read(self._reduced(grids, keep), state)


def pack_kept(grids: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather each row's kept patches, in index order, into a padded batch.

    Returns descriptors [B, L, D], indices [B, L] and padding [B, L] (True at filler slots), where
    L is the largest kept count in the batch.
    """
    counts = keep.sum(dim=1)
    length = max(int(counts.max()), 1)
    # A stable sort on "dropped" puts each row's kept indices first, still ascending.
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :length]
    padding = torch.arange(length, device=keep.device).unsqueeze(0) >= counts.unsqueeze(1)
    descriptors = torch.gather(grids, 1, order.unsqueeze(-1).expand(-1, -1, grids.shape[-1]))
    return descriptors.masked_fill(padding.unsqueeze(-1), 0.0), order.masked_fill(padding, 0), padding


def _require(config: dict, key: str):
    if key not in config:
        raise ValueError(f"policy config is missing {key!r}")
    return config[key]


def architecture_of(config: dict) -> str:
    """A policy config's architecture (see UNRECORDED_ARCHITECTURE for checkpoints without one)."""
    return config.get("architecture", UNRECORDED_ARCHITECTURE)


def state_inputs_of(config: dict) -> tuple[str, ...]:
    """A policy config's state inputs (sps_driving.core.state); checkpoints without the key read none."""
    return check_state_names(config.get("state_inputs", ()))


def check_architecture(architecture: str, selection: SelectionConfig) -> None:
    """Raise ValueError unless `architecture` is known and can take `selection`'s variant."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown policy architecture {architecture!r}; expected one of {list(ARCHITECTURES)}")
    if architecture not in SEQUENCE_ARCHITECTURES and selection.sparse_sequence:
        raise ValueError(f"a {architecture} policy reads the whole grid (zeros at dropped patches): use variant sps or "
                         f"threshold, not {selection.variant}, which feeds the kept tokens as a sequence "
                         f"(architecture {SEQUENCE_ARCHITECTURES[0]})")


@dataclass(frozen=True)
class PolicyArchitecture:
    """What a policy is, apart from the grid it reads: architecture, its settings and the output bound.

    The one builder of the policy config that `build_policy` reads (`config`): the trainer makes
    its checkpoints with it, and the timing tools time a checkpoint's architecture (`of`) on any
    backbone's grid with it.
    """

    name: str
    settings: dict  # exactly ARCHITECTURES[name]
    max_steering_rad: float  # rad; steering output bound

    def __post_init__(self) -> None:
        if self.name not in ARCHITECTURES:
            raise ValueError(f"unknown policy architecture {self.name!r}; expected one of {list(ARCHITECTURES)}")
        optional = set(SETTING_DEFAULTS.get(self.name, ()))
        if not set(ARCHITECTURES[self.name]) - optional <= set(self.settings) <= set(ARCHITECTURES[self.name]):
            raise ValueError(f"{self.name} policy settings must be exactly {list(ARCHITECTURES[self.name])} "
                             f"({sorted(optional) or 'none'} optional), got {sorted(self.settings)}")
        if not self.max_steering_rad > 0:
            raise ValueError(f"max_steering_rad must be positive, got {self.max_steering_rad}")

    @classmethod
    def of(cls, config: dict) -> PolicyArchitecture:
        """The architecture of a policy config (a checkpoint's config.json)."""
        output = _require(config, "output")
        if "max_steering_rad" not in output:
            raise ValueError("policy config output needs max_steering_rad")
        return cls(architecture_of(config), dict(_require(config, "policy")), float(output["max_steering_rad"]))

    def config(self, grid: PatchGrid, descriptor_dim: int, selection: SelectionConfig, backbone: str | None = None,
               position_dim: int | None = None, state_inputs: Sequence[str] = ()) -> dict:
        """The policy config of this architecture on a `grid` of `descriptor_dim` descriptors,
        reading `state_inputs` (names of sps_driving.core.state) besides.

        position_dim (P of the backbone's position table) lets a transformer sequence policy be
        built without the table itself (zeros, e.g. for timing); the other architectures ignore it.
        """
        check_architecture(self.name, selection)
        config = {
            "backbone": backbone,
            "grid": {"rows": grid.rows, "cols": grid.cols},
            "descriptor_dim": int(descriptor_dim),
            "selection": selection.to_dict(),
            "state_inputs": list(check_state_names(state_inputs)),
            "architecture": self.name,
            "policy": dict(self.settings),
            "output": {"max_steering_rad": self.max_steering_rad},
        }
        if position_dim is not None and selection.sparse_sequence and self.name == POSITION_TABLE_ARCHITECTURE:
            config["position_dim"] = int(position_dim)
        return config

    def describe(self) -> dict:
        return {"architecture": self.name, "policy": dict(self.settings), "max_steering_rad": self.max_steering_rad}


def build_policy(config: dict, position_table: np.ndarray | None = None) -> nn.Module:
    """A fresh policy module for `config` (see the module docstring for its keys).

    Sequence policies (spps, mspps) of architecture "transformer" need the backbone's position
    table [N, P]; without one they get a zero table of shape [N, config["position_dim"]] that
    loading a checkpoint fills. The other architectures ignore it.
    """
    grid_cfg = _require(config, "grid")
    grid = PatchGrid(int(grid_cfg["rows"]), int(grid_cfg["cols"]))
    descriptor_dim = int(_require(config, "descriptor_dim"))
    selection = SelectionConfig.from_dict(_require(config, "selection"))
    architecture = PolicyArchitecture.of(config)
    check_architecture(architecture.name, selection)
    dims, max_steering_rad = architecture.settings, architecture.max_steering_rad
    state_dim = len(state_inputs_of(config))
    if architecture.name == "cnn":
        if config.get("backbone") != PIXELS_BACKBONE:
            raise ValueError(f"a cnn policy reads the {PIXELS_BACKBONE!r} backbone's pooled pixels, "
                             f"not {config.get('backbone')!r} descriptors")
        return CnnPolicy(grid, descriptor_dim, width=int(dims["width"]), dropout=float(dims["dropout"]),
                         max_steering_rad=max_steering_rad, state_dim=state_dim)
    if architecture.name == "mlp":
        if int(dims["width"]) < 2 or int(dims["reduce"]) < 1:
            raise ValueError(f"mlp policy needs width >= 2 and reduce >= 1, got {dims}")
        canvas = dims.get("canvas", SETTING_DEFAULTS["mlp"]["canvas"])
        if canvas is not None and (not isinstance(canvas, (list, tuple)) or len(canvas) != 2):
            raise ValueError(f"mlp canvas must be null or [rows, cols] (patches), got {canvas!r}")
        return GridMlpPolicy(grid, descriptor_dim, width=int(dims["width"]), reduce=int(dims["reduce"]),
                             dropout=float(dims["dropout"]), max_steering_rad=max_steering_rad, state_dim=state_dim,
                             canvas=None if canvas is None else PatchGrid(int(canvas[0]), int(canvas[1])),
                             state_to_head=bool(dims.get("state_to_head", SETTING_DEFAULTS["mlp"]["state_to_head"])))
    if architecture.name == PATCH_POLICY:
        from sps_driving.core.patch_policy import build_patch_policy  # which builds on this module

        return build_patch_policy(grid, descriptor_dim, dims, max_steering_rad, state_dim)
    common = dict(
        descriptor_dim=descriptor_dim, width=int(dims["width"]), depth=int(dims["depth"]), heads=int(dims["heads"]),
        mlp_ratio=float(dims["mlp_ratio"]), dropout=float(dims["dropout"]), max_steering_rad=max_steering_rad,
        state_dim=state_dim,
    )
    if architecture.name == "relative_query":
        from sps_driving.core.relative_policy import RelativeQueryPolicy  # it builds on this module's parts

        if int(dims["width"]) < 2 or int(dims["reduce"]) < 1:
            raise ValueError(f"relative_query policy needs width >= 2 and reduce >= 1, got {dims}")
        return RelativeQueryPolicy(grid, reduce=int(dims["reduce"]), query_stride=int(dims["query_stride"]),
                                   readout=str(dims["readout"]), **common)
    if architecture.name == "positional_transformer":
        if int(dims["width"]) < 2 or int(dims["reduce"]) < 1:
            raise ValueError(f"positional_transformer policy needs width >= 2 and reduce >= 1, got {dims}")
        positional = PositionalSequencePolicy if selection.sparse_sequence else PositionalGridPolicy
        return positional(grid, reduce=int(dims["reduce"]), **common)
    if not selection.sparse_sequence:
        return GridPolicy(grid, **common)
    if position_table is None:
        position_dim = config.get("position_dim")
        if not position_dim:
            raise ValueError(f"a {selection.variant} policy needs the backbone's position table or position_dim")
        table = torch.zeros(grid.n, int(position_dim))
    else:
        table = torch.as_tensor(np.asarray(position_table, dtype=np.float32))
        if table.ndim != 2 or table.shape[0] != grid.n:
            raise ValueError(f"position table must be [{grid.n}, P], got {tuple(table.shape)}")
    return TableSequencePolicy(table, **common)


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

    def _check(self, descriptors, indices) -> tuple[np.ndarray, np.ndarray]:
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
        frames = [self._check(d, i) for d, i in zip(descriptors, indices)]
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
        descriptors, indices = self._check(descriptors, indices)
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
