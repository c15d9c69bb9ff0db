"""The studio's web app: the runs table, a run's page, its files, its training progress as server-sent events, and
the new-run form with its job queue.

Progress events carry the training log entry's position as their id (1 = the first entry). A browser that loses
the stream reconnects with `Last-Event-ID` and is sent only what came after it; a reloaded page starts at 0 and is
sent the whole history so far. The stream ends (event `end`) once the run's job has ended (or, for a run not
started here, run.json no longer says running) and every entry has been sent.

State-changing requests (POST) carry the page's CSRF token; the Host/Origin guard of `emotune serve` stands in front.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse

from emotune.core.config.base import is_run_name
from emotune.core.config.build import TASK_CONFIGS
from emotune.core.errors import UserError
from emotune.core.figures import packaged_cjk_font
from emotune.core.rundir import RunDir
from emotune.report.compare import comparison_table
from emotune.report.table import html_sections
from emotune.serve.guards import TrustedHosts, is_loopback
from emotune.serve.http import BodyAnswers, BodyLimit
from emotune.studio import form, pages
from emotune.studio.jobs import FINAL, JobQueue, NameTaken, worker
from emotune.studio.runs import (
    NotInRuns,
    any_run,
    artifacts,
    config_text,
    history,
    inside,
    last_line,
    list_runs,
    list_sweeps,
    log_tail,
    run_details,
    run_folder,
    summarize,
    summarize_sweep,
    sweep_folder,
    telemetry_row,
)
from emotune.studio.tryout import MAX_NEW_TOKENS, Refused, Tryout
from emotune.tasks import DEFAULT_TASK

TOKEN_COOKIE = "emotune_studio_token"
POLL_S = 0.5  # how often a live stream looks at the training log for new lines
STREAM_S = 300.0  # a progress stream is ended after this long; the browser reconnects at once with Last-Event-ID
MAX_FORM_BYTES = 1 << 20


def create_app(runs: Path, host: str = "127.0.0.1", token: str | None = None, poll_s: float = POLL_S,
               jobs_interval_s: float | None = 1.0, stream_s: float = STREAM_S, device: str = "auto") -> TrustedHosts:
    """The studio for the run folders under `runs`, bound to `host`; a non-loopback `host` needs `token`.
    `jobs_interval_s`: how often the queue moves on (None: only when a test calls `app.state.queue.tick()`).
    `stream_s`: how long one progress stream lasts before the browser is made to reconnect (proxies and tunnels cut
    long connections anyway; this way a reconnect is the ordinary case). `device`: where tried models run."""
    if not is_loopback(host) and not token:
        raise ValueError("a studio on a non-loopback host needs a token")
    runs = Path(runs).resolve()
    queue, csrf = JobQueue(runs), secrets.token_urlsafe(24)
    tryout = Tryout(queue.training, device)
    queue.ready = tryout.idle  # a training job waits for a try to end, and frees the tried model first

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        thread = worker(queue, stop, jobs_interval_s) if jobs_interval_s else None
        yield
        stop.set()
        if thread is not None:
            thread.join(timeout=5)

    app = FastAPI(title="emotune studio", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.queue, app.state.csrf, app.state.tryout = queue, csrf, tryout
    _guard_routes(app, token, csrf)
    _run_routes(app, runs, queue, csrf, poll_s, stream_s)
    _job_routes(app, runs, queue, csrf)
    _compare_routes(app, runs)
    _try_routes(app, runs, tryout, csrf)
    # the same Host/Origin guard as `emotune serve`: no DNS rebinding onto a loopback studio, no cross-site calls
    # a form over 1 MiB is refused before it is read whole (declared) or as soon as it passes 1 MiB (sent)
    limited = BodyLimit(app, MAX_FORM_BYTES, answers=BodyAnswers(
        too_large=lambda: PlainTextResponse("The form is larger than 1 MiB.", status_code=413),
        too_slow=lambda: PlainTextResponse("The form did not arrive within 30 s: send it again.", status_code=408)))
    guarded = TrustedHosts(limited, host, [])
    guarded.state = app.state
    return guarded


def _guard_routes(app: FastAPI, token: str | None, csrf: str) -> None:
    @app.middleware("http")
    async def require_token_and_csrf(request: Request, call_next):
        if token is not None and request.url.path not in ("/login", "/static/studio.js"):
            sent = request.cookies.get(TOKEN_COOKIE) or request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(sent.encode(), token.encode()):
                return HTMLResponse(pages.login_page("This studio needs its token."), status_code=401)
        if request.method == "POST" and request.url.path != "/login":
            body = await request.body()  # at most MAX_FORM_BYTES: BodyLimit (create_app) answered larger ones
            sent = (parse_qs(body.decode("utf-8", errors="replace")).get("csrf") or [""])[0]
            if not hmac.compare_digest(sent.encode(), csrf.encode()):
                return PlainTextResponse("The form's CSRF token is missing or stale: reload the page and send it again.",
                                         status_code=403)
        return await call_next(request)

    @app.get("/login", response_class=HTMLResponse)
    def login_form() -> str:
        return pages.login_page("")

    @app.post("/login")
    async def login(request: Request) -> Response:
        """The token typed into the login form (a POST: a token in a URL would stay in the browser's history)."""
        body = await request.body()
        sent = (parse_qs(body[:4096].decode("utf-8", errors="replace")).get("token") or [""])[0]
        if token is None or not hmac.compare_digest(sent.encode(), token.encode()):
            return HTMLResponse(pages.login_page("Wrong token."), status_code=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/static/studio.js")
    def script() -> Response:
        text = resources.files("emotune.studio").joinpath("static/studio.js").read_text(encoding="utf-8")
        return Response(text, media_type="text/javascript")

    @app.get("/static/cjk.otf")
    def cjk_font() -> Response:
        """Noto Sans SC, the font emotune's figures use for Chinese (a dependency): Chinese labels render on a
        machine without CJK fonts, and nothing is fetched from a font CDN. The page asks for it only for CJK text."""
        font = packaged_cjk_font()
        if font is None:
            return PlainTextResponse("No packaged CJK font (pylopdf-fonts-zh-cn is not installed).", status_code=404)
        return FileResponse(font, media_type="font/otf", headers={"Cache-Control": "max-age=86400"})


def _run_routes(app: FastAPI, runs: Path, queue: JobQueue, csrf: str, poll_s: float, stream_s: float) -> None:
    @app.get("/", response_class=HTMLResponse)
    def runs_table() -> str:
        return pages.runs_page(list_runs(runs), str(runs), pages.jobs_list(queue.jobs(), csrf), list_sweeps(runs))

    @app.get("/api/runs")
    def runs_json() -> list[dict]:
        return [r.as_row() for r in list_runs(runs)]

    @app.get("/runs/{name}", response_class=HTMLResponse)
    def run_page(name: str) -> Response:
        run, job = _run_or_job(runs, queue, name)
        if run is None:
            return HTMLResponse(pages.not_found(f"No run folder `{name}` in the runs folder."), status_code=404)
        summary = summarize(run)
        if job is not None and job.status not in FINAL:
            summary.status = job.status if summary.status != "running" else "running"
        job_html = (f'<p>Job {job.id}: <span id="job-status">{job.status}</span> {pages.stop_button(job, csrf)}</p>'
                    if job is not None else "")
        log = log_tail(queue.log(job)) if job is not None else ""
        return HTMLResponse(pages.run_page(pages.RunView(summary, config_text(run), len(history(run)),
                                                         artifacts(run) if run.root.is_dir() else [], log,
                                                         run.report_html.is_file(), job_html, run_details(run))))

    @app.get("/runs/{name}/files/{path:path}")
    def run_file(name: str, path: str) -> Response:
        return _file(runs, name, path, run_folder, "run")

    @app.get("/runs/{name}/events")
    async def run_events(name: str, request: Request) -> Response:
        run, _ = _run_or_job(runs, queue, name)
        if run is None:
            return HTMLResponse(pages.not_found(f"No run folder `{name}` in the runs folder."), status_code=404)
        last = request.headers.get("last-event-id", "0")
        # only ids this stream could have sent: int() refuses 4,300 digits and more, and isdigit() passes "²"
        start = int(last) if last.isascii() and last.isdigit() and len(last) <= 18 else 0
        return StreamingResponse(_events(run, queue, start, request, poll_s, stream_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _job_routes(app: FastAPI, runs: Path, queue: JobQueue, csrf: str) -> None:
    @app.get("/new", response_class=HTMLResponse)
    def new_run(task: str = DEFAULT_TASK) -> Response:
        if task not in TASK_CONFIGS:
            return HTMLResponse(pages.not_found(f"No task `{task}`; the tasks are {', '.join(TASK_CONFIGS)}."), status_code=404)
        return HTMLResponse(pages.form_page(task, list(TASK_CONFIGS), form.fields(task), {}, {}, csrf))

    @app.post("/new")
    async def submit_run(request: Request) -> Response:
        body = (await request.body()).decode("utf-8", errors="replace")  # bytes that are not UTF-8: refused by the field
        submitted = {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}
        task = submitted.get("task", DEFAULT_TASK)
        config_yaml, problems = form.validate(task, form.to_raw(task, submitted, runs) if task in TASK_CONFIGS else {}, runs)
        if config_yaml is None:
            fields = form.fields(task) if task in TASK_CONFIGS else []
            return HTMLResponse(pages.form_page(task, list(TASK_CONFIGS), fields, submitted, problems, csrf), status_code=400)
        name = form.run_name(config_yaml)
        try:
            queue.submit(name, config_yaml)
        except NameTaken as err:
            return HTMLResponse(pages.form_page(task, list(TASK_CONFIGS), form.fields(task), submitted, {"name": [str(err)]},
                                                csrf), status_code=400)
        return RedirectResponse(f"/runs/{quote(name)}", status_code=303)

    @app.post("/new/llamafactory", response_class=HTMLResponse)
    async def from_llamafactory(request: Request) -> Response:
        """A LLaMA-Factory training YAML, pasted or read from a file by the page: translated into the sft form,
        every translated field filled in and the translation shown above it; nothing is queued until it is sent."""
        submitted = parse_qs((await request.body()).decode("utf-8", errors="replace"), keep_blank_values=True)
        task, values, problems, notes = form.from_llamafactory((submitted.get("llamafactory") or [""])[0])
        return HTMLResponse(pages.form_page(task, list(TASK_CONFIGS), form.fields(task), values, problems, csrf, notes),
                            status_code=400 if problems.get("") and not values else 200)

    @app.post("/jobs/{job_id}/stop")
    def stop_job(job_id: int) -> Response:
        job = queue.stop(job_id)
        if job is None:
            return HTMLResponse(pages.not_found(f"No job {job_id}."), status_code=404)
        return RedirectResponse(f"/runs/{quote(job.name)}", status_code=303)


def _compare_routes(app: FastAPI, runs: Path) -> None:
    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request) -> Response:
        """The runs picked on the runs table (`?run=A&run=B`, a sweep's trials as SWEEP/TRIAL) side by side: the
        quality table with intervals and the paired test against the first, the figure, setup and cost, per class."""
        names = request.query_params.getlist("run")
        mismatch = request.query_params.get("mismatch") == "1"
        if len(names) < 2:
            return HTMLResponse(pages.compare_page(names, [], "Pick two or more runs on the runs table to compare."),
                                status_code=400)
        try:
            folders = [any_run(runs, name).root for name in names]
        except NotInRuns as err:
            return HTMLResponse(pages.not_found(f"No run folder `{err}` in the runs folder."), status_code=404)
        try:
            table = comparison_table(folders, allow_mismatch=mismatch)
        except UserError as err:
            return HTMLResponse(pages.compare_page(names, [], str(err), offer_mismatch=not mismatch), status_code=400)
        return HTMLResponse(pages.compare_page(names, html_sections(table), ""))

    @app.get("/sweeps/{name}", response_class=HTMLResponse)
    def sweep_page(name: str) -> Response:
        try:
            folder = sweep_folder(runs, name)
        except NotInRuns:
            return HTMLResponse(pages.not_found(f"No sweep folder `{name}` in the runs folder."), status_code=404)
        return HTMLResponse(pages.sweep_page(summarize_sweep(folder), _trials(folder)))

    @app.get("/sweeps/{name}/files/{path:path}")
    def sweep_file(name: str, path: str) -> Response:
        return _file(runs, name, path, sweep_folder, "sweep")


# A run folder's files hold what its data and model wrote (texts, labels, replies), served from the studio's own origin:
# a page among them runs no script and reaches no studio page (CSP sandbox: an opaque origin), and no file is read as
# another type than its name says (nosniff). The report has no scripts, so it shows as it does opened from disk.
FILE_HEADERS = {"Content-Security-Policy": "sandbox", "X-Content-Type-Options": "nosniff"}


def _file(runs: Path, name: str, path: str, folder, what: str) -> Response:
    """A file of the run or sweep folder `name` (`folder` checks it is one), resolved inside the runs folder; 404
    for anything else."""
    try:
        folder(runs, name)
        file = inside(runs, f"{name}/{path}")
    except NotInRuns:
        return HTMLResponse(pages.not_found(f"No file `{path}` in {what} `{name}`."), status_code=404)
    if not file.is_file():
        return HTMLResponse(pages.not_found(f"`{path}` is not a file."), status_code=404)
    return FileResponse(file, headers=FILE_HEADERS)


def _trials(folder: Path) -> list[str]:
    """The sweep's trial run folders that hold a report."""
    return sorted(p.name for p in folder.iterdir() if (p / "report.html").is_file())


def _try_routes(app: FastAPI, runs: Path, tryout: Tryout, csrf: str) -> None:
    @app.get("/runs/{name}/try", response_class=HTMLResponse)
    def try_page(name: str) -> Response:
        try:
            run = run_folder(runs, name)
        except NotInRuns:
            return HTMLResponse(pages.not_found(f"No run folder `{name}` in the runs folder."), status_code=404)
        try:
            artifact = tryout.artifact_of(run)
        except Refused as err:
            return HTMLResponse(pages.try_page(name, None, [], csrf, str(err), MAX_NEW_TOKENS), status_code=409)
        return HTMLResponse(pages.try_page(name, artifact.answers_freely, artifact.labels
                                           if not artifact.answers_freely else [], csrf, "", MAX_NEW_TOKENS))

    @app.post("/runs/{name}/classify")
    async def classify(name: str, request: Request) -> Response:
        fields = parse_qs((await request.body()).decode("utf-8", errors="replace"), keep_blank_values=True)
        try:
            run = run_folder(runs, name)
            probs = await asyncio.to_thread(tryout.classify, run, (fields.get("text") or [""])[0])
        except NotInRuns:
            return JSONResponse({"error": f"No run folder `{name}` in the runs folder."}, status_code=404)
        except Refused as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        return JSONResponse({"label": probs[0][0], "probs": [{"label": k, "p": p} for k, p in probs]})

    @app.post("/runs/{name}/chat")
    async def chat(name: str, request: Request) -> Response:
        """The reply streamed as plain text, piece by piece, as it is generated."""
        fields = parse_qs((await request.body()).decode("utf-8", errors="replace"), keep_blank_values=True)
        try:
            messages = json.loads((fields.get("messages") or ["[]"])[0])
            max_tokens = int((fields.get("max_tokens") or ["128"])[0])
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser follows
            return JSONResponse({"error": "`messages` must be a JSON list and `max_tokens` a whole number."},
                                status_code=422)
        try:
            run = run_folder(runs, name)
            reply = await asyncio.to_thread(tryout.chat, run, messages if isinstance(messages, list) else [], max_tokens)
        except NotInRuns:
            return JSONResponse({"error": f"No run folder `{name}` in the runs folder."}, status_code=404)
        except Refused as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)

        async def pieces() -> AsyncIterator[str]:
            try:
                while True:
                    piece = await asyncio.to_thread(reply.pieces.get)
                    if piece is None:
                        return
                    if isinstance(piece, BaseException):
                        yield f"\n[generation failed: {piece}]"
                        return
                    yield piece
            finally:
                reply.cancel.set()  # the browser left (or the reply ended): the model is free again

        return StreamingResponse(pieces(), media_type="text/plain; charset=utf-8", headers={"Cache-Control": "no-store"})


def _run_or_job(runs: Path, queue: JobQueue, name: str):
    """(run folder, its latest studio job): a run folder under `runs`, or the folder a queued job will make."""
    job = queue.job_for(name) if is_run_name(name) else None
    try:
        return run_folder(runs, name), job
    except NotInRuns:
        return (RunDir(runs / name), job) if job is not None else (None, None)


async def _events(run: RunDir, queue: JobQueue, start: int, request: Request, poll_s: float,
                  stream_s: float) -> AsyncIterator[str]:
    """Each training log entry after `start` as an SSE event with its position as id; then new ones as they come,
    for `stream_s` at most (the browser then reconnects with the last id it saw)."""
    sent, began, sample_sent = start, time.monotonic(), None
    yield "retry: 500\n\n"
    while True:
        entries = history(run)
        for position in range(sent + 1, len(entries) + 1):
            yield f"id: {position}\nevent: progress\ndata: {_json(entries[position - 1])}\n\n"
        sent = max(sent, len(entries))
        sample = last_line(run.telemetry)
        if sample is not None and sample.get("time") != sample_sent:  # no id: a reconnect resumes the log, not this
            yield f"event: telemetry\ndata: {_json(telemetry_row(sample))}\n\n"
            sample_sent = sample.get("time")
        job = queue.job_for(run.root.name)
        status = summarize(run).status if run.root.is_dir() else "queued"
        if (job is None or job.status in FINAL) and status != "running":
            yield f"event: end\ndata: {json.dumps({'status': job.status if job else status, 'entries': sent})}\n\n"
            return
        if await request.is_disconnected() or time.monotonic() - began > stream_s:
            return
        await asyncio.sleep(poll_s)


def _json(entry: dict) -> str:
    """The entry as JSON a browser parses: a NaN or infinite number (a step with no finite loss, a telemetry reading
    the device could not take) becomes null, however deep it sits."""
    return json.dumps(_finite(entry))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return [_finite(v) for v in value] if isinstance(value, (list, tuple)) else value
