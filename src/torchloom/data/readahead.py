"""Run an iterator in a background thread, a bounded number of items ahead of its consumer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_POLL_SECONDS = 0.05  # how often a blocked side checks whether the other side stopped
_DONE = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class ReadAhead(Generic[T]):
    """Iterates `source` in a daemon thread, at most `max_ahead` items ahead.

    `close()` stops the thread and waits for it; call it when the consumer stops early. An
    exception in `source` is raised in the consumer. The thread holds no reference to the
    caller's objects beyond `source`, so an abandoned loader can still be collected.
    """

    def __init__(self, source: Iterator[T], max_ahead: int):
        self._queue: queue.Queue = queue.Queue(max(1, max_ahead))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source,), name="torchloom-readahead", daemon=True)
        self._thread.start()

    def _run(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(_Failed(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if self._stop.is_set() or (not self._thread.is_alive() and self._queue.empty()):
                    raise StopIteration from None
                continue
            if self._stop.is_set():  # closed while the producer was putting its last item
                raise StopIteration
            if item is _DONE:
                self._stop.set()
                raise StopIteration
            if isinstance(item, _Failed):
                self._stop.set()
                raise item.error
            return item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue, and drop what it made
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
