"""`sps-driving faults`: the fault-injection matrix of the drive-by-wire path, against the live graph.

Every node is a real process over DDS, the car included: the PACMod 3 stand-in
(sps_driving.ros.nodes.pacmod3_standin) latches the commands and re-sends them every 33 ms as the real
driver does, and publishes each period's frame to the car, which this process records with the
time it arrived. For each fault: engage through the service, check that the car drives, inject
the fault, watch what reaches the car for `hold_s`, restore, then check that the graph recovers:
the safety driver's re-arm and engage, and the car drives again.

The perception nodes (camera driver, selection, extractor, policy, safety monitor) run under the
supervisor that the car launch runs them under (sps_driving.ros.respawn): a killed one is started
again by it, not by this harness. A killed vehicle interface or failsafe is started again by this
harness after RESTART_AFTER_KILL_S, as a person would restart it; nothing starts them by itself.

Three graphs:
- "vehicle": camera_driver (an image folder), vehicle_interface (pacmod3 backend), failsafe,
  safety_monitor and the stand-in; this process publishes the policy's commands, the lane state
  and the obstacle range.
- "clock": the same, with the vehicle interface on this process's /clock (use_sim_time), so the
  clock can be stepped.
- "perception": this process is the camera (the bundled drive's frames); selection, extractor and
  policy (the shipped policy) drive, with the same vehicle path.

What is measured, from the frames the driver sends to the car after the fault (t = 0), each at the
time the stand-in sent it:
- stopped / time_to_stop_s: the first frame in the stop set: no accelerator, and either the brake
  enabled at stop_brake or more, or steering, accelerator and brake all disabled (the car handed
  to the safety driver);
- held: every later frame in the window is in the stop set;
- unsafe_commands: frames with a non-finite value or a value over the configured limits, frames
  outside the stop set after the stop was first commanded, and every frame of a window without a
  stop. The frames between the fault and the stop are the reaction time, time_to_stop_s;
- recovered / time_to_drive_again_s: after the fault is cleared (the node restarted or resumed),
  the safety driver's re-arm and engage make the car drive again within RECOVERY_TIMEOUT_S; the
  time is from the fault;
- failsafe_trips: the failsafe's takeovers from the start of the fault's engage to its recovery;
  one is expected only when the vehicle interface itself is killed or frozen, any other is false.

`--repeat N` runs the chosen faults N times over in the same graphs, `--load K` keeps K busy
processes beside them; the summary gives each fault's worst case over the repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sps_driving.core import topics
from sps_driving.ros import msgs

HOLD_S = 2.0  # s watched after each fault
# s from a kill -9 to its successor's start, as the supervisor's first restart (config/respawn.yaml).
RESTART_AFTER_KILL_S = 4.0
STANDIN_SENT = "/pacmod3_standin/sent"  # the stand-in's frame to the car of every period
READY_TIMEOUT_S = 60.0  # s to get back to driving between faults (a killed node's DDS endpoints must expire)
# s from a fault until the graph must drive again: the supervisor's first restart waits 4 s (config/
# respawn.yaml) and the extractor then loads its model, 10-30 s on 2 CPU cores beside the graph.
RECOVERY_TIMEOUT_S = 90.0
# Run under sps_driving.ros.respawn, as the car launch runs them; the others stop the car and are not.
SUPERVISED = ("camera_driver", "selection", "extractor", "policy", "safety_monitor")
SHORT = ("kill -9 vehicle_interface", "kill -9 safety_monitor", "SIGTERM vehicle_interface", "override", "NaN command",
         "second stop-request publisher", "clock step backwards", "shift to reverse", "second speed-report publisher")


@dataclass(frozen=True)
class Fault:
    name: str
    graph: str  # "vehicle" or "perception"
    inject: str  # what the harness does (see Harness.inject)
    target: str = ""


WATCHED_NODES = ("vehicle_interface", "failsafe", "safety_monitor", "camera_driver")
# The faults after which the failsafe takes over: the vehicle interface gone silent.
FAILSAFE_FAULTS = ("kill -9 vehicle_interface", "SIGSTOP vehicle_interface")
# The watchdog that must notice a silent node: (node's parameters section, parameter) in config/graph.yaml.
# A second publisher is seen at the vehicle interface's next count of publishers; every other
# fault in the period it reaches the vehicle interface.
SILENCE_WATCHDOGS = {
    "vehicle_interface": ("failsafe", "silence_timeout_s"),
    "failsafe": ("vehicle_interface", "max_failsafe_age_s"),
    "safety_monitor": ("vehicle_interface", "max_safety_age_s"),
    "camera_driver": ("vehicle_interface", "max_camera_age_s"),
}
# s a stop may come after its watchdog's limit: a few 33 ms periods of the watchdog, the vehicle
# interface and the driver, and their messages' way over DDS.
STOP_MARGIN_S = 0.3
FAULTS = [
    *(Fault(f"kill -9 {node}", "vehicle", "kill", node) for node in WATCHED_NODES),
    *(Fault(f"SIGSTOP {node}", "vehicle", "sigstop", node) for node in WATCHED_NODES),
    Fault("SIGTERM vehicle_interface", "vehicle", "sigterm", "vehicle_interface"),
    Fault("SIGINT vehicle_interface", "vehicle", "sigint", "vehicle_interface"),
    Fault("lifecycle deactivate vehicle_interface", "vehicle", "deactivate", "vehicle_interface"),
    Fault("clock step backwards", "clock", "clock", "-3600"),
    Fault("clock step forwards", "clock", "clock", "3600"),
    Fault("override", "vehicle", "standin", "override"),
    Fault("PACMod fault", "vehicle", "standin", "fault"),
    Fault("CAN timeout", "vehicle", "standin", "can_timeout"),
    Fault("report timeout", "vehicle", "standin", "pause_reports"),
    Fault("shift to reverse", "vehicle", "standin", "reverse"),
    Fault("second stop-request publisher", "vehicle", "spoof", "stop"),
    Fault("second speed-report publisher", "vehicle", "spoof", "speed"),
    Fault("second heartbeat publisher", "vehicle", "spoof", "heartbeat"),
    Fault("NaN command", "vehicle", "command", "nan"),
    Fault("out-of-range command", "vehicle", "command", "huge"),
    Fault("obstacle too close to measure (-inf)", "vehicle", "obstacle", "-inf"),
    *(Fault(f"kill -9 {node}", "perception", "kill", node) for node in ("selection", "extractor", "policy")),
    *(Fault(f"SIGSTOP {node}", "perception", "sigstop", node) for node in ("selection", "extractor", "policy")),
    Fault("camera stop", "perception", "camera", "stop"),
    Fault("camera delay (frames 1.5 s late)", "perception", "camera", "delay"),
    Fault("corrupt frames", "perception", "camera", "corrupt"),
]


def in_stop_set(sent, stop_brake: float) -> bool:
    """No accelerator, and the brake held or every driving system disabled."""
    accel_off = not sent.enable["accel"] or sent.command["accel"] == 0.0
    disabled = not any(sent.enable[s] for s in ("steering", "accel", "brake"))
    braking = sent.enable["brake"] and sent.command["brake"] >= stop_brake - 1e-9
    return accel_off and (braking or disabled)


def within_limits(sent, limits, steering_ratio: float) -> bool:
    values = [sent.command[s] for s in ("steering", "accel", "brake")]
    if not all(math.isfinite(v) for v in values):
        return False
    wheel_limit = limits.max_road_wheel_angle_rad * steering_ratio + 1e-9
    return (abs(sent.command["steering"]) <= wheel_limit and 0.0 <= sent.command["accel"] <= limits.max_throttle + 1e-9
            and 0.0 <= sent.command["brake"] <= limits.max_brake + 1e-9)


def measure(sends, fault_s: float, end_s: float, limits, steering_ratio: float) -> dict:
    """The row of one fault from the sends between the fault and the end of the window."""
    window = [s for s in sends if fault_s <= s.time_s <= end_s]
    stop_index = next((i for i, s in enumerate(window) if in_stop_set(s, limits.stop_brake)), None)
    unsafe = sum(
        not within_limits(s, limits, steering_ratio)
        or stop_index is None
        or (i >= stop_index and not in_stop_set(s, limits.stop_brake))
        for i, s in enumerate(window)
    )
    row = {"stopped": stop_index is not None, "time_to_stop_s": None, "held": False, "unsafe_commands": unsafe, "sends": len(window)}
    if stop_index is not None:
        row["time_to_stop_s"] = round(window[stop_index].time_s - fault_s, 4)
        row["held"] = all(in_stop_set(s, limits.stop_brake) for s in window[stop_index:])
        row["end_state"] = "brake held" if window[-1].enable["brake"] else "manual (disabled)"
    return row


def stage_summary(stages: dict, now_s: float) -> str:
    """When each perception stage last reported a frame or a drop ({stage: (steady s, what)}),
    which names the stage that went quiet when the graph stops sending commands."""
    return ", ".join(f"{stage} never" if stage not in stages else f"{stage} {now_s - stages[stage][0]:.1f} s ago ({stages[stage][1]})"
                     for stage in ("selection", "extractor", "policy"))


class Harness:
    """This process's side of a faults run: the inputs the graph is not given by its own nodes, the
    clock, the operator's services and the record of what reached the car."""

    def __init__(self, graph_kind: str, work: Path, log_dir: Path, hold_s: float, safety_scheduling: dict | None = None):
        import rclpy
        import yaml
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node

        from sps_driving.core.control import ControlLimits
        from sps_driving.ros.graph import Graph, car_facts, default_params_file, isolate_ros

        self.kind, self.work, self.hold_s = graph_kind, work, hold_s
        self.safety_scheduling = safety_scheduling or {}  # the vehicle interface's and failsafe's SCHEDULING_PARAMETERS
        base = yaml.safe_load(default_params_file().read_text())
        shared = car_facts()
        vi = {**base["vehicle_interface"]["ros__parameters"], **shared}
        self.limits = ControlLimits.from_dict({k: vi[k] for k in ControlLimits.names()})
        self.settings = {name: {**section["ros__parameters"], **shared} for name, section in base.items() if name != "/**"}
        self.steering_ratio = float(shared["steering_ratio"])
        isolate_ros()  # before rclpy.init: this context joins the graph's private domain
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = Node("sps_faults", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.clock_offset_ns = 0
        self.command = (0.02, 0.15)  # what this process publishes as the policy (vehicle graphs)
        self.obstacle_m = math.inf
        self.camera_mode = "ok"
        self.spoof_wanted = ""  # "stop", "speed" or "heartbeat": a second publisher of that topic
        self.spoof = None  # (publisher, message(stamp)) while spoof_wanted
        self.status = {}
        self.failsafe_trips = 0  # takeovers over every failsafe process of this graph
        self._failsafe_trips_seen = 0  # the running failsafe's own count
        self.stages = {}  # perception stage -> (steady s, "frame" or "dropped: why") of its last report
        self.sent = []
        self.lock = threading.Lock()  # self.sent and self.status are written by the spinning thread
        self._frames = self._demo_frames() if graph_kind == "perception" else None
        self._frame_index = 0
        self._make_publishers()
        nodes = self._nodes()
        self.parameters = self._parameters()
        self.graph = Graph(nodes, parameters=self.parameters, log_dir=log_dir, respawn=[n for n in nodes if n in SUPERVISED])
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._spin, daemon=True)]
        if graph_kind == "clock":
            self._threads.append(threading.Thread(target=self._publish_clock, daemon=True))
        self._clients = {}

    # ------------------------------------------------------------ set-up

    def _nodes(self):
        vehicle = ("pacmod3_standin", "vehicle_interface", "failsafe", "safety_monitor")
        return ("selection", "extractor", "policy", *vehicle) if self.kind == "perception" else ("camera_driver", *vehicle)

    def _parameters(self) -> dict:
        from sps_driving.core.resources import shipped_policy

        checkpoint = str(shipped_policy().resolve())
        params = {
            "vehicle_interface": {"backend": "pacmod3", "use_sim_time": self.kind == "clock", **self.safety_scheduling},
            "safety_monitor": {"required_inputs": ["lane", "obstacle"]},
            "failsafe": dict(self.safety_scheduling),
        }
        if self.kind != "perception":
            frames = self.work / "frames"
            frames.mkdir(parents=True, exist_ok=True)
            self._write_frames(frames)
            params["camera_driver"] = {"source": str(frames), "loop": True, "width": 160, "height": 100, "rate_hz": 30.0}
        else:
            params["selection"] = {"checkpoint": checkpoint}
            params["policy"] = {"checkpoint": checkpoint, "vehicle_backend": "pacmod3"}  # its speed input: the stand-in's report
            # Two CPU cores run the whole perception graph at about 10 frames/s: commands come every
            # ~0.1 s with jitter, so the command age limit is 1 s here (0.25 s on the car's GPU).
            params["vehicle_interface"]["max_command_age_s"] = 1.0
            params["extractor"] = {"checkpoint": checkpoint}  # the policy's extraction (its region of interest and grid)
        return params

    def _demo_frames(self):
        from sps_driving.core.resources import package_path
        from sps_driving.ros.bagio import read_messages

        return [item.msg for item in read_messages(package_path("data/demo_drive"), [topics.IMAGE])]

    def _write_frames(self, folder: Path) -> None:
        import cv2
        import numpy as np

        from sps_driving.core.resources import package_path
        from sps_driving.ros.bagio import read_messages

        for i, item in enumerate(read_messages(package_path("data/demo_drive"), [topics.IMAGE])):
            if i >= 30:
                break
            rgb = np.frombuffer(item.msg.data, np.uint8).reshape(item.msg.height, item.msg.width, 3)
            cv2.imwrite(str(folder / f"{i:03d}.png"), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))

    def _make_publishers(self) -> None:
        from diagnostic_msgs.msg import DiagnosticArray
        from geometry_msgs.msg import PoseStamped
        from rclpy.clock import Clock, ClockType
        from rosgraph_msgs.msg import Clock as ClockMsg
        from sensor_msgs.msg import CameraInfo, Image, JointState, Range

        node = self.node
        self.lane_pub = node.create_publisher(PoseStamped, topics.LANE_POSE, msgs.qos("sensor_out"))
        self.range_pub = node.create_publisher(Range, topics.OBSTACLE_RANGE, msgs.qos("sensor_out"))
        self.clock_pub = node.create_publisher(ClockMsg, "/clock", msgs.qos("sensor_out"))
        self.command_pub = None
        if self.kind != "perception":
            self.command_pub = node.create_publisher(JointState, topics.POLICY_COMMAND, msgs.qos("stream"))
        if self.kind == "perception":
            self.image_pub = node.create_publisher(Image, topics.IMAGE, msgs.qos("image"))
            self.info_pub = node.create_publisher(CameraInfo, topics.CAMERA_INFO, msgs.qos("sensor_out"))
        node.create_subscription(DiagnosticArray, topics.DIAGNOSTICS, self._on_diagnostics, msgs.qos("status"))
        if self.kind == "perception":
            node.create_subscription(DiagnosticArray, topics.STAGE_TIMING, self._on_stage_timing, msgs.qos("status"))
        node.create_subscription(JointState, STANDIN_SENT, self._on_sent, msgs.qos("status"))
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        node.create_timer(1 / 30, self._publish_inputs, clock=steady)
        if self.kind == "perception":
            node.create_timer(1 / 15, self._publish_frame, clock=steady)

    def now_ns(self) -> int:
        return time.time_ns() + self.clock_offset_ns

    def _publish_clock(self) -> None:
        """/clock at 100 Hz from a thread of its own: executor timers in this busy process lag by
        more than the vehicle interface's clock-jump limit, which it would rightly take for a step."""
        from rosgraph_msgs.msg import Clock as ClockMsg

        while not self._stop.wait(0.01):
            self.clock_pub.publish(ClockMsg(clock=msgs.to_ros(msgs.time_fields(self.now_ns()))))

    def _publish_inputs(self) -> None:
        stamp = time.time_ns()  # the safety monitor runs on system time
        self.lane_pub.publish(msgs.to_ros(msgs.lane_pose_fields(0.0, 0.0, stamp)))
        self.range_pub.publish(msgs.to_ros(msgs.range_fields(self.obstacle_m, stamp)))
        if self.command_pub is not None:
            self.command_pub.publish(msgs.to_ros(msgs.command_fields(*self.command, self.now_ns())))
        # A second publisher lives on this (the executor's) thread only: made, used and destroyed
        # here, never while another thread publishes through it. Each says all is well: no stop
        # requested, a valid standstill.
        if self.spoof_wanted and self.spoof is None:
            self.spoof = self._spoof(self.spoof_wanted)
        elif not self.spoof_wanted and self.spoof is not None:
            self.node.destroy_publisher(self.spoof[0])
            self.spoof = None
        if self.spoof is not None:
            publisher, message = self.spoof
            publisher.publish(message(stamp))

    def _spoof(self, what: str):
        """A second publisher of `what` ("stop", "speed" or "heartbeat", as a replayed bag would
        bring) and the message it repeats: (publisher, message(stamp))."""
        if what == "stop":
            from diagnostic_msgs.msg import DiagnosticArray

            return (self.node.create_publisher(DiagnosticArray, topics.SAFETY_STOP, msgs.qos("control")),
                    lambda stamp: msgs.stop_request_message(stamp, "safety_monitor", False))
        if what == "heartbeat":
            from sensor_msgs.msg import JointState

            return (self.node.create_publisher(JointState, topics.ACTUATION, msgs.qos("control")),
                    lambda stamp: msgs.to_ros(msgs.command_fields(0.0, 0.0, stamp)))
        from pacmod3_msgs.msg import VehicleSpeedRpt

        return (self.node.create_publisher(VehicleSpeedRpt, topics.PACMOD_SPEED_RPT, msgs.qos("driver")),
                lambda stamp: VehicleSpeedRpt(header=msgs.to_ros(msgs.header_fields(stamp, "pacmod")), vehicle_speed=0.0,
                                              vehicle_speed_valid=True))

    def _publish_frame(self) -> None:
        if self.camera_mode == "stop":
            return
        frame = self._frames[self._frame_index % len(self._frames)]
        self._frame_index += 1
        stamp = time.time_ns() - (int(1.5e9) if self.camera_mode == "delay" else 0)
        image = msgs.from_bag(frame, self.image_pub.msg_type)
        image.header = msgs.to_ros(msgs.header_fields(stamp, "camera"))
        if self.camera_mode == "corrupt":
            image.data = bytes(image.data)[: len(image.data) // 3]  # truncated: fewer bytes than step x height
        self.image_pub.publish(image)
        self.info_pub.publish(msgs.to_ros(msgs.camera_info_fields(frame.height, frame.width, stamp, "camera", math.radians(130.0))))

    def _on_diagnostics(self, msg) -> None:
        with self.lock:
            for name, level, message, values in msgs.diagnostic_values(msg):
                self.status[name] = (level, message, values)
                if name == "failsafe" and "trips" in values:
                    trips = int(values["trips"])
                    # A restarted failsafe counts from 0 again.
                    self.failsafe_trips += trips - self._failsafe_trips_seen if trips >= self._failsafe_trips_seen else trips
                    self._failsafe_trips_seen = trips

    def _on_stage_timing(self, msg) -> None:
        now_s = time.monotonic()
        with self.lock:
            for report in msgs.stage_reports(msg):
                self.stages[report.stage] = (now_s, f"dropped: {report.reason}" if report.dropped else "frame")

    def _stage_summary(self) -> str:
        with self.lock:
            return stage_summary(dict(self.stages), time.monotonic())

    def _on_sent(self, msg) -> None:
        from sps_driving.ros.nodes.pacmod3_standin import sent_from_message

        # When the stand-in sent it (its stamp, on this machine's system clock), on this process's
        # steady clock: a frame this busy process takes in late still counts when it went out.
        sent_s = time.monotonic() - (time.time_ns() - msgs.stamp_ns(msg.header)) / 1e9
        sent = sent_from_message(msg, sent_s)
        with self.lock:
            self.sent.append(sent)

    def _spin(self) -> None:
        while not self._stop.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def start(self, startup_timeout_s: float = 300.0) -> None:
        from sps_driving.ros.graph import wait_for_nodes

        for thread in self._threads:
            thread.start()
        self.graph.start()
        wait_for_nodes(self.node, self.graph.nodes, startup_timeout_s, self.graph)

    def close(self) -> None:
        self.graph.stop()
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self.executor.shutdown()
        self.node.destroy_node()
        import rclpy

        rclpy.try_shutdown(context=self.context)

    # ------------------------------------------------------------ operating the car

    def call(self, service_type, name: str, request, timeout_s: float = 5.0):
        """A service call from this process; the response, or None without one in time."""
        if name not in self._clients:
            self._clients[name] = self.node.create_client(service_type, name)
        client = self._clients[name]
        if not client.wait_for_service(timeout_sec=timeout_s):
            return None
        future = client.call_async(request)
        deadline = time.monotonic() + timeout_s
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        return future.result() if future.done() else None

    def sends(self):
        with self.lock:
            return list(self.sent)

    def driving(self, since_s: float) -> bool:
        recent = [s for s in self.sends() if s.time_s >= since_s]
        return len(recent) >= 5 and all(
            all(s.enable[x] for x in ("steering", "accel", "brake")) and not in_stop_set(s, self.limits.stop_brake)
            for s in recent[-5:]
        )

    def engage(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Disengage, re-arm and engage until the car drives; returns the last refusal on timeout."""
        from std_srvs.srv import SetBool, Trigger

        deadline = time.monotonic() + timeout_s
        message = "no answer"
        self.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=False))
        while time.monotonic() < deadline:
            self.call(Trigger, topics.REARM_SERVICE, Trigger.Request())
            answer = self.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
            message = answer.message if answer is not None else "no answer"
            if answer is not None and answer.success:
                since = time.monotonic()
                while time.monotonic() - since < 3.0:
                    if self.driving(since):
                        return ""
                    time.sleep(0.05)
                self.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=False))
            time.sleep(0.5)
        return message

    # ------------------------------------------------------------ faults

    def inject_standin(self, name: str, active: bool) -> None:
        from std_srvs.srv import SetBool

        if self.call(SetBool, f"/pacmod3_standin/{name}", SetBool.Request(data=active)) is None:
            raise RuntimeError(f"the stand-in driver did not answer /pacmod3_standin/{name}")

    def inject(self, fault: Fault) -> None:
        kind, target = fault.inject, fault.target
        if kind == "kill":
            self.graph.kill(target, signal.SIGKILL)  # a supervised node: its supervisor starts it again
        elif kind in ("sigterm", "sigint", "sigstop"):
            self.graph.signal_node(target, {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigstop": signal.SIGSTOP}[kind])
        elif kind == "deactivate":
            from lifecycle_msgs.msg import Transition
            from lifecycle_msgs.srv import ChangeState

            request = ChangeState.Request()
            request.transition.id = Transition.TRANSITION_DEACTIVATE
            threading.Thread(target=self.call, args=(ChangeState, f"/{target}/change_state", request), daemon=True).start()
        elif kind == "clock":
            self.clock_offset_ns += int(float(target) * 1e9)
        elif kind == "standin":
            self.inject_standin(target, True)
        elif kind == "spoof":
            self.spoof_wanted = target
        elif kind == "command":
            self.command = (math.nan, 0.15) if target == "nan" else (5.0, 3.0)
        elif kind == "obstacle":
            self.obstacle_m = -math.inf
        elif kind == "camera":
            self.camera_mode = target
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def restore(self, fault: Fault, fault_s: float) -> None:
        """Undo `fault`, injected at steady time `fault_s`."""
        from sps_driving.ros.graph import wait_for_nodes

        kind, target = fault.inject, fault.target
        if kind == "sigstop":
            self.graph.signal_node(target, signal.SIGCONT)
        elif kind == "kill" and target in self.graph.respawn:
            pass  # its supervisor starts it again; recovery waits for it
        elif kind in ("kill", "sigterm", "sigint", "deactivate"):
            self.graph.stop([target])
            if kind == "kill":
                time.sleep(max(0.0, fault_s + RESTART_AFTER_KILL_S - time.monotonic()))
            self.graph.start(target)
            wait_for_nodes(self.node, [target], 120.0, self.graph)
        elif kind == "standin":
            self.inject_standin(target, False)
        elif kind == "spoof":
            self.spoof_wanted = ""
        elif kind == "command":
            self.command = (0.02, 0.15)
        elif kind == "obstacle":
            self.obstacle_m = math.inf
        elif kind == "camera":
            self.camera_mode = "ok"

    def run(self, fault: Fault, repeat: int = 0) -> dict:
        trips_before = self.failsafe_trips
        refused = self.drive()
        row = {"fault": fault.name, "graph": self.kind, "repeat": repeat}
        if refused:
            return {**row, "stopped": False, "time_to_stop_s": None, "held": False, "unsafe_commands": 0,
                    "recovered": False, "time_to_drive_again_s": None, "failsafe_trips": self.failsafe_trips - trips_before,
                    "error": f"could not drive before the fault: {refused}"
                    + (f"; last stage reports: {self._stage_summary()}" if self.kind == "perception" else "")}
        fault_s = time.monotonic()
        self.inject(fault)
        time.sleep(self.hold_s)
        end_s = time.monotonic()
        row.update(measure(self.sends(), fault_s, end_s, self.limits, self.steering_ratio))
        row["stop_deadline_s"] = round(self.detection_limit_s(fault) + STOP_MARGIN_S, 3)
        row["vehicle_interface"] = self._vehicle_interface()
        self.restore(fault, fault_s)
        refused = self.engage(max(1.0, fault_s + RECOVERY_TIMEOUT_S - time.monotonic()))
        row["recovered"] = not refused
        row["time_to_drive_again_s"] = None if refused else round(time.monotonic() - fault_s, 2)
        if refused:
            row["error"] = f"did not drive again within {RECOVERY_TIMEOUT_S:g} s of the fault: {refused}" + (
                f"; last stage reports: {self._stage_summary()}" if self.kind == "perception" else "")
        row["failsafe_trips"] = self.failsafe_trips - trips_before
        return row

    def detection_limit_s(self, fault: Fault) -> float:
        """s within which the graph's own limits say the fault must be seen."""
        vi = {**self.settings["vehicle_interface"], **self.parameters["vehicle_interface"]}
        if fault.graph == "perception" and fault.inject in ("kill", "sigstop", "camera"):
            # Commands of frames taken before the fault keep coming for as long as the vehicle
            # interface accepts their age (max_command_latency_s), then the command watchdog runs out.
            return float(vi["max_command_latency_s"]) + float(vi["max_command_age_s"])
        if fault.inject in ("kill", "sigstop") and fault.target in SILENCE_WATCHDOGS:
            section, name = SILENCE_WATCHDOGS[fault.target]
            return float(self.settings[section][name])
        if fault.inject == "standin" and fault.target == "pause_reports":
            return float(self.settings["vehicle_interface"]["max_report_age_s"])
        if fault.inject == "spoof":
            from sps_driving.ros.nodes.vehicle_interface import PUBLISHER_CHECK_PERIODS

            # The vehicle interface counts each topic's publishers once every PUBLISHER_CHECK_PERIODS periods.
            return PUBLISHER_CHECK_PERIODS / float(vi["control_rate_hz"])
        return 0.0

    def drive(self) -> str:
        """Make sure the car drives right before a fault; returns why it does not ("" when it does)."""
        if self.driving(time.monotonic() - 0.3):
            return ""
        refused = ""
        for _ in range(3):
            refused = self.engage()
            if refused:
                return refused
            time.sleep(0.5)
            if self.driving(time.monotonic() - 0.3):  # still driving right before the fault
                return ""
            refused = "stopped again before the fault: " + self._vehicle_interface()
        return refused

    def _vehicle_interface(self) -> str:
        """The vehicle interface's and the failsafe's latest statuses, in a few words."""
        with self.lock:
            vi = self.status.get("vehicle_interface", (0, "", {}))[2]
            failsafe = self.status.get("failsafe", (0, "", {}))[1]
        reasons = vi.get("stop_reasons") if vi.get("engagement") == "engaged" else vi.get("last_event", "")
        return f"{vi.get('engagement', '?')}: {reasons}; failsafe {failsafe}"


BUSY_LOOP = "import sys, time\ndeadline = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < deadline:\n    pass\n"


class Load:
    """`count` busy processes beside the graph (each a CPU-bound loop, as another job on the car's
    computer would be), ended with the run, with this process if it is killed, and after `limit_s`
    in any case."""

    def __init__(self, count: int, limit_s: float):
        self.count, self.limit_s = count, limit_s
        self.processes = []

    def __enter__(self) -> Load:
        import subprocess

        from sps_driving.ros.process import stop_with_parent

        self.processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.limit_s)], preexec_fn=stop_with_parent)
                          for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def run_matrix(faults: list[Fault], hold_s: float = HOLD_S, log_dir: Path | None = None, progress=print,
               repeat: int = 1, safety_scheduling: dict | None = None) -> list[dict]:
    """Each graph started once; its faults run `repeat` times over in it, one after the other."""
    work = Path(tempfile.mkdtemp(prefix="sps_faults_"))
    rows = []
    for kind in ("vehicle", "clock", "perception"):
        chosen = [f for f in faults if f.graph == kind]
        if not chosen:
            continue
        harness = Harness(kind, work / kind, Path(log_dir or work) / kind, hold_s, safety_scheduling)
        try:
            harness.start()
            for index in range(repeat):
                for fault in chosen:
                    row = harness.run(fault, index)
                    progress(format_row(row))
                    rows.append(row)
        finally:
            harness.close()
    return rows


