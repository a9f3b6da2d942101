"""Where the files shipped with the package are: config/, models/, data/, interfaces/*/msg.

A source checkout (editable install, `make demo`) uses its own folders; an installed package
(`colcon build` on the car, or a wheel) uses its share/sps_driving folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = "sps_driving"
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def share_dir() -> Path:
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory
    except ImportError:
        return Path(sys.prefix) / "share" / PACKAGE
    try:
        return Path(get_package_share_directory(PACKAGE))
    except PackageNotFoundError:
        return Path(sys.prefix) / "share" / PACKAGE


def package_path(relative: str) -> Path:
    """`relative` (e.g. "config/graph.yaml") in the source checkout if it is there, else in share/."""
    source = SOURCE_ROOT / relative
    if source.exists() and (SOURCE_ROOT / "package.xml").is_file():
        return source
    return share_dir() / relative


def config_path(name: str) -> Path:
    return package_path(f"config/{name}")


def source_revision() -> str:
    """The git revision of a source checkout (with "+changes" when it has uncommitted ones), for
    result files; "unknown" for an installed package."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=SOURCE_ROOT, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=SOURCE_ROOT, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    revision = head.stdout.strip()
    if not revision:
        return "unknown"
    return revision + ("+changes" if dirty.stdout.strip() else "")
