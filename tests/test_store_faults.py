"""Store faults with the real server: the S3 server (moto, over HTTP) behind a TCP proxy on 127.0.0.1 that the
test can cut (the store stops answering, halfway through a checkpoint's upload) or slow down (latency on every
chunk). Training runs on the local engine with its run on s3://; nothing is mocked."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.net import free_port
from support.s3 import s3_server

pytest.importorskip("moto")

from torchloom.data.synthetic import write_synthetic_dataset  # noqa: E402
from torchloom.store import errors as store_errors
from torchloom.store import storage  # noqa: E402

pytestmark = pytest.mark.heavy(10)  # see tests/support/schedule.py

BUCKET = "faults"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "faults", "AWS_SECRET_ACCESS_KEY": "faults-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


class Proxy:
    """Forwards 127.0.0.1:port to the S3 server. `cut_on(marker)`: the first request whose bytes hold
    `marker` closes every connection and every later one (the store is gone) until `restore()`.
    `delay_s`: each chunk from the client waits this long (a slow store)."""

    def __init__(self, target: int):
        self.target, self.port = target, free_port()
        self.marker: bytes | None = None
        self.down = threading.Event()
        self.cut_seen = threading.Event()
        self.delay_s = 0.0
        self.conns: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_on(self, marker: bytes) -> None:
        self.marker = marker

    def restore(self) -> None:
        self.marker = None
        self.down.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            if self.down.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if from_client and self.marker and self.marker in chunk:
                    self._cut()
                    return
                if from_client and self.delay_s:
                    time.sleep(self.delay_s)
                if self.down.is_set():
                    return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def _cut(self) -> None:
        self.down.set()
        self.cut_seen.set()
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.conns.clear()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The S3 server, a proxy in front of it, the bucket, and prepared data; this process talks to the
    server through the proxy as the training processes do."""
    made: dict[str, Proxy] = {}

    def front(port: int) -> int:
        made["proxy"] = Proxy(port)
        return made["proxy"].port

    with s3_server(tmp_path_factory.mktemp("moto"), BUCKET, CREDENTIALS, front=front):
        data = tmp_path_factory.mktemp("prepared") / "data"
        write_synthetic_dataset(data, rows={"train": 48, "val": 16, "test": 16})  # 6 steps of 8
        yield made["proxy"], data


