"""`sps-driving campaign run|status PLAN.yaml`: a long experiment as a declared plan (docs/campaign.md).

    sps-driving campaign status docs/results/driving/ood_policy/plan.yaml
    sps-driving campaign run docs/results/driving/ood_policy/plan.yaml --budget 150

`run` runs the steps left through DVC, those that need nothing rebuilt first, and commits the
results folder after each; `status` shows each step done, running or left, the measured time of
those done, the estimate of what is left and the order `run` takes them in. `step` is what DVC
runs for one step (not for use by hand).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from sps_driving.campaign.plan import load_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = actions.add_parser("run", help="run the steps left through DVC, those that need nothing rebuilt first")
    run.add_argument("plan", help="the plan file (YAML)")
    run.add_argument("--budget", type=float, metavar="MINUTES",
                     help="start only steps whose estimate fits the minutes left (a step resumable in units: one unit), "
                          "stop a running one at the end")
    run.add_argument("--no-commit", dest="commit", action="store_false",
                     help="do not git-commit the results folder after each step")
    status = actions.add_parser("status", help="each step done, running or left, measured times, estimate of what is left")
    status.add_argument("plan", help="the plan file (YAML)")
    status.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    step = actions.add_parser("step", help="run one step as DVC does (the stage command of RESULTS/dvc.yaml)")
    step.add_argument("plan")
    step.add_argument("name")


def run(args) -> int:
    from sps_driving.campaign import engine, runner

    if args.action in ("run", "step"):
        # Ctrl-C or `kill -INT` stops a run and its step, also one started in the background, where
        # shells ignore SIGINT and DVC ignores it around the step (which its children would inherit).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        plan = load_plan(args.plan)
        if args.action == "step":
            return runner.run_step(plan, plan.step(args.name))
        if args.action == "run":
            if args.budget is not None and args.budget <= 0:
                raise ValueError(f"--budget must be a positive number of minutes, got {args.budget:g}")
            return runner.run_plan(plan, args.budget, args.commit)
        engine.ensure_repository(plan.root)
        current = runner.states(plan)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        print(f"campaign: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"campaign": plan.name, "steps": [
            {"step": s.step.name, "state": s.state, "measured_min": round(s.measured_min, 2),
             "left_min": round(s.left_min, 2), "reason": s.reason} for s in current],
            "left_min": round(sum(s.left_min for s in current), 2),
            "run_order": [s.name for s in runner.to_run(plan, current)]}, indent=1))
    else:
        print(status_table(plan, current))
    return 0


def status_table(plan, current) -> str:
    from sps_driving.campaign import runner

    done = [s for s in current if s.left_min == 0]
    width = max(len(s.step.name) for s in current)
    lines = [f"campaign {plan.name} ({plan.path.name}): {len(done)} of {len(current)} steps done, "
             f"{sum(s.state == 'running' for s in current)} running, {len(current) - len(done)} left",
             f"{'step':<{width}}  {'state':<14}  {'measured':>9}  {'left (est.)':>11}  note"]
    for s in current:
        measured = f"{s.measured_min:.1f} min" if s.measured_min else ""
        left = f"{s.left_min:.0f} min" if s.left_min else ""
        lines.append(f"{s.step.name:<{width}}  {s.state:<14}  {measured:>9}  {left:>11}  {s.reason}".rstrip())
    pins = sorted({s.step.code_revision for s in current if s.step.code_revision})
    for pin in pins:
        steps = [s.step.name for s in current if s.step.code_revision == pin]
        lines.append(f"code {pin[:12]} (pinned; its worktree under {plan.work}/code/): {', '.join(steps)}")
    if pins and any(s.step.code_revision is None for s in current):
        lines.append("the other steps run this checkout's code")
    total = sum(s.left_min for s in current)
    spent = sum(s.measured_min for s in done)
    lines.append(f"measured so far: {spent:.0f} min; left: about {total:.0f} min ({total / 60:.1f} h) on this machine, "
                 "from the measured cost of each step's finished attempt where it has one, else the plan's estimate_min")
    order = [s.name for s in runner.to_run(plan, current)]
    if order:
        lines.append("`run` takes them in this order: " + ", ".join(order))
    return "\n".join(lines)
