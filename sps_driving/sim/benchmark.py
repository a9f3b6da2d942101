"""Simulator speed: rendering frames/s per scenario, and the full in-process closed-loop step
(render -> selection -> DINOv2 descriptors -> policy -> vehicle) with a given policy or the shipped one.

    python -m sps_driving.sim.benchmark [--policy DIR] [--device cpu] [--steps 30]

Prints numbers; timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from sps_driving.core.resources import SHIPPED_POLICY, shipped_policy
from sps_driving.sim.config import frame_stamp_ns, load_sim_config, set_render_width
from sps_driving.sim.expert import Expert
from sps_driving.sim.scenarios import SCENARIOS, get_scenario
from sps_driving.sim.world import World, make_episode


def render_rate(config: dict, scenario, frames: int) -> tuple[float, float]:
    """(scene build s, frames/s) for one episode of `scenario`, driven by the expert."""
    from sps_driving.sim.render import get_renderer

    renderer = get_renderer(config)
    world, expert = World(config, make_episode(config, scenario, 0)), Expert(config)
    start = time.perf_counter()
    renderer.load(world.episode)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(frames):
        renderer.render(world)
        c = expert.command(world)
        world.step(c.steering, c.throttle)
    return build_s, frames / (time.perf_counter() - start)


def step_rate(config: dict, policy_dir: str, device: str, steps: int) -> dict:
    from sps_driving.core.policies.registry import architecture_of
    from sps_driving.sim.episodes import PolicyDriver, driving_state
    from sps_driving.sim.render import get_renderer

    renderer = get_renderer(config)
    driver = PolicyDriver(policy_dir, device)
    world = World(config, make_episode(config, get_scenario(SCENARIOS[0].name), 0))
    times = {"render": [], "drive": [], "world": []}
    for k in range(steps + 2):
        t0 = time.perf_counter()
        image = renderer.render(world)
        t1 = time.perf_counter()
        steering, throttle = driver(image, frame_stamp_ns(config, 0, k), driving_state(world))
        t2 = time.perf_counter()
        world.step(steering, throttle)
        t3 = time.perf_counter()
        if k >= 2:  # the first steps warm up
            for name, value in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(value)
    total = np.sum([times[n] for n in times], axis=0)
    return {"steps_per_s": 1.0 / float(np.median(total)), **{f"{n}_ms": 1e3 * float(np.median(v)) for n, v in times.items()},
            "method": driver.policy.config["selection"], "architecture": architecture_of(driver.policy.config)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", help=f"policy folder (default: the shipped one, {SHIPPED_POLICY})")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=60, help="rendered frames per scenario")
    parser.add_argument("--steps", type=int, default=20, help="closed-loop steps timed")
    parser.add_argument("--width", type=int, help="rendered width in px (height follows the camera aspect)")
    parser.add_argument("--threads", type=int, help="torch threads")
    args = parser.parse_args(argv)
    config = load_sim_config()
    cam = config["camera"]
    if args.width:
        set_render_width(config, args.width)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(f"rendering at {cam['render_width']}x{cam['render_height']} px (expert driving, weather overlay included)")
    for scenario in SCENARIOS:
        build_s, fps = render_rate(config, scenario, args.frames)
        print(f"  {scenario.name:34s} scene build {build_s:5.2f} s   {fps:6.0f} frames/s")
    r = step_rate(config, args.policy or str(shipped_policy()), args.device, args.steps)
    print(f"closed-loop step on {args.device} ({r['architecture']}, {r['method']}): {r['steps_per_s']:.2f} steps/s "
          f"(render {r['render_ms']:.1f} ms, select+extract+policy {r['drive_ms']:.1f} ms, "
          f"vehicle+failures {r['world_ms']:.1f} ms; medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
