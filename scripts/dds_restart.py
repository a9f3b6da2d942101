#!/usr/bin/env python3
"""Does a restarted reader of large messages hear its writer again? A minimal two-process test.

A writer process publishes sensor_msgs/Image (reliable, keep last) at a fixed rate; a reader
process subscribes and is killed with SIGKILL (or stopped with SIGSTOP and continued) again and
again; each successor starts `delay` s after the kill (uniform in --delay). A restart is deaf when
the successor gets no message within --deaf-after s of its subscription being created. A second,
stable reader can stay alive beside it (--stable-reader) to see whether the fault of one reader
reaches the others. Each setting names the DDS transport and QoS that every process of the run
uses (`setting` below). The reader can work for a while between creating its node and its
subscription (--startup-s), as the extractor loads its model, and other nodes can share the domain
(--peers), as in the graph: without both the failure was rarely seen.

    .venv/bin/python scripts/dds_restart.py --settings shm_udp udp_loopback shm_udp_loopback \
        --runs 5 --restarts 20 --peers 6 --startup-s 8 --stable-reader --json out.json

Every run is a fresh writer in a ROS domain of its own, the settings interleaved run by run; each
process's output goes to --log-dir. docs/vehicle.md, "Restarting a node", has what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROFILE = """<?xml version="1.0" encoding="UTF-8"?>
<dds xmlns="http://www.eprosima.com"><profiles>
  <transport_descriptors>{descriptors}</transport_descriptors>
  <participant profile_name="p" is_default_profile="true"><rtps>
    {transports}
    <builtin>{locators}
      <discovery_config>
        <leaseDuration><sec>{lease_s}</sec></leaseDuration>
        <leaseAnnouncement><nanosec>{announce_ns}</nanosec></leaseAnnouncement>
      </discovery_config>
    </builtin>
  </rtps></participant>
