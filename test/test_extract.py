"""`sps-driving extract` on real rosbag2 files and image folders, with a tiny random BLIP-2 of the
real architecture (transformers classes, tiny dims) saved as a local Hugging Face folder."""

import json

import cv2
import numpy as np
import pytest

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.backbones.blip2 import Blip2Extractor, tiny_blip2_config
from sps_driving.ros import bagio, msgs
from sps_driving.train.cache import FeatureCache
from sps_driving.train.extract import ExtractSettings, extract

T0 = 1_700_000_000_000_000_000
FRAME_NS = 33_333_333


def without_state(frames):
    """The counts of frames written without each state input."""
    return {"written_without_speed_mps": frames, "written_without_target_speed_mps": frames}


def image(i):
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, size=(60, 96, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def extractor():
    return Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16})


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    """Frames 0..5: frame 3 has no command, frame 4's image is truncated, frame 5 is bgr8 with its
    command 5 ms late (within tolerance); an extra command is malformed."""
    path = tmp_path_factory.mktemp("bags") / "drive_0001"
    with bagio.BagWriter(path) as writer:
        for i in range(6):
            stamp = T0 + i * FRAME_NS
            msg = bagio.to_bag(msgs.image_fields(image(i), stamp, "camera", "bgr8" if i == 5 else "rgb8"))
            if i == 4:
                msg.data = msg.data[:100]
            writer.write(topics.IMAGE, msg, stamp)
            if i != 3:
                command_stamp = stamp + (5_000_000 if i == 5 else 0)
                writer.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.01 * i, 0.1 * i, command_stamp), command_stamp)
        malformed = msgs.command_fields(float("nan"), 0.0, T0 + 3 * FRAME_NS)
        writer.write(topics.REFERENCE_COMMAND, malformed, T0 + 3 * FRAME_NS)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("folders") / "parking_lot"
    path.mkdir()
    rows = ["filename,steering,throttle"]
    for i in range(3):
        cv2.imwrite(str(path / f"{i}.png"), cv2.cvtColor(image(10 + i), cv2.COLOR_RGB2BGR))
        rows.append(f"{i}.png,{-0.02 * i},{0.2}")
    rows.append("missing.png,0.0,0.0")
    rows.append("0.png,not-a-number,0.0")
    (path / "labels.csv").write_text("\n".join(rows) + "\n")
    return path


