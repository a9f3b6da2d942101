"""extractor: per-patch descriptors for the selected patches of the newest frame (SPS eqs. 1-2).

Never queues latency: callbacks only keep the newest image and the recent selection decisions;
one worker thread computes the newest frame whose decision has arrived. A frame replaced before
it was computed, or whose decision never came, is dropped and counted, as is a frame that cannot
be decoded or gives non-finite descriptors. Output: a PointCloud2 (sps_driving.ros.msgs) with the
frame's stamp and the computed patch indices.

Extraction settings come from the parameters, the policy `checkpoint`, the `backbone_config` file
and config/extraction.yaml, in that order (sps_driving.export.extractors): with a checkpoint the
descriptors are the ones its policy was trained on, and a parameter or file that says otherwise
stops the node with both values named. The node logs the backend, runtime, precision and threads
it runs, and sends them with every frame's timing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np
from rclpy.node import Node
from sensor_msgs.msg import Image, PointCloud2

from sps_driving.core import topics
from sps_driving.core.backbones import BACKBONES, BACKEND_CHOICES, PRECISIONS
from sps_driving.core.image import ImageError
from sps_driving.export.extractors import FACT_KEYS
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, StageTimer, declare, run, schedule

UNSET = "empty: the checkpoint's, else backbone_config's, else config/extraction.yaml's"
PARAMETERS = {
    "checkpoint": Param("", "policy folder; when set, the backbone and extraction settings its policy was trained with "
                            "(a parameter or backbone_config value that differs is an error)"),
    "backend": Param("", f"extraction runtime: auto (the fastest that matches torch), torch, onnxruntime, tensorrt; {UNSET}",
                     choices=("", *BACKEND_CHOICES)),
    "backbone": Param("", f"patch-descriptor backbone: dinov2_vits14 is embedded, blip2 needs model_path, pixels is the No-FM baseline; "
                          f"{UNSET}", choices=("", *BACKBONES)),
    "backbone_config": Param("", "YAML file of further extraction settings (keys of config/extraction.yaml); empty: its defaults"),
    "model_path": Param("", f"local weights (DINOv2 ONNX file or BLIP-2 folder); {UNSET} (the embedded DINOv2 file)"),
    "device": Param("", f"cpu, cuda or auto (cuda when there is a GPU); {UNSET}"),
    "precision": Param("", f"fp32, or int8 (onnxruntime's int8 graph of the ViT's layers); {UNSET}", choices=("", *PRECISIONS)),
    "selection_timeout_s": Param(0.5, "time a frame waits for its selection decision before it is dropped", "s", above=0.0),
    "realtime_priority": Param(0, "SCHED_FIFO priority of the extractor's threads, 1 to 99; 0 = normal scheduling. On the "
                               "CPU its threads otherwise wait on the graph's other threads (docs/results/bench_cpu.md). "
                               "Only below the vehicle interface's and the failsafe's, so that they still preempt it. "
                               "Needs CAP_SYS_NICE or a real-time priority limit (ulimit -r)", min=0, max=99),
}
EXTRACTION_PARAMETERS = ("backend", "backbone", "model_path", "device", "precision")
_KEPT_DECISIONS = 90  # selection decisions remembered (3 s at 30 fps)


def load_backbone(p: dict, logger):
    """The extractor of the node's parameters, checkpoint and backbone_config (sps_driving.export.extractors)."""
    from sps_driving.export.extractors import extraction_settings, open_extractor

    settings = extraction_settings({k: p[k] for k in EXTRACTION_PARAMETERS}, p["checkpoint"], p["backbone_config"])
    for warning in settings.warnings:
        logger.warning(warning)
    opened = open_extractor(settings)
    logger.info(opened.describe())
    logger.info(f"extraction settings: {settings.describe()}")
    return opened


