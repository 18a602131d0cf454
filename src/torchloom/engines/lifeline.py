"""The local engine's workers die with their driver: a `torchloom run` killed with SIGKILL (the OOM killer, `kill -9`)
leaves no fork server or rank training on and writing checkpoints into a run its user may already be running again.

The driver names itself to its workers in DRIVER_ENV (host, pid, start time, and whether it launches from its main
thread). Each worker asks the kernel for SIGKILL when the process that forked it ends (Linux's parent-death signal:
the fork server, or the launcher's thread under spawn), and watches the driver from a thread once a second (a pid
that is gone, or used again by another process). The fork server takes the parent-death signal too where the driver
started it from its main thread (the signal follows the thread that forked, which must outlive the server); started
from another thread it stops with the driver's next launch or its end, as before, and its workers still watch.

Spark's and Ray's tasks are their clusters' to stop: a driver that goes away ends its Spark application and its
Ray job, and their tasks with them. torchrun's workers (the pods) are torchrun's children: the signal follows it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
import threading

from torchloom.runs.ledger import process_start

DRIVER_ENV = "TORCHLOOM_DRIVER"
_PR_SET_PDEATHSIG = 1
WATCH_S = 1.0


def driver_token() -> str:
    """What the driver puts in DRIVER_ENV before it starts workers: host, pid, start time, launching thread."""
    main = "main" if threading.current_thread() is threading.main_thread() else "thread"
    return f"{socket.gethostname()}|{os.getpid()}|{process_start(os.getpid()) or ''}|{main}"


def _driver(env=None) -> tuple[int, int | None, bool] | None:
    """(pid, start time, launched from its main thread) of this host's driver, or None (none, or another host's)."""
    raw = (env or os.environ).get(DRIVER_ENV, "")
    parts = raw.split("|")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return None
    return int(parts[1]), int(parts[2]) if parts[2].isdigit() else None, parts[3] == "main"


def _gone(pid: int, started: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return started is not None and process_start(pid) not in (None, started)


def _parent_death_signal() -> bool:
    """SIGKILL to this process when the thread that forked it ends (Linux); False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_lifeline(parent: int):
    """A Popen preexec_fn: the child gets SIGTERM when `parent` (the process starting it, from its main thread)
    ends, SIGKILL included (the loop's candidate run: it stops as a run stops on SIGTERM, its workers with it)."""

    try:  # found here, before the fork: find_library may start a process, which a preexec_fn must not
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True) \
            if sys.platform.startswith("linux") else None
    except OSError:
        libc = None

    def arm() -> None:
        if libc is not None and libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0 \
                and os.getppid() != parent:  # the parent went before the ask
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def fork_server_lifeline() -> None:
    """In the local engine's fork server (engines/preload.py): die with a driver that started it from its main
    thread. No thread is started here: every worker is a fork of this process."""
    driver = _driver()
    if driver is None or not driver[2] or os.getppid() != driver[0]:
        return
    if _parent_death_signal() and os.getppid() != driver[0]:  # the driver went before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)


def worker_lifeline() -> None:
    """In a local worker, first thing: die with the process that forked it, and with the driver (watched)."""
    driver = _driver()
    if driver is None:
        return
    _parent_death_signal()  # a parent that went before this: the watch below sees the driver gone
    pid, started, _ = driver

    def watch() -> None:
        while True:
            if _gone(pid, started):
                os.kill(os.getpid(), signal.SIGKILL)  # nothing more is written into the run
            threading.Event().wait(WATCH_S)

    threading.Thread(target=watch, name="torchloom-driver-watch", daemon=True).start()
