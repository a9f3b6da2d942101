"""`sps-driving choose`: a registered selection rule applied to screen results, so the choice of
the policy that ships is a command anyone can run again on the committed results
(docs/results/driving/ood_policy/README.md, "Candidates" and "The selection rule").

    sps-driving choose ensembles SCREENS... --methods DA-PT SPS-50-PT SPPS-30-PT --out ENS_BEST ENS_SECOND
    sps-driving choose policy TABLES --id-min 0.95 --tie-points 1.0 [--latency-ms POLICY=MS ...]
    sps-driving choose ship CONFIRMATION... --chosen chosen --shipped SPS-50 --id-min 0.95 [--latency-ms CHOSEN SHIPPED]

`ensembles` ranks the named methods by their screen OOD average (the mean over their checkpoints)
and makes the ensemble of each of the best ones' checkpoints (`sps-driving ensemble`), in rank
order. `policy` takes every checkpoint (a method and training seed) and every ensemble as one
candidate: eligible where its in-distribution score is at least --id-min; chosen, the eligible one
with the highest OOD average. Candidates within --tie-points OOD points of the best are tied: an
ensemble wins over the single checkpoints it is made of, and what is still tied is decided by the
lowest camera-to-command p50 latency (`bench --graph`, one run side by side) given by
--latency-ms; without those numbers the choice says which candidates to measure and chooses none.
`ship` is the shipping test on the confirmation cells, paired by cell: the chosen policy's OOD
difference against the shipped one has a lower bound above 0, it scores at least --id-min in
distribution, passes at least as large a share of the OOD obstacles, and its camera-to-command
p50 latency is within --latency-margin of the shipped one's (undecided, exit 3, until given).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sps_driving.sim.results import merge_results
from sps_driving.sim.scenarios import ID_SCENARIO, OOD_SCENARIO_NAMES
from sps_driving.sim.statistics import Estimate, score_interval
from sps_driving.sim.tables import format_estimate, method_scores, obstacle_margins


@dataclass(frozen=True)
class Candidate:
    """One policy of the screen: a checkpoint (a method's training seed) or an ensemble."""

    method: str
    training_seed: int | None
    policy: str  # as the results name it (resources.portable_path)
    id_score: Estimate
    ood: Estimate
    members: tuple[str, ...] = ()  # an ensemble's checkpoints, as its config names them

    @property
    def name(self) -> str:
        return self.method if self.members else f"{self.method} seed {self.training_seed}"


@dataclass
class Choice:
    eligible: list[str]
    tied: list[str]  # the eligible candidates within the tie margin of the best, before the tie rules
    chosen: str | None  # None: a tie that needs the latency of the candidates in `measure`
    policy: str | None
    reason: str
    measure: list[str] = field(default_factory=list)


def _policy_members(policy: str) -> tuple[str, ...]:
    from sps_driving.core.policies.ensemble import NAME
    from sps_driving.core.resources import recorded_path

    config_file = recorded_path(policy) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no policy config at {config_file}: the results name policy {policy!r}, which choose "
                                "reads to tell an ensemble from a checkpoint (run it from the repository root)")
    config = json.loads(config_file.read_text())
    return tuple(m["checkpoint"] for m in config["members"]) if config.get("architecture") == NAME else ()


def candidates(rows: list[dict]) -> list[Candidate]:
    """Every (method, training seed) of the rows that drove the ID scenario and every OOD one."""
    policies = {(r["method"], r.get("training_seed")): r["policy"] for r in rows}
    found = []
    for (method, seed), policy in sorted(policies.items(), key=lambda item: (item[0][0], item[0][1] or 0)):
        own = [r for r in rows if (r["method"], r.get("training_seed")) == (method, seed)]
        scenarios = {r["scenario"] for r in own}
        missing = [s for s in (ID_SCENARIO.name, *OOD_SCENARIO_NAMES) if s not in scenarios]
        if missing:
            raise ValueError(f"{method} seed {seed} did not drive {', '.join(missing)}: a candidate is screened on every scenario")
        id_score = score_interval(method_scores(own, (ID_SCENARIO.name,))[method])
        ood = score_interval(method_scores(own, OOD_SCENARIO_NAMES)[method])
        found.append(Candidate(method, seed, policy, id_score, ood, _policy_members(policy)))
    return found


