"""What both HTTP APIs (native and TEI-compatible) stand on: the backend they call, the error they raise for a
request that cannot be answered, reading a bounded body, parsing it as bounded JSON off the event loop, and
dropping the work of a client that went away.

An `ApiError` carries the native API's status and code; `app.error_reply` answers it (and the backend's own
errors) in the shape of the API the request came to.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from torchloom.model.served import ModelIdentity
from torchloom.serve.metrics import ServeMetrics

T = TypeVar("T")
KEY_HEADER = "x-torchloom-key"  # a client's routing key: the same key, the same model (serve/fleet.py)
MODEL_HEADER = "X-Torchloom-Model"  # the model that answered
IDS_HEADER = "X-Torchloom-Ids"  # the texts' prediction ids, for POST /v1/feedback
# Bodies up to this size are parsed on the event loop (a thread hop costs more than parsing them); larger ones
# on a worker thread, so a few MB of JSON never stall the other connections.
PARSE_INLINE_BYTES = 16 * 1024
# Bounds on what a body may make the JSON parser do. A valid request nests 3 deep at most (TEI's batch); past
# about 1000 levels json raises RecursionError. An integer of more digits than Python's int_max_str_digits
# (4300 by default, settable to "no limit" from the environment, and then quadratic) raises ValueError. Both
# would be a 500: they are refused as invalid JSON first, with a fixed bound whatever the environment says.
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 100
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))  # 255: -1 as int8


class Backend(Protocol):
    """What the HTTP app, the fleet and the admin API ask of a backend (one model here or on Ray, or a fleet of
    them): every power a caller uses is named here, none probed for."""

    identity: ModelIdentity
    metrics: ServeMetrics
    # Several models behind the endpoint (serve/fleet.py: routing keys, feedback, the admin API, the verdict), or
    # None for one model: the fleet is this backend then, for routes only a fleet serves.
    fleet: Any

    @property
    def ready(self) -> bool: ...

    @property
    def queued(self) -> int: ...  # texts waiting in its queue now (a replaced model is stopped once it is 0)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def predict(self, texts: list[str]) -> list[dict[str, Any]]: ...

    def monitor_report(self) -> dict[str, Any]: ...  # monitor/live.py's report, or its "off" report


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
    task = asyncio.current_task()
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()  # cancels what the request awaits: its texts' place in the queue

    # One watcher task, the work awaited in this one: a second task and asyncio.wait per request cost more
    # than the rest of the front end's Python (issue 48)
    watcher = asyncio.ensure_future(disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone("waiting") from None
    finally:
        watcher.cancel()


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


class _TooManyDigits(Exception):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooManyDigits(len(digits.lstrip("-")))
    return int(digits)


def json_depth(body: bytes) -> int:
    """How deep the lists and objects of a JSON body nest (brackets inside strings do not count)."""
    import numpy as np

    # One C-speed pass each (regex, translate, cumsum): a Python loop over 4 MB of brackets takes a second.
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(np.frombuffer(brackets.translate(_BRACKET_STEP), np.int8), dtype=np.int64).max())


def load_json(body: bytes, example: str) -> Any:
    """The parsed body, or an ApiError 400 "invalid_json" naming what is wrong: not UTF-8, not JSON, nested
    past MAX_JSON_DEPTH, or an integer past MAX_INT_DIGITS digits."""
    # Counting brackets is cheap; bodies with few (every valid request has 2 to 5) are not scanned.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise ApiError(400, "invalid_json", f"the body nests lists or objects {depth} deep, more than the"
                                            f" {MAX_JSON_DEPTH} allowed; {example}")
    try:
        # JSON over HTTP is UTF-8 (RFC 8259); json.loads(bytes) would also guess UTF-16/32.
        return json.loads(body.decode("utf-8").removeprefix("\ufeff"), parse_int=_bounded_int)
    except UnicodeDecodeError as e:
        raise ApiError(400, "invalid_json", f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON ({e.msg} at line {e.lineno} column"
                                            f" {e.colno}); {example}") from None
    except _TooManyDigits as e:
        raise ApiError(400, "invalid_json", f"the body has an integer of {e.digits} digits, more than the"
                                            f" {MAX_INT_DIGITS} allowed; {example}") from None
    except RecursionError:  # unreachable while json_depth and the parser agree on strings; a 400 if they do not
        raise ApiError(400, "invalid_json", f"the body nests too deep to parse; {example}") from None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages: "a number, not a string"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def routed_predict(request: Request, backend: Backend, texts: list[str]):
    """backend.predict, with the request's routing key where the backend routes (serve/fleet.py)."""
    key = request.headers.get(KEY_HEADER)
    if key is not None and backend.fleet is not None:
        return backend.fleet.predict(texts, key)
    return backend.predict(texts)


def answered_by(backend: Backend, predictions: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """The model that answered, as the native body shows it, and the response headers that name it (and the
    texts' prediction ids, for POST /v1/feedback)."""
    name = predictions[0].get("model") if predictions else None
    members = backend.fleet.members if backend.fleet is not None else {}
    identity = members[name].identity if name in members else backend.identity
    model = identity.brief()
    headers = {}
    if name is not None:
        model["variant"] = name
        headers[MODEL_HEADER] = name
    if predictions and "id" in predictions[0]:
        headers[IDS_HEADER] = ",".join(p["id"] for p in predictions)
    return model, headers


# FastAPI reads these annotations by name from the module (this file uses postponed annotations).
BEARER = HTTPBearer(auto_error=False, description="the key the server was started with")
BearerToken = Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]


def api_key_check(api_key: str | None):
    """The dependency that refuses a request without `api_key` (None: every request passes)."""

    # async: FastAPI runs a plain `def` dependency on its thread pool, a thread hop on every request
    async def check_api_key(credentials: BearerToken) -> None:
        if api_key is None:
            return
        token = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(token, api_key.encode()):
            raise ApiError(401, "unauthorized", "missing or wrong API key; send the header"
                                                " 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})

    return check_api_key


class ErrorBody(BaseModel):
    code: str
    message: str
    id: str | None = Field(default=None, description="for model errors: find it in the server log")


class ErrorResponse(BaseModel):
    error: ErrorBody
