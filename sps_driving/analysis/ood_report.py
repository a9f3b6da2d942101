"""`sps-driving ood report`: what the OOD score tells, from eval rows that log it per frame.

- Prediction, on the rows of the runs without the rule (and without a cruise scale): for each
  scenario, the AUROC of each score for "a failure follows within horizon_s", over every frame of
  its episodes whose outcome the episode tells (not one within horizon_s of its end with no
  failure after it); the median over the OOD scenarios, with its 95% bootstrap interval over them;
  each combination of scores asked for (`combine`) against each of its parts, scenario by
  scenario; Spearman's rank correlation, across the OOD scenarios, of a scenario's mean score with
  its OOD average (a good score ranks the worst scenarios highest); the lead time of the first
  alarm (the score above the rule's slow or handover threshold) before each failure, counted from
  the previous failure or the episode's start.
- The rule replayed on those logged scores (sps_driving.core.monitor.OodRule, config/ood.yaml):
  handovers it would request per 10 minutes in the episodes without a failure, by scenario kind.
- Closed loop, per method (rule off, rule on, constant slow), on the cells every method drove: OOD average, failures per km and per
  minute of autonomous driving, share of frames slowed, handovers, and the OOD cells of the rule-off
  run with a failure in which the method's run requested a handover or slowed before that failure.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy import stats

from sps_driving.core.monitor import OodRule, OodRuleConfig
from sps_driving.core.ood import (
    HEAD_DISAGREEMENT,
    SCORE_METHODS,
    SELECTION_DISAGREEMENT,
    load_ood_config,
    lookahead_offset,
)
from sps_driving.sim.results import merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES
from sps_driving.sim.statistics import BOOTSTRAP_RESAMPLES, sample_interval

SMOOTHING_FRAMES = 10  # frames of the causal mean variant of each score (1 s at 10 Hz)
# Scores of the policy's own behaviour, from the steering each frame was driven with (rows that log
# `steering_rad`): its magnitude (rad) and its rate of change from the frame before (rad/s).
STEERING_MAGNITUDE, STEERING_RATE = "steering_magnitude", "steering_rate"
BEHAVIOUR_SCORES = (STEERING_MAGNITUDE, STEERING_RATE)
# Privileged, not scores the car has: the simulator's true lane pose of each frame (rows that log
# `lane_offset_m`), as the lane-pose probe's scores read it (core.ood.PROBE_METHODS): the bound of what any
# score of the car's place in its lane can predict.
TRUE_LANE_OFFSET, TRUE_LANE_LOOKAHEAD = "true_lane_offset", "true_lane_lookahead"
TRUE_LANE_SCORES = (TRUE_LANE_OFFSET, TRUE_LANE_LOOKAHEAD)
# A combination of scores ("a+b+c", `ood report --combine`) is the mean of its parts, each divided by
# this quantile of its values over the in-distribution episodes' frames, so that each part counts
# alike and no failure label goes into the scale.
COMBINATION_QUANTILE = 0.99


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Probability that a positive frame scores above a negative one (ties count half); NaN without both."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(average, counts)
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def frame_labels(row: dict, horizon_s: float) -> np.ndarray:
    """For each logged frame of an episode: a failure follows within `horizon_s` (s) of it."""
    times = np.asarray(row["ood"]["time_s"])
    failures = np.asarray(row["ood"]["failure_times_s"], dtype=np.float64)
    if len(failures) == 0:
        return np.zeros(len(times), dtype=bool)
    ahead = failures[None, :] - times[:, None]
    return ((ahead > 0) & (ahead <= horizon_s)).any(axis=1)


def outcome_known(row: dict, horizon_s: float) -> np.ndarray:
    """For each logged frame: whether the episode tells if a failure follows within `horizon_s`. A
    frame less than `horizon_s` before the episode's end without a failure after it is unknown (the
    end hides what would have come), not safe."""
    times = np.asarray(row["ood"]["time_s"], dtype=np.float64)
    end = float(row.get("duration_s", times[-1] if len(times) else 0.0))
    return frame_labels(row, horizon_s) | (times + horizon_s <= end + 1e-9)


def frame_scores(row: dict, method: str, causal_window: int = 1) -> np.ndarray:
    """A method's per-frame score of an episode; with causal_window n, the mean of the last n frames."""
    if method in BEHAVIOUR_SCORES:
        values = _behaviour(row, method)
    elif method in TRUE_LANE_SCORES:
        values = _true_lane(row, method)
    else:  # NaN where an episode did not log it (another calibration): left out like a dropped frame
        values = _finite(row["ood"]["scores"].get(method, [None] * len(row["ood"]["time_s"])))
    if causal_window <= 1:
        return values
    sums = np.cumsum(np.concatenate([[0.0], values]))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - causal_window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def _behaviour(row: dict, method: str) -> np.ndarray:
    steering = np.asarray(row["ood"]["steering_rad"], dtype=np.float64)
    if method == STEERING_MAGNITUDE:
        return np.abs(steering)
    times = np.asarray(row["ood"]["time_s"], dtype=np.float64)
    rate = np.zeros(len(steering))
    rate[1:] = np.abs(np.diff(steering)) / np.maximum(np.diff(times), 1e-9)
    return rate


