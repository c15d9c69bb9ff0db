"""`emotune serve`: an OpenAI-compatible HTTP API over one base model and any number of LoRA adapters.

    GET  /v1/models                 the base model and every loaded adapter
    POST /v1/classify               {"model", "input": str | [str]} -> label + per-label probabilities
    POST /v1/chat/completions       OpenAI chat completions, streaming (SSE) or not
    POST /v1/adapters               {"name", "path"} load an adapter (admin key; only from serve.adapter_dirs)
    DELETE /v1/adapters/{name}      unload it (admin key)
    GET  /health, GET /metrics      liveness; Prometheus text format

Every model call runs on one worker thread holding `Engine.lock`, so an adapter switch never lands in
the middle of a forward pass. Classify requests wait in a bounded queue and are scored together
(micro-batching): one forward pass serves many requests, which is where the throughput comes from.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import re
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from emotune import device as device_mod
from emotune.config import ModelConfig, PromptConfig, RunConfig, ServeConfig
from emotune.errors import UserError
from emotune.export import Artifact, find_artifact
from emotune.models import load_model, load_tokenizer, resolve_model_dir, stop_token_ids
from emotune.scoring import LabelScorer, score_label_probs

BASE_MODEL = "base"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class APIError(Exception):
    """An error answered as OpenAI-style JSON: {"error": {"message", "type", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


# --------------------------------------------------------------------------------------------------
# The engine: one base model, adapters by name, every call under one lock


@dataclass
class Loaded:
    name: str
    artifact: Artifact | None  # None for the base model
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))


class Engine:
    def __init__(self, model_cfg: ModelConfig, device: str = "auto"):
        self.device = device_mod.resolve_device(device)
        self.dtype = device_mod.choose_precision(self.device, "auto").dtype
        self.base_source = model_cfg.source
        self.base_dir = resolve_model_dir(model_cfg)
        self.model = load_model(self.base_dir, self.dtype, self.device).eval()
        self.models: dict[str, Loaded] = {BASE_MODEL: Loaded(BASE_MODEL, None, load_tokenizer(self.base_dir, model_cfg))}
        self.lock = threading.Lock()
        self.scorers: dict[str, LabelScorer] = {}  # per adapter; the cached prompt head depends on the weights

    @property
    def is_peft(self) -> bool:
        return hasattr(self.model, "peft_config")

    def add_adapter(self, artifact: Artifact) -> None:
        """Load an adapter under its name (called on the worker thread)."""
        from peft import PeftModel

        tokenizer = load_tokenizer(artifact.path, ModelConfig())
        with self.lock:
            if self.is_peft:
                self.model.load_adapter(artifact.path, adapter_name=artifact.name)
            else:
                self.model = PeftModel.from_pretrained(self.model, artifact.path, adapter_name=artifact.name).eval()
            self.models[artifact.name] = Loaded(artifact.name, artifact, tokenizer)
            self.scorers.clear()  # the first adapter wraps the model; start every scorer afresh

    def remove_adapter(self, name: str) -> None:
        with self.lock:
            self.models.pop(name)
            self.scorers.pop(name, None)
            self.model.delete_adapter(name)

    @contextmanager
    def using(self, name: str):
        """Hold the lock with `name` active: the base runs with every adapter disabled."""
        with self.lock:
            if name == BASE_MODEL:
                context = self.model.disable_adapter() if self.is_peft else nullcontext()
            else:
                self.model.set_adapter(name)
                context = nullcontext()
            with context:
                yield self.models[name]

    def classify(self, name: str, texts: list[str], prompt: PromptConfig, labels: list[str], batch_size: int) -> torch.Tensor:
        with self.using(name) as loaded:
            if loaded.artifact is None:  # the base with request-chosen labels: nothing worth keeping
                return score_label_probs(self.model, loaded.tokenizer, texts, prompt, labels, batch_size)
            # an adapter's scorer keeps the KV cache of its prompt head, so one request costs only its own text
            scorer = self.scorers.get(name)
            if scorer is None:
                scorer = self.scorers[name] = LabelScorer(self.model, loaded.tokenizer, prompt, labels)
            return scorer.log_probs(texts, batch_size).softmax(-1)


def check_base(artifact: Artifact, engine_source: str) -> None:
    """An adapter only fits the base it was trained on."""
    source = artifact.model_cfg.source
    same = source == engine_source or (Path(source).expanduser().exists() and Path(engine_source).expanduser().exists()
                                       and Path(source).expanduser().resolve() == Path(engine_source).expanduser().resolve())
    if not same:
        raise UserError(f"Adapter `{artifact.name}` was trained on base model `{source}`, but this server's base is "
                        f"`{engine_source}`. Serve it from a server started with that base.")


