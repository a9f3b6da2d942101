"""rosbag2 reading and writing without a ROS installation, through `rosbags`.

What a bag input is, for every command that reads one (`is_bag`, `open_bag`): a rosbag2 folder
(metadata.yaml and its sqlite3 or mcap storage files), or one storage file alone, a .mcap file
(what MCAP writers, Foxglove and `ros2 bag record -s mcap` copies hand out) or a .db3 file.
Anything else, or a bag rosbags cannot read, is a BagError that says which.

Bags recorded on the car (Humble or newer) and bags written by the simulator use the same
topics (sps_driving.core.topics) and are read by the same code. A bag's own stored message definitions
decide how its messages decode, so a bag recorded with another layout of a type decodes as
recorded; types a bag stores no definition for (rosbag2 sqlite3 on Humble stores none) decode with
ours: the ROS 2 distro's standard messages and the PACMod 3 messages of interfaces/pacmod3_msgs.
Writers always use ours.

Messages are written from the layouts of sps_driving.ros.msgs (`msgs.Fields`, the same field values
the live graph's rclpy messages are made of): `to_bag` makes the rosbags message of one, and
`BagWriter.write` takes either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rosbags.interfaces import MessageDefinitionFormat, Nodetype
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from sps_driving.core.resources import package_path
from sps_driving.ros.msgs import Fields

# PACMod 3 messages (astuff/pacmod3_msgs, ROS 2): the same .msg files the pacmod3_msgs interface
# package is built from where no ROS distro provides it.
PACMOD3_MSG_DIR = package_path("interfaces/pacmod3_msgs/msg")


def pacmod3_definitions() -> dict[str, str]:
    """{"pacmod3_msgs/msg/Name": .msg text} of every PACMod 3 message we know."""
    paths = sorted(PACMOD3_MSG_DIR.glob("*.msg"))
    if not paths:
        raise FileNotFoundError(f"no PACMod 3 message definitions in {PACMOD3_MSG_DIR}")
    return {f"pacmod3_msgs/msg/{path.stem}": path.read_text() for path in paths}


def _make_typestore():
    store = get_typestore(Stores.ROS2_HUMBLE)
    for name, text in pacmod3_definitions().items():
        store.register(get_types_from_msg(text, name))
    return store


TYPESTORE = _make_typestore()
STORAGES = {"sqlite3": StoragePlugin.SQLITE3, "mcap": StoragePlugin.MCAP}
STORAGE_FILES = {".mcap": "mcap", ".db3": "sqlite3"}  # a bag's storage file suffix -> its storage
METADATA = "metadata.yaml"
BAG_INPUTS = f"a rosbag2 folder (with {METADATA}), a .mcap file or a .db3 file"


class BagError(ValueError):
    """An input that is no bag, or a bag that cannot be read."""


def is_bag(path: str | Path) -> bool:
    """Whether `path` is a bag input: a rosbag2 folder or a bare .mcap / .db3 storage file."""
    path = Path(path)
    return (path.is_dir() and (path / METADATA).is_file()) or (path.is_file() and path.suffix in STORAGE_FILES)


def not_a_bag(path: str | Path, other: str | None = None) -> str:
    """Why `path` is no bag input, for a command that also takes `other` (e.g. "a feature cache")."""
    path = Path(path)
    if not path.exists():
        return f"no bag{f' or {other}' if other else ''} at {path}"
    stored = sorted(p.name for p in path.iterdir() if p.suffix in STORAGE_FILES) if path.is_dir() else []
    if stored:  # rosbag2 writes metadata.yaml when a recording ends: one stopped hard has none
        return (f"{path} is a bag folder without {METADATA} (a recording stopped before it was written): "
                f"`ros2 bag reindex {path}` writes it, or give its storage file ({', '.join(stored)})")
    return f"{path} is not a bag: expected {BAG_INPUTS}" + (f", or {other}" if other else "")


def bag_name(path: str | Path) -> str:
    """A bag's name: its folder's, or its storage file's without the suffix."""
    path = Path(path).resolve()
    return path.stem if path.suffix in STORAGE_FILES and path.is_file() else path.name


@contextmanager
def open_bag(path: str | Path) -> Iterator[Reader]:
    """An open rosbags Reader of a bag input; BagError when it is none or cannot be read."""
    path = Path(path)
    if not is_bag(path):
        raise BagError(not_a_bag(path))
    reader = Reader(path)
    try:
        reader.open()
    except Exception as exc:  # rosbags raises errors of many kinds on damaged bytes
        raise BagError(f"cannot read the bag {path}: {exc}") from exc
    try:
        yield reader
    finally:
        reader.close()


@dataclass(frozen=True)
class BagMessage:
    topic: str
    msgtype: str
    log_time_ns: int
    msg: object


