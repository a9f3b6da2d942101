"""Where each extraction setting comes from (node parameter, checkpoint, file, defaults), conflicts,
and backend auto: the onnxruntime export made on first use into a cache keyed by the model's hash,
its parity with torch, and the int8 option. The real embedded DINOv2 at 112 px (an 8x8 grid)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.dinov2 import bundled_onnx_path
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.backbones.runtimes import PARITY_FILE, cached_export_dir
from sps_driving.export.cache import ensure_export
from sps_driving.export.extractors import (
    ExtractionConflict,
    extraction_settings,
    extractor_for_policy,
    open_extractor,
    policy_extraction,
)

SMALL = {"input_size": [112, 112]}
IVIT = {"format": "sps_driving.policy/1", "backbone": "dinov2_vits14",
        "extractor": {"backbone": "dinov2_vits14", "backend": "torch", "device": "cuda", "input_size": [112, 112],
                      "masked_layer": -1, "falloff": "none", "alpha": 1.5, "suppression": -100.0, "model_path": None}}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("export_cache")


@pytest.fixture(scope="module")
def frame():
    return np.random.default_rng(7).integers(0, 256, (100, 160, 3), dtype=np.uint8)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_each_setting_comes_from_the_highest_source_and_an_override_is_named(tmp_path):
    # The bug this guards: a node parameter default silently replaced the file's backend.
    file = write(tmp_path / "ort.yaml", "backend: onnxruntime\nthreads: 1\ninput_size: [112, 112]\n")
    settings = extraction_settings({"backend": "", "device": None}, config_file=file)
    assert settings.config["backend"] == "onnxruntime" and settings.config["threads"] == 1 and not settings.warnings
    assert settings.sources["backend"] == f"file {file}" and "device" not in settings.sources
    assert settings.config["falloff"] == "hard"  # config/extraction.yaml under all of them
    settings = extraction_settings({"backend": "torch"}, config_file=file)
    assert settings.config["backend"] == "torch" and settings.sources["backend"] == "node parameter"
    assert settings.warnings == [f"extraction setting backend: node parameter 'torch' is used, not file {file} 'onnxruntime'"]


def test_the_checkpoint_decides_what_the_descriptors_are(tmp_path):
    # roi null, tokens all: a checkpoint without the keys was trained on the whole frame, every token of it
    assert policy_extraction(IVIT) == {"backbone": "dinov2_vits14", "input_size": [112, 112], "masked_layer": -1,
                                       "falloff": "none", "alpha": 1.5, "suppression": -100.0, "roi": None,
                                       "tokens": "all"}
    # Its runtime keys say how its cache was computed: not read.
    file = write(tmp_path / "runtime.yaml", "backend: onnxruntime\ndevice: cpu\n")
    settings = extraction_settings({}, IVIT, file)
    assert settings.config["falloff"] == "none" and settings.sources["falloff"] == "checkpoint"
    assert settings.config["device"] == "cpu" and not settings.warnings
    # The same value elsewhere is no conflict; another value is, with both values named.
    same = write(tmp_path / "same.yaml", "falloff: none\n")
    assert extraction_settings({"backbone": "dinov2_vits14"}, IVIT, same).config["falloff"] == "none"
    with pytest.raises(ExtractionConflict, match=r"falloff: file .*hard\.yaml gives 'hard', but the policy was trained with 'none'"):
        extraction_settings({}, IVIT, write(tmp_path / "hard.yaml", "falloff: hard\n"))
    with pytest.raises(ExtractionConflict, match="backbone: node parameter gives 'pixels'.*'dinov2_vits14'"):
        extraction_settings({"backbone": "pixels"}, IVIT)
    with pytest.raises(ExtractionConflict, match=r"input_size.*\[224, 224\].*\[112, 112\]"):
        extraction_settings({}, IVIT, write(tmp_path / "size.yaml", "input_size: [224, 224]\n"))


def test_weights_location_is_the_checkpoints_unless_given_here(tmp_path):
    policy = {"backbone": "blip2", "extractor": {"backbone": "blip2", "model_path": "/train/blip2", "dim": 16}}
    assert extraction_settings({}, policy).config["model_path"] == "/train/blip2"
    settings = extraction_settings({"model_path": "/car/blip2"}, policy)
    assert settings.config["model_path"] == "/car/blip2" and "'/train/blip2'" in settings.warnings[0]
    # An old checkpoint that records only its backbone
    assert policy_extraction({"backbone": "pixels"}) == {"backbone": "pixels", "roi": None}


def test_what_only_torch_computes_runs_torch_and_says_why():
    opened = open_extractor({"backbone": "pixels", "input_size": [112, 112]})
    assert opened.facts["backend"] == "torch" and "no model to export" in opened.facts["choice"]
    assert resolve_config({"backbone": "pixels"})["backend"] == "torch"
    with pytest.raises(ValueError, match="int8 runs on onnxruntime only"):
        resolve_config({"falloff": "none", "precision": "int8"})


def test_auto_exports_on_first_use_and_matches_torch(cache, frame):
    config = {**SMALL, "cache_dir": str(cache), "threads": 1}
    entry = cached_export_dir(resolve_config(config))
    assert entry.parent == cache / "exports" and not entry.exists()
    opened = open_extractor(config)
    facts = opened.facts
    assert facts["backend"] == "onnxruntime" and facts["precision"] == "fp32" and facts["threads"] == 1
    assert facts["export_dir"] == str(entry) and facts["choice"].startswith("auto: the onnxruntime export matches torch")
    parity = json.loads((entry / PARITY_FILE).read_text())
    assert parity["ok"] and parity["max_abs_diff"] <= 1e-4 and parity["tolerance"] == 1e-4
    # parity holds on another frame too
    torch_extractor = load_extractor({**config, "backend": "torch"})
    runtime = opened.extractor
    indices = np.arange(64)
    expected = torch_extractor.descriptors(torch_extractor.encode(frame), indices)
    assert np.abs(runtime.descriptors(runtime.encode(frame), indices) - expected).max() <= 1e-4
    assert expected.std(axis=0).mean() > 1e-2  # the comparison is not vacuous
    # the second use takes the entry as it is
    stamp = (entry / PARITY_FILE).stat().st_mtime_ns
    assert open_extractor(config).facts["export_dir"] == str(entry) and (entry / PARITY_FILE).stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.glob("exports/*") if p.is_dir()) == [entry.name]


def test_the_cache_is_keyed_by_the_model_hash_and_settings(cache, tmp_path):
    base = resolve_config({**SMALL, "cache_dir": str(cache)})
    copy = shutil.copy(bundled_onnx_path(), tmp_path / "same_model.onnx")
    assert cached_export_dir({**base, "model_path": str(copy)}) == cached_export_dir(base)  # the content, not the path
    assert cached_export_dir({**base, "alpha": 2.5}) != cached_export_dir(base)
    assert cached_export_dir({**base, "input_size": [224, 224]}) != cached_export_dir(base)
    changed = tmp_path / "other_model.onnx"
    changed.write_bytes(Path(copy).read_bytes() + b"\0")
    assert cached_export_dir({**base, "model_path": str(changed)}) != cached_export_dir(base)


def test_a_failed_parity_falls_back_to_torch_and_says_by_how_much(cache):
    config = {**SMALL, "cache_dir": str(cache)}
    entry = ensure_export(resolve_config(config))
    record = json.loads((entry / PARITY_FILE).read_text())
    try:
        (entry / PARITY_FILE).write_text(json.dumps({**record, "max_abs_diff": 0.25, "ok": False}))
        opened = open_extractor(config)
        assert opened.facts["backend"] == "torch" and "differs from torch by 0.25 > 0.0001" in opened.facts["choice"]
    finally:
        (entry / PARITY_FILE).write_text(json.dumps(record))


def test_a_killed_builders_leftovers_are_cleared_and_concurrent_first_uses_build_once(tmp_path):
    """Three processes open the same model at once on an empty cache with a killed builder's
    half-written folder in it: one complete entry results, nothing half-written is left, and all
    three run the same export."""
    cache = tmp_path / "cache"
    entry = cached_export_dir(resolve_config({**SMALL, "cache_dir": str(cache)}))
    leftover = entry.parent / f".building-{entry.name}-killed"
    leftover.mkdir(parents=True)
    (leftover / "backbone.onnx").write_bytes(b"half")
    script = (
        "import json, sys\n"
        "from sps_driving.export.extractors import open_extractor\n"
        f"opened = open_extractor({{'input_size': [112, 112], 'cache_dir': {str(cache)!r}, 'threads': 1}})\n"
        "print(json.dumps(opened.facts))\n"
    )
    workers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(3)]
    outputs = [w.communicate(timeout=600) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    facts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert {f["backend"] for f in facts} == {"onnxruntime"} and {f["export_dir"] for f in facts} == {str(entry)}
    assert sorted(p.name for p in entry.parent.iterdir() if p.is_dir()) == [entry.name]
    assert json.loads((entry / PARITY_FILE).read_text())["ok"]


def test_int8_is_an_option_that_is_quantized_and_close(cache, frame):
    config = {**SMALL, "cache_dir": str(cache)}
    fp32 = open_extractor(config).extractor
    opened = open_extractor({**config, "precision": "int8"})
    assert opened.facts["backend"] == "onnxruntime" and opened.facts["precision"] == "int8"
    int8 = opened.extractor
    indices = np.arange(64)
    expected = fp32.descriptors(fp32.encode(frame), indices)
    got = int8.descriptors(int8.encode(frame), indices)
    cosine = np.sum(got * expected, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert np.abs(got - expected).max() > 1e-3  # really another graph
    assert cosine.min() > 0.9 and np.linalg.norm(got - expected) / np.linalg.norm(expected) < 0.2
    with pytest.raises(ValueError, match="int8 runs on onnxruntime only"):
        open_extractor({**config, "precision": "int8", "backend": "torch"})


def test_the_policy_helper_gives_a_policys_own_extractor():
    opened = extractor_for_policy(IVIT, {"device": "cpu", "threads": 1})
    assert opened.settings.config["falloff"] == "none" and opened.facts["backend"] == "torch"
    assert "I-ViT" in opened.facts["choice"] and (opened.extractor.grid.rows, opened.extractor.dim) == (8, 384)
    pixels = extractor_for_policy({"backbone": "pixels", "extractor": {"backbone": "pixels", "input_size": [112, 112],
                                                                       "pixel_pool": 2}})
    assert (pixels.extractor.name, pixels.extractor.dim, pixels.extractor.grid.rows) == ("pixels", 147, 8)


def test_the_runtime_leaves_the_callers_arithmetic_alone(cache, frame):
    """onnxruntime's flush-to-zero for subnormal attention weights stays on its own threads: this
    thread still computes subnormal floats (a simulation or a test beside the extractor)."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    extractor = open_extractor({**SMALL, "cache_dir": str(cache)}).extractor
    extractor.descriptors(extractor.encode(frame), np.arange(64))
    assert tiny * np.float32(0.5) != 0 and np.nextafter(np.float64(0), np.float64(1)) > 0
