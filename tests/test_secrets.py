"""Secrets stay out of everything torchloom writes: redaction.py's rules, and a real run with a secret planted in
each place a user puts one (a tracking URI's user:password@, a study database URL, a Spark conf key), grepped
for in every file of the run dir, the MLflow server's store and artifacts, and the captured output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support.command import torchloom

from torchloom.model.tiny import write_tiny_model
from torchloom.redaction import MASK, is_secret_name, redact_config, redact_text

pytestmark = pytest.mark.heavy(8)  # see tests/support/schedule.py

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
SECRETS = {"tracking": "PLANTED-tracking-pw", "storage": "PLANTED-study-pw", "spark": "PLANTED-s3a-secret"}


@pytest.mark.parametrize("name", ["spark.hadoop.fs.s3a.secret.key", "spark.hadoop.fs.s3a.session.token", "api_key",
                                  "X-Amz-Signature", "fs.azure.account.key.acct.blob.core.windows.net", "password",
                                  "sessionToken", "MLFLOW_TRACKING_PASSWORD", "client_secret", "sas_token"])
def test_secret_names_are_masked(name):
    assert is_secret_name(name)
    assert redact_config({"s": {name: "hunter2"}}) == {"s": {name: MASK}}
    assert "hunter2" not in redact_text(f"failed with {name}=hunter2, retrying")


@pytest.mark.parametrize("name", ["max_batch_tokens", "tokenizer", "author", "text_column", "key", "keep_last",
                                  "spark.executor.memory", "monkey"])
def test_ordinary_names_are_kept(name):
    assert not is_secret_name(name)
    assert redact_config({"s": {name: "value"}}) == {"s": {name: "value"}}


@pytest.mark.parametrize("line", ["--require-api-key: no API key is set (--host 0.0.0.0); pass --api-key KEY",
                                  "--api-key: use at least 8 characters without surrounding spaces",
                                  "prepare.spark_conf spark.hadoop.fs.s3a.secret.key: Spark did not start"])
def test_an_error_line_that_names_a_secret_setting_keeps_its_words(line):
    from torchloom.errors import one_line

    assert one_line(line) == line  # `input: problem; fix` is not a `key: value` to mask


def test_uri_userinfo_is_stripped_wherever_it_appears():
    line = "tracking.uri http://alice:pw1@mlflow:5000: refused; tune.storage postgresql://bob:pw2@db/optuna failed"
    out = redact_text(line)
    assert "pw1" not in out and "pw2" not in out and "alice" not in out
    assert "http://***@mlflow:5000" in out and "postgresql://***@db/optuna" in out
    # presigned URLs: the signature's value goes, the rest of the address stays
    url = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F&X-Amz-Signature=abcdef&X-Amz-Expires=60"
    assert "abcdef" not in redact_text(url) and "X-Amz-Expires=60" in redact_text(url)
    # a config walk judges each dict entry by its own key, lists by their owner's, and leaves the input alone
    cfg = {"tune": {"storage": "postgresql://u:pw3@db/x", "space": {"train.lr": "loguniform(1e-5, 3e-4)"}}}
    assert redact_config(cfg)["tune"] == {"storage": "postgresql://***@db/x",
                                         "space": {"train.lr": "loguniform(1e-5, 3e-4)"}}
    assert cfg["tune"]["storage"] == "postgresql://u:pw3@db/x"


def test_a_study_database_password_reaches_workers_through_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("optuna")
    from torchloom.engines.worker import worker_env
    from torchloom.redaction import TUNE_STORAGE_ENV
    from torchloom.tune.pruning import hook_storage, make_storage

    monkeypatch.delenv(TUNE_STORAGE_ENV, raising=False)
    plain = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert hook_storage(plain) == plain and TUNE_STORAGE_ENV not in os.environ
    assert hook_storage("postgresql://u:pw4@db/optuna") == f"env:{TUNE_STORAGE_ENV}"  # what hooks.json holds
    assert worker_env()[TUNE_STORAGE_ENV] == "postgresql://u:pw4@db/optuna"  # what every engine forwards
    monkeypatch.setenv(TUNE_STORAGE_ENV, plain)
    assert make_storage(f"env:{TUNE_STORAGE_ENV}") is not None  # a worker opens the study from there


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on 127.0.0.1 with its own store and proxied artifacts."""
    from support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow-server")
    try:
        yield server.port, tmp_path / "mlflow-server"
    finally:
        server.stop()


