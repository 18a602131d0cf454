"""A file the workers write, read by the driver while they run: a daemon thread that polls it.

The driver's live views (the progress bar, the ranks' log lines) and the metrics it forwards to
MLflow all follow files the workers rewrite or append to; each is a `Poller` with its own `poll()`.
"""

from __future__ import annotations

import threading


class Poller:
    """Calls `poll()` every `interval` seconds from a daemon thread inside a `with` block, then once
    more at its end (`last_poll()`) for what the workers wrote last."""

    def __init__(self, interval: float, name: str, join_timeout: float = 5.0):
        self.interval, self.join_timeout = interval, join_timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def poll(self) -> None:
        raise NotImplementedError

    def last_poll(self) -> None:
        self.poll()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout)
        self.last_poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
