"""The studio's web app: the runs table, a run's page, its files, and its training progress as server-sent events.

Progress events carry the training log entry's position as their id (1 = the first entry). A browser that loses
the stream reconnects with `Last-Event-ID` and is sent only what came after it; a reloaded page starts at 0 and is
sent the whole history so far. The stream ends (event `end`) once the run is no longer running and every entry
has been sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse

from emotune.serve.guards import TrustedHosts, is_loopback
from emotune.studio import pages
from emotune.studio.runs import NotInRuns, artifacts, history, inside, list_runs, log_tail, run_folder, summarize

TOKEN_COOKIE = "emotune_studio_token"
POLL_S = 0.5  # how often a live stream looks at the training log for new lines
LOG_FILE = "studio.log"  # a run started by the studio writes its output here


def create_app(runs: Path, host: str = "127.0.0.1", token: str | None = None, poll_s: float = POLL_S) -> TrustedHosts:
    """The studio for the run folders under `runs`, bound to `host`; a non-loopback `host` needs `token`."""
    if not is_loopback(host) and not token:
        raise ValueError("a studio on a non-loopback host needs a token")
    runs = Path(runs)
    app = FastAPI(title="emotune studio", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if token is None or request.url.path == "/login":
            return await call_next(request)
        sent = request.cookies.get(TOKEN_COOKIE) or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(sent.encode(), token.encode()):
            return PlainTextResponse("This studio needs its token: open /login?token=... once (the token is in "
                                     "EMOTUNE_STUDIO_TOKEN or the file given to --token-file where it was started).",
                                     status_code=401)
        return await call_next(request)

    @app.get("/login")
    def login(request: Request) -> Response:
        sent = request.query_params.get("token", "")
        if token is None or not hmac.compare_digest(sent.encode(), token.encode()):
            return PlainTextResponse("Wrong or missing token.", status_code=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/", response_class=HTMLResponse)
    def runs_table() -> str:
        return pages.runs_page(list_runs(runs), str(runs))

    @app.get("/api/runs")
    def runs_json() -> list[dict]:
        return [r.as_row() for r in list_runs(runs)]

    @app.get("/runs/{name}", response_class=HTMLResponse)
    def run_page(name: str) -> Response:
        run = _run_or_404(runs, name)
        if isinstance(run, Response):
            return run
        return HTMLResponse(pages.run_page(summarize(run), run.saved_config() or "", len(history(run)),
                                           artifacts(run), log_tail(run / LOG_FILE), run.report_html.is_file()))

    @app.get("/runs/{name}/files/{path:path}")
    def run_file(name: str, path: str) -> Response:
        try:
            file = inside(runs, f"{name}/{path}")
            run_folder(runs, name)
        except NotInRuns:
            return HTMLResponse(pages.not_found(f"No file `{path}` in run `{name}`."), status_code=404)
        if not file.is_file():
            return HTMLResponse(pages.not_found(f"`{path}` is not a file."), status_code=404)
        return FileResponse(file)

    @app.get("/runs/{name}/events")
    async def run_events(name: str, request: Request) -> Response:
        run = _run_or_404(runs, name)
        if isinstance(run, Response):
            return run
        last = request.headers.get("last-event-id", "0")
        start = int(last) if last.isdigit() else 0
        return StreamingResponse(_events(run, start, request, poll_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/static/studio.js")
    def script() -> Response:
        text = resources.files("emotune.studio").joinpath("static/studio.js").read_text(encoding="utf-8")
        return Response(text, media_type="text/javascript")

    # the same Host/Origin guard as `emotune serve`: no DNS rebinding onto a loopback studio, no cross-site calls
    return TrustedHosts(app, host, [])


def _run_or_404(runs: Path, name: str):
    try:
        return run_folder(runs, name)
    except NotInRuns:
        return HTMLResponse(pages.not_found(f"No run folder `{name}` in the runs folder."), status_code=404)


async def _events(run, start: int, request: Request, poll_s: float) -> AsyncIterator[str]:
    """Each training log entry after `start` as an SSE event with its position as id; then new ones as they come."""
    sent = start
    yield "retry: 1000\n\n"
    while True:
        entries = history(run)
        for position in range(sent + 1, len(entries) + 1):
            yield f"id: {position}\nevent: progress\ndata: {_json(entries[position - 1])}\n\n"
        sent = max(sent, len(entries))
        status = summarize(run).status
        if status != "running":
            yield f"event: end\ndata: {json.dumps({'status': status, 'entries': sent})}\n\n"
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(poll_s)


def _json(entry: dict) -> str:
    """The entry as JSON a browser parses: a NaN or infinite number (a step with no finite loss) becomes null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in entry.items()})
