"""The HTTP API, shared by the local server and the Ray Serve deployment: routes, request checks, errors, auth.

A `Backend` does the predicting (the micro-batcher locally, `@serve.batch` on Ray); this module only
speaks HTTP. Every error is JSON: {"error": {"code", "message"[, "id"]}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import torchloom
from torchloom.serve.batcher import ModelFailed, Overloaded, ShuttingDown
from torchloom.serve.metrics import CONTENT_TYPE, ServeMetrics
from torchloom.serve.model import ModelIdentity

log = logging.getLogger("torchloom.serve")

ENDPOINTS = ("/v1/predict", "/predict", "/v1/labels", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json")
# Worst case JSON size of one character (\uXXXX for a surrogate half, twice) plus per-item overhead.
_BYTES_PER_CHAR = 12
_BYTES_PER_ITEM = 8
_BODY_SLACK = 4096


class Backend(Protocol):
    identity: ModelIdentity
    metrics: ServeMetrics

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def predict(self, texts: list[str]) -> list[dict[str, Any]]: ...


# FastAPI reads these annotations by name from the module (this file uses postponed annotations).
BearerToken = Annotated[HTTPAuthorizationCredentials | None,
                        Depends(HTTPBearer(auto_error=False, description="the key the server was started with"))]


# --- schemas: documentation in /docs (requests are parsed by hand for precise error messages) -----------


class PredictRequest(BaseModel):
    texts: list[str] = Field(min_length=1, examples=[["The striker scored twice in the second half."]])


def request_schema(max_texts: int, max_chars: int) -> dict:
    """PredictRequest's JSON schema with this server's limits, so that clients (and fuzzers) know them."""
    schema = PredictRequest.model_json_schema()
    texts = schema["properties"]["texts"]
    texts["maxItems"] = max_texts
    texts["items"] = {**texts.get("items", {}), "maxLength": max_chars}
    return schema


class Prediction(BaseModel):
    label: str
    score: float = Field(description="probability of `label`")
    probabilities: dict[str, float] = Field(description="probability of every label")


class TeiPrediction(BaseModel):
    score: float = Field(description="the label's probability, or its logit with raw_scores")
    label: str


class TeiErrorResponse(BaseModel):
    error: str
    error_type: str = Field(description="Validation (413), Tokenizer (422), Empty (400), Overloaded (429),"
                                        " Backend (424) or Unhealthy (503), as text-embeddings-inference says")


def tei_schema(max_texts: int, max_chars: int) -> dict:
    """The JSON schema of a TEI /predict body, with this server's limits."""
    text = {"type": "string", "maxLength": max_chars}
    return {"type": "object", "required": ["inputs"], "properties": {
        "inputs": {"oneOf": [text, {"type": "array", "minItems": 1, "maxItems": max_texts, "items": {
            "type": "array", "items": text, "minItems": 1, "maxItems": 1}}]},
        "truncate": {"type": "boolean", "default": False},
        "raw_scores": {"type": "boolean", "default": False}}}


class ModelInfo(BaseModel):
    name: str
    version: str


class PredictResponse(BaseModel):
    model: ModelInfo
    predictions: list[Prediction] = Field(description="one per text, in request order")


class LabelsResponse(BaseModel):
    model: ModelInfo
    labels: list[str]


class ErrorBody(BaseModel):
    code: str
    message: str
    id: str | None = Field(default=None, description="for model errors: find it in the server log")


class ErrorResponse(BaseModel):
    error: ErrorBody


# --- errors ------------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None,
                 error_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.error_id = status, code, message, headers, error_id


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   error_id: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if error_id:
        body["id"] = error_id
    return JSONResponse({"error": body}, status_code=status, headers=headers)


EXAMPLE = 'send JSON like {"texts": ["first text", "second text"]}'


