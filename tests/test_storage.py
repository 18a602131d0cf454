"""A run on object storage, against a real S3 server (moto's, over HTTP on 127.0.0.1): the storage layer,
background checkpoint uploads, and `torchloom run --output.dir s3://...` as a user runs it, then a second
"host" (an empty staging cache) that resumes, predicts and serves from the store alone."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.runs import torchloom
from support.s3 import s3_server

pytest.importorskip("moto")

from torchloom.errors import UserError  # noqa: E402
from torchloom.model_cache import fetch_dir  # noqa: E402
from torchloom.runs.rundir import RunDir  # noqa: E402
from torchloom.runs.runfiles import RunFiles  # noqa: E402
from torchloom.store import storage  # noqa: E402

pytestmark = pytest.mark.heavy(2)  # see tests/support/schedule.py

BUCKET = "torchloom-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}



SERVER_LOG: list[Path] = []  # the S3 server's log: a line per request


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with one bucket; this process and its children reach it through
    AWS_ENDPOINT_URL, as a user's S3-compatible store."""
    logs = tmp_path_factory.mktemp("moto")
    SERVER_LOG[:] = [logs / "s3-server.log"]
    with s3_server(logs, BUCKET, CREDENTIALS) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh private cache (staging copies, downloaded models): a host that has seen nothing."""
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def uri(*parts: str) -> str:
    return storage.join(f"s3://{BUCKET}", *parts)


# -- the storage layer --------------------------------------------------------------------------


def test_objects_round_trip_and_list(s3, tmp_path):
    storage.write_bytes(uri("a/b.txt"), b"hello")
    assert storage.read_bytes(uri("a/b.txt")) == b"hello"
    assert storage.exists(uri("a/b.txt")) and not storage.exists(uri("a/none.txt"))
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "meta.json").write_text("{}")
    (tmp_path / "d" / "sub" / "x.bin").write_bytes(b"\0" * 1000)
    assert storage.push_tree(tmp_path / "d", uri("tree"), last=("meta.json",)) == 1002
    assert storage.list_files(uri("tree")) == {"meta.json": 2, "sub/x.bin": 1000}
    assert storage.pull_tree(uri("tree"), tmp_path / "back") == 2
    assert (tmp_path / "back" / "sub" / "x.bin").read_bytes() == b"\0" * 1000
    # a staged input (by_time): an object edited in place at the same size is downloaded again, an unchanged one not
    assert storage.pull_tree(uri("tree"), tmp_path / "staged", by_time=True) == 2
    assert storage.pull_tree(uri("tree"), tmp_path / "staged", by_time=True) == 0
    time.sleep(1.1)  # a store's modification times may be whole seconds
    storage.write_bytes(uri("tree/sub/x.bin"), b"\1" * 1000)
    assert storage.pull_tree(uri("tree"), tmp_path / "staged", by_time=True) == 1
    assert (tmp_path / "staged" / "sub" / "x.bin").read_bytes() == b"\1" * 1000
    storage.write_bytes(uri("tree/sub/x.bin"), b"\0" * 1000)
    with storage.open_input(uri("tree/sub/x.bin")) as f:  # a ranged read, not a download
        assert f.read_at(10, 500) == b"\0" * 10
    storage.delete_tree(uri("tree"))
    assert storage.list_files(uri("tree")) == {}
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(uri("a/none.txt"))


def test_bad_store_uris_are_one_line_before_any_work(s3):
    with pytest.raises(UserError, match=r"output.dir s3://no-such-bucket/run: the store refused a test write"
                                        r" \(the bucket does not exist\)"):
        storage.check_writable("s3://no-such-bucket/run", "output.dir")
    with pytest.raises(UserError, match=r"unknown storage scheme ftp://"):
        storage.resolve("ftp://host/x")
    with pytest.raises(UserError, match=r"data.path s3://torchloom-test/none.csv: no such object"):
        storage.check_readable(uri("none.csv"), "data.path")
    with pytest.raises(UserError, match=r"data.path s3://torchloom-test/in/\*.csv: a pattern is not looked up"):
        storage.check_readable(uri("in/*.csv"), "data.path")
    # credentials never reach a line, nor config.toml: a URI that carries them is refused
    assert storage.redact("s3://user:secret@bucket/x?X-Amz-Signature=abc") == "s3://bucket/x"
    from torchloom.config import build
    from torchloom.preflight import check_stores

    with pytest.raises(UserError, match=r"^output.dir s3://bucket/run: holds credentials") as e:
        check_stores(build(None, ["--output.dir", "s3://key:secret@bucket/run"]))
    assert "secret" not in str(e.value)


def test_a_checkpoint_counts_on_the_store_only_once_its_meta_json_is_there(s3, cache):
    """An upload cut off halfway (the files but not meta.json, written last) leaves the previous checkpoint the
    one a new host resumes from."""
    run = uri("half-upload")
    for step, files in ((2, ("model.safetensors", "trainer.pt", "meta.json")),
                        (4, ("model.safetensors", "trainer.pt"))):
        for name in files:
            storage.write_bytes(storage.join(run, "checkpoints", f"step-{step}", name), b"x")
    rd = RunDir(run)
    assert rd.root.is_relative_to(cache)
    assert RunFiles(rd).checkpoints.pull() == [2]
    assert (rd.checkpoint(2) / "meta.json").is_file() and not rd.checkpoint(4).exists()


def local_files(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def test_a_resume_downloads_the_newest_intact_checkpoint_alone_and_hashes_it_once(s3, tmp_path, monkeypatch):
    from torchloom.train import checkpoint

    run = uri("resume-newest")
    for step in (2, 4, 6):
        files = {"model.safetensors": bytes([step]) * 4000, "trainer.pt": b"t" * 100}
        meta = {"step": step, "files": {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                                        for n, b in files.items()}}
        put(storage.join(run, "checkpoints", f"step-{step}"), {**files, "meta.json": json.dumps(meta).encode()})
    hashed: list[str] = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))

    def host(name: str) -> RunDir:
        monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / name))
        return RunDir(run)

    def intact(p: Path) -> bool:
        return checkpoint.damage(p) is None

    rd = host("a")
    assert RunFiles(rd).checkpoints.pull(intact=intact) == [6, 4, 2]
    assert local_files(rd.checkpoints) >= {"step-6/model.safetensors", "step-4/meta.json", "step-2/meta.json"}
    assert not {"step-4/model.safetensors", "step-2/trainer.pt"} & local_files(rd.checkpoints)  # meta.json alone
    # the driver's check, rank 0's pull and resolve on the same host: the checkpoint is read once
    assert checkpoint.resolve("latest", rd.checkpoints) == rd.checkpoint(6)
    RunFiles(rd).checkpoints.pull(intact=intact)
    assert checkpoint.resolve("latest", rd.checkpoints) == rd.checkpoint(6)
    assert sorted(hashed) == ["model.safetensors", "trainer.pt"]
    # export (no check: it may take the best of them) makes every one whole
    RunFiles(rd).checkpoints.pull()
    assert {"step-2/model.safetensors", "step-4/trainer.pt"} <= local_files(rd.checkpoints)
    # the newest damaged on the store (same size, other bytes): a new host takes the next, and says so at resume
    storage.write_bytes(storage.join(run, "checkpoints", "step-6", "model.safetensors"), b"\xff" * 4000)
    rd = host("b")
    RunFiles(rd).checkpoints.pull(intact=intact)
    assert {"step-6/model.safetensors", "step-4/model.safetensors", "step-2/meta.json"} <= local_files(rd.checkpoints)
    assert "step-2/model.safetensors" not in local_files(rd.checkpoints)
    assert checkpoint.resolve("latest", rd.checkpoints, warn=False) == rd.checkpoint(4)
    # a file changed since it was found intact is hashed again, not trusted by its stamp
    (rd.checkpoint(4) / "trainer.pt").write_bytes(b"T" * 100)
    assert "differs from what was written" in checkpoint.damage(rd.checkpoint(4))


def put(run: str, files: dict[str, bytes]) -> None:
    for rel, content in files.items():
        storage.write_bytes(storage.join(run, rel), content)


def prepare_and_train_on(host: Path, run: str, version: int, monkeypatch) -> None:
    """The host with this cache prepares `run` (manifest `version`, a new record) and trains afresh: its step-4."""
    monkeypatch.setenv("TORCHLOOM_CACHE", str(host))
    rd = RunDir(run)
    rd.data.mkdir(parents=True, exist_ok=True)
    rd.manifest.write_bytes(b'{"run": %d}' % version)
    RunFiles(rd).push(rd.data)
    RunFiles(rd).new_identity()
    put(run, {"checkpoints/step-4/model.safetensors": b"weights %d" % version,
              "checkpoints/step-4/meta.json": b'{"run": %d}' % version})


def test_a_hosts_copy_counts_only_for_the_run_it_was_made_from(s3, tmp_path, monkeypatch):
    """Two hosts (two caches) on one URI: host B's copy of the first run (its manifest, its step-4) is not
    trusted after host A prepares again and trains afresh; a step only B has is never resumed from."""
    run = uri("reused")
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    prepare_and_train_on(host_a, run, 1, monkeypatch)
    monkeypatch.setenv("TORCHLOOM_CACHE", str(host_b))
    b = RunDir(run)
    RunFiles(b).ensure(b.manifest)
    assert RunFiles(b).checkpoints.pull() == [4] and b.manifest.read_bytes() == b'{"run": 1}'
    (b.checkpoint(8)).mkdir()  # written here, never uploaded: the other hosts cannot load it
    (b.checkpoint(8) / "meta.json").write_bytes(b'{"run": 1}')
    prepare_and_train_on(host_a, run, 2, monkeypatch)  # host A: prepare again, then a fresh training
    monkeypatch.setenv("TORCHLOOM_CACHE", str(host_b))
    b = RunDir(run)
    RunFiles(b).ensure(b.manifest)
    assert b.manifest.read_bytes() == b'{"run": 2}'
    assert RunFiles(b).checkpoints.pull() == [4] and not b.checkpoint(8).exists()
    assert (b.checkpoint(4) / "model.safetensors").read_bytes() == b"weights 2"
    # the same record, a checkpoint rewritten on the store (a restart's step-4): compared by its meta.json
    put(run, {"checkpoints/step-4/model.safetensors": b"three", "checkpoints/step-4/meta.json": b'{"run": 3}'})
    RunFiles(b).checkpoints.pull()
    assert (b.checkpoint(4) / "model.safetensors").read_bytes() == b"three"


def test_a_model_re_exported_to_the_same_uri_is_fetched_again_and_keys_never_leave_the_cache(s3, cache):
    model = uri("cached-model")
    put(model, {"config.json": b"{}", "model.safetensors": b"AAAA"})
    first = fetch_dir(model, "--model")
    assert (first / "model.safetensors").read_bytes() == b"AAAA"
    time.sleep(1.1)  # the store's modification times count in seconds
    put(model, {"model.safetensors": b"BBBB"})  # the same size: the listing's names and sizes alone match
    assert (fetch_dir(model, "--model") / "model.safetensors").read_bytes() == b"BBBB"
    import boto3  # pyarrow's client makes `a/../../x` a plain key; any other client may write it as it is

    boto3.client("s3", endpoint_url=s3).put_object(Bucket=BUCKET, Key="escape/a/../../outside", Body=b"x")
    with pytest.raises(UserError, match=r"'a/../../outside', which would be written outside this host's copy"):
        storage.pull_tree(uri("escape"), cache / "escape" / "copy")
    assert not (cache / "outside").exists() and not (cache / "escape").exists()


def test_uploads_run_behind_training_and_the_store_keeps_what_the_run_keeps(s3, cache, tmp_path):
    from torchloom.runs.runfiles_checkpoints import CheckpointUploader

    rd = RunDir(uri("uploads"))
    logged = []
    up = CheckpointUploader(RunFiles(rd), logged.append)
    for step in (1, 2, 3):
        d = rd.checkpoint(step)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(os.urandom(1 << 16))
        (d / "meta.json").write_text(json.dumps({"step": step}))
        if step == 3:  # keep_last 2, as checkpoint.prune leaves it
            import shutil

            shutil.rmtree(rd.checkpoint(1))
        blocked = up.wait()
        up.submit(d, blocked)
    totals = up.drain()
    assert totals["checkpoints_uploaded"] == 3 and [r["step"] for r in logged] == [1, 2, 3]
    assert all(r["kind"] == "checkpoint" and r["upload_s"] >= 0 and r["blocked_s"] >= 0 for r in logged)
    names = {rel.split("/")[0] for rel in storage.list_files(storage.join(rd.remote, "checkpoints"))}
    assert names == {"step-2", "step-3"}


def reads_of(prefix: str) -> list[str]:
    """The GET and HEAD requests for objects under `prefix` in the S3 server's log so far."""
    import re

    time.sleep(0.3)  # the server logs a request after answering it
    text = SERVER_LOG[0].read_text(errors="replace")
    return re.findall(rf"(?:GET|HEAD) /{BUCKET}/{re.escape(prefix)}\S* HTTP/1\.1", text)


