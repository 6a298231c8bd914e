"""The OpenAPI document with the request bodies the handlers parse themselves.

The generate routes read their body with ``json_body`` (size, depth and text limits, OpenAI
error envelopes), so FastAPI cannot see a body parameter; this adds each route's request model
(with its bounds) as its ``requestBody`` and the error envelope as its error responses, so
clients, docs and schema-driven fuzzers know what to send.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from keyserve.cluster.openai_protocol import ErrorResponse

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {
    "400": "Invalid request (the field is named in `error.param`).",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "408": "The request ran past the server's timeout.",
    "413": "The request body is larger than --max-request-bytes.",
    "503": "The model is loading, the engine is down, or the queue is full (Retry-After).",
}


def install(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` document ``bodies`` (POST path -> request model)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    models = [(m, "validation") for m in (*bodies.values(), ErrorResponse)]
    _, defs = models_json_schema(models, ref_template=REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
    for path, model in bodies.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
        op["responses"].pop("422", None)
        for status, text in ERROR_STATUSES.items():
            op["responses"][status] = {"description": text, **error}
    return schema
