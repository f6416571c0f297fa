"""The published API description, ``/openapi.json``: every route's request and answers.

FastAPI describes a route from its signature; the gateway's routes read their bodies raw (the
chat route is served without FastAPI's layers at all), so their bodies and answers are
described here, from the models that validate them: :class:`ChatCompletionRequest` for
``POST /v1/chat/completions`` and each JSON-RPC method's params model
(:data:`~gateway_http.routes.rpc.METHOD_PARAMS`) for ``POST /api/rpc``. Every status a route
answers is listed with its body, the errors in OpenAI's shape, so a client (or an API fuzzer,
``tests/e2e/test_openapi.py``) can hold the gateway to it. The edge's refusals (408, 431,
gateway_http.edge) can answer any request and are listed on every operation.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway_http.chat_request import ChatCompletionRequest
from gateway_http.conversations import PAGE_DEFAULT_MESSAGES, PAGE_MAX_BYTES, PAGE_MAX_MESSAGES
from gateway_http.errors import MEMORY_HEADER, TABLE, ErrorKind, is_rest
from gateway_http.routes.passthrough import ROUTES as PASSED_ROUTES
from gateway_http.routes.rest import (
    WRITEBACK_HEADER,
    WRITEBACK_OFF,
    WRITEBACK_ON,
    WRITEBACK_SKIPPED,
)
from gateway_http.routes.rpc import METHOD_PARAMS

_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
            },
        }
    },
}

_WHY = {
    ErrorKind.BAD_INPUT: "Malformed JSON or an invalid field (the message names it)",
    ErrorKind.AUTH: "Missing or invalid API key (when ARONA_API_KEYS is set)",
    ErrorKind.FORBIDDEN: "The conversation belongs to another caller",
    ErrorKind.NOT_FOUND: "No such conversation; on chat, also a model no backend serves "
    "(code model_not_found)",
    ErrorKind.TOO_LARGE: "The body is over ARONA_HTTP_MAX_BODY_BYTES",
    ErrorKind.UNSUPPORTED_MEDIA: "The body is not sent as Content-Type: application/json",
    ErrorKind.UPSTREAM: "The upstream model failed, could not be reached or refused the "
    "gateway's key (an upstream's own 400, 404, 409, 413, 422 or 429 is answered with its status "
    "and body instead)",
    ErrorKind.QUOTA: "The caller's monthly budget is used up (insufficient_quota)",
    ErrorKind.UNAVAILABLE: "The conversation database is unavailable",
    ErrorKind.REQUEST_TIMEOUT: "The request's head or body did not arrive in time",
    ErrorKind.HEADERS_TOO_LARGE: "The header block is over ARONA_HTTP_MAX_HEADER_BYTES",
}
# What the edge may answer to any request.
_EDGE = (ErrorKind.REQUEST_TIMEOUT, ErrorKind.HEADERS_TOO_LARGE)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*kinds: ErrorKind) -> dict[str, Any]:
    return {
        str(TABLE[kind].http_status): _json({"$ref": _REF.format(model="Error")}, _WHY[kind])
        for kind in (*kinds, *_EDGE)
    }


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


_STRING = {"type": "string"}
_TIME = {"type": "string", "format": "date-time"}
_CONVERSATION = _object(
    ["id", "object", "title", "created_at", "updated_at"],
    id=_STRING,
    object={"const": "conversation"},
    title={"type": ["string", "null"]},
    created_at=_TIME,
    updated_at=_TIME,
)
# On every answer under /v1: what memory did for the turn (disabled for any other answer).
_MEMORY_STATE = {
    MEMORY_HEADER: {
        "description": "What memory did for the turn; disabled when nothing was recalled "
        "(every answer that is not a turn's)",
        "required": True,
        "schema": {"enum": ["enabled", "disabled", "offline"]},
    },
}
_MEMORY_HEADER = {
    **_MEMORY_STATE,
    WRITEBACK_HEADER: {
        "description": "Whether the turn is written back to memory once its reply is complete: "
        "on; off (no memory for this caller, or the memory service stores no writebacks); "
        "skipped for a streamed turn without conversation_id (unless "
        "ARONA_MEMORY_STREAM_WRITEBACK=true)",
        "required": True,
        "schema": {"enum": [WRITEBACK_ON, WRITEBACK_OFF, WRITEBACK_SKIPPED]},
    },
    "X-Arona-Backend": {
        "description": "The backend that answered: its name in the backends file "
        "(ARONA_BACKENDS), else upstream or echo",
        "schema": _STRING,
    },
}
_CHAT_ANSWER = {
    "description": "A chat.completion, or with stream: true its chunks as server-sent events",
    "headers": _MEMORY_HEADER,
    "content": {
        "application/json": {
            "schema": _object(
                ["id", "object", "choices"],
                id=_STRING,
                object={"const": "chat.completion"},
                choices={"type": "array"},
            )
        },
        # OpenAPI 3.1: the schema of one event; its data is a chat.completion.chunk as JSON,
        # then [DONE].
        "text/event-stream": {"schema": _object(["data"], data=_STRING)},
    },
}

# POST /v1/responses: the fields the gateway reads (checked as published), any other passed on.
_RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {}}]},
        "instructions": {"type": ["string", "null"]},
        "stream": {"type": ["boolean", "null"]},
        "memory": {
            "type": ["boolean", "null"],
            "description": "false: no recall for this turn (the gateway's own field)",
        },
    },
}
_RESPONSES_ANSWER = {
    "description": "A response object, or with stream: true its events as server-sent events, "
    "as the backend sent them",
    "headers": _MEMORY_HEADER,
    "content": {
        "application/json": {
            "schema": _object(["id", "object"], id=_STRING, object={"const": "response"})
        },
        "text/event-stream": {"schema": _object(["data"], data=_STRING)},
    },
}

_RPC_ID = {"type": ["string", "integer", "null"]}
_RPC_RESPONSE = _object(
    ["jsonrpc", "id"],
    jsonrpc={"const": "2.0"},
    id=_RPC_ID,
    result={},
    error=_object(["code", "message"], code={"type": "integer"}, message=_STRING, data={}),
)


def _rpc_request(method: str, params: type[BaseModel]) -> dict[str, Any]:
    return _object(
        ["jsonrpc", "method"],
        jsonrpc={"const": "2.0"},
        method={"const": method},
        params={"$ref": _REF.format(model=params.__name__)},
        id=_RPC_ID,
    )


def _schemas_of(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema and those it refers to, by name, for ``components``."""
    schema = model.model_json_schema(ref_template=_REF)
    found: dict[str, Any] = schema.pop("$defs", {})
    found[model.__name__] = schema
    for each in found.values():
        each.pop("description", None)  # the class docstring, written for this code's readers
    return found


