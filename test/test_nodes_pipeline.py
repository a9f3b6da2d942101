"""selection -> policy -> vehicle_interface as real processes over DDS, with this test playing the
camera (CameraInfo) and the extractor (descriptors for exactly the patches the selection node
chose). Commands must match the core run in-process; bad descriptors are dropped and counted;
killing the policy gives a controlled stop; a missing checkpoint is a clear error.
The full chain with the real DINOv2 extractor is test_nodes_extractor.py (slow)."""

import math
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe
from samples import tiny_policy
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.core.policies.checkpoint import load_policy
from sps_driving.core.selection import PatchSelector
from sps_driving.ros import msgs
from sps_driving.ros.graph import VEHICLE_WITHOUT_CAR, Graph, wait_for_nodes, wait_for_subscribers
from sps_driving.ros.process import CANNOT_START

pytestmark = pytest.mark.ros

DIM = 16
MAX_AGE = 0.4


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    ckpt = tiny_policy(tmp_path_factory.mktemp("ckpt") / "policy", dim=DIM)
    graph = Graph(
        ["selection", "policy", "vehicle_interface"],
        parameters={
            "selection": {"checkpoint": str(ckpt)},
            "policy": {"checkpoint": str(ckpt)},
            "vehicle_interface": {
                **VEHICLE_WITHOUT_CAR, "require_safety_monitor": False,
                "max_command_age_s": MAX_AGE, "max_camera_age_s": 2.0,
                "max_command_latency_s": 0.0,  # the frames carry made-up stamps
            },
        },
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    probe = Probe()
    probe.record(topics.SELECTION, Image, "selection")
    probe.record(topics.POLICY_COMMAND, JointState, "stream")
    probe.record(topics.ACTUATION, JointState, "status")
    probe.record(topics.DIAGNOSTICS, DiagnosticArray, "status")
    probe.record(topics.STAGE_TIMING, DiagnosticArray, "status")
    info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor_out")
    descriptors = probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream")
    try:
        with graph:
            wait_for_nodes(probe.node, graph.nodes, 60, graph)
            wait_for_subscribers(info, 2, 20)
            wait_for_subscribers(descriptors, 1, 20)
            yield graph, probe, load_policy(ckpt), info, descriptors
    finally:
        probe.close()  # also when the graph did not come up: a probe left behind would be a second publisher to later tests


def by_stamp(probe, topic):
    return {msgs.stamp_ns(m.header): m for m in probe.messages(topic)}


def play_frame(probe, info, descriptors, stamp, values_for):
    """Publish one frame's CameraInfo, wait for its selection, answer with descriptors, wait for the command."""
    info.publish(msgs.to_ros(msgs.camera_info_fields(600, 960, stamp, "camera", math.radians(130))))
    assert probe.spin_until(lambda: stamp in by_stamp(probe, topics.SELECTION), 10), f"no selection for {stamp}"
    indices, shape = msgs.selection_from_message(by_stamp(probe, topics.SELECTION)[stamp])
    values = values_for(indices)
    descriptors.publish(msgs.descriptors_message(values, indices, stamp, "camera"))
    got = probe.spin_until(lambda: stamp in by_stamp(probe, topics.POLICY_COMMAND), 3)
    return indices, values, got


def test_each_frame_gets_a_stamped_command_matching_the_core(rig):
    graph, probe, policy, info, descriptors = rig
    rng = np.random.default_rng(0)
    selector = PatchSelector(policy.selection, policy.grid)
    for i in range(6):
        stamp = 1_700_000_000_000_000_000 + i * 33_333_333
        indices, values, got = play_frame(
            probe, info, descriptors, stamp, lambda idx: rng.standard_normal((len(idx), DIM)).astype(np.float32)
        )
        assert got, f"no command for frame {i}"
        assert np.array_equal(indices, selector.select(stamp))
        steering, throttle = msgs.command_from_message(by_stamp(probe, topics.POLICY_COMMAND)[stamp])
        expected = policy.predict(values, indices)
        assert (steering, throttle) == pytest.approx(expected, abs=1e-6)
    timings = [msgs.stage_reports(m)[0] for m in probe.messages(topics.STAGE_TIMING)]
    assert {t.stage for t in timings} == {"selection", "policy"}
    assert all(not t.dropped and t.compute_ms >= 0 for t in timings)


def test_bad_descriptors_are_dropped_and_counted(rig):
    graph, probe, policy, info, descriptors = rig

    def with_nan(idx):
        values = np.ones((len(idx), DIM), np.float32)
        values[0, 0] = np.nan
        return values

    stamp = 1_700_000_001_000_000_000
    _, _, got = play_frame(probe, info, descriptors, stamp, with_nan)
    assert not got
    stamp += 33_333_333
    _, _, got = play_frame(probe, info, descriptors, stamp, lambda idx: np.ones((len(idx), DIM + 1), np.float32))
    assert not got  # wrong descriptor width for this policy
    stamp += 33_333_333
    _, _, got = play_frame(probe, info, descriptors, stamp, lambda idx: np.zeros((len(idx), DIM), np.float32))
    assert got  # the node is alive and still serving
    def policy_timing():
        for m in probe.messages(topics.STAGE_TIMING):
            report = msgs.stage_reports(m)[0]
            if report.stage == "policy" and msgs.stamp_ns(m.header) == stamp:
                return report.values
        return None

    assert probe.spin_until(lambda: policy_timing() is not None, 3)
    assert int(policy_timing()["dropped_invalid"]) == 2
    for s, t in (msgs.command_from_message(m) for m in probe.messages(topics.ACTUATION)):
        assert math.isfinite(s) and math.isfinite(t) and abs(s) <= 0.35 + 1e-9 and -0.8 <= t <= 0.3


def last_status(probe):
    return ("vehicle_interface", *probe.status("vehicle_interface"))


def test_killing_the_policy_stops_the_car_within_the_command_age(rig):
    graph, probe, policy, info, descriptors = rig
    rng = np.random.default_rng(1)
    stamp = 1_700_000_002_000_000_000
    period = 1 / 30
    next_frame = [time.monotonic()]
    pending = {}

    def feed():
        """Frames at 30 Hz; descriptors for each selection as soon as it arrives."""
        nonlocal stamp
        now = time.monotonic()
        if now >= next_frame[0]:
            next_frame[0] = now + period
            stamp += 33_333_333
            info.publish(msgs.to_ros(msgs.camera_info_fields(600, 960, stamp, "camera", math.radians(130))))
        for s, m in by_stamp(probe, topics.SELECTION).items():
            if s not in pending:
                idx, _ = msgs.selection_from_message(m)
                pending[s] = True
                descriptors.publish(msgs.descriptors_message(rng.standard_normal((len(idx), DIM)).astype(np.float32), idx, s, "camera"))

    assert probe.spin_until(lambda: last_status(probe)[2] == "driving", 10, every=feed), last_status(probe)
    graph.kill("policy")
    killed = time.monotonic()
    assert probe.spin_until(lambda: "command_timeout" in last_status(probe)[3].get("stop_reasons", ""), 5, every=feed)
    elapsed = time.monotonic() - killed
    assert elapsed < MAX_AGE + 1 / 30 + 0.3, elapsed  # age + one control period + DDS/test-loop slack
    assert graph.alive("selection") and graph.alive("vehicle_interface")
    # The policy comes back: the car drives again without any other node restarting.
    graph.start("policy")
    wait_for_nodes(probe.node, ["policy"], 60, graph)
    assert probe.spin_until(lambda: last_status(probe)[2] == "driving", 30, every=feed), last_status(probe)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(tmp_path / "nowhere")}}, log_dir=tmp_path)
    with graph:
        assert graph.returncode("policy", wait_s=60) == CANNOT_START
        assert "no policy config at" in graph.log("policy") and "nowhere" in graph.log("policy")
