"""HTTP plumbing: errors as OpenAI-style JSON, API keys, and the two pure ASGI middlewares (body limit, metrics)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from emotune.errors import UserError

if TYPE_CHECKING:
    from emotune.serve.state import Server


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def api_error(request: Request, err: APIError):
    return error_response(err.status, err.message, err.kind)


async def invalid_request(request: Request, err: RequestValidationError):
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in err.errors())
    return error_response(422, f"Invalid request: {problems}.")


async def http_error(request: Request, err: StarletteHTTPException):
    return error_response(err.status_code, str(err.detail), "not_found_error" if err.status_code == 404 else "invalid_request_error")


def resolve_key(value: str | None, field_name: str) -> str | None:
    if value is None or not value.startswith("env:"):
        return value
    variable = value.removeprefix("env:")
    if not os.environ.get(variable):
        raise UserError(f"serve.{field_name}=env:{variable}, but the environment variable {variable} is unset or empty. "
                        "Export it before starting the server, or give the key directly.")
    return os.environ[variable]


class BodyLimit:
    """Pure ASGI middleware: a body above `limit` bytes is answered 413 before the app parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
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
        response = error_response(413, f"The request body is larger than serve.max_body_bytes={self.limit} bytes. "
                                       "Send fewer or shorter texts per request.", "request_too_large")
        await response(scope, receive, send)


class Observe:
    """Pure ASGI middleware: counts requests by route and status, and times them, for /metrics."""

    def __init__(self, app, server: Server):
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
            self.server.metrics.observe_request(route, status[0], time.perf_counter() - started)


def _replay(messages: list[dict], then=None):
    async def receive():
        if messages:
            return messages.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}
    return receive
