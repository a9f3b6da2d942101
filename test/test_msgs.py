import math

import numpy as np
import pytest
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import JointState, PointCloud2

from sps_driving.core.image import ImageError
from sps_driving.ros import msgs
from sps_driving.ros.bagio import TYPESTORE, to_bag

RGB = np.random.default_rng(5).integers(0, 256, (6, 8, 3), dtype=np.uint8)
SHARED_LAYOUTS = [
    msgs.time_fields(1_700_000_000_123_456_789),
    msgs.header_fields(42, "camera"),
    msgs.image_fields(RGB, 7, "camera"),
    msgs.image_fields(RGB, 7, "camera", "bgr8"),
    msgs.camera_info_fields(600, 960, 3, "camera", math.radians(130)),
    msgs.camera_info_fields(600, 960, 3, "camera", None),
    msgs.command_fields(0.1, -0.4, 99),
    msgs.lane_pose_fields(0.7, -0.3, 5),
    msgs.twist_fields(9.0, 5),
]


@pytest.mark.parametrize("layout", SHARED_LAYOUTS, ids=lambda layout: layout.msgtype)
def test_one_layout_makes_the_same_message_for_the_graph_and_for_bags(layout):
    """The rosbags message of a layout, serialized as a bag holds it, reads back in rclpy as the
    rclpy message of the same layout (field by field: rclpy's own bytes carry uninitialized
    padding)."""
    graph = msgs.to_ros(layout)
    assert deserialize_message(bytes(TYPESTORE.serialize_cdr(to_bag(layout), layout.msgtype)), type(graph)) == graph


def test_a_layout_names_only_fields_of_its_type():
    from sensor_msgs.msg import Range

    # Range gained `variance` after Humble (the bag types): the fields both know agree.
    layout = msgs.range_fields(3.5, 42)
    graph, bag = msgs.to_ros(layout), to_bag(layout)
    assert graph.range == bag.range == 3.5 and graph.max_range == bag.max_range == 100.0
    assert graph.radiation_type == bag.radiation_type and msgs.stamp_ns(graph.header) == msgs.stamp_ns(bag.header) == 42
    assert isinstance(graph, Range)
    with pytest.raises(ValueError, match="no fields"):
        to_bag(msgs.Fields("sensor_msgs/msg/Range", {"rnage": 1.0}))


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
    msg = msgs.to_ros(msgs.command_fields(0.1, -0.4, 99))
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
    msg = msgs.to_ros(msgs.image_fields(rgb, 7, "camera", "bgr8"))
    assert np.array_equal(msgs.image_to_rgb(msg), rgb)
    msg.data = bytes(msg.data)[:10]
    with pytest.raises(ImageError):
        msgs.image_to_rgb(msg)
    msg = msgs.to_ros(msgs.image_fields(rgb, 7, "camera"))
    msg.encoding = "16UC1"
    with pytest.raises(ImageError, match="unsupported"):
        msgs.image_to_rgb(msg)


def test_camera_info_and_lane_pose_and_qos():
    info = msgs.to_ros(msgs.camera_info_fields(600, 960, 3, "camera", math.radians(130)))
    assert info.k[0] == pytest.approx(480 / math.tan(math.radians(65))) and info.k[2] == 480
    lateral, heading = msgs.lane_from_message(to_bag(msgs.lane_pose_fields(0.7, -0.3, 0)))
    assert lateral == pytest.approx(0.7) and heading == pytest.approx(-0.3)
    from rclpy.qos import ReliabilityPolicy

    assert msgs.qos("sensor").reliability == ReliabilityPolicy.BEST_EFFORT
    assert msgs.qos("stream").reliability == ReliabilityPolicy.RELIABLE
    with pytest.raises(ValueError):
        msgs.qos("fast")


def test_diagnostics_round_trip():
    arr = msgs.diagnostics(5, "vehicle_interface", msgs.Level.ERROR, "stopping", {"reason": "command_timeout", "count": 3})
    from diagnostic_msgs.msg import DiagnosticArray

    back = deserialize_message(serialize_message(arr), DiagnosticArray)
    assert msgs.diagnostic_values(back) == [("vehicle_interface", msgs.Level.ERROR, "stopping", {"reason": "command_timeout",
                                                                                                 "count": "3"})]
    bag = TYPESTORE.deserialize_cdr(serialize_message(arr), "diagnostic_msgs/msg/DiagnosticArray")
    assert msgs.diagnostic_values(bag)[0][1] == msgs.Level.ERROR


