"""The OpenAPI document, true to the API: request bodies and `/embed`'s query options from the request models,
each route's replies by content type, and the error body of every 4xx and 5xx (`status.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from .schemas import EmbedJSON, EmbedOptions, OpenAIEmbeddingRequest

REF = "#/components/schemas/{model}"
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["type", "message"],
    "properties": {"type": {"type": "string"}, "message": {"type": "string"},
                   "index": {"type": "integer", "description": "the input at fault"}}}}}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
ERRORS = {  # status -> (when, with Retry-After)
    "401": ("missing or wrong API key", False),
    "404": ("no such route", False),
    "405": ("method not allowed on this route", False),
    "413": ("body, input count, image pixels or video frames over a limit", False),
    "415": ("unsupported content type", False),
    "422": ("corrupt, empty or unsupported input; invalid JSON, base64 or options", False),
    "429": ("queue full", True),
    "500": ("a bug (never the input's fault)", False),
    "503": ("not ready, draining, engine restarting, deadline exceeded, or an item that failed on the device", True),
}
ROUTE_ERRORS = {
    "/embed": ("401", "404", "405", "413", "415", "422", "429", "500", "503"),
    "/v1/embeddings": ("401", "404", "405", "413", "415", "422", "429", "500", "503"),
    "/ready": ("405", "500", "503"),
    "/health": ("405", "500"), "/info": ("405", "500"), "/metrics": ("405", "500"),
}
ANY_OBJECT = {"type": "object"}


def _schema(model) -> tuple[dict, dict]:
    """`model`'s JSON schema with its references under components, and the components it defines."""
    schema = model.model_json_schema(ref_template=REF)
    return schema, schema.pop("$defs", {})


def _errors(statuses) -> dict:
    out = {}
    for status in statuses:
        when, retry = ERRORS[status]
        out[status] = {"description": when,
                       "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
        if retry:
            out[status]["headers"] = RETRY_AFTER
    return out


def build(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components: dict[str, Any] = {"Error": ERROR}
    embed_json, defs = _schema(EmbedJSON)
    components.update(defs)
    components["EmbedJSON"] = embed_json
    openai, defs = _schema(OpenAIEmbeddingRequest)
    components.update(defs)
    components["OpenAIEmbeddingRequest"] = openai
    options, _ = _schema(EmbedOptions)
    paths = spec["paths"]

    embed = paths["/embed"]["post"]
    embed["parameters"] = [{"name": name, "in": "query", "required": False, "schema": prop}
                           for name, prop in options["properties"].items()]
    embed["requestBody"] = {"required": True, "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "array", "minItems": 1, "items": {"type": "string", "format": "binary"}}}}},
        "image/*": {"schema": {"type": "string", "format": "binary"}},
        "video/*": {"schema": {"type": "string", "format": "binary"}},
        "application/json": {"schema": {"$ref": REF.format(model="EmbedJSON")}}}}
    embed["responses"] = {"200": {"description": "per input: tokens, DeepStack features, pooled vector (JSON), or "
                                                 "the safetensors file (format=safetensors)",
                                  "content": {"application/json": {"schema": ANY_OBJECT},
                                              "application/octet-stream": {"schema": {"type": "string",
                                                                                      "format": "binary"}}}},
                          **_errors(ROUTE_ERRORS["/embed"])}
    v1 = paths["/v1/embeddings"]["post"]
    v1["requestBody"] = {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model="OpenAIEmbeddingRequest")}}}}
    v1["responses"] = {"200": {"description": "OpenAI's embeddings list",
                               "content": {"application/json": {"schema": ANY_OBJECT}}},
                       **_errors(ROUTE_ERRORS["/v1/embeddings"])}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
        **_errors(ROUTE_ERRORS["/metrics"])}
    for path in ("/health", "/info"):
        paths[path]["get"]["responses"] = {
            "200": {"description": "OK", "content": {"application/json": {"schema": ANY_OBJECT}}},
            **_errors(ROUTE_ERRORS[path])}
    ready = {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}}
    paths["/ready"]["get"]["responses"] = {
        "200": {"description": "every front-end can serve", "content": {"application/json": {"schema": ready}}},
        **_errors(ROUTE_ERRORS["/ready"])}
    paths["/ready"]["get"]["responses"]["503"] = {
        "description": "not ready yet, or draining", "content": {"application/json": {"schema": ready}}}
    spec.setdefault("components", {})["schemas"] = components
    return spec


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi
