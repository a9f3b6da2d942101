"""Ctrl-C reaches a launch's processes twice: from the terminal to the whole process group, and
from launch, which passes a SIGINT on to every process it runs (launch/sps_driving.launch.py). A
node must end its teardown and exit 0 however soon and however often the later ones come."""

import signal
import time

import pytest
from ros_helpers import Probe

from sps_driving.ros.graph import Graph, wait_for_nodes


@pytest.mark.parametrize("gap_s", [0.0, 0.0, 0.0, 0.001, 0.05])
def test_more_sigints_do_not_cut_a_nodes_teardown_short(tmp_path, gap_s):
    graph = Graph(["failsafe"], log_dir=tmp_path)
    probe = Probe()
    try:
        with graph:
            wait_for_nodes(probe.node, ["failsafe"], 30, graph)
            process = graph.processes["failsafe"]
            for _ in range(20):
                process.send_signal(signal.SIGINT)
                time.sleep(gap_s)
                if process.poll() is not None:
                    break
            assert process.wait(timeout=20) == 0, graph.log("failsafe")
        assert "Traceback" not in graph.log("failsafe")
        assert "KeyboardInterrupt" not in graph.log("failsafe")
    finally:
        probe.close()
