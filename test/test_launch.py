"""The car launch file, checked without the `launch` package: every node is a real entry point,
every parameter it sets (directly or through the params file) is declared by that node with a
value the node accepts, every argument it uses is declared, and remaps name topics the nodes use.
This reading of the XML is checked against what the real launch (Jazzy's) resolved the file to,
test/data/car_launch_resolved.json, written by scripts/resolve_launch.py."""

import configparser
import functools
import importlib.util
import json
import pkgutil
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from sps_driving.core import topics
from sps_driving.ros.nodes.common import specs

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch" / "sps_driving.launch.xml"
EVERY_NODE = "/**"  # the params file's section for every node that declares its parameters
RESOLVED = ROOT / "test" / "data" / "car_launch_resolved.json"


@functools.cache
def setup_entry_points() -> dict:
    """{executable: "module:function"} of the console scripts setup.py declares, as a build sees them."""
    with tempfile.TemporaryDirectory() as egg_base:
        subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", egg_base], cwd=ROOT, check=True,
                       capture_output=True)
        parser = configparser.ConfigParser()
        parser.read(Path(egg_base) / "sps_driving.egg-info" / "entry_points.txt")
    return dict(parser["console_scripts"])


def test_setup_builds_an_executable_for_every_node_and_the_tools_start_only_those():
    from sps_driving.ros.executables import NODES
    from sps_driving.sim.graph_eval import GRAPH_NODES as SIM_NODES
    from sps_driving.tools.replay import GRAPH_NODES as REPLAY_NODES

    node_modules = {m.name for m in pkgutil.iter_modules([str(ROOT / "sps_driving" / "ros" / "nodes")]) if m.name != "common"}
    assert set(NODES) == node_modules
    assert {k: v for k, v in setup_entry_points().items() if k not in ("sps-driving", "respawn")} == {
        name: f"sps_driving.ros.nodes.{name}:main" for name in NODES}
    assert setup_entry_points()["respawn"] == "sps_driving.ros.respawn:main"
    assert set(REPLAY_NODES) <= set(NODES) and set(SIM_NODES) <= set(NODES)


@pytest.fixture(scope="module")
def launch():
    return ET.parse(LAUNCH).getroot()


def substituted(text: str, arguments: dict) -> str:
    """`text` with `$(var NAME)` replaced by the argument's default and `$(find-pkg-share ...)` by a path."""
    text = re.sub(r"\$\(find-pkg-share ([a-z_]+)\)", r"/opt/ros/share/\1", text)
    return re.sub(r"\$\(var ([a-z_]+)\)", lambda m: substituted(arguments[m.group(1)], arguments), text)


def params_file_sections() -> tuple[dict, dict]:
    """config/graph.yaml as ({node: its parameters}, the parameters of every node)."""
    sections = {name: s["ros__parameters"] for name, s in yaml.safe_load((ROOT / "config" / "graph.yaml").read_text()).items()}
    return sections, sections.pop(EVERY_NODE, {})


def as_launch_types_it(text: str):
    """A `<param value>` as launch_ros passes it to the node: YAML-typed, so `1` is an int and
    `0` is not the string "0"; an empty value stays the empty string."""
    return "" if text == "" else yaml.safe_load(text)


def test_nodes_are_entry_points_with_main(launch):
    entry_points = setup_entry_points()
    nodes = launch.findall("node")  # ours; the PACMod 3 driver's are in a group
    assert {n.get("exec") for n in nodes} == {
        "camera_driver", "selection", "extractor", "policy", "vehicle_interface", "safety_monitor", "failsafe"
    }
    for node in nodes:
        assert node.get("pkg") == "sps_driving"
        assert node.get("exec") in entry_points
        module = importlib.import_module(f"sps_driving.ros.nodes.{node.get('exec')}")
        assert callable(module.main) and module.PARAMETERS
        # The node's ROS name is the one the params file is keyed by, and it has a namespace: launch
        # then keys its <param> values by the full node name, so they override the params file's
        # section; without one they land under /** and the params file wins (checked with the real
        # Humble and Jazzy launch: every launch argument was ignored).
        assert node.get("name") == node.get("exec")
        assert node.get("namespace") == "/"


