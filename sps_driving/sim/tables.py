"""Tables and plots of closed-loop results (SPS Tables 1 and 2, Figure 5): per method and
scenario the mean score, failures by type, interventions, speed and obstacle passes; per method
the OOD average with its 95% interval over scenarios, layouts and training seeds, and the paired
difference against DA (sps_driving.sim.statistics).

OUT/table1.{csv,md} (methods: No-FM, I-ViT, DA, SPS-50 and any other named one) and
OUT/table2.{csv,md} (DA and SPS/SPPS/MSPPS at rates 0.7, 0.5, 0.3), each with one column per
method, the ID row then the 14 OOD rows, the OOD average and the gain over DA in points with
their intervals, the layouts and training seeds behind each column (methods with fewer than a
claim needs are marked), and the obstacle pass rate and margins; OUT/accuracy_vs_rate.png
(Figure 5: score against keep rate per selection family); and OUT/details.md (per scenario:
score with its interval, failures by type, interventions, obstacle passes and margins, mean
speed; paired and unpaired differences against DA).

Checkpoints of one method trained from different seeds are one column: their rows carry the
same method name and their own `training_seed`.

`sps-driving tables` renders them from the rows of several eval folders (each method and seed is
usually its own run), optionally on one range of layouts, and writes the merged rows beside them,
so a committed table folder can be rendered again from its own results.jsonl.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sps_driving.core.history import PATCH_POLICY
from sps_driving.core.resources import source_revision
from sps_driving.sim.results import RESULTS_FILE, merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES, SCENARIO_NAMES, SCENARIOS
from sps_driving.sim.statistics import Estimate, paired_difference, score_interval, training_seeds, unpaired_difference

EXPERT = "expert"  # the method name of the privileged expert's episodes
SELECTION_FAMILIES = ("SPS", "SPPS", "MSPPS")
RATES_PERCENT = (70, 50, 30)
# Column sets of the paper's tables: methods (Table 1) and selection variants by rate (Table 2).
TABLE1_METHODS = ("No-FM", "I-ViT", "DA", "SPS-50")
TABLE2_METHODS = ("DA",) + tuple(f"{family}-{rate}" for family in SELECTION_FAMILIES for rate in RATES_PERCENT)
# What a column needs to back a claim (layouts per scenario, training seeds); columns with fewer are marked.
CLAIM_LAYOUTS = 20
CLAIM_SEEDS = 3
MARK = "‡"
# Methods on the accuracy-against-rate plot: a selection family or the patch policy at a rate, and
# any suffix (SPS-50, SPS-50-PT, PP-50-T4-shared).
RATE_CURVE_NAME = re.compile(rf"(?P<family>{'|'.join((*SELECTION_FAMILIES, 'PP'))})-(?P<rate>\d+)(?P<suffix>(?:-\S+)?)")


def method_name(policy_config: dict) -> str:
    """The table column of a policy: No-FM (pixels backbone), I-ViT (the backbone's unmasked patch
    tokens), a patch policy by its rate and window (PP-50-T4, with -shared for a selection shared
    across the window), else by its selection: DA at rate 1.0, e.g. SPS-50 below; a relative_query
    policy (which reads every variant as its kept tokens) RQ and its rate, e.g. RQ-50; token
    dropping (extractor tokens kept) appends -TD, e.g. SPS-50-TD."""
    if policy_config.get("architecture") == PATCH_POLICY:  # a column of its own beside SPS at the same rate
        window = policy_config["policy"]
        rate = float(policy_config["selection"]["rate"])
        return f"PP-{int(round(rate * 100))}-T{window['window_frames']}" + ("-shared" if window["shared_selection"] else "")
    if policy_config.get("backbone") == "pixels":
        return "No-FM"
    if (policy_config.get("extractor") or {}).get("falloff") == "none":
        return "I-ViT"
    selection = policy_config.get("selection", {})
    rate = float(selection.get("rate", 1.0))
    variant = str(selection.get("variant", "sps"))
    if policy_config.get("architecture") == "relative_query":
        return f"RQ-{int(round(rate * 100))}"
    # Token dropping (the ViT on the kept patches only): a column of its own beside the dense one.
    dropping = "-TD" if (policy_config.get("extractor") or {}).get("tokens") == "kept" else ""
    if rate >= 1.0:
        return "DA" + dropping
    label = {"sps": "SPS", "spps": "SPPS", "mspps": "MSPPS", "threshold": "SPS-v1"}.get(variant, variant.upper())
    return f"{label}-{int(round(rate * 100))}{dropping}"


def training_seed(policy_config: dict) -> int | None:
    """The seed a policy was trained from: its selection seed, which also seeds the trainer's
    initial weights and every draw (sps_driving.train.trainer); None where the config has none."""
    seed = (policy_config.get("selection") or {}).get("seed")
    return None if seed is None else int(seed)


def method_scores(rows: list[dict], scenarios=SCENARIO_NAMES) -> dict:
    """{method: statistics.Scores} over `scenarios`: score per (scenario, layout seed, training seed)."""
    scores: dict = defaultdict(dict)
    for row in rows:
        if row["scenario"] in scenarios:
            scores[row["method"]][(row["scenario"], row["seed"], row.get("training_seed"))] = row["score"]
    return dict(scores)


def obstacle_margins(episodes: list[dict]) -> dict:
    """Pass rate and free-gap margin (m, gap minus the collision line) over the road-side obstacles
    the episodes' rows record; rows written before obstacles were recorded count for nothing."""
    obstacles = [o for e in episodes for o in e.get("obstacles", ())]
    margins = np.array([o["margin_m"] for o in obstacles], np.float64)
    return {
        "obstacles": len(obstacles),
        "passed": sum(o["passed"] for o in obstacles),
        "pass_rate": sum(o["passed"] for o in obstacles) / len(obstacles) if obstacles else math.nan,
        "margin_median_m": float(np.median(margins)) if obstacles else math.nan,
        "margin_p05_m": float(np.percentile(margins, 5)) if obstacles else math.nan,
    }


