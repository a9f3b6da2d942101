"""`sps-driving compare`: method A against method B over the episodes of `eval` results files,
paired cell by cell (sps_driving.sim.statistics): in distribution, out of distribution and, on
request, per OOD scenario, each with its 95% bootstrap interval over scenarios, layouts and training
seeds, and the cells won and lost. Tables 1 and 2 pair every method with DA only; an ablation (a
policy with and without an option, two architectures, one policy on two views) needs any pair.

With `--effect-points E` and several training seeds of each method: the standard deviation of one
checkpoint's OOD average within each method, and how many seeds a method would need for the 95%
interval of the difference of two such means to be +-E points wide at that spread,
ceil(1.96^2 (sd_A^2 + sd_B^2) / E^2): whether an effect of that size can be decided at all."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sps_driving.sim.results import merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES
from sps_driving.sim.statistics import paired_difference, score_interval
from sps_driving.sim.tables import format_estimate, method_scores, seed_scores


def compare(rows: list[dict], a: str, b: str, per_scenario: bool = False) -> list[dict]:
    """One entry per group of scenarios both methods drove: its name, each method's score and A - B,
    each an Estimate. Groups: in distribution, OOD (the mean over its scenarios) and, with
    `per_scenario`, each OOD scenario."""
    methods = {row["method"] for row in rows}
    unknown = [m for m in (a, b) if m not in methods]
    if unknown:
        raise ValueError(f"no episodes of {', '.join(map(repr, unknown))}; the results hold {', '.join(sorted(map(repr, methods)))}")
    groups = [("in distribution", (ID_SCENARIO.name,)), ("OOD", OOD_SCENARIO_NAMES)]
    if per_scenario:
        groups += [(name, (name,)) for name in OOD_SCENARIO_NAMES]
    entries = []
    for group, scenarios in groups:
        scores = method_scores(rows, scenarios)
        if a not in scores or b not in scores:
            continue
        try:
            difference = paired_difference(scores[a], scores[b])
        except ValueError:  # no cell that both drove
            continue
        entries.append({"group": group, "a": score_interval(scores[a]), "b": score_interval(scores[b]),
                        "difference": difference})
    if not entries:
        raise ValueError(f"{a!r} and {b!r} share no (scenario, layout) cell: evaluate both with the same --first-seed")
    return entries


def seeds_to_decide(rows: list[dict], a: str, b: str, effect_points: float) -> dict:
    """Each method's checkpoint-to-checkpoint SD of the OOD average and the seeds per method that
    would make the difference's 95% interval +-`effect_points` wide; ValueError without two seeds each."""
    per_seed = seed_scores(rows)
    spread = {}
    for method in (a, b):
        averages = [ood.mean for _, ood in per_seed.get(method, {}).values() if ood is not None]
        if len(averages) < 2:
            raise ValueError(f"{method} has {len(averages)} checkpoint(s) with OOD cells: a seed spread needs at least two")
        spread[method] = float(np.std(averages, ddof=1))
    needed = math.ceil(1.96 ** 2 * (spread[a] ** 2 + spread[b] ** 2) / (effect_points / 100) ** 2)
    return {"effect_points": effect_points, "seed_sd": spread, "seeds_per_method": max(needed, 2)}


def markdown(entries: list[dict], a: str, b: str) -> str:
    lines = [f"| scenarios | cells (scenarios x layouts) | seeds A / B | {a} | {b} | A - B, points [95%] | wins / losses |",
             "|---|---|---|---|---|---|---|"]
    for entry in entries:
        d = entry["difference"]
        lines.append(f"| {entry['group']} | {d.cells} ({d.scenarios} x {d.layouts}) | {d.seeds_a} / {d.seeds_b} | "
                     f"{format_estimate(entry['a'])} | {format_estimate(entry['b'])} | {format_estimate(d, 100, '+.1f')} | "
                     f"{d.wins} / {d.losses} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="eval output folders or their results.jsonl files")
    parser.add_argument("--a", required=True, metavar="METHOD", help="method name of A (as eval's --name wrote it)")
    parser.add_argument("--b", required=True, metavar="METHOD", help="method name of B")
    parser.add_argument("--per-scenario", action="store_true", help="also a row per OOD scenario")
    parser.add_argument("--effect-points", type=float, metavar="E",
                        help="also the seeds per method an OOD difference of E points would need (several seeds each)")
    parser.add_argument("--json", metavar="FILE", help="also write the estimates to FILE")


def run(args) -> int:
    try:
        rows = merge_results(args.results)
        entries = compare(rows, args.a, args.b, args.per_scenario)
        seeds = None if args.effect_points is None else seeds_to_decide(rows, args.a, args.b, args.effect_points)
    except (FileNotFoundError, ValueError) as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    print(markdown(entries, args.a, args.b))
    if seeds is not None:
        sd = seeds["seed_sd"]
        print(f"\nOne checkpoint's OOD average varies by {100 * sd[args.a]:.1f} points ({args.a}) and {100 * sd[args.b]:.1f} "
              f"points ({args.b}) from seed to seed (SD): a {args.effect_points:g}-point difference needs about "
              f"{seeds['seeds_per_method']} training seeds per method for its 95% interval to be that narrow.")
    if args.json:
        records = [{"group": e["group"], **{k: asdict(e[k]) for k in ("a", "b", "difference")}} for e in entries]
        record = {"a": args.a, "b": args.b, "groups": records, **({"seeds_to_decide": seeds} if seeds else {})}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0
