"""The HTTP app, shared by the local server and the Ray Serve deployment: the native API, the TEI-compatible
one (tei.py), health and metrics, auth, and the one answer to a failed request.

A `Backend` does the predicting (the micro-batcher locally, `@serve.batch` on Ray); this module only
speaks HTTP. Every native error is JSON: {"error": {"code", "message"[, "id"]}}.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import torchloom
from torchloom.errors import UserError, one_line
from torchloom.serve import tei
from torchloom.serve.api_common import (
    BEARER,
    ApiError,
    Backend,
    ClientGone,
    ErrorResponse,
    answered_by,
    api_key_check,
    json_type,
    load_json,
    parse_off_loop,
    read_body,
    routed_predict,
    until_disconnect,
)
from torchloom.serve.batcher import ModelFailed, Overloaded, ShuttingDown
from torchloom.serve.connections import RequestCap
from torchloom.serve.metrics import CONTENT_TYPE, ServeMetrics
from torchloom.serve.settings import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger("torchloom.serve")

ENDPOINTS = ("/v1/predict", "/predict", "/v1/labels", "/v1/monitor", "/v1/feedback", "/v1/admin", "/",
             "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json")
# Worst case JSON size of one character (\uXXXX for a surrogate half, twice) plus per-item overhead.
_BYTES_PER_CHAR = 12
_BYTES_PER_ITEM = 8
_BODY_SLACK = 4096


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


class PathStep(BaseModel):
    label: str
    score: float


class Prediction(BaseModel):
    label: str
    score: float = Field(description="probability of `label`")
    probabilities: dict[str, float] = Field(description="probability of every label (a multi-label model: each"
                                                        " tag's own sigmoid, not summing to 1)")
    labels: list[str] | None = Field(None, description="a multi-label model's tags for the text: those at or over"
                                                       " their thresholds, the most probable first")
    path: list[PathStep] | None = Field(None, description="hierarchical labels (data.label_path_delimiter): the"
                                        " predicted leaf's parents, the top first, then the leaf; a parent's score"
                                        " is the sum of its leaves' probabilities")
    parents: list[str] | None = Field(None, description="a hierarchical multi-label model's parents of its tags")


class ModelInfo(BaseModel):
    name: str = Field(description="the model's name: a registered model's registry name, else its directory's")
    version: str = Field(description="a registered model's registry version, else its export time")
    aliases: list[str] | None = Field(None, description="a registered model's aliases when it was fetched")
    uri: str | None = Field(None, description="a registered model's models:/NAME/VERSION")
    variant: str | None = Field(None, description="the model's name behind this endpoint, where several are")


class PredictResponse(BaseModel):
    model: ModelInfo
    predictions: list[Prediction] = Field(description="one per text, in request order")


class LabelsResponse(BaseModel):
    model: ModelInfo
    labels: list[str]


# --- errors ------------------------------------------------------------------------------------------------


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   error_id: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if error_id:
        body["id"] = error_id
    return JSONResponse({"error": body}, status_code=status, headers=headers)


# What a request can fail with that is not the server's fault: error_reply answers each.
DOMAIN_ERRORS = (ApiError, UserError, Overloaded, ShuttingDown, ModelFailed, ClientGone)
# A body refused for what it holds: one log line each (no traceback), so an operator sees what clients send.
BODY_REFUSALS = (400, 413, 422)


async def error_reply(request: Request, e: Exception) -> Response:
    """The one answer to a failed request, for both APIs: a domain error as a status, code and message (with
    Retry-After or an error id where they help), in the shape of the API the request came to."""
    if isinstance(e, ClientGone):
        # Nobody to answer: the body was cut off, or the texts were dropped from the queue before the model saw them.
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.client_disconnects.inc(e.stage)
        return Response(status_code=499)
    if isinstance(e, Overloaded):
        e = ApiError(429, "overloaded", f"the server is at capacity ({e}); retry after {e.retry_after} s",
                     {"Retry-After": str(e.retry_after)})
    elif isinstance(e, ShuttingDown):
        e = ApiError(503, "shutting_down", "the server is shutting down; retry on another instance",
                     {"Retry-After": "1"})
    elif isinstance(e, ModelFailed):
        e = ApiError(500, "model_error", f"{e}; the server log has the traceback under this id", error_id=e.error_id)
    elif isinstance(e, UserError):
        e = ApiError(422, "invalid_request", one_line(str(e)))
    if e.status in BODY_REFUSALS:
        client = request.client.host if request.client else "a client"
        log.info("refused %s %s from %s: %d %s: %s", request.method, request.url.path, client, e.status, e.code,
                 one_line(e.message))
    # A refused key gets the native answer on both APIs (TEI's own is a bare 401, without a body).
    if isinstance(request.scope.get("route"), tei.TeiRoute) and e.status != 401:
        return tei.error_response(e)
    return error_response(e.status, e.code, e.message, e.headers, e.error_id)


def _answer_errors(app: FastAPI) -> None:
    """Every error as JSON: domain errors through error_reply; routing, schema and unexpected errors."""
    for kind in DOMAIN_ERRORS:
        app.add_exception_handler(kind, error_reply)

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


# --- the native API ----------------------------------------------------------------------------------------


EXAMPLE = 'send JSON like {"texts": ["first text", "second text"]}'


def parse_texts(body: bytes, max_texts: int, max_chars: int) -> list[str]:
    """The texts of a /v1/predict body, or an ApiError naming what is wrong with it."""
    if not body.strip():
        raise ApiError(400, "empty_body", f"the request body is empty; {EXAMPLE}")
    payload = load_json(body, EXAMPLE)
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", f"the body is a JSON {json_type(payload)}, not an object; {EXAMPLE}")
    if "texts" not in payload:
        raise ApiError(422, "invalid_request", f'the body has no "texts" field; {EXAMPLE}')
    texts = payload["texts"]
    if not isinstance(texts, list):
        raise ApiError(422, "invalid_request", f'"texts" is a {json_type(texts)}, not a list of strings; {EXAMPLE}')
    if not texts:
        raise ApiError(422, "empty_texts", '"texts" is an empty list; send at least one text')
    if len(texts) > max_texts:
        raise ApiError(413, "too_many_texts", f'"texts" has {len(texts)} items, more than the {max_texts} allowed'
                                              " per request; split it into several requests")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ApiError(422, "invalid_text", f'"texts"[{i}] is a {json_type(text)}, not a string')
        if len(text) > max_chars:
            raise ApiError(413, "text_too_long", f'"texts"[{i}] has {len(text)} characters, more than the'
                                                 f" {max_chars} allowed; shorten it (the model reads only the"
                                                 " first tokens anyway)")
    return texts


def native_router(backend: Backend, max_texts: int, max_chars: int, body_limit: int) -> APIRouter:
    """The native API over `backend`: POST /v1/predict and GET /v1/labels."""
    identity = backend.identity
    model_info = identity.brief()
    api = APIRouter()

    @api.get("/v1/labels", response_model=LabelsResponse)
    async def labels() -> Response:
        return JSONResponse({"model": model_info, "labels": list(identity.labels)})

    @api.get("/v1/monitor", summary="the monitor's verdict on recent texts: drift per signal against its"
                                     " threshold, estimated accuracy, class shares (docs/serving.md, Monitoring)")
    async def monitor() -> Response:
        report = monitor_report(backend)
        shown = {k: v for k, v in report.items() if k not in ("at", "model")}
        fleet = backend.fleet.report() if backend.fleet is not None else {}
        return JSONResponse({"model": model_info, **shown, **fleet})

    @api.post(
        "/v1/predict", response_model=PredictResponse,
        responses={status: {"model": ErrorResponse} for status in (400, 413, 422, 429, 500, 503)},
        summary="label, score and per-label probabilities for each text",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_schema(max_texts, max_chars)}}}},
    )
    async def predict(request: Request) -> Response:
        return await answer_predict(request, backend, max_texts, max_chars, body_limit)

    return api


def monitor_report(backend: Backend) -> dict[str, Any]:
    """The backend's monitor report (monitor/live.py; its "off" report where it watches nothing)."""
    return backend.monitor_report()


