"""The run directory's contract: atomic writes, the metrics log on resume, hooks the workers obey."""

from __future__ import annotations

import json

import pytest

from torchloom.engines.worker import hooked_reporters, worker_reporter
from torchloom.errors import UserError
from torchloom.jsonio import write_atomic
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.train.reporter import Reporters
from torchloom.tune.pruning import PruningReporter


def test_write_atomic_replaces_whole_and_leaves_no_temporary_on_failure(tmp_path):
    target = tmp_path / "f.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_text() == "new"
    with pytest.raises(TypeError):
        write_atomic(target, 42)  # neither str nor bytes: nothing written, the old file stays
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_reset_metrics_keeps_lines_up_to_the_resumed_step_and_fresh_start_removes_the_file(tmp_path):
    rd = RunDir(tmp_path)
    rd.metrics.write_text("".join(json.dumps({"kind": k, "step": s}) + "\n"
                                  for k, s in [("train", 10), ("eval", 10), ("train", 20)]))
    rd.reset_metrics(10)
    assert [r["step"] for r in rd.metric_records()] == [10, 10]
    assert [r["kind"] for r in rd.metric_records("eval")] == ["eval"]
    rd.reset_metrics(None)
    assert not rd.metrics.exists() and rd.metric_records() == []


def test_hooks_build_the_named_reporter_on_every_rank_and_refuse_foreign_code(tmp_path):
    rd = RunDir(tmp_path)
    # rank 1 of an Optuna trial builds a pruning reporter that opens no storage (rank 0 does)
    rd.write_hooks({"reporters": [PruningReporter.hook(storage="sqlite:///x.db", study_name="s", trial_id=0,
                                                       metric="macro_f1", scheduler="asha", grace_period=1,
                                                       reduction_factor=2)]})
    reporter = worker_reporter(RunFiles(rd), rank=1)
    assert isinstance(reporter, Reporters) and reporter.may_stop
    assert any(isinstance(r, PruningReporter) for r in reporter.reporters)
    rd.write_hooks({"reporters": [{"class": "os:system", "args": {}}]})
    with pytest.raises(UserError, match="not torchloom's"):
        hooked_reporters(rd, rank=0)
    rd.write_hooks({})
    assert not rd.hooks.exists() and hooked_reporters(rd, rank=0) == []


def test_progress_and_errors_reach_the_driver_files(tmp_path):
    rd = RunDir(tmp_path)
    reporter = worker_reporter(RunFiles(rd), rank=0)
    reporter.progress({"total_steps": 10, "step": 3, "phase": "train"})
    assert json.loads(rd.progress.read_text())["step"] == 3
    reporter.failed(ValueError("boom"))
    reporter.failed(RuntimeError("later"))  # the first error stays
    err = json.loads(rd.error_file(0).read_text())
    assert err["type"] == "ValueError" and err["message"] == "boom" and "ValueError: boom" in err["traceback"]


def test_a_store_run_s_copy_behind_a_symbolic_link_is_one_path(tmp_path, monkeypatch):
    """A home or cache directory that is a symbolic link (/gpfs, /lustre on clusters): every path of the copy
    maps to its URI, whoever resolved it (was: ValueError '... is not in the subpath')."""
    from torchloom.runs.rundir import RunDir
    from torchloom.runs.runfiles import RunFiles

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "link"))
    rd = RunDir("s3://bucket/runs/x")
    rd.data.mkdir(parents=True)
    assert RunFiles(rd).uri(rd.data) == "s3://bucket/runs/x/data"
    assert rd.home(rd.data.resolve() / "manifest.json") == "s3://bucket/runs/x/data/manifest.json"
    assert RunFiles(rd).uri(tmp_path / "link" / rd.root.relative_to(tmp_path / "real") / "model") \
        == "s3://bucket/runs/x/model"


def test_metrics_and_config_are_never_written_through_a_link(tmp_path):
    """A metrics.jsonl that is a symbolic link, or a hard link into a snapshot, and a config.toml that is a link:
    the run gets files of its own; what they pointed at is unchanged."""
    import os

    from torchloom.config import build, save
    from torchloom.runs.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text('{"mine": 1}\n')
    rd.metrics.symlink_to(elsewhere)
    rd.append_metrics({"step": 1})
    assert elsewhere.read_text() == '{"mine": 1}\n' and not rd.metrics.is_symlink()
    assert rd.metrics.read_text() == '{"mine": 1}\n{"step": 1}\n'
    snapshot = tmp_path / "snapshot.jsonl"
    os.link(rd.metrics, snapshot)
    rd.append_metrics({"step": 2})
    assert snapshot.read_text() == '{"mine": 1}\n{"step": 1}\n'
    theirs = tmp_path / "theirs.toml"
    theirs.write_text("# someone's\n")
    rd.config.symlink_to(theirs)
    save(build(None, ["--output.dir", str(rd.root)]), rd.config)
    assert theirs.read_text() == "# someone's\n" and not rd.config.is_symlink()
