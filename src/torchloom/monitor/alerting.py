"""`torchloom monitor rules`: Prometheus alerting rules for a torchloom server's metrics (serve/metrics.py), their
unit tests for `promtool test rules`, and a Grafana dashboard, written from the same few numbers.

The alerts (each by job and instance, so several servers behind one Prometheus alert one by one; the monitor's and
the A/B ones by model and version too, so each model of a fleet alerts on its own):
    TorchloomDrift           a model's monitor says drift (monitor/live.py: any signal past its threshold)
    TorchloomAccuracyLow     even the top of a model's estimated accuracy's interval is under --accuracy-floor
    TorchloomErrorRate       more than --error-rate of the requests answered 5xx
    TorchloomLatencyHigh     p99 request latency of the predict endpoints over --p99-seconds
    TorchloomQueueSaturated  the queue is more than --queue-share full (next: 429s)
    TorchloomModelErrors     the model raised on a batch or request
    TorchloomMonitorOff      a model is served without a monitor (exported before profiles, or a damaged one)
    TorchloomChallengerWorse a model taking traffic is proved worse than the first model on the labels fed back
    TorchloomChallengerBetter  a model is proved better than the first: a candidate to promote
    TorchloomDown            Prometheus cannot scrape the server (`up` of --job)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RULES_FILE = "torchloom-rules.yml"
TESTS_FILE = "torchloom-rules.test.yml"
DASHBOARD_FILE = "torchloom-dashboard.json"
PREDICT = 'endpoint=~"/v1/predict|/predict"'
BY = "job, instance"
MODEL_BY = "job, instance, model, version"  # the monitor's series: one per model behind the endpoint
AB_BY = "job, instance, model, against"
WHERE = "{{ $labels.instance }}"
MODEL = "{{ $labels.instance }} {{ $labels.model }} {{ $labels.version }}"
SERVED = 'endpoint!="/readyz"'  # a warming-up server's /readyz answers 503 by design: not an error


@dataclass
class Limits:
    job: str = "torchloom"
    wait: str = "5m"  # `for`: how long a condition holds before the alert fires
    rate_window: str = "5m"  # the window of rate() and increase()
    accuracy_floor: float = 0.8
    error_rate: float = 0.01
    p99_seconds: float = 1.0
    queue_share: float = 0.8


def alerts(limits: Limits) -> list[dict[str, Any]]:
    """The alerting rules, as Prometheus' rule files hold them."""
    w, f = limits.rate_window, limits.wait

    def rule(name: str, expr: str, severity: str, summary: str, description: str, wait: str = f) -> dict[str, Any]:
        return {"alert": name, "expr": expr, "for": wait, "labels": {"severity": severity},
                "annotations": {"summary": summary, "description": description}}

    return [
        rule("TorchloomDrift", f"max by ({MODEL_BY}) (torchloom_monitor_drift) > 0", "warning",
             f"{MODEL}: recent texts have drifted from the model's reference",
             "The monitor's window differs from the validation texts on at least one signal past its threshold"
             " (GET /v1/monitor on the server says which, and the page at / shows it)."),
        rule("TorchloomAccuracyLow",
             f'max by ({MODEL_BY}) (torchloom_monitor_estimated_accuracy{{bound="high"}}) < {limits.accuracy_floor:g}',
             "critical", f"{MODEL}: estimated accuracy under {limits.accuracy_floor:g}",
             "Even the top of the 95 % interval of the accuracy the model's confidence promises on recent texts is"
             " under the floor: label a sample and retrain."),
        rule("TorchloomErrorRate",
             f'sum by ({BY}) (rate(torchloom_requests_total{{status=~"5..", {SERVED}}}[{w}])) / sum by ({BY})'
             f" (rate(torchloom_requests_total{{{SERVED}}}[{w}])) > {limits.error_rate:g}", "critical",
             "{{ $labels.instance }}: more than " + f"{limits.error_rate:.0%}" + " of requests fail",
             "Requests answered 5xx (/readyz aside); the server's log has each model error's id."),
        rule("TorchloomLatencyHigh",
             f"histogram_quantile(0.99, sum by ({BY}, le) (rate(torchloom_request_duration_seconds_bucket{{{PREDICT}}}"
             f"[{w}]))) > {limits.p99_seconds:g}", "warning",
             "{{ $labels.instance }}: p99 latency over " + f"{limits.p99_seconds:g} s",
             "The slowest 1 % of predict requests took longer than the limit: add replicas or lower --max-wait-ms."),
        rule("TorchloomQueueSaturated",
             f"max by ({BY}) (torchloom_queue_depth / torchloom_queue_capacity) > {limits.queue_share:g}", "warning",
             "{{ $labels.instance }}: the queue is nearly full",
             "Texts waiting for the model fill most of --max-queue; past it requests get 429."),
        rule("TorchloomModelErrors", f"sum by ({BY}) (increase(torchloom_model_errors_total[{w}])) > 0", "critical",
             "{{ $labels.instance }}: the model failed on requests",
             "The model raised on a batch; the server's log has the traceback under each error id.", wait="0s"),
        rule("TorchloomMonitorOff", f'max by ({MODEL_BY}) (torchloom_monitor_state{{state="off"}}) > 0', "info",
             f"{MODEL}: served without a monitor",
             "The model has no readable monitor/profile.json: export it again to monitor it."),
        rule("TorchloomChallengerWorse",
             f'max by ({AB_BY}) (torchloom_ab_verdict{{state="a_better"}}) > 0 and on (job, instance, model)'
             " torchloom_model_traffic_percent > 0", "warning",
             "{{ $labels.instance }} {{ $labels.model }}: worse than {{ $labels.against }} on the labels fed back",
             "The sequential test says the first model is better, and this one still takes traffic: send it none"
             " (torchloom serve's admin route, or --traffic) or roll it back.", wait="0s"),
        rule("TorchloomChallengerBetter", f'max by ({AB_BY}) (torchloom_ab_verdict{{state="b_better"}}) > 0',
             "info", "{{ $labels.instance }} {{ $labels.model }}: better than {{ $labels.against }} on the labels"
             " fed back", "The sequential test says this model is better than the first: a candidate to promote.",
             wait="0s"),
        rule("TorchloomDown", f'up{{job="{limits.job}"}} == 0', "critical",
             "{{ $labels.instance }}: the server cannot be scraped",
             "Prometheus gets no answer from /metrics."),
    ]


