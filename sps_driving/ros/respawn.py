"""Run a node and start it again when it crashes, waiting longer after each crash: the car launch's
supervisor of the perception nodes (camera driver, selection, extractor, policy, safety monitor).

    respawn [--name NAME] [--config FILE] -- COMMAND [ARG ...]

A node that exits by a signal or with a failure status is started again after a delay that grows
with the restarts in the last `window_s` (config/respawn.yaml); after `max_restarts` of them it
stays down and this process exits with its status. A node that ends cleanly (status 0), or cannot
start (a bad parameter or a missing model: sps_driving.ros.process.CANNOT_START), is not started
again. SIGINT, SIGTERM and SIGHUP go to the node, and then this process exits with it; a node still
running `stop_grace_s` after the first of them is killed (SIGKILL), so that a node hung in its
teardown cannot outlive the launch (after a SIGTERM launch itself ends at once, and nothing else
would end it).

A restart never moves the car: the vehicle interface holds its stop while any input is missing and
until the safety driver disengages and engages again (docs/vehicle.md). The vehicle interface and
the failsafe are never run under this supervisor: they are what stops the car.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from sps_driving.ros.process import CANNOT_START, describe_exit, stop_with_parent

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class BackOff:
    """When to start a crashed node again, and how long a stopped one may take to end (units: s);
    config/respawn.yaml says why each value."""

    first_delay_s: float = 4.0
    factor: float = 2.0
    max_delay_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 600.0
    stop_grace_s: float = 10.0

    def __post_init__(self):
        if not (self.first_delay_s >= 0 and self.factor >= 1 and self.max_delay_s >= self.first_delay_s
                and self.max_restarts >= 0 and self.window_s > 0 and self.stop_grace_s > 0):
            raise ValueError(f"respawn settings out of range: {self}")

    @classmethod
    def from_file(cls, path: Path) -> BackOff:
        import yaml

        values = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown respawn settings {sorted(unknown)}")
        return cls(**values)

    def next_delay(self, status: int, restarts: list[float], now_s: float) -> float | None:
        """Seconds to wait before starting again a node that exited with `status` at `now_s`,
        after `restarts` (their times); None: leave it down."""
        if status in (0, CANNOT_START):
            return None
        recent = [t for t in restarts if now_s - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return None
        return min(self.max_delay_s, self.first_delay_s * self.factor ** len(recent))


class Supervisor:
    """Runs `command` under `back_off`; `run()` returns the exit status to leave with."""

    def __init__(self, command: list[str], back_off: BackOff, name: str, log: Callable[[str], None] = print):
        self.command, self.back_off, self.name, self.log = command, back_off, name, log
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None  # the first stop signal
        self._received: list[int] = []  # every stop signal, in order; each is passed on once
        self._passed_on: set[int] = set()
        self._stopped = threading.Event()
        # Re-entrant: stop() runs in a signal handler, which may interrupt run() holding it.
        self._lock = threading.RLock()

    def stop(self, signum: int) -> None:
        """Pass a stop signal to the node and start nothing again. A signal already passed on is
        not passed again (a Ctrl-C that reached both), another one is (launch's SIGTERM after a
        SIGINT the node did not finish in time)."""
        with self._lock:
            if self.stop_signal is None:
                self.stop_signal = signum
                # A thread: this runs in a signal handler, while run() waits for the node. A daemon,
                # so that this process exits as soon as the node has.
                killer = threading.Timer(self.back_off.stop_grace_s, self._kill_if_running, args=(signum,))
                killer.daemon = True
                killer.start()
            self._received.append(signum)
            self._pass_on_stop()
        self._stopped.set()

    def _kill_if_running(self, signum: int) -> None:
        with self._lock:
            if self.child is None or self.child.poll() is not None:
                return
            self.log(f"[respawn] {self.name} still running {self.back_off.stop_grace_s:g} s after "
                     f"{signal.Signals(signum).name}: killing it (SIGKILL)")
            self.child.kill()

    def _pass_on_stop(self) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        for signum in self._received:
            if signum not in self._passed_on:
                self.child.send_signal(signum)
                self._passed_on.add(signum)

    def run(self) -> int:
        restarts: list[float] = []
        while True:
            with self._lock:
                if self.stop_signal is not None:
                    return exit_status(-self.stop_signal)
                # A session of its own: a terminal's Ctrl-C reaches this process only, which
                # passes it on once. The node stops with this process (stop_with_parent).
                self.child = subprocess.Popen(self.command, start_new_session=True)
                self._pass_on_stop()  # a stop that came while it started
            status = self.child.wait()
            if self.stop_signal is not None:
                return exit_status(status)
            now = time.monotonic()
            delay = self.back_off.next_delay(status, restarts, now)
            if delay is None:
                why = ("it ended" if status == 0 else "it cannot start" if status == CANNOT_START
                       else f"{self.back_off.max_restarts} restarts within {self.back_off.window_s:g} s")
                self.log(f"[respawn] {self.name} exited ({describe_exit(status)}); not starting it again: {why}")
                return exit_status(status)
            restarts.append(now)
            self.log(f"[respawn] {self.name} exited ({describe_exit(status)}); starting it again in {delay:g} s "
                     f"(restart {len(restarts)}, at most {self.back_off.max_restarts} within {self.back_off.window_s:g} s)")
            if self._stopped.wait(delay):
                return exit_status(status)


def exit_status(status: int) -> int:
    """A child's status as this process's exit status: a signal N as 128 + N, as a shell says it."""
    return status if status >= 0 else 128 - status


def main(argv: list[str] | None = None) -> int:
    from sps_driving.core.resources import config_path

    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: respawn [--name NAME] [--config FILE] -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="respawn", description=__doc__.split("\n")[0])
    parser.add_argument("--name", help="the node's name in the log lines (default: the command)")
    parser.add_argument("--enabled", choices=("true", "false"), default="true",
                        help="false: run the command in this process, never started again (a launch argument turns it off)")
    parser.add_argument("--config", type=Path, default=None, help="back-off settings (default: config/respawn.yaml)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("no command after --")
    if args.enabled == "false":
        os.execvp(command[0], command)
    try:
        back_off = BackOff.from_file(args.config or config_path("respawn.yaml"))
    except (OSError, ValueError, TypeError) as exc:
        print(f"[respawn] cannot start: {exc}", file=sys.stderr)
        return CANNOT_START
    stop_with_parent()
    # On stderr: launch shows a node's stderr on the screen, its stdout only in the log file.
    supervisor = Supervisor(command, back_off, args.name or Path(command[0]).name,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, _frame: supervisor.stop(signum))
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
