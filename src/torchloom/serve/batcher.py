"""Dynamic micro-batching: concurrent requests are merged into model batches on one model thread.

With an `encode` function, a request's texts are tokenized first (on a pool of tokenizer threads, so the event
loop stays free; requests that arrive while every tokenizer thread is busy are encoded together in one call
once one frees, which shares a call's fixed cost) and each text's `cost` is known: (rows, longest row in
tokens). Requests are cut into chunks of at most `max_batch_size` texts and `max_batch_tokens` padded tokens
(rows x longest row, which is what a padded forward computes) and queued. A batch is the oldest chunks that
fit in both limits; it goes to the model once it is full or its oldest chunk has waited `max_wait_ms`, and at
once when no request is being tokenized, that is about to join it (unless adaptive_wait is off): waiting for
requests not yet sent only adds latency (a lone client's, or 8 clients' whose 8 requests are all in: they
waited the whole max_wait, 8 ms a request with the tiny model), and under load the next batch gathers while
the model runs this one.

The model thread takes its next batch itself, from the queue, the moment it has handed back the last one's
results: what arrived while the model ran goes next, without waiting for the event loop, which may be busy
answering the batch just done (with a tiny model or a GPU, that wait was a third of the model thread's time).
The event loop only queues chunks and settles results (and the metrics, which are not thread-safe). The
model sorts a batch's rows by length before padding. One model thread means batches never compete for the
cores. The queue is bounded in texts: a request that would overfill it is refused at once (the server answers
429 with Retry-After) instead of growing memory and latency. A single text over the token budget still runs,
alone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torchloom.serve.metrics import ServeMetrics

log = logging.getLogger("torchloom.serve")


class Overloaded(Exception):
    """The queue has no room for the request; retry after `retry_after` seconds."""

    def __init__(self, queued: int, max_queue: int, retry_after: int = 1) -> None:
        super().__init__(f"{queued} texts are queued (at most {max_queue}); retry later")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is draining and takes no new work."""


class ModelFailed(Exception):
    """The model raised on this request's texts; the traceback is in the log under `error_id`."""

    def __init__(self, error_id: str) -> None:
        super().__init__(f"the model failed on this request (error id {error_id})")
        self.error_id = error_id


@dataclass
class _Chunk:
    texts: list[str]
    future: asyncio.Future
    items: list[Any]  # what the model takes: the texts, or their encodings
    costs: list[tuple[int, int]]  # per text: (rows, longest row in tokens); (1, 0) without encode
    queued_at: float = field(default_factory=time.monotonic)
    taken_at: float = 0.0  # when the model thread took it into a batch


def padded_tokens(costs: list[tuple[int, int]]) -> int:
    """Tokens a padded forward of these texts computes: all their rows x the longest row."""
    return sum(rows for rows, _ in costs) * max((longest for _, longest in costs), default=0)


