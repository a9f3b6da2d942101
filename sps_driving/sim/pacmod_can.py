"""The PACMod 3 CAN frames behind the driver's topics, for the frames the stack uses. Pure logic.

Layout: DBC major version 3 (as_pacmod.dbc 3.4.1 of astuff/pacmod_dbc), the only one the ROS 2
driver (astuff/pacmod3, ros2_master) speaks; Motorola byte order, flags in byte 0 (bit 0 enable or
enabled, bit 1 ignore_overrides or override_active, ...). docs/vehicle.md, "The PACMod 3 driver's
contract", has the upstream file and line of each rule below.

- `encode_command`: the bytes the driver puts on the bus for one command message, as it encodes
  them (pacmod3_core.cpp): the value as a float32 times 1000, truncated toward zero into 16 bits
  (an out-of-range value wraps: x86-64's conversion of C++'s undefined case), clear_faults always 0,
  and the driver's own lengths (3 bytes for accelerator and brake, 5 for steering, 2 for turn and
  shift), not the DBC's 8.
- `decode_command`: what the PACMod reads from such a frame (the DBC's scaling).
- `encode_report`: a report frame as the PACMod sends it (the DBC's scaling, rounded).
- `decode_report`: what the driver makes of a report frame (pacmod3_core.cpp `parse`).
Checked against the real driver and the DBC: test/data/pacmod3_driver_frames.json.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

# CAN ids (DBC 3)
GLOBAL_RPT = 0x10
ACCEL_CMD, BRAKE_CMD, SHIFT_CMD, STEERING_CMD, TURN_CMD = 0x100, 0x104, 0x128, 0x12C, 0x130
ACCEL_RPT, BRAKE_RPT, SHIFT_RPT, STEERING_RPT, TURN_RPT = 0x200, 0x204, 0x228, 0x22C, 0x230
VEHICLE_SPEED_RPT = 0x400

COMMAND_IDS = {"accel": ACCEL_CMD, "brake": BRAKE_CMD, "shift": SHIFT_CMD, "steering": STEERING_CMD, "turn": TURN_CMD}
REPORT_IDS = {"accel": ACCEL_RPT, "brake": BRAKE_RPT, "shift": SHIFT_RPT, "steering": STEERING_RPT, "turn": TURN_RPT}
FLOAT_SYSTEMS = ("accel", "brake", "steering")  # 16-bit values x 0.001; turn and shift: one byte
# Flags of a command's byte 0 and of a system report's byte 0, in bit order.
COMMAND_FLAGS = ("enable", "ignore_overrides", "clear_override", "clear_faults")
REPORT_FLAGS = ("enabled", "override_active", "command_output_fault", "input_output_fault", "output_reported_fault",
                "pacmod_fault", "vehicle_fault")
GLOBAL_FLAGS = ("enabled", "override_active", "user_can_timeout", "steering_can_timeout", "brake_can_timeout",
                "subsystem_can_timeout", "vehicle_can_timeout", "pacmod_sys_fault_active")


@dataclass(frozen=True)
class CommandFrame:
    """A command as the PACMod reads it: flags, and the value in its unit (fractions of the pedals,
    rad of the steering wheel, a TURN_* or SHIFT_* value); rotation_rate rad/s, steering only."""

    system: str
    enable: bool
    ignore_overrides: bool
    clear_override: bool
    clear_faults: bool
    command: float
    rotation_rate: float = 0.0


def _driver_raw(value: float) -> int:
    """The driver's `static_cast<uint16_t or int16_t>(float(value) * 1000.0)`, as 16 raw bits."""
    scaled = float(np.float32(value)) * 1000.0
    if not math.isfinite(scaled) or abs(scaled) >= 2**31:
        return 0  # x86-64 turns NaN and what int32 cannot hold into INT_MIN, whose low 16 bits are 0
    return int(scaled) & 0xFFFF  # truncation toward zero, then the low 16 bits


def _flags(names, values: dict) -> int:
    return sum(1 << bit for bit, name in enumerate(names) if values.get(name))


