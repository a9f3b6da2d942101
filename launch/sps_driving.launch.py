"""The car launch: the graph of sps_driving.launch.xml (its arguments apply here), and, when the
PACMod 3 driver is started here too (launch_driver:=true), the whole launch shut down as soon as
the vehicle interface exits however it exits (a crash, kill -9, out of memory). The driver then
stops, so it no longer re-sends the last command every 33 ms, and the PACMod's own command timeout
hands the car back to the safety driver. ROS 2 Humble's XML front end has no on_exit, hence this
file. Checked under the real Humble and Jazzy launch front ends: every process is gone about 2 s
after `kill -9` of the vehicle interface.

Stop it with Ctrl-C (SIGINT). SIGTERM to the launch process ends it at once and leaves the nodes
running: under a service manager use SIGINT (systemd: KillSignal=SIGINT).

When the driver runs in a launch of its own, nothing is shut down: the failsafe node, which
outlives the vehicle interface, brakes the car and holds it (docs/vehicle.md).

    ros2 launch sps_driving sps_driving.launch.py launch_driver:=true vehicle_backend:=pacmod3
"""

import os

from launch.actions import IncludeLaunchDescription, RegisterEventHandler, Shutdown
from launch.conditions import IfCondition
from launch.event_handlers import OnProcessExit
from launch.launch_description_sources import AnyLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration

from launch import LaunchDescription


def is_vehicle_interface(action) -> bool:
    # Asked once the process ran, when the node's resolved name is known (its executable is a list
    # of substitutions when the node comes from XML).
    return getattr(action, "node_name", None) == "/vehicle_interface"


def generate_launch_description():
    # A plain path, so that `ros2 launch ... --show-args` can list the XML's arguments.
    graph = IncludeLaunchDescription(AnyLaunchDescriptionSource(os.path.join(os.path.dirname(__file__), "sps_driving.launch.xml")))
    tie = RegisterEventHandler(
        OnProcessExit(target_action=is_vehicle_interface, on_exit=[Shutdown(reason="the vehicle interface exited")]),
        condition=IfCondition(LaunchConfiguration("launch_driver", default="false")),
    )
    return LaunchDescription([graph, tie])
