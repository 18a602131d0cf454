"""Several models behind one endpoint (serve/fleet.py, issue 58): a traffic split, sticky keys, shadows, feedback,
the verdict, and the admin route, on a real `torchloom serve` (and on Ray Serve through its proxy).

The models are the tiny random BERT: A; B, the same weights with its labels rotated (it answers a different label
for every text: a planted difference); C, a copy of A (an equal model, which must never be called different)."""

from __future__ import annotations

import asyncio
import random
import shutil
from pathlib import Path

import pytest
from support.net import free_port
from support.owned import one_error, torchloom
from support.served import Server, export_tiny, sample_value, wait_for

httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.heavy(3)

LABELS = ["sport", "money", "music"]
WORDS = {"sport": "match goal team win league", "money": "bank shares profit market price",
         "music": "guitar band song album concert"}
TEXTS = [*WORDS.values(), "short", "a much longer text " * 10]
API_KEY = "fleet-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "fleet-admin-4567"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    from torchloom.model.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("fleet")
    base = write_tiny_model(root / "base")
    a = export_tiny(base, root / "a" / "model", LABELS, TEXTS, seed=0)
    b = export_tiny(base, root / "b" / "model", LABELS[1:] + LABELS[:1], TEXTS, seed=0)  # A's logits, labels rotated
    c = str(root / "c" / "model")
    shutil.copytree(a, c)
    other = export_tiny(base, root / "other" / "model", ["yes", "no", "maybe"], TEXTS, seed=0)
    return {"A": a, "B": b, "C": c, "other": other}


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(list(WORDS.values()))} {rng.choice(list(WORDS.values()))} number {i}" for i in range(n)]


def counted(s: Server, model: str, role: str) -> float:
    return sample_value(s.metrics(), "torchloom_model_texts", "torchloom_model_texts_total", model=model, role=role)


def routed(s: Server, n: int, key: str | None = None) -> list[str]:
    """The model that answered each of n one-text requests (sent at once), checked header against body."""
    async def send():
        headers = {**AUTH, **({"X-Torchloom-Key": key} if key else {})}
        async with httpx.AsyncClient(base_url=s.url, timeout=60, headers=headers) as client:
            return await asyncio.gather(*(client.post("/v1/predict", json={"texts": [t]}) for t in texts(n)))

    out = []
    for r in asyncio.run(send()):
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["X-Torchloom-Model"] == body["model"]["variant"]
        assert r.headers["X-Torchloom-Ids"] == body["predictions"][0]["id"]
        out.append(body["model"]["variant"])
    return out


def check_split_sticky_and_shadow(s: Server, shares: dict[str, float], shadow: str, n: int = 300,
                                  one_process: bool = True) -> None:
    """Answers split within 4.5 standard deviations of the shares; a key always reaches one model; the shadow
    never answers and, on a server of one process (the metric is the process's), sees every text."""
    before = counted(s, shadow, "shadow")
    answered = routed(s, n)
    assert shadow not in answered
    for name, share in shares.items():
        sd = (n * share * (1 - share)) ** 0.5
        assert abs(answered.count(name) - n * share) <= 4.5 * sd, (name, answered.count(name), shares)
    for key in ("user-1", "user-2", "user-3", "user-4"):
        assert len(set(routed(s, 8, key))) == 1, key
    if one_process:
        wait_for(lambda: counted(s, shadow, "shadow") == before + n + 32)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    s = Server("", "--model", f"A={models['A']}", "--model", f"B={models['B']}", "--model", f"C={models['C']}",
               "--traffic", "A=70,B=30", "--shadow", "C", "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
               "--device", "cpu",
               log_dir=tmp_path_factory.mktemp("fleet-log"))
    s.client.headers.update(AUTH)
    yield s
    s.kill()


