import math

import numpy as np
import pytest
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving import msgs
from sps_driving.bagio import TYPESTORE, lane_pose_message
from sps_driving.core.image import ImageError


def test_descriptor_cloud_round_trip_is_exact_through_cdr():
    rng = np.random.default_rng(0)
    values = rng.standard_normal((37, 384)).astype(np.float32)
    indices = np.sort(rng.choice(256, 37, replace=False)).astype(np.int64)
    msg = msgs.descriptors_message(values, indices, 1_234_567_890_123, "camera")
    back = deserialize_message(serialize_message(msg), PointCloud2)
    got_values, got_indices = msgs.descriptors_from_message(back)
    assert got_values.dtype == np.float32 and np.array_equal(got_values, values)
    assert np.array_equal(got_indices, indices) and back.is_dense
    assert msgs.stamp_ns(back.header) == 1_234_567_890_123
    # The same decoder reads the rosbags form of the message (replay report, bags).
    bag_msg = TYPESTORE.deserialize_cdr(serialize_message(msg), "sensor_msgs/msg/PointCloud2")
    v2, i2 = msgs.descriptors_from_message(bag_msg)
    assert np.array_equal(v2, values) and np.array_equal(i2, indices)


def test_descriptor_cloud_marks_non_finite_and_rejects_bad_layouts():
    values = np.ones((2, 4), np.float32)
    values[1, 2] = np.nan
    msg = msgs.descriptors_message(values, np.array([3, 9]), 5, "camera")
    assert not msg.is_dense
    assert np.isnan(msgs.descriptors_from_message(msg)[0][1, 2])
    msg.data = bytes(msg.data)[:-4]
    with pytest.raises(msgs.MessageError, match="bytes"):
        msgs.descriptors_from_message(msg)
    msg = msgs.descriptors_message(values, np.array([3, 9]), 5, "camera")
    msg.fields[1].datatype = 8  # FLOAT64
    with pytest.raises(msgs.MessageError, match="FLOAT32"):
        msgs.descriptors_from_message(msg)
    with pytest.raises(msgs.MessageError, match="indices"):
        msgs.descriptors_message(values, np.array([1, 2, 3]), 5, "camera")


def test_selection_mask_round_trip():
    indices = np.array([0, 5, 17, 255])
    msg = msgs.selection_message(indices, 16, 16, 42, "camera")
    assert (msg.height, msg.width, msg.encoding) == (16, 16, "mono8")
    got, shape = msgs.selection_from_message(msg)
    assert shape == (16, 16) and np.array_equal(got, indices)
    msg.encoding = "rgb8"
    with pytest.raises(msgs.MessageError):
        msgs.selection_from_message(msg)


def test_command_by_name_and_errors():
    msg = msgs.command_message(0.1, -0.4, 99)
    back = deserialize_message(serialize_message(msg), JointState)
    assert msgs.command_from_message(back) == (pytest.approx(0.1), pytest.approx(-0.4))
    swapped = JointState(name=["throttle", "steering"], position=[0.3, -0.2])
    assert msgs.command_from_message(swapped) == (-0.2, 0.3)
    with pytest.raises(msgs.MessageError):
        msgs.command_from_message(JointState(name=["steering"], position=[0.1]))
    with pytest.raises(msgs.MessageError):
        msgs.command_from_message(JointState(name=["steering", "throttle"], position=[0.1]))
    assert math.isnan(msgs.command_from_message(JointState(name=["steering", "throttle"], position=[math.nan, 0.0]))[0])


def test_image_round_trip_and_bad_frames():
    rgb = np.random.default_rng(1).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    msg = msgs.rgb_to_image(rgb, 7, "camera", "bgr8")
    assert np.array_equal(msgs.image_to_rgb(msg), rgb)
    msg.data = bytes(msg.data)[:10]
    with pytest.raises(ImageError):
        msgs.image_to_rgb(msg)
    msg = msgs.rgb_to_image(rgb, 7, "camera")
    msg.encoding = "16UC1"
    with pytest.raises(ImageError, match="unsupported"):
        msgs.image_to_rgb(msg)


def test_camera_info_and_lane_pose_and_qos():
    info = msgs.camera_info(600, 960, 3, "camera", math.radians(130))
    assert info.k[0] == pytest.approx(480 / math.tan(math.radians(65))) and info.k[2] == 480
    lateral, heading = msgs.lane_from_message(lane_pose_message(0.7, -0.3, 0))
    assert lateral == pytest.approx(0.7) and heading == pytest.approx(-0.3)
    from rclpy.qos import ReliabilityPolicy

    assert msgs.qos("sensor").reliability == ReliabilityPolicy.BEST_EFFORT
    assert msgs.qos("stream").reliability == ReliabilityPolicy.RELIABLE
    with pytest.raises(ValueError):
        msgs.qos("fast")


