"""Interventions and disengagements from real rosbag2 files (sqlite3 and mcap) with PACMod 3 reports in
the ROS 2 pacmod3_msgs layout, or with the vehicle interface's status."""

import json

import pytest

from sps_driving import cli
from sps_driving.core import topics
from sps_driving.ros.bagio import BagWriter, to_bag
from sps_driving.ros.drive import read_drive
from sps_driving.ros.engagement import OLD_VEHICLE_STATUS
from sps_driving.ros.msgs import Fields, Level, header_fields, twist_fields

S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S
TICK_NS = S // 30  # PACMod reports at 30 Hz
# Each report topic's offset within the 33 ms CAN cycle, as they arrive on the car.
PHASE_MS = {
    "/pacmod/global_rpt": 0, "/pacmod/enabled": 1, "/pacmod/steering_rpt": 4, "/pacmod/brake_rpt": 8,
    "/pacmod/accel_rpt": 12, "/pacmod/turn_rpt": 16, topics.PACMOD_SPEED_RPT: 20,
}
GLOBAL_FLAGS = (
    "override_active", "user_can_timeout", "steering_can_timeout", "brake_can_timeout", "subsystem_can_timeout",
    "vehicle_can_timeout", "pacmod_sys_fault_active", "supervisory_enable_required", "config_fault_active",
)
SYSTEM_FLAGS = (
    "override_active", "command_output_fault", "input_output_fault", "output_reported_fault", "pacmod_fault",
    "vehicle_fault", "command_timeout",
)


def analyze(bag):
    """The engagement summary of a bag as the drive reader finds it, with the topics it came from."""
    drive = read_drive(bag)
    return {**drive.engagement.summary(), "sources": drive.engagement_sources}


def global_rpt(t, enabled, **flags):
    values = {name: flags.get(name, False) for name in GLOBAL_FLAGS}
    return to_bag(Fields("pacmod3_msgs/msg/GlobalRpt", {"header": header_fields(t), "enabled": enabled, "user_can_read_errors": 3,
                                                        **values}))


def system_rpt(t, enabled, kind="Float", **flags):
    values = {name: flags.get(name, False) for name in SYSTEM_FLAGS}
    return to_bag(Fields(f"pacmod3_msgs/msg/SystemRpt{kind}", {"header": header_fields(t), "enabled": enabled, **values}))


