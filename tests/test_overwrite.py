"""--overwrite deletes only what is torchloom's: a run, prepared data or a study nobody is running."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def torchloom(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchloom", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=cwd)


def one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def topics_csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("csv") / "topics.csv"
    vocab = {"sport": "match goal team win league", "money": "bank market price shares profit"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *([f"{v} number {i}", k] for k, v in vocab.items()
                                                      for i in range(30))])
    return path


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, topics_csv, tiny_model_dir):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", str(mine), "--overwrite"))
    assert f"output.dir {mine}: not replaced" in error and "neither empty nor a torchloom run" in error
    assert (mine / "chapter1.tex").read_text() == "years of work"


def test_overwrite_refuses_the_working_directory(tmp_path, topics_csv, tiny_model_dir):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "config.toml").write_text("")  # a torchloom run, but the one the user stands in
    error = one_error(torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir,
                                "--output.dir", ".", "--overwrite", cwd=run))
    assert "is the working directory" in error
    assert (run / "config.toml").exists()


def test_tune_overwrite_refuses_while_another_process_runs_the_study(tmp_path, topics_csv, tiny_model_dir):
    out = tmp_path / "study"
    args = ["tune", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir", str(out),
            "--prepare.spark_master", "local[1]", "--tune.backend", "optuna", "--engine.workers", "1",
            "--tune.trials", "50", "--train.epochs", "3", "--tracking.enabled", "false"]
    running = subprocess.Popen([sys.executable, "-m", "torchloom", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out / "study.json").is_file():
            assert running.poll() is None and time.monotonic() < deadline, "the first tune did not start a study"
            time.sleep(0.2)
        error = one_error(torchloom(*args, "--overwrite"))
        assert "another torchloom tune process is running this study" in error
        assert (out / "study.json").is_file() and running.poll() is None
    finally:
        running.kill()
        running.wait()
    # once it has stopped, --overwrite starts the study afresh
    from torchloom.config import build
    from torchloom.tune.study import open_study_dir

    (out / "leftover").write_text("from the killed study")
    sd, resuming = open_study_dir(build(None, [*args[1:], "--output.overwrite", "true"]), "optuna")
    assert not resuming and not (out / "leftover").exists() and sd.marker.is_file()


def test_batch_predict_overwrite_replaces_only_earlier_predictions(tmp_path, monkeypatch):
    from torchloom.errors import UserError
    from torchloom.serve.score_files import _check_paths

    src = tmp_path / "in.parquet"
    src.write_bytes(b"")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "part-0.parquet").write_bytes(b"")
    (earlier / "_SUCCESS").write_bytes(b"")
    _check_paths(str(src), str(earlier), overwrite=True, local_only=True)  # earlier predictions: replaced
    (earlier / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="not replaced: it holds notes.md"):
        _check_paths(str(src), str(earlier), overwrite=True, local_only=True)
    monkeypatch.chdir(earlier)
    with pytest.raises(UserError, match="is the working directory"):
        _check_paths(str(src), ".", overwrite=True, local_only=True)
