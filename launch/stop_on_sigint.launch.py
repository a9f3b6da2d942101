"""Stop every process of the launch that includes this file on a SIGINT to the launch process alone.

sps_driving.launch.xml includes it first, so that the graph stops the same way whichever car launch
file is started. A SIGINT that reaches the launch process alone (`kill -INT`, a service manager
that signals only its main process) is passed on to every process of the launch at once: launch
itself takes any SIGINT for a terminal's Ctrl-C that its processes already got, sends them nothing
and waits 5 s before SIGTERM, and for those 5 s the graph would go on driving. A process that did
get the Ctrl-C gets the SIGINT twice, which stops it the same way (the vehicle interface and the
supervisors act on the first). The signal table of docs/vehicle.md says how soon the car brakes.

A launch started in the background of a shell script (`ros2 launch ... &`) inherits SIGINT
ignored, and launch would then never see a SIGINT: this file gives it back Python's own handler,
through which launch receives it, so that such a launch stops like any other.
"""

import os
import signal

from launch.actions import LogInfo, RegisterEventHandler
from launch.event_handlers import OnProcessExit, OnProcessStart, OnShutdown

from launch import LaunchDescription


class SigintToEveryProcess:
    """Pass a SIGINT that stops the launch on to every process it runs, as a terminal's Ctrl-C would."""

    def __init__(self):
        self.running: dict[int, str] = {}  # pid -> launch's name of the process

    def started(self, event, _context):
        self.running[event.pid] = event.process_name

    def exited(self, event, _context):
        self.running.pop(event.pid, None)

    def on_shutdown(self, event, _context):
        if not event.due_to_sigint:
            return None  # launch signals its processes itself
        for pid in list(self.running):
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                self.running.pop(pid, None)
        return [LogInfo(msg=f"SIGINT passed on to {len(self.running)} processes: {sorted(self.running.values())}")]

    def handlers(self) -> list:
        return [RegisterEventHandler(OnProcessStart(on_start=self.started)),
                RegisterEventHandler(OnProcessExit(on_exit=self.exited)),
                RegisterEventHandler(OnShutdown(on_shutdown=self.on_shutdown))]


def take_sigint_again() -> bool:
    """Undo an ignored SIGINT (inherited from a shell's background job); True if it was ignored.
    launch hears SIGINT only through Python's handler, which Python does not install then."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


def generate_launch_description():
    told = [LogInfo(msg="SIGINT was ignored by this launch (started in a shell's background): taken again")] if take_sigint_again() else []
    return LaunchDescription([*told, *SigintToEveryProcess().handlers()])
