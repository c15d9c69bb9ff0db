"""What stands between the network and the app: who may address the server (Host, Origin) and how slowly.

A server on loopback is still reachable from a browser: a page from any site can make its own name resolve to
127.0.0.1 (DNS rebinding) and talk to the server as a same-origin page. The browser sends that site's name in
`Host` and `Origin`, so a loopback server answers only requests addressed to a loopback name.

A client that sends its headers a byte at a time holds a connection forever (uvicorn bounds idle keep-alive
connections, not a request in progress): `SlowClientH11` closes a connection whose headers are not complete
within serve.header_timeout_s; the body's own limit is `BodyLimit`'s (emotune.serve.http).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from emotune.core.config.eval import ServeConfig
from emotune.serve.http import error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    return host.strip("[]") in LOOPBACK_HOSTS


class TrustedHosts:
    """Pure ASGI middleware: 421 for a `Host` and 403 for an `Origin` that name a host this server is not."""

    def __init__(self, app, bound: str, allowed: list[str]):
        self.app = app
        self.names = set(LOOPBACK_HOSTS) if is_loopback(bound) else {bound, *allowed}
        self.any_name = not is_loopback(bound) and not allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any_name:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.allowed(host):
            response = error_response(421, f"This server does not answer to the host name `{host[:100]}`; address "
                                           f"it as {' or '.join(sorted(self.names))} (serve.allowed_hosts).",
                                      "misdirected_request")
            return await response(scope, receive, send)
        origin = headers.get(b"origin")
        if origin is not None and not self.allowed(_netloc(origin.decode("latin-1"))):
            response = error_response(403, f"Requests from web pages of `{origin.decode('latin-1')[:100]}` are "
                                           "refused: only pages served from this server's own host names may call it.",
                                      "permission_error")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def allowed(self, netloc: str) -> bool:
        try:
            name = urlsplit("//" + netloc).hostname  # drops the port; brackets of an IPv6 literal too
        except ValueError:  # an unclosed `[`
            return False
        return name is not None and name.lower() in self.names


def _netloc(origin: str) -> str:
    """The host part of an `Origin` (`scheme://host[:port]`); empty for one that is not a URL, such as `null` or an
    unclosed `[`."""
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return ""


class SlowClientH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `header_timeout_s`
    (counted from the connection, or from the end of the previous response on a kept-alive connection)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._headers_due is not None:  # the headers are in
            self._headers_due.cancel()
            self._headers_due = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._headers_due is None:
            self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, cfg: ServeConfig, **changes):
    """uvicorn's settings for `app`: serve.host/port, the graceful-shutdown bound and the slow-client guard."""
    import uvicorn

    protocol = type("SlowClientH11", (SlowClientH11,), {"header_timeout_s": cfg.header_timeout_s})
    settings = dict(host=cfg.host, port=cfg.port, http=protocol, timeout_graceful_shutdown=cfg.shutdown_timeout_s,
                    log_level="info", lifespan="on")
    return uvicorn.Config(app, **{**settings, **changes})
