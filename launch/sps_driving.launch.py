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

Stop it with Ctrl-C (SIGINT), or any of the ways of docs/vehicle.md's signal table: the XML includes
stop_on_sigint.launch.py, which passes a SIGINT to the launch process alone on to every process.

When the driver runs in a launch of its own, nothing is shut down, as here while one of the two
lives.

    ros2 launch sps_driving sps_driving.launch.py launch_driver:=true vehicle_backend:=pacmod3
"""

import os

from launch.actions import IncludeLaunchDescription, LogInfo, RegisterEventHandler, Shutdown
from launch.conditions import IfCondition
from launch.event_handlers import OnProcessExit
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


def generate_launch_description():
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
    return LaunchDescription([graph, tie])
