"""The I-ViT baseline: DINOv2 with falloff none gives the ViT's own (unmasked) patch tokens. Checked
with the real embedded DINOv2 ViT-S/14 on a real photograph against transformers' Dinov2Model."""

import json

import cv2
import numpy as np
import pytest
import torch
from samples import sample_photo

from sps_driving.cli import main
from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.dinov2 import DinoV2Extractor
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.train.cache import FeatureCache


@pytest.fixture(scope="module")
def unmasked(model):
    return DinoV2Extractor(model, falloff="none")


@pytest.fixture(scope="module")
def photo():
    return sample_photo("grace_hopper.jpg")


def test_descriptors_are_dinov2s_own_last_hidden_state(model, extractor, unmasked, photo):
    everything = np.arange(unmasked.grid.n)
    descriptors = unmasked.descriptors(unmasked.encode(photo), everything)
    with torch.inference_mode():
        reference = model(pixel_values=unmasked.preprocess(photo)).last_hidden_state[0, 1:].numpy()
    assert descriptors.shape == reference.shape == (256, 384) and descriptors.dtype == np.float32
    assert np.abs(descriptors - reference).max() <= 1e-5
    some = np.array([200, 3, 17])
    np.testing.assert_array_equal(unmasked.descriptors(unmasked.encode(photo), some), descriptors[some])
    masked = extractor.descriptors(extractor.encode(photo), everything)
    assert np.abs(masked - descriptors).max() > 1.0, "the masked descriptors are a different thing"


@pytest.mark.parametrize("facet,layer", [("key", 9), ("query", -1), ("value", 0)])
def test_a_facet_is_that_projection_of_the_blocks_normalized_input(model, unmasked, photo, facet, layer):
    """The SPS paper's I-ViT: keys, queries or values of an intermediate block (Amir et al.),
    checked against transformers' own forward up to that block."""
    reader = DinoV2Extractor(model, falloff="none", ivit_facet=facet, ivit_layer=layer)
    descriptors = reader.descriptors(reader.encode(photo), np.arange(reader.grid.n))
    block = model.encoder.layer[layer]
    projection = {"key": block.attention.k_proj, "query": block.attention.q_proj, "value": block.attention.v_proj}[facet]
    with torch.inference_mode():
        entering = model(pixel_values=reader.preprocess(photo), output_hidden_states=True).hidden_states[layer % 12]
        reference = projection(block.norm1(entering))[0, 1:].numpy()
    assert descriptors.shape == (256, 384) and descriptors.dtype == np.float32
    assert np.abs(descriptors - reference).max() <= 1e-4 * max(1.0, np.abs(reference).max())
    tokens = unmasked.descriptors(unmasked.encode(photo), np.arange(256))
    assert np.abs(descriptors - tokens).max() > 1.0, "a facet is not the output token"


def test_facet_settings_are_checked_and_recorded(model):
    for settings, match in [({"ivit_facet": "attention"}, "unknown ivit_facet 'attention'"),
                            ({"ivit_facet": "key", "ivit_layer": 12}, "ivit_layer must index one of the 12 blocks")]:
        with pytest.raises(ValueError, match=match):
            DinoV2Extractor(model, falloff="none", **settings)
    # What the descriptors are: a policy trained on one facet refuses another's.
    from sps_driving.core.backbones import DESCRIPTOR_KEYS

    assert {"ivit_facet", "ivit_layer"} <= set(DESCRIPTOR_KEYS)
    assert resolve_config({"falloff": "none"})["ivit_facet"] == "token"  # what falloff none meant before facets


def test_all_patches_come_from_one_forward_pass(model, unmasked, photo):
    calls = []
    hooks = [layer.mlp.register_forward_hook(lambda *_: calls.append(1)) for layer in model.encoder.layer]
    try:
        state = unmasked.encode(photo)
        assert len(calls) == len(model.encoder.layer), "each layer runs once per frame"
        unmasked.descriptors(state, np.arange(unmasked.grid.n))
        assert len(calls) == len(model.encoder.layer), "no per-patch work"
    finally:
        for hook in hooks:
            hook.remove()


def test_mask_settings_are_ignored(model, unmasked, photo):
    other = DinoV2Extractor(model, falloff="none", masked_layer=3, alpha=0.0, suppression=-1.0, memory_budget_mb=1)
    indices = np.arange(0, 256, 7)
    np.testing.assert_array_equal(other.descriptors(other.encode(photo), indices),
                                  unmasked.descriptors(unmasked.encode(photo), indices))


def test_bad_indices_and_falloffs_are_clear_errors(unmasked, photo):
    state = unmasked.encode(photo)
    for indices, match in [(np.array([256]), r"in \[0, 256\)"), (np.array([-1]), r"in \[0, 256\)"),
                           (np.array([1.0]), "integer")]:
        with pytest.raises(ValueError, match=match):
            unmasked.descriptors(state, indices)
    with pytest.raises(ValueError, match="unknown mask falloff 'gaussian'.*'none'"):
        load_extractor({"falloff": "gaussian"})


def test_exported_runtimes_refuse_it(unmasked):
    for backend in ("onnxruntime", "tensorrt"):
        with pytest.raises(ValueError, match="falloff none .* backend torch only"):
            load_extractor({"falloff": "none", "backend": backend, "export_dir": "nowhere"})
    from sps_driving.export.onnx_export import export_spec

    with pytest.raises(ValueError, match="falloff none .* cannot be exported"):
        export_spec(unmasked)


def test_falloff_none_reaches_the_cache_and_the_policy_config(tmp_path, unmasked, photo):
    folder = tmp_path / "street"
    folder.mkdir()
    cv2.imwrite(str(folder / "0.png"), cv2.cvtColor(photo, cv2.COLOR_RGB2BGR))
    cv2.imwrite(str(folder / "1.png"), cv2.cvtColor(sample_photo("logo2.png"), cv2.COLOR_RGB2BGR))
    (folder / "labels.csv").write_text("filename,steering,throttle\n0.png,0.01,0.2\n1.png,-0.01,0.3\n")
    settings = tmp_path / "ivit.yaml"
    settings.write_text("falloff: none\n")
    cache_dir = tmp_path / "cache"
    assert main(["extract", "--out", str(cache_dir), "--extractor-config", str(settings), str(folder)]) == 0
    cache = FeatureCache(cache_dir)
    assert cache.meta["extractor"] == resolve_config({"falloff": "none"})
    expected = unmasked.descriptors(unmasked.encode(photo), np.arange(256))
    np.testing.assert_allclose(cache[0].descriptors.astype(np.float32), expected, rtol=1e-2, atol=1e-2)  # fp16
    out = tmp_path / "policy"
    assert main(["train", "--cache", str(cache_dir), "--out", str(out), "--epochs", "1", "--width", "16",
                 "--reduce", "2", "--state-inputs"]) == 0  # an image folder without speeds: the frame only
    recorded = json.loads((out / "config.json").read_text())
    # what evaluation reads to name the method I-ViT
    assert recorded["backbone"] == "dinov2_vits14" and recorded["extractor"]["falloff"] == "none"
    assert recorded["architecture"] == "mlp"  # the default policy
