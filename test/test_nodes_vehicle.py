"""vehicle_interface ("topics" backend) and safety_monitor as real processes over DDS: engagement
through the services, limits, latched stops with their reasons, overrides and the re-arm lockout,
a second publisher on the stop request, the OOD rule's slow-down, REP 117 ranges, a stepped ROS clock, and the exit
sequence on SIGTERM (test_nodes_vehicle_exit.py). The PACMod 3 backend against the stand-in
driver: test_nodes_pacmod.py."""

import math
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped, TwistStamped
from ros_helpers import Probe, Rate
from sensor_msgs.msg import CameraInfo, JointState, Range
from std_msgs.msg import Bool, Float32
from std_srvs.srv import SetBool, Trigger

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros

VEHICLE = {
    "backend": "topics",
    "require_failsafe": False,
    "max_command_age_s": 0.3,
    "max_camera_age_s": 0.3,
    "max_safety_age_s": 0.6,
    "max_report_age_s": 0.3,
    "max_road_wheel_angle_rad": 0.3,
    "max_throttle": 0.3,
    "max_brake": 0.8,
    "max_command_latency_s": 0.5,
}
STOP_BRAKE = 0.5  # config/graph.yaml


def lane_pose(lateral, heading):
    return msgs.to_ros(msgs.lane_pose_fields(lateral, heading, 0))


def start_rig(tmp_path, vehicle=VEHICLE, nodes=("vehicle_interface", "safety_monitor")):
    graph = Graph(list(nodes), parameters={"vehicle_interface": vehicle}, log_dir=tmp_path)
    probe = Probe()
    probe.record(topics.ACTUATION, JointState, "status")  # keep every message, even while the test is not spinning
    probe.record(topics.DIAGNOSTICS, DiagnosticArray, "status")
    probe.record(topics.SAFETY_EVENTS, DiagnosticArray, "status")
    graph.start()
    wait_for_nodes(probe.node, graph.nodes, 30, graph)
    return graph, probe


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    graph, probe = start_rig(tmp_path_factory.mktemp("logs"))
    yield graph, probe
    for name in graph.nodes:
        assert graph.alive(name), graph.log(name)
    graph.stop()
    probe.close()


class Inputs:
    """Camera info, lane state, speed and policy commands at 30 Hz, each switchable."""

    def __init__(self, probe, clock=None):
        self.probe = probe
        self.clock = clock or time.time_ns  # the vehicle interface's ROS clock
        self.camera = self.lane = self.command = True
        self.steering, self.throttle = 0.05, 0.2
        self.lateral, self.heading = 0.0, 0.0
        self.age_s = 0.0  # how old the frame behind each command is
        # m; when set, published every tick as a range sensor repeats itself (one best-effort message
        # can be lost while the receiver's side of discovery is still matching)
        self.obstacle_m = None
        self.info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor_out")
        self.pose = probe.publisher(topics.LANE_POSE, PoseStamped, "sensor_out")
        self.twist = probe.publisher(topics.VEHICLE_TWIST, TwistStamped, "sensor_out")
        self.cmd = probe.publisher(topics.POLICY_COMMAND, JointState, "stream")
        self.range = probe.publisher(topics.OBSTACLE_RANGE, Range, "sensor_out")
        self.tick = Rate(1 / 30, self._publish)

    def _publish(self):
        stamp = self.clock()
        if self.camera:
            self.info.publish(msgs.to_ros(msgs.camera_info_fields(600, 960, stamp, "camera", math.radians(130))))
        if self.lane:
            self.pose.publish(lane_pose(self.lateral, self.heading))
        self.twist.publish(msgs.to_ros(msgs.twist_fields(3.0, stamp)))
        if self.command:
            self.cmd.publish(msgs.to_ros(msgs.command_fields(self.steering, self.throttle, stamp - int(self.age_s * 1e9))))
        if self.obstacle_m is not None:
            self.range.publish(msgs.to_ros(msgs.range_fields(self.obstacle_m, stamp)))


def vehicle(probe):
    return probe.status("vehicle_interface")


def run_until(probe, inputs, predicate, timeout_s=5.0):
    return probe.spin_until(predicate, timeout_s, every=inputs.tick)


def actuation(probe):
    return [msgs.command_from_message(m) for m in probe.messages(topics.ACTUATION)]


def drives(probe):
    return vehicle(probe)[1] == "driving"


