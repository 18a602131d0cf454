"""A served model that watches itself, as its operators meet it: a real `torchloom serve` (the tiny model, with the
reference profile export writes) sent texts like its validation texts, then shifted ones; Debian's real Prometheus
scraping it with the rules `torchloom monitor rules` writes, until the drift alert fires; the status page in a real
headless Chromium. One server for the module (~10 s), Prometheus ~3 s, Chromium ~5 s, and their apt-get install
on a fresh machine (~45 s, once).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time

import numpy as np
import pytest
from support.browser import Browser
from support.debian import ensure
from support.prometheus import Prometheus
from support.served import Server, export_tiny

pytestmark = pytest.mark.heavy(3)

LABELS = ["sport", "money", "music"]
POOLS = {"sport": ["match", "goal", "team", "win", "league", "player", "coach", "score", "season", "cup"],
         "money": ["bank", "shares", "profit", "market", "price", "rate", "fund", "stock", "trade", "loan"],
         "music": ["guitar", "band", "song", "album", "concert", "singer", "tour", "stage", "record", "chart"]}
COMMON = ["the", "a", "of", "and", "in", "to", "today", "after", "with", "new"]
WINDOW = 100


def like_validation(rng: random.Random, n: int) -> tuple[list[str], list[str]]:
    """Texts from the distribution the profile was drawn from, and their labels."""
    texts, labels = [], []
    for _ in range(n):
        label = rng.choice(LABELS)
        texts.append(" ".join(rng.choice(POOLS[label] + COMMON) for _ in range(rng.randint(4, 14))))
        labels.append(label)
    return texts, labels


def shifted(rng: random.Random, n: int) -> list[str]:
    """Another kind of text: ten times longer, in words the model never saw."""
    return [" ".join(rng.choice(["zxq", "vlorp", "quandle", "mib", "fr0st"]) for _ in range(rng.randint(60, 120)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def monitored_model(tmp_path_factory) -> str:
    from torchloom.model.tiny import write_tiny_model
    from torchloom.monitor.profile import write_profile

    root = tmp_path_factory.mktemp("monitored")
    model = export_tiny(write_tiny_model(root / "base"), root / "shop" / "model", LABELS,
                        [" ".join(POOLS[label][:6]) for label in LABELS])
    texts, labels = like_validation(random.Random(0), 400)
    write_profile(model, texts, labels, {"val": 400, "test": 0})
    return model


@pytest.fixture(scope="module")
def server(monitored_model, tmp_path_factory):
    s = Server(monitored_model, "--monitor-window", str(WINDOW), "--device", "cpu",
               log_dir=tmp_path_factory.mktemp("server"))
    yield s
    assert s.terminate() == 0, s.stderr()[-3000:]


def send(server: Server, texts: list[str], per_request: int = 25) -> None:
    for start in range(0, len(texts), per_request):
        r = server.client.post("/v1/predict", json={"texts": texts[start:start + per_request]})
        assert r.status_code == 200, r.text


def monitor(server: Server) -> dict:
    r = server.client.get("/v1/monitor")
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------------------
# Prometheus: the rules as written, a real scrape, the alert from inactive to firing
# ---------------------------------------------------------------------------------------------


def test_the_drift_alert_fires_in_a_real_prometheus_and_not_before(server, tmp_path):
    """In-distribution traffic: the monitor says no drift and Prometheus' TorchloomDrift stays inactive; shifted
    traffic: the server logs the change once, /metrics says drift, and the alert goes to firing. The rules are
    `torchloom monitor rules`' own, checked and unit-tested by promtool first."""
    from support.owned import torchloom

    promtool = ensure("promtool", "prometheus")
    out = tmp_path / "rules"
    made = torchloom("monitor", "rules", "--output", str(out), "--for", "0s", "--rate-window", "1m")
    assert made.returncode == 0, made.stderr
    rules = out / "torchloom-rules.yml"
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 10 rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([promtool, "test", "rules", "torchloom-rules.test.yml"], capture_output=True, text=True,
                           cwd=out)
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
    dashboard = json.loads((out / "torchloom-dashboard.json").read_text())
    assert {p["title"] for p in dashboard["panels"]} >= {"Drift verdict, per model", "A/B: traffic per model",
                                                         "A/B: the verdict against the first model"}
    again = torchloom("monitor", "rules", "--output", str(out), "--for", "0s", "--rate-window", "1m",
                      "--error-rate", "0.02")  # its own files: replaced
    assert again.returncode == 0 and "> 0.02" in rules.read_text(), again.stderr
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "torchloom-rules.yml").write_text("groups: []  # a team's own rules\n")
    refused = torchloom("monitor", "rules", "--output", str(theirs))
    assert refused.returncode == 2 and "torchloom did not write it" in refused.stderr
    assert (theirs / "torchloom-rules.yml").read_text() == "groups: []  # a team's own rules\n"
    assert "--for 5x: not a Prometheus duration" in torchloom("monitor", "rules", "--for", "5x").stderr

    rng = random.Random(1)
    before = monitor(server)
    assert before["state"] == "warming_up" and before["texts"] == 0
    prometheus = Prometheus(server.url.split("://", 1)[1], rules, tmp_path)
    try:
        for _ in range(3):  # three windows like the validation texts: no drift at each
            send(server, like_validation(rng, WINDOW)[0])
            verdict = monitor(server)
            assert verdict["state"] == "no_drift", verdict
        prometheus.wait(lambda: any(r["value"][1] == "1" for r in prometheus.query(
            'torchloom_monitor_state{state="no_drift"}')), 30, "Prometheus never scraped the no-drift verdict")
        prometheus.wait(lambda: prometheus.alert_state("TorchloomMonitorOff") == "inactive", 10, "rules not evaluated")
        assert prometheus.alert_state("TorchloomDrift") == "inactive"
        assert prometheus.alert_state("TorchloomDown") == "inactive"

        windows = 0
        while monitor(server)["state"] != "drift":  # shifted texts: drift within one window
            windows += 1
            assert windows <= 4, monitor(server)
            send(server, shifted(rng, WINDOW // 4))
        verdict = monitor(server)
        assert "length" in verdict["drifted"] and verdict["signals"]["length"]["distance"] > \
            verdict["signals"]["length"]["threshold"]
        assert windows <= 4  # a quarter window at a time: at most one window of shifted texts
        prometheus.wait(lambda: prometheus.alert_state("TorchloomDrift") == "firing", 30,
                        "TorchloomDrift never fired")
        alerts = prometheus.client.get("/api/v1/alerts").json()["data"]["alerts"]
        drift = [a for a in alerts if a["labels"]["alertname"] == "TorchloomDrift"]
        assert drift and drift[0]["state"] == "firing" and drift[0]["labels"]["severity"] == "warning"
    finally:
        prometheus.stop()
    log = server.stderr()  # a line when the verdict changes, not one per window
    name = server.client.get("/v1/labels").json()["model"]["name"]  # each line names the model
    assert f"WARNING torchloom.serve: monitor {name}: drift in " in log, log
    assert f"monitor {name}: no drift (last 100 texts" in log and log.count(": no drift") == 1, log


# ---------------------------------------------------------------------------------------------
# the status page in a real headless Chromium
# ---------------------------------------------------------------------------------------------


def test_the_status_page_shows_the_monitor_and_answers_a_text_in_chromium(server, tmp_path):
    """GET / in a real browser: it loads with no console error (its own policy allows only itself), shows the model,
    live traffic and each signal against its threshold, and the try-it box returns a label."""
    send(server, like_validation(random.Random(2), WINDOW)[0])
    browser = Browser(tmp_path)
    try:
        browser.call("Page.navigate", url=server.url + "/")
        browser.until("document.readyState === 'complete'")
        assert browser.js("document.getElementById('model').textContent") == "shop"
        from torchloom.monitor.drift import signal_names

        rows = browser.until(f"document.querySelectorAll('#signals tbody tr').length === {len(signal_names())} && "
                             "[...document.querySelectorAll('#signals tbody tr')].map(r => r.dataset.signal)")
        assert rows == ["classes", "confidence", "length", "unknown", "truncated", "representation"]  # the table's
        state = browser.js("document.getElementById('state').textContent")
        assert state.startswith(("drift", "no drift")), state
        assert browser.js("document.querySelectorAll('#shares tbody tr').length") == len(LABELS)
        period = browser.js("document.querySelector('#history tbody tr').textContent")  # this hour, drawn
        assert "(now)" in period, period
        browser.until("document.getElementById('throughput').textContent !== '-'", timeout=10)
        browser.js("document.getElementById('text').value = 'goal match team league win'; "
                   "document.getElementById('send').click(); true")
        label = browser.until("document.getElementById('label') && document.getElementById('label').textContent")
        assert label in LABELS
        # latency as the server measured it over its last minute (not a histogram bucket's bound)
        recent = dict((m["quantile"], v) for m, v in scraped(server, "torchloom_request_duration_recent_seconds"))
        assert recent["count"] >= 1 and 0 < recent["0.5"] <= recent["0.99"], recent
        p50 = browser.until("/^[0-9.]+ (ms|s)$/.test(document.getElementById('p50').textContent) &&"
                            " document.getElementById('p50').textContent", timeout=10)
        assert not p50.startswith(("\u2264", "\u2248")), p50
        assert browser.errors == [], browser.errors
    finally:
        browser.close()


# ---------------------------------------------------------------------------------------------
# no profile, a damaged one, flags: one line each
# ---------------------------------------------------------------------------------------------


def test_a_model_without_a_profile_serves_and_says_monitoring_is_off(monitored_model, tmp_path):
    """An older export (no monitor/), and a damaged profile: the server starts and serves, and says in one line
    that monitoring is off and how to turn it on; /v1/monitor and /metrics say "off"."""
    from support.owned import one_error, torchloom

    from torchloom.monitor.live import load_monitor
    from torchloom.serve.settings import ServeSettings

    older = tmp_path / "older" / "model"
    shutil.copytree(monitored_model, older, ignore=shutil.ignore_patterns("monitor"))
    s = Server(str(older), "--device", "cpu", "--no-tune", log_dir=tmp_path)
    try:
        lines = [line for line in s.stderr().splitlines() if "monitoring" in line]
        assert len(lines) == 1 and "monitoring off: model dir" in lines[0] and "export it again" in lines[0], lines
        assert s.client.post("/v1/predict", json={"texts": ["goal"]}).status_code == 200
        report = s.client.get("/v1/monitor").json()
        assert report["state"] == "off" and "export it again" in report["reason"]
        name, version = s.client.get("/v1/labels").json()["model"].values()  # each model's gauges name both
        assert (f'torchloom_monitor_state{{model="{name}",version="{version}",state="off"}} 1'
                in s.client.get("/metrics").text)
    finally:
        assert s.terminate() == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(monitored_model, damaged)
    sketch = damaged / "monitor" / "sketch.safetensors"
    sketch.write_bytes(sketch.read_bytes()[:100])  # cut short
    monitor_, off, line = load_monitor(ServeSettings(model_dir=str(damaged)), str(damaged), LABELS, "m")
    assert monitor_ is None and off["state"] == "off" and "\n" not in line
    assert line.startswith("warning: monitoring off: model dir ")
    assert "cannot be read (sketch.safetensors is damaged)" in line
    (damaged / "monitor" / "profile.json").write_text('{"format": "torchloom-monitor/2", "labels": []}')
    monitor_, off, line = load_monitor(ServeSettings(model_dir=str(damaged)), str(damaged), LABELS, "m")
    assert monitor_ is None and off["state"] == "off"
    assert line.startswith("warning: monitoring off: model dir ") and "cannot be read" in line and "\n" not in line
    for flags, needle in ((["--monitor-window", "1"], "--monitor-window 1: must be at least 2"),
                          (["--false-alarm", "2"], "--false-alarm 2.0: a chance, between 0 and 1"),
                          (["--monitor-window-s", "-1"], "--monitor-window-s -1: must be 0")):
        assert needle in one_error(torchloom("serve", monitored_model, *flags))


def test_answers_without_a_sketch_stop_the_representation_never_a_request(monitored_model):
    """A monitor that compares sketches and then gets answers without one (a forward that gave none) goes on with
    the other four signals instead of failing the request."""
    from torchloom.monitor.live import LiveMonitor
    from torchloom.monitor.profile import read_profile

    profile = read_profile(monitored_model)
    monitor = LiveMonitor(profile, "m", size=100, kernel=profile["_sketch"]["kernel"])
    monitor._calibrate()
    sketch = profile["_sketch"]["features"][0][:32] * 0  # any 32 numbers: the kernel's input is a sketch
    monitor.observe([{"label": LABELS[i % 3], "score": 0.9, "tokens": 8, "unknown": 0.0, "sketch": sketch}
                     for i in range(60)])
    assert "representation" in monitor.evaluate()["signals"]
    monitor.observe([{"label": "sport", "score": 0.9, "tokens": 8, "unknown": 0.0} for _ in range(60)])
    report = monitor.evaluate()
    assert monitor.kernel is None and "representation" not in report["signals"] and report["texts"] == 100


def test_a_dangling_link_as_the_report_is_refused_before_the_work(monitored_model, tmp_path):
    from torchloom.errors import UserError
    from torchloom.monitor.batch import monitor_file

    out = tmp_path / "report"
    out.symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match="a symbolic link to nothing"):
        monitor_file(monitored_model, str(tmp_path / "no-such-input.csv"), str(out))  # before the input is read


def test_the_batch_monitor_exits_0_3_or_2_and_its_report_names_the_model_and_the_time(monitored_model, tmp_path):
    """`torchloom monitor` as a scheduled job: 0 no drift, 3 drift, 2 (one line, no traceback) for a usage or input
    error, so `|| notify drift` hears only drift when it checks for 3; monitor.json says which model and when."""
    import csv
    from datetime import UTC, datetime

    from support.owned import torchloom

    def write(name: str, texts: list[str]) -> str:
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([["text"], *[[t] for t in texts]])
        return str(path)

    like, other = write("like.csv", like_validation(random.Random(7), 200)[0]), write("other.csv",
                                                                                         shifted(random.Random(7), 200))
    (tmp_path / "empty").mkdir()
    started = datetime.now(UTC).replace(microsecond=0)
    same = torchloom("monitor", "--model", monitored_model, "--input", like, "--output", str(tmp_path / "same"))
    assert same.returncode == 0 and same.stdout.startswith("monitor: no drift"), same.stderr[-2000:]
    report = json.loads((tmp_path / "same" / "monitor.json").read_text())
    assert report["model_identity"]["name"] == "shop" and report["model_identity"]["version"]
    assert started <= datetime.fromisoformat(report["at"]) <= datetime.now(UTC)
    assert "Model shop, version " in (tmp_path / "same" / "report.md").read_text()
    drifted = torchloom("monitor", "--model", monitored_model, "--input", other, "--output", str(tmp_path / "d"))
    assert drifted.returncode == 3 and drifted.stdout.startswith("monitor: drift in "), drifted.stderr[-2000:]
    for args, needle in ((["--input", str(tmp_path / "missing.csv")], "no such file or directory"),
                         (["--input", like, "--false-alarm", "2"], "a chance, between 0 and 1"),
                         (["--input", str(tmp_path / "empty")], "no .csv, .json"),
                         (["--input", like, "--text-column", "body"], "body")):
        bad = torchloom("monitor", "--model", monitored_model, *args, "--output", str(tmp_path / "bad"))
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, bad.stderr[-2000:])
        assert "Traceback" not in bad.stderr and not (tmp_path / "bad").exists()


