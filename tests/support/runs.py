"""Running the torchloom command as a user does, as another host would: its own private cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchloom(*args: str, cache: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m torchloom ARGS` with TORCHLOOM_CACHE=cache (a host that has seen only what that cache holds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TORCHLOOM_CACHE": str(cache),
           "TORCHLOOM_CPU_BF16": "0"}
    return subprocess.run([sys.executable, "-m", "torchloom", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def prepared_study(out: Path, args: list[str]) -> None:
    """A tune study directory whose data is prepared (synthetic rows, 3 labels) as the study `args` key it: the
    study reuses it, as one whose prepare ran before, and no Spark starts."""
    from torchloom.config import build
    from torchloom.data.synthetic import write_synthetic_dataset
    from torchloom.runs.rundir import StudyDir
    from torchloom.tune.study import absolute_paths, prepare_key

    sd = StudyDir(out)
    write_synthetic_dataset(sd.data, rows={"train": 48, "val": 12, "test": 12})
    sd.prepare_key.write_text(prepare_key(absolute_paths(build(None, args))))
