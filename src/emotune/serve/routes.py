"""The app: its route table, error handlers and middlewares; each route gets the shared `Server` as a dependency."""

from __future__ import annotations

import asyncio
import re
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from emotune.config import PromptConfig, ServeConfig
from emotune.errors import UserError
from emotune.artifacts import Artifact, find_artifact
from emotune.serve.chat import chat_job, generate_reply, stream_chat
from emotune.serve.engine import BASE_MODEL, Engine, Loaded, check_base
from emotune.serve.http import APIError, BodyLimit, Observe, api_error, http_error, invalid_request
from emotune.serve.schemas import AdapterRequest, ChatRequest, ClassifyRequest
from emotune.serve.state import Server

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    state = Server(engine, cfg)
    app = FastAPI(title="emotune", lifespan=lifespan)
    app.state.server = state
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/classify", classify, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/adapters", load_adapter, methods=["POST"], status_code=201)
    app.add_api_route("/v1/adapters/{name}", unload_adapter, methods=["DELETE"])
    app.add_middleware(Observe, server=state)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)  # outermost: oversized bodies never reach the app
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: Server = app.state.server
    worker = asyncio.create_task(state.batcher.run())
    yield
    # uvicorn has stopped accepting and waited for requests in flight; now the worker may go
    worker.cancel()
    state.executor.shutdown(wait=True)


async def current_server(request: Request) -> Server:
    """The app's shared state; async, so FastAPI resolves it on the event loop rather than a thread."""
    return request.app.state.server


ServerState = Annotated[Server, Depends(current_server)]


async def health(state: ServerState):
    return {"status": "ok", "models": list(state.engine.models), "queue": state.batcher.pending}


async def metrics(request: Request, state: ServerState):
    state.authorize(request)
    gauges = {"emotune_queue_texts": state.batcher.pending, "emotune_requests_in_flight": state.in_flight,
              "emotune_adapters_loaded": len(state.engine.models) - 1}
    return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")


async def list_models(request: Request, state: ServerState):
    state.authorize(request)
    return {"object": "list", "data": [_model_card(m, state.engine) for m in state.engine.models.values()]}


async def classify(body: ClassifyRequest, request: Request, state: ServerState):
    state.authorize(request)
    loaded = state.loaded(body.model)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts or len(texts) > state.cfg.max_inputs:
        raise APIError(422, f"`input` holds {len(texts)} texts; give 1 to serve.max_inputs={state.cfg.max_inputs}.")
    for i, text in enumerate(texts):
        state.check_text(text, f"input[{i}]")
    prompt, labels = _task(loaded, body.labels)
    probs = await state.batcher.submit(loaded.name, texts, prompt, labels)
    data = []
    for i, row in enumerate(probs.tolist()):
        best = max(range(len(labels)), key=row.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": dict(zip(labels, row))})
    # a JSONResponse skips FastAPI's generic encoder, which costs more than the scoring for small batches
    return JSONResponse({"object": "list", "model": loaded.name, "data": data, "usage": {"texts": len(texts)}})


async def chat(body: ChatRequest, request: Request, state: ServerState):
    state.authorize(request)
    loaded = state.loaded(body.model)
    job = chat_job(body, loaded, state.cfg, state)
    if body.stream:
        return StreamingResponse(stream_chat(job, state.engine, state), media_type="text/event-stream")
    loop = asyncio.get_running_loop()
    text, finish, usage = await loop.run_in_executor(state.executor, generate_reply, state.engine, job, None)
    return {"id": job["id"], "object": "chat.completion", "created": job["created"], "model": loaded.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": usage}


async def load_adapter(body: AdapterRequest, request: Request, state: ServerState):
    state.authorize(request, admin=True)
    engine = state.engine
    if not NAME_PATTERN.match(body.name) or body.name == BASE_MODEL:
        raise APIError(422, f"Adapter name `{body.name}` must be 1-64 letters, digits, `.`, `_` or `-` and not "
                            f"`{BASE_MODEL}`.")
    if body.name in engine.models:
        raise APIError(409, f"An adapter named `{body.name}` is already loaded. DELETE /v1/adapters/{body.name} first.",
                       "conflict_error")
    artifact = _adapter_artifact(state, body)
    await asyncio.get_running_loop().run_in_executor(state.executor, engine.add_adapter, artifact)
    return _model_card(engine.models[artifact.name], engine)


async def unload_adapter(name: str, request: Request, state: ServerState):
    state.authorize(request, admin=True)
    if name == BASE_MODEL:
        raise APIError(422, "The base model cannot be unloaded.")
    state.loaded(name)
    await asyncio.get_running_loop().run_in_executor(state.executor, state.engine.remove_adapter, name)
    return {"id": name, "object": "model", "deleted": True}


def _model_card(loaded: Loaded, engine: Engine) -> dict:
    card = {"id": loaded.name, "object": "model", "created": loaded.created, "owned_by": "emotune",
            "root": engine.base_source if loaded.artifact is None else str(loaded.artifact.path),
            "parent": None if loaded.artifact is None else BASE_MODEL}
    if loaded.artifact is not None:
        card["labels"] = loaded.artifact.labels
    return card


def _task(loaded: Loaded, labels: list[str] | None) -> tuple[PromptConfig, list[str]]:
    """The prompt and label set to score with: the adapter's own, or (base model) the request's labels."""
    if loaded.artifact is not None:
        if labels is not None and labels != loaded.artifact.labels:
            raise APIError(422, f"`labels` can only be chosen for the base model; `{loaded.name}` classifies into "
                                f"{loaded.artifact.labels}. Leave `labels` out.")
        return loaded.artifact.prompt, loaded.artifact.labels
    if not labels or len(set(labels)) < 2:
        raise APIError(422, f"The `{BASE_MODEL}` model has no label set of its own: pass `labels`, two or more names.")
    return PromptConfig(), labels


def _adapter_artifact(state: Server, body: AdapterRequest) -> Artifact:
    folder = state.allowed_adapter_path(body.path)
    try:
        artifact = find_artifact(folder, name=body.name)
        if artifact.merged:
            raise UserError(f"`{body.path}` is a merged model, not an adapter; serve it on its own (vllm serve).")
        if not (artifact.path / "adapter_model.safetensors").is_file():
            raise UserError(f"`{body.path}` has no adapter_model.safetensors; only safetensors adapters are loaded "
                            "(pickled .bin files can run code).")
        check_base(artifact, state.engine.base_source)
    except UserError as err:
        raise APIError(422, str(err)) from None
    return artifact
