"""Matmul FLOPs per frame of the DINOv2 per-patch extractor, counted from the model's shapes.

A multiply-add is 2 FLOPs; what is counted is what torch's FLOP counter counts (the test checks
it against `torch.utils.flop_counter.FlopCounterMode` on the real architecture): the patch
embedding's convolution, every Linear layer and the two attention products (q k^T and the
weights times v). LayerNorm, softmax, GELU, the bicubic resize of the position embeddings and the
eq. 1 bias add are left out: together a few % of the work, and not GEMM work that a peak measures.

Stages, as the extractor splits a frame (sps_driving.core.backbones.dinov2):

- encode: once per frame. Dense (tokens all): the patch embedding and every layer before the
  masked one on all T = prefix + N tokens. Token dropping (tokens kept): the patch embedding only.
  I-ViT (falloff none): the embedding and every layer it runs, on all tokens.
- descriptors: the k kept patches. Dense, masking the last layer: its keys and values of all T
  tokens, and queries, output projection and MLP of the k patches' rows only. Dense, masking an
  earlier layer: k masked copies of the sequence through the later layers. Token dropping: every
  layer on the T' = prefix + k kept tokens, the last one (when it is the masked one) for the k
  patches' rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViTShape:
    """What the FLOPs of a ViT depend on."""

    hidden: int  # D, channels per token
    layers: int
    mlp_hidden: int  # the MLP's inner width
    patch: int  # px per side of a patch
    channels: int = 3  # of the input image
    prefix: int = 1  # non-patch tokens (CLS)

    @classmethod
    def of(cls, model) -> ViTShape:
        """The shape of a transformers `Dinov2Model`."""
        config = model.config
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers,
                   mlp_hidden=int(config.hidden_size * config.mlp_ratio), patch=config.patch_size,
                   channels=config.num_channels)

    def linear(self, rows: int) -> int:
        """q, k, v, output projection and MLP of `rows` tokens."""
        return 2 * rows * (4 * self.hidden ** 2 + 2 * self.hidden * self.mlp_hidden)

    def attention(self, queries: int, keys: int) -> int:
        """q k^T and the weighted sum of values, all heads."""
        return 4 * queries * keys * self.hidden

    def layer(self, tokens: int) -> int:
        """One layer with every token a query."""
        return self.linear(tokens) + self.attention(tokens, tokens)

    def masked_rows(self, queries: int, tokens: int) -> int:
        """One layer computing only `queries` rows' outputs over all `tokens` keys and values."""
        d, m = self.hidden, self.mlp_hidden
        keys_values = 2 * tokens * 2 * d * d
        query_side = 2 * queries * (2 * d * d + 2 * d * m)  # q, output projection, MLP
        return keys_values + query_side + self.attention(queries, tokens)

    def embedding(self, patches: int) -> int:
        return 2 * patches * self.channels * self.patch ** 2 * self.hidden


def dinov2_flops(shape: ViTShape, patches: int, kept: int, masked_layer: int = -1, tokens: str = "all",
                 unmasked: bool = False) -> dict[str, int]:
    """{"encode": FLOPs, "descriptors": FLOPs} of one frame of `patches` patches with `kept` of them
    asked for (module docstring); masked_layer counts from the end when negative."""
    if not 0 <= kept <= patches:
        raise ValueError(f"kept patches must lie in 0..{patches}, got {kept}")
    layers = shape.layers
    masked = masked_layer % layers
    total = shape.prefix + patches
    embed = shape.embedding(patches)
    if unmasked:
        return {"encode": embed + layers * shape.layer(total), "descriptors": 0}
    if tokens == "kept":
        if kept == 0:
            return {"encode": embed, "descriptors": 0}
        sequence = shape.prefix + kept
        return {"encode": embed, "descriptors": masked * shape.layer(sequence) + _masked_tail(shape, masked, kept, sequence)}
    if tokens != "all":
        raise ValueError(f"unknown tokens {tokens!r}; expected all or kept")
    return {"encode": embed + masked * shape.layer(total), "descriptors": _masked_tail(shape, masked, kept, total) if kept else 0}


def _masked_tail(shape: ViTShape, masked: int, kept: int, tokens: int) -> int:
    """The masked layer and those after it, for `kept` patches over a sequence of `tokens`."""
    last = shape.layers - 1
    if masked == last:  # one pass: the kept patches' query rows
        return shape.masked_rows(kept, tokens)
    d = shape.hidden
    # The masked layer: q, k, v of the sequence once, then per patch its own masked copy.
    flops = 2 * tokens * 3 * d * d + kept * (shape.attention(tokens, tokens) + 2 * tokens * d * d
                                             + 2 * tokens * 2 * d * shape.mlp_hidden)
    flops += kept * (last - masked - 1) * shape.layer(tokens)  # the layers in between, per copy
    return flops + kept * shape.masked_rows(1, tokens)  # the last layer: each copy's own patch row
