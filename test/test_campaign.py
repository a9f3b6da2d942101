"""`sps-driving campaign`: a tiny plan (3 expert drives of 2 s, a pixels cache, a No-FM policy,
4 evaluation episodes, tables) run for real through DVC, killed with SIGKILL mid-training and
mid-evaluation and run again, against the same plan run without a stop; and resumed on a "fresh
machine" (a git clone: the committed results only), where the drives and the cache are rebuilt
from their seeds only when a step needs them, and come out bit for bit the same."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from sps_driving.campaign import engine, runner
from sps_driving.campaign.plan import code_files, load_plan
from sps_driving.core.resources import SOURCE_ROOT

PLAN = """\
campaign: tiny
results: results
work: work
steps:
  drives:
    run: collect --out {work}/drives --episodes 3 --episode-s 2 --width 96 --seed 0
    outs: ["{work}/drives"]
    estimate_min: 0.1
  cache:
    run: extract {work}/drives/episode_00000 {work}/drives/episode_00001 {work}/drives/episode_00002
      --out {work}/cache --extractor-config pixels.yaml
    deps: ["{work}/drives", pixels.yaml]
    outs: ["{work}/cache"]
    estimate_min: 0.1
  train:
    run: train --cache {work}/cache --out {results}/policy --architecture cnn --rate 1.0 --epochs 12 --early-stop-patience 12 --width 64
    deps: ["{work}/cache"]
    outs: ["{results}/policy"]
    estimate_min: 0.2
    unit_min: 0.01
  eval:
    run: eval --policy {results}/policy --name No-FM --episodes 2 --episode-s 2 --workers 1 --no-failure-strips
      --scenarios rural-summer-dry-day-car urban-summer-dry-night-car --out {results}/eval
    deps: ["{results}/policy"]
    outs: ["{results}/eval"]
    estimate_min: 0.2
    unit_min: 0.01
  tables:
    run: tables {results}/eval --out {results}/tables
    deps: ["{results}/eval"]
    outs: ["{results}/tables"]
    estimate_min: 0.1
"""
PIXELS = "backbone: pixels\ninput_size: [28, 56]\npixel_pool: 7\nroi: [0.40, 0.65, 0.125, 0.875]\n"
KEPT = ["policy/policy.safetensors", "policy/last/policy.safetensors", "policy/last/train_state.safetensors",
        "eval/results.jsonl", "tables/results.jsonl"]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def campaign(root: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "sps_driving.cli", "campaign", *args], cwd=root, env=env,
                            start_new_session=True, stdout=open(root / "campaign.log", "a"), stderr=subprocess.STDOUT)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@pytest.fixture
def orphans_left_unreaped():
    """The killed runs' orphans (their DVC among them) are re-parented to this process and left as
    zombies until the test ends, as under an init that reaps late or a subreaper that never does:
    their PIDs still exist, which is all DVC asks of a lock's holder."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for child in psutil.Process().children():
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, 0)


