"""A policy that reads patches by their offset from the centre of the region of interest
(architecture "relative_query"), after Spatially Equivariant Patch Representations: no absolute
position anywhere, so moving what is visible together with the roi's centre moves the
representation and nothing else, and the policy runs on another grid without retraining.

- Tokens: each kept descriptor standardized with training statistics, projected to the model
  width and LayerNorm'd (as the positional transformer), and nothing else: no position embedding.
- Encoder: pre-norm self-attention over the kept tokens with a learned logit bias per head for
  each offset (drow, dcol) between two tokens, a function of the offset only (translation
  invariant), then a feed-forward layer.
- Queries: a fixed set of offsets from the roi's centre (patch units; the cells of the grid the
  policy was trained on, every `query_stride`-th row and column), each mapped by a small MLP to a
  query vector. The centre is the roi's (sps_driving.core.view.grid_center), never the centroid
  of the kept patches, which would move with every selection draw.
- Cross-attention from the queries to the encoded tokens, with a learned logit bias per head for
  each offset between a query's cell and a token's, then a feed-forward layer.
- Readout (`readout`): "flatten" reduces each query to `reduce` channels and reads them in query
  order with a two-layer MLP (each readout weight knows its offset from the centre); "pool"
  averages the queries and reads that with the MLP. The state inputs are appended, and the
  shared bounded head gives (steering rad, throttle).

The policy reads a window: the grid it was trained on, centred on the roi's centre. A token
outside it is left out as a dropped patch is, so on a wider grid (the wider view of
sps_driving.core.view, `set_view`) it reads the central window exactly as it read its training
grid, and every offset it meets was met in training. Both bias tables span the window's offsets.
They start local (head h weighs an offset d, in patches, by exp(-d / sigma_h), sigma from 1 patch
to the window's size), so each query starts by reading its neighbourhood.

All variants: sps and threshold are read as their kept tokens (a zero at a dropped patch means
"not kept"; the policy never sees it), spps and mspps as they are; so sps and spps give this
policy the same inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import (
    BoundedHead,
    PolicySpec,
    SequencePolicy,
    StandardizedInput,
    add_state_input,
    readout_mlp,
    with_state,
)
from sps_driving.core.policies.positional_transformer import SETTINGS as POSITIONAL_TRANSFORMER_SETTINGS
from sps_driving.core.view import grid_center

NAME = "relative_query"
SETTINGS = (*POSITIONAL_TRANSFORMER_SETTINGS, "query_stride", "readout")
READOUTS = ("flatten", "pool")


class RelativeBias(nn.Module):
    """A learned attention-logit bias per head for every offset (drow, dcol) with |drow| <= rows - 1
    and |dcol| <= cols - 1 of the window grid (offsets beyond are clamped; only masked tokens
    have them)."""

    def __init__(self, heads: int, window: PatchGrid):
        super().__init__()
        self.span = (window.rows - 1, window.cols - 1)
        rows = torch.arange(-self.span[0], self.span[0] + 1, dtype=torch.float32)
        cols = torch.arange(-self.span[1], self.span[1] + 1, dtype=torch.float32)
        distance = torch.sqrt(rows[:, None] ** 2 + cols[None, :] ** 2)  # patches
        # One length scale per head, geometric from 1 patch to the window's largest side.
        sigma = torch.logspace(0.0, math.log10(max(2.0, float(max(window.rows, window.cols)))), heads)
        self.table = nn.Parameter(-distance[None] / sigma[:, None, None])

    def forward(self, offsets: torch.Tensor) -> torch.Tensor:
        """offsets [B, Lq, Lk, 2] (drow, dcol) int64 -> bias [B, heads, Lq, Lk]."""
        rows = offsets[..., 0].clamp(-self.span[0], self.span[0]) + self.span[0]
        cols = offsets[..., 1].clamp(-self.span[1], self.span[1]) + self.span[1]
        bias = self.table.flatten(1)[:, rows * (2 * self.span[1] + 1) + cols]  # [heads, B, Lq, Lk]
        return bias.permute(1, 0, 2, 3)


class AttentionBlock(nn.Module):
    """Pre-norm multi-head attention with an additive logit bias (self-attention, or cross-attention
    to a context), then a pre-norm feed-forward layer; residual dropout, none on the weights."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, dropout: float, cross: bool = False):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.context_norm = nn.LayerNorm(width) if cross else None
        self.query = nn.Linear(width, width)
        self.key_value = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, width)
        self.ff_norm = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.ff = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, Lq, W], mask [B, heads, Lq, Lk] added to the logits, context [B, Lk, W] (None: x)."""
        batch, length, width = x.shape
        h = self.norm(x)
        c = h if context is None else self.context_norm(context)
        q = self.query(h).view(batch, length, self.heads, -1).transpose(1, 2)
        k, v = self.key_value(c).view(batch, c.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.ff(self.ff_norm(x)))


class RelativeQueryPolicy(SequencePolicy, StandardizedInput, nn.Module):
    """forward(descriptors [B, L, D], indices [B, L] of the view grid, padding [B, L] True at
    filler slots, state [B, S]) -> [B, 2] (steering rad, throttle); see the module docstring."""

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, depth: int, heads: int, mlp_ratio: float,
                 dropout: float, reduce: int, query_stride: int, readout: str, max_steering_rad: float, state_dim: int = 0):
        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"unknown readout {readout!r}; expected one of {READOUTS}")
        if query_stride < 1 or width % heads:
            raise ValueError(f"need query_stride >= 1 and width ({width}) a multiple of heads ({heads})")
        add_state_input(self, state_dim)
        self.register_input_statistics(descriptor_dim)
        self.window, self.readout = grid, readout
        self.register_buffer("half_extent", torch.tensor(grid_center(grid)), persistent=False)
        rows, cols = torch.meshgrid(torch.arange(0, grid.rows, query_stride), torch.arange(0, grid.cols, query_stride),
                                    indexing="ij")
        cells = torch.stack([rows.flatten(), cols.flatten()], dim=1).float()
        self.register_buffer("query_offsets", cells - self.half_extent, persistent=False)  # [Q, 2] patches
        self.input_proj = nn.Linear(descriptor_dim, width)
        self.input_norm = nn.LayerNorm(width)
        self.query_mlp = nn.Sequential(nn.Linear(2, width), nn.GELU(), nn.Linear(width, width))
        self.encoder = nn.ModuleList(AttentionBlock(width, heads, mlp_ratio, dropout) for _ in range(depth))
        self.encoder_bias = nn.ModuleList(RelativeBias(heads, grid) for _ in range(depth))
        self.cross = AttentionBlock(width, heads, mlp_ratio, dropout, cross=True)
        self.cross_bias = RelativeBias(heads, grid)
        self.norm = nn.LayerNorm(width)
        if readout == "flatten":
            self.reduce = nn.Linear(width, reduce)
            features = len(cells) * reduce
        else:
            self.reduce, features = None, width
        self.mlp = nn.Sequential(*readout_mlp(features + state_dim, width, dropout))
        self.head = BoundedHead(width // 2, max_steering_rad)
        self.set_view(grid)

    reads_a_window = True  # it reads the window about the centre of any grid that holds it (DrivingPolicy)

    def set_view(self, grid: PatchGrid, center: tuple[float, float] | None = None) -> None:
        """Read patch indices of `grid` from now on, about `center` (row, col in patch coordinates;
        default the roi's, `grid_center(grid)`), which must put the window's cells on the grid's."""
        center = grid_center(grid) if center is None else (float(center[0]), float(center[1]))
        origin = [c - h for c, h in zip(center, grid_center(self.window))]
        if not all(math.isclose(o, round(o), abs_tol=1e-9) for o in origin):
            raise ValueError(f"centre {center} puts this policy's {self.window.rows}x{self.window.cols} window between the "
                             f"cells of the {grid.rows}x{grid.cols} grid")
        device = self.half_extent.device
        cells = torch.from_numpy(grid.coords).to(device=device, dtype=torch.long)
        self.register_buffer("cells", cells, persistent=False)  # [N, 2] (row, col) of each index
        self.register_buffer("center", torch.tensor(center, device=device), persistent=False)
        query_cells = torch.round(self.query_offsets + self.center).long()
        self.register_buffer("query_cells", query_cells, persistent=False)  # [Q, 2]
        self.view = grid

    def queries(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        """The per-position representation: [B, Q, W], query q's features at cell `query_cells[q]`."""
        cells = self.cells[indices]  # [B, L, 2]
        outside = ((cells - self.center).abs() > self.half_extent + 1e-6).any(dim=-1)
        left_out = outside if padding is None else padding | outside
        blocked = torch.zeros(left_out.shape, dtype=descriptors.dtype, device=descriptors.device)
        blocked = blocked.masked_fill(left_out, torch.finfo(descriptors.dtype).min / 2)[:, None, None, :]
        tokens = self.input_norm(self.input_proj((descriptors - self.input_mean) / self.input_std))
        offsets = cells[:, :, None, :] - cells[:, None, :, :]
        for block, bias in zip(self.encoder, self.encoder_bias):
            tokens = block(tokens, bias(offsets) + blocked)
        query_offsets = self.query_cells[None, :, None, :] - cells[:, None, :, :]  # [B, Q, L, 2]
        start = self.query_mlp(self.query_offsets / self.half_extent.clamp(min=1.0))
        queries = self.cross(start.expand(len(tokens), -1, -1), self.cross_bias(query_offsets) + blocked, tokens)
        return self.norm(queries)

    def forward(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        queries = self.queries(descriptors, indices, padding)
        features = self.reduce(queries).flatten(1) if self.reduce is not None else queries.mean(dim=1)
        return self.head(self.mlp(with_state(self, features, state)))


def build(spec: PolicySpec) -> RelativeQueryPolicy:
    spec.check_width_and_reduce(f"{NAME} policy")
    return RelativeQueryPolicy(spec.grid, reduce=int(spec.settings["reduce"]), query_stride=int(spec.settings["query_stride"]),
                               readout=str(spec.settings["readout"]), **spec.transformer_arguments())
