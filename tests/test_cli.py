"""The command line as a user runs it: subprocesses, real Spark, real DDP workers, a tiny model."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.command import torchloom

from torchloom.model.tiny import write_tiny_model

pytestmark = pytest.mark.heavy(1)  # see tests/support/schedule.py

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def reviews_csv(tmp_path_factory):
    """Three topics a tiny model can learn from their words, 40 rows each, plus two unusable rows."""
    path = tmp_path_factory.mktemp("csv") / "reviews.csv"
    words = {"sport": "match goal team win league", "money": "bank market price shares profit",
             "music": "album song band concert guitar"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "body", "topic"])
        for label, vocab in words.items():
            for i in range(40):
                w.writerow([f"{label}{i}", f"{vocab} number {i} " + " ".join(reversed(vocab.split())), label])
        w.writerow(["x1", "", "sport"])
        w.writerow(["x2", "a text without a label", ""])
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny, reviews_csv):
    rd = tmp_path_factory.mktemp("runs") / "reviews"
    store = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    proc = torchloom(
        "run", "--data.path", str(reviews_csv), "--data.text_column", "body", "--data.label_column", "topic",
        "--model.path", tiny, "--output.dir", str(rd), "--prepare.spark_master", "local[2]",
        "--train.epochs", "3", "--train.batch_size", "8", "--train.lr", "3e-3",
        "--train.log_every", "2", "--tracking.uri", store, "--tracking.experiment", "cli-tests",
        # train.precision auto, on a CPU told to answer "no native bf16" (an AVX2-only machine's answer)
        env={"TORCHLOOM_CPU_BF16": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return rd, proc


def test_run_writes_every_output_and_a_summary(finished_run):
    rd, proc = finished_run
    # no foreign lines: the JVM's incubator-module warning, torch's SIGTERM notes
    assert "Using incubator modules" not in proc.stderr and "via signal SIGTERM" not in proc.stderr
    summary = json.loads((rd / "summary.json").read_text())
    for stage in ("prepare_s", "train_s", "export_s", "evaluate_s", "total_s"):
        assert summary["timings"][stage] > 0
    assert "test accuracy" in proc.stdout and str(rd / "model") in proc.stdout
    for name in ("config.toml", "metrics.jsonl", "report.md", "report.json", "misclassified.jsonl",
                 "plots/confusion.png", "plots/calibration.png", "plots/loss.png", "model/config.json",
                 "model/model.safetensors", "data/manifest.json"):
        assert (rd / name).is_file(), name
    manifest = json.loads((rd / "data" / "manifest.json").read_text())
    assert manifest["labels"] == ["money", "music", "sport"]
    assert sum(manifest["counts"]["rows_rejected"].values()) == 2
    report = json.loads((rd / "report.json").read_text())
    # the words give the topic away: even the tiny model must learn it
    assert report["metrics"]["accuracy"] >= 0.9, report["metrics"]["accuracy"]
    assert summary["accuracy"] == report["metrics"]["accuracy"]
    # the classical baseline, on the same test rows, beside the transformer everywhere
    baseline = report["baseline"]
    assert baseline["split"] == "test" and baseline["n"] == report["metrics"]["n"]
    assert baseline["name"] == "TF-IDF + logistic regression" and 0 <= baseline["accuracy"] <= 1
    assert baseline["accuracy_gain"] == pytest.approx(report["metrics"]["accuracy"] - baseline["accuracy"])
    assert summary["baseline"]["accuracy"] == baseline["accuracy"] and summary["timings"]["baseline_s"] > 0
    stored = json.loads((rd / "baseline.json").read_text())
    assert stored["fingerprint"] == manifest["fingerprint"]
    assert stored["train_rows"] == manifest["splits"]["train"]["rows"]
    assert "## Against a classical baseline" in (rd / "report.md").read_text()
    assert f"baseline {baseline['accuracy']:.4f}" in proc.stdout
    # the verdict: in the summary when the transformer did not win, and said once
    if baseline["accuracy_gain"] <= 0:
        assert summary["verdict"] and proc.stdout.count(summary["verdict"]) == 1, proc.stdout
        assert summary["verdict"] not in proc.stderr
    else:
        assert summary["verdict"] is None
    assert "netlib" not in proc.stderr and "Broadcasting large task binary" not in proc.stderr


def test_run_says_what_precision_auto_chose_and_where_the_start_up_time_went(finished_run):
    rd, proc = finished_run
    summary = json.loads((rd / "summary.json").read_text())
    assert summary["precision"] == "fp32" and summary["precision_reason"] == "auto: this CPU has no native bf16"
    assert "precision fp32 (auto: this CPU has no native bf16)" in proc.stdout
    assert "emulates" not in proc.stderr  # auto never warns of its own choice
    assert json.loads((rd / "train_result.json").read_text())["precision"] == "fp32"
    # the start-up account: every phase before the first step, in the summary and in metrics.jsonl
    startup = summary["startup"]
    for phase in ("spark_start_s", "read_clean_s", "tokenize_s", "baseline_s", "worker_launch_s",
                  "process_group_s", "model_load_s", "data_s", "first_batch_s", "first_step_s"):
        assert startup[phase] >= 0, phase
    assert 0 < startup["first_step_after_s"] < summary["timings"]["total_s"]
    assert "start-up Spark start" in proc.stdout and "first step" in proc.stdout
    records = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    sides = [r for r in records if r["kind"] == "startup"]
    assert {"spark_start_s", "baseline_s"} <= set(sides[0]) and sides[0]["side"] == "driver"
    assert {"worker_launch_s", "model_load_s", "first_step_s"} <= set(sides[1])
    config = tomllib.loads((rd / "config.toml").read_text())
    assert config["train"]["precision"] == "auto" and config["engine"]["workers"] == 2  # counted, then saved


def test_evaluate_reuses_the_runs_baseline_and_can_leave_it_out(finished_run, tmp_path):
    import shutil

    rd = tmp_path / "copy"
    shutil.copytree(finished_run[0], rd)
    stored = json.loads((rd / "baseline.json").read_text())
    proc = torchloom("evaluate", "--output.dir", str(rd), "--eval.split", "val", "--tracking.enabled", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline: TF-IDF" not in proc.stderr  # scored at run time on val too, for these prepared rows
    report = json.loads((rd / "report.json").read_text())
    assert report["baseline"]["split"] == "val"
    assert report["baseline"]["accuracy"] == stored["splits"]["val"]["accuracy"]
    proc = torchloom("evaluate", "--output.dir", str(rd), "--eval.baseline", "false", "--tracking.enabled", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "baseline" not in json.loads((rd / "report.json").read_text())
    assert "Against a classical baseline" not in (rd / "report.md").read_text()


def test_run_is_one_mlflow_run_with_config_metrics_artifacts_and_a_servable_model(finished_run):
    mlflow = pytest.importorskip("mlflow")
    import pandas as pd
    from mlflow import MlflowClient

    from torchloom.model.predict import Predictor

    rd, proc = finished_run
    summary = json.loads((rd / "summary.json").read_text())
    uri = tomllib.loads((rd / "config.toml").read_text())["tracking"]["uri"]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("cli-tests")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, "one MLflow run per job, not one per rank"
    run = runs[0]
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert f"mlflow  run {run.info.run_id}" in proc.stdout
    assert run.data.params["train.lr"] == "0.003" and run.data.params["engine.workers"] == "2"
    tags = run.data.tags
    assert tags["engine"] == "local" and tags["world_size"] == "2" and tags["torchloom.version"]
    manifest = json.loads((rd / "data" / "manifest.json").read_text())
    assert tags["data_fingerprint"] == manifest["fingerprint"]
    # Per-step metrics come from rank 0 alone: one point per logged step, none twice.
    logged = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in logged if r["kind"] == "train"]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == train_steps and len(train_steps) > 3
    evals = {r["step"]: r["macro_f1"] for r in logged if r["kind"] == "eval"}
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_macro_f1")} == evals
    assert run.data.metrics["baseline_test_accuracy"] == summary["baseline"]["accuracy"]
    assert run.data.metrics["test_accuracy"] == summary["accuracy"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.toml", "metrics.jsonl", "manifest.json", "report.md", "report.json", "plots",
            "model"} <= artifacts
    # The logged model is an MLflow pyfunc model giving what torchloom's own predictor gives.
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = ENV["MLFLOW_TRACKING_URI"]
    texts = ["bank shares profit market price", "guitar band song album concert", "match goal team"]
    out = model.predict(pd.DataFrame({"text": texts}))
    expected = Predictor(str(rd / "model")).predict(texts)
    assert list(out["label"]) == [e["label"] for e in expected]
    assert all(abs(a - e["score"]) < 1e-5 for a, e in zip(out["score"], expected))


def test_predict_cli_uses_the_exported_model(finished_run, tmp_path):
    rd, _ = finished_run
    proc = torchloom("predict", "--model", str(rd / "model"), "bank shares profit market price",
                     "guitar band song album concert")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["label"] for x in lines] == ["money", "music"]
    assert all(abs(sum(x["probabilities"].values()) - 1) < 1e-4 for x in lines)
    src = tmp_path / "in.txt"
    src.write_text("match goal team win league\n")
    proc = torchloom("predict", str(rd), "--input", str(src))  # the run directory: its exported model, said so
    assert proc.returncode == 0 and json.loads(proc.stdout)["label"] == "sport", proc.stderr[-2000:]
    assert f"a run directory; using its exported model, {rd / 'model'}" in proc.stderr


def test_train_resume_latest_continues_to_more_epochs(finished_run, tiny):
    rd, _ = finished_run
    before = json.loads((rd / "train_result.json").read_text())["steps"]
    with open(rd / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 99')  # a last line cut short (a full disk, a killed writer)
    proc = torchloom("train", "--output.dir", str(rd), "--model.path", tiny, "--resume", "--train.epochs", "4",
                     "--train.batch_size", "8", "--train.lr", "3e-3", "--train.precision", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped a line that is not whole JSON" in proc.stderr and "Traceback" not in proc.stderr
    after = json.loads((rd / "train_result.json").read_text())
    assert after["resumed_from"].endswith(f"step-{before}")
    assert after["steps"] == before // 3 * 4


def test_a_fresh_train_in_a_trained_run_removes_the_earlier_checkpoints(finished_run, tiny, tmp_path):
    """Only with --overwrite (a retried job that forgets --resume loses nothing); then export must not pick the
    earlier training's (higher-numbered) checkpoints."""
    rd, _ = finished_run
    run = tmp_path / "again"
    shutil.copytree(rd, run)
    earlier = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    args = ["train", "--output.dir", str(run), "--train.max_steps", "2",  # the run's own model
            "--train.batch_size", "8", "--train.precision", "fp32", "--engine.workers", "1", "--tracking.enabled",
            "false"]
    refused = torchloom(*args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"holds {len(earlier)} checkpoint(s) of an earlier training" in refused.stderr
    assert "pass --resume to go on from the latest, or --overwrite to train afresh" in refused.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == earlier
    # a file of someone else's among them: --overwrite is refused too, before anything starts
    (run / "checkpoints" / "mine.ckpt").write_bytes(b"w")
    refused = torchloom(*args, "--overwrite")
    assert refused.returncode == 2 and "it holds checkpoints/mine.ckpt, which torchloom did not" in refused.stderr
    (run / "checkpoints" / "mine.ckpt").unlink()
    proc = torchloom(*args, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr + "".join(p.read_text() for p in (run / "logs").rglob("*") if p.is_file())
    assert f"the {len(earlier)} checkpoint(s) of the earlier training" in said, said[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-2"]
    record = json.loads((run / "torchloom-run.json").read_text())
    assert record["id"] != json.loads((rd / "torchloom-run.json").read_text())["id"]


def test_a_real_run_s_ledger_lists_every_file_it_wrote(finished_run, tmp_path):
    """The ledger of a real `run` (every stage) vouches for each file in it: --overwrite may replace it whole; a base
    model kept in model/ is never exported over."""
    from torchloom.errors import UserError
    from torchloom.runs.ledger import LEDGER_FILE, LocalTree, deletable
    from torchloom.runs.runfiles import RunFiles

    rd, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(rd, run)  # sizes and modification times kept, as a copy of a run would
    every = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file() and p != run / LEDGER_FILE)
    assert deletable(LocalTree(run), "output.dir") == every
    (run / "model" / "vocab-notes.txt").write_text("mine")
    exported = torchloom("export", "--output.dir", str(run))
    assert exported.returncode == 2 and "it holds model/vocab-notes.txt, which torchloom did not" in exported.stderr
    with pytest.raises(UserError, match="nothing deleted: it holds model/vocab-notes.txt"):
        RunFiles(run).place.replace()
    (run / "model" / "vocab-notes.txt").unlink()
    RunFiles(run).place.replace()
    assert [p.name for p in run.iterdir()] == [LEDGER_FILE]


def test_run_resume_follows_the_recorded_model_as_train_resume_does(finished_run, tiny, tmp_path):
    """Was: `run --resume` without --model.path rewrote config.toml with the default model before a worker failed,
    after which export and train --resume refused the right model."""
    from torchloom.cli.recorded import follow
    from torchloom.config import build
    from torchloom.runs.runfiles import RunFiles

    rd, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(rd, run)
    cfg = follow(build(None, ["--output.dir", str(run), "--train.resume", "latest"]), "run", set(), RunFiles(run))
    assert cfg.model.path == tiny and cfg.train.batch_size == 8  # the recorded model and training settings
    fresh = follow(build(None, ["--output.dir", str(run)]), "run", set(), RunFiles(run))
    assert fresh.model.path == ""  # a fresh run (which --overwrite must allow) takes what it is given
    config = (run / "config.toml").read_bytes()
    other = write_tiny_model(tmp_path / "other")
    refused = torchloom("run", "--output.dir", str(run), "--resume", "--model.path", other)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "trained from model.path" in refused.stderr and "leave --model.path out" in refused.stderr
    assert (run / "config.toml").read_bytes() == config


def test_a_stage_run_on_its_own_follows_what_the_run_recorded(finished_run, tiny, tmp_path):
    """The run trained a tiny model of its own (--model.path): export, evaluate and train --resume with no flags use
    it and the run's training settings; a --model.path that contradicts the run is one line."""
    rd, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(rd, run)
    shutil.rmtree(run / "model")
    exported = torchloom("export", "--output.dir", str(run))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"export: model.path {tiny}, as the run in {run} recorded" in exported.stderr
    evaluated = torchloom("evaluate", "--output.dir", str(run), "--tracking.enabled", "false")
    assert evaluated.returncode == 0 and json.loads((run / "report.json").read_text())["metrics"]["accuracy"] >= 0.9
    other = write_tiny_model(tmp_path / "other")
    refused = torchloom("export", "--output.dir", str(run), "--model.path", other)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "trained from model.path" in refused.stderr and "leave --model.path out" in refused.stderr
    again = torchloom("prepare", "--output.dir", str(run), "--overwrite", "--data.path", str(run / "config.toml"))
    assert again.returncode == 2 and "holds checkpoints trained on the data that prepare would replace" \
        in again.stderr, again.stderr[-2000:]  # a second prepare into a trained run: one line, nothing touched
    before = json.loads((run / "train_result.json").read_text())
    resumed = torchloom("train", "--output.dir", str(run), "--resume", "--tracking.enabled", "false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads((run / "train_result.json").read_text())
    # the recorded batch size and epochs: the same schedule, so the finished run has no step left
    assert after["resumed_from"].endswith(f"step-{before['steps']}") and after["total_steps"] == before["total_steps"]


def test_a_train_whose_launch_fails_before_any_worker_starts_leaves_the_run_as_it_was(finished_run, tiny,
                                                                                        tmp_path, monkeypatch):
    from torchloom.config import build
    from torchloom.stages import train

    rd, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(rd, run)
    before = {name: (run / name).read_bytes() for name in ("config.toml", "metrics.jsonl")}
    cfg = build(None, ["--output.dir", str(run), "--model.path", tiny, "--train.lr", "0.5", "--engine.workers", "1",
                       "--train.batch_size", "8", "--output.overwrite", "true"])

    def unreachable(*args, **kwargs):
        raise RuntimeError("the cluster did not answer")

    monkeypatch.setattr(train, "launch", unreachable)
    with pytest.raises(RuntimeError, match="did not answer"):
        train.train_stage(cfg, quiet=True)
    assert {name: (run / name).read_bytes() for name in before} == before  # the history and the record of it

    def started_then_failed(run, quiet):
        (run.rd.logs / "placement-x-rank0-start0.json").write_text("{}")  # a rank recorded its start
        raise RuntimeError("rank 0 failed")

    monkeypatch.setattr(train, "launch", started_then_failed)
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        train.train_stage(cfg, quiet=True)
    assert (run / "config.toml").read_bytes() != before["config.toml"]  # what ran is what the run says ran


@pytest.mark.parametrize("args, needle", [
    (["config", "--train.lr", "0"], "train.lr"),
    (["config", "--train.batch_size", "-4"], "train.batch_size"),
    (["config", "--engine.name", "mesos"], "engine.name"),
    (["config", "--train.nope", "1"], "train.nope"),
    (["config", "--train.epochs", "two"], "train.epochs"),
    (["prepare", "--data.path", "/no/such/file.csv", "--output.dir", "/tmp/torchloom-never"], "/no/such/file.csv"),
    (["train", "--output.dir", "/no/such/run"], "/no/such/run"),
    (["predict", "--model", "/no/such/model", "text"], "/no/such/model"),
])
def test_user_errors_are_one_line_with_exit_2(args, needle):
    proc = torchloom(*args, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not Path("/tmp/torchloom-never").exists()


@pytest.mark.parametrize("args", [
    ["prepare", "--data.path", "/no/such/file.csv", "--output.dir", "/tmp/torchloom-never"],
    ["run", "--data.path", "/no/such/file.csv", "--output.dir", "/tmp/torchloom-never"],
    ["train", "--output.dir", "/no/such/run"],
    ["predict", "--model", "/no/such/model", "text"],
], ids=["prepare", "run", "train", "predict"])
def test_a_wrong_path_is_refused_before_spark_mlflow_or_torch_load(args):
    # a typo costs no JVM start-up, no MLflow store and no torch import (seconds each)
    code = ("import sys; from torchloom import cli; rc = cli.main(sys.argv[1:]);"
            " print(rc, sorted(m for m in ('torch', 'pyspark', 'mlflow', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.stdout.split() == ["2", "[]"], proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "/no/such/" in proc.stderr


# --- common mistakes: one line on stderr, exit 2, nothing written ------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny):
    """A tiny classifier as `torchloom export` writes it."""
    from torchloom.model.build import build_classifier
    from torchloom.model.export import export_model

    out = tmp_path_factory.mktemp("exported") / "model"
    return Path(export_model(build_classifier(tiny, ["money", "sport"]), tiny, ["money", "sport"], str(out)))


def _small_csv(tmp: Path) -> Path:
    path = tmp / "small.csv"
    path.write_text("text,label\n" + "".join(f"match goal {i},sport\nbank price {i},money\n" for i in range(10)))
    return path


def _cut_gzip(tmp: Path, whole_first: bool = False) -> Path:
    """A .csv.gz whose second half is missing (an interrupted copy); with whole_first, the pattern of a folder
    holding a whole .csv.gz and then that one (Spark's schema pass reads the whole one only)."""
    import gzip
    import random

    r = random.Random(7)
    text = "text,label\n" + "".join(f"{' '.join(str(r.random()) for _ in range(6))},sport\n" for _ in range(3000))
    data = gzip.compress(text.encode())
    folder = tmp / "parts"
    folder.mkdir()
    if whole_first:
        (folder / "a.csv.gz").write_bytes(data)
    path = folder / "cut.csv.gz"
    path.write_bytes(data[:len(data) // 2])
    return folder / "*.csv.gz" if whole_first else path


def _parquet_folder_one_damaged(tmp: Path) -> Path:
    """Two Parquet files of texts; the second lost its middle (its footer says more than the file holds)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp / "texts"
    folder.mkdir()
    table = pa.table({"text": [f"match goal {i}" for i in range(2000)]})
    pq.write_table(table, folder / "a.parquet")
    pq.write_table(table, folder / "b.parquet")
    data = (folder / "b.parquet").read_bytes()
    (folder / "b.parquet").write_bytes(data[:len(data) // 3] + data[-len(data) // 3:])
    return folder


def _texts_csv(tmp: Path) -> Path:
    path = tmp / "texts.csv"
    path.write_text("id,text\n" + "".join(f"{i},match goal {i}\n" for i in range(10)))
    return path


def _truncated(tmp: Path, exported: Path) -> Path:
    import shutil

    model = tmp / "model"
    shutil.copytree(exported, model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # an interrupted copy
    return model


def _file_in(tmp: Path) -> Path:
    (tmp / "a-file").write_text("not a directory\n")
    return tmp / "a-file"


def _prepare(tmp: Path, tiny: str, *more: str) -> list[str]:
    return ["prepare", "--data.path", str(_small_csv(tmp)), "--model.path", tiny, "--output.dir", str(tmp / "run"),
            "--prepare.spark_master", "local[1]", *more]


def _spark_engine_on_one_slot(tmp: Path, request) -> list[str]:
    import shutil

    run = tmp / "run"
    shutil.copytree(request.getfixturevalue("finished_run")[0], run)
    return ["train", "--output.dir", str(run), "--model.path", request.getfixturevalue("tiny"), "--engine.name",
            "spark", "--engine.workers", "2", "--prepare.spark_master", "local-cluster[1,1,1024]", "--overwrite"]


# case: (args, extra environment, what the error line says: a string or several); each gets a fresh tmp dir
MISTAKES = {
    "spark_conf_the_jvm_refuses": lambda tmp, rq: (
        _prepare(tmp, rq.getfixturevalue("tiny"), "--prepare.spark_conf", '{"spark.driver.memory" = "lots"}'),
        {}, "prepare.spark_conf spark.driver.memory: Spark did not start (Invalid maximum heap size"),
    "spark_conf_spark_refuses": lambda tmp, rq: (
        _prepare(tmp, rq.getfixturevalue("tiny"), "--prepare.spark_conf", '{"spark.driver.maxResultSize" = "lots"}'),
        {}, "prepare.spark_conf spark.driver.maxResultSize: Spark did not start"),
    "spark_sql_conf_spark_refuses": lambda tmp, rq: (
        _prepare(tmp, rq.getfixturevalue("tiny"), "--prepare.spark_conf", '{"spark.sql.shuffle.partitions" = "x"}'),
        {}, "prepare.spark_conf spark.sql.shuffle.partitions: Spark did not start"),
    "java_home_without_java": lambda tmp, rq: (
        _prepare(tmp, rq.getfixturevalue("tiny")), {"JAVA_HOME": "/nonexistent"},
        "JAVA_HOME /nonexistent: no bin/java"),
    "no_java_on_path": lambda tmp, rq: (
        _prepare(tmp, rq.getfixturevalue("tiny")), {"JAVA_HOME": "", "PATH": os.path.dirname(sys.executable)},
        "java: not found"),
    "prepare_output_dir_under_a_file": lambda tmp, rq: (
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--output.dir", str(_file_in(tmp) / "run")], {},
        ("output.dir ", "a-file/run: cannot be created, ", "a-file is a file, not a directory")),
    "run_output_dir_under_a_file": lambda tmp, rq: (
        ["run", "--data.path", str(_small_csv(tmp)), "--output.dir", str(_file_in(tmp) / "run")], {},
        "output.dir"),
    "run_output_dir_is_a_file": lambda tmp, rq: (
        ["run", "--data.path", str(_small_csv(tmp)), "--output.dir", str(_file_in(tmp))], {},
        "is a file, not a directory"),
    "train_output_dir_under_a_file": lambda tmp, rq: (
        ["train", "--output.dir", str(_file_in(tmp) / "run")], {}, "output.dir"),
    "prepare_output_dir_read_only": lambda tmp, rq: (
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--output.dir", str(_read_only(tmp) / "run")], {},
        "is not writable"),
    "predict_with_truncated_weights": lambda tmp, rq: (
        ["predict", str(_truncated(tmp, rq.getfixturevalue("exported"))), "some text"], {},
        "model.safetensors is truncated or corrupt (SafetensorError"),
    "serve_with_truncated_weights": lambda tmp, rq: (
        ["serve", str(_truncated(tmp, rq.getfixturevalue("exported"))), "--port", "0"], {},
        "model.safetensors is truncated or corrupt"),
    "unreachable_spark_connect_server": lambda tmp, rq: (
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--prepare.spark_master", "sc://127.0.0.1:1"], {},
        "prepare.spark_master sc://127.0.0.1:1: no Spark Connect server answered"),
    "no_file_system_for_the_scheme": lambda tmp, rq: (
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--data.path", "foo:/bucket/reviews.csv"], {},
        "data.path foo:/bucket/reviews.csv: this Spark has no file system for foo://"),
    "input_gzip_cut_short": lambda tmp, rq: (  # no Spark task's stack trace before the line either
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--data.path", str(_cut_gzip(tmp))], {},
        ("data.path ", "cut.csv.gz: Spark cannot read file:/", "cut.csv.gz (EOFException: Unexpected end of input",
         "replace that file")),
    "input_gzip_cut_short_after_a_whole_one": lambda tmp, rq: (  # it fails in prepare's first pass, not in read's
        [*_prepare(tmp, rq.getfixturevalue("tiny")), "--data.path", str(_cut_gzip(tmp, whole_first=True))], {},
        ("data.path ", "*.csv.gz: Spark cannot read file:", "parts/cut.csv.gz (EOFException: Unexpected end of input")),
    "more_workers_than_barrier_slots": lambda tmp, rq: (
        _spark_engine_on_one_slot(tmp, rq), {}, "engine.workers 2: Spark (local-cluster[1,1,1024]) has 1 barrier slot"),
    "spark_scoring_output_under_a_file": lambda tmp, rq: (
        ["predict", str(rq.getfixturevalue("exported")), "--input", str(_texts_csv(tmp)), "--output",
         str(_file_in(tmp) / "out"), "--score-with", "spark", "--spark-master", "local[1]"], {},
        ("--output ", "a-file/out: Spark cannot write there (ParentNotDirect")),
    "spark_scoring_input_file_damaged": lambda tmp, rq: (
        ["predict", str(rq.getfixturevalue("exported")), "--input", str(_parquet_folder_one_damaged(tmp)),
         "--output", str(tmp / "out"), "--score-with", "spark", "--spark-master", "local[1]"], {},
        ("--input ", "texts: Spark cannot read file:", "texts/b.parquet (", "replace that file")),
    "local_scoring_output_under_a_file": lambda tmp, rq: (
        ["predict", str(rq.getfixturevalue("exported")), "--input", str(_texts_csv(tmp)), "--output",
         str(_file_in(tmp) / "out")], {}, ("--output ", "a-file/out: cannot write there (a part of its path")),
}


def _read_only(tmp: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes to a read-only directory")
    ro = tmp / "read-only"
    ro.mkdir(mode=0o555)
    return ro


def _paths(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# The mistakes a JVM's launch answers (its heap, its java): in a process of their own, whose JVM starts then (in
# this one pyspark keeps the JVM that started first).
JVM_LAUNCH = {"spark_conf_the_jvm_refuses", "java_home_without_java", "no_java_on_path"}


@pytest.mark.parametrize("case", MISTAKES)
def test_common_mistakes_are_one_line_with_exit_2_and_write_nothing(case, tmp_path, request):
    if case == "unreachable_spark_connect_server":
        pytest.importorskip("grpc")
    args, env, needle = MISTAKES[case](tmp_path, request)
    before = _paths(tmp_path)
    proc = torchloom(*args, env=env, timeout=240, process=case in JVM_LAUNCH)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("torchloom: error: ")]
    foreign = [line for line in lines if not line.startswith("torchloom: ")]  # the rest: progress lines
    assert len(errors) == 1 and not foreign, proc.stderr[-3000:]
    assert len(errors[0]) < 300 and all(n in errors[0] for n in ([needle] if isinstance(needle, str) else needle)), \
        errors[0]
    assert _paths(tmp_path) == before  # nothing half-written (a run dir, a temp dir, a Parquet part)


def test_predict_into_a_reader_that_stops_early_ends_quietly(exported, tmp_path):
    """`torchloom predict ... | head -1`: the Unix convention, no traceback and no message."""
    many = tmp_path / "many.txt"
    many.write_text("".join(f"match goal team number {i} and more words to make a long line\n" for i in range(3000)))
    err = tmp_path / "stderr.txt"
    shell = '"$0" -m torchloom predict --model "$1" --input "$2" 2>"$3" | head -1; exit "${PIPESTATUS[0]}"'
    proc = subprocess.run(["bash", "-c", shell, sys.executable, str(exported), str(many), str(err)],
                          capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode in (0, 141), err.read_text()
    assert err.read_text() == "" and len(proc.stdout.splitlines()) == 1, err.read_text()
    assert json.loads(proc.stdout)["label"] in ("money", "sport")


def test_config_prints_toml_that_loads_back(tmp_path):
    proc = torchloom("config", "--train.lr", "3e-5", "--engine.workers", "4")
    assert proc.returncode == 0
    path = tmp_path / "run.toml"
    path.write_text(proc.stdout)
    again = torchloom("config", "--config", str(path))
    assert again.stdout == proc.stdout and "lr = 3e-05" in proc.stdout and "workers = 4" in proc.stdout


def test_the_tracking_uri_is_one_flag_everywhere_with_the_other_spelling_as_its_alias(tmp_path):
    """export/run/train take --tracking-uri as serve, predict and monitor do; those take --tracking.uri too."""
    store = f"sqlite:///{tmp_path / 'm.db'}"
    for spelled in (["--tracking-uri", store], [f"--tracking-uri={store}"], ["--tracking.uri", store]):
        proc = torchloom("config", *spelled)
        assert proc.returncode == 0 and f'uri = "{store}"' in proc.stdout, (spelled, proc.stderr)
    for command in ("serve", "predict", "monitor"):
        assert "--tracking-uri URI, --tracking.uri URI" in torchloom(command, "--help").stdout, command


def test_every_config_key_has_one_meaning_and_docs_config_md_says_the_same():
    import dataclasses
    import re

    from torchloom.config.keys import MEANINGS
    from torchloom.config.schema import Config

    schema_keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
                   for f in dataclasses.fields(s.default_factory())}
    assert set(MEANINGS) == schema_keys
    docs, section = {}, None
    for line in (Path(__file__).parents[1] / "docs" / "config.md").read_text().splitlines():
        m = re.match(r"^## \[(\w+)\]", line)
        section = m.group(1) if m else (None if line.startswith("## ") else section)
        if section and line.startswith("| ") and not line.startswith(("| key", "|---")):
            keys, _default, meaning = line.strip().strip("|").split(" | ", 2)
            docs.update({f"{section}.{k.strip()}": meaning.strip() for k in keys.split(",")})
    assert docs == MEANINGS  # the tables in docs/config.md and the --help lines cannot drift apart


def test_help_lists_the_config_keys_of_the_command_with_defaults():
    def help_of(command: str) -> str:
        proc = torchloom(command, "--help", timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    train = help_of("train")
    assert "--train.lr 0.0001\n      peak learning rate" in train and '--engine.name "local"' in train
    assert "\n  --tune.trials" not in train
    prepare = help_of("prepare")
    assert "--prepare.max_length 128" in prepare and "--data.text_column" in prepare
    assert "\n  --engine.workers" not in prepare
    assert "--tune.trials 8" in help_of("tune")


def test_a_binary_file_named_csv_is_one_short_line(tmp_path):
    noise = tmp_path / "photo.csv"
    noise.write_bytes(bytes(range(256)) * 12 + os.urandom(2000))
    proc = torchloom("prepare", "--data.path", str(noise), "--output.dir", str(tmp_path / "run"),
                     "--prepare.spark_master", "local[1]", timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert len(errors) == 1 and len(errors[0]) < 300 and str(noise) in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Using incubator modules" not in proc.stderr


def test_a_spreadsheet_or_a_plain_text_file_as_input_says_what_to_give_instead(tmp_path):
    from torchloom.config.schema import DataConfig
    from torchloom.errors import UserError
    from torchloom.inputs.locate import resolve_format
    from torchloom.inputs.text_files import input_format
    from torchloom.model.predict import read_texts

    book = tmp_path / "reviews.xlsx"
    book.write_bytes(b"PK\x03\x04 a zip, as every workbook")
    (tmp_path / "lines.txt").write_text("a text\n")
    for call in (lambda: resolve_format(DataConfig(), str(book)), lambda: read_texts(str(book)),
                 lambda: input_format(str(book))):
        with pytest.raises(UserError, match=r"reviews.xlsx: it is a spreadsheet workbook, which torchloom does not"
                                            r" open; save the sheet as CSV UTF-8 \(Excel: File > Save As"):
            call()
    with pytest.raises(UserError, match=r"lines.txt: cannot tell the format from the name; a text file holds no"
                                        r" labels: give a CSV or JSON lines file with a text and a label column"):
        resolve_format(DataConfig(), str(tmp_path / "lines.txt"))


def test_a_missing_column_line_fills_in_the_columns_whose_names_say_what_they_hold():
    from torchloom.text.formats import column_fix

    both = {"data.text_column": "text", "data.label_column": "label"}
    assert column_fix(["id", "body", "topic"], both) == "set --data.text_column body --data.label_column topic"
    assert column_fix(["Review Text", "Rating", "Title"], both) == \
        "set --data.text_column 'Review Text' --data.label_column Rating"  # the first name that says text: review
    assert column_fix(["message", "x"], both) == "set --data.text_column message --data.label_column COLUMN"
    assert column_fix(["a", "b"], both) == "set --data.text_column / --data.label_column"
    assert column_fix(["comment", "Comment "], {"data.text_column": "text"}) == "set --data.text_column"  # two


def test_an_error_about_a_very_long_input_stays_one_short_line(tmp_path):
    deep = tmp_path / ("a-very-long-directory-name-" * 6) / ("nested-" * 20) / "reviews.csv"
    proc = torchloom("prepare", "--data.path", str(deep), "--output.dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) <= 300, lines
    assert lines[0].startswith("torchloom: error: data.path ") and "reviews.csv" in lines[0]


def test_evaluate_scores_what_serve_answers(finished_run):
    # eval.precision auto is fp32 on CPU, as `serve --precision auto`: the report's numbers are the served ones
    from torchloom.config import build
    from torchloom.data.texts import texts_at
    from torchloom.evaluate.mix import shipped_probabilities
    from torchloom.evaluate.run import score_split
    from torchloom.manifest import read as read_manifest
    from torchloom.model.served import ServedModel

    rd = finished_run[0]
    cfg = build(None, ["--output.dir", str(rd), "--engine.device", "cpu"])
    manifest = read_manifest(rd / "data")
    probs, _, index = score_split(cfg, str(rd / "model"), manifest)
    probs, _ = shipped_probabilities(str(rd / "model"), manifest, "test", probs, index)  # where it ships the mix
    texts = texts_at(manifest, "test", {int(i) for i in index})
    served = ServedModel(str(rd / "model"), device="cpu").predict([texts[int(i)] for i in index])
    assert len(served) == len(probs) > 0
    for row, answer in zip(probs, served):
        assert [answer["probabilities"][lb] for lb in manifest.labels] == pytest.approx(row.tolist(), abs=1e-5)


def test_a_baseline_that_fails_is_one_line_and_evaluate_goes_on(finished_run, tmp_path, monkeypatch, capsys):
    import shutil

    from torchloom import baseline
    from torchloom.config import build
    from torchloom.etl import session
    from torchloom.stages.evaluate import evaluate_stage

    rd = tmp_path / "copy"
    shutil.copytree(finished_run[0], rd)
    (rd / "baseline.json").unlink()

    def broken(*_args, **_kwargs):
        raise RuntimeError("MLlib went wrong\nat some.Java.Frame")

    monkeypatch.setattr(session, "get_spark", lambda *_: object())
    monkeypatch.setattr(baseline, "fit_and_score", broken)
    ev = evaluate_stage(build(None, ["--output.dir", str(rd), "--tracking.enabled", "false"]))
    assert ev["baseline"] is None and ev["metrics"]["n"] > 0
    err = capsys.readouterr().err
    # a small train split: scikit-learn on the driver, no SparkSession (get_spark above is never called)
    assert ("torchloom: baseline: skipped, scikit-learn on the driver failed (RuntimeError: MLlib went wrong);"
            " --eval.baseline false turns it off") in err
    assert "Java.Frame" not in err and "baseline" not in json.loads((rd / "report.json").read_text())


# --- ONNX exports: the gates, and predict, Spark batch, serve and evaluate through them ---------------------


@pytest.fixture(scope="module")
def onnx_run(finished_run, tiny, tmp_path_factory):
    """A copy of the finished run exported with --format onnx (kept aside) and then onnx-int8."""
    import shutil

    pytest.importorskip("onnxruntime")
    rd = tmp_path_factory.mktemp("onnx") / "run"
    shutil.copytree(finished_run[0], rd)
    fp32 = torchloom("export", "--output.dir", str(rd), "--model.path", tiny, "--format", "onnx", timeout=300)
    assert fp32.returncode == 0, fp32.stderr[-3000:]
    shutil.copytree(rd / "model", rd.parent / "fp32-model")
    int8 = torchloom("export", "--output.dir", str(rd), "--model.path", tiny, "--format", "onnx-int8", timeout=300)
    assert int8.returncode == 0, int8.stderr[-3000:]
    return rd, rd.parent / "fp32-model", fp32, int8


def test_onnx_exports_pass_their_gates_and_predict_answers_through_them(onnx_run):
    import numpy as np

    from torchloom.data.texts import texts_at
    from torchloom.manifest import read as read_manifest
    from torchloom.model.predict import Predictor

    rd, fp32_dir, fp32, int8 = onnx_run
    assert "fp32 gate passed on 12 test rows" in fp32.stderr and "int8 gate passed" in int8.stderr
    assert "Traceback" not in fp32.stderr + int8.stderr and "[torch.onnx]" not in fp32.stdout + fp32.stderr
    info = json.loads((fp32_dir / "torchloom.json").read_text())["onnx"]
    assert info["file"] == "model.onnx" and info["gate"]["fp32"]["max_abs_logit_diff"] <= 1e-3
    # a BERT's attention reaches ONNX Runtime as one fused op per layer (what makes ONNX faster than PyTorch)
    assert info["exporter"] == "torchscript" and info["opset"] == 17 and info["fused"].get("Attention", 0) >= 1
    assert "fused: " in fp32.stderr and " Attention" in fp32.stderr
    info = json.loads((rd / "model" / "torchloom.json").read_text())["onnx"]
    assert info["file"] == "model.int8.onnx" and info["files"] == ["model.onnx", "model.int8.onnx"]
    assert info["gate"]["int8"]["accuracy_loss"] <= 0.01 and (rd / "model" / "model.int8.onnx").is_file()

    manifest = read_manifest(rd / "data")
    texts = list(texts_at(manifest, "test", set(range(manifest.split("test").rows))).values())
    labels = manifest.labels

    def probs(predictor):
        return np.array([[p["probabilities"][lb] for lb in labels] for p in predictor.predict(texts)])

    torch_probs = probs(Predictor(str(fp32_dir)))
    fp32 = Predictor(str(fp32_dir), runtime="onnx")
    np.testing.assert_allclose(probs(fp32), torch_probs, atol=1e-5)
    one = fp32.predict([texts[0]])[0]  # a batch of one, and a one-token text: the graph's axes are dynamic
    assert [one["probabilities"][lb] for lb in labels] == pytest.approx(torch_probs[0].tolist(), abs=1e-5)
    assert fp32.predict([""])[0]["label"] == Predictor(str(fp32_dir)).predict([""])[0]["label"]
    int8_probs = probs(Predictor(str(rd / "model"), runtime="onnx"))
    assert np.mean(int8_probs.argmax(1) == torch_probs.argmax(1)) >= 0.9 and abs(int8_probs - torch_probs).max() > 0

    proc = torchloom("predict", "--model", str(rd / "model"), "--runtime", "onnx", *texts[:3], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    # int8 activations are quantized per batch: a text's answer moves a little with its batch-mates
    np.testing.assert_allclose([[a["probabilities"][lb] for lb in labels] for a in answers], int8_probs[:3],
                               atol=5e-3)

    # the gate's numbers reach the report
    proc = torchloom("evaluate", "--output.dir", str(rd), "--tracking.enabled", "false", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((rd / "report.json").read_text())
    assert report["onnx_export"]["file"] == "model.int8.onnx" and "int8 accuracy loss" in report["onnx_export"]
    assert "Onnx export" in (rd / "report.md").read_text()


def test_spark_batch_and_the_rest_server_answer_through_the_onnx_model(onnx_run, spark, tmp_path):
    import numpy as np
    import pyarrow.dataset as ds
    from test_serve import Server, httpx

    from torchloom.batch.spark import predict_spark
    from torchloom.model.predict import Predictor

    rd, fp32_dir = onnx_run[0], onnx_run[1]
    texts = ["match goal team win", "bank market price", "album song band", "a text about nothing much " * 30]
    expected = Predictor(str(fp32_dir)).predict(texts)  # PyTorch
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    for model, out, tolerance in ((fp32_dir, "fp32", 1e-5), (rd / "model", "int8", 5e-2)):
        predict_spark(spark, str(model), str(src), str(tmp_path / out), device="cpu", runtime="onnx")
        table = ds.dataset(tmp_path / out, format="parquet").to_table().sort_by([("id", "ascending")])
        scores = [dict(p) for p in table.column("probabilities").to_pylist()]
        for got, want in zip(scores, expected):
            assert got == pytest.approx(want["probabilities"], abs=tolerance), (out, got, want)
    if httpx is None:
        pytest.skip("the serve extra is not installed")
    server = Server(str(fp32_dir), "--device", "cpu", "--runtime", "onnx", log_dir=tmp_path)
    try:
        assert "runtime onnx, precision fp32" in server.stdout()
        got = server.client.post("/v1/predict", json={"texts": texts}).json()["predictions"]
    finally:
        assert server.terminate() == 0, server.stderr()[-3000:]
    assert [g["label"] for g in got] == [e["label"] for e in expected]
    np.testing.assert_allclose([g["score"] for g in got], [e["score"] for e in expected], atol=1e-5)


def test_serve_onnx_with_device_auto_runs_on_the_cpu_where_onnxruntime_has_no_cuda(onnx_run, monkeypatch):
    """A GPU host with the CPU build of onnxruntime: auto means what runs there (it used to refuse to start)."""
    from torchloom.model import onnx, served

    monkeypatch.setattr(served, "resolve_device", lambda device: "cuda")  # torch sees a GPU
    monkeypatch.setattr(onnx, "has_cuda_provider", lambda: False)
    assert served.ServedModel(str(onnx_run[1]), device="auto", runtime="onnx").device == "cpu"


def test_the_shipped_mix_scores_the_same_on_every_path(onnx_run, tmp_path):
    """A model that ships 0.4 x the transformer + 0.6 x the baseline: evaluate, predict (PyTorch and ONNX),
    the server's batched path (REST, TEI and Ray Serve run it), file scoring (Spark's tasks run the same
    ServedModel) give the same probabilities, and they are the mix of the two models' own."""
    import numpy as np
    import pyarrow.dataset as ds

    from torchloom.batch.files import predict_local
    from torchloom.config import build
    from torchloom.data.texts import texts_at
    from torchloom.evaluate.mix import shipped_probabilities
    from torchloom.evaluate.run import score_split
    from torchloom.lexical import Lexical
    from torchloom.manifest import read as read_manifest
    from torchloom.model.predict import Predictor
    from torchloom.model.served import ServedModel

    rd, fp32_dir = onnx_run[0], onnx_run[1]
    mixed = tmp_path / "mixed"
    shutil.copytree(fp32_dir, mixed)
    shutil.rmtree(mixed / "baseline", ignore_errors=True)
    shutil.copytree(rd / "baseline", mixed / "baseline")
    info = json.loads((mixed / "torchloom.json").read_text())
    (mixed / "torchloom.json").write_text(json.dumps({**info, "combine": {"weight": 0.4, "baseline": "baseline"}}))
    manifest = read_manifest(rd / "data")
    cfg = build(None, ["--output.dir", str(rd), "--engine.device", "cpu"])
    alone, _, index = score_split(cfg, str(mixed), manifest)
    shipped, transformer = shipped_probabilities(str(mixed), manifest, "test", alone, index)
    found = texts_at(manifest, "test", {int(i) for i in index})
    texts = [found[int(i)] for i in index]
    baseline = Lexical.load(rd / "baseline").probabilities(texts)
    np.testing.assert_allclose(shipped, 0.4 * transformer + 0.6 * baseline, atol=1e-6)
    assert np.abs(shipped - transformer).max() > 1e-3 and np.abs(shipped - baseline).max() > 1e-3

    def table(answers):
        return np.array([[a["probabilities"][lb] for lb in manifest.labels] for a in answers])

    served = ServedModel(str(mixed), device="cpu")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    predict_local(str(mixed), str(src), str(tmp_path / "scored.parquet"), device="cpu")
    scored = ds.dataset(tmp_path / "scored.parquet", format="parquet").to_table().sort_by([("id", "ascending")])
    paths = {"predict": table(Predictor(str(mixed)).predict(texts)),
             "onnx": table(Predictor(str(mixed), runtime="onnx").predict(texts)),
             "server": table(served.predict_encoded(served.encode(texts))),
             "file scoring": np.array([[dict(p)[lb] for lb in manifest.labels]
                                       for p in scored.column("probabilities").to_pylist()])}
    for name, probs in paths.items():
        np.testing.assert_allclose(probs, shipped, atol=1e-5, err_msg=name)

    # the baseline won on val (weight 0): it answers alone, and the transformer is never run
    (mixed / "torchloom.json").write_text(json.dumps({**info, "combine": {"weight": 0.0, "baseline": "baseline"}}))
    alone = Predictor(str(mixed))

    def never(*args, **kwargs):
        raise AssertionError("the transformer ran")

    alone.logits = never
    np.testing.assert_allclose(table(alone.predict(texts)), baseline, atol=1e-6)
    # a weight that is no share of a mix: one line, never NaN or a probability outside 0..1
    from torchloom.errors import UserError

    for bad in ("0.4", 1.5, -0.1, None, "nan"):
        (mixed / "torchloom.json").write_text(json.dumps({**info, "combine": {"weight": bad}}))
        if bad == "0.4":  # a number written as a string still reads as one
            Predictor(str(mixed))
            continue
        with pytest.raises(UserError, match=r"combine.weight is .*, not a number from 0 to 1.*export the model"):
            Predictor(str(mixed))


def test_onnx_export_falls_back_to_torch_export_when_the_torchscript_exporter_fails(finished_run, tmp_path,
                                                                                    monkeypatch):
    """A torch without the TorchScript exporter (it is deprecated) or a model it cannot trace: torch.export writes
    the graph instead, and the same gate judges it."""
    import shutil

    import torch

    from torchloom.data.texts import gate_rows
    from torchloom.manifest import read as read_manifest
    from torchloom.model import onnx

    model = tmp_path / "model"
    shutil.copytree(finished_run[0] / "model", model)
    real = torch.onnx.export

    def no_torchscript(*args, **kwargs):
        if kwargs.get("dynamo") is False:
            raise RuntimeError("the TorchScript-based ONNX exporter is no longer supported")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", no_torchscript)
    said: list[str] = []
    info = onnx.export_onnx(model, gate_rows(read_manifest(finished_run[0] / "data"), 2000), "onnx", say=said.append)
    assert info["exporter"] == "torch.export" and info["opset"] == onnx.OPSET and "Attention" not in info["fused"]
    assert info["gate"]["fp32"]["max_abs_logit_diff"] <= 1e-3 and (model / "model.onnx").is_file()
    assert any("torch.export exporter, opset 18" in line for line in said), said
    assert not list(model.glob(".onnx-tmp-*"))


def test_a_failed_onnx_gate_writes_nothing_and_a_model_without_onnx_is_one_line(onnx_run, finished_run, tmp_path,
                                                                                monkeypatch):
    import shutil

    from torchloom.data.texts import gate_rows
    from torchloom.errors import UserError
    from torchloom.manifest import read as read_manifest
    from torchloom.model import onnx

    model = tmp_path / "model"
    shutil.copytree(finished_run[0] / "model", model)
    before = sorted(p.name for p in model.iterdir()), (model / "torchloom.json").read_bytes()
    monkeypatch.setattr(onnx, "FP32_MAX_LOGIT_DIFF", -1.0)  # no export can pass: the refusal path
    with pytest.raises(UserError, match=r"failed its parity gate on 12 test rows .*nothing was written"):
        onnx.export_onnx(model, gate_rows(read_manifest(finished_run[0] / "data"), 2000), "onnx")
    assert (sorted(p.name for p in model.iterdir()), (model / "torchloom.json").read_bytes()) == before

    proc = torchloom("predict", "--model", str(model), "--runtime", "onnx", "some text", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"torchloom: error: model dir {model}: no ONNX export there; run torchloom export --format onnx (or onnx-int8)"
        " on the run first, or use --runtime torch"]


def test_predict_and_serve_name_where_they_run_and_take_the_old_flag(capsys):
    """--engine meant three things; predict says --score-with, serve --serve-with, and the old name still works
    with one line naming the new one."""
    from torchloom.cli import parser

    p = parser()
    assert p.parse_args(["predict", "m", "--score-with", "spark"]).score_with == "spark"
    assert p.parse_args(["serve", "m", "--serve-with", "ray"]).serve_with == "ray"
    assert capsys.readouterr().err == ""
    args = p.parse_args(["serve", "m", "--engine", "ray"])
    assert args.serve_with == "ray"
    assert "--engine is now --serve-with" in capsys.readouterr().err
    assert p.parse_args(["predict", "m", "--engine", "spark"]).score_with == "spark"
    assert "--engine is now --score-with" in capsys.readouterr().err


def test_install_hints_name_the_extras_packages_never_a_torchloom_package():
    """torchloom is not on PyPI: `pip install 'torchloom[x]'` would fail today and install a stranger's code
    once someone registers the name. The hints name each extra's own packages, as pyproject.toml has them."""
    import re

    from torchloom.errors import EXTRAS

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name, packages in EXTRAS.items():
        assert re.findall(r"'([^']+)'", packages) == extras[name], name
    for path in [*(Path(__file__).parents[1] / "src" / "torchloom").rglob("*.py"),
                 *(Path(__file__).parents[1] / "docs").glob("*.md"), Path(__file__).parents[1] / "README.md"]:
        text = path.read_text()
        assert not re.search(r"pip install '?torchloom\[", text), path
        assert "torchloom==" not in text, path


# -- monitoring: the reference profile and `torchloom monitor` --------------------------------------------------

def _topic_texts(path: Path, numbers: range, repeat: int = 1, noise: str = "") -> Path:
    words = {"sport": "match goal team win league", "money": "bank market price shares profit",
             "music": "album song band concert guitar"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["body", "topic"])
        for label, vocab in words.items():
            for i in numbers:
                w.writerow([" ".join([f"{vocab} number {i} " + " ".join(reversed(vocab.split())) + noise] * repeat),
                            label])
    return path


def test_monitor_compares_new_texts_with_the_model_s_profile(finished_run, tmp_path):
    """A file like the held-out texts: no drift (exit 0); texts ten times longer, in words the model never saw:
    drift (exit 3), with the report, plots and an accuracy estimate; a model exported without a profile, or with a
    damaged one, is one line."""
    from torchloom.model.predict import read_texts
    from torchloom.monitor.batch import monitor_file
    from torchloom.monitor.profile import write_profile

    rd, proc = finished_run
    assert "export: no monitoring profile: " in proc.stderr  # 120 rows: too few held-out texts
    model = tmp_path / "model"
    shutil.copytree(rd / "model", model)
    held = _topic_texts(tmp_path / "held.csv", range(100, 150))  # what the reference holds: 150 unseen texts
    write_profile(model, read_texts(str(held), column="body"), read_texts(str(held), column="topic"),
                  {"val": 150, "test": 0})
    like = _topic_texts(tmp_path / "like.csv", range(200, 240))
    same = monitor_file(str(model), str(like), str(tmp_path / "same"), text_column="body", labels_column="topic",
                        say=lambda line: None)
    assert not same["drift"] and same["accuracy"] >= 0.9, same
    assert same["estimated_accuracy"]["low"] <= same["accuracy"] <= same["estimated_accuracy"]["high"]
    assert {"report.md", "monitor.json", "plots"} <= {p.name for p in (tmp_path / "same").iterdir()}
    shifted = _topic_texts(tmp_path / "shifted.csv", range(300, 340), repeat=10, noise=" zxq vlorp")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = torchloom("monitor", "--model", str(model), "--input", str(shifted), "--text-column", "body",
                     "--output", str(tmp_path / "drift"), "--track", "--tracking-uri", store)
    assert proc.returncode == 3, proc.stderr[-3000:]
    from mlflow import MlflowClient  # the report in MLflow: its numbers and its files

    client = MlflowClient(tracking_uri=store)
    (tracked,) = client.search_runs([client.get_experiment_by_name("torchloom").experiment_id])
    assert tracked.data.tags["torchloom.kind"] == "monitor" and tracked.data.metrics["drift"] == 1.0
    assert tracked.data.metrics["length_distance"] > tracked.data.metrics["length_threshold"]
    assert not tracked.data.params  # a monitor trains nothing: no config as params
    assert {a.path for a in client.list_artifacts(tracked.info.run_id, "monitor")} >= {
        "monitor/report.md", "monitor/monitor.json", "monitor/plots"}
    assert proc.stdout.startswith("monitor: drift in ") and "length" in proc.stdout
    report = json.loads((tmp_path / "drift" / "monitor.json").read_text())
    assert report["signals"]["length"]["drift"] and report["texts"] == 120
    assert "**Drift** in" in (tmp_path / "drift" / "report.md").read_text()
    # a second report where one is: only with --overwrite, and only over torchloom's own
    again = torchloom("monitor", "--model", str(model), "--input", str(like), "--text-column", "body",
                      "--output", str(tmp_path / "drift"))
    assert again.returncode == 2 and "already exists; remove it or pass --overwrite" in again.stderr
    monitor_file(str(model), str(like), str(tmp_path / "drift"), text_column="body", overwrite=True,
                 say=lambda line: None)
    assert not json.loads((tmp_path / "drift" / "monitor.json").read_text())["drift"]
    # older exports, damaged profiles: one line each
    from torchloom.errors import UserError

    with pytest.raises(UserError, match=r"no monitoring profile .*export it again"):
        monitor_file(str(rd / "model"), str(like), str(tmp_path / "none"), text_column="body")
    (model / "monitor" / "profile.json").write_text('{"format": "torchloom-monitor/2", "reference": {}}')
    with pytest.raises(UserError, match=r"monitor/ cannot be read \(profile.json: .*\); export it again"):
        monitor_file(str(model), str(like), str(tmp_path / "none"), text_column="body")


def test_predict_with_two_models_compares_them_on_a_labelled_file(finished_run, tmp_path):
    """`predict --model v1=A --model v2=B --input FILE --labels COL`: agreement, class shares, each model's accuracy
    and F1, and McNemar's verdict naming the better one (B: A with a scrambled head); one line for two models of
    different labels, and for --output with two models."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    rd, _ = finished_run
    worse = tmp_path / "worse"
    shutil.copytree(rd / "model", worse, ignore=shutil.ignore_patterns("monitor", "baseline"))
    info = json.loads((worse / "torchloom.json").read_text())
    info.pop("combine", None)  # the transformer alone: its scrambled head is all it has
    (worse / "torchloom.json").write_text(json.dumps(info))
    weights = load_file(str(worse / "model.safetensors"))
    for k in [k for k in weights if k.startswith("classifier.")]:  # each class's row moved to the next class
        weights[k] = np.ascontiguousarray(np.roll(weights[k], 1, axis=0))
    save_file(weights, str(worse / "model.safetensors"), metadata={"format": "pt"})
    data = _topic_texts(tmp_path / "labelled.csv", range(400, 480))
    proc = torchloom("predict", "--model", f"v1={rd / 'model'}", "--model", f"v2={worse}", "--input", str(data),
                     "--text-column", "body", "--labels", "topic", "--report", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "v1 better" in proc.stdout, proc.stdout
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["texts"] == result["labelled"] == 240 and result["verdict"]["state"] == "v1 better"
    assert result["accuracy"]["v1"] > result["accuracy"]["v2"] and result["verdict"]["p_value"] < 0.05
    assert 0 <= result["agreement"] < 1 and set(result["f1"]) == {"sport", "money", "music"}
    disagreements = (tmp_path / "cmp" / "disagreements.jsonl").read_text().splitlines()
    assert len(disagreements) == round(240 * (1 - result["agreement"]))
    assert set(json.loads(disagreements[0])) == {"text", "v1", "v2", "label"}
    assert "McNemar" in (tmp_path / "cmp" / "report.md").read_text()
    # --overwrite replaces only a report of torchloom's, as it left it; never a user's file, never an input
    from torchloom.errors import UserError
    from torchloom.monitor.compare import compare_file

    models = [("v1", str(rd / "model")), ("v2", str(worse))]
    report = tmp_path / "cmp"
    with pytest.raises(UserError, match=r"--report .*: already exists; remove it or pass --overwrite"):
        compare_file(models, str(data), str(report), text_column="body", say=lambda line: None)
    compare_file(models, str(data), str(report), text_column="body", overwrite=True, say=lambda line: None)
    assert "verdict" not in json.loads((report / "compare.json").read_text())  # replaced: no --labels this time
    (report / "notes.md").write_text("mine")
    with pytest.raises(UserError, match=r"--report .*: not replaced, nothing deleted: it holds notes.md"):
        compare_file(models, str(data), str(report), text_column="body", overwrite=True, say=lambda line: None)
    assert (report / "notes.md").read_text() == "mine" and (report / "compare.json").is_file()
    inside = report / "labelled.csv"
    shutil.copy(data, inside)
    (report / "notes.md").unlink()
    with pytest.raises(UserError, match=r"--report .*: holds the input .*labelled.csv"):
        compare_file(models, str(inside), str(report), text_column="body", overwrite=True, say=lambda line: None)
    assert inside.read_text() == data.read_text()
    again = torchloom("predict", "--model", str(rd / "model"), "--model", str(worse), "--input", str(data),
                      "--text-column", "body", "--output", str(tmp_path / "x.parquet"))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "with two models the comparison goes to --report" in again.stderr


def test_evaluate_and_the_mix_scored_by_spark_tasks_give_the_run_s_numbers(finished_run, tmp_path):
    # the run scored test (evaluate) and val (export's mix) in one process; Spark tasks give the same numbers
    import shutil

    rd = tmp_path / "copy"
    shutil.copytree(finished_run[0], rd)
    before = json.loads((rd / "report.json").read_text())
    shipped = json.loads((rd / "model" / "torchloom.json").read_text())
    for command in ("export", "evaluate"):
        proc = torchloom(command, "--output.dir", str(rd), "--eval.score_with", "spark",
                         "--prepare.spark_master", "local[2]", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"{command}: scoring {'val' if command == 'export' else 'test'}'s " in proc.stderr, proc.stderr
    after = json.loads((rd / "report.json").read_text())
    for key in ("accuracy", "macro_f1", "loss", "ece", "confusion_matrix", "per_class", "n"):
        assert after["metrics"][key] == before["metrics"][key], key
    assert json.loads((rd / "model" / "torchloom.json").read_text()).get("combine") == shipped.get("combine")