def _true_lane(row: dict, method: str) -> np.ndarray:
    lateral = _finite(row["ood"]["lane_offset_m"])
    if method == TRUE_LANE_OFFSET:
        return np.abs(lateral)
    return lookahead_offset(lateral, _finite(row["ood"]["heading_error_rad"]))


def score_variants(rows: list[dict], combinations: tuple[str, ...] = ()) -> list[tuple[str, str, int]]:
    """(label, method, causal window in frames) of every score the rows logged, of the behaviour
    scores where they logged the steering, and of the combinations added to them (`combine`)."""
    logged = {name for row in _logged(rows) for name in row["ood"]["scores"]}
    if _logged(rows) and all("steering_rad" in row["ood"] for row in _logged(rows)):
        logged |= set(BEHAVIOUR_SCORES)
    if _logged(rows) and all("lane_offset_m" in row["ood"] for row in _logged(rows)):
        logged |= set(TRUE_LANE_SCORES)
    methods = [m for m in (*SCORE_METHODS, HEAD_DISAGREEMENT, SELECTION_DISAGREEMENT, *BEHAVIOUR_SCORES,
                           *TRUE_LANE_SCORES) if m in logged] + list(combinations)
    return [(m, m, 1) for m in methods] + [(f"{m} ({SMOOTHING_FRAMES}-frame mean)", m, SMOOTHING_FRAMES) for m in methods]


def combine(rows: list[dict], combination: str) -> None:
    """Adds to each row's per-frame scores the combination "a+b+..." of the scores it names (see
    COMBINATION_QUANTILE); a frame without one of its parts has none."""
    parts = combination.split("+")
    known = {method for _, method, _ in score_variants(rows)}
    if len(parts) < 2 or not set(parts) <= known:
        raise ValueError(f"cannot combine {combination!r}: name two or more of these rows' scores, joined by '+': "
                         + ", ".join(sorted(known)))
    in_distribution = [r for r in rows if r["scenario"] == ID_SCENARIO.name]
    if not in_distribution:
        raise ValueError(f"cannot combine {combination!r}: its scale is read from in-distribution episodes, and none are here")
    scales = []
    for part in parts:
        values = np.concatenate([frame_scores(r, part) for r in in_distribution])
        scale = float(np.nanquantile(values, COMBINATION_QUANTILE)) if np.isfinite(values).any() else math.nan
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"cannot combine {combination!r}: {part} has no positive scale in distribution ({scale})")
        scales.append(scale)
    for row in rows:
        scaled = [frame_scores(row, part) / scale for part, scale in zip(parts, scales)]
        row["ood"]["scores"][combination] = np.mean(scaled, axis=0).tolist()


def _logged(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("ood") and r["ood"].get("frames")]


def _baseline(rows: list[dict]) -> list[dict]:
    return [r for r in _logged(rows) if not r["ood"]["rule"] and float(r["ood"]["cruise_scale"]) == 1.0]


def _autonomy_s(row: dict) -> float:
    handover = row["ood"].get("handover_s")
    return float(row["duration_s"]) if handover is None else float(handover)


