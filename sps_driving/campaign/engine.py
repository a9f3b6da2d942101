"""The plan as a DVC pipeline (docs/campaign.md, "Why DVC"): RESULTS/dvc.yaml with one stage per
step, RESULTS/keys.yaml with each step's code key (a DVC parameter), and DVC's own dvc.lock beside
them, which records the content hash of every input, parameter and output of each finished step.

Every stage runs `sps-driving campaign step PLAN NAME` (sps_driving.campaign.runner), which runs
the step's command with its resume flags. Outputs are `persist` (DVC does not delete them before
a rerun, so a cut-short step resumes) and `cache: false` (not copied into DVC's cache: results and
checkpoints are committed with git, drives and caches are rebuilt from seeds). Nothing reaches
the network: analytics and update checks are off in the repository's DVC config and in the
environment of every DVC call.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from sps_driving.campaign.plan import Plan, Step
from sps_driving.core.resources import SOURCE_ROOT

PIPELINE_FILE = "dvc.yaml"
LOCK_FILE = "dvc.lock"
KEYS_FILE = "keys.yaml"
# Repository-wide DVC settings: no analytics, no update check, nothing staged in git behind the user's back.
DVC_SETTINGS = {"core.analytics": "false", "core.check_update": "false", "core.autostage": "false"}
# Folders DVC never needs to walk (it looks for pipelines in the whole repository).
DVC_IGNORED = (".venv/", "out/", "build/", ".hypothesis/", ".pytest_cache/")
REPOSITORY_FILES = (".dvc/config", ".dvc/.gitignore", ".dvcignore")  # what `dvc init` leaves that git keeps
INTERRUPT_POLL_S = 0.2  # s between looks at a running process for a SIGINT to act on


def environment(root: Path) -> dict:
    """The environment of every DVC call and of the steps it runs: this interpreter first on PATH
    (stages run `python`), this source tree importable, DVC offline with its site cache inside the repository."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(SOURCE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="1", DVC_IGNORE_ISATTY="1",
               DVC_SITE_CACHE_DIR=str(root / ".dvc" / "tmp" / "site"))
    return env


def process_running(pid: int, started: float | None = None) -> bool:
    """Whether `pid` is a live process; with `started` (a time it recorded), the one that recorded it,
    not a later one given the same PID. A killed process not yet reaped by its new parent is a
    zombie: its PID exists, which is all DVC asks of a lock's holder."""
    import psutil  # DVC's own dependency

    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and (started is None or process.create_time() <= started + 1.0)
    except psutil.Error:
        return False


def _lock_holder_running(info: dict) -> bool:
    try:
        return process_running(int(info["pid"]))
    except (KeyError, ValueError):
        return False


def release_dead_locks(root: Path) -> None:
    """Drop the entries of DVC's lock file (.dvc/tmp/rwlock) whose process is gone, so that a run
    killed at any moment never blocks the next one."""
    from dvc.lock import make_lock

    folder = root / ".dvc" / "tmp"
    path = folder / "rwlock"
    if not path.is_file():
        return
    with make_lock(str(folder / "rwlock.lock"), tmp_dir=str(folder)):  # the guard DVC edits it under
        try:
            lock = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # DVC reports a corrupt lock file itself
        kept = {"write": {p: i for p, i in lock.get("write", {}).items() if _lock_holder_running(i)},
                "read": {p: live for p, infos in lock.get("read", {}).items()
                         if (live := [i for i in infos if _lock_holder_running(i)])}}
        if kept != lock:
            path.write_text(json.dumps(kept))


def dvc(root: Path, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    release_dead_locks(root)
    result = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=environment(root), text=True, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} failed (exit {result.returncode}): {(result.stderr or '').strip()}")
    return result


def ensure_repository(root: Path) -> None:
    """`dvc init` at `root` when it has no .dvc yet (without git when it is no git work tree), with DVC_SETTINGS."""
    if not (root / ".dvc").is_dir():
        dvc(root, "init", "--quiet", *(() if (root / ".git").exists() else ("--no-scm",)), capture_output=True)
    config = root / ".dvc" / "config"
    text = config.read_text() if config.is_file() else ""
    if "[core]" not in text:  # written here, not by `dvc config`: three DVC starts less
        config.write_text(text + "[core]\n" + "".join(f"    {key.split('.')[1]} = {value}\n" for key, value in DVC_SETTINGS.items()))
    elif any(f"{key.split('.')[1]} = {value}" not in text for key, value in DVC_SETTINGS.items()):
        for key, value in DVC_SETTINGS.items():
            dvc(root, "config", key, value, capture_output=True)
    ignore = root / ".dvcignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    missing = [entry for entry in DVC_IGNORED if entry not in lines]
    if missing:
        ignore.write_text("\n".join(lines + missing) + "\n")


