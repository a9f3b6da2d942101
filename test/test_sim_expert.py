"""The privileged expert drives the world without failure, also when pushed around."""

import math

import pytest

from sps_driving.sim.config import load_sim_config
from sps_driving.sim.expert import Disturbance, Expert
from sps_driving.sim.scenarios import ID_SCENARIO, SCENARIOS
from sps_driving.sim.world import World, make_episode, rng_for


@pytest.fixture(scope="module")
def config():
    return load_sim_config()


def expert_drive(config, scenario, seed, disturbed):
    """One full-length episode; returns the result and the smallest gap to any actor."""
    episode = make_episode(config, scenario, seed)
    disturbance = Disturbance(config, rng_for(seed, "disturbance"))
    world = World(config, episode, **(disturbance.start_state(episode.cruise_speed) if disturbed else {}))
    expert = Expert(config)
    steps = int(config["episode_s"] * config["control_rate_hz"])
    smallest_gap = math.inf
    for _ in range(steps):
        command = expert.command(world)
        assert -config["vehicle"]["max_steer_rad"] <= command.steering <= config["vehicle"]["max_steer_rad"]
        assert -1.0 <= command.throttle <= 1.0
        if disturbed:
            command = disturbance.apply(command, world.dt)
        smallest_gap = min(smallest_gap, world.step(command.steering, command.throttle).gap_m)
    return world.result(steps * world.dt), smallest_gap


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("disturbed", [False, True])
def test_expert_drives_in_distribution_episodes_without_failure(config, seed, disturbed):
    result, smallest_gap = expert_drive(config, ID_SCENARIO, 1_000_000 + seed, disturbed)
    assert result.interventions == 0, result.failures
    assert result.score == 1.0
    assert smallest_gap < 3.0  # obstacles were met, not avoided by luck
    assert result.mean_speed_mps > 6.0  # it drove, it did not stop in front of them


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_expert_drives_every_scenario_without_failure(config, scenario):
    for seed in range(20):
        for disturbed in (False, True):
            result, _ = expert_drive(config, scenario, seed, disturbed)
            assert result.interventions == 0, (seed, disturbed, result.failures)