def rules_document(limits: Limits) -> dict[str, Any]:
    return {"groups": [{"name": "torchloom", "rules": alerts(limits)}]}


class _Cases:
    """The unit tests' makings: a server's series and the alert each rule should (not) give, a minute a sample."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.instance, self.job = limits, "server-1:8000", limits.job
        self.base = f'job="{self.job}",instance="{self.instance}"'
        self.by_name = {r["alert"]: r for r in alerts(limits)}
        wait = _minutes(limits.wait)
        self.eval_at, self.n = f"{wait + 10}m", wait + 20

    def flat(self, value) -> str:
        return f"{value}x{self.n}"

    def grow(self, step) -> str:
        return f"0+{step}x{self.n}"

    def fires(self, name: str, series: list[dict[str, str]], labels: dict[str, str] | None = None) -> dict[str, Any]:
        rule = self.by_name[name]
        exp = {"job": self.job, "instance": self.instance, "severity": rule["labels"]["severity"], **(labels or {})}
        annotations = dict(rule["annotations"])
        for key, value in exp.items():
            annotations = {k: v.replace(f"{{{{ $labels.{key} }}}}", value) for k, v in annotations.items()}
        return {"interval": "1m", "input_series": series,
                "alert_rule_test": [{"eval_time": self.eval_at, "alertname": name,
                                     "exp_alerts": [{"exp_labels": exp, "exp_annotations": annotations}]}]}

    def silent(self, name: str, series: list[dict[str, str]]) -> dict[str, Any]:
        return {"interval": "1m", "input_series": series,
                "alert_rule_test": [{"eval_time": self.eval_at, "alertname": name, "exp_alerts": []}]}


def _server_tests(c: _Cases) -> list[dict[str, Any]]:
    """The server's alerts: errors, latency, the queue, model errors, the scrape."""
    base, flat, grow, limits = c.base, c.flat, c.grow, c.limits
    good_requests = [{"series": f'torchloom_requests_total{{{base},endpoint="/v1/predict",status="200"}}',
                      "values": grow(100)}]
    bucket = f'torchloom_request_duration_seconds_bucket{{{base},endpoint="/v1/predict"'
    fast = [{"series": f'{bucket},le="0.1"}}', "values": grow(100)},
            {"series": f'{bucket},le="+Inf"}}', "values": grow(100)}]
    slow = [{"series": f'{bucket},le="0.1"}}', "values": grow(50)},
            {"series": f'{bucket},le="{limits.p99_seconds * 10:g}"}}', "values": grow(100)},
            {"series": f'{bucket},le="+Inf"}}', "values": grow(100)}]
    queue = lambda depth: [{"series": f"torchloom_queue_depth{{{base}}}", "values": flat(depth)},  # noqa: E731
                           {"series": f"torchloom_queue_capacity{{{base}}}", "values": flat(1000)}]
    errors = f"torchloom_model_errors_total{{{base}}}"
    return [
        c.silent("TorchloomErrorRate", good_requests),
        c.fires("TorchloomErrorRate", good_requests + [
            {"series": f'torchloom_requests_total{{{base},endpoint="/v1/predict",status="500"}}',
             "values": grow(max(1, round(100 * limits.error_rate * 3)))}]),
        c.silent("TorchloomLatencyHigh", fast),
        c.fires("TorchloomLatencyHigh", slow),
        c.silent("TorchloomQueueSaturated", queue(round(1000 * limits.queue_share / 2))),
        c.fires("TorchloomQueueSaturated", queue(min(1000, round(1000 * limits.queue_share) + 50))),
        c.silent("TorchloomModelErrors", [{"series": errors, "values": flat(3)}]),
        c.fires("TorchloomModelErrors", [{"series": errors, "values": grow(1)}]),
        c.silent("TorchloomDown", [{"series": f"up{{{base}}}", "values": flat(1)}]),
        c.fires("TorchloomDown", [{"series": f"up{{{base}}}", "values": flat(0)}]),
    ]