def test_the_perception_nodes_run_under_the_supervisor_and_the_nodes_that_stop_the_car_do_not(launch):
    from sps_driving.ros.graph import NEVER_RESPAWNED

    arguments = {a.get("name"): a.get("default") for a in launch.iter("arg")}
    respawn = next(let.get("value") for let in launch.iter("let") if let.get("name") == "respawn")
    assert respawn == "$(find-pkg-prefix sps_driving)/lib/sps_driving/respawn --enabled $(var respawn_perception)"
    assert arguments["respawn_perception"] == "true"
    for node in launch.findall("node"):
        name = node.get("name")
        if name in NEVER_RESPAWNED:
            assert node.get("launch-prefix") is None, name
        else:
            assert node.get("launch-prefix") == f"$(var respawn) --name {name} --", name


def test_the_driver_starts_before_our_nodes(launch):
    children = list(launch)
    driver = next(i for i, c in enumerate(children) if c.tag == "group" and c.get("if") == "$(var launch_driver)")
    assert driver < min(i for i, c in enumerate(children) if c.tag == "node")  # a missing driver package fails first
    drivers = [n for n in children[driver].iter("node") if n.get("pkg") == "pacmod3"]
    assert drivers and all(n.get("name") == "pacmod3_driver" for n in drivers)
    assert '"sps_driving.launch.xml"' in (ROOT / "launch" / "sps_driving.launch.py").read_text()


def test_both_car_launch_files_pass_a_sigint_to_the_launch_alone_on_before_any_process_starts(launch):
    # sps_driving.launch.py includes the XML, so the XML's include covers both files; before the
    # driver and our nodes, so that the handlers know every process launch starts.
    children = [c for c in launch if c.tag in ("include", "group", "node")]
    assert children[0].tag == "include" and children[0].get("file") == "$(dirname)/stop_on_sigint.launch.py"
    assert (ROOT / "launch" / "stop_on_sigint.launch.py").is_file()


def car_launch_module(monkeypatch, file="sps_driving.launch.py"):
    """A Python launch file of launch/ with `launch`'s classes as recording stand-ins (`launch` is not
    on PyPI; the files were run under the real Humble and Jazzy front ends, docs/vehicle.md)."""
    class Recorded:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    names = {"launch": ["LaunchDescription"], "launch.actions": ["IncludeLaunchDescription", "LogInfo", "RegisterEventHandler", "Shutdown"],
             "launch.conditions": ["IfCondition"], "launch.event_handlers": ["OnProcessExit", "OnProcessStart", "OnShutdown"],
             "launch.launch_description_sources": ["AnyLaunchDescriptionSource"], "launch.substitutions": ["LaunchConfiguration"]}
    for module_name, classes in names.items():
        module = type(sys)(module_name)
        for name in classes:
            setattr(module, name, type(name, (Recorded,), {}))
        monkeypatch.setitem(sys.modules, module_name, module)
    spec = importlib.util.spec_from_file_location(file.split(".")[0], ROOT / "launch" / file)
    car_launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(car_launch)
    return car_launch


def car_launch_exit_handler(monkeypatch):
    """(matcher, on_exit) of the car launch's process-exit handler."""
    graph, tie = car_launch_module(monkeypatch).generate_launch_description().args[0]
    assert tie.kwargs["condition"].args[0].args == ("launch_driver",)
    handler = tie.args[0].kwargs
    return handler["target_action"], handler["on_exit"]


