"""The first transformers (architecture "transformer", kept so their checkpoints load and run as
they did): they read the raw descriptors, whose norms (~46 for DINOv2) swamp their position codes,
and end in a CLS token; they barely learned where things are (docs/training.md). A policy with
state inputs reads them as one more token (a linear embedding of the state vector).

- `GridPolicy`: one token per patch, zeros at dropped patches, plus a learned position embedding
  per patch (initialized at 0.02).
- `TableSequencePolicy`: only the kept descriptors, each with its ORIGINAL position embedding
  from the backbone's own table (`PatchExtractor.position_table()`, [N, P], a frozen buffer
  saved in the checkpoint) projected to the model width.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import BoundedHead, DenseGridInput, PolicySpec, SequencePolicy, add_state_input

SETTINGS = ("width", "depth", "heads", "mlp_ratio", "dropout")


class _TransformerPolicy(nn.Module):
    """CLS token + pre-norm transformer encoder + bounded (steering, throttle) head."""

    def __init__(self, width: int, depth: int, heads: int, mlp_ratio: float, dropout: float, max_steering_rad: float,
                 state_dim: int = 0):
        super().__init__()
        add_state_input(self, state_dim)
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


class GridPolicy(DenseGridInput, _TransformerPolicy):
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



def build(spec: PolicySpec) -> nn.Module:
    """A grid policy for sps and threshold; for spps and mspps a sequence policy over the
    backbone's position table, or, without one, a zero table of config "position_dim" that
    loading a checkpoint fills."""
    common = spec.transformer_arguments()
    if not spec.selection.sparse_sequence:
        return GridPolicy(spec.grid, **common)
    if spec.position_table is None:
        position_dim = spec.config.get("position_dim")
        if not position_dim:
            raise ValueError(f"a {spec.selection.variant} policy needs the backbone's position table or position_dim")
        table = torch.zeros(spec.grid.n, int(position_dim))
    else:
        table = torch.as_tensor(np.asarray(spec.position_table, dtype=np.float32))
        if table.ndim != 2 or table.shape[0] != spec.grid.n:
            raise ValueError(f"position table must be [{spec.grid.n}, P], got {tuple(table.shape)}")
    return TableSequencePolicy(table, **common)
