"""The JPEG quality the camera is recorded at (config/recording.yaml): on a drive's frames, each
quality's descriptors and the policy's commands against the raw frame's, and the bytes an hour.

    python -m sps_driving.tools.jpeg_quality [BAG] [--qualities 60 75 90 95] [--checkpoint DIR]

For every camera frame of the bag (default the bundled drive) the policy's selection at the
frame's stamp, the descriptors of its kept patches from the raw frame and from the frame
JPEG-encoded and decoded at each quality (the policy's extractor: the embedded DINOv2 with the
shipped policy), and the policy's command from each, with the bag's state inputs matched by stamp.
Printed per quality: descriptor relative error (|d_jpeg - d_raw| / |d_raw| over the kept patches)
mean / p95 / max, steering and throttle |difference| mean / max, and the mean frame size and GB an
hour at 30 fps, at the bag's frame size and for the car's 960x600 camera (its frames resized to
that size first, an estimate: resized rendered frames are smoother than a real camera's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cv2
import numpy as np

from sps_driving.core.jpeg import decode_compressed, encode_jpeg
from sps_driving.core.resources import package_path, shipped_policy

CAR_FRAME = (600, 960)  # px (height, width) of the car's camera (config/recording.yaml)
FPS = 30.0


def spread(values) -> dict:
    return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95)), "max": float(np.max(values))}


def measure(bag: Path, qualities: list[int], checkpoint: Path) -> dict:
    from sps_driving.core.policies.checkpoint import load_policy
    from sps_driving.core.policies.streaming import StreamingPolicy
    from sps_driving.export.extractors import extractor_for_policy
    from sps_driving.ros.drive import read_drive
    from sps_driving.train.extract import ExtractSettings, bag_states, matched_state

    opened = extractor_for_policy(checkpoint, {"device": "cpu"})
    extractor = opened.extractor
    policy = load_policy(checkpoint, grid=extractor.grid)
    drivers = {q: StreamingPolicy(load_policy(checkpoint, grid=extractor.grid)) for q in ["raw", *qualities]}
    drive = read_drive(bag)
    states, tolerance_ns = bag_states(drive), int(ExtractSettings().match_tolerance_s * 1e9)
    error = {q: [] for q in qualities}
    commands = {q: [] for q in ["raw", *qualities]}
    size = {q: [] for q in qualities}
    car_size = {q: [] for q in qualities}
    for frame in drive.camera.frames():
        rgb, stamp = frame.rgb(), frame.stamp_ns
        indices = policy.selector.select(stamp)
        state = matched_state(states, stamp, tolerance_ns)
        raw = extractor.descriptors(extractor.encode(rgb), indices)
        commands["raw"].append(drivers["raw"].step(stamp, raw, indices, state))
        car_frame = cv2.resize(rgb, CAR_FRAME[::-1], interpolation=cv2.INTER_CUBIC)
        for q in qualities:
            data = encode_jpeg(rgb, q)
            size[q].append(len(data))
            car_size[q].append(len(encode_jpeg(car_frame, q)))
            got = extractor.descriptors(extractor.encode(decode_compressed(data, "jpeg")), indices)
            error[q].append(float(np.linalg.norm(got - raw) / np.linalg.norm(raw)))
            commands[q].append(drivers[q].step(stamp, got, indices, state))
    raw_commands = np.asarray(commands["raw"], np.float64)
    rows = {}
    for q in qualities:
        diff = np.abs(np.asarray(commands[q], np.float64) - raw_commands)
        rows[q] = {
            "descriptor_relative_error": spread(error[q]),
            "steering_abs_diff_rad": spread(diff[:, 0]), "throttle_abs_diff": spread(diff[:, 1]),
            "frame_bytes": float(np.mean(size[q])), "gb_per_hour": float(np.mean(size[q])) * FPS * 3600 / 1e9,
            "car_frame_bytes": float(np.mean(car_size[q])), "car_gb_per_hour": float(np.mean(car_size[q])) * FPS * 3600 / 1e9,
        }
    h, w = rgb.shape[:2]
    return {"bag": str(bag), "frames": len(raw_commands), "frame_size": [h, w], "extractor": opened.facts.get("backend"),
            "checkpoint": str(checkpoint), "kept_patches": int(policy.selector.count),
            "raw_gb_per_hour": h * w * 3 * FPS * 3600 / 1e9, "car_raw_gb_per_hour": CAR_FRAME[0] * CAR_FRAME[1] * 3 * FPS * 3600 / 1e9,
            "qualities": rows}


def format_rows(result: dict) -> str:
    h, w = result["frame_size"]
    lines = [f"{result['bag']}: {result['frames']} frames {w}x{h}, {result['kept_patches']} patches kept a frame, "
             f"extractor {result['extractor']}; raw {result['raw_gb_per_hour']:.1f} GB/h here, "
             f"{result['car_raw_gb_per_hour']:.1f} GB/h at 960x600",
             "| quality | descriptor rel. error mean / p95 / max | steering diff mean / max (rad) | throttle diff mean / max "
             f"| KB a frame ({w}x{h}) | GB/h ({w}x{h}) | KB a frame (960x600, est.) | GB/h (960x600, est.) |",
             "|---|---|---|---|---|---|---|---|"]
    for q, r in result["qualities"].items():
        e, s, t = r["descriptor_relative_error"], r["steering_abs_diff_rad"], r["throttle_abs_diff"]
        lines.append(f"| {q} | {e['mean']:.4f} / {e['p95']:.4f} / {e['max']:.4f} | {s['mean']:.2e} / {s['max']:.2e} | "
                     f"{t['mean']:.2e} / {t['max']:.2e} | {r['frame_bytes'] / 1e3:.1f} | {r['gb_per_hour']:.2f} | "
                     f"{r['car_frame_bytes'] / 1e3:.1f} | {r['car_gb_per_hour']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bag", type=Path, nargs="?", default=package_path("data/demo_drive"))
    parser.add_argument("--qualities", type=int, nargs="+", default=[60, 75, 90, 95])
    parser.add_argument("--checkpoint", type=Path, default=None, help="policy (default the shipped one)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.bag, args.qualities, args.checkpoint or shipped_policy())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(format_rows(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
