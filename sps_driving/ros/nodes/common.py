"""What every node shares: parameter declaration from a table, the main loop, status publishing.

Each node module has a `PARAMETERS` table {name: Param(...)}; a plain default stands for a Param
that says nothing more. The node declares exactly these, so the launch-file test can check that
every parameter it sets exists and is allowed. Nodes read their parameters once, at start: every
parameter is declared read-only, so `ros2 param set` is refused with a reason, never accepted and
then ignored.
"""

from __future__ import annotations

import array
import math
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import rclpy
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from rclpy.parameter import Parameter

from sps_driving.ros import msgs
from sps_driving.ros.process import CANNOT_START, apply_scheduling, stop_with_parent

_TYPE_WORDS = {
    Parameter.Type.BOOL: "a boolean (true or false)",
    Parameter.Type.INTEGER: "an integer",
    Parameter.Type.DOUBLE: "a number",
    Parameter.Type.STRING: "a string",
    Parameter.Type.BYTE_ARRAY: "a list of bytes",
    Parameter.Type.BOOL_ARRAY: "a list of booleans",
    Parameter.Type.INTEGER_ARRAY: "a list of integers",
    Parameter.Type.DOUBLE_ARRAY: "a list of numbers",
    Parameter.Type.STRING_ARRAY: "a list of strings",
}
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Param:
    """A node parameter: its default (whose type is the parameter's type), what it is, its unit,
    and the values it may take: `min`/`max` inclusive, `above`/`below` exclusive bounds (numbers),
    `choices` (the only values allowed)."""

    default: Any
    description: str = ""
    unit: str = ""
    min: float | None = None
    max: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple = ()

    def __post_init__(self):
        numeric = self.type in (Parameter.Type.INTEGER, Parameter.Type.DOUBLE)
        bounds = (self.min, self.max, self.above, self.below)
        if any(b is not None for b in bounds) and not numeric:
            raise TypeError(f"bounds on a parameter of type {self.type.name}")
        if self.type == Parameter.Type.INTEGER and (self.above is not None or self.below is not None):
            raise TypeError("an integer parameter takes min and max, not above and below")
        if (self.min is not None and self.above is not None) or (self.max is not None and self.below is not None):
            raise TypeError("one lower and one upper bound at most")
        self.convert(self.default)  # the default itself must be allowed

    @property
    def type(self) -> Parameter.Type:
        return Parameter.Type.from_parameter_value(self.default)

    def allowed(self) -> str:
        """The values it takes, in words: "a finite number > 0 and <= 1", "one of 'sps', 'spps'"."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        bounds = [
            f"{sign} {bound:g}"
            for sign, bound in ((">", self.above), (">=", self.min), ("<", self.below), ("<=", self.max))
            if bound is not None
        ]
        what = "a finite number" if self.type == Parameter.Type.DOUBLE else _TYPE_WORDS[self.type]
        return " and ".join([what + (" " + bounds[0] if bounds else ""), *bounds[1:]])

    def convert(self, value):
        """`value` as this parameter's type, or ValueError saying what is allowed. An integer for a
        number is that number (1 -> 1.0) and a number for a string its text (0 -> "0"): a launch
        argument or YAML value like `rate:=1` or `source:=0` arrives typed that way."""
        given = Parameter.Type.from_parameter_value(value)
        converted = value
        if given != self.type:
            if self.type == Parameter.Type.DOUBLE and given == Parameter.Type.INTEGER:
                converted = float(value)
            elif self.type == Parameter.Type.STRING and given in (Parameter.Type.INTEGER, Parameter.Type.DOUBLE):
                converted = str(value)
            else:
                raise ValueError(f"{_shown(value)} ({_TYPE_WORDS.get(given, given.name)}); allowed: {self.allowed()}")
        if (
            (self.choices and converted not in self.choices)
            or (self.type == Parameter.Type.DOUBLE and not math.isfinite(converted))
            or (self.min is not None and not converted >= self.min)
            or (self.max is not None and not converted <= self.max)
            or (self.above is not None and not converted > self.above)
            or (self.below is not None and not converted < self.below)
        ):
            raise ValueError(f"{_shown(value)}; allowed: {self.allowed()}")
        return converted

    def descriptor(self, name: str) -> ParameterDescriptor:
        """What `ros2 param describe` shows: description with unit, type, constraints, range, read-only."""
        descriptor = ParameterDescriptor(
            name=name,
            type=self.type.value,
            description=f"{self.description} [{self.unit}]" if self.unit else self.description,
            additional_constraints=self.allowed(),
            read_only=True,
        )
        low = self.min if self.min is not None else self.above
        high = self.max if self.max is not None else self.below
        if low is not None or high is not None:
            if self.type == Parameter.Type.INTEGER:
                descriptor.integer_range = [
                    IntegerRange(from_value=_INT64[0] if low is None else low, to_value=_INT64[1] if high is None else high)
                ]
            else:  # a descriptor's range is inclusive: `above`/`below` are in additional_constraints
                descriptor.floating_point_range = [
                    FloatingPointRange(from_value=-math.inf if low is None else float(low),
                                       to_value=math.inf if high is None else float(high))
                ]
        return descriptor


def _shown(value) -> str:
    return repr(list(value) if isinstance(value, array.array) else value)


def specs(parameters: dict) -> dict[str, Param]:
    """A node's PARAMETERS table with every plain default as a Param."""
    return {name: spec if isinstance(spec, Param) else Param(spec) for name, spec in parameters.items()}


