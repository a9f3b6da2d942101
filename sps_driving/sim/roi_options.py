"""How many patches an obstacle ahead covers, and what extraction costs, for each way of feeding
the camera frame to the backbone (render size, region of interest, input size): docs/results/roi.md.

    nice -n 10 python -m sps_driving.sim.roi_options --out docs/results/roi.md

In the in-distribution scenario, every road-side obstacle of `--layouts` layouts is seen with the
ego car on the lane centre DISTANCES_M behind it (along the lane, ego centre to obstacle centre,
as sps_driving.sim.gallery measures "ahead"; the camera is about 3.4 m closer to the obstacle's
rear). Its pixels are the ones that change when it is removed from the frame (two renders), so
what is measured is what the renderer draws. Per option: the patches those pixels touch (a patch
is touched when its rectangle in the frame, sps_driving.core.image.patch_rectangles, overlaps an
obstacle pixel: the input the backbone reads there depends on the obstacle), as rows x columns of
the grid; the obstacle's bounding box in rendered px and in patches. Extraction time: onnxruntime
fp32 on 2 threads, encode and the descriptors of all patches of a rendered frame
(core.backbones.time_extraction), the options taking turns frame by frame, the fastest of
`--rounds` frames (the least disturbed by other work on the machine). The road band (ROAD_BAND) is measured by projecting the ego
lane, one lane width on each side, from the road up to a car's height, 5-25 m ahead, from every
5 m of the layouts' roads (curves of radius >= 90 m included).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sps_driving.core.image import patch_rectangles, roi_box
from sps_driving.sim.config import load_sim_config, set_render_width
from sps_driving.sim.scenarios import ID_SCENARIO, TRAINING_CARS
from sps_driving.sim.world import World, make_episode

DISTANCES_M = (14.0, 20.0, 23.0)  # m ahead: where the expert starts to swerve (20-23 m) and closer
BAND_AHEAD_M = (5.0, 25.0)  # m ahead (ego centre): where the road and obstacles must be readable
BAND_STEP_M = 5.0  # m between ego positions along each road for the band
HORIZON_M = 300.0  # m: a road point this far ahead is at the horizon to 0.003 of the frame height
# The region of interest of the road-band options [top, bottom, left, right] (fractions of the
# frame): the band measured by `road_band` (rows 0.435-0.608, columns 0.148-0.854 over 10 layouts)
# with room above for taller vehicles and below for the lane lines from about 4 m ahead; its
# 0.75 width is 336 px of a 448 px render, the 336 px input width of option c.
ROAD_BAND = (0.40, 0.65, 0.125, 0.875)
# The same rows, the middle half of the columns: one lane width on each side of the ego lane from
# 6 m ahead on a straight road, the ego lane's lines from 4 m (the band's bottom row); obstacles
# are 1.5x as wide in patches as in ROAD_BAND at the same input size.
NARROW_BAND = (0.40, 0.65, 0.25, 0.75)
TIMING_THREADS = 2
PATCH_PX = 14  # DINOv2's patch


@dataclass(frozen=True)
class Option:
    name: str
    what: str
    render_width: int  # px; the height follows the camera's aspect
    input_size: tuple[int, int]  # (height, width) px fed to the backbone
    roi: tuple[float, float, float, float] | None  # None: the whole frame

    @property
    def grid(self) -> tuple[int, int]:
        return self.input_size[0] // PATCH_PX, self.input_size[1] // PATCH_PX


OPTIONS = (
    Option("a", "today: whole frame", 224, (224, 224), None),
    Option("b", "whole frame, wider input", 224, (224, 336), None),
    Option("c", "road band", 448, (168, 336), ROAD_BAND),
    Option("d", "road band, finer grid", 448, (224, 448), ROAD_BAND),
    Option("e", "as d from a 2x larger render", 896, (224, 448), ROAD_BAND),
    Option("f", "narrow road band", 448, (168, 336), NARROW_BAND),
)


class _Without:
    """`world` as the renderer sees it, less one actor."""

    def __init__(self, world: World, spec):
        self._world, self._spec = world, spec

    def __getattr__(self, name):
        return getattr(self._world, name)

    def actor_poses(self):
        return [pose for pose in self._world.actor_poses() if pose.spec is not self._spec]


def placed_behind(config: dict, episode, spec, distance_m: float) -> World:
    """The episode at t = 0 with the ego car on the lane centre, aligned with the lane,
    `distance_m` along the lane behind the actor `spec`'s centre."""
    placed = copy.deepcopy(config)
    placed["road"]["start_s_m"] = spec.lane_state(0.0)[0] - distance_m
    return World(placed, episode)


