"""A server's own monitor: a sliding window of the texts it answered, compared with the model's reference profile
(monitor/profile.py) on every signal (monitor/drift.py), with the accuracy the model's confidence promises.

The window holds the last `size` texts, and none older than `max_age_s` (0: no age limit). A verdict needs at
least `min_texts` of them ("warming_up" before). Thresholds depend on how many texts are compared: they are drawn
at start (on a thread: about 0.2 s each on a 2-core CPU) for a ladder of sizes from `min_texts` to `size`, and a
window between two rungs uses the lower one's, whose thresholds are higher (fewer alarms, never more than the
chosen rate). The verdict is worked out again every `size // 10` texts (at most once a second) and whenever
someone reads it (/metrics, /v1/monitor, the status page); each change is one log line.

Everything runs on the server's event loop (observing a text is a few appends; a verdict 0.4 ms on 500 texts),
except the thresholds' thread. One monitor per process: a Ray Serve replica watches the texts it answered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from torchloom.monitor.drift import (
    Kernel,
    Reading,
    Texts,
    caveat,
    distances,
    estimated_accuracy,
    read_rows,
    signal_names,
    thresholds,
    verdict,
)
from torchloom.monitor.history import History

log = logging.getLogger("torchloom.serve")

WINDOW = 500  # texts: a class share of 10 % is then known to about +-2.7 %; 4 signals drawn from 1000 reference texts
MIN_TEXTS = 100
STALE_S = 600.0  # a verdict with no text for this long says it is stale
EVALUATE_EVERY_S = 1.0  # a verdict (0.4-0.7 ms) at most this often from traffic alone: under 0.1 % of a core
STATES = ("off", "warming_up", "no_drift", "drift")


class LiveMonitor:
    def __init__(self, profile: dict, model: str, size: int = WINDOW, max_age_s: float = 0.0,
                 false_alarm: float | None = None, min_texts: int = MIN_TEXTS, kernel: Kernel | None = None,
                 stale_s: float = STALE_S, history: History | None = None) -> None:
        """kernel: the profile's, where the server's answers carry sketches (model/profile.kernel_for); stale_s: a
        verdict with no text for this long says it is stale; history: its verdicts over time (monitor/history.py)."""
        from torchloom.monitor.profile import reference_texts

        self.profile = profile
        self.model = model
        self.labels = list(profile["labels"])
        self.kernel = kernel
        self.reference = reference_texts(profile, sketched=kernel is not None)
        self.correct = np.asarray(profile["reference"]["correct"], bool)
        self.size = int(size)
        self.max_age_s = float(max_age_s)
        self.false_alarm = float(profile.get("false_alarm", 0.01) if false_alarm is None else false_alarm)
        self.min_texts = max(2, min(int(min_texts), self.size))
        # the signals read off each answer, in this order (drift.SIGNALS' rows that read one), and the reading
        self.rows = [s for s in read_rows() if s.column in self.reference.values]
        self.reading = Reading({label: i for i, label in enumerate(self.labels)}, profile.get("max_length"))
        # (time, each row's value) per text, newest last
        self.window: deque[tuple[float, tuple]] = deque(maxlen=self.size)
        self.sketches: deque[np.ndarray] = deque(maxlen=self.size)  # with a kernel: each text's, as `window`
        self.seen = 0
        self.last_text = 0.0  # when the newest text came (0: none yet)
        self.stale_s = float(stale_s)
        self.history = history or History(model, 3600.0)
        self._since_verdict = 0
        self.every = max(1, self.size // 10)
        self.limits: dict[int, dict[str, float]] = {}  # rung size -> thresholds, filled by the thread
        self.state = "warming_up"
        self.since = time.time()
        self.last: dict[str, Any] = {}
        self._ladder = ladder(self.min_texts, self.size, len(self.reference))
        self._thread = threading.Thread(target=self._calibrate, name="torchloom-monitor-thresholds", daemon=True)
        self.on_report: Callable[[dict[str, Any]], None] | None = None  # told each new verdict (Ray's shared gauges)

    def start(self) -> None:
        self._thread.start()

    def _calibrate(self) -> None:
        k = len(self.labels)
        for rung in self._ladder:  # smallest first: a verdict is possible as soon as min_texts have come
            self.limits[rung] = thresholds(self.reference, rung, k, self.false_alarm)

    # --- fed by the server -------------------------------------------------------------------------------

    def observe(self, answers: list[dict[str, Any]]) -> None:
        """The answers to one request (Predictor's, with signals)."""
        now = self.last_text = time.time()
        self.history.observed(len(answers), now)
        rows, reading, append = self.rows, self.reading, self.window.append
        for a in answers:
            append((now, tuple(s.read(a, reading) for s in rows)))
        if self.kernel is not None:
            sketches = [a.get("sketch") for a in answers]
            if any(sketch is None for sketch in sketches):  # a forward that gave none: stop comparing, never fail
                log.warning("monitor: answers without a sketch; the representation is no longer compared")
                self.kernel, self.reference.features = None, None
                self.limits = {}
                self._thread = threading.Thread(target=self._calibrate, daemon=True)
                self._thread.start()  # thresholds again, over the signals left
                self.sketches.clear()
            else:
                self.sketches.extend(sketches)
        self.seen += len(answers)
        self._since_verdict += len(answers)
        if self._since_verdict >= self.every and now - self.last.get("at", 0.0) >= EVALUATE_EVERY_S:
            self.evaluate()

    # --- read by /metrics, /v1/monitor, the page -----------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """The verdict on the window as it is now (also kept as `last`); logs a change of verdict."""
        self._since_verdict = 0
        now = time.time()
        if self.max_age_s > 0:
            while self.window and self.window[0][0] < now - self.max_age_s:
                self.window.popleft()
                if self.sketches:
                    self.sketches.popleft()
        n = len(self.window)
        rung = max((r for r in self.limits if r <= n), default=None)
        report: dict[str, Any] = {"state": "warming_up", "model": self.model, "texts": n, "seen": self.seen,
                                  "window": {"size": self.size, "max_age_s": self.max_age_s,
                                             "min_texts": self.min_texts},
                                  "false_alarm": self.false_alarm, "reference_texts": len(self.reference),
                                  "drift": False, "drifted": []}
        if n >= 2:
            values = list(zip(*(v for _, v in self.window)))
            features = (self.kernel.features(np.stack(self.sketches))
                if self.kernel is not None and len(self.sketches) == n else None)
            window = Texts({s.column: np.fromiter(column, np.int64 if s.integer else np.float64, n)
                            for s, column in zip(self.rows, values)}, features)
            report["seconds"] = round(now - self.window[0][0], 1)
            found = distances(window, self.reference, len(self.labels))
            limits = self.limits.get(rung, {}) if rung is not None else {}
            drifted = verdict(found, limits) if limits else []
            estimate, low, high = estimated_accuracy(window.confidence, self.reference, self.correct)
            report["signals"] = {name: {"distance": round(found[name], 6),
                                        "threshold": round(limits[name], 6) if limits else None,
                                        "drift": name in drifted} for name in signal_names() if name in found}
            report["estimated_accuracy"] = {"value": round(estimate, 4), "low": round(low, 4), "high": round(high, 4),
                                            "reference": self.profile.get("accuracy")}
            report["class_shares"] = {
                label: {"window": round(float(np.mean(window.predicted == i)), 4),
                        "reference": round(float(np.mean(self.reference.predicted == i)), 4)}
                for i, label in enumerate(self.labels)}
            if limits and n >= self.min_texts:
                report["state"] = "drift" if drifted else "no_drift"
                report["drift"], report["drifted"] = bool(drifted), drifted
                report["estimated_accuracy"]["caveat"] = caveat(drifted)
                report["calibrated_for"] = rung
        self._settle(report)
        self._staleness(report, now)
        report["since"] = round(self.since, 3)
        report["at"] = now
        self.history.note(report, now)
        report["history"] = self.history.view()
        self.last = report
        if self.on_report is not None:
            self.on_report(report)
        return report

    def _staleness(self, report: dict[str, Any], now: float) -> None:
        """A verdict stands without texts, and says so: stale once no text came for stale_s, or once its window
        emptied with age below what a verdict needs (the report then carries the standing verdict)."""
        quiet = now - self.last_text if self.last_text else None
        report["last_text_s"] = round(quiet, 1) if quiet is not None else None
        report["stale"], why = False, ""
        if report["state"] == "warming_up" and self.state in ("drift", "no_drift"):
            report.update(state=self.state, drift=self.state == "drift", drifted=self.last.get("drifted", []))
            report["stale"], why = True, (f"the window holds {report['texts']} texts since older ones left it"
                                          f" (--monitor-window-s {self.max_age_s:g}); the verdict before stands")
        elif report["state"] in ("drift", "no_drift") and quiet is not None and quiet > self.stale_s:
            report["stale"], why = True, f"no text for {quiet:.0f} s; the verdict is of the texts before"
        if why:
            report["stale_reason"] = why

    def _settle(self, report: dict[str, Any]) -> None:
        state = report["state"]
        if state == "warming_up" and self.state in ("drift", "no_drift"):
            return  # the window emptied with age: the verdict stands until enough texts come again
        if state == self.state and report["drifted"] == self.last.get("drifted", []):
            return
        self.state, self.since = state, time.time()
        if state == "warming_up":
            return
        est = report["estimated_accuracy"]
        what = f"drift in {', '.join(report['drifted'])}" if report["drift"] else "no drift"
        (log.warning if report["drift"] else log.info)(
            "monitor %s: %s (last %d texts over %.0f s; estimated accuracy %.3f [%.3f, %.3f], %s on the reference)",
            self.model, what, report["texts"], report.get("seconds", 0.0), est["value"], est["low"], est["high"],
            est["reference"])

    def current(self, max_age: float = 1.0) -> dict[str, Any]:
        """The last verdict, worked out again when texts came since or it is older than `max_age` seconds."""
        if not self.last or self._since_verdict or time.time() - self.last["at"] > max_age:
            self.evaluate()
        return self.last


def ladder(low: int, size: int, reference: int) -> list[int]:
    """The window sizes thresholds are drawn for: low, doubling, then the top, `size` (monitor/drift.py calibrates a
    window larger than half the reference at that half, so the top is never more)."""
    top = max(low, min(size, reference // 2))
    rungs, r = [], low
    while r < top:
        rungs.append(r)
        r *= 2
    return [*rungs, top]


def off_report(reason: str) -> dict[str, Any]:
    return {"state": "off", "reason": reason, "drift": False, "drifted": []}


def outlier_scorer(settings, monitor: LiveMonitor | None, name: str):
    """The server's --outlier-score scorer of a model (monitor/outliers.py): from its monitor's profile, where the
    answers carry sketches; None (said once) where they cannot."""
    if not getattr(settings, "outlier_score", False):
        return None
    from torchloom.monitor.outliers import scorer_for

    scorer = scorer_for(monitor.profile) if monitor is not None and monitor.kernel is not None else None
    if scorer is None:
        log.warning("%s: --outlier-score: no reference sketches to score against (the monitor off, a profile"
                    " without a sketch, or the ONNX runtime); predictions carry no \"outlier\"", name)
    return scorer


def load_monitor(settings, model_dir: str, labels: list[str], name: str, predictor=None
                 ) -> tuple[LiveMonitor | None, dict[str, Any], str]:
    """The monitor of the model in `model_dir` against its own profile (None when off; each model of a fleet has
    its own), the report it gives while off, and the one line the server prints at start: what it watches, or why
    monitoring is off and how to turn it on. A damaged profile never stops a server: it serves, unmonitored, and
    says so."""
    from torchloom.errors import UserError
    from torchloom.monitor.profile import REEXPORT, kernel_for, read_profile

    if not settings.monitor:
        reason = "monitoring off (--no-monitor)"
        return None, off_report(reason), reason
    try:
        profile = read_profile(model_dir)
    except UserError as e:
        reason = f"monitoring off: {e}"
        return None, off_report(reason), f"warning: {reason}"
    if profile is None:
        reason = (f"monitoring off: model dir {model_dir} has no monitor/profile.json (exported before"
                  f" torchloom wrote one); {REEXPORT}")
        return None, off_report(reason), reason
    if list(profile["labels"]) != list(labels):
        reason = f"monitoring off: the profile in {model_dir}/monitor is of other labels; {REEXPORT}"
        return None, off_report(reason), f"warning: {reason}"
    kernel = kernel_for(profile, predictor) if predictor is not None else None
    monitor = LiveMonitor(profile, name, settings.monitor_window, settings.monitor_window_s, settings.false_alarm,
                          kernel=kernel, stale_s=settings.monitor_stale_s,
                          history=History(name, settings.monitor_period_s, settings.monitor_history))
    age = f", none older than {settings.monitor_window_s:g} s" if settings.monitor_window_s else ""
    sketch = "" if kernel is not None else (", representation not compared (" + (
        "the profile has no sketch" if "_sketch" not in profile else "the ONNX runtime gives logits only") + ")")
    return monitor, {}, (f"monitoring: the last {monitor.size} texts{age} against {len(monitor.reference)} reference"
                         f" texts, {monitor.false_alarm:.2%} false alarms{sketch} (GET /v1/monitor, /metrics, /)")
