"""torchloom as a Spark Connect client: prepare and train through `sc://` with no SparkContext.

A real Spark Connect server (pyspark's own jars) runs `local-cluster[2,1,1024]` on 127.0.0.1, so the
workers are executor tasks of the server's cluster; the torchloom process is a client with no JVM.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.engine_reference import COMMON, LAST, assert_same_weights, new_run, reference
from support.net import free_port
from support.spark_jvm import JVM_ENV

pyspark = pytest.importorskip("pyspark")
pytestmark = pytest.mark.heavy(4)  # see tests/support/schedule.py
SERVER = "org.apache.spark.sql.connect.service.SparkConnectServer"
JARS = Path(pyspark.__file__).parent / "jars"


def connect_unavailable() -> str | None:
    if not any(p.name.startswith("spark-connect_") for p in JARS.glob("*.jar")):
        return f"pyspark has no Spark Connect server jar in {JARS}"
    try:
        import grpc_status  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError as e:
        return f"Spark Connect's client libraries are missing ({e}); pip install 'torchloom[spark]'"
    return None


reason = connect_unavailable()
if reason:
    pytest.skip(reason, allow_module_level=True)



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """sc://127.0.0.1:PORT of a Spark Connect server on a local cluster of two executors."""
    tmp = tmp_path_factory.mktemp("connect")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k in JVM_ENV or not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", SPARK_LOG_DIR=str(tmp), TMPDIR=str(tmp))
    log = tmp / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--class", SERVER,
             "--master", "local-cluster[2,1,1024]", "--conf", "spark.ui.enabled=false",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Spark Connect server started" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("connect-ref"))


def torchloom(args: list[str], tmp: Path, expect: int = 0) -> subprocess.CompletedProcess:
    """The command in a process of its own (support.command's process=True): a Spark Connect client, without this
    process's classic Spark settings (its SPARK_*, PYSPARK_*, TORCHLOOM_* but the suite's JVM options)."""
    from support.command import torchloom as run

    unset = {k: None for k in os.environ if k not in JVM_ENV and k.startswith(("SPARK_", "PYSPARK_", "TORCHLOOM_"))}
    proc = run(*args, env={**unset, "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(tmp)}, timeout=400,
               process=True)
    assert proc.returncode == expect, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def test_train_through_spark_connect_gives_the_local_weights(server, setup, tmp_path):
    rd = new_run(tmp_path, setup["data"], "connect")
    torchloom(["train", "--engine.name", "spark", "--prepare.spark_master", server, "--output.dir", str(rd),
               "--model.path", setup["model"], "--tracking.enabled", "false", *COMMON], tmp_path)
    assert_same_weights(setup["ref"] / "checkpoints" / LAST, rd / "checkpoints" / LAST)


def test_run_through_spark_connect_prepares_on_the_server_and_trains(server, tmp_path):
    data = tmp_path / "in.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["body", "topic"])
        for label, vocab in {"sport": "match goal team", "tech": "chip software data"}.items():
            for i in range(30):
                w.writerow([f"{vocab} number {i}", label])
        w.writerow(["", "sport"])  # no text: set aside, counted
    from torchloom.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    rd = tmp_path / "run"
    proc = torchloom(["run", "--data.path", str(data), "--data.text_column", "body", "--data.label_column", "topic",
                      "--engine.name", "spark", "--prepare.spark_master", server, "--engine.workers", "2",
                      "--engine.device", "cpu", "--model.path", model, "--output.dir", str(rd),
                      "--tracking.enabled", "false", "--train.epochs", "1", "--eval.baseline_engine", "spark"],
                     tmp_path)
    assert "61 rows read, 1 set aside (null_text 1)" in proc.stderr, proc.stderr[-3000:]
    assert (rd / "model").is_dir() and (rd / "report.md").is_file()
    # the MLlib baseline ran on the Connect server too (its features in the server's tasks), on the same test rows
    report = json.loads((rd / "report.json").read_text())
    assert report["baseline"]["n"] == report["metrics"]["n"] > 0
    assert json.loads((rd / "baseline.json").read_text())["engine"] == "spark"


def test_a_conf_the_connect_server_owns_is_one_line(server, setup, tmp_path):
    rd = new_run(tmp_path, setup["data"], "static")
    proc = torchloom(["train", "--engine.name", "spark", "--prepare.spark_master", server, "--output.dir", str(rd),
                      "--model.path", setup["model"], "--tracking.enabled", "false", *COMMON,
                      "--prepare.spark_conf", '{"spark.executor.memory" = "2g"}'], tmp_path, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchloom: error:")]
    assert len(errors) == 1 and "prepare.spark_conf spark.executor.memory" in errors[0], proc.stderr[-3000:]
    assert not (rd / "checkpoints").exists()
