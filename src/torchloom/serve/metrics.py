"""Counters, histograms and a gauge in Prometheus' text exposition format (version 0.0.4), no dependency.

Each server owns one `ServeMetrics`; values are only touched from the event loop thread, so no locks.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RECENT_S = 60.0  # the recent latencies' span (the status page's p50 and p99)
RECENT_MAX = 20_000  # latencies kept for it at the most (the newest)
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
                 read: Callable[[], list[tuple[tuple[str, ...], float]]], kind: str = "gauge") -> None:
        self.name, self.help, self.labelnames, self.read, self.kind = name, help_text, labelnames, read, kind

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for labels, value in self.read():
            yield f"{self.name}{_labels(self.labelnames, labels)} {_number(value)}"


def monitor_families(reports) -> list[Family]:
    """The monitor's gauges (monitor/gauges.py: one series per model and version), read when scraped."""
    from torchloom.monitor.gauges import monitor_gauges

    return [Family(*gauge) for gauge in monitor_gauges(reports)]


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


# --- several processes (Ray Serve's replicas): prometheus-client's multiprocess mode ---------------------------
#
# Each replica writes its values to files in one directory of the node (ServeSettings.metrics_dir, in the server's
# private temp dir); whichever replica the proxy sends a scrape to reads them all: counters and histograms summed
# over replicas (a restarted replica's counts stay), the queue gauges summed over live replicas, the monitor's
# gauges one series per live replica (a `pid` label: each replica watches the texts it answered).


def _use_files(path: str) -> None:
    """prometheus-client's values in files under `path` for this process. The choice is made when
    prometheus_client is imported (Ray's worker may have imported it first): the value class is set here too."""
    import os

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()


class _Shared:
    """One prometheus-client metric behind the interface of Counter/Histogram above."""

    def __init__(self, metric, labelnames: tuple[str, ...]) -> None:
        self.metric, self.labelnames = metric, labelnames
        self.children: dict[tuple[str, ...], object] = {}

    def child(self, labels: tuple[str, ...]):
        found = self.children.get(labels)
        if found is None:
            found = self.children[labels] = self.metric.labels(*labels) if self.labelnames else self.metric
        return found


class SharedCounter(_Shared):
    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.child(labels).inc(amount)

    @property
    def values(self) -> dict[tuple[str, ...], float]:
        """This process's own counts (as Counter.values)."""
        return {labels: child._value.get() for labels, child in self.children.items()}


class SharedHistogram(_Shared):
    def observe(self, value: float, *labels: str) -> None:
        self.child(labels).observe(value)

    def count(self, *labels: str) -> int:
        child = self.children.get(labels)
        return int(sum(b.get() for b in child._buckets)) if child is not None else 0


def _shared_metrics(path: str) -> dict[str, object]:
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PCounter
    from prometheus_client import Gauge as PGauge
    from prometheus_client import Histogram as PHistogram

    _use_files(path)
    registry = CollectorRegistry()  # the objects only: what a scrape shows comes from the files (render)

    def counter(name, help_text, labelnames=()):
        return SharedCounter(PCounter(name, help_text, labelnames, registry=registry), labelnames)

    def histogram(name, help_text, buckets, labelnames=()):
        return SharedHistogram(PHistogram(name, help_text, labelnames, registry=registry, buckets=buckets),
                               labelnames)

    def gauge(name, help_text, labelnames=(), mode="livesum"):
        return PGauge(name, help_text, labelnames, registry=registry, multiprocess_mode=mode)

    return {"counter": counter, "histogram": histogram, "gauge": gauge}


