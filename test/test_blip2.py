"""BLIP-2 per-patch descriptors: the fast Q-Former path against transformers' own model.

All models here are tiny random configs of the real classes (Blip2ForImageTextRetrieval with
tiny dims, weights drawn with std 0.1 so patches differ clearly); no checkpoint is needed.
"""

import numpy as np
import pytest
import torch
from transformers import BertTokenizer

from sps_driving.core.backbones.blip2 import (
    PIXEL_MEAN,
    PIXEL_STD,
    Blip2Extractor,
    Blip2WeightsMissing,
    fit_pca_head,
    load_head,
    save_head,
    tiny_blip2_config,
)
from sps_driving.core.image import normalized_pixels

WORDS = "a the car road snow rain night on in is of dog deer truck winter lane".split()


def tokenizer():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    return BertTokenizer(vocab={w: i for i, w in enumerate(specials + WORDS)})


@pytest.fixture(scope="module")
def model():
    return Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16}, seed=3).model


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(7).integers(0, 256, (60, 96, 3), dtype=np.uint8)


def extractor(model, **options):
    return Blip2Extractor(model, {"dim": 16, **options}, tokenizer=tokenizer())


MASKS = [
    dict(falloff="hard", alpha=1.5, suppression=float("-inf")),
    dict(falloff="hard", alpha=1.0, suppression=-4.0),
    dict(falloff="exp2", suppression=-6.0),
    dict(falloff="inverse", suppression=-3.0, cls_mask=0.0),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"{m['falloff']}{m['suppression']}")
def test_fast_matches_naive_transformers_qformer(model, image, mask):
    fast, naive = extractor(model, **mask), extractor(model, implementation="naive", **mask)
    indices = np.arange(fast.grid.n)
    ours = fast.descriptors(fast.encode(image), indices)
    reference = naive.descriptors(naive.encode(image), indices)
    assert ours.shape == (16, 16) and ours.dtype == np.float32
    assert np.abs(ours - reference).max() <= 1e-5
    # not vacuous: the mask changes the descriptor clearly more than the tolerance
    assert ours.std(axis=0).mean() > 1e-3


def test_query_outputs_match_before_projection(model, image):
    fast, naive = extractor(model, suppression=-2.0), extractor(model, implementation="naive", suppression=-2.0)
    bias = fast.token_bias(np.arange(16))
    ours = fast.query_outputs(fast.encode(image), bias)
    reference = naive.query_outputs(naive.encode(image), bias)
    assert ours.shape == (16, 4, 32)
    assert (ours - reference).abs().max().item() <= 1e-5


def test_hard_mask_with_infinite_r_equals_transformers_padding_mask(model, image):
    fast = extractor(model, falloff="hard", alpha=1.0, suppression=float("-inf"))
    state = fast.encode(image)
    bias = fast.token_bias(np.arange(16))
    keep = torch.isfinite(bias).long()  # the library's own 0/1 encoder attention mask
    with torch.inference_mode():
        reference = model.qformer(
            query_embeds=model.query_tokens.expand(16, -1, -1),
            encoder_hidden_states=state.image_tokens.expand(16, -1, -1),
            encoder_attention_mask=keep,
        ).last_hidden_state
    assert (fast.query_outputs(state, bias) - reference).abs().max().item() <= 1e-5


def test_skipping_excluded_keys_changes_nothing(model, image):
    fast = extractor(model, falloff="hard", alpha=1.5, suppression=float("-inf"))
    state = fast.encode(image)
    bias = fast.token_bias(np.array([0, 5, 15, 6]))
    with torch.inference_mode():
        skipped = fast.patch_qformer(state.qformer_frame, bias, skip_excluded_keys=True)
        dense = fast.patch_qformer(state.qformer_frame, bias, skip_excluded_keys=False)
    assert (skipped - dense).abs().max().item() <= 1e-6


@pytest.mark.parametrize("suppression", [float("-inf"), -5.0])
def test_descriptor_independent_of_batch(model, image, suppression):
    fast = extractor(model, suppression=suppression)
    state = fast.encode(image)
    everything = fast.descriptors(state, np.arange(16))
    for j in (0, 9, 15):
        alone = fast.descriptors(state, np.array([j]))
        assert np.abs(alone[0] - everything[j]).max() <= 1e-6
    shuffled = np.array([12, 3, 7])
    assert np.abs(fast.descriptors(state, shuffled) - everything[shuffled]).max() <= 1e-6


def test_memory_budget_chunks_without_changing_results(model, image):
    tight = extractor(model, memory_budget_mb=0)
    assert tight.patches_per_batch() == 1
    roomy = extractor(model)
    assert roomy.patches_per_batch() >= 16
    indices = np.arange(16)
    np.testing.assert_allclose(
        tight.descriptors(tight.encode(image), indices), roomy.descriptors(roomy.encode(image), indices), atol=1e-6
    )