def _model_tests(c: _Cases) -> list[dict[str, Any]]:
    """The monitor's and the A/B alerts, on a fleet of two whose second model alone is bad: its alert names it,
    the first stays silent."""
    base, flat, floor = c.base, c.flat, c.limits.accuracy_floor
    one, two = f'{base},model="v1",version="1"', f'{base},model="v2",version="7"'
    second, ab = {"model": "v2", "version": "7"}, {"model": "v2", "against": "v1"}

    def models(metric: str, good: str, bad: str, extra: str = "") -> list[dict[str, str]]:
        return [{"series": f"{metric}{{{one}{extra}}}", "values": good},
                {"series": f"{metric}{{{two}{extra}}}", "values": bad}]

    accuracy = lambda high: models("torchloom_monitor_estimated_accuracy", flat(1.0), flat(high),  # noqa: E731
                                   ',bound="high"')
    state = lambda off: models("torchloom_monitor_state", flat(0), flat(off), ',state="off"')  # noqa: E731
    verdict = lambda state, traffic: [  # noqa: E731
        {"series": f'torchloom_ab_verdict{{{base},model="v2",against="v1",state="{state}"}}', "values": flat(1)},
        {"series": f'torchloom_model_traffic_percent{{{base},model="v2"}}', "values": flat(traffic)}]
    return [
        c.silent("TorchloomDrift", models("torchloom_monitor_drift", flat(0), flat(0))),
        c.fires("TorchloomDrift", models("torchloom_monitor_drift", flat(0), f"0 {flat(1)}"), second),
        c.silent("TorchloomAccuracyLow", accuracy(min(1.0, floor + 0.05))),
        c.fires("TorchloomAccuracyLow", accuracy(max(0.0, floor - 0.05)), second),
        c.silent("TorchloomMonitorOff", state(0)),
        c.fires("TorchloomMonitorOff", state(1), second),
        c.silent("TorchloomChallengerWorse", verdict("a_better", 0)),  # worse, but it takes no traffic
        c.fires("TorchloomChallengerWorse", verdict("a_better", 10), ab),
        c.silent("TorchloomChallengerBetter", verdict("not_yet_known", 10)),
        c.fires("TorchloomChallengerBetter", verdict("b_better", 10), ab),
    ]


def rules_tests(limits: Limits) -> dict[str, Any]:
    """`promtool test rules` cases: each alert silent on a healthy series and firing on a bad one."""
    c = _Cases(limits)
    return {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": [*_model_tests(c), *_server_tests(c)]}


def _minutes(duration: str) -> int:
    """A Prometheus duration as whole minutes, rounded up (the unit tests step a minute at a time)."""
    import re

    seconds = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", duration):
        seconds += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800,
                                    "y": 31536000}[unit]
    return -(-int(seconds) // 60)


SEL = '{job="$job", instance=~"$instance"}'  # the dashboard's variables


def panel(i: int, title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          width: int = 12, thresholds: list[tuple[str, float | None]] | None = None) -> dict[str, Any]:
    """A Grafana panel, two to a row by its id."""
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    return {"id": i, "type": kind, "title": title, "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": width, "x": (i - 1) % 2 * 12 if width == 12 else 0, "y": (i - 1) // 2 * 8},
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                            "overrides": []},
            "options": {}, "targets": [{"refId": chr(65 + k), "expr": expr, "legendFormat": legend}
                                       for k, (expr, legend) in enumerate(targets)]}