def _operations(max_batch: int) -> dict[tuple[str, str], dict[str, Any]]:
    """What this module says of each operation, on top of what FastAPI found."""
    one_call = {"anyOf": [_rpc_request(m, p) for m, p in METHOD_PARAMS.items()]}
    batch = {"type": "array", "items": one_call, "minItems": 1, "maxItems": max_batch}
    conversation_errors = (ErrorKind.AUTH, ErrorKind.FORBIDDEN, ErrorKind.NOT_FOUND)
    return {
        ("post", "/v1/chat/completions"): {
            "summary": "Chat completion with long-term memory (OpenAI-compatible)",
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": _REF.format(model="ChatCompletionRequest")}
                    }
                },
            },
            "responses": {
                "200": _CHAT_ANSWER,
                **_errors(
                    ErrorKind.BAD_INPUT,
                    *conversation_errors,
                    ErrorKind.TOO_LARGE,
                    ErrorKind.UNSUPPORTED_MEDIA,
                    ErrorKind.UPSTREAM,
                    ErrorKind.UNAVAILABLE,
                    ErrorKind.QUOTA,
                ),
            },
        },
        ("post", "/v1/responses"): {
            "summary": "The Responses API with long-term memory (OpenAI-compatible)",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _RESPONSES_REQUEST}},
            },
            "responses": {
                "200": _RESPONSES_ANSWER,
                **_errors(
                    ErrorKind.BAD_INPUT,
                    ErrorKind.AUTH,
                    ErrorKind.NOT_FOUND,
                    ErrorKind.TOO_LARGE,
                    ErrorKind.UNSUPPORTED_MEDIA,
                    ErrorKind.UPSTREAM,
                    ErrorKind.QUOTA,
                ),
            },
        },
        ("get", "/v1/models"): {
            "responses": {
                "200": _json(
                    _object(["object", "data"], object={"const": "list"}, data={"type": "array"}),
                    "The upstream's models (or echo); with a backends file, the model names "
                    "and aliases it routes",
                ),
                **_errors(ErrorKind.AUTH, ErrorKind.UPSTREAM),
            }
        },
        **_passthrough_operations(),
        ("get", "/healthz"): {
            "responses": {"200": _json(_object(["status"], status=_STRING), "The process is up")}
        },
        ("get", "/readyz"): {
            "responses": {
                "200": _json(_object(["status"], status=_STRING), "MemoryService answers"),
                "503": _json(
                    _object(["status", "reason"], status=_STRING, reason=_STRING),
                    "MemoryService does not answer",
                ),
                **_errors(),
            }
        },
        ("get", "/v1/conversations"): {
            "responses": {
                "200": _json(
                    _object(
                        ["object", "data"],
                        object={"const": "list"},
                        data={"type": "array", "items": _CONVERSATION},
                    ),
                    "The caller's conversations",
                ),
                **_errors(ErrorKind.AUTH, ErrorKind.UNAVAILABLE),
            }
        },
        ("post", "/v1/conversations"): {
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"title": {"type": ["string", "null"]}},
                        }
                    }
                },
            },
            "responses": {
                "200": _json(_CONVERSATION, "The new conversation"),
                **_errors(
                    ErrorKind.BAD_INPUT,
                    ErrorKind.AUTH,
                    ErrorKind.TOO_LARGE,
                    ErrorKind.UNSUPPORTED_MEDIA,
                    ErrorKind.UNAVAILABLE,
                ),
            },
        },
        ("get", "/v1/conversations/{conversation_id}"): {
            "parameters": [
                {
                    "name": "conversation_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "title": "Conversation Id"},
                },
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "description": "How many of the most recent messages (default "
                    f"{PAGE_DEFAULT_MESSAGES}; at most {PAGE_MAX_BYTES // 2**20} MiB of them)",
                    "schema": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": PAGE_MAX_MESSAGES,
                        "default": PAGE_DEFAULT_MESSAGES,
                    },
                },
                {
                    "name": "before",
                    "in": "query",
                    "required": False,
                    "description": "A page's first_id: the messages before it",
                    "schema": {"type": "string"},
                },
            ],
            "responses": {
                "200": _json(
                    {
                        **_CONVERSATION,
                        "required": [*_CONVERSATION["required"], "messages", "has_more"],
                        "properties": {
                            **_CONVERSATION["properties"],
                            "messages": {"type": "array"},
                            "has_more": {"type": "boolean"},
                            "first_id": {"type": ["string", "null"]},
                        },
                    },
                    "The conversation and its most recent messages, oldest first",
                ),
                **_errors(ErrorKind.BAD_INPUT, *conversation_errors, ErrorKind.UNAVAILABLE),
            },
        },
        ("delete", "/v1/conversations/{conversation_id}"): {
            "responses": {
                "200": _json(
                    _object(
                        ["id", "object", "deleted"],
                        id=_STRING,
                        object={"const": "conversation.deleted"},
                        deleted={"const": True},
                    ),
                    "Deleted",
                ),
                **_errors(*conversation_errors, ErrorKind.UNAVAILABLE),
            }
        },
        ("post", "/api/rpc"): {
            "summary": "JSON-RPC 2.0: one call or a batch (Authorization: Bearer <JWT or key>)",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"anyOf": [one_call, batch]}}},
            },
            "responses": {
                "200": _json(
                    {"anyOf": [_RPC_RESPONSE, {"type": "array", "items": _RPC_RESPONSE}]},
                    "The answer (errors too, as JSON-RPC error objects)",
                ),
                "204": {"description": "Only notifications: nothing to answer"},
                "413": _json(_RPC_RESPONSE, "The body is over ARONA_RPC_MAX_BODY_BYTES"),
                **_errors(),
            },
        },
    }


