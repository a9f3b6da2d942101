"""Per-patch descriptors from a ViT by masked self-attention (SPS eqs. 1-2, Drive-Anywhere).

For patch j, the attention logits of the masked layer l get the additive bias (1 - m^(j)) r
(`grid.attention_bias`), added to the scaled logits q k^T / sqrt(d) that the softmax sees, as a
transformers attention mask is; the remaining layers then run unmasked and token j's output,
after the final LayerNorm, is patch j's descriptor. Prefix tokens (CLS, registers) are not
patches: every query always attends to them (bias 0), which also keeps every softmax row finite
when r = -inf.

Each piece of work is done once:
- layers before l run once per frame (`prefix`);
- masking the last layer (the default): only token j's output is needed and only row j of its
  attention depends on m^(j), so all requested patches come from one pass whose query rows are
  the k requested tokens, with a k x T bias (row j = patch j's bias); keys and values are
  computed once;
- masking an earlier layer: eq. 1 masks every query row of layer l with the same m^(j), so the
  later layers see a different sequence per patch; layer l's q, k, v are computed once and
  broadcast over a batch of patches, the later layers run batched (chunked to the memory
  budget), and the last layer computes only token j's query row.

Token dropping (`kept_descriptors`, config tokens "kept"): only the prefix tokens and the k kept
patches' tokens (each with its own position embedding, added before the gather) go through the
ViT, so every layer costs about k / N of the dense pass. The masked layer then sees the kept tokens
only: patch j's eq. 1 mask is its dense mask restricted to them, and a neighbour that was dropped
contributes nothing to j's descriptor (with the hard falloff, j attends to CLS and the kept patches
within alpha). So a kept patch's descriptor depends on which patches were kept, and differs from
its dense descriptor; at rate 1.0 (every patch kept) it is the dense descriptor.

Layers run on the weights of the transformers modules (no copy), with LayerNorm and attention
(softmax included) in fp32 so fp16/bf16 weights stay finite.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sps_driving.core.backbones.fp32_norm import layer_norm_fp32
from sps_driving.core.grid import FALLOFFS, PatchGrid, token_bias

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def _gather_tokens(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """x [B or 1, T, D], tokens [B', Tq] -> [B', Tq, D] (a batch of 1 is shared by all rows)."""
    batch = tokens.shape[0]
    rows = torch.arange(batch, device=tokens.device)[:, None]
    return x.expand(batch, -1, -1)[rows, tokens]


def block_forward(
    layer: nn.Module,
    hidden: torch.Tensor,
    bias: torch.Tensor | None = None,
    query_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pre-norm ViT block (a transformers `Dinov2Layer`) with an additive attention bias.

    hidden [B, T, D]; bias broadcastable to [B', heads, Tq, T], added to the scaled logits;
    query_tokens [B', Tq] computes only those tokens' outputs (keys and values still come from
    all T tokens). Batch dimensions broadcast, so hidden [1, T, D] with bias [c, 1, 1, T] gives
    c differently masked copies while q, k, v are computed once.
    """
    attn = layer.attention
    x = layer_norm_fp32(hidden, layer.norm1)
    if query_tokens is None:
        queries, residual = x, hidden
    else:
        queries, residual = _gather_tokens(x, query_tokens), _gather_tokens(hidden, query_tokens)
    heads = attn.num_attention_heads

    def split_heads(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (heads, -1)).transpose(-3, -2)

    q, k, v = (split_heads(t).float() for t in (attn.q_proj(queries), attn.k_proj(x), attn.v_proj(x)))
    if bias is not None and bias.shape[0] > q.shape[0]:  # the fused kernel does not broadcast batches
        q, k, v = (t.expand(bias.shape[0], -1, -1, -1) for t in (q, k, v))
    # A float attn_mask is added to the scaled logits q k^T * scaling before the softmax: eq. 1's
    # bias exactly. The fused kernel is faster than matmul + softmax written out (measured on CPU).
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scaling).to(x.dtype)
    context = context.transpose(-3, -2).flatten(-2)
    hidden = layer.layer_scale1(attn.o_proj(context)) + residual
    return hidden + layer.layer_scale2(layer.mlp(layer_norm_fp32(hidden, layer.norm2)))


