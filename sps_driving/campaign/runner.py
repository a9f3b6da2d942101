"""What `sps-driving campaign` does around DVC: each step's state (done, running, left, or done with
its outputs absent on this machine), its measured time, the estimate of what is left, running
the steps that fit a budget, committing what finished, and the step itself as DVC runs it.

A step's record (RESULTS/steps.jsonl, one JSON line per start and per end, flushed) holds its
attempt key: the hash of its code key and of the content of what it reads (the hashes dvc.lock
recorded for outputs of earlier steps, the files' own contents for the rest). A step started
again with the same key resumes (its command's own resume: `train --resume` from its last epoch,
`eval` from its last finished cell, `collect --resume`, `extract` and `dagger` by their rerun);
with another key its old outputs are removed first, so no run ever continues from other inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sps_driving.campaign import engine
from sps_driving.campaign.plan import Plan, Step

RECORD_FILE = "steps.jsonl"
RUNNING_FILE = "running.json"
DEADLINE_ENV = "SPS_DRIVING_CAMPAIGN_DEADLINE"  # unix time at which a running step is stopped (--budget)
STOPPED_AT_BUDGET = 75  # exit code of a step stopped at its deadline (its finished units are kept)
INTERRUPTED = 130  # exit code of a step stopped by SIGINT (Ctrl-C; 128 + 2, as a shell reports one)
STOP_GRACE_S = 20.0  # s between asking a stopped step to end and killing it
DONE, ABSENT, RUNNING, LEFT = "done", "done, not here", "running", "left"
# Instruction sets by which onnxruntime and torch choose their CPU kernels: the same step gives
# results that differ in their last digits, and closed loops that drift apart, from one host to
# another (docs/results/driving/ood_policy/README.md), so each attempt records its host's.
KERNEL_ISA = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


# ---- records ----------------------------------------------------------------------------------


def host_cpu() -> dict:
    """The CPU model and which of KERNEL_ISA it has (Linux's /proc/cpuinfo; empty elsewhere)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "isa": [name for name in KERNEL_ISA if name in flags]}


def read_records(plan: Plan) -> list[dict]:
    path = engine.results_dir(plan) / RECORD_FILE
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    return rows


def append_record(plan: Plan, record: dict) -> None:
    path = engine.results_dir(plan) / RECORD_FILE
    with path.open("a+b") as sink:
        sink.seek(0, os.SEEK_END)
        if sink.tell() and (sink.seek(-1, os.SEEK_END), sink.read(1))[1] != b"\n":
            sink.write(b"\n")  # a line cut by a kill stays on its own
        sink.write((json.dumps(record) + "\n").encode())
        sink.flush()


def attempt_key(plan: Plan, step: Step) -> str:
    """sha256 of the step's code key and of what it reads (module docstring)."""
    lock = engine.locked(plan)
    sha = hashlib.sha256(step.code_key().encode())
    for dep in step.deps:
        producer = plan.producer(dep)
        recorded = None
        if producer is not None:
            entries = lock.get(producer.name, {}).get("outs", [])
            recorded = next((e.get("md5") for e in entries if dep == e["path"] or dep.startswith(e["path"] + "/")), None)
            recorded = None if recorded is None else f"{recorded}:{dep}"
        sha.update(f"{dep}\0{recorded or tree_digest(plan.root / dep)}\0".encode())
    return sha.hexdigest()


def tree_digest(path: Path) -> str:
    """sha256 of a file's contents, or of a folder's relative names and contents; "missing" if absent."""
    if not path.exists():
        return "missing"
    sha = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        sha.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
    return sha.hexdigest()


def step_ends(plan: Plan, step: Step) -> list[dict]:
    """The end records of the step's attempts, oldest first."""
    return [r for r in read_records(plan) if r["step"] == step.name and r["event"] == "end"]


def measured_minutes(plan: Plan, step: Step, key: str | None = None) -> float:
    """Minutes the step's attempts took (those of attempt `key`, or of its last key), ends only."""
    ends = step_ends(plan, step)
    key = key if key is not None else (ends[-1]["key"] if ends else None)
    return sum(r["seconds"] for r in ends if r["key"] == key) / 60.0


# ---- states -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepState:
    step: Step
    state: str
    measured_min: float  # time its attempts took (done: the whole step's cost)
    left_min: float  # estimate of what is left of it (0 when done)
    reason: str = ""


def running_step(plan: Plan) -> str | None:
    """The step a live `campaign step` process of this plan runs on this machine, if any."""
    path = engine.results_dir(plan) / RUNNING_FILE
    try:
        record = json.loads(path.read_text())
        alive = engine.process_running(int(record["pid"]), float(record["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record["step"] if alive else None


def states(plan: Plan) -> list[StepState]:
    """Every step's state in plan order. A step is done when DVC finds it up to date; done, not
    here, when it finished once (dvc.lock) and all that DVC misses is its own outputs or inputs
    that are outputs of steps done, not here (a fresh machine: drives and caches not rebuilt yet);
    left otherwise, and whenever a step it reads from is left. A step whose outputs are here and
    whose inputs are outputs of steps done, not here, is done."""
    engine.write_pipeline(plan)
    running = running_step(plan)
    # DVC locks a running step's outputs: the steps that read them wait for it and are not asked about.
    busy = set() if running is None else {running, *(s.name for s in plan.downstream(plan.step(running)))}
    changed = engine.changes(plan, None if not busy else [s for s in plan.steps if s.name not in busy])
    lock = engine.locked(plan)
    result: dict[str, StepState] = {}
    for step in plan.steps:
        upstream = [result[s.name] for s in plan.upstream(step)]
        spent = measured_minutes(plan, step)
        if step.name == running:
            state, reason = RUNNING, ""
        elif any(u.state in (LEFT, RUNNING) for u in upstream):
            state, reason = LEFT, "after " + ", ".join(u.step.name for u in upstream if u.state in (LEFT, RUNNING))
        elif step.name not in changed:
            state, reason = DONE, ""
        elif step.name in lock and _only_absent(plan, step, changed[step.name], result):
            outs_here = all((plan.root / out).exists() for out in step.outs)
            state, reason = (DONE, "") if outs_here else (ABSENT, "rebuilt from seeds when a step left reads it")
        else:
            state, reason = LEFT, _describe(changed[step.name]) if step.name in lock else "not finished yet"
        done = state in (DONE, ABSENT)
        if not done:  # what attempts with the inputs it has now have spent on it (none: its inputs are still to be made)
            spent = 0.0 if reason.startswith("after ") else measured_minutes(plan, step, attempt_key(plan, step))
        left = 0.0 if done else remaining_minutes(plan, step, spent)
        result[step.name] = StepState(step, state, spent, left, reason)
    return list(result.values())


def _only_absent(plan: Plan, step: Step, entries: list, earlier: dict) -> bool:
    for entry in entries:
        if not isinstance(entry, dict):
            return False  # "changed command" and the like
        for kind, paths in entry.items():
            for path, how in paths.items():
                if how != "deleted":
                    return False
                producer = plan.producer(path)
                if kind == "changed deps" and (producer is None or earlier[producer.name].state != ABSENT):
                    return False
                if kind == "changed outs" and path.startswith(plan.results + "/"):
                    return False  # kept outputs come with the repository
    return True


def _describe(entries: list) -> str:
    words = []
    for entry in entries:
        if isinstance(entry, dict):
            for kind, paths in entry.items():
                words += [f"{kind.replace('changed ', '')} {path} {how}" for path, how in paths.items()]
        else:
            words.append(str(entry))
    return "; ".join(words)


def remaining_minutes(plan: Plan, step: Step, spent: float) -> float:
    """What is left of a step: its estimate (the measured cost of its last finished attempt, all of
    that attempt key's time, when it has one, else the plan's), less what an unfinished attempt
    with the same inputs has spent so far, but at least one unit."""
    finished = [r["key"] for r in step_ends(plan, step) if r.get("exit") == 0]
    estimate = measured_minutes(plan, step, finished[-1]) if finished else step.estimate_min
    return max(estimate - spent, step.unit_min or 0.0, 0.0)


def to_run(plan: Plan, current: list[StepState]) -> list[Step]:
    """The steps `campaign run` runs: every left one, and every done-not-here one that a step to
    run reads from (its outputs rebuilt first). Those that need nothing rebuilt come first, then
    the rebuilds and the steps that wait for them, each group in plan order: a budget that ends
    early is spent on results, not on rebuilding what the next machine has to rebuild again."""
    by_name = {s.step.name: s for s in current}
    chosen = {s.step.name for s in current if s.state == LEFT}
    for state in reversed(current):
        if state.step.name in chosen:
            chosen |= {u.name for u in plan.upstream(state.step) if by_name[u.name].state == ABSENT}
    waits_for_rebuild: set[str] = set()
    for state in current:  # plan order: a step's upstream is decided before it
        if state.step.name in chosen and (state.state == ABSENT or waits_for_rebuild & {u.name for u in plan.upstream(state.step)}):
            waits_for_rebuild.add(state.step.name)
    ordered = [s.step for s in current if s.step.name in chosen]
    return [s for s in ordered if s.name not in waits_for_rebuild] + [s for s in ordered if s.name in waits_for_rebuild]


# ---- running ----------------------------------------------------------------------------------


def run_plan(plan: Plan, budget_min: float | None = None, commit: bool = True, log=print) -> int:
    """Run what is left in the order of `to_run`; with `budget_min`, start a step only if its estimate fits
    the time left (or, for a step resumable in units, one unit does: it is then stopped at the
    budget's end and resumes next time). Each finished or stopped step's results are committed."""
    engine.ensure_repository(plan.root)
    deadline = None if budget_min is None else time.time() + 60.0 * budget_min
    current = states(plan)
    busy = [s.step.name for s in current if s.state == RUNNING]
    if busy:
        log(f"campaign {plan.name}: {busy[0]} is running in another process of this plan; not starting a second run")
        return 1
    pending = to_run(plan, current)
    if not pending:
        log(f"campaign {plan.name}: nothing left to run")
    for done, step in enumerate(pending):
        estimate = next(s.left_min for s in current if s.step is step)
        left_min = None if deadline is None else (deadline - time.time()) / 60.0
        if left_min is not None and estimate > left_min and not (step.unit_min and step.unit_min <= left_min):
            log(f"campaign {plan.name}: {step.name} needs about {estimate:.1f} min, {left_min:.1f} min of the budget "
                f"left: not started ({len(pending) - done} step(s) left)")
            return 0
        log(f"campaign {plan.name}: {step.name} (about {estimate:.1f} min): sps-driving {' '.join(step.argv)}")
        started = time.time()
        try:
            code = engine.reproduce(plan, step, {} if deadline is None else {DEADLINE_ENV: str(deadline)},
                                    on_interrupt=lambda: interrupt_running_step(plan))
        except KeyboardInterrupt:
            with engine.sigint_caught():  # a second Ctrl-C does not cut the commit short
                if commit:
                    commit_results(plan, f"{step.name} interrupted, finished units kept")
            log(f"campaign {plan.name}: interrupted; {step.name} stopped, it resumes next time")
            raise
        code = step_exit(plan, step, since=started, otherwise=code)
        if commit:
            commit_results(plan, f"{step.name} " + ("done" if code == 0 else f"stopped ({_exit_reason(code)}), finished units kept"))
        if code != 0 and deadline is not None and time.time() >= deadline:
            log(f"campaign {plan.name}: {step.name} stopped at the budget's end; it resumes next time")
            return 0
        if code != 0:
            log(f"campaign {plan.name}: {step.name} ended with exit {code}")
            return code
    return 0


def step_exit(plan: Plan, step: Step, since: float, otherwise: int) -> int:
    """The exit code the step recorded at its end after `since`; `otherwise` (DVC's own, which says
    only that the stage failed) where it recorded none: DVC ended before the step ran."""
    ends = [r for r in step_ends(plan, step) if r["time"] >= since]
    return int(ends[-1]["exit"]) if ends else otherwise


def _exit_reason(code: int) -> str:
    return {STOPPED_AT_BUDGET: "at the budget's end", INTERRUPTED: "interrupted"}.get(code, f"exit {code}")


def commit_results(plan: Plan, what: str) -> None:
    """git commit of the results folder and DVC's settings alone (nothing else staged is taken along)."""
    if not (plan.root / ".git").exists():
        return
    paths = [plan.results] + [p for p in engine.REPOSITORY_FILES if (plan.root / p).exists()]
    subprocess.run(["git", "add", "-A", "--", *paths], cwd=plan.root, check=True)
    if subprocess.run(["git", "diff", "--cached", "--quiet", "--", *paths], cwd=plan.root).returncode == 0:
        return
    subprocess.run(["git", "commit", "-q", "-m", f"campaign {plan.name}: {what}", "--", *paths], cwd=plan.root, check=True)


# `python -m sps_driving.cli ARGV` with the step's own source tree first on the path in place of the
# working folder, which is the checkout (`-P` does that from Python 3.11 only).
STEP_LAUNCHER = ("import runpy, sys; sys.path[0] = sys.argv.pop(1); "
                 "runpy.run_module('sps_driving.cli', run_name='__main__', alter_sys=True)")


def run_step(plan: Plan, step: Step) -> int:
    """The step as DVC runs it: remove outputs of another attempt key, run the command with its
    resume flags (stopped at the deadline of DEADLINE_ENV, or by a SIGINT), record start and end."""
    folder = engine.results_dir(plan)
    folder.mkdir(parents=True, exist_ok=True)
    with engine.sigint_caught() as interrupted:
        # First: a run stopped from now on finds this process (`interrupt_running_step`).
        (folder / RUNNING_FILE).write_text(json.dumps({"step": step.name, "pid": os.getpid(), "started": time.time()}))
        try:
            return _run_step(plan, step, interrupted)
        finally:
            (folder / RUNNING_FILE).unlink(missing_ok=True)


def _run_step(plan: Plan, step: Step, interrupted: list) -> int:
    key = attempt_key(plan, step)
    attempts = [r for r in read_records(plan) if r["step"] == step.name]
    if not attempts or attempts[-1]["key"] != key:
        for out in step.outs:
            path = plan.root / out
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    argv = list(step.argv) + resume_flags(plan, step)
    if interrupted:
        return INTERRUPTED
    append_record(plan, {"step": step.name, "key": key, "event": "start", "time": time.time(), "argv": argv, "host": host_cpu(),
                         **({"code": step.code_revision} if step.code_revision else {})})
    began = time.time()
    deadline = float(os.environ[DEADLINE_ENV]) if DEADLINE_ENV in os.environ else None
    # Outputs that record when they were made record when this attempt key first started: the same on any machine.
    first = next(r["time"] for r in read_records(plan) if r["step"] == step.name and r["key"] == key)
    path = os.pathsep.join([str(step.code_root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(int(first)), "PYTHONPATH": path}
    process = subprocess.Popen([sys.executable, "-c", STEP_LAUNCHER, str(step.code_root), *argv], cwd=plan.root, env=env)
    code = None
    while code is None:
        if interrupted:  # Ctrl-C reached the command too, or only this process: one more SIGINT is harmless
            code = _stop(process, INTERRUPTED)
        elif deadline is not None and time.time() >= deadline:
            code = _stop(process, STOPPED_AT_BUDGET)
        else:
            try:
                code = process.wait(engine.INTERRUPT_POLL_S)
            except subprocess.TimeoutExpired:
                pass
    append_record(plan, {"step": step.name, "key": key, "event": "end", "time": time.time(),
                         "seconds": round(time.time() - began, 3), "exit": code})
    return code


def _stop(process: subprocess.Popen, code: int) -> int:
    """SIGINT to a step's command (it keeps its finished units), SIGKILL if it has not ended after STOP_GRACE_S."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return code


def interrupt_running_step(plan: Plan) -> None:
    """SIGINT to the process of this plan's running step, which stops its command: DVC, between the run
    and the step, ignores SIGINT while a step runs and does not pass it on."""
    path = engine.results_dir(plan) / RUNNING_FILE
    try:
        record = json.loads(path.read_text())
        if engine.process_running(int(record["pid"]), float(record["started"])):
            os.kill(int(record["pid"]), signal.SIGINT)
    except (OSError, ValueError, KeyError):
        pass  # no step running (between steps, or it has just ended)


def resume_flags(plan: Plan, step: Step) -> list[str]:
    """The flags that make the step's command continue a cut-short run of itself."""
    out = step.option("--out")
    if out is None:
        return []
    if step.command == "train":
        from sps_driving.train.trainer import has_last_epoch

        return ["--resume"] if has_last_epoch(plan.root / out) else []
    if step.command == "collect" and (plan.root / out).exists():
        return ["--resume"]
    return []
