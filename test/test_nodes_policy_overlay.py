"""The policy node's overlay (/policy/overlay), as a real process over DDS: this test plays the camera
and the extractor. With publish_overlay the node reads the camera, matches a commanded frame's image
by stamp and publishes it with the kept patches as they were (tinted by attribution) and the
dropped ones dimmed, every overlay_every_n-th frame; a frame whose image never comes is skipped and
counted, and its command still goes out. Without it the node neither reads the camera nor
publishes an overlay."""

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe
from samples import tiny_policy
from sensor_msgs.msg import Image, JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.core.overlay import DROPPED_DIM
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes, wait_for_subscribers

pytestmark = pytest.mark.ros

ROWS = COLS = 8
DIM = 16
HEIGHT, WIDTH = 64, 96  # px: 8 x 12 px patches over the whole frame (the tiny policy records no roi)
GRAY = 200
T0 = 1_700_000_000_000_000_000
KEPT = np.arange(0, ROWS * COLS, 3)


def start(tmp_path, **overlay):
    ckpt = tiny_policy(tmp_path / "policy", ROWS, COLS, DIM)
    graph = Graph(["policy"], parameters={"policy": {"checkpoint": str(ckpt), **overlay}}, log_dir=tmp_path / "logs")
    probe = Probe()
    for topic, kind, qos in ((topics.POLICY_COMMAND, JointState, "stream"), (topics.POLICY_OVERLAY, Image, "image"),
                             (topics.STAGE_TIMING, DiagnosticArray, "status")):
        probe.record(topic, kind, qos)
    publishers = {"image": probe.publisher(topics.IMAGE, Image, "image"),
                  "descriptors": probe.publisher(topics.DESCRIPTORS, PointCloud2, "stream")}
    graph.start()
    wait_for_nodes(probe.node, ["policy"], 60, graph)
    wait_for_subscribers(publishers["descriptors"], 1, 60)
    return graph, probe, publishers


def frame(probe, publishers, stamp, with_image=True):
    """Publish one frame's camera image and descriptors; returns its command."""
    if with_image:
        publishers["image"].publish(msgs.to_ros(msgs.image_fields(np.full((HEIGHT, WIDTH, 3), GRAY, np.uint8), stamp, "camera")))
    values = np.random.default_rng(stamp % 1000).standard_normal((len(KEPT), DIM)).astype(np.float32)
    publishers["descriptors"].publish(msgs.descriptors_message(values, KEPT, stamp, "camera"))

    def command():
        return next((m for m in probe.messages(topics.POLICY_COMMAND) if msgs.stamp_ns(m.header) == stamp), None)

    assert probe.spin_until(lambda: command() is not None, 10), f"no command for frame {stamp}"
    return command()


def overlays(probe):
    return {msgs.stamp_ns(m.header): m for m in probe.messages(topics.POLICY_OVERLAY)}


def test_the_overlay_shows_the_kept_patches_of_every_nth_frame_and_skips_one_without_its_image(tmp_path):
    graph, probe, publishers = start(tmp_path, publish_overlay=True, overlay_every_n=2, overlay_attribution=True,
                                     overlay_image_timeout_s=0.5)
    try:
        wait_for_subscribers(publishers["image"], 1, 30)
        stamps = [T0 + i * 100_000_000 for i in range(4)]
        frame(probe, publishers, stamps[0])
        # Its overlay drawn before the next due frame: the low-priority worker is free again (on a
        # loaded machine it can lag, and an overlay due while it is busy is skipped, by design).
        assert probe.spin_until(lambda: stamps[0] in overlays(probe), 10)
        for stamp in stamps[1:3]:
            frame(probe, publishers, stamp)
        assert probe.spin_until(lambda: len(overlays(probe)) == 2, 10)
        probe.spin(0.5)
        drawn = overlays(probe)
        assert sorted(drawn) == [stamps[0], stamps[2]]  # frames 0 and 2 of every 2nd
        overlay = drawn[stamps[2]]
        assert (overlay.height, overlay.width, overlay.encoding, overlay.header.frame_id) == (HEIGHT, WIDTH, "rgb8", "camera")
        rgb = msgs.image_to_rgb(overlay)
        centres = [(r * 8 + 4, c * 12 + 6) for r, c in (divmod(j, COLS) for j in range(ROWS * COLS))]
        kept = np.array([rgb[centres[j]] for j in KEPT]).astype(int)
        dropped = np.array([rgb[centres[j]] for j in np.setdiff1d(np.arange(ROWS * COLS), KEPT)]).astype(int)
        assert (dropped == round(GRAY * DROPPED_DIM)).all()
        assert (kept[:, 0] >= GRAY).all() and (kept[:, 1] <= GRAY).all()  # undimmed; tinted red by attribution
        assert kept[:, 1].min() < GRAY - 50, "the most influential kept patch is tinted"

        # Frame 4 (due) has no image: its command goes out, its overlay is skipped and counted.
        frame(probe, publishers, stamps[3])
        frame(probe, publishers, stamps[3] + 100_000_000, with_image=False)
        probe.spin(1.0)
        frame(probe, publishers, stamps[3] + 200_000_000)
        assert len(overlays(probe)) == 2

        def counters():
            reports = [msgs.stage_reports(m)[0] for m in probe.messages(topics.STAGE_TIMING)]
            return reports[-1].values if reports else {}

        assert probe.spin_until(lambda: counters().get("frames") == "6", 5)
        assert {k: int(v) for k, v in counters().items() if k.startswith("overlay")} == {
            "overlay_published": 2, "overlay_no_image": 1, "overlay_skipped_busy": 0, "overlay_invalid": 0}
    finally:
        graph.stop()
        probe.close()


def test_without_publish_overlay_the_node_neither_reads_the_camera_nor_publishes_one(tmp_path):
    graph, probe, publishers = start(tmp_path)
    try:
        frame(probe, publishers, T0)
        probe.spin(1.0)
        assert overlays(probe) == {}
        subscribed = {t for t, _ in probe.node.get_subscriber_names_and_types_by_node("policy", "/")}
        published = {t for t, _ in probe.node.get_publisher_names_and_types_by_node("policy", "/")}
        assert topics.DESCRIPTORS in subscribed and topics.IMAGE not in subscribed
        assert topics.POLICY_COMMAND in published and topics.POLICY_OVERLAY not in published
    finally:
        graph.stop()
        probe.close()
