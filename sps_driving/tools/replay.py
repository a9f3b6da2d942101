"""`sps-driving replay BAG`: play a bag (a rosbag2 folder, or a bare .mcap or .db3 file:
sps_driving.ros.bagio) through the live graph and report.

The graph (selection, extractor, policy, vehicle_interface with the `topics` backend,
safety_monitor) runs as separate node processes over DDS on loopback (sps_driving.ros.graph). The
bag's camera frames (and lane state, obstacle range, speed when recorded) are published with their
recorded stamps, so the selection is the one the car made and results are reproducible (a JPEG
camera, CompressedImage on /camera/image_raw/compressed as `record` keeps it, plays decoded as
the camera driver sends it; the bag's references are read as a drive, sps_driving.ros.drive):

- lockstep (default): one frame at a time; the next frame goes out when the previous one has its
  command or a stage reported dropping it. Deterministic, and as fast as the graph computes.
  The vehicle interface's age limits are raised to the frame timeout (frames are not at 30 fps).
- real time: messages go out at their recorded pace; stages that cannot keep up drop frames.

Everything the graph publishes is recorded into an output bag (log time = when it was received
here; by default out/replay/<bag name>_<time> under the current folder), together with the
CameraInfo of each frame as it entered the graph. An image whose stamp was already played is not
published (the graph keys every frame by its stamp) and is counted as dropped. The report (every
image of the bag accounted for as a command or a drop with its reason, command error against the
bag's reference commands, failures, interventions, time stopping, per-stage latency, compute and
graph overhead) is computed from those records by `build_report`, which needs no ROS.

The reference commands are the ones that drove the car: /vehicle/command in the world's bags; in
a car's bag, what the safety driver did, from its PACMod 3 reports (sps_driving.ros.car_labels,
with the rules `sps-driving extract` labels by: only the frames the human drove, moving forward),
so a field recording validates a policy as a world recording does. The report says which.

A policy with state inputs reads them as on the car: from the bag's topics, and a frame without
a speed is dropped. For a bag that records none (a camera-only recording), --speed-mps and
--target-speed-mps supply constant values (`state_plan`): this process publishes them with each
frame's stamp, just before its image, on the topics the policy node reads, so the node and the
car's path stay as they are. Never by default, never over a recorded value; the report says where
each state input came from.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from sps_driving.core import topics
from sps_driving.core.history import COUNTER_PREFIX
from sps_driving.core.state import STATE_INPUTS, live_source, recorded_vehicle_backend
from sps_driving.export.extractors import FACT_KEYS
from sps_driving.ros import msgs
from sps_driving.ros.graph import VEHICLE_WITHOUT_CAR

# Stage outputs whose receive time minus the frame's entry time is that stage's latency.
STAGES = {"selection": topics.SELECTION, "extractor": topics.DESCRIPTORS, "policy": topics.POLICY_COMMAND}
RECORDED = {
    topics.SELECTION: "sensor_msgs/msg/Image",
    topics.DESCRIPTORS: "sensor_msgs/msg/PointCloud2",
    topics.POLICY_COMMAND: "sensor_msgs/msg/JointState",
    topics.ACTUATION: "sensor_msgs/msg/JointState",
    topics.DIAGNOSTICS: "diagnostic_msgs/msg/DiagnosticArray",
    topics.SAFETY_EVENTS: "diagnostic_msgs/msg/DiagnosticArray",
    topics.SAFETY_STOP: "diagnostic_msgs/msg/DiagnosticArray",
    topics.STAGE_TIMING: "diagnostic_msgs/msg/DiagnosticArray",
    topics.POLICY_OVERLAY: "sensor_msgs/msg/Image",  # with --overlay
    topics.OOD_SCORE: "sensor_msgs/msg/JointState",  # with a calibrated checkpoint
}
# Besides the camera; and the topics of the policy's state inputs the bag has (`played_topics`).
PLAYED = (topics.LANE_POSE, topics.OBSTACLE_RANGE, topics.VEHICLE_TWIST)
PLAYED_QOS = {topics.IMAGE: "image"}  # as the camera driver publishes it; the other played topics as drivers publish sensor data
GRAPH_NODES = ("selection", "extractor", "policy", "vehicle_interface", "safety_monitor")
REFERENCE_MATCH_S = 0.05  # a reference command within this of a frame's stamp is its reference
VEHICLE_INTERFACE, SAFETY_MONITOR = "vehicle_interface", "safety_monitor"  # their status names
REPEATED_STAMP = "repeated stamp"  # drop reason: an image whose stamp was already played
NO_OUTCOME = "no outcome"  # drop reason: neither a command nor a stage's drop report came
IDLE_WAIT_S = 0.25  # s, the longest a lockstep wait sleeps without a message (see Player.wait_for)
# State inputs a replay may supply for a bag that records none: state input -> its option.
SUPPLY_OPTIONS = {"speed_mps": "--speed-mps", "target_speed_mps": "--target-speed-mps"}


@dataclass(frozen=True)
class Record:
    topic: str
    log_time_ns: int  # when it was received (outputs) or published (frames)
    msg: object  # a rosbags message


# ---------------------------------------------------------------- report (no ROS)


def percentiles(values) -> dict:
    values = np.asarray(list(values), dtype=np.float64)
    if values.size == 0:
        return {"p50": None, "p99": None, "mean": None, "max": None, "count": 0}
    return {
        "p50": float(np.percentile(values, 50)),
        "p99": float(np.percentile(values, 99)),
        "mean": float(values.mean()),
        "max": float(values.max()),
        "count": int(values.size),
    }


def errors(pairs) -> dict:
    """MAE, RMSE and max absolute error of (predicted, reference) pairs."""
    diff = np.array([p - r for p, r in pairs], dtype=np.float64)
    if diff.size == 0:
        return {"mae": None, "rmse": None, "max": None, "count": 0}
    return {
        "mae": float(np.abs(diff).mean()),
        "rmse": float(np.sqrt((diff**2).mean())),
        "max": float(np.abs(diff).max()),
        "count": int(diff.size),
    }


def match_reference(stamps, reference: dict, tolerance_ns: int) -> dict:
    """{frame stamp: reference (steering, throttle)} by nearest reference stamp within tolerance."""
    if not reference:
        return {}
    ref_stamps = np.array(sorted(reference), dtype=np.int64)
    out = {}
    for stamp in stamps:
        i = int(np.searchsorted(ref_stamps, stamp))
        best = min((ref_stamps[j] for j in (i - 1, i) if 0 <= j < len(ref_stamps)), key=lambda s: abs(int(s) - stamp))
        if abs(int(best) - stamp) <= tolerance_ns:
            out[stamp] = reference[int(best)]
    return out


def stopping_fraction(states, start_ns: int | None, end_ns: int | None) -> float | None:
    """Fraction of [start_ns, end_ns] during which the latest of `states` [(time ns, stopping)] said
    stopping; time before the first state is not stopping. None for an empty span."""
    if start_ns is None or end_ns is None or end_ns <= start_ns:
        return None
    states = sorted(states)
    stopped = 0
    for (t, stopping), (t_next, _) in zip(states, states[1:] + [(end_ns, False)]):
        if stopping:
            stopped += max(0, min(t_next, end_ns) - max(t, start_ns))
    return stopped / (end_ns - start_ns)


@dataclass
class _GraphOutputs:
    """What the graph's outputs say, gathered in one pass over the records (`from_records`) for
    `build_report`."""

    first_seen: dict = field(default_factory=lambda: {topic: {} for topic in STAGES.values()})  # output -> {stamp: log time}
    commands: dict = field(default_factory=dict)  # stamp -> the first policy command for it
    compute: dict = field(default_factory=dict)  # stage -> {stamp: compute ms}
    reported_drops: dict = field(default_factory=dict)  # stamp -> the first drop reported for it
    policy_history: dict = field(default_factory=dict)  # a patch policy's frame history: frames, resets and cut windows by reason
    extractor_runs: dict = field(default_factory=dict)  # what the extractor runs (backend, runtime, precision, threads), from its timing
    failure_counts: dict = field(default_factory=dict)
    safety_interventions: int = 0
    vehicle_interventions: int = 0
    stop_reasons: dict = field(default_factory=dict)
    vehicle_states: list = field(default_factory=list)  # (time ns, stopping) of each vehicle-interface status

    @classmethod
    def from_records(cls, records: list, start_ns: int | None) -> _GraphOutputs:
        """Each record by its topic; statuses only from `start_ns` on (start-up stops are left out)."""
        outputs = cls()
        for rec in records:
            if rec.topic in outputs.first_seen:
                outputs._add_stage_output(rec)
            elif rec.topic == topics.STAGE_TIMING:
                outputs._add_stage_timing(rec.msg)
            elif rec.topic == topics.SAFETY_EVENTS:
                outputs._add_safety_events(rec.msg)
            elif rec.topic == topics.DIAGNOSTICS and start_ns is not None and rec.log_time_ns >= start_ns:
                outputs._add_statuses(rec)
        return outputs

    def _add_stage_output(self, rec: Record) -> None:
        """A stage's output: when it first came for its frame (latency) and, from the policy, the command."""
        stamp = msgs.stamp_ns(rec.msg.header)
        self.first_seen[rec.topic].setdefault(stamp, rec.log_time_ns)
        if rec.topic == topics.POLICY_COMMAND:
            self.commands.setdefault(stamp, msgs.command_from_message(rec.msg))

    def _add_stage_timing(self, msg) -> None:
        """A frame's compute time or drop by a stage, and what the policy and extractor report of themselves."""
        for report in msgs.stage_reports(msg):
            if report.stage == "policy":  # a patch policy's history counters (totals: the largest is the latest)
                for key, value in report.values.items():
                    if key.startswith(COUNTER_PREFIX):
                        name = key[len(COUNTER_PREFIX):]
                        self.policy_history[name] = max(self.policy_history.get(name, 0), int(value))
            if report.compute_ms is not None:
                self.compute.setdefault(report.stage, {})[msgs.stamp_ns(msg.header)] = report.compute_ms
                if report.stage == "extractor":
                    self.extractor_runs.update({k: v for k, v in report.values.items() if k in FACT_KEYS})
            elif report.dropped:
                self.reported_drops.setdefault(msgs.stamp_ns(msg.header), f"{report.stage}: {report.reason[:80]}")

    def _add_safety_events(self, msg) -> None:
        """The safety monitor's failure events, counted by failure."""
        for _, _, _, values in msgs.diagnostic_values(msg):
            failure = values.get("failure", "unknown")
            self.failure_counts[failure] = self.failure_counts.get(failure, 0) + 1

    def _add_statuses(self, rec: Record) -> None:
        """The safety monitor's and vehicle interface's statuses: their intervention totals, and
        whether (and why) the vehicle interface was stopping."""
        for name, _, _, values in msgs.diagnostic_values(rec.msg):
            if name == SAFETY_MONITOR:
                self.safety_interventions = max(self.safety_interventions, int(values.get("interventions", 0)))
            elif name == VEHICLE_INTERFACE:
                self.vehicle_interventions = max(self.vehicle_interventions, int(values.get("interventions", 0)))
                reasons = [r for r in values.get("stop_reasons", "").split(",") if r]
                self.vehicle_states.append((rec.log_time_ns, bool(reasons)))
                for reason in reasons:
                    self.stop_reasons[reason] = self.stop_reasons.get(reason, 0) + 1


