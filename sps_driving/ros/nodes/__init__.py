"""One thin rclpy node per executable: `sps_driving.ros.nodes.<name>.main`, each named in
sps_driving.ros.executables.NODES."""
