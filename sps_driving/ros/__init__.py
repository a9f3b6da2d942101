"""The ROS 2 side: the message layer (msgs.py: conversion and QoS; bagio.py: rosbag2 and MCAP
files without a ROS install), the nodes (nodes/, one thin rclpy node per executable), the live
graph as OS processes (graph.py), the node processes' scheduling and exit with their parent
(process.py), the supervisor that starts a crashed perception node again (respawn.py) and SROS2
access control (security.py)."""
