"""policy: descriptors of the kept patches (and the car's state) -> a stamped (steering, throttle) command.

Loads a checkpoint folder (policy.safetensors + config.json, sps_driving.core.policies.checkpoint). A message
with the wrong layout, non-finite descriptors or indices the policy cannot take is dropped and
counted; the command carries the camera frame's stamp of its descriptors.

A policy with state inputs (sps_driving.core.state) also reads the car's speed, from the report
the vehicle interface's backend reads (`vehicle_backend`), and the cruise target speed, from
topics.TARGET_SPEED or, until a message arrives there, the `target_speed_mps` parameter. A frame's
state is the value whose header stamp is nearest to the frame's stamp, as training paired them; a
frame without one within the age limit (none received, stale, or reported invalid) is dropped and
counted by reason, never driven from an old speed.

A patch policy (sps_driving.core.policies.patch_policy) reads each frame with the earlier frames of its
window, kept in a history by camera stamp (sps_driving.core.history): a frame dropped before or
here leaves its slot empty and shortens the windows that would have used it, stamps that go
backwards or a long gap restart the history; the counters say how often (`history_*`).

With `ood_score` the node scores every commanded frame's kept descriptors against the calibration
in the checkpoint's folder (sps_driving.core.ood: a missing or mismatched one stops the node at
start with the reason) and publishes the score on topics.OOD_SCORE with the frame's stamp, after
the command; the latest is in its timing diagnostics (`ood_score`). The safety monitor's OOD rule
slows the car through the vehicle interface's speed cap; the policy reads the cruise target as set
(a lowered one made the shipped policy drive faster: docs/results/ood_score.md).

With `publish_overlay` the node also shows what the policy sees, on topics.POLICY_OVERLAY: every
`overlay_every_n`-th commanded frame's camera image (read from topics.IMAGE, matched to the
descriptors by stamp) with the kept patches outlined, the dropped ones dimmed and, with
`overlay_attribution`, each kept patch tinted by its occlusion attribution. A worker thread at a
lower CPU priority draws it after the command is out, so the command never waits for it; a frame
whose image has not arrived within `overlay_image_timeout_s`, or that a newer one replaces while
the worker is busy, is skipped and counted. Off by default: on the car it copies every camera
frame into this process and spends k + 1 policy forwards per attributed frame on the CPU the
command path shares.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from rclpy.node import Node
from sensor_msgs.msg import Image, JointState, PointCloud2

from sps_driving.core import topics
from sps_driving.core.image import ImageError
from sps_driving.core.resources import SHIPPED_POLICY
from sps_driving.core.state import SPEED_TOPICS, StateTracker, StateUnavailable, live_source
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, StageTimer, declare, run

PARAMETERS = {
    "checkpoint": Param(SHIPPED_POLICY, "policy folder with policy.safetensors and config.json"),
    "device": Param("cpu", "torch device: cpu, cuda or auto (cuda when there is a GPU)"),
    "vehicle_backend": Param("topics", "the vehicle interface's backend, whose speed report is read: pacmod3 "
                             f"{SPEED_TOPICS['pacmod3']}, topics {SPEED_TOPICS['topics']}", choices=tuple(SPEED_TOPICS)),
    "target_speed_mps": Param(4.0, f"cruise target speed until one arrives on {topics.TARGET_SPEED}; keep it below "
                              "the vehicle interface's max_speed_mps, where the accelerator is cut", "m/s", above=0.0),
    "max_speed_age_s": Param(0.1, "the speed nearest a frame's stamp may be this far from it, else the frame is dropped",
                             "s", above=0.0),
    "max_target_speed_age_s": Param(1.0, "the same for the cruise target speed, once one has arrived", "s", above=0.0),
    "ood_score": Param(False, f"publish the OOD score of every commanded frame on {topics.OOD_SCORE} (needs the "
                       "checkpoint's calibration, `sps-driving ood calibrate`)"),
    "ood_config": Param("", "OOD score settings, the score's method among them ('' = config/ood.yaml)"),
    "publish_overlay": Param(False, f"publish {topics.POLICY_OVERLAY}: camera frames with the kept patches drawn (RViz, "
                             "Foxglove); off on the car, where it costs a camera subscription and CPU beside the command path"),
    "overlay_every_n": Param(5, "draw every n-th commanded frame (from the first)", "frames", min=1),
    "overlay_attribution": Param(True, "tint each kept patch by its occlusion attribution (k + 1 policy forwards per drawn frame)"),
    "overlay_image_timeout_s": Param(0.5, "a frame to draw whose camera image has not arrived within this is skipped",
                                     "s", above=0.0),
}
OVERLAY_IMAGES = 30  # camera images kept for matching by stamp (1 s at 30 fps); the oldest go first
OVERLAY_NICENESS = 10  # added to the overlay thread's nice value: the command path comes first
# State input -> the parameter of its age limit.
MAX_AGE_PARAMETERS = {"speed_mps": "max_speed_age_s", "target_speed_mps": "max_target_speed_age_s"}


class PolicyNode(Node):
    NODE_NAME = "policy"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        from sps_driving.core.backbones import resolve_device
        from sps_driving.core.policies.checkpoint import load_policy
        from sps_driving.core.policies.streaming import StreamingPolicy

        self.policy = load_policy(p["checkpoint"], device=str(resolve_device(p["device"])))
        # A patch policy reads the frame's window from its history (sps_driving.core.history).
        self.streaming = StreamingPolicy(self.policy)
        self.counters = {"frames": 0, "dropped_invalid": 0, **self.streaming.counts}
        self.publisher = self.create_publisher(JointState, topics.POLICY_COMMAND, msgs.qos("stream"))
        self.stage_timer = StageTimer(self, self.NODE_NAME)
        self.state_tracker = None
        if self.policy.state_inputs:
            self.state_tracker = self._read_state(p)
        self.ood = OodPublisher(self, p) if p["ood_score"] else None
        self.overlay = OverlayPublisher(self, p) if p["publish_overlay"] else None
        self.create_subscription(PointCloud2, topics.DESCRIPTORS, self._on_descriptors, msgs.qos("stream"))
        sel = self.policy.selection
        self.get_logger().info(f"policy {p['checkpoint']}: {sel.variant} rate {sel.rate}, D={self.policy.descriptor_dim}, "
                               f"state inputs {list(self.policy.state_inputs) or 'none'}, {self.streaming.describe()}")

    def _read_state(self, p: dict) -> StateTracker:
        names = self.policy.state_inputs
        tracker = StateTracker({name: p[MAX_AGE_PARAMETERS[name]] for name in names},
                               fallback={"target_speed_mps": p["target_speed_mps"]})
        for name in names:
            topic, msgtype = live_source(name, p["vehicle_backend"])
            try:
                message_type = msgs.ros_type(msgtype)
            except ImportError as exc:
                raise ValueError(f"reading {name} from {topic} needs {msgtype} (for pacmod3: apt install "
                                 f"ros-$ROS_DISTRO-pacmod3-msgs); or set vehicle_backend to 'topics'") from exc

            def on_state(msg, name=name):
                tracker.add(name, msgs.stamp_ns(msg.header), msgs.speed_from_message(msg))

            self.create_subscription(message_type, topic, on_state, msgs.qos("sensor"))
            self.get_logger().info(f"state input {name} from {topic}, at most {p[MAX_AGE_PARAMETERS[name]]:g} s from the frame")
        self.counters.update(dropped_state_missing=0, dropped_state_stale=0, dropped_state_invalid=0)
        return tracker

    def _on_descriptors(self, msg: PointCloud2) -> None:
        started = time.perf_counter()
        stamp = msgs.stamp_ns(msg.header)
        try:
            values, indices = msgs.descriptors_from_message(msg)
            state = self.state_tracker.at(stamp) if self.state_tracker is not None else None
            steering, throttle = self.streaming.step(stamp, values, indices, state)
        except StateUnavailable as exc:
            self.counters[f"dropped_state_{exc.kind}"] += 1
            self.stage_timer.dropped(stamp, str(exc), self.counters)
            self.get_logger().warning(f"dropped a frame: {exc}", throttle_duration_sec=1.0)
            return
        except (ValueError, RuntimeError) as exc:  # MessageError, bad shapes, NaN/Inf in or out; torch errors
            self.counters["dropped_invalid"] += 1
            self.stage_timer.dropped(stamp, str(exc), self.counters)
            self.get_logger().error(f"dropped descriptors: {exc}", throttle_duration_sec=1.0)
            return
        command = msgs.to_ros(msgs.command_fields(steering, throttle, stamp))
        ready = time.perf_counter()
        self.publisher.publish(command)
        if self.ood is not None:
            self.ood.publish(stamp, values, indices)
        self.counters.update(self.streaming.counts)
        if self.overlay is not None and self.counters["frames"] % self.overlay.every_n == 0:
            self.overlay.submit(stamp, values, indices, state)
        self.counters["frames"] += 1
        self.stage_timer.publish(stamp, started, ready, self.counters)

    def destroy_node(self):
        if self.overlay is not None:
            self.overlay.stop()
        return super().destroy_node()


class OodPublisher:
    """The OOD score of each commanded frame on topics.OOD_SCORE (see the module docstring)."""

    def __init__(self, node: PolicyNode, p: dict):
        from sps_driving.core.ood import load_calibration, load_ood_config
        from sps_driving.core.policies.checkpoint import WEIGHTS_FILE

        self.node = node
        self.method = load_ood_config(p["ood_config"] or None)["score"]["method"]
        self.scorer = load_calibration(p["checkpoint"], node.policy.config, Path(p["checkpoint"]) / WEIGHTS_FILE,
                                       method=self.method)
        self.publisher = node.create_publisher(JointState, topics.OOD_SCORE, msgs.qos("stream"))
        node.counters.update(ood_score=float("nan"), ood_invalid=0)
        node.get_logger().info(f"OOD score {self.method} on {topics.OOD_SCORE} (calibration of {p['checkpoint']}: "
                               f"scales {self.scorer.scales})")

    def publish(self, stamp: int, descriptors, indices) -> None:
        try:
            score = self.scorer.score(descriptors, self.method, indices)
        except ValueError as exc:
            self.node.counters["ood_invalid"] += 1
            self.node.get_logger().error(f"OOD score: {exc}", throttle_duration_sec=1.0)
            return
        self.node.counters["ood_score"] = round(score, 4)
        self.publisher.publish(msgs.to_ros(msgs.Fields("sensor_msgs/msg/JointState", {
            "header": msgs.header_fields(stamp, "camera"), "name": [self.method], "position": [score]})))


class OverlayPublisher:
    """The policy's view on topics.POLICY_OVERLAY (see the module docstring): camera images kept
    by stamp, the newest frame to draw, and the worker thread that draws and publishes it."""

    def __init__(self, node: PolicyNode, p: dict):
        from sps_driving.export.extractors import extraction_settings, frame_overlay

        self.node, self.policy = node, node.policy
        self.every_n, self.with_attribution = p["overlay_every_n"], p["overlay_attribution"]
        self.image_timeout_s = p["overlay_image_timeout_s"]
        # Where the patches lie on the frame: the extraction settings the checkpoint records.
        self.drawer = frame_overlay(extraction_settings(checkpoint=self.policy.config).config, self.policy.grid)
        node.counters.update(overlay_published=0, overlay_no_image=0, overlay_skipped_busy=0, overlay_invalid=0)
        self._lock = threading.Condition()
        self._images: OrderedDict[int, Image] = OrderedDict()
        self._pending = None  # (stamp, descriptors, indices, state, monotonic s when handed over)
        self._running = True
        self.publisher = node.create_publisher(Image, topics.POLICY_OVERLAY, msgs.qos("image"))
        node.create_subscription(Image, topics.IMAGE, self._on_image, msgs.qos("image"))
        self.worker = threading.Thread(target=self._work, name="overlay", daemon=True)
        self.worker.start()
        node.get_logger().info(f"overlay on {topics.POLICY_OVERLAY}: every {self.every_n} frame(s), "
                               f"attribution {'on' if self.with_attribution else 'off'}")

    def _on_image(self, msg: Image) -> None:
        with self._lock:
            self._images[msgs.stamp_ns(msg.header)] = msg
            while len(self._images) > OVERLAY_IMAGES:
                self._images.popitem(last=False)
            self._lock.notify()

    def submit(self, stamp: int, descriptors, indices, state) -> None:
        """Hand a commanded frame to the worker; never waits for it."""
        with self._lock:
            if self._pending is not None:
                self.node.counters["overlay_skipped_busy"] += 1
            self._pending = (stamp, descriptors, indices, state, time.monotonic())
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify()
        self.worker.join(timeout=2.0)

    def _next(self):
        """The pending frame and its image once the image is in; a frame whose image is late is skipped."""
        with self._lock:
            while self._running:
                if self._pending is not None:
                    image = self._images.get(self._pending[0])
                    if image is not None:
                        job, self._pending = self._pending, None
                        return job, image
                    if time.monotonic() - self._pending[-1] > self.image_timeout_s:
                        self._pending = None
                        self.node.counters["overlay_no_image"] += 1
                        self.node.get_logger().warning("overlay: no camera image with the frame's stamp arrived in time",
                                                       throttle_duration_sec=5.0)
                        continue
                self._lock.wait(timeout=0.05)
        return None

    def _work(self) -> None:
        # Linux: the nice value is per thread (and the threads torch starts from here inherit it).
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + OVERLAY_NICENESS)
        while (item := self._next()) is not None:
            (stamp, descriptors, indices, state, _), image = item
            try:
                rgb = msgs.image_to_rgb(image)
                attribution = self.policy.attribution(descriptors, indices, state) if self.with_attribution else None
                drawn = self.drawer.draw(rgb, indices, attribution)
            except (ImageError, ValueError, RuntimeError) as exc:  # a bad frame; torch errors
                self.node.counters["overlay_invalid"] += 1
                self.node.get_logger().warning(f"overlay: {exc}", throttle_duration_sec=5.0)
                continue
            self.publisher.publish(msgs.to_ros(msgs.image_fields(drawn, stamp, image.header.frame_id)))
            self.node.counters["overlay_published"] += 1


def main(args=None) -> int:
    return run(PolicyNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