# --------------------------------------------------------------------------------------------------
# Micro-batching


@dataclass
class Job:
    model: str
    texts: list[str]
    prompt: PromptConfig
    labels: list[str]
    future: asyncio.Future

    @property
    def key(self) -> tuple:
        return self.model, self.prompt.system_prompt, self.prompt.user_template, tuple(self.labels)


class MicroBatcher:
    """Bounded queue of classify jobs; the worker scores every job that arrived together in one call."""

    def __init__(self, engine: Engine, executor: ThreadPoolExecutor, metrics: Metrics, cfg: ServeConfig):
        self.engine, self.executor, self.metrics, self.cfg = engine, executor, metrics, cfg
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.pending = 0  # texts queued or being scored

    async def submit(self, model: str, texts: list[str], prompt: PromptConfig, labels: list[str]) -> torch.Tensor:
        if self.pending + len(texts) > self.cfg.max_queue:
            self.metrics.inc("emotune_rejected_total", {"reason": "queue_full"})
            raise APIError(503, f"The classify queue is full ({self.pending} texts waiting, serve.max_queue="
                                f"{self.cfg.max_queue}). Retry shortly.", "server_overloaded")
        job = Job(model, texts, prompt, labels, asyncio.get_running_loop().create_future())
        self.pending += len(texts)
        try:
            self.queue.put_nowait(job)
            return await job.future
        finally:
            self.pending -= len(texts)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect(loop)
            groups: dict[tuple, list[Job]] = defaultdict(list)
            for job in batch:
                groups[job.key].append(job)
            for jobs in groups.values():
                await self._score(loop, jobs)

    async def _collect(self, loop) -> list[Job]:
        """The first waiting job, plus whatever arrives within batch_wait_ms, up to max_batch_size texts."""
        batch = [await self.queue.get()]
        size, deadline = len(batch[0].texts), loop.time() + self.cfg.batch_wait_ms / 1000
        while size < self.cfg.max_batch_size:
            try:
                job = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            batch.append(job)
            size += len(job.texts)
        return [job for job in batch if not job.future.done()]  # skip clients that went away

    async def _score(self, loop, jobs: list[Job]) -> None:
        if not jobs:
            return
        texts = [t for job in jobs for t in job.texts]
        first = jobs[0]
        self.metrics.observe_batch(len(texts))
        try:
            probs = await loop.run_in_executor(self.executor, self.engine.classify, first.model, texts, first.prompt,
                                               first.labels, self.cfg.max_batch_size)
        except Exception as err:  # one failing batch must not take the worker down
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        start = 0
        for job in jobs:
            if not job.future.done():
                job.future.set_result(probs[start:start + len(job.texts)])
            start += len(job.texts)


# --------------------------------------------------------------------------------------------------
# Metrics (Prometheus text format)


