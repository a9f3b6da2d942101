"""The field-test report of a folder of generated drives (sps_driving.tools.field_bags): real rosbag2
files (mcap and sqlite3 folders, a bare .mcap) with engagements, overrides of each kind, the
stops, a PACMod fault, the safety driver's notes, a drive without speed and a corrupt bag; the
report's counts, distances and times against what the generator put in, the intervals against a
hand computation, the frames of each strip at the stated offsets."""

import json
import shutil

import cv2
import numpy as np
import pytest

from sps_driving import cli
from sps_driving.core.field_report import garwood, per_event
from sps_driving.ros.drive import read_drive
from sps_driving.tools.field_bags import Engagement, Plan, S, corrupt, write_drive

DRIVE_A = Plan(70.0, [
    Engagement(2, 12, "override_brake"), Engagement(15, 25, "override_steering"), Engagement(28, 38, "override_accel"),
    Engagement(40, 50, "operator_disengage"), Engagement(55, None)],
    notes=[(12.5, "precautionary"), (51.0, "end of the loop"), (1.0, "starting")])
DRIVE_B = Plan(60.0, [
    Engagement(1, 11, "failsafe_stop"), Engagement(16, 24, "safety_stop:lane_boundary"), Engagement(29, 37, "stale_input"),
    Engagement(42, 50, "pacmod_fault")], speed_mps=8.0, storage="sqlite3", notes=[(51.0, "system")])
DRIVE_C = Plan(30.0, [Engagement(3, None)], speed_mps=6.0, handovers=[10.0, 20.0])  # no intervention; two OOD handover requests
NO_SPEED = Plan(20.0, [Engagement(2, 10, "override_brake")], speed_reports=False, camera=None)


@pytest.fixture(scope="module")
def day(tmp_path_factory):
    root = tmp_path_factory.mktemp("field")
    folder = root / "day"
    folder.mkdir()
    expected = {"a": write_drive(folder / "a", DRIVE_A), "b": write_drive(folder / "b", DRIVE_B)}
    expected["c"] = write_drive(root / "c", DRIVE_C)
    shutil.move(next((root / "c").glob("*.mcap")), folder / "c.mcap")  # a bare storage file
    expected["d_no_speed"] = write_drive(folder / "d_no_speed", NO_SPEED)
    write_drive(root / "e", Plan(20.0, [Engagement(2, 10, "override_brake")]))
    shutil.move(next((root / "e").glob("*.mcap")), folder / "e_corrupt.mcap")
    corrupt(folder / "e_corrupt.mcap", "garble")
    (folder / "e_corrupt.mcap").write_bytes((folder / "e_corrupt.mcap").read_bytes()[:20_000])  # and cut before its first message
    out = root / "report"
    code = cli.main(["interventions", str(folder), "--out", str(out)])
    return expected, json.loads((out / "report.json").read_text()), out, code, folder


def drives_by_name(report):
    return {d["name"]: d for d in report["drives"]}


def test_counts_times_and_distances_match_the_generator(day):
    expected, report, _, _, _ = day
    drives = drives_by_name(report)
    assert sorted(drives) == ["a", "b", "c", "d_no_speed", "e_corrupt"]
    for name in ("a", "b", "c"):
        got, want = drives[name], expected[name]
        interventions = [e for e in got["events"] if e["intervention"]]
        assert [(e["kind"], e["time_ns"]) for e in interventions] == [(e["kind"], e["time_ns"]) for e in want.events]
        for g, w in zip(interventions, want.events):
            assert g["engaged_s_since"] == pytest.approx(w["engaged_s_since"], abs=1e-6)
            assert g["engaged_m_since"] == pytest.approx(w["engaged_m_since"], abs=0.01)  # speed reported at 30 Hz
        disengagements = [e for e in got["events"] if e["kind"] == "operator_disengage"]
        assert [e["time_ns"] for e in disengagements] == [d["time_ns"] for d in want.disengagements]
        assert got["engaged_s"] == pytest.approx(want.engaged_s, abs=1e-6)
        assert got["engaged_km"] * 1000 == pytest.approx(want.engaged_m, abs=0.05)
        assert got["distance_km"] * 1000 == pytest.approx(want.distance_m, rel=2e-3)
        assert got["read_whole"] and not got["problems"]
    t = report["totals"]
    kinds = {k: v["count"] for k, v in t["rates"].items()}
    assert kinds == {"all": 8, "failsafe_stop": 1, "override_accel": 1, "override_brake": 2, "override_steering": 1,
                     "pacmod_fault": 1, "safety_stop:lane_boundary": 1, "stale_input": 1}
    assert t["drives"] == 5 and t["drives_counted"] == 4 and t["drives_with_distance"] == 3
    with_speed = sum(expected[n].engaged_m for n in "abc")
    assert t["engaged_km"] * 1000 == pytest.approx(with_speed, abs=0.1)
    assert t["engaged_s"] == pytest.approx(sum(expected[n].engaged_s for n in ("a", "b", "c", "d_no_speed")), abs=1e-5)
    # km per intervention counts the drives with speed only: 7 of the 8 interventions
    km = t["engaged_km"]
    assert t["rates"]["all"]["km_per"]["value"] == pytest.approx(km / 7)


