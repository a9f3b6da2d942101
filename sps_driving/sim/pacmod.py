"""A stand-in for the PACMod 3 driver and the car behind it, as the vehicle interface sees them.
Pure logic, no ROS (the node is sps_driving.ros.nodes.pacmod3_standin).

What it copies from the real driver (astuff/pacmod3, ROS 2, `PACMod3Node`; the contract with file
and line: docs/vehicle.md):
- each command topic's latest message is latched and re-sent to the car every period (33 ms)
  from the driver's own loop, with no timeout: a silent sender leaves its last command in force;
  before the first turn command the turn signal frame says TURN_NONE;
- what reaches the car is what the PACMod reads from the driver's CAN frames
  (sps_driving.sim.pacmod_can): values truncated to 0.001, an out-of-range value wrapped;
- when the global report shows an override or a system fault, the driver clears the enable bit of
  every latched command (`set_enable(false)`); a later command with enable sets it again;
- reports: per system enabled / override / fault flags, the echoed command and the measured
  output (the driver never sets command_timeout); the global report's `enabled` is true when any
  system is enabled.
What it copies from the PACMod firmware: a system is enabled while its latched command has
enable set, its override flag is clear and no fault or CAN timeout is present; an override flag
stays set after the driver lets go until a command arrives with clear_override.
The car: the steering wheel moves toward its command at the commanded rotation rate; speed
(signed, negative in reverse) follows the pedals (full accelerator `max_accel_mps2`, full brake
`max_decel_mps2`); a system not enabled is the human's (pedals released, wheel left where it is).
The gear is the human's: forward unless shifted to reverse.
Fault injection: an override (the safety driver takes a system), a PACMod fault, a CAN timeout,
reports that stop (the car's state then unknown to the stack), and a shift to reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sps_driving.sim import pacmod_can

COMMANDED = ("steering", "accel", "brake", "turn")  # command topics the stand-in latches
TURN_NONE = 1  # pacmod3_msgs/SystemCmdInt: turn signals off (the driver's stalk)
SHIFT_REVERSE, SHIFT_FORWARD = 1, 3  # pacmod3_msgs/SystemRptInt gears


@dataclass
class Latched:
    """The latched command of one system: what the driver re-sends every period."""

    enable: bool = False
    ignore_overrides: bool = False
    clear_override: bool = False
    command: float = 0.0
    rotation_rate: float = 0.0  # steering only, rad/s of the steering wheel
    received: int = 0  # commands received on this topic


@dataclass(frozen=True)
class Sent:
    """One period's frame to the car: the latched enable and command of every system."""

    time_s: float
    enable: dict  # system -> bool
    command: dict  # system -> float (turn: the TURN_* value)


@dataclass
class SystemReport:
    enabled: bool = False
    override_active: bool = False
    pacmod_fault: bool = False
    command: float = 0.0  # echoed command
    output: float = 0.0  # measured output
    manual_input: float = 0.0


@dataclass
class CarReports:
    systems: dict = field(default_factory=dict)  # system -> SystemReport
    enabled: bool = False  # GlobalRpt.enabled: any system enabled
    override_active: bool = False
    pacmod_sys_fault_active: bool = False
    can_timeout: bool = False  # every *_can_timeout flag of GlobalRpt
    vehicle_speed: float = 0.0  # m/s
    vehicle_speed_valid: bool = True
    gear: int = SHIFT_FORWARD  # the shift report's output