def ranked_methods(found: list[Candidate], methods: list[str]) -> list[tuple[str, float]]:
    """`methods` with their OOD average (the mean over their checkpoints), best first."""
    averages = []
    for method in methods:
        own = [c.ood.mean for c in found if c.method == method and not c.members]
        if len(own) < 2:
            raise ValueError(f"{method} has {len(own)} screened checkpoint(s): an ensemble needs at least two")
        averages.append((method, sum(own) / len(own)))
    return sorted(averages, key=lambda item: -item[1])


def choose(found: list[Candidate], id_min: float, tie_points: float, latency_ms: dict[str, float]) -> Choice:
    eligible = [c for c in found if c.id_score.mean >= id_min]
    names = [c.name for c in eligible]
    if not eligible:
        return Choice(names, [], None, None, f"no candidate scores at least {id_min} in distribution")
    best = max(c.ood.mean for c in eligible)
    tied = sorted((c for c in eligible if best - c.ood.mean <= tie_points / 100 + 1e-9), key=lambda c: -c.ood.mean)
    tied_names = [c.name for c in tied]
    if len(tied) == 1:
        return Choice(names, tied_names, tied[0].name, tied[0].policy, "the highest OOD average")
    ensembled = {member for c in tied for member in c.members}
    left = [c for c in tied if c.policy not in ensembled]
    why = (f"within {tie_points} OOD points of the best" +
           (", an ensemble over the checkpoints it is made of" if len(left) < len(tied) else ""))
    if len(left) == 1:
        return Choice(names, tied_names, left[0].name, left[0].policy, why)
    unmeasured = [c.policy for c in left if c.policy not in latency_ms]
    if unmeasured:
        return Choice(names, tied_names, None, None, why + ": the camera-to-command p50 latency decides, "
                      "measured in one `bench --graph` run of each", unmeasured)
    fastest = min(left, key=lambda c: latency_ms[c.policy])
    return Choice(names, tied_names, fastest.name, fastest.policy, why + ", then the lowest camera-to-command p50 latency")


