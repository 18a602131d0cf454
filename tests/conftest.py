"""Shared pytest fixtures. Each section belongs to one part of torchloom; keep them apart."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Runs tracked by default (tracking.enabled) go to a throw-away MLflow store, not the working directory.
_mlflow_dir = tempfile.mkdtemp(prefix="torchloom-test-mlflow-")
atexit.register(shutil.rmtree, _mlflow_dir, ignore_errors=True)
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_mlflow_dir}/mlflow.db"


# ---------------------------------------------------------------------------------------------
# Spark and the tiny model (etl / prepare)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole test run (starting one costs ~8 s)."""
    pytest.importorskip("pyspark")
    from torchloom.config.schema import PrepareConfig
    from torchloom.etl.session import get_spark

    session = get_spark(PrepareConfig(spark_master="local[2]", partitions=4))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random BERT with the embedded MiniLM's tokenizer files."""
    from torchloom.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"))
