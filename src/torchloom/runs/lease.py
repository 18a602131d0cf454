"""A lease on a run on a store: which driver writes it now.

A run on a store has no shared directory to lock (a local run's stages take flock-style locks on its files), so
two drivers on two hosts could both write one run and leave a mix of both. The driver of a stage that writes
(`prepare`, `train`, `run`, `export`, `evaluate`, `tune`) holds `lease.json` at the run's prefix: its owner (host,
pid, a random id), the stage, and an expiry it moves forward every third of LEASE_S from a thread while the stage
runs; it removes the object at the end. Another driver that finds an unexpired lease of another owner stops in
one line that names the owner and when the lease ends; an expired one (its driver died without removing it) is
taken over with a warning.

Best effort, not a consensus protocol: two drivers that start within the same fraction of a second may both
read "no lease"; each reads the object back after writing it and the one whose id is not there stops, which
closes that window to the store's read-after-write (S3 and its kin are strongly consistent) but not entirely.
Expiry times are the writers' clocks (NTP keeps hosts' within far less than LEASE_S).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from torchloom.errors import UserError, first_line
from torchloom.runs.runfiles import RunFiles

FORMAT = "torchloom-lease/1"
LEASE_ENV = "TORCHLOOM_LEASE_S"
# 60 s: a driver that died frees its run within a minute, and a renewal every 20 s outlasts the store's own
# retry window (storage.RETRY_S, 30 s) before the lease runs out.
LEASE_S = 60.0
SETTLE_S = 0.3  # between writing the lease and reading it back: a second writer's lease lands meanwhile


def lease_seconds() -> float:
    raw = os.environ.get(LEASE_ENV, "").strip()
    try:
        value = float(raw) if raw else LEASE_S
    except ValueError:
        value = -1.0
    if not 1 <= value < float("inf"):
        raise UserError(f"{LEASE_ENV}={raw!r}: not a number of seconds >= 1; set it to e.g. 60, or unset it")
    return value


def read(run: RunFiles | str) -> dict | None:
    """The lease of the run (its files, or its URI) (None: none there, or not a lease torchloom wrote)."""
    files = RunFiles.of(run)
    try:
        data = json.loads(files.read(files.rd.lease) or b"null")
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("expires"), (int, float)):
        return None
    return data


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def describe(lease: dict) -> str:
    return (f"{lease.get('stage', 'a stage')} on host {lease.get('host', '?')} (pid {lease.get('pid', '?')},"
            f" lease {str(lease.get('id', '?'))[:8]})")


class Lease:
    """Hold the run (its files, or its URI) for `stage` while the block runs (`with Lease(...)`)."""

    def __init__(self, run: RunFiles | str, stage: str, seconds: float | None = None, owner: dict | None = None):
        self.files, self.stage = RunFiles.of(run.rstrip("/") if isinstance(run, str) else run), stage
        self.rd = self.files.rd
        self.seconds = seconds or lease_seconds()
        self.owner = owner or {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        return self.rd.home(self.rd.lease)

    def _write(self) -> None:
        now = time.time()
        body = {"format": FORMAT, **self.owner, "stage": self.stage, "renewed": round(now, 3),
                "expires": round(now + self.seconds, 3)}
        self.files.write(self.rd.lease, json.dumps(body).encode())

    def _refuse(self, held: dict) -> UserError:
        left = max(0, round(held["expires"] - time.time()))
        return UserError(f"output.dir {self.rd.where}: another torchloom writes this run: {describe(held)}, its"
                         f" lease until {_when(held['expires'])} ({left} s from now); wait for it to end, or if that"
                         f" process is gone, wait {left} s or remove {self.where}")

    def acquire(self) -> None:
        held = read(self.files)
        if held is not None and held.get("id") != self.owner["id"]:
            if held["expires"] > time.time():
                raise self._refuse(held)
            print(f"torchloom: warning: {self.where}: took over the expired lease of {describe(held)}, which ended"
                  f" at {_when(held['expires'])}", file=sys.stderr, flush=True)
        self._write()
        time.sleep(SETTLE_S)
        held = read(self.files)
        if held is not None and held.get("id") != self.owner["id"]:
            raise self._refuse(held)  # another driver wrote its lease just after ours
        self._thread = threading.Thread(target=self._renew, name="torchloom-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(self.seconds / 3):
            try:
                held = read(self.files)
                if held is not None and held.get("id") != self.owner["id"]:
                    print(f"torchloom: warning: {self.where}: now held by {describe(held)} (it was removed or"
                          " expired); this stage goes on without it", file=sys.stderr, flush=True)
                    return
                self._write()
                warned = False
            except Exception as e:  # the store away longer than its retry window: said once, tried again
                if not warned:
                    print(f"torchloom: warning: {self.where}: could not renew the lease ({first_line(e)})",
                          file=sys.stderr, flush=True)
                    warned = True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            held = read(self.files)
            if held is not None and held.get("id") == self.owner["id"]:
                self.files.delete(self.rd.lease)
        except Exception as e:  # the lease then expires by itself
            print(f"torchloom: warning: {self.where}: could not remove the lease ({first_line(e)}); it expires by"
                  " itself", file=sys.stderr, flush=True)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


WRITERS = ("prepare", "train", "run", "export", "evaluate", "tune")  # the commands whose driver holds the lease


def hold(run, command: str):
    """The lease of a command that writes `run` (run.Run) on a store, after the store's pre-flight write check (one
    line within seconds for a wrong endpoint, asked once per run); nothing for a local run (the meaning differs:
    a local directory has no lease, its driver is the one process writing it) or a command that only reads."""
    if command not in WRITERS or not run.files.on_store:  # the meaning differs: a local run has no lease
        return contextlib.nullcontext()
    run.check_writable()
    return Lease(run.files, command)
