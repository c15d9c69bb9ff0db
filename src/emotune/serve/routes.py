"""The app: its route table, error handlers and middlewares; each route gets the shared `Server` as a dependency."""

from __future__ import annotations

import asyncio
import logging
import re
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPBearer
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import ServeConfig
from emotune.core.errors import UserError
from emotune.model.artifacts import Artifact, check_adapter_files, find_artifact
from emotune.model.finite import nonfinite_rows, not_finite_message
from emotune.serve.chat import Generation, chat_job, check_chat, generate_reply, stream_chat
from emotune.serve.engine import BASE_MODEL, Engine, Loaded, ModelGone
from emotune.serve.guards import TrustedHosts
from emotune.serve.http import (
    AnswerFailures,
    APIError,
    BodyLimit,
    HeadAsGet,
    Observe,
    RequireKey,
    api_error,
    http_error,
    invalid_request,
    server_error,
    shown,
)
from emotune.serve.limits import check_labels
from emotune.serve.schemas import (
    AdapterRequest,
    ChatCompletion,
    ChatRequest,
    ClassifyRequest,
    ClassifyResponse,
    Deleted,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
)
from emotune.serve.state import Server

log = logging.getLogger("emotune.serve")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


ERRORS = {"4XX": {"model": ErrorBody, "description": "Refused; `error.message` says why and what to do."},
          "5XX": {"model": ErrorBody, "description": "The server could not answer (overloaded, or a failure it logged)."}}
# /metrics answers text, and FastAPI would declare its errors as text too; they are the same JSON as everywhere
TEXT_ROUTE_ERRORS = {code: {"description": response["description"],
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
                     for code, response in ERRORS.items()}
SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
             "description": "A chat.completion, or with `stream: true` chat.completion.chunk events."}}
ADMIN_PREFIX = "/v1/adapters"
bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="serve.api_key; serve.admin_key for /v1/adapters")


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    state = Server(engine, cfg)
    app = FastAPI(title="emotune", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    # The keys are checked by RequireKey; `Security(bearer)` declares them in the OpenAPI document.
    user = [Security(bearer)] if state.api_key is not None else []
    admin = [Security(bearer)]
    route = partial(app.add_api_route, responses=ERRORS, response_model_exclude_unset=True)
    route("/health", health, methods=["GET"], response_model=Health,
          responses={**ERRORS, 503: {"model": Health, "description": "The worker is restarting, or the server stopping."}})
    route("/metrics", metrics, methods=["GET"], response_class=PlainTextResponse, dependencies=user,
          responses=TEXT_ROUTE_ERRORS)
    route("/v1/models", list_models, methods=["GET"], response_model=ModelList, dependencies=user)
    route("/v1/models/{model}", retrieve_model, methods=["GET"], response_model=ModelCard, dependencies=user)
    route("/v1/classify", classify, methods=["POST"], response_model=ClassifyResponse, dependencies=user)
    route("/v1/chat/completions", chat, methods=["POST"], response_model=ChatCompletion, dependencies=user,
          responses={**ERRORS, **SSE})
    route(ADMIN_PREFIX, load_adapter, methods=["POST"], status_code=201, response_model=ModelCard, dependencies=admin)
    route(ADMIN_PREFIX + "/{name}", unload_adapter, methods=["DELETE"], response_model=Deleted, dependencies=admin)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes, timeout_s=cfg.body_timeout_s)  # before any parsing
    # added after BodyLimit, so it runs before it: a caller without the key gets 401 before a byte of its body is read
    # or waited for, whatever it sends (/docs, /openapi.json too)
    app.add_middleware(RequireKey, api_key=state.api_key, admin_key=state.admin_key, admin_prefix=ADMIN_PREFIX,
                       open_paths=("/health",))
    # before the key: a page of a foreign site (DNS rebinding) learns nothing, not even whether a key is set
    app.add_middleware(TrustedHosts, bound=cfg.host, allowed=cfg.allowed_hosts)
    app.add_middleware(HeadAsGet)  # every layer below sees GET
    app.add_middleware(AnswerFailures)  # outside every other layer but Observe, which counts its 500s
    app.add_middleware(Observe, server=state)  # outermost: every answer is counted, refusals too
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: Server = app.state.server
    supervisor = asyncio.create_task(state.supervise())
    yield
    # uvicorn has stopped accepting and waited up to its shutdown timeout for requests in flight; whatever still
    # runs is stopped: generation at its next token, queued model calls never start, and nothing waits for the
    # model call running now (emotune.serve.run_server ends the process if it outlives the server)
    state.stopping.set()
    supervisor.cancel()
    state.model_thread.shutdown(wait=False, cancel_futures=True)


async def current_server(request: Request) -> Server:
    """The app's shared state; async, so FastAPI resolves it on the event loop rather than a thread."""
    return request.app.state.server


ServerState = Annotated[Server, Depends(current_server)]


async def health(state: ServerState):
    status, body = state.health()
    return JSONResponse(body, status_code=status)


