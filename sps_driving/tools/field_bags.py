"""Generated field-test drives: rosbag2 files shaped as `sps-driving record` writes them on the car
(PACMod 3 reports at 30 Hz, the JPEG camera, the selection, the stack's commands and status, stop
requests, the safety driver's notes), with engagements ending in the interventions a `Plan` asks for.

They are what the field report is checked against (test/test_field_report.py), what its example
report is made of (docs/results/field_report/) and what its benchmark reads (`python -m
sps_driving.tools.field_bags bench`). `write_drive` returns what it put in: each event's log time
and kind, the engaged time and distance before it, the drive's distance, and each camera frame's
log time, so a reader's results can be checked against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sps_driving.core import topics
from sps_driving.core.field_report import OPERATOR_DISENGAGE
from sps_driving.core.jpeg import JPEG_FORMAT, encode_jpeg
from sps_driving.ros.bagio import TYPESTORE, BagWriter, to_bag
from sps_driving.ros.msgs import Fields, Level, header_fields, time_fields

S = 1_000_000_000
MS = 1_000_000
TICK_NS = S // 30  # PACMod 3 reports at 30 Hz
STATUS_NS = 3 * TICK_NS  # vehicle interface status and stop requests at 10 Hz, every third report cycle
STEERING_RATIO = 14.8  # steering-wheel angle per road-wheel angle (config/graph.yaml's)
STOP_HOLD_S = 2.0  # s a stop is held before the safety driver takes over by the brake
DECELERATION_MPS2 = 3.0  # m/s^2 in a controlled stop
# Offset of each topic's messages in their period (ms), as they arrive on the car.
PHASE_MS = {
    topics.PACMOD_GLOBAL_RPT: 0, topics.PACMOD_ENABLED: 1, topics.PACMOD_STEERING_RPT: 4, topics.PACMOD_BRAKE_RPT: 8,
    topics.PACMOD_ACCEL_RPT: 12, topics.PACMOD_SPEED_RPT: 20, topics.DIAGNOSTICS: 3, topics.SAFETY_STOP: 6,
    topics.FAILSAFE_STATUS: 9,
}
OVERRIDE_REPORTS = {"override_steering": topics.PACMOD_STEERING_RPT, "override_brake": topics.PACMOD_BRAKE_RPT,
                    "override_accel": topics.PACMOD_ACCEL_RPT}
STOP_KINDS = ("failsafe_stop", "safety_stop:lane_boundary", "safety_stop:collision", "safety_stop:heading", "stale_input")
KINDS = (*OVERRIDE_REPORTS, *STOP_KINDS, "pacmod_fault", OPERATOR_DISENGAGE)


@dataclass(frozen=True)
class Engagement:
    start_s: float  # s into the drive
    end_s: float | None  # when it ends (None: still engaged when the recording ends)
    end: str = OPERATOR_DISENGAGE  # one of KINDS


@dataclass
class Plan:
    duration_s: float
    engagements: list[Engagement]
    speed_mps: float = 10.0
    fps: float = 10.0  # camera frames per second
    frame_size: tuple[int, int] = (96, 160)  # px (height, width)
    camera: str | None = "jpeg"  # "jpeg", "raw" or None
    jpeg_quality: int = 90
    speed_reports: bool = True
    selection: bool = True  # record the kept patches
    grid: tuple[int, int] = (12, 24)
    notes: list[tuple[float, str]] = field(default_factory=list)  # (s into the drive, text)
    handovers: list[float] = field(default_factory=list)  # s into the drive of the safety monitor's handover requests
    distinct_frames: int | None = None  # encode only this many frames and repeat them (long drives)
    pictures: list | None = None  # RGB frames of frame_size shown in turn (default: stripes that say the index)
    start_ns: int = 1_700_000_000 * S
    storage: str = "mcap"


@dataclass
class Expected:
    """What `write_drive` put in."""

    events: list[dict]  # {"kind", "time_ns", "engaged_s_since", "engaged_m_since"} of each intervention
    disengagements: list[dict]  # operator disengagements: {"time_ns"}
    engaged_s: float
    engaged_m: float
    distance_m: float
    frame_log_ns: list[int]
    notes: list[tuple[int, str]]


def grid_time(t_ns: int, topic: str, period: int, start_ns: int) -> int:
    """The first log time of `topic` (every `period` ns, at its phase) at or after t_ns."""
    phase = PHASE_MS[topic] * MS
    k = math.ceil((t_ns - start_ns - phase) / period)
    return start_ns + phase + max(k, 0) * period


@dataclass(frozen=True)
class _Span:
    engage_ns: int  # the first report that says enabled
    kind: str | None  # how it ends (None: it does not)
    end_ns: int | None  # when the plan ends it
    onset_ns: int | None  # the first message that shows the end: the event's time
    override_ns: int | None  # from when a system report shows the safety driver's override
    disable_ns: int | None  # from when the reports say not enabled

    def holds(self, t: int) -> bool:
        return self.engage_ns <= t and (self.end_ns is None or t < self.disable_ns + S)


class _Timeline:
    """The drive's state at any time, from its plan: who drives, overrides, faults, stops, speed."""

    def __init__(self, plan: Plan):
        self.plan, self.t0 = plan, plan.start_ns
        self.spans = [self._span(e) for e in plan.engagements]

    def _grid(self, t: int, topic: str, period: int = TICK_NS) -> int:
        return grid_time(t, topic, period, self.t0)

    def _span(self, e: Engagement) -> _Span:
        engage = self._grid(self.t0 + int(e.start_s * S), topics.PACMOD_GLOBAL_RPT)
        if e.end_s is None:
            return _Span(engage, None, None, None, None, None)
        end, cycle = self.t0 + int(e.end_s * S), TICK_NS
        if e.end in STOP_KINDS:
            source = {"failsafe_stop": topics.FAILSAFE_STATUS, "stale_input": topics.DIAGNOSTICS}.get(e.end, topics.SAFETY_STOP)
            takeover = end + int(STOP_HOLD_S * S)
            return _Span(engage, e.end, end, self._grid(end, source, STATUS_NS), takeover, takeover + cycle)
        if e.end in OVERRIDE_REPORTS:  # the system's report shows it first, the global one a cycle later
            onset = self._grid(end, OVERRIDE_REPORTS[e.end])
            return _Span(engage, e.end, end, onset, end, onset + cycle)
        if e.end == "pacmod_fault":  # the fault shows on the global report, enable goes off two cycles later
            disable = end + 2 * cycle
            return _Span(engage, e.end, end, self._grid(disable, topics.PACMOD_GLOBAL_RPT), None, disable)
        return _Span(engage, e.end, end, self._grid(end, topics.PACMOD_GLOBAL_RPT), None, end)

    def span(self, t: int) -> _Span | None:
        return next((s for s in self.spans if s.holds(t)), None)

    def enabled(self, t: int) -> bool:
        s = self.span(t)
        return s is not None and (s.end_ns is None or t < s.disable_ns)

    def override(self, t: int) -> str | None:
        """The override kind a system report shows at t (a held stop ends by a brake override)."""
        s = self.span(t)
        if s is None or s.override_ns is None or t < s.override_ns:
            return None
        return s.kind if s.kind in OVERRIDE_REPORTS else "override_brake"

    def fault(self, t: int) -> bool:
        s = self.span(t)
        return s is not None and s.kind == "pacmod_fault" and s.end_ns <= t

    def stopping(self, t: int, reacting_ns: int = 0) -> str | None:
        """The stop under way at t, `reacting_ns` after its onset (the vehicle interface follows the monitor)."""
        s = self.span(t)
        return s.kind if s is not None and s.kind in STOP_KINDS and s.onset_ns + reacting_ns <= t < s.override_ns else None

    def speed(self, t: int) -> float:
        """Constant speed, but from a stop's onset: braking to a standstill held until the takeover."""
        s = self.span(t)
        v = self.plan.speed_mps
        if s is not None and s.kind in STOP_KINDS and s.onset_ns <= t < s.override_ns:
            return max(0.0, v - DECELERATION_MPS2 * (t - s.onset_ns) / S)
        return v


