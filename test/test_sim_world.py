"""The driving world: failure rules on hand-built drives, footprint gaps, determinism."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sps_driving.core.failures import Failure
from sps_driving.sim.config import load_sim_config
from sps_driving.sim.expert import Expert
from sps_driving.sim.geometry import polygon_gap, rectangle
from sps_driving.sim.road import Road
from sps_driving.sim.scenarios import ID_SCENARIO, SCENARIO_NAMES, SCENARIOS, TRAINING_CARS, get_scenario
from sps_driving.sim.vehicle import VehicleParams, clamp_command
from sps_driving.sim.world import ActorSpec, Episode, World, make_episode


@pytest.fixture(scope="module")
def config():
    return load_sim_config()


def straight_episode(config, actors=(), speed=10.0):
    road = Road(np.array([0.0, 400.0]), np.array([0.0, 0.0]), 0.5, config["road"]["lane_width_m"], config["road"]["shoulder_m"])
    return Episode(ID_SCENARIO, 0, road, speed, tuple(actors))


def drive(world, steering, throttle, seconds):
    """Hold one command; returns the step results."""
    return [world.step(steering, throttle) for _ in range(int(round(seconds / world.dt)))]


def drive_until_failure(world, steering, throttle, seconds):
    """Hold one command until the first failure; returns all step results up to it."""
    results = []
    for _ in range(int(round(seconds / world.dt))):
        results.append(world.step(steering, throttle))
        if results[-1].failures:
            break
    return results


def first_failure(results):
    return next((i, r) for i, r in enumerate(results) if r.failures)


def test_table1_scenarios_in_paper_order():
    assert len(SCENARIOS) == 15 and len(set(SCENARIO_NAMES)) == 15
    assert SCENARIO_NAMES[0] == "rural-summer-dry-day-car" and SCENARIOS[0].in_distribution
    assert not any(s.in_distribution for s in SCENARIOS[1:])
    assert SCENARIO_NAMES[4] == "rural-winter-snow-day-unseencar"
    assert SCENARIO_NAMES[-1] == "urban-summer-dry-night-animal"
    assert SCENARIOS[1].label == "Rural Spring Dry Day Car†"
    assert get_scenario("urban-summer-rain-day-animal").weather == "rain"
    with pytest.raises(ValueError, match="scene-season"):
        get_scenario("rural-summer")
    with pytest.raises(ValueError, match="unknown weather"):
        get_scenario("rural-summer-fog-day-car")


def test_polygon_gap():
    a = rectangle(0, 0, 0, 4, 2)
    assert polygon_gap(a, rectangle(7, 0, 0, 4, 2)) == pytest.approx(3.0)
    assert polygon_gap(a, rectangle(0, 3.5, 0, 4, 2)) == pytest.approx(1.5)
    assert polygon_gap(a, rectangle(1, 1, 0.3, 4, 2)) == 0.0  # overlapping
    # A diamond whose tip points at the rectangle's side: gap is tip to side.
    assert polygon_gap(a, rectangle(2 + 2 + math.sqrt(2), 0, math.pi / 4, 2, 2)) == pytest.approx(2.0)


def test_no_failure_on_a_clean_straight_drive_past_an_oncoming_car(config):
    car = TRAINING_CARS[0]
    oncoming = ActorSpec(car, (1, 1, 1), 200.0, 3.6, -10.0, oncoming=True)
    world = World(config, straight_episode(config, [oncoming]))
    results = drive(world, 0.0, 0.02, 20.0)
    assert not any(r.failures for r in results)
    assert min(r.gap_m for r in results) < 3.0  # it really passed close by
    result = world.result(20.0)
    assert result.score == 1.0 and result.interventions == 0 and result.failures == {}


def test_crossing_the_lane_boundary(config):
    world = World(config, straight_episode(config))
    results = drive_until_failure(world, 0.05, 0.0, 5.0)
    i, hit = first_failure(results)
    assert hit.failures == (Failure.LANE,)
    assert hit.lane.lateral > 1.8 and abs(results[i - 1].lane.lateral) <= 1.8
    assert abs(hit.lane.heading_error) < math.radians(30)
    # The safety driver put the car back on the lane centre, aligned.
    assert world.lane.lateral == 0.0 and world.lane.heading_error == 0.0
    results += drive(world, 0.05, 0.0, 5.0)
    result = world.result(world.time)
    assert result.success_s == pytest.approx((i + 1) * world.dt)
    assert result.score == pytest.approx(result.success_s / world.time)
    assert result.interventions >= 2 and result.failures == {"lane_boundary": result.interventions}


def test_hitting_an_actor(config):
    parked = ActorSpec(TRAINING_CARS[1], (1, 0, 0), 60.0, 0.0, 0.0)
    world = World(config, straight_episode(config, [parked]))
    results = drive(world, 0.0, 0.0, 6.0)
    i, hit = first_failure(results)
    assert hit.failures == (Failure.COLLISION,)
    assert hit.gap_m <= 1.0 < results[i - 1].gap_m
    # Put back past the actor with room to spare, then no further failure.
    assert world.nearest_gap() > 1.0 + config["failures"]["reset_clearance_m"]
    assert world.lane.s > 60.0
    assert world.result(6.0).interventions == 1


def test_obstacle_passes_count_a_pass_a_hit_and_leave_out_unfinished_ones(config):
    """Straight at the lane centre: an obstacle off the lane's edge is passed 0.25 m outside the
    collision line, one in the lane is hit; the safety driver's reset carries the car past a third
    one it never reached, and a fourth is still alongside when the episode ends."""
    half_lane, ego_half_width = config["road"]["lane_width_m"] / 2, config["vehicle"]["width_m"] / 2
    line = config["failures"]["min_obstacle_gap_m"]
    car = TRAINING_CARS[0]
    clear_lateral = -(ego_half_width + line + 0.25) - car.width_m / 2  # its inner edge 1.25 m from the ego's side
    passed = ActorSpec(car, (1, 1, 1), 50.0, clear_lateral, 0.0)
    hit = ActorSpec(car, (1, 1, 1), 110.0, -half_lane + 0.6, 0.0)  # reaches 1.5 m into the lane
    behind_the_hit = ActorSpec(car, (1, 1, 1), 117.0, clear_lateral, 0.0)  # within the reset's clearance
    oncoming = ActorSpec(car, (1, 1, 1), 300.0, half_lane * 2, -10.0, oncoming=True)
    probe = World(config, straight_episode(config, [passed, hit, behind_the_hit, oncoming]))
    drive(probe, 0.0, 0.0, 15.0)
    alongside_at_the_end = ActorSpec(car, (1, 1, 1), probe.lane.s, clear_lateral, 0.0)
    world = World(config, straight_episode(config, [passed, hit, behind_the_hit, alongside_at_the_end, oncoming]))
    drive(world, 0.0, 0.0, 15.0)
    assert world.lane.s == probe.lane.s and world.passes[3].reached and not world.passes[3].over
    assert world.passes[2].over and not world.passes[2].reached
    result = world.result(15.0)
    assert result.failures == {"collision": 1}
    first, second = result.obstacles
    assert (first["actor"], first["passed"]) == (0, True)
    assert first["min_gap_m"] == pytest.approx(line + 0.25, abs=1e-6) and first["margin_m"] == pytest.approx(0.25, abs=1e-6)
    assert (second["actor"], second["passed"], second["model"]) == (1, False, car.name)
    assert second["min_gap_m"] <= line and second["margin_m"] == pytest.approx(second["min_gap_m"] - line)
    assert world.result(15.0).as_dict()["obstacles"] == result.obstacles


def test_turning_past_30_degrees(config):
    world = World(config, straight_episode(config, speed=2.0), start_lateral=-0.5)
    results = drive(world, 0.55, 0.0, 3.0)
    i, hit = first_failure(results)
    assert hit.failures == (Failure.HEADING,)
    assert abs(hit.lane.heading_error) > math.radians(30) >= abs(results[i - 1].lane.heading_error)
    assert abs(hit.lane.lateral) < 1.8


def test_non_finite_commands_never_move_the_car_unsafely(config):
    params = VehicleParams.from_config(config)
    assert clamp_command(params, float("nan"), 0.5) == (0.0, -1.0)
    assert clamp_command(params, 3.0, 7.0) == (params.max_steer_rad, 1.0)
    world = World(config, straight_episode(config))
    drive(world, float("inf"), float("nan"), 3.0)
    assert world.state.speed == 0.0 and all(math.isfinite(v) for v in (world.state.x, world.state.y, world.state.yaw))


def test_episodes_are_deterministic_and_share_layouts_across_scenarios(config):
    a, b = make_episode(config, ID_SCENARIO, 7), make_episode(config, ID_SCENARIO, 7)
    assert np.array_equal(a.road.x, b.road.x) and a.actors == b.actors and a.cruise_speed == b.cruise_speed
    other = make_episode(config, ID_SCENARIO, 8)
    assert not np.array_equal(a.road.x, other.road.x)
    animal = make_episode(config, get_scenario("rural-spring-dry-day-animal"), 7)
    assert np.array_equal(a.road.x, animal.road.x)
    assert [x.s0 for x in a.actors if not x.oncoming] == [x.s0 for x in animal.actors if not x.oncoming]
    assert {x.model.shape for x in animal.actors if not x.oncoming} <= {"deer", "cow", "moose", "dog"}


def test_actors_reach_into_the_ego_lane_within_the_configured_range(config):
    lo, hi = config["traffic"]["intrusion_m"]
    half = config["road"]["lane_width_m"] / 2
    for seed in range(5):
        for actor in make_episode(config, ID_SCENARIO, seed).actors:
            if actor.oncoming:
                continue
            for t in np.linspace(0, 20, 41):
                _, lateral, _, _ = actor.lane_state(t)
                intrusion = lateral + actor.model.width_m / 2 + half
                assert lo - 1e-9 <= intrusion <= hi + 1e-9


def check_determinism() -> None:
    from sps_driving.sim.render import get_renderer

    config = load_sim_config()
    renderer = get_renderer(config)

    def frames_and_states(scenario, seed, steps=12):
        world, expert = World(config, make_episode(config, scenario, seed)), Expert(config)
        frames, states = [], []
        for _ in range(steps):
            frames.append(renderer.render(world))
            c = expert.command(world)
            world.step(c.steering, c.throttle)
            states.append(world.state)
        return frames, states

    # Snow checks the seeded snowflakes too; in this scene, drawing opaque geometry sorted by render
    # state (memory addresses) changed up to 163 pixels of a frame from one build to the next.
    snow = get_scenario("rural-winter-snow-day-animal")
    first_frames, first_states = frames_and_states(snow, 3)
    frames_and_states(ID_SCENARIO, 4)  # the renderer switches scene in between
    again_frames, again_states = frames_and_states(snow, 3)
    assert first_states == again_states
    for f, g in zip(first_frames, again_frames):
        assert f.shape == (config["camera"]["render_height"], config["camera"]["render_width"], 3) and f.dtype == np.uint8
        assert np.array_equal(f, g)
    assert not np.array_equal(first_frames[0], first_frames[-1])  # the camera moves


def test_world_and_frames_are_deterministic():
    """Same seed, same states and frames, also after the renderer drew another scene in between.
    Checked in a fresh process, as an evaluation worker runs."""
    here = Path(__file__).parent
    # The package of this checkout, not whichever one the interpreter has installed.
    path = os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", "import test_sim_world; test_sim_world.check_determinism()"],
        cwd=here, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_scenario_axes_change_the_picture(config):
    """Season, time and weather each shift the image statistics in the expected direction."""
    from sps_driving.sim.render import get_renderer

    renderer = get_renderer(config)

    def mean_frame(name):
        world = World(config, make_episode(config, get_scenario(name), 2))
        return renderer.render(world).astype(np.float64)

    day = mean_frame("rural-summer-dry-day-car")
    night = mean_frame("rural-summer-dry-night-car")
    winter = mean_frame("rural-winter-dry-day-car")
    urban = mean_frame("urban-summer-dry-day-car")
    assert night.mean() < 0.5 * day.mean()
    lower = slice(day.shape[0] * 2 // 3, None)
    assert winter[lower].mean() > day[lower].mean() + 20  # snow cover beside the road
    summer_green = day[..., 1] - day[..., [0, 2]].mean(-1)
    urban_green = urban[..., 1] - urban[..., [0, 2]].mean(-1)
    assert summer_green.mean() > urban_green.mean() + 5  # fields versus concrete


def test_lane_frame_on_a_circular_road(config):
    radius = 100.0
    road = Road(np.array([0.0, 300.0]), np.array([1 / radius, 1 / radius]), 0.5, 3.6, 1.2)
    # The centerline is a circle of radius 100 m centred at (0, 100) (left turns, start heading +x).
    angle = 1.2
    assert road.pose_at(radius * angle)[:2] == pytest.approx((radius * math.sin(angle), radius - radius * math.cos(angle)), abs=1e-3)
    for lateral in (-1.5, 0.0, 2.0):
        x, y = road.point(radius * angle, lateral)
        assert math.hypot(x, y - radius) == pytest.approx(radius - lateral, abs=1e-3)
        pose = road.to_lane(x, y, angle + 0.1, s_hint=radius * angle - 10.0)
        assert pose.s == pytest.approx(radius * angle, abs=0.05)
        assert pose.lateral == pytest.approx(lateral, abs=1e-3)
        assert pose.heading_error == pytest.approx(0.1, abs=1e-3)


def test_bicycle_model_turning_radius_speed_and_steering_rate(config):
    from sps_driving.sim.vehicle import VehicleState, step

    params = VehicleParams.from_config(config)
    state = VehicleState(0.0, 0.0, 0.0, 5.0, 0.2)
    for _ in range(50):  # hold 0.2 rad for 5 s at about 5 m/s: a circle of radius L / tan(0.2)
        state = step(params, state, 0.2, params.drag_per_s * 5.0 / params.max_accel_mps2, 0.1)
    radius = params.wheelbase_m / math.tan(0.2)
    assert math.hypot(state.x, state.y - radius) == pytest.approx(radius, rel=1e-3)
    assert state.speed == pytest.approx(5.0, rel=1e-3)
    slewing = step(params, VehicleState(0, 0, 0, 5.0, 0.0), 0.5, 0.0, 0.1)
    assert slewing.steer == pytest.approx(params.max_steer_rate_rad_s * 0.1)
    braking = step(params, VehicleState(0, 0, 0, 1.0, 0.0), 0.0, -1.0, 0.5)
    assert braking.speed == 0.0  # stops, never reverses