def write_field_test(path, storage, speed=True):
    """60 s of reports at 30 Hz on six topics, 10 m/s throughout. Engaged at 2 s; at 10 s the
    safety driver brakes (brake_rpt override first, the global report one cycle later with enable
    off); re-engaged at 15 s; at 25 s a steering fault, and the driver clears enable two cycles later;
    re-engaged at 30 s; at 40 s a steering CAN timeout, enable off one cycle later; re-engaged at
    45 s; at 55 s the operator's disengage button. Returns the expected disengagements
    [(cause, time ns, fields)] and engagement times."""
    ticks = {
        "engage1": 60, "override": 300, "override_end": 330, "engage2": 450, "fault": 750, "fault_disable": 752,
        "fault_end": 810, "engage3": 900, "timeout": 1200, "timeout_disable": 1201, "timeout_end": 1230,
        "engage4": 1350, "disable": 1650,
    }
    k = ticks
    with BagWriter(path, storage) as bag:
        for i in range(1800):
            enabled = (k["engage1"] <= i < k["override"] + 1 or k["engage2"] <= i < k["fault_disable"]
                       or k["engage3"] <= i < k["timeout_disable"] or k["engage4"] <= i < k["disable"])
            braking = k["override"] <= i < k["override_end"]
            fault = k["fault"] <= i < k["fault_end"]
            timeout = k["timeout"] <= i < k["timeout_end"]

            def at(topic):
                return T0 + i * TICK_NS + PHASE_MS[topic] * MS

            t = at("/pacmod/global_rpt")
            overridden = braking and i > k["override"]  # the global report shows it a cycle later
            bag.write("/pacmod/global_rpt", global_rpt(
                t, enabled and not overridden, override_active=overridden, pacmod_sys_fault_active=fault,
                steering_can_timeout=timeout, supervisory_enable_required=True,
            ), t)
            bag.write(topics.PACMOD_ENABLED, Fields("std_msgs/msg/Bool", {"data": enabled and not overridden}), at(topics.PACMOD_ENABLED))
            t = at("/pacmod/steering_rpt")
            bag.write("/pacmod/steering_rpt", system_rpt(t, enabled, vehicle_fault=fault), t)
            t = at("/pacmod/brake_rpt")
            bag.write("/pacmod/brake_rpt", system_rpt(t, enabled, override_active=braking), t)
            t = at("/pacmod/accel_rpt")
            bag.write("/pacmod/accel_rpt", system_rpt(t, enabled), t)
            t = at("/pacmod/turn_rpt")
            bag.write("/pacmod/turn_rpt", system_rpt(t, False, kind="Int"), t)
            if speed:
                t = at(topics.PACMOD_SPEED_RPT)
                bag.write(topics.VEHICLE_TWIST, twist_fields(10.0, t), t)

    def tick(name, topic="/pacmod/global_rpt"):
        return T0 + k[name] * TICK_NS + PHASE_MS[topic] * MS

    return [
        ("override", tick("override", "/pacmod/brake_rpt"), ["/pacmod/brake_rpt: override_active", "/pacmod/global_rpt: override_active"]),
        ("fault", tick("fault_disable"), ["/pacmod/global_rpt: pacmod_sys_fault_active", "/pacmod/steering_rpt: vehicle_fault"]),
        ("timeout", tick("timeout_disable"), ["/pacmod/global_rpt: steering_can_timeout"]),
        ("disable", tick("disable"), ["/pacmod/global_rpt: enabled=false"]),
    ], [tick(name) for name in ("engage1", "engage2", "engage3", "engage4")]


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_only_overrides_are_interventions_other_disengagements_by_cause(tmp_path, storage):
    expected, engaged = write_field_test(tmp_path / "drive", storage)
    s = analyze(tmp_path / "drive")
    assert s["sources"]["/pacmod/turn_rpt"] == "system"  # SystemRptInt is read as well
    ends = [(t["cause"], t["time_ns"], t["fields"]) for t in s["transitions"] if t["event"] == "disengaged"]
    assert ends == expected
    assert [t["time_ns"] for t in s["transitions"] if t["event"] == "engaged"] == engaged
    assert s["interventions"] == 1 and s["engagements"] == 4
    assert s["disengagements"] == {"fault": 1, "timeout": 1, "disable": 1}
    autonomy_s = sum((end - start) / S for (_, end, _), start in zip(expected, engaged))
    assert autonomy_s == pytest.approx(8.008 + 10.067 + 10.033 + 10.0, abs=1e-3)
    assert s["autonomy_s"] == pytest.approx(autonomy_s)
    assert s["autonomy_km"] == pytest.approx(autonomy_s * 10 / 1000, rel=1e-3)
    assert s["interventions_per_hour"] == pytest.approx(1 / (autonomy_s / 3600))
    assert s["interventions_per_km"] == pytest.approx(1 / (autonomy_s * 10 / 1000), rel=1e-3)


def test_cli_prints_the_report_and_json(tmp_path, capsys):
    """One bag without speed or camera: its interventions and disengagements by kind, listed as not
    read whole (exit status 1) since distances and frames are missing."""
    write_field_test(tmp_path / "drive", "sqlite3", speed=False)
    assert cli.main(["interventions", str(tmp_path / "drive"), "--out", str(tmp_path / "report")]) == 1
    out = capsys.readouterr().out
    assert "| override_brake | 1 |" in out and "| all | 3 |" in out  # the override, the fault and the CAN timeout
    assert "no speed reports" in out and "no camera" in out
    assert cli.main(["interventions", str(tmp_path / "drive"), "--json", "--out", str(tmp_path / "report")]) == 1
    data = json.loads(capsys.readouterr().out)
    events = data["drives"][0]["events"]
    assert [e["kind"] for e in events] == ["override_brake", "pacmod_fault", "pacmod_timeout", "operator_disengage"]
    assert [e["intervention"] for e in events] == [True, True, True, False]
    assert events[0]["detail"] == "/pacmod/brake_rpt: override_active, /pacmod/global_rpt: override_active"
    assert data["totals"]["engaged_km"] is None and data["totals"]["rates"]["all"]["km_per"]["value"] is None
    assert (tmp_path / "report" / "report.md").is_file() and (tmp_path / "report" / "figures").is_dir()


