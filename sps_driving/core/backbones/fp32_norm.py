"""LayerNorm computed in fp32 whatever the weights' dtype: fp16 LayerNorm overflows (its variance
of activations of a few hundred exceeds fp16's 65504), bf16 loses the mean. The one place every
backbone takes it from (the masked ViT, DINOv2, the Q-Former, BLIP-2's vision model)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def layer_norm_fp32(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(x)` computed in fp32, returned in x's dtype."""
    weight = None if norm.weight is None else norm.weight.float()
    bias = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, weight, bias, norm.eps).to(x.dtype)


def keep_layer_norms_fp32(module: nn.Module) -> None:
    """Make every LayerNorm inside `module` compute in fp32 (`layer_norm_fp32`). The weights keep
    their dtype: transformers' modules take their compute dtype from them."""
    for norm in module.modules():
        if isinstance(norm, nn.LayerNorm):
            norm.forward = lambda x, norm=norm: layer_norm_fp32(x, norm)
