"""What both HTTP APIs (native and TEI-compatible) stand on: the backend they call, the error they raise for a
request that cannot be answered, reading a bounded body, and dropping the work of a client that went away.

An `ApiError` carries the native API's status and code; `app.error_reply` answers it (and the backend's own
errors) in the shape of the API the request came to.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fastapi import Request

from torchloom.serve.metrics import ServeMetrics
from torchloom.serve.model import ModelIdentity


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
    """The client closed the connection while its texts waited."""


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
        raise ClientGone
    return task.result()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (never buffered whole)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"the body has {declared} bytes, more than the {limit} allowed")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"the body is larger than the {limit} bytes allowed")
        chunks.append(chunk)
    return b"".join(chunks)


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages: "a number, not a string"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)