def engage(probe, inputs, timeout_s=10.0):
    """Disengage, re-arm and engage until the car drives (again after a stop that latched meanwhile)."""
    deadline = time.monotonic() + timeout_s
    answer = None
    while time.monotonic() < deadline:
        probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=False))
        probe.call(Trigger, topics.REARM_SERVICE, Trigger.Request())
        run_until(probe, inputs, lambda: False, 0.2)
        answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
        if answer is not None and answer.success and run_until(probe, inputs, lambda: drives(probe), 2.0):
            return
    raise AssertionError(f"did not engage: {answer and answer.message}; status {vehicle(probe)}")


def stop_reasons(probe):
    return vehicle(probe)[2].get("stop_reasons", "").split(",")


def test_engage_is_refused_until_every_input_is_ready(rig):
    graph, probe = rig
    assert probe.spin_until(lambda: "engagement" in vehicle(probe)[2], 10)
    answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
    assert answer is not None and not answer.success and "inputs not ready" in answer.message, answer
    assert vehicle(probe)[2]["engagement"] == "disengaged"


def test_drives_within_limits_then_each_fault_latches_a_stop(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    inputs.steering, inputs.throttle = 0.9, 0.9  # over both limits, inside the physical range
    engage(probe, inputs)
    probe.received[topics.ACTUATION].clear()
    run_until(probe, inputs, lambda: False, 1.5)
    steering, throttle = zip(*actuation(probe))
    assert max(throttle) == pytest.approx(0.3) and max(steering) <= 0.3 + 1e-9
    assert steering[-1] == pytest.approx(0.3)  # reached the limit through the rate limit

    def stop_time(reason, timeout_s=3.0):
        t0 = time.monotonic()
        assert run_until(probe, inputs, lambda: reason in stop_reasons(probe), timeout_s), vehicle(probe)
        return time.monotonic() - t0

    # Policy goes silent: stop within the command age plus one control period (+ DDS and test loop slack).
    inputs.command = False
    assert stop_time("command_timeout") < 0.3 + 1 / 30 + 0.25
    assert vehicle(probe)[0] == msgs.Level.WARN
    inputs.command = True
    run_until(probe, inputs, lambda: False, 0.1)  # a command sent before the stop can be taken in after its status
    probe.received[topics.ACTUATION].clear()
    run_until(probe, inputs, lambda: False, 0.6)  # the policy is back: the stop holds
    assert all(t == pytest.approx(-STOP_BRAKE) for _, t in actuation(probe))
    assert "command_timeout" in stop_reasons(probe)

    engage(probe, inputs)
    inputs.camera = False  # camera stops (commands still arrive)
    assert stop_time("camera_timeout") < 0.3 + 1 / 30 + 0.25
    inputs.camera = True

    engage(probe, inputs)
    inputs.steering = math.nan  # NaN command: stop at once, nothing non-finite or out of limits goes out
    stop_time("invalid_command", 1.0)
    assert all(math.isfinite(s) and math.isfinite(t) and -0.8 <= t <= 0.3 for s, t in actuation(probe))
    inputs.steering = 0.0
    assert int(vehicle(probe)[2]["invalid_commands"]) >= 1

    engage(probe, inputs)
    inputs.age_s = 1.0  # commands from frames older than max_command_latency_s (a lagging pipeline)
    stop_time("late_command", 1.0)
    assert int(vehicle(probe)[2]["late_commands"]) >= 1
    inputs.age_s = 0.0


def test_override_disengages_counts_an_intervention_and_locks_out_until_rearmed(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    engage(probe, inputs)
    before = int(vehicle(probe)[2]["interventions"])
    override = probe.publisher(topics.VEHICLE_OVERRIDE, Bool, "control")
    wait_for_subscribers(override, 1, 10)
    override.publish(Bool(data=True))
    assert run_until(probe, inputs, lambda: vehicle(probe)[2]["engagement"] == "disengaged", 3)
    assert int(vehicle(probe)[2]["interventions"]) == before + 1
    assert vehicle(probe)[2]["last_event"] == "override" and vehicle(probe)[2]["locked_out"] == "True"
    override.publish(Bool(data=False))
    run_until(probe, inputs, lambda: False, 0.3)
    answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
    assert not answer.success and "re-arm" in answer.message
    assert probe.call(Trigger, topics.REARM_SERVICE, Trigger.Request()).success
    assert probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True)).success
    assert run_until(probe, inputs, lambda: drives(probe), 3)