def passed(row: dict) -> bool:
    """Stopped, held, no unsafe command, drove again, and the failsafe took over only if it had to."""
    false_trips = row.get("failsafe_trips", 0) if row["fault"] not in FAILSAFE_FAULTS else 0
    return row["stopped"] and row["held"] and row["unsafe_commands"] == 0 and row.get("recovered", False) and not false_trips


def summarize(rows: list[dict]) -> list[dict]:
    """Each fault over its repeats: how many passed, the worst and median times."""
    import statistics

    summary = []
    for name in dict.fromkeys(r["fault"] for r in rows):
        mine = [r for r in rows if r["fault"] == name]
        stops = [r["time_to_stop_s"] for r in mine if r["time_to_stop_s"] is not None]
        again = [r["time_to_drive_again_s"] for r in mine if r.get("time_to_drive_again_s") is not None]
        summary.append({
            "fault": name, "graph": mine[0]["graph"], "runs": len(mine), "passed": sum(passed(r) for r in mine),
            "stopped": sum(r["stopped"] for r in mine), "held": sum(r["held"] for r in mine),
            "recovered": sum(r.get("recovered", False) for r in mine),
            "unsafe_commands": sum(r["unsafe_commands"] for r in mine),
            "late_stops": sum(r["time_to_stop_s"] is not None and r["time_to_stop_s"] > r.get("stop_deadline_s", math.inf)
                              for r in mine),
            "false_failsafe_trips": 0 if name in FAILSAFE_FAULTS else sum(r.get("failsafe_trips", 0) for r in mine),
            "time_to_stop_s": {"median": statistics.median(stops), "worst": max(stops)} if stops else None,
            "time_to_drive_again_s": {"median": statistics.median(again), "worst": max(again)} if again else None,
        })
    return summary


