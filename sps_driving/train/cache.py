"""The on-disk feature cache: dense patch-descriptor grids with their driving labels.

Extraction with a frozen foundation model is the slow part of training, so it runs once
(`sps-driving extract`) and the trainer reads its output many times. Descriptors are stored for
ALL patches (rate 1.0), so training can draw a fresh patch selection for every frame in every
epoch and still cover every variant and rate from one cache.

Layout of a cache directory (format "sps_driving.feature_cache/1")::

    CACHE/
      meta.json                 written last: a directory without it is not a cache
      position_table.npy        float32 [N, P], the backbone's patch position embeddings
                                (for SPPS / MSPPS policies); absent when the backbone has none
      shard_00000/
        descriptors.npy         float16 [n, N, D], patch j of a frame at row j (row-major grid)
        targets.npy             float32 [n, 2]: steering (front road-wheel angle, rad, left +),
                                throttle in [-1, 1] (negative = brake), as in sps_driving.core.topics
        stamps.npy              int64 [n]: the camera frame's header stamp, ns
        sources.npy             int32 [n]: index into meta.json "sources"
        state.npy               float32 [n, S]: the frame's state inputs (sps_driving.core.state),
                                columns as meta.json "state" names them, NaN where unknown
        intervention.npy        bool [n]: the frame is in the seconds after a safety driver's
                                override (sps_driving.ros.car_labels)
        orbital.npy             float16 [m, V, N, D], only in caches with orbital states: the V
                                visible orbital states of every patch (sps_driving.core.orbital)
                                of m of the shard's frames, for Manifold augmentation in training
        orbital_rows.npy        int32 [m]: which rows of the shard those are, ascending
        token_groups.npy        int16 [n, N], only in token-dropping caches: which of the frame's
                                passes computed each patch's descriptor (-1: none, zeros stored)
      shard_00001/ ...       (names are the writer's: FeatureCacheWriter numbers them,
                                UnitCacheWriter's callers name them by unit; meta.json orders them)
      progress/                 an unfinished UnitCacheWriter cache's plan and finished units

meta.json keys: format, backbone (name), extractor (the extractor config used), grid {rows,
cols}, descriptor_dim (D), dtype ("float16"), frames (total), shard_size (frames per shard,
the last may hold fewer), shards [{path, frames}], sources [names, e.g. bag or episode names:
validation splits by them], position_table (file name or null), state (the state.npy columns;
absent in caches written before state inputs: their frames' states are unknown), intervention
(true: the shards hold intervention.npy; absent in older caches, whose frames read as not in
one), orbital (only in caches with orbital states: offsets_px [[dy, dx] x V], family, every,
frames), token_dropping (only in caches of DINOv2 with tokens kept: variant, rate, seed, kept k
and groups G; each frame's patches were split into G disjoint groups of k, `PatchSelector.groups`,
and each group computed in one pass of the ViT on CLS and its k patches, so a patch's descriptor
is the one it has when kept with the rest of its group: training picks one group per frame as its
selection), plus anything the writer's caller adds (e.g. extraction counts of dropped frames).

All .npy files are plain NumPy format, so `np.load(path, mmap_mode="r")` maps them without a
copy; `FeatureCache` does that for the descriptors and loads the small arrays into memory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from sps_driving.core.grid import PatchGrid
from sps_driving.core.resources import read_format_json
from sps_driving.core.state import STATE_NAMES

CACHE_FORMAT = "sps_driving.feature_cache/1"
META_FILE = "meta.json"
POSITION_TABLE_FILE = "position_table.npy"
PROGRESS_DIR = "progress"  # an unfinished UnitCacheWriter cache's plan and finished units
PLAN_FILE = "plan.json"
FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class CacheFrame:
    descriptors: np.ndarray  # float16 [N, D], memory-mapped
    steering: float  # rad
    throttle: float  # [-1, 1]
    stamp_ns: int
    source: str
    state: dict  # {state input name: value}, NaN where unknown
    intervention: bool = False  # in the seconds after a safety driver's override


def _frame_row(grid_n: int, dim: int, descriptors, steering: float, throttle: float, stamp_ns: int,
               state: dict | None, intervention: bool) -> tuple:
    """One frame as a shard stores it (without its source id); ValueError for a frame that cannot be stored."""
    descriptors = np.asarray(descriptors)
    if descriptors.shape != (grid_n, dim):
        raise ValueError(f"descriptors must be [{grid_n}, {dim}], got {descriptors.shape}")
    if not np.all(np.isfinite(descriptors)):
        raise ValueError("descriptors contain NaN or Inf")
    if np.abs(descriptors).max() > FLOAT16_MAX:
        raise ValueError(f"descriptors exceed the float16 range (|x| > {FLOAT16_MAX})")
    if not (np.isfinite(steering) and np.isfinite(throttle)):
        raise ValueError(f"labels must be finite, got steering={steering}, throttle={throttle}")
    if int(stamp_ns) < 0:
        raise ValueError(f"stamp must be >= 0 ns, got {stamp_ns}")
    state = dict(state or {})
    unknown = set(state) - set(STATE_NAMES)
    if unknown:
        raise ValueError(f"unknown state inputs {sorted(unknown)}; expected some of {list(STATE_NAMES)}")
    state_row = np.array([state.get(name, np.nan) for name in STATE_NAMES], dtype=np.float32)
    if np.isinf(state_row).any():
        raise ValueError(f"state inputs must be finite or NaN (unknown), got {state}")
    return descriptors.astype(np.float16), (float(steering), float(throttle)), int(stamp_ns), state_row, bool(intervention)


def _orbital_shape(meta: dict, grid: PatchGrid, dim: int) -> tuple[int, int, int] | None:
    """[V, N, D] of a frame's orbital states in a cache made with meta "orbital"; None: the cache holds none."""
    orbital = meta.get("orbital")
    return (len(orbital["offsets_px"]), grid.n, dim) if orbital else None


