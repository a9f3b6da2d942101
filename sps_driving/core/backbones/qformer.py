"""Per-patch BLIP-2 Q-Former (SPS eq. 1 at the cross-attention to image tokens), doing each
piece of work once per frame.

For patch j the Q-Former's cross-attention logits get the additive bias (1 - m^(j)) r over the
image tokens (added to the scaled logits, as a transformers attention mask is). Everything that
does not depend on j is shared:

- the keys and values of the image tokens in every cross-attention layer (the straightforward
  way, `qformer_naive.py`, recomputes them for every patch: about half of its FLOPs);
- layer 0 up to the cross-attention logits: the query tokens, their LayerNorm and layer-0
  self-attention, the cross-attention query projection and Q K^T are the same for every patch,
  so only the bias, softmax and the weighted sum of values run per patch there;
- with hard masks (r = -inf), keys that no patch of a batch attends to are dropped, and each
  patch attends only to its own kept keys (padded to the batch's largest count).

The layers run on the weights of the transformers modules (no copy), with LayerNorm and softmax
always in fp32 so fp16/bf16 weights stay finite (the known fp16 LayerNorm overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def layer_norm_fp32(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(
        x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps
    ).to(x.dtype)


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., S, H] -> [..., heads, S, H / heads]"""
    *lead, seq, hidden = x.shape
    return x.reshape(*lead, seq, heads, hidden // heads).transpose(-3, -2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[..., heads, S, d] -> [..., S, heads * d]"""
    *lead, heads, seq, head_dim = x.shape
    return x.transpose(-3, -2).reshape(*lead, seq, heads * head_dim)


def _self_attention(block, hidden: torch.Tensor) -> torch.Tensor:
    """A Blip2QFormerAttention (self) block: multi-head attention, dense, residual LayerNorm."""
    attn = block.attention
    heads = attn.num_attention_heads
    q = _split_heads(attn.query(hidden), heads)
    k = _split_heads(attn.key(hidden), heads)
    v = _split_heads(attn.value(hidden), heads)
    probs = softmax_fp32(q @ k.transpose(-1, -2) * attn.scaling).to(v.dtype)
    context = _merge_heads(probs @ v)
    return layer_norm_fp32(block.output.dense(context) + hidden, block.output.LayerNorm)


def _cross_output(block, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return layer_norm_fp32(block.output.dense(context) + residual, block.output.LayerNorm)


def _feed_forward(layer, hidden: torch.Tensor) -> torch.Tensor:
    intermediate = layer.intermediate_query(hidden)
    return layer_norm_fp32(layer.output_query.dense(intermediate) + hidden, layer.output_query.LayerNorm)


@dataclass
class QFormerFrame:
    """Per-frame work shared by all patches."""

    keys: list[torch.Tensor]  # per cross-attention layer: [heads, T, d]
    values: list[torch.Tensor]  # per cross-attention layer: [heads, T, d]
    layer0_residual: torch.Tensor  # [Q, H] layer-0 self-attention output (cross-attention residual)
    layer0_logits: torch.Tensor  # [heads, Q, T] layer-0 scaled cross-attention logits before the bias


class PatchQFormer(nn.Module):
    """Q-Former query outputs for a batch of per-patch attention biases over one frame's image tokens."""

    def __init__(self, qformer: nn.Module, query_tokens: torch.Tensor):
        super().__init__()
        self.qformer = qformer
        self.query_tokens = query_tokens  # [1, Q, H]
        self.cross_layers = [i for i, layer in enumerate(qformer.encoder.layer) if layer.has_cross_attention]
        if self.cross_layers[:1] != [0]:
            raise ValueError("the Q-Former's first layer must cross-attend to the image tokens")

    def frame(self, image_tokens: torch.Tensor) -> QFormerFrame:
        """image_tokens [T, E] (the vision model's output, CLS first) -> the shared per-frame work."""
        dtype = self.query_tokens.dtype
        image_tokens = image_tokens.to(dtype)
        keys, values = [], []
        for i in self.cross_layers:
            attn = self.qformer.encoder.layer[i].crossattention.attention
            keys.append(_split_heads(attn.key(image_tokens), attn.num_attention_heads))
            values.append(_split_heads(attn.value(image_tokens), attn.num_attention_heads))
        layer0 = self.qformer.encoder.layer[0]
        queries = layer_norm_fp32(self.query_tokens[0], self.qformer.layernorm)
        residual = _self_attention(layer0.attention, queries)
        cross = layer0.crossattention.attention
        q = _split_heads(cross.query(residual), cross.num_attention_heads)
        logits = q @ keys[0].transpose(-1, -2) * cross.scaling
        return QFormerFrame(keys, values, residual, logits)

    def forward(self, frame: QFormerFrame, bias: torch.Tensor, skip_excluded_keys: bool = True) -> torch.Tensor:
        """bias [k, T] additive logit bias per patch (0 = keep, r < 0 suppress, -inf exclude)
        -> query outputs [k, Q, H]."""
        bias = bias.float()
        key_index = None
        if skip_excluded_keys and not torch.jit.is_tracing() and torch.isinf(bias).any():
            key_index, bias = _kept_keys(bias)
        cross_slot = 0
        hidden = None
        for i, layer in enumerate(self.qformer.encoder.layer):
            if i == 0:
                logits = frame.layer0_logits.float()  # [heads, Q, T]
                if key_index is None:
                    logits = logits.unsqueeze(0)
                else:
                    logits = logits[:, :, key_index].permute(2, 0, 1, 3)  # [k, heads, Q, K]
                probs = softmax_fp32(logits + bias[:, None, None, :])
                context = _merge_heads(_attend(probs, frame.values[0], key_index))
                hidden = _cross_output(layer.crossattention, context, frame.layer0_residual)
            else:
                hidden = _self_attention(layer.attention, hidden)
                if layer.has_cross_attention:
                    cross_slot += 1
                    hidden = self._cross_attention(layer, hidden, frame, cross_slot, bias, key_index)
            hidden = _feed_forward(layer, hidden)
        return hidden

    @staticmethod
    def _cross_attention(layer, hidden, frame: QFormerFrame, slot: int, bias, key_index) -> torch.Tensor:
        attn = layer.crossattention.attention
        q = _split_heads(attn.query(hidden), attn.num_attention_heads)  # [k, heads, Q, d]
        keys = frame.keys[slot]
        if key_index is None:
            logits = q @ keys.transpose(-1, -2)
        else:
            # [k, heads, Q, d] x [k, heads, d, K]: each patch against its own kept keys
            logits = q @ keys[:, key_index].permute(1, 0, 3, 2)
        probs = softmax_fp32(logits * attn.scaling + bias[:, None, None, :])
        context = _merge_heads(_attend(probs, frame.values[slot], key_index))
        return _cross_output(layer.crossattention, context, hidden)


def _attend(probs: torch.Tensor, values: torch.Tensor, key_index: torch.Tensor | None) -> torch.Tensor:
    """probs [k, heads, Q, K] (fp32) x values [heads, T, d] (or gathered by key_index [k, K])."""
    if key_index is not None:
        values = values[:, key_index].transpose(0, 1)  # [k, heads, K, d]
    return probs.to(values.dtype) @ values


def _kept_keys(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each patch, the indices of the keys its bias does not exclude, padded to the batch's
    largest count with an excluded key: (index [k, K] int64, gathered bias [k, K])."""
    kept = torch.isfinite(bias)
    counts = kept.sum(dim=1)
    if int(counts.min()) == 0:
        raise ValueError("a patch's attention bias excludes every image token")
    width = int(counts.max())
    # stable sort puts kept keys first, in their original order
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :width]
    return order, torch.gather(bias, 1, order)


def itc_embeddings(query_outputs: torch.Tensor, vision_projection: nn.Linear) -> torch.Tensor:
    """[k, Q, H] query outputs -> [k, P] one unit vector per patch in BLIP-2's image-text space:
    each query's ITC embedding (vision_projection, L2-normalized, as Blip2ForImageTextRetrieval),
    then their mean over the queries, renormalized."""
    per_query = F.normalize(vision_projection(query_outputs).float(), dim=-1)
    return F.normalize(per_query.mean(dim=1), dim=-1)
