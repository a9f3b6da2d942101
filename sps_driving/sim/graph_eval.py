"""Closed-loop episodes through the live ROS 2 graph (`sps-driving eval --graph`): the sim_world
node stands in for the car and its sensors, and the exact on-car stack (selection, extractor,
policy, vehicle_interface with its limits and watchdogs, safety_monitor) drives it.

One graph per scenario runs that scenario's episodes back to back; sim_world appends each finished
episode to a JSONL file, which becomes rows of the evaluation's results.jsonl under the method
name with " (graph)" appended, so tables and details show both ways side by side.

The world can run slower than real time (`real_time_factor` < 1) for machines where the stack
cannot keep up with 10 frames/s. Every wall-clock setting of the stack is scaled with it so the
stack sees the world as it would at real time: staleness timeouts by 1/factor, the steering-rate
limit (per wall second) by factor.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from sps_driving.core import topics
from sps_driving.ros.graph import VEHICLE_WITHOUT_CAR

GRAPH_NODES = ("selection", "extractor", "policy", "vehicle_interface", "safety_monitor", "sim_world")
GRAPH_SUFFIX = " (graph)"
# Wall-clock seconds of the stack's parameters: scaled by 1/real_time_factor.
_TIMEOUTS = {
    "extractor": ("selection_timeout_s",),
    "vehicle_interface": ("max_command_age_s", "max_camera_age_s", "max_safety_age_s", "max_command_latency_s"),
    "safety_monitor": ("max_input_age_s",),
}
# Per-wall-second rates: scaled by real_time_factor.
_RATES = {"vehicle_interface": ("max_steering_rate_rad_s",)}


def graph_parameters(base: dict, policy_dir: Path, sim_config: Path, scenario: str, first_episode: int,
                     episodes: int, results: Path, real_time_factor: float, device: str = "cpu",
                     world_max_speed_mps: float = 20.0) -> dict:
    """Per-node overrides of `base` (the params file's {node: parameters}) for one scenario."""
    params = {
        "selection": {"checkpoint": str(policy_dir)},
        "extractor": {"checkpoint": str(policy_dir), "device": device},
        "policy": {"checkpoint": str(policy_dir), "device": device},
        # The world's own speed limit, not the car's field-test cap: scenarios cruise at 8-12 m/s.
        "vehicle_interface": {**VEHICLE_WITHOUT_CAR, "max_speed_mps": float(world_max_speed_mps)},
        "safety_monitor": {"required_inputs": ["lane", "obstacle"]},
        "sim_world": {
            "scenario": scenario, "first_episode": first_episode, "episodes": episodes,
            "sim_config": str(sim_config), "real_time_factor": real_time_factor,
            "results_path": str(results), "wait_for_command": True,
            # The vehicle interface sends stop commands until the stack's first policy command:
            # the world starts when the policy has spoken, not at the first (braking) actuation.
            "start_topic": topics.POLICY_COMMAND,
        },
    }
    for node, names in _TIMEOUTS.items():
        for name in names:
            params[node][name] = float(base[node][name]) / real_time_factor
    for node, names in _RATES.items():
        for name in names:
            params[node][name] = float(base[node][name]) * real_time_factor
    return params


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_scenario(config: dict, policy_dir: Path, scenario: str, seeds: list[int], work: Path,
                 real_time_factor: float, device: str = "cpu", startup_timeout_s: float = 300.0) -> list[dict]:
    """Drive layouts `seeds` (consecutive episode seeds) of one scenario through a fresh graph; their results."""
    from sps_driving.ros.graph import Graph, default_params_file

    if not (real_time_factor > 0):
        raise ValueError(f"real_time_factor must be positive, got {real_time_factor}")
    work.mkdir(parents=True, exist_ok=True)
    sim_config = work / "sim_config.yaml"
    sim_config.write_text(yaml.safe_dump(config))
    results = work / f"{scenario}.jsonl"
    results.unlink(missing_ok=True)
    base = {node: section["ros__parameters"] for node, section in yaml.safe_load(default_params_file().read_text()).items()}
    params = graph_parameters(base, policy_dir, sim_config, scenario, seeds[0], len(seeds), results, real_time_factor, device,
                              float(config["vehicle"]["max_speed_mps"]))
    # Generous: start-up, then every episode at the chosen speed, twice over.
    budget_s = startup_timeout_s + 2.0 * len(seeds) * float(config["episode_s"]) / real_time_factor
    deadline = time.monotonic() + budget_s
    with Graph(GRAPH_NODES, parameters=params, log_dir=work / f"logs_{scenario}") as graph:
        while len(_read_jsonl(results)) < len(seeds):
            dead = [name for name in GRAPH_NODES if not graph.alive(name)]
            if dead:
                raise RuntimeError(f"node {dead[0]} exited ({graph.returncode(dead[0])}) during {scenario}:\n"
                                   f"{graph.log(dead[0])[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scenario}: {len(_read_jsonl(results))} of {len(seeds)} episode(s) finished "
                                   f"in {budget_s:.0f} s; logs in {graph.log_dir}")
            time.sleep(0.5)
    return _read_jsonl(results)