def published(app: FastAPI, max_batch: int) -> dict[str, Any]:
    """The OpenAPI document of ``app``: FastAPI's, with each operation's body and answers."""
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    # Path parameters are plain strings: FastAPI's 422 for them never happens.
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR_SCHEMA
    models: list[type[BaseModel]] = [ChatCompletionRequest, *METHOD_PARAMS.values()]
    for model in models:
        schemas.update(_schemas_of(model))
    for (method, path), described in _operations(max_batch).items():
        spec["paths"][path][method].update(described)
    edge = _errors()
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, answer in edge.items():
                responses.setdefault(status, answer)
            if is_rest(path):
                for status, answer in responses.items():
                    # A copy: the edge's answers are shared with the paths outside /v1.
                    headers = {**_MEMORY_STATE, **answer.get("headers", {})}
                    responses[status] = {**answer, "headers": headers}
    return spec


# The routes passed through to a backend (gateway_http.routes.passthrough): the backend's answer
# as it came, so only its envelope is described.
_PASSED_ANSWERS = {
    "embeddings": ("application/json", "The backend's list of embeddings, and its usage"),
    "completions": (
        "application/json",
        "The backend's text_completion, or with stream: true its server-sent events",
    ),
    "moderations": ("application/json", "The backend's moderation results"),
    "audio/speech": ("audio/*", "The audio, streamed as the backend sends it"),
    "audio/transcriptions": ("application/json", "The backend's transcription"),
    "audio/translations": ("application/json", "The backend's translation"),
    "images/generations": ("application/json", "The backend's images"),
}
_PASSED_ERRORS = {
    "400": "Malformed JSON, no model, or the backend's own 400 (its body as it sent it)",
    "401": "Missing or invalid API key (when ARONA_API_KEYS is set)",
    "404": "A model no backend serves (model_not_found), one the echo model does not serve "
    "on this route (model_not_supported), or the backend's own 404",
    "413": "The body is over ARONA_HTTP_MAX_BODY_BYTES",
    "415": "A JSON body not sent as application/json, an upload not sent as multipart/form-data",
    "429": "The caller's monthly budget is used up (insufficient_quota), or the backend's 429",
    "502": "The backend failed, could not be reached, or refused the gateway's key",
}


