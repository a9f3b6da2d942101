"""Stop the car launch the ways a user or a service manager does, and time how soon the car brakes.

    scripts/car_launch_stop.py --frames DIR [--ways ctrl_c sigint_launch ...] [--runs N] [--json FILE]

Needs the workspace sourced (`source install/setup.bash`: `ros2 launch` and the installed
sps_driving) and a ROS domain of its own. For each run it starts the PACMod 3 stand-in driver (a
launch of its own, as the real driver with launch_driver:=false), publishes the lane pose and the
obstacle range the safety monitor reads, starts `ros2 launch sps_driving sps_driving.launch.py
vehicle_backend:=pacmod3` in a session of its own (as a shell starts a job), engages once every
input is fresh, lets the graph drive for `--drive-s`, then stops the launch one way:

- ctrl_c: SIGINT to the launch's process group (a terminal's Ctrl-C);
- sigint_launch: SIGINT to the launch process alone (`kill -INT <pid>`);
- sigterm_launch: SIGTERM to the launch process alone (`kill <pid>`);
- systemd_cgroup_sigint: SIGINT to every process of the launch at once (systemd KillMode=control-group,
  KillSignal=SIGINT: the whole cgroup gets the stop signal);
- systemd_mixed_sigint: SIGINT to the launch process alone and, the moment it has exited, SIGKILL to
  every process of the launch still left (KillMode=mixed, KillSignal=SIGINT: systemd.kill(5)'s
  "subsequent SIGKILL ... to all remaining processes"; at once, the harshest reading).

Jazzy's `ros2 launch` sends its processes a SIGINT of its own only when its standard input is not
a terminal (`--noninteractive`, Humble's has no such mode): the launch gets a terminal as its
standard input for the first three ways, as from a shell, and /dev/null under the service manager's
two (`--stdin` overrides).

A run counts only if the car was driving when signalled (engaged, the accelerator enabled, no stop:
on a busy machine the CPU-bound extractor can be too slow and the vehicle interface stops first);
otherwise the launch is tried again (`--attempts`).

Two figures per run: from the signal to the first braking command the vehicle interface or the
failsafe sends (`/pacmod/brake_cmd`, enable and brake > 0) and to the first period the driver sends
to the car with it (`/pacmod3_standin/sent`), and from the signal until no process of the launch is
left. Also: the accelerator the car last got before the brake, and whether any period after the
brake carried an accelerator.

Secured (ROS_SECURITY_ENABLE=true, ROS_SECURITY_STRATEGY=Enforce, ROS_SECURITY_KEYSTORE): the launch's
nodes run in their own enclaves; `--bench-enclave` names the one enclave of what is not the car's
(this script's node, which publishes the lane pose and obstacle range and engages, and the stand-in).
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WAYS = ("ctrl_c", "sigint_launch", "sigterm_launch", "systemd_cgroup_sigint", "systemd_mixed_sigint")


STOP_BRAKE = 0.5 - 1e-3  # config/graph.yaml stop_brake, as the driver sends it (steps of 0.001)
TURN_HAZARDS = 3  # pacmod3_msgs/SystemCmdInt


def is_stop(sent: dict) -> bool:
    """A period the driver sends to the car in a stop of the vehicle interface or the failsafe:
    the stop brake with the hazard lights on."""
    return bool(sent.get("brake.enable")) and sent.get("brake.command", 0) >= STOP_BRAKE and sent.get("turn.command") == TURN_HAZARDS


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def left_process(pid: int) -> str:
    """A process left after the timeout: its command line, state and what each thread waits in."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        waits = sorted({(task / "wchan").read_text() for task in Path(f"/proc/{pid}/task").iterdir()})
    except OSError:
        return ""
    return f"{command} (state {state}, threads waiting in {', '.join(waits)})"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Bus:
    """The inputs the safety monitor needs, and what reaches the driver and the car, timed."""

    def __init__(self):
        import rclpy
        from geometry_msgs.msg import PoseStamped
        from pacmod3_msgs.msg import SystemCmdFloat
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState, Range
        from std_srvs.srv import SetBool

        from sps_driving.core import topics
        from sps_driving.ros import msgs

        rclpy.init()
        self.msgs, self.topics = msgs, topics
        self.node = rclpy.create_node("car_launch_stop")
        self.lane = self.node.create_publisher(PoseStamped, topics.LANE_POSE, msgs.qos("sensor_out"))
        self.range = self.node.create_publisher(Range, topics.OBSTACLE_RANGE, msgs.qos("sensor_out"))
        self.lock = threading.Lock()
        self.brake_cmds: list[tuple[float, bool, float]] = []
        self.accel_cmds: list[tuple[float, bool, float]] = []
        self.sent: list[tuple[float, dict]] = []
        for store, topic in ((self.brake_cmds, topics.PACMOD_BRAKE_CMD), (self.accel_cmds, topics.PACMOD_ACCEL_CMD)):
            self.node.create_subscription(SystemCmdFloat, topic, lambda m, s=store: self._add(s, (time.monotonic(), m.enable, m.command)),
                                          msgs.qos("driver"))
        self.node.create_subscription(JointState, "/pacmod3_standin/sent",
                                      lambda m: self._add(self.sent, (time.monotonic(), dict(zip(m.name, m.position)))), msgs.qos("status"))
        self.engage = self.node.create_client(SetBool, topics.ENGAGE_SERVICE)
        self.SetBool = SetBool
        self.node.create_timer(1 / 30, self._publish)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _add(self, store, item):
        with self.lock:
            store.append(item)

    def _spin(self):
        while not self.stopping.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def _publish(self):
        stamp = time.time_ns()
        self.lane.publish(self.msgs.to_ros(self.msgs.lane_pose_fields(0.0, 0.0, stamp)))
        self.range.publish(self.msgs.to_ros(self.msgs.range_fields(float("inf"), stamp)))

    def try_engage(self, timeout_s: float) -> str:
        if not self.engage.wait_for_service(timeout_sec=1.0):
            return "no engage service"
        done = threading.Event()
        future = self.engage.call_async(self.SetBool.Request(data=True))
        future.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout_s):
            return "no answer"
        answer = future.result()
        return "engaged" if answer.success else answer.message

    def close(self):
        self.stopping.set()
        self.thread.join()
        self.node.destroy_node()
        import rclpy

        rclpy.try_shutdown()