def prediction(rows: list[dict], horizon_s: float, combinations: tuple[str, ...] = ()) -> dict:
    """AUROC per scenario and score variant, their median over OOD scenarios, rank correlation."""
    by_scenario = defaultdict(list)
    for row in rows:
        by_scenario[row["scenario"]].append(row)
    table, mean_scores = {}, defaultdict(dict)
    variants = score_variants(rows, combinations)
    for scenario, episodes in by_scenario.items():
        labels = np.concatenate([frame_labels(r, horizon_s) for r in episodes])
        known = np.concatenate([outcome_known(r, horizon_s) for r in episodes])
        entry = {"frames": int(known.sum()), "positive_frames": int(labels.sum()), "unknown_frames": int((~known).sum()),
                 "ood_average": float(np.mean([r["score"] for r in episodes])), "episodes": len(episodes)}
        for label, method, window in variants:
            scores = np.concatenate([frame_scores(r, method, window) for r in episodes])
            keep = np.isfinite(scores) & known
            entry[label] = auroc(scores[keep], labels[keep])
            mean_scores[label][scenario] = float(np.nanmean(scores))
        table[scenario] = entry
    ood = [s for s in OOD_SCENARIO_NAMES if s in table]
    summary = {}
    for label, _, _ in variants:
        values = [table[s][label] for s in ood if math.isfinite(table[s][label])]
        summary[label] = {
            "median_auroc": float(np.median(values)) if values else math.nan, "scenarios_with_failures": len(values),
            "median_auroc_interval": over_scenarios(values, np.median),
            "spearman_mean_score_vs_ood_average": rank_correlation([mean_scores[label][s] for s in ood],
                                                                   [table[s]["ood_average"] for s in ood]),
            "in_distribution_mean": mean_scores[label].get(ID_SCENARIO.name, math.nan),
            "ood_mean": float(np.mean([mean_scores[label][s] for s in ood])) if ood else math.nan,
        }
    for combination in combinations:
        # A combination earns its place only where it beats each of its parts, scenario by scenario.
        summary[combination]["against_parts"] = {
            part: _paired([table[s][combination] for s in ood], [table[s][part] for s in ood]) for part in combination.split("+")}
    return {"per_scenario": table, "summary": summary}


def over_scenarios(values: list[float], statistic) -> list[float]:
    """The 95% percentile bootstrap interval of `statistic` over the scenarios' values (seeded; NaN
    for fewer than 2). Frames of one scenario are not independent, so the scenarios are the sample."""
    if len(values) < 2:
        return [math.nan, math.nan]
    return list(sample_interval(values, statistic, BOOTSTRAP_RESAMPLES, np.random.default_rng(0)))


def _paired(a: list[float], b: list[float]) -> dict:
    """A's per-scenario AUROC minus B's, in points: mean, interval, scenarios higher and lower."""
    differences = [100.0 * (x - y) for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    return {"mean_points": float(np.mean(differences)) if differences else math.nan,
            "interval": over_scenarios(differences, np.mean), "scenarios": len(differences),
            "higher": sum(d > 0 for d in differences), "lower": sum(d < 0 for d in differences)}


def _finite(values: np.ndarray) -> np.ndarray:
    return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)


def rank_correlation(a: list, b: list) -> float:
    """Rank correlation with tied ranks averaged; NaN for fewer than 3 pairs or a missing value."""
    if len(a) < 3:
        return math.nan
    return float(stats.spearmanr(a, b).statistic)


def lead_times(rows: list[dict], method: str, threshold: float) -> dict:
    """For each failure, the time from the first frame above `threshold` since the previous failure
    (or the start) to the failure; failures without such a frame have no alarm."""
    leads, without = [], 0
    for row in rows:
        times = np.asarray(row["ood"]["time_s"])
        scores = frame_scores(row, method)
        previous = -math.inf
        for failure in row["ood"]["failure_times_s"]:
            window = (times > previous) & (times < failure) & (scores > threshold)
            if window.any():
                leads.append(failure - float(times[window][0]))
            else:
                without += 1
            previous = failure
    return {"threshold": threshold, "failures": len(leads) + without, "alarmed": len(leads),
            "median_lead_s": float(np.median(leads)) if leads else math.nan}


def replayed_rule(rows: list[dict], rule: OodRuleConfig, method: str) -> dict:
    """The rule on the logged scores of rule-off episodes without a failure: requests per 10 minutes
    and the share of frames it would slow, in and out of distribution."""
    out = {}
    for kind, names in (("in distribution", {ID_SCENARIO.name}), ("OOD", set(OOD_SCENARIO_NAMES))):
        clean = [r for r in rows if r["scenario"] in names and not r["ood"]["failure_times_s"]]
        handovers, slowed, frames, seconds = 0, 0, 0, 0.0
        for row in clean:
            replay = OodRule(rule)
            for t, value in zip(row["ood"]["time_s"], _finite(row["ood"]["scores"][method])):
                if math.isfinite(value):
                    replay.on_score(value, t)
                status = replay.step(t)
                slowed += status.slowed
                handovers += status.new_handover
                frames += 1
            seconds += float(row["duration_s"])
        out[kind] = {"episodes": len(clean), "minutes": seconds / 60.0,
                     "handovers_per_10_min": 600.0 * handovers / seconds if seconds else math.nan,
                     "slowed_share": slowed / frames if frames else math.nan}
    return out


