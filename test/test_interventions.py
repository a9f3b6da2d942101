"""Intervention counting from a real rosbag2 file with PACMod 3 reports (sqlite3 and mcap)."""

import json

import pytest

from sps_driving import cli, topics
from sps_driving.bagio import TYPESTORE, BagWriter, header, twist_message
from sps_driving.interventions import analyze

S = 1_000_000_000
T0 = 1_700_000_000 * S


def global_rpt(t, enabled, override):
    return TYPESTORE.types["pacmod3_msgs/msg/GlobalRpt"](
        header=header(t), enabled=enabled, override_active=override, user_can_timeout=False, steering_can_timeout=False,
        brake_can_timeout=False, subsystem_can_timeout=False, vehicle_can_timeout=False, pacmod_sys_fault_active=False,
        supervisory_enable_required=False, config_fault_active=False, user_can_read_errors=0,
    )


def system_rpt(t, override):
    return TYPESTORE.types["pacmod3_msgs/msg/SystemRptFloat"](
        header=header(t), enabled=True, override_active=override, command_output_fault=False, input_output_fault=False,
        output_reported_fault=False, pacmod_fault=False, vehicle_fault=False, command_timeout=False,
        manual_input=0.0, command=0.0, output=0.0,
    )


def write_field_test(path, storage, speed=True):
    """60 s at 10 Hz reports: engaged at 5 s, steering override at 20 s (PACMod then disables),
    re-engaged at 30 s, disengage button at 50 s. 10 m/s throughout."""
    with BagWriter(path, storage) as bag:
        for i in range(600):
            t = T0 + i * S // 10
            sec = i / 10
            autonomous = 5 <= sec < 20 or 30 <= sec < 50
            override = 20 <= sec < 21
            enabled = autonomous
            bag.write("/pacmod/global_rpt", global_rpt(t, enabled, override), t)
            bag.write("/pacmod/steering_rpt", system_rpt(t, override), t)
            bag.write("/pacmod/enabled", TYPESTORE.types["std_msgs/msg/Bool"](data=enabled), t)
            if speed:
                bag.write(topics.VEHICLE_TWIST, twist_message(10.0, t), t)


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_counts_overrides_and_disables(tmp_path, storage):
    write_field_test(tmp_path / "drive", storage)
    s = analyze(tmp_path / "drive")
    events = [(t["event"], round((t["time_ns"] - T0) / S, 1)) for t in s["transitions"]]
    assert events == [("engaged", 5.0), ("override", 20.0), ("engaged", 30.0), ("disabled", 50.0)]
    assert s["interventions"] == 2 and s["overrides"] == 1 and s["disables"] == 1
    assert s["autonomy_s"] == pytest.approx(35.0)
    assert s["autonomy_km"] == pytest.approx(0.35, rel=1e-3)
    assert s["interventions_per_hour"] == pytest.approx(2 / (35 / 3600))
    assert s["interventions_per_km"] == pytest.approx(2 / 0.35, rel=1e-3)


def test_cli_prints_report_and_json(tmp_path, capsys):
    write_field_test(tmp_path / "drive", "sqlite3", speed=False)
    assert cli.main(["interventions", str(tmp_path / "drive")]) == 0
    out = capsys.readouterr().out
    assert "override" in out and "interventions:   2" in out and "per km:          n/a" in out
    assert cli.main(["interventions", str(tmp_path / "drive"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["interventions"] == 2 and data["interventions_per_km"] is None


def test_bag_without_reports_is_a_clear_error(tmp_path, capsys):
    with BagWriter(tmp_path / "empty", "sqlite3") as bag:
        bag.write(topics.VEHICLE_TWIST, twist_message(1.0, T0), T0)
    assert cli.main(["interventions", str(tmp_path / "empty")]) == 2
    assert "no engagement reports" in capsys.readouterr().out
    assert cli.main(["interventions", str(tmp_path / "missing")]) == 2