def test_a_verdict_without_texts_goes_stale_and_says_so_and_each_period_is_kept(monitored_model, tmp_path,
                                                                                 monkeypatch):
    """Time, not only texts: a verdict with no text for stale_s says it is stale (the report, its reason, the
    gauge); once the window empties with age the verdict before stands, stale; each period's record (texts, the
    verdict, the estimated accuracy) is kept, in GET /v1/monitor's history and appended to --monitor-history's
    file as its period ends. The clock is the test's; the monitor and the model are real."""
    from torchloom.model.predict import Predictor
    from torchloom.monitor import live
    from torchloom.monitor.history import History
    from torchloom.monitor.profile import read_profile
    from torchloom.serve.metrics import monitor_families

    clock = [1_800_000_000.0]  # on an hour's boundary
    monkeypatch.setattr(live, "time", type("Clock", (), {"time": staticmethod(lambda: clock[0])}))
    path = tmp_path / "history.jsonl"
    monitor = live.LiveMonitor(read_profile(monitored_model), "shop", size=200, max_age_s=3000, stale_s=600,
                               history=History("shop", 3600, str(path)))
    monitor._calibrate()
    monitor.observe(Predictor(monitored_model).predict(like_validation(random.Random(8), 200)[0], with_signals=True))
    fresh = monitor.evaluate()
    assert (fresh["state"], fresh["stale"], fresh["last_text_s"]) == ("no_drift", False, 0.0), fresh
    clock[0] += 700
    quiet = monitor.evaluate()
    assert quiet["state"] == "no_drift" and quiet["stale"] and "no text for 700 s" in quiet["stale_reason"], quiet
    gauges = {f.name: f.read() for f in monitor_families(lambda: [(("shop", "1"), quiet)])}
    assert gauges["torchloom_monitor_stale"] == [(("shop", "1"), 1.0)]
    assert gauges["torchloom_monitor_last_text_age_seconds"] == [(("shop", "1"), 700.0)]
    assert not path.exists()  # the hour is not over
    clock[0] += 3000  # past the window's age and the hour
    emptied = monitor.evaluate()
    assert (emptied["texts"], emptied["state"], emptied["stale"]) == (0, "no_drift", True), emptied
    assert "older ones left it" in emptied["stale_reason"]
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert (record["model"], record["texts"], record["state"], record["drift_seen"]) == ("shop", 200, "no_drift",
                                                                                         False), record
    assert record["end"] - record["start"] == 3600 and 0 <= record["estimated_accuracy"] <= 1
    assert [h.get("open", False) for h in emptied["history"]] == [False, True]


