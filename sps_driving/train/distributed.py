"""Several processes of one command under `torchrun`: who this process is, its device, and what
the processes exchange (sums, objects, a check that they agree).

    torchrun --nproc-per-node=4 -m sps_driving.cli extract --out CACHE BAG...      # one machine, 4 GPUs
    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m sps_driving.cli eval --policy DIR --out OUT                             # two machines

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them (a plain command) there is one
process and nothing is exchanged. A process on a GPU gets cuda:LOCAL_RANK (unless the device
names its index), and the processes talk over gloo for objects on the CPU and NCCL for tensors
on GPUs. `train` (DistributedDataParallel), `extract`, `eval` and `dagger` share these helpers
(docs/distributed.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

# How long a process leaving the group waits for the others to finish their collectives.
CLOSE_WAIT = timedelta(seconds=60)

T = TypeVar("T")

# Set once this process has left a process group it joined (Processes.close): see exit_after_group.
left_a_process_group = False


@dataclass
class Processes:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    local_rank: int = 0
    joined: bool = False  # start_processes joined the process group for this object: close() leaves it

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, *values: float) -> list[float]:
        """Each value summed over the processes (float64)."""
        if self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value) -> list:
        """Every process's `value` (picklable), in rank order, on every process."""
        if self.world_size == 1:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value):
        """Process 0's `value` on every process (the others pass anything, e.g. None)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def first(self, work: Callable[..., T], *args) -> T:
        """`work(*args)` on process 0 only (writing a shared file, reading one another process may be
        writing); its result on every process, or its OSError / ValueError raised on every one."""
        outcome = None
        if self.main:
            try:
                outcome = (True, work(*args))
            except (OSError, ValueError) as exc:
                outcome = (False, exc)
        ok, value = self.broadcast(outcome)
        if not ok:
            raise value
        return value

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def agree(self, what: str, value) -> None:
        """ValueError on every process unless all give the same `value` (JSON-able): each process
        reads its own settings and inputs, which the processes on other machines may not share."""
        if self.world_size == 1:
            return
        digests = self.gather(digest(value))
        if len(set(digests)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, d in enumerate(digests):
                groups.setdefault(d, []).append(rank)
            listed = "; ".join(f"ranks {', '.join(map(str, ranks))}: {d[:12]}" for d, ranks in groups.items())
            raise ValueError(f"the processes disagree on {what} ({listed}); every rank must run the same command "
                             f"with the same configuration files and inputs (docs/distributed.md)")

    def log(self, message: str) -> None:
        """A line on this process's stderr, naming the rank when there are several."""
        from tqdm import tqdm

        prefix = f"[rank {self.rank}/{self.world_size}] " if self.world_size > 1 else ""
        tqdm.write(prefix + message, file=sys.stderr)  # above process 0's progress bar

    def close(self) -> None:
        """Leave the process group if start_processes joined it for this object."""
        global left_a_process_group
        if self.joined and dist.is_initialized():
            # No process tears the group down while another is still in a collective: under load,
            # a process leaving first has been seen to abort the other at exit (gloo, SIGABRT). The
            # wait is bounded, so a process that failed alone does not hang the others.
            try:
                dist.monitored_barrier(timeout=CLOSE_WAIT)
            except RuntimeError:
                pass  # a process failed or left: its own error is the one to report
            dist.destroy_process_group()
            left_a_process_group = True
        self.joined = False


def exit_after_group(code: int) -> None:
    """End a process that has left its process group with `code`, its output flushed, without the
    interpreter's teardown: there, gloo's C++ threads and the objects they still hold are torn down
    in no fixed order, and under load that has aborted a process (SIGABRT, "terminate called
    without an active exception") after its work and its error message were complete. Every file
    a command writes is closed before it returns."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def start_processes(device: str = "cpu") -> Processes:
    """This process's rank and device; joins the torchrun process group when there is one
    (WORLD_SIZE > 1) and it is not joined yet. `device`: cpu, cuda, cuda:N or auto (cuda when
    torch sees a GPU); cuda without an index is cuda:LOCAL_RANK."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", local_rank)
    if world_size == 1:
        return Processes(0, 1, target, local_rank)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    joined = not dist.is_initialized()
    if joined:
        # gloo carries the objects the processes exchange (in CPU memory), NCCL the GPU tensors.
        dist.init_process_group("cpu:gloo,cuda:nccl" if target.type == "cuda" else "gloo")
    return Processes(dist.get_rank(), dist.get_world_size(), target, local_rank, joined)


def digest(value) -> str:
    """sha256 of `value` as canonical JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def file_digest(*paths) -> str:
    """sha256 of the contents of `paths` (in order): the same weights on every machine."""
    sha = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
    return sha.hexdigest()


def shares(count: int, processes: Processes) -> range:
    """The positions of `count` equal work items this process takes: one contiguous block each,
    sizes differing by one at most (rank order = item order)."""
    base, extra = divmod(count, processes.world_size)
    start = processes.rank * base + min(processes.rank, extra)
    return range(start, start + base + (processes.rank < extra))