class MicroBatcher:
    """Runs `predict(texts) -> results` (one result per text, in order) on merged batches from many callers."""

    def __init__(self, predict: Callable[[list[Any]], list[Any]], max_batch_size: int = 32,
                 max_wait_ms: float = 5.0, max_queue: int = 1024, metrics: ServeMetrics | None = None,
                 adaptive_wait: bool = True, encode: Callable[[list[str]], list[Any]] | None = None,
                 cost: Callable[[Any], tuple[int, int]] | None = None, max_batch_tokens: int = 0,
                 encode_workers: int = 1, nice: int = 0) -> None:
        """predict takes what encode returns (or the texts, without encode); cost gives an encoded text's
        (rows, longest row); max_batch_tokens 0: no token limit; encode_workers: tokenizer threads; nice: the
        model thread's niceness (a shadow's: the cores go to the models that answer first, serve/fleet.py)."""
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0 or max_batch_tokens < 0:
            raise ValueError("max_batch_size and max_queue must be >= 1, max_wait_ms and max_batch_tokens >= 0")
        self._predict = predict
        self._encode, self._cost = encode, cost
        self.max_batch_tokens = max_batch_tokens if encode is not None and cost is not None else 0
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000
        self.max_queue = max_queue
        self.adaptive_wait = adaptive_wait
        self.metrics = metrics or ServeMetrics()
        # Shared with the model thread, under _lock: the queue, _pending, _closing and the calls to run
        self._lock = threading.Condition()
        self._queue: deque[_Chunk] = deque()
        self._calls: deque[tuple[Callable[..., Any], tuple, asyncio.Future]] = deque()  # run_in_worker's
        self._pending = 0  # texts accepted and not yet taken by the model thread
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None  # done when the model thread has finished
        self._tokenizer: ThreadPoolExecutor | None = None
        self._encode_workers = max(1, encode_workers)
        self._nice = nice
        self._to_encode: list[tuple[list[str], asyncio.Future]] = []  # requests waiting for a tokenizer thread
        self._encoding = 0  # tokenizer calls running
        self._tokenizing = 0  # requests being tokenized: about to join the queue

    @property
    def queue_depth(self) -> int:
        return self._pending

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        if self._encode is not None:
            self._tokenizer = ThreadPoolExecutor(max_workers=self._encode_workers,
                                                 thread_name_prefix="torchloom-tokenize")
        self._thread = threading.Thread(target=self._model_thread, name="torchloom-model", daemon=True)
        self._thread.start()

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the model thread, in turn with the batches (e.g. the warm-up)."""
        if self._loop is None or self._stopped is None or self._stopped.done():
            raise ShuttingDown("the server is shutting down")
        future = self._loop.create_future()
        with self._lock:
            self._calls.append((fn, args, future))
            self._lock.notify()
        return await future

    async def submit(self, texts: list[str], items: list[Any] | None = None,
                     on_items: Callable[[list[Any]], None] | None = None) -> list[Any]:
        """Results for `texts`, in order. Raises Overloaded, ShuttingDown or ModelFailed. items: their encodings,
        made by another model's batcher with the same encoding (a shadow: tokenized once, serve/fleet.py);
        on_items: called with the encodings once made, before they queue."""
        if self._closing or self._thread is None:
            raise ShuttingDown("the server is shutting down")
        if self._pending + len(texts) > self.max_queue:
            raise Overloaded(self._pending, self.max_queue)
        loop = asyncio.get_running_loop()
        with self._lock:
            self._pending += len(texts)  # the room is taken now: tokenizing below lets other requests in
        queued = tokenizing = False
        try:
            if self._encode is not None:
                if items is None:
                    self._tokenizing, tokenizing = self._tokenizing + 1, True
                    items = await self._tokenize(texts)
                if on_items is not None:
                    on_items(items)
                costs = [self._cost(item) for item in items] if self._cost is not None else [(1, 0)] * len(texts)
            else:
                items, costs = list(texts), [(1, 0)] * len(texts)
            chunks = [_Chunk(texts[a:b], loop.create_future(), items[a:b], costs[a:b])
                      for a, b in self._cut(costs)]
            with self._lock:
                if tokenizing:  # with the queueing: the model thread sees it in one or the other
                    self._tokenizing, tokenizing = self._tokenizing - 1, False
                if self._closing:  # checked under the lock: the model thread never misses a chunk queued
                    raise ShuttingDown("the server is shutting down")
                self._queue.extend(chunks)
                queued = True
                self._lock.notify()
            # A cancelled request (client gone) cancels its chunks; the model thread then skips them.
            if len(chunks) == 1:
                return await chunks[0].future
            parts = await asyncio.gather(*(c.future for c in chunks), return_exceptions=True)
        except asyncio.CancelledError:
            if not queued:  # the client went away while its texts were being tokenized: dropped before the model too
                self.metrics.dropped.inc(amount=len(texts))
            raise
        finally:
            if not queued:
                with self._lock:
                    self._pending -= len(texts)
                    self._tokenizing -= tokenizing
                    self._lock.notify()  # one request fewer to wait for
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return [result for part in parts for result in part]

    def _tokenize(self, texts: list[str]) -> asyncio.Future:
        """The encodings of `texts`: encoded now if a tokenizer thread is free, else with the requests that arrive
        before one is."""
        future = asyncio.get_running_loop().create_future()
        self._to_encode.append((texts, future))
        if self._encoding < self._encode_workers:
            self._encode_waiting()
        return future

    def _encode_waiting(self) -> None:
        group = [(texts, future) for texts, future in self._to_encode if not future.done()]  # done: client gone
        self._to_encode = []
        if not group:
            return
        if self._closing:
            for _, future in group:
                future.set_exception(ShuttingDown("the server is shutting down"))
            return
        self._encoding += 1
        started = time.perf_counter()
        job = asyncio.get_running_loop().run_in_executor(self._tokenizer, self._encode_group, [t for t, _ in group])
        job.add_done_callback(lambda done: self._encoded(group, done, started))

    def _encode_group(self, requests: list[list[str]]) -> list[Any]:
        """Each request's encodings (or the exception encoding it raised): all in one call, and where that call
        fails each request alone, so that only a request that fails alone gets an error."""
        texts = [t for request in requests for t in request]
        try:
            items = self._encode(texts)  # type: ignore[misc]
            if len(items) != len(texts):
                raise RuntimeError(f"encode returned {len(items)} encodings for {len(texts)} texts")
        except Exception as e:
            if len(requests) == 1:
                return [e]
            return [self._encode_group([request])[0] for request in requests]
        out, start = [], 0
        for request in requests:
            out.append(items[start:start + len(request)])
            start += len(request)
        return out

    def _encoded(self, group: list[tuple[list[str], asyncio.Future]], job: asyncio.Future, started: float) -> None:
        self._encoding -= 1
        seconds = time.perf_counter() - started
        parts = job.result() if job.exception() is None else [job.exception()] * len(group)
        for (_, future), part in zip(group, parts):
            self.metrics.tokenize_seconds.observe(seconds)
            if future.done():
                continue
            if isinstance(part, BaseException):
                future.set_exception(part)
            else:
                future.set_result(part)
        if self._to_encode:
            self._encode_waiting()

    def _cut(self, costs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """[start, stop) ranges of a request's texts: at most max_batch_size texts and max_batch_tokens
        padded tokens each (one text over the budget alone)."""
        ranges, start = [], 0
        for i in range(1, len(costs) + 1):
            if i == len(costs):
                ranges.append((start, i))
            elif i - start + 1 > self.max_batch_size or (
                    self.max_batch_tokens and padded_tokens(costs[start:i + 1]) > self.max_batch_tokens):
                ranges.append((start, i))
                start = i
        return ranges

    async def close(self) -> None:
        """Stop taking requests, finish everything queued, stop the model thread."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._stopped is not None:
            await self._stopped
        if self._thread is not None:
            self._thread.join()
        if self._tokenizer is not None:
            self._tokenizer.shutdown(wait=True)

    # --- the model thread -----------------------------------------------------------------------------------

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the event loop (results, errors, metrics); dropped if the loop is gone."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop was closed without close(): nobody is waiting any more
            pass

    def _model_thread(self) -> None:
        if self._nice:
            import os

            try:  # Linux: a thread's niceness is its own, and threads it starts (torch's workers) inherit it
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError:
                log.warning("could not lower the model thread's priority (nice %d)", self._nice)
        try:
            while True:
                work = self._take()
                if work is None:
                    return
                if isinstance(work, tuple):  # a run_in_worker call
                    fn, args, future = work
                    try:
                        self._post(_resolve, future, fn(*args), None)
                    except Exception as e:
                        self._post(_resolve, future, None, e)
                    continue
                try:
                    self._run_batch(work)
                except Exception as e:  # the model thread must outlive any one batch, or every request would hang
                    self._post(self._failed, work, e)
        finally:
            self._post(_resolve, self._stopped, None, None)

    def _take(self) -> list[_Chunk] | tuple | None:
        """The next work for the model thread: a run_in_worker call, or the next batch (the oldest chunks that
        fit, waiting up to max_wait for more while there is room); None once closing and nothing is left."""
        with self._lock:
            while True:
                if self._calls:
                    return self._calls.popleft()
                size, fit, full = self._fit()
                if not fit:
                    if self._closing:
                        return None
                    self._lock.wait()
                    continue
                oldest = self._queue[0].queued_at
                remaining = oldest + self.max_wait - time.monotonic()
                if (full or size >= self.max_batch_size or self._closing or remaining <= 0
                        or (self.adaptive_wait and not self._tokenizing)):  # nobody is about to join
                    now = time.monotonic()
                    batch = [self._queue.popleft() for _ in range(fit)]
                    for chunk in batch:
                        chunk.taken_at = now
                    self._pending -= size
                    return batch
                self._lock.wait(remaining)

    def _fit(self) -> tuple[int, int, bool]:
        """Under the lock: (texts, chunks, full) of the batch the queue's head makes now; chunks whose request
        went away are removed on the way (and counted as dropped)."""
        size, fit, full, dropped = 0, 0, False, 0
        costs: list[tuple[int, int]] = []
        while fit < len(self._queue):
            chunk = self._queue[fit]
            if chunk.future.done():  # cancelled by its request (its client went away)
                del self._queue[fit]
                self._pending -= len(chunk.texts)
                dropped += len(chunk.texts) if chunk.future.cancelled() else 0
                continue
            if fit and (size + len(chunk.texts) > self.max_batch_size or (
                    self.max_batch_tokens and padded_tokens(costs + chunk.costs) > self.max_batch_tokens)):
                full = True
                break
            size, fit = size + len(chunk.texts), fit + 1
            costs += chunk.costs
        if dropped:
            self._post(self._dropped, dropped)
        return size, fit, full

    def _run_batch(self, batch: list[_Chunk]) -> None:
        gone = sum(len(chunk.texts) for chunk in batch if chunk.future.cancelled())  # while the batch waited to fill
        if gone:
            self._post(self._dropped, gone)
            batch = [chunk for chunk in batch if not chunk.future.done()]
            if not batch:
                return
        started = time.perf_counter()
        try:
            results = self._predict_checked([i for chunk in batch for i in chunk.items])
        except Exception as e:
            self._post(self._observe, batch, time.perf_counter() - started)
            self._isolate(batch, e)
            return
        seconds = time.perf_counter() - started
        parts, start = [], 0
        for chunk in batch:
            parts.append(results[start:start + len(chunk.texts)])
            start += len(chunk.texts)
        self._post(self._answer, batch, parts, seconds)

    def _isolate(self, batch: list[_Chunk], error: Exception) -> None:
        """After a failed batch, run each request's chunk alone: only the chunks that fail again get an error."""
        if len(batch) == 1:
            self._post(self._fail, batch[0], error)
            return
        for chunk in batch:
            if chunk.future.done():
                continue
            try:
                self._post(self._answer, [chunk], [self._predict_checked(chunk.items)], None)
            except Exception as e:
                self._post(self._fail, chunk, e)

    def _predict_checked(self, items: list[Any]) -> list[Any]:
        results = self._predict(items)
        if len(results) != len(items):
            raise RuntimeError(f"the model returned {len(results)} results for {len(items)} texts")
        return results

    # --- back on the event loop -----------------------------------------------------------------------------

    def _observe(self, batch: list[_Chunk], seconds: float | None) -> None:
        """A batch's metrics: its size, tokens, each chunk's wait in the queue and (when it ran) its seconds."""
        self.metrics.batch_size.observe(sum(len(chunk.texts) for chunk in batch))
        for chunk in batch:
            self.metrics.queue_seconds.observe(chunk.taken_at - chunk.queued_at)
        if self._encode is not None:
            self.metrics.batch_tokens.observe(padded_tokens([c for chunk in batch for c in chunk.costs]))
        if seconds is not None:
            self.metrics.batch_seconds.observe(seconds)

    def _answer(self, batch: list[_Chunk], parts: list[list[Any]], seconds: float | None) -> None:
        """A batch's results (seconds None: a chunk run alone after its batch failed, already observed)."""
        if seconds is not None:
            self._observe(batch, seconds)
        self.metrics.texts.inc(amount=sum(len(chunk.texts) for chunk in batch))
        for chunk, part in zip(batch, parts):
            _settle(chunk, result=part)

    def _dropped(self, texts: int) -> None:
        self.metrics.dropped.inc(amount=texts)

    def _failed(self, batch: list[_Chunk], error: Exception) -> None:
        """A batch the model thread could not handle at all: each request gets an error, the thread goes on."""
        error_id = uuid.uuid4().hex[:12]
        log.error("batcher error %s", error_id, exc_info=error)
        for chunk in batch:
            _settle(chunk, exc=ModelFailed(error_id))

    def _fail(self, chunk: _Chunk, error: Exception) -> None:
        error_id = uuid.uuid4().hex[:12]
        self.metrics.model_errors.inc()
        log.error("model error %s on %d texts (first: %r)", error_id, len(chunk.texts), chunk.texts[0][:80],
                  exc_info=error)
        _settle(chunk, exc=ModelFailed(error_id))


def _resolve(future: asyncio.Future | None, result: Any, exc: BaseException | None) -> None:
    if future is None or future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _settle(chunk: _Chunk, result: Any = None, exc: BaseException | None = None) -> None:
    if chunk.future.done():
        return
    if exc is not None:
        chunk.future.set_exception(exc)
    else:
        chunk.future.set_result(result)
