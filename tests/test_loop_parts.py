"""The loop's parts on their own (torchloom.loop): the gates' statistics, the triggers' cooldown and limit, the
state read back from the events, the snapshot's choice of labels, the Alertmanager webhook, and the command's
one-line errors. In process, no model: tests/test_loop.py runs the whole loop."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import pytest
from support.command import torchloom


def test_non_inferiority_needs_evidence_and_per_class_harm_needs_evidence_of_harm():
    from torchloom.loop.gates import harmed_classes, paired

    rng = random.Random(0)
    same = [rng.random() < 0.9 for _ in range(300)]
    assert paired(same, same, 0.02, 0.05)["passed"]  # no text told apart: the difference is 0
    worse = [x and rng.random() < 0.85 for x in same]  # about 13 points worse
    record = paired(same, worse, 0.02, 0.05)
    assert not record["passed"] and record["lower_bound"] < -0.02 and record["p_value"] > 0.05
    # a little worse on many texts: within the margin, with evidence
    big = [rng.random() < 0.9 for _ in range(20_000)]
    slightly = [x if rng.random() > 0.01 else not x for x in big]
    assert paired(big, slightly, 0.02, 0.05)["passed"]
    # no worse but few texts, many told apart: not enough evidence that it is not worse by 2 points
    a = [True, False] * 10
    b = [False, True] * 10
    assert not paired(a, b, 0.02, 0.05)["passed"]
    labels = ["sport"] * 40 + ["money"] * 40 + ["music"] * 3
    champ = [True] * 83
    cand = [i % 2 == 0 for i in range(40)] + [True] * 40 + [False] * 3
    harmed = harmed_classes(labels, champ, cand, 0.05, 0.05)
    assert [h["label"] for h in harmed] == ["sport"]  # music lost all 3, too few to call it harm
    assert harmed[0]["recall_drop"] == 0.5 and harmed[0]["level"] == pytest.approx(0.05 / 3)


def test_a_slower_candidate_is_one_slower_by_the_ratio_and_by_a_millisecond_a_text():
    from torchloom.loop.gates import too_slow

    assert too_slow({"ratio": 2.0, "champion_ms": 5.0, "candidate_ms": 10.0}, 1.5)
    assert not too_slow({"ratio": 1.4, "champion_ms": 5.0, "candidate_ms": 7.0}, 1.5)
    assert not too_slow({"ratio": 3.6, "champion_ms": 0.1, "candidate_ms": 0.36}, 1.5)  # noise on a tiny model


def test_triggers_fire_on_what_is_seen_and_wait_out_their_cooldown_and_daily_limit():
    from torchloom.loop.triggers import due, parse

    triggers = parse({"labels": 100, "drift": 500, "accuracy": 0.8, "schedule": 24, "alert": 1})
    assert [t.id for t in triggers] == ["alert", "labels", "drift", "accuracy", "schedule"]
    start = [{"kind": "started", "at": 1000.0}]
    quiet = {"labels": 10, "monitor": {"drift": True, "drifted": ["length"], "texts": 200,
                                       "estimated_accuracy": {"value": 0.9}}}
    assert due(triggers, quiet, start, 3600, 2, now=2000.0) == (None, "no trigger fires")
    trigger, why = due(triggers, {**quiet, "labels": 150}, start, 3600, 2, now=2000.0)
    assert trigger.id == "labels" and "150 labels" in why
    drifted = {**quiet, "monitor": {"drift": True, "drifted": ["classes", "length"], "texts": 800}}
    trigger, why = due(triggers, drifted, start, 3600, 2, now=2000.0)
    assert trigger.id == "drift" and "drifted in classes, length over 800 texts" in why
    low = {**quiet, "monitor": {"estimated_accuracy": {"value": 0.7}}}
    assert due(triggers, low, start, 3600, 2, now=2000.0)[0].id == "accuracy"
    assert due(triggers, quiet, start, 3600, 2, now=1000.0 + 24 * 3600)[0].id == "schedule"
    assert due(triggers, {**quiet, "alerts": ["ModelDrift"]}, start, 3600, 2, now=2000.0)[0].id == "alert"
    fired = start + [{"kind": "trigger", "trigger": "labels", "at": 1500.0}]
    trigger, why = due(triggers, {**quiet, "labels": 150}, fired, 3600, 2, now=2000.0)
    assert trigger is None and "cools down for 52 more minutes" in why
    twice = fired + [{"kind": "trigger", "trigger": "labels", "at": 6000.0}]
    trigger, why = due(triggers, {**quiet, "labels": 150}, twice, 3600, 2, now=10_000.0)
    assert trigger is None and "fired 2 times in the last day" in why
    assert due(triggers, {**quiet, "labels": 150}, twice, 3600, 2, now=1500.0 + 86_401)[0].id == "labels"


def test_the_state_is_read_back_from_the_events_and_a_new_trigger_starts_a_new_cycle():
    from torchloom.loop.controller import state_of

    events = [{"seq": 1, "kind": "started", "at": 1, "who": "l", "stage": "idle"},
              {"seq": 2, "kind": "trigger", "at": 2, "who": "l", "stage": "snapshot", "cycle": 1, "champion": "a"},
              {"seq": 3, "kind": "admin", "at": 3, "who": "10.0.0.1", "action": "traffic"},
              {"seq": 4, "kind": "snapshot", "at": 4, "who": "l", "stage": "train", "watermark": 7},
              {"seq": 5, "kind": "stopped", "at": 5, "who": "l", "stage": "paused", "gate": "train"}]
    stage, cycle = state_of(events)
    assert stage == "paused" and cycle == {"cycle": 1, "champion": "a", "watermark": 7, "gate": "train"}
    events += [{"seq": 6, "kind": "resumed", "at": 6, "who": "alice", "stage": "idle"},
               {"seq": 7, "kind": "trigger", "at": 7, "who": "l", "stage": "snapshot", "cycle": 2, "champion": "a"}]
    assert state_of(events) == ("snapshot", {"cycle": 2, "champion": "a"})
    assert state_of([]) == ("idle", {})


def test_the_snapshot_takes_each_text_once_and_counts_what_it_sets_aside(tmp_path):
    from torchloom.loop.snapshot import feedback
    from torchloom.monitor.predlog import PredictionLog, text_hash

    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "f", keep_texts=True)
    log.predictions("m", "1", "answer", ["p1", "p2", "p3"], ["kept text", "hashed?", "in the data"],
                    [{"label": "sport"}] * 3)
    log.feedback("p1", "sport")
    log.feedback("p3", "money")
    log.feedback("t1", "money", text="sent with its text", source="text")
    log.feedback("t2", "nope", text="a label the model lacks", source="text")
    log.feedback("t3", "sport", text="sent with its text", source="text")  # relabelled: the newest stands
    log.feedback("p9", "sport")  # an id whose prediction has no text in the log
    assert log.flush()
    used, aside = feedback(log, log.watermark(), {"sport", "money"}, {text_hash("in the data")})
    assert [(t, y) for _, t, y in used] == [("kept text", "sport"), ("sent with its text", "sport")]
    assert aside == {"in_the_data": 1, "unknown_label": 1, "relabelled": 1, "no_text": 1}
    assert feedback(log, 1, {"sport", "money"}, set())[0] == [(1, "kept text", "sport")]  # up to the watermark
    log.close()


def test_a_snapshot_built_again_removes_only_the_files_the_loop_writes(tmp_path):
    from torchloom.errors import UserError
    from torchloom.loop.snapshot import FILES, remove_ours

    out = tmp_path / "snapshot"
    out.mkdir()
    for name in (*FILES.values(), "snapshot.json"):
        (out / name).write_text("x")
    (out / "notes.txt").write_text("a person's file")
    with pytest.raises(UserError, match=r"not \(only\) a snapshot the loop wrote \(notes.txt\)"):
        remove_ours(out)
    assert (out / "notes.txt").read_text() == "a person's file" and (out / "train.parquet").exists()
    (out / "notes.txt").unlink()
    remove_ours(out)
    assert not out.exists()


def test_an_alertmanager_webhook_records_firing_alerts_as_events(tmp_path, monkeypatch):
    from torchloom.loop.webhook import KEY_ENV, listen
    from torchloom.monitor.predlog import PredictionLog

    monkeypatch.setenv(KEY_ENV, "hook-key")
    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "f")
    server = listen(log, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def post(body, key="hook-key") -> int:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        body = {"status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": "TorchloomDrift"}},
                                               {"status": "resolved", "labels": {"alertname": "Old"}}]}
        assert post(body) == 200
        assert post(body, key="wrong") == 401 and post({"no": "alerts"}) == 400
    finally:
        server.shutdown()
    assert [(e["kind"], e["who"], e["alert"]) for e in log.events()] == [("alert", "alertmanager", "TorchloomDrift")]
    log.close()


@pytest.mark.parametrize("args, message", [
    (["--fleet", "f", "--log", "x.db", "--work", "w"], "loop: --url is missing"),
    (["--fleet", "f", "--log", "x.db", "--url", "http://127.0.0.1:9", "--work", "w", "--ramp", "50,25"],
     "--ramp 50,25: give rising shares"),
    (["--fleet", "f", "--url", "http://127.0.0.1:9", "--work", "w"], "loop: --log is missing"),
    (["--fleet", "f", "--log", "{log}", "--url", "http://127.0.0.1:9", "--work", "{tmp}/w", "--once",
      "--on-drift", "1"], "the server at http://127.0.0.1:9 cannot be reached"),
    (["history", "--fleet", "f", "--log", "{tmp}/typo.db"], "--log {tmp}/typo.db: no such file; give the file the"
                                                           " server writes"),
    (["--fleet", "f", "--log", "x.db", "--url", "u", "--work", "w", "--holdout", "2"], "--holdout 2 is not between"),
    (["--fleet", "f", "--log", "x.db", "--url", "u", "--work", "w", "--train-on", "k8s", "--store", "runs/"],
     "--store runs/: --train-on k8s trains the candidate in pods that read and write its run on a store"),
    (["--fleet", "f", "--log", "x.db", "--url", "u", "--work", "w", "--store", "s3://b/loop"],
     "--store s3://b/loop: only --train-on k8s puts the candidates' runs on a store"),
], ids=["no-url", "ramp", "no-log", "unreachable", "typo", "holdout", "k8s-no-store", "store-alone"])
def test_loop_mistakes_are_one_line_with_exit_2(args, message, tmp_path):
    from torchloom.monitor.predlog import PredictionLog

    PredictionLog(f"sqlite:///{tmp_path}/log.db", "f").close()  # a log the server made
    fill = lambda a: a.replace("{log}", str(tmp_path / "log.db")).replace("{tmp}", str(tmp_path))  # noqa: E731
    proc = torchloom("loop", *map(fill, args), TORCHLOOM_LOG=None)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fill(message) in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "typo.db").exists()


def test_the_canary_s_limits_roll_back_on_errors_or_a_slow_p99_never_on_jitter():
    from torchloom.loop.gates import limits
    from torchloom.loop.server import model_numbers

    text = "\n".join([
        '# TYPE torchloom_model_requests_total counter',
        'torchloom_model_requests_total{model="t-r1"} 130', 'torchloom_model_requests_total{model="t"} 900',
        'torchloom_model_failures_total{model="t-r1"} 7',
        'torchloom_model_duration_recent_seconds{model="t-r1",quantile="0.99"} 0.400',
        'torchloom_model_duration_recent_seconds{model="t-r1",quantile="count"} 160',
        'torchloom_model_duration_recent_seconds{model="t",quantile="0.99"} 0.100',
        'torchloom_model_duration_recent_seconds{model="t",quantile="count"} 500'])
    now = model_numbers(text, "t", "t-r1")
    assert now == {"requests": 130, "failed": 7, "candidate_p99": 0.4, "candidate_count": 160, "champion_p99": 0.1,
                   "champion_count": 500}
    before = {"requests": 30, "failed": 1}
    found = limits(before, now, 0.01, 2.0)
    assert found["breached"] and found["requests"] == 100 and found["failed"] == 6
    assert found["why"][0].startswith("error rate 0.060 on 100 requests") and "p99 400 ms" in found["why"][1]
    calm = {**now, "failed": 1, "candidate_p99": 0.012, "champion_p99": 0.004}  # 3 times, but 8 ms: jitter
    assert not limits(before, calm, 0.01, 2.0)["breached"]
    few = {**now, "requests": 40, "candidate_count": 60}  # 10 requests since, 60 timed: too few to judge either
    assert limits(before, few, 0.01, 2.0)["why"] == []
    restarted = {**calm, "requests": 25, "failed": 1}  # counters began again: counted from 0
    assert limits({"requests": 30, "failed": 1}, restarted, 0.01, 2.0)["requests"] == 25


def test_one_loop_per_fleet_a_second_is_one_line_and_a_lapsed_lease_is_taken_over(tmp_path):
    from torchloom.loop.lease import NAME, LoopLease
    from torchloom.monitor.predlog import PredictionLog

    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "f")
    said: list[str] = []

    def step(fleet: str = "f"):
        return torchloom("loop", "--fleet", fleet, "--log", str(tmp_path / "log.db"), "--url", "http://127.0.0.1:9",
                         "--work", str(tmp_path / "w"), "--once", "--on-drift", "1")

    try:
        first = LoopLease(log, "torchloom loop@host-a", said.append)
        first.take(wait=False)
        proc = step()
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "loop: fleet f is run by another loop (torchloom loop@host-a pid" in lines[0], lines
        assert "stop that one first" in lines[0]
        assert "cannot be reached" in step("g").stderr  # another fleet's loop is not held
        first.release()
        assert "cannot be reached" in step().stderr  # let go: the next loop takes it (and lets go of it)
        log.take_lease(NAME, "torchloom loop@elsewhere pid 1 (killed)", -1.0)  # lapsed: its loop stopped renewing
        assert "cannot be reached" in step().stderr
        # a loop of this host killed with SIGKILL: its lease (valid for a minute more) is taken over at once
        import signal
        import socket
        import subprocess

        dead = subprocess.Popen(["sleep", "60"])
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        log.take_lease(NAME, f"torchloom loop@{socket.gethostname()} pid {dead.pid} (x)", 60)
        proc = step()
        assert "taking over the fleet's lease from" in proc.stdout and "cannot be reached" in proc.stderr, proc.stdout
        # a loop whose lease lapsed (its store away past the lease) and was taken by another: it stops
        mine = LoopLease(log, "torchloom loop@host-b", said.append)
        mine.take(wait=False)
        log.read("UPDATE tl_leases SET until = 0 WHERE fleet = 'f'")
        log.take_lease(NAME, "torchloom loop@host-c", 60)
        mine.renew()
        assert mine.lost and said[-1].startswith("loop: warning: the fleet's lease went to torchloom loop@host-c")
        mine.release()
        assert log.take_lease(NAME, "someone", 60)[0] == "torchloom loop@host-c"  # a lost lease is not dropped
    finally:
        log.close()


def test_after_promotion_a_breached_limit_rolls_back_to_the_champion_it_replaced_and_pauses(tmp_path):
    """The watch stage against a stand-in server on 127.0.0.1 (its admin route and /metrics: a model failing its
    requests cannot be made to order from a real one): quiet numbers keep watching; a breach loads the replaced
    champion again where it was unloaded, gives it the traffic back and pauses. tests/test_loop.py runs a real
    promotion through its watch."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from torchloom.monitor.predlog import PredictionLog

    fake = {"view": {"plan": "", "traffic": {"topics-r1": 100.0}, "shadows": [], "models": {}}, "failed": 0,
            "calls": []}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: str, kind: str = "application/json") -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._answer(f'torchloom_model_requests_total{{model="topics-r1"}} 130\n'
                             f'torchloom_model_failures_total{{model="topics-r1"}} {fake["failed"]}\n', "text/plain")
            else:
                self._answer(json.dumps(fake["view"]))

        def do_PUT(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fake["calls"].append((self.path, body))
            if self.path == "/v1/admin/traffic":
                fake["view"]["traffic"] = body["traffic"]
            else:
                fake["view"]["traffic"][self.path.rsplit("/", 1)[1]] = 0.0
            self._answer(json.dumps(fake["view"]))

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "topics")
    log.event("started", "test", stage="idle")
    log.event("trigger", "test", stage="snapshot", cycle=1, champion="topics", champion_path="/runs/a/model",
              champion_source="models:/topics/1")
    log.event("candidate", "test", stage="offline", candidate="topics-r1", candidate_path="/runs/b/model")
    log.event("promote", "test", stage="watch", champion="topics-r1", previous="topics", registry=None,
              watch_since=time.time(), watch_at={"requests": 10, "failed": 0})

    def step() -> str:
        proc = torchloom("loop", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--log",
                         str(tmp_path / "log.db"), "--fleet", "topics", "--work", str(tmp_path / "w"), "--once",
                         TORCHLOOM_ADMIN_KEY="k")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    try:
        assert "watching topics-r1 for 60 min more: 120 requests, 0 failed, no limit breached" in step()
        fake["failed"] = 9  # 9 of the 120 requests since promotion failed
        out = step()
        assert "rolled back to topics after promotion: error rate 0.075 on 120 requests (at most 0.01)" in out, out
        assert fake["calls"] == [("/v1/admin/models/topics", {"path": "models:/topics/1"}),  # unloaded: again
                                 ("/v1/admin/traffic", {"traffic": {"topics-r1": 0.0, "topics": 100.0},
                                                        "shadows": []})]
        last = log.events()[-1]
        assert last["kind"] == "rollback" and last["stage"] == "paused" and last["gate"] == "watch"
        assert "paused" in step()
    finally:
        log.close()
        server.shutdown()
