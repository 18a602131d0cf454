"""Where a step's time goes and what it computed: the numbers every run reports beside samples/s.

- tokens/s counts real tokens (the attention mask's ones), not padding; `padding` is the share of the tokens the
  model computed that were padding.
- FLOPs are model FLOPs of the real tokens (forward + backward, activation recomputation not counted):
  6 N per token, N the parameters that multiply each token (the embeddings, pooler and head aside), plus
  12 L h t^2 per sequence of t tokens for attention (the formula plan/estimate.py uses). MFU divides their rate by
  the device's dense peak for the precision (machine.gpu_peak_tflops) times the ranks; only where the peak is
  known: never a guess for an unknown GPU, and never on a CPU.
- The time split: data (waiting for the next batch), forward_backward (with the gradient all-reduce DDP and FSDP
  overlap with it), optimizer (clipping, the step, the scheduler), notice (the per-step collective that shares a
  preemption notice), checkpoint, eval. Host time on a CPU, where every op is synchronous; on CUDA, the
  forward_backward and optimizer phases are timed by CUDA events read at the next log step (after the loss has
  synchronised the device anyway), so measuring adds no synchronisation; the notice, a CPU collective, by host time.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from torchloom.machine import gpu_peak_tflops
from torchloom.train.distributed import Dist, all_reduce_sum

PHASES = ("data", "forward_backward", "optimizer", "notice", "checkpoint", "eval")
DEVICE_PHASES = ("forward_backward", "optimizer")  # timed by CUDA events on a GPU (the notice is a CPU collective)


def flops_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(N, layers, hidden): the parameters that multiply each token, and the attention term's shape."""
    skip = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) or name.rsplit(".", 1)[-1] in ("pooler", "classifier", "score"):
            skip.update(id(p) for p in module.parameters())
    n = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    config = getattr(model, "config", None)
    return n, int(getattr(config, "num_hidden_layers", 0) or 0), int(getattr(config, "hidden_size", 0) or 0)


class StepClock:
    """Per-phase time and per-step work on this rank, summed over a log window and over the run."""

    def __init__(self, device: torch.device, shape: tuple[int, int, int]):
        self.cuda = torch.device(device).type == "cuda"
        self.n, self.layers, self.hidden = shape
        self.window = self._empty()
        self.run = self._empty()
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @staticmethod
    def _empty() -> dict[str, float]:
        return {**dict.fromkeys(PHASES, 0.0), "real_tokens": 0.0, "computed_tokens": 0.0, "flops": 0.0}

    @contextmanager
    def phase(self, name: str):
        if self.cuda and name in DEVICE_PHASES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        started = time.perf_counter()
        yield
        self._add(name, time.perf_counter() - started)

    def count(self, attention_mask: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """One micro-batch's tokens and model FLOPs (the mask as the loader gives it, on the host). lengths: each
        sequence's tokens where a row holds several (a packed batch); attention's FLOPs are per sequence."""
        lengths = (attention_mask.sum(dim=1) if lengths is None else lengths).to(torch.float64)
        real = float(lengths.sum())
        flops = 6.0 * self.n * real + 12.0 * self.layers * self.hidden * float((lengths * lengths).sum())
        for totals in (self.window, self.run):
            totals["real_tokens"] += real
            totals["computed_tokens"] += float(attention_mask.numel())
            totals["flops"] += flops

    def _add(self, name: str, seconds: float) -> None:
        self.window[name] += seconds
        self.run[name] += seconds

    def settle(self) -> None:
        """The CUDA events' times into the totals (call where the device has synchronised: a log step)."""
        for name, start, end in self._events:
            end.synchronize()
            self._add(name, start.elapsed_time(end) / 1000)
        self._events.clear()

    def take_window(self) -> dict[str, float]:
        self.settle()
        window, self.window = self.window, self._empty()
        return window


def summed(d: Dist, loss: float, work: dict[str, float]) -> tuple[float, dict[str, float]]:
    """Collective: the loss and a clock's totals summed over the ranks (one small all-reduce)."""
    keys = sorted(work)
    values = all_reduce_sum(d, [loss, *(work[k] for k in keys)])
    return values[0], dict(zip(keys, values[1:], strict=True))


def rates(totals: dict[str, float], seconds: float, ranks_per_replica: int, device: torch.device, precision: str,
          world_size: int) -> dict:
    """tokens/s, padding, MFU (where the peak is known) and the time split (shares of `seconds`) from totals summed
    over the ranks (a pipeline's stages all count the same batches: `ranks_per_replica` of them)."""
    real = totals["real_tokens"] / ranks_per_replica
    computed = totals["computed_tokens"] / ranks_per_replica
    out: dict = {"tokens_per_s": round(real / seconds, 1) if seconds > 0 else 0.0,
                 "padding": round(1 - real / computed, 4) if computed else 0.0}
    if torch.device(device).type == "cuda" and seconds > 0:
        peak = gpu_peak_tflops(torch.cuda.get_device_name(device), precision)
        if peak:
            out["mfu"] = round(totals["flops"] / ranks_per_replica / seconds / (peak * 1e12 * world_size), 4)
    return out


def time_split(totals: dict[str, float], seconds: float, world_size: int) -> dict[str, float]:
    """Each phase's share of the wall time, averaged over the ranks (their phase seconds were summed)."""
    if seconds <= 0:
        return {}
    return {name: round(totals[name] / world_size / seconds, 4) for name in PHASES if totals[name] > 0}
