#!/usr/bin/env bash
# The safety driver's and the engineer's ros2 commands against the car launch under `ros2 launch`,
# in the order of docs/results/car_launch.md ("Operating it"), each shown with its output:
#
#   scripts/car_launch_operate.sh FRAMES PARAMS_FILE [operate|secured]
#
# Needs the workspace sourced (`ros2`, the installed sps_driving) and a ROS domain of its own. The
# car is the PACMod 3 stand-in (a process of its own, as the driver with launch_driver:=false), the
# camera the image folder FRAMES, the lane pose and obstacle range come from `ros2 topic pub`.
# PARAMS_FILE is the launch's params_file:= (config/graph.yaml, with `loop: true` for an image
# folder). Ends every process it started.
#
# `secured` (docs/security.md; ROS_SECURITY_ENABLE=true, ROS_SECURITY_STRATEGY=Enforce and the
# keystore in the environment, made from a policy with a /sps_driving/bench enclave allowed every
# topic and service for what is not the car's): the launch's nodes in their own enclaves, the
# stand-in, the publishers and the observer's commands in the bench enclave, engagement from the
# operator enclave; then the refusals of a process without keys, without security, and of the
# policy's enclave, on /pacmod/accel_cmd and the engage service.
set -uo pipefail

frames="$(realpath "${1:?usage: $0 FRAMES PARAMS_FILE [operate|secured]}")"
params="$(realpath "${2:?usage: $0 FRAMES PARAMS_FILE [operate|secured]}")"
mode="${3:-operate}"
if [[ "$mode" == secured ]]; then
    [[ "${ROS_SECURITY_ENABLE:-}" == true && "${ROS_SECURITY_STRATEGY:-}" == Enforce ]] || {
        echo "secured: set ROS_SECURITY_ENABLE=true, ROS_SECURITY_STRATEGY=Enforce and ROS_SECURITY_KEYSTORE" >&2; exit 2; }
    export ROS_SECURITY_ENCLAVE_OVERRIDE=/sps_driving/bench  # everything here but the launch and the operator
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
logs="$(mktemp -d)"
started=()

show() { echo "\$ $*"; "$@" 2>&1; local status=$?; [[ $status -eq 0 ]] || echo "[exit $status]"; }
background() { setsid "$@" >"$logs/$(basename "$1")_${#started[@]}.log" 2>&1 & started+=($!); }
stop_all() {
    for pid in "${started[@]}"; do kill -INT -- "-$pid" 2>/dev/null; done
    sleep 8
    for pid in "${started[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    started=()
    sleep 12  # the DDS lease: let peers forget the ended processes
}
trap stop_all EXIT
sent() { show timeout 10 ros2 topic echo --once /pacmod3_standin/sent --field position; }
# the node itself, not its supervisor (whose command line names the node after its own)
node_pid() { pgrep -f "^[^ ]+ [^ ]+/lib/sps_driving/$1 --ros-args"; }
wait_for_service() {
    for _ in $(seq 90); do ros2 service list 2>/dev/null | grep -qx /vehicle_interface/engage && return 0; sleep 2; done
    echo "no engage service after 180 s"; return 1
}
engage() {
    if [[ "$mode" == secured ]]; then
        show env ROS_SECURITY_ENCLAVE_OVERRIDE=/sps_driving/operator timeout 30 ros2 service call /vehicle_interface/engage std_srvs/srv/SetBool "{data: $1}"
    else
        show timeout 30 ros2 service call /vehicle_interface/engage std_srvs/srv/SetBool "{data: $1}"
    fi
}
driving() { timeout 10 ros2 topic echo --once /pacmod3_standin/sent --field position | grep -q "^array('d', \[1.0, [-0-9.]*, 1.0, [-0-9.]*, 1.0, 0.0,"; }
engage_until_driving() {  # a stop latches: disengage, then engage again
    for attempt in $(seq 20); do
        driving && return 0
        echo "# engage, attempt $attempt"
        engage false | grep -E "Response" ; engage true | grep -E "^\\\$|Response" ; sleep 4
    done
    echo "not driving after 20 attempts"; return 1
}
start_launch() {  # the car's nodes in their own enclaves
    background env -u ROS_SECURITY_ENCLAVE_OVERRIDE ros2 launch sps_driving sps_driving.launch.py vehicle_backend:=pacmod3 "camera_source:=$frames" "params_file:=$params" "$@"
    launch_log="$logs/env_$((${#started[@]} - 1)).log"
}

