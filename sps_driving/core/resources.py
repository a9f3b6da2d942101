"""Where the files shipped with the package are: config/, models/, data/, interfaces/*/msg.

A source checkout (editable install, `make demo`) uses its own folders; an installed package
(`colcon build` on the car, or a wheel) uses its share/sps_driving folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PACKAGE = "sps_driving"
SOURCE_ROOT = Path(__file__).resolve().parents[2]
# The policy the car runs by default (config/graph.yaml and the launch file name it too) and
# the timing tools time.
SHIPPED_POLICY = "models/spps30pt_dinov2"


def share_dir() -> Path:
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory
    except ImportError:
        return Path(sys.prefix) / "share" / PACKAGE
    try:
        return Path(get_package_share_directory(PACKAGE))
    except (PackageNotFoundError, OSError):  # OSError: no ROS environment (AMENT_PREFIX_PATH unset)
        return Path(sys.prefix) / "share" / PACKAGE


def package_path(relative: str) -> Path:
    """`relative` (e.g. "config/graph.yaml") in the source checkout if it is there, else in share/."""
    source = SOURCE_ROOT / relative
    if source.exists() and (SOURCE_ROOT / "package.xml").is_file():
        return source
    return share_dir() / relative


def config_path(name: str) -> Path:
    return package_path(f"config/{name}")


def shipped_policy() -> Path:
    return package_path(SHIPPED_POLICY)


def repository_path(path) -> str | None:
    """`path` relative to the source checkout, share/sps_driving or the working directory when
    inside one (e.g. "runs/q/sps50"), else None. The working directory counts because a campaign
    runs a step's pinned code (a checkout of its own) from the repository root, whose folders
    the step reads and writes."""
    path = Path(path).resolve()
    working = Path.cwd().resolve()
    for root in (SOURCE_ROOT, share_dir().resolve(), *([working] if working != Path(working.anchor) else [])):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return None


def portable_path(path) -> str:
    """`path` as result files record it, naming no folder of the machine that wrote them:
    `repository_path` (e.g. "models/sps50_dinov2") when it has one, else the folder's own name."""
    return repository_path(path) or Path(path).resolve().name


def portable_record(value):
    """A JSON record (a policy's config.json, a run's provenance) with every absolute path in it,
    alone or as a word of a command line, written as `portable_path` writes it: a file that ships
    names no folder of the machine that made it."""
    if isinstance(value, dict):
        return {key: portable_record(item) for key, item in value.items()}
    if isinstance(value, list):
        return [portable_record(item) for item in value]
    if isinstance(value, str) and "/" in value:
        return " ".join(portable_path(word) if word.startswith("/") else word for word in value.split(" "))
    return value


def recorded_path(recorded: str) -> Path:
    """A path read from a result file: relative ones (`repository_path`) from this checkout or
    share/, else from the working directory where they are there; absolute ones (as older result
    files have them) as they are."""
    path = Path(recorded)
    if path.is_absolute():
        return path
    packaged = package_path(recorded)
    return path.resolve() if not packaged.exists() and path.exists() else packaged


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


def read_format_json(path: Path, file_format: str, what: str, missing_hint: str) -> dict:
    """The JSON object at `path` whose "format" is `file_format` (a policy config, a cache's meta):
    FileNotFoundError with `missing_hint` when it is not there, ValueError when it is not such a
    file. `what` names it in the errors."""
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}: {missing_hint}")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {path} is not valid JSON: {err}") from err
    if not isinstance(value, dict) or value.get("format") != file_format:
        raise ValueError(f"{path} is not a {what} of format {file_format!r}")
    return value