async def answer_predict(request: Request, backend: Backend, max_texts: int, max_chars: int,
                         body_limit: int) -> Response:
    """The answer to POST /v1/predict (errors raised, for error_reply)."""
    texts = await parse_off_loop(parse_texts, await read_body(request, body_limit), max_texts, max_chars)
    predictions = await until_disconnect(request, routed_predict(request, backend, texts))
    model, headers = answered_by(backend, predictions)
    shown = [{k: p[k] for k in SHOWN if k in p} for p in predictions]
    body = json.dumps({"model": model, "predictions": shown}, ensure_ascii=False, separators=(",", ":"))
    return Response(body.encode("utf-8"), media_type="application/json", headers=headers)


SHOWN = ("id", "label", "score", "probabilities", "labels", "path", "parents", "outlier")


class FastPredict:
    """POST /v1/predict answered in plain ASGI, past FastAPI's routing, dependency solving and exception
    middleware, which cost more per request than the rest of the front end together (docs/benchmarks.md, issue
    48). The same key check (the same HTTPBearer), the same answer (answer_predict), the same error replies
    (error_reply; anything else reaches the app's unexpected-error handler, as a route's would). The FastAPI route
    stays: it is what /openapi.json documents."""

    def __init__(self, app, backend: Backend, max_texts: int, max_chars: int, body_limit: int,
                 api_key: str | None) -> None:
        self.app, self.backend, self.limits, self.check = (app, backend, (max_texts, max_chars, body_limit),
            api_key_check(api_key))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/predict" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            await self.check(await BEARER(request))
            response = await answer_predict(request, self.backend, *self.limits)
        except DOMAIN_ERRORS as e:
            response = await error_reply(request, e)
        await response(scope, receive, send)