def test_the_loader_streams_shards_from_the_store_one_get_per_row_group(s3, tmp_path):
    # The same batches as from local disk, and a request economy that a real store's per-request latency and
    # price need: each shard opened once (its size and its footer), then one ranged GET per row group read,
    # however many read-ahead threads fetch them.
    from dataclasses import replace

    import torch

    from torchloom.data import ShardedLoader
    from torchloom.data.synthetic import write_synthetic_dataset

    local = write_synthetic_dataset(tmp_path / "data", rows={"train": 600}, rows_per_group=25, rows_per_shard=150)
    storage.push_tree(tmp_path / "data", uri("loader/data"), last=("manifest.json",))
    remote = replace(local, root=uri("loader/data"))
    before = len(reads_of("loader/data/train/"))
    for rank in (0, 1):
        a, b = (list(ShardedLoader(m, "train", rank=rank, world_size=2, batch_size=4, seed=3, shuffle_buffer=64))
                for m in (local, remote))
        assert len(a) == len(b) == 75
        for x, y in zip(a, b):
            assert all(torch.equal(x[k], y[k]) for k in x)
    reads = reads_of("loader/data/train/")[before:]
    shards, groups = len(local.split("train").shards), sum(len(s.row_groups) for s in local.split("train").shards)
    assert (shards, groups) == (4, 24)
    # each rank opens a shard once (a HEAD, a footer GET) and reads each of its row groups with one GET; the
    # ranks' rows (300 each) and partitions (75) fall on row-group bounds, so the two read the 24 once in all
    heads = sum(r.startswith("HEAD") for r in reads)
    assert heads <= 2 * shards and len(reads) == 2 * heads + groups, reads


