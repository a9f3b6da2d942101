"""The field-test report's figures and text (`sps-driving interventions`): a drive's timeline, the
frame strip before each intervention, the printed summary and report.md, rendered from what
sps_driving.tools.interventions found."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import cv2
import numpy as np

from sps_driving.core import topics
from sps_driving.core.image import ImageError
from sps_driving.core.overlay import FrameOverlay, frame_strip

PLOT_POINTS = 4000  # at most this many points a curve (a drive of an hour has 100,000 reports a topic)
MISSING_TILE = (600, 960)  # px (height, width) of the dark tile where a strip has no frame and no other frame says the size


def _num(value, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def rate_text(rate: dict, unit: str) -> str:
    """"12.30 km [4.50, 67.80]", ">= 9.90 km (none; one-sided)" or "n/a"."""
    if rate.get("one_sided"):
        return f">= {_num(rate['at_least'], '.2f')} {unit} (none; one-sided)"
    if rate["value"] is None:
        return "n/a"
    return f"{_num(rate['value'], '.2f')} {unit} [{_num(rate['low'], '.2f')}, {_num(rate['high'], '.2f')}]"


def _thin(t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step = max(1, len(t) // PLOT_POINTS)
    return t[::step], v[::step]


def steering_ratio() -> float:
    from sps_driving.ros.graph import car_facts

    return float(car_facts()["steering_ratio"])


def draw_timeline(d, path: Path, settings: dict) -> str:
    """Speed, the stack's steering command against the measured steering (road-wheel rad), the
    stack's driving shaded and each event marked with its kind; returns the file's name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drive, t0 = d.drive, d.drive.start_ns
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(settings["timeline_width_in"], settings["timeline_height_in"]))
    if drive.speed is not None:
        top.plot(*_thin((drive.speed.log_ns - t0) / 60e9, drive.speed.values[:, 0]), color="k", lw=0.8, label="speed")
    top.set_ylabel("speed (m/s)")
    command = drive.series.get(topics.POLICY_COMMAND) or drive.series.get(topics.ACTUATION)
    if command is not None:
        bottom.plot(*_thin((command.log_ns - t0) / 60e9, command.values[:, 0]), lw=0.8, label="stack's command")
    measured = drive.series.get(topics.PACMOD_STEERING_RPT)
    if measured is not None:
        bottom.plot(*_thin((measured.log_ns - t0) / 60e9, measured.values[:, 0] / steering_ratio()), lw=0.8,
                    label="measured (steering_rpt / ratio)")
    bottom.set_ylabel("road-wheel angle (rad)")
    bottom.set_xlabel("minutes since the drive's start")
    for axis in (top, bottom):
        for a, b in d.driving:
            axis.axvspan((a - t0) / 60e9, (b - t0) / 60e9, color="tab:green", alpha=0.15, lw=0)
        for event in d.events:
            axis.axvline((event.time_ns - t0) / 60e9, color="tab:red" if event.intervention else "tab:gray", lw=1)
    for event in d.events:
        top.annotate(event.kind, ((event.time_ns - t0) / 60e9, 1.0), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=7)
    if bottom.lines:
        bottom.legend(loc="lower left", fontsize=7)
    top.set_title(f"{drive.name}: engaged (green), interventions (red), other disengagements (gray)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=settings["figure_dpi"])
    plt.close(fig)
    return path.name


def policy_layout(checkpoint: Path) -> tuple[list | None, tuple[int, int], tuple[int, int]] | None:
    """(roi, input size, grid) a policy's patches lie on, from its config.json; None without one."""
    config_file = Path(checkpoint) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    grid = (int(config["grid"]["rows"]), int(config["grid"]["cols"]))
    extractor = config.get("extractor") or {}
    return extractor.get("roi"), tuple(extractor.get("input_size") or grid), grid


def overlay_for(layout, kept: tuple[np.ndarray, tuple[int, int] | None]) -> FrameOverlay | None:
    """Where kept patches lie: the policy's layout when its grid is the recorded one, else the recorded
    grid over the whole frame; None when the indices fit neither."""
    indices, grid = kept
    if layout is not None and (grid is None or tuple(grid) == layout[2]):
        overlay = FrameOverlay(*layout)
    elif grid is not None:
        overlay = FrameOverlay(None, tuple(grid), tuple(grid))
    else:
        return None
    rows, cols = overlay.grid_shape
    return overlay if not len(indices) or int(np.max(indices)) < rows * cols else None


def _strip_tile(camera, frame, layout, settings: dict) -> tuple[np.ndarray | None, dict]:
    """(the frame drawn with its kept patches, or None, and what the report says of it)."""
    if frame is None:
        return None, {"frame": None, "why": f"no frame within {settings['frame_search_s']} s before"}
    info = {"log_ns": frame.log_ns, "stamp_ns": frame.stamp_ns}
    try:
        rgb = frame.rgb()
    except ImageError as error:
        return None, {**info, "why": str(error)}
    kept = camera.kept_patches(frame, int(settings["kept_search_s"] * 1e9))
    overlay = None if kept is None else overlay_for(layout, kept)
    info["kept_patches"] = None if overlay is None else len(kept[0])
    return (rgb if overlay is None else overlay.draw(rgb, kept[0])), info


def draw_strips(d, figures: Path, stem: str, settings: dict, checkpoint: Path) -> list[dict]:
    """One PNG per intervention: the camera frames at the configured offsets before it; returns what
    each strip holds."""
    camera, layout, strips = d.drive.camera, policy_layout(checkpoint), []
    offsets = [float(o) for o in settings["strip_offsets_s"]]
    search_ns = int(settings["frame_search_s"] * 1e9)
    for number, event in enumerate(d.interventions):
        frames = camera.at([event.time_ns - int(round(o * 1e9)) for o in offsets], search_ns)
        drawn = [_strip_tile(camera, frame, layout, settings) for frame in frames]
        shape = next((tile.shape for tile, _ in drawn if tile is not None), (*MISSING_TILE, 3))
        tiles = [tile if tile is not None else np.full(shape, 32, np.uint8) for tile, _ in drawn]
        captions = [f"-{o:g} s" + ("" if tile is not None else " (no frame)") + f"\n{event.kind}" for o, (tile, _) in zip(offsets, drawn)]
        name = f"{stem}_strip{number:02d}.png"
        strip = frame_strip(tiles, captions, int(settings["strip_height_px"]))
        cv2.imwrite(str(figures / name), cv2.cvtColor(strip, cv2.COLOR_RGB2BGR))
        strips.append({"event_time_ns": event.time_ns, "kind": event.kind, "file": name,
                       "frames": [{"offset_s": -o, **info} for o, (_, info) in zip(offsets, drawn)]})
    return strips


def _minutes(seconds) -> str:
    return _num(None if seconds is None else seconds / 60.0, ".1f")


def drive_rows(report: dict) -> list[list[str]]:
    rows = []
    for d in report["drives"]:
        rate = d["rates"]["all"] if d["rates"] else None
        rows.append([
            d["name"], d["start"], _minutes(d["duration_s"]), _num(d["distance_km"], ".2f"), _minutes(d["engaged_s"]),
            _num(d["engaged_km"], ".2f"), str(rate["count"]) if rate else "n/a",
            rate_text(rate["km_per"], "km") if rate else "n/a", rate_text(rate["min_per"], "min") if rate else "n/a",
            "yes" if d["read_whole"] else "no",
        ])
    return rows


def kind_rows(report: dict) -> list[list[str]]:
    return [[kind, str(rate["count"]), rate_text(rate["km_per"], "km"), rate_text(rate["min_per"], "min")]
            for kind, rate in report["totals"]["rates"].items()]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


DRIVE_HEADER = ["drive", "start", "min", "km", "engaged min", "engaged km", "interventions", "km per intervention",
                "min per intervention", "read whole"]
KIND_HEADER = ["kind", "interventions", "engaged km per intervention", "engaged min per intervention"]


def summary_tables(report: dict) -> str:
    """The printed summary: a row per drive, the totals by kind, and the bags not read whole."""
    t = report["totals"]
    lines = [f"{t['drives']} drives ({t['drives_counted']} with an engagement history, {t['drives_with_distance']} with speed): "
             f"{_minutes(t['engaged_s'])} engaged min, {_num(t['engaged_km'], '.2f')} engaged km, "
             f"{t['requested_handovers']} handover requests of the OOD rule (not interventions); "
             f"[{report['confidence']:.0%} interval, {report['interval']}]", ""]
    lines += _table(DRIVE_HEADER, drive_rows(report)) + [""] + _table(KIND_HEADER, kind_rows(report))
    bad = [d for d in report["drives"] if not d["read_whole"]]
    if bad:
        lines += ["", "not read whole:"] + [f"  {d['bag']}: " + "; ".join(d["problems"]) for d in bad]
    return "\n".join(lines)


def _clock(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%H:%M:%S")


def event_rows(d: dict) -> list[list[str]]:
    rows = []
    for e in d["events"]:
        km = None if e["engaged_m_since"] is None else e["engaged_m_since"] / 1000
        kind = e["kind"] + ("" if e["intervention"] else " (not counted)")
        rows.append([
            _clock(e["time_ns"]), f"{(e['time_ns'] - d['start_ns']) / 1e9:.1f}", kind, _num(e["speed_mps"], ".1f"),
            f"{_minutes(e['engaged_s_since'])} min, {_num(km, '.2f')} km",
            e["detail"] + (f"; then {e['ended_by']}" if e["ended_by"] else ""), e["note"] or "",
        ])
    return rows


EVENT_HEADER = ["time (UTC)", "s into drive", "kind", "speed m/s", "engaged since previous", "shown by", "safety driver's note"]


def write_markdown(report: dict, path: Path) -> None:
    t = report["totals"]
    lines = [
        "# Field-test report", "",
        f"{t['drives']} drives, {t['drives_counted']} with an engagement history, {t['drives_with_distance']} of them with "
        f"speed reports; the stack drove {_minutes(t['engaged_s'])} min, and {_num(t['engaged_km'], '.2f')} km of the "
        f"{_num(t['distance_km'], '.2f')} km of the drives with speed (km per intervention counts those drives only). "
        f"Intervals: {report['confidence']:.0%}, {report['interval']}; with no intervention, the one-sided bound.", "",
        "## Per intervention, by kind", "", *_table(KIND_HEADER, kind_rows(report)), "",
        "## Drives", "", *_table(DRIVE_HEADER, drive_rows(report)), "",
    ]
    bad = [d for d in report["drives"] if not d["read_whole"]]
    if bad:
        lines += ["## Bags not read whole", ""] + [f"- `{d['bag']}`: " + "; ".join(d["problems"]) for d in bad] + [""]
    for d in report["drives"]:
        if d["start_ns"] is None:
            continue
        lines += [f"## {d['name']}", "", f"Started {d['start']}, {_minutes(d['duration_s'])} min.", ""]
        if d["timeline"]:
            lines += [f"![timeline](figures/{d['timeline']})", ""]
        if d["events"]:
            lines += _table(EVENT_HEADER, event_rows(d)) + [""]
        lines += [f"- note at {_clock(n['time_ns'])} following no event: {n['text']}" for n in d["notes_not_following_an_event"]]
        for strip in d["strips"]:
            lines += [f"{strip['kind']} at {_clock(strip['event_time_ns'])}:", "", f"![strip](figures/{strip['file']})", ""]
    path.write_text("\n".join(lines) + "\n")