# --- health and metrics ------------------------------------------------------------------------------------


PREDICT_ENDPOINTS = ("/v1/predict", "/predict")


class RefusedLog:
    """A 401 is one log line (the client, the endpoint; never the key it sent), at most one a minute per client
    and endpoint, with how many were refused since the last line."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, scope, endpoint: str) -> None:
        client = (scope.get("client") or ("?", 0))[0]
        now = time.monotonic()
        at, count = self.last.get((client, endpoint), (-self.EVERY_S, 0))
        if now - at < self.EVERY_S:
            self.last[(client, endpoint)] = (at, count + 1)
            return
        more = f" ({count} more since the last line)" if count else ""
        log.warning("refused %s from %s: 401, missing or wrong key%s", endpoint, client, more)
        if len(self.last) > 10_000:  # a scan from many addresses: the oldest forgotten
            self.last.clear()
        self.last[(client, endpoint)] = (now, 0)


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status and times it (pure ASGI: no per-request task)."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics, self.refused = app, metrics, RefusedLog()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "/v1/admin" if path.startswith("/v1/admin/") else "other"
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
            seconds = time.perf_counter() - started
            self.metrics.requests.inc(endpoint, str(status))
            self.metrics.latency.observe(seconds, endpoint)
            if status == 200 and endpoint in PREDICT_ENDPOINTS:
                self.metrics.observe_predict(seconds)
            elif status == 401:
                self.refused.note(scope, endpoint)


# The page's own script and style only, calls to this server only, in no frame of another site
PAGE_POLICY = ("default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self';"
               " img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def health_router(backend: Backend) -> APIRouter:
    """GET /healthz, /readyz and /metrics: open to anyone, like a load balancer or Prometheus."""
    identity = backend.identity
    api = APIRouter()

    @api.get("/healthz", summary="the process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz", summary="the model is loaded and warmed up", responses={503: {"model": ErrorResponse}})
    async def readyz() -> Response:
        if not backend.ready:
            return error_response(503, "not_ready", "the model is warming up", {"Retry-After": "1"})
        return JSONResponse({"status": "ready", "model": identity.brief()})

    @api.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(backend.metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/", summary="the status page: the model, live traffic, the monitor, a box to try a text",
             response_class=Response)
    async def status_page() -> Response:
        from torchloom.serve.page import render_page

        nonce = secrets.token_urlsafe(16)
        return Response(render_page(identity, nonce), media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": PAGE_POLICY.format(nonce=nonce),
                                 "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    return api


# --- the app -----------------------------------------------------------------------------------------------


def body_limit_for(max_texts: int, max_chars: int, max_body_bytes: int) -> int:
    """The largest body a request may send: `max_body_bytes`, or less where the text limits allow less."""
    return min(max_body_bytes, max_texts * (max_chars * _BYTES_PER_CHAR + _BYTES_PER_ITEM) + _BODY_SLACK)


def create_app(backend: Backend, max_texts: int, max_chars: int, api_key: str | None = None,
               engine: str = "local", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_connections: int | None = None, admin_key: str | None = None,
               model_roots: list[str] = ()) -> FastAPI:
    """The FastAPI app for `backend`, one router per API; its lifespan starts and stops the backend.
    max_connections: requests served at once, past it 503 (connections.RequestCap); None: no cap (Ray's).
    admin_key: the admin route's own key (None: the route refuses every call); model_roots: where it may load."""
    identity = backend.identity
    body_limit = body_limit_for(max_texts, max_chars, max_body_bytes)

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
    app.state.metrics = backend.metrics  # error_reply counts client disconnects
    app.add_middleware(FastPredict, backend=backend, max_texts=max_texts, max_chars=max_chars, body_limit=body_limit,
                       api_key=api_key)  # innermost of ours: the cap and the metrics see its requests
    if max_connections is not None:
        app.add_middleware(RequestCap, limit=max_connections)  # added first: inside the metrics, which count its 503s
    app.add_middleware(MetricsMiddleware, metrics=backend.metrics)
    _answer_errors(app)
    app.include_router(health_router(backend))
    guarded: dict[str, Any] = {"dependencies": [Depends(api_key_check(api_key))],
                               "responses": {401: {"model": ErrorResponse}}}
    app.include_router(native_router(backend, max_texts, max_chars, body_limit), **guarded)
    app.include_router(tei.router(backend, max_texts, max_chars, body_limit), **guarded)
    if backend.fleet is not None:
        from torchloom.serve.fleet_api import admin_key_check, admin_router, feedback_router

        app.include_router(feedback_router(backend), **guarded)
        app.include_router(admin_router(backend, list(model_roots)),
                           dependencies=[Depends(admin_key_check(admin_key, api_key))],
                           responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    return app