# -- the whole run on the store, as a user runs it ----------------------------------------------


@pytest.fixture(scope="module")
def store_run(s3, tmp_path_factory, tiny_model_dir):
    """`torchloom run` with its data (train, val and test files) and its run directory on the store: nothing
    shared but S3."""
    words = {"sport": "match goal team win league", "money": "bank market price shares profit",
             "music": "album song band concert guitar"}
    lines = ["body,topic"] + [f"{vocab} number {i} {' '.join(reversed(vocab.split()))},{label}"
                              for label, vocab in words.items() for i in range(30)]
    storage.write_bytes(uri("input/reviews.csv"), ("\n".join(lines) + "\n").encode())
    for split in ("val", "test"):
        held_out = ["body,topic"] + [f"{vocab} {split} text {i},{label}" for label, vocab in words.items()
                                     for i in range(4)]
        storage.write_bytes(uri(f"input/{split}.csv"), ("\n".join(held_out) + "\n").encode())
    host_a = tmp_path_factory.mktemp("host-a")
    proc = torchloom("run", "--data.path", uri("input/reviews.csv"), "--data.val_path", uri("input/val.csv"),
                     "--data.test_path", uri("input/test.csv"), "--data.text_column", "body",
                     "--data.label_column", "topic", "--model.path", tiny_model_dir,
                     "--output.dir", uri("runs/reviews"), "--prepare.spark_master", "local[2]",
                     "--train.epochs", "2", "--train.batch_size", "8", "--train.lr", "3e-3",
                     "--train.checkpoint_every", "4", "--train.keep_last", "1", "--tracking.enabled", "false",
                     cache=host_a)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, host_a


