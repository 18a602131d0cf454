"""torchloom tune as a user runs it: a real local Ray instance (Ray Tune + Ray Train), real Optuna
studies in sqlite driven by concurrent processes, a real MLflow store, a tiny model."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from torchloom.config import build
from torchloom.errors import UserError
from torchloom.tune import space

pytestmark = pytest.mark.heavy(5)  # see tests/support/schedule.py

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def torchloom(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The command in this process (support.command), but a Ray study in its own: ray.init's driver state (the
    instance, its token, its threads) outlives the command in the process that made it."""
    from support.command import torchloom as run

    return run(*args, timeout=timeout, process="ray" in args)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def topics_csv(tmp_path_factory):
    """Three topics whose words give them away, 30 rows each."""
    path = tmp_path_factory.mktemp("csv") / "topics.csv"
    vocab = {"sport": "match goal team win league", "money": "bank market price shares profit",
             "music": "album song band concert guitar"}
    rows = [[f"{v} number {i} {' '.join(reversed(v.split()))}", k] for k, v in vocab.items() for i in range(30)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *rows])
    return path


def common(csv_path, tiny, out) -> list[str]:
    return ["--data.path", str(csv_path), "--model.path", tiny, "--output.dir", str(out),
            "--prepare.spark_master", "local[2]", "--train.precision", "fp32", "--train.batch_size", "8",
            "--train.log_every", "2",
            "--eval.baseline", "false"]  # the baseline is tested with `run` (test_cli.py); a study's costs ~10 s