def summarize(rows: list[dict]) -> dict:
    """{method: {scenario: stats}} from result rows: the score with its 95% bootstrap interval
    over layouts and training seeds, failures, interventions, speed and obstacle passes."""
    grouped: dict = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["method"]][row["scenario"]].append(row)
    summary = {}
    for method, by_scenario in grouped.items():
        summary[method] = {}
        for scenario, episodes in by_scenario.items():
            score = score_interval(method_scores(episodes, (scenario,))[method])
            failures: dict = defaultdict(int)
            for e in episodes:
                for kind, count in e["failures"].items():
                    failures[kind] += count
            summary[method][scenario] = {
                "mean": score.mean,
                "low": score.low,
                "high": score.high,
                "episodes": len(episodes),
                "layouts": len({e["seed"] for e in episodes}),
                "seeds": len({e.get("training_seed") for e in episodes}),
                "interventions": sum(e["interventions"] for e in episodes),
                "failures": dict(failures),
                "mean_speed_mps": float(np.mean([e["mean_speed_mps"] for e in episodes])),
                "dropped_frames": sum(e.get("dropped_frames", 0) for e in episodes),
                "episode_s": episodes[0]["episode_s"],
                "size": f"{episodes[0]['width']}x{episodes[0]['height']}",
                **obstacle_margins(episodes),
            }
    return summary


@dataclass(frozen=True)
class MethodReport:
    """What Tables 1 and 2 say of one method over the OOD rows."""

    ood: Estimate | None  # OOD score with its 95% interval over scenarios x layouts x training seeds
    gain: Estimate | None  # paired difference against DA over the OOD cells both drove
    layouts: int  # distinct layout seeds, in the scenario with the fewest
    seeds: int  # distinct training seeds (checkpoints), in the scenario with the fewest
    obstacles: dict  # obstacle_margins over its OOD rows

    @property
    def indicative(self) -> bool:
        """Fewer layouts or training seeds than a claim needs."""
        return self.layouts < CLAIM_LAYOUTS or self.seeds < CLAIM_SEEDS


def method_reports(rows: list[dict]) -> dict:
    """{method: MethodReport} from result rows."""
    ood = method_scores(rows, OOD_SCENARIO_NAMES)
    reports = {}
    for method in sorted({r["method"] for r in rows}):
        own = [r for r in rows if r["method"] == method]
        scenarios = {r["scenario"] for r in own}
        gain = None
        if method != "DA" and method in ood and "DA" in ood:
            try:
                gain = paired_difference(ood[method], ood["DA"])
            except ValueError:  # no OOD cell driven by both
                gain = None
        reports[method] = MethodReport(
            score_interval(ood[method]) if method in ood else None, gain,
            min(len({r["seed"] for r in own if r["scenario"] == s}) for s in scenarios),
            min(len({r.get("training_seed") for r in own if r["scenario"] == s}) for s in scenarios),
            obstacle_margins([r for r in own if r["scenario"] in OOD_SCENARIO_NAMES]))
    return reports


