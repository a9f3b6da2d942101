"""Token dropping (tokens kept): the ViT runs on CLS and the kept patches only. The real embedded
DINOv2 ViT-S/14 on the shipped road band (168x336 px, 12x24 patches) and the bundled drive's frames;
a tiny random policy where one is trained.

What is checked: at rate 1.0 it is the dense backbone (torch exactly, the onnxruntime export within
the dense export's parity tolerance); at rate 0.5 the kept patches' descriptors differ from their
dense ones by a measured amount (on the bundled drive, frames 0, 10, ..., 90 at the shipped
selection: relative error 0.25-0.43 per frame, mean cosine 0.91-0.97; at rate 0.3: 0.34-0.65 and
0.78-0.94); the export takes any number of kept patches; the descriptor key keeps dense and
token-dropped policies apart; a token-dropping feature cache holds each frame's patch groups, and
a policy trains on it at its rate only."""

import json

import numpy as np
import pytest

from sps_driving import cli
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.resources import package_path
from sps_driving.core.selection import PatchSelector, SelectionConfig
from sps_driving.export.cache import PARITY_TOLERANCE, ensure_export, ensure_int8
from sps_driving.export.extractors import ExtractionConflict, extraction_settings, open_extractor
from sps_driving.ros import msgs
from sps_driving.tools.bench import bag_frames

ROAD_BAND = {"backbone": "dinov2_vits14", "input_size": [168, 336], "roi": [0.4, 0.65, 0.125, 0.875]}
FRAMES = (0, 50, 90)  # of the bundled drive's 100


@pytest.fixture(scope="module")
def drive():
    return [(stamp, msgs.image_to_rgb(image)) for stamp, image in bag_frames(package_path("data/demo_drive"))]


@pytest.fixture(scope="module")
def dense():
    return load_extractor({**ROAD_BAND, "backend": "torch"})


@pytest.fixture(scope="module")
def kept(dense):
    extractor = load_extractor({**ROAD_BAND, "backend": "torch", "tokens": "kept"})
    assert extractor.drops_tokens and not dense.drops_tokens
    return extractor


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("export_cache")


def test_at_rate_one_it_is_the_dense_backbone(dense, kept, drive):
    everything = np.arange(dense.grid.n)
    for index in FRAMES:
        image = drive[index][1]
        expected = dense.descriptors(dense.encode(image), everything)
        assert np.array_equal(kept.descriptors(kept.encode(image), everything), expected)


