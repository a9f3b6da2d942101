"""Positional transformers (architecture "positional_transformer", the one to train): every
descriptor channel standardized with training-set statistics (buffers the trainer sets with
`set_input_statistics`), projected to the model width and LayerNorm'd, plus a learned embedding
of its grid cell at the same scale (unit RMS); a pre-norm transformer encoder; then a per-cell
readout: each token reduced to `reduce` channels and put back at its cell (zeros at cells with no
token), the grid flattened in cell order and read by a two-layer MLP, so every readout weight
knows its cell, as in the grid MLP. The state inputs are concatenated to the flattened readout grid.

- `PositionalGridPolicy` (SPS, threshold, dense Drive-Anywhere): one token per patch, zeros at
  dropped patches (SPS eq. 4) before the standardization.
- `PositionalSequencePolicy` (SPPS, MSPPS; SPS section 3.4 v2): only the kept descriptors, each
  at its original cell; a batch of different lengths is padded and masked.
"""

from __future__ import annotations

import torch
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.policies.blocks import (
    CELL_EMBEDDING_STD,
    BoundedHead,
    DenseGridInput,
    FastDropout,
    FusedAttentionEncoderLayer,
    PolicySpec,
    SequencePolicy,
    StandardizedInput,
    StridedSelfAttention,
    add_state_input,
    readout_mlp,
    with_state,
)
from sps_driving.core.policies.transformer import SETTINGS as TRANSFORMER_SETTINGS

NAME = "positional_transformer"
SETTINGS = (*TRANSFORMER_SETTINGS, "reduce")


class _PositionalTransformer(StandardizedInput, nn.Module):
    """Standardized, LayerNorm'd tokens plus learned cell embeddings, a pre-norm transformer
    encoder, and a per-cell readout into the bounded (steering, throttle) head (module docstring)."""

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, depth: int, heads: int, mlp_ratio: float,
                 dropout: float, reduce: int, max_steering_rad: float, state_dim: int = 0):
        super().__init__()
        add_state_input(self, state_dim)
        self.register_input_statistics(descriptor_dim)
        self.input_proj = nn.Linear(descriptor_dim, width)
        self.input_norm = nn.LayerNorm(width)
        self.cell_embedding = nn.Parameter(torch.empty(grid.n, width))
        nn.init.trunc_normal_(self.cell_embedding, std=CELL_EMBEDDING_STD, a=-2 * CELL_EMBEDDING_STD,
                              b=2 * CELL_EMBEDDING_STD)
        layer = FusedAttentionEncoderLayer(
            width, heads, int(width * mlp_ratio), dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # No dropout on the attention weights (the feed-forward and residual dropout stay): PyTorch's
        # fused CPU attention takes none, and with it a training step ran ~3x faster (256 tokens).
        layer.self_attn.dropout = 0.0
        layer.self_attn = StridedSelfAttention.replacing(layer.self_attn)
        layer.dropout, layer.dropout1, layer.dropout2 = (FastDropout(dropout) for _ in range(3))
        # No nested-tensor fast path: padded batches and single frames must take the same arithmetic.
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.reduce = nn.Linear(width, reduce)
        self.mlp = nn.Sequential(*readout_mlp(grid.n * reduce + state_dim, width, dropout))
        self.head = BoundedHead(width // 2, max_steering_rad)

    def _read(self, descriptors: torch.Tensor, indices: torch.Tensor | None = None, padding: torch.Tensor | None = None,
              state: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """descriptors [B, L, D] at cells `indices` [B, L] (None: all N cells in order), padding
        [B, L] True at filler slots (and states [B, S]; keep [B, L] False at dropped patches, read as
        zeros) -> [B, 2] (steering rad, throttle)."""
        tokens = self.input_norm(self.standardized_projection(self.input_proj, descriptors, keep))
        tokens = tokens + (self.cell_embedding if indices is None else self.cell_embedding[indices])
        reduced = self.reduce(self.norm(self.encoder(tokens, src_key_padding_mask=padding)))
        if indices is None:
            cells = reduced
        else:  # each token back at its cell; cells without one (dropped patches) and filler slots read zeros
            if padding is not None:
                reduced = reduced.masked_fill(padding.unsqueeze(-1), 0.0)
            cells = reduced.new_zeros(reduced.shape[0], self.cell_embedding.shape[0], reduced.shape[-1])
            cells = cells.scatter_add(1, indices.unsqueeze(-1).expand(-1, -1, reduced.shape[-1]), reduced)
        return self.head(self.mlp(with_state(self, cells.flatten(1), state)))


class PositionalGridPolicy(DenseGridInput, _PositionalTransformer):
    def forward(self, grids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """grids [B, N, D] with zeros at dropped patches (and states [B, S]) -> [B, 2] (steering rad, throttle)."""
        return self._read(grids, state=state)

    def forward_selected(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Dense grids [B, N, D] and keep masks [B, N] (and states [B, S]); as forward on the zeroed grids."""
        return self._read(grids, state=state, keep=keep)


class PositionalSequencePolicy(SequencePolicy, _PositionalTransformer):
    def forward(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        """descriptors [B, L, D] of kept patches `indices` [B, L]; padding [B, L] True at filler slots."""
        return self._read(descriptors, indices, padding, state)



def build(spec: PolicySpec) -> nn.Module:
    spec.check_width_and_reduce(f"{NAME} policy")
    positional = PositionalSequencePolicy if spec.selection.sparse_sequence else PositionalGridPolicy
    return positional(spec.grid, reduce=int(spec.settings["reduce"]), **spec.transformer_arguments())