def panels(limits: Limits) -> list[dict[str, Any]]:
    """The server's panels, each model's monitor, and the A/B row."""
    sel, w = SEL, limits.rate_window
    predict = '{job="$job", instance=~"$instance", ' + PREDICT + "}"
    return [
        panel(1, "Texts per second", [(f"sum by (instance) (rate(torchloom_texts_total{sel}[{w}]))", "{{instance}}")]),
        panel(2, "Request latency (p50, p99)", [
            (f"histogram_quantile(0.5, sum by (instance, le) (rate(torchloom_request_duration_seconds_bucket{predict}"
             f"[{w}])))", "p50 {{instance}}"),
            (f"histogram_quantile(0.99, sum by (instance, le) (rate(torchloom_request_duration_seconds_bucket"
             f"{predict}[{w}])))", "p99 {{instance}}")], unit="s"),
        panel(3, "Requests by status", [(f"sum by (status) (rate(torchloom_requests_total{sel}[{w}]))",
                                         "{{status}}")], unit="reqps"),
        panel(4, "Queue (share of --max-queue)", [(f"torchloom_queue_depth{sel} / torchloom_queue_capacity{sel}",
                                                    "{{instance}}")], unit="percentunit",
              thresholds=[("green", None), ("red", limits.queue_share)]),
        panel(5, "Drift verdict, per model", [(f"max by (instance, model, version) (torchloom_monitor_drift{sel})",
                                                "{{model}} {{version}} {{instance}}")],
              kind="stat", thresholds=[("green", None), ("red", 1)]),
        panel(6, "Estimated accuracy per model (95 % interval)", [
            (f'torchloom_monitor_estimated_accuracy{{job="$job", instance=~"$instance", bound="{b}"}}',
             f"{b} {{{{model}}}} {{{{instance}}}}") for b in ("estimate", "low", "high")], unit="percentunit",
              thresholds=[("red", None), ("green", limits.accuracy_floor)]),
        panel(7, "Signal distance / threshold per model (drift past 1)", [
            (f"torchloom_monitor_distance{sel} / on (job, instance, model, version, signal)"
             f" torchloom_monitor_threshold{sel}", "{{model}} {{signal}} {{instance}}")],
              thresholds=[("green", None), ("red", 1)]),
        panel(8, "Predicted class shares per model", [(f"torchloom_monitor_class_share{sel}",
                                                       "{{model}} {{label}} {{instance}}")], unit="percentunit"),
        panel(9, "Model errors", [(f"sum by (instance) (increase(torchloom_model_errors_total{sel}[{w}]))",
                                   "{{instance}}")]),
        panel(10, "Batch size (mean texts per forward)", [
            (f"sum by (instance) (rate(torchloom_batch_size_sum{sel}[{w}])) / sum by (instance)"
             f" (rate(torchloom_batch_size_count{sel}[{w}]))", "{{instance}}")]),
        # the A/B row: several models behind the endpoint (serve --model NAME=DIR ... --traffic)
        panel(11, "A/B: traffic per model", [(f"torchloom_model_traffic_percent{sel}", "{{model}} {{instance}}")],
              unit="percent"),
        panel(12, "A/B: accuracy on the labels fed back (95 % interval)", [
            (f'torchloom_online_accuracy{{job="$job", instance=~"$instance", bound="{b}"}}',
             f"{b} {{{{model}}}} {{{{instance}}}}") for b in ("estimate", "low", "high")], unit="percentunit"),
        panel(13, "A/B: the verdict against the first model", [
            (f"torchloom_ab_verdict{sel} == 1", "{{model}} vs {{against}}: {{state}}")], kind="table", width=24),
    ]