def _files_holding(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {n}" for n in needles if n.encode() in data]
    return hits


def test_no_secret_reaches_a_file_a_param_or_a_line(tmp_path, mlflow_server, topics_csv):
    port, store = mlflow_server
    tiny = write_tiny_model(tmp_path / "tiny")
    rd = tmp_path / "run"
    proc = torchloom(
        "run", "--data.path", str(topics_csv), "--model.path", tiny,
        "--output.dir", str(rd), "--prepare.spark_master", "local[2]", "--train.epochs", "1",
        "--engine.workers", "1", "--tracking.uri", f"http://alice:{SECRETS['tracking']}@127.0.0.1:{port}",
        "--tune.storage", f"postgresql://bob:{SECRETS['storage']}@127.0.0.1:1/optuna",
        "--prepare.spark_conf", f'{{"spark.hadoop.fs.s3a.secret.key" = "{SECRETS["spark"]}"}}', timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    needles = list(SECRETS.values())
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if any(n in line for n in needles)]
    assert not _files_holding(rd, needles)
    assert not _files_holding(store, needles)  # the params, tags and every logged artifact
    config = (rd / "config.toml").read_text()
    assert f"http://{MASK}@127.0.0.1:{port}" in config and '"spark.hadoop.fs.s3a.secret.key" = "***"' in config
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
    run = client.search_runs([client.get_experiment_by_name("torchloom").experiment_id])[0]
    assert run.data.params["tune.storage"] == f"postgresql://{MASK}@127.0.0.1:1/optuna"
    assert run.data.metrics["test_accuracy"] >= 0  # the run was logged through the URI with the password


def test_a_tune_with_an_unreachable_study_database_says_so_without_its_password(tmp_path, topics_csv):
    pytest.importorskip("optuna")
    tiny = write_tiny_model(tmp_path / "tiny")
    proc = torchloom(
        "tune", "--data.path", str(topics_csv), "--model.path", tiny,
        "--output.dir", str(tmp_path / "study"), "--tune.backend", "optuna", "--tracking.enabled", "false",
        "--tune.storage", f"postgresql://bob:{SECRETS['storage']}@127.0.0.1:1/optuna", timeout=300)
    assert proc.returncode != 0
    assert SECRETS["storage"] not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("torchloom: error: tune.storage postgresql://***@127.0.0.1:1/optuna:"), last
    assert not _files_holding(tmp_path / "study", [SECRETS["storage"]])


@pytest.mark.parametrize("text, masked", [
    ("postgresql://alice:Zq3/xK9+mW2=@127.0.0.1:5432/optuna", "postgresql://***@127.0.0.1:5432/optuna"),
    ("s3://KEY:ab/cd@bkt/m", "s3://***@bkt/m"),
    ("failed: 'postgresql://u:x\"y'z@h/db' refused", "failed: 'postgresql://***@h/db' refused"),
    ("see postgresql://a:p@ss@h:1/db now", "see postgresql://***@h:1/db now"),
    ("s3://bucket/data/user@example.com/f.csv", "s3://bucket/data/user@example.com/f.csv"),  # an @ in the path
    ("http://127.0.0.1:8000/ mail admin@example.com", "http://127.0.0.1:8000/ mail admin@example.com"),
    ("abfs://runs@acct.dfs.core.windows.net/x", "abfs://runs@acct.dfs.core.windows.net/x"),  # a container
])
def test_userinfo_is_found_as_url_parsers_find_it(text, masked):
    """The password runs to the `@` before the host, whatever it holds but whitespace (a base64 one's `/+=`)."""
    assert redact_text(text) == masked


def test_a_password_seen_in_a_config_is_masked_by_value_in_every_file_and_line(tmp_path, capsys):
    from torchloom.config import build
    from torchloom.jsonio import write_atomic
    from torchloom.redaction import MaskingStream

    build(None, ["--tune.storage", "postgresql://bob:Gh7/kk+Qw3=x@db:5432/optuna"])
    write_atomic(tmp_path / "f.txt", "the server said: password Gh7/kk+Qw3=x is wrong (Gh7%2Fkk%2BQw3%3Dx)")
    assert (tmp_path / "f.txt").read_text() == "the server said: password *** is wrong (***)"
    MaskingStream(sys.stderr).write("a library printed Gh7/kk+Qw3=x\n")
    assert "Gh7/kk+Qw3=x" not in capsys.readouterr().err
    build(None, ["--tune.storage", "postgresql://bob:password@db:5432/optuna"])  # letters alone: by the URL rule
    assert redact_text("password too short") == "password too short"
