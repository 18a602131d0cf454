"""A command's run, built once and handed down: the config, the run's files (their owner, RunFiles, which names
them through its RunDir), the tracker and the SparkSession where the command has them.

The CLI builds it after the checks before a stage (preflight.open_run) and under the run's lease; every stage,
the engines and the study take it (the engines and the workers the files alone: a worker gets them pickled, or
builds them once from the run's location). A stage called from Python with a Config gets one built by
stages.as_run, with the same checks. Nothing below the stages derives the run from `cfg.output.dir` again.

What a command learns about its run once (its prefix holds only torchloom's files) is kept here, on the run,
instead of in a module's global memory: a second Run of the same directory asks again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchloom.config import Config
from torchloom.runs.rundir import RunDir
from torchloom.runs.runfiles import RunFiles


@dataclasses.dataclass
class Run:
    cfg: Config
    files: RunFiles
    tracker: Any = None  # tracking.Tracker (None: nothing tracked; stages use a NullTracker)
    spark: Any = None  # a SparkSession the command started and shares between its stages, or None
    checked: set[str] = dataclasses.field(default_factory=set)  # the checks this run passed (shared by but())

    @property
    def rd(self) -> RunDir:
        return self.files.rd

    @property
    def spark_here(self) -> bool:
        """prepare's Spark runs on this machine (its processes see this host's files), else on a cluster."""
        return self.cfg.prepare.spark_here

    def but(self, **changes: Any) -> Run:
        """This run with another config (its output.dir unchanged), tracker or session; its files and its checks
        are the same objects."""
        cfg = changes.get("cfg")
        if cfg is not None and cfg.output.dir != self.cfg.output.dir:
            raise ValueError(f"a Run of {self.cfg.output.dir} given the config of {cfg.output.dir}")
        return dataclasses.replace(self, **changes)

    def check_writable(self) -> None:
        """The run's store answers and these credentials may write and delete there, or its local directory can be
        made and written (RunFiles.check_writable), once per run."""
        self.once("writable", lambda: self.files.check_writable("output.dir"))

    def check_own(self) -> None:
        """The run's place holds nothing of someone else's (files.place.check_own), once per run."""
        self.once("own", self.files.place.check_own)

    def once(self, check: str, answer) -> None:
        """answer() the first time this run asks `check`; a failed check raises and is asked again."""
        if check not in self.checked:
            answer()
            self.checked.add(check)
