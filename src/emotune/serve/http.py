"""HTTP plumbing: errors as OpenAI-style JSON, API keys, and the pure ASGI middlewares (keys, body limit, metrics)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from emotune.core.errors import UserError
from emotune.serve.metrics import Metrics


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


log = logging.getLogger("emotune.serve")
STREAM_FAILED = "emotune_stream_failed"  # set in scope["state"] by a stream that ended in an error event


def shown(text: str, limit: int = 100) -> str:
    """A client's text quoted back in an error, cut to `limit` characters: a megabyte-long model name came back whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    # a message may quote what the client sent, lone surrogates included; UTF-8 cannot hold those
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    headers = {"Retry-After": "1"} if status in (429, 503) else None  # limited or full for now: clients back off
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers)


async def api_error(request: Request, err: APIError):
    return error_response(err.status, err.message, err.kind)


JSON_BODY = "Send one JSON object, UTF-8 encoded, with `Content-Type: application/json`."
NOT_AN_OBJECT = {"missing", "model_attributes_type", "model_type", "dict_type"}  # pydantic's words for a whole body


async def invalid_request(request: Request, err: RequestValidationError):
    errors = err.errors()
    if any(e["type"] == "json_invalid" for e in errors):  # FastAPI's loc is ("body", character): say it in words
        where = next(e for e in errors if e["type"] == "json_invalid")
        detail = (where.get("ctx") or {}).get("error", "JSON decode error")
        return error_response(400, f"The body is not valid JSON ({detail} at character {where['loc'][-1]}). {JSON_BODY}")
    content_type = request.headers.get("content-type", "")
    if errors and tuple(errors[0]["loc"]) == ("body",) and "json" not in content_type.lower():
        # FastAPI reads a body as JSON only under a JSON content type; anything else arrives as no object at all
        return error_response(415 if content_type else 422, f"The body was sent as `{content_type[:80] or 'no content type'}`, "
                                                           f"not JSON. {JSON_BODY}")
    if len(errors) == 1 and tuple(errors[0]["loc"]) == ("body",) and errors[0]["type"] in NOT_AN_OBJECT:
        body = "empty" if errors[0]["type"] == "missing" else f"{_json_kind(errors[0].get('input'))}, not an object"
        return error_response(422, f"The body is {body}. {JSON_BODY}")
    return error_response(422, f"Invalid request: {_problems(errors)}.")


def _json_kind(value) -> str:
    kinds = {list: "a JSON list", str: "a JSON string", bool: "JSON true or false", int: "a JSON number", float: "a JSON number"}
    return "JSON null" if value is None else kinds.get(type(value), f"JSON of type {type(value).__name__}")


FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
MAX_PROBLEMS = 10  # fields named in one answer: enough to fix a body, never a message as long as the body


