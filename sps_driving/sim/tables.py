"""Tables and plots of closed-loop results (SPS Tables 1 and 2, Figure 5): per method and
scenario the mean score with its 95% interval, failures by type, interventions and speed; the
paired difference of each method against DA over the same OOD episodes.

OUT/table1.{csv,md} (methods: No-FM, I-ViT, DA, SPS-50 and any other named one) and
OUT/table2.{csv,md} (DA and SPS/SPPS/MSPPS at rates 0.7, 0.5, 0.3), each with one column per
method, the ID row then the 14 OOD rows, an average over the OOD rows and the gain over DA in
points; OUT/accuracy_vs_rate.png (Figure 5: score against keep rate per selection family); and
OUT/details.md (per scenario: mean with 95% interval, failures by type, interventions, mean
speed; paired differences against DA).
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from sps_driving.resources import source_revision
from sps_driving.sim.scenarios import SCENARIO_NAMES, SCENARIOS
from sps_driving.sim.statistics import interval95, paired_difference

EXPERT = "expert"  # the method name of the privileged expert's episodes
SELECTION_FAMILIES = ("SPS", "SPPS", "MSPPS")
RATES_PERCENT = (70, 50, 30)
# Column sets of the paper's tables: methods (Table 1) and selection variants by rate (Table 2).
TABLE1_METHODS = ("No-FM", "I-ViT", "DA", "SPS-50")
TABLE2_METHODS = ("DA",) + tuple(f"{family}-{rate}" for family in SELECTION_FAMILIES for rate in RATES_PERCENT)


def method_name(policy_config: dict) -> str:
    """The table column of a policy: No-FM (pixels backbone), I-ViT (the backbone's unmasked patch
    tokens), else by its selection: DA at rate 1.0, e.g. SPS-50 below."""
    if policy_config.get("backbone") == "pixels":
        return "No-FM"
    if (policy_config.get("extractor") or {}).get("falloff") == "none":
        return "I-ViT"
    selection = policy_config.get("selection", {})
    rate = float(selection.get("rate", 1.0))
    variant = str(selection.get("variant", "sps"))
    if rate >= 1.0:
        return "DA"
    label = {"sps": "SPS", "spps": "SPPS", "mspps": "MSPPS", "threshold": "SPS-v1"}.get(variant, variant.upper())
    return f"{label}-{int(round(rate * 100))}"


def summarize(rows: list[dict]) -> dict:
    """{method: {scenario: stats}} from result rows."""
    grouped: dict = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["method"]][row["scenario"]].append(row)
    summary = {}
    for method, by_scenario in grouped.items():
        summary[method] = {}
        for scenario, episodes in by_scenario.items():
            mean, half = interval95([e["score"] for e in episodes])
            failures: dict = defaultdict(int)
            for e in episodes:
                for kind, count in e["failures"].items():
                    failures[kind] += count
            summary[method][scenario] = {
                "mean": mean,
                "ci95": half,
                "episodes": len(episodes),
                "interventions": sum(e["interventions"] for e in episodes),
                "failures": dict(failures),
                "mean_speed_mps": float(np.mean([e["mean_speed_mps"] for e in episodes])),
                "dropped_frames": sum(e.get("dropped_frames", 0) for e in episodes),
                "episode_s": episodes[0]["episode_s"],
                "size": f"{episodes[0]['width']}x{episodes[0]['height']}",
            }
    return summary


def _method_sort_key(name: str) -> tuple:
    if name in TABLE1_METHODS:
        return (0, TABLE1_METHODS.index(name), name)
    if name in TABLE2_METHODS:
        return (1, TABLE2_METHODS.index(name), name)
    return (3 if name == EXPERT else 2, 0, name)


def table_rows(summary: dict, methods: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    """Table layout: header and rows (ID, OOD rows, average over OOD, gain over DA in points)."""
    methods = sorted(summary if methods is None else methods, key=_method_sort_key)
    header = ["scenario"] + methods
    rows = []
    for scenario in SCENARIO_NAMES:
        if any(scenario in summary[m] for m in methods):
            rows.append([scenario] + [f"{summary[m][scenario]['mean']:.2f}" if scenario in summary[m] else "" for m in methods])
    averages = {m: ood_average(summary[m]) for m in methods}
    rows.append(["average"] + [f"{averages[m]:.3f}" if averages[m] is not None else "" for m in methods])
    if averages.get("DA") is not None:
        gains = [f"{100 * (averages[m] - averages['DA']):+.1f}" if averages[m] is not None else "" for m in methods]
        rows.append(["gain_over_DA_points", *gains])
    return header, rows


def ood_average(by_scenario: dict) -> float | None:
    """Mean score over the OOD scenarios present (every Table 1 row but the first, the ID one)."""
    ood = [by_scenario[s]["mean"] for s in SCENARIO_NAMES[1:] if s in by_scenario]
    return float(np.mean(ood)) if ood else None


def table_methods(summary: dict) -> dict:
    """{table name: methods present}: Table 1 holds the method families (and any other named
    method, and the expert as a reference), Table 2 DA and the selection variants by rate."""
    tables = {
        "table1": [m for m in summary if m not in TABLE2_METHODS or m in TABLE1_METHODS],
        "table2": [m for m in summary if m in TABLE2_METHODS],
    }
    return {name: methods for name, methods in tables.items() if methods}


def write_tables(rows: list[dict], out: Path, command: str) -> None:
    """OUT/table1.{csv,md}, table2.{csv,md}, details.md and accuracy_vs_rate.png from `rows`."""
    summary = summarize(rows)
    if not summary:
        return
    labels = {s.name: s.label for s in SCENARIOS}
    settings = sorted({(r["profile"], r["episode_s"], r["width"], r["height"]) for r in rows})
    for name, methods in table_methods(summary).items():
        header, table = table_rows(summary, methods)
        with (out / f"{name}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(table)
        expected = TABLE1_METHODS if name == "table1" else TABLE2_METHODS
        missing = [m for m in expected if m not in summary]
        counts = {m: sorted({v["episodes"] for v in summary[m].values()}) for m in header[1:]}
        lines = [
            f"# {'Table 1: methods' if name == 'table1' else 'Table 2: selection variants and rates'}"
            " (closed loop, normalized success duration)",
            "",
            f"Command: `{command}`  ",
            f"Git revision: {source_revision()}  ",
            "Settings (profile, episode s, rendered size): " + "; ".join(f"{p}, {e:g} s, {w}x{h}" for p, e, w, h in settings) + "  ",
            "Episodes per scenario: " + ", ".join(f"{m}: {'/'.join(map(str, c))}" for m, c in counts.items()) + "  ",
            "Not yet run: " + (", ".join(missing) if missing else "none") + "  ",
            "Episode seeds: 0..N-1 (layouts shared by all scenarios and methods). Score: time until the first "
            "failure / episode length. Average: over the OOD rows. Gain: average minus DA's, in points.",
            "",
            "| " + " | ".join(["Scenario"] + header[1:]) + " |",
            "|" + "---|" * len(header),
        ]
        for row in table:
            lines.append("| " + " | ".join([labels.get(row[0], row[0])] + row[1:]) + " |")
        (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    details = ["# Per-scenario details", ""]
    for method in sorted(summary, key=_method_sort_key):
        details += [f"## {method}", "",
                    "| Scenario | Score (95% CI) | Episodes | Interventions | Lane | Collision | Heading | Speed m/s | Dropped frames |",
                    "|---|---|---|---|---|---|---|---|---|"]
        for scenario in SCENARIO_NAMES:
            s = summary[method].get(scenario)
            if s is None:
                continue
            f = s["failures"]
            details.append(
                f"| {labels[scenario]} | {s['mean']:.2f} ± {s['ci95']:.2f} | {s['episodes']} | {s['interventions']} | "
                f"{f.get('lane_boundary', 0)} | {f.get('collision', 0)} | {f.get('heading', 0)} | "
                f"{s['mean_speed_mps']:.1f} | {s['dropped_frames']} |"
            )
        details.append("")
    paired = paired_against_da(rows)
    if paired:
        details += ["## Paired differences against DA", "",
                    "Over the OOD episodes both ran (same scenario, same seed); 95% bootstrap interval of the mean.", "",
                    "| Method | Difference (points) | 95% interval | Wins | Losses | Pairs |", "|---|---|---|---|---|---|"]
        for method in sorted(paired, key=_method_sort_key):
            d = paired[method]
            details.append(f"| {method} | {100 * d.mean:+.1f} | [{100 * d.low:+.1f}, {100 * d.high:+.1f}] | {d.wins} | "
                           f"{d.losses} | {d.pairs} |")
        details.append("")
    (out / "details.md").write_text("\n".join(details))
    curves = rate_curves(summary)
    if any(len(points) > 1 for points in curves.values()):
        plot_rate_curves(curves, out / "accuracy_vs_rate.png")


def paired_against_da(rows: list[dict]) -> dict:
    """{method: statistics.PairedDifference} of each method minus DA over the OOD episodes both
    ran (same scenario, same episode seed); methods sharing fewer than two are left out."""
    scores: dict = defaultdict(dict)
    for row in rows:
        if row["scenario"] != SCENARIO_NAMES[0]:
            scores[row["method"]][(row["scenario"], row["episode"])] = row["score"]
    if "DA" not in scores:
        return {}
    paired = {}
    for method, by_episode in scores.items():
        common = sorted(set(by_episode) & set(scores["DA"]))
        if method != "DA" and len(common) >= 2:
            paired[method] = paired_difference([by_episode[k] for k in common], [scores["DA"][k] for k in common])
    return paired


def rate_curves(summary: dict) -> dict:
    """{family: [(keep rate, OOD average, ID score)]} for SPS, SPPS and MSPPS, each ending at DA (rate 1)."""
    curves = {}
    for family in SELECTION_FAMILIES:
        points = []
        for rate, method in [(r / 100, f"{family}-{r}") for r in RATES_PERCENT] + [(1.0, "DA")]:
            ood = ood_average(summary[method]) if method in summary else None
            if ood is not None:
                points.append((rate, ood, summary[method].get(SCENARIO_NAMES[0], {}).get("mean", math.nan)))
        if any(rate < 1.0 for rate, _, _ in points):
            curves[family] = sorted(points)
    return curves


def plot_rate_curves(curves: dict, path: Path) -> None:
    """Figure 5's layout: average OOD score (solid) and ID score (dashed) against the keep rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for (family, points), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green")):
        rates, ood, in_dist = zip(*points)
        ax.plot(rates, ood, "o-", color=color, label=f"{family}: OOD average")
        ax.plot(rates, in_dist, "s--", color=color, alpha=0.5, label=f"{family}: ID")
    ax.set_xlabel("keep rate (1.0 = DA, dense)")
    ax.set_ylabel("normalized success duration")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