def format_row(row: dict) -> str:
    t = "-" if row["time_to_stop_s"] is None else f"{row['time_to_stop_s']:.3f}"
    again = "-" if row.get("time_to_drive_again_s") is None else f"{row['time_to_drive_again_s']:.1f}"
    extra = row.get("error") or row.get("vehicle_interface", "")
    return (f"| {row['fault']} | {row.get('repeat', 0) + 1} | {row['graph']} | {'yes' if row['stopped'] else 'NO'} | {t} | "
            f"{'yes' if row['held'] else 'NO'} | {row.get('end_state', '-')} | {row['unsafe_commands']} | "
            f"{'yes' if row.get('recovered') else 'NO'} | {again} | {row.get('failsafe_trips', 0)} | {extra} |")


TABLE_HEADER = ("| fault | repeat | graph | stopped | time to stop (s) | held | end state | unsafe commands | drove again "
                "| time to drive again (s) | failsafe takeovers | at the end |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
SUMMARY_HEADER = ("| fault | graph | passed | unsafe commands | false failsafe takeovers | time to stop (s), median / worst "
                  "| stops later than their watchdogs allow + 0.3 s | time to drive again (s), median / worst |\n"
                  "|---|---|---|---|---|---|---|---|")


def format_summary(entry: dict) -> str:
    def times(t):
        return "-" if t is None else f"{t['median']:.3f} / {t['worst']:.3f}"

    def again(t):
        return "-" if t is None else f"{t['median']:.1f} / {t['worst']:.1f}"

    return (f"| {entry['fault']} | {entry['graph']} | {entry['passed']} of {entry['runs']} | {entry['unsafe_commands']} | "
            f"{entry['false_failsafe_trips']} | {times(entry['time_to_stop_s'])} | {entry['late_stops']} | "
            f"{again(entry['time_to_drive_again_s'])} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--short", action="store_true", help=f"only: {', '.join(SHORT)}")
    parser.add_argument("--only", nargs="+", metavar="FAULT", help="run these faults (names as in the table)")
    parser.add_argument("--hold", type=float, default=HOLD_S, help="s watched after each fault")
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen faults this many times over in the same graphs")
    parser.add_argument("--load", type=int, default=0, metavar="K", help="K busy processes beside the graph while it runs")
    parser.add_argument("--load-limit", type=float, default=6 * 3600.0, metavar="S",
                        help="s after which the busy processes end even if the run has not")
    parser.add_argument("--safety-cpus", default="", metavar="CPUS",
                        help="cpu_affinity of the vehicle interface and the failsafe, e.g. 1 (default: any)")
    parser.add_argument("--safety-priority", type=int, default=0, metavar="N",
                        help="their realtime_priority, SCHED_FIFO 1-99 (default 0: normal scheduling)")
    parser.add_argument("--json", action="store_true", help='print {"faults": [...], "summary": [...]} as JSON')
    parser.add_argument("--log-dir", type=Path, help="keep the node logs here")
    parser.add_argument("--out", type=Path, help="also write the tables as Markdown here, with the command and revision")


def select(short: bool, only: list[str] | None) -> list[Fault]:
    names = set(SHORT) if short else set(only) if only else None
    if names is None:
        return list(FAULTS)
    unknown = names - {f.name for f in FAULTS}
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {[f.name for f in FAULTS]}")
    return [f for f in FAULTS if f.name in names]


def run(args: argparse.Namespace) -> int:
    try:
        faults = select(args.short, args.only)
        if args.repeat < 1 or args.load < 0:
            raise ValueError("--repeat must be 1 or more and --load 0 or more")
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    if not args.json:
        print(TABLE_HEADER, flush=True)
    progress = (lambda _row: None) if args.json else (lambda line: print(line, flush=True))
    scheduling = {"cpu_affinity": args.safety_cpus, "realtime_priority": args.safety_priority}
    with Load(args.load, args.load_limit):
        rows = run_matrix(faults, args.hold, args.log_dir, progress=progress, repeat=args.repeat, safety_scheduling=scheduling)
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"faults": rows, "summary": summary, "repeat": args.repeat, "load": args.load}, indent=2))
    else:
        print("\n" + SUMMARY_HEADER)
        print("\n".join(format_summary(entry) for entry in summary))
    if args.out:
        write_markdown(rows, args.out, "sps-driving " + " ".join(sys.argv[1:]), args.hold, args.load)
    return 0 if all(passed(r) for r in rows) else 1