def _report(kind: str, t: int, **values):
    return to_bag(Fields(f"pacmod3_msgs/msg/{kind}", {"header": header_fields(t), **values}))


def _diag(t: int, name: str, level: int, message: str, values: dict):
    status = Fields("diagnostic_msgs/msg/DiagnosticStatus", {
        "level": level, "name": name, "message": message, "hardware_id": name,
        "values": [Fields("diagnostic_msgs/msg/KeyValue", {"key": k, "value": str(v)}) for k, v in values.items()],
    })
    return to_bag(Fields("diagnostic_msgs/msg/DiagnosticArray", {"header": header_fields(t), "status": [status]}))


def _write_reports(bag: BagWriter, tl: _Timeline, t: int, plan: Plan) -> None:
    """One 30 Hz cycle of PACMod 3 reports."""
    def at(topic):
        return t + PHASE_MS[topic] * MS

    g = at(topics.PACMOD_GLOBAL_RPT)
    override = tl.override(g - TICK_NS)  # the global report shows an override a cycle after the system's
    enabled = tl.enabled(g) and override is None
    bag.write(topics.PACMOD_GLOBAL_RPT, _report("GlobalRpt", g, enabled=enabled, override_active=override is not None,
                                                pacmod_sys_fault_active=tl.fault(g)), g)
    bag.write(topics.PACMOD_ENABLED, Fields("std_msgs/msg/Bool", {"data": enabled}), at(topics.PACMOD_ENABLED))
    for kind, topic in OVERRIDE_REPORTS.items():
        r = at(topic)
        # the measured steering follows the command 0.3 s behind
        output = 0.05 * STEERING_RATIO * math.sin((r - tl.t0) / S / 4.0 - 0.3 / 4.0) if topic == topics.PACMOD_STEERING_RPT else 0.1
        bag.write(topic, _report("SystemRptFloat", r, enabled=tl.enabled(r), override_active=tl.override(r) == kind,
                                 output=output, command=output), r)
    if plan.speed_reports:
        r = at(topics.PACMOD_SPEED_RPT)
        bag.write(topics.PACMOD_SPEED_RPT, _report("VehicleSpeedRpt", r, vehicle_speed=tl.speed(r), vehicle_speed_valid=True), r)


