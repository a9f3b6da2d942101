"""Kinematic bicycle model of the Lexus RX 450h at a fixed control step.

Commands follow sps_driving/core/topics.py: steering is the front road-wheel angle in rad (left
positive), throttle in [-1, 1] with negative meaning brake. The state's (x, y) is the rear-axle
centre; the footprint centre, the lane-offset reference point, sits half a wheelbase ahead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sps_driving.sim.geometry import rectangle


@dataclass(frozen=True)
class VehicleParams:
    wheelbase_m: float
    length_m: float
    width_m: float
    rear_overhang_m: float
    max_steer_rad: float
    max_steer_rate_rad_s: float
    max_accel_mps2: float
    max_decel_mps2: float
    drag_per_s: float
    max_speed_mps: float

    @classmethod
    def from_config(cls, config: dict) -> VehicleParams:
        return cls(**{k: float(v) for k, v in config["vehicle"].items()})

    @property
    def center_offset_m(self) -> float:
        """Footprint centre ahead of the rear axle."""
        return self.length_m / 2.0 - self.rear_overhang_m


@dataclass(frozen=True)
class VehicleState:
    x: float  # m, rear-axle centre
    y: float  # m
    yaw: float  # rad
    speed: float  # m/s, never negative
    steer: float  # rad, the road-wheel angle the actuator has reached

    def center(self, params: VehicleParams) -> tuple[float, float]:
        d = params.center_offset_m
        return self.x + d * math.cos(self.yaw), self.y + d * math.sin(self.yaw)

    def footprint(self, params: VehicleParams) -> np.ndarray:
        cx, cy = self.center(params)
        return rectangle(cx, cy, self.yaw, params.length_m, params.width_m)


def state_at_center(params: VehicleParams, cx: float, cy: float, yaw: float, speed: float, steer: float = 0.0) -> VehicleState:
    d = params.center_offset_m
    return VehicleState(cx - d * math.cos(yaw), cy - d * math.sin(yaw), yaw, speed, steer)


def clamp_command(params: VehicleParams, steering: float, throttle: float) -> tuple[float, float]:
    """Commands within the vehicle's limits; a non-finite command becomes straight and full brake."""
    if not (math.isfinite(steering) and math.isfinite(throttle)):
        return 0.0, -1.0
    return (min(max(steering, -params.max_steer_rad), params.max_steer_rad), min(max(throttle, -1.0), 1.0))


def step(params: VehicleParams, state: VehicleState, steering: float, throttle: float, dt: float, substeps: int = 4) -> VehicleState:
    """Advance one control step holding the command (the actuator slews toward `steering`)."""
    steering, throttle = clamp_command(params, steering, throttle)
    accel = throttle * (params.max_accel_mps2 if throttle >= 0 else params.max_decel_mps2)
    h = dt / substeps
    x, y, yaw, v, delta = state.x, state.y, state.yaw, state.speed, state.steer
    max_slew = params.max_steer_rate_rad_s * h
    for _ in range(substeps):
        delta += min(max(steering - delta, -max_slew), max_slew)
        v_next = min(max(v + (accel - params.drag_per_s * v) * h, 0.0), params.max_speed_mps)
        v_mid = 0.5 * (v + v_next)
        yaw_mid = yaw + 0.5 * v_mid * math.tan(delta) / params.wheelbase_m * h
        x += v_mid * math.cos(yaw_mid) * h
        y += v_mid * math.sin(yaw_mid) * h
        yaw += v_mid * math.tan(delta) / params.wheelbase_m * h
        v = v_next
    return replace(state, x=x, y=y, yaw=yaw, speed=v, steer=delta)