def _latency_and_compute(frames: dict, outputs: _GraphOutputs) -> tuple[dict, dict]:
    """(latency, compute) percentiles in ms: each stage's output and the command after the frame
    entered the graph; each stage's compute (until its output is ready), and the graph overhead:
    end-to-end latency minus the compute on the critical path (extractor, policy), so transport,
    the publishing of each output included."""

    def latencies(topic):
        return {s: (t - frames[s]) / 1e6 for s, t in outputs.first_seen[topic].items() if s in frames}

    latency_ms = {stage: percentiles(latencies(topic).values()) for stage, topic in STAGES.items()}
    camera_to_command = latencies(topics.POLICY_COMMAND)
    latency_ms["camera_to_command"] = percentiles(camera_to_command.values())
    compute = outputs.compute
    compute_ms = {stage: percentiles(by_stamp.values()) for stage, by_stamp in sorted(compute.items())}
    overhead = [
        total - compute.get("extractor", {}).get(s, math.nan) - compute.get("policy", {}).get(s, math.nan)
        for s, total in camera_to_command.items()
    ]
    compute_ms["graph_overhead"] = percentiles(v for v in overhead if math.isfinite(v))
    return latency_ms, compute_ms


def _drops(frames: dict, outputs: _GraphOutputs, repeated_stamps: int) -> dict:
    """{reason: images} for every image without a command: repeated stamps first, then by the
    first drop a stage reported for the frame, or NO_OUTCOME."""
    drops = {REPEATED_STAMP: repeated_stamps} if repeated_stamps else {}
    for stamp in frames:
        if stamp not in outputs.commands:
            reason = outputs.reported_drops.get(stamp, NO_OUTCOME)
            drops[reason] = drops.get(reason, 0) + 1
    return drops