def _write_status(bag: BagWriter, tl: _Timeline, t: int) -> None:
    """One 10 Hz cycle of the vehicle interface's status and the stop requests."""
    d = t + PHASE_MS[topics.DIAGNOSTICS] * MS
    stop = tl.stopping(d)
    if stop and stop.startswith("safety_stop"):  # the vehicle interface stops on the monitor's request, a little later
        stop = tl.stopping(d, reacting_ns=50 * MS)
    if stop != "failsafe_stop":  # a vehicle interface the failsafe stops for is silent
        reasons = {"stale_input": "camera_timeout", None: ""}.get(stop, "safety_stop")
        bag.write(topics.DIAGNOSTICS, _diag(d, "vehicle_interface", Level.WARN if reasons else Level.OK, "",
                                            {"engagement": "engaged" if tl.enabled(d) else "disengaged",
                                             "stop_reasons": reasons, "last_event": ""}), d)
    s = t + PHASE_MS[topics.SAFETY_STOP] * MS
    stop = tl.stopping(s)
    failure = stop.split(":")[1] if stop and stop.startswith("safety_stop") else ""
    bag.write(topics.SAFETY_STOP, _diag(s, "safety_monitor", Level.ERROR if failure else Level.OK, failure,
                                        {"stop": bool(failure)}), s)
    f = t + PHASE_MS[topics.FAILSAFE_STATUS] * MS
    active = tl.stopping(f) == "failsafe_stop"
    bag.write(topics.FAILSAFE_STATUS, _diag(f, "failsafe", Level.ERROR if active else Level.OK,
                                            "vehicle interface silent: stopping" if active else "", {"stop": active}), f)