def test_run_on_the_store_leaves_the_whole_run_there(store_run):
    proc, host_a = store_run
    on_store = storage.list_files(uri("runs/reviews"))
    for name in ("config.toml", "data/manifest.json", "baseline.json", "metrics.jsonl", "train_result.json",
                 "model/config.json", "model/model.safetensors", "report.md", "report.json", "plots/confusion.png",
                 "summary.json"):
        assert name in on_store, name
    assert any(n.startswith("data/train/") and n.endswith(".parquet") for n in on_store)
    # keep_last 1 (and the best): the store keeps what the run keeps, each checkpoint whole
    steps = {n.split("/")[1] for n in on_store if n.startswith("checkpoints/")}
    assert 1 <= len(steps) <= 2 and all(f"checkpoints/{s}/meta.json" in on_store for s in steps)
    summary = json.loads(storage.read_bytes(uri("runs/reviews/summary.json")))
    assert summary["run_dir"] == uri("runs/reviews") and summary["model_dir"] == uri("runs/reviews/model")
    records = [json.loads(x) for x in storage.read_bytes(uri("runs/reviews/metrics.jsonl")).splitlines()]
    uploads = [r for r in records if r["kind"] == "checkpoint"]
    assert uploads and all(r["upload_s"] >= 0 and r["blocked_s"] >= 0 for r in uploads)
    assert json.loads(storage.read_bytes(uri("runs/reviews/train_result.json")))["uploads"]["checkpoints_uploaded"]
    assert summary["uploads"]["checkpoints_uploaded"] == len(uploads) and summary["uploads"]["blocked_s"] >= 0
    assert "testing-secret" not in proc.stdout + proc.stderr
    # the input is named as the user gave it (the embedded Spark read a local copy of it)
    manifest = json.loads(storage.read_bytes(uri("runs/reviews/data/manifest.json")))
    assert manifest["inputs"]["path"] == uri("input/reviews.csv")
    for split in ("val", "test"):  # the held-out files too
        assert manifest["inputs"][f"{split}_path"] == uri(f"input/{split}.csv"), manifest["inputs"]
        assert manifest["splits"][split]["rows"] == 12
        assert f"prepare: reading {uri(f'input/{split}.csv')} (csv) as the {split} split" in proc.stderr
    assert f"prepare: {uri('input/reviews.csv')} (csv) -> {uri('runs/reviews/data')}" in proc.stderr
    assert f"prepare: reading {uri('input/reviews.csv')} (csv)" in proc.stderr
    assert re.search(rf"export: step-\d+ -> {re.escape(uri('runs/reviews/model'))}\n", proc.stderr), proc.stderr
    assert str(host_a) not in proc.stderr  # every line names the store's objects, never this host's working copy


def test_another_host_resumes_and_predicts_from_the_store_alone(store_run, tmp_path, tiny_model_dir):
    proc, host_a = store_run
    # predict from the model URI on a host that has nothing: the same answers as from the run's local copy
    text = "match goal team win league"
    remote = torchloom("predict", "--model", uri("runs/reviews/model"), text, cache=tmp_path / "host-b")
    assert remote.returncode == 0, remote.stderr[-2000:]
    staged = next(p for p in (host_a / "staging").iterdir() if p.is_dir()) / "model"  # beside it: its lock
    local = torchloom("predict", "--model", str(staged), text, cache=tmp_path / "host-c")
    assert json.loads(remote.stdout.splitlines()[0]) == json.loads(local.stdout.splitlines()[0])
    # resume on a third host: data and the newest complete checkpoint come from the store
    args = ("train", "--output.dir", uri("runs/reviews"), "--train.resume", "latest", "--train.epochs", "3",
            "--engine.workers", "1", "--tracking.enabled", "false", "--train.batch_size", "8")
    wrong = torchloom(*args, "--model.path", "", cache=tmp_path / "host-d")  # the default model, not the run's
    assert wrong.returncode != 0 and f"trained from model.path {tiny_model_dir}" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    resumed = torchloom(*args, cache=tmp_path / "host-d")  # the run's own model, as its config.toml on the store says
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(storage.read_bytes(uri("runs/reviews/train_result.json")))
    assert result["resumed_at_step"] and result["steps"] > result["resumed_at_step"]
    # the run's history is appended to from the new host, never replaced by its lines alone
    steps = {r.get("step") for r in map(json.loads, storage.read_bytes(uri("runs/reviews/metrics.jsonl")).splitlines())
             if r.get("kind") == "train"}
    assert min(steps) < result["resumed_at_step"] < max(steps), sorted(steps)