class ServeMetrics:
    """The server's metrics: requests by endpoint and status, latency, batch sizes, queue depth, model errors."""

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0,
                 monitor: Callable[[], list] | None = None, queue_capacity: float = 0,
                 shared_dir: str | None = None) -> None:
        """monitor: each model's (name, version) and its monitor's current report (monitor/live.py:
        LiveMonitor.current, or its "off" report).
        shared_dir: the directory the processes of one server share their values in (prometheus-client's
        multiprocess mode, for Ray Serve's replicas); None: this process's own, rendered by hand (the local
        server: one process, and the cheapest per request)."""
        self.shared_dir = shared_dir
        made = _shared_metrics(shared_dir) if shared_dir else {}
        Counter_ = made.get("counter", Counter)  # noqa: N806 (a class, or its stand-in)
        Histogram_ = made.get("histogram", Histogram)  # noqa: N806
        self.requests = Counter_("torchloom_requests_total", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"))
        self.latency = Histogram_("torchloom_request_duration_seconds",
                                 "Time from request received to response sent, by endpoint.",
                                 LATENCY_BUCKETS, ("endpoint",))
        self.batch_size = Histogram_("torchloom_batch_size", "Texts per model forward batch.", BATCH_BUCKETS)
        self.batch_seconds = Histogram_("torchloom_batch_duration_seconds",
                                       "Time one batch spends in the model (forward and softmax; cleaning and"
                                       " tokenizing too where the request was not tokenized first).",
                                       LATENCY_BUCKETS)
        self.batch_tokens = Histogram_("torchloom_batch_tokens", "Padded tokens per model forward batch (rows x"
                                      " the longest row): what the forward computes.", TOKEN_BUCKETS)
        self.queue_seconds = Histogram_("torchloom_queue_duration_seconds",
                                       "Time a request's texts wait in the queue before their batch starts.",
                                       LATENCY_BUCKETS)
        self.tokenize_seconds = Histogram_("torchloom_tokenize_duration_seconds",
                                          "Time to clean and tokenize one request's texts.", LATENCY_BUCKETS)
        self.texts = Counter_("torchloom_texts_total", "Texts predicted.")
        self.dropped = Counter_("torchloom_texts_dropped_total",
                               "Texts dropped before the model because their client disconnected.")
        self.client_disconnects = Counter_("torchloom_client_disconnects_total",
                                          "Requests whose client closed the connection before the answer: while"
                                          " sending the body (stage=body) or while its texts waited"
                                          " (stage=waiting).", ("stage",))
        for stage in ("body", "waiting"):  # both series from the start, at 0
            self.client_disconnects.inc(stage, amount=0)
        self.warm_up_batches = Counter_("torchloom_warm_up_batches_total", "Batches the warm-up ran before /readyz, by"
                                       " padded length: one per length bucket.", ("length",))
        self.model_errors = Counter_("torchloom_model_errors_total", "Batches or requests the model failed on.")
        self.queue_depth = Gauge("torchloom_queue_depth", "Texts accepted and waiting for the model.", queue_depth)
        self.queue_capacity = Gauge("torchloom_queue_capacity", "Texts the queue holds at most (--max-queue): past it"
                                    " requests get 429.", lambda: queue_capacity)
        # the predict endpoints' latencies of the last RECENT_S, measured (the page's p50 and p99, not a bucket)
        self.recent: deque[tuple[float, float]] = deque(maxlen=RECENT_MAX)
        self.recent_latency = Family("torchloom_request_duration_recent_seconds", "Predict requests' latency over"
                                     f" the last {RECENT_S:g} s, measured (this process's): p50, p99 and the count.",
                                     ("quantile",), self._recent_quantiles)
        self.read_monitor = monitor
        self.monitor = monitor_families(monitor) if monitor is not None else []
        self.extra: list[Family] = []  # this process's own, rendered by hand in either mode (serve/fleet.py's)
        self.shared_gauges: dict[str, object] = self._shared_gauges(made["gauge"], queue_capacity) if shared_dir else {}

    def _shared_gauges(self, gauge, queue_capacity: float) -> dict[str, object]:
        """Several processes (Ray Serve's replicas): the gauges each writes into the shared files."""
        gauges = {
            "queue_depth": gauge("torchloom_queue_depth", "Texts accepted and waiting for the model."),
            "queue_capacity": gauge("torchloom_queue_capacity", "Texts the queues hold at most (--max-queue"
                                    " each): past it requests get 429."),
            **{f.name: gauge(f.name, f.help, f.labelnames, mode="liveall") for f in self.monitor},
        }
        gauges["queue_capacity"].set(queue_capacity)
        gauges["queue_depth"].set(0)
        return gauges

    def observe_predict(self, seconds: float) -> None:
        """A predict request's latency, kept for the recent quantiles (RECENT_MAX at most, the newest)."""
        self.recent.append((time.monotonic(), seconds))

    def _recent_quantiles(self) -> list[tuple[tuple[str, ...], float]]:
        return recent_quantiles(self.recent)

    def queue_changed(self) -> None:
        """Several processes: this one's queue depth (the queue_depth it was given, read now: the sum over a
        replica's models), in the files (one process: read when scraped)."""
        if self.shared_gauges:
            self.shared_gauges["queue_depth"].set(self.queue_depth.read())

    def publish_monitor(self, _report: dict | None = None) -> None:
        """Several processes: this one's monitor gauges, in the files (one process: read when scraped)."""
        if not self.shared_gauges:
            return
        for family in self.monitor:
            gauge = self.shared_gauges[family.name]
            for labels, value in family.read():
                (gauge.labels(*labels) if family.labelnames else gauge).set(value)

    def process_gone(self) -> None:
        """Several processes: this one stops; its live gauges leave the files (its counts stay)."""
        if self.shared_dir:
            import os

            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), self.shared_dir)

    def render(self) -> str:
        if self.shared_dir:
            return self._render_shared()
        lines: list[str] = []
        for metric in (self.requests, self.latency, self.batch_size, self.batch_tokens, self.batch_seconds,
                       self.queue_seconds, self.tokenize_seconds, self.texts, self.dropped,
                       self.client_disconnects, self.warm_up_batches, self.model_errors, self.queue_depth,
                       self.queue_capacity, *self.monitor, self.recent_latency, *self.extra):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"

    def _render_shared(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        if self.read_monitor is not None:
            self.publish_monitor()  # this replica's verdict as of now; the others' as of their last evaluation
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.shared_dir)
        own = [line for family in (self.recent_latency, *self.extra) for line in family.render()]
        return generate_latest(registry).decode("utf-8") + ("\n".join(own) + "\n" if own else "")