def build_report(frames: dict, records: list, reference: dict, wall_s: float, repeated_stamps: int = 0) -> dict:
    """The replay report.

    frames: {camera stamp ns: time the frame entered the graph, ns}, one per image played;
    records: graph outputs as `Record`s; reference: {stamp ns: (steering, throttle)} from the bag;
    wall_s: duration of the playback; repeated_stamps: images of the bag not played because their
    stamp already was. Every image has one outcome: its command (frames_out) or a drop, by reason
    (the first drop a stage reported for it, "repeated stamp", or "no outcome" when neither came),
    so frames_in = frames_out + frames_dropped. Statuses (from /diagnostics or the nodes' old status
    topics, by status name) count from the moment the first frame entered the graph, so start-up
    stops are left out; the counters they carry are the nodes' totals (a patch policy's history
    counters are `policy_history`: frames, resets and cut windows by reason).
    """
    start_ns = min(frames.values(), default=None)
    end_ns = max(frames.values(), default=None)
    outputs = _GraphOutputs.from_records(records, start_ns)
    latency_ms, compute_ms = _latency_and_compute(frames, outputs)
    commands = outputs.commands
    out_stamps = [s for s in commands if s in frames]
    drops = _drops(frames, outputs, repeated_stamps)
    matched = match_reference(out_stamps, reference, int(REFERENCE_MATCH_S * 1e9))
    steering = errors((commands[s][0], ref[0]) for s, ref in matched.items())
    throttle = errors((commands[s][1], ref[1]) for s, ref in matched.items())
    return {
        "frames_in": len(frames) + repeated_stamps,
        "frames_out": len(out_stamps),
        "frames_dropped": sum(drops.values()),
        "drops": drops,
        "wall_s": wall_s,
        "throughput_fps": len(out_stamps) / wall_s if wall_s > 0 else None,
        "reference_commands": len(matched),
        "steering_mae": steering["mae"],
        "steering_rmse": steering["rmse"],
        "steering_max": steering["max"],
        "throttle_mae": throttle["mae"],
        "throttle_rmse": throttle["rmse"],
        "throttle_max": throttle["max"],
        "failures": outputs.failure_counts,
        "interventions": outputs.safety_interventions + outputs.vehicle_interventions,
        "interventions_safety": outputs.safety_interventions,
        "interventions_override": outputs.vehicle_interventions,
        "vehicle_stopping_fraction": stopping_fraction(outputs.vehicle_states, start_ns, end_ns),
        "vehicle_stop_reasons": outputs.stop_reasons,
        "latency_ms": latency_ms,
        "compute_ms": compute_ms,
        "extractor": outputs.extractor_runs,
        **({"policy_history": outputs.policy_history} if outputs.policy_history else {}),
    }


def format_report(r: dict) -> str:
    def num(value, fmt=".4f"):
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"frames in {r['frames_in']}, out {r['frames_out']}, dropped {r['frames_dropped']}"
        f" ({num(r['throughput_fps'], '.2f')} frames/s over {r['wall_s']:.1f} s)",
    ]
    for reason, count in sorted(r["drops"].items()):
        lines.append(f"  dropped, {reason}: {count}")
    for name, state_source in r.get("state", {}).items():
        lines.append(f"state {name}: {describe_state_source(state_source)}")
    source = f" (from {r['reference_source']})" if r.get("reference_source") else ""
    lines.append(f"reference commands matched: {r['reference_commands']}{source}")
    if r.get("reference_unavailable"):
        lines.append(f"  no reference: {r['reference_unavailable']}")
    if r.get("reference_excluded"):
        excluded = ", ".join(f"{k} {v}" for k, v in sorted(r["reference_excluded"].items()))
        lines.append(f"  frames without the human's command: {excluded}")
    for name in ("steering", "throttle"):
        lines.append(
            f"  {name:9s} MAE {num(r[name + '_mae'])}  RMSE {num(r[name + '_rmse'])}  max {num(r[name + '_max'])}"
        )
    failures = ", ".join(f"{k} {v}" for k, v in sorted(r["failures"].items())) or "none"
    lines.append(f"failures: {failures}")
    lines.append(
        f"interventions: {r['interventions']} ({r['interventions_safety']} failure episodes, "
        f"{r['interventions_override']} overrides)"
    )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["vehicle_stop_reasons"].items())) or "none"
    lines.append(
        f"vehicle stopping {num(r['vehicle_stopping_fraction'], '.0%')} of the time from first to last frame"
        f" (stop reasons in status reports: {reasons})"
    )
    runs = r.get("extractor") or {}
    if runs:
        lines.append(f"extractor: backend {runs.get('backend')}, {runs.get('runtime')}, {runs.get('precision')}, "
                     f"{runs.get('threads')} thread(s)")
    if r.get("policy_history"):
        lines.append("policy history (windows of frames): " + ", ".join(f"{k} {v}" for k, v in r["policy_history"].items()))
    lines.append("latency ms (from the frame entering the graph)   p50      p99      n")
    for stage, stats in r["latency_ms"].items():
        lines.append(f"  {stage:44s} {num(stats['p50'], '8.1f')} {num(stats['p99'], '8.1f')} {stats['count']:6d}")
    lines.append("compute ms (inside the node)                      p50      p99      n")
    for stage, stats in r["compute_ms"].items():
        lines.append(f"  {stage:44s} {num(stats['p50'], '8.1f')} {num(stats['p99'], '8.1f')} {stats['count']:6d}")
    return "\n".join(lines)


def describe_state_source(source: dict) -> str:
    """One line on where a state input's values came from (`state_plan`)."""
    if source["from"] == "bag":
        played = f" (played as {source['played_as']})" if "played_as" in source else ""
        return f"from the bag's {source['topic']}{played}"
    if source["from"] == "option":
        return f"{source['value']:g} m/s on every frame, supplied by {source['option']} (not recorded)"
    if source["from"] == "parameter":
        value = f"{source['value']:g} m/s, " if source.get("value") is not None else ""
        return f"{value}the {source['parameter']} parameter (not recorded)"
    return "none: neither recorded nor supplied (frames that need it are dropped)"