def start_train(run: str, data: Path, model: str, cache: Path, *extra: str, retry_s: float = 0) -> subprocess.Popen:
    """retry_s: the store's retry window (TORCHLOOM_STORE_RETRY_S); none by default, so a store cut for good fails
    in seconds (the window's own rules: test_transient_store_errors_are_retried_within_a_window_...)."""
    storage.push_tree(data, storage.join(run, "data"), last=("manifest.json",))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TORCHLOOM_CACHE": str(cache), "PYTHONUNBUFFERED": "1",
           store_errors.RETRY_ENV: str(retry_s)}
    return subprocess.Popen([sys.executable, "-m", "torchloom", "train", "--output.dir", run, "--model.path", model,
                             "--train.precision", "fp32", "--train.batch_size", "8", "--engine.workers", "2",
                             "--engine.threads_per_worker", "1", "--train.epochs", "1", "--train.checkpoint_every",
                             "3", "--train.keep_last", "5", "--tracking.enabled", "false", "--engine.max_restarts",
                             "0", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def checkpoints_on_store(run: str) -> dict[int, bool]:
    """{step: complete (meta.json there)} of the checkpoints on the store."""
    out: dict[int, bool] = {}
    for rel in storage.list_files(storage.join(run, "checkpoints")):
        step = int(rel.split("/")[0].removeprefix("step-"))
        out[step] = out.get(step, False) or rel.endswith("/meta.json")
    return out


def test_the_store_stopping_halfway_through_an_upload_leaves_the_previous_checkpoint_the_one_resumed(
        store, tiny_model_dir, tmp_path):
    proxy, data = store
    run = f"s3://{BUCKET}/runs/cut"
    proxy.cut_on(f"/{BUCKET}/runs/cut/checkpoints/step-6/".encode())  # the second checkpoint's first object
    proc = start_train(run, data, tiny_model_dir, tmp_path / "host-a")
    out, err = proc.communicate(timeout=300)
    assert proxy.cut_seen.is_set(), err[-3000:]
    # training fails with one line that names the store, not a traceback
    assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("torchloom: error:")]
    assert len(errors) == 1 and "s3://faults/runs/cut" in errors[0], err[-3000:]
    proxy.restore()
    # the driver could not remove its lease from a store that was away: it would hold the run for LEASE_S; the
    # way out its refusal names is to remove the object
    assert storage.exists(storage.join(run, "lease.json"))
    storage.delete(storage.join(run, "lease.json"))
    on_store = checkpoints_on_store(run)
    assert on_store.get(3) is True and not on_store.get(6), on_store  # step 6 never completed
    # another host resumes from the store: the newest complete checkpoint is step 3
    resumed = start_train(run, data, tiny_model_dir, tmp_path / "host-b", "--train.resume", "latest")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    result = json.loads(storage.read_bytes(storage.join(run, "train_result.json")))
    assert result["resumed_at_step"] == 3 and result["steps"] == 6 and result["uploads"]["checkpoints_uploaded"] == 1
    assert checkpoints_on_store(run).get(6) is True


def test_transient_store_errors_are_retried_within_a_window_and_a_permanent_one_is_one_line_at_once(
        monkeypatch, capsys, tmp_path):
    from torchloom.engines.common import failure_cause
    from torchloom.engines.worker import record_error
    from torchloom.errors import UserError
    from torchloom.runs.rundir import RunDir
    from torchloom.runs.runfiles import RunFiles

    monkeypatch.setattr(store_errors, "BACKOFF_S", (0.01, 0.02))
    monkeypatch.setenv(store_errors.RETRY_ENV, "5")
    calls: list[str] = []

    def fails_with(*messages: str):
        def op():
            calls.append("try")
            if len(calls) <= len(messages):
                raise OSError(messages[len(calls) - 1])
            return "done"
        calls.clear()
        return op

    slow = "AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."
    http_503 = "AWS Error UNKNOWN (HTTP status 503) during GetObject operation: Service Unavailable"
    assert store_errors.attempts("s3://b/k", "write it", fails_with(slow, http_503)) == "done" and len(calls) == 3
    assert capsys.readouterr().err.count("s3://b/k: could not write it") == 1  # one warning per operation
    denied = "AWS Error ACCESS_DENIED during PutObject operation: Access Denied"
    with pytest.raises(UserError, match=r"s3://b/k: cannot write it \(access denied") as raised:
        store_errors.attempts("s3://b/k", "write it", fails_with(denied))
    assert len(calls) == 1 and not isinstance(raised.value, store_errors.StoreUnavailable)
    monkeypatch.setenv(store_errors.RETRY_ENV, "0.2")
    down = "AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to server"
    started = time.monotonic()
    with pytest.raises(store_errors.StoreUnavailable, match=r"does not answer.*, for 0.2 s\).*TORCHLOOM_STORE_RETRY_S"):
        store_errors.attempts("s3://b/k", "look it up", fails_with(*[down] * 1000))
    assert 0.2 <= time.monotonic() - started < 1.0 and 5 < len(calls) < 30
    monkeypatch.setenv(store_errors.RETRY_ENV, "soon")
    with pytest.raises(UserError, match=r"TORCHLOOM_STORE_RETRY_S='soon': not a number of seconds"):
        store_errors.retry_window()
    # in a worker, a store that outlasted the window is restartable like a lost process; a user error is not
    rd = RunDir(tmp_path / "run")
    record_error(RunFiles(rd), 0, store_errors.StoreUnavailable("s3://b/k: cannot write it"), "L1")
    assert failure_cause(rd, "L1") is None
    record_error(RunFiles(rd), 1, UserError("data.path x: no such file"), "L1")
    assert failure_cause(rd, "L1")["rank"] == 1


def test_a_store_away_for_three_seconds_during_a_checkpoint_costs_a_retry_not_the_run(store, tiny_model_dir, tmp_path):
    proxy, data = store
    run = f"s3://{BUCKET}/runs/blip"
    proxy.cut_on(f"/{BUCKET}/runs/blip/checkpoints/step-6/".encode())  # a rank's first object of the checkpoint

    def restore_later() -> None:
        if proxy.cut_seen.wait(timeout=300):
            time.sleep(3.0)  # longer than the S3 client's own few quick retries
            proxy.restore()

    proxy.cut_seen.clear()
    threading.Thread(target=restore_later, daemon=True).start()
    proc = start_train(run, data, tiny_model_dir, tmp_path / "host", retry_s=30)
    out, err = proc.communicate(timeout=300)
    proxy.restore()
    assert proxy.cut_seen.is_set(), err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    # the warning, on the driver's terminal or in the worker's own log on this host (the tail may end first)
    logs = [p.read_text(errors="replace") for p in (tmp_path / "host").rglob("*") if p.is_file() and "logs" in p.parts]
    assert any(re.search(r"checkpoints/step-6\S*: could not .*retrying for up to 30 s", x) for x in [err, *logs]
               ), err[-3000:]
    result = json.loads(storage.read_bytes(storage.join(run, "train_result.json")))
    assert result["steps"] == 6 and result["uploads"]["checkpoints_uploaded"] == 2
    assert checkpoints_on_store(run) == {3: True, 6: True}


def test_a_slow_store_makes_training_wait_only_for_the_upload_still_in_flight(store, tiny_model_dir, tmp_path):
    proxy, data = store
    run = f"s3://{BUCKET}/runs/slow"
    proxy.delay_s = 0.02  # every chunk from the client: a slow link to the store
    try:
        proc = start_train(run, data, tiny_model_dir, tmp_path / "host", "--train.checkpoint_every", "2",
                           "--train.keep_last", "10")
        out, err = proc.communicate(timeout=600)
    finally:
        proxy.delay_s = 0.0
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(x) for x in storage.read_bytes(storage.join(run, "metrics.jsonl")).splitlines()]
    uploads = sorted((r for r in records if r["kind"] == "checkpoint"), key=lambda r: r["step"])
    assert [r["step"] for r in uploads] == [2, 4, 6]
    # backpressure: a checkpoint waits for the previous upload and for nothing else (at most its upload time)
    for before, r in zip(uploads, uploads[1:]):
        assert r["blocked_s"] <= before["upload_s"] + 0.5, (before, r)
    assert uploads[0]["blocked_s"] < 0.5 and any(r["blocked_s"] > 0 for r in uploads[1:])
    assert checkpoints_on_store(run) == {2: True, 4: True, 6: True}