def test_the_odd_texts_are_named_by_their_outlier_score_in_the_report_and_in_predict(monitored_model, tmp_path):
    """A file of texts like the reference with 10 in another script among 200 (5 %): the drift verdict may pass,
    but the report says how many texts are unusual against the reference and lists the most unusual, which are
    the odd ones; `predict --outlier-score` gives each text its score. Texts like the reference score like the
    reference: about 1 % past 0.99. (The tiny random model tells only gross oddities apart, another script among
    them; how finely the real MiniLM's representation tells them apart is benchmarks/outliers.py's.)"""
    import csv

    from support.owned import torchloom

    from torchloom.model.predict import Predictor
    from torchloom.monitor.outliers import scorer_for
    from torchloom.monitor.profile import kernel_for, read_profile

    rng = random.Random(11)
    cjk = ["数据", "模型", "训练", "价格", "市场", "音乐", "比赛", "银行"]  # another script: off the reference
    like = like_validation(rng, 190)[0]
    odd = [" ".join(rng.choice(cjk) for _ in range(rng.randint(6, 20))) for _ in range(10)]
    mixed = like[:95] + odd + like[95:]
    path = tmp_path / "mixed.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["text"], *[[t] for t in mixed]])
    proc = torchloom("monitor", "--model", monitored_model, "--input", str(path), "--output", str(tmp_path / "r"),
                     "--outliers", "10")
    assert proc.returncode in (0, 3) and "unusual" in proc.stdout, proc.stderr[-2000:]
    report = json.loads((tmp_path / "r" / "monitor.json").read_text())
    listed = [o["text"] for o in report["outliers"]]
    assert len(listed) == 10 and sum(t in odd for t in listed) >= 8, report["outliers"]
    assert report["unusual"]["share"] >= 0.04, report["unusual"]
    assert "| outlier score | predicted | text |" in (tmp_path / "r" / "report.md").read_text()
    # texts like the reference: scored like it (a uniform score, about 1 % past 0.99)
    profile, predictor = read_profile(monitored_model), Predictor(monitored_model)
    kernel_for(profile, predictor)
    fresh = like_validation(random.Random(12), 400)[0]
    scores = scorer_for(profile).scores(np.stack([a["sketch"] for a in predictor.predict(fresh, with_signals=True)]))
    assert 0.35 <= float(np.median(scores)) <= 0.65 and float(np.mean(scores >= 0.99)) <= 0.05, np.median(scores)
    scored = torchloom("predict", "--model", monitored_model, "--outlier-score", like[0], odd[0])
    assert scored.returncode == 0, scored.stderr[-2000:]
    lines = [json.loads(line) for line in scored.stdout.splitlines()]
    assert lines[1]["outlier"] > 0.99 > lines[0]["outlier"] and set(lines[0]) == {"text", "label", "score",
                                                                                  "probabilities", "outlier"}, lines
    (tmp_path / "log").mkdir()
    served = Server(monitored_model, "--outlier-score", "--device", "cpu", "--no-tune", log_dir=tmp_path / "log")
    try:  # the server's optional field: the same scores
        r = served.client.post("/v1/predict", json={"texts": [like[0], odd[0]]})
        assert [p["outlier"] for p in r.json()["predictions"]] == [line["outlier"] for line in lines], r.text
    finally:
        assert served.terminate() == 0, served.stderr()[-2000:]


