"""Start the live graph's nodes as separate OS processes, wait for them, stop them.

The same node executables and parameters file as `ros2 launch` on the car, without needing the
`launch` package: `replay`, the tests, the simulator's graph evaluation and the demo share this.
Each node runs `python -m sps_driving.ros.nodes.<name> --ros-args --params-file <params>` with
optional remaps, where <params> is config/graph.yaml with the node's overrides written in; its
output goes to `<log_dir>/<name>.log`.
A graph keeps to this machine and a ROS domain of its own (`isolate_ros`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from sps_driving.core.resources import config_path
from sps_driving.ros.executables import NODES

PACKAGE = "sps_driving"
# The nodes that stop the car: never started again by a supervisor (sps_driving.ros.respawn); that the
# car drives again after one of them died is the safety driver's decision.
NEVER_RESPAWNED = ("vehicle_interface", "failsafe")
# The vehicle interface in a graph without the car (replays, the simulator, tests): standard
# messages, engaged as soon as the inputs are ready, no failsafe (it guards the PACMod driver), no
# speed report needed, and stops that do not latch (a replay reports whether the stack resumes).
VEHICLE_WITHOUT_CAR = {
    "backend": "topics", "auto_engage": True, "require_failsafe": False, "require_speed": False, "latch_stops": False,
}

# A tool's graph (`replay`, `demo`, `eval --graph`, `faults`) must never exchange messages with a car: not
# with one on the same network (discovery stays on this machine), nor with the car's own stack
# when it runs on the car's computer (a domain of its own). The domain is DOMAIN_VARIABLE when
# set; otherwise one of PRIVATE_DOMAINS picked by process id, so that two tools running at once
# keep apart too, and never the ROS_DOMAIN_ID of the shell the tool started from (on the car, the
# stack's). To watch a tool's graph: set DOMAIN_VARIABLE, then use that ROS_DOMAIN_ID with
# ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST on the same machine.
DOMAIN_VARIABLE = "SPS_DRIVING_ROS_DOMAIN_ID"
# The upper half of the ids valid on every OS with DDS's port mapping (0..101): 0 is every ROS 2
# default, and robots and teams take low numbers.
PRIVATE_DOMAINS = range(51, 102)
MAX_DOMAIN_ID = 232  # the largest valid on Linux
FAST_DDS = "rmw_fastrtps_cpp"  # the RMW whose participant profile (config/fastdds*.xml) the graph sets
# Settings that would reach DDS participants on other machines.
_REMOTE_DISCOVERY = ("ROS_STATIC_PEERS", "ROS_DISCOVERY_SERVER")


def default_params_file() -> Path:
    return config_path("graph.yaml")


def car_facts(params_file: Path | None = None) -> dict:
    """The facts of the car that several nodes share (the params file's `/**` section: the steering
    ratio, the stop brake), for tools that read recordings of it."""
    path = Path(params_file) if params_file else default_params_file()
    return dict((yaml.safe_load(path.read_text()) or {}).get("/**", {}).get("ros__parameters", {}))


def private_domain_candidates(environ: Mapping[str, str], pid: int) -> list[int]:
    """The domains a tool's graph may take, in the order it tries them: DOMAIN_VARIABLE alone when
    set, else PRIVATE_DOMAINS starting at one picked by `pid`, without the shell's ROS_DOMAIN_ID."""
    chosen = environ.get(DOMAIN_VARIABLE, "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) > MAX_DOMAIN_ID:
            raise ValueError(f"{DOMAIN_VARIABLE}={chosen!r}: expected a ROS domain id, an integer from 0 to {MAX_DOMAIN_ID}")
        return [int(chosen)]
    shell = environ.get("ROS_DOMAIN_ID", "").strip()
    candidates = [domain for domain in PRIVATE_DOMAINS if str(domain) != shell]
    start = pid % len(candidates)
    return candidates[start:] + candidates[:start]


def private_domain_id(environ: Mapping[str, str], pid: int) -> int:
    """The ROS domain of a tool's graph: DOMAIN_VARIABLE when set, else one picked by `pid`."""
    return private_domain_candidates(environ, pid)[0]


_claimed_domain = None  # (domain, the open lock file that holds it) of this process


def claim_domain(candidates: list[int]) -> int:
    """The first of `candidates` that no other tool or test run on this machine holds, held for
    the life of this process by a lock file in the temporary directory: runs started at once
    would otherwise share a domain when their process ids pick the same one, and hear each
    other's nodes. Falls back to the first candidate when every one is held."""
    import fcntl

    global _claimed_domain
    folder = Path(tempfile.gettempdir()) / "sps_driving_ros_domains"
    folder.mkdir(exist_ok=True)
    for domain in candidates:
        lock = open(folder / f"{domain}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _claimed_domain = (domain, lock)
        return domain
    return candidates[0]


def isolate_ros() -> int:
    """Keep this process's ROS 2 graph to itself (see DOMAIN_VARIABLE) and return its domain id.

    Sets the environment that this process's rclpy contexts read at init and its node processes
    inherit, so call it before rclpy.init; later calls keep the first call's domain. Discovery
    and data stay on this machine through config/fastdds_loopback.xml: UDP on 127.0.0.1 only, with
    no shared memory, whose transport left restarted nodes deaf (docs/vehicle.md). That profile
    holds only where rmw_fastrtps does not impose its own transports: ROS_AUTOMATIC_DISCOVERY_RANGE
    is SYSTEM_DEFAULT (Iron on) and ROS_LOCALHOST_ONLY 0 (Humble). Under another RMW the profile
    does not apply, and the localhost discovery range keeps the graph here instead."""
    from sps_driving.core.resources import config_path

    candidates = private_domain_candidates(os.environ, os.getpid())
    domain = candidates[0] if os.environ.get(DOMAIN_VARIABLE, "").strip() else claim_domain(candidates)
    os.environ.update({DOMAIN_VARIABLE: str(domain), "ROS_DOMAIN_ID": str(domain)})
    if os.environ.get("RMW_IMPLEMENTATION", FAST_DDS) == FAST_DDS:
        os.environ.update({"FASTDDS_DEFAULT_PROFILES_FILE": str(config_path("fastdds_loopback.xml")),
                           "ROS_AUTOMATIC_DISCOVERY_RANGE": "SYSTEM_DEFAULT", "ROS_LOCALHOST_ONLY": "0"})
    else:
        os.environ.update({"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_LOCALHOST_ONLY": "1"})
    for name in _REMOTE_DISCOVERY:
        os.environ.pop(name, None)
    return domain


class Graph:
    """A set of node processes. Use as a context manager so they are always stopped."""

    def __init__(
        self,
        nodes,
        parameters: dict | None = None,
        remaps: dict | None = None,
        params_file: str | Path | None = None,
        log_dir: str | Path | None = None,
        respawn=(),
    ):
        unknown = (set(nodes) | set(respawn)) - set(NODES)
        if unknown:
            raise ValueError(f"unknown nodes {sorted(unknown)}; expected some of {NODES}")
        if set(respawn) & set(NEVER_RESPAWNED):
            raise ValueError(f"{sorted(set(respawn) & set(NEVER_RESPAWNED))} stop the car and are never started again by a supervisor")
        self.nodes = tuple(nodes)
        self.respawn = frozenset(respawn)  # nodes run under sps_driving.ros.respawn, as on the car
        self.parameters = parameters or {}  # {node: {name: value}} over the params file
        self.remaps = remaps or {}  # {from: to}, applied to every node
        self.params_file = Path(params_file) if params_file else default_params_file()
        if not self.params_file.is_file():
            raise FileNotFoundError(f"no parameters file at {self.params_file}")
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="sps_graph_")
        self.log_dir = Path(log_dir or self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}

    def command(self, name: str) -> list[str]:
        params_file = self.params_file
        overrides = self.parameters.get(name)
        if overrides:
            # One file, not the overrides in a second one: across files rcl keeps a value of
            # another type than the first file's only for some type pairs (a string for a number
            # is dropped), so a wrong-typed override would pass unseen.
            params = yaml.safe_load(self.params_file.read_text()) or {}
            params.setdefault(name, {}).setdefault("ros__parameters", {}).update(overrides)
            params_file = self.log_dir / f"{name}.params.yaml"
            params_file.write_text(yaml.safe_dump(params))
        cmd = [sys.executable, "-m", f"{PACKAGE}.ros.nodes.{name}", "--ros-args", "--params-file", str(params_file)]
        for source, target in self.remaps.items():
            cmd += ["-r", f"{source}:={target}"]
        if name in self.respawn:
            cmd = [sys.executable, "-m", f"{PACKAGE}.ros.respawn", "--name", name, "--", *cmd]
        return cmd

    def start(self, name: str | None = None) -> Graph:
        """Start one node (again, e.g. after a kill) or all of them, in this process's private
        ROS domain on this machine (`isolate_ros`)."""
        isolate_ros()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RCUTILS_COLORIZED_OUTPUT": "0"}
        for node in [name] if name else self.nodes:
            log = open(self.log_dir / f"{node}.log", "ab")
            self.processes[node] = subprocess.Popen(
                self.command(node), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            log.close()
        return self

    def alive(self, name: str) -> bool:
        return name in self.processes and self.processes[name].poll() is None

    def returncode(self, name: str, wait_s: float = 0.0) -> int | None:
        """The node's exit status, waiting up to `wait_s` for it to exit; None while it runs."""
        try:
            return self.processes[name].wait(timeout=wait_s) if wait_s > 0 else self.processes[name].poll()
        except subprocess.TimeoutExpired:
            return None

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def node_pid(self, name: str) -> int | None:
        """The process id of the node itself (under a supervisor: its child); None when not running."""
        process = self.processes.get(name)
        if process is None or process.poll() is not None:
            return None
        if name not in self.respawn:
            return process.pid
        try:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None  # none while the supervisor waits to start it again

    def signal_node(self, name: str, sig: int) -> None:
        """Send `sig` to the node process (not to its supervisor, which starts it again if it dies)."""
        pid = self.node_pid(name)
        if pid is None:
            raise ProcessLookupError(f"node {name} is not running")
        os.kill(pid, sig)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the node and, for a node without a supervisor, wait for it to exit."""
        if name in self.respawn:
            self.signal_node(name, sig)
            return
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(sig)
            process.wait(timeout=10)

    def stop(self, nodes=None, timeout_s: float = 5.0) -> dict:
        """Ctrl-C every node (or those named), then kill what is left; returns {node: exit status}."""
        chosen = [self.processes[n] for n in nodes if n in self.processes] if nodes is not None else list(self.processes.values())
        for process in chosen:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for process in chosen:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return {name: p.returncode for name, p in self.processes.items()}

    def __enter__(self) -> Graph:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


def wait_for_nodes(observer, names, timeout_s: float, graph: Graph | None = None) -> None:
    """Block until every node in `names` is visible on the ROS graph from `observer` (an rclpy
    Node). Raises TimeoutError naming the missing ones, or RuntimeError with the log of a node
    that exited while starting."""
    wanted = set(names)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = wanted - set(observer.get_node_names())
        if not missing:
            return
        if graph is not None:
            for name in missing:
                if name in graph.processes and not graph.alive(name):
                    raise RuntimeError(f"node {name} exited with {graph.returncode(name)}:\n{graph.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nodes not up after {timeout_s} s: {sorted(missing)}")
        time.sleep(0.1)


def wait_for_subscribers(publisher, count: int, timeout_s: float) -> None:
    """Block until `publisher` is matched by at least `count` subscriptions."""
    deadline = time.monotonic() + timeout_s
    while publisher.get_subscription_count() < count:
        if time.monotonic() > deadline:
            matched = publisher.get_subscription_count()
            raise TimeoutError(f"{publisher.topic_name}: {matched} of {count} subscribers after {timeout_s} s")
        time.sleep(0.05)


def wait_for_topics(observer, subscribers: dict, timeout_s: float, graph: Graph | None = None) -> None:
    """Block until each topic has at least the given number of subscriptions on the ROS graph.
    A node is visible before it has loaded its model; its subscriptions come after, so this is
    the readiness check. Raises like `wait_for_nodes`."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = {t: n for t, n in subscribers.items() if observer.count_subscribers(t) < n}
        if not missing:
            return
        if graph is not None:
            for name in graph.nodes:
                if name in graph.processes and not graph.alive(name):
                    raise RuntimeError(f"node {name} exited with {graph.returncode(name)}:\n{graph.log(name)[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics without their subscribers after {timeout_s} s: {missing}")
        time.sleep(0.1)