def _frames(plan: Plan, count: int):
    """The camera frame of each index: a picture whose stripes and brightness say its index."""
    h, w = plan.frame_size
    rows, cols = np.mgrid[0:h, 0:w]
    cache: dict[int, object] = {}

    def frame(i: int):
        key = i % plan.distinct_frames if plan.distinct_frames else i
        if key not in cache:
            rgb = plan.pictures[key % len(plan.pictures)] if plan.pictures else np.stack(
                [(rows * 2 + key * 5) % 256, (cols * 3) % 256, np.full((h, w), (key * 37) % 256)], -1).astype(np.uint8)
            cache[key] = encode_jpeg(rgb, plan.jpeg_quality) if plan.camera == "jpeg" else rgb
            if not plan.distinct_frames:
                cache.pop(key - 1, None)
        return cache[key]

    return frame


def _write_camera(bag: BagWriter, plan: Plan, t: int, image, grid_kept) -> None:
    header = {"stamp": time_fields(t), "frame_id": "camera"}
    if plan.camera == "jpeg":
        msg = TYPESTORE.types["sensor_msgs/msg/CompressedImage"](
            header=to_bag(Fields("std_msgs/msg/Header", header)), format=JPEG_FORMAT, data=np.frombuffer(image, np.uint8))
        bag.write(topics.IMAGE_COMPRESSED, msg, t)
    else:
        h, w = plan.frame_size
        bag.write(topics.IMAGE, Fields("sensor_msgs/msg/Image", {"header": Fields("std_msgs/msg/Header", header), "height": h,
                                                                "width": w, "encoding": "rgb8", "step": 3 * w,
                                                                "data": image.tobytes()}), t)
    if grid_kept is not None:
        rows, cols = plan.grid
        mask = np.zeros(rows * cols, np.uint8)
        mask[grid_kept] = 255
        bag.write(topics.SELECTION, Fields("sensor_msgs/msg/Image", {"header": Fields("std_msgs/msg/Header", header),
                                                                    "height": rows, "width": cols, "encoding": "mono8",
                                                                    "step": cols, "data": mask.tobytes()}), t + MS)


class _Recording(BagWriter):
    """A bag writer that keeps the last log time written (where a reader's drive ends)."""

    last_ns = 0

    def write(self, topic: str, msg, log_time_ns: int) -> None:
        super().write(topic, msg, log_time_ns)
        self.last_ns = max(self.last_ns, int(log_time_ns))