def test_a_new_signal_is_one_table_row_and_reaches_the_window_the_batch_report_and_the_gauges(monitored_model,
                                                                                               tmp_path, monkeypatch):
    """One row added to drift.SIGNALS (the share of texts asking a question, a value a throw-away Predictor
    subclass puts in its answers), nothing else changed: the profile export writes stores it, the server's live
    window, the batch monitor's report and its markdown compare it, and the gauges carry it."""
    import csv

    from torchloom.model import predict
    from torchloom.monitor import drift
    from torchloom.monitor.batch import monitor_file
    from torchloom.monitor.live import LiveMonitor
    from torchloom.monitor.profile import read_profile, write_profile
    from torchloom.serve.metrics import monitor_families

    row = drift.Signal("questions", "questions", "ks", "share of texts that ask a question (a test's signal)",
                       lambda answer, reading: answer["questions"])
    monkeypatch.setattr(drift, "SIGNALS", [*drift.SIGNALS, row])

    class Asking(predict.Predictor):
        def predict(self, texts, *args, with_signals=False, **kwargs):
            answers = super().predict(texts, *args, with_signals=with_signals, **kwargs)
            for text, answer in zip(texts, answers if with_signals else ()):
                answer["questions"] = float(text.rstrip().endswith("?"))
            return answers

    monkeypatch.setattr(predict, "Predictor", Asking)
    model = tmp_path / "model"
    shutil.copytree(monitored_model, model)
    texts, labels = like_validation(random.Random(5), 300)
    write_profile(model, texts, labels, {"val": 300, "test": 0})  # no question in the reference
    profile = read_profile(model)
    assert profile["reference"]["questions"] == [0.0] * 300
    asked = [t + " ?" for t in like_validation(random.Random(6), 200)[0]]  # the same texts, asked

    monitor = LiveMonitor(profile, "m", size=200)
    monitor._calibrate()
    monitor.observe(Asking(str(model)).predict(asked, with_signals=True))
    report = monitor.evaluate()
    assert report["signals"]["questions"]["drift"] and "questions" in report["drifted"], report["signals"]
    assert not report["signals"]["length"]["drift"]  # a question mark is one token more: not a length shift
    gauges = {f.name: f.read() for f in monitor_families(lambda: [(("m", "1"), report)])}
    assert (("m", "1", "questions"), report["signals"]["questions"]["distance"]) in gauges["torchloom_monitor_distance"]

    data = tmp_path / "asked.csv"
    with open(data, "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([t] for t in asked)])
    batch = monitor_file(str(model), str(data), str(tmp_path / "report"), say=lambda *_: None)
    assert batch["signals"]["questions"]["drift"] and batch["drift"], batch["signals"]
    assert "share of texts that ask a question" in (tmp_path / "report" / "report.md").read_text()


def test_each_model_of_a_fleet_is_watched_against_its_own_profile_before_and_after_a_promotion(monitored_model,
                                                                                               tmp_path):
    """Two models behind one server whose profiles differ (v1's from short topic texts, v2's from long texts in
    other words), each sent texts like its own reference through a routing key: neither drifts, in /v1/monitor's
    entry of each model and in its top-level report (the model most traffic goes to), before and after v2 is
    promoted. (Each model of a local fleet was watched against the first one's profile: v2 drifted on its own
    reference, and the promotion raised the drift under v1's name.) In /metrics each model has its own series (model,
    version), and in a real Prometheus TorchloomDrift fires for v2 alone once v2 is sent v1's kind of text."""
    from support.owned import torchloom

    from torchloom.monitor.profile import write_profile

    v2 = tmp_path / "v2" / "model"
    shutil.copytree(monitored_model, v2)
    long_texts = shifted(random.Random(1), 400)
    write_profile(v2, long_texts, [LABELS[i % 3] for i in range(400)], {"val": 400, "test": 0})
    key, admin = "fleet-monitor-key", "fleet-monitor-admin"
    (tmp_path / "log").mkdir()
    s = Server("", "--model", f"v1={monitored_model}", "--model", f"v2={v2}", "--traffic", "v1=50,v2=50",
               "--monitor-window", str(WINDOW), "--api-key", key, "--admin-key", admin, "--device", "cpu",
               log_dir=tmp_path / "log")
    made = torchloom("monitor", "rules", "--output", str(tmp_path / "rules"), "--for", "0s", "--rate-window", "1m")
    assert made.returncode == 0, made.stderr
    prometheus = None
    try:
        for _ in range(3):  # a wrong key: refused, and logged once a minute (never the key it sent)
            wrong = s.client.post("/v1/predict", json={"texts": ["x"]}, headers={"Authorization": "Bearer guess-1234"})
            assert wrong.status_code == 401
        s.client.headers.update({"Authorization": f"Bearer {key}"})
        keys = {}
        for i in range(200):  # a routing key that reaches each model (a key always reaches the same one)
            r = s.client.post("/v1/predict", json={"texts": ["warm"]}, headers={"X-Torchloom-Key": f"user-{i}"})
            keys.setdefault(r.headers["X-Torchloom-Model"], f"user-{i}")
            if len(keys) == 2:
                break

        def feed(seed: int, names=("v1", "v2")) -> None:
            own = {"v1": like_validation(random.Random(seed), 2 * WINDOW)[0],
                   "v2": shifted(random.Random(seed), 2 * WINDOW)}
            for name in names:
                for start in range(0, len(own[name]), 25):
                    r = s.client.post("/v1/predict", json={"texts": own[name][start:start + 25]},
                                      headers={"X-Torchloom-Key": keys[name]})
                    assert r.status_code == 200 and r.headers["X-Torchloom-Model"] == name, r.text

        def states() -> dict:
            report = monitor(s)
            return {"top": report["state"], **{n: m["monitor"]["state"] for n, m in report["models"].items()}}

        def drift_gauges() -> dict:
            return {(m["model"], m["version"]): v for m, v in scraped(s, "torchloom_monitor_drift")}

        feed(2)
        deadline = time.monotonic() + 60
        while "warming_up" in states().values() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert states() == {"top": "no_drift", "v1": "no_drift", "v2": "no_drift"}
        versions = {n: m["version"] for n, m in monitor(s)["models"].items()}
        assert drift_gauges() == {("v1", versions["v1"]): 0.0, ("v2", versions["v2"]): 0.0}
        prometheus = Prometheus(s.url.split("://", 1)[1], tmp_path / "rules" / "torchloom-rules.yml", tmp_path)
        r = s.client.post("/v1/admin/promote", json={"model": "v2"}, headers={"Authorization": f"Bearer {admin}"})
        assert r.status_code == 200 and r.json()["traffic"]["v2"] == 100, r.text
        feed(3, names=("v2",))  # every request is v2's now: its own kind of text
        report = monitor(s)
        assert report["models"]["v2"]["traffic"] == 100 and report["models"]["v1"]["traffic"] == 0
        assert states() == {"top": "no_drift", "v1": "no_drift", "v2": "no_drift"}
        prometheus.wait(lambda: len(prometheus.query("torchloom_monitor_drift == 0")) == 2, 30, "never scraped")
        prometheus.wait(lambda: prometheus.alert_state("TorchloomMonitorOff") == "inactive", 10, "rules not evaluated")
        assert prometheus.alert_state("TorchloomDrift") == "inactive"
        rng, windows = random.Random(4), 0  # v1's kind of text to v2: v2 drifts, v1's verdict stands
        while monitor(s)["models"]["v2"]["monitor"]["state"] != "drift":
            windows += 1
            assert windows <= 8, monitor(s)["models"]["v2"]
            send(s, like_validation(rng, WINDOW // 4)[0])
        assert drift_gauges() == {("v1", versions["v1"]): 0.0, ("v2", versions["v2"]): 1.0}
        prometheus.wait(lambda: prometheus.alert_state("TorchloomDrift") == "firing", 30, "TorchloomDrift never fired")
        firing = [a["labels"] for a in prometheus.client.get("/api/v1/alerts").json()["data"]["alerts"]
                  if a["labels"]["alertname"] == "TorchloomDrift"]
        assert [(a["model"], a["version"]) for a in firing] == [("v2", versions["v2"])], firing
        refused = [line for line in s.stderr().splitlines() if "refused /v1/predict from 127.0.0.1: 401" in line]
        assert len(refused) == 1 and "guess-1234" not in s.stderr(), refused
        browser = Browser(tmp_path)  # the page: every model of the fleet, once the API key is given
        try:
            browser.call("Page.navigate", url=s.url + "/")
            browser.until("document.readyState === 'complete'")
            browser.until("document.getElementById('reason').textContent.includes('API key')")  # 401 without it
            browser.js(f"document.getElementById('key').value = '{key}'; true")
            browser.errors.clear()  # the 401 the page was told before the key was typed
            rows = browser.until("document.querySelectorAll('#models tbody tr').length === 2 &&"
                                 " [...document.querySelectorAll('#models tbody tr')].map(r => r.textContent)")
            assert "v1" in rows[0] and "0 %" in rows[0] and "no drift" in rows[0], rows
            assert "v2" in rows[1] and "100 %" in rows[1] and "drift" in rows[1], rows
            assert browser.errors == [], browser.errors
        finally:
            browser.close()
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.stderr()[-2000:]}") from None
    finally:
        if prometheus is not None:
            prometheus.stop()
        s.kill()


def scraped(server: Server, family: str) -> list[tuple[dict, float]]:
    """A family's samples in the server's /metrics: (labels, value) each."""
    from prometheus_client.parser import text_string_to_metric_families

    for f in text_string_to_metric_families(server.client.get("/metrics").text):
        if f.name == family:
            return [(sample.labels, sample.value) for sample in f.samples]
    return []