def obstacle_mask(renderer, world: World, spec) -> np.ndarray:
    """bool [H, W]: the pixels of the frame that change when actor `spec` is removed."""
    with_it = renderer.render(world).astype(np.int16)
    return np.any(with_it != renderer.render(_Without(world, spec)), axis=2)


def touched_patches(mask: np.ndarray, option: Option) -> tuple[int, int]:
    """(rows, columns) of the option's patch grid that obstacle pixels `mask` touch."""
    rectangles = patch_rectangles(mask.shape, option.roi, option.input_size, option.grid)
    touched = [
        mask[int(np.floor(top)):int(np.ceil(bottom)), int(np.floor(left)):int(np.ceil(right))].any()
        for left, top, right, bottom in rectangles
    ]
    rows, cols = np.divmod(np.flatnonzero(touched), option.grid[1])
    return len(set(rows.tolist())), len(set(cols.tolist()))


def size_in_patches(mask: np.ndarray, option: Option) -> tuple[float, float] | None:
    """The obstacle's bounding box (width, height) in patches of the option (None: not in the roi)."""
    top, bottom, left, right = roi_box(*mask.shape, option.roi)
    inside = mask[top:bottom, left:right]
    if not inside.any():
        return None
    rows, cols = np.flatnonzero(inside.any(axis=1)), np.flatnonzero(inside.any(axis=0))
    patch_width = (right - left) / option.grid[1]
    patch_height = (bottom - top) / option.grid[0]
    return (cols[-1] - cols[0] + 1) / patch_width, (rows[-1] - rows[0] + 1) / patch_height


def bounding_box(mask: np.ndarray) -> tuple[int, int] | None:
    """(width, height) px of the mask's bounding box (None: empty)."""
    if not mask.any():
        return None
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)


def road_obstacles(episode) -> list:
    return [spec for spec in episode.actors if not spec.oncoming]


def measure_obstacles(config: dict, layouts: int) -> dict:
    """{option name: {distance: [(rows, cols touched), bbox (w, h) px, size in patches (w, h)] per
    obstacle}} and the render time per frame of each render width (ms, median)."""
    from sps_driving.sim.render import get_renderer

    episodes = [make_episode(config, ID_SCENARIO, seed) for seed in range(layouts)]
    found: dict = {option.name: {d: [] for d in DISTANCES_M} for option in OPTIONS}
    render_ms = {}
    for width in sorted({option.render_width for option in OPTIONS}):
        sized = copy.deepcopy(config)
        set_render_width(sized, width)
        renderer = get_renderer(sized)
        times = []
        for episode in tqdm(episodes, desc=f"obstacles at {width} px", unit="layout"):
            for spec in road_obstacles(episode):
                for distance in DISTANCES_M:
                    world = placed_behind(sized, episode, spec, distance)
                    start = time.perf_counter()
                    renderer.render(world)
                    times.append(1e3 * (time.perf_counter() - start))
                    mask = obstacle_mask(renderer, world, spec)
                    for option in (o for o in OPTIONS if o.render_width == width):
                        found[option.name][distance].append(
                            (touched_patches(mask, option), bounding_box(mask), size_in_patches(mask, option)))
        render_ms[width] = float(np.median(times))
    return {"obstacles": found, "render_ms": render_ms}