def test_a_split_with_a_shadow_routes_by_share_and_key_and_never_returns_the_shadows_answers(server):
    check_split_sticky_and_shadow(server, {"A": 0.7, "B": 0.3}, "C")
    families = server.metrics()
    assert sample_value(families, "torchloom_model_traffic_percent", "torchloom_model_traffic_percent",
                        model="B") == 30
    assert sample_value(families, "torchloom_model_shadow", "torchloom_model_shadow", model="C") == 1
    # TEI's body keeps its shape; the headers say who answered
    watched = counted(server, "C", "shadow")
    r = server.client.post("/predict", json={"inputs": "match goal"}, headers={"X-Torchloom-Key": "user-1"})
    assert r.status_code == 200 and isinstance(r.json(), list) and r.headers["X-Torchloom-Model"] in ("A", "B")
    wait_for(lambda: counted(server, "C", "shadow") == watched + 1)  # the shadow watched it too


def test_feedback_scores_the_models_and_refuses_unknown_repeated_and_foreign_labels(server):
    before = counted(server, "C", "shadow")
    r = server.client.post("/v1/predict", json={"texts": ["match goal team", "bank"]},
                           headers={"X-Torchloom-Key": "k"})
    variant, (prediction, other) = r.json()["model"]["variant"], r.json()["predictions"]
    wait_for(lambda: counted(server, "C", "shadow") == before + 2)  # the shadow's answers are in
    r = server.client.post("/v1/feedback", json={"id": prediction["id"], "label": prediction["label"]})
    assert r.status_code == 200, r.text
    # C is A's copy: right where A answered, wrong where B (A's labels rotated) did
    assert r.json()["right"] == {variant: True, "C": variant == "A"}, r.json()
    for body, status, code in [({"id": prediction["id"], "label": "sport"}, 409, "already_labelled"),
                               ({"id": "0-0", "label": "sport"}, 404, "unknown_id"),
                               ({"id": other["id"], "label": "weather"}, 422, "unknown_label"),
                               ({"label": "sport"}, 422, "invalid_request")]:
        r = server.client.post("/v1/feedback", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        assert "\n" not in r.json()["error"]["message"]
    assert "Traceback" not in server.stderr()


def test_the_verdict_names_the_worse_model_only_once_enough_labels_came_and_never_an_equal_one(server):
    r = server.client.put("/v1/admin/traffic", json={"traffic": {"A": 100, "B": 0, "C": 0}, "shadows": ["B", "C"]},
                          headers=ADMIN)
    assert r.status_code == 200, r.text
    sent = texts(400, seed=1)
    shadowed = {name: counted(server, name, "shadow") for name in ("B", "C")}
    predictions = [p for chunk in (sent[:200], sent[200:]) for p in
                   server.client.post("/v1/predict", json={"texts": chunk}).json()["predictions"]]
    for name in ("B", "C"):
        wait_for(lambda name=name: counted(server, name, "shadow") == shadowed[name] + 400)
    rng = random.Random(0)
    truth = [p["label"] if rng.random() < 0.9 else rng.choice(LABELS) for p in predictions]

    def verdicts() -> dict[str, dict]:
        return {v["model"]: v for v in server.client.get("/v1/monitor").json()["verdicts"]}

    for p, label in zip(predictions[:150], truth[:150]):
        assert server.client.post("/v1/feedback", json={"id": p["id"], "label": label}).status_code == 200
    assert verdicts()["B"]["state"] == "not_yet_known" and verdicts()["B"]["needed"] > 0  # too few labels
    for p, label in zip(predictions[150:], truth[150:]):
        assert server.client.post("/v1/feedback", json={"id": p["id"], "label": label}).status_code == 200
    v = verdicts()
    assert v["B"]["state"] == "a_better" and v["B"]["test"] == "paired", v["B"]
    assert v["C"]["state"] == "not_yet_known", v["C"]  # C is A's copy
    families = server.metrics()
    assert sample_value(families, "torchloom_ab_verdict", "torchloom_ab_verdict", model="B", state="a_better") == 1
    assert sample_value(families, "torchloom_online_accuracy", "torchloom_online_accuracy", model="A",
                        bound="estimate") > 0.85
    assert "verdict B against A: A better" in server.stderr()


def test_admin_changes_need_the_key_and_refuse_bad_splits_unknown_models_and_foreign_labels(server, models):
    bare = httpx.Client(base_url=server.url, timeout=60)
    for headers in ({}, {"Authorization": "Bearer wrong-key-000"}):
        r = bare.put("/v1/admin/traffic", json={"traffic": {"A": 100}}, headers=headers)
        assert r.status_code == 401, r.text
    r = bare.put("/v1/admin/traffic", json={"traffic": {"A": 100}}, headers=AUTH)  # the predict key: not here
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert bare.post("/v1/predict", json={"texts": ["x"]}, headers=ADMIN).status_code == 401  # nor the other way
    pickled = Path(models["A"]).parent.parent / "pickled" / "model"
    shutil.copytree(models["A"], pickled)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    for method, path, body, status in [
            ("PUT", "/v1/admin/traffic", {"traffic": {"A": 50, "B": 40}}, 422),  # 90, not 100
            ("PUT", "/v1/admin/traffic", {"traffic": {"A": 50, "Z": 50}}, 422),
            ("PUT", "/v1/admin/traffic", {"traffic": {"A": 50, "C": 50}, "shadows": ["C"]}, 422),
            ("POST", "/v1/admin/promote", {"model": "Z"}, 404),
            ("PUT", "/v1/admin/models/D", {"path": models["other"]}, 422),  # other labels
            ("PUT", "/v1/admin/models/D", {"path": "/nonexistent/model"}, 422),
            ("PUT", "/v1/admin/models/D", {"path": str(pickled)}, 422),  # a pickle's weights: never loaded
            ("PUT", "/v1/admin/models/%D0%BC%D0%BE%D0%B4%D0%B5%D0%BB%D1%8C", {"path": models["A"]}, 422)]:  # модель
        r = server.client.request(method, path, json=body, headers=ADMIN)
        assert r.status_code == status, (path, body, r.text)
        assert "\n" not in r.json()["error"]["message"]
    # promote, then load a new version of A in place: warmed up first, then it answers A's traffic
    assert server.client.post("/v1/admin/promote", json={"model": "C"}, headers=ADMIN).json()["traffic"]["C"] == 100
    assert set(routed(server, 20)) == {"C"}
    r = server.client.put("/v1/admin/traffic", json={"traffic": {"A": 100}, "shadows": []}, headers=ADMIN)
    version = r.json()["models"]["A"]["version"]
    again = Path(models["A"]).parent.parent / "a2" / "model"
    shutil.copytree(models["A"], again)
    (again / "torchloom.json").write_text((again / "torchloom.json").read_text().replace("{", '{"version": "v2", ', 1))
    r = server.client.put("/v1/admin/models/A", json={"path": str(again)}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["models"]["A"]["version"] == "v2" != version, r.text
    assert server.client.post("/v1/predict", json={"texts": ["x"]}).json()["model"]["version"] == "v2"
    wait_for(lambda: "released a " in server.stderr())
    changes = {s.labels["action"]: s.value for s in server.metrics()["torchloom_admin_changes"].samples
               if s.name.endswith("_total")}
    assert changes["promote"] >= 1 and changes["replace"] == 1, changes


def test_a_server_without_a_key_has_no_admin_and_bad_splits_fail_in_one_line(models, tmp_path):
    for flags, words in [(["--traffic", "A=50,B=40"], "add up to 90"),
                         (["--traffic", "A=100", "--shadow", "A"], "give it no traffic"),
                         (["--shadow", "A", "--shadow", "B"], "every model is a shadow"),
                         (["--shadow", "Z"], "no model is named 'Z'")]:
        error = one_error(torchloom("serve", "--model", f"A={models['A']}", "--model", f"B={models['B']}", *flags))
        assert words in error, error
    error = one_error(torchloom("serve", "--model", f"модель={models['A']}", "--port", "0"))
    assert "a model's name is up to 64 letters, digits" in error, error
    error = one_error(torchloom("serve", models["A"], "--api-key", "same-key-123", "--admin-key", "same-key-123"))
    assert "--admin-key: must differ from --api-key" in error, error
    error = one_error(torchloom("serve", models["A"], "--api-key", "ключ-0123456"))
    assert "--api-key: use at least 8 printable ASCII characters" in error, error
    error = one_error(torchloom("serve", "--model", f"A={models['A']}", "--model", f"B={models['other']}",
                                "--port", "0"))
    assert "labels" in error and "differ" in error, error
    s = Server(models["A"], "--device", "cpu", log_dir=tmp_path)
    try:
        r = s.client.put("/v1/admin/traffic", json={"traffic": {"A": 100}}, headers=ADMIN)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled", r.text
        p = s.client.post("/v1/predict", json={"texts": ["match"]}).json()  # one model: feedback works too
        assert s.client.post("/v1/feedback", json={"id": p["predictions"][0]["id"], "label": "sport"}).status_code \
            == 200
        assert s.client.get("/v1/monitor").json()["models"]["a"]["online_accuracy"]["labels"] == 1
    finally:
        s.kill()


@pytest.mark.ray
def test_ray_serve_splits_sticks_and_shadows_through_its_proxy(models, tmp_path):
    pytest.importorskip("ray.serve")
    s = Server("", "--serve-with", "ray", "--model", f"A={models['A']}", "--model", f"B={models['B']}", "--model",
               f"C={models['C']}", "--traffic", "A=60,B=40", "--shadow", "C", "--api-key", API_KEY, "--device", "cpu",
               "--port", str(free_port()), "--log", str(tmp_path / "log.db"), "--fleet-name", "ray-fleet",
               "--replicas", "2", "--admin-key", ADMIN_KEY, log_dir=tmp_path, ready_timeout=150)
    try:
        s.client.headers.update(AUTH)
        check_split_sticky_and_shadow(s, {"A": 0.6, "B": 0.4}, "C", n=200, one_process=False)  # the log counts
        p = s.client.post("/v1/predict", json={"texts": ["match"]}).json()["predictions"][0]
        r = s.client.post("/v1/feedback", json={"id": p["id"], "label": "sport"})  # any replica: the log's ids
        assert r.status_code == 200, r.text
        # a change reaches one replica; the other follows it through the log (serve/fleet_sync.py)
        r = s.client.put("/v1/admin/traffic", json={"traffic": {"A": 0, "B": 100, "C": 0}}, headers=ADMIN)
        assert r.status_code == 200, r.text
        wait_for(lambda: set(routed(s, 40)) == {"B"}, timeout=30)
        assert s.terminate(timeout=60) == 0, s.stderr()[-3000:]
    finally:
        s.kill()
    from torchloom.monitor.predlog import PredictionLog

    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "ray-fleet")  # the replica wrote it, and drained it on stop
    try:
        rows = dict(log.read("SELECT model || ' ' || role, COUNT(*) FROM tl_predictions GROUP BY 1"))
        assert rows["C shadow"] >= 200 and rows["A answer"] + rows["B answer"] >= 200, rows
        assert [(i.id, i.label) for i in log.labelled()] == [(p["id"], "sport")]
    finally:
        log.close()


def test_requests_sent_while_a_model_is_replaced_are_all_answered_by_the_old_version_or_the_new(models, tmp_path):
    """Texts wait 300 ms for their batch; requests keep coming while A's new version loads: the ones still queued at
    the swap are answered by the old version (released only once its queue is empty), none fails."""
    import threading

    s = Server("", "--model", f"A={models['A']}", "--api-key", API_KEY, "--admin-key", ADMIN_KEY, "--device", "cpu",
               "--max-wait-ms", "300",
               "--fixed-wait", "--no-tune", log_dir=tmp_path)
    try:
        s.client.headers.update(AUTH)
        again = tmp_path / "a2" / "model"
        shutil.copytree(models["A"], again)
        (again / "torchloom.json").write_text((again / "torchloom.json").read_text().replace("{", '{"version": "v2", ',
                                                                                             1))
        answers: list[tuple[int, str]] = []
        done = threading.Event()

        def keep_asking() -> None:
            with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as client:
                while not done.is_set() or len(answers) < 5:
                    r = client.post("/v1/predict", json={"texts": ["match goal"]})
                    answers.append((r.status_code, r.json()["model"]["version"] if r.status_code == 200 else r.text))

        askers = [threading.Thread(target=keep_asking) for _ in range(4)]
        for t in askers:
            t.start()
        r = s.client.put("/v1/admin/models/A", json={"path": str(again)}, headers=ADMIN)
        wait_for(lambda: any(v == "v2" for _, v in answers))  # the askers' requests after the swap: the new version's
        done.set()
        for t in askers:
            t.join(60)
        assert r.status_code == 200, r.text
        assert all(code == 200 for code, _ in answers), [a for a in answers if a[0] != 200][:3]
        versions = [v for _, v in answers]
        assert "v2" in versions and versions[0] != "v2" and set(versions) == {versions[0], "v2"}
        wait_for(lambda: "released a " in s.stderr())
    finally:
        s.kill()


class Held:
    """A backend whose answers wait until the test lets them go (`release`): a shadow slower than the labels."""

    def __init__(self, labels: list[str], answer: str) -> None:
        import asyncio

        from torchloom.model.served import ModelIdentity

        self.identity = ModelIdentity("m", "1", tuple(labels))
        self.answer, self.gate = answer, asyncio.Event()

    def room(self) -> int:
        return 1000

    async def predict(self, texts: list[str], **_) -> list[dict]:
        await self.gate.wait()
        return [{"label": self.answer, "score": 1.0} for _ in texts]


def test_a_label_that_comes_before_the_shadow_answered_is_credited_to_it_once_it_does():
    """Feedback is sent while the shadow still works on the text (221 of 1,124 in a real run were): it used to be
    lost for the shadow; now the shadow is scored when its answer comes (tally, its pair with the first model,
    the verdict), and torchloom_feedback_late_total counts it. Here the backends are stand-ins: the subject is the
    fleet's bookkeeping, not a model."""
    import asyncio

    from torchloom.serve.fleet import Fleet, Member
    from torchloom.serve.metrics import ServeMetrics, fleet_families
    from torchloom.serve.split import make_plan

    async def scenario() -> tuple[dict, dict, dict]:
        first, shadow = Held(LABELS, LABELS[0]), Held(LABELS, LABELS[1])
        first.gate.set()
        plan = make_plan(["A", "C"], {"A": 100.0}, ["C"])
        fleet = Fleet([Member("A", "a", first), Member("C", "c", shadow)], plan, ServeMetrics(), 100, 0.05, 0.05)
        answers = await fleet.predict(["one", "two"])
        early = fleet.feedback(answers[0]["id"], LABELS[1])  # the shadow has not answered yet
        shadow.gate.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if fleet.tallies["C"].labels:
                break
        families = {f.name: f.read() for f in fleet_families(fleet)}
        return early, {n: (t.labels, t.right) for n, t in fleet.tallies.items()}, families

    early, tallies, families = asyncio.run(scenario())
    assert early["right"] == {"A": False}  # at the time of the label only A had answered
    assert tallies == {"A": (1, 0), "C": (1, 1)}  # C's answer, when it came, was the label: credited
    assert (("credited",), 1.0) in families["torchloom_feedback_late_total"]


def test_feedback_in_bulk_over_http_and_from_a_file_with_torchloom_feedback(server, tmp_path):
    """POST /v1/feedback with a list: each label recorded as one request would be, the refused ones by their code,
    in order; `torchloom feedback --input FILE` sends a file's labels in such lists and says what became of them."""
    import csv

    from support.command import torchloom

    predictions = server.client.post("/v1/predict", json={"texts": texts(30, seed=9)}).json()["predictions"]
    bulk = [{"id": p["id"], "label": p["label"]} for p in predictions[:10]]
    r = server.client.post("/v1/feedback", json=[*bulk, {"id": "0-0", "label": LABELS[0]}, bulk[0]])
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["recorded"], body["refused"]) == (10, 2)
    assert [x.get("error", {}).get("code") for x in body["results"][-2:]] == ["unknown_id", "already_labelled"]
    assert server.client.post("/v1/feedback", json=[{"id": "x"}]).json()["error"]["message"].startswith("item 0:")
    labels = tmp_path / "labels.csv"
    with open(labels, "w", newline="") as f:
        csv.writer(f).writerows([["id", "label"], *[[p["id"], p["label"]] for p in predictions[10:]],
                                 ["", LABELS[0]], [predictions[0]["id"], LABELS[0]]])
    sent = torchloom("feedback", "--input", str(labels), "--url", server.url, "--batch", "7",
                     TORCHLOOM_API_KEY=API_KEY)
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert sent.stdout.strip() == (f"feedback: 21 labels sent to {server.url}: 20 recorded, 1 refused"
                                   " (already_labelled 1); 1 rows without an id or a label set aside"), sent.stdout
    wrong = torchloom("feedback", "--input", str(labels), "--url", server.url, TORCHLOOM_API_KEY="nope")
    assert wrong.returncode == 2 and "answered 401" in wrong.stderr and "nope" not in wrong.stderr, wrong.stderr