def _field(loc) -> str:
    """The field's path as the client wrote it (`messages.0.content`): pydantic also names the branch of a union it
    tried (`function-after[_utf8(), str]`, `list[ContentPart]`, `str`), which means nothing to a client."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (FIELD_NAME.fullmatch(p) and p not in UNION_TAGS)]
    return ".".join(parts) or "body"


def _problems(errors: list[dict]) -> str:
    """One phrase per field: a validator's own words (`value_error`) where one spoke for it or a field inside it,
    rather than every other branch of the union saying what the value is not; else what each branch expected."""
    fields = [_field(e["loc"]) for e in errors]
    specific = {f for f, e in zip(fields, errors, strict=True) if e["type"] == "value_error"}
    said: dict[str, list[str]] = {}
    for field, e in zip(fields, errors, strict=True):
        if e["type"] != "value_error" and any(s == field or s.startswith(field + ".") for s in specific):
            continue
        message = e["msg"].removeprefix("Value error, ")
        if message not in said.setdefault(field, []):
            said[field].append(message)
    phrases = [f"{field}: {messages[0]}" + "".join(f" or {m.removeprefix('Input should be ')}" for m in messages[1:])
               for field, messages in said.items()]
    more = f" (and {len(phrases) - MAX_PROBLEMS} more)" if len(phrases) > MAX_PROBLEMS else ""
    return "; ".join(phrases[:MAX_PROBLEMS]) + more


async def http_error(request: Request, err: StarletteHTTPException):
    message, where = str(err.detail), f"{request.method} {request.url.path[:200]}"
    if err.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words, nothing more
        message = (f"The body could not be read as JSON (bytes that are not UTF-8, nesting too deep, or a number of more "
                   f"than 4,300 digits). {JSON_BODY}")
    elif err.status_code == 404 and message == "Not Found":  # the router's words: no route has this path
        message = f"There is no endpoint {where}. This server answers {_endpoints(request)}."
    elif err.status_code == 405 and message == "Method Not Allowed":
        methods = (err.headers or {}).get("Allow", "").split(", ")
        methods += ["HEAD"] if "GET" in methods else []  # answered as GET by HeadAsGet
        err.headers = {**(err.headers or {}), "Allow": ", ".join(methods)}
        allowed = " or ".join(methods)
        message = f"{where}: this endpoint answers {allowed} only."
    response = error_response(err.status_code, message,
                              "not_found_error" if err.status_code == 404 else "invalid_request_error")
    response.headers.update(err.headers or {})  # a 405's Allow, which HTTP requires
    return response


def _endpoints(request: Request) -> str:
    routes = [route for route in request.app.routes if isinstance(route, APIRoute)]
    return ", ".join(f"{method} {route.path}" for route in routes for method in sorted(route.methods))


def failure_response(request: Request, err: Exception) -> JSONResponse:
    """Anything unforeseen: the same error body as every other failure, and the traceback in the log."""
    log.error("%s %s failed", request.method, request.url.path[:200], exc_info=err)
    return error_response(500, f"The server failed on this request ({type(err).__name__}: {err}). It has been "
                               "logged; other requests are unaffected.", "server_error")


async def server_error(request: Request, err: Exception):
    """Starlette's handler for what fails outside AnswerFailures (in the outermost middleware)."""
    response = failure_response(request, err)
    # Starlette raises the error again once this answer is sent, and uvicorn then closes the connection: a client that kept it
    # alive would send its next request into a closed socket (connection reset). Said here, it opens a new one.
    response.headers["Connection"] = "close"
    return response


def resolve_key(value: str | None, field_name: str) -> str | None:
    """The key itself from `env:NAME`, `file:PATH` or a key written in the config; an empty one is refused."""
    if value is None:
        return None
    if value.startswith("env:"):
        variable = value.removeprefix("env:")
        key = os.environ.get(variable, "").strip()
        where = f"the environment variable {variable} is unset or empty. Export it before starting the server"
    elif value.startswith("file:"):
        path = Path(value.removeprefix("file:")).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"serve.{field_name}=file:{path}, but the file cannot be read ({err}). Write the key into "
                            "it (one line, readable by this user only: chmod 600).") from None
        where = f"the file {path} is empty. Write the key into it"
    else:
        key = value.strip()
        where = "the key is empty. Give one"
    if not key:
        raise UserError(f"serve.{field_name}={value}, but {where}; an empty key would let anyone in.")
    return key


class RequireKey:
    """Pure ASGI middleware: the API key (admin key for /v1/adapters) is checked before the body is read or
    validated, so a caller without a key learns nothing about the API, not even what a valid body is.

    Every path but `open_paths` needs the key when one is set: the routes, /docs and /openapi.json alike."""

    def __init__(self, app, api_key: str | None, admin_key: str | None, admin_prefix: str, open_paths: tuple[str, ...]):
        self.app, self.api_key, self.admin_key = app, api_key, admin_key
        self.admin_prefix, self.open_paths = admin_prefix, open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in self.open_paths:  # they take no body: none is read (or held) for a caller without a key
            return await self.app(scope, _replay([{"type": "http.request", "body": b"", "more_body": False}], receive),
                                  send)
        problem = self.problem(scope)
        if problem is not None:
            return await error_response(*problem)(scope, receive, send)
        return await self.app(scope, receive, send)

    def problem(self, scope) -> tuple[int, str, str] | None:
        admin = scope["path"] == self.admin_prefix or scope["path"].startswith(self.admin_prefix + "/")
        expected = self.admin_key if admin else self.api_key
        if admin and expected is None:
            return 403, "Adapter loading is off: start the server with serve.admin_key set to enable it.", "permission_error"
        if expected is None:
            return None
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        given = header[7:] if header[:7].lower() == b"bearer " else b""
        if hmac.compare_digest(given, expected.encode()):
            return None
        return 401, ("Missing or wrong API key: send `Authorization: Bearer <key>`"
                     + (" with the admin key." if admin else ".")), "authentication_error"


