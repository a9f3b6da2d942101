"""What every node shares: parameter declaration from a table, the main loop, status publishing.

Each node module has a `PARAMETERS` table {name: default}; the node declares exactly these, so the
launch-file test can check that every parameter it sets exists.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node

from sps_driving import msgs


def declare(node: Node, parameters: dict) -> dict:
    """Declare every parameter of the table and return their values."""
    for name, default in parameters.items():
        node.declare_parameter(name, default)
    return {name: node.get_parameter(name).value for name in parameters}


def now_ns(node: Node) -> int:
    return node.get_clock().now().nanoseconds


class StageTimer:
    """Per-frame compute time on the shared timing topic, stamped with the frame's stamp, plus the
    node's counters, so the replay report can split latency into compute and graph overhead."""

    def __init__(self, node: Node, stage: str):
        from diagnostic_msgs.msg import DiagnosticArray

        from sps_driving import topics

        self.stage = stage
        self.publisher = node.create_publisher(DiagnosticArray, topics.STAGE_TIMING, msgs.qos("status"))

    def publish(self, stamp: int, started_s: float, counters: dict) -> None:
        compute_ms = (time.perf_counter() - started_s) * 1e3
        self.publisher.publish(msgs.diagnostics(stamp, self.stage, 0, "", {"compute_ms": f"{compute_ms:.3f}", **counters}))

    def dropped(self, stamp: int, reason: str, counters: dict) -> None:
        """A frame this stage will not pass on (level WARN, the reason as message)."""
        self.publisher.publish(msgs.diagnostics(stamp, self.stage, 1, f"dropped: {reason}", dict(counters)))


def run(node_class, args=None) -> int:
    """Init, spin until Ctrl-C or shutdown, clean up. A node that cannot start (bad parameter,
    missing checkpoint) prints one clear error and exits with status 1.

    A node with a `fail_safe_exit(why)` method (the vehicle interface) gets it called on every exit
    this process can catch, while its publishers still work: SIGINT, SIGTERM, SIGHUP (rclpy's own
    handlers, which would shut the context down first, are not installed) and an exception raised
    by a callback (then the exit status is 1)."""
    fail_safe = hasattr(node_class, "fail_safe_exit")
    if fail_safe:
        from rclpy.signals import SignalHandlerOptions

        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    else:
        rclpy.init(args=args)
    name = getattr(node_class, "NODE_NAME", node_class.__name__)
    node = None
    status = 0
    try:
        try:
            node = node_class()
        except (ValueError, FileNotFoundError, OSError) as exc:
            print(f"[{name}] cannot start: {exc}", file=sys.stderr, flush=True)
            return 1
        if fail_safe:
            status = _spin_fail_safe(node)
        else:
            rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return status


def _spin_fail_safe(node) -> int:
    from rclpy.executors import SingleThreadedExecutor

    received = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        while not received:
            executor.spin_once(timeout_sec=0.05)
    except Exception as exc:  # noqa: BLE001 - any failure must still stop the car
        node.get_logger().fatal(f"exception in a callback: {exc!r}")
        traceback.print_exc()
        _exit_safely(node, f"exception {type(exc).__name__}")
        return 1
    _exit_safely(node, received[0])
    return 0


def _exit_safely(node, why: str) -> None:
    try:
        node.fail_safe_exit(why)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