def test_intervals_against_a_hand_computation(day):
    # Garwood 95%: k = 7 -> [2.8143, 14.423]; k = 1 -> [0.025318, 5.5716]; k = 0: one-sided 95% bound -ln(0.05) = 2.9957
    assert garwood(7, 0.95) == pytest.approx((2.8143, 14.423), rel=1e-4)
    assert garwood(1, 0.95) == pytest.approx((0.025318, 5.5716), rel=1e-4)
    assert per_event(10.0, 0, 0.95)["at_least"] == pytest.approx(10.0 / 2.9957, rel=1e-4)
    _, report, _, _, _ = day
    t = report["totals"]
    km = t["rates"]["all"]["km_per"]
    assert (km["low"], km["high"]) == pytest.approx((t["engaged_km"] / 14.423, t["engaged_km"] / 2.8143), rel=1e-4)
    minutes = t["rates"]["failsafe_stop"]["min_per"]
    engaged_min = t["engaged_s"] / 60
    assert (minutes["value"], minutes["low"], minutes["high"]) == pytest.approx(
        (engaged_min, engaged_min / 5.5716, engaged_min / 0.025318), rel=1e-4)
    c = drives_by_name(report)["c"]["rates"]["all"]
    assert c["count"] == 0 and c["km_per"]["one_sided"]
    assert c["km_per"]["at_least"] == pytest.approx(drives_by_name(report)["c"]["engaged_km"] / 2.9957, rel=1e-4)


def test_strip_frames_at_the_stated_offsets(day):
    expected, report, out, _, _ = day
    for name in ("a", "b"):
        d = drives_by_name(report)[name]
        frames = np.asarray(expected[name].frame_log_ns)
        interventions = [e for e in d["events"] if e["intervention"]]
        assert len(d["strips"]) == len(interventions)
        for strip, event in zip(d["strips"], interventions):
            assert strip["event_time_ns"] == event["time_ns"]
            assert [f["offset_s"] for f in strip["frames"]] == [-2.0, -1.0, -0.0]
            for f in strip["frames"]:
                target = event["time_ns"] + f["offset_s"] * S
                want = frames[frames <= target][-1]  # the last frame logged at or before the time
                assert f["log_ns"] == want and f["stamp_ns"] == want
                assert f["kept_patches"] == 144  # the recorded selection, half of 12 x 24
            image = cv2.imread(str(out / "figures" / strip["file"]))
            assert image is not None and image.shape[0] == 200 and image.shape[1] > 3 * 200
        assert d["timeline"] and (out / "figures" / d["timeline"]).is_file()


def test_handover_requests_are_listed_and_counted_apart_from_interventions(day):
    expected, report, out, _, _ = day
    c = drives_by_name(report)["c"]
    requests = [e for e in c["events"] if e["kind"] == "requested_handover"]
    assert [e["time_ns"] for e in requests] == [DRIVE_C.start_ns + int(s * S) for s in DRIVE_C.handovers]
    assert not any(e["intervention"] for e in requests) and c["rates"]["all"]["count"] == 0
    assert report["totals"]["requested_handovers"] == 2
    assert "requested_handover (not counted)" in (out / "report.md").read_text()


def test_notes_beside_the_event_they_follow(day):
    _, report, out, _, _ = day
    a, b = drives_by_name(report)["a"], drives_by_name(report)["b"]
    noted = {e["kind"]: e["note"] for e in a["events"] if e["note"]}
    assert noted == {"override_brake": "precautionary", "operator_disengage": "end of the loop"}
    assert [n["text"] for n in a["notes_not_following_an_event"]] == ["starting"]
    assert [e["note"] for e in b["events"] if e["note"]] == ["system"]
    assert [e["kind"] for e in b["events"] if e["note"]] == ["pacmod_fault"]
    markdown = (out / "report.md").read_text()
    assert "| precautionary |" in markdown and "| system |" in markdown


def test_bad_bags_are_listed_and_do_not_sink_the_report(day):
    _, report, out, code, _ = day
    drives = drives_by_name(report)
    bad = drives["e_corrupt"]
    assert not bad["read_whole"] and not bad["counted"]
    assert bad["problems"] and "nothing read" in bad["problems"][0]
    no_speed = drives["d_no_speed"]
    assert no_speed["counted"] and no_speed["engaged_km"] is None and no_speed["distance_km"] is None
    assert any("no speed reports" in p for p in no_speed["problems"]) and any("no camera" in p for p in no_speed["problems"])
    assert [e["kind"] for e in no_speed["events"]] == ["override_brake"]
    assert not report["all_read"] and code == 1
    markdown = (out / "report.md").read_text()
    assert "## Bags not read whole" in markdown and "e_corrupt" in markdown