def road_band(config: dict, layouts: int) -> dict:
    """Where the ego lane and one lane on each side (lateral +-1.5 lane widths), from the road up to
    the tallest training car, BAND_AHEAD_M ahead, appear in the frame: {"rows": [min, max],
    "cols": [min, max]} as fractions, over ego positions every BAND_STEP_M of each layout, and the
    horizon's row."""
    from sps_driving.sim.render import get_renderer

    renderer = get_renderer(config)
    half = 1.5 * float(config["road"]["lane_width_m"])
    height = max(model.height_m for model in TRAINING_CARS)
    ahead = np.arange(BAND_AHEAD_M[0], BAND_AHEAD_M[1] + 1e-9, 1.0)
    rows, cols = [np.inf, -np.inf], [np.inf, -np.inf]
    for seed in tqdm(range(layouts), desc="road band", unit="layout"):
        episode = make_episode(config, ID_SCENARIO, seed)
        road = episode.road
        for s in np.arange(float(config["road"]["start_s_m"]), road.length - BAND_AHEAD_M[1], BAND_STEP_M):
            moved = copy.deepcopy(config)
            moved["road"]["start_s_m"] = float(s)
            world = World(moved, episode)
            lane_s = np.repeat(s + ahead, 4)
            lateral = np.tile([-half, -half, half, half], len(ahead))
            z = np.tile([0.0, height, 0.0, height], len(ahead))
            points = np.column_stack([road.points(lane_s, lateral), z])
            found = renderer.project(world, points)
            rows = [min(rows[0], found[:, 0].min()), max(rows[1], found[:, 0].max())]
            cols = [min(cols[0], found[:, 1].min()), max(cols[1], found[:, 1].max())]
    # The flat world's horizon: a point on the road plane far ahead along the camera's heading.
    state = world.state
    far = [[state.x + HORIZON_M * np.cos(state.yaw), state.y + HORIZON_M * np.sin(state.yaw), 0.0]]
    return {"rows": [float(v) for v in rows], "cols": [float(v) for v in cols], "lateral_m": half, "height_m": height,
            "horizon_row": float(renderer.project(world, np.array(far))[0, 0])}


def time_options(config: dict, rounds: int) -> dict:
    """Per option: onnxruntime fp32 extraction of all patches of a rendered frame, ms; the options
    take turns, one frame each per round (after one untimed frame), so that load on the machine
    falls on all of them alike. {option: {"encode_ms", "descriptors_ms", "total_ms": [per round],
    "k", "runtime", "threads"}}."""
    from sps_driving.core.backbones import time_extraction
    from sps_driving.export.extractors import open_extractor
    from sps_driving.sim.gallery import frame_with_actor_ahead

    opened, frames = {}, {}
    for option in OPTIONS:
        sized = copy.deepcopy(config)
        set_render_width(sized, option.render_width)
        frames[option.name] = frame_with_actor_ahead(sized, ID_SCENARIO, seed=0, ahead_m=(18.0, 22.0))
        opened[option.name] = open_extractor({"backend": "onnxruntime", "precision": "fp32", "threads": TIMING_THREADS,
                                              "input_size": list(option.input_size), "roi": list(option.roi) if option.roi else None})
    timings = {name: {"encode_ms": [], "descriptors_ms": [], "total_ms": [], "k": None,
                      "runtime": o.facts["runtime"], "threads": o.facts["threads"]} for name, o in opened.items()}
    for round_index in range(rounds):
        for name, o in opened.items():
            result = time_extraction(o.extractor, frames[name], rates=(1.0,), repeats=1, warmup=int(round_index == 0))[1.0]
            for key in ("encode_ms", "descriptors_ms", "total_ms"):
                timings[name][key].append(result[key])
            timings[name]["k"] = result["k"]
    return timings


def _median_range(values) -> str:
    values = np.asarray(values, dtype=np.float64)
    return f"{np.median(values):.3g} ({values.min():.3g}-{values.max():.3g})"


def markdown(result: dict, command: str) -> str:
    lines = [*_method_section(result, command), *_band_section(result), *_options_section(result),
             *_obstacle_sections(result), *_timing_section(result)]
    return "\n".join(lines) + "\n"