def write_markdown(rows: list[dict], path: Path, command: str, hold_s: float, load: int = 0) -> None:
    from datetime import datetime, timezone

    from sps_driving.core.resources import source_revision

    ok = sum(passed(r) for r in rows)
    repeats = max(r.get("repeat", 0) for r in rows) + 1
    lines = [
        "# Fault-injection matrix of the drive-by-wire path",
        "",
        f"Command: `{command}`  ",
        f"Revision: {source_revision()}, {datetime.now(timezone.utc).strftime('%Y-%m-%d')}  ",
        f"Each fault watched for {hold_s:g} s, {repeats} time(s) over, {load} busy process(es) beside the graph; "
        f"{ok} of {len(rows)} ended in a held stop with 0 unsafe commands, drove again within {RECOVERY_TIMEOUT_S:g} s "
        "and had no false failsafe takeover.  ",
        f"Load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores.",
        "",
        "Times to stop are from the fault to the first 33 ms frame the PACMod 3 stand-in sent to the car in the stop set",
        "(no accelerator, and the brake at 0.5 or more, or every system disabled); times to drive again from the fault to",
        "the car driving again after the safety driver's re-arm and engage. How they are measured and what each graph",
        "contains: `sps_driving/tools/faults.py`; what they mean for the safety driver: `docs/vehicle.md`. In the perception",
        "graph the command age limit is 1 s instead of 0.25 s: two CPU cores run the whole perception graph at about",
        "10 frames/s, so its stops come about 1 s after the fault.",
        "",
        "## Summary",
        "",
        SUMMARY_HEADER,
        *(format_summary(entry) for entry in summarize(rows)),
        "",
        "## Every run",
        "",
        TABLE_HEADER,
        *(format_row(r) for r in rows),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
