"""The straightforward per-patch Q-Former, as a user of transformers would write it: the image
tokens expanded once per patch and the per-patch bias given as the encoder attention mask.

It recomputes the image tokens' keys and values in every cross-attention layer for every patch.
It is the reference that the fast path (`qformer.py`) must match and the benchmark's baseline.
"""

from __future__ import annotations

import torch
from torch import nn


def naive_query_outputs(
    qformer: nn.Module, query_tokens: torch.Tensor, image_tokens: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """image_tokens [T, E], bias [k, T] -> query outputs [k, Q, H] of transformers' Blip2QFormerModel."""
    patches = bias.shape[0]
    dtype = query_tokens.dtype
    outputs = qformer(
        query_embeds=query_tokens.expand(patches, -1, -1),
        encoder_hidden_states=image_tokens.to(dtype).expand(patches, -1, -1),
        # a 4D float mask is added to the attention logits as given: [k, 1, 1, T]
        encoder_attention_mask=bias.to(dtype)[:, None, None, :],
    )
    return outputs.last_hidden_state
