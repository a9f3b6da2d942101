"""`sps-driving ood`: the out-of-distribution score's calibration and its measurement.

    sps-driving ood calibrate --policy models/sps50_dinov2 --cache runs/cache_rb20
    sps-driving ood report runs/ood_off [runs/ood_on ...] --out docs/results/ood_score
    sps-driving ood bench --policy models/sps50_dinov2

`calibrate` fits both scores of sps_driving.core.ood on the policy's training frames (a feature
cache of them): each frame's kept patches are the ones the policy's own selection keeps at the
frame's stamp, as on the car. The last `holdout_sources` drives of the cache are held out to set
each score's scale (its 99th percentile there). The files go into the checkpoint folder, with how
they were made in ood.json.

`report` reads eval folders whose rows carry the per-frame scores (every in-process eval of a
calibrated policy logs them) and writes the per-scenario AUROC for a failure within the next
`--horizon-s`, the lead time of the first alarm, and the closed-loop rows by method.

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
    METHODS,
    SCALE_QUANTILE,
    OodScorer,
    PatchCoreset,
    PooledMahalanobis,
    descriptor_settings,
    load_calibration,
    load_ood_config,
)
from sps_driving.core.resources import portable_path, portable_record, source_revision

HOLDOUT_QUANTILES = (0.5, 0.9, 0.99, 0.999, 1.0)


def kept_frames(cache, policy, rows: np.ndarray):
    """(row, kept descriptors float32 [k, D]) of cache rows, the policy's selection at each frame's stamp."""
    for row in rows:
        frame = cache[int(row)]
        yield int(row), np.asarray(frame.descriptors[policy.selector.select(frame.stamp_ns)], dtype=np.float32)


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
    policy = load_policy(policy_dir)
    holdout = int(settings["holdout_sources"])
    if not 1 <= holdout < len(cache.sources):
        raise ValueError(f"holdout_sources must lie in 1..{len(cache.sources) - 1} for {len(cache.sources)} sources, got {holdout}")
    held = np.isin(cache.source_ids, np.arange(len(cache.sources) - holdout, len(cache.sources)))
    fit_rows, held_rows = np.flatnonzero(~held), np.flatnonzero(held)
    rng = np.random.default_rng(int(settings["seed"]))
    pooled, patches = [], []
    for _, kept in kept_frames(cache, policy, fit_rows):
        pooled.append(kept.mean(axis=0))
        patches.append(kept)
    patches = np.concatenate(patches)
    sample = rng.choice(len(patches), size=min(int(settings["coreset_sample_patches"]), len(patches)), replace=False)
    mahalanobis = PooledMahalanobis.fit(np.stack(pooled), float(settings["shrinkage"]))
    coreset = PatchCoreset.fit(patches[sample], int(settings["coreset_size"]), rng)
    raw = {m: [] for m in METHODS}
    for _, kept in kept_frames(cache, policy, held_rows):
        raw["pooled_mahalanobis"].append(mahalanobis.raw(kept))
        raw["patch_coreset"].append(coreset.raw(kept))
    scales = {m: float(np.quantile(raw[m], SCALE_QUANTILE)) for m in METHODS}
    meta = {
        "format": FORMAT,
        "descriptors": expected,
        "policy_weights_sha256": file_sha256(Path(policy_dir) / WEIGHTS_FILE),
        "scales": scales,
        "scale_quantile": SCALE_QUANTILE,
        "holdout_scores": {m: {f"q{q:g}": float(np.quantile(np.asarray(raw[m]) / scales[m], q)) for q in HOLDOUT_QUANTILES}
                           for m in METHODS},
        "settings": dict(settings),
        "made": portable_record({
            "command": command, "revision": source_revision(), "caches": [portable_path(d) for d in cache_dirs],
            "cache_inputs": cache.meta.get("inputs"), "fit_frames": int(len(fit_rows)), "holdout_frames": int(len(held_rows)),
            "holdout_sources": cache.sources[-holdout:], "fit_patches": int(len(patches)),
            "selection": "the policy's own selection at each frame's stamp",
        }),
    }
    return OodScorer(mahalanobis, coreset, meta)


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
                      "seconds": round(time.perf_counter() - started, 1)}, indent=1))
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
    timed = {**{m: (lambda f, m=m: scorer.score(f, m)) for m in METHODS},
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