def signal_launch(way: str, launch: subprocess.Popen, processes: list[int]) -> None:
    if way == "ctrl_c":
        os.killpg(launch.pid, signal.SIGINT)
    elif way in ("sigint_launch", "systemd_mixed_sigint"):
        launch.send_signal(signal.SIGINT)
    elif way == "sigterm_launch":
        launch.send_signal(signal.SIGTERM)
    elif way == "systemd_cgroup_sigint":
        for pid in [launch.pid, *processes]:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    else:
        raise ValueError(way)


def one_run(way: str, args, bus: Bus, env: dict, bench_env: dict) -> dict:
    standin = subprocess.Popen(["ros2", "run", "sps_driving", "pacmod3_standin"], env=bench_env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    log = open(args.log_dir / f"{way}.log", "w")
    stdin = args.stdin or ("null" if way.startswith("systemd") else "tty")
    terminal, stdin_file = pty.openpty() if stdin == "tty" else (None, subprocess.DEVNULL)
    launch = subprocess.Popen(
        ["ros2", "launch", "sps_driving", args.launch_file, "vehicle_backend:=pacmod3", f"camera_source:={args.frames}",
         *([f"params_file:={args.params_file}"] if args.params_file else [])],
        env=env, stdin=stdin_file, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result = {"way": way, "launch_file": args.launch_file, "stdin": stdin}
    try:
        deadline = time.monotonic() + args.ready_s
        why = ""
        while time.monotonic() < deadline:
            why = bus.try_engage(2.0)
            if why == "engaged":
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{way}: not engaged within {args.ready_s} s: {why}")
        result["engaged_after_s"] = round(args.ready_s - (deadline - time.monotonic()), 1)
        driving_from = None
        while driving_from is None and time.monotonic() < deadline + args.drive_s + 20:
            time.sleep(0.1)
            with bus.lock:
                driving_from = next((t for t, s in bus.sent if s.get("accel.enable") and s.get("accel.command", 0) > 0), None)
        if driving_from is None:
            raise RuntimeError(f"{way}: engaged, but no accelerator reached the car")
        time.sleep(max(0.0, driving_from + args.drive_s - time.monotonic()))
        with bus.lock:
            last = bus.sent[-1][1]
        if is_stop(last) or not last.get("accel.enable"):
            raise RuntimeError(f"{way}: the car was not driving when the signal was due: {last}")
        processes = descendants(launch.pid)
        result["processes"] = len(processes) + 1
        with bus.lock:
            driving = [a for a in bus.sent if a[0] > time.monotonic() - 1.0]
        result["accel_on_bus_before_s"] = max((s.get("accel.command", 0.0) for _t, s in driving), default=None)
        signalled = time.monotonic()
        signal_launch(way, launch, processes)
        everyone = [launch.pid, *processes]
        mixed_killed = False
        gone_at = None
        while time.monotonic() - signalled < args.gone_timeout_s:
            launch.poll()
            if way == "systemd_mixed_sigint" and not mixed_killed and launch.returncode is not None:
                mixed_killed = True
                for pid in processes:
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
                result["sigkilled_after_main_exit"] = sum(1 for pid in processes if alive(pid))
            if not any(alive(pid) for pid in everyone):
                gone_at = time.monotonic()
                break
            time.sleep(0.005)
        time.sleep(1.0)  # what reaches the car after the stop
        launch.poll()
        with bus.lock:
            brake = next((t for t, enable, value in bus.brake_cmds if t >= signalled and enable and value >= STOP_BRAKE), None)
            on_bus = next((t for t, s in bus.sent if t >= signalled and is_stop(s)), None)
            accel_after = [s.get("accel.command", 0) for t, s in bus.sent if on_bus is not None and t > on_bus and s.get("accel.enable")]
            accel_last = [s.get("accel.command", 0) for t, s in bus.sent if t < (on_bus or signalled)][-1:]
        result.update({
            "brake_cmd_s": None if brake is None else round(brake - signalled, 3),
            "brake_on_bus_s": None if on_bus is None else round(on_bus - signalled, 3),
            "no_process_left_s": None if gone_at is None else round(gone_at - signalled, 3),
            "left_after_timeout": {pid: left_process(pid) for pid in everyone if alive(pid)},
            "accel_last_before_brake": accel_last[0] if accel_last else None,
            "accel_periods_after_brake": sum(1 for a in accel_after if a > 0),
            "launch_status": launch.returncode,
        })
        return result
    finally:
        # Also those found when signalled: a process left after launch died is no longer below it.
        for pid in {launch.pid, *descendants(launch.pid), *result.get("left_after_timeout", {})}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launch.wait()
        log.close()
        if terminal is not None:
            os.close(terminal)
            os.close(stdin_file)
        os.killpg(standin.pid, signal.SIGINT)
        standin.wait()
        with bus.lock:
            bus.brake_cmds.clear()
            bus.accel_cmds.clear()
            bus.sent.clear()
        time.sleep(args.pause_s)  # let peers forget the ended processes before the next launch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=Path, required=True, help="image folder for the camera driver")
    parser.add_argument("--params-file", type=Path, default=None, help="params_file:= of the launch (e.g. with camera_driver loop true)")
    parser.add_argument("--launch-file", default="sps_driving.launch.py", help="the launch file of sps_driving to run")
    parser.add_argument("--stdin", choices=("tty", "null"), default=None,
                        help="the launch's standard input (default: a terminal, /dev/null for the systemd ways)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--runs", type=int, default=1, help="runs of each way, interleaved")
    parser.add_argument("--drive-s", type=float, default=3.0, help="s driven between the first accelerator on the bus and the signal")
    parser.add_argument("--ready-s", type=float, default=180.0, help="s allowed from the launch to engagement")
    parser.add_argument("--gone-timeout-s", type=float, default=30.0, help="s to wait for every process to exit")
    parser.add_argument("--pause-s", type=float, default=12.0, help="s between runs (the DDS lease is 10 s)")
    parser.add_argument("--attempts", type=int, default=3, help="launches tried per run until the car drives when signalled")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/car_launch_stop"))
    parser.add_argument("--json", type=Path, default=None, help="append each run's result here (JSON lines)")
    parser.add_argument("--bench-enclave", default=None,
                        help="secured (ROS_SECURITY_ENABLE=true): the enclave of what is not the car's, this script's node and "
                             "the stand-in driver; the launch's nodes keep their own")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "ROS_SECURITY_ENCLAVE_OVERRIDE"}
    bench_env = {**env, "ROS_SECURITY_ENCLAVE_OVERRIDE": args.bench_enclave} if args.bench_enclave else env
    os.environ.clear()
    os.environ.update(bench_env)  # read by rclpy.init
    bus = Bus()
    try:
        for run in range(args.runs):
            for way in args.ways:
                for attempt in range(args.attempts):
                    try:
                        result = {"run": run, "attempt": attempt, **one_run(way, args, bus, env, bench_env)}
                        break
                    except RuntimeError as exc:  # a graph too slow on a busy machine to drive
                        result = {"run": run, "attempt": attempt, "way": way, "not_measured": str(exc)}
                print(json.dumps(result), flush=True)
                if args.json:
                    with args.json.open("a") as out:
                        out.write(json.dumps(result) + "\n")
    finally:
        bus.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