def bag_typestore(connections):
    """Our types, overridden by every definition (.msg format) the bag stores for `connections`."""
    stored = {}
    for conn in connections:
        if conn.msgdef.format == MessageDefinitionFormat.MSG and conn.msgdef.data:
            stored.update(get_types_from_msg(conn.msgdef.data, conn.msgtype))
    if not stored:
        return TYPESTORE
    store = get_typestore(Stores.EMPTY)
    store.register({**TYPESTORE.fielddefs, **stored})
    return store


def topic_types(path: str | Path) -> dict[str, str]:
    with open_bag(path) as reader:
        return {conn.topic: conn.msgtype for conn in reader.connections}


def message_count(path: str | Path, topic: str) -> int:
    """How many messages the bag holds on `topic`."""
    with open_bag(path) as reader:
        return sum(conn.msgcount for conn in reader.connections if conn.topic == topic)


def read_messages(path: str | Path, topics: Iterable[str] | None = None, first: int = 0,
                  stop: int | None = None, start_ns: int | None = None, stop_ns: int | None = None) -> Iterator[BagMessage]:
    """Deserialized messages in log-time order; `topics` limits which are read, `first` and `stop`
    to those at positions first..stop-1 of that order (the ones before are not deserialized),
    `start_ns` and `stop_ns` to log times in [start_ns, stop_ns) (the storage's index skips the rest)."""
    with open_bag(path) as reader:
        wanted = set(topics) if topics is not None else None
        connections = [c for c in reader.connections if wanted is None or c.topic in wanted]
        if not connections:  # none of the topics is in the bag (rosbags reads every connection for an empty list)
            return
        store = bag_typestore(connections)
        position = 0
        try:
            for position, (conn, log_time, raw) in enumerate(
                    reader.messages(connections=connections, start=start_ns, stop=stop_ns)):
                if stop is not None and position >= stop:
                    return
                if position >= first:
                    yield BagMessage(conn.topic, conn.msgtype, log_time, store.deserialize_cdr(raw, conn.msgtype))
        except Exception as exc:  # damaged bytes past the index (rosbags raises errors of many kinds)
            raise BagError(f"cannot read the bag {path} after message {position}: {exc}") from exc


class BagWriter:
    """Write rosbag2 (sqlite3 or mcap); a topic's connection is created on its first message."""

    def __init__(self, path: str | Path, storage: str = "sqlite3"):
        if storage not in STORAGES:
            raise ValueError(f"unknown bag storage {storage!r}; expected one of {sorted(STORAGES)}")
        self._writer = Writer(Path(path), version=9, storage_plugin=STORAGES[storage])
        self._connections: dict[str, object] = {}

    def __enter__(self) -> BagWriter:
        self._writer.open()
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()

    def write(self, topic: str, msg, log_time_ns: int) -> None:
        """Write `msg` (a rosbags message, or a msgs.Fields layout) at log time `log_time_ns`."""
        if isinstance(msg, Fields):
            msg = to_bag(msg)
        conn = self._connections.get(topic)
        if conn is None:
            conn = self._writer.add_connection(topic, msg.__msgtype__, typestore=TYPESTORE)
            self._connections[topic] = conn
        self._writer.write(conn, int(log_time_ns), TYPESTORE.serialize_cdr(msg, msg.__msgtype__))


# rosbags holds arrays of numbers as numpy arrays of the field's own type.
_DTYPES = {"bool": np.bool_, "byte": np.uint8, "char": np.uint8, "float32": np.float32, "float64": np.float64,
           "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "int32": np.int32,
           "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64}


def to_bag(fields: Fields):
    """The rosbags message of a layout (sps_driving.ros.msgs); fields it leaves out get their type's defaults."""
    definition = dict(TYPESTORE.fielddefs[fields.msgtype][1])
    unknown = set(fields.values) - set(definition)
    if unknown:
        raise ValueError(f"{fields.msgtype} has no fields {sorted(unknown)}")
    values = {name: _bag_value(fields.values.get(name), kind) for name, kind in definition.items()}
    return TYPESTORE.types[fields.msgtype](**values)


def _bag_value(value, kind):
    """`value` (None: the default) as rosbags holds a field of `kind` (a rosbags field definition)."""
    node, detail = kind
    if node == Nodetype.BASE:
        if value is not None:
            return value
        return "" if detail[0] == "string" else False if detail[0] == "bool" else 0.0 if detail[0].startswith("float") else 0
    if node == Nodetype.NAME:
        return to_bag(value if value is not None else Fields(detail, {}))
    (element_node, element), count = detail
    if value is None:
        value = [] if node == Nodetype.SEQUENCE else [None] * count
    if element_node == Nodetype.NAME:
        return [_bag_value(item, (element_node, element)) for item in value]
    if element[0] == "string":
        return ["" if item is None else item for item in value]
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, dtype=np.uint8)
    return np.asarray([0 if item is None else item for item in value], dtype=_DTYPES[element[0]])