echo "# these scripts at $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '(no checkout)'); sps_driving from $(ros2 pkg prefix sps_driving)"
background ros2 run sps_driving pacmod3_standin
background ros2 topic pub -r 30 /lane/pose geometry_msgs/msg/PoseStamped "{header: {frame_id: lane}}"
background ros2 topic pub -r 30 /obstacles/nearest sensor_msgs/msg/Range "{range: .inf, max_range: 100.0}"
echo "\$ ros2 launch sps_driving sps_driving.launch.py vehicle_backend:=pacmod3 camera_source:=$frames params_file:=$params safety_nice:=2"
start_launch safety_nice:=2
wait_for_service
for _ in $(seq 30); do [[ $(ros2 node list 2>/dev/null | wc -l) -ge 8 ]] && break; sleep 2; done  # discovery
show ros2 node list
if [[ "$mode" == secured ]]; then
    echo "# engage from the operator enclave, the commands at the driver"
    engage_until_driving
    show timeout 8 ros2 topic hz /pacmod/accel_cmd
    show timeout 8 ros2 topic hz /pacmod3_standin/sent
    echo "# refused, while it drives: no keys under Enforce (the keystore's root has no enclave)"
    show env ROS_SECURITY_ENCLAVE_OVERRIDE=/ timeout 20 ros2 topic pub --once /pacmod/accel_cmd pacmod3_msgs/msg/SystemCmdFloat "{enable: true, command: 0.9}"
    echo "# no security at all: it runs, and nobody of the secured graph is matched with it"
    ROS_SECURITY_ENABLE=false timeout 12 ros2 topic pub -r 10 /pacmod/accel_cmd pacmod3_msgs/msg/SystemCmdFloat "{enable: true, command: 0.9}" >"$logs/intruder.log" 2>&1 &
    intruder=$!
    sleep 4
    show env ROS_SECURITY_ENABLE=false ros2 topic info /pacmod/accel_cmd --no-daemon
    echo "\$ timeout 5 ros2 topic echo /pacmod/accel_cmd --field command | grep -c '^0.9\$'   # bench enclave"
    timeout 5 ros2 topic echo /pacmod/accel_cmd --field command | grep -c '^0.9$'
    echo "\$ timeout 5 ros2 topic echo /pacmod/accel_cmd --field command | grep -vc -- '---'"
    timeout 5 ros2 topic echo /pacmod/accel_cmd --field command | grep -vc -- '---'
    wait "$intruder"
    echo "# keys, but an enclave without the grant (the policy's)"
    show env ROS_SECURITY_ENCLAVE_OVERRIDE=/sps_driving/policy timeout 20 python "$here/test/security_peer.py" pub /pacmod/accel_cmd policy / policy_peer
    echo "# the engage service, disengaged first from the operator enclave"
    engage false
    show env ROS_SECURITY_ENCLAVE_OVERRIDE=/ timeout 20 ros2 service call /vehicle_interface/engage std_srvs/srv/SetBool "{data: true}"
    show env ROS_SECURITY_ENABLE=false timeout 20 ros2 service call /vehicle_interface/engage std_srvs/srv/SetBool "{data: true}"
    show env ROS_SECURITY_ENCLAVE_OVERRIDE=/sps_driving/policy timeout 20 ros2 service call /vehicle_interface/engage std_srvs/srv/SetBool "{data: true}"
    sent
    echo "# engaged again from the operator enclave, then Ctrl-C to the launch's process group"
    engage_until_driving
    launch_pid="${started[-1]}"
    show kill -INT -- "-$launch_pid"
    sleep 1
    sent
    sleep 9
    grep -aE "SIGINT|finished cleanly|exit code" "$launch_log" | head -12
    show pgrep -f "lib/sps_driving/(respawn|camera_driver|selection|extractor|policy|safety_monitor|vehicle_interface|failsafe) |ros2 launch"  # not the stand-in
    exit 0
fi

