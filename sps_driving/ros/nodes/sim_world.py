"""sim_world: the driving world as a node, standing in for the car and its sensors.

Publishes, per control step and all with the node clock's stamp at publishing (as a camera driver
does): the camera (sensor_msgs/Image and CameraInfo), the safety-monitor inputs (lane pose,
nearest-obstacle range), the vehicle speed, the episode's cruise target speed (what a safety driver
sets on the car, topics.TARGET_SPEED), and the privileged expert's command for the same
state on topics.REFERENCE_COMMAND. Consumes the vehicle interface's limited command
(topics.ACTUATION, "topics" backend) and applies the newest one at the next step. Logic:
sps_driving.sim.live.

Until the first command arrives the start state is published every tick and the world waits
(`wait_for_command`; otherwise it coasts with a zero command). `start_topic` makes the world wait
for a message there instead: the policy's output, when the vehicle interface sends stop
commands until the stack has warmed up. `real_time_factor` < 1 runs the
world slower than real time, for stacks that cannot keep up on the machine at hand. Each
finished episode is logged, published on ~/status, and appended to `results_path` (JSONL) when
set; after the last episode the node keeps publishing its final status.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped, TwistStamped
from rclpy.node import Node
from sensor_msgs.msg import CameraInfo, Image, JointState, Range

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.nodes.common import Param, declare, now_ns, run
from sps_driving.sim.config import load_sim_config
from sps_driving.sim.live import LiveSim

PARAMETERS = {
    "scenario": Param("rural-summer-dry-day-car", "driving-world scenario: scene-season-weather-time-actor"),
    "first_episode": Param(0, "episode seed of the first episode; the next ones count up", min=0),
    "episodes": Param(1, "episodes driven one after another", min=1),
    "episode_s": Param(0.0, "episode length; 0 = the length in the simulator config", "s", min=0.0),
    "sim_config": Param("", "simulator settings (YAML); empty: config/sim.yaml"),
    "real_time_factor": Param(1.0, "world seconds per wall second", above=0.0),
    "wait_for_command": Param(True, "hold the world still until the stack sends its first command"),
    "start_topic": Param("", "JointState topic whose first message starts the world; empty: the command topic itself"),
    "frame_id": Param("camera", "frame of the published camera"),
    "results_path": Param("", "JSONL file each finished episode is appended to; empty: none"),
}


class SimWorldNode(Node):
    NODE_NAME = "sim_world"

    def __init__(self):
        super().__init__(self.NODE_NAME)
        p = declare(self, PARAMETERS)
        config = load_sim_config(p["sim_config"] or None)
        if p["episode_s"] > 0:
            config["episode_s"] = p["episode_s"]
        factor = p["real_time_factor"]
        self.sim = LiveSim(config, p["scenario"], p["first_episode"], p["episodes"])
        self.hfov = math.radians(float(config["camera"]["hfov_deg"]))
        self.frame_id = p["frame_id"]
        self.results_path = Path(p["results_path"]) if p["results_path"] else None
        self.wait_for_command = p["wait_for_command"]
        self.command = None
        self.started = not self.wait_for_command
        self.dropped_commands = 0
        self.image_pub = self.create_publisher(Image, topics.IMAGE, msgs.qos("image"))
        self.info_pub = self.create_publisher(CameraInfo, topics.CAMERA_INFO, msgs.qos("sensor_out"))
        self.lane_pub = self.create_publisher(PoseStamped, topics.LANE_POSE, msgs.qos("sensor_out"))
        self.range_pub = self.create_publisher(Range, topics.OBSTACLE_RANGE, msgs.qos("sensor_out"))
        self.twist_pub = self.create_publisher(TwistStamped, topics.VEHICLE_TWIST, msgs.qos("sensor_out"))
        self.target_speed_pub = self.create_publisher(TwistStamped, topics.TARGET_SPEED, msgs.qos("sensor_out"))
        self.reference_pub = self.create_publisher(JointState, topics.REFERENCE_COMMAND, msgs.qos("stream"))
        self.status_pub = self.create_publisher(DiagnosticArray, "~/status", msgs.qos("status"))
        self.create_subscription(JointState, topics.ACTUATION, self._on_command, msgs.qos("control"))
        self.start_topic = p["start_topic"] or topics.ACTUATION
        if self.start_topic != topics.ACTUATION:
            self.create_subscription(JointState, self.start_topic, self._on_start, msgs.qos("stream"))
        self.create_timer(1.0 / (float(config["control_rate_hz"]) * factor), self._tick)
        self.get_logger().info(
            f"{p['scenario']}: {p['episodes']} episode(s) of {config['episode_s']:g} s from seed {p['first_episode']}, "
            f"{config['camera']['render_width']}x{config['camera']['render_height']} px, real-time factor {factor:g}"
        )

    def _on_command(self, msg: JointState) -> None:
        try:
            self.command = msgs.command_from_message(msg)
        except msgs.MessageError as exc:
            self.dropped_commands += 1
            self.get_logger().warning(f"dropped command: {exc}", throttle_duration_sec=1.0)
            return
        if self.start_topic == topics.ACTUATION:
            self.started = True

    def _on_start(self, _msg: JointState) -> None:
        self.started = True

    def _tick(self) -> None:
        if self.sim.done:
            self._publish_status("finished")
            return
        if not self.started:
            # The stack needs frames to produce its first command: show it the start state.
            self._publish_status("waiting for the first message on " + self.start_topic)
            self._publish_observation()
            return
        command = self.command if self.command is not None else (0.0, 0.0)
        result = self.sim.advance(*command)
        if result is not None:
            self._finish_episode(result)
            if self.sim.done:
                return
        self._publish_observation()

    def _publish_observation(self) -> None:
        obs = self.sim.observe()
        stamp = now_ns(self)
        # The frame's state first: a policy that reads it finds it there when the frame's descriptors come.
        self.twist_pub.publish(msgs.to_ros(msgs.twist_fields(obs.speed_mps, stamp)))
        self.target_speed_pub.publish(msgs.to_ros(msgs.twist_fields(obs.target_speed_mps, stamp)))
        self.image_pub.publish(msgs.to_ros(msgs.image_fields(obs.image, stamp, self.frame_id)))
        self.info_pub.publish(msgs.to_ros(msgs.camera_info_fields(obs.image.shape[0], obs.image.shape[1], stamp, self.frame_id, self.hfov)))
        self.lane_pub.publish(msgs.to_ros(msgs.lane_pose_fields(obs.lateral_offset_m, obs.heading_error_rad, stamp)))
        self.range_pub.publish(msgs.to_ros(msgs.range_fields(obs.obstacle_gap_m, stamp)))
        self.reference_pub.publish(msgs.to_ros(msgs.command_fields(obs.expert_steering, obs.expert_throttle, stamp)))

    def _finish_episode(self, result: dict) -> None:
        self.get_logger().info(
            f"episode {result['episode']}: score {result['score']:.2f}, interventions {result['interventions']}, "
            f"failures {result['failures']}"
        )
        if self.results_path is not None:
            with self.results_path.open("a") as sink:
                sink.write(json.dumps(result) + "\n")
        self._publish_status("episode finished")

    def _publish_status(self, message: str) -> None:
        last = self.sim.results[-1] if self.sim.results else {}
        self.status_pub.publish(
            msgs.diagnostics(
                now_ns(self),
                self.NODE_NAME,
                msgs.Level.OK,
                message,
                {
                    "episode": self.sim.episode,
                    "step": self.sim.world.steps,
                    "episodes_finished": len(self.sim.results),
                    "last_score": f"{last['score']:.4f}" if last else "",
                    "last_interventions": last.get("interventions", ""),
                    "dropped_commands": self.dropped_commands,
                },
            )
        )


def main(args=None) -> int:
    return run(SimWorldNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