class Metrics:
    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))

    def __init__(self):
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.latency: dict[str, list[int]] = defaultdict(lambda: [0] * len(self.BUCKETS))
        self.latency_sum: dict[str, float] = defaultdict(float)

    def inc(self, name: str, labels: dict[str, str] | None = None, value: float = 1.0) -> None:
        self.counters[(name, tuple(sorted((labels or {}).items())))] += value

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.inc("emotune_requests_total", {"endpoint": endpoint, "status": str(status)})
        self.latency_sum[endpoint] += seconds
        for i, bound in enumerate(self.BUCKETS):
            if seconds <= bound:
                self.latency[endpoint][i] += 1

    def observe_batch(self, texts: int) -> None:
        self.inc("emotune_batches_total")
        self.inc("emotune_classified_texts_total", value=texts)

    def render(self, gauges: dict[str, float]) -> str:
        lines = []
        for (name, labels), value in sorted(self.counters.items()):
            lines.append(f"{name}{_labels(dict(labels))} {value:g}")
        for endpoint, counts in sorted(self.latency.items()):
            for bound, count in zip(self.BUCKETS, counts):
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f"emotune_request_seconds_bucket{_labels({'endpoint': endpoint, 'le': le})} {count}")
            lines.append(f"emotune_request_seconds_sum{_labels({'endpoint': endpoint})} {self.latency_sum[endpoint]:.6f}")
            lines.append(f"emotune_request_seconds_count{_labels({'endpoint': endpoint})} {counts[-1]}")
        lines += [f"{name} {value:g}" for name, value in gauges.items()]
        header = ["# TYPE emotune_requests_total counter", "# TYPE emotune_request_seconds histogram",
                  "# TYPE emotune_batches_total counter", "# TYPE emotune_classified_texts_total counter",
                  "# TYPE emotune_rejected_total counter",
                  *(f"# TYPE {name} gauge" for name in gauges)]
        return "\n".join(header + lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


# --------------------------------------------------------------------------------------------------
# Requests


class ClassifyRequest(BaseModel):
    model: str
    input: str | list[str]
    labels: list[str] | None = None
    """Only for the base model, which has no label set of its own."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        """OpenAI content may be a list of parts; the text parts are what a text model reads."""
        if isinstance(value, list):
            return "".join(part.get("text", "") for part in value if part.get("type") == "text")
        return value or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we accept and ignore
    model: str
    messages: list[ChatMessage]
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None


class AdapterRequest(BaseModel):
    name: str
    path: str


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


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


# --------------------------------------------------------------------------------------------------
# The app


class Server:
    """State shared by the routes: engine, worker thread, batcher, metrics, keys."""

    def __init__(self, engine: Engine, cfg: ServeConfig):
        self.engine, self.cfg = engine, cfg
        self.api_key = resolve_key(cfg.api_key, "api_key")
        self.admin_key = resolve_key(cfg.admin_key, "admin_key")
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emotune-model")
        self.metrics = Metrics()
        self.batcher = MicroBatcher(engine, self.executor, self.metrics, cfg)
        self.in_flight = 0

    # ---- checks ----

    def authorize(self, request: Request, admin: bool = False) -> None:
        expected = self.admin_key if admin else self.api_key
        if admin and expected is None:
            raise APIError(403, "Adapter loading is off: start the server with serve.admin_key set to enable it.",
                           "permission_error")
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(401, "Missing or wrong API key: send `Authorization: Bearer <key>`"
                                + (" with the admin key." if admin else "."), "authentication_error")

    def loaded(self, name: str) -> Loaded:
        if name not in self.engine.models:
            raise APIError(404, f"The model `{name}` does not exist. Loaded: {', '.join(self.engine.models)} "
                                "(GET /v1/models).", "not_found_error")
        return self.engine.models[name]

    def check_text(self, text: str, what: str) -> None:
        if len(text) > self.cfg.max_input_chars:
            raise APIError(422, f"{what} has {len(text)} characters; the limit is serve.max_input_chars="
                                f"{self.cfg.max_input_chars}. Shorten it.")

    def allowed_adapter_path(self, path: str) -> Path:
        """The resolved adapter folder, if it lies inside one of serve.adapter_dirs (links and `..` resolved)."""
        roots = [Path(d).expanduser().resolve() for d in self.cfg.adapter_dirs]
        given = Path(path).expanduser()
        candidates = [given.resolve()] if given.is_absolute() else [(root / given).resolve() for root in roots]
        inside = [c for c in candidates if any(c.is_relative_to(root) for root in roots)]
        where = f"serve.adapter_dirs ({', '.join(map(str, roots)) or 'none'})"
        if not inside:
            raise APIError(403, f"Adapter path `{path}` lies outside {where}.", "permission_error")
        found = next((c for c in inside if c.is_dir()), None)
        if found is None:
            raise APIError(404, f"Adapter path `{path}` is not a folder inside {where}.", "not_found_error")
        return found


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    state = Server(engine, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = asyncio.create_task(state.batcher.run())
        yield
        # uvicorn has stopped accepting and waited for requests in flight; now the worker may go
        worker.cancel()
        state.executor.shutdown(wait=True)

    app = FastAPI(title="emotune", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err.status, err.message, err.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in err.errors())
        return error_response(422, f"Invalid request: {problems}.")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), "not_found_error" if err.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(engine.models), "queue": state.batcher.pending}

    @app.get("/metrics")
    async def metrics(request: Request):
        state.authorize(request)
        gauges = {"emotune_queue_texts": state.batcher.pending, "emotune_requests_in_flight": state.in_flight,
                  "emotune_adapters_loaded": len(engine.models) - 1}
        return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def list_models(request: Request):
        state.authorize(request)
        return {"object": "list", "data": [_model_card(m, engine) for m in engine.models.values()]}

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request):
        state.authorize(request)
        loaded = state.loaded(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or len(texts) > cfg.max_inputs:
            raise APIError(422, f"`input` holds {len(texts)} texts; give 1 to serve.max_inputs={cfg.max_inputs}.")
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

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        state.authorize(request)
        loaded = state.loaded(body.model)
        job = _chat_job(body, loaded, cfg, state)
        if body.stream:
            return StreamingResponse(_stream_chat(job, engine, state), media_type="text/event-stream")
        loop = asyncio.get_running_loop()
        text, finish, usage = await loop.run_in_executor(state.executor, _generate, engine, job, None)
        return {"id": job["id"], "object": "chat.completion", "created": job["created"], "model": loaded.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": usage}

    @app.post("/v1/adapters", status_code=201)
    async def load_adapter(body: AdapterRequest, request: Request):
        state.authorize(request, admin=True)
        if not NAME_PATTERN.match(body.name) or body.name == BASE_MODEL:
            raise APIError(422, f"Adapter name `{body.name}` must be 1-64 letters, digits, `.`, `_` or `-` and not "
                                f"`{BASE_MODEL}`.")
        if body.name in engine.models:
            raise APIError(409, f"An adapter named `{body.name}` is already loaded. DELETE /v1/adapters/{body.name} first.",
                           "conflict_error")
        artifact = _adapter_artifact(state, body)
        await asyncio.get_running_loop().run_in_executor(state.executor, engine.add_adapter, artifact)
        return _model_card(engine.models[artifact.name], engine)

    @app.delete("/v1/adapters/{name}")
    async def unload_adapter(name: str, request: Request):
        state.authorize(request, admin=True)
        if name == BASE_MODEL:
            raise APIError(422, "The base model cannot be unloaded.")
        state.loaded(name)
        await asyncio.get_running_loop().run_in_executor(state.executor, engine.remove_adapter, name)
        return {"id": name, "object": "model", "deleted": True}

    app.add_middleware(Observe, server=state)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)  # outermost: oversized bodies never reach the app
    return app


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


# --------------------------------------------------------------------------------------------------
# Chat completions


def _chat_job(body: ChatRequest, loaded: Loaded, cfg: ServeConfig, state: Server) -> dict:
    if body.n != 1:
        raise APIError(422, "Only n=1 is supported.")
    if not body.messages:
        raise APIError(422, "`messages` is empty; send at least one user message.")
    for i, message in enumerate(body.messages):
        state.check_text(message.content, f"messages[{i}].content")
    max_tokens = body.max_completion_tokens or body.max_tokens or min(64, cfg.max_new_tokens)
    if not 1 <= max_tokens <= cfg.max_new_tokens:
        raise APIError(422, f"max_tokens={max_tokens} is outside 1..serve.max_new_tokens={cfg.max_new_tokens}.")
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise APIError(422, "temperature must be between 0 and 2.")
    try:
        prompt = loaded.tokenizer.apply_chat_template([m.model_dump(include={"role", "content"}) for m in body.messages],
                                                      tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raise_exception: e.g. roles that do not alternate
        raise APIError(422, f"The chat template rejected the messages: {err}") from None
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": loaded.name,
            "prompt": prompt, "max_tokens": max_tokens, "temperature": body.temperature or 0.0,
            "top_p": body.top_p, "seed": body.seed}


def _generate(engine: Engine, job: dict, streamer) -> tuple[str, str, dict]:
    """Runs on the worker thread; with a streamer, the text also flows out token by token."""
    try:
        with engine.using(job["model"]) as loaded:
            tokenizer = loaded.tokenizer
            enc = tokenizer(job["prompt"], return_tensors="pt", add_special_tokens=False).to(engine.device)
            sampling = job["temperature"] > 0
            if sampling and job["seed"] is not None:
                torch.manual_seed(job["seed"])
            output = engine.model.generate(
                **enc, max_new_tokens=job["max_tokens"], do_sample=sampling, streamer=streamer,
                temperature=job["temperature"] if sampling else None, top_p=job["top_p"] if sampling else None,
                top_k=None, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    except BaseException:
        if streamer is not None:
            streamer.end()  # unblock the reader, which would otherwise wait for tokens that never come
        raise
    new = output[0, enc["input_ids"].shape[1]:]
    finish = "stop" if len(new) and int(new[-1]) in stop_token_ids(tokenizer) else "length"
    usage = {"prompt_tokens": enc["input_ids"].shape[1], "completion_tokens": len(new),
             "total_tokens": enc["input_ids"].shape[1] + len(new)}
    return tokenizer.decode(new, skip_special_tokens=True).strip(), finish, usage


async def _stream_chat(job: dict, engine: Engine, state: Server):
    from transformers import TextIteratorStreamer

    loaded = engine.models[job["model"]]
    streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(state.executor, _generate, engine, job, streamer)

    def chunk(delta: dict, finish: str | None = None) -> str:
        payload = {"id": job["id"], "object": "chat.completion.chunk", "created": job["created"], "model": job["model"],
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    pieces = aiter_streamer(streamer, loop)
    async for piece in pieces:
        if piece:
            yield chunk({"content": piece})
    _, finish, _ = await done
    yield chunk({}, finish)
    yield "data: [DONE]\n\n"


async def aiter_streamer(streamer, loop):
    """TextIteratorStreamer blocks on a queue; read it from a helper thread so the event loop stays free."""
    sentinel = object()
    while True:
        piece = await loop.run_in_executor(None, next, streamer, sentinel)
        if piece is sentinel:
            return
        yield piece


# --------------------------------------------------------------------------------------------------
# Starting


def build_engine(cfg: RunConfig, targets: list[str]) -> tuple[Engine, list[Artifact]]:
    artifacts = [find_artifact(t) for t in targets]
    names = [a.name for a in artifacts]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserError(f"Two adapters would both be named {duplicates}; the name is the run folder's name. "
                        "Serve one of them, or copy it to a folder with another name.")
    merged = [a.name for a in artifacts if a.merged]
    if merged:
        raise UserError(f"{merged} are merged models; `emotune serve` serves adapters over one base. Point at the run "
                        "folders instead, or serve the merged model with vLLM (export --vllm writes serve_merged.sh).")
    model_cfg = artifacts[0].model_cfg if artifacts else cfg.model
    for artifact in artifacts:
        check_base(artifact, model_cfg.source)
    print(f"Loading base model {model_cfg.source} ...", flush=True)
    engine = Engine(model_cfg, cfg.device)
    for artifact in artifacts:
        engine.add_adapter(artifact)
        print(f"Loaded adapter {artifact.name} ({len(artifact.labels)} labels) from {artifact.path}", flush=True)
    return engine, artifacts


def serve(cfg: RunConfig, targets: list[str]) -> None:
    if cfg.serve.engine == "vllm":
        return serve_with_vllm(cfg, targets)
    import uvicorn

    resolve_key(cfg.serve.api_key, "api_key"), resolve_key(cfg.serve.admin_key, "admin_key")  # fail before loading weights
    engine, _ = build_engine(cfg, targets)
    app = create_app(engine, cfg.serve)
    if cfg.serve.host not in ("127.0.0.1", "localhost", "::1") and cfg.serve.api_key is None:
        print(f"Warning: listening on {cfg.serve.host} without serve.api_key; anyone who can reach it can use it.", flush=True)
    print(f"Serving {', '.join(engine.models)} on http://{cfg.serve.host}:{cfg.serve.port}/v1", flush=True)
    uvicorn.run(app, host=cfg.serve.host, port=cfg.serve.port, timeout_graceful_shutdown=cfg.serve.shutdown_timeout_s,
                log_level="info")


def serve_with_vllm(cfg: RunConfig, targets: list[str]) -> None:
    import importlib.util
    import shutil
    import subprocess
    import sys

    from emotune.export import max_lora_rank, adapter_config, vllm_base_reference, vllm_blockers

    if importlib.util.find_spec("vllm") is None:
        raise UserError("serve.engine=vllm needs the `vllm` package, which is not installed here (it needs a CUDA or "
                        "ROCm GPU). Install vllm, or use serve.engine=native.")
    artifacts = [find_artifact(t) for t in targets]
    if not artifacts or any(a.merged for a in artifacts):
        raise UserError("serve.engine=vllm serves run or adapter folders; for a merged model run its serve_merged.sh.")
    for artifact in artifacts:
        blockers = vllm_blockers(adapter_config(artifact.path))
        if blockers:
            raise UserError(f"vLLM cannot hot-load adapter `{artifact.name}`: {'; '.join(blockers)}. Use "
                            f"`emotune export {artifact.path.parent} --merge --vllm` and its serve_merged.sh.")
        check_base(artifact, artifacts[0].model_cfg.source)
    base, extra = vllm_base_reference(artifacts[0].model_cfg)
    rank = max(max_lora_rank(adapter_config(a.path)) for a in artifacts)
    args = ["serve", base, *extra, "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(artifacts)),
            "--lora-modules", *(f"{a.name}={a.path.resolve()}" for a in artifacts),
            "--host", cfg.serve.host, "--port", str(cfg.serve.port), "--generation-config", "auto"]
    api_key = resolve_key(cfg.serve.api_key, "api_key")
    executable = shutil.which("vllm", path=str(Path(sys.executable).parent)) or shutil.which("vllm") or "vllm"
    print(f"Starting: vllm {' '.join(args)}" + (" --api-key ***" if api_key else ""), flush=True)
    subprocess.run([executable, *args, *(["--api-key", api_key] if api_key else [])], check=False)
