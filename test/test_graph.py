"""A tool's graph keeps to this machine and a ROS domain of its own (sps_driving.ros.graph.isolate_ros):
its node processes and its own rclpy context alike."""

import json
import os
import subprocess
import sys

import pytest

from sps_driving.ros.graph import DOMAIN_VARIABLE, PRIVATE_DOMAINS, private_domain_id

# What a tool does (sps_driving.tools.replay.replay_bag): isolate, its own context, then the graph.
TOOL = """
import json, os, sys
from sps_driving.ros.graph import Graph, isolate_ros, wait_for_nodes
domain = isolate_ros()
import rclpy
from rclpy.node import Node
context = rclpy.Context()
rclpy.init(context=context)
node = Node("tool", context=context)
with Graph(["selection"], log_dir=sys.argv[1]) as graph:
    wait_for_nodes(node, ["selection"], 30, graph)
    pid = graph.processes['selection'].pid
    with open(f"/proc/{pid}/environ") as f:
        child = dict(item.split("=", 1) for item in f.read().split("\\0") if "=" in item)
    # The local address of every UDP socket the node process holds (/proc/net/udp: hex, little-endian IPv4).
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")}
    with open("/proc/net/udp") as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    addresses = sorted({".".join(str(int(r[1][i:i + 2], 16)) for i in (6, 4, 2, 0)) for r in rows if r[9] in inodes})
    shared_memory = sum("fastdds_" in line and "/dev/shm" in line for line in open(f"/proc/{pid}/maps"))
print(json.dumps({"domain": domain, "context": context.get_domain_id(), "child": child, "udp": addresses,
                  "shared_memory": shared_memory}))
node.destroy_node()
rclpy.shutdown(context=context)
"""


def test_the_domain_is_the_users_choice_or_a_private_one_picked_by_process_id():
    assert private_domain_id({DOMAIN_VARIABLE: "7", "ROS_DOMAIN_ID": "7"}, 1) == 7
    for bad in ("seven", "-1", "233"):
        with pytest.raises(ValueError, match=DOMAIN_VARIABLE):
            private_domain_id({DOMAIN_VARIABLE: bad}, 1)
    # Never the shell's domain (on the car, its stack's); two tools at once get two domains.
    assert {private_domain_id({"ROS_DOMAIN_ID": "60"}, pid) for pid in range(500)} == set(PRIVATE_DOMAINS) - {60}
    assert private_domain_id({}, 1000) != private_domain_id({}, 1001)


CLAIM = """
import sys, time
from sps_driving.ros.graph import claim_domain
print(claim_domain([int(d) for d in sys.argv[1:]]), flush=True)
time.sleep(30)
"""


def test_a_domain_held_by_another_run_on_this_machine_is_not_taken():
    """Two runs whose process ids pick the same domain get two domains."""
    candidates = ["201", "202", "203"]
    first = subprocess.Popen([sys.executable, "-c", CLAIM, *candidates], stdout=subprocess.PIPE, text=True)
    second = subprocess.Popen([sys.executable, "-c", CLAIM, *candidates], stdout=subprocess.PIPE, text=True)
    try:
        held = {int(first.stdout.readline()), int(second.stdout.readline())}
    finally:
        first.kill(), second.kill()
        first.wait(), second.wait()
    assert held == {201, 202}
    # Once they are gone their domains are free again.
    third = subprocess.run([sys.executable, "-c", CLAIM.replace("time.sleep(30)", ""), *candidates], capture_output=True,
                           text=True, timeout=60)
    assert third.stdout.strip() == "201"


@pytest.mark.ros
def test_a_tools_context_and_its_node_processes_share_one_private_domain_on_this_machine(tmp_path):
    shell_domain = os.environ["ROS_DOMAIN_ID"]
    env = {k: v for k, v in os.environ.items() if k not in (DOMAIN_VARIABLE, "ROS_LOCALHOST_ONLY")}
    env.update(ROS_DOMAIN_ID=shell_domain, ROS_AUTOMATIC_DISCOVERY_RANGE="SUBNET", ROS_STATIC_PEERS="192.0.2.1")
    done = subprocess.run([sys.executable, "-c", TOOL, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + (tmp_path / "selection.log").read_text()
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    child = seen["child"]
    assert seen["domain"] == seen["context"] == int(child["ROS_DOMAIN_ID"]) != int(shell_domain)
    assert seen["domain"] in PRIVATE_DOMAINS
    assert "ROS_STATIC_PEERS" not in child
    # UDP on this machine only, no shared memory (config/fastdds_loopback.xml; docs/vehicle.md).
    assert child["FASTDDS_DEFAULT_PROFILES_FILE"].endswith("config/fastdds_loopback.xml")
    assert child["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "SYSTEM_DEFAULT" and child["ROS_LOCALHOST_ONLY"] == "0"
    assert seen["udp"] == ["127.0.0.1"], seen["udp"]
    assert seen["shared_memory"] == 0