</profiles></dds>
"""
UDP_LOOPBACK = """<transport_descriptor><transport_id>udp_loopback</transport_id><type>UDPv4</type>
      <interfaceWhiteList><address>127.0.0.1</address></interfaceWhiteList><maxInitialPeersRange>32</maxInitialPeersRange>
      <sendBufferSize>8388608</sendBufferSize><receiveBufferSize>8388608</receiveBufferSize></transport_descriptor>"""
SHM = """<transport_descriptor><transport_id>shm</transport_id><type>SHM</type>{options}</transport_descriptor>"""
LOOPBACK_LOCATORS = """
      <metatrafficUnicastLocatorList><locator><udpv4><address>127.0.0.1</address></udpv4></locator></metatrafficUnicastLocatorList>
      <initialPeersList><locator><udpv4><address>127.0.0.1</address></udpv4></locator></initialPeersList>"""


def setting(name: str, tmp: Path) -> tuple[dict, dict]:
    """(environment, QoS of the image topic) of every process in a run of setting `name`:
    - shm_udp: the graph as it runs under ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, where
      rmw_fastrtps always adds its own shared-memory and UDP transports (no environment variable or
      profile takes shared memory away there), lease 2 s;
    - udp_loopback: UDP only, on 127.0.0.1 (discovery through unicast to localhost, no multicast),
      8 MB socket buffers, lease 2 s; the range is SYSTEM_DEFAULT so that the profile's transports hold;
    - shm_udp_loopback: the same with Fast DDS's shared-memory transport added: tells shared memory
      from the change of range;
    - shm_tolerant: as shm_udp_loopback with a 16 MB segment and a 5 s listener health check;
    - best_effort, depth1, depth10: shm_udp with the image topic's QoS changed;
    - lease20: shm_udp without a profile (Fast DDS's 20 s lease, announcements every 3 s)."""
    def profile(descriptors="", transport_ids=(), loopback=False):
        transports = ("<useBuiltinTransports>false</useBuiltinTransports><userTransports>"
                      + "".join(f"<transport_id>{t}</transport_id>" for t in transport_ids) + "</userTransports>") if transport_ids else ""
        path = tmp / f"{name}.xml"
        path.write_text(PROFILE.format(descriptors=descriptors, transports=transports, locators=LOOPBACK_LOCATORS if loopback else "",
                                       lease_s=2, announce_ns=500_000_000))
        return {"FASTDDS_DEFAULT_PROFILES_FILE": str(path)}

    localhost = {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    loopback = {"ROS_AUTOMATIC_DISCOVERY_RANGE": "SYSTEM_DEFAULT"}
    qos = {"reliability": "reliable", "depth": 3}  # the graph's image topic (msgs.QOS_DEPTHS)
    if name == "shm_udp":
        return {**localhost, **profile()}, qos
    if name == "udp_loopback":
        return {**loopback, **profile(UDP_LOOPBACK, ["udp_loopback"], loopback=True)}, qos
    if name == "shm_udp_loopback":
        return {**loopback, **profile(SHM.format(options="") + UDP_LOOPBACK, ["shm", "udp_loopback"], loopback=True)}, qos
    if name == "shm_tolerant":
        options = "<segment_size>16777216</segment_size><healthy_check_timeout_ms>5000</healthy_check_timeout_ms>"
        return {**loopback, **profile(SHM.format(options=options) + UDP_LOOPBACK, ["shm", "udp_loopback"], loopback=True)}, qos
    if name == "best_effort":
        return {**localhost, **profile()}, {**qos, "reliability": "best_effort"}
    if name in ("depth1", "depth10"):
        return {**localhost, **profile()}, {**qos, "depth": int(name.removeprefix("depth"))}
    if name == "lease20":
        return localhost, qos
    raise ValueError(f"unknown setting {name!r}")


SETTINGS = ("shm_udp", "udp_loopback", "shm_udp_loopback", "shm_tolerant", "best_effort", "depth1", "depth10", "lease20")


# ------------------------------------------------------------------ the two roles


def qos_profile(qos: dict):
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

    reliability = ReliabilityPolicy.BEST_EFFORT if qos["reliability"] == "best_effort" else ReliabilityPolicy.RELIABLE
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=qos["depth"], reliability=reliability)


def writer(qos: dict, size: int, rate_hz: float) -> None:
    import rclpy
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node("restart_writer")
    publisher = node.create_publisher(Image, "/camera/image_raw", qos_profile(qos))
    width = 448
    message = Image(height=size // (3 * width), width=width, encoding="rgb8", step=3 * width)
    message.data = bytes(message.height * message.step)
    count = 0

    def tick():
        nonlocal count
        now = time.time_ns()
        message.header.stamp.sec, message.header.stamp.nanosec = divmod(now, 1_000_000_000)
        message.header.frame_id = str(count)
        publisher.publish(message)
        count += 1

    node.create_timer(1.0 / rate_hz, tick)
    print("ready", flush=True)
    rclpy.spin(node)


def reader(qos: dict, work_ms: float, startup_s: float, idle: bool) -> None:
    import rclpy
    from sensor_msgs.msg import Image

    rclpy.init()
    node = rclpy.create_node("restart_reader")
    busy_until = time.perf_counter() + startup_s  # a node loading its model before it subscribes
    if idle:
        time.sleep(startup_s)
    while time.perf_counter() < busy_until:
        pass
    start = time.monotonic()
    received = 0

    def on_image(msg):
        nonlocal received
        received += 1
        busy_until = time.perf_counter() + work_ms / 1000  # a node's own work on each message
        while time.perf_counter() < busy_until:
            pass
        if received == 1:
            print(f"first {time.monotonic() - start:.3f} {len(msg.data)}", flush=True)

    node.create_subscription(Image, "/camera/image_raw", on_image, qos_profile(qos))
    print("ready", flush=True)

    def report():
        print(f"count {received}", flush=True)

    node.create_timer(0.5, report)
    rclpy.spin(node)


def peer(index: int) -> None:
    """Another node of the graph: a small status message out and in at 10 Hz."""
    import rclpy
    from std_msgs.msg import String

    rclpy.init()
    node = rclpy.create_node(f"restart_peer_{index}")
    publisher = node.create_publisher(String, "/peer_status", 10)
    node.create_subscription(String, "/peer_status", lambda _msg: None, 10)
    node.create_timer(0.1, lambda: publisher.publish(String(data=str(index))))
    print("ready", flush=True)
    rclpy.spin(node)


# ------------------------------------------------------------------ the runner


class Process:
    """A role in a child process whose stdout lines are read by a thread."""

    def __init__(self, role: str, env: dict, qos: dict, args: argparse.Namespace, log: Path, index: int = 0):
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "a")
        command = [sys.executable, __file__, "--role", role, "--qos", json.dumps(qos), "--size", str(args.size),
                   "--rate", str(args.rate), "--work-ms", str(args.work_ms),
                   "--startup-s", str(args.startup_s), "--index", str(index)] + (["--startup-idle"] if args.startup_idle else [])
        self.popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append((time.monotonic(), line.strip()))
            self.log.write(line)

    def first(self, word: str, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if line.startswith(word):
                    return t
            if self.popen.poll() is not None:
                return None
            time.sleep(0.02)
        return None

    def count(self) -> int:
        counts = [int(line.split()[1]) for _, line in list(self.lines) if line.startswith("count ")]
        return counts[-1] if counts else 0

    def stop(self, sig=signal.SIGKILL):
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.popen.wait()
        if self.popen.poll() is not None:
            self.log.close()


def unlinked_ports(pid: int) -> list[str]:
    """Shared-memory ports the process still has mapped although their name was unlinked (re-made
    by another process): what it writes there, nobody reads."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-2] for line in maps.splitlines() if "fastdds_port" in line and line.endswith("(deleted)")})


def run_once(name: str, run: int, args: argparse.Namespace, rng: random.Random, tmp: Path) -> dict:
    extra, qos = setting(name, tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTDDS_") and k != "ROS_LOCALHOST_ONLY"}
    env.update(extra)
    env.update({"ROS_DOMAIN_ID": str(args.first_domain + run % 50), "PYTHONUNBUFFERED": "1"})
    logs = args.log_dir / name / f"run{run:03d}"
    logs.mkdir(parents=True, exist_ok=True)
    writer_process = Process("writer", env, qos, args, logs / "writer.log")
    stable = Process("reader", env, qos, args, logs / "stable.log") if args.stable_reader else None
    peers = [Process("peer", env, qos, args, logs / f"peer{k}.log", index=k) for k in range(args.peers)]
    restarts = []
    try:
        writer_process.first("ready", 30)
        current = Process("reader", env, qos, args, logs / "reader_000.log")
        current.first("first", args.deaf_after + 10)
        for i in range(args.restarts):
            time.sleep(args.settle)
            fault_s = time.monotonic()
            delay = rng.uniform(*args.delay)
            if args.fault == "kill":
                current.stop(signal.SIGKILL)
                time.sleep(max(0.0, fault_s + delay - time.monotonic()))
                current = Process("reader", env, qos, args, logs / f"reader_{i + 1:03d}.log")
                ready = current.first("ready", 30)
            else:  # sigstop: the same reader (sigstop_writer: the writer) stopped for `delay` s, then continued
                count_before = current.count()
                paused = writer_process if args.fault == "sigstop_writer" else current
                paused.stop(signal.SIGSTOP)
                time.sleep(delay)
                paused.stop(signal.SIGCONT)
                ready = time.monotonic()
            if args.fault == "kill":
                first = current.first("first", args.deaf_after)
                heard = first is not None
                latency = None if first is None else round(first - ready, 3)
            else:
                deadline = time.monotonic() + args.deaf_after
                while time.monotonic() < deadline and current.count() <= count_before + 2:
                    time.sleep(0.05)
                heard = current.count() > count_before + 2
                latency = None
            stable_count = stable.count() if stable else None
            restarts.append({"delay_s": round(delay, 3), "heard": heard, "first_message_s": latency,
                             "stable_reader_count": stable_count,
                             "writer_unlinked_ports": unlinked_ports(writer_process.popen.pid)})
            print(f"{name} run {run} restart {i}: delay {delay:.2f} s -> {'heard' if heard else 'DEAF'}"
                  + (f" after {latency:.2f} s" if latency is not None else "")
                  + f"; writer maps unlinked ports {restarts[-1]['writer_unlinked_ports']}", flush=True)
        if stable:  # did the stable reader keep hearing through every fault of its neighbour?
            before = stable.count()
            time.sleep(2.0)
            stable_alive = stable.count() > before
        else:
            stable_alive = None
    finally:
        current.stop(signal.SIGCONT)
        current.stop(signal.SIGKILL)
        if stable:
            stable.stop(signal.SIGKILL)
        for process in peers:
            process.stop(signal.SIGKILL)
        writer_process.stop(signal.SIGKILL)
    return {"setting": name, "run": run, "restarts": restarts, "stable_reader_heard_at_end": stable_alive}


def summarize(rows: list[dict]) -> dict:
    summary = {}
    for row in rows:
        s = summary.setdefault(row["setting"], {"runs": 0, "restarts": 0, "deaf": 0, "runs_with_deaf": 0,
                                                "deaf_by_delay": {}, "stable_reader_deaf_runs": 0})
        s["runs"] += 1
        deaf = [r for r in row["restarts"] if not r["heard"]]
        s["restarts"] += len(row["restarts"])
        s["deaf"] += len(deaf)
        s["runs_with_deaf"] += bool(deaf)
        for r in deaf:
            bucket = f"{int(r['delay_s'])}-{int(r['delay_s']) + 1} s"
            s["deaf_by_delay"][bucket] = s["deaf_by_delay"].get(bucket, 0) + 1
        s["stable_reader_deaf_runs"] += row["stable_reader_heard_at_end"] is False
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("writer", "reader", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--qos", default='{"reliability": "reliable", "depth": 1}', help=argparse.SUPPRESS)
    parser.add_argument("--settings", nargs="+", default=["shm_udp"], choices=SETTINGS)
    parser.add_argument("--runs", type=int, default=2, help="fresh writers per setting")
    parser.add_argument("--restarts", type=int, default=10, help="reader faults per run")
    parser.add_argument("--fault", choices=("kill", "sigstop", "sigstop_writer"), default="kill")
    parser.add_argument("--delay", type=float, nargs=2, default=[0.0, 5.0], metavar=("MIN", "MAX"),
                        help="s from the kill to the successor's start (sigstop: how long it stays stopped)")
    parser.add_argument("--deaf-after", type=float, default=10.0, help="s without a message that make a restart deaf")
    parser.add_argument("--settle", type=float, default=1.0, help="s of normal running before each fault")
    parser.add_argument("--size", type=int, default=448 * 280 * 3, help="bytes of image data per message")
    parser.add_argument("--rate", type=float, default=15.0, help="messages per second")
    parser.add_argument("--work-ms", type=float, default=0.0, help="ms of CPU work a reader does per message")
    parser.add_argument("--startup-s", type=float, default=0.0,
                        help="s of CPU work a reader does between creating its node and its subscription")
    parser.add_argument("--startup-idle", action="store_true", help="the reader sleeps through --startup-s instead of working")
    parser.add_argument("--peers", type=int, default=0, help="other nodes in the domain (small messages at 10 Hz), as in the graph")
    parser.add_argument("--stable-reader", action="store_true", help="a second reader that is never faulted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-domain", type=int, default=120)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write every restart and the summary here")
    args = parser.parse_args(argv)
    if args.role == "writer":
        writer(json.loads(args.qos), args.size, args.rate)
        return 0
    if args.role == "reader":
        reader(json.loads(args.qos), args.work_ms, args.startup_s, args.startup_idle)
        return 0
    if args.role == "peer":
        peer(args.index)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="dds_restart_"))
    args.log_dir = args.log_dir or tmp / "logs"
    rng = random.Random(args.seed)
    rows = []
    for run in range(args.runs):  # settings interleaved, so that each meets the same machine load
        for name in args.settings:
            rows.append(run_once(name, run, args, rng, tmp))
            if args.json:
                args.json.write_text(json.dumps({"args": vars(args) | {"log_dir": str(args.log_dir), "json": str(args.json)},
                                                 "summary": summarize(rows), "rows": rows}, indent=1))
    print(json.dumps(summarize(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
