"""Fault injection for tests of failure handling: make one rank raise or die at a given step.

Set TORCHLOOM_FAULT="rank=1,step=5,kind=raise" in the environment of the job; host=NAME instead of
rank=R picks whichever rank runs on that host. kind=raise raises, kind=kill is SIGKILL, kind=hang stops
answering (as a rank on a host that lost power or network does), kind=term sends the rank SIGTERM (a
notice of preemption) and lets it go on; kind=term_saving sends it SIGTERM while the checkpoint of `step`
is being written (its `.step-N.tmp` directory exists; the marker says whether it was caught there);
kind=slow,sleep=S makes every step from `step` on S seconds
longer (no marker: every run), so a test can signal a launcher while its workers train. Any other fault
fires once per run directory (a marker file records it; a run on a store keeps it there, so a rank
that resumes on another host knows too), so a job that restarts and resumes from a checkpoint does not hit
it again.
The launcher adds a FaultInjector to the worker's reporter only when the variable is set; the
training loop knows nothing of it.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

from torchloom.runs.runfiles import RunFiles
from torchloom.train.reporter import Reporter

ENV = "TORCHLOOM_FAULT"


class InjectedFault(RuntimeError):
    pass


def parse(spec: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in spec.split(",") if "=" in part)


class FaultInjector(Reporter):
    def __init__(self, spec: str, files: RunFiles, rank: int):
        f = parse(spec)
        self.spec, self.files, self.rd, self.rank = spec, files, files.rd, rank
        self.at_rank, self.at_step, self.kind = int(f.get("rank", -1)), int(f.get("step", -1)), f.get("kind", "raise")
        self.at_host = f.get("host")  # instead of a rank: whichever rank runs on this host
        self.sleep = float(f.get("sleep", 0.5))

    def mine(self) -> bool:
        if self.at_host is not None:
            return self.at_host == socket.gethostname()
        return self.at_rank == self.rank

    def step_done(self, step: int) -> None:
        if self.kind == "term_saving":
            if step == 1 and self.mine() and not self.fired(self.rd.fault_marker(self.rank, self.at_step)):
                threading.Thread(target=self.term_while_saving, daemon=True).start()
            return
        if self.kind == "slow":  # every step from `step` on takes `sleep` seconds longer, every run
            if step >= self.at_step and self.mine():
                time.sleep(self.sleep)
            return
        if self.at_step != step or not self.mine():
            return
        marker = self.rd.fault_marker(self.rank, step)
        if self.fired(marker):
            return
        self.record(marker, self.spec)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "term":  # a notice of preemption, through the real signal; training goes on
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.kind == "hang":
            while True:  # the test takes the whole host away from here
                time.sleep(60)
        raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")


    def term_while_saving(self) -> None:
        """SIGTERM to this rank as soon as the checkpoint of at_step is being written (or, if its write
        was missed, once it is there)."""
        final = self.rd.checkpoint(self.at_step)
        tmp = final.with_name(f".{final.name}.tmp")
        while not tmp.exists() and not final.exists():
            time.sleep(0.0002)
        caught = tmp.exists()
        os.kill(os.getpid(), signal.SIGTERM)
        self.record(self.rd.fault_marker(self.rank, self.at_step), f"{self.spec}\nwhile saving: {caught}")

    def fired(self, marker) -> bool:
        """This fault fired before in this run (on a store: on any host)."""
        if not marker.exists():
            self.files.pull(marker, quiet=True)
        return marker.exists()

    def record(self, marker, text: str) -> None:
        """On a store, there before it is here: a test that cuts the host off on seeing it loses none."""
        self.files.write_through(marker, text)


def from_env(files: RunFiles, rank: int) -> FaultInjector | None:
    spec = os.environ.get(ENV)
    return FaultInjector(spec, files, rank) if spec else None
