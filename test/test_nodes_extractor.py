"""The full chain with the real embedded DINOv2 extractor (at 112 px: an 8x8 grid) as separate
processes: corrupt frames are dropped and counted without harm to any node, the extractor keeps
only the newest frame under a burst, and killing it stops the car within the command age.
Slow: loading the backbone alone takes 5-20 s on two shared cores."""

import math
import signal
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe
from samples import tiny_policy
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.graph import VEHICLE_WITHOUT_CAR, Graph, wait_for_nodes, wait_for_topics

pytestmark = pytest.mark.ros
MAX_AGE = 0.5


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extractor")
    ckpt = tiny_policy(tmp / "policy", rows=8, cols=8, dim=384)
    (tmp / "extraction.yaml").write_text("input_size: [112, 112]\n")
    graph = Graph(
        ["selection", "extractor", "policy", "vehicle_interface"],
        parameters={
            "selection": {"checkpoint": str(ckpt)},
            "extractor": {"backbone_config": str(tmp / "extraction.yaml"), "selection_timeout_s": 5.0},
            "policy": {"checkpoint": str(ckpt)},
            "vehicle_interface": {
                **VEHICLE_WITHOUT_CAR, "require_safety_monitor": False, "max_command_age_s": MAX_AGE, "max_camera_age_s": 5.0,
                "max_command_latency_s": 0.0,  # the frames carry made-up stamps
            },
        },
        log_dir=tmp / "logs",
    )
    probe = Probe()
    for topic, kind, msg_type in (
        (topics.DESCRIPTORS, "status", PointCloud2), (topics.POLICY_COMMAND, "status", JointState),
        (topics.STAGE_TIMING, "status", DiagnosticArray), (topics.DIAGNOSTICS, "status", DiagnosticArray),
        (topics.ACTUATION, "status", JointState),
    ):
        probe.record(topic, msg_type, kind)
    image = probe.publisher(topics.IMAGE, Image, "image")
    info = probe.publisher(topics.CAMERA_INFO, CameraInfo, "sensor_out")
    try:
        with graph:
            wait_for_nodes(probe.node, graph.nodes, 180, graph)
            wait_for_topics(probe.node, {topics.IMAGE: 1, topics.CAMERA_INFO: 2, topics.SELECTION: 1, topics.DESCRIPTORS: 2}, 60, graph)
            yield graph, probe, image, info
    finally:
        probe.close()  # also when the graph did not come up: a probe left behind would be a second publisher to later tests


RNG = np.random.default_rng(0)
STAMP = [1_700_000_000_000_000_000]


def send(image_pub, info_pub, msg=None):
    STAMP[0] += 33_333_333
    stamp = STAMP[0]
    if msg is None:
        msg = msgs.to_ros(msgs.image_fields(RNG.integers(0, 256, (600, 960, 3), dtype=np.uint8), stamp, "camera"))
    msg.header.stamp = msgs.to_ros(msgs.time_fields(stamp))
    image_pub.publish(msg)
    info_pub.publish(msgs.to_ros(msgs.camera_info_fields(600, 960, stamp, "camera", math.radians(130))))
    return stamp


def outcome(probe, stamp):
    """'command', a drop reason, or None while pending."""
    if any(msgs.stamp_ns(m.header) == stamp for m in probe.messages(topics.POLICY_COMMAND)):
        return "command"
    for m in probe.messages(topics.STAGE_TIMING):
        report = msgs.stage_reports(m)[0]
        if report.dropped and msgs.stamp_ns(m.header) == stamp:
            return f"{report.stage} dropped: {report.reason}"
    return None


def test_corrupt_frames_are_dropped_and_counted(rig):
    graph, probe, image, info = rig
    stamp = send(image, info)
    assert probe.spin_until(lambda: outcome(probe, stamp) is not None, 120), graph.log("extractor")[-2000:]
    assert outcome(probe, stamp) == "command"
    good = msgs.to_ros(msgs.image_fields(np.zeros((600, 960, 3), np.uint8), 0, "camera"))
    bad = {
        "wrong encoding": Image(height=600, width=960, encoding="16UC1", step=1920, data=bytes(600 * 1920)),
        "truncated": Image(height=600, width=960, encoding="rgb8", step=2880, data=bytes(1000)),
        "short step": Image(height=600, width=960, encoding="rgb8", step=100, data=bytes(600 * 2880)),
        "empty": Image(height=0, width=0, encoding="rgb8", step=0, data=b""),
    }
    for what, msg in bad.items():
        stamp = send(image, info, msg)
        assert probe.spin_until(lambda: outcome(probe, stamp) is not None, 30), what
        assert outcome(probe, stamp).startswith("extractor dropped"), (what, outcome(probe, stamp))
    # A selection decision for another grid (here from the test, with no CameraInfo for the frame).
    STAMP[0] += 33_333_333
    stamp = STAMP[0]
    good.header.stamp = msgs.to_ros(msgs.time_fields(stamp))
    selection = probe.publisher(topics.SELECTION, Image, "selection")
    image.publish(good)
    selection.publish(msgs.selection_message(np.array([0, 5]), 4, 4, stamp, "camera"))
    assert probe.spin_until(lambda: outcome(probe, stamp) is not None, 30)
    assert "selection is 4x4" in outcome(probe, stamp) and "backbone grid is 8x8" in outcome(probe, stamp)
    stamp = send(image, info, good)
    assert probe.spin_until(lambda: outcome(probe, stamp) is not None, 60), graph.log("extractor")[-1500:]
    assert outcome(probe, stamp) == "command"
    assert all(graph.alive(n) for n in graph.nodes)
    for s, t in (msgs.command_from_message(m) for m in probe.messages(topics.ACTUATION)):
        assert math.isfinite(s) and math.isfinite(t) and abs(s) <= 0.35 + 1e-9 and -0.8 <= t <= 0.3