def results_dir(plan: Plan) -> Path:
    return plan.root / plan.results


def write_pipeline(plan: Plan) -> None:
    """RESULTS/dvc.yaml and RESULTS/keys.yaml for the plan as it is now (rewritten only on change)."""
    folder = results_dir(plan)
    folder.mkdir(parents=True, exist_ok=True)
    wdir = os.path.relpath(plan.root, folder)
    keys_path = f"{plan.results}/{KEYS_FILE}"
    plan_path = os.path.relpath(plan.path, plan.root)
    stages = {}
    for step in plan.steps:
        stage = {"cmd": f"python -m sps_driving.cli campaign step {plan_path} {step.name}", "wdir": wdir,
                 "params": [{keys_path: [step.name]}],
                 "outs": [{out: {"cache": False, "persist": True}} for out in step.outs]}
        if step.deps:
            stage["deps"] = list(step.deps)
        stages[step.name] = stage
    _write_if_changed(folder / KEYS_FILE, yaml.safe_dump({s.name: s.code_key() for s in plan.steps}, sort_keys=False))
    header = f"# Generated from {plan_path} by `sps-driving campaign`; edit the plan, not this file.\n"
    _write_if_changed(folder / PIPELINE_FILE, header + yaml.safe_dump({"stages": stages}, sort_keys=False, width=200))


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def stage_target(plan: Plan, step: Step) -> str:
    return f"{plan.results}/{PIPELINE_FILE}:{step.name}"


def lock_copy(plan: Plan) -> Path:
    return plan.root / ".dvc" / "tmp" / f"{plan.name}.{LOCK_FILE}"


def repair_lock(plan: Plan) -> None:
    """A dvc.lock cut by a kill while DVC wrote it is replaced by its copy from before that step
    (the step then runs again with the same key: it resumes and is recorded)."""
    path = results_dir(plan) / LOCK_FILE
    try:
        yaml.safe_load(path.read_text()) if path.is_file() else None
    except yaml.YAMLError:
        copy = lock_copy(plan)
        if copy.is_file():
            shutil.copyfile(copy, path)
        else:
            path.unlink()


def changes(plan: Plan, steps: list[Step] | None = None) -> dict[str, list]:
    """DVC's status of every step (or of `steps`) that is not up to date: {step: [its changes as
    `dvc status --json` says them]}."""
    repair_lock(plan)
    targets = [f"{plan.results}/{PIPELINE_FILE}"] if steps is None else [stage_target(plan, s) for s in steps]
    if not targets:
        return {}
    result = dvc(plan.root, "status", "--json", *targets, capture_output=True)
    found = json.loads(result.stdout or "{}")
    return {name.rpartition(":")[2]: entries for name, entries in found.items()}


def locked(plan: Plan) -> dict:
    """The steps dvc.lock records as finished once: {step: its lock entry}."""
    path = results_dir(plan) / LOCK_FILE
    return (yaml.safe_load(path.read_text()) or {}).get("stages", {}) if path.is_file() else {}


@contextlib.contextmanager
def sigint_caught():
    """While the block runs, SIGINT appends to the yielded list instead of raising KeyboardInterrupt,
    which could land anywhere (between a record's start and end, inside a commit)."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


def reproduce(plan: Plan, step: Step, env_extra: dict | None = None, on_interrupt=None) -> int:
    """Run one step through DVC (its upstream steps are not looked at: the caller orders them);
    DVC records its hashes in dvc.lock when the step's command succeeds. Returns the exit code.
    After a SIGINT, calls `on_interrupt` (which stops the step) until DVC has ended, then raises
    KeyboardInterrupt: DVC is not killed, so it leaves its lock files in order."""
    env = {**environment(plan.root), **(env_extra or {})}
    lock = results_dir(plan) / LOCK_FILE
    if lock.is_file():
        lock_copy(plan).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lock, lock_copy(plan))
    release_dead_locks(plan.root)
    with sigint_caught() as interrupted:
        process = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--quiet", "--single-item",
                                    stage_target(plan, step)], cwd=plan.root, env=env)
        code = None
        while code is None:
            try:
                code = process.wait(INTERRUPT_POLL_S)
            except subprocess.TimeoutExpired:
                # Again each time: the step may not have started, or not yet said where it runs.
                if interrupted and on_interrupt is not None:
                    on_interrupt()
    if interrupted:
        raise KeyboardInterrupt
    return code