def test_stage_reports_tell_a_passed_frame_from_a_dropped_one():
    from diagnostic_msgs.msg import DiagnosticArray

    passed = msgs.stage_timing_message(5, "policy", 4.25, {"frames": 3})
    dropped = msgs.stage_drop_message(6, "extractor", "no selection: late", {"frames": 3})
    for msg in (passed, TYPESTORE.deserialize_cdr(serialize_message(passed), "diagnostic_msgs/msg/DiagnosticArray")):
        assert msgs.stage_reports(msg) == [msgs.StageReport("policy", False, "", 4.25, {"compute_ms": "4.250", "frames": "3"})]
    back = deserialize_message(serialize_message(dropped), DiagnosticArray)
    assert msgs.stage_reports(back) == [msgs.StageReport("extractor", True, "no selection: late", None, {"frames": "3"})]
    assert msgs.diagnostic_values(back)[0][1] == msgs.Level.WARN
    # a warning that is not a drop report is not counted as one
    assert not msgs.stage_reports(msgs.diagnostics(7, "policy", msgs.Level.WARN, "slow", {}))[0].dropped


def test_bag_messages_convert_to_this_distros_types():
    from sensor_msgs.msg import CameraInfo, Image, Range

    rng_msg = msgs.from_bag(to_bag(msgs.range_fields(3.5, 42)), Range)  # Humble's Range has no `variance`
    assert rng_msg.range == pytest.approx(3.5) and msgs.stamp_ns(rng_msg.header) == 42
    info = msgs.from_bag(to_bag(msgs.camera_info_fields(600, 960, 7, "camera", math.radians(130))), CameraInfo)
    assert info.k[2] == 480.0 and info.roi.do_rectify is False and info.header.frame_id == "camera"
    rgb = np.random.default_rng(3).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    image = msgs.from_bag(to_bag(msgs.image_fields(rgb, 9, "camera")), Image)
    assert np.array_equal(msgs.image_to_rgb(image), rgb)
    from diagnostic_msgs.msg import DiagnosticArray

    bag_diag = TYPESTORE.deserialize_cdr(serialize_message(msgs.diagnostics(1, "n", msgs.Level.WARN, "m", {"a": 1})),
                                         "diagnostic_msgs/msg/DiagnosticArray")
    assert msgs.diagnostic_values(msgs.from_bag(bag_diag, DiagnosticArray)) == [("n", msgs.Level.WARN, "m", {"a": "1"})]
    assert msgs.ros_type("sensor_msgs/msg/Image") is Image and msgs.ros_type("sensor_msgs/Image") is Image
    with pytest.raises(ValueError):
        msgs.ros_type("Image")


def test_pacmod3_reports_and_commands_in_the_upstream_layout():
    from pacmod3_msgs.msg import GlobalRpt, SteeringCmd, SystemCmdFloat, SystemCmdInt, SystemRptFloat, SystemRptInt

    from sps_driving.core.control import GlobalStatus, PacmodCommand, SystemStatus

    report = SystemRptFloat(enabled=True, override_active=False, vehicle_fault=True, command_timeout=False, output=1.5)
    assert msgs.system_status(report) == SystemStatus(True, False, True, False, 1.5)
    assert msgs.system_status(SystemRptFloat(command_timeout=True)).timeout
    assert msgs.global_status(GlobalRpt(enabled=True, brake_can_timeout=True)) == GlobalStatus(True, False, False, True)
    assert msgs.global_status(GlobalRpt(config_fault_active=True)).fault
    gears = {g: msgs.forward_gear(SystemRptInt(output=getattr(SystemRptInt, g))) for g in
             ("SHIFT_PARK", "SHIFT_REVERSE", "SHIFT_NEUTRAL", "SHIFT_FORWARD", "SHIFT_LOW", "SHIFT_NONE")}
    assert gears == {"SHIFT_PARK": False, "SHIFT_REVERSE": False, "SHIFT_NEUTRAL": False, "SHIFT_FORWARD": True,
                     "SHIFT_LOW": True, "SHIFT_NONE": False}
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
    from sps_driving.ros.nodes.pacmod3_standin import sent_from_message, sent_message
    from sps_driving.sim.pacmod import Sent

    sent = Sent(1.0, {"steering": True, "accel": False}, {"steering": -0.5, "accel": 0.25})
    assert sent_from_message(sent_message(sent, 3), 2.0) == Sent(2.0, sent.enable, sent.command)