def parse_texts(body: bytes, max_texts: int, max_chars: int) -> list[str]:
    """The texts of a /v1/predict body, or an ApiError naming what is wrong with it."""
    if not body.strip():
        raise ApiError(400, "empty_body", f"the request body is empty; {EXAMPLE}")
    try:
        # JSON over HTTP is UTF-8 (RFC 8259); json.loads(bytes) would also guess UTF-16/32.
        payload = json.loads(body.decode("utf-8").removeprefix("\ufeff"))
    except UnicodeDecodeError as e:
        raise ApiError(400, "invalid_json", f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON ({e.msg} at line {e.lineno} column"
                                            f" {e.colno}); {EXAMPLE}") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", f"the body is a JSON {_json_type(payload)}, not an object; {EXAMPLE}")
    if "texts" not in payload:
        raise ApiError(422, "invalid_request", f'the body has no "texts" field; {EXAMPLE}')
    texts = payload["texts"]
    if not isinstance(texts, list):
        raise ApiError(422, "invalid_request", f'"texts" is a {_json_type(texts)}, not a list of strings; {EXAMPLE}')
    if not texts:
        raise ApiError(422, "empty_texts", '"texts" is an empty list; send at least one text')
    if len(texts) > max_texts:
        raise ApiError(413, "too_many_texts", f'"texts" has {len(texts)} items, more than the {max_texts} allowed'
                                              " per request; split it into several requests")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ApiError(422, "invalid_text", f'"texts"[{i}] is a {_json_type(text)}, not a string')
        if len(text) > max_chars:
            raise ApiError(413, "text_too_long", f'"texts"[{i}] has {len(text)} characters, more than the'
                                                 f" {max_chars} allowed; shorten it (the model reads only the"
                                                 " first tokens anyway)")
    return texts


class TeiError(Exception):
    """An error of the TEI-compatible route, answered the way text-embeddings-inference answers it:
    {"error": message, "error_type": Validation | Tokenizer | Overloaded | Backend | Unhealthy | Empty}."""

    STATUS = {"Validation": 413, "Tokenizer": 422, "Overloaded": 429, "Backend": 424, "Unhealthy": 503, "Empty": 400}

    def __init__(self, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.error_type, self.message, self.headers = error_type, message, headers


TEI_EXAMPLE = 'send JSON like {"inputs": "a text"} or {"inputs": [["first text"], ["second text"]]}'


def parse_tei(body: bytes, max_texts: int, max_chars: int) -> tuple[list[str], bool, bool]:
    """(texts, batched, raw_scores) of a TEI /predict body: `inputs` is a string, or a batch of one-string
    lists. A pair of strings ([a, b] or [[a, b], ...]) is for cross-encoders and is refused."""
    if not body.strip():
        raise TeiError("Empty", f"the request body is empty; {TEI_EXAMPLE}")
    try:
        payload = json.loads(body.decode("utf-8").removeprefix("\ufeff"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TeiError("Tokenizer", f"the body is not UTF-8 JSON ({e}); {TEI_EXAMPLE}") from None
    if not isinstance(payload, dict) or "inputs" not in payload:
        raise TeiError("Tokenizer", f'the body has no "inputs" field; {TEI_EXAMPLE}')
    for flag in ("truncate", "raw_scores"):
        if not isinstance(payload.get(flag, False), bool):
            raise TeiError("Tokenizer", f'"{flag}" is a {_json_type(payload[flag])}, not true or false')
    inputs = payload["inputs"]
    if isinstance(inputs, str):
        texts, batched = [inputs], False
    elif isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        raise TeiError("Tokenizer", f"a list of {len(inputs)} strings is a text pair (for cross-encoders); this model"
                                    ' classifies single texts: send a batch as [["first"], ["second"]]')
    elif isinstance(inputs, list) and inputs and all(isinstance(x, list) for x in inputs):
        if any(len(x) != 1 or not isinstance(x[0], str) for x in inputs):
            raise TeiError("Tokenizer", "every item of a batch must be a one-string list [\"text\"]; this model"
                                        " classifies single texts, not pairs")
        texts, batched = [x[0] for x in inputs], True
    else:
        raise TeiError("Empty" if inputs == [] else "Tokenizer",
                       f'"inputs" must be a string or a non-empty batch of one-string lists; {TEI_EXAMPLE}')
    if len(texts) > max_texts:
        raise TeiError("Validation", f"batch size {len(texts)} > maximum allowed batch size {max_texts}")
    for i, text in enumerate(texts):
        if len(text) > max_chars:
            raise TeiError("Validation", f"input {i} has {len(text)} characters, more than the {max_chars} allowed")
    return texts, batched, payload.get("raw_scores", False)


def tei_answer(prediction: dict[str, Any], raw_scores: bool) -> list[dict[str, Any]]:
    """One text's TEI answer: every label with its probability (or its logit, raw_scores), highest first."""
    scores = prediction["logits"] if raw_scores else prediction["probabilities"]
    return sorted(({"score": float(v), "label": k} for k, v in scores.items()), key=lambda x: -x["score"])


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


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


# --- metrics middleware ------------------------------------------------------------------------------------


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status and times it (pure ASGI: no per-request task)."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        started = time.perf_counter()
        status = 500

        async def send_and_record(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.inc(endpoint, str(status))
            self.metrics.latency.observe(time.perf_counter() - started, endpoint)


# --- the app -----------------------------------------------------------------------------------------------


def create_app(backend: Backend, max_texts: int, max_chars: int, api_key: str | None = None,
               engine: str = "local") -> FastAPI:
    """The FastAPI app for `backend`; its lifespan starts and stops the backend."""
    identity = backend.identity
    model_info = {"name": identity.name, "version": identity.version}
    body_limit = max_texts * (max_chars * _BYTES_PER_CHAR + _BYTES_PER_ITEM) + _BODY_SLACK

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(
        title=f"torchloom: {identity.name}",
        version=torchloom.__version__,
        description=f"Text classifier {identity.name} (version {identity.version}), labels:"
                    f" {', '.join(identity.labels)}. Served by torchloom ({engine} engine).",
        lifespan=lifespan,
    )
    app.add_middleware(MetricsMiddleware, metrics=backend.metrics)

    def check_api_key(credentials: BearerToken) -> None:
        if api_key is None:
            return
        token = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(token, api_key.encode()):
            raise ApiError(401, "unauthorized", "missing or wrong API key; send the header"
                                                " 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.code, e.message, e.headers, e.error_id)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(e.status_code, code, str(e.detail), getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", str(e.errors()))

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, e: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s", error_id, exc_info=e)
        return error_response(500, "internal_error", f"unexpected server error (error id {error_id}); see the"
                                                     " server log", error_id=error_id)

    errors = {status: {"model": ErrorResponse} for status in (400, 401, 413, 422, 429, 500, 503)}

    @app.get("/healthz", summary="the process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="the model is loaded and warmed up", responses={503: {"model": ErrorResponse}})
    async def readyz() -> Response:
        if not backend.ready:
            return error_response(503, "not_ready", "the model is warming up", {"Retry-After": "1"})
        return JSONResponse({"status": "ready", "model": model_info})

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(backend.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/labels", response_model=LabelsResponse, dependencies=[Depends(check_api_key)],
             responses={401: errors[401]})
    async def labels() -> Response:
        return JSONResponse({"model": model_info, "labels": list(identity.labels)})

    @app.post(
        "/v1/predict", response_model=PredictResponse, dependencies=[Depends(check_api_key)], responses=errors,
        summary="label, score and per-label probabilities for each text",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_schema(max_texts, max_chars)}}}},
    )
    async def predict(request: Request) -> Response:
        texts = parse_texts(await read_body(request, body_limit), max_texts, max_chars)
        try:
            predictions = await until_disconnect(request, backend.predict(texts))
        except ClientGone:
            # Nobody to answer: the texts were dropped from the queue before the model saw them.
            return Response(status_code=499)
        except Overloaded as e:
            raise ApiError(429, "overloaded", f"the server is at capacity ({e}); retry after"
                                              f" {e.retry_after} s", {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise ApiError(503, "shutting_down", "the server is shutting down; retry on another instance",
                           {"Retry-After": "1"}) from None
        except ModelFailed as e:
            raise ApiError(500, "model_error", f"{e}; the server log has the traceback under this id",
                           error_id=e.error_id) from None
        shown = [{k: p[k] for k in ("label", "score", "probabilities")} for p in predictions]
        body = json.dumps({"model": model_info, "predictions": shown}, ensure_ascii=False, separators=(",", ":"))
        return Response(body.encode("utf-8"), media_type="application/json")

    @app.exception_handler(TeiError)
    async def tei_error(_request: Request, e: TeiError) -> JSONResponse:
        return JSONResponse({"error": e.message, "error_type": e.error_type}, status_code=TeiError.STATUS[e.error_type],
                            headers=e.headers)

    @app.post(
        "/predict", dependencies=[Depends(check_api_key)],
        response_model=list[TeiPrediction] | list[list[TeiPrediction]],
        summary="text-embeddings-inference's predict: every label's score per input, highest first",
        description="TEI's request shape: `inputs` (a string, or a batch [[\"text\"], ...]), `truncate` (accepted;"
                    " texts are always cut the way the model was trained), `raw_scores` (logits instead of"
                    " probabilities). Errors are TEI's: {\"error\", \"error_type\"}.",
        responses={401: errors[401],
                   **{status: {"model": TeiErrorResponse} for status in (400, 413, 422, 424, 429, 503)}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": tei_schema(max_texts, max_chars)}}}},
    )
    async def tei_predict(request: Request) -> Response:
        try:
            body = await read_body(request, body_limit)
        except ApiError as e:
            raise TeiError("Validation", e.message) from None
        texts, batched, raw = parse_tei(body, max_texts, max_chars)
        try:
            predictions = await until_disconnect(request, backend.predict(texts))
        except ClientGone:
            return Response(status_code=499)
        except Overloaded as e:
            raise TeiError("Overloaded", f"model is overloaded ({e})", {"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise TeiError("Unhealthy", "the server is shutting down; retry on another instance",
                           {"Retry-After": "1"}) from None
        except ModelFailed as e:
            raise TeiError("Backend", f"{e} (error id {e.error_id}; the server log has the traceback)") from None
        answers = [tei_answer(p, raw) for p in predictions]
        body = json.dumps(answers if batched else answers[0], ensure_ascii=False, separators=(",", ":"))
        return Response(body.encode("utf-8"), media_type="application/json")

    return app
