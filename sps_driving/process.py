"""Process plumbing shared by the nodes and their supervisor (sps_driving.respawn); no ROS here."""

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