def _checked_orbital(orbital, shape: tuple[int, int, int] | None) -> np.ndarray:
    """A frame's orbital states as a shard stores them (float16 [V, N, D]); ValueError for states
    that cannot be stored or a cache made without them."""
    if shape is None:
        raise ValueError("this cache was made without orbital states (meta \"orbital\"): it cannot store them")
    orbital = np.asarray(orbital)
    if orbital.shape != shape:
        raise ValueError(f"orbital states must be [{', '.join(map(str, shape))}], got {orbital.shape}")
    if not np.all(np.isfinite(orbital)) or np.abs(orbital).max() > FLOAT16_MAX:
        raise ValueError("orbital states contain NaN or Inf or exceed the float16 range")
    return orbital.astype(np.float16)


def _groups_count(meta: dict) -> int | None:
    """How many patch groups a frame of a token-dropping cache has; None: a dense cache."""
    dropping = meta.get("token_dropping")
    return int(dropping["groups"]) if dropping else None


def _checked_groups(groups, grid: PatchGrid, count: int | None) -> np.ndarray | None:
    """A frame's patch groups as a shard stores them (int16 [N]); ValueError for groups a cache of
    `count` groups (None: dense) cannot store."""
    if count is None:
        if groups is not None:
            raise ValueError("this cache was made without token dropping (meta \"token_dropping\"): it stores no patch groups")
        return None
    if groups is None:
        raise ValueError("a token-dropping cache stores each frame's patch groups: add(..., groups=[N])")
    groups = np.asarray(groups)
    if groups.shape != (grid.n,) or not np.issubdtype(groups.dtype, np.integer) or groups.min() < -1 or groups.max() >= count:
        raise ValueError(f"patch groups must be integers in -1..{count - 1} of shape [{grid.n}], got {groups.dtype} {groups.shape}")
    return groups.astype(np.int16)