def test_a_second_stop_request_publisher_stops_and_blocks_engagement(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    engage(probe, inputs)
    rogue = probe.node.create_publisher(DiagnosticArray, topics.SAFETY_STOP, msgs.qos("control"))
    spoof = Rate(0.1, lambda: rogue.publish(msgs.stop_request_message(time.time_ns(), "safety_monitor", False)))

    def tick():
        inputs.tick()
        spoof()

    assert probe.spin_until(lambda: "duplicate_publisher" in stop_reasons(probe), 3, every=tick), vehicle(probe)
    probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=False))
    answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
    assert not answer.success and "duplicate_publisher" in answer.message
    probe.node.destroy_publisher(rogue)
    engage(probe, inputs)


def test_the_ood_rules_slow_down_caps_the_speed_at_its_scale_of_the_cruise_target(rig):
    graph, probe = rig
    inputs = Inputs(probe)  # the car at 3 m/s, the policy asking for 0.2 throttle
    inputs.steering = 0.0
    engage(probe, inputs)
    scale = probe.publisher(topics.CRUISE_SCALE, Float32, "control")
    target = probe.publisher(topics.TARGET_SPEED, TwistStamped, "sensor_out")
    wait_for_subscribers(scale, 1, 10)
    wait_for_subscribers(target, 1, 10)

    def slowed_to(value, cap_mps):
        def tick():
            inputs.tick()
            scale.publish(Float32(data=value))
            target.publish(msgs.to_ros(msgs.twist_fields(4.0, time.time_ns())))

        assert probe.spin_until(lambda: vehicle(probe)[2].get("speed_cap_mps") == f"{cap_mps:.2f}", 3, every=tick), vehicle(probe)
        probe.spin_until(lambda: False, 0.2, every=tick)  # commands sent before the status can be taken in after it
        probe.received[topics.ACTUATION].clear()
        probe.spin_until(lambda: False, 0.3, every=tick)
        return [t for _, t in actuation(probe)]

    dropped = int(vehicle(probe)[2]["dropped_messages"])
    assert all(t == pytest.approx(-0.2) for t in slowed_to(0.5, 2.0))  # 1 m/s over a cap of 0.5 x 4 m/s: a gentle brake
    assert drives(probe)  # slowed, not stopped
    assert all(t == pytest.approx(0.2) for t in slowed_to(1.0, 8.0))  # the rule lets go: the policy's throttle again
    slowed_to(1.5, 8.0)  # not a scale: dropped and counted, the cap unchanged
    assert int(vehicle(probe)[2]["dropped_messages"]) > dropped
    probe.node.destroy_publisher(scale)
    probe.node.destroy_publisher(target)


def test_lane_failure_and_an_obstacle_too_close_to_measure_stop(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    inputs.steering = 0.0
    engage(probe, inputs)
    events_before = len(probe.messages(topics.SAFETY_EVENTS))
    inputs.lateral = 2.5
    assert run_until(probe, inputs, lambda: "safety_stop" in stop_reasons(probe), 3)
    assert run_until(probe, inputs, lambda: len(probe.messages(topics.SAFETY_EVENTS)) > events_before, 2)
    event = msgs.diagnostic_values(probe.messages(topics.SAFETY_EVENTS)[-1])[0]
    assert event[2] == "lane_boundary" and event[1] == msgs.Level.ERROR
    inputs.lateral = 0.0
    engage(probe, inputs)
    # REP 117: -inf is an obstacle too close to measure, a collision.
    events_before = len(probe.messages(topics.SAFETY_EVENTS))
    inputs.obstacle_m = -math.inf
    assert run_until(probe, inputs, lambda: len(probe.messages(topics.SAFETY_EVENTS)) > events_before, 3)
    assert msgs.diagnostic_values(probe.messages(topics.SAFETY_EVENTS)[-1])[0][2] == "collision"
    assert run_until(probe, inputs, lambda: "safety_stop" in stop_reasons(probe), 3)
    inputs.obstacle_m = math.inf
    engage(probe, inputs)


@pytest.mark.parametrize(
    "params, message",
    [({"backend": "can"}, "parameter backend of /vehicle_interface is 'can'"), ({"max_throttle": 1.5}, "max_throttle")],
)
def test_bad_configuration_is_a_clear_startup_error(tmp_path, params, message):
    graph = Graph(["vehicle_interface"], parameters={"vehicle_interface": params}, log_dir=tmp_path)
    with graph:
        assert graph.returncode("vehicle_interface", wait_s=30) == CANNOT_START
        assert message in graph.log("vehicle_interface")
