"""A grid MLP (architecture "mlp", the trainer's default): `GridMlpPolicy` standardizes each
descriptor channel with training-set statistics, reduces every patch to a few channels, flattens
the grid in patch order (zeros at dropped patches) and reads it with a two-layer MLP; with a
`canvas`, the grid is placed on a larger canvas centred on the roi's centre. The state inputs are
concatenated to its flattened reduced grid (and with state_to_head to the input of its head)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import (
    BoundedHead,
    DenseGridInput,
    PolicySpec,
    StandardizedInput,
    add_state_input,
    readout_mlp,
)
from sps_driving.core.view import window_origin

SETTINGS = ("width", "reduce", "dropout", "canvas", "state_to_head")
# Settings added after checkpoints without them were written: the value those checkpoints mean (a
# policy config leaves them out at that value).
SETTING_DEFAULTS = {"canvas": None, "state_to_head": False}


class GridMlpPolicy(DenseGridInput, StandardizedInput, nn.Module):
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
        add_state_input(self, state_dim)
        self.register_input_statistics(descriptor_dim)
        self.reduce = nn.Linear(descriptor_dim, reduce)
        self.canvas = canvas
        cells = grid.n if canvas is None else canvas.n
        self.mlp = nn.Sequential(nn.Flatten(), *readout_mlp(cells * reduce + state_dim, width, dropout))
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
        reduced = self.standardized_projection(self.reduce, grids, keep)
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



def build(spec: PolicySpec) -> nn.Module:
    spec.check_width_and_reduce("mlp policy")
    dims = spec.settings
    canvas = dims.get("canvas", SETTING_DEFAULTS["canvas"])
    if canvas is not None and (not isinstance(canvas, (list, tuple)) or len(canvas) != 2):
        raise ValueError(f"mlp canvas must be null or [rows, cols] (patches), got {canvas!r}")
    return GridMlpPolicy(spec.grid, spec.descriptor_dim, width=int(dims["width"]), reduce=int(dims["reduce"]),
                         dropout=float(dims["dropout"]), max_steering_rad=spec.max_steering_rad, state_dim=spec.state_dim,
                         canvas=None if canvas is None else PatchGrid(int(canvas[0]), int(canvas[1])),
                         state_to_head=bool(dims.get("state_to_head", SETTING_DEFAULTS["state_to_head"])))
