"""Shared pytest fixtures and the test run's environment. Each section belongs to one part of torchloom; keep
them apart. Helpers that test modules import (free_port, s3_server, JVM_ENV, the engines' reference job) are in
tests/support/; which tests share an xdist worker is support/schedule.py's (a plugin, loaded here). See
tests/README.md."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from support import spark_jvm

pytest_plugins = ["support.schedule", "support.durations"]

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
# class-data-sharing archive of Spark's classes (support/spark_jvm.py: what each saves, and how). The pytest
# controller builds the archive in the background when it is missing; xdist workers inherit the environment.
# Environments built for other hosts keep these variables (support.spark_jvm.JVM_ENV).
spark_jvm.use_in_this_run()


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