def seed_scores(rows: list[dict]) -> dict:
    """{method: {training seed: (ID Estimate or None, OOD Estimate or None)}} for the methods with
    more than one checkpoint: how far apart the seeds of one method land, beside the pooled score."""
    by_method: dict = defaultdict(dict)
    for method, scores in method_scores(rows).items():
        seeds = training_seeds(scores)
        if len(seeds) < 2:
            continue
        for seed in seeds:
            own = {cell: score for cell, score in scores.items() if cell[2] == seed}
            groups = [{c: v for c, v in own.items() if c[0] in names} for names in ((ID_SCENARIO.name,), OOD_SCENARIO_NAMES)]
            by_method[method][seed] = tuple(score_interval(g) if g else None for g in groups)
    return dict(by_method)


def table2_column(name: str) -> str | None:
    """The Table 2 column a method belongs beside: itself, or the column it is a variant of, named
    with a suffix (SPS-50-PT: SPS-50 with another architecture); None for other methods."""
    if name in TABLE2_METHODS:
        return name
    return next((column for column in TABLE2_METHODS if name.startswith(column + "-")), None)


def _method_sort_key(name: str) -> tuple:
    column = table2_column(name) or name  # a suffixed variant right after its column
    if column in TABLE1_METHODS:
        return (0, TABLE1_METHODS.index(column), name)
    if column in TABLE2_METHODS:
        return (1, TABLE2_METHODS.index(column), name)
    return (3 if name == EXPERT else 2, 0, name)


def _number(value: float, fmt: str) -> str:
    return "" if value is None or not math.isfinite(value) else format(value, fmt)


