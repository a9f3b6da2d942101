"""Closed-loop episodes in process: the camera frame -> selection -> descriptors -> policy
driver, one episode in the driving world, and a pool of worker processes (spawn) that runs many.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable

import numpy as np

from sps_driving.sim.config import frame_stamp_ns
from sps_driving.sim.scenarios import get_scenario
from sps_driving.sim.world import World, make_episode

# Evaluation episodes use seeds EVAL_SEED_BASE + 0..N-1; collection seeds start at 1,000,000
# (sps_driving.sim.collect.episode_seed), so training never sees an evaluation layout.
EVAL_SEED_BASE = 0


def driving_state(world: World) -> dict:
    """The state inputs (sps_driving.core.state) of the world's current state: the car's speed and
    the episode's cruise target speed, as the car's speed report and its safety driver give them."""
    return {"speed_mps": world.state.speed, "target_speed_mps": world.episode.cruise_speed}


class PolicyDriver:
    """Camera frame (and the car's state) -> selected patches -> descriptors -> policy command."""

    def __init__(self, policy_dir: str, device: str = "cpu", threads: int | None = None, backbone_config: str | None = None):
        from sps_driving.core.policy import load_policy
        from sps_driving.extractors import extractor_for_policy

        self.policy = load_policy(policy_dir, device=device)
        self.extractor = extractor_for_policy(self.policy.config, {"device": device, "threads": threads}, backbone_config).extractor
        if self.extractor.grid != self.policy.grid or self.extractor.dim != self.policy.descriptor_dim:
            raise ValueError(
                f"policy {policy_dir} expects a {self.policy.grid.rows}x{self.policy.grid.cols}x{self.policy.descriptor_dim} "
                f"descriptor grid but the extractor gives {self.extractor.grid.rows}x{self.extractor.grid.cols}x{self.extractor.dim}"
            )
        self.selector = self.policy.selector
        self.last = (0.0, 0.0)
        self.drops = 0

    def reset(self) -> None:
        self.last = (0.0, 0.0)

    def __call__(self, image: np.ndarray, stamp_ns: int, state: dict | None = None) -> tuple[float, float]:
        """The command for one frame; `state` ({name: value}, `driving_state`) for a policy that reads one."""
        try:
            indices = self.selector.select(stamp_ns)
            encoded = self.extractor.encode(image)
            command = self.policy.predict(self.extractor.descriptors(encoded, indices), indices, state)
        except (ValueError, RuntimeError):
            # A frame the stack cannot use is dropped and counted; the car holds the last
            # command, as the vehicle interface does within its staleness timeout.
            self.drops += 1
            return self.last
        if not all(math.isfinite(c) for c in command):
            self.drops += 1
            return self.last
        self.last = command
        return command


def run_episode(config: dict, scenario_name: str, episode_index: int, driver=None, renderer=None) -> dict:
    """One closed-loop episode; `driver` None means the privileged expert (no camera needed)."""
    from sps_driving.sim.expert import Expert

    episode = make_episode(config, get_scenario(scenario_name), EVAL_SEED_BASE + episode_index)
    world = World(config, episode)
    steps = int(round(float(config["episode_s"]) * float(config["control_rate_hz"])))
    expert = Expert(config) if driver is None else None
    drops_before = getattr(driver, "drops", 0)
    if driver is not None:
        driver.reset()
    for step in range(steps):
        if expert is not None:
            command = expert.command(world)
            steering, throttle = command.steering, command.throttle
        else:
            image = renderer.render(world)
            steering, throttle = driver(image, frame_stamp_ns(config, episode_index, step), driving_state(world))
        world.step(steering, throttle)
    result = world.result(steps * world.dt).as_dict()
    result["episode"] = episode_index
    result["dropped_frames"] = getattr(driver, "drops", 0) - drops_before
    return result


# ------------------------------------------------------------------------------ workers
_WORKER: dict = {}


def _init_worker(config: dict, policy_dir: str | None, device: str, threads: int, backbone_config: str | None) -> None:
    _WORKER["config"] = config
    if policy_dir is not None:
        import torch

        from sps_driving.sim.render import get_renderer

        torch.set_num_threads(threads)
        _WORKER["renderer"] = get_renderer(config)
        _WORKER["driver"] = PolicyDriver(policy_dir, device, threads, backbone_config)


def _run_task(task: tuple[str, int]) -> dict:
    scenario_name, episode_index = task
    return run_episode(_WORKER["config"], scenario_name, episode_index, _WORKER.get("driver"), _WORKER.get("renderer"))


def run_episodes(config: dict, policy_dir: str | None, tasks: list[tuple[str, int]], workers: int, device: str,
                 record: Callable[[dict], None], backbone_config: str | None = None) -> None:
    """Run (scenario, episode index) `tasks` with the policy at `policy_dir` (None: the expert) in
    `workers` processes, handing each finished episode's result to `record` as it comes."""
    threads = int(config.get("eval", {}).get("torch_threads_per_worker", 1))
    init = (config, policy_dir, device, threads, backbone_config)
    if workers <= 1:
        _init_worker(*init)
        for task in tasks:
            record(_run_task(task))
        return
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
        for row in pool.imap_unordered(_run_task, tasks):
            record(row)