def human_reference(car, frame_log_times: dict) -> tuple[dict, dict]:
    """({stamp: (steering, throttle)} of the frames a car_labels.CarLabels labels, {reason: count}
    of the frames it does not) for frames {camera stamp: log time in the bag}."""
    reference, excluded = {}, {}
    for stamp, log_time in frame_log_times.items():
        label = car.label(stamp, log_time)
        if label.drop_reason:
            excluded[label.drop_reason] = excluded.get(label.drop_reason, 0) + 1
        else:
            reference[stamp] = (label.steering, label.throttle)
    return reference, excluded


def reference_commands(drive, topic: str = topics.REFERENCE_COMMAND) -> dict:
    """{stamp: (steering, throttle)} of the commands that drove the car, from `topic` of the drive."""
    series = drive.series.get(topic)
    if series is None:
        return {}
    return {int(stamp): (float(steering), float(throttle)) for stamp, (steering, throttle) in zip(series.stamp_ns, series.values)}


# ---------------------------------------------------------------- playback (ROS)


class Player:
    """Publishes bag messages into the graph and records what the graph publishes."""

    def __init__(self, node, input_types: dict):
        from rclpy.executors import SingleThreadedExecutor

        self.node = node
        self.executor = SingleThreadedExecutor(context=node.context)
        self.executor.add_node(node)
        self.records: list[Record] = []
        # Camera stamp -> when the frame entered the graph: when the later of its image and its
        # CameraInfo was published, ns. One per image played.
        self.frames: dict[int, int] = {}
        self.frame_log_times: dict[int, int] = {}  # camera stamp -> the image's log time in the bag, ns
        self.repeated_stamps = 0  # images not played: their stamp already was
        self._info_published: dict[int, int] = {}  # camera stamp -> when its CameraInfo was published, ns
        self.done: set[int] = set()  # frames with a command or a reported drop
        self.unreadable = 0  # recorded messages that could not be decoded (left out of the bag)
        self.publishers = {
            topic: node.create_publisher(msgs.ros_type(msgtype), topic, msgs.qos(PLAYED_QOS.get(topic, "sensor_out")))
            for topic, msgtype in input_types.items()
        }
        for topic, msgtype in RECORDED.items():
            node.create_subscription(msgs.ros_type(msgtype), topic, self._recorder(topic, msgtype), msgs.qos("status"), raw=True)

    def _recorder(self, topic: str, msgtype: str):
        from rosbags.serde import SerdeError

        from sps_driving.ros.bagio import TYPESTORE

        def store(raw: bytes) -> None:
            received = time.time_ns()
            try:
                msg = TYPESTORE.deserialize_cdr(raw, msgtype)
            except SerdeError:
                self.unreadable += 1
                return
            self.records.append(Record(topic, received, msg))
            if topic == topics.POLICY_COMMAND or (topic == topics.STAGE_TIMING and any(r.dropped for r in msgs.stage_reports(msg))):
                self.done.add(msgs.stamp_ns(msg.header))

        return store

    def publish(self, topic: str, msg) -> bool:
        """Publish one bag message into the graph. An image or CameraInfo whose stamp was already
        played is held back (returns False): the graph keys each frame by its stamp."""
        publisher = self.publishers[topic]
        ros_msg = msgs.from_bag(msg, publisher.msg_type)
        now = time.time_ns()
        if topic == topics.IMAGE:
            stamp = msgs.stamp_ns(msg.header)
            if stamp in self.frames:
                self.repeated_stamps += 1
                return False
            self.frames[stamp] = now
        elif topic == topics.CAMERA_INFO:
            stamp = msgs.stamp_ns(msg.header)
            if stamp in self._info_published:
                return False
            self._info_published[stamp] = now
            if stamp in self.frames:
                self.frames[stamp] = now
            self.records.append(Record(topic, now, msg))
        publisher.publish(ros_msg)
        return True

    def spin(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            self.executor.spin_once(timeout_sec=max(0.0, min(0.01, end - time.monotonic())))
            if time.monotonic() >= end:
                return

    def wait_for(self, stamp: int, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while stamp not in self.done:
            if time.monotonic() > end:
                return False
            # Returns as soon as a message is in; a long wait means few idle wake-ups of this
            # process, which shares the cores with the graph (measured: 2 ms of the extractor's
            # 41 ms per frame, and 10 ms of the p99 camera-to-command latency, at 0.01 s).
            self.executor.spin_once(timeout_sec=IDLE_WAIT_S)
        return True


def _in_log_time_order(bag: Path, wanted: list, topic_map: dict):
    """The bag's messages on the `wanted` topics, each camera message (image, CameraInfo) held
    back until the messages recorded at its own log time are out: a recorder writes the frame
    first, then the speed of that instant."""
    from sps_driving.ros.bagio import read_messages
    from sps_driving.ros.drive import as_raw_image

    held: list = []  # camera messages waiting for the rest of their log time
    for item in read_messages(bag, wanted):
        if topic_map.get(item.topic, item.topic) == topics.IMAGE:
            item = as_raw_image(item)  # a compressed frame plays decoded, as the camera driver sends it
            if item is None:  # undecodable: never reaches the graph, so it is a frame not played
                continue
        if held and item.log_time_ns > held[0].log_time_ns:
            yield from held
            held.clear()
        if topic_map.get(item.topic, item.topic) in (topics.IMAGE, topics.CAMERA_INFO):
            held.append(item)
        else:
            yield item
    yield from held


class _FramePublisher:
    """Publishes the bag's messages into the graph for `play`, and keeps the stamps of the frames
    played whose outcome is not awaited yet: a frame is in once both its image and its camera
    info are."""

    def __init__(self, player: Player, frame_timeout_s: float, has_info: bool, supplied: dict | None):
        self.player = player
        self.frame_timeout_s = frame_timeout_s
        self.has_info = has_info
        self.supplied = supplied
        self.image_stamps: set[int] = set()
        self.info_stamps: set[int] = set()

    def begins_frame(self, msg) -> bool:
        """Whether a camera message is the first of its frame: the next frame begins."""
        return msgs.stamp_ns(msg.header) not in self.image_stamps | self.info_stamps

    def await_complete_frames(self) -> None:
        """Wait for the command of each frame that is in, up to the frame timeout each."""
        for stamp in sorted(self.image_stamps & self.info_stamps):
            self.player.wait_for(stamp, self.frame_timeout_s)
            self.image_stamps.discard(stamp)
            self.info_stamps.discard(stamp)

    def publish(self, topic: str, item) -> None:
        """Publish one bag message (`item`, on graph topic `topic`). A new frame's image goes out
        after the supplied state with its stamp, and, for a bag without CameraInfo, is followed by
        one made from the image."""
        from sps_driving.ros.bagio import to_bag

        player = self.player
        if topic == topics.IMAGE and self.supplied and msgs.stamp_ns(item.msg.header) not in player.frames:
            for state_topic, value in self.supplied.items():  # out before the image, as the car's reports would be
                player.publish(state_topic, to_bag(msgs.twist_fields(value, msgs.stamp_ns(item.msg.header))))
        published = player.publish(topic, item.msg)
        if topic == topics.IMAGE:
            stamp = msgs.stamp_ns(item.msg.header)
            if published:
                player.frame_log_times[stamp] = item.log_time_ns
                self.image_stamps.add(stamp)
                if not self.has_info:
                    info = to_bag(msgs.camera_info_fields(item.msg.height, item.msg.width, stamp, item.msg.header.frame_id, None))
                    player.publish(topics.CAMERA_INFO, info)
                    self.info_stamps.add(stamp)
        elif topic == topics.CAMERA_INFO and published:
            self.info_stamps.add(msgs.stamp_ns(item.msg.header))


def play(bag: Path, lockstep: bool, frame_timeout_s: float, player: Player, has_info: bool, topic_map: dict,
         played=PLAYED, supplied: dict | None = None) -> float:
    """Publish the bag's camera and `played` topics (renamed by `topic_map`) and, before each new
    frame's image, the supplied state ({topic: value}, `state_plan`) with its stamp; returns the
    playback wall time in s. In lockstep a frame's command is awaited when the next frame begins,
    so every message recorded before that (the frame's speed among them) is in the graph first. A
    camera message waits for the messages recorded at its own log time (a recorder writes the
    frame first, then the speed of that instant), so a frame's state is out before its image: on
    busy cores the frame could otherwise reach the policy before the state it was recorded with."""
    from tqdm import tqdm

    bag_names = {graph_topic: bag_topic for bag_topic, graph_topic in topic_map.items()}
    wanted = [bag_names.get(t, t) for t in (topics.IMAGE, *played, *([topics.CAMERA_INFO] if has_info else []))]
    publisher = _FramePublisher(player, frame_timeout_s, has_info, supplied)
    started = time.monotonic()
    first_log = None
    bar = tqdm(desc="replay", unit="frame", disable=None)
    for item in _in_log_time_order(bag, wanted, topic_map):
        topic = topic_map.get(item.topic, item.topic)
        if lockstep and topic in (topics.IMAGE, topics.CAMERA_INFO) and publisher.begins_frame(item.msg):
            publisher.await_complete_frames()
        if not lockstep:
            first_log = item.log_time_ns if first_log is None else first_log
            player.spin(max(0.0, (item.log_time_ns - first_log) / 1e9 - (time.monotonic() - started)))
        publisher.publish(topic, item)
        if topic == topics.IMAGE:
            bar.update(1)
        if not lockstep:
            player.spin(0.0)
    if lockstep:
        publisher.await_complete_frames()
    bar.close()
    wall_s = time.monotonic() - started
    if publisher.image_stamps and not lockstep:  # the newest frame is never skipped: wait for its outcome
        player.wait_for(max(publisher.image_stamps), frame_timeout_s)
    player.spin(0.5)  # trailing status and timing messages
    return wall_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bag", type=Path, help="a rosbag2 folder (sqlite3 or mcap), a .mcap file or a .db3 file with camera "
                                               f"frames on {topics.IMAGE}")
    parser.add_argument(
        "--out", type=Path,
        help="output bag of everything the graph published (default: out/replay/<bag name>_<time> under the current folder)",
    )
    parser.add_argument("--storage", choices=("sqlite3", "mcap"), default="sqlite3", help="output bag storage")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lockstep", dest="lockstep", action="store_true", default=True, help="one frame at a time (default)")
    mode.add_argument("--realtime", dest="lockstep", action="store_false", help="at the recorded pace")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--checkpoint", type=Path, help="policy folder (default: the policy checkpoint of config/graph.yaml)")
    parser.add_argument("--backbone-config", type=Path, help="extraction settings YAML (default: config/extraction.yaml)")
    parser.add_argument("--precision", choices=("fp32", "int8"),
                        help="the extractor node's precision (its parameter; default the settings'): int8 runs onnxruntime's "
                             "int8 graph")
    parser.add_argument("--params", type=Path, help="graph parameters file (default: config/graph.yaml)")
    parser.add_argument("--overlay", action="store_true",
                        help=f"the policy node publishes what it sees on {topics.POLICY_OVERLAY} (its publish_overlay), "
                             "recorded in the output bag")
    for name, option in SUPPLY_OPTIONS.items():
        topic, msgtype = live_source(name, "topics")
        parser.add_argument(option, type=float, dest=name, metavar=STATE_INPUTS[name].unit.upper().replace("/", "_"),
                            help=f"for a bag that records no {name} (a camera-only recording): this value, "
                                 f"{STATE_INPUTS[name].unit}, on every frame, published with the frame's stamp; the report says "
                                 f"so (from another {msgtype} topic of the bag instead: --topic BAG_TOPIC:={topic})")
    parser.add_argument("--frame-timeout", type=float, default=60.0, help="s to wait for one frame's command in lockstep")
    parser.add_argument("--startup-timeout", type=float, default=180.0, help="s to wait for the nodes to come up")
    parser.add_argument("--log-dir", type=Path, help="keep the node logs here")
    parser.add_argument(
        "--topic", action="append", default=[], metavar="BAG_TOPIC:=GRAPH_TOPIC",
        help="play a bag topic as a graph topic, e.g. /flir_camera/image_raw:=/camera/image_raw (repeatable)",
    )


def parse_topic_map(items) -> dict:
    topic_map = {}
    for item in items:
        source, sep, target = item.partition(":=")
        if not sep or not source.startswith("/") or not target.startswith("/"):
            raise ReplayError(f"--topic takes /bag/topic:=/graph/topic, got {item!r}")
        topic_map[source] = target
    return topic_map


def state_plan(policy_config: dict, bag_topics: dict, supplied: dict, params_file: Path,
               topic_map: dict | None = None) -> tuple[dict, dict]:
    """({topic: value} this process publishes with each frame's stamp, {state input: where its
    values come from}) for the state inputs of a policy replayed on a bag with topics `bag_topics`
    (renamed by `topic_map`). Each comes from the bag when it records it (as `played_topics`
    plays it), else from `supplied` ({state input: value}, the SUPPLY_OPTIONS), published on the
    topic the policy node reads, else from the policy node's fallback parameter (the cruise
    target's, in the params file) or from nowhere. ReplayError for a supplied value that is not a
    speed, that a recorded one exists for, or that the policy does not read."""
    import yaml

    from sps_driving.core.policies.registry import state_inputs_of
    from sps_driving.core.state import recorded_source

    reads = state_inputs_of(policy_config)
    bag_names = {graph_topic: bag_topic for bag_topic, graph_topic in (topic_map or {}).items()}
    for name, value in supplied.items():
        option, recorded = SUPPLY_OPTIONS[name], recorded_source(name, bag_topics)
        if name not in reads:
            raise ReplayError(f"{option}: the policy reads no {name} (its state inputs: {', '.join(reads) or 'none'})")
        if not (math.isfinite(value) and (value > 0 if name == "target_speed_mps" else value >= 0)):
            raise ReplayError(f"{option} takes a speed in m/s ({'> 0' if name == 'target_speed_mps' else '>= 0'}), got {value}")
        if recorded is not None:
            raise ReplayError(f"{option}: the bag records {name} on {bag_names.get(recorded[0], recorded[0])}; "
                              "replay it as recorded")
    publish, sources = {}, {}
    for name in reads:
        recorded = recorded_source(name, bag_topics)
        if recorded is not None:
            topic = recorded[0]
            sources[name] = {"from": "bag", "topic": bag_names.get(topic, topic),
                             **({"played_as": topic} if topic in bag_names else {})}
        elif name in supplied:
            topic = live_source(name, recorded_vehicle_backend(bag_topics))[0]
            publish[topic] = supplied[name]
            sources[name] = {"from": "option", "option": SUPPLY_OPTIONS[name], "value": supplied[name], "topic": topic}
        elif name == "target_speed_mps":  # the policy node's fallback until a target arrives (nodes/policy.py)
            policy_params = (yaml.safe_load(Path(params_file).read_text()) or {}).get("policy", {}).get("ros__parameters", {})
            sources[name] = {"from": "parameter", "parameter": "policy target_speed_mps",
                             "value": policy_params.get("target_speed_mps")}
        else:
            sources[name] = {"from": "none"}
    return publish, sources


def played_topics(policy_config: dict, bag_topics: dict) -> tuple[str, ...]:
    """PLAYED and, for each state input of the policy (sps_driving.core.state), the topic the bag
    carries it on (as `sps-driving extract` reads it)."""
    from sps_driving.core.policies.registry import state_inputs_of
    from sps_driving.core.state import recorded_source

    state = [recorded_source(name, bag_topics) for name in state_inputs_of(policy_config)]
    return tuple(dict.fromkeys([*PLAYED, *(source[0] for source in state if source is not None)]))


class ReplayError(ValueError):
    """A replay that cannot start: bad bag, missing checkpoint, output in the way, graph not up."""


def graph_parameters(checkpoint: Path, bag_topics: dict, lockstep: bool, frame_timeout_s: float,
                     backbone_config: Path | None = None, overlay: bool = False, precision: str | None = None) -> dict:
    """Per-node parameters over the params file for a replay (`overlay`: the policy node publishes
    what it sees, topics.POLICY_OVERLAY, which the output bag records; `precision`: the extractor's)."""
    params = {
        "selection": {"checkpoint": str(checkpoint)},
        "extractor": {"checkpoint": str(checkpoint)},
        # The car's speed from the report the bag recorded (PACMod 3's on a car bag).
        "policy": {"checkpoint": str(checkpoint), "vehicle_backend": recorded_vehicle_backend(bag_topics)},
        # Nothing real is driven: engage at once so the vehicle interface's decisions are recorded.
        # The bag's stamps are old, so the camera-to-command latency check is off.
        "vehicle_interface": {**VEHICLE_WITHOUT_CAR, "max_command_latency_s": 0.0},
        "safety_monitor": {},
    }
    if overlay:
        params["policy"]["publish_overlay"] = True
    if has_ood_calibration(checkpoint):
        params["policy"]["ood_score"] = True
    if backbone_config:
        params["extractor"]["backbone_config"] = str(Path(backbone_config).resolve())
    if precision:
        params["extractor"]["precision"] = precision
    if lockstep:  # frames come as fast as the graph computes them, not at 30 fps
        params["vehicle_interface"].update(max_command_age_s=frame_timeout_s, max_camera_age_s=frame_timeout_s)
        params["extractor"]["selection_timeout_s"] = frame_timeout_s
        params["safety_monitor"]["max_input_age_s"] = frame_timeout_s
    # The monitor requires only the inputs the bag has ([""]: none; a ROS list parameter cannot be empty).
    recorded = [name for name, t in (("lane", topics.LANE_POSE), ("obstacle", topics.OBSTACLE_RANGE)) if t in bag_topics]
    params["safety_monitor"]["required_inputs"] = recorded or [""]
    return params


def _graph_topics(bag: Path, present: dict, topic_map: dict) -> dict:
    """{topic: message type} of the bag's topics `present`, renamed by `topic_map` to the graph's,
    the camera as the graph receives it (a compressed camera is played decoded); ReplayError for a
    bag that has no camera frames to play."""
    from sps_driving.ros.drive import COMPRESSED_IMAGE, IMAGE

    bag_topics = {topic_map.get(t, t): msgtype for t, msgtype in present.items()}
    if bag_topics.get(topics.IMAGE) == COMPRESSED_IMAGE:
        bag_topics[topics.IMAGE] = IMAGE
    if bag_topics.get(topics.IMAGE) != IMAGE:
        raise ReplayError(f"{bag} has no sensor_msgs/Image frames on {topics.IMAGE} nor compressed ones on "
                          f"{topics.IMAGE_COMPRESSED} (topics: {sorted(bag_topics)})")
    return bag_topics


def mapped_camera(topic_map: dict) -> str | None:
    """The bag topic that `topic_map` maps onto the graph's camera, if any."""
    return next((b for b, g in topic_map.items() if g == topics.IMAGE), None)


def camera_map(present: dict, topic_map: dict) -> dict:
    """`topic_map` with the camera of a bag of topics `present` ({topic: message type}) played as the
    graph's: the camera mapped onto it (or the graph's own), or where the bag records that one only
    compressed, its /compressed topic."""
    from sps_driving.ros.drive import camera_topic_of

    asked = mapped_camera(topic_map) or topics.IMAGE
    found = camera_topic_of(present, asked)
    if found is None or found == asked:
        return topic_map
    return {**{b: g for b, g in topic_map.items() if g != topics.IMAGE}, found: topics.IMAGE}


def _policy_checkpoint(checkpoint: Path | None, params_file: Path) -> Path:
    """The policy folder, absolute: `checkpoint`, else the policy node's in the params file;
    ReplayError when it holds no policy."""
    if checkpoint is None:
        import yaml

        checkpoint = Path(yaml.safe_load(params_file.read_text())["policy"]["ros__parameters"]["checkpoint"])
        # A relative default (a folder of models/) names the package's folder wherever replay runs from.
        if not checkpoint.is_absolute() and not checkpoint.exists():
            checkpoint = params_file.resolve().parent.parent / checkpoint
    checkpoint = Path(checkpoint).resolve()
    if not (checkpoint / "config.json").is_file():
        raise ReplayError(
            f"no policy checkpoint at {checkpoint}: put policy.safetensors and config.json there "
            "(`sps-driving train --out DIR`) or pass --checkpoint DIR"
        )
    return checkpoint


def _input_types(bag_topics: dict, played: tuple, supplied: dict) -> dict:
    """{topic: message type} this process publishes into the graph: the camera and the `played`
    topics the bag has, each frame's CameraInfo, and the supplied state (`state_plan`)."""
    input_types = {t: bag_topics[t] for t in (topics.IMAGE, *played) if t in bag_topics}
    input_types[topics.CAMERA_INFO] = "sensor_msgs/msg/CameraInfo"
    input_types.update({topic: "geometry_msgs/msg/TwistStamped" for topic in supplied})  # msgs.twist_fields
    return input_types


def _wait_until_up(node, graph, startup_timeout_s: float, overlay: bool) -> None:
    """Wait for the graph's nodes, then for each stage's input to have its reader (and this
    recorder where it records it); ReplayError when they are not there in time."""
    from sps_driving.ros.graph import wait_for_nodes, wait_for_topics

    try:
        wait_for_nodes(node, GRAPH_NODES, startup_timeout_s, graph)
        readers = {
            topics.IMAGE: 2 if overlay else 1, topics.CAMERA_INFO: 2, topics.SELECTION: 2, topics.DESCRIPTORS: 2,
            topics.POLICY_COMMAND: 2,
        }
        wait_for_topics(node, readers, startup_timeout_s, graph)
    except (TimeoutError, RuntimeError) as exc:
        raise ReplayError(f"the graph did not start: {exc}") from exc


def _play_through_graph(input_types: dict, parameters: dict, params_file: Path, log_dir: Path | None,
                        startup_timeout_s: float, overlay: bool, playback) -> tuple[Player, float]:
    """Start the graph with `parameters`, in a ROS domain of its own, and once it is up run
    `playback(player)`; returns the player (what the graph published) and the playback wall time
    `playback` returned, s. Raises ReplayError when the graph does not come up."""
    import rclpy
    from rclpy.node import Node

    from sps_driving.ros.graph import Graph, isolate_ros

    isolate_ros()  # before rclpy.init: this context joins the graph's private domain
    context = rclpy.Context()
    rclpy.init(context=context)
    node = Node("sps_replay", context=context)
    player = Player(node, input_types)
    graph = Graph(GRAPH_NODES, parameters=parameters, params_file=params_file, log_dir=log_dir)
    try:
        with graph:
            _wait_until_up(node, graph, startup_timeout_s, overlay)
            wall_s = playback(player)
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return player, wall_s


def _write_records(out: Path, storage: str, records: list) -> None:
    """Write the records into a new bag at `out`, in the order they were received."""
    from sps_driving.ros.bagio import BagWriter

    out.parent.mkdir(parents=True, exist_ok=True)
    with BagWriter(out, storage) as writer:
        for rec in sorted(records, key=lambda r: r.log_time_ns):
            writer.write(rec.topic, rec.msg, rec.log_time_ns)


def _reference(drive, car, reference_topic: str, frame_log_times: dict) -> tuple[dict, dict, str | None]:
    """(reference commands {stamp: (steering, throttle)}, frames left out of them, where they came
    from): the drive's reference topic, or the safety driver's driving from the car's labels `car`."""
    if car is None:
        reference = reference_commands(drive, reference_topic)
        return reference, {}, reference_topic if reference else None
    reference, excluded = human_reference(car, frame_log_times)
    return reference, excluded, "pacmod3 reports: the safety driver's driving"


def replay_bag(
    bag: Path,
    out: Path,
    lockstep: bool = True,
    checkpoint: Path | None = None,
    backbone_config: Path | None = None,
    params_file: Path | None = None,
    frame_timeout_s: float = 60.0,
    startup_timeout_s: float = 180.0,
    log_dir: Path | None = None,
    storage: str = "sqlite3",
    topic_map: dict | None = None,
    overlay: bool = False,
    supplied_state: dict | None = None,
    precision: str | None = None,
) -> dict:
    """Play `bag` through a freshly started graph, write what it published to `out`, return the
    report (`build_report` plus mode, output_bag, unreadable_messages, state). `topic_map` renames
    bag topics to the graph's ({"/flir_camera/image_raw": "/camera/image_raw"} for a bag recorded
    with the vendor camera driver); `supplied_state` ({state input: value}) supplies state inputs
    the bag does not record (`state_plan`). Raises ReplayError."""
    from sps_driving.core.policies.checkpoint import read_policy_config
    from sps_driving.ros.bagio import BagError
    from sps_driving.ros.drive import read_drive
    from sps_driving.ros.graph import default_params_file

    bag, out = Path(bag), Path(out)
    params_file = Path(params_file) if params_file else default_params_file()
    checkpoint = _policy_checkpoint(checkpoint, params_file)
    if out.exists():
        raise ReplayError(f"output bag {out} exists; pass another --out")
    topic_map = dict(topic_map or {})
    try:  # the one reading of the bag besides playing it: its topics, reports and commands
        drive = read_drive(bag, camera_topic=mapped_camera(topic_map))
    except BagError as exc:
        raise ReplayError(str(exc)) from None
    topic_map = camera_map(drive.topics, topic_map)
    bag_topics = _graph_topics(bag, drive.topics, topic_map)
    has_info = bag_topics.get(topics.CAMERA_INFO) == "sensor_msgs/msg/CameraInfo"
    policy_config = read_policy_config(checkpoint)
    played = played_topics(policy_config, bag_topics)
    supplied, state_sources = state_plan(policy_config, bag_topics, supplied_state or {}, params_file, topic_map)
    reference_topic = {g: b for b, g in topic_map.items()}.get(topics.REFERENCE_COMMAND, topics.REFERENCE_COMMAND)
    try:
        car, unavailable = car_reference(drive, reference_topic, params_file), None
    except ValueError as exc:  # a car bag whose reports cannot tell the human's driving: replayed without a reference
        car, unavailable = None, str(exc)
    parameters = graph_parameters(checkpoint, bag_topics, lockstep, frame_timeout_s, backbone_config, overlay, precision)
    player, wall_s = _play_through_graph(
        _input_types(bag_topics, played, supplied), parameters, params_file, log_dir, startup_timeout_s, overlay,
        lambda player: play(bag, lockstep, frame_timeout_s, player, has_info, topic_map, played, supplied),
    )
    _write_records(out, storage, player.records)
    reference, excluded, reference_source = _reference(drive, car, reference_topic, player.frame_log_times)
    report = build_report(player.frames, player.records, reference, wall_s, player.repeated_stamps)
    report.update(reference_source=reference_source, reference_excluded=excluded, state=state_sources)
    if unavailable:
        report["reference_unavailable"] = unavailable
    report["mode"] = "lockstep" if lockstep else "realtime"
    report["unreadable_messages"] = player.unreadable
    report["output_bag"] = str(out)
    report["ood_score"] = ood_score_report(player.records)
    return report


def car_reference(drive, reference_topic: str, params_file: Path):
    """The car's labels (car_labels.CarLabels) when the drive's reference is the safety driver's
    (`sps-driving extract`'s choice of label source, by config/train.yaml), else None; ValueError
    when the bag lacks reports they need."""
    from sps_driving.ros.car_labels import configured_rules, label_source, read_car_labels
    from sps_driving.ros.graph import car_facts

    rules, source = configured_rules()
    if label_source(drive.topics, source, reference_topic) == "command":
        return None
    return read_car_labels(drive, rules, float(car_facts(params_file)["steering_ratio"]))


def default_output(bag: Path) -> Path:
    """out/replay/<bag name>_<time> under the current folder: never inside the bag's own tree (the
    bundled bags live in the package)."""
    from sps_driving.ros.bagio import bag_name

    return Path("out") / "replay" / f"{bag_name(bag)}_{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def run(args: argparse.Namespace) -> int:
    from sps_driving.ros.bagio import BagError

    out = args.out or default_output(args.bag)
    try:
        report = replay_bag(
            args.bag, out, lockstep=args.lockstep, checkpoint=args.checkpoint, backbone_config=args.backbone_config,
            params_file=args.params, frame_timeout_s=args.frame_timeout, startup_timeout_s=args.startup_timeout,
            log_dir=args.log_dir, storage=args.storage, topic_map=parse_topic_map(args.topic), overlay=args.overlay,
            supplied_state={name: getattr(args, name) for name in SUPPLY_OPTIONS if getattr(args, name) is not None},
            precision=args.precision,
        )
    except (ReplayError, BagError) as exc:  # BagError: a bag damaged part-way through the playback
        print(f"error: {exc}")
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report) + format_ood_score(report["ood_score"])
          + f"\noutput bag: {out}")
    return 0


