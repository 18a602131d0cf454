"""A classifier's forward as one traced graph (TorchScript), for serving on a CPU.

Eager PyTorch runs a forward op by op from Python and lets go of the GIL around each op. Alone, that costs
little (a traced forward of the tiny model is ~7 % faster). In a server it costs much more: between two ops
the model thread must win the GIL back from the event loop and the tokenizer threads, hundreds of times a
batch, and the batch takes twice as long as offline (tiny model, 1 text per request, c = 64,
docs/benchmarks.md). A traced graph runs its ops in C++ with the GIL released once.

`torch.jit.trace` is deprecated in favour of torch.compile and torch.export, neither of which gives this
without a compile step of tens of seconds per shape; the trace is taken in ~0.1 s, and only where it answers as
eager does: each graph is checked against eager on rows of different lengths (padded and not) before it is
used, and where it is slower alone than eager (MiniLM under bf16 autocast) or anything fails (an older or
newer torch without it, a model that does not trace, different logits) the forward stays eager. A server
chooses once, at warm-up (model/served.py); one graph per (input names, autocast dtype).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torchloom.errors import first_line

# a traced graph must give eager's logits within this (fp32: the same ops, so equal; bf16 runs the same casts)
PARITY_ATOL = {"fp32": 1e-4, "reduced": 2e-2}


class TracedForward:
    """`logits(batch)`: the model's logits for a padded batch (a dict of int64 tensors on its device), through
    a traced graph where `choose` chose one for these inputs and this autocast dtype, else eager. Not
    thread-safe (one model thread)."""

    def __init__(self, model: Any, pooled: bool = False) -> None:
        """pooled: the graphs also give each row's pooled representation (`forward`; a monitor's sketch)."""
        self.model = model
        self.pooled = pooled
        self._graphs: dict[tuple, Any] = {}  # (input names, autocast dtype) -> the graph chosen (None: eager)

    def logits(self, batch: dict[str, Any]) -> Any:
        return self.forward(batch)[0]

    def forward(self, batch: dict[str, Any]) -> tuple[Any, Any]:
        """(logits, pooled representation or None) of a padded batch."""
        graph = self._graphs.get((tuple(batch), _autocast_dtype()))
        if graph is None:
            return eager_forward(self.model, batch, self.pooled)
        out = graph(*batch.values())
        return out if self.pooled else (out, None)

    @property
    def traced(self) -> bool:
        """Whether `choose` chose a graph for any inputs."""
        return any(graph is not None for graph in self._graphs.values())

    def choose(self, batch: dict[str, Any], context: Callable[[], Any] = nullcontext, gain: float = 1.0
               ) -> tuple[bool, str]:
        """Trace the model for `batch`'s inputs, check the graph against eager (a padded probe, an unpadded row
        and `batch`) and time both on `batch`, each forward in `context` (the server's autocast, entered per
        batch as it runs them). The graph is used from now on where it takes at most `gain` x eager's time:
        alone it is then no slower, and in a server it also spares the model thread the GIL hand-offs. A graph
        can be slower (MiniLM under bf16 autocast: 25-45 %), and where the two tie the forward is long enough
        that the hand-offs hardly matter. Returns (traced, the reason in a few words)."""
        import torch

        with context():
            key = (tuple(batch), _autocast_dtype())
        self._graphs[key] = None
        try:
            probe = _probe(batch)
            with warnings.catch_warnings(), context():
                warnings.simplefilter("ignore")  # the deprecation notice, and transformers' tracer warnings
                graph = torch.jit.trace(_positional(self.model, key[0], self.pooled), tuple(probe.values()),
                                        check_trace=False)
            atol = PARITY_ATOL["reduced" if key[1] is not None else "fp32"]
            for rows in (probe, _unpadded(probe), batch):
                with context():
                    want = eager_forward(self.model, rows, self.pooled)
                    got = graph(*rows.values())
                    got = got if self.pooled else (got, None)
                for what, a, b in zip(("logits", "pooled representations"), want, got):
                    if a is None:
                        continue
                    a, b = a.float(), b.float()
                    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=0):
                        return False, f"traced {what} differ from eager by {(a - b).abs().max().item():.3g}"
        except Exception as e:  # noqa: BLE001 - whatever the tracer or the model raises, the forward stays eager
            return False, f"the model does not trace ({first_line(e)})"
        def run_eager() -> None:
            with context():
                eager_forward(self.model, batch, self.pooled)

        def run_traced() -> None:
            with context():
                graph(*batch.values())

        eager, traced = best_seconds(run_eager), best_seconds(run_traced)
        timing = f"{traced * 1e3:.1f} ms a batch traced, {eager * 1e3:.1f} eager"
        if traced > gain * eager:
            return False, f"not faster traced ({timing})"
        self._graphs[key] = graph
        return True, timing


def best_seconds(run: Any, times: int = 3, warm: int = 3) -> float:
    """The fastest of `times` runs of `run`, in seconds, after `warm` runs not counted (a traced graph's first
    two runs profile and optimize it)."""
    import time

    for _ in range(warm):
        run()
    best = float("inf")
    for _ in range(times):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def eager_forward(model: Any, batch: dict[str, Any], pooled: bool = False) -> tuple[Any, Any]:
    """(logits, pooled) of a padded batch, eagerly; pooled: each row's last hidden states averaged over its tokens
    (the attention mask), the representation a monitor sketches (monitor/profile.py); None unless asked."""
    if not pooled:
        return model(**batch).logits, None
    out = model(**batch, output_hidden_states=True)
    return out.logits, mean_pooled(out.hidden_states[-1], batch["attention_mask"])


def mean_pooled(hidden: Any, mask: Any) -> Any:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)


def _positional(model: Any, names: tuple[str, ...], pooled: bool = False) -> Any:
    """The model as a module of positional tensors (what a trace takes), giving its logits (and pooled)."""
    import torch

    class Positional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return (eager_forward(self.model, dict(zip(names, tensors)), pooled) if pooled else
                self.model(**dict(zip(names, tensors))).logits)

    return Positional()


def _autocast_dtype() -> Any:
    """The dtype autocast runs at on the CPU now, or None when it is off."""
    import torch

    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _probe(batch: dict[str, Any]) -> dict[str, Any]:
    """Two rows of 8 tokens from the batch's first row, the second padded after 5: a trace must see padding,
    or a model that skips an all-ones attention mask records the skip and ignores padding for ever."""
    import torch

    out = {}
    for name, values in batch.items():
        row = values[0]
        first = torch.cat([row[:1], row[1:2].repeat(7)]) if row.numel() > 1 else row.repeat(8)
        rows = torch.stack([first, first.clone()])
        if name == "attention_mask":
            rows[:] = 1
            rows[1, 5:] = 0
        out[name] = rows.to(values.device)
    return out


def _unpadded(probe: dict[str, Any]) -> dict[str, Any]:
    """The probe's first row alone: no padding at all."""
    return {name: values[:1] for name, values in probe.items()}
