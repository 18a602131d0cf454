"""What both HTTP APIs (native and TEI-compatible) stand on: the backend they call, the error they raise for a
request that cannot be answered, reading a bounded body, parsing it off the event loop, and dropping the work
of a client that went away.

An `ApiError` carries the native API's status and code; `app.error_reply` answers it (and the backend's own
errors) in the shape of the API the request came to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from torchloom.serve.metrics import ServeMetrics
from torchloom.serve.model import ModelIdentity

T = TypeVar("T")
# Bodies up to this size are parsed on the event loop (a thread hop costs more than parsing them); larger ones
# on a worker thread, so a few MB of JSON never stall the other connections.
PARSE_INLINE_BYTES = 16 * 1024


class Backend(Protocol):
    identity: ModelIdentity
    metrics: ServeMetrics

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def predict(self, texts: list[str]) -> list[dict[str, Any]]: ...


class ApiError(Exception):
    """A request that cannot be answered: its status and code (the native API's), a message for the client."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 error_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.error_id = status, code, message, headers, error_id


class ClientGone(Exception):
    """The client closed the connection: while sending its body ("body"), or while its texts waited ("waiting")."""

    def __init__(self, stage: str = "waiting") -> None:
        super().__init__(f"the client disconnected ({stage})")
        self.stage = stage


async def until_disconnect(request: Request, work) -> Any:
    """Await `work`, or cancel it as soon as the client disconnects (uvicorn does not cancel a handler
    whose client went away; cancelling the prediction takes its texts out of the batcher's queue)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientGone("waiting")
    return task.result()


def body_too_large(size: str, limit: int) -> ApiError:
    """413 for a body past `limit`, closing the connection so that the rest of the body is never read."""
    return ApiError(413, "body_too_large", f"the request body has {size}, more than the {limit} bytes allowed;"
                                           " send fewer or shorter texts per request", headers={"Connection": "close"})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 up front when its Content-Length passes `limit` bytes, and as soon as it
    passes them when it has none (chunked): never buffered past `limit`. A client that disconnects while
    sending it is ClientGone("body")."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise body_too_large(f"{declared} bytes (its Content-Length)", limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(f"{size} bytes so far (no Content-Length)", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone("body") from None
    return b"".join(chunks)


async def parse_off_loop(parse: Callable[..., T], body: bytes, *args: Any) -> T:
    """`parse(body, *args)`: on the event loop for a small body, on a worker thread for a larger one."""
    if len(body) <= PARSE_INLINE_BYTES:
        return parse(body, *args)
    return await asyncio.to_thread(parse, body, *args)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages: "a number, not a string"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)
