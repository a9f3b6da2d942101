"""One ROS 2 participant for test_security.py, secured or not by the ROS_SECURITY_* environment.

    python security_peer.py pub|sub TOPIC NODE NAMESPACE LABEL --ros-args --enclave ENCLAVE

`pub` publishes LABEL (std_msgs/String) on TOPIC every 50 ms; `sub` prints "received <data>" for
each message. Prints "ready" once its endpoint exists, or "refused: <error>" and exits 3 when the
middleware refuses the node or the endpoint (access control denies it, or security is missing).
"""

import sys

import rclpy
from rclpy.executors import ExternalShutdownException
from std_msgs.msg import String

REFUSED = 3


def main() -> int:
    mode, topic, node_name, namespace, label = sys.argv[1:6]
    rclpy.init(args=sys.argv)
    try:
        node = rclpy.create_node(node_name, namespace=namespace)
        if mode == "pub":
            publisher = node.create_publisher(String, topic, 10)
            node.create_timer(0.05, lambda: publisher.publish(String(data=label)))
        else:
            node.create_subscription(String, topic, lambda msg: print(f"received {msg.data}", flush=True), 10)
    except RuntimeError as exc:  # rclpy's RCLError
        print(f"refused: {exc}", flush=True)
        return REFUSED
    print("ready", flush=True)
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
