"""Write what the real ROS 2 launch resolves the car launch to, without starting a process:
test/data/car_launch_resolved.json, which test/test_launch.py compares with its own reading of the
launch file (CI has no `launch`: it is not on PyPI).

    source <launch stack>/setup.bash && source install/setup.bash   # a workspace with sps_driving built
    python scripts/resolve_launch.py [--out test/data/car_launch_resolved.json]

Runs `sps_driving.launch.py` under a launch service for each argument set of CASES, with launch's
process runner replaced by one that records each process instead of starting it; everything else
(arguments, includes, conditions, <let>, <set_env>, substitutions, launch_ros's parameter files and
remaps) is launch's own. Per node: executable (the command up to the ROS arguments, the install
prefix written as <prefix>), node name and namespace, parameters (the params file by its path in
the package, and the values launch_ros wrote for <param>, as typed by it), remaps, launch's respawn
setting and the enclave; per case, the environment the launch set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "defaults": [],
    "operator": ["vehicle_backend:=pacmod3", "selection_rate:=1", "camera_source:=0", "respawn_perception:=false",
                 "safety_cpu_affinity:=3", "safety_realtime_priority:=50", "use_vendor_camera:=true",
                 "camera_topic:=/flir_camera/image_raw", "camera_info_topic:=/flir_camera/camera_info",
                 "lane_topic:=/perception/lane", "selection_checkpoint:=''"],
}


def resolve(arguments: list[str]) -> dict:
    from ament_index_python.packages import get_package_prefix, get_package_share_directory
    from launch.actions import execute_local
    from launch.launch_description_sources import AnyLaunchDescriptionSource
    from launch_ros.actions import Node

    import launch

    prefix = get_package_prefix("sps_driving")
    share = get_package_share_directory("sps_driving")
    recorded: list[dict] = []

    def portable(text: str) -> str:
        return text.replace(share, "<share>").replace(prefix, "<prefix>")

    def portable_values(value):
        if isinstance(value, str):
            return portable(value)
        if isinstance(value, dict):
            return {k: portable_values(v) for k, v in value.items()}
        if isinstance(value, list):
            return [portable_values(v) for v in value]
        return value

    async def record_instead_of_running(action, context):
        details = action.process_details
        cmd = [portable(part) for part in details["cmd"]]
        ros = cmd.index("--ros-args") if "--ros-args" in cmd else len(cmd)
        entry = {"executable": cmd[:ros], "launch_respawn": bool(action._ExecuteLocal__respawn)}
        if isinstance(action, Node):
            entry.update({"name": action.node_name, "namespace": action.expanded_node_namespace,
                          "remaps": [list(rule) for rule in action.expanded_remapping_rules or []],
                          "params_files": [], "param_values": {}})
            for argument, is_file in action._Node__expanded_parameter_arguments or []:
                if is_file and argument.startswith(share):
                    entry["params_files"].append(portable(argument))
                elif is_file:  # the file launch_ros wrote for a <param>, keyed by the node's full name
                    (values,) = yaml.safe_load(Path(argument).read_text()).values()
                    entry["param_values"].update(portable_values(values["ros__parameters"]))
                else:
                    raise ValueError(f"{action.node_name}: a parameter rule {argument!r}, not expected here")
            # What launch_ros adds after --ros-args besides the parameters, the remaps and the
            # node's name and namespace: the enclave.
            enclave = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--enclave"]
            entry["enclave"] = enclave[0] if enclave else None
        recorded.append(entry)
        action._ExecuteLocal__completed_future.set_result(None)  # as if it had run and ended

    execute_local.ExecuteLocal._ExecuteLocal__execute_process = record_instead_of_running
    before = dict(os.environ)
    service = launch.LaunchService(argv=arguments, noninteractive=True)
    service.include_launch_description(launch.LaunchDescription([
        launch.actions.IncludeLaunchDescription(
            AnyLaunchDescriptionSource(os.path.join(share, "launch", "sps_driving.launch.py")),
            launch_arguments=[tuple(a.split(":=", 1)) for a in arguments]),
    ]))
    if service.run() != 0:
        raise RuntimeError(f"the launch failed with {arguments}")
    asyncio.set_event_loop(asyncio.new_event_loop())
    # <set_env> sets launch's environment, which is this process's.
    environment = {k: portable(v) for k, v in os.environ.items() if before.get(k) != v}
    os.environ.clear()
    os.environ.update(before)
    return {"arguments": arguments, "environment": environment, "processes": sorted(recorded, key=lambda e: e.get("name", ""))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "test" / "data" / "car_launch_resolved.json")
    args = parser.parse_args(argv)
    os.environ.pop("FASTDDS_DEFAULT_PROFILES_FILE", None)  # so that the launch's own <set_env> shows
    record = {
        "resolved_by": {name: version(name) for name in ("launch", "launch_xml", "launch_ros")},
        "cases": {name: resolve(arguments) for name, arguments in CASES.items()},
    }
    args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    counts = ", ".join(f"{name}: {len(case['processes'])} processes" for name, case in record["cases"].items())
    print(f"wrote {args.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
