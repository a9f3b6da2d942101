"""A bag whose camera is JPEG CompressedImage on /camera/image_raw/compressed (as `record` keeps it)
is read by every bag command as the raw one is: the same frames and labels in `extract`, the same
frame count in `analyze`, every frame played through the live graph in `replay`."""

import json

import numpy as np
import pytest
from test_bag_inputs import ENGAGED, TICKS
from test_car_labels import write_car_bag

from sps_driving.cli import main
from sps_driving.core import topics
from sps_driving.core.jpeg import JPEG_FORMAT, decode_compressed, encode_jpeg
from sps_driving.ros import bagio, msgs
from sps_driving.ros.drive import read_drive
from sps_driving.train.cache import FeatureCache


def compressed_copy(raw, out, quality=90):
    """`raw` with its camera JPEG-compressed onto the compressed topic, everything else as it was."""
    with bagio.BagWriter(out, "mcap") as writer:
        for item in bagio.read_messages(raw):
            if item.topic != topics.IMAGE:
                writer.write(item.topic, item.msg, item.log_time_ns)
                continue
            header = bagio.to_bag(msgs.header_fields(msgs.stamp_ns(item.msg.header), item.msg.header.frame_id))
            data = np.frombuffer(encode_jpeg(msgs.image_to_rgb(item.msg), quality), np.uint8)
            image = bagio.TYPESTORE.types["sensor_msgs/msg/CompressedImage"](header=header, format=JPEG_FORMAT, data=data)
            writer.write(topics.IMAGE_COMPRESSED, image, item.log_time_ns)
    return out


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    raw = write_car_bag(root / "raw", "mcap", ticks=TICKS, engaged=ENGAGED)
    return raw, compressed_copy(raw, root / "jpeg")


def test_the_drive_reads_the_compressed_camera_lazily_and_decodes_it(bags):
    raw, jpeg = bags
    a, b = read_drive(raw), read_drive(jpeg)
    assert b.camera.topic == topics.IMAGE_COMPRESSED and b.camera.count == a.camera.count == TICKS // 3
    raw_frames, jpeg_frames = list(a.camera.frames()), list(b.camera.frames())
    assert [f.stamp_ns for f in raw_frames] == [f.stamp_ns for f in jpeg_frames]
    # the recorded JPEG decodes to what the codec makes of the raw frame
    np.testing.assert_array_equal(jpeg_frames[5].rgb(), decode_compressed(encode_jpeg(raw_frames[5].rgb(), 90), "jpeg"))
    (middle,) = b.camera.at([jpeg_frames[10].log_ns + 1], search_ns=10**8)
    assert middle.stamp_ns == jpeg_frames[10].stamp_ns
    with pytest.raises(ValueError, match="cannot decode"):
        decode_compressed(b"\xff\xd8 not a jpeg", "jpeg")


def test_extract_and_analyze_read_it_as_the_raw_camera(bags, tmp_path, capsys):
    raw, jpeg = bags
    pixels = tmp_path / "pixels.yaml"
    pixels.write_text("backbone: pixels\ninput_size: [28, 28]\n")
    caches = {}
    for name, bag in (("raw", raw), ("jpeg", jpeg)):
        assert main(["extract", "--out", str(tmp_path / name), "--extractor-config", str(pixels), str(bag)]) == 0
        caches[name] = FeatureCache(tmp_path / name)
    assert len(caches["jpeg"]) == len(caches["raw"]) > 0
    np.testing.assert_array_equal(caches["jpeg"].stamps, caches["raw"].stamps)
    np.testing.assert_array_equal(caches["jpeg"].targets, caches["raw"].targets)
    assert main(["analyze", str(jpeg), "--out", str(tmp_path / "analysis"), "--extractor-config", str(pixels)]) == 0
    assert json.loads((tmp_path / "analysis" / "summary.json").read_text())["frames"] == TICKS // 3
    capsys.readouterr()


@pytest.mark.ros
def test_replay_plays_the_compressed_camera_decoded(bags, tmp_path, capsys):
    from samples import tiny_policy

    _, jpeg = bags
    ckpt = tiny_policy(tmp_path / "ckpt", rows=8, cols=8, dim=384, state_inputs=("speed_mps",))
    (tmp_path / "extraction.yaml").write_text("input_size: [112, 112]\n")
    assert main(["replay", str(jpeg), "--out", str(tmp_path / "out"), "--json", "--checkpoint", str(ckpt),
                 "--backbone-config", str(tmp_path / "extraction.yaml"), "--log-dir", str(tmp_path / "logs")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["frames_in"], report["frames_out"]) == (TICKS // 3, TICKS // 3), report["drops"]
    assert report["reference_source"].startswith("pacmod3 reports") and report["reference_commands"] > 0


def test_a_vendor_camera_is_found_raw_or_compressed(bags, tmp_path):
    from sps_driving.ros.drive import COMPRESSED_IMAGE, IMAGE, camera_topic_of, read_drive
    from sps_driving.tools.replay import camera_map

    vendor = "/flir_camera/image_raw"
    assert camera_topic_of({vendor: IMAGE}, vendor) == vendor
    assert camera_topic_of({f"{vendor}/compressed": COMPRESSED_IMAGE}, vendor) == f"{vendor}/compressed"
    assert camera_topic_of({topics.IMAGE: IMAGE, topics.IMAGE_COMPRESSED: COMPRESSED_IMAGE}) == topics.IMAGE
    assert camera_topic_of({topics.IMAGE_COMPRESSED: COMPRESSED_IMAGE}) == topics.IMAGE_COMPRESSED
    assert camera_topic_of({vendor: "sensor_msgs/msg/CameraInfo"}, vendor) is None
    raw, jpeg = (read_drive(bag).topics for bag in bags)
    assert camera_map(raw, {}) == {}
    assert camera_map(jpeg, {}) == {topics.IMAGE_COMPRESSED: topics.IMAGE}
    assert camera_map(jpeg, {topics.IMAGE: topics.IMAGE, "/other": "/x"}) == {topics.IMAGE_COMPRESSED: topics.IMAGE, "/other": "/x"}
