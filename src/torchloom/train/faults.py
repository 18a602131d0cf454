"""Fault injection for tests of failure handling: make one rank raise or die at a given step.

Set TORCHLOOM_FAULT="rank=1,step=5,kind=raise" (or kind=kill for SIGKILL) in the environment of the
job. A fault fires once per run directory (a marker file records it), so a job that restarts and
resumes from a checkpoint does not hit it again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


class InjectedFault(RuntimeError):
    pass


def parse(spec: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in spec.split(",") if "=" in part)


def maybe_fire(rank: int, step: int, run_dir: Path) -> None:
    spec = os.environ.get("TORCHLOOM_FAULT")
    if not spec:
        return
    f = parse(spec)
    if int(f.get("rank", -1)) != rank or int(f.get("step", -1)) != step:
        return
    marker = run_dir / "logs" / f"fault-fired-rank{rank}-step{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(spec)
    if f.get("kind", "raise") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault on rank {rank} at step {step}")
