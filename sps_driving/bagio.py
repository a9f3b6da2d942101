"""rosbag2 reading and writing without a ROS installation, through `rosbags`.

Bags recorded on the car (Humble or newer) and bags written by the simulator use the same
topics (sps_driving.topics) and are read by the same code. A bag's own stored message definitions
decide how its messages decode, so a bag recorded with another layout of a type decodes as
recorded; types a bag stores no definition for (rosbag2 sqlite3 on Humble stores none) decode with
ours: the ROS 2 distro's standard messages and the PACMod 3 messages of interfaces/pacmod3_msgs.
Writers always use ours.

Messages are written from the layouts of sps_driving.msgs (`msgs.Fields`, the same field values
the live graph's rclpy messages are made of): `to_bag` makes the rosbags message of one, and
`BagWriter.write` takes either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rosbags.interfaces import MessageDefinitionFormat, Nodetype
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from sps_driving.msgs import Fields
from sps_driving.resources import package_path

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
    with Reader(Path(path)) as reader:
        return {conn.topic: conn.msgtype for conn in reader.connections}


def read_messages(path: str | Path, topics: Iterable[str] | None = None, first: int = 0,
                  stop: int | None = None) -> Iterator[BagMessage]:
    """Deserialized messages in log-time order; `topics` limits which are read, `first` and `stop`
    to those at positions first..stop-1 of that order (the ones before are not deserialized)."""
    with Reader(Path(path)) as reader:
        wanted = set(topics) if topics is not None else None
        connections = [c for c in reader.connections if wanted is None or c.topic in wanted]
        if not connections:  # none of the topics is in the bag (rosbags reads every connection for an empty list)
            return
        store = bag_typestore(connections)
        for position, (conn, log_time, raw) in enumerate(reader.messages(connections=connections)):
            if stop is not None and position >= stop:
                return
            if position >= first:
                yield BagMessage(conn.topic, conn.msgtype, log_time, store.deserialize_cdr(raw, conn.msgtype))


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
    """The rosbags message of a layout (sps_driving.msgs); fields it leaves out get their type's defaults."""
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
