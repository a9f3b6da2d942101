"""`sps-driving interventions BAG`: safety-driver interventions in a recorded field test.

Reads the engagement history from a bag (a rosbag2 folder, sqlite3 or mcap, or a bare .mcap or
.db3 file) without ROS: sps_driving.ros.engagement says which reports it reads. Only a
safety-driver override (pedal or wheel) is an intervention; the other ends of autonomy are
disengagements by cause: a fault, a timeout, or a disable (the operator's button or the stack) with
none of those (core.monitor.AutonomyLog decides, from the reports within CAUSE_WINDOW_S of each).
Prints every engagement and disengagement with its time, cause and the report fields that show it,
the time and distance in autonomy, and interventions per hour and per km (distance from
/vehicle/twist or the PACMod vehicle speed report, when recorded). Times are the bag's log times.
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from sps_driving.ros.engagement import autonomy_log


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bag", type=Path, help="a rosbag2 folder (sqlite3 or mcap), a .mcap file or a .db3 file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def analyze(bag: Path) -> dict:
    log, roles = autonomy_log(bag)
    summary = log.summary()
    summary["bag"] = str(bag)
    summary["sources"] = roles
    return summary


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def format_summary(s: dict) -> str:
    def num(value, fmt):
        return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)

    lines = [f"bag: {s['bag']}", "sources: " + ", ".join(f"{t} ({r})" for t, r in sorted(s["sources"].items()))]
    start = s["transitions"][0]["time_ns"] if s["transitions"] else None
    for t in s["transitions"]:
        what = t["event"] if t["event"] == "engaged" else f"disengaged: {t['cause']} ({', '.join(t['fields'])})"
        if t.get("other_fields"):
            what += f", also seen: {', '.join(t['other_fields'])}"
        lines.append(f"  {_clock(t['time_ns'])}  +{(t['time_ns'] - start) / 1e9:9.2f} s  {what}")
    d = s["disengagements"]
    lines += [
        f"recording:       {s['recording_s']:.1f} s",
        f"in autonomy:     {s['autonomy_s']:.1f} s, {num(s['autonomy_km'], '.3f')} km (of {num(s['total_km'], '.3f')} km driven)",
        f"engagements:     {s['engagements']}",
        f"interventions:   {s['interventions']} (safety-driver overrides)",
        f"disengagements:  fault {d['fault']}, timeout {d['timeout']}, disable {d['disable']} (not interventions;"
        f" cause from the reports within {s['cause_window_s']:.2f} s)",
        f"per hour:        {num(s['interventions_per_hour'], '.2f')} interventions",
        f"per km:          {num(s['interventions_per_km'], '.3f')} interventions",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        summary = analyze(args.bag)
    except ValueError as exc:  # no bag (bagio.BagError), or one without engagement reports
        print(f"error: {exc}")
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