class BodyLimit:
    """Pure ASGI middleware: a body above `limit` bytes is answered 413, and one not sent whole within `timeout_s`
    408, before the app parses it (declared too large: before a byte of it is read; sent too large: as soon as it
    passes the limit, never held whole). `answers` makes the two answers for another app (the studio's plain text);
    the default is OpenAI's JSON errors naming serve's settings."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0, answers: BodyAnswers | None = None):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s
        self.answers = answers or BodyAnswers(
            too_large=lambda: error_response(413, f"The request body is larger than serve.max_body_bytes={limit} bytes. "
                                                  "Send fewer or shorter texts per request.", "request_too_large"),
            too_slow=lambda: error_response(408, f"The request body did not arrive within serve.body_timeout_s="
                                                 f"{timeout_s:g} s. Send it at once.", "request_timeout"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                return await self.answers.too_slow()(scope, receive, send)
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._reject(scope, receive, send)
        return await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                             receive), send)

    async def _reject(self, scope, receive, send):
        await self.answers.too_large()(scope, receive, send)


@dataclass(frozen=True)
class BodyAnswers:
    """What `BodyLimit` answers: a body over the limit (413) and one that did not arrive in time (408)."""

    too_large: Callable[[], Response]
    too_slow: Callable[[], Response]


class Observed(Protocol):
    """What `Observe` counts into: the server's metrics and its number of requests in flight (emotune.serve.state)."""

    in_flight: int
    metrics: Metrics


class Observe:
    """Pure ASGI middleware: counts requests by route and status, and times them, for /metrics."""

    def __init__(self, app, server: Observed):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.server.in_flight += 1
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.server.in_flight -= 1
            route = getattr(scope.get("route"), "path", "unmatched")  # the router fills scope["route"]
            # a stream that failed after its 200 was sent said so in-band; count it as the error it was
            failed = (scope.get("state") or {}).get(STREAM_FAILED)
            self.server.metrics.observe_request(route, 500 if failed else status[0], time.perf_counter() - started)


class AnswerFailures:
    """Pure ASGI middleware: an unforeseen error in a route (or a middleware below this one) becomes
    `failure_response`'s 500 here, logged once. Left to Starlette, its handler (`server_error`) answered and logged,
    then Starlette raised the error again, and uvicorn logged the same traceback a second time ("Exception in ASGI
    application") and closed the connection. An error after the answer started (a stream) goes on up: the stream
    says it in-band, and uvicorn logs it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = [False]

        async def noting_the_start(message):
            started[0] = started[0] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, noting_the_start)
        except Exception as err:
            if started[0]:
                raise
            response = failure_response(Request(scope), err)
            await response(scope, receive, send)


class HeadAsGet:
    """Pure ASGI middleware: HEAD is answered as GET without the body (HTTP requires both of a server; FastAPI's routes
    take the methods they list, and a load balancer's `HEAD /health` got 405). The request goes on as GET, so the key
    and the route apply as they do to GET; the headers (Content-Length included) are GET's, the body is dropped."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        as_get = {**scope, "method": "GET"}

        async def without_body(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(as_get, receive, without_body)
        finally:
            if "route" in as_get:  # for Observe, which counts by route
                scope["route"] = as_get["route"]


def _replay(messages: list[dict], then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}
    return receive