echo "# ros2 param dump of each node against the params file and the launch's own values"
for node in camera_driver extractor failsafe policy safety_monitor selection vehicle_interface; do
    ros2 param dump "/$node" >"$logs/$node.yaml" 2>&1
done
python - "$logs" "$params" "$frames" "$here/test" <<'EOF'
import sys
from pathlib import Path

import yaml

logs, params, frames, test_dir = sys.argv[1:]
sys.path.insert(0, test_dir)
from test_launch import static_resolution  # the record's reading of the XML: what launch gives each <param>

given = {p["name"]: p["param_values"] for p in static_resolution(
    ["vehicle_backend:=pacmod3", f"camera_source:={frames}", f"params_file:={params}", "safety_nice:=2"])["processes"]}
file = yaml.safe_load(Path(params).read_text())
rclpy_own = {"use_sim_time", "start_type_description_service"}
for node in sorted(given):
    dumped = yaml.safe_load((Path(logs) / f"{node[1:]}.yaml").read_text())[node]["ros__parameters"]
    expected = {**file.get("/**", {}).get("ros__parameters", {}), **file.get(node[1:], {}).get("ros__parameters", {})}
    expected.update({k: v.replace("<share>", "") if isinstance(v, str) else v for k, v in given[node].items()})
    differ = {k: (expected.get(k), v) for k, v in dumped.items() if k not in rclpy_own and not (
        expected.get(k) == v or (isinstance(v, str) and k in given[node] and v.endswith(str(expected.get(k)))))}
    # a /** value applies only to the nodes that declare it; the node's own section must all be there
    missing = sorted(set(file.get(node[1:], {}).get("ros__parameters", {})) - set(dumped))
    print(f"{node}: {len(dumped) - len(rclpy_own & set(dumped))} parameters, "
          f"{'equal' if not differ and not missing else f'DIFFER {differ} missing {missing}'}; from the launch: {given[node]}")
EOF

echo "# QoS of the camera, descriptor and command topics"
for topic in /camera/image_raw /sps/descriptors /sps/command /pacmod/accel_cmd; do
    show ros2 topic info -v "$topic" | grep -E "^\\\$|^Node name|^Endpoint type|Reliability|Durability"
done

echo "# engage, and the commands at the driver"
engage_until_driving
show timeout 8 ros2 topic hz /pacmod/accel_cmd
show timeout 8 ros2 topic hz /pacmod3_standin/sent
show timeout 8 ros2 topic hz /sps/command
sent

echo "# kill -9 of a perception node (the extractor, under its supervisor), driving"
engage_until_driving
sent
show ps -o pid,ppid,args -p "$(node_pid extractor)"
show kill -9 "$(node_pid extractor)"
sleep 1
sent
engage true
sleep 10
grep -aE "respawn.*extractor|controlled stop" "$launch_log" | tail -4
show pgrep -f "^[^ ]+ [^ ]+/lib/sps_driving/extractor --ros-args"
sent
echo "# the stop holds until the safety driver disengages and engages again"
engage false
engage_until_driving
show timeout 6 ros2 topic hz /pacmod/accel_cmd
sent

echo "# kill -9 of the vehicle interface, driving"
engage_until_driving
sent
show kill -9 "$(node_pid vehicle_interface)"
sleep 2
show timeout 10 ros2 topic echo --once /pacmod/brake_cmd
sent
sleep 2
sent
grep -a "vehicle interface silent" "$launch_log" | head -2
stop_all

echo "# launch arguments typed on the command line"
background ros2 run sps_driving pacmod3_standin
echo "\$ ros2 launch ... selection_checkpoint:=\"''\" selection_rate:=1"
start_launch "selection_checkpoint:=''" selection_rate:=1
wait_for_service
sleep 10
show ros2 param get /selection rate
show ros2 param get /selection checkpoint
grep -a -m1 "\[selection\]: sps rate" "$launch_log"
grep -a -m1 "dropped a frame" "$launch_log"
engage true
stop_all
echo "\$ ros2 launch ... selection_checkpoint:=\"''\" selection_rate:=abc"
start_launch "selection_checkpoint:=''" selection_rate:=abc
sleep 40
grep -a -E "cannot start|not starting it again" "$launch_log" | head -3
