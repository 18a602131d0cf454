"""The loop (torchloom.loop; issue 76): a real champion run (the tiny model, its recipe recorded and registered in a
real MLflow server), served by a real server with a SQLite prediction log; `torchloom loop --once` steps it one
transition at a time, while the test plays the traffic and the people who send labels.

The shift: the champion learnt sport and money from one vocabulary; texts of a second vocabulary arrive, their
labels fed back. A candidate trained on the snapshot (the champion's data and those labels) knows both."""

from __future__ import annotations

import csv
import json
import random
import time

import pytest
from support.command import torchloom
from support.served import Server, wait_for

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.heavy(2)

OLD = {"sport": "match goal team win league", "money": "bank market price shares profit"}
NEW = {"sport": "striker stadium referee penalty trophy", "money": "loan interest bond mortgage dividend"}
ADMIN = {"TORCHLOOM_ADMIN_KEY": "loop-admin-key"}


def texts_of(vocab: dict[str, str], n: int, start: int, rng: random.Random) -> list[tuple[str, str]]:
    """n (text, label) of these words, shuffled, each text its own."""
    out = []
    for i in range(start, start + n):
        label = rng.choice(sorted(vocab))
        words = vocab[label].split()
        rng.shuffle(words)
        out.append((f"{' '.join(words[:4])} item {i}", label))
    return out


