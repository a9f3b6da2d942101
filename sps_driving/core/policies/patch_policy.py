"""Patch policy (architecture "patch_policy"): a block-causal transformer over every kept patch of
the last T frames.

After "Patch Policy" (Zhou et al.): the frozen ViT's patch tokens are kept instead of pooled, and a
light transformer reads several frames under a block-causal mask, each token attending fully
within its own frame and to every earlier frame, never to a later one. Here each frame brings the
patches its selection kept (SPS: a different subset every frame), so a window can gather what
single frames miss.

Tokens, per frame of the window (oldest first, frame index f = 0 .. T - 1):

- one per kept patch: its descriptor standardized per channel with training statistics (as the
  grid MLP and the positional transformer), reduced to `reduce` channels by one map shared by all
  patches (as the grid MLP), projected to the model width and LayerNorm'd, plus a learned
  embedding of the patch's grid cell and one of the frame index f, both at the tokens' scale
  (unit RMS, as the positional transformer's cell embedding);
- one readout token: a learned vector plus the frame index embedding, plus, for a policy with state
  inputs, a linear embedding of that frame's standardized state (speed, cruise target speed).

A frame's block is [readout, kept patches]; a token of frame f attends to every token of frames
0 .. f (the block-causal mask M[q, k] = 0 where frame(k) <= frame(q), -inf elsewhere). Blocks are of
equal length (padded), so the keys frame f may read are a prefix of the window: the encoder runs
one attention per frame over that prefix (`_block_causal_layer`) instead of one masked attention
over the window, which gives the same result without building an [S, S] mask (a window of four
frames at rate 0.5: 580 tokens) and without the products with later frames' keys.

Frame f's command is read from its readout token: the final LayerNorm, the frame's standardized
state appended, two MLP layers (width, width / 2) and the bounded head shared by every policy.
The readout of frame f depends on frames 0 .. f and their embeddings 0 .. f only, exactly as the
newest readout of a window of f + 1 frames: so training puts a loss on every readout, and a window
shorter than T (after a start or a reset of the history) needs nothing but fewer frames. Windows
of several lengths in one batch are padded at the end (absent frames and filler patch slots are
masked out as keys).

The window itself (stride, tolerance, resets) is `sps_driving.core.history`'s; `StreamingPolicy` (.streaming)
steps a loaded policy one camera frame at a time through a `FrameHistory`, the one way the policy
node, replay, the in-process and the graph evaluation run a patch policy. One frame alone is a
window of one: `DrivingPolicy.predict` and the occlusion attribution read a patch policy that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sps_driving.core.grid import PatchGrid
from sps_driving.core.history import PATCH_POLICY, WINDOW_SETTINGS, HistorySettings
from sps_driving.core.policies.blocks import (
    CELL_EMBEDDING_STD,
    BoundedHead,
    PolicySpec,
    SequencePolicy,
    StandardizedInput,
    add_state_input,
    pack_kept,
    readout_mlp,
)
from sps_driving.core.policies.positional_transformer import SETTINGS as POSITIONAL_TRANSFORMER_SETTINGS

# A positional transformer's settings and its window's.
SETTINGS = (*POSITIONAL_TRANSFORMER_SETTINGS, *WINDOW_SETTINGS)


def _block_causal_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor, block: int,
                        filler: torch.Tensor) -> torch.Tensor:
    """One pre-norm encoder layer (its own weights, dropouts and activation, as its forward would
    apply them) over windows x [B, F * block, W] of F frame blocks, under the block-causal mask:
    frame f's queries attend to the keys of frames 0 .. f, a prefix of the window. filler [B, S]
    is True at keys no query may read (filler slots and absent frames)."""
    attention = layer.self_attn
    batch, tokens, width = x.shape
    heads = attention.num_heads
    q, k, v = (t.reshape(batch, tokens, heads, width // heads).transpose(1, 2)
               for t in F.linear(layer.norm1(x), attention.in_proj_weight, attention.in_proj_bias).chunk(3, dim=-1))
    readable = None if not bool(filler.any()) else ~filler[:, None, None, :]
    attended = torch.cat([
        F.scaled_dot_product_attention(q[:, :, start:start + block], k[:, :, :start + block], v[:, :, :start + block],
                                       attn_mask=None if readable is None else readable[..., :start + block])
        for start in range(0, tokens, block)
    ], dim=2)
    x = x + layer.dropout1(attention.out_proj(attended.transpose(1, 2).reshape(batch, tokens, width)))
    return x + layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(layer.norm2(x))))))


class PatchPolicy(SequencePolicy, StandardizedInput, nn.Module):
    """The patch policy (module docstring). `forward_windows` reads windows of frames; `forward`
    and `forward_selected` of single frames (or of windows of dense grids) as every policy does."""

    def __init__(self, grid: PatchGrid, descriptor_dim: int, width: int, depth: int, heads: int, mlp_ratio: float,
                 dropout: float, reduce: int, max_steering_rad: float, history: HistorySettings,
                 shared_selection: bool, state_dim: int = 0):
        super().__init__()
        add_state_input(self, state_dim)
        self.register_input_statistics(descriptor_dim)
        self.history, self.shared_selection = history, bool(shared_selection)
        self.reduce = nn.Linear(descriptor_dim, reduce)
        self.input_proj = nn.Linear(reduce, width)
        self.input_norm = nn.LayerNorm(width)
        self.cell_embedding = nn.Parameter(torch.empty(grid.n, width))
        self.frame_embedding = nn.Parameter(torch.empty(history.window_frames, width))
        for embedding in (self.cell_embedding, self.frame_embedding):
            nn.init.trunc_normal_(embedding, std=CELL_EMBEDDING_STD, a=-2 * CELL_EMBEDDING_STD, b=2 * CELL_EMBEDDING_STD)
        self.readout_token = nn.Parameter(torch.zeros(width))
        self.state_proj = nn.Linear(state_dim, width) if state_dim else None
        layer = nn.TransformerEncoderLayer(
            width, heads, int(width * mlp_ratio), dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # The layers' weights; `_block_causal_layer` runs them (nn.TransformerEncoder's forward would need the
        # mask), with no dropout on the attention weights, as the positional transformer.
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(*readout_mlp(width + state_dim, width, dropout))
        self.head = BoundedHead(width // 2, max_steering_rad)

    def forward_windows(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor,
                        state: torch.Tensor | None = None) -> torch.Tensor:
        """[B, F, 2] (steering rad, throttle) read at every frame's readout, for windows of F <= T
        frames, oldest first: descriptors [B, F, L, D] of the kept patches `indices` [B, F, L],
        padding [B, F, L] True at filler slots (a frame of only filler is absent: windows shorter
        than F end with such frames; their rows of the output mean nothing), states [B, F, S]."""
        batch, frames, length, _ = descriptors.shape
        if frames > self.frame_embedding.shape[0]:
            raise ValueError(f"a window of {frames} frames is longer than this policy's {self.frame_embedding.shape[0]}")
        if bool(padding[:, 0].all(dim=1).any()):
            raise ValueError("every window needs its first frame")
        width = self.frame_embedding.shape[1]
        tokens = self.input_norm(self.input_proj(self.reduce((descriptors - self.input_mean) / self.input_std)))
        tokens = tokens + self.cell_embedding[indices]
        readout = self.readout_token.expand(batch, frames, width)
        if self.state is not None:
            standardized = self.state(None if state is None else state.reshape(batch * frames, -1)).to(tokens.dtype)
            readout = readout + self.state_proj(standardized).reshape(batch, frames, width)
        blocks = torch.cat([readout.unsqueeze(2), tokens], dim=2) + self.frame_embedding[:frames, None]
        tokens_per_window = frames * (1 + length)
        absent = padding.all(dim=2, keepdim=True)
        filler = torch.cat([absent, padding], dim=2).reshape(batch, tokens_per_window)
        encoded = self.encode(blocks.reshape(batch, tokens_per_window, width), 1 + length, filler)
        readouts = self.norm(encoded.reshape(batch, frames, 1 + length, width)[:, :, 0]).reshape(batch * frames, width)
        if self.state is not None:
            readouts = torch.cat([readouts, standardized], dim=1)
        return self.head(self.mlp(readouts)).reshape(batch, frames, 2)

    def encode(self, tokens: torch.Tensor, block: int, filler: torch.Tensor) -> torch.Tensor:
        """The encoder layers over windows tokens [B, F * block, W] of F frame blocks of `block`
        tokens under the block-causal mask; filler [B, F * block] True at keys no query reads."""
        for layer in self.encoder.layers:
            tokens = _block_causal_layer(layer, tokens, block, filler)
        return tokens

    def forward(self, descriptors: torch.Tensor, indices: torch.Tensor, padding: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> torch.Tensor:
        """Single frames, each a window of one: descriptors [B, L, D] of kept patches `indices` [B, L],
        padding [B, L] True at filler slots, states [B, S] -> [B, 2]."""
        if padding is None:
            padding = torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)
        return self.forward_windows(descriptors[:, None], indices[:, None], padding[:, None],
                                    None if state is None else state[:, None])[:, 0]

    def forward_selected(self, grids: torch.Tensor, keep: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """Dense grids and keep masks: single frames (grids [B, N, D], keep [B, N], states [B, S]
        -> [B, 2]) or windows (grids [B, F, N, D], keep [B, F, N], states [B, F, S] -> [B, F, 2];
        an absent frame keeps nothing, and absent frames come last)."""
        if grids.ndim == 3:
            return super().forward_selected(grids, keep, state)
        batch, frames = keep.shape[:2]
        descriptors, indices, padding = pack_kept(grids.flatten(0, 1), keep.flatten(0, 1))
        return self.forward_windows(descriptors.unflatten(0, (batch, frames)), indices.unflatten(0, (batch, frames)),
                                    padding.unflatten(0, (batch, frames)), state)


def build(spec: PolicySpec) -> PatchPolicy:
    """The patch policy of a config's `policy` settings (config/train.yaml names them)."""
    settings = spec.settings
    history = HistorySettings(settings["window_frames"], settings["frame_stride_s"], settings["stride_tolerance_s"],
                              settings["max_gap_s"])
    spec.check_width_and_reduce(PATCH_POLICY)
    if not isinstance(settings["shared_selection"], bool):
        raise ValueError(f"shared_selection must be true or false, got {settings['shared_selection']!r}")
    return PatchPolicy(spec.grid, spec.descriptor_dim, width=int(settings["width"]), depth=int(settings["depth"]),
                       heads=int(settings["heads"]), mlp_ratio=float(settings["mlp_ratio"]),
                       dropout=float(settings["dropout"]), reduce=int(settings["reduce"]),
                       max_steering_rad=spec.max_steering_rad, history=history,
                       shared_selection=settings["shared_selection"], state_dim=spec.state_dim)


def window_tensors(frames: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]], descriptor_dim: int,
                   device) -> tuple[torch.Tensor, ...]:
    """One window's frames [(descriptors [k, D], indices [k], state vector [S] or None)], oldest
    first, as forward_windows' batch of one: descriptors, indices, padding and states (or None)."""
    length = max(len(indices) for _, indices, _ in frames)
    descriptors = np.zeros((1, len(frames), length, descriptor_dim), dtype=np.float32)
    indices = np.zeros((1, len(frames), length), dtype=np.int64)
    padding = np.ones((1, len(frames), length), dtype=bool)
    for f, (values, kept, _) in enumerate(frames):
        descriptors[0, f, : len(kept)], indices[0, f, : len(kept)], padding[0, f, : len(kept)] = values, kept, False
    tensors = [torch.from_numpy(a).to(device) for a in (descriptors, indices, padding)]
    states = None if frames[0][2] is None else torch.from_numpy(np.stack([s for _, _, s in frames])[None]).to(device)
    return (*tensors, states)