class _PendingShard:
    """The frames of the shard being filled: their rows (_frame_row's, each with its source id after
    the stamp), in a cache with orbital states the states of those frames that have them, and in a
    token-dropping cache every frame's patch groups."""

    def __init__(self, orbital_shape: tuple[int, int, int] | None, groups: bool = False):
        self.orbital_shape = orbital_shape
        self.rows: list[tuple] = []
        self.orbital: list[tuple[int, np.ndarray]] = []  # (row in the shard, float16 [V, N, D])
        self.groups: list[np.ndarray] | None = [] if groups else None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: tuple, source_id: int, orbital: np.ndarray | None, groups: np.ndarray | None = None) -> None:
        if orbital is not None:
            self.orbital.append((len(self.rows), orbital))
        if self.groups is not None:
            self.groups.append(groups)
        self.rows.append((*row[:3], source_id, *row[3:]))

    def write(self, directory: Path, name: str) -> dict:
        """Shard `name` of the pending frames, appearing atomically (written as NAME.tmp, then renamed
        over whatever an interrupted run left there); nothing is pending afterwards."""
        tmp, final = directory / (name + ".tmp"), directory / name
        for leftover in (tmp, final):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
        descriptors, targets, stamps, sources, states, interventions = zip(*self.rows)
        np.save(tmp / "descriptors.npy", np.stack(descriptors))
        np.save(tmp / "targets.npy", np.asarray(targets, dtype=np.float32))
        np.save(tmp / "stamps.npy", np.asarray(stamps, dtype=np.int64))
        np.save(tmp / "sources.npy", np.asarray(sources, dtype=np.int32))
        np.save(tmp / "state.npy", np.stack(states).astype(np.float32))
        np.save(tmp / "intervention.npy", np.asarray(interventions, dtype=bool))
        if self.orbital_shape is not None:
            rows = [row for row, _ in self.orbital]
            states_of_rows = [s for _, s in self.orbital]
            np.save(tmp / "orbital.npy", np.stack(states_of_rows) if rows else np.zeros((0, *self.orbital_shape), np.float16))
            np.save(tmp / "orbital_rows.npy", np.asarray(rows, dtype=np.int32))
        if self.groups is not None:
            np.save(tmp / "token_groups.npy", np.stack(self.groups))
        os.replace(tmp, final)
        shard = {"path": name, "frames": len(self.rows)}
        self.rows, self.orbital = [], []
        self.groups = None if self.groups is None else []
        return shard


def _check_meta(meta: dict, shard_size: int) -> PatchGrid:
    for key in ("backbone", "grid", "descriptor_dim"):
        if key not in meta:
            raise ValueError(f"feature cache meta needs {key!r}")
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return PatchGrid(int(meta["grid"]["rows"]), int(meta["grid"]["cols"]))


def _save_position_table(directory: Path, table, grid: PatchGrid) -> None:
    table = np.asarray(table, dtype=np.float32)
    if table.ndim != 2 or table.shape[0] != grid.n or not np.all(np.isfinite(table)):
        raise ValueError(f"position table must be finite [{grid.n}, P], got {table.shape}")
    np.save(directory / POSITION_TABLE_FILE, table)


def _write_meta(directory: Path, meta: dict, extra_meta: dict | None, grid: PatchGrid, dim: int, shard_size: int,
                shards: list[dict], sources: list[str], has_position_table: bool, orbital_frames: int) -> None:
    meta = {
        **meta,
        **(extra_meta or {}),
        "format": CACHE_FORMAT,
        "grid": {"rows": grid.rows, "cols": grid.cols},
        "descriptor_dim": dim,
        "dtype": "float16",
        "frames": sum(int(shard["frames"]) for shard in shards),
        "shard_size": shard_size,
        "shards": shards,
        "sources": sources,
        "position_table": POSITION_TABLE_FILE if has_position_table else None,
        "state": list(STATE_NAMES),
        "intervention": True,
        # SOURCE_DATE_EPOCH (the reproducible-builds convention; `campaign` sets it): a cache rebuilt from
        # the same drives is then the original byte for byte.
        "created_unix": float(os.environ.get("SOURCE_DATE_EPOCH", time.time())),
    }
    if meta.get("orbital"):
        meta["orbital"] = {**meta["orbital"], "frames": orbital_frames}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")


