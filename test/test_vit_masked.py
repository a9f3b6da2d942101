"""Masked-attention per-patch descriptors (SPS eqs. 1-2) on the real DINOv2 ViT-S/14, checked
against references built from the transformers layers themselves with their own attention masks
(transformers passes them to torch's scaled_dot_product_attention)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from samples import sample_photo

from sps_driving.core.backbones.dinov2 import DinoV2Extractor
from sps_driving.core.backbones.vit_masked import MaskedViT
from sps_driving.core.grid import attention_bias, patch_masks

FRAME = sample_photo("grace_hopper.jpg")


@pytest.fixture(scope="module")
def state(extractor):
    return extractor.encode(FRAME)


def reference_tokens(model, pixels, masked_layer, attention_mask):
    """The transformers model run layer by layer, with `attention_mask` at `masked_layer`."""
    with torch.inference_mode():
        hidden = model.embeddings(pixels)
        for index, layer in enumerate(model.encoder.layer):
            hidden = layer(hidden, attention_mask if index == masked_layer else None)
        return model.layernorm(hidden)[0]


def full_mask(extractor, indices, suppression):
    """[1, 1, T, T] logit bias whose query row 1 + j is patch j's eq. 1 bias (CLS always attended)."""
    grid = extractor.grid
    mask = torch.zeros(1, 1, 1 + grid.n, 1 + grid.n)
    bias = attention_bias(patch_masks(grid, indices, extractor.encoder.falloff, extractor.encoder.alpha), suppression)
    mask[0, 0, 1 + torch.as_tensor(indices), 1:] = torch.from_numpy(bias)
    return mask


@pytest.mark.parametrize("input_size", [(224, 224), (224, 336)])
def test_hard_mask_with_infinite_suppression_equals_boolean_masked_attention(model, input_size):
    extractor = DinoV2Extractor(model, input_size=input_size, falloff="hard", alpha=1.5, suppression=float("-inf"))
    grid = extractor.grid
    indices = np.arange(grid.n)
    allowed = torch.ones(1, 1, 1 + grid.n, 1 + grid.n, dtype=torch.bool)
    allowed[0, 0, 1:, 1:] = torch.from_numpy(grid.distances <= 1.5)
    expected = reference_tokens(model, extractor.preprocess(FRAME), 11, allowed)[1:]
    got = extractor.descriptors(extractor.encode(FRAME), indices)
    assert got.shape == (grid.n, 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-4)
    unmasked = reference_tokens(model, extractor.preprocess(FRAME), 11, None)[1:]
    assert np.abs(got - unmasked.numpy()).max() > 0.5  # the mask really changes the descriptors


def test_finite_suppression_and_soft_falloff_follow_eq1(model):
    extractor = DinoV2Extractor(model, falloff="exp2", suppression=-3.0)
    indices = np.array([0, 17, 120, 255])
    expected = reference_tokens(model, extractor.preprocess(FRAME), 11, full_mask(extractor, indices, -3.0))
    got = extractor.descriptors(extractor.encode(FRAME), indices)
    np.testing.assert_allclose(got, expected[1 + indices].numpy(), atol=1e-4)


def test_strong_finite_suppression_approaches_the_hard_mask(model):
    indices = np.array([5, 130, 250])
    by_r = {}
    for r in (float("-inf"), -1e4, -1.0):
        extractor = DinoV2Extractor(model, suppression=r)
        by_r[r] = extractor.descriptors(extractor.encode(FRAME), indices)
    np.testing.assert_allclose(by_r[-1e4], by_r[float("-inf")], atol=1e-5)
    assert np.abs(by_r[-1.0] - by_r[float("-inf")]).max() > 0.1  # a weak r lets the masked patches in


# Earlier-layer masking runs the later layers once per patch: those tests use a small 8x8 input
# (interpolated position embeddings, same weights) to stay fast.
@pytest.mark.parametrize("masked_layer, input_size", [(11, (224, 224)), (4, (112, 112))])
def test_alpha_covering_the_grid_equals_the_unmasked_forward(model, masked_layer, input_size):
    extractor = DinoV2Extractor(
        model, input_size=input_size, masked_layer=masked_layer, alpha=100.0, suppression=float("-inf")
    )
    indices = np.arange(extractor.grid.n)
    with torch.inference_mode():
        unmasked = model(pixel_values=extractor.preprocess(FRAME)).last_hidden_state[0, 1:]
    got = extractor.descriptors(extractor.encode(FRAME), indices)
    np.testing.assert_allclose(got, unmasked[indices].numpy(), atol=1e-4)


