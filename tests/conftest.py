"""Shared pytest fixtures. Each section belongs to one part of torchloom; keep them apart."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Runs tracked by default (tracking.enabled) go to a throw-away MLflow store, not the working directory.
_mlflow_dir = tempfile.mkdtemp(prefix="torchloom-test-mlflow-")
atexit.register(shutil.rmtree, _mlflow_dir, ignore_errors=True)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_mlflow_dir}/mlflow.db"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (test modules import it: `from conftest import free_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
