"""The pacmod3 backend of vehicle_interface against the PACMod 3 stand-in driver, with the failsafe
and the safety monitor, as real processes over DDS: what the policy commands reaches the car as the
PACMod reads it from the driver's CAN frames (docs/vehicle.md, "The PACMod 3 driver's contract"),
and the reports carry what the driver parses from the car's frames. The fault matrix against the
same graph: test_faults.py."""

import math
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from ros_helpers import Probe, Rate
from sensor_msgs.msg import CameraInfo, JointState
from std_srvs.srv import SetBool

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes
from sps_driving.ros.nodes.pacmod3_standin import sent_from_message

pytestmark = pytest.mark.ros

SENT = "/pacmod3_standin/sent"
STEERING_RAD, THROTTLE = -0.0123456, 0.123456  # not multiples of the CAN layout's 0.001 steps
RATIO = 14.8  # config/graph.yaml


def test_commands_reach_the_car_as_can_signals_and_reports_as_the_driver_parses_them(tmp_path):
    from pacmod3_msgs.msg import GlobalRpt, SystemRptFloat, VehicleSpeedRpt

    graph = Graph(["pacmod3_standin", "vehicle_interface", "failsafe", "safety_monitor"], log_dir=tmp_path,
                  # The test's inputs come from this process: ages that a stall of it on a loaded machine does not trip.
                  parameters={"vehicle_interface": {"backend": "pacmod3", "max_command_age_s": 1.0, "max_camera_age_s": 1.0},
                              "safety_monitor": {"required_inputs": ["lane"], "max_input_age_s": 1.0}})
    probe = Probe()
    for topic, kind in ((SENT, JointState), (topics.DIAGNOSTICS, DiagnosticArray)):
        probe.record(topic, kind, "status")
    for topic, kind in ((topics.PACMOD_SPEED_RPT, VehicleSpeedRpt), (topics.PACMOD_STEERING_RPT, SystemRptFloat),
                        (topics.PACMOD_ACCEL_RPT, SystemRptFloat), (topics.PACMOD_GLOBAL_RPT, GlobalRpt)):
        probe.record(topic, kind, "sensor")
    info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor_out")
    lane = probe.publisher(topics.LANE_POSE, PoseStamped, "sensor_out")
    command = probe.publisher(topics.POLICY_COMMAND, JointState, "stream")

    def publish():
        stamp = time.time_ns()
        info.publish(msgs.to_ros(msgs.camera_info_fields(600, 960, stamp, "camera", math.radians(130))))
        lane.publish(msgs.to_ros(msgs.lane_pose_fields(0.0, 0.0, stamp)))
        command.publish(msgs.to_ros(msgs.command_fields(STEERING_RAD, THROTTLE, stamp)))

    tick = Rate(1 / 30, publish)
    with graph:
        try:
            wait_for_nodes(probe.node, graph.nodes, 30, graph)
            engaged = False
            deadline = time.monotonic() + 30
            while not engaged and time.monotonic() < deadline:
                probe.spin_until(lambda: False, 0.3, every=tick)
                answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
                engaged = answer is not None and answer.success and probe.spin_until(
                    lambda: probe.status("vehicle_interface")[1] == "driving", 3, every=tick)
            assert engaged, probe.status("vehicle_interface")
            probe.spin_until(lambda: False, 1.0, every=tick)  # the steering rate limit reaches the command
            window_s = time.monotonic()
            probe.received[SENT].clear()
            probe.spin_until(lambda: False, 1.0, every=tick)
            sends = [sent_from_message(m, t) for t, m in probe.received[SENT]]
        finally:
            probe.close()
    assert len(sends) > 15
    for sent in sends:
        assert all(sent.enable[s] for s in ("steering", "accel", "brake", "turn")), sent
        # In 0.001 steps, truncated toward zero by the driver's cast (not rounded).
        assert sent.command["steering"] == -0.182 and sent.command["accel"] == 0.123, sent
        assert sent.command["brake"] == 0.0 and sent.command["turn"] == 1.0, sent  # TURN_NONE
    speeds = [m.vehicle_speed for _, m in probe.received[topics.PACMOD_SPEED_RPT]]
    assert speeds and max(speeds) > 0.1 and all(round(v * 100) == pytest.approx(v * 100, abs=1e-6) for v in speeds)
    wheel = [m.output for _, m in probe.received[topics.PACMOD_STEERING_RPT]]
    assert wheel and all(round(v * 1000) == pytest.approx(v * 1000, abs=1e-6) for v in wheel)
    accel = [m for t, m in probe.received[topics.PACMOD_ACCEL_RPT] if t > window_s + 0.1]
    assert accel and all(m.enabled and m.command == 0.123 and not m.command_timeout for m in accel), accel[:3]
    assert all(not m.supervisory_enable_required for _, m in probe.received[topics.PACMOD_GLOBAL_RPT])
