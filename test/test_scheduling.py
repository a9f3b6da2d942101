"""CPU affinity and scheduling priority of the nodes that stop the car (sps_driving.ros.process,
nodes.common.SCHEDULING_PARAMETERS): applied to every thread, refused with what it needs."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sps_driving.ros.process import CANNOT_START, parse_cpus

# Runs apply_scheduling in a fresh process with a few threads, then prints each thread's policy,
# priority, nice value and CPUs.
APPLY = textwrap.dedent(
    """
    import json, os, sys, threading
    from sps_driving.ros.process import apply_scheduling
    stop = threading.Event()
    before = [threading.Thread(target=stop.wait) for _ in range(3)]
    for t in before: t.start()
    try:
        print("applied:", apply_scheduling(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
        later = threading.Thread(target=stop.wait); later.start()  # started after: inherits it
        for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
            print("thread", json.dumps([os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
                                        os.getpriority(os.PRIO_PROCESS, tid), sorted(os.sched_getaffinity(tid))]))
    except ValueError as exc:
        print("refused:", exc)
    stop.set()
    """
)
# Drops CAP_SYS_NICE for the command, as a process without it runs (util-linux).
WITHOUT_CAP_SYS_NICE = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice"]


def apply(cpus: str, priority: int, nice: int, prefix=()) -> tuple[str, list[tuple]]:
    done = subprocess.run([*prefix, sys.executable, "-c", APPLY, cpus, str(priority), str(nice)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    threads = [json.loads(line.removeprefix("thread ")) for line in done.stdout.splitlines() if line.startswith("thread ")]
    return done.stdout, threads


def can_raise_priority() -> bool:
    try:
        param = os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        os.sched_setscheduler(0, os.SCHED_OTHER, param)
        return True
    except PermissionError:
        return False


needs_a_capability_to_drop = pytest.mark.skipif(shutil.which("setpriv") is None or not can_raise_priority(),
                                                reason="needs setpriv (util-linux) and CAP_SYS_NICE to drop")


def test_cpu_lists():
    assert parse_cpus("1") == {1} and parse_cpus("0,1") == {0, 1} and parse_cpus("0-2, 4") == {0, 1, 2, 4}
    assert parse_cpus("") == os.sched_getaffinity(0)
    with pytest.raises(ValueError, match="expected CPU numbers"):
        parse_cpus("core1")


def test_every_thread_is_pinned_including_those_started_later():
    out, threads = apply("0", 0, 0)
    assert "applied: CPUs [0]" in out
    assert len(threads) >= 5 and all(cpus == [0] for *_, cpus in threads)


def test_a_cpu_the_machine_lacks_is_refused():
    out, _ = apply(str(os.cpu_count() + 3), 0, 0)
    assert "refused: cpu_affinity" in out and "names CPUs this machine does not have" in out


@pytest.mark.skipif(not can_raise_priority(), reason="this process may not use real-time scheduling")
def test_every_thread_runs_under_sched_fifo_at_the_priority():
    out, threads = apply("", 10, 0)
    assert "applied: SCHED_FIFO priority 10" in out
    assert threads and all(policy == os.SCHED_FIFO and priority == 10 for policy, priority, *_ in threads)


@needs_a_capability_to_drop
def test_without_cap_sys_nice_the_priority_is_refused_saying_what_it_needs():
    out, threads = apply("", 10, 0, prefix=WITHOUT_CAP_SYS_NICE)
    assert "refused: realtime_priority 10 needs CAP_SYS_NICE or a real-time priority limit of at least 10" in out
    assert "ulimit -r 10" in out
    out, _ = apply("", 0, -5, prefix=WITHOUT_CAP_SYS_NICE)
    assert "refused: nice -5 needs CAP_SYS_NICE" in out and "ulimit -e 25" in out


def params_file(tmp_path, node: str, **values) -> Path:
    """config/graph.yaml with `values` for `node`, in this process's private ROS domain."""
    import yaml

    from sps_driving.ros.graph import default_params_file, isolate_ros

    isolate_ros()
    params = yaml.safe_load(default_params_file().read_text())
    params[node]["ros__parameters"].update(values)
    path = Path(tmp_path) / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.mark.ros
@needs_a_capability_to_drop
def test_the_failsafe_does_not_start_without_the_priority_it_was_given(tmp_path):
    """A safety node that cannot have its priority says why and exits as a node that cannot start."""
    path = params_file(tmp_path, "failsafe", realtime_priority=20, cpu_affinity="0")
    command = [*WITHOUT_CAP_SYS_NICE, sys.executable, "-m", "sps_driving.ros.nodes.failsafe", "--ros-args", "--params-file", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == CANNOT_START, done.stderr
    assert "[failsafe] cannot start: realtime_priority 20 needs CAP_SYS_NICE" in done.stderr


@pytest.mark.ros
@pytest.mark.skipif(not can_raise_priority(), reason="this process may not use real-time scheduling")
def test_the_extractor_runs_every_thread_under_its_realtime_priority(tmp_path):
    """realtime_priority is applied before the runtime starts its threads, so they inherit it
    (the graph's extractor at its standalone speed on the CPU: docs/results/bench_cpu.md)."""
    import time

    path = params_file(tmp_path, "extractor", realtime_priority=10, backbone="pixels", device="cpu")
    node = subprocess.Popen([sys.executable, "-m", "sps_driving.ros.nodes.extractor", "--ros-args", "--params-file", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any("extraction settings" in line for line in lines):  # logged once the runtime is open
            line = node.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        time.sleep(0.5)
        threads = [int(t) for t in os.listdir(f"/proc/{node.pid}/task")]
        assert len(threads) > 3 and any("scheduling: SCHED_FIFO priority 10" in line for line in lines)
        assert all(os.sched_getscheduler(t) == os.SCHED_FIFO and os.sched_getparam(t).sched_priority == 10 for t in threads)
    finally:
        node.terminate()
        node.wait(timeout=30)


@pytest.mark.ros
@needs_a_capability_to_drop
def test_the_extractor_does_not_start_without_the_priority_it_was_given(tmp_path):
    path = params_file(tmp_path, "extractor", realtime_priority=20, backbone="pixels", device="cpu")
    command = [*WITHOUT_CAP_SYS_NICE, sys.executable, "-m", "sps_driving.ros.nodes.extractor", "--ros-args", "--params-file", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == CANNOT_START, done.stderr
    assert "[extractor] cannot start: realtime_priority 20 needs CAP_SYS_NICE" in done.stderr
