"""The supervisor that starts a crashed perception node again (sps_driving.ros.respawn): its back-off,
and real processes under it, a real node included."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from sps_driving.ros.process import CANNOT_START
from sps_driving.ros.respawn import BackOff

# A child that records each start (its pid) and how it was stopped, then exits as told.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    log = sys.argv[1]
    with open(log, "a") as f:
        f.write(f"start {os.getpid()}\\n")
    def stopped(signum, _frame):
        with open(log, "a") as f:
            f.write(f"signal {signal.Signals(signum).name}\\n")
        sys.exit(0)
    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    exit_with = int(sys.argv[2])
    if exit_with == -2:  # a node hung in its teardown: it takes no stop signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(log, "a") as f:
            f.write("deaf\\n")
    if exit_with >= 0:
        sys.exit(exit_with)
    time.sleep(60)
    """
)


def test_the_delay_grows_with_each_restart_up_to_its_cap_and_stops_after_the_last_allowed():
    back_off = BackOff(first_delay_s=4.0, factor=2.0, max_delay_s=30.0, max_restarts=5, window_s=600.0)
    restarts, delays = [], []
    for now in range(0, 50, 10):
        delays.append(back_off.next_delay(-9, restarts, float(now)))
        restarts.append(float(now))
    assert delays == [4.0, 8.0, 16.0, 30.0, 30.0]
    assert back_off.next_delay(-9, restarts, 50.0) is None  # a sixth crash within 600 s: it stays down
    assert back_off.next_delay(-9, restarts, 625.0) == 16.0  # three of the five are older than the window
    assert back_off.next_delay(1, [], 0.0) == 4.0  # a failure status is a crash too


def test_a_clean_exit_or_a_node_that_cannot_start_is_not_started_again():
    back_off = BackOff()
    assert back_off.next_delay(0, [], 0.0) is None
    assert back_off.next_delay(CANNOT_START, [], 0.0) is None


def test_the_shipped_settings_are_bounded(tmp_path):
    from sps_driving.core.resources import config_path

    back_off = BackOff.from_file(config_path("respawn.yaml"))
    assert 0 < back_off.first_delay_s <= back_off.max_delay_s < back_off.window_s
    assert back_off.max_restarts > 0
    misspelt = tmp_path / "respawn.yaml"
    misspelt.write_text("first_delay: 1.0\n")
    with pytest.raises(ValueError, match="unknown respawn settings"):
        BackOff.from_file(misspelt)


def supervise(tmp_path, exit_with: int, **settings):
    config = tmp_path / "respawn.yaml"
    config.write_text(yaml.safe_dump({"first_delay_s": 0.2, "factor": 2.0, "max_delay_s": 1.0, "max_restarts": 2,
                                      "window_s": 60.0, **settings}))
    log = tmp_path / "child.log"
    command = [sys.executable, "-m", "sps_driving.ros.respawn", "--name", "child", "--config", str(config), "--",
               sys.executable, "-c", CHILD, str(log), str(exit_with)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), log


def starts(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("start ")]


def wait_for(condition, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_node_is_started_again_and_ctrl_c_stops_it_for_good(tmp_path):
    supervisor, log = supervise(tmp_path, exit_with=-1)
    try:
        wait_for(lambda: len(starts(log)) == 1)
        first = starts(log)[0]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: len(starts(log)) == 2)
        assert starts(log)[1] != first
        # Ctrl-C of the supervisor reaches the node once, and nothing is started after it.
        time.sleep(0.5)  # the node's handlers are installed
        supervisor.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        out, _ = supervisor.communicate(timeout=20)
        assert time.monotonic() - signalled < 5.0  # gone with its node, not after the grace time (10 s)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert log.read_text().count("signal SIGINT") == 1
    assert len(starts(log)) == 2
    assert supervisor.returncode == 0  # the node's own status after the stop
    assert "child exited (killed by SIGKILL); starting it again in 0.2 s (restart 1" in out


def test_a_node_that_does_not_end_after_a_stop_signal_is_killed_after_the_grace_time(tmp_path):
    # After a SIGTERM to the launch alone nothing else ends a hung node: the supervisor must.
    supervisor, log = supervise(tmp_path, exit_with=-2, stop_grace_s=1.0)
    try:
        wait_for(lambda: log.exists() and "deaf" in log.read_text())
        node = starts(log)[0]
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=20)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert "child still running 1 s after SIGTERM: killing it (SIGKILL)" in out
    assert supervisor.returncode == 128 + signal.SIGKILL and len(starts(log)) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(node, 0)


def test_after_the_allowed_restarts_the_node_stays_down_with_its_status(tmp_path):
    supervisor, log = supervise(tmp_path, exit_with=3)
    out, _ = supervisor.communicate(timeout=30)
    assert len(starts(log)) == 3  # the first start and two restarts
    assert supervisor.returncode == 3
    assert "in 0.2 s (restart 1" in out and "in 0.4 s (restart 2" in out
    assert "not starting it again: 2 restarts within 60 s" in out


def test_a_node_that_cannot_start_is_not_started_again(tmp_path):
    supervisor, log = supervise(tmp_path, exit_with=CANNOT_START)
    out, _ = supervisor.communicate(timeout=30)
    assert len(starts(log)) == 1
    assert supervisor.returncode == CANNOT_START
    assert "not starting it again: it cannot start" in out


def test_turned_off_the_command_runs_in_its_place(tmp_path):
    log = tmp_path / "child.log"
    done = subprocess.run([sys.executable, "-m", "sps_driving.ros.respawn", "--enabled", "false", "--",
                           sys.executable, "-c", CHILD, str(log), "5"], timeout=30)
    assert done.returncode == 5 and len(starts(log)) == 1


@pytest.mark.ros
def test_a_killed_node_of_the_graph_comes_back_under_its_supervisor(tmp_path):
    """A real node (the safety monitor) under the supervisor, as the car launch runs it."""
    import rclpy
    from rclpy.node import Node

    from sps_driving.ros.graph import Graph, isolate_ros, wait_for_nodes

    isolate_ros()
    context = rclpy.Context()
    rclpy.init(context=context)
    observer = Node("respawn_observer", context=context)
    try:
        with Graph(["safety_monitor"], log_dir=tmp_path, respawn=["safety_monitor"]) as graph:
            wait_for_nodes(observer, ["safety_monitor"], 60, graph)
            first = graph.node_pid("safety_monitor")
            graph.kill("safety_monitor")
            wait_for(lambda: graph.node_pid("safety_monitor") not in (None, first), timeout_s=30)
            wait_for(lambda: "safety_monitor" in observer.get_node_names(), timeout_s=60)
            assert graph.alive("safety_monitor")
            assert "safety_monitor exited (killed by SIGKILL); starting it again in 4 s" in graph.log("safety_monitor")
    finally:
        observer.destroy_node()
        rclpy.try_shutdown(context=context)


def test_the_vehicle_interface_and_the_failsafe_are_never_supervised():
    from sps_driving.ros.graph import Graph

    for node in ("vehicle_interface", "failsafe"):
        with pytest.raises(ValueError, match="never started again"):
            Graph([node], respawn=[node])