# ---------------------------------------------------------------- the OOD score of a drive


def has_ood_calibration(checkpoint: Path) -> bool:
    from sps_driving.core.ood import META_FILE, TENSORS_FILE

    return (Path(checkpoint) / META_FILE).is_file() and (Path(checkpoint) / TENSORS_FILE).is_file()


def ood_score_report(records: list) -> dict | None:
    """The distribution of the policy's OOD score over a drive's frames (topics.OOD_SCORE records)
    and the frames above each threshold of the safety monitor's rule (config/ood.yaml); None when
    the drive has no score."""
    from sps_driving.core.ood import load_ood_config

    scores = sorted((msgs.stamp_ns(r.msg.header), float(r.msg.position[0])) for r in records
                    if r.topic == topics.OOD_SCORE and len(r.msg.position) == 1)
    if not scores:
        return None
    rule = load_ood_config()["rule"]
    values = np.array([v for _, v in scores])
    above = {name: [stamp for stamp, v in scores if v > float(rule[name])] for name in ("slow_threshold", "handover_threshold")}
    return {"frames": len(scores), "method": str(next(r.msg.name[0] for r in records if r.topic == topics.OOD_SCORE)),
            **{k: v for k, v in percentiles(values).items() if k != "count"}, "p90": float(np.percentile(values, 90)),
            "above": {name: {"threshold": float(rule[name]), "frames": len(stamps), "share": len(stamps) / len(scores),
                             "first_stamps_ns": stamps[:20]} for name, stamps in above.items()}}


def format_ood_score(section: dict | None) -> str:
    if section is None:
        return "\nOOD score: none (the checkpoint has no calibration)"
    lines = [f"\nOOD score ({section['method']}, {section['frames']} frames; 1.0 = the 99th percentile of training frames): "
             f"p50 {section['p50']:.2f}, p90 {section['p90']:.2f}, p99 {section['p99']:.2f}, max {section['max']:.2f}"]
    for name, entry in section["above"].items():
        first = ", ".join(str(s) for s in entry["first_stamps_ns"][:5])
        lines.append(f"  above {name} {entry['threshold']:g}: {entry['frames']} frames ({100 * entry['share']:.1f}%)"
                     + (f", first stamps (ns) {first}" if first else ""))
    return "\n".join(lines)