def diagnostics(name, values):
    status = Fields("diagnostic_msgs/msg/DiagnosticStatus", {
        "level": Level.OK, "name": name,
        "values": [Fields("diagnostic_msgs/msg/KeyValue", {"key": k, "value": v}) for k, v in values.items()],
    })
    return Fields("diagnostic_msgs/msg/DiagnosticArray", {"header": header_fields(0), "status": [status]})


@pytest.mark.parametrize("topic", [topics.DIAGNOSTICS, OLD_VEHICLE_STATUS])
def test_vehicle_interface_status_without_pacmod_reports(tmp_path, topic):
    """The vehicle interface's status at 10 Hz: its `last_event` gives the cause. On /diagnostics
    other nodes' statuses (here the safety monitor's) are told apart by name."""
    timeline = [  # (from s, engagement, last_event)
        (0, "disengaged", ""), (1, "engaged", "engaged"), (5, "disengaged", "override"), (7, "engaged", "engaged"),
        (9, "disengaged", "fault"), (11, "engaged", "engaged"), (13, "disengaged", "can_timeout"),
        (15, "engaged", "engaged"), (17, "disengaged", "disengage_requested"), (19, "engaged", "engaged"),
        (21, "disengaged", "disabled_by_vehicle"),
    ]
    with BagWriter(tmp_path / "drive", "mcap") as bag:
        for i in range(230):
            t = T0 + i * S // 10
            _, engagement, event = [row for row in timeline if row[0] * 10 <= i][-1]
            bag.write(topic, diagnostics("vehicle_interface", {"engagement": engagement, "last_event": event, "stop_reasons": ""}), t)
            if topic == topics.DIAGNOSTICS:  # another node's status, saying something else
                bag.write(topic, diagnostics("safety_monitor", {"engagement": "engaged", "interventions": "0"}), t + 1)
    s = analyze(tmp_path / "drive")
    ends = [(t["cause"], round((t["time_ns"] - T0) / S, 1), t["fields"]) for t in s["transitions"] if t["event"] == "disengaged"]
    source = f"{topic} vehicle_interface"
    assert ends == [
        ("override", 5.0, [f"{source}: last_event=override"]),
        ("fault", 9.0, [f"{source}: last_event=fault"]),
        ("timeout", 13.0, [f"{source}: last_event=can_timeout"]),
        ("disable", 17.0, [f"{source}: engagement=disengaged, last_event=disengage_requested"]),
        ("disable", 21.0, [f"{source}: engagement=disengaged, last_event=disabled_by_vehicle"]),
    ]
    assert s["interventions"] == 1 and s["disengagements"] == {"fault": 1, "timeout": 1, "disable": 2}
    assert s["autonomy_s"] == pytest.approx(4 + 2 + 2 + 2 + 2)


def test_bag_without_reports_is_a_clear_error(tmp_path, capsys):
    with BagWriter(tmp_path / "empty", "sqlite3") as bag:
        bag.write(topics.VEHICLE_TWIST, twist_fields(1.0, T0), T0)
    assert cli.main(["interventions", str(tmp_path / "empty"), "--out", str(tmp_path / "report")]) == 2
    assert "no engagement reports" in capsys.readouterr().out
    assert cli.main(["interventions", str(tmp_path / "missing"), "--out", str(tmp_path / "report")]) == 2