def markdown(found: list[Candidate], choice: Choice, id_min: float) -> str:
    lines = [f"| candidate | policy | in distribution [95%] | OOD average [95%] | eligible (ID >= {id_min}) |",
             "|---|---|---|---|---|"]
    for c in sorted(found, key=lambda c: -c.ood.mean):
        mark = "**" if c.name == choice.chosen else ""
        lines.append(f"| {mark}{c.name}{mark} | {c.policy} | {format_estimate(c.id_score)} | {format_estimate(c.ood)} | "
                     f"{'yes' if c.name in choice.eligible else 'no'} |")
    lines.append("")
    if choice.chosen:
        lines.append(f"Chosen: **{choice.chosen}** ({choice.policy}): {choice.reason}.")
    else:
        lines.append(f"Chosen: none yet: {choice.reason}" + (f": {', '.join(choice.measure)}." if choice.measure else "."))
    if len(choice.tied) > 1:
        lines.append(f"Tied: {', '.join(choice.tied)}.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Condition:
    """One condition of the shipping test: what it asks, what was measured, and whether it holds
    (None: not measured)."""

    asks: str
    measured: str
    holds: bool | None


def shipping_test(rows: list[dict], chosen: str, shipped: str, id_min: float, latency_ms: tuple[float, float] | None,
                  latency_margin: float) -> list[Condition]:
    from sps_driving.sim.compare import compare

    groups = {entry["group"]: entry for entry in compare(rows, chosen, shipped)}
    missing = [g for g in ("in distribution", "OOD") if g not in groups]
    if missing:
        raise ValueError(f"{chosen!r} and {shipped!r} share no {' or '.join(missing)} cell")
    ood, in_distribution = groups["OOD"]["difference"], groups["in distribution"]["a"]
    passes = {m: obstacle_margins([r for r in rows if r["method"] == m and r["scenario"] in OOD_SCENARIO_NAMES])
              for m in (chosen, shipped)}
    share = {m: passes[m]["pass_rate"] for m in passes}
    latency = None if latency_ms is None else latency_ms[0] <= (1.0 + latency_margin) * latency_ms[1]
    return [
        Condition("paired OOD difference against the shipped policy: lower bound above 0",
                  f"{format_estimate(ood, 100, '+.1f')} points over {ood.cells} cells", ood.low > 0),
        Condition(f"in distribution at least {id_min}", format_estimate(in_distribution), in_distribution.mean >= id_min),
        Condition("share of the OOD obstacles passed at least the shipped policy's",
                  f"{share[chosen]:.3f} of {passes[chosen]['obstacles']} against {share[shipped]:.3f} of "
                  f"{passes[shipped]['obstacles']}", share[chosen] >= share[shipped]),
        Condition(f"camera-to-command p50 latency within {100 * latency_margin:g}% of the shipped policy's",
                  "not measured" if latency_ms is None else f"{latency_ms[0]:.1f} ms against {latency_ms[1]:.1f} ms", latency),
    ]


def verdict(conditions: list[Condition]) -> str:
    if any(c.holds is False for c in conditions):
        return "does not ship"
    return "ships" if all(c.holds for c in conditions) else "undecided"


def _latencies(pairs: list[str]) -> dict[str, float]:
    latency = {}
    for pair in pairs:
        policy, _, value = pair.rpartition("=")
        try:
            latency[policy] = float(value)
        except ValueError:
            raise ValueError(f"--latency-ms takes POLICY=MILLISECONDS, got {pair!r}") from None
        if not policy:
            raise ValueError(f"--latency-ms takes POLICY=MILLISECONDS, got {pair!r}")
    return latency


def add_arguments(parser: argparse.ArgumentParser) -> None:
    steps = parser.add_subparsers(dest="what", required=True)
    ensembles = steps.add_parser("ensembles", help="the ensembles of the methods with the best screen OOD averages")
    ensembles.add_argument("results", nargs="+", help="the screens' eval folders, or a tables folder")
    ensembles.add_argument("--methods", nargs="+", required=True, help="the methods (eval's --name) that may be ensembled")
    ensembles.add_argument("--out", nargs="+", required=True, type=Path,
                           help="one new checkpoint folder per ensemble, best method first")
    ensembles.add_argument("--json", metavar="FILE", help="also write the ranking and what each ensemble is made of to FILE")
    policy = steps.add_parser("policy", help="the candidate the selection rule chooses")
    policy.add_argument("results", nargs="+", help="the screens' eval folders, or a tables folder")
    policy.add_argument("--id-min", type=float, required=True, help="the lowest in-distribution score a candidate may have")
    policy.add_argument("--tie-points", type=float, required=True, help="OOD points within which candidates are tied")
    policy.add_argument("--latency-ms", nargs="*", default=[], metavar="POLICY=MS",
                        help="camera-to-command p50 latency of tied candidates (bench --graph), the policy as the results name it")
    policy.add_argument("--json", metavar="FILE", help="also write the candidates and the choice to FILE")
    policy.add_argument("--out", type=Path, help="copy the chosen checkpoint to this folder (for the confirmation run); "
                        "exit 3 when the rule chooses none yet")
    ship = steps.add_parser("ship", help="the shipping test of the chosen policy against the shipped one")
    ship.add_argument("results", nargs="+", help="the confirmation's eval folders")
    ship.add_argument("--chosen", required=True, metavar="METHOD", help="the chosen policy's method name (eval's --name)")
    ship.add_argument("--shipped", required=True, metavar="METHOD", help="the shipped policy's method name")
    ship.add_argument("--id-min", type=float, required=True, help="the lowest in-distribution score the chosen may have")
    ship.add_argument("--latency-ms", nargs=2, type=float, metavar=("CHOSEN", "SHIPPED"),
                      help="camera-to-command p50 latency of both, ms, measured side by side (bench --graph)")
    ship.add_argument("--latency-margin", type=float, default=0.10, help="how much slower the chosen may be (fraction)")
    ship.add_argument("--json", metavar="FILE", help="also write the conditions and the verdict to FILE")


def _make_ensembles(found: list[Candidate], methods: list[str], outs: list[Path]) -> dict:
    from sps_driving.core.resources import recorded_path
    from sps_driving.train.ensemble import make_ensemble

    ranked = ranked_methods(found, methods)
    if len(outs) > len(ranked):
        raise ValueError(f"{len(outs)} ensembles asked of {len(ranked)} methods")
    made = []
    for (method, _), out in zip(ranked, outs):
        checkpoints = [c.policy for c in found if c.method == method and not c.members]
        if out.exists() and _policy_members(str(out)) == tuple(checkpoints):
            print(f"{out}: the ensemble of {method}'s {len(checkpoints)} checkpoints, made before")  # a rerun resumes
        else:
            make_ensemble([recorded_path(p) for p in checkpoints], out)
            print(f"{out}: the ensemble of {method}'s {len(checkpoints)} checkpoints")
        made.append({"method": method, "out": out.as_posix(), "checkpoints": checkpoints})
    return {"ranking": [{"method": m, "ood_average": v} for m, v in ranked], "ensembles": made}


def _copy_chosen(policy: str, out: Path) -> None:
    """The chosen checkpoint (without its training's resume state) in `out`; one copied there
    before is kept, another checkpoint there is an error."""
    from sps_driving.core.resources import recorded_path
    from sps_driving.train.trainer import LAST_DIR

    source = recorded_path(policy)
    if out.exists():
        if (out / "config.json").read_bytes() != (source / "config.json").read_bytes():
            raise ValueError(f"{out} holds another checkpoint than the chosen {policy}")
        return
    shutil.copytree(source, out, ignore=shutil.ignore_patterns(LAST_DIR))


def _ship(args) -> tuple[dict, int]:
    conditions = shipping_test(merge_results(args.results), args.chosen, args.shipped, args.id_min,
                               None if args.latency_ms is None else tuple(args.latency_ms), args.latency_margin)
    decided = verdict(conditions)
    lines = ["| condition | measured | holds |", "|---|---|---|"]
    lines += [f"| {c.asks} | {c.measured} | {'-' if c.holds is None else 'yes' if c.holds else 'no'} |" for c in conditions]
    print("\n".join(lines) + f"\n\n{args.chosen} {decided}.")
    record = {"chosen": args.chosen, "shipped": args.shipped, "verdict": decided, "conditions": [asdict(c) for c in conditions]}
    return record, 3 if decided == "undecided" else 0


def _policy(args, found: list[Candidate]) -> tuple[dict, int]:
    choice = choose(found, args.id_min, args.tie_points, _latencies(args.latency_ms))
    print(markdown(found, choice, args.id_min))
    record = {"rule": {"id_min": args.id_min, "tie_points": args.tie_points},
              "candidates": [{**asdict(c), "name": c.name} for c in found], "choice": asdict(choice)}
    if not args.out:
        return record, 0
    if choice.policy:
        _copy_chosen(choice.policy, args.out)
        return record, 0
    print(f"choose: nothing copied to {args.out}: the rule has chosen none yet", file=sys.stderr)
    return record, 3


def run(args) -> int:
    """Each subcommand's record goes to --json; 2 for bad input, 3 while the answer waits for a latency."""
    try:
        if args.what == "ship":
            record, code = _ship(args)
        else:
            found = candidates(merge_results(args.results))
            record, code = (_make_ensembles(found, args.methods, args.out), 0) if args.what == "ensembles" else _policy(args, found)
    except (FileNotFoundError, ValueError) as err:
        print(f"choose: {err}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return code