class PacmodStandIn:
    def __init__(self, max_accel_mps2: float = 2.0, max_decel_mps2: float = 6.0, drag_per_s: float = 0.02):
        self.latched = {name: Latched() for name in COMMANDED}
        self.latched["turn"].command = float(TURN_NONE)  # the driver's first turn frame
        self.override_flags = {name: False for name in COMMANDED}
        self.human = {name: False for name in COMMANDED}  # the safety driver is on this system now
        self.fault = False
        self.can_timeout = False
        self.reports_paused = False
        self.gear = SHIFT_FORWARD
        self.steering_wheel_rad = 0.0
        self.speed_mps = 0.0
        self.max_accel_mps2 = max_accel_mps2
        self.max_decel_mps2 = max_decel_mps2
        self.drag_per_s = drag_per_s

    # ------------------------------------------------------------ the driver's subscriptions

    def on_command(self, system: str, enable: bool, ignore_overrides: bool, clear_override: bool, command: float,
                   rotation_rate: float = 0.0) -> None:
        latched = self.latched[system]
        latched.enable, latched.ignore_overrides, latched.clear_override = bool(enable), bool(ignore_overrides), bool(clear_override)
        latched.command, latched.rotation_rate = float(command), float(rotation_rate)
        latched.received += 1

    # ------------------------------------------------------------ fault injection

    def override(self, system: str | None = None, active: bool = True) -> None:
        """The safety driver takes (or lets go of) one system, or all of them."""
        for name in [system] if system else ("steering", "accel", "brake"):
            self.human[name] = active
            self.override_flags[name] = self.override_flags[name] or active

    def enabled(self, system: str) -> bool:
        latched = self.latched[system]
        return latched.enable and not self.override_flags[system] and not self.fault and not self.can_timeout

    # ------------------------------------------------------------ one period

    def received(self) -> dict:
        """{system: pacmod_can.CommandFrame}: what the PACMod reads from the driver's frame of each
        latched command."""
        return {
            name: pacmod_can.decode_command(*pacmod_can.encode_command(
                name, s.enable, s.ignore_overrides, s.clear_override, s.command, s.rotation_rate))
            for name, s in self.latched.items()
        }

    def step(self, now_s: float, dt_s: float) -> Sent:
        """The driver's re-send of every latched command, and the car's response to it."""
        for name, latched in self.latched.items():
            if latched.clear_override and latched.enable and not self.human[name]:
                self.override_flags[name] = False
        if any(self.override_flags.values()) or self.fault:
            for latched in self.latched.values():  # the driver's set_enable(false)
                latched.enable = False
        received = self.received()
        sent = Sent(now_s, {n: r.enable for n, r in received.items()}, {n: r.command for n, r in received.items()})
        steering = received["steering"]
        if self.enabled("steering"):
            step = steering.rotation_rate * dt_s
            self.steering_wheel_rad += max(-step, min(step, steering.command - self.steering_wheel_rad))
        accel = received["accel"].command if self.enabled("accel") else 0.0
        brake = received["brake"].command if self.enabled("brake") else 0.0
        # Signed speed, as PACMod reports it: the accelerator pushes the way the gear points; brake
        # and drag slow the car down to a standstill, never through it.
        direction = -1.0 if self.gear == SHIFT_REVERSE else 1.0
        speed = self.speed_mps + direction * self.max_accel_mps2 * accel * dt_s
        slowing = (self.max_decel_mps2 * brake + self.drag_per_s * abs(speed)) * dt_s
        self.speed_mps = math.copysign(max(0.0, abs(speed) - slowing), speed)
        return sent

    def reports(self) -> CarReports | None:
        """The reports of this period; None while reports are paused."""
        if self.reports_paused:
            return None
        received = self.received()
        outputs = {
            "steering": self.steering_wheel_rad,
            "accel": received["accel"].command if self.enabled("accel") else 0.0,
            "brake": received["brake"].command if self.enabled("brake") else 0.0,
            "turn": received["turn"].command if self.enabled("turn") else float(TURN_NONE),
        }
        systems = {
            name: SystemReport(
                enabled=self.enabled(name),
                override_active=self.override_flags[name],
                pacmod_fault=self.fault,
                command=received[name].command,
                output=outputs[name],
            )
            for name in COMMANDED
        }
        return CarReports(
            systems=systems,
            enabled=any(r.enabled for r in systems.values()),
            override_active=any(self.override_flags.values()),
            pacmod_sys_fault_active=self.fault,
            can_timeout=self.can_timeout,
            vehicle_speed=self.speed_mps,
            gear=self.gear,
        )
