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
- with hard masks (r = -inf), each patch attends only to the keys its mask keeps (gathered per
  patch, padded to the batch's largest count with an excluded key) instead of all T image tokens.

The layers run on the weights of the transformers modules (no copy), with LayerNorm and softmax
always in fp32 so fp16/bf16 weights stay finite (the known fp16 LayerNorm overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sps_driving.core.backbones.fp32_norm import layer_norm_fp32

_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in fp32. On the CPU, probabilities below the smallest normal float (what a finite
    r such as -100 leaves on suppressed tokens) become 0: subnormal operands make the following
    matmul over 50x slower there, and the change is below 1.2e-38."""
    probs = torch.softmax(logits.float(), dim=-1)
    if probs.device.type == "cpu" and not torch.jit.is_tracing():
        probs = F.threshold(probs, _SMALLEST_NORMAL, 0.0, inplace=not probs.requires_grad)
    return probs


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., S, H] -> [..., heads, S, H / heads]"""
    *lead, seq, hidden = x.shape
    return x.reshape(*lead, seq, heads, hidden // heads).transpose(-3, -2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[k, heads, S, d] -> [k, S, heads * d]"""
    return x.transpose(1, 2).flatten(2)


def _self_attention(block, hidden: torch.Tensor) -> torch.Tensor:
    """A Blip2QFormerAttention (self) block: multi-head attention, dense, residual LayerNorm.
    The fused kernel keeps its softmax accumulation in fp32 for fp16/bf16 inputs."""
    attn = block.attention
    heads = attn.num_attention_heads
    q = _split_heads(attn.query(hidden), heads)
    k = _split_heads(attn.key(hidden), heads)
    v = _split_heads(attn.value(hidden), heads)
    context = _merge_heads(F.scaled_dot_product_attention(q, k, v, scale=attn.scaling))
    return layer_norm_fp32(block.output.dense(context) + hidden, block.output.LayerNorm)


def _cross_output(block, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return layer_norm_fp32(block.output.dense(context) + residual, block.output.LayerNorm)


def _feed_forward(layer, hidden: torch.Tensor) -> torch.Tensor:
    intermediate = layer.intermediate_query(hidden)
    return layer_norm_fp32(layer.output_query.dense(intermediate) + hidden, layer.output_query.LayerNorm)


@dataclass
class QFormerFrame:
    """Per-frame work shared by all patches."""

    keys: list[torch.Tensor]  # per cross-attention layer: [heads, T, d], pre-multiplied by the logit scale
    values: list[torch.Tensor]  # per cross-attention layer: [heads, T, d]
    layer0_residual: torch.Tensor  # [Q, H] layer-0 self-attention output (cross-attention residual)
    layer0_logits: torch.Tensor  # [heads, Q, T] fp32 layer-0 scaled cross-attention logits before the bias


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
            # contiguous per head: the batched GEMMs against them are slow on strided operands
            keys.append(_split_heads(attn.key(image_tokens) * attn.scaling, attn.num_attention_heads).contiguous())
            values.append(_split_heads(attn.value(image_tokens), attn.num_attention_heads).contiguous())
        layer0 = self.qformer.encoder.layer[0]
        queries = layer_norm_fp32(self.query_tokens[0], self.qformer.layernorm)
        residual = _self_attention(layer0.attention, queries[None])[0]
        cross = layer0.crossattention.attention
        q = _split_heads(cross.query(residual), cross.num_attention_heads)
        logits = (q @ keys[0].transpose(-1, -2)).float()
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
                logits = frame.layer0_logits  # [heads, Q, T], shared by all patches
                if key_index is None:
                    logits = logits.unsqueeze(1)
                else:
                    logits = logits[:, :, key_index].transpose(1, 2)  # [heads, k, Q, K]
                context = _attend(logits, bias, frame.values[0], key_index, owned=key_index is not None)
                hidden = _cross_output(layer.crossattention, context, frame.layer0_residual)
            else:
                hidden = _self_attention(layer.attention, hidden)
                if layer.has_cross_attention:
                    cross_slot += 1
                    hidden = _cross_attention(layer, hidden, frame, cross_slot, bias, key_index)
            hidden = _feed_forward(layer, hidden)
        return hidden


def _cross_attention(layer, hidden, frame: QFormerFrame, slot: int, bias, key_index) -> torch.Tensor:
    attn = layer.crossattention.attention
    patches, queries, _ = hidden.shape
    q = _split_heads(attn.query(hidden), attn.num_attention_heads).transpose(0, 1)  # [heads, k, Q, d]
    keys = frame.keys[slot]  # [heads, T, d]
    if key_index is None:
        # every patch's queries stacked per head: one GEMM against the shared keys
        stacked = q.reshape(q.shape[0], patches * queries, -1)
        logits = (stacked @ keys.transpose(-1, -2)).view(q.shape[0], patches, queries, -1)
    else:
        logits = q @ keys[:, key_index].transpose(-1, -2)  # each patch against its own kept keys
    context = _attend(logits, bias, frame.values[slot], key_index, owned=True)
    return _cross_output(layer.crossattention, context, hidden)


def _attend(logits: torch.Tensor, bias: torch.Tensor, values: torch.Tensor, key_index, owned: bool) -> torch.Tensor:
    """logits [heads, k or 1, Q, K] + bias [k, K] -> fp32 softmax -> weighted values -> context [k, Q, H].
    values [heads, T, d] are shared by all patches (gathered per patch by key_index when given)."""
    bias = bias[None, :, None, :]
    # logits made for this batch take the bias in place (one large buffer less); shared ones must not
    logits = logits.add_(bias) if owned and logits.dtype == bias.dtype else logits + bias
    probs = softmax_fp32(logits).to(values.dtype)
    heads, patches, queries, width = probs.shape
    if key_index is None:
        context = (probs.reshape(heads, patches * queries, width) @ values).view(heads, patches, queries, -1)
    else:
        context = probs @ values[:, key_index]
    return context.permute(1, 2, 0, 3).reshape(patches, queries, -1)


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
