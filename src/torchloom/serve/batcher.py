"""Dynamic micro-batching: concurrent requests are merged into model batches on one worker thread.

With an `encode` function, a request's texts are tokenized first (on a pool of tokenizer threads, so the event
loop stays free; requests that arrive while every tokenizer thread is busy are encoded together in one call
once one frees, which shares a call's fixed cost) and each text's `cost` is known: (rows, longest row in
tokens). Requests are cut into chunks of at most `max_batch_size` texts and `max_batch_tokens` padded tokens
(rows x longest row, which is what a padded forward computes) and queued. A batch is the oldest chunks that
fit in both limits; it goes to the model once it is full or its oldest chunk has waited `max_wait_ms`, and at
once when nobody else is likely to join it: the batcher keeps a moving average of how many other requests were
in flight when each one arrived, and below one (a lone client, or light load) waiting would only add latency,
so it does not wait (unless adaptive_wait is off). While the model runs a batch, the next one gathers what
arrives and goes the moment the model is free, so the model thread is fed continuously. The model sorts a
batch's rows by length before padding. It runs on a single worker thread so batches never compete for the
cores. The queue is bounded in texts: a request that would overfill it is refused at once (the server answers
429 with Retry-After) instead of growing memory and latency. A single text over the token budget still runs,
alone.
"""

from __future__ import annotations

import asyncio
import logging
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


def padded_tokens(costs: list[tuple[int, int]]) -> int:
    """Tokens a padded forward of these texts computes: all their rows x the longest row."""
    return sum(rows for rows, _ in costs) * max((longest for _, longest in costs), default=0)


