"""The fast collective tier: the engine-agnostic training loop (train.entry.run, what every engine's worker runs)
on N threads of this process, joined by torch's threaded process group (torch.testing's multi_threaded_pg, what
PyTorch's own distributed tests prefer where the process is not the subject).

Each thread is a rank with its own process group (torch's thread-isolation mode); the collectives are real (a sum
is a sum of every rank's tensor), so a DDP run on threads ends at the weights of the local engine's processes, bit
for bit, in a second instead of ten. What threads share that processes do not: one CPU random generator. The model
is built under a lock, right after its seed (train/loop.py seeds, then builds), so each rank's initial weights are
the ones its process would draw; use a model without dropout, whose training draws nothing.

Every collective a rank calls through torch.distributed is recorded, in order, with its tensors' shapes: ranks that
call different collectives (or the same in another order) hang in production; here the records differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
               "gather", "scatter", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier",
               "gather_object", "scatter_object_list", "all_to_all_single")


@dataclasses.dataclass
class ThreadedRun:
    results: dict[int, Any]  # rank -> its TrainResult
    errors: dict[int, BaseException]  # rank -> what it raised
    calls: dict[int, list[tuple]]  # rank -> (collective, group, shapes) in the order it called them


def _shapes(args, kwargs) -> tuple:
    import torch

    def one(x):
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), str(x.dtype))
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
            return tuple(one(t) for t in x)
        return None

    return tuple(s for s in (one(a) for a in (*args, *kwargs.values())) if s is not None)


def _bytes(name: str, args, kwargs) -> int:
    """What one rank puts into a collective: its tensors' bytes, or an object's pickled size (what torch sends)."""
    import pickle

    import torch

    if name.endswith("_object") or name.endswith("_object_list"):
        obj = args[1] if name == "all_gather_object" else args[0]
        return len(pickle.dumps(obj))
    return sum(x.numel() * x.element_size() for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))


@contextlib.contextmanager
def threaded_world(calls: dict[int, list[tuple]], sent: dict[int, int] | None = None):
    """torch's threaded process group installed (each thread its own world), the collectives recorded into
    `calls` (and the bytes each rank put into them summed into `sent`), and the model built under a lock after its
    seed; all put back after."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    from torchloom.train import loop

    lock, seeds = threading.Lock(), threading.local()
    real_seed, real_build = loop.seed_everything, loop.build_classifier

    def seed(value: int) -> None:
        seeds.value = value

    def build(*args, **kwargs):
        with lock:
            real_seed(seeds.value)
            return real_build(*args, **kwargs)

    def recorded(name, real):
        def call(*args, **kwargs):
            if dist.is_initialized():
                group = kwargs.get("group")
                kind = "default" if group is None or group is dist.group.WORLD else group.name()
                calls.setdefault(dist.get_rank(), []).append((name, kind, _shapes(args, kwargs)))
                if sent is not None:
                    sent[dist.get_rank()] = sent.get(dist.get_rank(), 0) + _bytes(name, args, kwargs)
            return real(*args, **kwargs)
        return call

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    loop.seed_everything, loop.build_classifier = seed, build
    for name, real in originals.items():
        setattr(dist, name, recorded(name, real))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)
        loop.seed_everything, loop.build_classifier = real_seed, real_build
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()
        mtpg.ProcessLocalGroup.reset()


def train_on_threads(cfg, run_dir: str, world: int, timeout_s: float = 120) -> ThreadedRun:
    """train.entry.run of `cfg` on `world` ranks, one thread each, in this process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    from torchloom.runs.runfiles import RunFiles
    from torchloom.train import entry

    out = ThreadedRun({}, {}, {})
    store = dist.HashStore()

    def rank(r: int) -> None:
        try:
            dist.init_process_group("threaded", rank=r, world_size=world, store=store)
            out.results[r] = entry.run(cfg, RunFiles(run_dir))
        except BaseException as e:  # the others would wait for this rank's next collective: wake them
            out.errors[r] = e
            mtpg.ProcessLocalGroup.exception_handle(e)

    with threaded_world(out.calls):
        threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise AssertionError(f"{', '.join(stuck)} still running after {timeout_s} s: a collective no rank joined")
    return out


def run_on_threads(world: int, fn, timeout_s: float = 60) -> tuple[dict[int, Any], dict[int, int]]:
    """fn(rank) on `world` ranks, one thread each, joined by the threaded process group: ({rank: what it returned},
    {rank: bytes it put into collectives}); what a rank raised is raised here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    sent: dict[int, int] = {}
    store = dist.HashStore()

    def rank(r: int) -> None:
        try:
            dist.init_process_group("threaded", rank=r, world_size=world, store=store)
            results[r] = fn(r)
        except BaseException as e:
            errors[r] = e
            mtpg.ProcessLocalGroup.exception_handle(e)

    with threaded_world({}, sent):
        threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
    if errors:
        raise next(iter(errors.values()))
    assert len(results) == world, f"ranks {sorted(set(range(world)) - set(results))} never returned"
    return results, sent