def recent_quantiles(kept: Iterable[tuple[float, float]]) -> list[tuple[tuple[str, ...], float]]:
    """p50, p99 and the count of the (monotonic time, seconds) pairs of the last RECENT_S; none when there are
    none."""
    since = time.monotonic() - RECENT_S
    values = sorted(v for at, v in kept if at >= since)
    if not values:
        return []
    at = lambda q: values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]  # noqa: E731
    return [(("0.5",), at(0.5)), (("0.99",), at(0.99)), (("count",), float(len(values)))]


def fleet_families(fleet) -> list[Family]:
    """A fleet's metrics (serve/fleet.py: ServeMetrics.extra), read when scraped."""

    def counted(family: str):
        return lambda: [(k[1:], v) for k, v in sorted(fleet.counts.items()) if k[0] == family]

    def accuracy():
        out = []
        for name in fleet.order:
            est = fleet.tallies[name].interval()
            if est:
                out += [((name, b), est[k]) for b, k in (("estimate", "value"), ("low", "low"), ("high", "high"))]
        return out

    def recent():  # each model's requests over the last RECENT_S, as the server-wide family has them
        return [((name, q), v) for name, kept in fleet.latency.items() for (q,), v in recent_quantiles(kept)]

    def verdicts():
        return [((name, fleet.order[0], state), float(v.state == state)) for name, v in fleet.verdicts.items()
                for state in ("a_better", "b_better", "not_yet_known")]

    return [
        Family("torchloom_model_info", "1 per model behind the endpoint, with its name and version.",
               ("model", "name", "version"), lambda: [((n, fleet.members[n].identity.name,
                                                        fleet.members[n].identity.version), 1.0)
                                                      for n in fleet.order]),
        Family("torchloom_model_traffic_percent", "Each model's share of the requests (the split).", ("model",),
               lambda: [((n,), fleet.plan.traffic.get(n, 0.0)) for n in fleet.order]),
        Family("torchloom_model_shadow", "1 for a shadow: it sees every text, its answers are never returned.",
               ("model",), lambda: [((n,), float(n in fleet.plan.shadows)) for n in fleet.order]),
        Family("torchloom_model_texts_total", "Texts each model answered (role=answer) or watched as a shadow"
               " (role=shadow).", ("model", "role"), counted("answers"), "counter"),
        Family("torchloom_model_requests_total", "Predict requests each model answered or failed (as the one that"
               " answers, not as a shadow).", ("model",), counted("requests"), "counter"),
        Family("torchloom_model_failures_total", "Predict requests each model failed on (its own error; a full"
               " queue or a stop is not counted).", ("model",), counted("failed"), "counter"),
        Family("torchloom_model_duration_recent_seconds", f"Each model's predict latency over the last {RECENT_S:g}"
               " s: quantile 0.5, 0.99, and count.", ("model", "quantile"), recent),
        Family("torchloom_shadow_dropped_total", "Texts a shadow did not get to, by reason (its queue full, the"
               " server stopping, its model's error).", ("model", "reason"), counted("shadow_dropped"),
               "counter"),
        Family("torchloom_feedback_total", "Labels sent to POST /v1/feedback, by result.", ("result",),
               counted("feedback"), "counter"),
        Family("torchloom_feedback_late_total", "Labels that came before a shadow's answer: credited to it once the"
               " answer came (result=credited), or never (never_answered: the prediction left the store first).",
               ("result",), counted("feedback_late"), "counter"),
        Family("torchloom_online_accuracy", "Each model's accuracy on the labels fed back, with its 95 %"
               " interval.", ("model", "bound"), accuracy),
        Family("torchloom_online_labels", "Labels fed back for each model's answers.", ("model",),
               lambda: [((n,), float(fleet.tallies[n].labels)) for n in fleet.order]),
        Family("torchloom_ab_verdict", "1 for the verdict on each model against the first: a_better (the first"
               " is), b_better (this one is), not_yet_known.", ("model", "against", "state"), verdicts),
        Family("torchloom_admin_changes_total", "Changes made through the admin route, by action.", ("action",),
               counted("admin"), "counter"),
        *([Family("torchloom_log_rows", "The prediction log's rows (serve --log) by what became of them: written,"
                  " dropped (its queue full), failed (the store refused), pruned (aged out), queued (waiting now).",
                  ("result",), fleet.log.counts)] if fleet.log is not None else []),
    ]
