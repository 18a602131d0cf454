"""Models by name (registry.py) against a real MLflow store (SQLite here; the MLflow server with PostgreSQL behind it
is tests/cluster/test_shared_db.py's, where another host serves the model by name): a tiny exported model registered
with an alias, loaded by `torchloom predict` with an empty cache, and each way a registered name fails as one line.
The commands run in this process (main), each with its own cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.net import free_port
from support.served import export_tiny

pytest.importorskip("mlflow")

LABELS = ["money", "music", "sport"]
TEXTS = ["bank shares profit market price", "guitar band song album concert", "match goal team"]


def torchloom(*args: str, cache: Path, uri: str | None = None):
    """`torchloom ARGS` (support.command: in this process) with its own cache, as a fresh host, and the registry at
    `uri` (--tracking-uri, which the command sets as MLFLOW_TRACKING_URI: put back after, with the rest)."""
    from support.command import torchloom as run

    return run(*args, *(["--tracking-uri", uri] if uri else []), cache=cache, env={"MLFLOW_TRACKING_URI": None})


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """(store URI, exported model dir, the registration) of a tiny model registered as `topics` with alias champion,
    by registry.register through a torchloom Tracker, as export does."""
    from torchloom.config import build
    from torchloom.model.tiny import write_tiny_model
    from torchloom.registry import register
    from torchloom.tracking import Tracker

    tmp = tmp_path_factory.mktemp("registry")
    model_dir = export_tiny(write_tiny_model(tmp / "tiny"), tmp / "model", LABELS, TEXTS)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = build(None, ["--tracking.uri", uri, "--output.dir", str(tmp / "run")])
    with Tracker.start(cfg, "export", params=False) as tracker:
        first = register(tracker, Path(model_dir), "topics", "", {"val_accuracy": 0.5})
        done = register(tracker, Path(model_dir), "topics", "champion", {"val_accuracy": 0.75})
    assert (first["version"], done["version"]) == ("1", "2")
    return uri, model_dir, done


def test_a_registered_model_is_predicted_by_alias_with_an_empty_cache(registered, tmp_path):
    from mlflow import MlflowClient

    uri, model_dir, done = registered
    assert done["uri"] == "models:/topics@champion"
    version = MlflowClient(tracking_uri=uri).get_model_version_by_alias("topics", "champion")
    assert str(version.version) == "2" and version.tags["val_accuracy"] == "0.75"
    cache = tmp_path / "cache"
    proc = torchloom("predict", "--model", "models:/topics@champion", "bank shares profit", cache=cache,
                     uri=uri)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "version 2 of topics" in proc.stderr
    line = json.loads(proc.stdout.splitlines()[0])
    assert line["label"] in LABELS
    # the same scores as the exported directory itself, and the model was fetched into the private cache
    from torchloom.model.predict import Predictor

    direct = Predictor(model_dir, device="cpu").predict(["bank shares profit"])[0]
    assert direct["probabilities"] == pytest.approx(line["probabilities"], abs=1e-6)
    assert [p for p in (cache / "registry").rglob("config.json")]
    by_version = torchloom("predict", "--model", "models:/topics/1", "match goal", cache=cache, uri=uri)
    assert by_version.returncode == 0 and "version 1 of topics" in by_version.stderr, by_version.stderr[-2000:]


@pytest.mark.parametrize("model, needle", [
    ("models:/nothing@champion", "no model 'nothing' is registered at"),
    ("models:/topics@staging", "has no alias 'staging' (its aliases: champion)"),
    ("models:/topics/9", "has no version 9"),
    ("models:/topics", "not a registered model's URI"),
])
def test_a_registered_name_that_does_not_resolve_is_one_line(registered, tmp_path, model, needle):
    uri, _, _ = registered
    proc = torchloom("predict", "--model", model, "text", cache=tmp_path / "cache", uri=uri)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchloom: error:") and needle in lines[0], proc.stderr


def test_a_registry_that_does_not_answer_is_one_line_at_once(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = torchloom("serve", "models:/topics@champion", cache=tmp_path / "cache", uri=dead)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the registry at {dead} does not answer" in lines[0], proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--alias", "champion"], "an alias names a version of a registered model"),
    (["--register", "a/b"], "not a model name the registry takes"),
    (["--register", "topics", "--alias", "latest"], "which MLflow reserves"),
])
def test_register_and_alias_are_checked_before_any_work(tmp_path, args, needle):
    proc = torchloom("export", "--output.dir", str(tmp_path / "run"), *args, cache=tmp_path / "cache")
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_cache_deletes_only_its_own_entries(tmp_path, monkeypatch):
    """model_cache.fill_once, the fetch of a registered (or stored) model: a fill that fails leaves nothing, an entry
    is replaced only under <cache>/<kind>/<hex key>, and a key that is not hex is refused (it could name a path)."""
    from torchloom.model_cache import fill_once

    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    beside = tmp_path / "cache" / "registry" / "notes.txt"
    beside.parent.mkdir(parents=True)
    beside.write_text("a user's file")

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise OSError("the download broke")

    with pytest.raises(OSError):
        fill_once("registry", "ab12", lambda entry: False, broken)
    assert sorted(p.name for p in beside.parent.iterdir()) == [".ab12.lock", "notes.txt"]
    made = fill_once("registry", "ab12", lambda entry: (entry / "ok").is_file(),
                     lambda tmp: (tmp.mkdir(), (tmp / "ok").write_text("1")))
    assert made == beside.parent / "ab12" and beside.read_text() == "a user's file"
    with pytest.raises(ValueError):
        fill_once("registry", "../../x", lambda entry: False, lambda tmp: None)


@pytest.mark.parametrize("named", ["../../elsewhere", "/etc"])
def test_a_registered_model_naming_a_directory_outside_its_download_is_refused(tmp_path, named):
    from torchloom.errors import UserError
    from torchloom.registry import _model_dir

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "MLmodel").write_text(
        f"flavors:\n  python_function:\n    artifacts:\n      model_dir:\n        path: {named}\n")
    with pytest.raises(UserError, match="names a model directory outside the downloaded model"):
        _model_dir(tmp_path, "models:/reviews/1", "MODEL_DIR")


def test_latest_is_the_newest_version_and_a_pinned_one_is_served_from_the_cache_while_the_registry_is_down(
        registered, tmp_path):
    """models:/NAME/latest (which MLflow reads) is the newest version; a pinned version fetched once serves from the
    cache with one warning once the registry (a real MLflow server over the registered store) is gone; an alias
    (which may have moved) or latest do not, each in one whole line."""
    from support.mlflow_server import MlflowServer

    store, _, _ = registered
    cache = tmp_path / "cache"
    server = MlflowServer(tmp_path / "server", backend=store)
    try:
        latest = torchloom("predict", "--model", "models:/topics/latest", "match goal", cache=cache, uri=server.url)
        assert latest.returncode == 0 and "version 2 of topics" in latest.stderr, latest.stderr[-2000:]
        pinned = torchloom("predict", "--model", "models:/topics/1", "match goal", cache=cache, uri=server.url)
        assert pinned.returncode == 0, pinned.stderr[-2000:]
    finally:
        server.stop()
    dead = server.url
    offline = torchloom("predict", "--model", "models:/topics/1", "match goal", cache=cache, uri=dead)
    assert offline.returncode == 0, offline.stderr[-2000:]
    warned = [line for line in offline.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1 and f"the registry at {dead} does not answer" in warned[0], offline.stderr
    assert "serving version 1 of topics from the cache" in warned[0]
    assert json.loads(offline.stdout.splitlines()[0]) == json.loads(pinned.stdout.splitlines()[0])
    for moving in ("models:/topics@champion", "models:/topics/latest"):
        refused = torchloom("predict", "--model", moving, "match goal", cache=cache, uri=dead)
        line = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(line) == 1 and "does not answer" in line[0], refused.stderr
        assert line[0].rstrip().endswith("to the right one") and ")" in line[0]  # whole: never cut mid-word


def test_a_server_by_registry_name_answers_as_the_registered_version(registered, tmp_path, monkeypatch):
    """serve models:/topics@champion: the responses, the page, the monitor's gauges and a real Prometheus's alert
    (the model has no profile: TorchloomMonitorOff) name the registered model (topics, version 2, alias champion),
    not the download's directory; --tracking.uri is --tracking-uri's alias. The admin route loads a version by its
    registry URI (the loop's candidate when the server is in a pod of its own) and says where each model came
    from, so a loop on another host reads the champion from there (loop/controller.readable)."""
    from support.command import torchloom as run
    from support.prometheus import Prometheus
    from support.served import Server

    uri, _, _ = registered
    (tmp_path / "log").mkdir()
    s = Server("models:/topics@champion", "--tracking.uri", uri, "--device", "cpu", "--no-tune",
               "--admin-key", "registry-admin-4567",
               log_dir=tmp_path / "log", env={"TORCHLOOM_CACHE": str(tmp_path / "cache")})
    try:
        want = {"name": "topics", "version": "2", "aliases": ["champion"], "uri": "models:/topics/2"}
        assert s.client.get("/v1/labels").json()["model"] == want
        r = s.client.post("/v1/predict", json={"texts": ["match goal team"]})
        assert r.status_code == 200 and r.json()["model"] == {**want, "variant": "topics"}, r.text
        assert s.client.get("/readyz").json()["model"] == want
        metrics = s.client.get("/metrics").text
        assert 'torchloom_monitor_state{model="topics",version="2",state="off"} 1' in metrics, metrics[-2000:]
        assert "topics" in s.client.get("/").text and "artifacts" not in s.client.get("/").text
        assert "ready: topics 2" in s.stderr()
        made = run("monitor", "rules", "--output", str(tmp_path / "rules"), "--for", "0s")
        assert made.returncode == 0, made.stderr
        prometheus = Prometheus(s.url.split("://", 1)[1], tmp_path / "rules" / "torchloom-rules.yml", tmp_path)
        try:
            prometheus.wait(lambda: prometheus.alert_state("TorchloomMonitorOff") == "firing", 30, "never fired")
            (alert,) = [a["labels"] for a in prometheus.client.get("/api/v1/alerts").json()["data"]["alerts"]
                        if a["labels"]["alertname"] == "TorchloomMonitorOff"]
            assert (alert["model"], alert["version"]) == ("topics", "2"), alert
        finally:
            prometheus.stop()
        admin = {"Authorization": "Bearer registry-admin-4567"}
        r = s.client.put("/v1/admin/models/older", json={"path": "models:/topics/1"}, headers=admin)
        assert r.status_code == 200, r.text
        models = s.client.get("/v1/admin", headers=admin).json()["models"]
        assert (models["older"]["version"], models["older"]["source"]) == ("1", "models:/topics/1"), models
        assert models["topics"]["source"] == "models:/topics/2", models
        from torchloom.loop.controller import readable
        from torchloom.model.export import is_exported

        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "loop-cache"))  # the loop's own host
        here = readable("/a/serve/pod/cache/entry", models["topics"]["source"])
        assert here.startswith(str(tmp_path / "loop-cache")) and is_exported(here), here
        assert readable(models["topics"]["path"], "models:/topics/2") == models["topics"]["path"]  # seen here
    finally:
        assert s.terminate() == 0, s.stderr()[-3000:]


def test_a_read_by_name_where_no_registry_is_creates_no_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = torchloom("predict", "--model", "models:/reviews@champion", "a text", cache=tmp_path / "cache")
    assert done.returncode == 2 and "no registry at sqlite:///" in done.stderr, done.stderr
    assert not (tmp_path / "mlflow.db").exists()
