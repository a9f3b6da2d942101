"""The No-FM baseline: the `pixels` backbone (each patch's pooled raw pixels, no foundation model)
and the CNN policy over its grid. Policies are tiny random configs of the real CNN architecture
(MLP width 16); training data are small synthetic drives (56x56 px frames, a 4x4 patch grid) made
by the real pixels extractor."""

import json

import cv2
import numpy as np
import pytest
import torch

from sps_driving.cli import main
from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.loader import load_extractor
from sps_driving.core.backbones.pixels import PixelExtractor
from sps_driving.core.image import ImageError
from sps_driving.core.policies.checkpoint import load_policy, save_policy
from sps_driving.core.policies.cnn import CnnPolicy
from sps_driving.core.policies.registry import build_policy
from sps_driving.core.policies.transformer import GridPolicy
from sps_driving.core.selection import SelectionConfig
from sps_driving.train.cache import FeatureCache, FeatureCacheWriter
from sps_driving.train.trainer import TrainConfig, evaluate_checkpoint, train

# ImageNet mean and std, restated so the reference below does not share the extractor's constants.
MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])
SIZE = 56  # px: a 4x4 grid of 14 px patches
TINY_CNN = dict(architecture="cnn", width=16, dropout=0.0, batch_size=16, state_inputs=[])  # stripe frames have no speed