@pytest.mark.parametrize("masked_layer, falloff, suppression", [(8, "hard", float("-inf")), (10, "inverse", -100.0)])
def test_earlier_layer_masking_equals_a_per_patch_full_forward(model, masked_layer, falloff, suppression):
    extractor = DinoV2Extractor(
        model, input_size=(112, 112), masked_layer=masked_layer, falloff=falloff, suppression=suppression
    )
    indices = np.array([3, 36, 63])
    pixels = extractor.preprocess(FRAME)
    got = extractor.descriptors(extractor.encode(FRAME), indices)
    for row, j in enumerate(indices):
        # eq. 1: every query row of the masked layer gets patch j's bias
        bias = attention_bias(patch_masks(extractor.grid, [j], falloff, extractor.encoder.alpha), suppression)[0]
        mask = torch.zeros(1, 1, 1, 65)
        mask[..., 1:] = torch.from_numpy(bias)
        expected = reference_tokens(model, pixels, masked_layer, mask)[1 + j]
        np.testing.assert_allclose(got[row], expected.numpy(), atol=1e-4)


@pytest.mark.parametrize("masked_layer", [11, 9])
def test_a_descriptor_does_not_depend_on_its_batch(model, masked_layer):
    extractor = DinoV2Extractor(model, input_size=(112, 112), masked_layer=masked_layer)
    state = extractor.encode(FRAME)
    alone = extractor.descriptors(state, np.array([42]))
    crowd = np.array([7, 42, 8, 20, 13, 63, 0, 50])
    together = extractor.descriptors(state, crowd)
    np.testing.assert_allclose(together[1], alone[0], atol=1e-5)
    # chunking to a tiny memory budget (one patch per pass) changes nothing either
    extractor.encoder.memory_budget_bytes = 1
    assert extractor.encoder.chunk_size(65, 384) == 1
    np.testing.assert_allclose(extractor.descriptors(state, crowd), together, atol=1e-5)


def test_shapes_for_square_and_non_square_grids(model):
    for input_size, (rows, cols) in [((224, 224), (16, 16)), ((224, 336), (16, 24)), ((112, 168), (8, 12))]:
        extractor = DinoV2Extractor(model, input_size=input_size)
        state = extractor.encode(FRAME)
        indices = np.arange(0, rows * cols, 3)
        values = extractor.descriptors(state, indices)
        assert values.shape == (len(indices), 384) and values.dtype == np.float32
        assert np.isfinite(values).all()
        dense = extractor.grid.scatter(values, indices)
        assert dense.shape == (rows, cols, 384)
        assert extractor.descriptors(state, np.array([], dtype=np.int64)).shape == (0, 384)


@pytest.mark.parametrize(
    "indices, message",
    [
        (np.array([0, 256]), r"\[0, 256\)"),
        (np.array([-1]), r"\[0, 256\)"),
        (np.array([1.0, 2.0]), "integer"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
    ],
)
def test_bad_indices_are_refused(extractor, state, indices, message):
    with pytest.raises(ValueError, match=message):
        extractor.descriptors(state, indices)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"masked_layer": -13}, "out of range"),
        ({"suppression": float("nan")}, "negative"),
        ({"suppression": 0.0}, "negative"),
        ({"alpha": -1.0}, "alpha"),
        ({"memory_budget_mb": 0}, "memory_budget_mb"),
    ],
)
def test_bad_masking_options_are_refused(model, extractor, options, message):
    with pytest.raises(ValueError, match=message):
        MaskedViT(list(model.encoder.layer), model.layernorm, extractor.grid, **options)


def test_hidden_states_of_another_grid_are_refused(model, extractor, state):
    other = DinoV2Extractor(model, input_size=(112, 112))
    with pytest.raises(ValueError, match="one frame"):
        other.descriptors(state, np.array([0]))
    with pytest.raises(ValueError, match="one frame"):
        extractor.encoder.descriptors(state.hidden.expand(2, -1, -1), np.array([0]))


def test_negative_masked_layer_counts_from_the_end(model, extractor):
    encoder = MaskedViT(list(model.encoder.layer), model.layernorm, extractor.grid, masked_layer=-3)
    assert encoder.masked_layer == 9 and not encoder.masks_last_layer
