"""Ctrl-C reaches a launch's processes twice: from the terminal to the whole process group, and
from launch, which passes a SIGINT on to every process it runs (launch/sps_driving.launch.py). A
node must end its teardown and exit 0 however soon the second one comes."""

import signal
import time

import pytest
from ros_helpers import Probe

from sps_driving.ros.graph import Graph, wait_for_nodes


@pytest.mark.parametrize("gap_s", [0.0, 0.05])
def test_a_second_sigint_does_not_cut_a_nodes_teardown_short(tmp_path, gap_s):
    graph = Graph(["failsafe"], log_dir=tmp_path)
    probe = Probe()
    try:
        with graph:
            wait_for_nodes(probe.node, ["failsafe"], 30, graph)
            process = graph.processes["failsafe"]
            process.send_signal(signal.SIGINT)
            time.sleep(gap_s)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=20) == 0, graph.log("failsafe")
        assert "Traceback" not in graph.log("failsafe")
    finally:
        probe.close()
