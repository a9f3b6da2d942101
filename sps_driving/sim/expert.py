"""The privileged expert (guided policy learning): PID lane keeping with control-barrier-function
(CBF) obstacle terms, computed in the lane frame from the world's true state.

Lateral: a PI law on the lateral offset gives a desired lateral speed; lateral CBFs, one per
obstacle and two for the lane, bound it (a one-dimensional CBF quadratic program, solved in
closed form by clipping); a heading loop (the D term) turns it into a road-wheel angle on top of
the curvature feed-forward. Longitudinal: speed tracking toward the cruise speed (limited in
curves), bounded by a following-distance CBF for obstacles the lateral barriers cannot clear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sps_driving.sim.world import World


@dataclass(frozen=True)
class Command:
    steering: float  # rad, road-wheel angle, left positive
    throttle: float  # [-1, 1], negative brakes


class Expert:
    def __init__(self, config: dict):
        self.config = config
        self.e = config["expert"]
        self.integral = 0.0

    def reset(self) -> None:
        self.integral = 0.0

    def command(self, world: World) -> Command:
        params, lane = world.params, world.lane
        v = max(world.state.speed, 0.5)
        lower, upper, blocking = self._lateral_bounds(world, v)
        vy_max = self.e["max_lateral_speed_mps"]
        vy = float(np.clip(np.clip(self._desired_lateral_speed(world), lower, upper), -vy_max, vy_max))

        # Heading loop: desired heading error from the lateral speed; tan(delta) from yaw-rate demand.
        psi_des = math.asin(max(min(vy / v, 0.5), -0.5))
        kappa = world.road.curvature_at(lane.s)
        yaw_rate = v * kappa + self.e["k_heading_per_s"] * (psi_des - lane.heading_error)
        steering = math.atan(params.wheelbase_m * yaw_rate / v)
        return Command(
            float(np.clip(steering, -params.max_steer_rad, params.max_steer_rad)),
            float(np.clip(self._throttle(world, v, blocking), -1.0, 1.0)),
        )

    def _desired_lateral_speed(self, world: World) -> float:
        """PI lane keeping: the lateral speed (m/s) toward the lane centre."""
        e, y = self.e, world.lane.lateral
        self.integral = float(np.clip(self.integral + y * world.dt, -e["integral_limit_m_s"], e["integral_limit_m_s"]))
        return -e["k_lateral_per_s"] * y - e["k_integral_per_s2"] * self.integral

    def _lateral_bounds(self, world: World, v: float) -> tuple[float, float, list]:
        """Lateral barriers: h >= 0 kept by dh/dt >= -gamma h gives bounds (lower, upper) on the
        lateral speed, from the lane's edges and every obstacle near; and the obstacles the lane
        leaves no room to pass, as (ds, pose, model), for the longitudinal barrier."""
        e, params, lane = self.e, world.params, world.lane
        ego_half_len, ego_half_w = params.length_m / 2.0, params.width_m / 2.0
        y = lane.lateral
        gamma = e["cbf_gamma_per_s"]
        keep_lo, keep_hi = e["lane_keep_m"]
        lower, upper = -gamma * (y - keep_lo), gamma * (keep_hi - y)
        clearance_gap = world.thresholds.min_obstacle_gap_m + e["clearance_margin_m"]
        ahead_speed = v * math.cos(lane.heading_error)
        blocking = []
        for pose in world.actor_poses():
            model = pose.spec.model
            ds = pose.s - lane.s
            overlap = ego_half_len + model.length_m / 2.0 + clearance_gap
            if ds < -overlap or ds > 80.0:
                continue
            # Side to pass on: obstacles right of the ego pass on the left (+1), others on the right.
            side = 1.0 if pose.lateral < y else -1.0
            need = ego_half_w + model.width_m / 2.0 + clearance_gap
            far = max(abs(ds) - overlap, 0.0)
            h = side * (y - pose.lateral) - need + e["cbf_slope"] * far
            closing = (pose.ds_dt - ahead_speed) * (1.0 if ds > 0 else -1.0) if far > 0 else 0.0
            # dh/dt = side (vy - dlat) + slope * d|ds|/dt >= -gamma h
            bound = -gamma * h + side * pose.dlat_dt - e["cbf_slope"] * closing
            if side > 0:
                lower = max(lower, bound)
                # Obstacles that cannot be cleared inside the lane get the longitudinal barrier.
                if pose.lateral + need > keep_hi + 1e-6 and ds > 0:
                    blocking.append((ds, pose, model))
            else:
                upper = min(upper, side * bound)
                if pose.lateral - need < keep_lo - 1e-6 and ds > 0 and not pose.spec.oncoming:
                    blocking.append((ds, pose, model))
        if lower > upper:
            lower = upper = 0.5 * (lower + upper)
        return lower, upper, blocking

    def _throttle(self, world: World, v: float, blocking: list) -> float:
        """Longitudinal: cruise speed limited by the curvature ahead, then the following barrier for
        each blocking obstacle; as a fraction of the car's acceleration (+) or deceleration (-)."""
        e, params, lane, speed = self.e, world.params, world.lane, world.state.speed
        preview = world.road.max_curvature(lane.s, lane.s + e["preview_s"] * v)
        target = min(world.episode.cruise_speed, math.sqrt(self.config["traffic"]["max_lateral_accel_mps2"] / max(preview, 1e-6)))
        accel = e["k_speed_per_s"] * (target - speed)
        for ds, pose, model in blocking:
            gap = ds - params.length_m / 2.0 - model.length_m / 2.0 - e["follow_gap_m"]
            h = gap - e["follow_time_s"] * speed
            # dh/dt = (v_obstacle - v) - T a >= -gamma h
            a_max = (pose.ds_dt - speed + e["cbf_long_gamma_per_s"] * h) / e["follow_time_s"]
            accel = min(accel, a_max)
        return accel / (params.max_accel_mps2 if accel >= 0 else params.max_decel_mps2)


class Disturbance:
    """Collection-time pushes: steering pulses and throttle noise added to the applied command."""

    def __init__(self, config: dict, rng: np.random.Generator):
        self.d = config["disturbance"]
        self.rng = rng
        self.offset = 0.0
        self.remaining_s = 0.0

    def apply(self, command: Command, dt: float) -> Command:
        d = self.d
        if self.remaining_s <= 0.0:
            self.offset = 0.0
            if self.rng.random() < d["pulse_rate_per_s"] * dt:
                self.offset = float(self.rng.choice([-1.0, 1.0]) * self.rng.uniform(*d["pulse_steer_rad"]))
                self.remaining_s = float(self.rng.uniform(*d["pulse_duration_s"]))
        self.remaining_s -= dt
        noise = float(self.rng.normal(0.0, d["throttle_noise"]))
        return Command(command.steering + self.offset, float(np.clip(command.throttle + noise, -1.0, 1.0)))

    def start_state(self, cruise_speed: float) -> dict:
        """Perturbed start: lateral offset, heading error and speed for World(...)."""
        d = self.d
        return {
            "start_lateral": float(self.rng.uniform(-1, 1) * d["start_lateral_m"]),
            "start_heading": float(math.radians(self.rng.uniform(-1, 1) * d["start_heading_deg"])),
            "start_speed": float(cruise_speed * self.rng.uniform(*d["start_speed_fraction"])),
        }
