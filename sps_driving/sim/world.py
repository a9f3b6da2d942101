"""The closed-loop world: a road, road actors, the ego vehicle, the failure rules of SPS
section 4.2 and a safety-driver model.

Determinism: an episode is a pure function of (config, scenario, seed). The road, the actors'
placement and motion come from the seed alone, so every scenario drives the same layouts and
scenarios differ only in appearance and actor types; appearance draws use (seed, scenario).

Score (normalized success duration): the time driven from the episode start until the first
failure, divided by the episode length. Safety-driver model: every failure is one intervention;
the car is put back on the lane centre (past any obstacle it is too close to), aligned with the
lane, and the episode continues, so interventions are counted over the whole episode.

Per road-side obstacle (ObstaclePass): whether the ego got past it without a collision failure
with it, and the smallest free gap to it; the margin is that gap minus the collision line
(failures.min_obstacle_gap_m), negative or zero for a hit. An obstacle counts once its pass is
over: hit, or reached (the ego's front level with its rear) and then left fully behind. One the
safety driver's reset carried the ego past unreached, or that is still alongside when the episode
ends, is left out.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from sps_driving.core.failures import Failure, FailureThresholds, check_failures
from sps_driving.sim.geometry import polygon_gap, rectangle
from sps_driving.sim.road import LanePose, Road, generate_road
from sps_driving.sim.scenarios import ActorModel, Scenario, road_actor_models, traffic_models
from sps_driving.sim.vehicle import VehicleParams, VehicleState, state_at_center
from sps_driving.sim.vehicle import step as vehicle_step

# Actors farther than this (m, centre to centre) cannot be within the failure gap of the ego.
_GAP_SEARCH_M = 60.0
# Layout (episode) seeds: evaluation layouts lie below, training collections' from here up
# (sps_driving.sim.collect.episode_seed), so no policy is evaluated on a layout it was trained on.
COLLECTION_SEED_BASE = 1_000_000


def rng_for(*keys: int | str) -> np.random.Generator:
    """An independent random stream per purpose, stable across Python runs (no hash())."""
    words = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng(np.random.SeedSequence(words))


@dataclass(frozen=True)
class ActorSpec:
    """A road actor moving in the lane frame: s(t) = s0 + speed t, lateral(t) = lateral0 + sway."""

    model: ActorModel
    color: tuple[float, float, float]
    s0: float
    lateral0: float
    speed_along: float  # m/s along +s; negative for oncoming traffic
    sway_amplitude: float = 0.0
    sway_period: float = 1.0
    sway_phase: float = 0.0
    oncoming: bool = False

    def lane_state(self, t: float) -> tuple[float, float, float, float]:
        """(s, lateral, ds/dt, dlateral/dt) at time t."""
        w = 2.0 * math.pi / self.sway_period
        phase = w * t + self.sway_phase
        return (
            self.s0 + self.speed_along * t,
            self.lateral0 + self.sway_amplitude * math.sin(phase),
            self.speed_along,
            self.sway_amplitude * w * math.cos(phase),
        )


@dataclass(frozen=True)
class Episode:
    scenario: Scenario
    seed: int
    road: Road
    cruise_speed: float  # m/s
    actors: tuple[ActorSpec, ...]
    # The scenario name whose appearance draws (scenery placement, sun) the renderer uses; None:
    # this episode's own. Another scenario's draws render the same scenery in this one's looks.
    scenery: str | None = None


def make_episode(config: dict, scenario: Scenario, seed: int) -> Episode:
    layout = rng_for(seed, "layout")
    looks = rng_for(seed, "looks", scenario.name)
    traffic = config["traffic"]
    if max(traffic["creep_speed_mps"]) >= min(traffic["cruise_speed_mps"]):
        raise ValueError("traffic: creeping obstacles must be slower than the slowest cruise speed")
    road = generate_road(layout, config)
    cruise = float(layout.uniform(*traffic["cruise_speed_mps"]))
    start = config["road"]["start_s_m"]
    half_lane = road.lane_width / 2.0
    obstacle_models, car_models = road_actor_models(scenario), traffic_models(scenario)
    actors, obstacle_s = [], []

    s = start + layout.uniform(*traffic["first_obstacle_s_m"])
    while s < road.length - 20.0:
        index, paint = layout.integers(1 << 30), layout.random()
        model = obstacle_models[index % len(obstacle_models)]
        color = model.colors[int(paint * len(model.colors))]
        moving = layout.random() < traffic["moving_fraction"]
        lo, hi = traffic["intrusion_m"]
        # The sway never takes the intrusion outside [lo, hi].
        amp = min(traffic["sway_amplitude_m"], (hi - lo) / 2.0) if moving else 0.0
        intrusion = layout.uniform(lo + amp, hi - amp)
        # The inner edge reaches `intrusion` into the ego lane from its right boundary.
        lateral = -half_lane + intrusion - model.width_m / 2.0
        creep = float(layout.uniform(*traffic["creep_speed_mps"])) if moving else 0.0
        actors.append(
            ActorSpec(
                model,
                tuple(float(c) * float(looks.uniform(0.85, 1.1)) for c in color),
                s,
                lateral,
                creep,
                amp,
                float(layout.uniform(*traffic["sway_period_s"])),
                float(layout.uniform(0, 2 * math.pi)),
            )
        )
        # Where the ego, at cruise speed, passes it (a creeping obstacle is met further on).
        obstacle_s.append(s + creep * (s - start) / (cruise - creep))
        s += layout.uniform(*traffic["obstacle_spacing_m"])

    # Oncoming cars are timed to meet the ego (driving at cruise speed) away from the obstacles,
    # where the ego may be swerving toward the centre line.
    meet = start + layout.uniform(*traffic["oncoming_spacing_m"]) / 2.0
    while meet < road.length:
        if all(abs(meet - so) >= traffic["oncoming_clear_m"] for so in obstacle_s):
            speed = float(layout.uniform(*traffic["oncoming_speed_mps"]))
            t_meet = (meet - start) / cruise
            model = car_models[int(layout.integers(1 << 30)) % len(car_models)]
            color = model.colors[int(layout.integers(1 << 30)) % len(model.colors)]
            actors.append(ActorSpec(model, color, meet + speed * t_meet, road.lane_width, -speed, oncoming=True))
            meet += layout.uniform(*traffic["oncoming_spacing_m"])
        else:
            meet += 5.0
    return Episode(scenario, seed, road, cruise, tuple(actors))


@dataclass(frozen=True)
class ActorPose:
    spec: ActorSpec
    s: float
    lateral: float
    ds_dt: float
    dlat_dt: float
    x: float
    y: float
    yaw: float
    index: int  # position in Episode.actors

    def footprint(self) -> np.ndarray:
        return rectangle(self.x, self.y, self.yaw, self.spec.model.length_m, self.spec.model.width_m)


@dataclass
class ObstaclePass:
    """The ego's pass of one road-side obstacle (Episode.actors[actor])."""

    actor: int
    model: str
    reached: bool = False  # the ego's front came level with the obstacle's rear, or it hit it
    hit: bool = False  # a collision failure with this obstacle
    over: bool = False  # hit, or left fully behind: nothing more can happen at this obstacle
    min_gap_m: float = math.inf  # smallest free gap between the footprints while the pass lasted

    def as_dict(self, collision_line_m: float) -> dict:
        return {"actor": self.actor, "model": self.model, "passed": not self.hit, "min_gap_m": self.min_gap_m,
                "margin_m": self.min_gap_m - collision_line_m}