def write_drive(path: Path, plan: Plan) -> Expected:
    """Write the drive of `plan` into a new bag at `path`; returns what it holds."""
    tl, t0 = _Timeline(plan), plan.start_ns
    end_ns = t0 + int(plan.duration_s * S)
    frame_period = int(round(S / plan.fps))
    frame_times = list(range(t0 + 2 * MS, end_ns, frame_period)) if plan.camera else []
    image = _frames(plan, len(frame_times))
    rng = np.random.default_rng(0)
    notes = sorted((t0 + int(s * S), text) for s, text in plan.notes)
    with _Recording(path, plan.storage) as bag:
        next_frame, next_note = 0, 0
        for cycle, t in enumerate(range(t0, end_ns, TICK_NS)):
            while next_frame < len(frame_times) and frame_times[next_frame] < t + TICK_NS:
                ft = frame_times[next_frame]
                kept = rng.choice(plan.grid[0] * plan.grid[1], plan.grid[0] * plan.grid[1] // 2, replace=False) if plan.selection else None
                _write_camera(bag, plan, ft, image(next_frame), kept)
                steering = 0.05 * math.sin((ft - t0) / S / 4.0)
                bag.write(topics.POLICY_COMMAND, Fields("sensor_msgs/msg/JointState", {
                    "header": header_fields(ft), "name": list(topics.COMMAND_NAMES), "position": [steering, 0.1]}), ft + 2 * MS)
                next_frame += 1
            _write_reports(bag, tl, t, plan)
            if cycle % (STATUS_NS // TICK_NS) == 0:
                _write_status(bag, tl, t)
            for at in (t0 + int(s * S) for s in plan.handovers):
                if t <= at < t + TICK_NS:
                    bag.write(topics.HANDOVER_EVENTS, _diag(at, "safety_monitor", 2, topics.HANDOVER_EVENT, {"score": 3.0}), at)
            while next_note < len(notes) and notes[next_note][0] < t + TICK_NS:
                bag.write(topics.DRIVER_NOTE, Fields("std_msgs/msg/String", {"data": notes[next_note][1]}), notes[next_note][0])
                next_note += 1
    return _expected(tl, plan, bag.last_ns, frame_times, notes)


def _expected(tl: _Timeline, plan: Plan, end_ns: int, frame_times: list[int], notes) -> Expected:
    v, events, disengagements, engaged_s, since_s = plan.speed_mps, [], [], 0.0, 0.0
    for span in tl.spans:
        seconds = ((span.onset_ns if span.kind else end_ns) - span.engage_ns) / S
        engaged_s += seconds
        since_s += seconds
        if span.kind == OPERATOR_DISENGAGE:
            disengagements.append({"time_ns": span.onset_ns})
        elif span.kind is not None:
            events.append({"kind": span.kind, "time_ns": span.onset_ns, "engaged_s_since": since_s, "engaged_m_since": since_s * v})
            since_s = 0.0
    step = 10 * MS  # the speed integrated on a 10 ms grid
    distance = sum(tl.speed(t) for t in range(tl.t0, end_ns, step)) * step / S if plan.speed_reports else math.nan
    return Expected(events, disengagements, engaged_s, engaged_s * v, distance, frame_times, notes)


def corrupt(path: Path, how: str = "truncate") -> None:
    """Damage a bare storage file: "truncate" cuts it at half (a recording stopped hard: no index
    at its end), "garble" flips bytes through 50 kB from 60% into it (a bad disk)."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        del data[len(data) // 2:]
    elif how == "garble":
        start = len(data) * 6 // 10
        for i in range(start, min(len(data), start + 50_000), 97):
            data[i] ^= 0xFF
    else:
        raise ValueError(f"unknown damage {how!r}: truncate or garble")
    path.write_bytes(bytes(data))


def field_plan(minutes: float, frame_size: tuple[int, int] = (600, 960), fps: float = 30.0, pictures=None) -> Plan:
    """A drive of `minutes` as `record` writes it on the car (the JPEG camera at 960x600 and 30 fps):
    engaged stretches of about 100 s, each ended by the next kind of KINDS in turn."""
    duration = minutes * 60.0
    engagements, start, index = [], 5.0, 0
    while start + 110.0 < duration:
        engagements.append(Engagement(start, start + 100.0, KINDS[index % len(KINDS)]))
        start, index = start + 110.0, index + 1
    return Plan(duration, engagements, fps=fps, frame_size=frame_size, distinct_frames=30, pictures=pictures,
                notes=[(e.end_s + 3.0, "precautionary") for e in engagements[::3]])


def _evict(path: Path) -> None:
    """Drop the bag's pages from the page cache, so the report reads it from disk as after a drive."""
    import os

    for file in ([path] if path.is_file() else sorted(path.iterdir())):
        with open(file, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _timed_report(bag: Path, out: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak resident MiB) of `sps-driving interventions BAG` in a process of its own."""
    import os
    import subprocess
    import sys
    import time

    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "sps_driving.cli", "interventions", str(bag), "--out", str(out)],
                               stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode not in (0, 1):
        raise RuntimeError(f"the report of {bag} exited with {process.returncode}")
    return time.perf_counter() - started, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024  # KiB on Linux


def bench(folder: Path, minutes: list[float], rounds: int) -> dict:
    """Write a drive of each length (once) and time its report, `rounds` times interleaved."""
    import time

    folder.mkdir(parents=True, exist_ok=True)
    pictures = demo_pictures((600, 960))  # the car camera's size: JPEG sizes as a camera's, not as stripes'
    drives = {}
    for m in minutes:
        bag = folder / f"drive_{m:g}min"
        if not (bag / "metadata.yaml").is_file():
            started = time.perf_counter()
            write_drive(bag, field_plan(m, pictures=pictures))
            print(f"wrote {bag} in {time.perf_counter() - started:.0f} s", flush=True)
        drives[m] = bag
    runs = {m: [] for m in minutes}
    for r in range(rounds):
        for m in minutes:
            _evict(drives[m])
            runs[m].append(_timed_report(drives[m], folder / f"report_{m:g}min_{r}"))
    rows = {}
    for m in minutes:
        size = sum(f.stat().st_size for f in drives[m].iterdir())
        rows[m] = {"bag_gb": size / 1e9, "wall_s": [r[0] for r in runs[m]], "cpu_s": [r[1] for r in runs[m]],
                   "peak_mib": [r[2] for r in runs[m]]}
    fits = {}
    for measure in ("wall_s", "cpu_s", "peak_mib"):  # a line through the fastest of each length
        slope, intercept = np.polyfit(list(minutes), [min(rows[m][measure]) for m in minutes], 1)
        fits[measure] = {"per_minute": float(slope), "at_0": float(intercept), "one_hour": float(slope * 60 + intercept)}
    return {"rows": rows, "fits": fits}


def demo_pictures(size: tuple[int, int] | None = None, count: int = 30) -> list[np.ndarray]:
    """The bundled drive's first camera frames, resized to `size` (height, width) when given."""
    import cv2

    from sps_driving.core.resources import package_path
    from sps_driving.ros.drive import camera_frames

    frames = [f.rgb() for f in camera_frames(package_path("data/demo_drive")).frames(0, count)]
    return frames if size is None else [cv2.resize(f, size[::-1], interpolation=cv2.INTER_CUBIC) for f in frames]


def example_day(folder: Path) -> None:
    """The example report's day (docs/results/field_report): three drives with the bundled drive's
    frames, every kind of intervention among them, notes, and a bag cut short."""
    pictures = demo_pictures()
    size = pictures[0].shape[:2]
    plans = {
        "0900_loop_a": Plan(300.0, [Engagement(10, 80, "override_steering"), Engagement(90, 150, "safety_stop:lane_boundary"),
                                    Engagement(160, 290, "operator_disengage")], speed_mps=9.0,
                            notes=[(82, "precautionary: cyclist ahead"), (292, "end of loop")]),
        "1030_loop_b": Plan(360.0, [Engagement(5, 120, "override_brake"), Engagement(130, 200, "failsafe_stop"),
                                    Engagement(215, 300, "stale_input"), Engagement(310, 350, "override_accel")], speed_mps=11.0,
                            storage="sqlite3", notes=[(122, "precautionary"), (205, "system")]),
        "1400_loop_c": Plan(240.0, [Engagement(8, 200, "pacmod_fault"), Engagement(210, None)], speed_mps=7.0,
                            notes=[(202, "system: PACMod fault light")]),
        "1530_cut_short": Plan(60.0, [Engagement(5, 40, "override_brake")]),
    }
    day = 1_793_664_000 * S  # 2026-11-03 00:00 UTC
    for name, plan in plans.items():
        plan.frame_size, plan.pictures, plan.distinct_frames = size, pictures, len(pictures)
        plan.start_ns = day + (int(name[:2]) * 3600 + int(name[2:4]) * 60) * S
        write_drive(folder / name, plan)
    cut = folder / "1530_cut_short"
    (storage,) = cut.glob("*.mcap")
    storage.rename(folder / "1530_cut_short.mcap")
    for leftover in cut.iterdir():
        leftover.unlink()
    cut.rmdir()
    corrupt(folder / "1530_cut_short.mcap")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    parser = argparse.ArgumentParser(description="generated field drives: the example day, the report's benchmark")
    sub = parser.add_subparsers(dest="what", required=True)
    example = sub.add_parser("example", help="write the example report's day of bags into FOLDER")
    example.add_argument("folder", type=Path)
    timing = sub.add_parser("bench", help="time the report of drives of several lengths as `record` writes them")
    timing.add_argument("folder", type=Path)
    timing.add_argument("--minutes", type=float, nargs="+", default=[5, 10, 20])
    timing.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.what == "example":
        example_day(args.folder)
        return 0
    result = bench(args.folder, args.minutes, args.rounds)
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
