"""The PACMod 3 CAN layout (sps_driving.sim.pacmod_can) against frames the real driver
(astuff/pacmod3, ros2_master) put on its can_rx topic and the DBC's reading of them
(test/data/pacmod3_driver_frames.json, docs/results/real_driver.md), and the stand-in sending
and reporting through it."""

import json
import math
from pathlib import Path

import pytest

from sps_driving.sim import pacmod_can
from sps_driving.sim.pacmod import TURN_NONE, PacmodStandIn

DT = 1 / 30
FRAMES = json.loads((Path(__file__).parent / "data" / "pacmod3_driver_frames.json").read_text())


@pytest.mark.parametrize("case", FRAMES["commands"], ids=lambda c: f"{c['system']}={c['ros']['command']}")
def test_a_command_is_the_frame_the_real_driver_sent_and_reads_as_the_dbc_says(case):
    ros = case["ros"]
    can_id, data = pacmod_can.encode_command(case["system"], ros["enable"], ros["ignore_overrides"], ros["clear_override"],
                                             ros["command"], ros.get("rotation_rate", 0.0))
    assert (can_id, data.hex()) == (case["can_id"], case["data"])
    read = pacmod_can.decode_command(can_id, bytes.fromhex(case["data"]))
    dbc = case["dbc"]
    assert (read.enable, read.ignore_overrides, read.clear_override, read.clear_faults) == (
        dbc["ENABLE"] == 1, dbc["IGNORE_OVERRIDES"] == 1, dbc["CLEAR_OVERRIDE"] == 1, dbc["CLEAR_FAULTS"] == 1)
    assert read.command == pytest.approx(dbc[case["signal"]], abs=1e-12)
    assert read.rotation_rate == pytest.approx(dbc.get("ROTATION_RATE", 0.0), abs=1e-12)


@pytest.mark.parametrize("case", FRAMES["reports"], ids=lambda c: hex(c["can_id"]))
def test_a_report_frame_encoded_from_the_dbc_is_what_the_real_driver_published(case):
    published = dict(case["driver"])
    never_set = {k: published.pop(k) for k in ("command_timeout", "supervisory_enable_required") if k in published}
    assert not any(never_set.values())  # no frame bit is parsed into them: always false
    assert pacmod_can.decode_report(case["can_id"], bytes.fromhex(case["data"])) == pytest.approx(published, abs=1e-12)


def test_a_report_frame_is_the_dbc_encoding():
    for case in FRAMES["reports"]:
        fields = {k: v for k, v in case["driver"].items() if k not in ("command_timeout", "supervisory_enable_required")}
        if case["can_id"] == pacmod_can.VEHICLE_SPEED_RPT:
            frame = pacmod_can.encode_speed_report(fields["vehicle_speed"], fields["vehicle_speed_valid"])
        elif case["can_id"] == pacmod_can.GLOBAL_RPT:
            frame = pacmod_can.encode_global_report(**fields)
        else:
            system = next(s for s, i in pacmod_can.REPORT_IDS.items() if i == case["can_id"])
            values = {k: fields[k] for k in ("manual_input", "command", "output")}
            frame = pacmod_can.encode_report(system, **values, **{k: v for k, v in fields.items() if k not in values})
        assert frame == (case["can_id"], bytes.fromhex(case["data"])), case


def test_standin_sends_turn_none_before_any_turn_command():
    sent = PacmodStandIn().step(0.0, DT)
    assert sent.command["turn"] == TURN_NONE and not sent.enable["turn"]


def test_standin_sends_what_the_pacmod_reads_from_the_drivers_frames():
    car = PacmodStandIn()
    car.on_command("steering", True, False, False, -0.0123456 * 14.8, 4.44)
    car.on_command("accel", True, False, False, 0.123456)
    car.on_command("brake", True, False, False, -0.001)  # never sent by the stack: the driver's cast wraps it
    sent = car.step(0.0, DT)
    # 0.001 steps, truncated toward zero (a float32 times 1000 cast to 16 bits)
    assert sent.command["steering"] == -0.182 and sent.command["accel"] == 0.123
    assert sent.command["brake"] == 65.535
    assert car.reports().systems["accel"].command == 0.123  # the PACMod echoes what it read


def test_report_values_come_back_as_the_driver_parses_them():
    frame = pacmod_can.encode_report("steering", -1.23449, 7.9, -32.0, enabled=True, pacmod_fault=True)
    fields = pacmod_can.decode_report(*frame)
    assert (fields["manual_input"], fields["command"], fields["output"]) == (-1.234, 7.9, -32.0)
    assert fields["enabled"] and fields["pacmod_fault"] and not fields["override_active"]
    assert "command_timeout" not in fields  # DBC 3's bit 7 is not parsed: the message's field stays false
    speed = pacmod_can.decode_report(*pacmod_can.encode_speed_report(-3.456, True))
    assert speed == {"vehicle_speed": -3.46, "vehicle_speed_valid": True}
    assert math.isclose(pacmod_can.decode_report(*pacmod_can.encode_speed_report(400.0, False))["vehicle_speed"], 327.67)
