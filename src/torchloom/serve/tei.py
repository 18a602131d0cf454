"""The TEI-compatible API: text-embeddings-inference's `POST /predict`, for clients written for TEI.

`router` builds it over a backend; `create_app` includes it beside the native API, behind the same API key.
Its requests fail with the same `ApiError`s as the native API's; `error_response` puts one in TEI's shape:
{"error": message, "error_type": Validation | Tokenizer | Overloaded | Backend | Unhealthy | Empty}.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from torchloom.serve.api_common import (
    ApiError,
    Backend,
    answered_by,
    json_type,
    load_json,
    parse_off_loop,
    read_body,
    routed_predict,
    until_disconnect,
)

STATUS = {"Validation": 413, "Tokenizer": 422, "Overloaded": 429, "Backend": 424, "Unhealthy": 503, "Empty": 400}
# An ApiError's code -> TEI's error_type; any other code is a body TEI cannot read: Tokenizer.
ERROR_TYPES = {"empty_body": "Empty", "empty_texts": "Empty", "body_too_large": "Validation",
               "too_many_texts": "Validation", "text_too_long": "Validation", "overloaded": "Overloaded",
               "shutting_down": "Unhealthy", "model_error": "Backend"}
EXAMPLE = 'send JSON like {"inputs": "a text"} or {"inputs": [["first text"], ["second text"]]}'


class TeiPrediction(BaseModel):
    score: float = Field(description="the label's probability, or its logit with raw_scores")
    label: str


class TeiErrorResponse(BaseModel):
    error: str
    error_type: str = Field(description="Validation (413), Tokenizer (422), Empty (400), Overloaded (429),"
                                        " Backend (424) or Unhealthy (503), as text-embeddings-inference says")


class TeiRoute(APIRoute):
    """A route of this API: the app answers its errors with `error_response`."""


def error_response(error: ApiError) -> JSONResponse:
    """`error` as text-embeddings-inference answers: its error_type, and the status TEI gives that type."""
    error_type = ERROR_TYPES.get(error.code, "Tokenizer")
    return JSONResponse({"error": error.message, "error_type": error_type}, status_code=STATUS[error_type],
                        headers=error.headers)


def request_schema(max_texts: int, max_chars: int) -> dict:
    """The JSON schema of a TEI /predict body, with this server's limits."""
    text = {"type": "string", "maxLength": max_chars}
    return {"type": "object", "required": ["inputs"], "properties": {
        "inputs": {"oneOf": [text, {"type": "array", "minItems": 1, "maxItems": max_texts, "items": {
            "type": "array", "items": text, "minItems": 1, "maxItems": 1}}]},
        "truncate": {"type": "boolean", "default": False},
        "raw_scores": {"type": "boolean", "default": False}}}


def parse_request(body: bytes, max_texts: int, max_chars: int) -> tuple[list[str], bool, bool]:
    """(texts, batched, raw_scores) of a TEI /predict body: `inputs` is a string, or a batch of one-string
    lists. A pair of strings ([a, b] or [[a, b], ...]) is for cross-encoders and is refused."""
    if not body.strip():
        raise ApiError(400, "empty_body", f"the request body is empty; {EXAMPLE}")
    payload = load_json(body, EXAMPLE)
    if not isinstance(payload, dict) or "inputs" not in payload:
        raise ApiError(422, "invalid_request", f'the body has no "inputs" field; {EXAMPLE}')
    for flag in ("truncate", "raw_scores"):
        if not isinstance(payload.get(flag, False), bool):
            raise ApiError(422, "invalid_request", f'"{flag}" is a {json_type(payload[flag])}, not true or false')
    texts, batched = _texts(payload["inputs"])
    if len(texts) > max_texts:
        raise ApiError(413, "too_many_texts", f"batch size {len(texts)} > maximum allowed batch size {max_texts}")
    for i, text in enumerate(texts):
        if len(text) > max_chars:
            raise ApiError(413, "text_too_long", f"input {i} has {len(text)} characters, more than the {max_chars}"
                                                 " allowed")
    return texts, batched, payload.get("raw_scores", False)


def _texts(inputs: Any) -> tuple[list[str], bool]:
    """(texts, batched) of `inputs`: one string, or a batch of one-string lists."""
    if isinstance(inputs, str):
        return [inputs], False
    if isinstance(inputs, list) and inputs and all(isinstance(x, str) for x in inputs):
        raise ApiError(422, "text_pair", f"a list of {len(inputs)} strings is a text pair (for cross-encoders); this"
                                         ' model classifies single texts: send a batch as [["first"], ["second"]]')
    if isinstance(inputs, list) and inputs and all(isinstance(x, list) for x in inputs):
        if any(len(x) != 1 or not isinstance(x[0], str) for x in inputs):
            raise ApiError(422, "invalid_text", "every item of a batch must be a one-string list [\"text\"]; this"
                                                " model classifies single texts, not pairs")
        return [x[0] for x in inputs], True
    if inputs == []:
        raise ApiError(422, "empty_texts", f'"inputs" is an empty list; {EXAMPLE}')
    raise ApiError(422, "invalid_request", f'"inputs" must be a string or a non-empty batch of one-string lists;'
                                           f" {EXAMPLE}")


def answer(prediction: dict[str, Any], raw_scores: bool) -> list[dict[str, Any]]:
    """One text's TEI answer: every label with its probability (or its logit, raw_scores), highest first."""
    scores = prediction["logits"] if raw_scores else prediction["probabilities"]
    return sorted(({"score": float(v), "label": k} for k, v in scores.items()), key=lambda x: -x["score"])


def router(backend: Backend, max_texts: int, max_chars: int, body_limit: int) -> APIRouter:
    """The TEI-compatible API over `backend`: POST /predict."""
    api = APIRouter(route_class=TeiRoute)

    @api.post(
        "/predict",
        response_model=list[TeiPrediction] | list[list[TeiPrediction]],
        summary="text-embeddings-inference's predict: every label's score per input, highest first",
        description="TEI's request shape: `inputs` (a string, or a batch [[\"text\"], ...]), `truncate` (accepted;"
                    " texts are always cut the way the model was trained), `raw_scores` (logits instead of"
                    " probabilities). Errors are TEI's: {\"error\", \"error_type\"}.",
        responses={status: {"model": TeiErrorResponse} for status in (400, 413, 422, 424, 429, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": request_schema(max_texts, max_chars)}}}},
    )
    async def tei_predict(request: Request) -> Response:
        texts, batched, raw = await parse_off_loop(parse_request, await read_body(request, body_limit), max_texts,
                                                   max_chars)
        predictions = await until_disconnect(request, routed_predict(request, backend, texts))
        answers = [answer(p, raw) for p in predictions]
        body = json.dumps(answers if batched else answers[0], ensure_ascii=False, separators=(",", ":"))
        return Response(body.encode("utf-8"), media_type="application/json",
                        headers=answered_by(backend, predictions)[1])

    return api
