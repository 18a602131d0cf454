"""Running the torchloom command as another host would (support.command's runner with cache=: its own private
cache), and a tune study whose data is prepared."""

from __future__ import annotations

from pathlib import Path

from support.command import torchloom

__all__ = ["torchloom", "prepared_study"]


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