def _method_section(result: dict, command: str) -> list[str]:
    return [
        "# Region of interest: obstacle size in patches and extraction time",
        "",
        f"Revision {result['revision']}, {result['date']}, {result['machine']}. Command:",
        "",
        "```bash",
        command,
        "```",
        "",
        f"In-distribution scenario ({ID_SCENARIO.name}), layouts (episode seeds) 0-{result['layouts'] - 1}: each of their",
        f"{result['obstacle_count']} road-side obstacles (training cars reaching 0.2-0.65 m into the lane) seen with the ego",
        "car on the lane centre at each distance behind it (m along the lane, ego centre to obstacle centre; the camera is",
        "about 3.4 m closer to the obstacle's rear). Obstacle pixels: those that change when it is removed (two renders).",
        "A patch is touched when its rectangle in the frame overlaps an obstacle pixel (what the backbone reads there",
        "depends on the obstacle). Method: `sps_driving/sim/roi_options.py`.",
    ]


def _band_section(result: dict) -> list[str]:
    band, camera = result["band"], result["camera"]
    roi = ", ".join(f"{v:g}" for v in ROAD_BAND)
    return [
        "",
        "## Where the road is: the band",
        "",
        f"Projected through the renderer's camera ({camera['hfov_deg']:g} deg horizontal field of view, pitch "
        f"{camera['pitch_deg']:g} deg): the ego lane",
        f"and one lane width on each side (lateral +-{band['lateral_m']:.1f} m), from the road up to {band['height_m']:.2f} m"
        " (the tallest training",
        f"car), {BAND_AHEAD_M[0]:g}-{BAND_AHEAD_M[1]:g} m ahead, from every {BAND_STEP_M:g} m of the same layouts' roads"
        f" (straights and curves of radius >= {result['min_radius_m']:g} m),",
        f"lie in rows {band['rows'][0]:.3f}-{band['rows'][1]:.3f} and columns {band['cols'][0]:.3f}-{band['cols'][1]:.3f}"
        f" of the frame; the horizon is row {band['horizon_row']:.3f}. Above the band",
        "there is sky and scenery, below it road closer than 5 m. The road-band options crop",
        f"`roi: [{roi}]` (top, bottom, left, right): the band with room above for taller",
        "vehicles and below for the lane lines from about 4 m ahead; its 0.75 width is 336 px of a 448 px render, the input",
        "width of option c, so that option does not resample horizontally. Option f keeps the same rows and the middle half",
        f"of the columns (`roi: [{', '.join(f'{v:g}' for v in NARROW_BAND)}]`): one lane width on each side of the ego lane"
        " from 6 m ahead on a straight",
        "road, the ego lane's lines from 4 m.",
    ]