class MaskedViT:
    """Masked-attention descriptor extraction over a stack of ViT blocks.

    masked_layer: index of the masked block, 0-based; None or -1 = the last (negative counts
    from the end). falloff / alpha (patches) / suppression r: the mask m^(j) = f(d_ij) and the
    strength of eq. 1 (r < 0; -inf is a hard mask). memory_budget_mb bounds the activations of
    one batched pass (MiB).
    """

    def __init__(
        self,
        layers: list[nn.Module],
        final_norm: nn.LayerNorm,
        grid: PatchGrid,
        num_prefix_tokens: int = 1,
        masked_layer: int | None = None,
        falloff: str = "hard",
        alpha: float = 1.5,
        suppression: float = -100.0,
        memory_budget_mb: float = 256.0,
    ):
        depth = len(layers)
        masked_layer = depth - 1 if masked_layer is None else int(masked_layer)
        if not -depth <= masked_layer < depth:
            raise ValueError(f"masked_layer {masked_layer} out of range for {depth} layers")
        if falloff not in FALLOFFS:
            raise ValueError(f"unknown mask falloff {falloff!r}; expected one of {FALLOFFS}")
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite distance >= 0 patches, got {alpha}")
        if not suppression < 0:  # also rejects nan
            raise ValueError(f"suppression strength r must be negative (or -inf), got {suppression}")
        if not memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be positive, got {memory_budget_mb}")
        self.layers = layers
        self.final_norm = final_norm
        self.grid = grid
        self.num_prefix_tokens = num_prefix_tokens
        self.masked_layer = masked_layer % depth
        self.falloff = falloff
        self.alpha = float(alpha)
        self.suppression = float(suppression)
        self.memory_budget_bytes = memory_budget_mb * 2**20
        self.heads = layers[0].attention.num_attention_heads

    @property
    def masks_last_layer(self) -> bool:
        return self.masked_layer == len(self.layers) - 1

    def prefix(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the unmasked layers before the masked one, once per frame: [1, T, D] -> [1, T, D]."""
        for layer in self.layers[: self.masked_layer]:
            tokens = block_forward(layer, tokens)
        return tokens

    def mask_bias(self, indices: np.ndarray, device: torch.device) -> torch.Tensor:
        """fp32 [k, T]: eq. 1's (1 - m^(j)) r over all tokens, 0 for the prefix tokens."""
        bias = token_bias(self.grid, indices, self.falloff, self.alpha, self.suppression, self.num_prefix_tokens)
        return torch.from_numpy(bias).to(device)

    def chunk_size(self, tokens: int, dim: int) -> int:
        """Patches per batched pass that fit the memory budget (fp32 logits, ~4D MLP hidden)."""
        if self.masks_last_layer:  # one query row per patch
            per_patch = 4 * (3 * self.heads * tokens + 8 * dim)
        else:  # a whole masked copy of the sequence per patch
            per_patch = 4 * tokens * (2 * self.heads * tokens + 8 * dim)
        return max(1, int(self.memory_budget_bytes // per_patch))

    def _checked(self, hidden: torch.Tensor, indices: np.ndarray) -> np.ndarray:
        """indices as int64 [k] after checking them and that `hidden` is one frame's [1, T, D]."""
        indices = np.asarray(indices)
        if indices.ndim != 1 or not (indices.size == 0 or np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(f"patch indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
        if indices.size and (indices.min() < 0 or indices.max() >= self.grid.n):
            raise ValueError(f"patch indices must lie in [0, {self.grid.n}), got {indices.min()}..{indices.max()}")
        frames, tokens, _ = hidden.shape
        if frames != 1 or tokens != self.num_prefix_tokens + self.grid.n:
            raise ValueError(
                f"expected the hidden states of one frame [1, {self.num_prefix_tokens + self.grid.n}, D], "
                f"got {list(hidden.shape)}"
            )
        return indices.astype(np.int64)

    def descriptors(self, hidden: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        """[k, D] descriptors of patch `indices` (int [k], row-major) from prefix() output [1, T, D]."""
        indices = self._checked(hidden, indices)
        _, tokens, dim = hidden.shape
        chunk = self.chunk_size(tokens, dim)
        outputs = [
            self._chunk(hidden, indices[start : start + chunk]) for start in range(0, len(indices), chunk)
        ]
        return torch.cat(outputs) if outputs else hidden.new_zeros(0, dim)

    def kept_descriptors(self, tokens: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        """Token dropping: [k, D] descriptors of patch `indices` (distinct, int [k]) from the embedded
        tokens of one frame [1, T, D] (position embeddings added), with only the prefix tokens and
        these patches' tokens run through the layers (module docstring)."""
        indices = self._checked(tokens, indices)
        if len(np.unique(indices)) != len(indices):
            raise ValueError("token dropping needs distinct patch indices: a repeated token would weigh twice in attention")
        dim = tokens.shape[-1]
        if not len(indices):
            return tokens.new_zeros(0, dim)
        kept = torch.from_numpy(np.concatenate([np.arange(self.num_prefix_tokens), indices + self.num_prefix_tokens]))
        kept = kept.to(tokens.device)
        hidden = self.prefix(tokens[:, kept])
        bias = self.mask_bias(indices, tokens.device)[:, kept]  # each patch's dense mask, on the kept tokens only
        chunk = self.chunk_size(len(kept), dim)
        return torch.cat([
            self.patch_forward(hidden, bias[start:start + chunk],
                               torch.arange(start, min(start + chunk, len(indices)), device=tokens.device) + self.num_prefix_tokens)
            for start in range(0, len(indices), chunk)
        ])

    def kept_forward(self, tokens: torch.Tensor, bias: torch.Tensor, patch_index: torch.Tensor) -> torch.Tensor:
        """kept_descriptors as tensors only, in one pass (what the ONNX export traces): embedded
        tokens [1, T, D], the patches' dense eq. 1 biases [k, T] and their indices [k] -> [k, D]."""
        prefix = self.num_prefix_tokens
        kept = torch.cat([torch.arange(prefix, device=patch_index.device), patch_index + prefix])
        hidden = self.prefix(tokens[:, kept])
        # Query positions prefix .. prefix + k - 1, written with k read from the input (a dynamic axis when traced).
        queries = torch.cumsum(torch.ones_like(patch_index), 0) - 1 + prefix
        return self.patch_forward(hidden, bias[:, kept], queries)

    def _chunk(self, hidden: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        bias = self.mask_bias(indices, hidden.device)
        query_tokens = torch.from_numpy(indices + self.num_prefix_tokens).to(hidden.device)
        return self.patch_forward(hidden, bias, query_tokens)

    def patch_forward(self, hidden: torch.Tensor, bias: torch.Tensor, query_tokens: torch.Tensor) -> torch.Tensor:
        """Descriptors [k, D] of the patches whose tokens are `query_tokens` [k], from the hidden
        states entering the masked layer [1, T, D] and their eq. 1 biases [k, T]. Tensors only, so
        the ONNX export traces this same code."""
        if self.masks_last_layer:
            out = block_forward(self.layers[-1], hidden, bias[None, None], query_tokens[None])[0]
        else:
            hidden = block_forward(self.layers[self.masked_layer], hidden, bias[:, None, None, :])
            for layer in self.layers[self.masked_layer + 1 : -1]:
                hidden = block_forward(layer, hidden)
            out = block_forward(self.layers[-1], hidden, query_tokens=query_tokens[:, None])[:, 0]
        return layer_norm_fp32(out, self.final_norm)
