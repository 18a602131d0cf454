"""RunFiles, the one owner of a run's files: its verbs on a local run (nothing to move) and on a local directory
used as a store (`file+store://`), where a whole `torchloom run` shows that every file the run wrote on this host
reached the store, and a second host with an empty cache works from the store alone. No S3 server: the same
staging path, run by pyarrow's local file system (tests/test_storage.py runs it against S3)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from support.command import torchloom

from torchloom.errors import UserError
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles
from torchloom.runs.runrecord import TEMP_NAME
from torchloom.store import storage


def test_a_local_run_has_nothing_to_move(tmp_path):
    rd = RunDir(tmp_path / "run")
    files = RunFiles(rd)
    rd.root.mkdir()
    (rd.root / "a.txt").write_text("x")
    assert not files.on_store
    assert files.push(rd.root / "a.txt") == 0 and files.listing(rd.root) == {} and files.checkpoints.steps() == []
    files.pull(rd.metrics)
    files.ensure(rd.manifest)
    assert not rd.metrics.exists() and not rd.manifest.exists()
    files.write_through(rd.root / "b.txt", "y")
    assert files.read(rd.root / "b.txt") == b"y" and files.reachable(rd.root / "b.txt")
    files.delete(rd.root / "b.txt")
    assert not (rd.root / "b.txt").exists()


def test_on_a_store_the_verbs_move_files_and_quiet_ones_only_warn(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    uri = f"file+store://{tmp_path}/store/run"
    files = RunFiles(uri)
    rd = files.rd
    assert files.on_store and rd.root.is_relative_to(tmp_path / "cache")
    (rd.logs).mkdir(parents=True)
    rd.rank_log(0).write_text("line\n")
    assert files.push(rd.logs) == 5
    assert files.listing(rd.logs) == {"rank-0.log": 5}
    assert (tmp_path / "store/run/logs/rank-0.log").read_text() == "line\n"
    files.write_through(rd.error_file(1), '{"rank": 1}')
    assert files.read(rd.error_file(1)) == b'{"rank": 1}' and rd.error_file(1).is_file()
    # another host: an empty cache, the same run
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache-b"))
    other = RunFiles(uri)
    other.pull(other.rd.logs)
    assert other.rd.rank_log(0).read_text() == "line\n"
    other.delete(other.rd.rank_log(0))
    assert not (tmp_path / "store/run/logs/rank-0.log").exists() and not other.rd.rank_log(0).exists()
    # a store that refuses: quiet verbs say it in one warning line (wait=False: not even that), loud ones raise
    monkeypatch.setattr(storage, "upload", lambda *a: (_ for _ in ()).throw(OSError("access denied")))
    other.rd.progress.write_text("{}")
    other.push(other.rd.progress, quiet=True)
    other.push(other.rd.progress, quiet=True, wait=False)
    err = capsys.readouterr().err
    assert err.count("warning: could not upload") == 1 and f"{uri}/progress.json (OSError: access denied)" in err
    with pytest.raises(OSError):
        other.push(other.rd.progress)


def test_a_store_uri_for_a_directory_is_absolute(tmp_path):
    from torchloom.errors import UserError

    with pytest.raises(UserError, match=r"file\+store:///abs/path"):
        storage.resolve("file+store://relative/dir")


def digests(root: Path) -> dict[str, str]:
    """{path relative to root: sha256} of every file under root but torchloom's temporary names and a host's own
    note that it hashed a checkpoint copy (train/checkpoint.py's `.step-N.verified`: true of that copy only)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not TEMP_NAME.match(p.name) and not p.name.endswith(".verified")}


def test_every_file_a_run_writes_on_a_host_reaches_its_store(tmp_path, topics_csv, tiny_model_dir):
    """A forgotten push loses data only on a store, and only where no host shares a directory: here any file of
    the host's working copy that the store lacks (or holds otherwise) fails the test, with its name."""
    store = tmp_path / "store"
    uri = f"file+store://{store}/run"
    host_a = tmp_path / "host-a"
    proc = torchloom("run", "--data.path", str(topics_csv), "--model.path", tiny_model_dir, "--output.dir", uri,
                     "--train.epochs", "2", "--train.batch_size", "8", "--train.checkpoint_every", "4",
                     "--train.keep_last", "1", "--engine.workers", "2", "--tracking.enabled", "false", cache=host_a)
    assert proc.returncode == 0, proc.stderr[-3000:]
    copy = next(p for p in (host_a / "staging").iterdir() if p.is_dir())
    here, there = digests(copy), digests(store / "run")
    assert "model/model.safetensors" in here and "checkpoints" in {n.split("/")[0] for n in here}
    missing = sorted(name for name in here if name not in there)
    assert not missing, f"written on the host, never pushed: {missing}"
    differ = sorted(name for name in here if there[name] != here[name])
    assert not differ, f"the store holds another version of: {differ}"
    # but the run's ledger, kept on the store by the driver (what --overwrite may delete there)
    assert sorted(set(there) - set(here)) == ["torchloom-ledger.json"], "the store holds files this host's copy lacks"
    assert str(host_a) not in proc.stderr and f"report {uri}/report.md" in proc.stdout + proc.stderr
    # a second host with nothing: evaluates the run from the store alone, to the same numbers
    before = json.loads((store / "run/report.json").read_text())
    again = torchloom("evaluate", "--output.dir", uri, "--tracking.enabled", "false", cache=tmp_path / "host-b")
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((store / "run/report.json").read_text())
    assert after["metrics"]["accuracy"] == before["metrics"]["accuracy"]


def test_a_host_without_access_is_told_its_own_stores_credentials():
    from torchloom.engines.common import not_visible

    for uri, names in (("s3://b/run", "AWS_ACCESS_KEY_ID"), ("gs://b/run", "GOOGLE_APPLICATION_CREDENTIALS"),
                       ("abfs://c@acct.dfs.core.windows.net/run", "AZURE_STORAGE_CONNECTION_STRING")):
        line = str(not_visible(RunFiles(uri), ["hostb"]))
        assert names in line and "hostb" in line and "\n" not in line, line


def test_a_host_s_copy_is_checked_file_by_file_before_it_is_trusted(tmp_path, monkeypatch):
    """The host that trained holds data/ with its manifest alone (it streamed the shards), and a model exported
    before another host exported again (the same sizes): a stage there reads the store's, never a stale copy."""
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    uri = f"file+store://{tmp_path}/store/run"
    store = tmp_path / "store" / "run"
    for rel, content in {"torchloom-run.json": b'{"id": "r"}', "data/manifest.json": b'{"m": 1}',
                         "data/train/part-0.parquet": b"rows", "model/torchloom.json": b'{"step": 320}',
                         "model/model.safetensors": b"new-weights"}.items():
        (store / rel).parent.mkdir(parents=True, exist_ok=True)
        (store / rel).write_bytes(content)
    rd = RunDir(uri)
    for rel, content in {"torchloom-run.json": b'{"id": "r"}', "data/manifest.json": b'{"m": 1}',
                         "model/torchloom.json": b'{"step": 290}', "model/model.safetensors": b"old-weights",
                         "model/model.onnx": b"an earlier export's"}.items():
        (rd.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (rd.root / rel).write_bytes(content)
    RunFiles(rd).ensure(rd.model, rd.data)
    assert (rd.data / "train" / "part-0.parquet").read_bytes() == b"rows"
    assert (rd.model / "torchloom.json").read_bytes() == b'{"step": 320}'
    assert sorted(p.name for p in rd.model.iterdir()) == ["model.safetensors", "torchloom.json"]
    assert (rd.model / "model.safetensors").read_bytes() == b"new-weights"


def test_a_study_on_a_store_goes_up_as_it_goes(tmp_path, monkeypatch):
    """Each finished trial once (again when it ends again), the marker, and a consistent copy of optuna.db; a
    trial still running stays here until the study's end."""
    import sqlite3

    from torchloom.runs.rundir import StudyDir
    from torchloom.tune.study import push_finished

    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    sd = StudyDir(f"file+store://{tmp_path}/store/study")
    store = tmp_path / "store" / "study"
    (sd.trials / "t0").mkdir(parents=True)
    (sd.trials / "t0" / "metrics.jsonl").write_text("{}\n")
    (sd.trials / "t0" / "trial_result.json").write_text('{"status": "completed"}')
    (sd.trials / "t1").mkdir()
    (sd.trials / "t1" / "metrics.jsonl").write_text("{}\n")  # running
    sd.marker.write_text('{"format": "torchloom-study/1"}')
    with sqlite3.connect(sd.optuna_db) as db:
        db.execute("create table trials (n int)")
        db.execute("insert into trials values (1)")
    pushed: dict[str, int] = {}
    push_finished(RunFiles(sd), sd, pushed)
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) == [
        "optuna.db", "study.json", "trials/t0/metrics.jsonl", "trials/t0/trial_result.json"]
    with sqlite3.connect(store / "optuna.db") as db:
        assert db.execute("select n from trials").fetchall() == [(1,)]
    (sd.trials / "t0" / "metrics.jsonl").write_text("{}\n{}\n")  # not ended again: not pushed again
    push_finished(RunFiles(sd), sd, pushed)
    assert (store / "trials" / "t0" / "metrics.jsonl").read_text() == "{}\n"
    assert not list(sd.root.glob(".optuna.db.*"))


def test_a_fresh_start_on_a_store_empties_only_this_hosts_copy_and_never_an_input(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    files = RunFiles(f"file+store://{tmp_path}/store/run")
    copy = files.rd.root
    (copy / "data").mkdir(parents=True)
    (copy / "data" / "old.parquet").write_text("an earlier run's")
    (copy / "reviews.csv").write_text("text,label\n")  # an input someone put in the cache
    with pytest.raises(UserError, match=r"holds an input of the command .*reviews\.csv.*move that input out"):
        files.drop_copy(inputs=[str(copy / "reviews.csv")])
    assert (copy / "reviews.csv").is_file() and (copy / "data" / "old.parquet").is_file()  # nothing deleted
    files.drop_copy(copy / "data", inputs=[str(copy / "reviews.csv")])  # the input is not under data/
    assert not (copy / "data").exists() and (copy / "reviews.csv").is_file()
    with pytest.raises(ValueError):
        files.drop_copy(tmp_path)  # nothing outside this host's copy
    assert tmp_path.is_dir()
    local = RunFiles(tmp_path / "local-run")
    (tmp_path / "local-run").mkdir()
    local.drop_copy()  # a local run's directory is the run itself
    assert (tmp_path / "local-run").is_dir()
