"""Shared pytest fixtures. Each section belongs to one part of torchloom; keep them apart."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import spark_jvm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The same answers on every CI machine: where the CPU runs bf16 natively (AMX, AVX512-BF16) `precision auto`
# serves and trains in bf16, and tests that compare a path's answers with fp32 inference would fail there
# only. So the suite treats every CPU as one without native bf16; tests/test_hardware.py tests the rule itself
# with each kind of CPU, and tests that want bf16 ask for it.
os.environ.setdefault("TORCHLOOM_CPU_BF16", "0")
# Runs tracked by default (tracking.enabled) go to a throw-away MLflow store, not the working directory.
_mlflow_dir = tempfile.mkdtemp(prefix="torchloom-test-mlflow-")
atexit.register(shutil.rmtree, _mlflow_dir, ignore_errors=True)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_mlflow_dir}/mlflow.db"
# Every Spark JVM a test starts runs C1 only with the serial GC, does not verify Spark's bytecode, and maps a
# class-data-sharing archive of Spark's classes (tests/spark_jvm.py: what each saves, and how). The pytest
# controller builds the archive in the background when it is missing; xdist workers inherit the environment.
# Environments built for other hosts keep these variables (JVM_ENV).
os.environ.pop("SPARK_CONF_DIR", None)  # first on the JVM's class path: a directory with files there rules CDS out
_ARCHIVE = os.environ.get("TORCHLOOM_TEST_SPARK_CDS") or spark_jvm.archive_path()
JVM_ENV = spark_jvm.environment(_ARCHIVE)
os.environ.update(JVM_ENV)
if "PYTEST_XDIST_WORKER" not in os.environ and not os.environ.get("TORCHLOOM_TEST_SPARK_CDS"):
    os.environ["TORCHLOOM_TEST_SPARK_CDS"] = _ARCHIVE  # the workers take this one
    spark_jvm.build_in_background(_ARCHIVE)


# -- pytest-xdist: which tests share a worker ------------------------------------------------------------------
# scripts/test.sh runs the suite on two xdist workers with `--dist loadgroup`, scheduled by the hook below. A
# module's tests stay on one worker (its module fixtures are built once), and two groups run one test at a time
# on one worker each. "cluster": the namespace cluster tests (tests/cluster, at a higher CPU priority than the
# other worker: tests/cluster/conftest.py). "ray": the tests that start a local Ray instance (they share
# torchloom's private Ray directory): test_ray_local.py, test_engines.py whole (its reference run, a module
# fixture, is then built once: ~1 min of a core), and in RAY_MODULES the tests named test_ray_* or with a `ray`
# parameter; the other tests of those modules stay in their module's unit (a module fixture that both use is
# built on both workers). Those two groups are the longest, so they go first; then the heaviest modules
# (HEAVY), then the rest.
# The suite keeps 2 cores busy with two workers (their summed test time is ~97% of twice the wall time): a third
# worker (or the two cluster modules at once on a fourth) ran at a load of 8-15 and starved time-bound steps
# (Ray Serve's start, a cluster's not-visible check, a Ray node's step).
# (xdist's own loadgroup reads `xdist_group` marks into the test ids through `item._nodeid`, which pytest 9.2 no
# longer uses: every test was its own unit, and multi-host tests ran two at a time.)
TESTS = os.path.dirname(os.path.abspath(__file__))
FIRST = ("cluster", "ray")  # the longest units, in this order
RAY_WHOLE = ("test_ray_local.py", "test_engines.py")
RAY_MODULES = ("test_tune.py", "test_serve.py")
HEAVY = ("test_engines.py", "test_cli.py", "test_storage.py", "test_serve.py", "test_spark_connect.py",
         "test_tune.py", "test_train.py", "test_preemption.py", "test_secrets.py", "test_baseline.py",
         "test_store_faults.py", "test_parallelism.py")


def xdist_scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to (nodeid relative to the repository): its group, or its module."""
    path, _, name = nodeid.partition("::")
    module = os.path.relpath(os.path.join(os.path.dirname(TESTS), path), TESTS).replace(os.sep, "/")
    if module.startswith("cluster/"):
        return "cluster"
    starts_ray = name.startswith("test_ray_") or "[ray]" in name or "[ray-" in name
    return "ray" if module in RAY_WHOLE or (module in RAY_MODULES and starts_ray) else module


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        scope = xdist_scope_of(item.nodeid)
        if scope in FIRST:
            return FIRST.index(scope)
        return len(FIRST) + (HEAVY.index(scope) if scope in HEAVY else len(HEAVY))

    items.sort(key=rank)  # stable: the order within stays


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup: xdist's scope scheduler, a scope being a group of FIRST or one module."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # xdist gives a worker its next unit while it still has 2 tests to run: behind the last tests of a
            # long unit (minutes each), the next would wait, so it gets the queue's last one, a small module
            behind_long = any(scope in FIRST and not all(done.values())
                              for scope, done in self.assigned_work.get(node, {}).items())
            if behind_long and len(self.workqueue) > 1:
                self.workqueue.move_to_end(next(reversed(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (test modules import it: `from conftest import free_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(log_dir, bucket: str, credentials: dict, front=None):
    """A real S3 server (moto's, over HTTP on 127.0.0.1) with one bucket, for the storage tests. This process
    and its children reach it through AWS_ENDPOINT_URL, as a user's S3-compatible store: at the server's port,
    or at `front(port)`'s (a proxy in front of it). Yields the port clients use; the environment is restored."""
    from torchloom import storage

    port = free_port()
    log = open(os.path.join(log_dir, "s3-server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                pytest.fail("the moto S3 server did not start")
            time.sleep(0.2)
    client_port = front(port) if front else port
    saved = {k: os.environ.get(k) for k in [*credentials, "AWS_ENDPOINT_URL"]}
    os.environ.update({**credentials, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{client_port}"})
    storage._filesystem.cache_clear()
    from pyarrow import fs as pafs

    pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{port}", scheme="http", allow_bucket_creation=True,
                      region="us-east-1").create_dir(bucket)
    try:
        yield client_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        storage._filesystem.cache_clear()


# ---------------------------------------------------------------------------------------------
# Spark and the tiny model (etl / prepare)
# ---------------------------------------------------------------------------------------------


_SPARK: dict = {}


@pytest.fixture
def spark():
    """One local[2] SparkSession shared by the tests (starting one costs ~8 s); started again when a test
    stopped it (tests/test_engines.py must, to start a local-cluster of its own)."""
    pytest.importorskip("pyspark")
    from torchloom.config.schema import PrepareConfig
    from torchloom.etl.session import get_spark

    session = _SPARK.get("local")
    if session is None or session.sparkContext._jsc is None:  # none yet, or stopped since
        session = _SPARK["local"] = get_spark(PrepareConfig(spark_master="local[2]", partitions=4))
    return session


@pytest.fixture(scope="session", autouse=True)
def stop_spark_at_the_end():
    yield
    if _SPARK.get("local") is not None:
        _SPARK.pop("local").stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random BERT with the embedded MiniLM's tokenizer files."""
    from torchloom.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def topics_csv(tmp_path_factory):
    """Two topics whose words give them away, 30 rows each (a module may define a topics_csv of its own)."""
    import csv

    path = tmp_path_factory.mktemp("csv") / "topics.csv"
    vocab = {"sport": "match goal team win league", "money": "bank market price shares profit"}
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"], *([f"{v} number {i}", k] for k, v in vocab.items()
                                                      for i in range(30))])
    return path