@pytest.mark.parametrize("due_to_sigint", [True, False])
def test_a_sigint_to_the_launch_alone_reaches_every_process_it_still_runs(monkeypatch, due_to_sigint):
    """launch takes any SIGINT for a terminal's Ctrl-C and signals nothing for 5 s: the car launch
    passes it on to each process started and not yet exited (real processes here), and leaves a
    shutdown of another cause to launch."""
    passer = car_launch_module(monkeypatch, "stop_on_sigint.launch.py").SigintToEveryProcess()
    event = lambda **fields: type("Event", (), fields)()  # noqa: E731
    # Default SIGINT action (end), as each node sets its own, even where the test runs with SIGINT
    # ignored (a non-interactive shell's background job), which children would inherit.
    children = [subprocess.Popen(["sleep", "30"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
                for _ in range(3)]
    try:
        for i, child in enumerate(children):
            passer.started(event(pid=child.pid, process_name=f"node-{i}"), None)
        children[2].kill()
        children[2].wait()
        passer.exited(event(pid=children[2].pid), None)
        said = passer.on_shutdown(event(due_to_sigint=due_to_sigint), None)
        if due_to_sigint:
            assert [child.wait(timeout=10) for child in children[:2]] == [-signal.SIGINT] * 2
            assert "node-0" in said[0].kwargs["msg"] and "node-2" not in said[0].kwargs["msg"]
        else:
            assert said is None and [child.poll() for child in children[:2]] == [None, None]
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_launch_started_with_sigint_ignored_takes_it_again(monkeypatch):
    """`ros2 launch ... &` in a script starts launch with SIGINT ignored, and launch hears SIGINT
    only through Python's handler: the car launch puts that handler back (and says so)."""
    car_launch = car_launch_module(monkeypatch, "stop_on_sigint.launch.py")
    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        told = car_launch.generate_launch_description().args[0][0]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert "SIGINT was ignored" in told.kwargs["msg"]
        assert not car_launch.take_sigint_again()  # not ignored: left as it is
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("order", [("/vehicle_interface", "/failsafe"), ("/failsafe", "/vehicle_interface")])
def test_with_the_driver_the_car_launch_shuts_down_once_neither_node_that_stops_the_car_is_left(monkeypatch, order):
    # While the failsafe or the vehicle interface lives it stops the car; with both gone the
    # driver would re-send the last command, so the launch must stop it.
    matcher, on_exit = car_launch_exit_handler(monkeypatch)
    node = lambda name: type("Node", (), {"node_name": name})()  # noqa: E731
    assert [matcher(node(n)) for n in ("/vehicle_interface", "/failsafe", "/policy", "/pacmod3_driver")] == [True, True, False, False]
    assert not matcher(object())  # a process that is not a node
    exit_of = lambda name: type("ProcessExited", (), {"action": node(name)})()  # noqa: E731
    assert on_exit(exit_of(order[0]), None) is None
    assert on_exit(exit_of(order[0]), None) is None  # the same node twice is still one of two
    log, shutdown = on_exit(exit_of(order[1]), None)
    assert type(shutdown).__name__ == "Shutdown" and "both exited" in log.kwargs["msg"]


def test_every_parameter_set_is_declared_and_allowed(launch):
    sections, every_node = params_file_sections()
    arguments = {a.get("name"): a.get("default") for a in launch.findall("arg")}
    for node in launch.findall("node"):
        declared = specs(importlib.import_module(f"sps_driving.ros.nodes.{node.get('exec')}").PARAMETERS)
        for param in node.findall("param"):
            if param.get("from"):
                assert "params_file" in param.get("from")
                continue
            name = param.get("name")
            assert name in declared, f"{node.get('exec')} does not declare {name}"
            declared[name].convert(as_launch_types_it(substituted(param.get("value"), arguments)))
        from_file = {**{k: v for k, v in every_node.items() if k in declared}, **sections[node.get("name")]}
        assert set(from_file) == set(declared), node.get("exec")
        for name, value in from_file.items():
            # The node would take an int for a float; the file still spells each type out.
            assert type(value) is type(declared[name].default), f"{node.get('exec')}.{name}: {value!r} vs {declared[name].default!r}"
            assert declared[name].convert(value) == value


def test_the_car_runs_the_shipped_policy_by_default(launch):
    from sps_driving.core.resources import SHIPPED_POLICY
    from sps_driving.ros.nodes import policy

    sections, _ = params_file_sections()
    arguments = {a.get("name"): a.get("default") for a in launch.findall("arg")}
    assert sections["policy"]["checkpoint"] == policy.PARAMETERS["checkpoint"].default == SHIPPED_POLICY
    assert arguments["checkpoint"] == f"$(find-pkg-share sps_driving)/{SHIPPED_POLICY}"


def test_operator_arguments_typed_by_launch_reach_the_node_as_declared():
    """`selection_rate:=1` arrives as an int and `camera_source:=0` (a V4L2 index) as an int:
    the nodes take them as the number 1.0 and the string "0"."""
    from sps_driving.ros.nodes import camera_driver, selection

    rate = selection.PARAMETERS["rate"].convert(as_launch_types_it("1"))
    assert rate == 1.0 and type(rate) is float
    assert camera_driver.PARAMETERS["source"].convert(as_launch_types_it("0")) == "0"
    with pytest.raises(ValueError, match=r"^2; allowed: a finite number > 0 and <= 1$"):
        selection.PARAMETERS["rate"].convert(as_launch_types_it("2"))


def test_arguments_are_declared_and_cover_the_operator_choices(launch):
    declared = {a.get("name") for a in launch.findall("arg")}
    set_here = {let.get("name") for let in launch.findall("let")}
    used = set(re.findall(r"\$\(var ([a-z_]+)\)", LAUNCH.read_text()))
    assert used <= declared | set_here and declared | set_here <= used | {"params_file"}
    for needed in ("backbone", "checkpoint", "selection_variant", "selection_rate", "camera_source", "vehicle_backend"):
        assert needed in declared
    assert all(a.get("description") for a in launch.findall("arg"))


def test_remaps_name_real_topics_and_let_a_vendor_camera_replace_ours(launch):
    known = {v for k, v in vars(topics).items() if k.isupper() and isinstance(v, str)}
    for remap in (r for n in launch.findall("node") for r in n.findall("remap")):
        assert remap.get("from") in known
    readers = {n.get("exec"): {r.get("from"): r.get("to") for r in n.findall("remap")} for n in launch.findall("node")}
    for node in ("extractor", "policy"):  # the policy reads the camera for its overlay (publish_overlay)
        assert readers[node][topics.IMAGE] == "$(var camera_topic)"
    for node in ("selection", "vehicle_interface"):
        assert readers[node][topics.CAMERA_INFO] == "$(var camera_info_topic)"
    camera = [n for n in launch.findall("node") if n.get("exec") == "camera_driver"][0]
    assert camera.get("unless") == "$(var use_vendor_camera)"


def test_params_file_sections_are_nodes_the_graph_can_start():
    from sps_driving.ros.executables import NODES

    sections, every_node = params_file_sections()
    assert set(sections) <= set(NODES) and set(NODES) <= set(setup_entry_points())
    declared = {name: specs(importlib.import_module(f"sps_driving.ros.nodes.{name}").PARAMETERS) for name in NODES}
    for name, section in sections.items():
        assert set(section) <= set(declared[name]), name
    # A parameter for every node is declared by some node, with the same type and allowed by each.
    for parameter, value in every_node.items():
        takers = [table[parameter] for table in declared.values() if parameter in table]
        assert takers, f"{EVERY_NODE}: no node declares {parameter}"
        for spec in takers:
            assert type(value) is type(spec.default) and spec.convert(value) == value, parameter


def test_the_policy_reads_the_speed_the_vehicle_interface_reads_and_a_target_below_its_cap(launch):
    """One launch argument chooses both nodes' vehicle backend (where the car's speed is read), the
    params file sets them alike, and the policy's fallback cruise target is below the speed at which
    the vehicle interface cuts the accelerator."""
    sections, _ = params_file_sections()
    assert sections["policy"]["vehicle_backend"] == sections["vehicle_interface"]["backend"]
    assert 0 < sections["policy"]["target_speed_mps"] < sections["vehicle_interface"]["max_speed_mps"]
    values = {n.get("exec"): {p.get("name"): p.get("value") for p in n.findall("param")} for n in launch.findall("node")}
    assert values["policy"]["vehicle_backend"] == values["vehicle_interface"]["backend"] == "$(var vehicle_backend)"


def static_resolution(case_arguments: list[str]) -> dict:
    """What this test's reading of the XML says the launch starts with `case_arguments` (NAME:=VALUE),
    in the record's terms: the install prefix and share folder as <prefix> and <share>."""
    root = ET.parse(LAUNCH).getroot()
    arguments = {a.get("name"): a.get("default") for a in root.iter("arg")}
    arguments.update(a.split(":=", 1) for a in case_arguments)

    def expand(text: str) -> str:
        text = text.replace("$(find-pkg-share sps_driving)", "<share>").replace("$(find-pkg-prefix sps_driving)", "<prefix>")
        return re.sub(r"\$\(var ([a-z_]+)\)", lambda m: expand(arguments[m.group(1)]), text)

    def applies(element) -> bool:
        return (element.get("if") is None or expand(element.get("if")) == "true") and (
            element.get("unless") is None or expand(element.get("unless")) != "true")

    environment = {}
    for element in root:
        if element.tag == "let":
            arguments[element.get("name")] = expand(element.get("value"))
        elif element.tag == "set_env":
            environment[element.get("name")] = expand(element.get("value"))
    processes = []
    for node in (n for n in root.findall("node") if applies(n)):
        values = {}
        for param in node.findall("param"):
            if param.get("name"):
                values[param.get("name")] = as_launch_types_it(expand(param.get("value")))
        enclave = shlex.split(node.get("ros_args", ""))
        processes.append({
            "name": "/" + node.get("name"), "namespace": node.get("namespace"),
            "executable": shlex.split(expand(node.get("launch-prefix", ""))) + [f"<prefix>/lib/{node.get('pkg')}/{node.get('exec')}"],
            "launch_respawn": node.get("respawn", "false") == "true",
            "params_files": [expand(p.get("from")) for p in node.findall("param") if p.get("from")],
            "param_values": values,
            "remaps": [[r.get("from"), expand(r.get("to"))] for r in node.findall("remap")],
            "enclave": enclave[enclave.index("--enclave") + 1] if "--enclave" in enclave else None,
        })
    return {"arguments": case_arguments, "environment": environment, "processes": sorted(processes, key=lambda p: p["name"])}


@pytest.mark.parametrize("case", sorted(json.loads(RESOLVED.read_text())["cases"]))
def test_this_reading_of_the_launch_file_is_what_the_real_launch_resolved(case):
    """Each node's executable (with the supervisor and its settings), name, namespace, parameters
    (file and typed values), remaps, respawn setting and enclave, and the environment the launch
    sets: a change to the launch file that the static checks above would misread fails here.
    After a change to the launch file, regenerate the record with the real launch
    (scripts/resolve_launch.py; docs/results/car_launch.md says how)."""
    resolved = json.loads(RESOLVED.read_text())["cases"][case]
    assert static_resolution(resolved["arguments"]) == resolved


def test_the_record_covers_the_operators_choices_and_the_supervisor_switch():
    cases = json.loads(RESOLVED.read_text())["cases"]
    names = {case: {p["name"] for p in c["processes"]} for case, c in cases.items()}
    assert "/camera_driver" in names["defaults"] and "/camera_driver" not in names["operator"]  # use_vendor_camera
    supervised = {case: {p["executable"][2] for p in c["processes"] if p["executable"][0].endswith("/respawn")}
                  for case, c in cases.items()}
    assert supervised == {"defaults": {"true"}, "operator": {"false"}}