def table_rows(summary: dict, reports: dict, methods: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Table layout (the CSV's): header, then the ID and OOD rows (mean score), the OOD average with
    its 95% interval, the gain over DA in points with its paired 95% interval, the layouts and
    training seeds each method ran, and its obstacle pass rate and margins (m) over the OOD rows."""
    methods = sorted(summary if methods is None else methods, key=_method_sort_key)
    header = ["scenario"] + methods
    rows = []
    for scenario in SCENARIO_NAMES:
        if any(scenario in summary[m] for m in methods):
            rows.append([scenario] + [f"{summary[m][scenario]['mean']:.2f}" if scenario in summary[m] else "" for m in methods])

    def row(name, value):
        rows.append([name] + [value(reports[m]) for m in methods])

    row("average", lambda r: _number(r.ood.mean, ".3f") if r.ood else "")
    row("average_low", lambda r: _number(r.ood.low, ".3f") if r.ood else "")
    row("average_high", lambda r: _number(r.ood.high, ".3f") if r.ood else "")
    if "DA" in methods and reports["DA"].ood is not None:
        row("gain_over_DA_points", lambda r: "+0.0" if r is reports["DA"] else _number(100 * r.gain.mean, "+.1f") if r.gain else "")
        row("gain_low_points", lambda r: _number(100 * r.gain.low, "+.1f") if r.gain else "")
        row("gain_high_points", lambda r: _number(100 * r.gain.high, "+.1f") if r.gain else "")
    row("layouts", lambda r: str(r.layouts))
    row("training_seeds", lambda r: str(r.seeds))
    row("obstacle_pass_rate", lambda r: _number(r.obstacles["pass_rate"], ".3f"))
    row("margin_median_m", lambda r: _number(r.obstacles["margin_median_m"], ".2f"))
    row("margin_p05_m", lambda r: _number(r.obstacles["margin_p05_m"], ".2f"))
    return header, rows


def ood_average(by_scenario: dict) -> float | None:
    """Mean score over the OOD scenarios present (every Table 1 row but the first, the ID one)."""
    ood = [by_scenario[s]["mean"] for s in OOD_SCENARIO_NAMES if s in by_scenario]
    return float(np.mean(ood)) if ood else None


def table_methods(summary: dict) -> dict:
    """{table name: methods present}: Table 1 holds the method families (and any other named
    method, and the expert as a reference), Table 2 DA and the selection variants by rate, each
    with its suffixed variants beside it (SPS-50-PT after SPS-50)."""
    tables = {
        "table1": [m for m in summary if table2_column(m) is None or m in TABLE1_METHODS],
        "table2": [m for m in summary if table2_column(m) is not None],
    }
    return {name: methods for name, methods in tables.items() if methods}


def format_interval(low: float, high: float, scale: float = 1.0, fmt: str = ".2f") -> str:
    """"[low, high]" scaled and formatted; "[n/a]" where there was nothing to resample."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "[n/a]"
    return f"[{format(scale * low, fmt)}, {format(scale * high, fmt)}]"


def format_estimate(estimate: Estimate | None, scale: float = 1.0, fmt: str = ".3f") -> str:
    """"mean [low, high]" scaled and formatted; empty for no estimate."""
    if estimate is None:
        return ""
    return f"{format(scale * estimate.mean, fmt)} {format_interval(estimate.low, estimate.high, scale, fmt)}"


def _markdown_table(header: list[str], table: list[list[str]], reports: dict) -> list[str]:
    """The CSV's rows with each interval beside its value, the counts as layouts x seeds, and
    methods short of a claim's layouts or seeds marked."""
    labels = {s.name: s.label for s in SCENARIOS}
    methods = header[1:]
    by_name = {row[0]: row[1:] for row in table}
    names = [m + (f" {MARK}" if reports[m].indicative else "") for m in methods]
    lines = ["| " + " | ".join(["Scenario"] + names) + " |", "|" + "---|" * len(header)]
    for row in table:
        if row[0] in SCENARIO_NAMES:
            lines.append("| " + " | ".join([labels[row[0]]] + row[1:]) + " |")
    average = [f"{a} [{lo}, {hi}]" if lo else a for a, lo, hi in
               zip(by_name["average"], by_name["average_low"], by_name["average_high"])]
    lines.append("| Average (OOD) [95% interval] | " + " | ".join(average) + " |")
    if "gain_over_DA_points" in by_name:
        gains = [f"{g} [{lo}, {hi}]" if lo else g for g, lo, hi in
                 zip(by_name["gain_over_DA_points"], by_name["gain_low_points"], by_name["gain_high_points"])]
        lines.append("| Gain over DA, points [paired 95% interval] | " + " | ".join(gains) + " |")
    lines.append("| Layouts x training seeds | " + " | ".join(f"{n} x {k}" for n, k in
                                                              zip(by_name["layouts"], by_name["training_seeds"])) + " |")
    lines.append("| Obstacles passed (OOD) | " + " | ".join(by_name["obstacle_pass_rate"]) + " |")
    lines.append("| Margin m, median / 5th percentile (OOD) | " + " | ".join(
        f"{med} / {p05}" if med else "" for med, p05 in zip(by_name["margin_median_m"], by_name["margin_p05_m"])) + " |")
    return lines


def _provenance(rows: list[dict], command: str, revision: str) -> list[str]:
    """The lines of a table's header that say how its rows were made: command, revision, settings
    and layouts."""
    settings = sorted({(r["profile"], r["episode_s"], r["width"], r["height"]) for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    layouts = f"{seeds[0]}..{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ", ".join(map(str, seeds))
    return [
        f"Command: `{command}`  ",
        f"Git revision: {revision}  ",
        "Host (sps_driving.core.host): " + (" | ".join(sorted({r["host"] for r in rows if "host" in r})) or "not recorded") + "  ",
        "Settings (profile, episode s, rendered size): " + "; ".join(f"{p}, {e:g} s, {w}x{h}" for p, e, w, h in settings) + "  ",
        f"Layouts (episode seeds, shared by all scenarios and methods): {layouts}  ",
    ]


def _write_table(out: Path, name: str, methods: list[str], summary: dict, reports: dict, provenance: list[str]) -> None:
    """OUT/NAME.csv and OUT/NAME.md: table1 (methods) or table2 (selection variants and rates) of
    `methods`, the markdown with its provenance and the methods not yet run."""
    header, table = table_rows(summary, reports, methods)
    with (out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(table)
    expected = TABLE1_METHODS if name == "table1" else TABLE2_METHODS
    missing = [m for m in expected if m not in summary]
    lines = [
        f"# {'Table 1: methods' if name == 'table1' else 'Table 2: selection variants and rates'}"
        " (closed loop, normalized success duration)",
        "",
        *provenance,
        "Not yet run: " + (", ".join(missing) if missing else "none") + "  ",
        "Score: time until the first failure / episode length; each cell the mean over layouts and training seeds. "
        "Average: over the OOD rows, with its 95% bootstrap interval over scenarios, layouts and training seeds. "
        "Gain: the paired difference to DA over the OOD (scenario, layout) cells both drove, 95% paired bootstrap "
        "interval (sps_driving.sim.statistics). Obstacles passed: share of the road-side obstacles reached that were "
        "passed without a collision failure; margin: smallest free gap to an obstacle minus the collision line. "
        f"{MARK}: fewer than {CLAIM_LAYOUTS} layouts or {CLAIM_SEEDS} training seeds: indicative, not a claim.",
        "",
        *_markdown_table(header, table, reports),
    ]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def _scenario_details(summary: dict) -> list[str]:
    """details.md's opening: each method's scores, failures, obstacles, speed and drops by scenario."""
    labels = {s.name: s.label for s in SCENARIOS}
    details = ["# Per-scenario details", "",
               "Score: mean over layouts and training seeds, 95% bootstrap interval over both. Obstacles: passed / "
               "reached; margin (m): smallest free gap to an obstacle minus the collision line, median and 5th percentile.",
               ""]
    for method in sorted(summary, key=_method_sort_key):
        details += [f"## {method}", "",
                    "| Scenario | Score [95% interval] | Layouts x seeds | Interventions | Lane | Collision | Heading | "
                    "Obstacles passed | Margin m median / p5 | Speed m/s | Dropped frames |",
                    "|---|---|---|---|---|---|---|---|---|---|---|"]
        for scenario in SCENARIO_NAMES:
            s = summary[method].get(scenario)
            if s is None:
                continue
            f = s["failures"]
            passes = f"{s['passed']}/{s['obstacles']}" if s["obstacles"] else ""
            margin = f"{s['margin_median_m']:+.2f} / {s['margin_p05_m']:+.2f}" if s["obstacles"] else ""
            details.append(
                f"| {labels[scenario]} | {s['mean']:.2f} {format_interval(s['low'], s['high'])} | {s['layouts']} x {s['seeds']} | "
                f"{s['interventions']} | {f.get('lane_boundary', 0)} | {f.get('collision', 0)} | {f.get('heading', 0)} | "
                f"{passes} | {margin} | {s['mean_speed_mps']:.1f} | {s['dropped_frames']} |"
            )
        details.append("")
    return details


def _paired_details(rows: list[dict], reports: dict) -> list[str]:
    """details.md's section on each method's paired difference to DA beside the unpaired one;
    none without a method paired with DA."""
    paired = {m: r.gain for m, r in reports.items() if r.gain is not None}
    if not paired:
        return []
    ood = method_scores(rows, OOD_SCENARIO_NAMES)
    details = ["## Paired differences against DA", "",
               "Over the OOD (scenario, layout) cells both methods drove with every checkpoint; 95% bootstrap "
               "intervals: paired (resampling scenarios, layouts within them, and each method's training seeds) and, "
               "for comparison, unpaired (every episode an independent draw; too narrow where checkpoints differ). "
               "Wins and losses: cells where the method's mean over its checkpoints beats DA's, or DA's beats it.", "",
               "| Method | Difference (points) | Paired 95% interval | Unpaired 95% interval | Scenarios | Layouts | "
               "Seeds (method / DA) | Wins | Losses |",
               "|---|---|---|---|---|---|---|---|---|"]
    for method in sorted(paired, key=_method_sort_key):
        d = paired[method]
        _, low, high = unpaired_difference(ood[method], ood["DA"])
        details.append(f"| {method} | {100 * d.mean:+.1f} | {format_interval(d.low, d.high, 100, '+.1f')} | "
                       f"{format_interval(low, high, 100, '+.1f')} | {d.scenarios} | {d.layouts} | {d.seeds_a} / {d.seeds_b} | "
                       f"{d.wins} | {d.losses} |")
    details.append("")
    return details


def _seed_details(rows: list[dict]) -> list[str]:
    """details.md's section on each checkpoint of a method with several training seeds; none
    without such a method."""
    per_seed = seed_scores(rows)
    if not per_seed:
        return []
    details = ["## Training seeds", "",
               "Each checkpoint of a method with several: its score over the layouts it drove, 95% bootstrap interval over "
               "layouts (in distribution) and over scenarios and layouts (OOD). The spread between seeds of one method "
               "is part of what the pooled intervals above resample.", "",
               "| Method | Training seed | In distribution [95%] | OOD average [95%] | OOD cells |", "|---|---|---|---|---|"]
    for method in sorted(per_seed, key=_method_sort_key):
        for seed, (in_distribution, ood) in per_seed[method].items():
            details.append(f"| {method} | {seed} | {format_estimate(in_distribution)} | {format_estimate(ood)} | "
                           f"{ood.cells if ood else 0} |")
    details.append("")
    return details


def write_tables(rows: list[dict], out: Path, command: str, revision: str | None = None) -> None:
    """OUT/table1.{csv,md}, table2.{csv,md}, details.md and accuracy_vs_rate.png from `rows`;
    `revision`: the source revision they record (default: the checkout's now)."""
    summary = summarize(rows)
    if not summary:
        return
    revision = revision or source_revision()
    reports = method_reports(rows)
    provenance = _provenance(rows, command, revision)
    for name, methods in table_methods(summary).items():
        _write_table(out, name, methods, summary, reports, provenance)
    details = [*_scenario_details(summary), *_paired_details(rows, reports), *_seed_details(rows)]
    (out / "details.md").write_text("\n".join(details))
    curves = rate_curves(summary)
    if any(len(points) > 1 for points in curves.values()):
        plot_rate_curves(curves, out / "accuracy_vs_rate.png")


def rate_curves(summary: dict) -> dict:
    """{curve: [(keep rate, OOD average, ID score)]} in ascending rate: SPS, SPPS and MSPPS, each
    ending at DA (rate 1); a suffixed variant of theirs on its own (SPS-PT from SPS-50-PT), as the
    patch policies by window (PP-T4 from PP-50-T4, PP-30-T4, ...), without the DA end: DA is
    neither their architecture nor their window."""
    def point(rate: float, by_scenario: dict) -> tuple | None:
        ood = ood_average(by_scenario)
        return None if ood is None else (rate, ood, by_scenario.get(ID_SCENARIO.name, {}).get("mean", math.nan))

    curves = {}
    for method, by_scenario in summary.items():
        match = RATE_CURVE_NAME.fullmatch(method)
        found = point(int(match["rate"]) / 100, by_scenario) if match else None
        if found is not None:
            curves.setdefault(match["family"] + match["suffix"], []).append(found)
    dense = point(1.0, summary["DA"]) if "DA" in summary else None
    for family in SELECTION_FAMILIES:
        if family in curves and dense is not None:
            curves[family].append(dense)
    return {name: sorted(points) for name, points in curves.items()}


def plot_rate_curves(curves: dict, path: Path) -> None:
    """Figure 5's layout: average OOD score (solid) and ID score (dashed) against the keep rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for index, (curve, points) in enumerate(curves.items()):
        rates, ood, in_dist = zip(*points)
        ax.plot(rates, ood, "o-", color=f"C{index}", label=f"{curve}: OOD average")
        ax.plot(rates, in_dist, "s--", color=f"C{index}", alpha=0.5, label=f"{curve}: ID")
    ax.set_xlabel("keep rate (1.0 = DA, dense)")
    ax.set_ylabel("normalized success duration")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+",
                        help="eval output folders or their results.jsonl files (a later file's copy of an episode wins)")
    parser.add_argument("--out", required=True, help="folder for the tables, details.md and the merged results.jsonl")
    parser.add_argument("--first-seed", type=int, metavar="N", help="keep only layouts N .. N + EPISODES - 1 (with --episodes)")
    parser.add_argument("--episodes", type=int, metavar="EPISODES", help="how many layouts from --first-seed")


def run(args) -> int:
    if (args.first_seed is None) != (args.episodes is None) or (args.episodes is not None and args.episodes < 1):
        print("tables: give --first-seed and a positive --episodes together, or neither", file=sys.stderr)
        return 2
    try:
        rows = merge_results(args.results)
    except FileNotFoundError as err:
        print(f"tables: {err}", file=sys.stderr)
        return 2
    command = f"sps-driving tables {' '.join(args.results)} --out {args.out}"
    if args.episodes is not None:
        layouts = range(args.first_seed, args.first_seed + args.episodes)
        rows = [r for r in rows if r["seed"] in layouts]
        command += f" --first-seed {args.first_seed} --episodes {args.episodes}"
    if not rows:
        print("tables: no episodes to tabulate" + (" on those layouts" if args.episodes is not None else ""), file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    revision = source_revision()  # before writing: an output folder inside the checkout would count as a change
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_tables(rows, out, command, revision)
    print(f"{len(rows)} episodes: tables and details in {out}")
    return 0
