import math

import numpy as np
import pytest

from sps_driving.core import topics
from sps_driving.core.image import ImageError, from_rgb, to_rgb
from sps_driving.ros import bagio, msgs


def _frame(h=6, w=8):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8"])
def test_image_roundtrip(encoding):
    rgb = _frame()
    data, step = from_rgb(rgb, encoding)
    np.testing.assert_array_equal(to_rgb(data, 6, 8, encoding, step), rgb)


def test_padded_rows_and_other_encodings_decode():
    rgb = _frame()
    padded = np.zeros((6, 8 * 3 + 5), np.uint8)
    padded[:, :24] = rgb.reshape(6, 24)
    np.testing.assert_array_equal(to_rgb(padded.tobytes(), 6, 8, "rgb8", 29), rgb)
    gray = to_rgb(np.full(48, 7, np.uint8).tobytes(), 6, 8, "mono8", 8)
    assert gray.shape == (6, 8, 3) and np.all(gray == 7)
    assert to_rgb(np.zeros(48, np.uint8).tobytes(), 6, 8, "bayer_rggb8", 8).shape == (6, 8, 3)


@pytest.mark.parametrize(
    "args",
    [
        (b"\0" * 10, 6, 8, "rgb8", 24),  # too short
        (b"\0" * 144, 6, 8, "rgb8", 20),  # step shorter than a row
        (b"\0" * 144, 6, 8, "16UC1", 16),  # unsupported encoding
        (b"", 0, 8, "rgb8", 24),  # empty
    ],
)
def test_bad_images_raise_image_error(args):
    with pytest.raises(ImageError):
        to_rgb(*args)


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_bag_roundtrip(tmp_path, storage):
    path = tmp_path / "bag"
    rgb = _frame()
    stamp = 1_700_000_000_123_456_789
    with bagio.BagWriter(path, storage) as bag:
        bag.write(topics.IMAGE, msgs.image_fields(rgb, stamp, "camera"), stamp)
        bag.write(topics.CAMERA_INFO, msgs.camera_info_fields(6, 8, stamp, "camera", math.radians(130)), stamp)
        bag.write(topics.REFERENCE_COMMAND, msgs.command_fields(0.1, -0.2, stamp), stamp + 1)
        bag.write(topics.LANE_POSE, msgs.lane_pose_fields(0.4, -0.3, stamp), stamp + 2)
        bag.write(topics.OBSTACLE_RANGE, msgs.range_fields(12.5, stamp), stamp + 3)
        bag.write(topics.VEHICLE_TWIST, msgs.twist_fields(9.0, stamp), stamp + 4)
    types = bagio.topic_types(path)
    assert types[topics.IMAGE] == "sensor_msgs/msg/Image"
    assert types[topics.REFERENCE_COMMAND] == "sensor_msgs/msg/JointState"
    read = list(bagio.read_messages(path))
    assert [m.topic for m in read][:1] == [topics.IMAGE] and len(read) == 6
    img = read[0].msg
    assert msgs.stamp_ns(img.header) == stamp
    np.testing.assert_array_equal(to_rgb(img.data, img.height, img.width, img.encoding, img.step), rgb)
    cmd = next(m.msg for m in read if m.topic == topics.REFERENCE_COMMAND)
    assert list(cmd.name) == list(topics.COMMAND_NAMES) and cmd.position.tolist() == [0.1, -0.2]
    pose = next(m.msg for m in read if m.topic == topics.LANE_POSE).pose
    assert pose.position.y == 0.4
    assert math.atan2(2 * pose.orientation.z * pose.orientation.w, 1 - 2 * pose.orientation.z**2) == pytest.approx(-0.3)
    only_cmd = list(bagio.read_messages(path, [topics.REFERENCE_COMMAND]))
    assert len(only_cmd) == 1
    assert list(bagio.read_messages(path, [topics.POLICY_OVERLAY])) == []  # a topic the bag does not have


def test_pacmod_reports_are_registered():
    rpt = bagio.TYPESTORE.types["pacmod3_msgs/msg/SystemRptFloat"]
    assert "override_active" in rpt.__dataclass_fields__
