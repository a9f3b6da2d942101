"""ONNX export and the onnxruntime backend against the torch extractors (fp32).

BLIP-2 runs as a tiny random config of the real classes; DINOv2 is the real embedded backbone
exported at full size."""

import json

import numpy as np
import onnx
import pytest

from sps_driving import cli
from sps_driving.core.backbones.blip2 import Blip2Extractor, tiny_blip2_config
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.backbones.runtimes import RuntimeMissing, load_runtime_extractor
from sps_driving.export.onnx_export import export_onnx


@pytest.fixture(scope="module")
def blip2():
    return Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16, "suppression": -6.0, "device": "cpu"}, seed=5)


@pytest.fixture(scope="module")
def exported(blip2, tmp_path_factory):
    out = tmp_path_factory.mktemp("blip2_export")
    # a tiny threshold exercises the external-data path that ViT-g (> 2 GB) takes
    export_onnx(blip2, out, external_data_threshold=1000)
    return out


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(1).integers(0, 256, (120, 200, 3), dtype=np.uint8)


def test_export_layout_and_dynamic_patch_axis(exported, blip2):
    meta = json.loads((exported / "export.json").read_text())
    assert meta["grid"] == [4, 4] and meta["dim"] == 16 and meta["tokens"] == 17
    assert meta["patch_inputs"] == ["tokens", "bias"]
    assert meta["mask"]["suppression"] == -6.0
    assert (exported / "patches.onnx.data").is_file() and (exported / "backbone.onnx.data").is_file()
    graph = onnx.load(str(exported / "patches.onnx"), load_external_data=False).graph
    bias = next(i for i in graph.input if i.name == "bias")
    assert bias.type.tensor_type.shape.dim[0].dim_param == "patches"
    assert [o.name for o in graph.output] == ["descriptors"]
    opset = onnx.load(str(exported / "backbone.onnx"), load_external_data=False).opset_import[0].version
    assert opset == 17


@pytest.mark.parametrize("indices", [np.arange(16), np.array([3]), np.array([15, 0, 7, 8, 2])], ids=len)
def test_onnxruntime_matches_torch(exported, blip2, image, indices):
    runtime = load_runtime_extractor({"backbone": "blip2", "backend": "onnxruntime", "export_dir": str(exported)})
    expected = blip2.descriptors(blip2.encode(image), indices)
    got = runtime.descriptors(runtime.encode(image), indices)
    assert got.shape == expected.shape == (len(indices), 16) and got.dtype == np.float32
    assert np.abs(got - expected).max() <= 1e-4
    if len(indices) > 1:  # patches differ: the comparison is not vacuous
        assert expected.std(axis=0).mean() > 1e-3


def test_runtime_through_load_extractor_chunks_and_protocol(exported, blip2, image):
    config = {"backbone": "blip2", "backend": "onnxruntime", "export_dir": str(exported), "max_patch_batch": 3}
    runtime = load_extractor(config)
    assert (runtime.name, runtime.grid, runtime.dim) == (blip2.name, blip2.grid, blip2.dim)
    np.testing.assert_array_equal(runtime.position_table(), blip2.position_table())
    indices = np.arange(16)
    np.testing.assert_allclose(
        runtime.descriptors(runtime.encode(image), indices), blip2.descriptors(blip2.encode(image), indices), atol=1e-4
    )
    assert runtime.descriptors(runtime.encode(image), np.array([], np.int64)).shape == (0, 16)
    with pytest.raises(IndexError):
        runtime.descriptors(runtime.encode(image), np.array([16]))


def test_mask_is_an_input_so_the_runtime_can_change_it(exported, blip2, image):
    runtime = load_runtime_extractor(
        {"backbone": "blip2", "backend": "onnxruntime", "export_dir": str(exported), "falloff": "hard", "alpha": 1.0,
         "suppression": float("-inf")}
    )
    hard = Blip2Extractor(blip2.model, {**blip2.options, "falloff": "hard", "alpha": 1.0, "suppression": float("-inf")})
    indices = np.arange(16)
    got = runtime.descriptors(runtime.encode(image), indices)
    np.testing.assert_allclose(got, hard.descriptors(hard.encode(image), indices), atol=1e-4)
    assert np.abs(got - blip2.descriptors(blip2.encode(image), indices)).max() > 1e-3


def test_missing_export_names_the_command(tmp_path):
    with pytest.raises(RuntimeMissing, match=r"sps-driving export onnx --backbone blip2 --model-path m/b2 --out"):
        load_runtime_extractor({"backbone": "blip2", "backend": "onnxruntime", "export_dir": str(tmp_path), "model_path": "m/b2"})