def test_diagnostics_round_trip():
    arr = msgs.diagnostics(5, "vehicle_interface", 2, "stopping", {"reason": "command_timeout", "count": 3})
    from diagnostic_msgs.msg import DiagnosticArray

    back = deserialize_message(serialize_message(arr), DiagnosticArray)
    assert msgs.diagnostic_values(back) == [("vehicle_interface", 2, "stopping", {"reason": "command_timeout", "count": "3"})]
    bag = TYPESTORE.deserialize_cdr(serialize_message(arr), "diagnostic_msgs/msg/DiagnosticArray")
    assert msgs.diagnostic_values(bag)[0][1] == 2


def test_bag_messages_convert_to_this_distros_types():
    from sensor_msgs.msg import CameraInfo, Image, Range

    from sps_driving.bagio import camera_info_message, image_message, range_message

    rng_msg = msgs.from_bag(range_message(3.5, 42), Range)  # Humble's Range has no `variance`
    assert rng_msg.range == pytest.approx(3.5) and msgs.stamp_ns(rng_msg.header) == 42
    info = msgs.from_bag(camera_info_message(600, 960, 7, hfov_rad=math.radians(130)), CameraInfo)
    assert info.k[2] == 480.0 and info.roi.do_rectify is False and info.header.frame_id == "camera"
    rgb = np.random.default_rng(3).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    image = msgs.from_bag(image_message(rgb, 9), Image)
    assert np.array_equal(msgs.image_to_rgb(image), rgb)
    from diagnostic_msgs.msg import DiagnosticArray

    bag_diag = TYPESTORE.deserialize_cdr(serialize_message(msgs.diagnostics(1, "n", 1, "m", {"a": 1})), "diagnostic_msgs/msg/DiagnosticArray")
    assert msgs.diagnostic_values(msgs.from_bag(bag_diag, DiagnosticArray)) == [("n", 1, "m", {"a": "1"})]
    assert msgs.ros_type("sensor_msgs/msg/Image") is Image and msgs.ros_type("sensor_msgs/Image") is Image
    with pytest.raises(ValueError):
        msgs.ros_type("Image")


def test_pacmod3_reports_and_commands_in_the_upstream_layout():
    from pacmod3_msgs.msg import GlobalRpt, SteeringCmd, SystemCmdFloat, SystemCmdInt, SystemRptFloat

    from sps_driving.core.control import GlobalStatus, PacmodCommand, SystemStatus

    report = SystemRptFloat(enabled=True, override_active=False, vehicle_fault=True, command_timeout=False, output=1.5)
    assert msgs.system_status(report) == SystemStatus(True, False, True, False, 1.5)
    assert msgs.system_status(SystemRptFloat(command_timeout=True)).timeout
    assert msgs.global_status(GlobalRpt(enabled=True, brake_can_timeout=True)) == GlobalStatus(True, False, False, True)
    assert msgs.global_status(GlobalRpt(config_fault_active=True)).fault
    command = PacmodCommand(True, False, 0.3, 4.4, 0.2, 0.0, True)
    out = msgs.pacmod_commands(command, 5)
    assert isinstance(out["steering"], SteeringCmd) and out["steering"].command == 0.3 and out["steering"].rotation_rate == 4.4
    assert isinstance(out["accel"], SystemCmdFloat) and out["accel"].command == 0.2 and out["accel"].enable
    assert out["turn"].command == SystemCmdInt.TURN_HAZARDS and isinstance(out["turn"], SystemCmdInt)
    assert all(m.header.stamp.nanosec == 5 and not m.clear_override and not m.ignore_overrides for m in out.values())


def test_stop_request_round_trip_and_refusals():
    msg = msgs.stop_request_message(7, "safety_monitor", True, "collision")
    assert msgs.stop_request_from_message(msg) == msgs.StopRequest("safety_monitor", True, "collision", 7)
    assert not msgs.stop_request_from_message(msgs.stop_request_message(8, "failsafe", False)).stop
    stale = msgs.diagnostics(9, "safety_monitor", msgs.Level.STALE, "", {})
    with pytest.raises(msgs.MessageError, match="OK or ERROR"):
        msgs.stop_request_from_message(stale)
    stale.status = []
    with pytest.raises(msgs.MessageError, match="exactly one status"):
        msgs.stop_request_from_message(stale)


def test_standin_frame_round_trip():
    from sps_driving.sim.pacmod import Sent

    sent = Sent(1.0, {"steering": True, "accel": False}, {"steering": -0.5, "accel": 0.25})
    assert msgs.sent_from_message(msgs.sent_message(sent, 3), 2.0) == Sent(2.0, sent.enable, sent.command)