@pytest.fixture(scope="module")
def champion(tmp_path_factory, tiny_model_dir):
    """The champion's run, registered as version 1 of `topics` with the alias champion, in a real MLflow server."""
    from support.mlflow_server import MlflowServer

    root = tmp_path_factory.mktemp("loop")
    mlflow = MlflowServer(root / "mlflow")
    rng = random.Random(0)
    with open(root / "old.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *texts_of(OLD, 100, 0, rng)])
    proc = torchloom("run", "--data.path", str(root / "old.csv"), "--model.path", tiny_model_dir,
                     "--output.dir", str(root / "champion"), "--prepare.spark_master", "local[1]",
                     "--prepare.test_fraction", "0.3", "--train.epochs", "4", "--train.batch_size", "8",
                     "--train.lr", "3e-3", "--tracking.uri", mlflow.url, "--tracking.experiment", "loop",
                     "--export.register", "topics", "--export.alias", "champion")
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield root, mlflow
    mlflow.stop()


def serve(run, tmp_path, *extra: str, model: str = "", env: dict | None = None) -> Server:
    return Server("", "--model", f"topics={model or f'{run}/model'}", "--log", str(tmp_path / "log.db"),
                  "--keep-texts", "--fleet-name", "topics", *extra, log_dir=tmp_path, env={**ADMIN, **(env or {})})


def predict(s: Server, items: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(id, text, true label) of each text sent, with the answer, in order."""
    r = s.client.post("/v1/predict", json={"texts": [t for t, _ in items]})
    assert r.status_code == 200, r.text
    return [(a["id"], a["label"], y) for a, (_, y) in zip(r.json()["predictions"], items)]


def feed(s: Server, answered: list[tuple[str, str, str]], truth=None) -> None:
    body = [{"id": i, "label": y if truth is None else truth(answer, y)} for i, answer, y in answered]
    done = s.client.post("/v1/feedback", json=body).json()
    assert done["recorded"] == len(body), done


def loop(s: Server, tmp_path, *extra: str, env: dict | None = None) -> str:
    """One step of the loop; its output."""
    proc = torchloom("loop", "--url", s.url, "--log", str(tmp_path / "log.db"), "--fleet", "topics", "--work",
                     str(tmp_path / "work"), "--on-labels", "150", "--on-drift", "0", "--shadow-texts", "60",
                     "--ramp", "50", "--canary-labels", "20", "--once", *extra, env={**ADMIN, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def loop_until(s: Server, tmp_path, needle: str, timeout: float = 30, env: dict | None = None) -> str:
    """Steps until one says `needle` (the server writes its log within a fraction of a second)."""
    said = []
    wait_for(lambda: (said.append(loop(s, tmp_path, env=env)), needle in said[-1])[1], timeout=timeout)
    return said[-1]


def labels_in_log(tmp_path) -> int:
    from torchloom.monitor.predlog import PredictionLog

    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "topics")
    try:
        return log.count_labels()
    finally:
        log.close()


def history(tmp_path) -> list[dict]:
    proc = torchloom("loop", "history", "--log", str(tmp_path / "log.db"), "--fleet", "topics", "--json")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def traffic(s: Server) -> dict[str, float]:
    return s.client.get("/v1/admin", headers={"Authorization": f"Bearer {ADMIN['TORCHLOOM_ADMIN_KEY']}"}
                        ).json()["traffic"]


def timeline_in_chromium(s: Server, tmp_path, newest: str) -> list[str]:
    """The status page's Loop timeline as a real browser draws it, newest first (once its newest row is of kind
    `newest`: the page reads the log every 2 s): each row's event and line."""
    from support.browser import Browser

    browser = Browser(tmp_path)
    try:
        browser.call("Page.navigate", url=s.url + "/")
        browser.until("document.readyState === 'complete'")
        rows = browser.until(f"!document.getElementById('loop').hidden && document.querySelector('#timeline tbody"
                             f" tr').dataset.kind === '{newest}' && [...document.querySelectorAll('#timeline tbody"
                             " tr')].map(r => r.cells[1].textContent + ' ' + r.cells[3].textContent)")
        assert browser.errors == [], browser.errors
        return rows
    finally:
        browser.close()


def test_a_shift_fed_back_is_retrained_gated_shadowed_ramped_and_promoted(champion, tmp_path):
    from mlflow import MlflowClient

    root, mlflow = champion
    rng = random.Random(1)
    alias_before = MlflowClient(tracking_uri=mlflow.url, registry_uri=mlflow.url
                                ).get_model_version_by_alias("topics", "champion").version
    s = serve(root / "champion", tmp_path)
    try:
        assert "idle" in loop(s, tmp_path) and "0 new labels" in loop(s, tmp_path, "--on-drift", "1")  # its monitor
        answered = predict(s, texts_of(NEW, 200, 1000, rng))
        wrong = sum(a != y for _, a, y in answered)
        assert wrong > 40, f"the champion already knows the new words ({wrong} of 200 wrong)"
        feed(s, answered)
        loop_until(s, tmp_path, "triggered: 200 labels fed back")
        out = loop(s, tmp_path)  # the snapshot
        assert "snapshot at label seq" in out and "40 held out" in out, out
        out = loop(s, tmp_path)  # the candidate, trained by the champion's recipe
        assert "candidate topics-r1" in out, out
        out = loop(s, tmp_path)  # the offline gate
        assert "offline gate passed" in out, out
        loop(s, tmp_path)  # loaded as a shadow
        assert traffic(s) == {"topics": 100.0, "topics-r1": 0.0}
        assert "shadow: 0 of 60" in loop(s, tmp_path)
        predict(s, texts_of(OLD, 30, 5000, rng) + texts_of(NEW, 30, 6000, rng))
        loop_until(s, tmp_path, "shadow gate passed")
        loop(s, tmp_path)  # the canary: half the traffic
        assert traffic(s) == {"topics": 50.0, "topics-r1": 50.0}
        assert s.metrics()["torchloom_model_requests"].samples  # each model's requests, for the canary's limits
        # a request each, routed at random by the split: labels on both models' answers
        feed(s, [a for item in texts_of(NEW, 90, 7000, rng) for a in predict(s, [item])])
        loop_until(s, tmp_path, "canary step passed")
        assert "promoted" in loop(s, tmp_path)
        assert traffic(s)["topics-r1"] == 100.0
        assert all(a == y for _, a, y in predict(s, texts_of(NEW, 20, 9000, rng)))  # the new words, learnt
        # the watch: the new champion's limits for --watch-hours (1 by default), then kept
        assert "watching topics-r1 for 60 min more: 1 requests, 0 failed, no limit breached" in loop(s, tmp_path)
        time.sleep(0.5)  # past a watch of 0.0001 h (0.36 s) since the promotion, however fast the steps came
        assert "topics-r1 kept after 0.0001 h" in loop(s, tmp_path, "--watch-hours", "0.0001")
        shown = timeline_in_chromium(s, tmp_path, "watched")
        assert shown[0].startswith("watched") and "topics-r1 kept after" in shown[0], shown
        assert any(row.startswith("promote") and "topics-r1 promoted over topics" in row for row in shown), shown
        assert any(row.startswith("gate offline") and "passed" in row for row in shown), shown
    finally:
        assert s.terminate() == 0
    events = history(tmp_path)
    kinds = [e["kind"] for e in events if e["kind"] != "admin"]
    assert kinds == ["started", "trigger", "snapshot", "candidate", "gate", "shadow", "gate", "canary", "gate",
                     "promote", "watched"], kinds
    canary = next(e for e in events if e["kind"] == "canary")
    assert canary["limits_at"]["champion_count"] > 0  # the champion's recent p99 was there to compare with
    offline = next(e for e in events if e.get("gate") == "offline")
    assert offline["result"]["sets"]["newest"]["candidate"] > offline["result"]["sets"]["newest"]["champion"]
    assert offline["result"]["sets"]["frozen_test"]["n"] == 30
    promoted = events[-1] if events[-1]["kind"] == "promote" else [e for e in events if e["kind"] == "promote"][-1]
    client = MlflowClient(tracking_uri=mlflow.url, registry_uri=mlflow.url)
    now = client.get_model_version_by_alias("topics", "champion")
    registered = next(e for e in events if e["kind"] == "candidate")["registered"]
    assert now.version == promoted["registry"]["version"] == registered["version"]
    assert promoted["registry"]["was"] == alias_before != now.version
    assert now.tags["torchloom.loop.outcome"] == "promoted"
    assert now.tags["torchloom.loop.watch"].startswith("topics-r1 kept after 0.0001 h")
    assert now.tags["torchloom.loop.gate.offline"].startswith("offline gate passed: frozen_test")
    assert now.tags["torchloom.loop.gate.canary_50"].startswith("no harm at 50 %")
    admin = [e["action"] for e in events if e["kind"] == "admin"]  # the server's record of the same changes
    assert admin == ["load", "traffic", "traffic", "promote"], admin
    table = torchloom("loop", "history", "--log", str(tmp_path / "log.db"), "--fleet", "topics").stdout
    assert "promote" in table and "topics-r1 promoted over topics" in table


def test_a_candidate_trained_as_a_kubernetes_job_on_the_store_is_gated_and_shadowed_from_there(champion, tmp_path):
    """The loop as `torchloom k8s loop --train-on k8s` runs it: the candidate's run on a store (a real S3 server), its
    training the Indexed Job of `torchloom k8s train`, created through the API (the fake API server, whose kubelet
    runs the pods' shell and torchrun here, pod 0 named in DNS as the headless Service would), then exported,
    registered and evaluated from the store; the gates read it from there."""
    from mlflow import MlflowClient
    from support.kube_api import fake_kube, run_pods
    from support.s3 import s3_server

    root, mlflow = champion
    rng = random.Random(4)
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    on_k8s = ("--train-on", "k8s", "--store", "s3://loop/runs")
    with s3_server(tmp_path, "loop", creds) as port, fake_kube(tmp_path) as (fake, kubeconfig):
        fake.namespaces.add("ml")
        fake.add_secret("ml", "store", {**creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
        fake.kubelet = lambda f, ns, job: run_pods(f, ns, job, tmp_path)
        env = {"KUBECONFIG": str(kubeconfig), "TORCHLOOM_TRAIN_K8S": json.dumps(
            {"image": "registry.example/torchloom:0.1", "namespace": "ml", "env_from": "store"})}
        # the serve pod reads the store with the Secret's credentials too
        s = serve(root / "champion", tmp_path, env={**creds, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
        try:
            feed(s, predict(s, texts_of(NEW, 200, 1000, rng)))
            wait_for(lambda: "triggered" in loop(s, tmp_path, *on_k8s, env=env), timeout=30)
            assert "snapshot at label seq" in loop(s, tmp_path, *on_k8s, env=env)
            out = loop(s, tmp_path, *on_k8s, env=env)  # prepare, the Job, export, evaluate
            assert "training the candidate as job topics-r1 in namespace ml (created): 1 pods x 2 ranks" in out, out
            assert "job topics-r1: complete (1 pods succeeded)" in out and "deleted job/topics-r1" in out, out
            assert "candidate topics-r1" in out and "(s3://loop/runs/topics-r1)" in out, out
            assert [(o["kind"], o["metadata"]["name"]) for o in fake.created()] == []  # both deleted, by uid
            assert {(r, n) for r, n, _ in fake.deleted} == {("jobs", "topics-r1"), ("services", "topics-r1")}
            pod_log = (tmp_path / "topics-r1-0.log").read_text()
            assert "rank 0 of 2" in pod_log and "rank 1 of 2" in pod_log, pod_log[-3000:]
            assert "offline gate passed" in loop(s, tmp_path, *on_k8s, env=env)
            assert "shadow started" in loop(s, tmp_path, *on_k8s, env=env)
            assert traffic(s) == {"topics": 100.0, "topics-r1": 0.0}
        finally:
            assert s.terminate() == 0
    candidate = next(e for e in history(tmp_path) if e["kind"] == "candidate")
    assert candidate["run"] == "s3://loop/runs/topics-r1" and candidate["candidate_path"].startswith("s3://")
    version = MlflowClient(tracking_uri=mlflow.url, registry_uri=mlflow.url).get_model_version(
        "topics", candidate["registered"]["version"])
    assert version.tags["torchloom.output_dir"] == "s3://loop/runs/topics-r1"
    assert candidate["candidate_source"] == f"models:/topics/{version.version}"


def test_a_worse_candidate_is_stopped_at_the_offline_gate_and_the_loop_waits_for_a_person(champion, tmp_path):
    root, _ = champion
    from mlflow import MlflowClient

    rng = random.Random(2)
    alias_before = MlflowClient(tracking_uri=champion[1].url, registry_uri=champion[1].url
                                ).get_model_version_by_alias("topics", "champion").version
    # the champion served from the registry: the loop finds its recipe through the version's torchloom.output_dir
    registry = {"MLFLOW_TRACKING_URI": champion[1].url}
    first = MlflowClient(tracking_uri=champion[1].url, registry_uri=champion[1].url).search_model_versions(
        "name='topics'", order_by=["version_number ASC"])[0].version
    s = serve(root / "champion", tmp_path, model=f"models:/topics/{first}", env=registry)
    try:
        # labels that swap the topics of the champion's own words: a candidate learns them and gets worse
        answered = predict(s, texts_of(OLD, 200, 1000, rng))
        feed(s, answered, truth=lambda answer, y: "money" if y == "sport" else "sport")
        loop_until(s, tmp_path, "triggered", env=registry)
        for _ in range(2):  # the snapshot, the candidate
            loop(s, tmp_path, env=registry)
        out = loop(s, tmp_path, env=registry)
        assert "offline gate refused" in out and "frozen_test" in out, out
        assert traffic(s) == {"topics": 100.0}  # never loaded: the champion answered everything
        feed(s, predict(s, texts_of(NEW, 200, 3000, rng)))  # more labels: no new cycle while paused
        wait_for(lambda: labels_in_log(tmp_path) == 400)  # written by the server's writer thread
        assert "paused" in loop(s, tmp_path, env=registry) and "paused" in loop(s, tmp_path, env=registry)
        resumed = torchloom("loop", "resume", "--log", str(tmp_path / "log.db"), "--fleet", "topics", "--who",
                            "alice")
        assert "goes on" in resumed.stdout, resumed.stdout + resumed.stderr
        assert "not paused" in torchloom("loop", "resume", "--log", str(tmp_path / "log.db"), "--fleet",
                                         "topics").stdout
        assert "triggered" in loop(s, tmp_path, "--cooldown-hours", "0", env=registry)
    finally:
        assert s.terminate() == 0
    events = history(tmp_path)
    trigger = next(e for e in events if e["kind"] == "trigger")
    assert trigger["recipe"] == str(root / "champion") and trigger["champion_path"] != str(root / "champion" / "model")
    refused = next(e for e in events if e.get("gate") == "offline")
    assert refused["stage"] == "paused" and refused["result"]["passed"] is False
    test = refused["result"]["sets"]["frozen_test"]
    assert test["candidate"] < test["champion"] and test["lower_bound"] < -0.02
    assert [e["who"] for e in events if e["kind"] == "resumed"] == ["alice"]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=champion[1].url, registry_uri=champion[1].url)
    registered = next(e for e in events if e["kind"] == "candidate")["registered"]
    assert client.get_model_version("topics", registered["version"]).tags["torchloom.loop.outcome"] == \
        "stopped at the offline gate"
    assert client.get_model_version_by_alias("topics", "champion").version == alias_before  # never moved


def killed_while_training(s: Server, tmp_path) -> None:
    """The loop's training step as its own process, SIGKILLed once the candidate's run is under way: the run ends
    with it (no orphan goes on writing into the candidate's directory), and the events still say "train"."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from support.served import ENV

    run = tmp_path / "work" / "cycle-1" / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torchloom", "loop", "--url", s.url, "--log",
                             str(tmp_path / "log.db"), "--fleet", "topics", "--work", str(tmp_path / "work"), "--once"],
                            env={**ENV, **ADMIN}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: "prepare: read" in (run.parent / "train.log").read_text()
             if (run.parent / "train.log").is_file() else False, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def left() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if str(run).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    found.append(int(pid))
            except OSError:
                pass
        return found

    wait_for(lambda: not left(), timeout=30)
    time.sleep(1)
    assert not left()
    assert [e["kind"] for e in history(tmp_path)][-1] == "snapshot"  # the cycle stands at "train"


def test_harm_in_the_canary_rolls_back_to_the_champion_with_no_request_failing(champion, tmp_path):
    root, _ = champion
    rng = random.Random(3)
    s = serve(root / "champion", tmp_path)
    try:
        feed(s, predict(s, texts_of(NEW, 200, 1000, rng)))
        loop_until(s, tmp_path, "triggered")
        loop(s, tmp_path)  # the snapshot
        killed_while_training(s, tmp_path)
        assert "candidate topics-r1" in loop(s, tmp_path)  # trained again, from the start, where it was
        for _ in range(2):  # its offline gate, the shadow
            loop(s, tmp_path)
        predict(s, texts_of(OLD, 30, 5000, rng) + texts_of(NEW, 30, 6000, rng))
        loop_until(s, tmp_path, "shadow gate passed")
        loop(s, tmp_path)
        assert traffic(s) == {"topics": 50.0, "topics-r1": 50.0}
        # the world turns: the new words now mean the other topic; the candidate, which learnt them, is wrong
        flipped = [a for item in texts_of(NEW, 120, 7000, rng) for a in predict(s, [item])]
        feed(s, flipped, truth=lambda answer, y: "money" if y == "sport" else "sport")
        out = loop_until(s, tmp_path, "rolled back")
        assert "champion better" in out, out
        assert traffic(s) == {"topics": 100.0}  # the candidate unloaded
        assert all(r[0] for r in predict(s, texts_of(NEW, 10, 9000, rng)))
        assert "paused" in loop(s, tmp_path)
    finally:
        assert s.terminate() == 0
    events = history(tmp_path)
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert rollback["stage"] == "paused" and rollback["verdict"]["state"] == "a_better"
    from mlflow import MlflowClient

    registered = next(e for e in events if e["kind"] == "candidate")["registered"]
    tags = MlflowClient(tracking_uri=champion[1].url, registry_uri=champion[1].url).get_model_version(
        "topics", registered["version"]).tags
    assert tags["torchloom.loop.outcome"] == "rolled back" and "champion better" in tags["torchloom.loop.rollback"]
    assert rollback["verdict"]["labels"] <= 40  # found at the first or second look