def encode_command(system: str, enable: bool, ignore_overrides: bool, clear_override: bool, command: float,
                   rotation_rate: float = 0.0) -> tuple[int, bytes]:
    """(CAN id, data) the driver sends for one command message of `system`."""
    flags = _flags(COMMAND_FLAGS, {"enable": enable, "ignore_overrides": ignore_overrides, "clear_override": clear_override})
    if system in FLOAT_SYSTEMS:
        data = bytes([flags]) + struct.pack(">H", _driver_raw(command))
        if system == "steering":
            data += struct.pack(">H", _driver_raw(rotation_rate))
    else:
        data = bytes([flags, int(command) & 0xFF])
    return COMMAND_IDS[system], data


def decode_command(can_id: int, data: bytes) -> CommandFrame:
    system = next(name for name, cid in COMMAND_IDS.items() if cid == can_id)
    flags = {name: bool(data[0] >> bit & 1) for bit, name in enumerate(COMMAND_FLAGS)}
    if system in FLOAT_SYSTEMS:
        fmt = ">h" if system == "steering" else ">H"
        command = struct.unpack(fmt, bytes(data[1:3]))[0] / 1000.0
        rate = struct.unpack(">H", bytes(data[3:5]))[0] / 1000.0 if system == "steering" else 0.0
    else:
        command, rate = float(data[1]), 0.0
    return CommandFrame(system, command=command, rotation_rate=rate, **flags)


def _raw16(value: float, scale: float) -> bytes:
    raw = int(round(value / scale))
    return struct.pack(">h", max(-0x8000, min(0x7FFF, raw)))


def encode_report(system: str, manual_input: float, command: float, output: float, **flags) -> tuple[int, bytes]:
    """(CAN id, 8 bytes) of a system report; `flags` by the names of REPORT_FLAGS (missing: false)."""
    head = bytes([_flags(REPORT_FLAGS, flags)])
    if system in FLOAT_SYSTEMS:
        body = b"".join(_raw16(v, 0.001) for v in (manual_input, command, output)) + b"\0"
    else:
        body = bytes([int(manual_input) & 0xFF, int(command) & 0xFF, int(output) & 0xFF]) + bytes(4)
    return REPORT_IDS[system], head + body


def encode_global_report(user_can_read_errors: int = 0, config_fault_active: bool = False, **flags) -> tuple[int, bytes]:
    """(CAN id, 8 bytes) of GLOBAL_RPT; `flags` by the names of GLOBAL_FLAGS (missing: false)."""
    data = bytes([_flags(GLOBAL_FLAGS, flags), 0x80 if config_fault_active else 0]) + bytes(4)
    return GLOBAL_RPT, data + struct.pack(">H", user_can_read_errors & 0xFFFF)


def encode_speed_report(speed_mps: float, valid: bool) -> tuple[int, bytes]:
    return VEHICLE_SPEED_RPT, _raw16(speed_mps, 0.01) + bytes([1 if valid else 0]) + bytes(5)


def decode_report(can_id: int, data: bytes) -> dict:
    """The fields the driver fills in its report message from one frame (pacmod3_core.cpp `parse`;
    a system report's command_timeout is never read: it stays false)."""
    if can_id == GLOBAL_RPT:
        out = {name: bool(data[0] >> bit & 1) for bit, name in enumerate(GLOBAL_FLAGS)}
        return {**out, "config_fault_active": bool(data[1] & 0x80), "user_can_read_errors": data[6] << 8 | data[7]}
    if can_id == VEHICLE_SPEED_RPT:
        return {"vehicle_speed": struct.unpack(">h", bytes(data[0:2]))[0] / 100.0, "vehicle_speed_valid": data[2] == 1}
    system = next(name for name, cid in REPORT_IDS.items() if cid == can_id)
    out = {name: bool(data[0] >> bit & 1) for bit, name in enumerate(REPORT_FLAGS)}
    if system in FLOAT_SYSTEMS:  # the driver reads all three as signed, the pedals' included
        values = struct.unpack(">hhh", bytes(data[1:7]))
        return {**out, **dict(zip(("manual_input", "command", "output"), (v / 1000.0 for v in values)))}
    return {**out, "manual_input": data[1], "command": data[2], "output": data[3]}