async def metrics(state: ServerState):
    adapters = sum(loaded.artifact is not None and not loaded.artifact.merged for loaded in state.engine.models.values())
    gauges = {"emotune_queue_texts": state.batcher.pending, "emotune_requests_in_flight": state.in_flight,
              "emotune_adapters_loaded": adapters}
    thread = state.model_thread
    lanes = {lane: (thread.seconds[lane], thread.jobs[lane]) for lane in thread.seconds}
    return PlainTextResponse(state.metrics.render(gauges, lanes), media_type="text/plain; version=0.0.4")


async def list_models(state: ServerState):
    return {"object": "list", "data": [_model_card(m, state.engine) for m in state.engine.models.values()]}


async def retrieve_model(model: str, state: ServerState):
    """OpenAI's GET /v1/models/{model}: one model's card, or 404."""
    return _model_card(state.loaded(model), state.engine)


async def classify(body: ClassifyRequest, state: ServerState, request: Request):
    loaded = state.loaded(body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts or len(texts) > state.cfg.max_inputs:
        raise APIError(422, f"`input` holds {len(texts)} texts; give 1 to serve.max_inputs={state.cfg.max_inputs}.")
    if len(texts) > state.cfg.max_queue:  # never admitted, however empty the queue: not the 503 that says retry
        raise APIError(422, f"`input` holds {len(texts)} texts, more than this server ever queues at once (serve.max_queue="
                            f"{state.cfg.max_queue}). Send at most {state.cfg.max_queue} per request.")
    for i, text in enumerate(texts):
        state.check_text(text, f"input[{i}]")
    prompt, labels = _task(loaded, body.labels, state)
    await asyncio.to_thread(state.check_context, loaded, texts, prompt, labels)  # tokenizing: off the event loop
    with model_gone_is_404():
        probs = await unless_client_leaves(request, state.batcher.submit(loaded.name, texts, prompt, labels))
    _check_finite(probs, loaded, state)
    data = []
    for i, row in enumerate(probs.tolist()):
        best = max(range(len(labels)), key=row.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": dict(zip(labels, row, strict=False))})
    # a JSONResponse skips FastAPI's generic encoder, which costs more than the scoring for small batches
    return JSONResponse({"object": "list", "model": loaded.name, "data": data, "usage": {"texts": len(texts)}})


async def chat(body: ChatRequest, state: ServerState, request: Request):
    loaded = state.loaded(body.model)
    check_chat(body, loaded, state.cfg, state)  # what a bad request is told (422), before it takes a place
    ticket = state.admission.take(chats=1)  # 429 or 503 before any rendering, and before a stream's 200 is sent
    try:
        # rendering and counting a long conversation takes a while: off the event loop, which other clients need
        job = await asyncio.to_thread(chat_job, body, loaded, state.cfg, state)
        await _unless_gone(request)  # a client that left meanwhile: its generation never starts
    except BaseException:
        ticket.release()
        raise
    if body.stream:
        return StreamingResponse(stream_chat(job, state.engine, state, ticket, request.state),
                                 media_type="text/event-stream", background=BackgroundTask(ticket.release))
    try:
        with model_gone_is_404():
            generation = Generation(state.engine, job, state.cfg.chat_slice_tokens, state.cfg.prefill_slice_tokens)
            reply = generate_reply(generation, state.chat_executor)
            text, finish, usage = await unless_client_leaves(request, reply, job["cancel"].set)
    finally:
        ticket.release()
    return {"id": job["id"], "object": "chat.completion", "created": job["created"], "model": loaded.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": usage}


async def unless_client_leaves(request: Request, work, on_leave=None):
    """Await `work`; if the client disconnects first, cancel it (and call `on_leave`, which stops what cancelling
    cannot: a generation already running) and answer 499, which nobody reads. A client already gone when the work
    would start has it never started: on an idle model thread a queued call starts before a disconnect is seen."""
    try:
        await _unless_gone(request)
    except APIError:
        if asyncio.iscoroutine(work):
            work.close()  # never started
        raise
    work = asyncio.ensure_future(work)
    left = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if work.done():
        return work.result()
    work.cancel()
    if on_leave is not None:
        on_leave()
    raise _client_gone()


async def _unless_gone(request: Request) -> None:
    """499 at once when the client has disconnected already (seen without waiting for a message)."""
    if await request.is_disconnected():
        raise _client_gone()


def _client_gone() -> APIError:
    return APIError(499, "The client closed the connection; its work was cancelled.", "client_closed_request")


async def _disconnected(request: Request) -> None:
    # the body is read already: the next message the server sends is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def load_adapter(body: AdapterRequest, state: ServerState):
    engine = state.engine
    if not NAME_PATTERN.match(body.name) or body.name == BASE_MODEL:
        raise APIError(422, f"Adapter name `{shown(body.name)}` must be 1-64 letters, digits, `.`, `_` or `-` and not "
                            f"`{BASE_MODEL}`.")
    async with state.name_lock(body.name):  # a second load of the same name waits, then finds it loaded
        if body.name in engine.models:
            raise APIError(409, f"An adapter named `{body.name}` is already loaded. DELETE /v1/adapters/{body.name} "
                                "first.", "conflict_error")
        artifact = await asyncio.to_thread(_adapter_artifact, state, body)  # reads files: off the event loop
        try:
            tokenizer = await asyncio.to_thread(engine.tokenizer_for, artifact)  # off the model thread too
            await asyncio.get_running_loop().run_in_executor(state.chat_executor, engine.add_adapter, artifact, tokenizer)
        except UserError as err:  # weights holding NaN (NonFiniteOutput), or a tokenizer, head or layers that do not
            raise APIError(422, str(err)) from None  # fit this base: refused, the models served before unchanged
    return _model_card(engine.models[artifact.name], engine)


async def unload_adapter(name: str, state: ServerState):
    if name == BASE_MODEL:
        raise APIError(422, "The base model cannot be unloaded.")
    async with state.name_lock(name):  # a second unload of the same name waits, then finds it gone (404)
        artifact = state.loaded(name).artifact
        if artifact is not None and artifact.merged:
            raise APIError(422, f"`{name}` is the merged model this server serves; it cannot be unloaded.")
        with model_gone_is_404():
            await asyncio.get_running_loop().run_in_executor(state.chat_executor, state.engine.remove_adapter, name)
    return {"id": name, "object": "model", "deleted": True}


def _check_finite(probs, loaded: Loaded, state: Server) -> None:
    """A 500 naming the texts whose probabilities are NaN or infinite (no answer, and not JSON either), rather than
    one from the JSON encoder. The weights were finite when the model loaded (Engine._probe), so this is an overflow
    on these texts or a weight only they reach."""
    bad = nonfinite_rows(probs)
    if bad:
        where = ", ".join(f"input[{i}]" for i in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        message = not_finite_message(f"The model `{loaded.name}`", where, state.engine.dtype_of(loaded))
        log.error("%s", message)
        raise APIError(500, message, "server_error")


@contextmanager
def model_gone_is_404():
    try:
        yield
    except ModelGone as err:
        raise APIError(404, str(err), "not_found_error") from None


def _model_card(loaded: Loaded, engine: Engine) -> dict:
    artifact = loaded.artifact
    card = {"id": loaded.name, "object": "model", "created": loaded.created, "owned_by": "emotune",
            "root": _source_name(engine.base_source) if artifact is None else loaded.name,
            "parent": None if artifact is None or artifact.merged else BASE_MODEL}
    if artifact is not None:
        card["task"] = artifact.task
        if not artifact.answers_freely:
            card["labels"] = artifact.labels
        card["merged"] = artifact.merged
    return card


def _source_name(source: str) -> str:
    """A base model by name (a hub id, `embedded`, a folder's name): never a path of the server's disk."""
    path = Path(source).expanduser()
    return path.name if path.is_absolute() or path.exists() or len(path.parts) > 2 else source


def _task(loaded: Loaded, labels: list[str] | None, state: Server) -> tuple[PromptConfig, list[str]]:
    """The prompt and label set to score with: the adapter's own, or (base model) the request's labels. A head model
    reads no prompt; its labels are its head's."""
    if loaded.artifact is not None and loaded.artifact.answers_freely:
        raise APIError(422, f"`{loaded.name}` is an {loaded.artifact.task} model: it answers in free text and has no "
                            "label set to classify into. Send its requests to /v1/chat/completions; /v1/classify "
                            f"serves classify and classify_head models, and `{BASE_MODEL}` with a `labels` list.")
    if loaded.artifact is not None:
        if labels is not None and labels != loaded.artifact.labels:
            raise APIError(422, f"`labels` can only be chosen for the base model; `{loaded.name}` classifies into "
                                f"{loaded.artifact.labels}. Leave `labels` out.")
        prompt = PromptConfig() if loaded.artifact.has_head else loaded.artifact.prompt  # a head reads no prompt
        return prompt, loaded.artifact.labels
    if not labels or len(set(labels)) < 2:
        raise APIError(422, f"The `{BASE_MODEL}` model has no label set of its own: pass `labels`, two or more names.")
    check_labels(labels, loaded.tokenizer, state.cfg)
    return PromptConfig(), labels


def _adapter_artifact(state: Server, body: AdapterRequest) -> Artifact:
    folder = state.allowed_adapter_path(body.path)
    try:
        artifact = find_artifact(folder, name=body.name)
        if artifact.merged:
            raise UserError(f"`{body.path}` is a merged model, not an adapter; serve it on its own "
                            "(`emotune serve FOLDER`).")
        if not (artifact.path / "adapter_model.safetensors").is_file():
            raise UserError(f"`{body.path}` has no adapter_model.safetensors; only safetensors adapters are loaded "
                            "(pickled .bin files can run code).")
        state.engine.check_loadable(artifact)
        check_adapter_files(artifact.path)
    except UserError as err:
        raise APIError(422, str(err)) from None
    return artifact