def test_kept_patches_differ_from_their_dense_descriptors_by_a_measured_amount(dense, kept, drive):
    selector = PatchSelector(SelectionConfig("sps", 0.5, 0), dense.grid)
    for index in FRAMES:
        stamp, image = drive[index]
        indices = selector.select(stamp)
        expected = dense.descriptors(dense.encode(image), indices)
        got = kept.descriptors(kept.encode(image), indices)
        relative = np.linalg.norm(got - expected) / np.linalg.norm(expected)
        cosine = np.mean(np.sum(got * expected, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1))
        assert 0.15 < relative < 0.55 and 0.85 < cosine < 0.99, (index, relative, cosine)
        # the same patches computed with another set kept beside them: other descriptors
        others = np.setdiff1d(np.arange(dense.grid.n), indices)[: len(indices) // 2]
        mixed = np.sort(np.concatenate([indices[: len(indices) // 2], others]))
        shared = np.isin(mixed, indices)
        assert np.abs(kept.descriptors(kept.encode(image), mixed)[shared] - got[np.isin(indices, mixed)]).max() > 0.1
    with pytest.raises(ValueError, match="distinct patch indices"):
        kept.descriptors(kept.encode(drive[0][1]), np.array([3, 3, 4]))


def test_the_export_matches_torch_at_any_count_and_int8_quantizes_its_layers(kept, drive, cache):
    config = {**ROAD_BAND, "tokens": "kept", "cache_dir": str(cache)}
    opened = open_extractor(config)
    assert opened.facts["backend"] == "onnxruntime" and opened.extractor.drops_tokens
    entry = ensure_export({**opened.settings.config})
    assert entry != ensure_export({**ROAD_BAND, **{k: v for k, v in opened.settings.config.items() if k != "tokens"},
                                   "tokens": "all"})  # its own entry in the export cache
    parity = json.loads((entry / "parity.json").read_text())
    assert parity["ok"] and parity["max_abs_diff"] <= PARITY_TOLERANCE
    runtime = opened.extractor
    image = drive[10][1]
    rng = np.random.default_rng(0)
    for count in (kept.grid.n, 87, 1):  # rate 1.0, 0.3 and a single patch: one graph, a dynamic axis
        indices = np.sort(rng.choice(kept.grid.n, count, replace=False))
        expected = kept.descriptors(kept.encode(image), indices)
        assert np.abs(runtime.descriptors(runtime.encode(image), indices) - expected).max() <= PARITY_TOLERANCE
    assert ensure_int8(entry).name == "patches.int8.onnx"  # the per-patch graph holds every layer
    int8 = open_extractor({**config, "precision": "int8"}).extractor
    indices = np.sort(rng.choice(kept.grid.n, 144, replace=False))
    expected = kept.descriptors(kept.encode(image), indices)
    relative = np.linalg.norm(int8.descriptors(int8.encode(image), indices) - expected) / np.linalg.norm(expected)
    assert 1e-3 < relative < 0.1


def test_dense_and_token_dropped_policies_refuse_each_others_descriptors(tmp_path):
    # the shipped policy records no tokens: trained before the key, on dense descriptors
    dense_policy = json.loads(package_path("models/sps50_dinov2/config.json").read_text())
    assert "tokens" not in dense_policy["extractor"]
    (tmp_path / "kept.yaml").write_text("tokens: kept\n")
    for policy in (dense_policy, {**dense_policy, "extractor": {**dense_policy["extractor"], "tokens": "all"}}):
        with pytest.raises(ExtractionConflict, match="tokens: file .* gives 'kept', but the policy was trained with 'all'"):
            extraction_settings(checkpoint=policy, config_file=tmp_path / "kept.yaml")
    kept_policy = {**dense_policy, "extractor": {**dense_policy["extractor"], "tokens": "kept"}}
    with pytest.raises(ExtractionConflict, match="node parameter gives 'all', but the policy was trained with 'kept'"):
        extraction_settings({"tokens": "all"}, checkpoint=kept_policy)
    assert extraction_settings(checkpoint=kept_policy).config["tokens"] == "kept"
    with pytest.raises(ValueError, match="falloff none"):
        extraction_settings({"tokens": "kept", "falloff": "none"})


def test_a_token_dropping_cache_holds_each_frames_groups_and_trains_at_its_rate(tmp_path, capsys):
    """`extract --keep-rate 0.3` at 112 px (an 8x8 grid: 3 groups of 20, 4 patches in none) of the
    bundled drive; each group's descriptors are those of one pass on that group."""
    from sps_driving.train.cache import FeatureCache

    settings = tmp_path / "kept.yaml"
    settings.write_text("input_size: [112, 112]\ntokens: kept\n")
    out = tmp_path / "cache"
    argv = ["extract", str(package_path("data/demo_drive")), "--out", str(out), "--extractor-config", str(settings)]
    assert cli.main(argv) == 2  # tokens kept needs --keep-rate
    assert "--keep-rate" in capsys.readouterr().err
    assert cli.main(argv + ["--keep-rate", "0.3"]) == 0
    cache = FeatureCache(out)
    assert cache.token_dropping == {"variant": "sps", "rate": 0.3, "seed": 0, "kept": 20, "groups": 3}
    assert cache.meta["extractor"]["tokens"] == "kept" and cache.token_groups.shape == (len(cache), 64)
    extractor = load_extractor({"input_size": [112, 112], "tokens": "kept", "backend": "torch"})
    selector = PatchSelector(SelectionConfig("sps", 0.3, 0), extractor.grid)
    frames = {stamp: image for stamp, image in bag_frames(package_path("data/demo_drive"))}
    for row in (0, 37):
        stamp, groups = int(cache.stamps[row]), cache.token_groups[row]
        assert np.array_equal(np.flatnonzero(groups == 0), selector.select(stamp))
        assert np.bincount(groups + 1).tolist() == [4, 20, 20, 20]
        encoded = extractor.encode(msgs.image_to_rgb(frames[stamp]))
        stored = cache.descriptors([row])[0]
        for group in range(3):
            patches = np.flatnonzero(groups == group)
            np.testing.assert_allclose(stored[patches], extractor.descriptors(encoded, patches), atol=2e-2, rtol=1e-2)  # fp16
        assert not stored[groups == -1].any()
    train = ["train", "--cache", str(out), "--epochs", "1", "--width", "16", "--reduce", "2"]
    assert cli.main(train + ["--rate", "0.3", "--out", str(tmp_path / "policy")]) == 0
    policy = json.loads((tmp_path / "policy" / "config.json").read_text())
    assert policy["extractor"]["tokens"] == "kept" and policy["training"]["token_dropping"]["kept"] == 20
    assert cli.main(train + ["--rate", "0.5", "--out", str(tmp_path / "other")]) == 2
    assert "train a policy of selection rate 0.3" in capsys.readouterr().err