def closed_loop(rows: list[dict], baseline_method: str | None) -> dict:
    """Per method: the OOD and in-distribution rows' driving numbers (see the module docstring)."""
    methods = defaultdict(list)
    for row in _logged(rows):
        methods[row["method"]].append(row)
    # Only the cells every method drove: the methods side by side on the same layouts.
    shared = set.intersection(*({(r["scenario"], r["seed"]) for r in m} for m in methods.values()))
    methods = {name: [r for r in m if (r["scenario"], r["seed"]) in shared] for name, m in methods.items()}
    base = {(r["scenario"], r["seed"]): r for r in methods.get(baseline_method, [])}
    out = {}
    for method, method_rows in sorted(methods.items()):
        entry = {}
        for kind, names in (("in distribution", {ID_SCENARIO.name}), ("OOD", set(OOD_SCENARIO_NAMES))):
            cells = [r for r in method_rows if r["scenario"] in names]
            if not cells:
                continue
            km = sum(r["distance_m"] for r in cells) / 1000.0
            minutes = sum(_autonomy_s(r) for r in cells) / 60.0
            failures = sum(r["interventions"] for r in cells)
            handovers = sum(bool(r.get("handover")) for r in cells)
            entry[kind] = {
                "episodes": len(cells), "average": float(np.mean([r["score"] for r in cells])),
                "failures": failures, "failures_per_km": failures / km if km else math.nan,
                "failures_per_min": failures / minutes if minutes else math.nan,
                "slowed_share": sum(r["ood"]["slowed_frames"] for r in cells) / max(sum(r["ood"]["frames"] for r in cells), 1),
                "handovers": handovers, "handovers_per_10_min": 10.0 * handovers / minutes if minutes else math.nan,
                "mean_speed_mps": float(np.mean([r["mean_speed_mps"] for r in cells])),
                **_caught(cells, base),
            }
        out[method] = entry
    return out


def _caught(cells: list[dict], base: dict) -> dict:
    """Of the cells whose rule-off run failed: in how many this run handed over or slowed before that
    first failure; and of the rule-off run's cells without failure, how many this run handed over in."""
    failing = caught = clean = clean_handovers = 0
    for row in cells:
        ref = base.get((row["scenario"], row["seed"]))
        if ref is None or ref is row:
            continue
        first = ref["ood"]["failure_times_s"][0] if ref["ood"]["failure_times_s"] else None
        if first is None:
            clean += 1
            clean_handovers += bool(row.get("handover"))
            continue
        failing += 1
        handover = row["ood"].get("handover_s")
        slowed_before = row["ood"]["slowed_frames"] > 0 and _first_slowed(row) < first
        caught += (handover is not None and handover < first) or slowed_before
    return {"baseline_failing_cells": failing, "caught_before_first_failure": caught,
            "baseline_clean_cells": clean, "handovers_in_clean_cells": clean_handovers}


def _first_slowed(row: dict) -> float:
    """The time of the first slowed frame, replayed from the logged scores with the run's rule."""
    rule = OodRule(OodRuleConfig.from_config(load_ood_config()["rule"]))
    for t, value in zip(row["ood"]["time_s"], _finite(row["ood"]["scores"][row["ood"]["method"]])):
        if math.isfinite(value):
            rule.on_score(value, t)
        if rule.step(t).slowed:
            return t
    return math.inf


