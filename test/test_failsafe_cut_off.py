"""A vehicle interface silent for longer than the DDS lease while its node is still in the graph
(a stall after which it can stay cut off for good, docs/vehicle.md): the failsafe keeps braking and
says so on /diagnostics and in its log with the operator's remedy. The failsafe is a real process;
the vehicle interface is a real node of this test that falls silent but stays."""

import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from ros_helpers import Probe
from sensor_msgs.msg import JointState

from sps_driving.core import topics
from sps_driving.ros import msgs
from sps_driving.ros.graph import Graph, wait_for_nodes

pacmod = pytest.importorskip("pacmod3_msgs.msg", reason="pacmod3_msgs is built by make setup (scripts/build_interfaces.sh)")


def test_a_vehicle_interface_silent_past_the_lease_but_still_in_the_graph_is_reported_cut_off_while_the_car_stays_braked(tmp_path):
    graph = Graph(["failsafe"], parameters={"failsafe": {"cut_off_after_s": 1.5, "silence_timeout_s": 0.5}}, log_dir=tmp_path)
    probe = Probe()
    vehicle_interface = Probe("vehicle_interface")
    heartbeat = vehicle_interface.publisher(topics.ACTUATION, JointState, "control")
    global_rpt = probe.publisher(topics.PACMOD_GLOBAL_RPT, pacmod.GlobalRpt, "sensor")
    probe.record(topics.DIAGNOSTICS, DiagnosticArray, "status")
    probe.record(topics.PACMOD_BRAKE_CMD, pacmod.SystemCmdFloat, "control")
    cut_off = lambda: probe.status("failsafe")[2].get("cut_off") == "True"  # noqa: E731

    def car_enabled():
        global_rpt.publish(pacmod.GlobalRpt(enabled=True))

    try:
        with graph:
            wait_for_nodes(probe.node, ["failsafe"], 30, graph)
            assert probe.spin_until(lambda: probe.status("failsafe")[0] >= 0, 20, every=car_enabled)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # the vehicle interface talks: the car is driven by it
                heartbeat.publish(JointState())
                car_enabled()
                vehicle_interface.spin(0.02)
                probe.spin(0.01)
            assert not cut_off() and not probe.messages(topics.PACMOD_BRAKE_CMD)
            # It falls silent and stays in the graph: the failsafe brakes at once, and says it is
            # cut off once the silence is longer than cut_off_after_s.
            assert probe.spin_until(lambda: bool(probe.messages(topics.PACMOD_BRAKE_CMD)), 5, every=car_enabled)
            assert not cut_off()
            assert probe.spin_until(cut_off, 10, every=lambda: (car_enabled(), vehicle_interface.spin(0.0)))
            level, message, _values = probe.status("failsafe")
            assert level == msgs.Level.ERROR and "cut off" in message and "stop the launch and start it again" in message
            braking = probe.messages(topics.PACMOD_BRAKE_CMD)[-1]
            assert braking.enable and braking.command > 0  # still braking: a held stop
            # Gone from the graph (a crash): no longer reported as cut off, still braking.
            vehicle_interface.close()
            vehicle_interface = None
            assert probe.spin_until(lambda: not cut_off(), 15, every=car_enabled)
            assert probe.messages(topics.PACMOD_BRAKE_CMD)[-1].command > 0
        assert "vehicle interface cut off" in (tmp_path / "failsafe.log").read_text()
    finally:
        if vehicle_interface is not None:
            vehicle_interface.close()
        probe.close()
