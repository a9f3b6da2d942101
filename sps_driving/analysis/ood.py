"""`sps-driving ood`: the out-of-distribution score's calibration and its measurement.

    sps-driving ood calibrate --policy models/sps50_dinov2 --cache runs/cache_rb20
    sps-driving ood report runs/ood_off [runs/ood_on ...] --out docs/results/ood_score
    sps-driving ood bench --policy models/sps50_dinov2

`calibrate` fits both scores of sps_driving.core.ood on the policy's training frames (a feature
cache of them): each frame's kept patches are the ones the policy's own selection keeps at the
frame's stamp, as on the car. Where the cache's drives are at hand and record the lane pose
(topics.LANE_POSE), it fits the lane-pose probe on them too. The last `holdout_sources` drives of
the cache are held out to set each score's scale (its 99th percentile there). The files go into
the checkpoint folder, with how they were made in ood.json.

`report` reads eval folders whose rows carry the per-frame scores (every in-process eval of a
calibrated policy logs them) and writes the per-scenario AUROC for a failure within the next
`--horizon-s`, the lead time of the first alarm, and the closed-loop rows by method. Runs that
drove the same cells alike, frame for frame, are read as one, with the scores each logged
(sim.results.merge_results); `--combine a+b` adds a score made of others.

`bench` times each score per frame on the kept patches of a frame (the process's threads as set
by OMP_NUM_THREADS; the number it prints is the per-frame cost).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from sps_driving.core.backbones.runtimes import file_sha256
from sps_driving.core.ood import (
    FORMAT,
    LOOKAHEAD_M,
    SCALE_QUANTILE,
    LanePoseProbe,
    OodScorer,
    PatchCoreset,
    PooledMahalanobis,
    band_features,
    calibration_methods,
    descriptor_settings,
    load_calibration,
    load_ood_config,
)
from sps_driving.core.resources import portable_path, portable_record, source_revision

HOLDOUT_QUANTILES = (0.5, 0.9, 0.99, 0.999, 1.0)
CALIBRATION_SETTINGS = ("shrinkage", "coreset_size", "coreset_sample_patches", "holdout_sources", "seed", "probe_bands",
                        "probe_ridge", "lane_pose_tolerance_s")  # config/ood.yaml, calibration


def kept_frames(cache, policy, rows: np.ndarray):
    """(row, kept indices, kept descriptors float32 [k, D]) of cache rows, the policy's selection at each frame's stamp."""
    for row in rows:
        frame = cache[int(row)]
        indices = policy.selector.select(frame.stamp_ns)
        yield int(row), indices, np.asarray(frame.descriptors[indices], dtype=np.float32)


def recorded_lane_poses(cache, tolerance_s: float) -> tuple[np.ndarray | None, str]:
    """[frames, 2] each cache frame's (lateral offset m, heading error rad) as its drive recorded it
    on topics.LANE_POSE nearest the frame's stamp (within `tolerance_s`), or None and why not: a
    drive is not at the path the cache records, records no lane pose, or not near every frame."""
    from sps_driving.core import topics
    from sps_driving.core.state import nearest
    from sps_driving.ros.bagio import BagError, is_bag, read_messages
    from sps_driving.ros.msgs import lane_from_message, stamp_ns

    drives = {}
    for directory in cache.directories:
        meta = json.loads((directory / "meta.json").read_text())
        if len(meta.get("inputs") or []) != len(meta["sources"]):
            return None, f"cache {directory} does not record one drive per source"
        prefix = "" if len(cache.directories) == 1 else f"{directory.resolve().name}/"
        drives.update({prefix + source: Path(path) for source, path in zip(meta["sources"], meta["inputs"])})
    poses = np.full((len(cache), 2), np.nan)
    for source_id, source in enumerate(cache.sources):
        drive = drives[source]
        if not drive.exists():
            return None, f"drive {drive} of cache source {source} is not here (paths are read from the current folder)"
        if not is_bag(drive):
            return None, f"cache source {source} is not a bag ({drive}): it records no lane pose"
        try:
            recorded = sorted((stamp_ns(m.msg.header), *lane_from_message(m.msg)) for m in read_messages(drive, [topics.LANE_POSE]))
        except BagError as exc:
            return None, str(exc)
        if not recorded:
            return None, f"drive {drive} records no {topics.LANE_POSE}"
        stamps = np.array([r[0] for r in recorded], dtype=np.int64)
        for row in np.flatnonzero(cache.source_ids == source_id):
            index = nearest(stamps, int(cache.stamps[row]))
            if abs(int(stamps[index]) - int(cache.stamps[row])) > tolerance_s * 1e9:
                return None, f"drive {drive} records no {topics.LANE_POSE} within {tolerance_s} s of frame {int(cache.stamps[row])}"
            poses[row] = recorded[index][1:]
    return poses, f"{topics.LANE_POSE} of the cache's {len(cache.sources)} drives"


def calibrate(policy_dir: Path, cache_dirs: list[str], settings: dict, command: str) -> OodScorer:
    from sps_driving.core.policies.checkpoint import WEIGHTS_FILE, load_policy, read_policy_config
    from sps_driving.train.cache import FeatureCache

    policy_config = read_policy_config(policy_dir)
    expected = descriptor_settings(policy_config)
    cache = FeatureCache(cache_dirs)
    cache_settings = descriptor_settings({"descriptor_dim": cache.descriptor_dim, "grid": cache.meta["grid"],
                                          "extractor": cache.meta.get("extractor") or {}})
    if cache_settings != expected:
        raise ValueError(f"cache {cache.name} holds other descriptors than policy {policy_dir} reads: "
                         f"{cache_settings} against {expected}")
    if missing := [key for key in CALIBRATION_SETTINGS if key not in settings]:
        raise ValueError(f"calibration settings lack {missing} (see config/ood.yaml, calibration)")
    bands, cols = int(settings["probe_bands"]), cache.grid.cols
    if not 1 <= bands <= cols:
        raise ValueError(f"probe_bands must lie in 1..{cols} (the grid's columns), got {bands}")
    if not (float(settings["probe_ridge"]) >= 0 and float(settings["lane_pose_tolerance_s"]) >= 0):
        raise ValueError("probe_ridge and lane_pose_tolerance_s must be >= 0")
    policy = load_policy(policy_dir)
    holdout = int(settings["holdout_sources"])
    if not 1 <= holdout < len(cache.sources):
        raise ValueError(f"holdout_sources must lie in 1..{len(cache.sources) - 1} for {len(cache.sources)} sources, got {holdout}")
    held = np.isin(cache.source_ids, np.arange(len(cache.sources) - holdout, len(cache.sources)))
    fit_rows, held_rows = np.flatnonzero(~held), np.flatnonzero(held)
    rng = np.random.default_rng(int(settings["seed"]))
    poses, poses_from = recorded_lane_poses(cache, float(settings["lane_pose_tolerance_s"]))
    pooled, patches, probe_features = [], [], []
    for _, indices, kept in kept_frames(cache, policy, fit_rows):
        pooled.append(kept.mean(axis=0))
        patches.append(kept)
        if poses is not None:
            probe_features.append(band_features(kept, indices, bands, cols))
    patches = np.concatenate(patches)
    sample = rng.choice(len(patches), size=min(int(settings["coreset_sample_patches"]), len(patches)), replace=False)
    mahalanobis = PooledMahalanobis.fit(np.stack(pooled), float(settings["shrinkage"]))
    coreset = PatchCoreset.fit(patches[sample], int(settings["coreset_size"]), rng)
    probe = None if poses is None else LanePoseProbe.fit(np.stack(probe_features), poses[fit_rows],
                                                         float(settings["probe_ridge"]), bands, cols)
    methods = calibration_methods(probe)
    raw = {m: [] for m in methods}
    errors = []
    for row, indices, kept in kept_frames(cache, policy, held_rows):
        raw["pooled_mahalanobis"].append(mahalanobis.raw(kept))
        for m, value in coreset.raw(kept).items():
            raw[m].append(value)
        if probe is not None:
            for m, value in probe.raw(kept, indices).items():
                raw[m].append(value)
            errors.append(np.subtract(probe.pose(kept, indices), poses[row]))
    scales = {m: float(np.quantile(raw[m], SCALE_QUANTILE)) for m in methods}
    probe_record = {} if probe is None else {"probe": {
        "bands": bands, "poses": poses_from, "lookahead_m": LOOKAHEAD_M,
        "holdout_mean_abs_error": dict(zip(("lateral_offset_m", "heading_error_rad"), np.abs(errors).mean(axis=0).round(4).tolist())),
        "holdout_r2": dict(zip(("lateral_offset_m", "heading_error_rad"), _r2(np.array(errors), poses[held_rows]).round(4).tolist()))}}
    meta = {
        "format": FORMAT,
        "descriptors": expected,
        "policy_weights_sha256": file_sha256(Path(policy_dir) / WEIGHTS_FILE),
        "scales": scales,
        "scale_quantile": SCALE_QUANTILE,
        "holdout_scores": {m: {f"q{q:g}": float(np.quantile(np.asarray(raw[m]) / scales[m], q)) for q in HOLDOUT_QUANTILES}
                           for m in methods},
        "settings": dict(settings),
        **probe_record,
        "made": portable_record({
            "command": command, "revision": source_revision(), "caches": [portable_path(d) for d in cache_dirs],
            "cache_inputs": cache.meta.get("inputs"), "fit_frames": int(len(fit_rows)), "holdout_frames": int(len(held_rows)),
            "holdout_sources": cache.sources[-holdout:], "fit_patches": int(len(patches)),
            "selection": "the policy's own selection at each frame's stamp",
            "lane_pose_probe": poses_from if probe is not None else f"none: {poses_from}",
        }),
    }
    return OodScorer(mahalanobis, coreset, meta, probe)


def _r2(errors: np.ndarray, truth: np.ndarray) -> np.ndarray:
    return 1.0 - (errors ** 2).sum(axis=0) / ((truth - truth.mean(axis=0)) ** 2).sum(axis=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ood_command", required=True)
    cal = sub.add_parser("calibrate", help="fit the scores on a policy's training frames into its folder")
    cal.add_argument("--policy", required=True, help="checkpoint folder; ood.safetensors and ood.json are written there")
    cal.add_argument("--cache", nargs="+", required=True, help="feature cache(s) of the policy's training frames")
    cal.add_argument("--config", help="settings file (default config/ood.yaml)")
    rep = sub.add_parser("report", help="AUROC per scenario, lead time and closed-loop rows from eval folders")
    rep.add_argument("runs", nargs="+", help="eval output folders (results.jsonl with per-frame scores)")
    rep.add_argument("--out", required=True, help="folder for ood_report.md and ood_report.json")
    rep.add_argument("--horizon-s", type=float, default=2.0, help="s: a frame is positive when a failure follows within this")
    rep.add_argument("--method", help="method (column name) whose rule-off rows the AUROC reads (default: every one)")
    rep.add_argument("--combine", action="append", metavar="A+B[+...]",
                     help="also score by the mean of these scores, each scaled by its 99th percentile in distribution (repeatable)")
    ben = sub.add_parser("bench", help="per-frame cost of each score")
    ben.add_argument("--policy", required=True, help="calibrated checkpoint folder")
    ben.add_argument("--frames", type=int, default=2000, help="frames timed per score")


def run(args) -> int:
    if args.ood_command == "calibrate":
        return _run_calibrate(args)
    if args.ood_command == "bench":
        return _run_bench(args)
    from sps_driving.analysis.ood_report import write_report

    return write_report(args)


def _run_calibrate(args) -> int:
    config = load_ood_config(args.config)
    command = "sps-driving " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["ood"] else "sps-driving ood calibrate ..."
    started = time.perf_counter()
    try:
        scorer = calibrate(Path(args.policy), args.cache, config["calibration"], command)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"ood calibrate: {exc}") from None
    path = scorer.save(args.policy)
    print(json.dumps({"written": str(path), "scales": scorer.meta["scales"], "holdout_scores": scorer.meta["holdout_scores"],
                      "lane_pose_probe": scorer.meta["made"]["lane_pose_probe"], "seconds": round(time.perf_counter() - started, 1)},
                     indent=1))
    return 0


def _run_bench(args) -> int:
    """Each score and the policy's own forward on the same kept patches, interleaved in rounds so that
    load on the machine affects all alike; per-frame ms, median and best round."""
    import os

    from sps_driving.core.policies.checkpoint import WEIGHTS_FILE, load_policy, read_policy_config

    policy_config = read_policy_config(args.policy)
    scorer = load_calibration(args.policy, policy_config, Path(args.policy) / WEIGHTS_FILE)
    policy = load_policy(args.policy)
    indices = policy.selector.select(0)
    frames = np.random.default_rng(0).standard_normal((16, len(indices), scorer.dim)).astype(np.float32)
    state = {name: 8.0 for name in policy.state_inputs} or None
    timed = {**{m: (lambda f, m=m: scorer.score(f, m, indices)) for m in scorer.methods},
             "policy_forward": lambda f: policy.predict(f, indices, state)}
    rounds = {name: [] for name in timed}
    per_round = max(args.frames // 10, 1)
    for fn in timed.values():  # warm up
        for i in range(20):
            fn(frames[i % 16])
    for _ in range(10):
        for name, fn in timed.items():
            started = time.perf_counter()
            for i in range(per_round):
                fn(frames[i % 16])
            rounds[name].append(1e3 * (time.perf_counter() - started) / per_round)
    result = {"kept_patches": len(indices), "dim": scorer.dim, "coreset_centres": len(scorer.models["patch_coreset"].centers),
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"), "load_average_1min": os.getloadavg()[0],
              **{f"{name}_ms_per_frame": {"median": round(float(np.median(v)), 3), "best": round(min(v), 3)}
                 for name, v in rounds.items()}}
    print(json.dumps(result, indent=1))
    return 0
