"""`sps-driving interventions BAG`: safety-driver interventions in a recorded field test.

Reads the drive-by-wire state from a rosbag2 (sqlite3 or mcap) without ROS: PACMod 3 reports
(`pacmod3_msgs/GlobalRpt` enabled + override, every `SystemRptFloat` report's override flag, the
`std_msgs/Bool` on /pacmod/enabled) or, on cars run with the `topics` backend, the vehicle
interface's status. Prints every engage / override / disable with its time, the time and distance
in autonomy, and interventions per hour and per km (distance from /vehicle/twist or the PACMod
vehicle speed report, when recorded). Times are the bag's log times.
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from sps_driving import topics
from sps_driving.core.monitor import AutonomyLog

GLOBAL_RPT = "pacmod3_msgs/msg/GlobalRpt"
SYSTEM_RPT = "pacmod3_msgs/msg/SystemRptFloat"
SPEED_RPT = "pacmod3_msgs/msg/VehicleSpeedRpt"
BOOL = "std_msgs/msg/Bool"
TWIST = "geometry_msgs/msg/TwistStamped"
DIAGNOSTICS = "diagnostic_msgs/msg/DiagnosticArray"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bag", type=Path, help="rosbag2 folder (sqlite3 or mcap)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def selected_topics(types: dict[str, str]) -> dict[str, str]:
    """{topic: role} of the topics that carry engagement or speed."""
    roles = {}
    for topic, msgtype in types.items():
        if msgtype == GLOBAL_RPT:
            roles[topic] = "global"
        elif msgtype == SYSTEM_RPT:
            roles[topic] = "system"
        elif msgtype == SPEED_RPT:
            roles[topic] = "speed_rpt"
        elif msgtype == BOOL and topic == topics.PACMOD_ENABLED:
            roles[topic] = "enabled"
        elif msgtype == TWIST and topic == topics.VEHICLE_TWIST:
            roles[topic] = "twist"
    if not any(r in ("global", "system", "enabled") for r in roles.values()) and types.get(topics.VEHICLE_STATUS) == DIAGNOSTICS:
        roles[topics.VEHICLE_STATUS] = "vehicle_interface"
    # One speed source: the twist when both are recorded.
    if "twist" in roles.values():
        roles = {t: r for t, r in roles.items() if r != "speed_rpt"}
    return roles


def analyze(bag: Path) -> dict:
    from sps_driving.bagio import read_messages, topic_types
    from sps_driving.msgs import diagnostic_values

    roles = selected_topics(topic_types(bag))
    if not any(r in ("global", "system", "enabled", "vehicle_interface") for r in roles.values()):
        raise ValueError(
            f"{bag} has no engagement reports: expected {GLOBAL_RPT}, {SYSTEM_RPT}, {BOOL} on {topics.PACMOD_ENABLED} "
            f"or the vehicle interface status on {topics.VEHICLE_STATUS}"
        )
    from tqdm import tqdm

    log = AutonomyLog()
    for item in tqdm(read_messages(bag, topics=list(roles)), desc="reading reports", unit="msg", disable=None):
        role, msg, t = roles[item.topic], item.msg, item.log_time_ns
        if role == "global":
            log.on_report(t, item.topic, bool(msg.enabled), bool(msg.override_active))
        elif role == "system":
            log.on_report(t, item.topic, None, bool(msg.override_active))
        elif role == "enabled":
            log.on_report(t, item.topic, bool(msg.data), None)
        elif role == "vehicle_interface":
            for name, _, _, values in diagnostic_values(msg):
                if "engagement" in values:
                    engaged = values["engagement"] == "engaged"
                    overridden = not engaged and values.get("last_event") == "override"
                    log.on_report(t, item.topic, engaged or overridden, overridden)
        elif role == "twist":
            log.on_speed(t, float(msg.twist.linear.x))
        elif role == "speed_rpt" and msg.vehicle_speed_valid:
            log.on_speed(t, float(msg.vehicle_speed))
    log.finish()
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
        lines.append(f"  {_clock(t['time_ns'])}  +{(t['time_ns'] - start) / 1e9:9.2f} s  {t['event']}")
    lines += [
        f"recording:       {s['recording_s']:.1f} s",
        f"in autonomy:     {s['autonomy_s']:.1f} s, {num(s['autonomy_km'], '.3f')} km (of {num(s['total_km'], '.3f')} km driven)",
        f"interventions:   {s['interventions']} ({s['overrides']} overrides, {s['disables']} disables), "
        f"{s['engagements']} engagements",
        f"per hour:        {num(s['interventions_per_hour'], '.2f')}",
        f"per km:          {num(s['interventions_per_km'], '.3f')}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.bag.exists():
        print(f"no bag at {args.bag}")
        return 2
    try:
        summary = analyze(args.bag)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
