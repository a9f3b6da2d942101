"""Episodes driven from outside, one control step at a time: the logic of the sim_world node,
which puts the live ROS 2 graph (the exact on-car stack) in the driver's seat.

Each tick: `observe()` gives the camera frame and the safety-monitor inputs of the current state
(and the expert's command for it, as a reference), then `advance(steering, throttle)` applies the
stack's command for one step. An episode that reaches its length returns its result and the next
one starts; after the last, `done` is true.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sps_driving.sim.expert import Expert
from sps_driving.sim.scenarios import get_scenario
from sps_driving.sim.world import World, make_episode


@dataclass(frozen=True)
class Observation:
    image: np.ndarray | None  # uint8 [H, W, 3] RGB, None when rendering is off
    lateral_offset_m: float
    heading_error_rad: float
    obstacle_gap_m: float
    speed_mps: float
    target_speed_mps: float  # the episode's cruise target speed
    expert_steering: float
    expert_throttle: float
    episode: int
    step: int


class LiveSim:
    def __init__(self, config: dict, scenario_name: str, first_episode: int = 0, episodes: int = 1, render: bool = True):
        if episodes < 1:
            raise ValueError(f"episodes must be at least 1, got {episodes}")
        self.config = config
        self.scenario = get_scenario(scenario_name)
        self.episodes = range(first_episode, first_episode + episodes)
        self.steps_per_episode = int(round(float(config["episode_s"]) * float(config["control_rate_hz"])))
        self.renderer = None
        if render:
            from sps_driving.sim.render import get_renderer

            self.renderer = get_renderer(config)
        self.results: list[dict] = []
        self._start(first_episode)

    def _start(self, episode: int) -> None:
        self.episode = episode
        self.world = World(self.config, make_episode(self.config, self.scenario, episode))
        self.expert = Expert(self.config)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.episodes)

    def observe(self) -> Observation:
        world = self.world
        reference = self.expert.command(world)
        return Observation(
            image=self.renderer.render(world) if self.renderer is not None else None,
            lateral_offset_m=world.lane.lateral,
            heading_error_rad=world.lane.heading_error,
            obstacle_gap_m=world.nearest_gap(),
            speed_mps=world.state.speed,
            target_speed_mps=world.episode.cruise_speed,
            expert_steering=reference.steering,
            expert_throttle=reference.throttle,
            episode=self.episode,
            step=world.steps,
        )

    def advance(self, steering: float, throttle: float) -> dict | None:
        """Apply one command (the vehicle model clamps it; non-finite means full brake)."""
        if self.done:
            raise RuntimeError("all episodes are finished")
        self.world.step(steering, throttle)
        if self.world.steps < self.steps_per_episode:
            return None
        result = self.world.result(self.steps_per_episode * self.world.dt).as_dict()
        result["episode"] = self.episode
        self.results.append(result)
        if not self.done:
            self._start(self.episode + 1)
        return result