def test_a_frame_without_a_decision_is_dropped_after_the_timeout(rig):
    """No decision within selection_timeout_s (5 s here) drops the frame with that reason, and the
    next frame is computed as usual."""
    graph, probe, image, info = rig
    STAMP[0] += 33_333_333
    stamp = STAMP[0]
    frame = msgs.to_ros(msgs.image_fields(RNG.integers(0, 256, (600, 960, 3), dtype=np.uint8), stamp, "camera"))
    image.publish(frame)  # no CameraInfo: the selection node never decides
    assert probe.spin_until(lambda: outcome(probe, stamp) is not None, 30)
    assert outcome(probe, stamp) == "extractor dropped: no selection"
    following = send(image, info)
    assert probe.spin_until(lambda: outcome(probe, following) is not None, 60)
    assert outcome(probe, following) == "command"


def test_burst_keeps_only_the_newest_frame(rig):
    """Eight frames arrive back to back while no decision can come (the selection node is
    stopped): the extractor keeps only the newest, so once decisions flow again exactly that one is
    computed. A queue would compute every frame it took in (or drop them for want of a decision).
    Holding the selection makes the outcome independent of how fast this machine runs."""
    graph, probe, image, info = rig
    frames = [msgs.to_ros(msgs.image_fields(RNG.integers(0, 256, (600, 960, 3), dtype=np.uint8), 0, "camera")) for _ in range(8)]
    graph.signal_node("selection", signal.SIGSTOP)
    try:
        stamps = [send(image, info, frame) for frame in frames]
        stale = lambda: sum(outcome(probe, s) == "extractor dropped: stale" for s in stamps)  # noqa: E731
        # Each frame the extractor takes in replaces the one before: wait until that has settled,
        # well within its 5 s wait for a decision.
        seen, settled_at = -1, time.monotonic()
        give_up = settled_at + 3.0
        while time.monotonic() - settled_at < 1.0 and time.monotonic() < give_up:
            if stale() != seen:
                seen, settled_at = stale(), time.monotonic()
            probe.spin(0.1)
    finally:
        graph.signal_node("selection", signal.SIGCONT)
    assert probe.spin_until(lambda: outcome(probe, stamps[-1]) is not None, 60)
    probe.spin(0.5)
    results = [outcome(probe, s) for s in stamps]
    assert results[-1] == "command", results
    # The others were replaced in the extractor (stale) or, under the camera QoS (keep last 3),
    # before it took them in (no outcome at all).
    assert set(results[:-1]) <= {"extractor dropped: stale", None}, results
    assert "extractor dropped: stale" in results, results


def test_killing_the_extractor_stops_the_car(rig):
    graph, probe, image, info = rig

    def status():
        return ("vehicle_interface", *probe.status("vehicle_interface"))

    stamp = send(image, info)
    assert probe.spin_until(lambda: outcome(probe, stamp) == "command", 60)
    assert probe.spin_until(lambda: status()[2] == "driving", 2)
    graph.kill("extractor")
    assert probe.spin_until(lambda: "command_timeout" in status()[3].get("stop_reasons", ""), 5)
    # The stop comes within the command age limit and one control period of the last command, both
    # as this process took them in. The status and the stop arrive on two topics, so the status can
    # be taken in first: wait for the stop.
    last_command = max(t for t, _ in probe.received[topics.POLICY_COMMAND])

    def throttles_after_last_command():
        return [(t, msgs.command_from_message(m)[1]) for t, m in probe.received[topics.ACTUATION] if t > last_command]

    def first_stop():
        """When the stop began: the first stop command after the car drove on the last command (an
        extraction slower than the command age can have stopped it, unlatched, just before)."""
        after = throttles_after_last_command()
        driving = next((i for i, (_, throttle) in enumerate(after) if throttle != pytest.approx(-0.5)), None)
        return None if driving is None else next((t for t, throttle in after[driving:] if throttle == pytest.approx(-0.5)), None)

    assert probe.spin_until(lambda: first_stop() is not None, 2), throttles_after_last_command()
    assert first_stop() - last_command < MAX_AGE + 1 / 30 + 0.2
    probe.spin(0.3)
    held = [throttle for t, throttle in throttles_after_last_command() if t >= first_stop()]
    assert len(held) >= 2 and all(throttle == pytest.approx(-0.5) for throttle in held), held  # the stop holds
    assert graph.alive("selection") and graph.alive("policy") and graph.alive("vehicle_interface")