# -- the search space is checked before anything starts --------------------------------------------
@pytest.mark.parametrize("entry, needle", [
    ({"train.lr": "lognormal(1e-5, 1e-3)"}, "unknown distribution 'lognormal'"),
    ({"train.lr": "loguniform(1e-3, 1e-5)"}, "low 0.001 must be below high 1e-05"),
    ({"train.lr": "loguniform(0, 1e-3)"}, "needs low > 0"),
    ({"train.nope": "uniform(0, 1)"}, "train.nope"),
    ({"nope": "uniform(0, 1)"}, "unknown config key"),
    ({"output.dir": "choice('a', 'b')"}, "cannot be tuned"),
    ({"train.epochs": "uniform(1, 3)"}, "integer setting"),
    ({"train.batch_size": "choice(16, 15)"}, "must be a multiple"),
    ({"train.lr": "uniform(-1, 1)"}, "train.lr"),
    ({"train.lr": "1e-4"}, "not a distribution"),
])
def test_bad_search_space_is_one_clear_error(entry, needle):
    cfg = build(None, ["--engine.workers", "2"])  # as tune's run has counted them (engine.workers auto) by now
    cfg.tune.space = entry
    with pytest.raises(UserError, match=None) as e:
        space.parse(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_space_reads_bare_keys_and_every_distribution():
    cfg = build(None, [])
    cfg.tune.space = {"lr": "loguniform(1e-5, 1e-3)", "batch_size": "choice(16, 32)",
                      "train.warmup_ratio": "uniform(0, 0.2)", "train.grad_accum": "int(1, 2)",
                      "train.epochs": "logint(1, 4)"}
    params = {p.key: p for p in space.parse(cfg)}
    assert set(params) == {"train.lr", "train.batch_size", "train.warmup_ratio", "train.grad_accum",
                           "train.epochs"}
    assert params["train.batch_size"].args == (16, 32) and params["train.epochs"].log
    out = space.apply(cfg, {"train.lr": 3e-4, "train.grad_accum": 2})
    assert out.train.lr == 3e-4 and out.train.grad_accum == 2 and cfg.train.grad_accum == 1


def test_cli_rejects_a_bad_space_before_any_trial(tmp_path, tiny, topics_csv):
    out = tmp_path / "study"
    proc = torchloom("tune", *common(topics_csv, tiny, out), "--tune.space", '{"train.lr" = "loguniform(1, 0.1)"}',
                     timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tune.space train.lr" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()


# -- Ray Tune: ASHA over distributed trials ---------------------------------------------------------
@pytest.fixture(scope="module")
def ray_study(tmp_path_factory, tiny, topics_csv):
    pytest.importorskip("ray.tune")
    pytest.importorskip("optuna")
    root = tmp_path_factory.mktemp("ray-study")
    store = f"sqlite:///{root / 'mlflow.db'}"
    out = root / "study"
    # Validation loss separates trials even when a tiny learning rate leaves accuracy flat; the
    # range spans learning rates that barely move the model, so ASHA has something to stop. One trial
    # at a time makes ASHA's decisions independent of which concurrent trial reports first.
    proc = torchloom("tune", *common(topics_csv, tiny, out), "--tune.backend", "ray", "--engine.workers", "2",
                     "--tune.trials", "3", "--tune.max_concurrent", "1", "--tune.metric", "loss",
                     "--train.epochs", "1", "--train.eval_every", "2",
                     "--tune.space", '{"train.lr" = "loguniform(1e-7, 2e-2)"}',
                     "--tracking.uri", store, "--tracking.experiment", "tune-tests")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, store, proc


@pytest.mark.ray
def test_ray_asha_study_stops_a_trial_early_and_exports_the_best(ray_study):
    out, _, proc = ray_study
    assert "Token authentication is enabled" not in proc.stderr  # Ray's note on what torchloom asked for
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert sum(r["stopped_early"] == "True" for r in rows) >= 1, rows
    completed = [r for r in rows if r["status"] == "completed"]
    assert completed and all(int(r["steps"]) == int(completed[0]["steps"]) for r in completed)
    stopped = [r for r in rows if r["stopped_early"] == "True"]
    assert all(int(r["evals"]) < int(completed[0]["evals"]) for r in stopped)
    best = min((r for r in rows if r["loss"]), key=lambda r: float(r["loss"]))
    study = json.loads((out / "study.json").read_text())
    assert study["best_trial"] == best["trial"] and study["backend"] == "ray"
    assert f"best    {best['trial']}" in proc.stdout
    # the best config reproduces the trial's parameters; the exported model is a servable dir
    best_cfg = tomllib.loads((out / "best_config.toml").read_text())
    assert best_cfg["train"]["lr"] == pytest.approx(float(best["train.lr"]))
    assert (out / "model" / "config.json").is_file() and (out / "results.png").stat().st_size > 0
    report = json.loads((out / "report.json").read_text())
    assert report["tune"]["best_trial"] == best["trial"]
    # every trial is an ordinary run dir with its own data link and metrics
    for r in rows:
        td = Path(r["run_dir"])
        assert (td / "data" / "manifest.json").is_file() and (td / "metrics.jsonl").is_file()
        # the trials' train workers run at full CPU priority on the study's own Ray instance
        log = (td / "logs" / "rank-1.log").read_text()
        assert log.count("rank 1 of 2 on ") == 1 and "niceness" not in log  # and printed once


@pytest.mark.ray
def test_ray_study_trials_are_nested_mlflow_runs(ray_study):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    out, store, _ = ray_study
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("tune-tests")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("torchloom.kind") == "tune"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 and len(runs) == 4
    assert {c.info.status for c in children} <= {"FINISHED", "KILLED"} and parent.info.status == "FINISHED"
    with open(out / "results.csv") as f:
        rows = {r["trial"]: r for r in csv.DictReader(f)}
    for c in children:
        row = rows[c.data.tags["trial"]]
        assert float(c.data.params["train.lr"]) == pytest.approx(float(row["train.lr"]))
        assert c.info.status == ("KILLED" if row["stopped_early"] == "True" else "FINISHED")
        assert client.get_metric_history(c.info.run_id, "val_loss")  # per-eval metrics from rank 0
    assert "model" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert parent.data.tags["best_trial"] == json.loads((out / "study.json").read_text())["best_trial"]


def test_study_dir_opened_by_many_at_once_is_one_study_and_a_foreign_dir_is_refused(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from torchloom.tune.study import open_study_dir

    for i in range(30):  # every opener joins one study; only one of them created it
        cfg = build(None, ["--output.dir", str(tmp_path / f"study{i}")])
        with ThreadPoolExecutor(6) as pool:
            opened = list(pool.map(open_study_dir, [cfg] * 6, ["optuna"] * 6))
        assert sorted(resuming for _, resuming in opened) == [False] + [True] * 5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a tune study"):
        open_study_dir(build(None, ["--output.dir", str(foreign)]), "optuna")
    with pytest.raises(UserError, match="holds a optuna study"):
        open_study_dir(build(None, ["--output.dir", str(tmp_path / "study0")]), "ray")
    # resumed with another search space: one line, not a study whose trials searched two spaces
    other = build(None, ["--output.dir", str(tmp_path / "study0"), "--tune.space", '{"train.lr" = "uniform(0.1, 1)"}'])
    with pytest.raises(UserError, match=r"the study there was started with tune.space \{"):
        open_study_dir(other, "optuna")


# -- Optuna: one study in sqlite, driven by two processes at once --------------------------------
# the local stand-in of tests/cluster/test_shared_db.py, two hosts filling one study
def test_optuna_study_in_sqlite_shared_by_two_concurrent_processes(tmp_path, tiny, topics_csv):
    optuna = pytest.importorskip("optuna")
    out = tmp_path / "study"
    args = [sys.executable, "-m", "torchloom", "tune", *common(topics_csv, tiny, out), "--tune.backend", "optuna",
            "--engine.workers", "1", "--tune.trials", "3", "--train.epochs", "1", "--tracking.enabled", "false",
            "--tune.space", '{"train.lr" = "loguniform(1e-4, 1e-2)", "train.warmup_ratio" = "uniform(0, 0.2)"}']
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for _ in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    # both processes ran trials, and all of them are in one study
    ran = [err.count("started: lr=") for _, err in outputs]
    assert all(n >= 1 for n in ran), ran
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{out / 'optuna.db'}")
    # exactly tune.trials ran: a trial asked for once the others had claimed the last ones is a surplus, never run
    trials = [t for t in study.trials if not t.user_attrs.get("surplus")]
    assert sum(ran) == len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 3  # each configuration once
    dirs = sorted(p.name for p in (out / "trials").iterdir())
    assert dirs == [f"trial-{t.number:03d}" for t in trials]
    # the data was prepared once, by one of them
    assert sum("reusing the prepared data" in err for _, err in outputs) == 1


@pytest.mark.gpu
@pytest.mark.ray
def test_ray_study_trials_train_on_gpus(tmp_path, tiny, topics_csv):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("ray.tune")
    out = tmp_path / "study"
    proc = torchloom("tune", *common(topics_csv, tiny, out), "--tune.backend", "ray", "--engine.workers", "1",
                     "--engine.device", "cuda", "--tune.trials", "2", "--train.epochs", "1",
                     "--train.precision", "bf16", "--tracking.enabled", "false",
                     "--tune.space", '{"train.lr" = "loguniform(1e-4, 1e-2)"}')
    assert proc.returncode == 0, proc.stderr[-4000:]
    for td in (out / "trials").iterdir():
        result = json.loads((td / "train_result.json").read_text())
        assert result["device"].startswith("cuda")


def test_optuna_prunes_a_poor_trial_and_a_rerun_resumes_the_study(tmp_path, tiny, topics_csv):
    # Sequential trials over learning rates from ones that barely move the model to useful ones: ASHA
    # (Optuna's successive halving) stops a trial whose validation loss trails at a rung. Run again with
    # more trials, the same command resumes the study: the finished trials are kept, not run again.
    optuna = pytest.importorskip("optuna")
    out = tmp_path / "study"
    args = ["tune", *common(topics_csv, tiny, out), "--tune.backend", "optuna", "--engine.workers", "1",
            "--tune.metric", "loss", "--train.epochs", "1", "--train.eval_every", "2", "--tracking.enabled", "false",
            "--tune.space", '{"train.lr" = "loguniform(1e-7, 2e-2)"}']
    first = torchloom(*args, "--tune.trials", "3")
    assert first.returncode == 0, first.stderr[-4000:]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and sum(r["stopped_early"] == "True" for r in rows) >= 1, rows
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{out / 'optuna.db'}")
    assert sum(t.state == optuna.trial.TrialState.PRUNED for t in study.trials) >= 1
    before = {p.name: (p / "metrics.jsonl").stat().st_mtime for p in (out / "trials").iterdir()}

    again = torchloom(*args, "--tune.trials", "4")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming study" in again.stdout + again.stderr
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    after = {p.name: (p / "metrics.jsonl").stat().st_mtime for p in (out / "trials").iterdir()}
    assert len(after) == 4 and all(after[name] == mtime for name, mtime in before.items())  # not re-run
