"""PACMod 3 messages: interfaces/pacmod3_msgs against the upstream ROS 2 layout, the classes
generated from it exchanged between two processes over Fast DDS, and rosbag2 files of them
decoded by sps_driving.ros.bagio (with a bag's own stored definitions taking precedence)."""

import importlib
import inspect
import json
import subprocess
import sys
import textwrap

import pytest
from rosbags.rosbag2 import Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from sps_driving.ros import bagio, msgs

# astuff/pacmod3_msgs (ROS 2) GlobalRpt after its header, in order. The ROS 1 layout differs.
UPSTREAM_GLOBAL_RPT = [
    "enabled",
    "override_active",
    "user_can_timeout",
    "steering_can_timeout",
    "brake_can_timeout",
    "subsystem_can_timeout",
    "vehicle_can_timeout",
    "pacmod_sys_fault_active",
    "supervisory_enable_required",
    "config_fault_active",
    "user_can_read_errors",
]
MESSAGES = ["GlobalRpt", "SteeringCmd", "SystemCmdFloat", "SystemCmdInt", "SystemRptFloat", "SystemRptInt", "VehicleSpeedRpt"]
# .msg type -> rosidl's name for it in get_fields_and_field_types()
ROSIDL_TYPES = {"bool": "boolean", "float64": "double", "uint16": "uint16"}


def msg_file(name):
    """(constants [(name, type, value)], fields [(name, type)]) of interfaces/pacmod3_msgs/msg/<name>.msg."""
    typename = f"pacmod3_msgs/msg/{name}"
    consts, fields = get_types_from_msg(bagio.pacmod3_definitions()[typename], typename)[typename]
    return consts, [(field, desc[1][0] if isinstance(desc[1], tuple) else desc[1]) for field, desc in fields]


def test_msg_files_are_the_upstream_ros2_layout():
    assert sorted(bagio.pacmod3_definitions()) == [f"pacmod3_msgs/msg/{name}" for name in MESSAGES]
    _, fields = msg_file("GlobalRpt")
    assert fields[0] == ("header", "std_msgs/msg/Header")
    assert [name for name, _ in fields[1:]] == UPSTREAM_GLOBAL_RPT
    assert dict(fields)["user_can_read_errors"] == "uint16"
    consts, _ = msg_file("SystemCmdInt")
    assert dict((n, v) for n, _, v in consts)["TURN_HAZARDS"] == 3 and msg_file("SystemRptInt")[0] == consts


def test_generated_classes_have_the_msg_files_fields_and_constants():
    try:
        generated = importlib.import_module("pacmod3_msgs.msg")
    except ImportError as exc:
        pytest.skip(f"pacmod3_msgs is not importable ({exc}); `make setup` builds it from interfaces/")
    assert list(generated.GlobalRpt.get_fields_and_field_types())[1:] == UPSTREAM_GLOBAL_RPT
    for name in MESSAGES:
        consts, fields = msg_file(name)
        cls = getattr(generated, name)
        expected = {field: ROSIDL_TYPES.get(kind, kind.replace("/msg/", "/")) for field, kind in fields}
        assert list(cls.get_fields_and_field_types().items()) == list(expected.items()), name
        assert [(c, getattr(cls, c)) for c, _, _ in consts] == [(c, v) for c, _, v in consts], name


def as_dict(msg):
    """An rclpy message's fields as JSON-ready values (header flattened)."""
    out = {name: getattr(msg, name) for name in msg.get_fields_and_field_types() if name != "header"}
    out["header"] = [msg.header.stamp.sec, msg.header.stamp.nanosec, msg.header.frame_id]
    return out


# A second process subscribes and prints, as JSON, every field of each report it receives.
LISTENER = inspect.getsource(as_dict) + textwrap.dedent(
    """
    import json, sys, time
    import rclpy
    from pacmod3_msgs.msg import GlobalRpt, SystemRptFloat
    from sps_driving.ros import msgs

    expected = {"/test/pacmod3/global_rpt": int(sys.argv[1]), "/test/pacmod3/system_rpt": int(sys.argv[2])}
    received = {topic: [] for topic in expected}
    rclpy.init()
    node = rclpy.create_node("pacmod3_report_listener")
    for topic, cls in (("/test/pacmod3/global_rpt", GlobalRpt), ("/test/pacmod3/system_rpt", SystemRptFloat)):
        node.create_subscription(cls, topic, lambda m, t=topic: received[t].append(as_dict(m)), msgs.qos("status"))
    end = time.monotonic() + 30
    while time.monotonic() < end and any(len(received[t]) < n for t, n in expected.items()):
        rclpy.spin_once(node, timeout_sec=0.05)
    print(json.dumps(received))
    """
)


