"""`sps-driving faults`: the measurement itself (stop set, reaction time, hold, unsafe frames) on
made-up frames, and the short form of the matrix against the live graph: the PACMod 3 stand-in,
vehicle_interface (pacmod3 backend, generated pacmod3_msgs), failsafe, safety_monitor and
camera_driver as real processes over DDS. The whole matrix (also the perception nodes) is
`sps-driving faults`; its table is docs/results/faults.md."""

import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sps_driving.core.control import ControlLimits
from sps_driving.sim.pacmod import Sent
from sps_driving.tools import faults

LIMITS = ControlLimits()
RATIO = 14.8


def frame(t, accel=0.0, brake=0.0, enable=True, steering=0.0):
    systems = ("steering", "accel", "brake", "turn")
    return Sent(t, {s: enable for s in systems}, {"steering": steering, "accel": accel, "brake": brake, "turn": 1.0})


def test_measure_finds_the_stop_and_counts_what_follows():
    driving = [frame(0.033 * i, accel=0.2) for i in range(10)]  # the fault is at t = 0.1
    braking = [frame(0.33 + 0.033 * i, brake=LIMITS.stop_brake) for i in range(20)]
    row = faults.measure(driving + braking, 0.1, 2.0, LIMITS, RATIO)
    assert row["stopped"] and row["held"] and row["unsafe_commands"] == 0
    assert row["time_to_stop_s"] == pytest.approx(0.23) and row["end_state"] == "brake held"
    # The accelerator comes back after the stop: not held, each such frame unsafe.
    again = [frame(1.0 + 0.033 * i, accel=0.1) for i in range(3)]
    row = faults.measure(driving + braking + again, 0.1, 2.0, LIMITS, RATIO)
    assert row["stopped"] and not row["held"] and row["unsafe_commands"] == 3
    # Disabled is a stop too (the car is the safety driver's); a frame over the limits is unsafe anywhere.
    handed_over = [frame(0.2, enable=False), frame(0.25, enable=False, accel=0.9)]
    row = faults.measure([frame(0.15, steering=math.nan)] + handed_over, 0.1, 2.0, LIMITS, RATIO)
    assert row["end_state"] == "manual (disabled)" and row["unsafe_commands"] == 2
    # No stop at all: every frame in the window is unsafe.
    row = faults.measure(driving, 0.1, 2.0, LIMITS, RATIO)
    assert not row["stopped"] and row["unsafe_commands"] == 6


def test_selecting_faults():
    assert sorted(f.name for f in faults.select(True, None)) == sorted(faults.SHORT)
    assert len(faults.select(False, None)) == len(faults.FAULTS)
    with pytest.raises(ValueError, match="unknown faults"):
        faults.select(False, ["kill -9 nobody"])


def test_stage_summary_names_the_stage_that_went_quiet():
    stages = {"selection": (9.5, "frame"), "extractor": (0.0, "dropped: no selection")}
    assert faults.stage_summary(stages, 10.0) == (
        "selection 0.5 s ago (frame), extractor 10.0 s ago (dropped: no selection), policy never")


def test_a_run_passes_if_it_stopped_held_drove_again_and_the_failsafe_took_over_only_if_it_had_to():
    good = {"fault": "override", "graph": "vehicle", "stopped": True, "held": True, "unsafe_commands": 0, "recovered": True,
            "failsafe_trips": 0}
    assert faults.passed(good)
    assert not faults.passed({**good, "recovered": False})
    assert not faults.passed({**good, "failsafe_trips": 1})  # a false takeover
    assert faults.passed({**good, "fault": "kill -9 vehicle_interface", "failsafe_trips": 1})
    rows = [{**good, "time_to_stop_s": 0.1, "time_to_drive_again_s": 5.0},
            {**good, "time_to_stop_s": 0.3, "time_to_drive_again_s": 7.0, "recovered": False}]
    summary, = faults.summarize(rows)
    assert summary["runs"] == 2 and summary["passed"] == 1 and summary["recovered"] == 1
    assert summary["time_to_stop_s"] == {"median": 0.2, "worst": 0.3}


@pytest.mark.ros
def test_short_fault_matrix_ends_every_fault_in_a_held_stop_and_drives_again(tmp_path):
    rows = faults.run_matrix(faults.select(True, None), hold_s=1.5, log_dir=tmp_path, progress=lambda _line: None)
    assert sorted(r["fault"] for r in rows) == sorted(faults.SHORT)
    for row in rows:
        assert row["stopped"] and row["held"] and row["unsafe_commands"] == 0, row
        assert row["time_to_stop_s"] <= row["stop_deadline_s"] <= 0.5 + faults.STOP_MARGIN_S, row
        assert row["recovered"] and row["time_to_drive_again_s"] < faults.RECOVERY_TIMEOUT_S, row
        assert faults.passed(row), row
    by_name = {r["fault"]: r for r in rows}
    assert by_name["kill -9 vehicle_interface"]["end_state"] == "brake held"  # the failsafe took over
    assert by_name["kill -9 vehicle_interface"]["failsafe_trips"] == 1
    # Its supervisor started the safety monitor again (4 s after the kill), not the harness.
    assert "safety_monitor exited (killed by SIGKILL); starting it again" in (tmp_path / "vehicle" / "safety_monitor.log").read_text()
    assert "failsafe stopping" in by_name["kill -9 vehicle_interface"]["vehicle_interface"]
    assert by_name["override"]["end_state"] == "manual (disabled)"
    assert "duplicate_publisher" in by_name["second stop-request publisher"]["vehicle_interface"]
    assert "clock_jump" in by_name["clock step backwards"]["vehicle_interface"]
    assert "gear_not_forward" in by_name["shift to reverse"]["vehicle_interface"]
    assert "duplicate_publisher" in by_name["second speed-report publisher"]["vehicle_interface"]


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_busy_processes_end_with_a_killed_run():
    script = textwrap.dedent("""
        import time
        from sps_driving.tools.faults import Load
        with Load(2, 60.0) as load:
            print(" ".join(str(p.pid) for p in load.processes), flush=True)
            time.sleep(60)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in run.stdout.readline().split()]
    assert len(pids) == 2 and all(running(pid) for pid in pids)
    run.kill()  # SIGKILL: no __exit__ runs
    run.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(running(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids)