def noise(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def reference_descriptors(image_rgb, input_size, pool):
    """Each patch's pooled normalized pixels, channel-major, by explicit loops in float64."""
    height, width = input_size
    if image_rgb.shape[:2] != (height, width):
        image_rgb = cv2.resize(image_rgb, (width, height), interpolation=cv2.INTER_AREA)
    normalized = (image_rgb.astype(np.float64) / 255.0 - MEAN) / STD
    side, cols = 14 // pool, width // 14
    out = np.zeros(((height // 14) * cols, 3, side, side))
    for j in range(len(out)):
        row, col = divmod(j, cols)
        patch = normalized[14 * row:14 * (row + 1), 14 * col:14 * (col + 1)]
        for y in range(side):
            for x in range(side):
                out[j, :, y, x] = patch[pool * y:pool * (y + 1), pool * x:pool * (x + 1)].mean(axis=(0, 1))
    return out.reshape(len(out), -1)


# ---- the pixels backbone ----------------------------------------------------------------------


@pytest.mark.parametrize("input_size, pool, grid, dim", [
    ((224, 224), 2, (16, 16), 147), ((224, 336), 2, (16, 24), 147), ((224, 336), 7, (16, 24), 12),
    ((112, 112), 1, (8, 8), 588),
])
def test_grid_and_dim_follow_input_size_and_pool(input_size, pool, grid, dim):
    extractor = load_extractor({"backbone": "pixels", "input_size": list(input_size), "pixel_pool": pool})
    assert isinstance(extractor, PixelExtractor) and extractor.name == "pixels"
    assert (extractor.grid.rows, extractor.grid.cols) == grid and extractor.dim == dim
    state = extractor.encode(noise((60, 96, 3), 0))
    assert extractor.descriptors(state, np.arange(extractor.grid.n)).shape == (grid[0] * grid[1], dim)


def test_defaults_are_224_px_and_pool_2():
    extractor = load_extractor({"backbone": "pixels"})
    assert extractor.input_size == (224, 224) and extractor.pixel_pool == 2 and extractor.dim == 147


@pytest.mark.parametrize("frame_shape, input_size, pool", [
    ((224, 336, 3), (224, 336), 2),  # no resize: the reference starts from the raw frame
    ((600, 960, 3), (224, 224), 2),
    ((600, 960, 3), (224, 336), 7),
])
def test_descriptors_are_each_patchs_pooled_normalized_pixels(frame_shape, input_size, pool):
    extractor = PixelExtractor(input_size, pool)
    frame = noise(frame_shape, 1)
    expected = reference_descriptors(frame, input_size, pool)
    state = extractor.encode(frame)
    every = extractor.descriptors(state, np.arange(extractor.grid.n))
    assert every.dtype == np.float32
    np.testing.assert_allclose(every, expected, rtol=0, atol=2e-6)
    some = np.array([5, 0, extractor.grid.n - 1])  # any subset, in the order asked
    np.testing.assert_array_equal(extractor.descriptors(state, some), every[some])
    assert np.abs(every[0] - every[1]).max() > 0.1, "different patches of a noise frame differ"


@pytest.mark.parametrize("bad, match", [
    (np.full((60, 96, 3), np.nan, dtype=np.float32), "uint8"),
    (np.zeros((60, 96, 4), dtype=np.uint8), "HxWx3"),
    (np.zeros((60, 96), dtype=np.uint8), "HxWx3"),
    (np.zeros((0, 96, 3), dtype=np.uint8), "HxWx3"),
])
def test_bad_frames_are_a_clear_value_error(bad, match):
    with pytest.raises(ImageError, match=match):  # ImageError is a ValueError, as DINOv2 raises
        PixelExtractor().encode(bad)


def test_bad_indices_and_settings_are_clear_errors():
    extractor = PixelExtractor()
    state = extractor.encode(noise((60, 96, 3), 2))
    for indices, match in [(np.array([256]), r"in \[0, 256\)"), (np.array([-1]), r"in \[0, 256\)"),
                           (np.array([0.0]), "integer"), (np.zeros((2, 2), np.int64), "1-D")]:
        with pytest.raises(ValueError, match=match):
            extractor.descriptors(state, indices)
    for config, match in [({"pixel_pool": 3}, "pixel_pool must divide"), ({"input_size": [224, 230]}, "multiples of 14"),
                          ({"pixel_pol": 2}, "unknown extractor option"), ({"backend": "onnxruntime"}, "no exported runtime")]:
        with pytest.raises(ValueError, match=match):
            load_extractor({"backbone": "pixels", **config})


def test_resolved_config_holds_only_the_keys_pixels_reads():
    config = resolve_config({"backbone": "pixels", "device": "cuda", "falloff": "exp2", "pixel_pool": 7})
    assert config == {"backbone": "pixels", "backend": "torch", "input_size": [224, 224], "roi": None, "pixel_pool": 7}
    assert resolve_config(config) == config  # what a cache records loads the same extractor again
    assert "pixel_pool" not in resolve_config({}), "DINOv2 configs do not record the pixels-only key"


def test_position_table_is_a_fixed_2d_sincos_table():
    extractor = PixelExtractor((224, 336))
    table = extractor.position_table()
    assert table.shape == (16 * 24, 64) and table.dtype == np.float32
    np.testing.assert_array_equal(table, PixelExtractor((224, 336)).position_table())
    assert len(np.unique(table, axis=0)) == 16 * 24, "every patch has its own position"
    rows, cols = np.divmod(np.arange(16 * 24), 24)
    # first half: the patch row only; second half: the column only
    np.testing.assert_array_equal(table[rows == 3, :32], np.repeat(table[3 * 24, None, :32], 24, axis=0))
    np.testing.assert_array_equal(table[cols == 5, 32:], np.repeat(table[5, None, 32:], 16, axis=0))
    np.testing.assert_allclose(table[0], [0.0] * 16 + [1.0] * 16 + [0.0] * 16 + [1.0] * 16)


# ---- the CNN policy ---------------------------------------------------------------------------


def cnn_config(rows=4, cols=4, dim=147, variant="sps", rate=0.5, backbone="pixels", **policy):
    return {
        "architecture": "cnn",
        "backbone": backbone,
        "grid": {"rows": rows, "cols": cols},
        "descriptor_dim": dim,
        "selection": SelectionConfig(variant, rate, 0).to_dict(),
        "policy": policy or {"width": 16, "dropout": 0.0},
        "output": {"max_steering_rad": 0.3},
    }


def test_the_cnn_sees_the_pooled_image_the_grid_came_from():
    extractor = PixelExtractor((56, 84), pixel_pool=2)
    frame = noise((56, 84, 3), 3)
    grid = extractor.descriptors(extractor.encode(frame), np.arange(extractor.grid.n))
    policy = build_policy(cnn_config(rows=4, cols=6))
    image = policy.grid_image(torch.from_numpy(grid)[None])[0].numpy()
    # independently: normalize the whole frame, then 2x2 area-average it (exact for integer factors)
    normalized = ((frame / 255.0 - MEAN) / STD).astype(np.float32)
    expected = cv2.resize(normalized, (42, 28), interpolation=cv2.INTER_AREA).transpose(2, 0, 1)
    assert image.shape == (3, 28, 42)
    np.testing.assert_allclose(image, expected, rtol=0, atol=2e-6)


def test_the_cnn_refuses_what_it_cannot_read():
    assert isinstance(build_policy(cnn_config()), CnnPolicy)
    for config, match in [
        (cnn_config(dim=384, backbone="pixels"), "descriptor_dim 384"),
        (cnn_config(dim=768, backbone="dinov2_vitb14"), "pixels"),  # 768 = 3 x 16^2, but not pixels
        (cnn_config(variant="spps"), "variant sps or threshold"),
        ({**cnn_config(), "policy": {"width": 16, "depth": 2, "heads": 4, "mlp_ratio": 2.0, "dropout": 0.0}},
         "cnn policy settings must be exactly"),
        ({**cnn_config(), "architecture": "rnn"}, "unknown policy architecture"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_policy(config)
    with pytest.raises(ValueError, match="cnn policy reads the whole grid"):
        TrainConfig.from_yaml(cache="c", out="o", architecture="cnn", variant="mspps")
    with pytest.raises(ValueError, match="unknown policy architecture"):
        TrainConfig.from_yaml(cache="c", out="o", architecture="rnn")
    # heads belong to the transformer: a cnn width need not divide by them
    cnn = TrainConfig.from_yaml(cache="c", out="o", architecture="cnn", width=30, dropout=0.2)
    assert cnn.policy_settings() == {"width": 30, "dropout": 0.2}


def test_outputs_have_the_transformers_bounds_and_dropped_patches_are_zeros():
    torch.manual_seed(0)
    policy = build_policy(cnn_config()).eval()
    grids = torch.randn(4, 16, 147) * 1e4
    keep = torch.rand(4, 16) < 0.5
    with torch.no_grad():
        for p in policy.head.parameters():
            p.mul_(100)
        out = policy.forward_selected(grids, keep)
        assert out.shape == (4, 2) and torch.isfinite(out).all()
        assert out[:, 0].abs().max() <= 0.3 and out[:, 1].abs().max() <= 1.0
        assert out[:, 0].abs().max() > 0.2, "the tanh range is actually used"
        changed = grids + (~keep).unsqueeze(-1) * torch.randn_like(grids)  # other values at dropped patches
        torch.testing.assert_close(policy.forward_selected(changed, keep), out, rtol=0, atol=0)
        torch.testing.assert_close(policy(grids * keep.unsqueeze(-1)), out, rtol=0, atol=0)


def test_a_checkpoint_without_architecture_loads_as_a_transformer(tmp_path):
    config = {**cnn_config(backbone="test-random", dim=8),
              "policy": {"width": 16, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "dropout": 0.0}}
    del config["architecture"]
    torch.manual_seed(0)
    policy = build_policy(config)
    save_policy(policy, config, tmp_path / "old")
    assert "architecture" not in json.loads((tmp_path / "old" / "config.json").read_text())
    loaded = load_policy(tmp_path / "old")
    assert isinstance(loaded.module, GridPolicy)
    grids = torch.randn(3, 16, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(grids), policy.eval()(grids), rtol=0, atol=0)


# ---- training on a pixels cache ---------------------------------------------------------------


def stripe_frame(rng):
    """A noisy dark frame with a bright vertical stripe: its column is the steering, its
    brightness the throttle, so the labels are learnable only by looking at the pixels."""
    frame = rng.integers(0, 60, size=(SIZE, SIZE, 3), dtype=np.uint8)
    column, brightness = int(rng.integers(0, SIZE - 8)), int(rng.integers(100, 256))
    frame[:, column:column + 8] = brightness
    steering = 0.25 * ((column + 4) / SIZE * 2 - 1)
    throttle = 1.2 * (brightness - 100) / 155 - 0.6
    return frame, steering, throttle


@pytest.fixture(scope="module")
def pixels_cache(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pixels") / "cache"
    config = resolve_config({"backbone": "pixels", "input_size": [SIZE, SIZE]})
    extractor = load_extractor(config)
    meta = {"backbone": extractor.name, "extractor": config, "descriptor_dim": extractor.dim,
            "grid": {"rows": extractor.grid.rows, "cols": extractor.grid.cols}}
    rng = np.random.default_rng(0)
    everything = np.arange(extractor.grid.n)
    with FeatureCacheWriter(directory, meta, extractor.position_table(), shard_size=40) as writer:
        for s, source in enumerate(("drive_a", "drive_b", "drive_c", "drive_d")):
            for i in range(32):
                frame, steering, throttle = stripe_frame(rng)
                descriptors = extractor.descriptors(extractor.encode(frame), everything)
                writer.add(descriptors, steering, throttle, 10**18 + (s * 1000 + i) * 33_333_333, source)
    return directory


def test_cnn_learns_from_a_pixels_cache_and_its_checkpoint_round_trips(pixels_cache, tmp_path):
    cache = FeatureCache(pixels_cache)
    assert (cache.grid.rows, cache.grid.cols, cache.descriptor_dim) == (4, 4, 147)
    out = tmp_path / "nofm"
    summary = train(TrainConfig.from_yaml(cache=str(pixels_cache), out=str(out), variant="sps", rate=0.5, epochs=8, **TINY_CNN))
    history = [h["validation_loss"] for h in summary["history"]]
    assert min(history) < 0.7 * history[0], f"validation loss should fall: {history}"
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["architecture"] == "cnn" and recorded["policy"] == {"width": 16, "dropout": 0.0}
    assert recorded["backbone"] == "pixels" and recorded["extractor"]["backbone"] == "pixels"
    assert abs(evaluate_checkpoint(out) - recorded["validation_loss"]) <= 1e-6

    policy = load_policy(out)
    assert isinstance(policy.module, CnnPolicy)
    save_policy(policy.module, policy.config, tmp_path / "copy")
    copy = load_policy(tmp_path / "copy")
    grids = torch.from_numpy(cache.descriptors(np.arange(8)))
    keep = torch.from_numpy(policy.selector.stamp_masks(cache.stamps[:8]))
    with torch.no_grad():
        expected = policy.module.forward_selected(grids, keep)
        torch.testing.assert_close(copy.module.forward_selected(grids, keep), expected, rtol=0, atol=0)
    # the car's per-frame path (only the kept patches' descriptors) gives the training path's output
    for frame in range(8):
        kept = np.flatnonzero(keep[frame].numpy())
        steering, throttle = copy.predict(grids[frame, kept].numpy(), kept)
        np.testing.assert_allclose([steering, throttle], expected[frame].numpy(), rtol=0, atol=1e-6)


def test_command_line_extract_pixels_then_train_cnn(tmp_path, capsys):
    folders = []
    for name, seed in (("lot_a", 10), ("lot_b", 20)):
        folder = tmp_path / name
        folder.mkdir()
        rows = ["filename,steering,throttle"]
        for i in range(3):
            cv2.imwrite(str(folder / f"{i}.png"), cv2.cvtColor(noise((60, 96, 3), seed + i), cv2.COLOR_RGB2BGR))
            rows.append(f"{i}.png,{0.01 * i},0.2")
        (folder / "labels.csv").write_text("\n".join(rows) + "\n")
        folders.append(folder)
    settings = tmp_path / "pixels.yaml"
    settings.write_text("input_size: [112, 168]\npixel_pool: 2\n")
    cache_dir = tmp_path / "cache"
    assert main(["extract", "--out", str(cache_dir), "--backbone", "pixels", "--extractor-config", str(settings),
                 *map(str, folders)]) == 0
    assert "backbone pixels, grid 8x12, D=147" in capsys.readouterr().out
    cache = FeatureCache(cache_dir)
    assert len(cache) == 6 and cache.meta["extractor"] == {
        "backbone": "pixels", "backend": "torch", "input_size": [112, 168], "roi": None, "pixel_pool": 2}
    extractor = PixelExtractor((112, 168), 2)
    expected = extractor.descriptors(extractor.encode(noise((60, 96, 3), 11)), np.arange(96))
    np.testing.assert_allclose(cache[1].descriptors.astype(np.float32), expected, atol=2e-3)  # fp16 cache

    out = tmp_path / "policy"
    assert main(["train", "--cache", str(cache_dir), "--out", str(out), "--architecture", "cnn", "--epochs", "1",
                 "--width", "16", "--validation-fraction", "0.5", "--state-inputs"]) == 0  # no speeds in these folders
    recorded = json.loads((out / "config.json").read_text())
    # what evaluation reads to name the method No-FM
    assert recorded["backbone"] == "pixels" and recorded["architecture"] == "cnn"
    assert recorded["extractor"] == cache.meta["extractor"]
    assert load_extractor(recorded["extractor"]).grid == load_policy(out).grid