def one_hot_reports(cls, flags, extra):
    """One report per flag with only that flag set, so a swapped or shifted field shows; `extra(i)`
    gives the other fields' values, distinct per report."""
    from std_msgs.msg import Header

    reports = []
    for i, flag in enumerate(flags):
        header = Header(frame_id=f"pacmod_{i}")
        header.stamp.sec, header.stamp.nanosec = 1_700_000_000 + i, 1000 * i + 7
        reports.append(cls(header=header, **{f: f == flag for f in flags}, **extra(i)))
    return reports


@pytest.mark.ros
def test_reports_cross_processes_over_fast_dds_with_every_field():
    msg_module = pytest.importorskip("pacmod3_msgs.msg", reason="`make setup` builds pacmod3_msgs from interfaces/")
    from ros_helpers import Probe

    global_flags = [f for f in UPSTREAM_GLOBAL_RPT if f != "user_can_read_errors"]
    global_rpts = one_hot_reports(msg_module.GlobalRpt, global_flags, lambda i: {"user_can_read_errors": 65535 - 1000 * i})
    system_fields = msg_module.SystemRptFloat.get_fields_and_field_types()
    system_flags = [f for f, kind in system_fields.items() if kind == "boolean"]
    system_rpts = one_hot_reports(
        msg_module.SystemRptFloat, system_flags,
        lambda i: {"manual_input": -0.1 * (i + 1), "command": 0.125 * i, "output": 1e-9 + i},
    )
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(len(global_rpts)), str(len(system_rpts))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    probe = Probe("pacmod3_report_talker")
    try:
        global_pub = probe.publisher("/test/pacmod3/global_rpt", msg_module.GlobalRpt, "status")
        system_pub = probe.publisher("/test/pacmod3/system_rpt", msg_module.SystemRptFloat, "status")
        matched = probe.spin_until(
            lambda: global_pub.get_subscription_count() > 0 and system_pub.get_subscription_count() > 0, 30
        )
        assert matched, "the listener process never subscribed"
        for msg in global_rpts:
            global_pub.publish(msg)
        for msg in system_rpts:
            system_pub.publish(msg)
        probe.spin(0.2)
        out, err = listener.communicate(timeout=40)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
        probe.close()
    assert listener.returncode == 0, err
    received = json.loads(out.strip().splitlines()[-1])
    assert received["/test/pacmod3/global_rpt"] == [as_dict(m) for m in global_rpts]
    assert received["/test/pacmod3/system_rpt"] == [as_dict(m) for m in system_rpts]


def bag_reports(t0):
    """One report of each PACMod 3 type, every field set to a value that tells it from its neighbours."""
    t = bagio.TYPESTORE.types
    header = bagio.to_bag(msgs.header_fields(t0, "pacmod"))
    flags = {f: i % 3 == 1 for i, f in enumerate(UPSTREAM_GLOBAL_RPT[:-1])}
    system_flags = dict(
        enabled=True, override_active=False, command_output_fault=True, input_output_fault=False,
        output_reported_fault=False, pacmod_fault=True, vehicle_fault=False, command_timeout=True,
    )
    cmd_flags = dict(enable=True, ignore_overrides=False, clear_override=True)
    return {
        "/pacmod/global_rpt": t["pacmod3_msgs/msg/GlobalRpt"](header=header, **flags, user_can_read_errors=4321),
        "/pacmod/steering_rpt": t["pacmod3_msgs/msg/SystemRptFloat"](
            header=header, **system_flags, manual_input=-0.25, command=0.5, output=0.375
        ),
        "/pacmod/turn_rpt": t["pacmod3_msgs/msg/SystemRptInt"](header=header, **system_flags, manual_input=1, command=3, output=2),
        "/pacmod/vehicle_speed_rpt": t["pacmod3_msgs/msg/VehicleSpeedRpt"](header=header, vehicle_speed=12.5, vehicle_speed_valid=True),
        "/pacmod/steering_cmd": t["pacmod3_msgs/msg/SteeringCmd"](header=header, **cmd_flags, command=-1.5, rotation_rate=3.25),
        "/pacmod/accel_cmd": t["pacmod3_msgs/msg/SystemCmdFloat"](header=header, **cmd_flags, command=0.3),
        "/pacmod/turn_cmd": t["pacmod3_msgs/msg/SystemCmdInt"](header=header, **cmd_flags, command=3),
    }


