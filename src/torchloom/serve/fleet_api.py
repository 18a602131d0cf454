"""The HTTP side of several models behind one endpoint (serve/fleet.py): POST /v1/feedback and the admin route,
/v1/admin, feedback behind the API key and the admin route behind its own (--admin-key; docs/serving.md, "A/B and
shadow"). Bodies are parsed by hand, for one-line errors;
their schemas document them in /openapi.json."""

from __future__ import annotations

import hmac
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from torchloom.errors import UserError
from torchloom.serve.api_common import (
    ApiError,
    BearerToken,
    ErrorResponse,
    json_type,
    load_json,
    read_body,
)
from torchloom.serve.settings import ADMIN_KEY_ENV, check_model_name


class FeedbackRequest(BaseModel):
    id: str = Field(min_length=1, description="a prediction's id, from /v1/predict", examples=["3f9a1c-2a"])
    label: str = Field(min_length=1, description="the text's true label", examples=["sport"])


class TrafficRequest(BaseModel):
    traffic: dict[str, float] = Field(description="each model's share in percent, summing to 100",
                                      examples=[{"v1": 90, "v2": 10}])
    shadows: list[str] | None = Field(default=None, description="the shadows (kept when left out)")


class PromoteRequest(BaseModel):
    model: str = Field(min_length=1, examples=["v2"])


class LoadRequest(BaseModel):
    path: str = Field(min_length=1, description="an exported model: a directory or a store's URI",
                      examples=["runs/b/model"])


def body_of(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra documenting a required JSON body of `model`'s schema (bodies are parsed by hand)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


FEEDBACK_BODY = 4 * 1024 * 1024  # a list of up to MAX_FEEDBACK labels fits
MAX_FEEDBACK = 10_000  # labels in one bulk request
FEEDBACK_EXAMPLE = ('send JSON like {"id": "<an id from /v1/predict>", "label": "<the true label>"}, or a list of'
                    ' such objects')


def parse_feedback(body: bytes) -> list[tuple] | tuple:
    """(id, label) of a POST /v1/feedback body, or a list of them for a list body; (None, label, text) for a label
    sent with its text instead of an id (kept in the prediction log, for retraining); an ApiError naming what is
    wrong (in a list: the first item that is, by its index)."""
    if not body.strip():
        raise ApiError(400, "empty_body", f"the request body is empty; {FEEDBACK_EXAMPLE}")
    payload = load_json(body, FEEDBACK_EXAMPLE)
    if isinstance(payload, list):
        if not 1 <= len(payload) <= MAX_FEEDBACK:
            raise ApiError(422, "invalid_request", f"a list of {len(payload)} labels; send 1 to {MAX_FEEDBACK} in"
                                                   " one request")
        return [_one_feedback(item, f"item {i}: ") for i, item in enumerate(payload)]
    return _one_feedback(payload, "")


def _one_feedback(payload, where: str) -> tuple:
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", f"{where}a JSON {json_type(payload)}, not an object;"
                                               f" {FEEDBACK_EXAMPLE}")
    if "id" not in payload and isinstance(payload.get("text"), str) and payload["text"]:
        if not isinstance(payload.get("label"), str) or not payload["label"]:
            raise ApiError(422, "invalid_request", f'{where}"label" is missing or not a non-empty string;'
                                                   f" {FEEDBACK_EXAMPLE}")
        return None, payload["label"], payload["text"]
    for key in ("id", "label"):
        if not isinstance(payload.get(key), str) or not payload[key]:
            got = "missing" if key not in payload else f"a {json_type(payload[key])}"
            raise ApiError(422, "invalid_request", f'{where}"{key}" is {got}, not a non-empty string;'
                                                   f" {FEEDBACK_EXAMPLE}")
    return payload["id"], payload["label"]


def feedback_one(fleet, item: tuple) -> dict[str, Any]:
    """One label: of a prediction's id (Fleet.feedback), or with its text (fleet_log.labelled_text)."""
    if item[0] is None:
        from torchloom.serve.fleet_log import labelled_text

        return labelled_text(fleet, item[2], item[1])
    return fleet.feedback(item[0], item[1])


def feedback_many(fleet, items: list[tuple]) -> dict[str, Any]:
    """Each label of a bulk request recorded as one request would be; what each got, in order (an error by its
    code), and the counts."""
    results = []
    for item in items:
        prediction_id, label = item[0] if item[0] is not None else "", item[1]
        try:
            results.append(feedback_one(fleet, item))
        except ApiError as e:
            results.append({"id": prediction_id, "label": label, "error": {"code": e.code, "message": e.message}})
    refused = sum("error" in r for r in results)
    return {"recorded": len(results) - refused, "refused": refused, "results": results}


def feedback_router(backend) -> APIRouter:
    """POST /v1/feedback over a Fleet."""
    api = APIRouter()

    @api.post("/v1/feedback", summary="the true label of a prediction (its id from /v1/predict): scores every"
                                      " model that answered it (docs/serving.md, A/B and shadow)",
              responses={status: {"model": ErrorResponse} for status in (400, 404, 409, 422)},
              openapi_extra=body_of(FeedbackRequest))
    async def feedback(request: Request) -> Response:
        if backend.fleet is None:
            raise ApiError(501, "not_supported", "this server keeps no predictions for feedback")
        parsed = parse_feedback(await read_body(request, FEEDBACK_BODY))
        if getattr(backend, "log", None) is not None:  # ids answered before a restart or by another replica
            from torchloom.serve.fleet_log import recall

            await recall(backend, [p[0] for p in (parsed if isinstance(parsed, list) else [parsed]) if p[0]])
        if isinstance(parsed, list):  # bulk: 200 with each label's result, the ones refused named by their code
            return JSONResponse(feedback_many(backend, parsed))
        return JSONResponse(feedback_one(backend, parsed))

    return api


