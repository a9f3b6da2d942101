"""vehicle_interface and safety_monitor as real processes over DDS: limits, watchdog stops with
their reasons, failure events, overrides counted as interventions."""

import math
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from sensor_msgs.msg import CameraInfo, JointState, Range
from std_msgs.msg import Bool

from ros_helpers import Probe, Rate
from sps_driving import msgs, topics
from sps_driving.bagio import lane_pose_message, range_message
from sps_driving.graph import Graph, wait_for_nodes, wait_for_subscribers

pytestmark = pytest.mark.ros

VEHICLE = {
    "auto_engage": True,
    "require_safety_monitor": True,
    "max_command_age_s": 0.3,
    "max_camera_age_s": 0.3,
    "max_safety_age_s": 0.6,
    "max_road_wheel_angle_rad": 0.3,
    "max_throttle": 0.3,
    "max_brake": 0.8,
    "stop_brake": 0.5,
    "max_command_latency_s": 0.5,
}


def lane_pose(lateral, heading):
    return msgs.from_bag(lane_pose_message(lateral, heading, 0), PoseStamped)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    graph = Graph(
        ["vehicle_interface", "safety_monitor"],
        parameters={"vehicle_interface": VEHICLE},
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    probe = Probe()
    for topic, kind in ((topics.ACTUATION, "control"),):
        probe.record(topic, JointState, kind)
    probe.record(topics.VEHICLE_STATUS, DiagnosticArray, "status")
    probe.record(topics.SAFETY_EVENTS, DiagnosticArray, "status")
    probe.record(topics.SAFETY_STATUS, DiagnosticArray, "status")
    with graph:
        wait_for_nodes(probe.node, graph.nodes, 30, graph)
        yield graph, probe
        for name in graph.nodes:
            assert graph.alive(name), graph.log(name)
    probe.close()


class Inputs:
    """Camera info, lane state and policy commands at 30 Hz, each switchable."""

    def __init__(self, probe):
        self.probe = probe
        self.camera = self.lane = self.command = True
        self.steering, self.throttle = 0.05, 0.2
        self.lateral, self.heading = 0.0, 0.0
        self.age_s = 0.0  # how old the frame behind each command is
        self.info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor")
        self.pose = probe.publisher(topics.LANE_POSE, PoseStamped, "sensor")
        self.cmd = probe.publisher(topics.POLICY_COMMAND, JointState, "stream")
        self.tick = Rate(1 / 30, self._publish)

    def _publish(self):
        stamp = time.time_ns()  # the nodes' ROS clock is system time
        if self.camera:
            self.info.publish(msgs.camera_info(600, 960, stamp, "camera", math.radians(130)))
        if self.lane:
            self.pose.publish(lane_pose(self.lateral, self.heading))
        if self.command:
            self.cmd.publish(msgs.command_message(self.steering, self.throttle, stamp - int(self.age_s * 1e9)))


def last_status(probe):
    return msgs.diagnostic_values(probe.messages(topics.VEHICLE_STATUS)[-1])[0]


def run_until(probe, inputs, predicate, timeout_s=5.0):
    return probe.spin_until(predicate, timeout_s, every=inputs.tick)


def actuation(probe):
    return [msgs.command_from_message(m) for m in probe.messages(topics.ACTUATION)]


def drives(probe):
    status = probe.messages(topics.VEHICLE_STATUS)
    return bool(status) and msgs.diagnostic_values(status[-1])[0][2] == "driving"


def test_drives_within_limits_then_stops_on_each_fault(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    inputs.steering, inputs.throttle = 1.0, 0.9  # beyond both limits
    assert run_until(probe, inputs, lambda: drives(probe), 15), probe.messages(topics.VEHICLE_STATUS)[-1:]
    probe.received[topics.ACTUATION].clear()
    run_until(probe, inputs, lambda: False, 1.5)
    steering, throttle = zip(*actuation(probe))
    assert max(throttle) == pytest.approx(0.3) and max(steering) <= 0.3 + 1e-9
    assert steering[-1] == pytest.approx(0.3)  # reached the limit through the rate limit

    def stops_for(reason):
        def check():
            name, level, message, values = last_status(probe)
            return level == 1 and reason in values["stop_reasons"].split(",")

        return check

    def stop_time(reason, timeout_s=3.0):
        t0 = time.monotonic()
        assert run_until(probe, inputs, stops_for(reason), timeout_s), last_status(probe)
        return time.monotonic() - t0

    # Policy goes silent: stop within the command age plus one control period (+ DDS and test loop slack).
    inputs.command = False
    assert stop_time("command_timeout") < 0.3 + 1 / 30 + 0.25
    probe.received[topics.ACTUATION].clear()
    run_until(probe, inputs, lambda: False, 0.3)
    assert all(t == pytest.approx(-0.5) for _, t in actuation(probe))
    inputs.command = True
    assert run_until(probe, inputs, lambda: drives(probe))

    # Camera stops (commands still arrive).
    inputs.camera = False
    assert stop_time("camera_timeout") < 0.3 + 1 / 30 + 0.25
    inputs.camera = True
    assert run_until(probe, inputs, lambda: drives(probe))

    # NaN command: stop at once, nothing non-finite or out of limits goes to the car.
    inputs.steering = math.nan
    stop_time("invalid_command", 1.0)
    assert all(math.isfinite(s) and math.isfinite(t) and -0.8 <= t <= 0.3 for s, t in actuation(probe))
    inputs.steering = 0.0
    assert run_until(probe, inputs, lambda: drives(probe))
    assert int(last_status(probe)[3]["invalid_commands"]) >= 1

    # Commands computed from frames older than max_command_latency_s (a lagging pipeline).
    inputs.age_s = 1.0
    stop_time("late_command", 1.0)
    assert int(last_status(probe)[3]["late_commands"]) >= 1
    inputs.age_s = 0.0
    assert run_until(probe, inputs, lambda: drives(probe))


def test_lane_failure_requests_stop_and_raises_event(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    inputs.steering = 0.0
    assert run_until(probe, inputs, lambda: drives(probe), 10)
    events_before = len(probe.messages(topics.SAFETY_EVENTS))
    inputs.lateral = 2.5
    assert run_until(probe, inputs, lambda: "safety_stop" in last_status(probe)[3]["stop_reasons"], 3)
    assert run_until(probe, inputs, lambda: len(probe.messages(topics.SAFETY_EVENTS)) > events_before, 2)
    event = msgs.diagnostic_values(probe.messages(topics.SAFETY_EVENTS)[-1])[0]
    assert event[2] == "lane_boundary" and event[1] == 2
    inputs.lateral = 0.0
    assert run_until(probe, inputs, lambda: drives(probe), 3)
    # An obstacle inside the minimum gap: collision.
    events_before = len(probe.messages(topics.SAFETY_EVENTS))
    obstacle = probe.publisher(topics.OBSTACLE_RANGE, Range, "control")
    wait_for_subscribers(obstacle, 1, 10)  # a message sent before discovery matches is lost
    obstacle.publish(msgs.from_bag(range_message(0.4, 0), Range))
    assert run_until(probe, inputs, lambda: len(probe.messages(topics.SAFETY_EVENTS)) > events_before, 3)
    assert msgs.diagnostic_values(probe.messages(topics.SAFETY_EVENTS)[-1])[0][2] == "collision"
    obstacle.publish(msgs.from_bag(range_message(float("inf"), 0), Range))
    assert run_until(probe, inputs, lambda: drives(probe), 3)
    # Lane state stops arriving: stale input -> stop requested.
    inputs.lane = False
    assert run_until(probe, inputs, lambda: "safety_stop" in last_status(probe)[3]["stop_reasons"], 3)
    inputs.lane = True
    assert run_until(probe, inputs, lambda: drives(probe), 3)


def test_override_disengages_and_counts_intervention(rig):
    graph, probe = rig
    inputs = Inputs(probe)
    assert run_until(probe, inputs, lambda: drives(probe), 10)
    before = int(last_status(probe)[3]["interventions"])
    override = probe.publisher(topics.VEHICLE_OVERRIDE, Bool, "control")
    engage = probe.publisher(topics.ENGAGE_REQUEST, Bool, "control")
    override.publish(Bool(data=True))
    assert run_until(probe, inputs, lambda: last_status(probe)[3]["engagement"] == "disengaged", 3)
    assert int(last_status(probe)[3]["interventions"]) == before + 1
    assert "disengaged" in last_status(probe)[3]["stop_reasons"]
    override.publish(Bool(data=False))
    run_until(probe, inputs, lambda: False, 0.3)
    assert last_status(probe)[3]["engagement"] == "disengaged"  # no re-engage without a request
    engage.publish(Bool(data=True))
    assert run_until(probe, inputs, lambda: drives(probe), 3)



@pytest.mark.parametrize(
    "params, message",
    [({"backend": "pacmod3"}, "needs pacmod3_msgs"), ({"backend": "can"}, "unknown vehicle backend"),
     ({"max_throttle": 1.5}, "max_throttle")],
)
def test_bad_configuration_is_a_clear_startup_error(tmp_path, params, message):
    graph = Graph(["vehicle_interface"], parameters={"vehicle_interface": params}, log_dir=tmp_path)
    with graph:
        assert graph.returncode("vehicle_interface", wait_s=30) == 1
        assert message in graph.log("vehicle_interface")