class MicroBatcher:
    """Runs `predict(texts) -> results` (one result per text, in order) on merged batches from many callers."""

    def __init__(self, predict: Callable[[list[Any]], list[Any]], max_batch_size: int = 32,
                 max_wait_ms: float = 5.0, max_queue: int = 1024, metrics: ServeMetrics | None = None,
                 adaptive_wait: bool = True, encode: Callable[[list[str]], list[Any]] | None = None,
                 cost: Callable[[Any], tuple[int, int]] | None = None, max_batch_tokens: int = 0,
                 encode_workers: int = 1) -> None:
        """predict takes what encode returns (or the texts, without encode); cost gives an encoded text's
        (rows, longest row); max_batch_tokens 0: no token limit; encode_workers: tokenizer threads."""
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
        self._queue: deque[_Chunk] = deque()
        self._pending = 0  # texts accepted and not yet handed to the model
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: ThreadPoolExecutor | None = None
        self._encode_workers = max(1, encode_workers)
        self._to_encode: list[tuple[list[str], asyncio.Future]] = []  # requests waiting for a tokenizer thread
        self._encoding = 0  # tokenizer calls running
        self._running: asyncio.Task | None = None  # the batch on the model thread
        self._in_flight = 0  # requests submitted and not yet answered
        self._concurrency = 0.0  # moving average of other requests in flight at each arrival

    @property
    def queue_depth(self) -> int:
        return self._pending

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchloom-model")
        if self._encode is not None:
            self._tokenizer = ThreadPoolExecutor(max_workers=self._encode_workers,
                                                 thread_name_prefix="torchloom-tokenize")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="torchloom-batcher")

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the model thread, in turn with the batches (e.g. the warm-up)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def submit(self, texts: list[str]) -> list[Any]:
        """Results for `texts`, in order. Raises Overloaded, ShuttingDown or ModelFailed."""
        if self._closing or self._task is None:
            raise ShuttingDown("the server is shutting down")
        if self._pending + len(texts) > self.max_queue:
            raise Overloaded(self._pending, self.max_queue)
        loop = asyncio.get_running_loop()
        self._concurrency = 0.9 * self._concurrency + 0.1 * self._in_flight
        self._pending += len(texts)  # the room is taken now: tokenizing below lets other requests in
        self._in_flight += 1
        queued = False
        try:
            if self._encode is not None:
                items = await self._tokenize(texts)
                costs = [self._cost(item) for item in items] if self._cost is not None else [(1, 0)] * len(texts)
            else:
                items, costs = list(texts), [(1, 0)] * len(texts)
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            chunks = [_Chunk(texts[a:b], loop.create_future(), items[a:b], costs[a:b])
                      for a, b in self._cut(costs)]
            self._queue.extend(chunks)
            queued = True
            self._wakeup.set()
            # A cancelled request (client gone) cancels its chunks; the batcher then skips them.
            if len(chunks) == 1:
                return await chunks[0].future
            parts = await asyncio.gather(*(c.future for c in chunks), return_exceptions=True)
        except asyncio.CancelledError:
            if not queued:  # the client went away while its texts were being tokenized: dropped before the model too
                self.metrics.dropped.inc(amount=len(texts))
            raise
        finally:
            self._in_flight -= 1
            if not queued:
                self._pending -= len(texts)
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
        """Stop taking requests, finish everything queued, stop the worker thread."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._tokenizer is not None:
            self._tokenizer.shutdown(wait=True)

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    if self._running is not None:
                        await self._running
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch: list[_Chunk] = []
            try:
                batch = await self._collect()
            except Exception:
                self._failed(batch)
                continue
            if batch:
                if self._running is not None:
                    await self._running  # a full batch gathered while the model ran the previous one
                self._running = asyncio.get_running_loop().create_task(self._run_guarded(batch))

    async def _run_guarded(self, batch: list[_Chunk]) -> None:
        try:
            await self._run_batch(batch)
        except Exception:
            self._failed(batch)
        finally:
            self._wakeup.set()  # the model is free: the batch gathered meanwhile goes now

    def _failed(self, batch: list[_Chunk]) -> None:
        """The batcher must outlive any one batch, or every later request would hang."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("batcher error %s", error_id)
        for chunk in batch:
            _settle(chunk, exc=ModelFailed(error_id))

    async def _collect(self) -> list[_Chunk]:
        """The next batch: the oldest chunks that fit, waiting up to max_wait for more while there is room."""
        batch: list[_Chunk] = []
        size = 0
        costs: list[tuple[int, int]] = []
        while True:
            full = False
            while self._queue:
                chunk = self._queue[0]
                if chunk.future.done():  # cancelled by its request (its client went away)
                    self._queue.popleft()
                    self._pending -= len(chunk.texts)
                    if chunk.future.cancelled():
                        self.metrics.dropped.inc(amount=len(chunk.texts))
                    continue
                if batch and (size + len(chunk.texts) > self.max_batch_size or (
                        self.max_batch_tokens and padded_tokens(costs + chunk.costs) > self.max_batch_tokens)):
                    full = True
                    break
                batch.append(self._queue.popleft())
                size += len(chunk.texts)
                costs += chunk.costs
            if full or size >= self.max_batch_size or self._closing or not batch:
                return batch
            if self._running is not None and not self._running.done():
                self._wakeup.clear()  # the model is busy: gather what arrives until it is free
                await self._wakeup.wait()
                continue
            if self.adaptive_wait and self._concurrency < 0.5:
                return batch  # light load: nobody is likely to join within max_wait
            remaining = batch[0].queued_at + self.max_wait - time.monotonic()
            if remaining <= 0:
                return batch
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                pass

    async def _run_batch(self, batch: list[_Chunk]) -> None:
        gone = [chunk for chunk in batch if chunk.future.cancelled()]  # while the batch waited to fill
        if gone:
            self._pending -= sum(len(chunk.texts) for chunk in gone)
            self.metrics.dropped.inc(amount=sum(len(chunk.texts) for chunk in gone))
            batch = [chunk for chunk in batch if not chunk.future.done()]
            if not batch:
                return
        texts = [t for chunk in batch for t in chunk.texts]
        self._pending -= len(texts)
        self.metrics.batch_size.observe(len(texts))
        started = time.perf_counter()
        for chunk in batch:
            self.metrics.queue_seconds.observe(time.monotonic() - chunk.queued_at)
        if self._encode is not None:
            self.metrics.batch_tokens.observe(padded_tokens([c for chunk in batch for c in chunk.costs]))
        try:
            results = await self.run_in_worker(self._predict_checked, [i for chunk in batch for i in chunk.items])
        except Exception as e:
            await self._isolate(batch, e)
            return
        finally:
            self.metrics.batch_seconds.observe(time.perf_counter() - started)
        self.metrics.texts.inc(amount=len(texts))
        start = 0
        for chunk in batch:
            _settle(chunk, result=results[start:start + len(chunk.texts)])
            start += len(chunk.texts)

    async def _isolate(self, batch: list[_Chunk], error: Exception) -> None:
        """After a failed batch, run each request's chunk alone: only the chunks that fail again get an error."""
        if len(batch) == 1:
            self._fail(batch[0], error)
            return
        for chunk in batch:
            if chunk.future.done():
                continue
            try:
                _settle(chunk, result=await self.run_in_worker(self._predict_checked, chunk.items))
                self.metrics.texts.inc(amount=len(chunk.texts))
            except Exception as e:
                self._fail(chunk, e)

    def _fail(self, chunk: _Chunk, error: Exception) -> None:
        error_id = uuid.uuid4().hex[:12]
        self.metrics.model_errors.inc()
        log.error("model error %s on %d texts (first: %r)", error_id, len(chunk.texts), chunk.texts[0][:80],
                  exc_info=error)
        _settle(chunk, exc=ModelFailed(error_id))

    def _predict_checked(self, items: list[Any]) -> list[Any]:
        results = self._predict(items)
        if len(results) != len(items):
            raise RuntimeError(f"the model returned {len(results)} results for {len(items)} texts")
        return results


def _settle(chunk: _Chunk, result: Any = None, exc: BaseException | None = None) -> None:
    if chunk.future.done():
        return
    if exc is not None:
        chunk.future.set_exception(exc)
    else:
        chunk.future.set_result(result)
