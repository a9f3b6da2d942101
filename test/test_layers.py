"""The layers of the package, read from the source (scripts/structure.py; imports inside functions
included): no module imports another's private name, no import circle between modules nor between rooms, core imports nothing
outside core, and everything core reaches stays out of sps_driving/export (export builds from
core, never the other way) and out of ROS."""

import importlib.util
import sys
from pathlib import Path

import sps_driving

PACKAGE_DIR = Path(sps_driving.__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("structure", PACKAGE_DIR.parent / "scripts" / "structure.py")
structure = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(structure)
PACKAGE = structure.Package(PACKAGE_DIR)
imports_of, reachable_from = PACKAGE.imports_of, PACKAGE.reachable_from


def is_ros(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("rclpy", "rosidl_runtime_py") or top.endswith("_msgs")


def core_modules() -> set[str]:
    return {name for name in PACKAGE.paths if name == "sps_driving.core" or name.startswith("sps_driving.core.")}


def test_the_import_walk_sees_function_level_imports():
    """The walk would find a violation: runtimes imports `tensorrt` only inside functions."""
    assert "tensorrt" in imports_of("sps_driving.core.backbones.runtimes")
    package, _ = reachable_from({"sps_driving.export.tensorrt"})
    assert "sps_driving.core.backbones.runtimes" in package


def test_core_never_reaches_export_or_ros():
    roots = core_modules()
    assert "sps_driving.core.backbones.runtimes" in roots and len(roots) > 10
    package, outside = reachable_from(roots)
    upward = sorted(m for m in package if m.startswith("sps_driving.export"))
    assert not upward, f"core reaches {upward}"
    assert not {m for m in package if m.startswith("sps_driving.ros.nodes")}
    assert not {m for m in outside if is_ros(m)}, sorted(outside)
    assert is_ros("sensor_msgs.msg") and is_ros("rclpy.node")


def test_node_modules_load_torch_only_when_a_node_starts():
    """Importing every node module (as `ros2 run` and the launch do) loads neither torch nor onnxruntime."""
    import subprocess
    import sys

    from sps_driving.ros.graph import NODES

    script = (
        "import importlib, sys\n"
        f"for name in {list(NODES)!r}: importlib.import_module('sps_driving.ros.nodes.' + name)\n"
        "print(sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=PACKAGE_DIR.parent)
    assert out.stdout.strip() == "[]"


def test_no_module_imports_a_private_name_of_another():
    assert not PACKAGE.private_imports(), [f"{i.importer}:{i.line} -> {i.module}.{i.name}" for i in PACKAGE.private_imports()]


def test_no_import_circles_between_modules():
    assert not structure.circles(PACKAGE.module_graph())


def test_rooms_import_one_way_but_for_a_package_and_its_own_sub_package():
    """Between rooms (sub-packages) imports run one way, so the rooms stand on floors. The one kind
    of circle allowed is a package's own modules with one of its sub-packages (core.orbital reads
    DINOv2 states from core.backbones, which uses core's image helpers)."""
    for circle in structure.circles(PACKAGE.room_graph()):
        outer, inner = sorted(circle)[0], sorted(circle)[-1]
        assert len(circle) == 2 and inner.startswith(outer + "."), f"rooms in a circle: {circle}"


def test_core_imports_nothing_outside_core():
    upward = PACKAGE.upward_imports("sps_driving.core")
    assert not upward, [f"{i.importer}:{i.line} -> {i.module}" for i in upward]


def test_the_checks_would_see_a_circle_a_private_import_and_an_upward_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "core").mkdir(parents=True)
    for name in ("__init__.py", "core/__init__.py", "tools.py"):
        (package / name).write_text("")
    (package / "core" / "a.py").write_text("def f():\n    from pkg.core import b\n")
    (package / "core" / "b.py").write_text("from pkg.core.a import f\nfrom pkg.tools import _helper\n")
    seeded = structure.Package(package)
    assert structure.circles(seeded.module_graph()) == [["pkg.core.a", "pkg.core.b"]]
    assert [(i.module, i.name) for i in seeded.private_imports()] == [("pkg.tools", "_helper")]
    assert [i.module for i in seeded.upward_imports("pkg.core")] == ["pkg.tools"]