def test_a_store_that_cannot_be_used_is_one_line_before_spark_starts(s3, tmp_path):
    started = time.monotonic()
    proc = torchloom("run", "--output.dir", "s3://no-such-bucket/run", "--tracking.enabled", "false",
                     cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("torchloom: error:")]
    assert "output.dir s3://no-such-bucket/run: the store refused a test write (the bucket does not exist)" in line
    assert "prepare:" not in proc.stderr and time.monotonic() - started < 60
    proc = torchloom("run", "--data.path", uri("nothing-here.csv"), "--output.dir", uri("runs/none"),
                     "--tracking.enabled", "false", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "data.path s3://torchloom-test/nothing-here.csv: no such object" in proc.stderr


def test_spark_batch_scoring_executors_fetch_the_model_from_the_store_themselves(store_run, tmp_path):
    # The executors get the model's URI, not the driver's copy: each host fetches it into its own cache (here
    # the executors' cache is another directory than the driver's, through spark.executorEnv).
    import pyarrow.parquet as pq

    texts = ["match goal team win league", "bank market price shares profit", "album song band concert guitar"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    conf = tmp_path / "spark-conf"
    conf.mkdir()
    executors = tmp_path / "executors-cache"
    (conf / "spark-defaults.conf").write_text(f"spark.executorEnv.TORCHLOOM_CACHE {executors}\n")
    os.environ["SPARK_CONF_DIR"] = str(conf)  # the suite's JVM options stay in SPARK_SUBMIT_OPTS (support/spark_jvm.py)
    try:
        proc = torchloom("predict", "--model", uri("runs/reviews/model"), "--input", str(src), "--output",
                         str(tmp_path / "scored"), "--score-with", "spark", "--spark-master", "local[1]",
                         cache=tmp_path / "driver-cache", process=True)  # a JVM of its own reads SPARK_CONF_DIR
    finally:
        os.environ.pop("SPARK_CONF_DIR")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(executors.glob("models/*/model.safetensors")), "the executors did not fetch the model themselves"
    scored = sorted(pq.read_table(tmp_path / "scored").to_pylist(), key=lambda r: r["id"])
    local = torchloom("predict", "--model", uri("runs/reviews/model"), *texts, cache=tmp_path / "driver-cache")
    expected = [json.loads(line) for line in local.stdout.splitlines()]
    assert [r["label"] for r in scored] == [e["label"] for e in expected]
    assert all(abs(r["score"] - e["score"]) < 1e-5 for r, e in zip(scored, expected))


def store_spark():
    """A local[2] Spark whose Python workers reach this module's store.

    The executors need the store's endpoint and credentials in their environment, as on a cluster. This
    process's JVM (started by an earlier test) runs its Python workers with the environment it started with,
    so a session of this module's own hands them over (the shared `spark` fixture starts its own again when it
    finds it stopped)."""
    from pyspark.sql import SparkSession

    from torchloom.config.schema import PrepareConfig
    from torchloom.etl.session import get_spark

    store_env = {f"spark.executorEnv.{k}": os.environ[k] for k in ("AWS_ENDPOINT_URL", *CREDENTIALS)}
    active = SparkSession.getActiveSession()
    if active is not None:
        conf = active.sparkContext.getConf()
        if all(conf.get(k) == v for k, v in store_env.items()):
            return active
        active.stop()
    return get_spark(PrepareConfig(spark_master="local[2]", partitions=4, spark_conf=store_env))


def test_executors_writing_through_the_store_give_the_shards_spark_writes(s3, cache, tmp_path, tiny_model_dir):
    # A Spark cluster whose hosts do not see the driver's working copy writes prepare's rows through the store
    # (etl/store_write.py): the same files, rows in the same order and the same row groups as Spark's writer,
    # rejected rows included; nothing is left under the temporary prefix.
    import pyarrow.parquet as pq

    from torchloom.config.schema import Config
    from torchloom.etl.prepare import prepare

    spark = store_spark()
    words = ["match goal team", "bank market price", "album song band"]
    lines = ["text,label"] + [f"{w} {i} {'x' * (i % 7)},{w.split()[0]}" for w in words for i in range(200)]
    lines += [",match", "   ,bank"]  # set aside: empty texts
    src = tmp_path / "in.csv"
    src.write_text("\n".join(lines) + "\n")
    cfg = Config()
    cfg.data.path, cfg.model.path = str(src), tiny_model_dir
    cfg.prepare.rows_per_group, cfg.prepare.partitions = 64, 3
    direct = prepare(cfg, str(tmp_path / "direct"), spark=spark)
    through = prepare(cfg, str(tmp_path / "through"), spark=spark, store=uri("prep-through"))
    assert direct.splits.keys() == through.splits.keys() and direct.counts == through.counts
    for name, split in direct.splits.items():
        other = through.splits[name]
        assert [(s.path, s.rows, s.row_groups) for s in split.shards] == \
            [(s.path, s.rows, s.row_groups) for s in other.shards], name
        assert len(split.shards) > 1 or name != "train"
        for a, b in zip(split.shards, other.shards):
            ta, tb = pq.read_table(tmp_path / "direct" / a.path), pq.read_table(tmp_path / "through" / b.path)
            assert ta.column_names == tb.column_names and ta.to_pylist() == tb.to_pylist()
    assert sorted(pq.read_table(tmp_path / "through" / "rejected").column("reason").to_pylist()) == \
        sorted(pq.read_table(tmp_path / "direct" / "rejected").column("reason").to_pylist())
    assert direct.fingerprint == through.fingerprint
    assert storage.list_files(uri("prep-through")) == {}


def test_an_input_on_the_store_is_read_by_the_tasks_as_spark_reads_it_from_disk(s3, cache, tmp_path,
                                                                                tiny_model_dir):
    # A Spark cluster with no Hadoop connector for s3:// (this one has none) reads data.path on the store
    # with inputs/store_read.py: the tasks stream the objects with pyarrow and Spark's own parsers parse them.
    # Each input gives the rows Spark's reader gives for the same files on local disk.
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchloom.config.schema import Config, DataConfig
    from torchloom.etl.prepare import prepare
    from torchloom.inputs.locate import resolve_format
    from torchloom.inputs.read import read_input, spark_reads

    spark = store_spark()
    assert not spark_reads(spark, uri("x.csv")) and spark_reads(spark, f"file://{tmp_path}")
    d = tmp_path / "in"
    (d / "csv").mkdir(parents=True)
    tricky = ('\ufeffbody,topic,extra\n"line one\nline two, ""quoted""",sport,1\n\n   ,tech,2\n"",money,3\nshort\n'
              '"a","b","c","d"\nplain text,,5\nsay "hi" there,tech,6\n"never closed,tech\nmore\n')
    (d / "csv" / "a.csv").write_bytes(tricky.encode())
    (d / "csv" / "b.csv").write_bytes(b'body,topic,extra\r\n"crlf\r\nline",sport,1\r\n\r\nnot utf-8 \xff,tech,2\r\n')
    (d / "csv" / "_SUCCESS").write_bytes(b"")
    (d / "gz").mkdir()
    (d / "gz" / "a.csv.gz").write_bytes(gzip.compress(tricky.encode()))
    (d / "t.tsv").write_text('body\ttopic\ntab, separated\tsport\n"quoted\ttab"\ttech\nno label\n')
    (d / "j.jsonl").write_text('{"body": "x y", "topic": 5}\n\n{"body": "z", "topic": "money"}\nnot json\n'
                               '{"topic": "t"}\n{"body": 2.5, "topic": true, "more": null}\n')
    pq.write_table(pa.table({"body": ["p", "q", None, "r"], "topic": [1, 2, 3, None]}), d / "p.parquet",
                   row_group_size=2)
    for label, texts in (("sport", ["goal\nmatch", "team"]), ("tech", ["chip"])):
        (d / "folder" / label).mkdir(parents=True)
        for i, text in enumerate(texts):
            (d / "folder" / label / f"{i}.txt").write_text(text)
    storage.push_tree(d, uri("input"))
    # the objects hold the files' bytes: a .gz is not gzipped again on its way up
    with storage.open_input(uri("input/gz/a.csv.gz")) as f:
        assert f.read() == (d / "gz" / "a.csv.gz").read_bytes()

    cfg = DataConfig(text_column="body", label_column="topic")
    for rel in ("csv", "gz/a.csv.gz", "t.tsv", "j.jsonl", "p.parquet", "folder"):
        remote, local = uri("input", rel), str(d / rel)
        assert resolve_format(cfg, remote) == resolve_format(cfg, local), rel  # a prefix by its listing
        ours = read_input(spark, cfg, remote, resolve_format(cfg, remote))
        theirs = read_input(spark, cfg, local, resolve_format(cfg, local))
        rows = sorted(map(tuple, ours.select("text", "label").collect()), key=repr)
        assert rows == sorted(map(tuple, theirs.select("text", "label").collect()), key=repr), rel
        assert len(rows) >= 3, rel
        assert {r.source for r in ours.select("source").distinct().collect()} <= \
            {uri("input", rel, f) for f in storage.list_files(uri("input", rel)) or [""]}, rel

    # a column that is not there: one line naming what is
    for rel in ("csv", "j.jsonl", "p.parquet"):
        with pytest.raises(UserError, match=rf"data.path {uri('input', rel)}: no column 'label'; columns found:"
                                            r" body, (more, )?topic"):
            read_input(spark, DataConfig(text_column="body", label_column="label"), uri("input", rel),
                       resolve_format(cfg, uri("input", rel)))

    # an object that is not what its name says: one line naming it, whether the driver or a task reads it
    storage.write_bytes(uri("bad", "a.parquet"), b"PAR1 not really")
    with pytest.raises(UserError, match=rf"^data.path {uri('bad', 'a.parquet')}: cannot be read \(.*Parquet"):
        read_input(spark, cfg, uri("bad", "a.parquet"), "parquet")
    storage.upload(d / "csv" / "a.csv", uri("bad", "csv", "a.csv"))
    storage.write_bytes(uri("bad", "csv", "b.csv.gz"), b"\x1f\x8b\x08\x00 not gzip at all" * 50)

    # prepare from the store: the same data as from the same file on disk
    words = ["match goal team", "bank market price", "album song band"]
    lines = ["text,label"] + [f'"{w} {i}\n{"x" * (i % 7)}",{w.split()[0]}' for w in words for i in range(60)]
    (tmp_path / "p.csv").write_text("\n".join([*lines, ",match"]) + "\n")
    storage.upload(tmp_path / "p.csv", uri("p.csv"))
    full = Config()
    full.model.path, full.prepare.partitions = tiny_model_dir, 2
    full.data.path = uri("p.csv")
    remote = prepare(full, str(tmp_path / "from-store"), spark=spark)
    full.data.path = str(tmp_path / "p.csv")
    local = prepare(full, str(tmp_path / "from-disk"), spark=spark)
    assert remote.fingerprint == local.fingerprint and remote.counts == local.counts
    assert remote.counts["rows_read"] == 181
    full.data.path, full.data.text_column, full.data.label_column = uri("bad", "csv"), "body", "topic"
    with pytest.raises(UserError, match=rf"^data.path {uri('bad', 'csv', 'b.csv.gz')}: cannot be read \(.*\); check"):
        prepare(full, str(tmp_path / "from-bad"), spark=spark)
    assert not (tmp_path / "from-bad").exists()

    # the Spark baseline on the shards on the store (a cluster's executors do not see the driver's copy)
    from dataclasses import replace

    from torchloom.baseline import spark as baseline_spark
    from torchloom.manifest import read as read_manifest

    storage.push_tree(tmp_path / "from-store", uri("prepared"), last=("manifest.json",))
    here = read_manifest(tmp_path / "from-store")
    there = replace(here, root=uri("prepared"))
    assert there.shard_uri(there.split("train").shards[0]).startswith("s3://")
    assert baseline_spark.fit(spark, there, ["test"]).confusion == baseline_spark.fit(spark, here, ["test"]).confusion


RANK_ON_A_HOST = """
import os, sys, time
from torchloom.engines import worker
from torchloom.runs.runfiles import RunFiles
worker.REMOTE_LOG_S = 0.5
files = RunFiles(sys.argv[1])
rd = files.rd
worker.capture_output(files, 0)
print("line from " + sys.argv[2], flush=True)
placement = rd.placement_file("l1", 0, 0)
worker.write_json(placement, {"host": sys.argv[2]})
worker.start_heartbeat(placement, files, rd.rank_log(0))
time.sleep(3)
os._exit(9)  # the host is gone: no upload at the end
"""


def test_a_ranks_log_on_the_store_keeps_the_lines_of_a_host_that_was_lost(s3, tmp_path):
    # Ranks upload their log while they run; a rank that starts again on another host (an empty cache) goes on
    # from the store's log instead of replacing it.
    run = uri("rank-log-run")
    for host in ("first", "second"):
        proc = subprocess.run([sys.executable, "-c", RANK_ON_A_HOST, run, host], capture_output=True, text=True,
                              env={**os.environ, "TORCHLOOM_CACHE": str(tmp_path / f"cache-{host}")}, timeout=120)
        assert proc.returncode == 9, proc.stderr[-2000:]
    assert storage.read_bytes(storage.join(run, "logs/rank-0.log")).decode() == "line from first\nline from second\n"


def test_the_driver_shows_the_lines_of_ranks_on_other_hosts_from_the_store(s3, cache, tmp_path):
    # Rank 0 writes its log on this host; rank 1 is on another host, whose log reaches the store only. Each line
    # is shown once with its rank's prefix; a log that another host now holds (shorter) is shown from its start.
    import io
    import time

    from torchloom.engines.progress import LogTailer

    rd = RunDir(uri("tailed"))
    rd.logs.mkdir(parents=True, exist_ok=True)
    other = tmp_path / "rank-1.log"
    other.write_text("old attempt line\n")
    storage.upload(other, uri("tailed", "logs", "rank-1.log"))  # before this launch: not shown
    out = io.StringIO()

    def shown_until(needle: str) -> str:
        deadline = time.monotonic() + 20
        while needle not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.2)
        return out.getvalue()

    with LogTailer(RunFiles(rd), stream=out, interval=0.2):
        (rd.logs / "rank-0.log").write_text("rank 0 here\n")
        other.write_text("old attempt line\nrank 1 on another host\n")
        storage.upload(other, uri("tailed", "logs", "rank-1.log"))
        shown_until("[rank1] rank 1 on another host")
        storage.upload(rd.logs / "rank-0.log", uri("tailed", "logs", "rank-0.log"))  # its own upload: not twice
        other.write_text("a new host\n")
        storage.upload(other, uri("tailed", "logs", "rank-1.log"))
        shown_until("[rank1] a new host")
        time.sleep(2.5)
    assert out.getvalue().splitlines() == ["[rank0] rank 0 here", "[rank1] rank 1 on another host",
                                           "[rank1] a new host"], out.getvalue()


# -- the lease: one driver writes a run on a store at a time ------------------------------------------------


def test_a_lease_keeps_a_second_driver_out_until_it_is_released_or_expires(s3, capsys, monkeypatch):
    from torchloom.runs import lease

    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    run = uri("leased")
    first = lease.Lease(run, "train", seconds=1.2, owner={"host": "host-a", "pid": 11, "id": "a" * 32})
    second = lease.Lease(run, "prepare", owner={"host": "host-b", "pid": 22, "id": "b" * 32})
    with first:
        held = lease.read(run)
        assert held["host"] == "host-a" and held["stage"] == "train"
        time.sleep(0.6)  # renewed every third of its 1.2 s: it stays ahead of the clock while the stage runs
        assert lease.read(run)["expires"] > held["expires"]
        with pytest.raises(UserError, match=r"^output.dir s3://torchloom-test/leased: another torchloom writes this"
                                            r" run: train on host host-a \(pid 11, lease aaaaaaaa\), its lease until"
                                            r" .* UTC .*; wait for it to end, or if that process is gone, wait \d+ s"
                                            r" or remove s3://torchloom-test/leased/lease.json$"):
            second.acquire()
    assert lease.read(run) is None and not storage.exists(storage.join(run, "lease.json"))  # released: removed
    # a driver that died holding it: its lease expires, and the next one takes it over with a warning
    storage.write_bytes(storage.join(run, "lease.json"), json.dumps(
        {"format": lease.FORMAT, "host": "gone", "pid": 1, "id": "c" * 32, "stage": "run",
         "expires": time.time() - 1}).encode())
    with second:
        assert lease.read(run)["host"] == "host-b"
    assert "took over the expired lease of run on host gone" in capsys.readouterr().err
    # the lease is never the reason a prefix counts as someone else's, nor deleted by --overwrite
    from torchloom.runs.runrecord import new_record

    storage.write_bytes(storage.join(run, "lease.json"), b"{}")
    RunFiles(run).place.check_own()
    put(run, {"torchloom-run.json": json.dumps(new_record()).encode()})
    RunFiles(run).place.replace()
    assert storage.list_files(run) == {"lease.json": 2}


def test_a_second_torchloom_train_on_a_leased_run_is_refused_in_one_line(s3, tmp_path):
    from torchloom.runs import lease

    run = uri("leased-cli")
    for command in ("train", "export", "evaluate"):  # every stage that writes the run holds the lease
        with lease.Lease(run, "train", owner={"host": "host-a", "pid": 11, "id": "a" * 32}):
            proc = torchloom(command, "--output.dir", run, "--tracking.enabled", "false", cache=tmp_path / "cache")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("torchloom: error:")]
        assert "another torchloom writes this run: train on host host-a (pid 11" in line and "lease.json" in line