def fields(msg):
    """Every field of a rosbags message, nested messages flattened, in declaration order."""
    out = []
    for name in msg.__dataclass_fields__:
        if name == "__msgtype__":
            continue
        value = getattr(msg, name)
        out += [(f"{name}.{k}", v) for k, v in fields(value)] if hasattr(value, "__msgtype__") else [(name, value)]
    return out


def write_and_read_upstream_reports(path, storage):
    """Write one report of each type with BagWriter (our definitions), read it back with bagio."""
    t0 = 1_700_000_000_123_456_789
    written = bag_reports(t0)
    with bagio.BagWriter(path, storage) as bag:
        for i, (topic, msg) in enumerate(written.items()):
            bag.write(topic, msg, t0 + i)
    return written, {m.topic: m for m in bagio.read_messages(path)}


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_bag_of_upstream_layout_reports_decodes_field_for_field(tmp_path, storage):
    written, read = write_and_read_upstream_reports(tmp_path / "bag", storage)
    assert sorted(read) == sorted(written)
    for topic, msg in written.items():
        assert read[topic].msgtype == msg.__msgtype__
        assert fields(read[topic].msg) == fields(msg), topic
    assert [name for name, _ in fields(read["/pacmod/global_rpt"].msg)][3:] == UPSTREAM_GLOBAL_RPT


# GlobalRpt as first published (ROS 1 pacmod_msgs heritage): same type name, other fields and order.
OLD_GLOBAL_RPT = """
std_msgs/Header header
bool enabled
bool override_active
bool fault_active
bool config_fault_active
bool user_can_timeout
bool brake_can_timeout
bool steering_can_timeout
bool vehicle_can_timeout
bool subsystem_can_timeout
bool user_can_read_errors
"""


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_a_bags_stored_definition_wins_over_ours(tmp_path, storage):
    """A bag recorded with the old GlobalRpt decodes with the layout it stores, and a report type it
    stores no definition for decodes with ours; neither changes how the next bag is read."""
    name = "pacmod3_msgs/msg/GlobalRpt"
    old = get_typestore(Stores.ROS2_HUMBLE)
    old.register(get_types_from_msg(OLD_GLOBAL_RPT, name))
    t0 = 1_700_000_000 * 10**9
    old_flags = [field for field, _ in old.fielddefs[name][1]][1:]  # after the header, all bool
    recorded = [old.types[name](header=bagio.to_bag(msgs.header_fields(t0 + i)), **{f: f == flag for f in old_flags}) for i,
                flag in enumerate(old_flags)]
    system_rpt = bag_reports(t0)["/pacmod/steering_rpt"]
    writer = Writer(tmp_path / "old", version=9, storage_plugin=bagio.STORAGES[storage])
    with writer:
        conn = writer.add_connection("/pacmod/global_rpt", name, msgdef=OLD_GLOBAL_RPT.strip(), rihs01="RIHS01_" + "0" * 64)
        for i, msg in enumerate(recorded):
            writer.write(conn, t0 + i, old.serialize_cdr(msg, name))
        # No stored definition for this one (as in bags recorded on Humble): ours applies.
        bare = writer.add_connection("/pacmod/steering_rpt", system_rpt.__msgtype__, msgdef="", rihs01="RIHS01_" + "0" * 64)
        writer.write(bare, t0 + 100, bagio.TYPESTORE.serialize_cdr(system_rpt, system_rpt.__msgtype__))

    read = list(bagio.read_messages(tmp_path / "old"))
    reports = [m.msg for m in read if m.topic == "/pacmod/global_rpt"]
    assert [fields(m) for m in reports] == [fields(m) for m in recorded]
    assert [[f for f in old_flags if getattr(m, f)] for m in reports] == [[f] for f in old_flags]
    assert fields(next(m.msg for m in read if m.topic == "/pacmod/steering_rpt")) == fields(system_rpt)

    # Ours is untouched: a bag of the upstream layout read afterwards still decodes with it.
    assert [f for f in bagio.TYPESTORE.types[name].__dataclass_fields__ if f != "__msgtype__"][1:] == UPSTREAM_GLOBAL_RPT
    written, read = write_and_read_upstream_reports(tmp_path / "next", storage)
    assert fields(read["/pacmod/global_rpt"].msg) == fields(written["/pacmod/global_rpt"])
