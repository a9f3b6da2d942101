"""`sps-driving interventions BAG_OR_FOLDER... --out DIR`: the field-test report of a day of drives.

Each input is a bag (a rosbag2 folder, sqlite3 or mcap, or a bare .mcap or .db3 file) or a folder
of them; each bag is one drive, read once (sps_driving.ros.drive). Per drive: its start, duration,
distance (the speed reports integrated), the time and distance the stack drove, and every
intervention with its kind (sps_driving.core.field_report), time, speed, the stack's driving since
the previous one, and the safety driver's note that followed it (topics.DRIVER_NOTE). Over all
drives: engaged km and minutes per intervention, overall and by kind, with the exact Poisson
(Garwood) interval at config/field_report.yaml's confidence, a one-sided bound where there was none.

DIR gets report.md, report.json and figures/: a timeline per drive (speed; the stack's steering
command against the measured steering; engagement shaded; each intervention marked) and a strip
per intervention of the camera frames at the configured offsets before it (only those frames are
decoded), the kept patches outlined where the selection or the descriptors were recorded.

A recording stopped hard (an MCAP file without its end: a power cut, a kill -9 of the recorder)
is read up to its cut from a copy of its whole records (sps_driving.ros.mcap_recovery). A bag
that cannot be read, or is damaged part-way, or lacks the speed, the camera or the engagement
history, is listed with what was read and why the rest was not; the others' report is written all
the same. Exit status 0 when every bag was read whole with all of that, 1 when not,
2 when there was nothing to report on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from sps_driving.core import topics
from sps_driving.core.field_report import (
    REQUESTED_HANDOVER,
    Event,
    Odometer,
    Stop,
    attach_notes,
    drive_events,
    engaged_between,
    fill_since,
    handover_events,
    per_event,
)
from sps_driving.core.resources import config_path, shipped_policy
from sps_driving.ros import bagio
from sps_driving.ros.drive import Drive, read_drive
from sps_driving.ros.mcap_recovery import recover_mcap

CONFIG = config_path("field_report.yaml")
INTERVAL = "exact Poisson (Garwood) on the count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", type=Path, nargs="+", metavar="BAG_OR_FOLDER",
                        help="rosbag2 folders (sqlite3 or mcap), .mcap or .db3 files, or folders of them")
    parser.add_argument("--out", type=Path, help="report folder (default out/interventions/<time>)")
    parser.add_argument("--json", action="store_true", help="print report.json instead of the summary")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the policy whose patch layout the kept patches are drawn in (default the shipped one)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="report settings (default config/field_report.yaml)")


def bag_inputs(inputs: list[Path]) -> list[Path]:
    """The bags named: each input that is a bag, no folder, or a recording cut short (a folder of
    its own storage files, <folder>_N.mcap, without metadata.yaml), else the bags (and what looks
    like one) directly in it, in name order."""
    found = []
    for path in inputs:
        if bagio.is_bag(path) or not path.is_dir() or _cut_short(path):
            found.append(path)
            continue
        inside = [p for p in sorted(path.iterdir()) if bagio.is_bag(p) or p.suffix in bagio.STORAGE_FILES or _cut_short(p)]
        found += inside or [path]  # a folder of no bags is reported as one
    return found


def _cut_short(path: Path) -> bool:
    """A rosbag2 folder whose recording stopped before metadata.yaml was written."""
    stored = [p for p in path.iterdir() if p.suffix in bagio.STORAGE_FILES] if path.is_dir() else []
    return bool(stored) and all(p.stem.rpartition("_")[0] == path.name for p in stored)


def read_up_to_the_cut(bag: Path, error: bagio.BagError, scratch: Path, problems: list[str]) -> Drive | None:
    """The drive of a recording stopped hard (a bare .mcap without its end, or a rosbag2 folder of
    .mcap files without metadata.yaml) from a copy of its whole records (recover_mcap);
    None, with the reason in `problems`, when nothing could be read."""
    sources = [bag] if bag.is_file() and bag.suffix == ".mcap" else sorted(bag.glob("*.mcap")) if _cut_short(bag) else []
    copy = scratch / f"{bagio.bag_name(bag)}.mcap"
    copied = recover_mcap(sources, copy) if sources else 0
    if not copied:
        problems.append(f"nothing read: {error}")
        return None
    try:
        drive = read_drive(copy)
    except bagio.BagError as again:
        problems.append(f"nothing read: {error}; a copy of its {copied} whole messages could not be read either: {again}")
        return None
    problems.append(f"cut short ({error}): read the {copied} whole messages before the cut from a copy with an end "
                    "(`mcap recover` makes a lasting one)")
    return drive


@dataclass
class DriveReport:
    """One drive's part of the report."""

    bag: Path
    drive: Drive | None = None
    events: list[Event] = field(default_factory=list)
    driving: list[tuple[int, int]] = field(default_factory=list)
    loose_notes: list[tuple[int, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    distance_m: float | None = None
    engaged_s: float = 0.0
    engaged_m: float | None = None
    strips: list[dict] = field(default_factory=list)
    timeline: str | None = None

    @property
    def counted(self) -> bool:
        """Whether its engagement history was read (it counts in the totals)."""
        return self.drive is not None and self.drive.engagement is not None

    @property
    def interventions(self) -> list[Event]:
        return [e for e in self.events if e.intervention]


def report_drive(bag: Path, settings: dict, scratch: Path) -> DriveReport:
    """Read one bag and find its events; never raises for a bad bag (its problems say why). A
    recording stopped hard is read up to its cut from a copy in `scratch`."""
    out = DriveReport(bag)
    try:
        drive = out.drive = read_drive(bag)
    except bagio.BagError as error:
        drive = out.drive = read_up_to_the_cut(bag, error, scratch, out.problems)
        if drive is None:
            return out
    out.problems += [f"read {drive.messages_read} messages ({drive.duration_s():.1f} s), then: {p}" for p in drive.problems]
    speed = drive.speed
    odometer = Odometer(speed.log_ns, speed.values[:, 0]) if speed is not None and len(speed) else None
    if odometer is None:
        out.problems.append(f"no speed reports ({topics.VEHICLE_TWIST} or {topics.PACMOD_SPEED_RPT}): distances unknown")
    else:
        out.distance_m = float(odometer.metres[-1])
    if drive.camera is None:
        out.problems.append(f"no camera ({topics.IMAGE} or {topics.IMAGE_COMPRESSED}): no frame strips")
    if drive.engagement is None:
        from sps_driving.ros.engagement import EngagementReader

        out.problems.append(f"{EngagementReader.missing('the bag')}: no interventions counted")
        return out
    stops = [Stop(s.time_ns, s.source, s.reasons) for s in drive.stops]
    window_ns = int(settings["stop_failure_window_s"] * 1e9)
    out.events, out.driving = drive_events(drive.engagement.transitions, stops, drive.failures, drive.end_ns, window_ns)
    out.events = sorted(out.events + handover_events(drive.handovers), key=lambda e: e.time_ns)
    fill_since(out.events, out.driving, odometer, drive.start_ns)
    out.loose_notes = attach_notes(out.events, [(n.time_ns, n.text) for n in drive.notes], int(settings["note_window_s"] * 1e9))
    out.engaged_s, out.engaged_m = engaged_between(out.driving, odometer, drive.start_ns, drive.end_ns)
    return out


def counts_by_kind(events: list[Event]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for event in events:
        if event.intervention:
            kinds[event.kind] = kinds.get(event.kind, 0) + 1
    return dict(sorted(kinds.items()))


def rates(engaged_s: float, events: list[Event], engaged_m: float | None, distance_events: list[Event],
          confidence: float) -> dict:
    """Minutes per intervention over `events` and km per intervention over `distance_events` (those
    of the drives whose distance is known), overall and by kind, with their intervals."""
    km = None if engaged_m is None else engaged_m / 1000.0
    by_kind, by_kind_km = counts_by_kind(events), counts_by_kind(distance_events)

    def row(kind):
        count, km_count = (sum(by_kind.values()), sum(by_kind_km.values())) if kind is None else (
            by_kind.get(kind, 0), by_kind_km.get(kind, 0))
        return {"count": count, "km_per": per_event(km, km_count, confidence),
                "min_per": per_event(engaged_s / 60.0, count, confidence)}

    return {"all": row(None), **{kind: row(kind) for kind in by_kind}}


def _clock(ns: int | None) -> str:
    if ns is None:
        return "n/a"
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S") + " UTC"


def drive_json(d: DriveReport, confidence: float) -> dict:
    drive = d.drive
    return {
        "bag": str(d.bag), "name": bagio.bag_name(d.bag) if d.bag.exists() else d.bag.name,
        "read_whole": not d.problems, "problems": d.problems,
        "start_ns": drive.start_ns if drive else None, "start": _clock(drive.start_ns if drive else None),
        "duration_s": drive.duration_s() if drive else 0.0,
        "distance_km": None if d.distance_m is None else d.distance_m / 1000.0,
        "engaged_s": d.engaged_s, "engaged_km": None if d.engaged_m is None else d.engaged_m / 1000.0,
        "counted": d.counted,
        "engagement_sources": drive.engagement_sources if drive else {},
        "events": [e.as_dict() for e in d.events],
        "notes_not_following_an_event": [{"time_ns": t, "text": text} for t, text in d.loose_notes],
        "rates": rates(d.engaged_s, d.events, d.engaged_m, d.events, confidence) if d.counted else None,
        "timeline": d.timeline, "strips": d.strips,
    }


def totals_json(reports: list[DriveReport], confidence: float) -> dict:
    """Over the drives with an engagement history; distances over those of them whose speed is known."""
    counted = [d for d in reports if d.counted]
    measured = [d for d in counted if d.engaged_m is not None]
    engaged_s = sum(d.engaged_s for d in counted)
    engaged_m = sum(d.engaged_m for d in measured) if measured else None
    events = [e for d in counted for e in d.events]
    return {
        "drives": len(reports), "drives_counted": len(counted), "drives_with_distance": len(measured),
        "engaged_s": engaged_s, "engaged_km": None if engaged_m is None else engaged_m / 1000.0,
        "requested_handovers": sum(e.kind == REQUESTED_HANDOVER for e in events),
        "distance_km": sum(d.distance_m for d in measured) / 1000.0 if measured else None,
        "rates": rates(engaged_s, events, engaged_m, [e for d in measured for e in d.events], confidence),
    }


def build_report(inputs: list[Path], out: Path, settings: dict, checkpoint: Path | None) -> dict:
    """Read every bag, draw the figures into out/figures, and return report.json's content."""
    from sps_driving.tools.field_figures import draw_strips, draw_timeline

    figures = out / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    # Copies of recordings cut short, on the report's disk (they are as large as the bags), until the figures are drawn.
    with tempfile.TemporaryDirectory(prefix=".cut_short_", dir=out) as scratch:
        reports = [report_drive(bag, settings, Path(scratch)) for bag in bag_inputs(inputs)]
        for index, d in enumerate(reports):
            if d.drive is None or d.drive.start_ns is None:
                continue
            stem = f"{index:02d}_{d.drive.name}"
            d.timeline = draw_timeline(d, figures / f"{stem}_timeline.png", settings)
            if d.drive.camera is not None:
                d.strips = draw_strips(d, figures, stem, settings, checkpoint or shipped_policy())
    confidence = float(settings["confidence"])
    return {
        "confidence": confidence, "interval": INTERVAL, "all_read": all(not d.problems for d in reports),
        "totals": totals_json(reports, confidence), "drives": [drive_json(d, confidence) for d in reports],
    }


def load_settings(path: Path = CONFIG) -> dict:
    settings = yaml.safe_load(Path(path).read_text())
    if not 0 < float(settings["confidence"]) < 1:
        raise ValueError(f"{path}: confidence must lie in (0, 1)")
    return settings


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}")
        return 2
    out = args.out or Path("out") / "interventions" / datetime.now().strftime("%Y%m%d-%H%M%S")
    report = build_report(args.inputs, out, settings, args.checkpoint)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    from sps_driving.tools.field_figures import summary_tables, write_markdown

    write_markdown(report, out / "report.md")
    print(json.dumps(report, indent=2) if args.json else summary_tables(report) + f"\nreport: {out / 'report.md'}")
    if not report["totals"]["drives_counted"]:
        return 2
    return 0 if report["all_read"] else 1