def test_an_admin_change_on_one_server_of_a_fleet_reaches_the_others_and_one_restarted(models, tmp_path):
    """Two servers of one deployment (the same flags: two pods behind a Service) on one SQLite log: a change made
    on one is followed by the other within a look of its log, a change on the other is made on top of it, a server
    restarted with the same flags serves the fleet's state, and one of other flags (another deployment) keeps its
    own. Nothing followed is recorded again."""
    from torchloom.monitor.predlog import PredictionLog

    def start(*flags: str) -> Server:
        logs = tmp_path / f"s{len(list(tmp_path.glob('s*')))}"
        logs.mkdir()
        s = Server("", "--model", f"A={models['A']}", "--model", f"B={models['B']}", *flags, "--api-key", API_KEY,
                   "--admin-key", ADMIN_KEY, "--device", "cpu", "--log", str(tmp_path / "log.db"), "--fleet-name",
                   "pods", log_dir=logs)
        s.client.headers.update(AUTH)
        return s

    def view(s: Server) -> dict:
        r = s.client.get("/v1/admin", headers=ADMIN)
        assert r.status_code == 200, r.text
        return r.json()

    def answered_by(s: Server) -> set[str]:
        return set(routed(s, 40))

    one, two = start("--traffic", "A=100,B=0"), start("--traffic", "A=100,B=0")
    three = other = None
    try:
        r = one.client.put("/v1/admin/models/C", json={"path": models["C"]}, headers=ADMIN)
        assert r.status_code == 200, r.text
        r = one.client.put("/v1/admin/traffic", json={"traffic": {"A": 0, "B": 0, "C": 100}, "shadows": ["B"]},
                           headers=ADMIN)
        assert r.status_code == 200, r.text
        wait_for(lambda: answered_by(two) == {"C"}, timeout=30)  # followed in the background, not on a request
        assert view(two)["traffic"] == {"A": 0.0, "B": 0.0, "C": 100.0} and view(two)["shadows"] == ["B"]
        assert "following" in two.stderr() and "admin (following" not in one.stderr()
        r = two.client.put("/v1/admin/traffic", json={"traffic": {"A": 50, "B": 0, "C": 50}}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["shadows"] == ["B"], r.text  # made on top of one's change
        wait_for(lambda: answered_by(one) == {"A", "C"}, timeout=30)
        assert one.terminate() == 0
        three = start("--traffic", "A=100,B=0")  # the same deployment, restarted: its fleet's state once ready
        assert answered_by(three) == {"A", "C"} and view(three)["shadows"] == ["B"]
        other = start("--traffic", "A=50,B=50")  # another deployment on the same log: its own flags stand
        assert answered_by(other) <= {"A", "B"} and "C" not in view(other)["models"]
    finally:
        for s in (one, two, three, other):
            if s is not None:
                s.kill()
    log = PredictionLog(f"sqlite:///{tmp_path}/log.db", "pods")
    try:
        actions = [e["action"] for e in log.events_of("admin")]
    finally:
        log.close()
    assert actions == ["load", "traffic", "traffic"], actions  # what a server followed is not recorded again
