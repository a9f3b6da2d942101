"""The sim_world node over real DDS: it publishes the camera and the safety-monitor inputs and
drives with the commands it receives on the vehicle interface's output topic."""

import json
import time

import pytest

from sps_driving.sim.config import load_sim_config
from sps_driving.sim.live import LiveSim

rclpy = pytest.importorskip("rclpy")


def test_live_sim_runs_episodes_from_outside_commands():
    config = load_sim_config()
    config["episode_s"] = 0.5
    sim = LiveSim(config, "rural-summer-dry-day-car", first_episode=3, episodes=2, render=False)
    results = []
    while not sim.done:
        obs = sim.observe()
        assert obs.image is None and abs(obs.lateral_offset_m) < 1.8
        assert obs.target_speed_mps == sim.world.episode.cruise_speed
        result = sim.advance(obs.expert_steering, obs.expert_throttle)
        if result is not None:
            results.append(result)
    assert [r["seed"] for r in results] == [3, 4] and all(r["score"] == 1.0 for r in results)
    with pytest.raises(RuntimeError):
        sim.advance(0.0, 0.0)


@pytest.mark.ros
def test_sim_world_node_publishes_and_obeys_commands(tmp_path):
    from geometry_msgs.msg import PoseStamped, TwistStamped
    from sensor_msgs.msg import Image, JointState, Range

    from sps_driving.core import topics
    from sps_driving.ros import msgs
    from sps_driving.ros.graph import Graph, wait_for_nodes

    results = tmp_path / "results.jsonl"
    rclpy.init()
    node = rclpy.create_node("sim_world_test")
    images, lanes, ranges, targets = [], [], [], []
    node.create_subscription(Image, topics.IMAGE, images.append, msgs.qos("image"))
    node.create_subscription(PoseStamped, topics.LANE_POSE, lambda m: lanes.append(msgs.lane_from_message(m)), msgs.qos("sensor"))
    node.create_subscription(Range, topics.OBSTACLE_RANGE, lambda m: ranges.append(m.range), msgs.qos("sensor"))
    node.create_subscription(TwistStamped, topics.TARGET_SPEED, lambda m: targets.append(msgs.speed_from_message(m)),
                             msgs.qos("sensor"))
    command_pub = node.create_publisher(JointState, topics.ACTUATION, msgs.qos("control"))
    graph = Graph(["sim_world"], parameters={"sim_world": {"episode_s": 1.0, "results_path": str(results)}}, log_dir=tmp_path)
    try:
        with graph:
            wait_for_nodes(node, ["sim_world"], 60.0, graph)
            deadline = time.monotonic() + 60
            while len(images) < 3 and time.monotonic() < deadline:
                rclpy.spin_once(node, timeout_sec=0.1)
            assert len(images) >= 3, graph.log("sim_world")
            camera = load_sim_config()["camera"]
            assert (images[0].height, images[0].width, images[0].encoding) == (camera["render_height"], camera["render_width"], "rgb8")
            # Waiting for a command: the world holds its start state.
            assert all(lane == lanes[0] for lane in lanes)
            # Steer hard left: the lateral offset grows, the safety driver resets, the episode ends.
            while not results.exists() and time.monotonic() < deadline:
                command_pub.publish(msgs.to_ros(msgs.command_fields(0.3, 0.0, 0)))
                rclpy.spin_once(node, timeout_sec=0.05)
            assert max(lat for lat, _ in lanes) > 0.5 and all(r > 0 for r in ranges)
            # the episode's cruise target, what a safety driver sets on the car (config/sim.yaml: 8-12 m/s)
            assert targets and len(set(targets)) == 1 and 8.0 <= targets[0] <= 12.0
            (result,) = [json.loads(line) for line in results.read_text().splitlines()]
            assert result["interventions"] >= 1 and result["score"] < 1.0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def test_graph_eval_scales_the_stacks_wall_clock_settings():
    from sps_driving.sim.graph_eval import graph_parameters

    base = {"vehicle_interface": {"max_command_age_s": 0.25, "max_camera_age_s": 0.25, "max_safety_age_s": 0.5,
                                  "max_command_latency_s": 1.0, "max_steering_rate_rad_s": 0.3},
            "extractor": {"selection_timeout_s": 0.5}, "safety_monitor": {"max_input_age_s": 0.5}}
    params = graph_parameters(base, "/p", "/s.yaml", "urban-summer-rain-day-car", 4, 2, "/r.jsonl", 0.25)
    vi = params["vehicle_interface"]
    assert (vi["max_command_age_s"], vi["max_command_latency_s"], vi["max_steering_rate_rad_s"]) == (1.0, 4.0, 0.075)
    assert params["extractor"]["selection_timeout_s"] == 2.0 and params["safety_monitor"]["max_input_age_s"] == 2.0
    assert params["sim_world"]["first_episode"] == 4 and params["sim_world"]["episodes"] == 2
    assert params["selection"]["checkpoint"] == params["policy"]["checkpoint"] == "/p"


@pytest.mark.ros
def test_eval_through_the_live_graph(tmp_path):
    """`sps-driving eval --graph`: sim_world and the on-car nodes drive a tiny random grid MLP (the shipped
    architecture, random weights) over the embedded DINOv2; the episode lands in results.jsonl."""
    from samples import tiny_dinov2_policy

    from sps_driving.cli import main

    tiny_dinov2_policy(tmp_path / "policy")
    out = tmp_path / "eval"
    args = ["eval", "--policy", str(tmp_path / "policy"), "--graph", "--real-time-factor", "0.5", "--episodes", "1",
            "--episode-s", "1", "--scenarios", "rural-fall-dry-day-animal", "--out", str(out)]
    assert main(args) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["method"] == "SPS-50 (graph)" and row["via"] == "graph" and row["real_time_factor"] == 0.5
    assert row["scenario"] == "rural-fall-dry-day-animal" and row["duration_s"] == 1.0
    # the world moved under the stack's commands (it starts at cruise speed and only the stack steers it)
    assert row["distance_m"] > 3.0 and 0.0 <= row["score"] <= 1.0
    assert (out / "graph" / "logs_rural-fall-dry-day-animal" / "policy.log").is_file()
    assert main(args) == 0  # resumable: nothing left to run
    assert len((out / "results.jsonl").read_text().splitlines()) == 1
