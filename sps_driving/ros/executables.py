"""The package's executables, one per node (`sps_driving.ros.nodes.<name>.main`).

NODES is the one list of them. setup.py reads this file without importing the package (so keep
it free of imports), `ros2 run sps_driving <name>` and the launch files use these names, and
sps_driving.ros.graph starts them; the subsets that tools start are checked against it.
"""

# sim_world stands in for the car in simulation; pacmod3_standin for the PACMod 3 driver in tests.
NODES = (
    "camera_driver", "selection", "extractor", "policy", "vehicle_interface", "safety_monitor", "failsafe", "sim_world",
    "pacmod3_standin",
)