def dashboard(limits: Limits) -> dict[str, Any]:
    """A Grafana dashboard (schema 39) of one server or several: traffic, latency, queue, errors, each model's
    monitor, and an A/B row (each model's traffic, its accuracy on the labels fed back, the verdict)."""
    return {
        "title": "torchloom serving", "uid": "torchloom-serving", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["torchloom"], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "job", "type": "custom", "query": limits.job, "current": {"text": limits.job,
                                                                                "value": limits.job}},
            {"name": "instance", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": 'label_values(torchloom_texts_total{job="$job"}, instance)', "includeAll": True,
             "multi": True, "allValue": ".*", "refresh": 2},
        ]},
        "panels": panels(limits),
    }


def write(out: Path, limits: Limits) -> list[Path]:
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    files = {RULES_FILE: yaml.safe_dump(rules_document(limits), sort_keys=False, width=1000),
             TESTS_FILE: yaml.safe_dump(rules_tests(limits), sort_keys=False, width=1000),
             DASHBOARD_FILE: json.dumps(dashboard(limits), indent=2) + "\n"}
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    from torchloom.errors import UserError, one_line

    p = argparse.ArgumentParser(prog="torchloom monitor rules", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="monitoring", help="directory for the rules, their tests and the dashboard"
                                                           " (default monitoring)")
    p.add_argument("--job", default=Limits.job, help="the Prometheus job that scrapes the servers (default torchloom)")
    p.add_argument("--for", dest="wait", default=Limits.wait,
                   help="how long a condition holds before its alert fires (default 5m)")
    p.add_argument("--rate-window", default=Limits.rate_window, help="window of rates (default 5m)")
    p.add_argument("--accuracy-floor", type=float, default=Limits.accuracy_floor,
                   help="alert when even the top of the estimated accuracy's interval is under this (default 0.8)")
    p.add_argument("--error-rate", type=float, default=Limits.error_rate,
                   help="alert past this share of 5xx answers (default 0.01)")
    p.add_argument("--p99-seconds", type=float, default=Limits.p99_seconds,
                   help="alert when p99 predict latency passes this (default 1)")
    p.add_argument("--queue-share", type=float, default=Limits.queue_share,
                   help="alert when the queue is fuller than this share of --max-queue (default 0.8)")
    args = p.parse_args(argv)
    try:
        limits = Limits(args.job, args.wait, args.rate_window, args.accuracy_floor, args.error_rate, args.p99_seconds,
                        args.queue_share)
        check(limits)
        out = Path(args.output)
        if out.exists() and not out.is_dir():
            raise UserError(f"--output {args.output}: a file, not a directory; name a directory")
        taken = [name for name in (RULES_FILE, TESTS_FILE, DASHBOARD_FILE) if (out / name).exists()
                 and not _ours(out / name)]
        if taken:
            raise UserError(f"--output {args.output}: {taken[0]} is there and torchloom did not write it; move it"
                            " away or pick another --output")
        for path in write(out, limits):
            print(f"monitor rules: wrote {path}")
    except UserError as e:
        print(f"torchloom: error: {one_line(e)}", file=sys.stderr)
        return UserError.exit_code
    print(f"monitor rules: check them with `promtool check rules {out / RULES_FILE}` and `promtool test rules"
          f" {out / TESTS_FILE}`; load {DASHBOARD_FILE} in Grafana (Dashboards > Import)")
    return 0


def check(limits: Limits) -> None:
    import re

    from torchloom.errors import UserError

    duration = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
    for flag, value in (("--for", limits.wait), ("--rate-window", limits.rate_window)):
        if not duration.match(value):
            raise UserError(f"{flag} {value}: not a Prometheus duration; use e.g. 30s, 5m or 1h")
    if not re.match(r"^[a-zA-Z_][a-zA-Z0-9_:.-]*$", limits.job):
        raise UserError(f"--job {limits.job}: letters, digits, _ : . - only (a Prometheus job name)")
    for flag, value in (("--accuracy-floor", limits.accuracy_floor), ("--error-rate", limits.error_rate),
                        ("--queue-share", limits.queue_share)):
        if not 0 < value < 1:
            raise UserError(f"{flag} {value:g}: a share, between 0 and 1")
    if limits.p99_seconds <= 0:
        raise UserError(f"--p99-seconds {limits.p99_seconds:g}: must be more than 0")


def _ours(path: Path) -> bool:
    """Whether a file where one of ours goes is an earlier one of ours (replaced; anything else is refused)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if path.name == DASHBOARD_FILE:
        try:
            return json.loads(text).get("uid") == "torchloom-serving"
        except ValueError:
            return False
    return "torchloom" in text and ("TorchloomDrift" in text)
