"""The live monitor's gauges (torchloom_monitor_*) as a server exposes them: one series per model behind the
endpoint (labels `model`, its name there, and `version`), read from each model's current report (monitor/live.py)
when scraped. serve/metrics.py makes them Prometheus families."""

from __future__ import annotations

from collections.abc import Callable

from torchloom.monitor.drift import signal_names
from torchloom.monitor.live import STATES

MonitorReports = Callable[[], list[tuple[tuple[str, str], dict]]]  # [((model, version), its report), ...]
Read = Callable[[], list[tuple[tuple[str, ...], float]]]
MODEL_LABELS = ("model", "version")


def monitor_gauges(reports: MonitorReports) -> list[tuple[str, str, tuple[str, ...], Read]]:
    """(name, help, label names, read) of each gauge."""

    def each(values: Callable[[dict], list[tuple[tuple[str, ...], float]]]) -> Read:
        return lambda: [(model + labels, value) for model, r in reports() for labels, value in values(r)]

    def signal(key: str) -> Read:
        return each(lambda r: [((name,), r["signals"][name][key]) for name in signal_names()
                               if name in r.get("signals", {}) and r["signals"][name][key] is not None])

    def accuracy(r: dict):
        est = r.get("estimated_accuracy")
        return ([((bound,), est[key]) for bound, key in (("estimate", "value"), ("low", "low"), ("high", "high"))]
                if est else [])

    def shares(r: dict):
        return [((label,), s["window"]) for label, s in r.get("class_shares", {}).items()]

    m = MODEL_LABELS
    return [
        ("torchloom_monitor_state", "1 for each model's monitor state: off (no profile), warming_up (too few"
         " texts), no_drift or drift.", (*m, "state"),
         each(lambda r: [((state,), float(state == r["state"])) for state in STATES])),
        ("torchloom_monitor_drift", "1 while a model's window of recent texts has drifted from its own reference"
         " (any signal past its threshold), else 0.", m, each(lambda r: [((), float(r["drift"]))])),
        ("torchloom_monitor_distance", "Each signal's distance between a model's window and its reference.",
         (*m, "signal"), signal("distance")),
        ("torchloom_monitor_threshold", "Each signal's threshold, drawn from the model's reference for the chosen"
         " false-alarm rate.", (*m, "signal"), signal("threshold")),
        ("torchloom_monitor_estimated_accuracy", "Accuracy a model's confidence promises on its window (no labels"
         " needed), with its 95 % interval.", (*m, "bound"), each(accuracy)),
        ("torchloom_monitor_stale", "1 while a model's verdict is stale: no text for --monitor-stale-s, or its"
         " window emptied with age (the verdict before stands).", m,
         each(lambda r: [((), float(bool(r.get("stale"))))] if r["state"] != "off" else [])),
        ("torchloom_monitor_last_text_age_seconds", "Seconds since a model's newest text.", m,
         each(lambda r: [((), float(r["last_text_s"]))] if r.get("last_text_s") is not None else [])),
        ("torchloom_monitor_window_texts", "Texts in a model's monitor window.", m,
         each(lambda r: [((), float(r.get("texts", 0)))])),
        ("torchloom_monitor_class_share", "Each label's share of a model's window of predictions.", (*m, "label"),
         each(shares)),
    ]