def declare(node: Node, parameters: dict) -> dict:
    """Declare every parameter of the table, read-only with its descriptor, and return their
    values as the table's types. A value that is not allowed is a ValueError of one line naming
    the node, the parameter, the value and what is allowed (`run` prints it and exits with CANNOT_START)."""
    values = {}
    for name, spec in specs(parameters).items():
        # Declared untyped first: a value of another type is then ours to convert or refuse
        # (declared typed, rclpy would raise its own exception); then the real descriptor,
        # with the converted value.
        node.declare_parameter(name, spec.default, ParameterDescriptor(dynamic_typing=True))
        try:
            value = spec.convert(node.get_parameter(name).value)
        except ValueError as exc:
            raise ValueError(f"parameter {name} of {node.get_fully_qualified_name()} is {exc}") from None
        node.set_descriptor(name, spec.descriptor(name), Parameter(name, value=value).get_parameter_value())
        values[name] = value
    return values


# Where and how the nodes that stop the car run (the vehicle interface and the failsafe): under CPU
# load their watchdogs must still run on time (docs/vehicle.md, "Under CPU load").
SCHEDULING_PARAMETERS = {
    "cpu_affinity": Param("", "CPUs every thread of this node runs on, as '3', '2,3' or '0-1'; '' = any. "
                          "Keep them off the cores the extractor and the policy use"),
    "realtime_priority": Param(0, "SCHED_FIFO priority of every thread, 1 to 99; 0 = normal scheduling. Needs "
                               "CAP_SYS_NICE or a real-time priority limit (ulimit -r)", min=0, max=99),
    "nice": Param(0, "nice value under normal scheduling, -20 (most CPU) to 19; below 0 needs CAP_SYS_NICE or a "
                  "nice limit (ulimit -e)", min=-20, max=19),
}


def schedule(node: Node, p: dict) -> None:
    """Apply SCHEDULING_PARAMETERS to every thread of this process; a node that cannot have them
    does not start (ValueError, saying what it needs)."""
    applied = apply_scheduling(p["cpu_affinity"], p["realtime_priority"], p["nice"])
    node.get_logger().info(f"scheduling: {applied}")


def now_ns(node: Node) -> int:
    return node.get_clock().now().nanoseconds


