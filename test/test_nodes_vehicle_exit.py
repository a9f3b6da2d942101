"""vehicle_interface ("topics" backend) in a graph of its own: a stepped ROS clock neither stalls
its watchdog nor goes unnoticed; SIGTERM while engaged brakes, then exits; an inactive (lifecycle)
node refuses to engage; an exception in a callback still runs the fail-safe exit; a node whose
parent dies (a launch killed) exits, the vehicle interface through its fail-safe exit."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState
from rosgraph_msgs.msg import Clock as ClockMsg
from std_srvs.srv import SetBool
from test_nodes_vehicle import STOP_BRAKE, VEHICLE, Inputs, actuation, drives, engage, start_rig, stop_reasons, vehicle

from sps_driving.core import topics
from sps_driving.ros import msgs

pytestmark = pytest.mark.ros


def test_a_stepped_ros_clock_neither_stalls_the_watchdog_nor_goes_unnoticed(tmp_path):
    offset = [0]

    def clock():
        return time.time_ns() + offset[0]

    graph, probe = start_rig(tmp_path, {**VEHICLE, "use_sim_time": True, "require_safety_monitor": False},
                             nodes=("vehicle_interface",))
    running = threading.Event()
    try:
        clock_pub = probe.publisher("/clock", ClockMsg, "sensor_out")
        inputs = Inputs(probe, clock)

        def publish_clock():  # at 100 Hz whatever the test loop does (service calls block it)
            while not running.wait(0.01):
                clock_pub.publish(ClockMsg(clock=msgs.to_ros(msgs.time_fields(clock()))))

        threading.Thread(target=publish_clock, daemon=True).start()
        tick = inputs.tick

        assert probe.spin_until(lambda: vehicle(probe)[1] != "", 10, every=tick)
        for step_s in (-3600, 3600):
            engage_deadline = time.monotonic() + 10
            while not drives(probe) and time.monotonic() < engage_deadline:
                probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=False))
                probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
                probe.spin_until(lambda: drives(probe), 1.0, every=tick)
            assert drives(probe), vehicle(probe)
            probe.received[topics.ACTUATION].clear()
            started = time.monotonic()
            offset[0] += step_s * 1_000_000_000
            assert probe.spin_until(lambda: "clock_jump" in stop_reasons(probe), 2, every=tick), vehicle(probe)
            probe.spin_until(lambda: False, 1.0 - (time.monotonic() - started), every=tick)
            beats = [t for t, _ in probe.received[topics.ACTUATION]]
            # A watchdog on the stepped clock would send nothing for the rest of the second (the
            # step is an hour). The bounds say "kept sending" with room for a loaded machine, where
            # this process itself can be off the CPU for a few hundred ms: half the 30 Hz rate, and
            # no silence longer than half the window.
            assert len(beats) >= 15, f"{len(beats)} commands in 1 s across a {step_s} s clock step"
            gaps = [b - a for a, b in zip([started, *beats], beats)]
            assert max(gaps) < 0.5, f"silent for {max(gaps):.2f} s across a {step_s} s clock step"
            assert actuation(probe)[-1][1] == pytest.approx(-STOP_BRAKE), (vehicle(probe), graph.log("vehicle_interface")[-3000:])
    finally:
        running.set()
        graph.stop()
        probe.close()


def test_sigterm_while_engaged_brakes_then_exits(tmp_path):
    graph, probe = start_rig(tmp_path, {**VEHICLE, "require_safety_monitor": False}, nodes=("vehicle_interface",))
    try:
        inputs = Inputs(probe)
        inputs.throttle = 0.2
        engage(probe, inputs)
        probe.received[topics.ACTUATION].clear()
        graph.processes["vehicle_interface"].send_signal(signal.SIGTERM)
        assert graph.returncode("vehicle_interface", wait_s=5) == 0
        probe.spin(0.3)
        after = actuation(probe)
        assert len(after) >= 15 and after[-1][1] == pytest.approx(-STOP_BRAKE)
        # No driving command after the first braking one.
        first_brake = next(i for i, (_, t) in enumerate(after) if t == pytest.approx(-STOP_BRAKE))
        assert all(t == pytest.approx(-STOP_BRAKE) for _, t in after[first_brake:])
        assert "exit commands" in graph.log("vehicle_interface")
    finally:
        graph.stop()
        probe.close()


def test_an_inactive_vehicle_interface_refuses_to_engage_until_activated(tmp_path):
    def transition(transition_id):
        request = ChangeState.Request()
        request.transition.id = transition_id
        answer = probe.call(ChangeState, "/vehicle_interface/change_state", request)
        assert answer is not None and answer.success

    graph, probe = start_rig(tmp_path, {**VEHICLE, "autostart": False, "require_safety_monitor": False},
                             nodes=("vehicle_interface",))
    try:
        inputs = Inputs(probe)
        transition(Transition.TRANSITION_CONFIGURE)
        probe.spin_until(lambda: False, 0.5, every=inputs.tick)  # inputs fresh: only the lifecycle state is missing
        answer = probe.call(SetBool, topics.ENGAGE_SERVICE, SetBool.Request(data=True))
        assert answer is not None and not answer.success and "not active" in answer.message
        transition(Transition.TRANSITION_ACTIVATE)
        engage(probe, inputs)
    finally:
        graph.stop()
        probe.close()


def test_an_exception_in_a_callback_runs_the_fail_safe_exit():
    script = textwrap.dedent(
        """
        import rclpy
        from rclpy.node import Node
        from sps_driving.ros.nodes.common import run

        class Crashing(Node):
            NODE_NAME = "crashing"

            def __init__(self):
                super().__init__(self.NODE_NAME)
                self.create_timer(0.05, self.boom)

            def boom(self):
                raise RuntimeError("boom")

            def fail_safe_exit(self, why):
                print("FAIL-SAFE EXIT:", why, flush=True)

        raise SystemExit(run(Crashing))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "FAIL-SAFE EXIT: exception RuntimeError" in done.stdout, (done.stdout, done.stderr)


NODE_UNDER_A_PARENT = textwrap.dedent(
    """
    import sys
    from rclpy.node import Node
    from sps_driving.ros.nodes.common import run

    class Watched(Node):
        NODE_NAME = "watched"

        def __init__(self):
            super().__init__(self.NODE_NAME)
            self.create_timer(0.05, lambda: open(sys.argv[1] + ".spinning", "w").close())

    class WatchedFailSafe(Watched):
        def fail_safe_exit(self, why):
            open(sys.argv[1] + ".exit", "w").write(why)

    raise SystemExit(run(WatchedFailSafe if sys.argv[2] == "fail-safe" else Watched))
    """
)


@pytest.mark.parametrize("kind", ["fail-safe", "plain"])
def test_a_node_whose_parent_dies_exits_the_vehicle_interface_through_its_fail_safe_exit(tmp_path, kind):
    """ros2 launch ended with SIGTERM or SIGKILL leaves its children running unless they ask Linux
    to stop them with it: the parent here starts the node and is then killed."""
    marker = tmp_path / "node"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]]); "
                               "print(child.pid, flush=True); time.sleep(600)", NODE_UNDER_A_PARENT, str(marker), kind],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not marker.with_suffix(".spinning").exists():
            assert time.monotonic() < deadline, "the node never spun"
            time.sleep(0.05)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{child}").exists() and b"Z" not in _state(child):
            assert time.monotonic() < deadline, "the node outlived its parent"
            time.sleep(0.05)
        if kind == "fail-safe":
            assert marker.with_suffix(".exit").read_text() == "SIGTERM"
    finally:
        parent.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b"Z"
