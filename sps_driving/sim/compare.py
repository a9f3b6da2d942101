"""`sps-driving compare`: method A against method B over the episodes of `eval` results files,
paired cell by cell (sps_driving.sim.statistics): in distribution, out of distribution and, on
request, per OOD scenario, each with its 95% bootstrap interval over scenarios, layouts and training
seeds, and the cells won and lost. Tables 1 and 2 pair every method with DA only; an ablation (a
policy with and without an option, two architectures, one policy on two views) needs any pair."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from sps_driving.sim.results import merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES
from sps_driving.sim.statistics import paired_difference, score_interval
from sps_driving.sim.tables import format_estimate, method_scores


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
    parser.add_argument("--json", metavar="FILE", help="also write the estimates to FILE")


def run(args) -> int:
    try:
        entries = compare(merge_results(args.results), args.a, args.b, args.per_scenario)
    except (FileNotFoundError, ValueError) as err:
        print(f"compare: {err}", file=sys.stderr)
        return 2
    print(markdown(entries, args.a, args.b))
    if args.json:
        records = [{"group": e["group"], **{k: asdict(e[k]) for k in ("a", "b", "difference")}} for e in entries]
        Path(args.json).write_text(json.dumps({"a": args.a, "b": args.b, "groups": records}, indent=1) + "\n")
    return 0
