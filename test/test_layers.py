"""The layers of the package, read from the source: everything sps_driving/core imports, directly or
through other modules of the package (imports inside functions included), stays out of
sps_driving/export (export builds from core, never the other way) and out of ROS."""

import ast
from pathlib import Path

import sps_driving

PACKAGE_DIR = Path(sps_driving.__file__).resolve().parent


def is_ros(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("rclpy", "rosidl_runtime_py") or top.endswith("_msgs")


def module_path(name: str) -> Path | None:
    """The source file of package module `name` (a package's __init__.py), or None."""
    relative = Path(*name.split(".")[1:])
    for path in (PACKAGE_DIR / relative.with_suffix(".py"), PACKAGE_DIR / relative / "__init__.py"):
        if path.is_file():
            return path
    return None


def imports_of(name: str) -> set[str]:
    """Every module named by an import statement anywhere in module `name`, absolute."""
    path = module_path(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from pkg import module` names a module too
            found.update(f"{base}.{alias.name}" for alias in node.names if module_path(f"{base}.{alias.name}"))
    return found


def reachable_from(roots: set[str]) -> tuple[set[str], set[str]]:
    """(package modules, outside modules) reachable by imports from `roots`."""
    seen, outside, todo = set(), set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in imports_of(name):
            if imported.split(".")[0] != "sps_driving":
                outside.add(imported)
                continue
            parts = imported.split(".")
            # importing a.b.c runs a and a.b first
            for depth in range(2, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                if module_path(prefix) and prefix not in seen:
                    todo.append(prefix)
    return seen, outside


def core_modules() -> set[str]:
    return {
        "sps_driving." + ".".join(p.relative_to(PACKAGE_DIR).with_suffix("").parts).removesuffix(".__init__")
        for p in (PACKAGE_DIR / "core").rglob("*.py")
    }


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
    """nodes/common.run sets OMP_WAIT_POLICY before a node is built; torch reads it when it loads."""
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