def test_bag_frames_are_matched_by_stamp_and_bad_frames_are_counted(tmp_path, extractor, bag):
    report = extract([bag], tmp_path / "cache", extractor, {"backbone": "blip2"})
    assert report == {"drive_0001": {"written": 4, "no_command_in_tolerance": 1, "undecodable_image": 1,
                                     "invalid_command_messages": 1, **without_state(4)}}
    cache = FeatureCache(tmp_path / "cache")
    assert len(cache) == 4 and cache.sources == ["drive_0001"]
    assert cache.grid == extractor.grid and cache.descriptor_dim == 16
    np.testing.assert_array_equal(cache.stamps, [T0 + i * FRAME_NS for i in (0, 1, 2, 5)])
    np.testing.assert_allclose(cache.targets, [[0.01 * i, 0.1 * i] for i in (0, 1, 2, 5)], atol=1e-7)
    # descriptors are the extractor's own for every patch of the decoded frame (bgr8 decoded to RGB)
    expected = extractor.descriptors(extractor.encode(image(5)), np.arange(extractor.grid.n))
    np.testing.assert_allclose(cache[3].descriptors.astype(np.float32), expected, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(cache.position_table(), extractor.position_table())
    assert cache.meta["counts"] == report and cache.meta["extractor"] == {"backbone": "blip2"}


def test_a_tight_tolerance_drops_the_late_command(tmp_path, extractor, bag):
    report = extract([bag], tmp_path / "cache", extractor, settings=ExtractSettings(match_tolerance_s=0.001))
    assert report["drive_0001"]["written"] == 3 and report["drive_0001"]["no_command_in_tolerance"] == 2


def test_image_folder_with_labels(tmp_path, extractor, folder):
    report = extract([folder], tmp_path / "cache", extractor)
    assert report == {"parking_lot": {"written": 3, "undecodable_image": 1, "bad_label_row": 1, **without_state(3)}}
    cache = FeatureCache(tmp_path / "cache")
    np.testing.assert_array_equal(cache.stamps, [0, FRAME_NS, 2 * FRAME_NS])
    assert cache[2].steering == pytest.approx(-0.04)
    expected = extractor.descriptors(extractor.encode(image(11)), np.arange(extractor.grid.n))
    np.testing.assert_allclose(cache[1].descriptors.astype(np.float32), expected, rtol=1e-3, atol=1e-3)


def test_unknown_inputs_and_missing_topics_are_refused_before_extraction(tmp_path, extractor, bag):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a bag: expected a rosbag2 folder .*, or an image folder with labels.csv"):
        extract([bag, tmp_path / "empty"], tmp_path / "cache", extractor)
    with pytest.raises(ValueError, match="no topic /driver/cmd; its topics: /camera/image_raw, /vehicle/command"):
        extract([bag], tmp_path / "cache", extractor, settings=ExtractSettings(command_topic="/driver/cmd"))
    assert not (tmp_path / "cache").exists()
    assert main(["extract", "--out", str(tmp_path / "cache"), str(tmp_path / "empty")]) == 2


def test_command_line_extract_then_train(tmp_path, bag, folder, capsys):
    """The CLI loads the backbone through load_extractor from a local Hugging Face folder."""
    model_dir = tmp_path / "blip2-tiny"
    Blip2Extractor.from_hf_config(tiny_blip2_config(), {"dim": 16}).model.save_pretrained(model_dir)
    extractor_yaml = tmp_path / "extractor.yaml"
    extractor_yaml.write_text(f"backbone: blip2\nmodel_path: {model_dir}\ndim: 16\n")
    cache_dir = tmp_path / "cache"
    assert main(["extract", "--out", str(cache_dir), "--extractor-config", str(extractor_yaml), str(bag), str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "7 frames from 2 input(s)" in printed and "drive_0001: 4 written" in printed
    cache = FeatureCache(cache_dir)
    assert cache.sources == ["drive_0001", "parking_lot"] and cache.meta["extractor"]["backbone"] == "blip2"
    out = tmp_path / "policy"
    # These inputs record no speed: a policy of the frame only (the default reads both state inputs).
    assert main(["train", "--cache", str(cache_dir), "--out", str(out), "--epochs", "2", "--width", "16",
                 "--depth", "1", "--heads", "2", "--validation-fraction", "0.5"]) == 2
    assert "has no speed_mps" in capsys.readouterr().err
    assert main(["train", "--cache", str(cache_dir), "--out", str(out), "--epochs", "2", "--width", "16",
                 "--depth", "1", "--heads", "2", "--validation-fraction", "0.5", "--state-inputs"]) == 0
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["backbone"] == "blip2" and recorded["training"]["split"]["validation_sources"] == ["parking_lot"]


def test_mcap_bags_are_read_too(tmp_path, extractor):
    path = tmp_path / "drive_mcap"
    with bagio.BagWriter(path, storage="mcap") as writer:
        for i in range(2):
            stamp = T0 + i * FRAME_NS
            writer.write(topics.IMAGE, msgs.image_fields(image(i), stamp, "camera"), stamp)
            writer.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.05, -0.5, stamp), stamp)
    assert extract([path], tmp_path / "cache", extractor) == {"drive_mcap": {"written": 2, **without_state(2)}}
    np.testing.assert_allclose(FeatureCache(tmp_path / "cache").targets, [[0.05, -0.5]] * 2, atol=1e-7)


def test_speed_and_target_speed_are_matched_to_frames_by_stamp(tmp_path, extractor):
    """A car bag: PACMod 3 speed reports 10 ms after each frame (one says its speed is not valid)
    and a simulator-style /vehicle/twist that must be ignored when PACMod's report is there; the
    cruise target set once, 15 ms before frame 0, and repeated only for frame 3."""
    path = tmp_path / "car_drive"
    with bagio.BagWriter(path) as writer:
        for i in range(5):
            stamp = T0 + i * FRAME_NS
            writer.write(topics.IMAGE, msgs.image_fields(image(i), stamp, "camera"), stamp)
            writer.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.0, 0.1, stamp), stamp)
            report = stamp + 10_000_000
            writer.write(topics.PACMOD_SPEED_RPT, msgs.Fields("pacmod3_msgs/msg/VehicleSpeedRpt", {
                "header": msgs.header_fields(report), "vehicle_speed": 5.0 + i, "vehicle_speed_valid": i != 2}), report)
            writer.write(topics.VEHICLE_TWIST, msgs.twist_fields(99.0, stamp), stamp)
        for stamp in (T0 - 15_000_000, T0 + 3 * FRAME_NS):
            writer.write(topics.TARGET_SPEED, msgs.twist_fields(8.5, stamp), stamp)
    report = extract([path], tmp_path / "cache", extractor)
    assert report == {"car_drive": {"written": 5, "written_without_speed_mps": 1, "written_without_target_speed_mps": 3}}
    cache = FeatureCache(tmp_path / "cache")
    np.testing.assert_array_equal(cache.state_values(["speed_mps"])[:, 0], [5, 6, np.nan, 8, 9])
    np.testing.assert_array_equal(cache.state_values(["target_speed_mps"])[:, 0], [8.5, np.nan, np.nan, 8.5, np.nan])
    # Nothing within a tighter tolerance than the reports' 10 ms delay: no speed at all.
    extract([path], tmp_path / "tight", extractor, settings=ExtractSettings(match_tolerance_s=0.005), overwrite=True)
    assert np.isnan(FeatureCache(tmp_path / "tight").state_values(["speed_mps"])).all()


def test_a_simulator_bag_gives_the_twist_speed_and_image_folders_their_columns(tmp_path, extractor):
    path = tmp_path / "sim_drive"
    with bagio.BagWriter(path) as writer:
        for i in range(2):
            stamp = T0 + i * FRAME_NS
            writer.write(topics.IMAGE, msgs.image_fields(image(i), stamp, "camera"), stamp)
            writer.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.0, 0.1, stamp), stamp)
            writer.write(topics.VEHICLE_TWIST, msgs.twist_fields(7.0 + i, stamp), stamp)
            writer.write(topics.TARGET_SPEED, msgs.twist_fields(10.0, stamp), stamp)
    folder = tmp_path / "yard"
    folder.mkdir()
    cv2.imwrite(str(folder / "0.png"), image(0))
    (folder / "labels.csv").write_text("filename,steering,throttle,speed_mps\n0.png,0.0,0.1,3.5\n")
    assert extract([path, folder], tmp_path / "cache", extractor) == {
        "sim_drive": {"written": 2}, "yard": {"written": 1, "written_without_target_speed_mps": 1}}
    cache = FeatureCache(tmp_path / "cache")
    np.testing.assert_array_equal(cache.state_values(["speed_mps", "target_speed_mps"]), [[7, 10], [8, 10], [3.5, np.nan]])
