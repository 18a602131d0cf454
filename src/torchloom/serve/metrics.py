"""Counters, histograms and a gauge in Prometheus' text exposition format (version 0.0.4), no dependency.

Each server owns one `ServeMetrics`; values are only touched from the event loop thread, so no locks.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class Counter:
    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        values = self.values or ({(): 0.0} if not self.labelnames else {})
        for labels, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


class Gauge:
    """A value read when scraped (e.g. the queue depth), so it is never stale."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help_text, read

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        yield f"{self.name} {_number(self.read())}"


class Family:
    """Gauges with labels, all read when scraped from one function: [(label values, value), ...]."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...],
                 read: Callable[[], list[tuple[tuple[str, ...], float]]]) -> None:
        self.name, self.help, self.labelnames, self.read = name, help_text, labelnames, read

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        for labels, value in self.read():
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


def monitor_families(report: Callable[[], dict]) -> list[Family]:
    """The monitor's gauges (serve/live_monitor.py), read from its current report when scraped."""
    from torchloom.drift import SIGNALS

    def signal(key: str):
        def read():
            r = report()
            return [((name,), r["signals"][name][key]) for name in SIGNALS
                    if "signals" in r and r["signals"][name][key] is not None]
        return read

    def states():
        current = report()["state"]
        return [((state,), float(state == current)) for state in ("off", "warming_up", "no_drift", "drift")]

    def accuracy():
        est = report().get("estimated_accuracy")
        return [((bound,), est[key]) for bound, key in (("estimate", "value"), ("low", "low"), ("high", "high"))] \
            if est else []

    def shares():
        r = report()
        return [((label,), s["window"]) for label, s in r.get("class_shares", {}).items()]

    return [
        Family("torchloom_monitor_state", "1 for the monitor's state: off (no profile), warming_up (too few texts),"
               " no_drift or drift.", ("state",), states),
        Family("torchloom_monitor_drift", "1 while the window of recent texts has drifted from the model's reference"
               " (any signal past its threshold), else 0.", (), lambda: [((), float(report()["drift"]))]),
        Family("torchloom_monitor_distance", "Each signal's distance between the window and the reference.",
               ("signal",), signal("distance")),
        Family("torchloom_monitor_threshold", "Each signal's threshold, drawn from the reference for the chosen"
               " false-alarm rate.", ("signal",), signal("threshold")),
        Family("torchloom_monitor_estimated_accuracy", "Accuracy the model's confidence promises on the window"
               " (no labels needed), with its 95 % interval.", ("bound",), accuracy),
        Family("torchloom_monitor_window_texts", "Texts in the monitor's window.",
               (), lambda: [((), float(report().get("texts", 0)))]),
        Family("torchloom_monitor_class_share", "Each label's share of the window's predictions.", ("label",),
               shares),
    ]


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...],
                 labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.labelnames = name, help_text, labelnames
        self.buckets = tuple(sorted(buckets))
        # per label values: counts per bucket (not cumulative; +Inf last), sum
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        counts, total = self.series.setdefault(labels, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        total[0] += value

    def count(self, *labels: str) -> int:
        return sum(self.series.get(labels, ([0], [0.0]))[0])

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        series = self.series or ({(): ([0] * (len(self.buckets) + 1), [0.0])} if not self.labelnames else {})
        for labels, (counts, total) in sorted(series.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts):
                cumulative += n
                le = 'le="' + _number(bound) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, labels, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, labels)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.labelnames, labels)} {cumulative}"


class ServeMetrics:
    """The server's metrics: requests by endpoint and status, latency, batch sizes, queue depth, model errors."""

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0,
                 monitor: Callable[[], dict] | None = None, queue_capacity: float = 0) -> None:
        """monitor: the monitor's current report (live_monitor.LiveMonitor.current, or its "off" report)."""
        self.requests = Counter("torchloom_requests_total", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"))
        self.latency = Histogram("torchloom_request_duration_seconds",
                                 "Time from request received to response sent, by endpoint.",
                                 LATENCY_BUCKETS, ("endpoint",))
        self.batch_size = Histogram("torchloom_batch_size", "Texts per model forward batch.", BATCH_BUCKETS)
        self.batch_seconds = Histogram("torchloom_batch_duration_seconds",
                                       "Time one batch spends in the model (forward and softmax; cleaning and"
                                       " tokenizing too where the request was not tokenized first).",
                                       LATENCY_BUCKETS)
        self.batch_tokens = Histogram("torchloom_batch_tokens", "Padded tokens per model forward batch (rows x"
                                      " the longest row): what the forward computes.", TOKEN_BUCKETS)
        self.queue_seconds = Histogram("torchloom_queue_duration_seconds",
                                       "Time a request's texts wait in the queue before their batch starts.",
                                       LATENCY_BUCKETS)
        self.tokenize_seconds = Histogram("torchloom_tokenize_duration_seconds",
                                          "Time to clean and tokenize one request's texts.", LATENCY_BUCKETS)
        self.texts = Counter("torchloom_texts_total", "Texts predicted.")
        self.dropped = Counter("torchloom_texts_dropped_total",
                               "Texts dropped before the model because their client disconnected.")
        self.client_disconnects = Counter("torchloom_client_disconnects_total",
                                          "Requests whose client closed the connection before the answer: while"
                                          " sending the body (stage=body) or while its texts waited"
                                          " (stage=waiting).", ("stage",))
        for stage in ("body", "waiting"):  # both series from the start, at 0
            self.client_disconnects.inc(stage, amount=0)
        self.warm_up_batches = Counter("torchloom_warm_up_batches_total", "Batches the warm-up ran before /readyz, by"
                                       " padded length: one per length bucket.", ("length",))
        self.model_errors = Counter("torchloom_model_errors_total", "Batches or requests the model failed on.")
        self.queue_depth = Gauge("torchloom_queue_depth", "Texts accepted and waiting for the model.", queue_depth)
        self.queue_capacity = Gauge("torchloom_queue_capacity", "Texts the queue holds at most (--max-queue): past it"
                                    " requests get 429.", lambda: queue_capacity)
        self.monitor = monitor_families(monitor) if monitor is not None else []

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.latency, self.batch_size, self.batch_tokens, self.batch_seconds,
                       self.queue_seconds, self.tokenize_seconds, self.texts, self.dropped,
                       self.client_disconnects, self.warm_up_batches, self.model_errors, self.queue_depth,
                       self.queue_capacity, *self.monitor):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