def test_alpha_covering_grid_equals_unmasked_itc_embeddings(model, image):
    fast = extractor(model, falloff="hard", alpha=100.0, dim=24)
    ours = fast.descriptors(fast.encode(image), np.arange(16))
    pixels = torch.from_numpy(normalized_pixels(image, (fast.image_size, fast.image_size), "cubic", PIXEL_MEAN, PIXEL_STD))
    with torch.inference_mode():
        out = model(pixel_values=pixels, input_ids=torch.tensor([[2, 7, 3]]), use_image_text_matching_head=False)
    # transformers' own per-query ITC embeddings [1, Q, P], pooled as documented
    pooled = torch.nn.functional.normalize(out.image_embeds.mean(dim=1), dim=-1)[0].numpy()
    assert np.abs(ours - pooled).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_text_descriptors_match_transformers_text_embeddings(model):
    fast = extractor(model, dim=24)
    texts = ["a car on the road", "snow at night", "a deer in the lane"]
    ours = fast.text_descriptors(texts)
    assert ours.shape == (3, 24) and ours.dtype == np.float32
    tokens = tokenizer()(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model(
            pixel_values=torch.zeros(1, 3, 56, 56),
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            use_image_text_matching_head=False,
        )
    assert np.abs(ours - out.text_embeds.numpy()).max() <= 1e-5
    assert np.abs(ours[0] - ours[1]).max() > 1e-3
    assert fast.text_descriptors([]).shape == (0, 24)


def test_text_and_patches_share_the_head(model, image, tmp_path):
    fast = extractor(model, dim=24)
    embeddings = fast.descriptors(fast.encode(image), np.arange(16))
    weight, bias = fit_pca_head(np.concatenate([embeddings, fast.text_descriptors(["snow", "a dog", "the truck"])]), 8)
    save_head(tmp_path / "head.safetensors", weight, bias)
    headed = extractor(model, head_path=str(tmp_path / "head.safetensors"))
    assert headed.dim == 8
    reduced = headed.descriptors(headed.encode(image), np.arange(16))
    np.testing.assert_allclose(reduced, embeddings @ weight.T + bias, atol=1e-5)
    np.testing.assert_allclose(headed.text_descriptors(["snow"]), fast.text_descriptors(["snow"]) @ weight.T + bias, atol=1e-5)


def test_pca_head_orders_variance_and_centres(model):
    rng = np.random.default_rng(0)
    data = rng.normal(size=(200, 6)) * np.array([5.0, 3.0, 1.0, 0.5, 0.1, 0.01]) + 2.0
    weight, bias = fit_pca_head(data, 3)
    projected = data @ weight.T + bias
    np.testing.assert_allclose(projected.mean(axis=0), 0.0, atol=1e-5)
    variances = projected.var(axis=0)
    assert variances[0] > variances[1] > variances[2]
    np.testing.assert_allclose(variances, [25.0, 9.0, 1.0], rtol=0.25)
    with pytest.raises(ValueError):
        fit_pca_head(data, 7)


def test_missing_head_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="fit_pca_head"):
        load_head(tmp_path / "nope.safetensors")


def test_from_config_loads_a_local_folder(model, image, tmp_path):
    folder = tmp_path / "blip2-tiny"
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    loaded = Blip2Extractor.from_config({"model_path": str(folder), "dim": 16, "suppression": -3.0})
    in_memory = extractor(model, suppression=-3.0)
    indices = np.arange(16)
    np.testing.assert_allclose(
        loaded.descriptors(loaded.encode(image), indices), in_memory.descriptors(in_memory.encode(image), indices), atol=1e-6
    )
    np.testing.assert_allclose(loaded.text_descriptors(["snow"]), in_memory.text_descriptors(["snow"]), atol=1e-6)


def test_missing_model_folder_names_the_folder(tmp_path):
    with pytest.raises(Blip2WeightsMissing, match="blip2-itm-vit-g.*config.json"):
        Blip2Extractor.from_config({"model_path": str(tmp_path / "blip2-itm-vit-g")})
    with pytest.raises(ValueError, match="model_path"):
        Blip2Extractor.from_config({})


def test_protocol_shapes_and_bad_input(model, image):
    fast = extractor(model)
    assert (fast.grid.rows, fast.grid.cols, fast.dim) == (4, 4, 16)
    assert fast.position_table().shape == (16, 32) and fast.position_table().dtype == np.float32
    state = fast.encode(image)
    assert fast.descriptors(state, np.array([], dtype=np.int64)).shape == (0, 16)
    with pytest.raises(IndexError):
        fast.descriptors(state, np.array([16]))
    with pytest.raises(ValueError):
        fast.encode(image.astype(np.float32))
    with pytest.raises(ValueError, match="unknown"):
        extractor(model, alhpa=2.0)
    for bad in (dict(suppression=1.0), dict(suppression=float("nan")), dict(falloff="gauss"), dict(alpha=-1.0),
                dict(cls_mask=2.0), dict(implementation="slow")):
        with pytest.raises(ValueError):
            extractor(model, **bad)


def test_bf16_keeps_layer_norm_and_softmax_finite_and_close(image):
    reference = Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16, "suppression": -4.0}, seed=3)
    half = Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16, "suppression": -4.0, "dtype": "bfloat16"}, seed=3)
    assert half.model.vision_projection.weight.dtype == torch.bfloat16
    naive = Blip2Extractor(half.model, {**half.options, "implementation": "naive"})
    indices = np.arange(16)
    low = half.descriptors(half.encode(image), indices)
    high = reference.descriptors(reference.encode(image), indices)
    assert np.isfinite(low).all()
    assert np.abs(low - high).max() < 0.05
    # the reference path runs in bf16 as well (transformers' Q-Former takes its LayerNorm's dtype)
    assert np.abs(naive.descriptors(naive.encode(image), indices) - high).max() < 0.05