class ExtractorNode(Node):
    NODE_NAME = "extractor"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        # Before the runtime starts its thread pool: threads inherit the scheduling of the one that starts them.
        schedule(self, {"cpu_affinity": "", "realtime_priority": p["realtime_priority"], "nice": 0})
        opened = load_backbone(p, self.get_logger())
        self.extractor = opened.extractor
        # Sent with every frame's timing: the replay report and the benchmark say what ran.
        self.facts = {key: str(opened.facts[key]) for key in FACT_KEYS}
        # The first frame through a runtime pays for its allocations: a blank one, not the camera's.
        self.extractor.descriptors(self.extractor.encode(np.zeros((224, 224, 3), np.uint8)), np.arange(self.extractor.grid.n))
        self.selection_timeout_s = p["selection_timeout_s"]
        self.counters = {"frames": 0, "dropped_stale": 0, "dropped_no_selection": 0, "dropped_invalid": 0}
        self._lock = threading.Condition()
        self._pending: tuple[Image, float] | None = None  # newest image not yet computed, arrival time
        self._decisions: OrderedDict[int, np.ndarray | str] = OrderedDict()
        self._running = True
        self.publisher = self.create_publisher(PointCloud2, topics.DESCRIPTORS, msgs.qos("stream"))
        self.stage_timer = StageTimer(self, self.NODE_NAME)
        # Decisions first: a writer that sees the image reader knows the decision reader exists.
        self.create_subscription(Image, topics.SELECTION, self._on_selection, msgs.qos("selection"))
        self.create_subscription(Image, topics.IMAGE, self._on_image, msgs.qos("image"))
        self.worker = threading.Thread(target=self._work, name="extractor", daemon=True)
        self.worker.start()

    def _on_image(self, msg: Image) -> None:
        with self._lock:
            if self._pending is not None:
                self.counters["dropped_stale"] += 1
                self.stage_timer.dropped(msgs.stamp_ns(self._pending[0].header), "stale", self.counters)
            self._pending = (msg, time.monotonic())
            self._lock.notify()

    def _on_selection(self, msg: Image) -> None:
        try:
            indices, shape = msgs.selection_from_message(msg)
        except msgs.MessageError as exc:
            self.get_logger().warning(f"dropped selection: {exc}", throttle_duration_sec=1.0)
            return
        grid = self.extractor.grid
        decision = indices
        if shape != (grid.rows, grid.cols) or len(indices) == 0:
            # Kept as the frame's decision, so its frame is dropped at once with this reason.
            decision = f"selection is {shape[0]}x{shape[1]} with {len(indices)} patches; backbone grid is {grid.rows}x{grid.cols}"
        with self._lock:
            self._decisions[msgs.stamp_ns(msg.header)] = decision
            while len(self._decisions) > _KEPT_DECISIONS:
                self._decisions.popitem(last=False)
            self._lock.notify()

    def _next_frame(self):
        """Wait for the newest frame whose decision (indices, or why it is unusable) is in; drop
        the frame if the decision is late."""
        with self._lock:
            while self._running:
                if self._pending is not None:
                    msg, arrived = self._pending
                    decision = self._decisions.get(msgs.stamp_ns(msg.header))
                    if decision is not None:
                        self._pending = None
                        return msg, decision
                    if time.monotonic() - arrived > self.selection_timeout_s:
                        self._pending = None
                        self.counters["dropped_no_selection"] += 1
                        self.stage_timer.dropped(msgs.stamp_ns(msg.header), "no selection", self.counters)
                        self.get_logger().warning("dropped a frame: no selection decision arrived", throttle_duration_sec=1.0)
                        continue
                self._lock.wait(timeout=0.05)
        return None

    def _work(self) -> None:
        try:
            self._extract_frames()
        except Exception:
            if self.context.ok():
                raise
            # Shutting down: on SIGINT or SIGTERM rclpy invalidates the context before
            # destroy_node stops this thread, and a publish in between fails. Nothing is lost.

    def _extract_frames(self) -> None:
        while True:
            item = self._next_frame()
            if item is None:
                return
            msg, indices = item
            started = time.perf_counter()
            stamp = msgs.stamp_ns(msg.header)
            if isinstance(indices, str):
                self._drop_invalid(stamp, indices)
                continue
            try:
                rgb = msgs.image_to_rgb(msg)
                values = self.extractor.descriptors(self.extractor.encode(rgb), indices)
            except (ImageError, ValueError, RuntimeError,
                    ArithmeticError) as exc:  # RuntimeError: torch (e.g. out of memory); ArithmeticError: non-finite output of a runtime
                self._drop_invalid(stamp, str(exc))
                continue
            if not np.all(np.isfinite(values)):
                self._drop_invalid(stamp, "non-finite descriptors")
                continue
            message = msgs.descriptors_message(values, indices, stamp, msg.header.frame_id)
            ready = time.perf_counter()
            self.publisher.publish(message)
            self.counters["frames"] += 1
            self.stage_timer.publish(stamp, started, ready, {**self.counters, **self.facts})

    def _drop_invalid(self, stamp: int, why: str) -> None:
        self.counters["dropped_invalid"] += 1
        self.stage_timer.dropped(stamp, why, self.counters)
        self.get_logger().error(f"dropped a frame: {why}", throttle_duration_sec=1.0)

    def destroy_node(self):
        with self._lock:
            self._running = False
            self._lock.notify()
        # The frame in hand finishes first: a runtime's thread pool torn down under it aborts the process.
        self.worker.join(timeout=10.0)
        return super().destroy_node()


def main(args=None) -> int:
    return run(ExtractorNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
