"""A tune study in a real PostgreSQL server (support/postgres.py: Debian's, a throwaway cluster on a free port of
127.0.0.1): the server restarted mid-study, a wrong password, an unknown database, a missing driver, a password
from the environment. The study across hosts is tests/cluster/test_shared_db.py's.

The studies here start from data prepared beforehand (the study reuses it, as one whose prepare ran before), so
no Spark starts: what is tested is the study's database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.postgres import Postgres, optuna_study_args
from support.runs import prepared_study

optuna = pytest.importorskip("optuna")
pytest.importorskip("psycopg")

SPACE = '{"train.lr" = "loguniform(1e-4, 1e-2)", "train.warmup_ratio" = "uniform(0, 0.2)"}'


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    with Postgres(tmp_path_factory.mktemp("pg")) as server:
        yield server


def study_args(out: Path, tiny: str, storage: str, trials: int) -> list[str]:
    return optuna_study_args(out, tiny, storage, trials, SPACE)


def tune(args: list[str], env: dict | None = None, timeout: float = 600, pre: str = "") -> subprocess.Popen:
    code = f"import sys; {pre}from torchloom.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, "tune", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})})


def test_a_study_goes_on_through_a_database_restart_and_counts_each_trial_once(pg, tmp_path, tiny_model_dir):
    # the password from the environment (libpq's PGPASSWORD), not the URL
    url = pg.url("restart").replace(f":{pg.password}@", "@")
    out = tmp_path / "study"
    args = study_args(out, tiny_model_dir, url, trials=2)
    prepared_study(out, args)
    proc = tune(args, env={"PGPASSWORD": pg.password})
    storage = optuna.storages.RDBStorage(pg.url("restart", driver="psycopg"))

    def finished() -> int:
        try:
            study = optuna.load_study(study_name="study", storage=storage)
        except Exception:  # noqa: BLE001 - not created yet
            return 0
        return sum(t.state.is_finished() for t in study.trials)

    deadline = time.monotonic() + 300
    while finished() < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    storage.engine.dispose()
    pg.restart(down_s=4)  # every connection cut, 4 s of refused connections
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    study = optuna.load_study(study_name="study", storage=optuna.storages.RDBStorage(pg.url("restart", "psycopg")))
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") + states.count("PRUNED") == 2 and "RUNNING" not in states, states
    assert {t.number for t in study.trials} == {0, 1}, (states, stderr[-6000:])  # none failed, none run twice
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["trial-000", "trial-001"]
    assert stderr.count("does not answer") <= 1 and pg.password not in stdout + stderr
    assert "torchloom tune finished: 2 trials" in stdout


@pytest.mark.parametrize("case, needle", [
    ("password", "the server refused the credentials"),
    ("database", "the database does not exist on the server"),
])
def test_a_wrong_password_or_database_is_one_line_before_any_trial(pg, tmp_path, tiny_model_dir, case, needle):
    pg.url("exists")
    url = pg.url("exists", password="wrong-secret") if case == "password" else \
        pg.url("exists").replace("/exists", "/missing")
    out = tmp_path / "study"
    args = study_args(out, tiny_model_dir, url, trials=2)
    prepared_study(out, args)
    proc = tune(args)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchloom: error: tune.storage postgresql://***@"), stderr
    assert needle in lines[0] and "wrong-secret" not in stderr and pg.password not in stderr
    assert not (out / "trials").exists()


def test_a_missing_driver_names_the_extra(pg, tmp_path, tiny_model_dir):
    out = tmp_path / "study"
    args = study_args(out, tiny_model_dir, pg.url("driver"), trials=2)
    prepared_study(out, args)
    proc = tune(args, pre="sys.modules.update(psycopg=None, psycopg2=None); ")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    assert "its database driver is not installed (psycopg" in stderr, stderr
    assert "pip install 'psycopg[binary]>=3.1' (torchloom's postgres extra)" in stderr, stderr


def test_a_worker_url_gets_psycopg_where_psycopg2_is_missing():
    from torchloom.tune.storage import with_driver

    assert with_driver("postgresql://u:p@h:5432/db") == "postgresql+psycopg://u:p@h:5432/db"
    assert with_driver("postgresql+psycopg2://h/db") == "postgresql+psycopg2://h/db"  # a driver given is kept
    assert with_driver("sqlite:///x.db") == "sqlite:///x.db"


def test_every_call_optunas_cache_makes_on_its_backend_waits_out_an_outage():
    """Optuna's cache calls some of its backend's private methods directly: each one not wrapped is a call a
    database restart fails the study on (CI saw one: a restart while a trial was created)."""
    import inspect
    import re

    from optuna.storages import _cached_storage

    from torchloom.tune.storage import CACHE_CALLS

    called = set(re.findall(r"self\._backend\.(_[a-z]\w*)\(", inspect.getsource(_cached_storage)))
    assert called and called <= set(CACHE_CALLS), called - set(CACHE_CALLS)
