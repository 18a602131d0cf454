"""One loop per fleet: two would act on the same state (the cycle read back from the events) and make every change
twice. A loop holds the fleet's lease "loop" in the prediction log (predlog.take_lease: one statement, atomic on
SQLite and PostgreSQL) for TTL_S, renewed by a thread every TTL_S / 3 while it runs (a step may train for hours),
and dropped when it stops. A loop killed with SIGKILL stops renewing: on the same host its lease is taken over
at once (its holder names the host and a process that is gone); elsewhere it lapses TTL_S later, and the loop
that replaces it (a pod restarted by its Deployment, a host of its own) waits that out once. A loop that finds
the lease renewed by another is one line and exit 2; one that loses its own (its store unreachable past TTL_S,
another loop took it) stops after its step."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable

from torchloom.errors import UserError, first_line

NAME = "loop"
TTL_S = 60.0
HOLDER = re.compile(r"@(?P<host>\S+) pid (?P<pid>\d+) \(")


def gone(holder: str) -> bool:
    """The holder is a process of this host that no longer runs (a loop killed with SIGKILL)."""
    m = HOLDER.search(holder)
    if not m or m["host"] != socket.gethostname():
        return False
    try:
        os.kill(int(m["pid"]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


class LoopLease:
    def __init__(self, log, who: str, say: Callable[[str], object]) -> None:
        self.log, self.say = log, say
        self.holder = f"{who} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"  # who: "torchloom loop@HOST"
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, wait: bool) -> None:
        """The lease, or a UserError naming who holds it; with `wait`, a lease left by a loop that was killed is
        waited out once (at most TTL_S)."""
        holder, until = self.log.take_lease(NAME, self.holder, TTL_S)
        if holder != self.holder and gone(holder):
            self.say(f"loop: taking over the fleet's lease from {holder}, a process of this host that is gone")
            holder, until = self.log.replace_lease(NAME, holder, self.holder, TTL_S)
        left = until - time.time()
        if holder != self.holder and wait and left <= TTL_S + 1:
            self.say(f"loop: the fleet's lease is held by {holder} for {max(0.0, left):.0f} s more (a loop that"
                     " stopped without letting go of it?); waiting for it to lapse")
            time.sleep(max(0.0, left) + 1.0)
            holder, until = self.log.take_lease(NAME, self.holder, TTL_S)
        if holder != self.holder:
            raise UserError(f"loop: fleet {self.log.fleet} is run by another loop ({holder}, its lease renewed until"
                            f" {time.strftime('%H:%M:%S', time.localtime(until))}); two loops of one fleet would"
                            " act twice: stop that one first")
        self._thread = threading.Thread(target=self._renew, name="torchloom-loop-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        failing = False
        while not self._stop.wait(TTL_S / 3) and not self.lost:
            failing = self.renew(failing)

    def renew(self, failing: bool = False) -> bool:
        """The lease renewed once; whether the store failed (said once while it does). Another holder: lost."""
        try:
            holder, _ = self.log.take_lease(NAME, self.holder, TTL_S)
        except Exception as e:  # noqa: BLE001 - the store may answer again before the lease lapses
            if not failing:
                self.say(f"loop: warning: cannot renew the fleet's lease ({first_line(e)[:160]})")
            return True
        if holder != self.holder:
            self.say(f"loop: warning: the fleet's lease went to {holder}; this loop stops after its step")
            self.lost = True
        return False

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self.lost:
            try:
                self.log.drop_lease(NAME, self.holder)
            except Exception as e:  # noqa: BLE001 - it lapses by itself
                self.say(f"loop: warning: the fleet's lease was not let go ({first_line(e)[:160]}); it lapses in"
                         f" {TTL_S:.0f} s")