def kill_when(root: Path, process: subprocess.Popen, ready, timeout_s: float = 120.0) -> None:
    """SIGKILL to the campaign and everything it started, as soon as `ready()` holds."""
    end = time.time() + timeout_s
    while not ready():
        assert process.poll() is None, "the run ended before the moment it was to be killed at"
        assert time.time() < end, "the moment to kill at never came"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def rows(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The tiny plan run from start to end without a stop."""
    root = tmp_path_factory.mktemp("reference")
    git(root, "init", "-q")
    git(root, "config", "user.email", "campaign@test")
    git(root, "config", "user.name", "campaign test")
    (root / "plan.yaml").write_text(PLAN)
    (root / "pixels.yaml").write_text(PIXELS)
    (root / ".gitignore").write_text("/work/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "plan")
    assert campaign(root, "run", "plan.yaml").wait() == 0
    return root


def cut_after_cache(reference: Path, root: Path) -> Path:
    """A copy of the reference repository with drives and cache done and nothing after them, as a
    run killed just then."""
    shutil.copytree(reference, root)
    plan = load_plan(root / "plan.yaml")
    for name in ("policy", "eval", "tables"):
        shutil.rmtree(root / "results" / name)
    lock_path = root / "results" / engine.LOCK_FILE
    lock = yaml.safe_load(lock_path.read_text())
    lock["stages"] = {k: v for k, v in lock["stages"].items() if k in ("drives", "cache")}
    lock_path.write_text(yaml.safe_dump(lock))
    records = root / "results" / runner.RECORD_FILE
    records.write_text("".join(f"{json.dumps(r)}\n" for r in runner.read_records(plan) if r["step"] in ("drives", "cache")))
    return root


def test_killed_mid_training_and_mid_evaluation_it_resumes_to_the_uninterrupted_result(reference, tmp_path,
                                                                                      orphans_left_unreaped):
    root = cut_after_cache(reference, tmp_path / "killed")
    plan = load_plan(root / "plan.yaml")

    state = root / "results/policy/last/train_state.json"
    kill_when(root, campaign(root, "run", "plan.yaml"), lambda: state.is_file())
    epochs_before_kill = json.loads(state.read_text())["epoch"]
    assert epochs_before_kill < 12
    results = root / "results/eval/results.jsonl"
    kill_when(root, campaign(root, "run", "plan.yaml"), lambda: len(rows(results)) >= 1)
    assert len(rows(results)) < 4
    assert campaign(root, "run", "plan.yaml").wait() == 0

    for kept in KEPT:  # bit for bit: training and evaluation are deterministic on the CPU
        assert (root / "results" / kept).read_bytes() == (reference / "results" / kept).read_bytes(), kept
    attempts = [r for r in runner.read_records(plan) if r["step"] == "train" and r["event"] == "start"]
    assert len(attempts) >= 2 and "--resume" in attempts[-1]["argv"]  # continued from its last epoch, not from scratch
    assert attempts[-1]["host"] == runner.host_cpu() and "avx2" in attempts[-1]["host"]["isa"]  # x86-64 CI and dev hosts
    assert {s.step.name: s.state for s in runner.states(plan)} == dict.fromkeys(("drives", "cache", "train", "eval", "tables"),
                                                                                 runner.DONE)
    assert "tables done" in git(root, "log", "--format=%s", "-1")
    assert not git(root, "status", "--porcelain", "--", "results")  # everything finished is committed


@pytest.mark.parametrize("sent_to", ["process group", "run process"])
def test_a_campaign_started_with_sigint_ignored_shows_its_status_stops_on_sigint_and_resumes(reference, tmp_path, sent_to):
    """As from `campaign run ... &` in a script, whose shell starts it with SIGINT ignored (and DVC
    ignores it around each step): `status` shows the training running; a SIGINT, to the run's
    process group as Ctrl-C sends it or to the run's process alone as `kill -INT` does, stops the
    run, DVC and the step's command, without a traceback, records the step's end, commits what it
    finished, and the next run resumes the training from its last epoch."""
    root = cut_after_cache(reference, tmp_path / "interrupted")
    # A training long enough to be still running when `status` has answered and the SIGINT comes.
    plan_file = root / "plan.yaml"
    plan_file.write_text(plan_file.read_text().replace("--epochs 12 --early-stop-patience 12",
                                                       "--epochs 300 --early-stop-patience 300"))
    env = {**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}
    log = root / "run.log"
    run = subprocess.Popen([sys.executable, "-m", "sps_driving.cli", "campaign", "run", "plan.yaml"], cwd=root,
                           env=env, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    state = root / "results/policy/last/train_state.json"
    end = time.time() + 120
    while not state.is_file():
        assert run.poll() is None and time.time() < end, "the training never saved an epoch"
        time.sleep(0.05)
    group = [run.pid] + [child.pid for child in psutil.Process(run.pid).children(recursive=True)]
    assert any("train" in psutil.Process(pid).cmdline() for pid in group)
    # `status` while a step runs (DVC locks that step's outputs, which the steps after it read)
    shown = subprocess.run([sys.executable, "-m", "sps_driving.cli", "campaign", "status", "plan.yaml", "--json"], cwd=root,
                           env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert {s["step"]: s["state"] for s in json.loads(shown.stdout)["steps"]} == {
        "drives": runner.DONE, "cache": runner.DONE, "train": runner.RUNNING, "eval": runner.LEFT, "tables": runner.LEFT}
    if sent_to == "process group":
        os.killpg(run.pid, signal.SIGINT)
    else:
        os.kill(run.pid, signal.SIGINT)
    # Ended by SIGINT, as a shell expects of a command Ctrl-C stopped (a script's loop stops too).
    assert run.wait(timeout=60) == -signal.SIGINT, log.read_text()
    output = log.read_text()
    assert "Traceback" not in output and "interrupted; train stopped" in output, output
    deadline = time.time() + 30
    while any(engine.process_running(pid) for pid in group) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in group if engine.process_running(pid)]
    plan = load_plan(root / "plan.yaml")
    assert not (root / "results" / runner.RUNNING_FILE).exists()
    assert runner.read_records(plan)[-1] | {"time": 0, "seconds": 0} == {
        "step": "train", "key": runner.attempt_key(plan, plan.step("train")), "event": "end", "time": 0, "seconds": 0,
        "exit": runner.INTERRUPTED}
    assert git(root, "log", "--format=%s", "-1") == "campaign tiny: train interrupted, finished units kept\n"
    assert "results/policy/last/train_state.json" in git(root, "ls-files", "results/policy")
    assert campaign(root, "run", "plan.yaml", "--no-commit").wait() == 0
    attempts = [r for r in runner.read_records(plan) if r["step"] == "train" and r["event"] == "start"]
    assert "--resume" in attempts[-1]["argv"]


def test_a_step_stopped_at_the_budgets_end_records_and_commits_why(reference, tmp_path):
    """The step's own exit code, not DVC's (which says only that the stage failed), in its end
    record, the commit message and the log; the run itself ends well, the step resumes next time."""
    root = cut_after_cache(reference, tmp_path / "budget_end")
    plan_file = root / "plan.yaml"
    # A training that outlasts the budget (about 30 epochs a second).
    plan_file.write_text(plan_file.read_text().replace("--epochs 12 --early-stop-patience 12",
                                                       "--epochs 10000 --early-stop-patience 10000"))
    assert campaign(root, "run", "plan.yaml", "--budget", "0.3").wait(timeout=120) == 0
    plan = load_plan(plan_file)
    assert runner.read_records(plan)[-1]["exit"] == runner.STOPPED_AT_BUDGET
    assert git(root, "log", "--format=%s", "-1") == "campaign tiny: train stopped (at the budget's end), finished units kept\n"
    assert "train stopped at the budget's end; it resumes next time" in (root / "campaign.log").read_text()


def test_a_fresh_machine_resumes_from_the_repository_and_rebuilds_the_cache_bit_for_bit(reference, tmp_path):
    root = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(reference), str(root))
    plan = load_plan(root / "plan.yaml")
    assert not (root / "work").exists()
    found = {s.step.name: s.state for s in runner.states(plan)}
    assert found == {"drives": runner.ABSENT, "cache": runner.ABSENT, "train": runner.DONE, "eval": runner.DONE,
                     "tables": runner.DONE}
    assert runner.to_run(plan, runner.states(plan)) == []  # nothing needs the drives or the cache: nothing rebuilt

    # A new step that reads the cache: the drives are driven again from their seeds and the cache
    # extracted again, equal to the original; the finished steps are not run again. A new step
    # that reads only committed results runs before the rebuilds, though later in the plan.
    (root / "plan.yaml").write_text(PLAN + """\
  train_seed1:
    run: train --cache {work}/cache --out {results}/policy_s1 --architecture cnn --rate 1.0 --epochs 1 --width 64 --seed 1
    deps: ["{work}/cache"]
    outs: ["{results}/policy_s1"]
    estimate_min: 0.1
  tables_again:
    run: tables {results}/eval --out {results}/tables_again
    deps: ["{results}/eval"]
    outs: ["{results}/tables_again"]
    estimate_min: 0.1
""")
    plan = load_plan(root / "plan.yaml")
    assert [s.name for s in runner.to_run(plan, runner.states(plan))] == ["tables_again", "drives", "cache", "train_seed1"]
    assert campaign(root, "run", "plan.yaml", "--no-commit").wait() == 0
    for folder in ("drives", "cache"):
        assert runner.tree_digest(root / "work" / folder) == runner.tree_digest(reference / "work" / folder), folder
    started = [r["step"] for r in runner.read_records(plan) if r["event"] == "start"]
    assert started.count("train") == sum(r["step"] == "train" for r in runner.read_records(load_plan(reference / "plan.yaml"))
                                         if r["event"] == "start")
    assert all(s.state == runner.DONE for s in runner.states(plan))


def test_status_shows_states_measured_times_and_what_is_left(reference, tmp_path, capsys):
    from sps_driving.cli import main

    root = tmp_path / "changed"
    shutil.copytree(reference, root)
    (root / "pixels.yaml").write_text(PIXELS.replace("pixel_pool: 7", "pixel_pool: 14"))  # the cache's config changed
    assert main(["campaign", "status", str(root / "plan.yaml"), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    by_step = {s["step"]: s for s in status["steps"]}
    assert by_step["drives"]["state"] == "done" and by_step["drives"]["measured_min"] > 0
    assert by_step["cache"]["state"] == "left" and "pixels.yaml modified" in by_step["cache"]["reason"]
    assert [by_step[s]["reason"] for s in ("train", "eval", "tables")] == ["after cache", "after train", "after eval"]
    assert status["run_order"] == ["cache", "train", "eval", "tables"]
    # What is left is each step's measured cost (its finished attempt), not the plan's estimate.
    measured = {s.name: runner.measured_minutes(load_plan(root / "plan.yaml"), s) for s in load_plan(root / "plan.yaml").steps}
    assert status["left_min"] == pytest.approx(sum(measured[s] for s in ("cache", "train", "eval", "tables")), abs=0.05)


def test_what_is_left_of_a_step_begun_again_with_new_inputs_is_its_last_finished_cost_less_the_new_attempts(
        reference, tmp_path):
    """A training that finished once (10 min) and, its inputs since changed, has run 2 min of a new
    attempt has about 8 min left, not one unit (the new attempt's time less itself)."""
    root = cut_after_cache(reference, tmp_path / "begun_again")
    plan = load_plan(root / "plan.yaml")
    step = plan.step("train")
    for key, seconds, code in (("inputs before", 600.0, 0), (runner.attempt_key(plan, step), 120.0, runner.STOPPED_AT_BUDGET)):
        runner.append_record(plan, {"step": "train", "key": key, "event": "start", "time": time.time()})
        runner.append_record(plan, {"step": "train", "key": key, "event": "end", "time": time.time(), "seconds": seconds,
                                    "exit": code})
    train = next(s for s in runner.states(plan) if s.step.name == "train")
    assert train.state == runner.LEFT
    assert (train.measured_min, train.left_min) == pytest.approx((2.0, 8.0))


def test_budget_starts_only_what_fits(tmp_path):
    root = tmp_path / "budget"
    root.mkdir()
    git(root, "init", "-q")
    (root / "plan.yaml").write_text(PLAN.replace("estimate_min: 0.1\n  cache", "estimate_min: 30\n  cache", 1))
    messages = []
    assert runner.run_plan(load_plan(root / "plan.yaml"), budget_min=5, log=messages.append) == 0
    assert not (root / "work").exists() and not runner.read_records(load_plan(root / "plan.yaml"))
    assert "drives needs about 30.0 min" in messages[-1] and "not started (5 step(s) left)" in messages[-1]


def test_code_key_follows_the_code_a_step_runs_not_the_repository():
    train = {p.relative_to(SOURCE_ROOT).as_posix() for p in code_files("train")}
    assert "sps_driving/train/trainer.py" in train and "config/train.yaml" in train
    assert "sps_driving/sim/evaluate.py" not in train and "sps_driving/tools/demo.py" not in train
    assert "sps_driving/sim/evaluate.py" in {p.relative_to(SOURCE_ROOT).as_posix() for p in code_files("eval")}


PINNED_PLAN = """\
campaign: pinned
results: results
work: work
steps:
  pinned:
    run: collect --out {work}/pinned --episodes 1 --episode-s 1 --width 64 --seed 0
    outs: ["{work}/pinned"]
    estimate_min: 0.1
    code: %s
  checkout:
    run: collect --out {work}/checkout --episodes 1 --episode-s 1 --width 64 --seed 0
    outs: ["{work}/checkout"]
    estimate_min: 0.1
"""


def test_a_step_pinned_to_a_commit_runs_that_commits_code_and_later_commits_do_not_touch_it(tmp_path):
    """A clone whose commit P makes every import of its collect module log where it came from: a step
    pinned to P runs P's tree (a worktree under work/code/) and records P; a commit after P changes
    the key of the step that runs the checkout (here the clone), not the pinned one's."""
    root = tmp_path / "repo"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(SOURCE_ROOT), str(root)], check=True)
    git(root, "config", "user.email", "campaign@test")
    git(root, "config", "user.name", "campaign test")
    for folder in ("sps_driving", "config"):  # the code under test, committed or not
        shutil.copytree(SOURCE_ROOT / folder, root / folder, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    git(root, "add", "-A", "sps_driving", "config")
    git(root, "commit", "-q", "--allow-empty", "-m", "the code under test")
    package = root / "sps_driving" / "sim" / "collect.py"
    package.write_text(package.read_text() + "\nwith open('imports.log', 'a') as _log:\n    _log.write(__file__ + '\\n')\n")
    git(root, "commit", "-q", "-am", "log imports")
    pinned = git(root, "rev-parse", "HEAD").strip()
    (root / "plan.yaml").write_text(PINNED_PLAN % pinned[:10])
    plan = load_plan(root / "plan.yaml")
    tree = root / "work" / "code" / pinned
    assert plan.step("pinned").code_revision == pinned and plan.step("pinned").code_root == tree
    assert plan.step("checkout").code_revision is None
    assert (tree.parent / "COLCON_IGNORE").is_file()  # a colcon build of the workspace finds one sps_driving

    def clone_campaign(*args):  # the clone's checkout is the one its campaign runs (as from a shell in it)
        done = subprocess.run([sys.executable, "-m", "sps_driving.cli", "campaign", *args], cwd=root, check=True,
                              capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        return yaml.safe_load((root / "results" / engine.KEYS_FILE).read_text()), done.stdout

    keys, _ = clone_campaign("run", "plan.yaml", "--no-commit")
    assert str(tree / "sps_driving" / "sim" / "collect.py") in (root / "imports.log").read_text().splitlines()
    starts = {r["step"]: r for r in runner.read_records(plan) if r["event"] == "start"}
    assert starts["pinned"]["code"] == pinned and "code" not in starts["checkout"]
    assert (root / "work" / "pinned" / "collect.json").is_file() and (root / "work" / "checkout" / "collect.json").is_file()

    package.write_text(package.read_text() + "# a later commit\n")
    git(root, "commit", "-q", "-am", "later")
    later, shown = clone_campaign("status", "plan.yaml")
    assert later["pinned"] == keys["pinned"] and later["checkout"] != keys["checkout"]
    assert f"code {pinned[:12]} (pinned; its worktree under work/code/): pinned\n" in shown

    (root / "plan.yaml").write_text(PINNED_PLAN % "no-such-revision")
    with pytest.raises(ValueError, match="step pinned: code: 'no-such-revision' is no commit"):
        load_plan(root / "plan.yaml")
    (root / "plan.yaml").write_text(PINNED_PLAN % "6153576")  # an abbreviated hash YAML reads as a number
    with pytest.raises(ValueError, match='step pinned: code: 6153576 is not text: write the commit quoted, "6153576"'):
        load_plan(root / "plan.yaml")
    graph = PINNED_PLAN.replace("run: collect --out {work}/pinned", "run: eval --graph --out {work}/pinned")
    (root / "plan.yaml").write_text(graph % pinned[:10])
    with pytest.raises(ValueError, match="--graph starts ROS nodes from the checkout"):
        load_plan(root / "plan.yaml")
    copy = tmp_path / "files_alone"  # as the GPU machine gets the repository: its files, no history
    copy.mkdir()
    (copy / "plan.yaml").write_text(PINNED_PLAN % pinned[:10] + "root: .\n")
    with pytest.raises(ValueError, match="pinning code needs the repository's history"):
        load_plan(copy / "plan.yaml")


@pytest.mark.parametrize("change, message", [
    (lambda s: s.replace("run: collect", "run: demo"), "must start with one of"),
    (lambda s: s.replace("outs: [\"{work}/cache\"]", "outs: [\"{work}/drives/cache\"]"), "overlaps"),
    (lambda s: s.replace("estimate_min: 0.2\n    unit_min: 0.01\n  eval", "estimate_min: -1\n  eval"), "estimate_min"),
    (lambda s: s.replace("{work}/drives --episodes", "{wrok}/drives --episodes"), "names"),
])
def test_a_bad_plan_is_a_clear_error(tmp_path, change, message):
    (tmp_path / ".git").mkdir()
    (tmp_path / "plan.yaml").write_text(change(PLAN))
    with pytest.raises(ValueError, match=message):
        load_plan(tmp_path / "plan.yaml")


@pytest.mark.slow
def test_the_gpu_script_runs_a_plan_from_seeds_and_brings_back_only_the_results_folder(tmp_path):
    import tarfile

    root = tmp_path / "gpu"
    root.mkdir()
    git(root, "init", "-q")
    (root / "plan.yaml").write_text(PLAN)
    (root / "pixels.yaml").write_text(PIXELS)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    subprocess.run(["bash", str(SOURCE_ROOT / "scripts" / "campaign_gpu.sh"), str(root / "plan.yaml")], env=env, check=True,
                   capture_output=True)
    with tarfile.open(out / "results.tar.gz") as archive:
        names = archive.getnames()
    assert "results/eval/results.jsonl" in names and "results/policy/policy.safetensors" in names
    assert not any(name.startswith("work") for name in names)  # drives and caches stay there
    assert len(rows(root / "results" / "eval" / "results.jsonl")) == 4
    assert (out / "results.tar.gz").stat().st_size < 64 * 1024 * 1024


def test_collect_resume_drives_again_only_the_episodes_cut_short_and_gives_the_same_bags(tmp_path):
    from sps_driving.cli import main

    args = ["collect", "--episodes", "2", "--episode-s", "1", "--width", "64", "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    manifest = json.loads((cut / "collect.json").read_text())
    (cut / "collect.json").write_text(json.dumps({**manifest, "results": manifest["results"][:1]}))  # killed in episode 1
    for file in (cut / "episode_00001").iterdir():
        file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(SystemExit, match="--resume"):
        main([*args, "--out", str(cut)])
    assert main([*args, "--out", str(cut), "--resume"]) == 0
    assert runner.tree_digest(cut) == runner.tree_digest(tmp_path / "whole")


def test_a_results_line_cut_by_a_kill_stays_apart_from_the_next(tmp_path):
    from sps_driving.sim.results import EvalSettings, Recorder, read_results

    path = tmp_path / "results.jsonl"
    path.write_text('{"method": "A", "scenario": "s", "seed": 0}\n{"method": "A", "scen')
    record = Recorder(EvalSettings("A", None, "quick", 1, 1.0, 64, 40), path, 1)
    record({"scenario": "s", "seed": 1})
    record.close()
    assert [row["seed"] for row in read_results(path)] == [0, 1]


def test_a_lock_file_cut_by_a_kill_is_replaced_by_its_copy_from_before_the_step(reference, tmp_path):
    root = tmp_path / "cut_lock"
    shutil.copytree(reference, root)
    plan = load_plan(root / "plan.yaml")
    lock = root / "results" / engine.LOCK_FILE
    whole = lock.read_text()
    engine.lock_copy(plan).parent.mkdir(parents=True, exist_ok=True)
    engine.lock_copy(plan).write_text(whole)
    lock.write_text(whole[: len(whole) // 2] + "\n  - {")  # DVC killed while it wrote the lock
    assert all(s.state == runner.DONE for s in runner.states(plan))
    assert lock.read_text() == whole


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(tmp_path):
    # A killed DVC not yet reaped is a zombie (its PID exists, which is all DVC asks); a live run's entry stays.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while psutil.Process(dead.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        entry = lambda process: {"pid": process.pid, "cmd": "dvc/__main__.py repro results/dvc.yaml:train"}  # noqa: E731
        lock = tmp_path / ".dvc" / "tmp" / "rwlock"
        lock.parent.mkdir(parents=True)
        lock.write_text(json.dumps({"write": {"a": entry(dead), "b": entry(live)}, "read": {"c": [entry(dead), entry(live)]}}))
        engine.release_dead_locks(tmp_path)
        assert json.loads(lock.read_text()) == {"write": {"b": entry(live)}, "read": {"c": [entry(live)]}}
    finally:
        live.kill()
        live.wait()
        dead.wait()
