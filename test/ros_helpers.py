"""Test-side ROS 2 helpers: one real rclpy node in the test process that publishes inputs and
records what the node processes under test publish (no fakes: real DDS on loopback)."""

from __future__ import annotations

import time
from collections import defaultdict

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

from sps_driving.core import topics
from sps_driving.ros import msgs


class Probe:
    def __init__(self, name: str = "test_probe"):
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = Node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.received = defaultdict(list)  # topic -> [(monotonic s, msg)]
        self.publishers = {}

    def record(self, topic: str, msg_type, qos_kind: str) -> None:
        def store(msg, topic=topic):
            self.received[topic].append((time.monotonic(), msg))

        self.node.create_subscription(msg_type, topic, store, msgs.qos(qos_kind))

    def publisher(self, topic: str, msg_type, qos_kind: str):
        if topic not in self.publishers:
            self.publishers[topic] = self.node.create_publisher(msg_type, topic, msgs.qos(qos_kind))
        return self.publishers[topic]

    def spin(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.executor.spin_once(timeout_sec=min(0.02, max(0.0, end - time.monotonic())))

    def spin_until(self, predicate, timeout_s: float, every=None) -> bool:
        """Spin until predicate() holds; `every()` is called each pass (e.g. to keep publishing)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if every is not None:
                every()
            self.executor.spin_once(timeout_sec=0.01)
            if predicate():
                return True
        return False

    def messages(self, topic: str) -> list:
        return [m for _, m in self.received[topic]]

    def status(self, name: str):
        """(level, message, values) of the newest status called `name` recorded on /diagnostics,
        or (-1, "", {}) before any (record topics.DIAGNOSTICS first)."""
        for msg in reversed(self.messages(topics.DIAGNOSTICS)):
            found = msgs.status_named(msg, name)
            if found is not None:
                return found
        return -1, "", {}

    def call(self, service_type, name: str, request, timeout_s: float = 10.0):
        """A real service call; the response, or None if there was no answer in time."""
        client = self.node.create_client(service_type, name)
        try:
            if not client.wait_for_service(timeout_sec=timeout_s):
                return None
            future = client.call_async(request)
            self.spin_until(future.done, timeout_s)
            return future.result() if future.done() else None
        finally:
            self.node.destroy_client(client)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


class Rate:
    """Calls fn at most every period seconds when polled: a publisher loop inside spin_until."""

    def __init__(self, period_s: float, fn):
        self.period_s, self.fn, self.last = period_s, fn, 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.period_s:
            self.last = now
            self.fn()
