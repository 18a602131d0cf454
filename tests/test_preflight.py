"""The checks before a stage run once per run (preflight.py, run.py): the CLI opens the command's Run, checked,
and hands it to `run` and the stages it calls, which ask nothing again; a stage called from Python with a Config
opens (and checks) a Run of its own."""

from __future__ import annotations

import pytest

from torchloom import cli, preflight
from torchloom.config import build
from torchloom.errors import UserError
from torchloom.runs.run import Run
from torchloom.runs.runfiles_prefix import Place


class Stopped(Exception):
    pass


def counting(monkeypatch) -> dict[str, list[str]]:
    """The checks' calls, by check: the output.dir each one checked."""
    calls: dict[str, list[str]] = {"for_this_machine": [], "check_own": []}
    machine, own = preflight.for_this_machine, Place.check_own
    monkeypatch.setattr(preflight, "for_this_machine",
                        lambda run: calls["for_this_machine"].append(run.cfg.output.dir) or machine(run))
    monkeypatch.setattr(Place, "check_own",
                        lambda self, *a: calls["check_own"].append(self.rd.location) or own(self, *a))
    return calls


def test_run_checks_its_run_once_and_hands_it_to_the_stages(tmp_path, monkeypatch):
    from torchloom.stages import run, save_config, train

    calls = counting(monkeypatch)
    given: list[Run] = []

    def trainable(r):  # train_stage's own check, reached with the Run the CLI built
        given.append(r)
        save_config(r)  # asks whether the run is torchloom's: kept on the Run, not asked again
        raise Stopped

    monkeypatch.setattr(train, "check_trainable", trainable)
    monkeypatch.setattr(run, "_run_all", lambda r, reuse: train.train_stage(r))  # no prepare: no Spark
    out = str(tmp_path / "run")
    with pytest.raises(Stopped):
        cli.main(["run", "--output.dir", out, "--engine.device", "cpu", "--tracking.enabled", "false"])
    assert [r.cfg.output.dir for r in given] == [out] and isinstance(given[0].cfg.engine.workers, int)
    assert calls == {"for_this_machine": [out], "check_own": [out]}
    assert (tmp_path / "run" / "config.toml").is_file()


def test_a_config_from_python_opens_a_run_of_its_own_and_a_run_passes_through(tmp_path, monkeypatch):
    from torchloom.stages import as_run

    calls = counting(monkeypatch)
    cfg = build(None, ["--output.dir", str(tmp_path / "run"), "--engine.device", "cpu"])
    opened = as_run(cfg)
    assert isinstance(opened, Run) and opened.cfg.engine.workers != "auto" and opened.rd.root == tmp_path / "run"
    assert as_run(opened) is opened and as_run(cfg) is not opened  # each Config: its own run, checked again
    assert len(calls["for_this_machine"]) == 2
    with pytest.raises(ValueError, match="given the config of"):  # a run never takes another directory's config
        opened.but(cfg=build(None, ["--output.dir", str(tmp_path / "other")]))


def test_a_failed_check_is_asked_again(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = build(None, ["--output.dir", str(tmp_path / "file"), "--engine.device", "cpu"])
    for _ in range(2):
        with pytest.raises(UserError, match="is a file, not a directory"):
            preflight.open_run(cfg)
    run = preflight.open_run(build(None, ["--output.dir", str(tmp_path / "ok"), "--engine.device", "cpu"]))
    answers = iter([UserError("down"), None])

    def flaky() -> None:
        error = next(answers)
        if error:
            raise error

    with pytest.raises(UserError):
        run.once("flaky", flaky)
    run.once("flaky", flaky)  # asked again, and passes
    run.once("flaky", lambda: pytest.fail("a passed check is kept"))
