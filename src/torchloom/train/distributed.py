"""Process group and device set-up for one worker, whichever engine started it."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchloom.errors import UserError


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # we initialised the process group, so we destroy it
    io_group: Any = None  # gloo, 30-minute timeout: barriers around checkpoint writes
    control_group: Any = None  # gloo, the collective timeout: small flags at every step (None: the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def io_barrier(self) -> None:
        """A barrier that waits for slow I/O (a checkpoint being written) longer than collectives may."""
        if self.enabled:
            dist.barrier(group=self.io_group)



def pick_device(kind: str, local_rank: int, assigned: str | None = None) -> torch.device:
    """One GPU per process: `assigned` (the device the engine gave this rank, e.g. Ray's) wins; else
    `auto` takes the GPU of this local rank when the host has GPUs, and `cuda` insists on it.

    Two ranks never share a GPU (NCCL refuses it): a local rank beyond the host's GPUs is an error.
    """
    if assigned:
        return torch.device(assigned)
    if kind == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UserError(f"engine.workers: local rank {local_rank} but this host has {count} visible GPU"
                            f"{'s' if count != 1 else ''}; run at most {count} workers per host (one per GPU)"
                            " or set engine.device cpu")
        return torch.device("cuda", local_rank)
    if kind == "cuda":
        raise UserError("engine.device cuda: torch sees no CUDA device on this worker; use engine.device cpu or auto")
    return torch.device("cpu")


IO_TIMEOUT = datetime.timedelta(minutes=30)


def io_group(world: int):
    # Every rank creates it, in the same order, right after the process group.
    return dist.new_group(backend="gloo", timeout=IO_TIMEOUT) if world > 1 else None


def control_group(world: int, timeout_s: float):
    """Small CPU collectives under the collective timeout (the preemption flag at every step): the default
    group where it is gloo, else a gloo group of its own, so a GPU's stream never waits for them.
    Every rank creates it, in the same order, right after io_group."""
    if world <= 1 or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def setup(device_kind: str, threads: int, assigned: str | None = None, timeout_s: float = 1800.0) -> Dist:
    """Join the process group the engine described (env vars) or use the one it already made.

    assigned: the device the engine gave this rank (None: chosen from device_kind and LOCAL_RANK).
    timeout_s: how long a collective may wait for a peer before it fails (a peer that died).
    """
    if threads > 0:
        torch.set_num_threads(threads)
    if dist.is_available() and dist.is_initialized():  # the engine made the group (Ray Train)
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = pick_device(device_kind, local_rank, assigned)
        if device.type == "cuda":  # the current device too: CUDA events, pinning threads and NCCL use it
            torch.cuda.set_device(device)
        return Dist(rank, world, local_rank, device, owns_group=False,
                    io_group=io_group(world), control_group=control_group(world, timeout_s))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_kind, local_rank, assigned)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # Collectives give up on a dead peer after timeout_s; the rendezvous store waits as long as
        # the slowest start may take.
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
            store=attempt_store(rank, world, IO_TIMEOUT), rank=rank, world_size=world,
        )
    return Dist(rank, world, local_rank, device, owns_group=world > 1, io_group=io_group(world),
                control_group=control_group(world, timeout_s))


def attempt_store(rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store; an agent-hosted one with its keys prefixed by the restart attempt.

    torch elastic keeps one agent-hosted store across restarts, so without a prefix the workers of a
    restarted attempt read the addresses the dead attempt's workers published, and gloo fails to
    connect to them (seen with torch 2.13 and torch elastic's max_restarts). The restart count is each
    agent's own, so across nodes it can differ after a restart (pytorch/pytorch#135712); there the
    torchrun engine asks for TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, under which rank 0 hosts a new store
    on a new port at every rendezvous round, and no prefix is needed (nor wanted).
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size=world, is_master=rank == 0 and not agent_store,
                          timeout=timeout, wait_for_workers=False)
    if not agent_store:
        return dist.PrefixStore("torchloom", store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"torchloom/attempt_{attempt}", store)


def teardown(d: Dist) -> None:
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, values: list[float], slow: bool = False) -> list[float]:
    """slow: some rank may take long to arrive (it waits on I/O, e.g. a tuning database), so the sum
    runs on the 30-minute gloo group instead of under the collective timeout."""
    t = torch.tensor(values, dtype=torch.float64, device="cpu" if slow else d.device)
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.io_group if slow else None)
    return t.tolist()


def all_reduce_array(d: Dist, values: np.ndarray) -> np.ndarray:
    """Collective: the element-wise sum over ranks of a float64 vector (on the training device: nccl's path)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).to(d.device)
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().numpy()


def any_rank(d: Dist, flag: bool) -> bool:
    """Collective: whether `flag` holds on any rank (on the control group: CPU, under the collective timeout)."""
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=d.control_group)
    return t.item() > 0


class AgreedLater:
    """A flag the ranks agree on at step boundaries without a wait on the training thread: each boundary's flags are
    summed in the background on the control group (gloo runs it on its own threads) and decide at the next boundary,
    the same on every rank. The preemption notice is shared this way (was a blocking all-reduce at every step: ~9%
    of a tiny model's step on 2 ranks, docs/benchmarks.md), a step later than a blocking one would."""

    def __init__(self, d: Dist):
        self.d = d
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, flag: bool) -> bool:
        """Collective: send this boundary's flag; whether any rank had it at the previous boundary."""
        pending = self._pending
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        work = (dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.d.control_group, async_op=True)
            if self.d.enabled else None)
        self._pending = (work, t)
        return self._answer(pending)

    def drain(self) -> bool:
        """Wait for the flags still on their way (before the group does anything else at the end)."""
        pending, self._pending = self._pending, None
        return self._answer(pending)

    @staticmethod
    def _answer(pending) -> bool:
        if pending is None:
            return False
        work, t = pending
        if work is not None:
            work.wait()
        return t.item() > 0


def broadcast_from_main(d: Dist, obj):
    """Collective: rank 0's `obj` on every rank (on the 30-minute I/O group: rank 0 may be reading a
    checkpoint meanwhile)."""
    if not d.enabled:
        return obj
    box = [obj if d.is_main else None]
    dist.broadcast_object_list(box, src=0, group=d.io_group)
    return box[0]


def all_gather_objects(d: Dist, obj):
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out
