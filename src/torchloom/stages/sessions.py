"""A SparkSession for scoring a split on Spark (eval.score_with; evaluate/spark_scoring.py): the run's own where the
command has one (`run` keeps its session when the Spark engine trains), else one started on first use and stopped
when the stage ends; the manifest its executors read (a store's shards on a cluster, as the baseline's)."""

from __future__ import annotations

from torchloom.console import say
from torchloom.runs.run import Run


class ScoringSpark:
    def __init__(self, run: Run, stage: str):
        self.run, self.stage, self.spark, self.started = run, stage, run.spark, False

    def session(self):
        if self.spark is None:
            from torchloom.etl.session import get_spark

            self.spark, self.started = get_spark(self.run.cfg.prepare), True
        return self.spark

    def manifest(self, m):
        return m if self.run.spark_here else self.run.files.streamed(m)

    def say(self, message: str) -> None:
        say(f"{self.stage}: {message}")

    def __enter__(self) -> ScoringSpark:
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            from torchloom.etl.session import stop_spark

            stop_spark()
            self.spark, self.started = None, False