class FeatureCacheWriter:
    """Append frames, then `close()` (or leave the `with` block) to write the last shard and meta.json.

    `meta` must hold backbone, grid {rows, cols} and descriptor_dim; extractor and other keys are
    recorded as given. A frame that cannot be stored (wrong shape, NaN/Inf, beyond float16
    range, non-finite label, infinite state) raises ValueError and nothing of it is written:
    callers count and skip. A frame's state inputs (sps_driving.core.state) are NaN where unknown.
    meta "orbital" ({"offsets_px": [[dy, dx], ...], "family": ...}) makes a cache that holds
    orbital states: `add(..., orbital=[V, N, D])` for the frames that have them.
    """

    def __init__(self, directory, meta: dict, position_table: np.ndarray | None = None,
                 shard_size: int = 512, overwrite: bool = False):
        self.directory = Path(directory)
        self.grid = _check_meta(meta, shard_size)
        if self.directory.exists() and any(self.directory.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{self.directory} is not empty; choose a new cache directory or overwrite it")
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dim = int(meta["descriptor_dim"])
        self.shard_size = int(shard_size)
        self.meta = dict(meta)
        if position_table is not None:
            _save_position_table(self.directory, position_table, self.grid)
        self._has_position_table = position_table is not None
        self._sources: dict[str, int] = {}
        self._shards: list[dict] = []
        self.groups_count = _groups_count(self.meta)
        self._pending = _PendingShard(_orbital_shape(self.meta, self.grid, self.dim), self.groups_count is not None)
        self._closed = False
        self.frames = 0
        self.orbital_frames = 0

    def add(self, descriptors: np.ndarray, steering: float, throttle: float, stamp_ns: int, source: str,
            state: dict | None = None, intervention: bool = False, orbital: np.ndarray | None = None,
            groups: np.ndarray | None = None) -> None:
        """One frame; `state` {name: value} of its state inputs, those left out (or NaN) unknown;
        `intervention`: the frame follows a safety driver's override; `orbital`: its patches'
        visible orbital states [V, N, D] (a cache made with meta "orbital" only); `groups`: its
        patches' groups [N] (a token-dropping cache, meta "token_dropping", only and always)."""
        row = _frame_row(self.grid.n, self.dim, descriptors, steering, throttle, stamp_ns, state, intervention)
        if orbital is not None:
            orbital = _checked_orbital(orbital, self._pending.orbital_shape)
        groups = _checked_groups(groups, self.grid, self.groups_count)
        if self._closed:
            raise RuntimeError(f"feature cache {self.directory} is already closed")
        source_id = self._sources.setdefault(str(source), len(self._sources))
        self._pending.add(row, source_id, orbital, groups)
        self.frames += 1
        self.orbital_frames += orbital is not None
        if len(self._pending) == self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if len(self._pending):
            self._shards.append(self._pending.write(self.directory, f"shard_{len(self._shards):05d}"))

    def close(self, extra_meta: dict | None = None) -> Path:
        """Write the last shard and meta.json; `extra_meta` is merged into meta.json. Closing twice is a no-op."""
        if self._closed:
            return self.directory
        self._closed = True
        self._flush()
        _write_meta(self.directory, self.meta, extra_meta, self.grid, self.dim, self.shard_size, self._shards,
                    list(self._sources), self._has_position_table, self.orbital_frames)
        return self.directory

    def __enter__(self) -> FeatureCacheWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an error the cache stays without meta.json, so it cannot be mistaken for a complete one.
        if exc_type is None:
            self.close()


class UnitCacheWriter:
    """A feature cache written in work units by one process or several (sps_driving.train.distributed):
    each unit (a stretch of an input's frames, a rollout episode) into shards of its own, named by
    the caller (`unit(name, base, first_part)`: shards BASE_PPPPP from FIRST_PART on, up to
    shard_size frames each). A cut-short run resumes with the units it had not finished, and the
    finished cache lists the shards in unit order, whichever process wrote which.

    While unfinished, CACHE/progress/ holds plan.json (what the units are: a resumed run must have
    the same plan, else ValueError) and UNIT.json for each finished unit (its shards and the
    caller's record, such as counts of dropped frames). `records` gathers them on every process;
    `close` has process 0 write meta.json (sources: `sources`, source ids their positions), then
    progress/ is removed. Process 0 prepares the folder: an existing cache or another folder there
    is FileExistsError unless `overwrite`; the others wait for it. meta "orbital" makes a cache
    with orbital states, as FeatureCacheWriter's: each shard holds those of its own frames.
    """

    def __init__(self, directory, meta: dict, plan: dict, units: Sequence[str], sources: Sequence[str],
                 position_table: np.ndarray | None = None, shard_size: int = 512, overwrite: bool = False,
                 processes=None):
        from sps_driving.train.distributed import Processes, digest

        self.processes = processes or Processes()
        self.directory = Path(directory)
        self.progress = self.directory / PROGRESS_DIR
        self.grid = _check_meta(meta, shard_size)
        self.dim = int(meta["descriptor_dim"])
        self.shard_size = int(shard_size)
        self.meta = dict(meta)
        self.units = list(units)
        self.sources = list(sources)
        self.source_ids = {name: index for index, name in enumerate(self.sources)}
        self.plan = {**plan, "units": self.units, "sources": self.sources, "shard_size": self.shard_size}
        self.plan_digest = digest(self.plan)
        self._has_position_table = position_table is not None
        self.orbital_shape = _orbital_shape(self.meta, self.grid, self.dim)
        self.groups_count = _groups_count(self.meta)
        self.processes.first(lambda: self._prepare(overwrite, position_table))
        self.progress.mkdir(parents=True, exist_ok=True)  # on machines that do not share the folder, too

    def _prepare(self, overwrite: bool, position_table) -> None:
        from sps_driving.train.distributed import digest

        if overwrite and self.directory.exists():
            shutil.rmtree(self.directory)
        if (self.directory / META_FILE).exists():
            raise FileExistsError(f"{self.directory} is a complete feature cache; choose a new cache directory or overwrite it")
        plan_file = self.progress / PLAN_FILE
        if plan_file.is_file():
            if digest(json.loads(plan_file.read_text())) != self.plan_digest:
                raise ValueError(f"{self.directory} holds an unfinished feature cache of other settings or inputs: "
                                 f"resume it with those, or overwrite it")
        elif self.directory.exists() and any(self.directory.iterdir()):
            raise FileExistsError(f"{self.directory} is not empty; choose a new cache directory or overwrite it")
        self.progress.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(plan_file, self.plan)
        if position_table is not None:
            _save_position_table(self.directory, position_table, self.grid)

    def done(self, unit: str) -> dict | None:
        """The record of `unit` when this machine's folder has it finished under this plan."""
        path = self.progress / f"{unit}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return record if record.get("plan") == self.plan_digest else None

    def unit(self, name: str, base: str, first_part: int = 0) -> UnitShards:
        return UnitShards(self, name, base, first_part)

    def records(self, mine: Sequence[str]) -> list[dict]:
        """Every unit's record, in unit order, on every process; `mine`: the units this process
        was given (each unit is some process's)."""
        local = {unit: record for unit in mine if (record := self.done(unit)) is not None}
        merged: dict[str, dict] = {}
        for part in self.processes.gather(local):
            merged.update(part)
        missing = [unit for unit in self.units if unit not in merged]
        if missing:
            raise RuntimeError(f"feature cache {self.directory}: units {missing[:5]} were not finished")
        return [merged[unit] for unit in self.units]

    def close(self, records: list[dict], extra_meta: dict | None = None) -> Path:
        """Process 0 writes meta.json with the shards of `records` (unit order); progress/ goes."""
        if self.processes.main:
            shards = [shard for record in records for shard in record["shards"]]
            _write_meta(self.directory, self.meta, extra_meta, self.grid, self.dim, self.shard_size, shards, self.sources,
                        self._has_position_table, sum(record["orbital_frames"] for record in records))
        self.processes.barrier()
        if self.processes.local_rank == 0:
            shutil.rmtree(self.progress, ignore_errors=True)
        return self.directory


class UnitShards:
    """The frames of one unit of a UnitCacheWriter: `add` as FeatureCacheWriter's (a source the
    writer does not list is a KeyError), `finish` to write the last shard and the unit's record."""

    def __init__(self, writer: UnitCacheWriter, name: str, base: str, first_part: int):
        self.writer, self.name, self.base, self.part = writer, name, base, first_part
        self.shards: list[dict] = []
        self.frames = 0
        self.orbital_frames = 0
        self._pending = _PendingShard(writer.orbital_shape, writer.groups_count is not None)

    def add(self, descriptors: np.ndarray, steering: float, throttle: float, stamp_ns: int, source: str,
            state: dict | None = None, intervention: bool = False, orbital: np.ndarray | None = None,
            groups: np.ndarray | None = None) -> None:
        w = self.writer
        row = _frame_row(w.grid.n, w.dim, descriptors, steering, throttle, stamp_ns, state, intervention)
        if orbital is not None:
            orbital = _checked_orbital(orbital, w.orbital_shape)
        groups = _checked_groups(groups, w.grid, w.groups_count)
        self._pending.add(row, w.source_ids[source], orbital, groups)
        self.frames += 1
        self.orbital_frames += orbital is not None
        if len(self._pending) == w.shard_size:
            self._flush()

    def _flush(self) -> None:
        if len(self._pending):
            self.shards.append(self._pending.write(self.writer.directory, f"{self.base}_{self.part:05d}"))
            self.part += 1

    def finish(self, record: dict | None = None) -> dict:
        """The unit is done: its last shard, then its record (`record` with its shards, frames and
        frames with orbital states)."""
        self._flush()
        record = {**(record or {}), "plan": self.writer.plan_digest, "shards": self.shards, "frames": self.frames,
                  "orbital_frames": self.orbital_frames}
        _write_json_atomically(self.writer.progress / f"{self.name}.json", record)
        return record


def _write_json_atomically(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _read_cache(directory: Path) -> dict:
    """meta, memory-mapped descriptor shards and the in-memory arrays of one cache directory."""
    meta = read_format_json(directory / META_FILE, CACHE_FORMAT, "feature cache",
                            f"create one with `sps-driving extract --out {directory} INPUT...`")
    grid_n = int(meta["grid"]["rows"]) * int(meta["grid"]["cols"])
    stored_state = list(meta.get("state", []))
    has_intervention = bool(meta.get("intervention"))
    orbital_views = len(meta["orbital"]["offsets_px"]) if meta.get("orbital") else 0
    has_groups = bool(meta.get("token_dropping"))
    part = {"meta": meta, "descriptors": [], "targets": [], "stamps": [], "source_ids": [], "state": [], "intervention": [],
            "orbital": [], "groups": []}
    for shard in meta["shards"]:
        path = directory / shard["path"]
        n = int(shard["frames"])
        arrays = {}
        for name, shape, dtype in (
            ("descriptors", (n, grid_n, int(meta["descriptor_dim"])), np.float16),
            ("targets", (n, 2), np.float32),
            ("stamps", (n,), np.int64),
            ("sources", (n,), np.int32),
            *((("state", (n, len(stored_state)), np.float32),) if stored_state else ()),
            *((("intervention", (n,), np.bool_),) if has_intervention else ()),
            *((("token_groups", (n, grid_n), np.int16),) if has_groups else ()),
        ):
            file = path / f"{name}.npy"
            try:
                arrays[name] = np.load(file, mmap_mode="r" if name == "descriptors" else None)
            except (OSError, ValueError) as err:
                raise ValueError(f"feature cache file {file} cannot be read: {err}") from err
            if arrays[name].shape != shape or arrays[name].dtype != dtype:
                raise ValueError(
                    f"feature cache file {file} is {arrays[name].dtype} {arrays[name].shape}, "
                    f"meta.json says {np.dtype(dtype)} {shape}"
                )
        part["descriptors"].append(arrays["descriptors"])
        for key, name in (("targets", "targets"), ("stamps", "stamps"), ("source_ids", "sources")):
            part[key].append(arrays[name])
        # Columns in STATE_NAMES order; NaN (unknown) for an input the cache does not store.
        state = np.full((n, len(STATE_NAMES)), np.nan, dtype=np.float32)
        for column, name in enumerate(stored_state):
            if name in STATE_NAMES:
                state[:, STATE_NAMES.index(name)] = arrays["state"][:, column]
        part["state"].append(state)
        part["intervention"].append(arrays["intervention"] if has_intervention else np.zeros(n, dtype=bool))
        if has_groups:
            part["groups"].append(arrays["token_groups"])
        part["orbital"].append(_read_orbital(path, n, (orbital_views, grid_n, int(meta["descriptor_dim"])))
                               if orbital_views else None)
    empty = {"targets": np.zeros((0, 2), np.float32), "stamps": np.zeros(0, np.int64), "source_ids": np.zeros(0, np.int32),
             "state": np.zeros((0, len(STATE_NAMES)), np.float32), "intervention": np.zeros(0, dtype=bool)}
    for key, default in empty.items():
        part[key] = np.concatenate(part[key]) if part[key] else default
    part["groups"] = np.concatenate(part["groups"]) if part["groups"] else np.zeros((0, grid_n), np.int16)
    if len(part["targets"]) != int(meta["frames"]):
        raise ValueError(f"{directory / META_FILE} says {meta['frames']} frames, its shards hold {len(part['targets'])}")
    ids = part["source_ids"]
    if len(ids) and (ids.min() < 0 or ids.max() >= len(meta["sources"])):
        raise ValueError(f"feature cache {directory} has source ids outside meta.json's sources")
    return part


def _read_orbital(path: Path, frames: int, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(orbital states float16 [m, V, N, D] memory-mapped, their rows in the shard int32 [m]) of a shard."""
    try:
        states = np.load(path / "orbital.npy", mmap_mode="r")
        rows = np.load(path / "orbital_rows.npy")
    except (OSError, ValueError) as err:
        raise ValueError(f"the orbital states of feature cache shard {path} cannot be read: {err}") from err
    if (states.dtype != np.float16 or states.shape[1:] != shape or rows.shape != (len(states),)
            or np.any(np.diff(rows) <= 0) or (len(rows) and not 0 <= rows.min() <= rows.max() < frames)):
        raise ValueError(f"the orbital states of feature cache shard {path} are {states.dtype} {states.shape} at rows "
                         f"{rows.tolist()[:8]}: meta.json says float16 [m, {', '.join(map(str, shape))}] at ascending rows "
                         f"of its {frames} frames")
    return states, rows


def _compared(meta: dict, key: str):
    """What must agree between caches read as one: meta[key], the extractor record with roi null
    (the whole frame) and tokens all (dense) where it has none, as every cache made before the
    setting existed."""
    value = meta.get(key)
    return {"roi": None, "tokens": "all", **value} if key == "extractor" and isinstance(value, dict) else value


class FeatureCache:
    """Read one cache directory, or several as one (e.g. drives extracted on different days):
    descriptors memory-mapped, labels, stamps and sources in memory.

    Several caches must come from the same extractor (backbone, settings, grid, D). Their source
    names are prefixed with the cache folder's name ("drives_0412/episode_00003"), so equal bag
    names in different caches stay different sources for the validation split.
    """

    def __init__(self, directory):
        paths = [directory] if isinstance(directory, (str, os.PathLike)) else list(directory)
        if not paths:
            raise ValueError("no feature cache given")
        self.directories = [Path(p) for p in paths]
        self.directory = self.directories[0]
        self.name = ", ".join(str(d) for d in self.directories)
        parts = [_read_cache(d) for d in self.directories]
        self.meta = dict(parts[0]["meta"])
        for d, part in zip(self.directories[1:], parts[1:]):
            mismatched = [k for k in ("backbone", "extractor", "grid", "descriptor_dim", "token_dropping")
                          if _compared(part["meta"], k) != _compared(self.meta, k)]
            if mismatched:
                raise ValueError(f"feature caches {self.directory} and {d} differ in {mismatched}: they cannot train one policy")
        self.grid = PatchGrid(int(self.meta["grid"]["rows"]), int(self.meta["grid"]["cols"]))
        self.descriptor_dim = int(self.meta["descriptor_dim"])
        self.backbone = self.meta["backbone"]
        if len(parts) == 1:
            self.sources = list(self.meta["sources"])
        else:
            self.sources = [f"{d.resolve().name}/{name}" for d, part in zip(self.directories, parts) for name in part["meta"]["sources"]]
            if len(set(self.sources)) != len(self.sources):
                raise ValueError(f"feature caches {self.name} repeat a folder name: their sources would be confused")
            self.meta.update(frames=sum(int(part["meta"]["frames"]) for part in parts), sources=self.sources)
        offsets = np.cumsum([0] + [len(part["meta"]["sources"]) for part in parts])[:-1]
        self._shards = [shard for part in parts for shard in part["descriptors"]]
        self.targets = np.concatenate([part["targets"] for part in parts])
        self.stamps = np.concatenate([part["stamps"] for part in parts])
        self.state = np.concatenate([part["state"] for part in parts])  # float32 [frames, len(STATE_NAMES)], NaN = unknown
        self.intervention = np.concatenate([part["intervention"] for part in parts])  # bool [frames]: after an override
        # Token dropping (meta token_dropping): int16 [frames, N], the pass that computed each patch (-1: none).
        self.token_dropping = self.meta.get("token_dropping")
        self.token_groups = np.concatenate([part["groups"] for part in parts]) if self.token_dropping else None
        self.source_ids = np.concatenate([part["source_ids"] + offset for part, offset in zip(parts, offsets)]).astype(np.int32)
        sizes = [len(s) for s in self._shards]
        self._starts = np.cumsum([0] + sizes)[:-1]
        self._read_orbital_index(parts)

    def __len__(self) -> int:
        return len(self.targets)

    def _locate(self, index: int) -> tuple[int, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"frame {index} out of range for a cache of {len(self)} frames")
        index %= len(self)
        shard = int(np.searchsorted(self._starts, index, side="right") - 1)
        return shard, index - int(self._starts[shard])

    def __getitem__(self, index: int) -> CacheFrame:
        shard, row = self._locate(int(index))
        steering, throttle = self.targets[index]
        return CacheFrame(self._shards[shard][row], float(steering), float(throttle),
                          int(self.stamps[index]), self.sources[self.source_ids[index]],
                          dict(zip(STATE_NAMES, self.state[index].tolist())), bool(self.intervention[index]))

    def state_values(self, names) -> np.ndarray:
        """float32 [frames, len(names)]: the frames' values of state inputs `names`, NaN where unknown."""
        return self.state[:, [STATE_NAMES.index(name) for name in names]]

    def descriptors(self, indices: Sequence[int]) -> np.ndarray:
        """float32 [B, N, D] dense descriptor grids of frames `indices` (`descriptor_batch` as an array)."""
        return self.descriptor_batch(indices).numpy()

    def descriptor_batch(self, indices: Sequence[int]) -> torch.Tensor:
        """float32 [B, N, D] dense descriptor grids of frames `indices`, read shard by shard (one
        fancy-indexed read per shard: reading frame by frame made training wait on the cache) as
        float16 and converted once by torch (its vectorized conversion took a seventh of NumPy's)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (-len(self) <= indices.min() and indices.max() < len(self)):
            raise IndexError(f"frames {indices.min()}..{indices.max()} out of range for a cache of {len(self)} frames")
        indices %= max(len(self), 1)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        half = np.empty((len(indices), self.grid.n, self.descriptor_dim), dtype=np.float16)
        for shard in np.unique(shards):
            rows = np.flatnonzero(shards == shard)
            offsets = indices[rows] - self._starts[shard]
            order = np.argsort(offsets, kind="stable")  # ascending reads of the mapped file
            half[rows[order]] = self._shards[shard][offsets[order]]
        return torch.from_numpy(half).float()

    def _read_orbital_index(self, parts: list[dict]) -> None:
        """orbital_frames (int64, ascending): the frames with orbital states; orbital_meta: how
        they were read (the same in every cache that has them)."""
        metas = [part["meta"]["orbital"] for part in parts if part["meta"].get("orbital")]
        if any(m["offsets_px"] != metas[0]["offsets_px"] or m["family"] != metas[0]["family"] for m in metas[1:]):
            raise ValueError(f"feature caches {self.name} hold orbital states of different offsets or families")
        self.orbital_meta = metas[0] if metas else None
        self._orbital = [orbital for part in parts for orbital in part["orbital"]]  # per shard: (states, rows) or None
        # Per frame with states (ascending): its index, its shard and its position in the shard's states.
        located = [(self._starts[shard] + rows, np.full(len(rows), shard), np.arange(len(rows)))
                   for shard, (_, rows) in ((k, o) for k, o in enumerate(self._orbital) if o is not None)]
        columns = [np.concatenate(column).astype(np.int64) for column in zip(*located)] if located else [np.zeros(0, np.int64)] * 3
        self.orbital_frames, self._orbital_shard, self._orbital_position = columns

    def has_orbital(self, indices) -> np.ndarray:
        """bool [B]: which frames `indices` have orbital states."""
        return np.isin(np.asarray(indices, dtype=np.int64), self.orbital_frames)

    def orbital_states(self, indices) -> np.ndarray:
        """float32 [B, V, N, D]: the visible orbital states of frames `indices`, which must have them."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        where = np.searchsorted(self.orbital_frames, indices)
        found = where < len(self.orbital_frames)
        found[found] = self.orbital_frames[where[found]] == indices[found]
        if not found.all():
            raise KeyError(f"frames {indices[~found].tolist()[:8]} of {self.name} have no orbital states")
        return np.stack([self._orbital[self._orbital_shard[w]][0][self._orbital_position[w]] for w in where]).astype(np.float32)

    def position_table(self) -> np.ndarray | None:
        """float32 [N, P] backbone position embeddings, or None when the cache has none."""
        name = self.meta.get("position_table")
        return None if not name else np.load(self.directory / name)

    def dataset(self, indices: Sequence[int] | None = None) -> FeatureDataset:
        return FeatureDataset(self, np.arange(len(self)) if indices is None else np.asarray(indices))


class FeatureDataset(Dataset):
    """Torch view of some cache frames. Item i: (grid float32 [N, D], target float32 [2], stamp ns,
    frame index); a list of items (what a BatchSampler yields, with DataLoader(batch_size=None)):
    the same four batched, read in one pass over the shards."""

    def __init__(self, cache: FeatureCache, indices: np.ndarray):
        self.cache = cache
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item):
        if np.ndim(item) == 0:
            grid, target, stamp, index = self[[item]]
            return grid[0], target[0], stamp[0], index[0]
        index = self.indices[np.asarray(item, dtype=np.int64)]
        return (
            self.cache.descriptor_batch(index),
            torch.from_numpy(self.cache.targets[index].astype(np.float32)),
            torch.from_numpy(self.cache.stamps[index].astype(np.int64)),
            torch.from_numpy(index),
        )
