"""The in-process simulator drives a policy that reads state inputs with the world's speed and the
episode's cruise target speed, the values the car's speed report and its safety driver give."""

import numpy as np
from samples import tiny_dinov2_policy

from sps_driving.core.state import STATE_NAMES
from sps_driving.sim.config import load_sim_config
from sps_driving.sim.episodes import PolicyDriver, driving_state, run_episode
from sps_driving.sim.scenarios import SCENARIO_NAMES, get_scenario
from sps_driving.sim.world import World, make_episode


class RecordingDriver(PolicyDriver):
    def __init__(self, *args):
        super().__init__(*args)
        self.states = []

    def __call__(self, image, stamp_ns, state=None):
        self.states.append(state)
        return super().__call__(image, stamp_ns, state)


def test_episodes_pass_the_worlds_speed_and_cruise_target_to_the_policy(tmp_path):
    from sps_driving.sim.render import get_renderer

    config = load_sim_config()
    config["episode_s"] = 0.5
    world = World(config, make_episode(config, get_scenario(SCENARIO_NAMES[0]), 0))
    assert set(driving_state(world)) == set(STATE_NAMES)

    tiny_dinov2_policy(tmp_path / "policy", state_inputs=STATE_NAMES)
    driver = RecordingDriver(str(tmp_path / "policy"))
    result = run_episode(config, SCENARIO_NAMES[0], 2, driver, get_renderer(config))
    assert result["dropped_frames"] == 0 and len(driver.states) == 5
    cruise = make_episode(config, get_scenario(SCENARIO_NAMES[0]), 2).cruise_speed
    assert all(s["target_speed_mps"] == cruise for s in driver.states)
    speeds = [s["speed_mps"] for s in driver.states]
    assert speeds[0] == cruise and len(set(speeds)) > 1  # it starts at cruise speed, then the commands move it
    # Without its state the policy cannot drive: the frame is dropped, the last command held.
    frame = np.zeros((140, 224, 3), np.uint8)
    held = driver.last
    assert PolicyDriver.__call__(driver, frame, 10**9) == held and driver.drops == 1