class StageTimer:
    """Per-frame compute time on the shared timing topic, stamped with the frame's stamp, plus the
    node's counters, so the replay report can split latency into compute and graph overhead. The
    compute ends when the stage's output is ready: publishing it is transport, in the overhead (on
    few cores a publish that wakes the next stages can take several ms)."""

    def __init__(self, node: Node, stage: str):
        from diagnostic_msgs.msg import DiagnosticArray

        from sps_driving.core import topics

        self.stage = stage
        self.publisher = node.create_publisher(DiagnosticArray, topics.STAGE_TIMING, msgs.qos("status"))

    def publish(self, stamp: int, started_s: float, ready_s: float, counters: dict) -> None:
        """The frame's compute time, from `started_s` to its output `ready_s` (time.perf_counter)."""
        compute_ms = (ready_s - started_s) * 1e3
        self.publisher.publish(msgs.stage_timing_message(stamp, self.stage, compute_ms, counters))

    def dropped(self, stamp: int, reason: str, counters: dict) -> None:
        """A frame this stage will not pass on (msgs.stage_drop_message)."""
        self.publisher.publish(msgs.stage_drop_message(stamp, self.stage, reason, counters))


def quiet_thread_pools() -> None:
    """The thread pools of a node process, which shares a few cores with the extractor's threads:
    torch's OpenMP threads sleep when idle instead of busy-waiting for 100s of ms after each op
    (measured: 20 ms of CPU per frame for 2 ms of work; read when torch loads, which no node module
    does on import), and numpy's OpenBLAS runs on one thread, whose idle workers would spin after
    each product (measured: the extractor node at 1.57x its standalone time beside the policy
    node's OOD score, 1.13x with one thread; docs/results/bench_cpu.md)."""
    from threadpoolctl import ThreadpoolController

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ThreadpoolController().select(internal_api="openblas").limit(limits=1)


class _InterruptWhileStarting:
    """Python's SIGINT handler in a node process: it raises KeyboardInterrupt only while the node is
    being built, where nothing spins yet. Later, rclpy's handler (which rclpy.init installs in front
    of this one) shuts the context down and that ends the spin. Ctrl-C reaches every process of a
    launch's group and launch passes it on as well, so a second SIGINT can land anywhere in the
    teardown, even as `finally` begins, and raising there would cut the teardown short."""

    def __init__(self):
        self.starting = True
        signal.signal(signal.SIGINT, self)

    def __call__(self, _signum, _frame):
        if self.starting:
            self.starting = False
            raise KeyboardInterrupt


def run(node_class, args=None) -> int:
    """Init, spin until Ctrl-C or shutdown, clean up. A node that cannot start (bad parameter,
    missing checkpoint) prints one clear error and exits with status CANNOT_START (78).

    A node with a `fail_safe_exit(why)` method (the vehicle interface) gets it called on every exit
    this process can catch, while its publishers still work: SIGINT, SIGTERM, SIGHUP (rclpy's own
    handlers, which would shut the context down first, are not installed) and an exception raised
    by a callback (then the exit status is 1). Every node also gets SIGTERM when the process that
    started it dies (`stop_with_parent`)."""
    quiet_thread_pools()
    stop_with_parent()
    fail_safe = hasattr(node_class, "fail_safe_exit")
    name = getattr(node_class, "NODE_NAME", node_class.__name__)
    interrupt = _InterruptWhileStarting()
    node = None
    status = 0
    try:
        if fail_safe:
            from rclpy.signals import SignalHandlerOptions

            rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
        else:
            rclpy.init(args=args)
        try:
            node = node_class()
        except (ValueError, FileNotFoundError, OSError) as exc:
            print(f"[{name}] cannot start: {exc}", file=sys.stderr, flush=True)
            return CANNOT_START
        interrupt.starting = False
        if fail_safe:
            status = _spin_fail_safe(node)
        else:
            _spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        interrupt.starting = False
        # rclpy's handler goes too: a second shutdown of the context must not race the teardown's.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return status


def _spin(node) -> None:
    try:
        rclpy.spin(node)
    except Exception:
        # SIGINT or SIGTERM shuts the context down under a spinning executor, which may then fail
        # to build its wait set: that is the shutdown the signal asked for, not a crash.
        if rclpy.ok():
            raise


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