ADMIN_BODY = 64 * 1024


def admin_key_check(admin_key: str | None, api_key: str | None = None):
    """The admin route's guard: its own key (--admin-key), and no admin at all on a server started without one;
    the predict key is refused there (403: that client may predict and send feedback, not load models)."""

    async def check_admin(credentials: BearerToken) -> None:
        if admin_key is None:
            raise ApiError(403, "admin_disabled", "the admin route needs its own key; start the server with"
                                                  f" --admin-key KEY (or {ADMIN_KEY_ENV})")
        token = credentials.credentials.encode() if credentials else b""
        if hmac.compare_digest(token, admin_key.encode()):
            return
        if api_key is not None and hmac.compare_digest(token, api_key.encode()):
            raise ApiError(403, "forbidden", "this key may predict and send feedback, not use /v1/admin; send the"
                                             " admin key")
        raise ApiError(401, "unauthorized", "missing or wrong admin key; send the header 'Authorization: Bearer"
                                            " <admin key>'", headers={"WWW-Authenticate": "Bearer"})

    return check_admin


async def admin_body(request: Request, example: str) -> dict[str, Any]:
    payload = load_json(await read_body(request, ADMIN_BODY), example)
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", f"the body is a JSON {json_type(payload)}, not an object; {example}")
    return payload


def check_model_root(path: str, roots: list[str]) -> None:
    """An admin load from one of the server's --model-root directories or store prefixes (none given: anywhere
    the server can read); one line otherwise."""
    if not roots:
        return
    from torchloom.uri import has_scheme

    def under(root: str) -> bool:
        if has_scheme(root) or has_scheme(path):
            return path.rstrip("/") == root.rstrip("/") or path.startswith(root.rstrip("/") + "/")
        here, top = os.path.realpath(path), os.path.realpath(root)
        return here == top or here.startswith(top.rstrip(os.sep) + os.sep)

    if not any(under(root) for root in roots):
        raise UserError(f"path {path}: not under a --model-root of this server ({', '.join(roots)}); load models"
                        " from there, or start the server with another --model-root")


async def on_newest(fleet, change) -> Response:
    """`change` made on (and the view from) the fleet's newest state, whichever of its servers recorded it
    (serve/fleet_sync.py), one change at a time."""
    from torchloom.serve.fleet_sync import catch_up

    async with fleet.sync_lock:
        await catch_up(fleet)
        done = change()
        return JSONResponse(await done if hasattr(done, "__await__") else done)


def admin_router(fleet, model_roots: list[str] = ()) -> APIRouter:
    """/v1/admin: the split, the shadows, promotion and loading a model, changed without a restart (fleet.py)."""
    from torchloom.serve.split import make_plan

    api = APIRouter(prefix="/v1/admin")

    def who(request: Request) -> str:
        return request.client.host if request.client else "a client"

    async def newest(change) -> Response:
        return await on_newest(fleet, change)

    @api.get("", summary="the models, the split and the shadows")
    async def view() -> Response:
        return await newest(fleet.admin_view)

    @api.put("/traffic", summary="set the split (and the shadows)", openapi_extra=body_of(TrafficRequest))
    async def traffic(request: Request) -> Response:
        example = 'send JSON like {"traffic": {"A": 90, "B": 10}, "shadows": ["C"]}'
        payload = await admin_body(request, example)
        split, shadows = payload.get("traffic"), payload.get("shadows")
        if not isinstance(split, dict):
            raise ApiError(422, "invalid_request", f'"traffic" is missing or not an object; {example}')
        if shadows is not None and (not isinstance(shadows, list) or not all(isinstance(x, str) for x in shadows)):
            raise ApiError(422, "invalid_request", f'"shadows" is not a list of model names; {example}')
        return await newest(lambda: fleet.set_plan(make_plan(fleet.order, split, fleet.plan.shadows if shadows is None
                                                             else shadows, what="traffic"), who(request)))

    @api.post("/promote", summary="the model takes all the traffic and stops being a shadow",
              openapi_extra=body_of(PromoteRequest))
    async def promote(request: Request) -> Response:
        name = (await admin_body(request, 'send JSON like {"model": "B"}')).get("model")
        if not isinstance(name, str):
            raise ApiError(422, "invalid_request", '"model" is missing or not a string; send JSON like {"model": "B"}')
        return await newest(lambda: fleet.promote(name, who(request)))

    @api.put("/models/{name}", summary="load a model (warmed up first) as NAME, or replace NAME in place",
             openapi_extra=body_of(LoadRequest))
    async def put_model(name: str, request: Request) -> Response:
        path = (await admin_body(request, 'send JSON like {"path": "runs/x/model"}')).get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(422, "invalid_request", '"path" is missing or not a string; send JSON like {"path":'
                                                   ' "runs/x/model"}')
        try:
            check_model_name(name, "model name")
            check_model_root(path.removeprefix("file://") if path.startswith("file:///") else path, model_roots)
        except UserError as e:
            raise ApiError(422, "invalid_request", str(e)) from None
        return await newest(lambda: fleet.put_model(name, path, who(request)))

    @api.delete("/models/{name}", summary="unload model NAME (one without traffic; not the first)")
    async def delete_model(name: str, request: Request) -> Response:
        return await newest(lambda: fleet.remove(name, who(request)))

    return api
