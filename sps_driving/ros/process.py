"""Process plumbing shared by the nodes and their supervisor (sps_driving.ros.respawn); no ROS here."""

from __future__ import annotations

import os
import signal
import sys

# Exit status of a node that cannot start (a bad parameter, a missing model file): starting it
# again would fail the same way, so the supervisor does not (sysexits.h EX_CONFIG).
CANNOT_START = 78


def stop_with_parent() -> None:
    """Have Linux send this process SIGTERM when the process that started it dies. A launch ended
    with SIGTERM or SIGKILL, or a crashed supervisor, otherwise leaves its nodes running, the car
    driven with nobody to stop it from the launch; with this each node exits as on SIGTERM, the
    vehicle interface through its fail-safe exit (brake, then disable)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        print(f"warning: cannot ask to be stopped with the parent process: errno {ctypes.get_errno()}", file=sys.stderr)
    elif os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def describe_exit(status: int) -> str:
    """A child's exit status in words ("killed by SIGKILL", "exit status 1")."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    if status == CANNOT_START:
        return f"exit status {status} (cannot start)"
    return f"exit status {status}"


def parse_cpus(text: str) -> set[int]:
    """CPUs from "2", "2,3" or "0-1,3"; the empty string is every CPU this process may use."""
    if not text.strip():
        return set(os.sched_getaffinity(0))
    cpus = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"cpu_affinity {text!r}: expected CPU numbers such as '3', '2,3' or '0-1'")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def apply_scheduling(cpus: str, realtime_priority: int, nice: int) -> str:
    """Pin every thread of this process to `cpus` (parse_cpus) and run them under SCHED_FIFO at
    `realtime_priority` (1-99), or with the `nice` value under normal scheduling (0: unchanged).
    Threads started later inherit it from the thread that starts them. Returns what was applied,
    in words; raises ValueError naming what it needs when the process may not have it."""
    chosen = parse_cpus(cpus)
    available = set(range(os.cpu_count() or 1))
    if not chosen <= available:
        raise ValueError(f"cpu_affinity {cpus!r} names CPUs this machine does not have (it has {min(available)}-{max(available)})")
    applied = []
    if cpus.strip():
        for tid in _threads():
            os.sched_setaffinity(tid, chosen)
        applied.append(f"CPUs {sorted(chosen)}")
    if realtime_priority:
        try:
            for tid in _threads():
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(realtime_priority))
        except PermissionError:
            raise ValueError(
                f"realtime_priority {realtime_priority} needs CAP_SYS_NICE or a real-time priority limit of at least "
                f"{realtime_priority} (`ulimit -r {realtime_priority}`, or `<user> - rtprio {realtime_priority}` in "
                f"/etc/security/limits.conf; under systemd LimitRTPRIO={realtime_priority}); this process's limit is "
                f"{_limit('RLIMIT_RTPRIO')}") from None
        applied.append(f"SCHED_FIFO priority {realtime_priority}")
    elif nice:
        try:
            for tid in _threads():
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            raise ValueError(
                f"nice {nice} needs CAP_SYS_NICE or a nice limit of at least {20 - nice} (`ulimit -e {20 - nice}`, or "
                f"`<user> - nice {nice}` in /etc/security/limits.conf; under systemd LimitNICE={20 - nice}); this process's "
                f"limit is {_limit('RLIMIT_NICE')}") from None
        applied.append(f"nice {nice}")
    return ", ".join(applied) or "default scheduling"


def _limit(name: str) -> str:
    import resource

    soft, _hard = resource.getrlimit(getattr(resource, name))
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
