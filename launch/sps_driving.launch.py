"""The car launch: the graph of sps_driving.launch.xml (its arguments apply here), and, when the
PACMod 3 driver is started here too (launch_driver:=true), the whole launch shut down once both the
vehicle interface and the failsafe have exited, however they exit (a crash, kill -9, out of
memory), in either order.

While one of them lives, the car is stopped by it: the failsafe brakes and holds a car whose
vehicle interface went silent while engaged, and the vehicle interface stops the car when the
failsafe's status goes silent (docs/vehicle.md). With both gone nothing would stop the driver
re-sending the last command every 33 ms, so the driver is stopped with them and the PACMod's own
command timeout hands the car back to the safety driver. ROS 2 Humble's XML front end has no
on_exit, hence this file.

Stop it with Ctrl-C (SIGINT). A SIGINT that reaches the launch process alone (`kill -INT`, a service
manager that signals only its main process) is passed on to every process of the launch at once:
launch itself takes any SIGINT for a terminal's Ctrl-C that its processes already got, sends them
nothing and waits 5 s before SIGTERM, and for those 5 s the graph would go on driving. A process
that did get the Ctrl-C gets the SIGINT twice, which stops it the same way (the vehicle interface
and the supervisors act on the first). SIGTERM to the launch process ends launch at once; each
node then gets SIGTERM from Linux as its parent dies (sps_driving/ros/process.py) and stops as on
Ctrl-C. The signal table of docs/vehicle.md says how soon the car brakes in each case.

A launch started in the background of a shell script (`ros2 launch ... &`) inherits SIGINT
ignored, and launch would then never see a SIGINT: this file gives it back Python's own handler,
through which launch receives it, so that such a launch stops like any other.

When the driver runs in a launch of its own, nothing is shut down, as here while one of the two
lives.

    ros2 launch sps_driving sps_driving.launch.py launch_driver:=true vehicle_backend:=pacmod3
"""

import os
import signal

from launch.actions import IncludeLaunchDescription, LogInfo, RegisterEventHandler, Shutdown
from launch.conditions import IfCondition
from launch.event_handlers import OnProcessExit, OnProcessStart, OnShutdown
from launch.launch_description_sources import AnyLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration

from launch import LaunchDescription

# The nodes that can stop the car on their own; the driver lives while one of them does.
CAR_STOPPERS = frozenset({"/vehicle_interface", "/failsafe"})
STOPPING_THE_DRIVER = ("the vehicle interface and the failsafe have both exited: shutting down the launch and the PACMod "
                       "driver with it; the PACMod's command timeout hands the car to the safety driver")


def is_car_stopper(action) -> bool:
    # Asked once the process ran, when the node's resolved name is known (its executable is a list
    # of substitutions when the node comes from XML).
    return getattr(action, "node_name", None) in CAR_STOPPERS


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
    was_ignored = take_sigint_again()
    # A plain path, so that `ros2 launch ... --show-args` can list the XML's arguments.
    graph = IncludeLaunchDescription(AnyLaunchDescriptionSource(os.path.join(os.path.dirname(__file__), "sps_driving.launch.xml")))
    exited = set()

    def shut_down_when_none_is_left(event, _context):
        exited.add(event.action.node_name)
        if exited >= CAR_STOPPERS:
            # Launch's own line names only the last process to exit, as if it alone had caused this.
            return [LogInfo(msg=STOPPING_THE_DRIVER), Shutdown(reason=STOPPING_THE_DRIVER)]
        return None

    tie = RegisterEventHandler(
        OnProcessExit(target_action=is_car_stopper, on_exit=shut_down_when_none_is_left),
        condition=IfCondition(LaunchConfiguration("launch_driver", default="false")),
    )
    told = [LogInfo(msg="SIGINT was ignored by this launch (started in a shell's background): taken again")] if was_ignored else []
    return LaunchDescription([*told, *SigintToEveryProcess().handlers(), graph, tie])