def write_report(args) -> int:
    rows = merge_results(args.runs)
    if not _logged(rows):
        raise SystemExit("ood report: no rows with per-frame OOD scores in " + ", ".join(args.runs))
    config = load_ood_config()
    rule = OodRuleConfig.from_config(config["rule"])
    method = config["score"]["method"]
    base = [r for r in _baseline(rows) if args.method is None or r["method"] == args.method]
    baseline_method = args.method or (base[0]["method"] if base else None)
    # The rule's alarms exist only where the rule's calibrated score was logged (not for an
    # uncalibrated ensemble's head disagreement alone).
    calibrated = [r for r in base if method in r["ood"]["scores"]]
    combinations = tuple(args.combine or ())
    try:
        for combination in combinations:
            combine(base, combination)
    except ValueError as error:
        raise SystemExit(f"ood report: {error}") from None
    report = {
        "horizon_s": args.horizon_s, "runs": args.runs, "rule": config["rule"], "score_method": method,
        "combination_quantile": COMBINATION_QUANTILE if combinations else None,
        "prediction": prediction(base, args.horizon_s, combinations),
        "lead_time": {name: lead_times([r for r in calibrated if r["scenario"] in OOD_SCENARIO_NAMES], method, threshold)
                      for name, threshold in (("slow", rule.slow_threshold), ("handover", rule.handover_threshold))}
        if calibrated else None,
        "replayed_rule": replayed_rule(calibrated, rule, method) if calibrated else None,
        "closed_loop": closed_loop(rows, baseline_method),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ood_report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    text = markdown(report)
    (out / "ood_report.md").write_text(text)
    print(text)
    return 0


def _f(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _signed(value: float) -> str:
    return f"{value:+.1f}" if math.isfinite(value) else "n/a"


def markdown(report: dict) -> str:
    pred = report["prediction"]
    labels = list(pred["summary"])
    lines = [f"### AUROC for a failure within {report['horizon_s']:g} s, per scenario (rule off)", "",
             "| scenario | episodes | OOD average | frames (positive; unknown, left out) | " + " | ".join(labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for scenario, e in pred["per_scenario"].items():
        frames = f"{e['frames']} ({e['positive_frames']}; {e['unknown_frames']})"
        lines.append(f"| {scenario} | {e['episodes']} | {_f(e['ood_average'])} | {frames} | "
                     + " | ".join(_f(e[label]) for label in labels) + " |")
    s = pred["summary"]
    lines += ["", "| score | median AUROC over OOD scenarios [95% over scenarios] (scenarios with a failure) | "
              "Spearman: mean score vs OOD average | mean score in distribution / OOD |", "|---|---|---|---|"]
    for label in labels:
        low, high = s[label]["median_auroc_interval"]
        lines.append(f"| {label} | {_f(s[label]['median_auroc'])} [{_f(low)}, {_f(high)}] ({s[label]['scenarios_with_failures']}) | "
                     f"{_f(s[label]['spearman_mean_score_vs_ood_average'])} | {_f(s[label]['in_distribution_mean'])} / "
                     f"{_f(s[label]['ood_mean'])} |")
    combined = [(label, part, e) for label in labels for part, e in s[label].get("against_parts", {}).items()]
    if combined:
        lines += ["", f"### Each combination against its parts (parts scaled by their in-distribution "
                      f"{100 * report['combination_quantile']:g}th percentile)", "",
                  "| combination | part | per-scenario AUROC difference, mean points [95%] | scenarios higher / lower |",
                  "|---|---|---|---|"]
        for label, part, e in combined:
            low, high = e["interval"]
            lines.append(f"| {label} | {part} | {_signed(e['mean_points'])} [{_signed(low)}, {_signed(high)}] | "
                         f"{e['higher']} / {e['lower']} |")
    if report["lead_time"] is None:
        lines += ["", f"The rule's score ({report['score_method']}) is not logged in these rows: no alarm lead times and "
                  "no replayed rule."]
    else:
        lines += ["", f"### Lead time of the first alarm ({report['score_method']}, OOD scenarios)", "",
                  "| alarm | threshold | failures | with an alarm before | median lead s |", "|---|---|---|---|---|"]
        for name, e in report["lead_time"].items():
            lines.append(f"| {name} | {e['threshold']:g} | {e['failures']} | {e['alarmed']} | {_f(e['median_lead_s'])} |")
        lines += ["", "### The rule replayed on the logged scores of episodes without a failure (rule off)", "",
                  "| | episodes | minutes | handovers per 10 min | share of frames slowed |", "|---|---|---|---|---|"]
        for kind, e in report["replayed_rule"].items():
            lines.append(f"| {kind} | {e['episodes']} | {_f(e['minutes'], 1)} | {_f(e['handovers_per_10_min'])} | "
                         f"{_f(e['slowed_share'])} |")
    lines += ["", "### Closed loop by method", "",
              "| method | kind | episodes | average | failures | per km | per min | slowed | handovers (per 10 min) | "
              "mean speed m/s | rule-off failing cells caught before the first failure | handovers in rule-off clean cells |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, kinds in report["closed_loop"].items():
        for kind, e in kinds.items():
            lines.append(f"| {method} | {kind} | {e['episodes']} | {_f(e['average'], 3)} | {e['failures']} | "
                         f"{_f(e['failures_per_km'])} | {_f(e['failures_per_min'])} | {_f(e['slowed_share'])} | "
                         f"{e['handovers']} ({_f(e['handovers_per_10_min'])}) | {_f(e['mean_speed_mps'])} | "
                         f"{e['caught_before_first_failure']} / {e['baseline_failing_cells']} | "
                         f"{e['handovers_in_clean_cells']} / {e['baseline_clean_cells']} |")
    return "\n".join(lines) + "\n"
