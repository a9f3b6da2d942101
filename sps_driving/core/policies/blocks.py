"""The building blocks every policy architecture shares: the bounded head, the state inputs'
standardizer, the descriptors' standardization, the two readout layers, the two ways a policy
takes a selection (the whole grid with zeros at dropped patches, or the kept tokens as a
sequence), and `PolicySpec`, what a builder reads from a policy config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sps_driving.core.grid import PatchGrid
from sps_driving.core.selection import SelectionConfig

# RMS of a positional transformer's cell embedding at initialization: that of the LayerNorm'd
# tokens it is added to, so where a token is weighs as much as what it shows from the first step.
CELL_EMBEDDING_STD = 1.0


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


def add_state_input(module: nn.Module, state_dim: int) -> None:
    """Give `module` its state standardizer (`module.state`, None without state inputs)."""
    module.state = StateStandardizer(state_dim) if state_dim else None


def with_state(module: nn.Module, features: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """features [B, F], with the standardized state [B, S] appended when the policy reads one."""
    if module.state is None:
        return features
    return torch.cat([features, module.state(state).to(features.dtype)], dim=1)


class DenseGridInput:
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


class StandardizedInput:
    """Descriptor channels standardized with the training set's per-channel mean and spread:
    buffers `input_mean`, `input_std` [D] the trainer sets (`set_input_statistics`), saved with the
    weights. A few channels carry most of the variance of foundation-model descriptors (DINOv2
    token norms ~46), and the road geometry lives in the small ones."""

    def register_input_statistics(self, descriptor_dim: int) -> None:
        self.register_buffer("input_mean", torch.zeros(descriptor_dim))
        self.register_buffer("input_std", torch.ones(descriptor_dim))

    @torch.no_grad()
    def set_input_statistics(self, mean: np.ndarray, std: np.ndarray) -> None:
        std = np.maximum(np.asarray(std, dtype=np.float32), 1e-6)
        self.input_mean.copy_(torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.input_std.copy_(torch.as_tensor(std))

    def standardized_projection(self, linear: nn.Linear, descriptors: torch.Tensor,
                                keep: torch.Tensor | None = None) -> torch.Tensor:
        """linear((descriptors * keep - mean) / std) [B, L, out] for descriptors [B, L, D] and keep
        masks [B, L] (None: all kept), with the standardization folded into the linear's weights and
        the mask applied to the projected channels: the same numbers for a fraction of the
        elementwise work on [B, L, D] (what training waited on)."""
        weight = linear.weight / self.input_std
        bias = linear.bias - weight @ self.input_mean
        projected = descriptors @ weight.T
        if keep is not None:
            projected = projected * keep.unsqueeze(-1).to(projected.dtype)
        return projected + bias


class FastDropout(nn.Dropout):
    """nn.Dropout whose mask, on the CPU, is drawn by numpy's PCG64 (32-bit uniforms, seeded by one
    draw from torch's generator, so torch.manual_seed fixes it as before): torch's CPU Bernoulli
    draws one Mersenne-twister number per element on one thread, and took a fifth of a
    positional transformer's training step on two threads (bench --train). Elsewhere, nn.Dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        uniforms = np.random.Generator(np.random.PCG64(seed)).bit_generator.random_raw((x.numel() + 1) // 2)
        dropped = uniforms.view(np.uint32)[:x.numel()] < np.uint32(round(self.p * 2 ** 32))
        mask = np.where(dropped, np.float32(0.0), np.float32(1.0 / (1.0 - self.p)))
        return x * torch.from_numpy(mask).view(x.shape).to(x.dtype)


class StridedSelfAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (same parameters, state-dict keys and results) whose forward, for
    batch-first self-attention without attention dropout, takes q, k and v as strided views of one
    projection and hands them to the fused kernel as they lie. The stock path transposes to
    sequence-first, copies q, k and v apart, and in the backward zero-fills and copies the same
    tensors again: about a fifth of a positional transformer's training step (bench --train).
    Anything else (weights asked for, a causal or explicit mask) is the stock path."""

    @classmethod
    def replacing(cls, attention: nn.MultiheadAttention) -> StridedSelfAttention:
        """This attention with `attention`'s settings and weights (built without drawing from the
        random generator, so the modules after it initialize as they did beside the stock one)."""
        with torch.random.fork_rng(devices=[]):
            strided = cls(attention.embed_dim, attention.num_heads, dropout=attention.dropout,
                          bias=attention.in_proj_bias is not None, batch_first=attention.batch_first)
        strided.load_state_dict(attention.state_dict())
        return strided

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if not (query is key and key is value and self.batch_first and not need_weights
                and attn_mask is None and not is_causal and self.dropout == 0.0 and self._qkv_same_embed_dim
                and self.in_proj_bias is not None and self.bias_k is None and not self.add_zero_attn):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                                   attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        batch, length, width = query.shape
        qkv = nn.functional.linear(query, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None
        if key_padding_mask is not None:  # True (or -inf) at filler slots, as the stock path reads it
            if key_padding_mask.dtype == torch.bool:
                key_padding_mask = torch.zeros_like(key_padding_mask, dtype=q.dtype).masked_fill(key_padding_mask,
                                                                                               float("-inf"))
            mask = key_padding_mask.to(q.dtype).view(batch, 1, 1, length)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(attended.transpose(1, 2).reshape(batch, length, width)), None


class FusedAttentionEncoderLayer(nn.TransformerEncoderLayer):
    """A pre-norm nn.TransformerEncoderLayer (same parameters and state-dict keys) that always takes
    the composable path, so its StridedSelfAttention reaches the fused attention kernel. PyTorch's
    inference fast path computes the attention as batched products and a separate softmax: on one
    CPU thread a positional transformer's forward took 1.2x as long that way (`sps-driving bench
    --policy-forward`, docs/results/driving/ood_policy/README.md)."""

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        x = src + self._sa_block(self.norm1(src), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + self._ff_block(self.norm2(x))


def readout_mlp(features: int, width: int, dropout: float) -> list[nn.Module]:
    """The two hidden layers (width, width // 2) that read a flattened grid (and the state)."""
    return [nn.Linear(features, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width // 2), nn.GELU()]



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



@dataclass(frozen=True)
class PolicySpec:
    """What an architecture's builder reads from a policy config (sps_driving.core.policies.registry
    checks and gathers it)."""

    config: dict  # the whole policy config, for a builder's own keys (cnn: backbone; transformer: position_dim)
    grid: PatchGrid
    descriptor_dim: int
    selection: SelectionConfig
    settings: dict  # config "policy": the architecture's settings
    max_steering_rad: float
    state_dim: int
    position_table: np.ndarray | None  # the backbone's [N, P] table, for the transformer's sequence policies

    def check_width_and_reduce(self, what: str) -> None:
        if int(self.settings["width"]) < 2 or int(self.settings["reduce"]) < 1:
            raise ValueError(f"{what} needs width >= 2 and reduce >= 1, got {self.settings}")

    def transformer_arguments(self) -> dict:
        """The keyword arguments every transformer policy takes."""
        dims = self.settings
        return dict(descriptor_dim=self.descriptor_dim, width=int(dims["width"]), depth=int(dims["depth"]),
                    heads=int(dims["heads"]), mlp_ratio=float(dims["mlp_ratio"]), dropout=float(dims["dropout"]),
                    max_steering_rad=self.max_steering_rad, state_dim=self.state_dim)
