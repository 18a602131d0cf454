"""The checks before a stage run once per command (preflight.py): the CLI checks the config, and `run` and the
stages it calls get the answer kept; a stage called from Python outside a command checks every time."""

from __future__ import annotations

import pytest

from torchloom import cli, preflight
from torchloom.config import build
from torchloom.errors import UserError
from torchloom.rundir import RunDir


class Stopped(Exception):
    pass


def counting(monkeypatch) -> dict[str, list[str]]:
    """The checks' calls, by check: the config's output.dir or the run directory each one checked."""
    calls: dict[str, list[str]] = {"for_this_machine": [], "check_foreign_config": []}
    machine, foreign = preflight._for_this_machine, preflight._check_foreign_config
    monkeypatch.setattr(preflight, "_for_this_machine",
                        lambda cfg: calls["for_this_machine"].append(cfg.output.dir) or machine(cfg))
    monkeypatch.setattr(preflight, "_check_foreign_config",
                        lambda rd: calls["check_foreign_config"].append(rd.location) or foreign(rd))
    return calls


def test_run_checks_the_config_once_though_run_all_and_train_stage_ask_again(tmp_path, monkeypatch):
    from torchloom.stages import run, train

    calls = counting(monkeypatch)
    asked: list[str] = []

    def trainable(cfg):  # train_stage has asked for_this_machine again by now
        asked.append(cfg.output.dir)
        raise Stopped

    monkeypatch.setattr(train, "check_trainable", trainable)
    monkeypatch.setattr(run, "_run_all", lambda cfg, rd, tracker, reuse: train.train_stage(cfg))  # no prepare: no Spark
    out = str(tmp_path / "run")
    with pytest.raises(Stopped):
        cli.main(["run", "--output.dir", out, "--engine.device", "cpu", "--tracking.enabled", "false"])
    assert asked == [out]  # the CLI, run_all and train_stage each asked; the machine and the run were checked once
    assert calls == {"for_this_machine": [out], "check_foreign_config": [out]}


def test_outside_a_command_every_call_checks(tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    cfg = build(None, ["--output.dir", str(tmp_path / "run"), "--engine.device", "cpu"])
    counted = preflight.for_this_machine(cfg)
    assert preflight.for_this_machine(counted) == counted
    assert len(calls["for_this_machine"]) == 2
    with preflight.command():
        assert preflight.for_this_machine(counted) is preflight.for_this_machine(counted)
        preflight.check_foreign_config(RunDir(tmp_path / "run"))
    assert len(calls["for_this_machine"]) == 3
    assert len(calls["check_foreign_config"]) == 3  # two outside the command, one in it


def test_a_failed_check_is_asked_again(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = build(None, ["--output.dir", str(tmp_path / "file"), "--engine.device", "cpu"])
    with preflight.command():
        for _ in range(2):
            with pytest.raises(UserError, match="is a file, not a directory"):
                preflight.for_this_machine(cfg)
