"""The OpenAPI schema as this server answers: the errors its routes may send (400, never
FastAPI's 422) and the limits of the model it serves.

Chapter 16 tells the story.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from minisgl.server.protocol import ErrorResponse, prompt_schema

# Every error the routes may answer with, in the schema (FastAPI would list 422, which this
# server never sends: a malformed body is a 400 with OpenAI's error object).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The request is malformed or asks for "
                                                 "something this server does not support"},
    404: {"model": ErrorResponse, "description": "No such model"},
    500: {"model": ErrorResponse, "description": "A worker failed while serving the request"},
    503: {"model": ErrorResponse, "description": "A worker has died, or the server is "
                                                 "shutting down"},
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The completion, or with `stream` a stream of Server-Sent Events",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **ERROR_RESPONSES,
}


def openapi_schema(app: FastAPI, model_name: str, max_token_id: int | None,
                   max_tokens: int | None) -> dict[str, Any]:
    """The OpenAPI schema, as this server answers: its errors (400, never FastAPI's 422), the
    limits of the model it serves (the largest token id, the most tokens a request may ask
    for) and its model's id as the example of ``/v1/models/{model_id}``. Built once, on the
    first request for it."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_id":
                    parameter["schema"]["examples"] = [model_name]
    components = schema.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = components.get(name, {}).get("properties", {})
        if max_tokens is not None:
            for field_name in {"max_tokens", "max_completion_tokens"} & properties.keys():
                properties[field_name]["maximum"] = max_tokens
        if max_token_id is not None:  # every body has stop_token_ids; a completion, a prompt
            properties["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = max_token_id
            if "prompt" in properties:
                properties["prompt"].update(prompt_schema(max_token_id))
    return schema
