"""The region of interest (extraction setting `roi`): its pixel rounding, validation, the one crop
every backend's preprocessing takes, its record in feature caches and checkpoints, and where
each patch of the grid lies in the camera frame. Tiny inputs and a tiny random DINOv2."""

import json

import cv2
import numpy as np
import pytest

from sps_driving.cli import main
from sps_driving.core.backbones import resolve_config
from sps_driving.core.backbones.dinov2 import IMAGENET_MEAN, IMAGENET_STD
from sps_driving.core.backbones.pixels import PixelExtractor
from sps_driving.core.backbones.runtimes import OnnxRuntimeExtractor
from sps_driving.core.image import ImageError, check_roi, normalized_pixels, patch_rectangles, roi_box
from sps_driving.export.extractors import ExtractionConflict, extraction_settings, extractor_for_policy, policy_extraction

ROI = [0.2, 0.7, 0.1, 0.9]  # on a 60x100 frame: rows 12..41, columns 10..89
FRAME = (60, 100, 3)
INPUT = (28, 56)  # px: a 2x4 grid of 14 px patches


def noise(shape=FRAME, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_edges_round_half_up_exactly_on_the_decimal_fraction():
    assert roi_box(60, 100, ROI) == (12, 42, 10, 90)
    assert roi_box(60, 100, None) == (0, 60, 0, 100)
    # 0.145 x 100 is 14.5: binary floating point makes it 14.499999999999998, rounded down to 14
    assert roi_box(100, 10, [0.145, 1.0, 0.0, 1.0])[0] == 15
    assert roi_box(5, 5, [0.5, 1.0, 0.1, 0.3]) == (3, 5, 1, 2)  # 2.5 -> 3, 0.5 -> 1, 1.5 -> 2
    # the same fractions crop the same region of a frame rendered twice as large
    small, large = roi_box(140, 224, [0.4, 0.65, 0.125, 0.875]), roi_box(280, 448, [0.4, 0.65, 0.125, 0.875])
    assert small == (56, 91, 28, 196) and large == tuple(2 * v for v in small)


@pytest.mark.parametrize("bad", [[0.5, 0.5, 0.0, 1.0], [0.6, 0.4, 0.0, 1.0], [0.0, 1.0, 0.7, 0.2], [-0.1, 0.5, 0.0, 1.0],
                                 [0.0, 1.2, 0.0, 1.0], [0.0, 1.0, 0.0], "0 1 0 1", [0.0, float("nan"), 0.0, 1.0],
                                 [False, True, 0.0, 1.0], [0.0, "1", 0.0, 1.0]])
def test_bad_roi_values_are_rejected_with_what_is_expected(bad):
    with pytest.raises(ValueError, match=r"roi must be null \(the whole frame\) or \[top, bottom, left, right\]"):
        check_roi(bad)
    with pytest.raises(ValueError, match="roi must be null"):
        resolve_config({"roi": bad})
    with pytest.raises(ValueError, match="roi must be null"):
        resolve_config({"backbone": "pixels", "roi": bad})


def test_a_roi_without_a_pixel_on_the_frame_is_an_image_error():
    with pytest.raises(ImageError, match="keeps no pixel of a 100x60 frame"):
        normalized_pixels(noise(), INPUT, "area", IMAGENET_MEAN, IMAGENET_STD, [0.5, 0.501, 0.0, 1.0])


def test_roi_null_is_todays_preprocessing_bit_for_bit():
    frame = noise(seed=1)
    today = cv2.resize(frame, (INPUT[1], INPUT[0]), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0
    today = np.ascontiguousarray(((today - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)[None])
    for roi in (None, [0.0, 1.0, 0.0, 1.0]):
        got = normalized_pixels(frame, INPUT, "area", IMAGENET_MEAN, IMAGENET_STD, roi)
        assert got.dtype == np.float32 and np.array_equal(got, today)
    assert resolve_config({})["roi"] is None and resolve_config({"backbone": "pixels"})["roi"] is None


@pytest.fixture(scope="module")
def tiny_dinov2():
    """A tiny random DINOv2 (2 layers, 64-d) with the roi, and its onnxruntime export opened with it."""
    from sps_driving.core.backbones.dinov2 import random_dinov2

    return lambda roi: random_dinov2("tiny", resolve_config({"input_size": list(INPUT), "roi": roi, "backend": "torch"}))


@pytest.fixture(scope="module")
def export_dir(tiny_dinov2, tmp_path_factory):
    from sps_driving.export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("tiny_dinov2_export")
    export_onnx(tiny_dinov2(None), out)  # made without a roi: the crop comes before the graph
    return out


def test_torch_onnxruntime_and_pixels_crop_the_same_pixels(tiny_dinov2, export_dir):
    frame = noise(seed=2)
    expected = normalized_pixels(np.ascontiguousarray(frame[12:42, 10:90]), INPUT, "area", IMAGENET_MEAN, IMAGENET_STD)
    torch_input = tiny_dinov2(ROI).preprocess(frame).numpy()
    runtime = OnnxRuntimeExtractor(export_dir, {"roi": ROI, "threads": 1, "device": "cpu"})
    # pixels with 1 px pooling: every patch's own normalized pixels, folded back into the image
    pixels = PixelExtractor(INPUT, pixel_pool=1, roi=ROI)
    patches = pixels.encode(frame).patches.reshape(2, 4, 3, 14, 14)
    pixels_input = patches.transpose(2, 0, 3, 1, 4).reshape(1, 3, *INPUT)
    for got in (torch_input, runtime.pixels(frame), pixels_input):
        np.testing.assert_array_equal(got, expected)
    whole = normalized_pixels(frame, INPUT, "area", IMAGENET_MEAN, IMAGENET_STD)
    assert np.abs(whole - expected).max() > 0.5  # the crop is not a no-op
    np.testing.assert_array_equal(OnnxRuntimeExtractor(export_dir, {"threads": 1, "device": "cpu"}).pixels(frame), whole)


def test_the_runtime_applies_the_roi_it_was_opened_with(tiny_dinov2, export_dir):
    frame, indices = noise(seed=3), np.arange(8)
    reference = tiny_dinov2(ROI)
    expected = reference.descriptors(reference.encode(frame), indices)
    runtime = OnnxRuntimeExtractor(export_dir, {"roi": ROI, "threads": 1, "device": "cpu"})
    np.testing.assert_allclose(runtime.descriptors(runtime.encode(frame), indices), expected, atol=1e-5)
    whole = tiny_dinov2(None)
    assert np.abs(whole.descriptors(whole.encode(frame), indices) - expected).max() > 1e-2


def test_roi_is_a_descriptor_key_and_old_checkpoints_mean_the_whole_frame(tmp_path):
    policy = {"backbone": "dinov2_vits14", "extractor": {"backbone": "dinov2_vits14", "input_size": [168, 336], "roi": ROI}}
    assert policy_extraction(policy)["roi"] == ROI
    settings = extraction_settings({}, policy)
    assert settings.config["roi"] == ROI and settings.sources["roi"] == "checkpoint"
    other = tmp_path / "other.yaml"
    other.write_text("roi: [0.3, 0.7, 0.1, 0.9]\n")
    with pytest.raises(ExtractionConflict, match=r"roi: file .*other\.yaml gives \[0\.3, 0\.7, 0\.1, 0\.9\], but the policy "
                                                 r"was trained with \[0\.2, 0\.7, 0\.1, 0\.9\]"):
        extraction_settings({}, policy, other)
    old = {"backbone": "dinov2_vits14", "extractor": {"backbone": "dinov2_vits14", "input_size": [224, 224]}}
    assert policy_extraction(old)["roi"] is None and extraction_settings({}, old).config["roi"] is None
    with pytest.raises(ExtractionConflict, match="roi: file .* but the policy was trained with null .*set it to null"):
        extraction_settings({}, old, other)
    same = tmp_path / "same.yaml"
    same.write_text("roi: [0.2, 0.7, 0.1, 0.9]\n")
    assert extraction_settings({}, policy, same).config["roi"] == ROI


def test_roi_round_trips_through_a_feature_cache_and_a_checkpoint_to_the_simulators_driver(tmp_path, capsys):
    from sps_driving.sim.episodes import PolicyDriver
    from sps_driving.train.cache import FeatureCache

    folders = []
    for name, seed in (("lot_a", 10), ("lot_b", 20)):
        folder = tmp_path / name
        folder.mkdir()
        for i in range(2):
            cv2.imwrite(str(folder / f"{i}.png"), cv2.cvtColor(noise(seed=seed + i), cv2.COLOR_RGB2BGR))
        (folder / "labels.csv").write_text("filename,steering,throttle\n0.png,0.01,0.2\n1.png,-0.01,0.2\n")
        folders.append(folder)
    settings = tmp_path / "pixels.yaml"
    settings.write_text(f"input_size: [28, 56]\npixel_pool: 7\nroi: {ROI}\n")
    cache_dir = tmp_path / "cache"
    assert main(["extract", "--out", str(cache_dir), "--backbone", "pixels", "--extractor-config", str(settings),
                 *map(str, folders)]) == 0
    cache = FeatureCache(cache_dir)
    assert cache.meta["extractor"]["roi"] == ROI
    expected = PixelExtractor(INPUT, 7, ROI)
    np.testing.assert_allclose(cache[0].descriptors.astype(np.float32),
                               expected.encode(noise(seed=10)).patches, atol=2e-3)  # fp16 cache
    policy = tmp_path / "policy"
    assert main(["train", "--cache", str(cache_dir), "--out", str(policy), "--architecture", "cnn", "--epochs", "1",
                 "--width", "8", "--validation-fraction", "0.5", "--state-inputs"]) == 0
    assert json.loads((policy / "config.json").read_text())["extractor"]["roi"] == ROI
    assert extractor_for_policy(policy).extractor.roi == ROI
    assert PolicyDriver(str(policy)).extractor.roi == ROI


def test_patch_rectangles_of_a_non_square_roi():
    rectangles = patch_rectangles(FRAME[:2], ROI, INPUT, (2, 4))
    # columns 10..89 (80 px) in 4 patches of 20 px, rows 12..41 (30 px) in 2 of 15 px; row-major
    assert rectangles.shape == (8, 4)
    np.testing.assert_array_equal(rectangles[0], [10, 12, 30, 27])
    np.testing.assert_array_equal(rectangles[6], [50, 27, 70, 42])
    np.testing.assert_array_equal(patch_rectangles(FRAME[:2], None, INPUT, (2, 4))[7], [75, 30, 100, 60])
    with pytest.raises(ValueError, match="does not tile"):
        patch_rectangles(FRAME[:2], ROI, INPUT, (3, 4))


def test_a_pixel_changes_exactly_the_patches_whose_rectangles_it_overlaps():
    """One bright pixel at a time: the backbone input changes in the patches whose rectangles
    overlap that pixel (cv2's area resize, fractional scales: 37 rows -> 28, 69 columns -> 56)."""
    roi, size = [0.1, 0.72, 0.15, 0.84], (28, 56)  # rows 6..42, columns 15..83 of a 60x100 frame
    rectangles = patch_rectangles(FRAME[:2], roi, size, (2, 4))
    blank = np.zeros(FRAME, np.uint8)
    base = normalized_pixels(blank, size, "area", IMAGENET_MEAN, IMAGENET_STD, roi)[0]
    rng = np.random.default_rng(4)
    for row, col in [(6, 15), (42, 83), (24, 32), (25, 49), *zip(rng.integers(0, 60, 40), rng.integers(0, 100, 40))]:
        frame = blank.copy()
        frame[row, col] = 255
        changed = np.abs(normalized_pixels(frame, size, "area", IMAGENET_MEAN, IMAGENET_STD, roi)[0] - base).sum(0) > 0
        by_patch = changed.reshape(2, 14, 4, 14).any(axis=(1, 3)).reshape(-1)
        overlaps = ((rectangles[:, 0] < col + 1) & (rectangles[:, 2] > col)
                    & (rectangles[:, 1] < row + 1) & (rectangles[:, 3] > row))
        np.testing.assert_array_equal(by_patch, overlaps, err_msg=f"pixel ({row}, {col})")


def test_a_cache_without_roi_reads_with_one_of_roi_null_but_not_with_a_cropped_one(tmp_path):
    from sps_driving.train.cache import FeatureCache, FeatureCacheWriter

    def cache(name, extractor):
        meta = {"backbone": "pixels", "grid": {"rows": 2, "cols": 4}, "descriptor_dim": 3, "extractor": extractor}
        with FeatureCacheWriter(tmp_path / name, meta, None) as writer:
            writer.add(np.zeros((8, 3), np.float32), 0.0, 0.0, 1, "episode")
        return tmp_path / name

    record = {"backbone": "pixels", "input_size": list(INPUT), "pixel_pool": 14}
    old, whole, cropped = cache("old", record), cache("whole", {**record, "roi": None}), cache("cropped", {**record, "roi": ROI})
    assert len(FeatureCache([old, whole])) == 2
    with pytest.raises(ValueError, match=r"differ in \['extractor'\]"):
        FeatureCache([old, cropped])


def test_touched_patches_and_size_of_a_known_mask():
    from sps_driving.sim.roi_options import Option, size_in_patches, touched_patches

    option = Option("t", "test", 100, INPUT, tuple(ROI))  # patches of 20 x 15 px from column 10, row 12
    mask = np.zeros(FRAME[:2], bool)
    mask[26:28, 29:31] = True  # straddles the corner of 4 patches
    assert touched_patches(mask, option) == (2, 2)
    assert size_in_patches(mask, option) == pytest.approx((2 / 20, 2 / 15))
    mask[:] = False
    mask[0:5, 0:5] = True  # outside the roi
    assert touched_patches(mask, option) == (0, 0) and size_in_patches(mask, option) is None


def test_the_report_tells_obstacles_out_of_view_apart_from_sizes():
    """roi.md's obstacle tables: the touched patches' median (range), and a bounding-box cell that
    counts the obstacles outside an option's region of interest, or says none was in view."""
    from sps_driving.sim.roi_options import DISTANCES_M, OPTIONS, markdown

    def obstacle(rows, size):
        return (rows, 3), (40, 20), size

    found = {d: [obstacle(1, (2.0, 1.0)), obstacle(3, (4.0, 1.0)), obstacle(2, None)] for d in DISTANCES_M}
    found[DISTANCES_M[-1]] = [obstacle(1, None)]
    timing = {"encode_ms": [2.0, 1.0], "descriptors_ms": [30.0], "total_ms": [40.0, 32.0], "k": 256,
              "runtime": "onnxruntime", "threads": 2}
    result = {"revision": "r", "date": "d", "machine": "m", "layouts": 2, "obstacle_count": 3, "rounds": 2,
              "camera": {"hfov_deg": 90, "pitch_deg": 0}, "min_radius_m": 90,
              "band": {"rows": [0.4, 0.6], "cols": [0.1, 0.9], "lateral_m": 5.0, "height_m": 1.8, "horizon_row": 0.45},
              "render_heights": {224: 140, 448: 280, 896: 560}, "render_ms": {224: 1.0, 448: 2.0, 896: 4.0},
              "obstacles": {option.name: found for option in OPTIONS}, "load_before": (1, 1, 1), "load_after": (1, 1, 1),
              "timing": {option.name: timing for option in OPTIONS}}
    lines = markdown(result, "cmd").splitlines()
    touched = lines.index("Touched patches, rows x columns: median (range) over the obstacles.")
    assert lines[touched + 4].startswith("| a | 2 (1-3) x 3 (3-3) |")
    boxes = lines.index("Bounding box, width x height: rendered px, and patches of the option; medians.")
    assert lines[boxes + 4] == ("| a | " + " | ".join(["40 x 20 px, 3.00 x 1.00 patches (1 not in view)"] * 2)
                                + " | not in view |")
    assert "| a | 256 | 1.0 | 30.0 | 32.0 | 1.00 | 36 (32-40) | 1.0 |" in lines


def test_the_rendered_obstacle_is_where_the_camera_projects_it():
    """The two measurements of the ROI tool agree: an obstacle's pixels (the frame with it minus the
    frame without it) lie around where the renderer's camera projects its centre, and shrink with
    distance."""
    from sps_driving.sim.config import load_sim_config
    from sps_driving.sim.render import get_renderer
    from sps_driving.sim.roi_options import bounding_box, obstacle_mask, placed_behind, road_obstacles
    from sps_driving.sim.scenarios import ID_SCENARIO
    from sps_driving.sim.world import make_episode

    config = load_sim_config()
    episode = make_episode(config, ID_SCENARIO, 0)
    spec = road_obstacles(episode)[0]
    renderer = get_renderer(config)
    sizes = []
    for distance in (10.0, 20.0):
        world = placed_behind(config, episode, spec, distance)
        pose = next(p for p in world.actor_poses() if p.spec is spec)
        assert pose.s - world.lane.s == pytest.approx(distance, abs=0.05)
        mask = obstacle_mask(renderer, world, spec)
        rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
        row, col = renderer.project(world, np.array([[pose.x, pose.y, spec.model.height_m / 2]]))[0]
        assert rows[0] <= row * mask.shape[0] <= rows[-1] + 1 and cols[0] <= col * mask.shape[1] <= cols[-1] + 1
        assert col > 0.5  # a road-side obstacle, right of the lane centre
        sizes.append(bounding_box(mask))
    assert sizes[1][0] < sizes[0][0] and sizes[1][1] < sizes[0][1]
