"""Notice of preemption: a host about to be taken back (a spot VM, a scheduler's SIGTERM) gives notice, and
every rank stops after the same optimizer step, with a checkpoint of that step.

The notice is a flag. A signal sets it without doing anything else: Python runs a signal handler only
between bytecodes, and not at all while the training thread waits in a collective, so the signal wakes a
thread (signal.set_wakeup_fd), and that thread gives the notice. The training loop all-reduces the flag
at each step boundary (train/loop.py): the rank that got the notice and every other rank leave the loop
after the same step, write one checkpoint and end the attempt "preempted".

Never a hang: the thread that gave the notice ends the process `grace_s` (+ EXIT_MARGIN_S) later if it is still alive
(a peer that vanished before the all-reduce leaves this rank waiting in it); the launcher then sees a
stopped rank, not a failure.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

# A rank still running this long after its grace period ends itself: time for a worker that decided not to
# write a checkpoint to leave cleanly, inside the platform's own limit (Kubernetes: 30 s, our default grace 25 s).
EXIT_MARGIN_S = 3.0

# A process whose SIGTERM watch was armed at its start (arm_sigterm) but whose training never said what to do
# on a notice (it was signalled while starting) leaves this long after the signal.
UNTOLD_EXIT_S = 20.0

# Exit code of `torchloom train` / `run` when the attempt ended preempted and nothing is left to go on
# with (the launcher itself was told to stop): EX_TEMPFAIL, "try again later".
EXIT_PREEMPTED = 75


class Notice:
    """The flag, with who gave it and when. One per process (NOTICE)."""

    def __init__(self) -> None:
        self._given = threading.Event()
        self.source = ""
        self.at = 0.0

    def give(self, source: str) -> None:
        if not self._given.is_set():
            self.source, self.at = source, time.time()
            self._given.set()

    @property
    def given(self) -> bool:
        return self._given.is_set()

    def left_s(self, grace_s: float) -> float:
        """Seconds left of the grace period (all of it when no notice was given here)."""
        return grace_s - (time.time() - self.at) if self.given else grace_s

    def clear(self) -> None:  # tests, and a process that trains again
        self._given.clear()
        self.source, self.at = "", 0.0


NOTICE = Notice()


class _Watch:
    """The SIGTERM watch of this process: armed once from the main thread; what to do on a notice is
    said later, by the rank (watch_sigterm), possibly from another thread."""

    def __init__(self) -> None:
        self.armed = False
        self.who = "a worker"
        self.grace_s = 0.0
        self.on_notice: Callable[[], None] | None = None
        self.on_expire: Callable[[], None] | None = None
        self.signalled = threading.Event()  # a SIGTERM came
        self.told = threading.Event()  # watch_sigterm said what to do

    def run(self) -> None:
        """After a SIGTERM: the notice, then (once the rank has said what to do) on_notice, and on_expire
        EXIT_MARGIN_S after the grace period."""
        NOTICE.give(f"SIGTERM to {self.who} on host {socket.gethostname()}")
        if not self.told.wait(UNTOLD_EXIT_S):  # a worker signalled before its training started: just leave
            os._exit(128 + signal.SIGTERM)
        try:
            if self.on_notice is not None:
                self.on_notice()
        finally:
            time.sleep(max(0.0, NOTICE.left_s(self.grace_s)) + EXIT_MARGIN_S)
            if self.on_expire is not None:
                self.on_expire()


_WATCH = _Watch()


def arm_sigterm() -> bool:
    """From the main thread: SIGTERM to this process becomes a notice (the handler only makes the C
    handler write to a pipe; a thread reads it and gives the notice). False where not the main thread.
    Engines whose training function runs off the main thread (Ray) call this at the worker's start."""
    if _WATCH.armed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    wake, wakeup = os.pipe()  # plain descriptors: they stay open for the life of the process
    os.set_blocking(wakeup, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python-level handler makes the C handler write to the fd
    signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(wake, 64):
            if signal.SIGTERM in data and not _WATCH.signalled.is_set():
                _WATCH.signalled.set()
                _WATCH.run()

    threading.Thread(target=watch, name="torchloom-preemption", daemon=True).start()
    _WATCH.armed = True
    return True


def watch_sigterm(who: str, grace_s: float, on_notice: Callable[[], None], on_expire: Callable[[], None]) -> bool:
    """SIGTERM gives the notice: a thread gives it, runs `on_notice` (it may do I/O), and EXIT_MARGIN_S
    after the grace period runs `on_expire`, which must end the process (time for a rank that wrote
    nothing to leave). Arms the watch from the main thread; from another thread (Ray runs the training
    function in one) only a watch armed at the worker's start (arm_sigterm) can serve: False without one.
    A SIGTERM that came before this call gave the notice already: on_notice runs from here, the grace period
    counts from the signal."""
    if not arm_sigterm():
        return False
    _WATCH.who, _WATCH.grace_s = who, grace_s
    _WATCH.on_notice, _WATCH.on_expire = on_notice, on_expire
    _WATCH.told.set()
    return True


def poll_url(url: str, every_s: float = 5.0) -> None:
    """Poll a cloud's preemption notice URL (e.g. GCE's instance/preempted, AWS's spot/instance-action):
    an answer 200 whose body is not empty, "FALSE" or "false" gives the notice; 404 and errors do not."""

    def poll() -> None:
        while not NOTICE.given:
            try:
                request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
                with urllib.request.urlopen(request, timeout=2) as answer:
                    body = answer.read(256).decode("utf-8", errors="replace").strip()
                if answer.status == 200 and body and body.upper() != "FALSE":
                    NOTICE.give(f"{url} on host {socket.gethostname()} ({body[:60]})")
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(every_s)

    threading.Thread(target=poll, name="torchloom-preemption-poll", daemon=True).start()