def test_tensorrt_backend_without_gpu_or_engine_is_a_clear_error(exported):
    with pytest.raises(RuntimeMissing, match="tensorrt|CUDA|sps-driving export tensorrt"):
        load_runtime_extractor({"backbone": "blip2", "backend": "tensorrt", "export_dir": str(exported)})


def test_cli_export_and_parity_with_random_weights(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["export", "onnx", "--backbone", "blip2", "--random-weights", "tiny", "--dim", "16", "--out", str(out)]) == 0
    assert (out / "patches.onnx").is_file()
    args = ["export", "parity", "--backbone", "blip2", "--random-weights", "tiny", "--dim", "16", "--export-dir", str(out), "--json"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_diff"] <= 1e-4 and result["min_cosine"] > 0.9999
    # a different seed is a different model: parity must fail, so the check can fail
    assert cli.main(args[:-1] + ["--seed", "1"]) == 1


def test_dinov2_export_matches_torch(tmp_path, image):
    dinov2 = load_extractor({"backbone": "dinov2_vits14", "backend": "torch", "device": "cpu", "dtype": "float32"})
    export_onnx(dinov2, tmp_path)
    runtime = load_runtime_extractor({"backbone": "dinov2_vits14", "backend": "onnxruntime", "export_dir": str(tmp_path)})
    indices = np.array([0, 17, 100, 255, 128])
    expected = dinov2.descriptors(dinov2.encode(image), indices)
    got = runtime.descriptors(runtime.encode(image), indices)
    # fp32 through 12 layers at descriptor magnitudes of ~10: 1e-4 relative to the largest entry
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


def test_cli_parity_on_a_drives_frames_for_fp32_and_int8(tmp_path, capsys):
    """`export parity --bag`: the export cache's onnxruntime graph (made on first use) against torch
    on every frame of a drive; fp32 within 1e-4, int8 a few % off and said to fail the tolerance."""
    from sps_driving.core import topics
    from sps_driving.ros import msgs
    from sps_driving.ros.bagio import BagWriter

    rng = np.random.default_rng(4)
    with BagWriter(tmp_path / "drive", "sqlite3") as bag:
        for i in range(3):
            t = 1_700_000_000_000_000_000 + i * 33_333_333
            bag.write(topics.IMAGE, msgs.image_fields(rng.integers(0, 256, (100, 160, 3), dtype=np.uint8), t, "camera"), t)
    (tmp_path / "small.yaml").write_text("input_size: [112, 112]\n")
    args = ["export", "parity", "--bag", str(tmp_path / "drive"), "--config", str(tmp_path / "small.yaml"), "--json"]
    assert cli.main(args) == 0
    fp32 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert fp32["frames"] == 3 and fp32["ok"] and fp32["max_abs_diff"] <= 1e-4 and fp32["backend"] == "onnxruntime fp32"
    assert cli.main(args + ["--precision", "int8"]) == 1
    int8 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not int8["ok"] and 1e-3 < int8["relative_error"] < 0.2 and int8["mean_cosine"] > 0.95
    # through a policy: the patches it selects on each frame, and its commands from each runtime
    from samples import tiny_policy

    policy = tiny_policy(tmp_path / "policy", rows=8, cols=8, dim=384)
    for precision, ok in (("fp32", 0), ("int8", 1)):
        assert cli.main(args + ["--precision", precision, "--policy", str(policy)]) == ok
        through = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["policy"]
        assert through["frames"] == 3 and through["kept_patches"] == 32
        assert through["steering_mae_vs_logged_rad"] == {"reference": None, "runtime": None}  # the drive logged no commands
        if precision == "fp32":
            assert through["token_relative_error"]["max"] < 1e-4 and through["steering_abs_diff_rad"]["max"] < 1e-4
        else:
            assert 1e-3 < through["token_relative_error"]["mean"] < 0.2 and through["steering_abs_diff_rad"]["max"] > 0
    assert cli.main(args[:-1] + ["--policy", str(policy)]) == 0  # as text
    assert "steering |diff| mean" in capsys.readouterr().out
    (tmp_path / "kept.yaml").write_text("input_size: [112, 112]\ntokens: kept\n")
    with pytest.raises(ValueError, match="tokens: file .* gives 'kept', but the policy was trained with 'all'"):
        cli.main(["export", "parity", "--bag", str(tmp_path / "drive"), "--config", str(tmp_path / "kept.yaml"),
                  "--policy", str(policy)])