def test_a_tune_study_on_the_store_keeps_its_study_trials_and_best_model_there(s3, tmp_path, tiny_model_dir):
    """`tune --output.dir s3://...` (Optuna, two tiny trials): the study, each trial's run and the best model reach
    the store; a second host resumes it from the store alone."""
    pytest.importorskip("optuna")
    words = {"sport": "match goal team win league", "money": "bank market price shares profit"}
    rows = ["text,label"] + [f"{v} number {i},{k}" for k, v in words.items() for i in range(24)]
    data = tmp_path / "topics.csv"
    data.write_text("\n".join(rows) + "\n")
    study = uri("studies/topics")
    args = ("tune", "--data.path", str(data), "--model.path", tiny_model_dir, "--output.dir", study,
            "--prepare.spark_master", "local[1]", "--train.precision", "fp32", "--train.batch_size", "8",
            "--train.epochs", "1", "--eval.baseline", "false", "--tune.backend", "optuna", "--engine.workers", "1",
            "--tracking.enabled", "false", "--tune.space", '{"train.lr" = "loguniform(1e-4, 1e-2)"}')
    first = torchloom(*args, "--tune.trials", "2", cache=tmp_path / "host-a")
    assert first.returncode == 0, first.stderr[-3000:]
    on_store = storage.list_files(study)
    for name in ("study.json", "optuna.db", "results.csv", "best_config.toml", "model/config.json",
                 "data/manifest.json", "torchloom-run.json"):
        assert name in on_store, (name, sorted(on_store)[:20])
    trials = {rel.split("/")[1] for rel in on_store if rel.startswith("trials/")}
    assert len(trials) == 2 and all(f"trials/{t}/train_result.json" in on_store for t in trials)
    again = torchloom(*args, "--tune.trials", "3", cache=tmp_path / "host-b")  # another host, nothing local
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming study" in again.stderr + again.stdout
    assert len({rel.split("/")[1] for rel in storage.list_files(study) if rel.startswith("trials/")}) == 3