def test_printed_summary_and_exit_status_of_good_bags(day, tmp_path, capsys):
    _, _, _, _, folder = day
    assert cli.main(["interventions", str(folder / "a"), str(folder / "c.mcap"), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    assert "| override_brake | 1 |" in printed and "| a |" in printed and "| c |" in printed
    assert cli.main(["interventions", str(tmp_path / "missing"), "--out", str(tmp_path / "r2")]) == 2
    assert "nothing read" in capsys.readouterr().out


def test_a_drive_damaged_part_way_keeps_what_came_before(tmp_path, capsys):
    plan = Plan(40.0, [Engagement(2, 10, "override_brake"), Engagement(20, 30, "override_steering")])
    write_drive(tmp_path / "drive", plan)
    whole = read_drive(tmp_path / "drive")
    corrupt(next((tmp_path / "drive").glob("*.mcap")), "garble")
    damaged = read_drive(tmp_path / "drive")
    assert whole.complete and not damaged.complete
    assert 0 < damaged.messages_read < whole.messages_read and "after message" in damaged.problems[0]
    assert damaged.end_ns < whole.end_ns and damaged.engagement is not None
    assert cli.main(["interventions", str(tmp_path / "drive"), "--out", str(tmp_path / "r"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    drive = report["drives"][0]
    assert drive["counted"] and not drive["read_whole"]
    assert drive["problems"][0].startswith(f"read {damaged.messages_read} messages")
    assert drive["duration_s"] == pytest.approx(damaged.duration_s())


@pytest.mark.parametrize("as_stopped", ["bare file", "folder without metadata.yaml"])
def test_a_recording_stopped_hard_is_read_up_to_its_cut(tmp_path, capsys, as_stopped):
    # Cut at half its bytes: no summary, no end magic, the last chunk in two. Its whole records are
    # read; the events before the cut are those of the whole drive up to there.
    plan = Plan(40.0, [Engagement(2, 8, "override_brake"), Engagement(10, 30, "override_steering")])
    expected = write_drive(tmp_path / "drive", plan)
    (storage,) = (tmp_path / "drive").glob("*.mcap")
    whole = read_drive(tmp_path / "drive")
    if as_stopped == "bare file":
        bag = tmp_path / "stopped.mcap"
        shutil.copy(storage, bag)
    else:
        bag = tmp_path / "stopped"
        bag.mkdir()
        shutil.copy(storage, bag / "stopped_0.mcap")
    corrupt(next(bag.glob("*.mcap")) if bag.is_dir() else bag)
    assert cli.main(["interventions", str(bag), "--out", str(tmp_path / "r"), "--json"]) == 1
    (drive,) = json.loads(capsys.readouterr().out)["drives"]
    assert drive["counted"] and not drive["read_whole"] and "cut short" in drive["problems"][0]
    assert 0.25 * plan.duration_s < drive["duration_s"] < 0.75 * plan.duration_s
    assert [(e["kind"], e["time_ns"]) for e in drive["events"] if e["intervention"]] == [
        (e["kind"], e["time_ns"]) for e in expected.events if e["time_ns"] <= whole.start_ns + drive["duration_s"] * S]
    assert [e["kind"] for e in drive["events"] if e["intervention"]][:1] == ["override_brake"]
    assert drive["strips"] and all((tmp_path / "r" / "figures" / strip["file"]).is_file() for strip in drive["strips"])
    assert all("why" not in frame for strip in drive["strips"] for frame in strip["frames"])  # decoded from the copy
    assert not list((tmp_path / "r").glob(".cut_short_*"))  # the copy is gone with the report written


def test_kinds_of_stops_and_overrides():
    from sps_driving.core.field_report import Stop, override_kind, stop_kind

    window = S
    assert stop_kind(Stop(10 * S, "safety_monitor", ("collision,heading; stale: lane",)), [], window) == "safety_stop:collision"
    assert stop_kind(Stop(10 * S, "safety_monitor", ("stale: lane",)), [], window) == "safety_stop:stale_input"
    # the vehicle interface's own view of a monitor stop takes the failure logged just before it
    assert stop_kind(Stop(10 * S, "vehicle_interface", ("safety_stop",)), [(int(9.5 * S), "heading")], window) == "safety_stop:heading"
    assert stop_kind(Stop(10 * S, "vehicle_interface", ("safety_stop",)), [(5 * S, "heading")], window) == "safety_stop:unknown"
    assert stop_kind(Stop(10 * S, "vehicle_interface", ("report_timeout", "overspeed")), [], window) == "stale_input"
    assert stop_kind(Stop(10 * S, "vehicle_interface", ("overspeed",)), [], window) == "controlled_stop:overspeed"
    assert stop_kind(Stop(10 * S, "vehicle_interface", ("failsafe_active",)), [], window) == "failsafe_stop"
    assert override_kind(("/pacmod/global_rpt: override_active", "/pacmod/accel_rpt: override_active")) == "override_accel"
    assert override_kind(("/diagnostics vehicle_interface: last_event=override",)) == "override"