def _passthrough_operations() -> dict[tuple[str, str], dict[str, Any]]:
    """The pass-through routes and ``GET /v1/models/{model_id}``."""
    operations: dict[tuple[str, str], dict[str, Any]] = {}
    model = {"type": "string", "minLength": 1}
    for route in PASSED_ROUTES:
        if route.form:
            body = {
                "multipart/form-data": {
                    "schema": _object(
                        ["model", "file"], model=model, file={"type": "string", "format": "binary"}
                    )
                }
            }
        else:
            required = [] if route.default_model is not None else ["model"]
            body = {"application/json": {"schema": _object(required, model=model)}}
        media, answer = _PASSED_ANSWERS[route.path]
        content: dict[str, Any] = {media: {}}
        if route.path == "completions":
            content["text/event-stream"] = {"schema": _object(["data"], data=_STRING)}
        operations[("post", f"/v1/{route.path}")] = {
            "summary": f"Passed through to the backend of the body's model ({route.path})",
            "requestBody": {"required": True, "content": body},
            "responses": {
                "200": {"description": answer, "content": content},
                **{
                    status: _json({"$ref": _REF.format(model="Error")}, why)
                    for status, why in _PASSED_ERRORS.items()
                },
                **_errors(),
            },
        }
    operations[("get", "/v1/models/{model_id}")] = {
        "parameters": [
            {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "responses": {
            "200": _json(
                _object(["id", "object"], id=_STRING, object={"const": "model"}),
                "One model of GET /v1/models",
            ),
            "404": _json({"$ref": _REF.format(model="Error")}, "Not in GET /v1/models"),
            **_errors(ErrorKind.AUTH, ErrorKind.UPSTREAM),
        },
    }
    return operations