@dataclass
class EpisodeResult:
    scenario: str
    seed: int
    duration_s: float
    success_s: float  # time from the start until the first failure
    interventions: int = 0
    failures: dict = field(default_factory=dict)  # failure type value -> count
    distance_m: float = 0.0
    mean_speed_mps: float = 0.0
    obstacles: list = field(default_factory=list)  # ObstaclePass.as_dict of the obstacles whose pass is over

    @property
    def score(self) -> float:
        return self.success_s / self.duration_s

    def as_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "duration_s": self.duration_s,
            "success_s": self.success_s,
            "score": self.score,
            "interventions": self.interventions,
            "failures": dict(self.failures),
            "distance_m": self.distance_m,
            "mean_speed_mps": self.mean_speed_mps,
            "obstacles": list(self.obstacles),
        }


@dataclass(frozen=True)
class StepResult:
    lane: LanePose  # after the step, before any reset
    gap_m: float
    failures: tuple[Failure, ...]
    intervened: bool


class World:
    """One episode being driven: `step(steering, throttle)` advances 1 / control_rate_hz."""

    def __init__(self, config: dict, episode: Episode, start_lateral: float = 0.0, start_heading: float = 0.0,
                 start_speed: float | None = None):
        self.config = config
        self.episode = episode
        self.road = episode.road
        self.params = VehicleParams.from_config(config)
        self.dt = 1.0 / float(config["control_rate_hz"])
        fail = config["failures"]
        self.thresholds = FailureThresholds(
            lane_boundary_offset_m=float(fail["lane_boundary_offset_m"]),
            min_obstacle_gap_m=float(fail["min_obstacle_gap_m"]),
            max_heading_error_rad=math.radians(float(fail["max_heading_error_deg"])),
        )
        self.time = 0.0
        self.steps = 0
        self.interventions = 0
        self.failure_counts: Counter = Counter()
        self.first_failure_time: float | None = None
        self.distance = 0.0
        self.passes = {i: ObstaclePass(i, spec.model.name) for i, spec in enumerate(episode.actors) if not spec.oncoming}
        speed = episode.cruise_speed if start_speed is None else start_speed
        self._place(config["road"]["start_s_m"], start_lateral, start_heading, speed)

    def _place(self, s: float, lateral: float, heading_error: float, speed: float) -> None:
        cx, cy = self.road.point(s, lateral)
        yaw = float(self.road.heading_at(s)) + heading_error
        self.state = state_at_center(self.params, cx, cy, yaw, speed)
        self.lane = LanePose(s, lateral, heading_error)

    def actor_poses(self, t: float | None = None) -> list[ActorPose]:
        """Actors on the road at time t (default now), placed in the world in one vectorized pass."""
        t = self.time if t is None else t
        states = [(i, spec, spec.lane_state(t)) for i, spec in enumerate(self.episode.actors)]
        states = [(i, spec, st) for i, spec, st in states if 0.0 <= st[0] <= self.road.length]
        if not states:
            return []
        s = np.array([st[0] for _, _, st in states])
        xy = self.road.points(s, np.array([st[1] for _, _, st in states]))
        yaw = self.road.heading_at(s)
        return [
            ActorPose(spec, st[0], st[1], st[2], st[3], float(p[0]), float(p[1]), float(h) + (math.pi if spec.oncoming else 0.0), i)
            for (i, spec, st), p, h in zip(states, xy, yaw)
        ]

    def actor_gaps(self, state: VehicleState | None = None, poses: list[ActorPose] | None = None) -> list[tuple[ActorPose, float]]:
        """(pose, free gap in m between the ego footprint and the actor's) of the actors near enough to matter."""
        state = self.state if state is None else state
        poses = self.actor_poses() if poses is None else poses
        cx, cy = state.center(self.params)
        ego = state.footprint(self.params)
        return [(p, polygon_gap(ego, p.footprint())) for p in poses if math.hypot(p.x - cx, p.y - cy) < _GAP_SEARCH_M]

    def nearest_gap(self, state: VehicleState | None = None, poses: list[ActorPose] | None = None) -> float:
        """Free gap (m) between the ego footprint and the nearest actor footprint; inf if none near."""
        return min((gap for _, gap in self.actor_gaps(state, poses)), default=math.inf)

    def step(self, steering: float, throttle: float) -> StepResult:
        self.state = vehicle_step(self.params, self.state, steering, throttle, self.dt)
        self.time += self.dt
        self.steps += 1
        self.distance += self.state.speed * self.dt
        cx, cy = self.state.center(self.params)
        self.lane = self.road.to_lane(cx, cy, self.state.yaw, self.lane.s)
        poses = self.actor_poses()
        gaps = self.actor_gaps(poses=poses)
        gap = min((g for _, g in gaps), default=math.inf)
        failures = tuple(check_failures(self.thresholds, self.lane.lateral, self.lane.heading_error, gap))
        result = StepResult(self.lane, gap, failures, bool(failures))
        self._follow_passes(poses, gaps, Failure.COLLISION in failures)
        if failures:
            self._intervene(failures, poses)
        self._end_passes(poses)
        return result

    def _follow_passes(self, poses: list[ActorPose], gaps: list[tuple[ActorPose, float]], collision: bool) -> None:
        """Before any reset: the gaps to the road-side obstacles, which ones the ego has reached, which it hit."""
        for pose, gap in gaps:
            obstacle = self.passes.get(pose.index)
            if obstacle is None or obstacle.over:
                continue
            obstacle.min_gap_m = min(obstacle.min_gap_m, gap)
            if collision and gap <= self.thresholds.min_obstacle_gap_m:
                obstacle.reached = obstacle.hit = obstacle.over = True
        front = self.lane.s + self.params.length_m / 2.0
        for pose in poses:
            obstacle = self.passes.get(pose.index)
            if obstacle is not None and not obstacle.over and front >= pose.s - pose.spec.model.length_m / 2.0:
                obstacle.reached = True

    def _end_passes(self, poses: list[ActorPose]) -> None:
        """After any reset: obstacles the ego is now fully past are over (left out if it never reached them)."""
        rear = self.lane.s - self.params.length_m / 2.0
        for pose in poses:
            obstacle = self.passes.get(pose.index)
            if obstacle is not None and not obstacle.over and rear >= pose.s + pose.spec.model.length_m / 2.0:
                obstacle.over = True

    def _intervene(self, failures: tuple[Failure, ...], poses: list[ActorPose]) -> None:
        self.interventions += 1
        self.failure_counts.update(f.value for f in failures)
        if self.first_failure_time is None:
            self.first_failure_time = self.time
        clearance = self.thresholds.min_obstacle_gap_m + float(self.config["failures"]["reset_clearance_m"])
        speed = min(self.state.speed, self.episode.cruise_speed)
        s = self.lane.s
        for _ in range(200):
            self._place(s, 0.0, 0.0, speed)
            if self.nearest_gap(poses=poses) > clearance:
                break
            s += 1.0

    def result(self, duration_s: float) -> EpisodeResult:
        success = duration_s if self.first_failure_time is None else min(self.first_failure_time, duration_s)
        return EpisodeResult(
            scenario=self.episode.scenario.name,
            seed=self.episode.seed,
            duration_s=duration_s,
            success_s=success,
            interventions=self.interventions,
            failures=dict(self.failure_counts),
            distance_m=self.distance,
            mean_speed_mps=self.distance / max(self.time, 1e-9),
            obstacles=[o.as_dict(self.thresholds.min_obstacle_gap_m) for o in self.passes.values() if o.over and o.reached],
        )