def _options_section(result: dict) -> list[str]:
    lines = [
        "",
        "## Options",
        "",
        "| option | render px | roi, px of the render | input px (patch grid) | input px per render px (horizontal x vertical) |",
        "|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        height = result["render_heights"][option.render_width]
        top, bottom, left, right = roi_box(height, option.render_width, option.roi)
        where = "whole frame" if option.roi is None else f"rows {top}-{bottom - 1}, columns {left}-{right - 1}"
        scale = f"{option.input_size[1] / (right - left):.2f} x {option.input_size[0] / (bottom - top):.2f}"
        lines.append(f"| {option.name}: {option.what} | {option.render_width}x{height} | {where} | "
                     f"{option.input_size[1]}x{option.input_size[0]} ({option.grid[0]}x{option.grid[1]}) | {scale} |")
    return lines


def _obstacle_sections(result: dict) -> list[str]:
    obstacles = result["obstacles"]
    header = ["| option | " + " | ".join(f"{d:g} m" for d in DISTANCES_M) + " |", "|---|" + "---|" * len(DISTANCES_M)]
    lines = ["", "## Obstacle size", "", "Touched patches, rows x columns: median (range) over the obstacles.", "", *header]
    for option in OPTIONS:
        cells = [_touched_cell(obstacles[option.name][distance]) for distance in DISTANCES_M]
        lines.append(f"| {option.name} | " + " | ".join(cells) + " |")
    lines += ["", "Bounding box, width x height: rendered px, and patches of the option; medians.", "", *header]
    for option in OPTIONS:
        cells = [_bounding_box_cell(obstacles[option.name][distance]) for distance in DISTANCES_M]
        lines.append(f"| {option.name} | " + " | ".join(cells) + " |")
    return lines


def _touched_cell(found: list) -> str:
    rows, cols = zip(*(touched for touched, _, _ in found))
    return f"{_median_range(rows)} x {_median_range(cols)}"


def _bounding_box_cell(found: list) -> str:
    seen = [(box, size) for _, box, size in found if size is not None]
    if not seen:
        return "not in view"
    missing = len(found) - len(seen)
    boxes, sizes = np.array([box for box, _ in seen]), np.array([size for _, size in seen])
    return (f"{np.median(boxes[:, 0]):.0f} x {np.median(boxes[:, 1]):.0f} px, "
            f"{np.median(sizes[:, 0]):.2f} x {np.median(sizes[:, 1]):.2f} patches"
            + (f" ({missing} not in view)" if missing else ""))


def _timing_section(result: dict) -> list[str]:
    timing = result["timing"]
    runtime = next(iter(timing.values()))["runtime"]
    lines = [
        "",
        f"## Extraction time per frame: all patches, {runtime}, fp32, {TIMING_THREADS} threads",
        "",
        f"{result['rounds']} rounds in which the options take turns, one frame each; load average (1 min)"
        f" {result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after",
        f"on {result['machine']}. Shared with other work, a frame is slowed by whatever else runs: the fastest round"
        " is the least disturbed,",
        "the median (range) says how disturbed. Render: the renderer's time per frame at that size (median over the"
        " obstacle frames above).",
        "",
        "| option | patches | encode, ms, fastest | descriptors, ms, fastest | total, ms, fastest | total / option a, fastest |"
        " total, ms, median (range) | render, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    today = min(timing[OPTIONS[0].name]["total_ms"])
    for option in OPTIONS:
        t = timing[option.name]
        lines.append(f"| {option.name} | {t['k']} | {min(t['encode_ms']):.1f} | {min(t['descriptors_ms']):.1f} | "
                     f"{min(t['total_ms']):.1f} | {min(t['total_ms']) / today:.2f} | {_median_range(t['total_ms'])} | "
                     f"{result['render_ms'][option.render_width]:.1f} |")
    return lines


def measure(layouts: int, rounds: int) -> dict:
    from sps_driving.core.backbones.runtimes import available_threads
    from sps_driving.core.resources import source_revision

    config = load_sim_config()
    measured = measure_obstacles(config, layouts)
    heights = {}
    for option in OPTIONS:
        sized = copy.deepcopy(config)
        set_render_width(sized, option.render_width)
        heights[option.render_width] = int(sized["camera"]["render_height"])
    return {
        "revision": source_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {available_threads()} CPU cores",
        "layouts": layouts,
        "obstacle_count": len(measured["obstacles"][OPTIONS[0].name][DISTANCES_M[0]]),
        "camera": {key: config["camera"][key] for key in ("hfov_deg", "pitch_deg")},
        "min_radius_m": config["road"]["min_radius_m"],
        "render_heights": heights,
        "band": road_band(config, layouts),
        **measured,
        "load_before": os.getloadavg(),
        "timing": time_options(config, rounds),
        "load_after": os.getloadavg(),
        "rounds": rounds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results/roi.md", help="markdown file to write")
    parser.add_argument("--layouts", type=int, default=10, help="layouts (episode seeds 0..N-1) of the in-distribution scenario")
    parser.add_argument("--rounds", type=int, default=15, help="timed frames per option, the options taking turns")
    args = parser.parse_args(argv)
    command = f"nice -n 10 python -m sps_driving.sim.roi_options --out {args.out} --layouts {args.layouts} --rounds {args.rounds}"
    result = measure(args.layouts, args.rounds)
    text = markdown(result, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
