"""The driver's forwarding of rank 0's metrics.jsonl into MLflow, against a real sqlite store."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("mlflow")

from torchloom.config import Config  # noqa: E402
from torchloom.runs.rundir import RunDir  # noqa: E402
from torchloom.tracking import MetricsForwarder, Tracker, forward_missing  # noqa: E402


def record(kind: str, step: int, value: float) -> str:
    # as the loop writes them: every record has a loss
    key = "loss" if kind == "train" else "macro_f1"
    return json.dumps({"kind": kind, "step": step, "loss": value, key: value}) + "\n"


@pytest.fixture
def tracker(tmp_path):
    cfg = Config()
    cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri=str(tmp_path / "store"),
                                                                experiment="forwarder"))
    with Tracker.start(cfg, "train", run_name="t") as t:
        yield t


def history(tracker, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in tracker.client.get_metric_history(tracker.run_id, name))


def test_forwards_each_step_once_after_the_resume_point(tracker, tmp_path):
    path = tmp_path / "metrics.jsonl"
    # A resumed run: lines up to its checkpoint (step 10) belong to the run that wrote them.
    path.write_text(record("train", 10, 1.0) + record("train", 20, 0.8) + record("eval", 20, 0.5))
    fwd = MetricsForwarder(tracker.client, tracker.run_id, path, after_step=10)
    fwd.poll()
    assert history(tracker, "train_loss") == [(20, 0.8)]
    assert history(tracker, "val_macro_f1") == [(20, 0.5)]
    # A worker restarted from the step-10 checkpoint rewrites the file as the Trainer does and logs
    # step 20 again, then goes on; the last line is still being written.
    RunDir(tmp_path).reset_metrics(10)
    with open(path, "a") as f:
        f.write(record("train", 20, 0.8) + record("train", 30, 0.6) + record("train", 40, 0.4)[:15])
    fwd.poll()
    assert history(tracker, "train_loss") == [(20, 0.8), (30, 0.6)]
    with open(path, "a") as f:
        f.write(record("train", 40, 0.4)[15:])
    with fwd:  # the thread's last poll on leaving
        pass
    assert history(tracker, "train_loss") == [(20, 0.8), (30, 0.6), (40, 0.4)]
    assert not fwd.failed


def test_a_failing_store_is_a_warning_not_an_error(tracker, tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(record("train", 10, 1.0))
    tracker.finish()
    tracker.client.delete_run(tracker.run_id)  # logging to a deleted run fails
    fwd = MetricsForwarder(tracker.client, tracker.run_id, path)
    fwd.poll()
    assert fwd.failed
    assert "MLflow logging of step metrics stopped" in capsys.readouterr().err
    fwd.poll()  # and stays quiet afterwards
    assert capsys.readouterr().err == ""


def test_forward_missing_sends_what_a_killed_process_did_not(tracker, tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(record("train", 10, 1.0) + record("eval", 10, 0.4))
    MetricsForwarder(tracker.client, tracker.run_id, path).poll()
    # The process dies after writing two more records, before its next poll; its parent catches up.
    with open(path, "a") as f:
        f.write(record("train", 20, 0.7) + record("eval", 20, 0.6))
    forward_missing(tracker.client, tracker.run_id, path)
    assert history(tracker, "train_loss") == [(10, 1.0), (20, 0.7)]
    assert history(tracker, "val_macro_f1") == [(10, 0.4), (20, 0.6)]
