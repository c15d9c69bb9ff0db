"""`emotune serve`: an OpenAI-compatible HTTP API over one base model and any number of LoRA adapters.

    GET  /v1/models                 the base model and every loaded adapter, with its task
    POST /v1/classify               {"model", "input": str | [str]} -> label + per-label probabilities (not sft)
    POST /v1/chat/completions       OpenAI chat completions (stop, max_tokens), streaming (SSE) or not (not
                                    classification-head models, which have no text to give)
    POST /v1/adapters               {"name", "path"} load an adapter (admin key; only from serve.adapter_dirs)
    DELETE /v1/adapters/{name}      unload it (admin key)
    GET  /health, GET /metrics      the worker and model thread (503 while down); Prometheus text format

Classification-head adapters (task classify_head) share the base with the others; a merged head model is
served alone. Every model call runs on one worker thread holding `Engine.lock`, so an adapter switch never lands in
the middle of a forward pass; that thread takes classify work and generations from two lanes, so chats cannot
starve classification (serve.chat_share). Classify requests wait in a bounded queue and are scored together
(micro-batching): one forward pass serves many requests, which is where the throughput comes from.

    engine.py    the base model, adapters by name, the lock; `build_engine` from run or adapter folders
    batching.py  the bounded classify queue and the micro-batcher
    modelthread.py  the model thread and its two lanes (classify, chat)
    state.py     `Server`: what every route shares, and the checks a request passes (key, model, sizes, paths)
    routes.py    `create_app`: the routes, error handlers and middlewares
    chat.py      chat completions, plain and streaming
    generation.py  one reply on the model thread: its prompt prefilled in chunks, then generated in slices
    http.py      errors as OpenAI JSON, API keys, the body-limit and request-metrics middlewares
    guards.py    Host and Origin checks (DNS rebinding), the slow-header guard, uvicorn's settings
    limits.py    request limits checked before work starts, and the admission gate classify and chat share
    metrics.py   counters and latency histograms in the Prometheus text format
    schemas.py   request bodies
    vllm.py      serve.engine=vllm: the same adapters handed to `vllm serve`
"""

from __future__ import annotations

import os
import sys

from emotune.core.config.eval import ServeConfig
from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError
from emotune.model.artifacts import Fallback
from emotune.serve.engine import build_engine
from emotune.serve.guards import is_loopback, uvicorn_config
from emotune.serve.http import resolve_key
from emotune.serve.routes import create_app
from emotune.serve.vllm import serve_with_vllm

__all__ = ["build_engine", "check_auth", "create_app", "run_server", "serve", "serve_with_vllm"]


def serve(cfg: RunConfig, targets: list[str], fallback: Fallback | None = None) -> None:
    check_auth(cfg.serve)  # before loading weights, with the keys themselves
    if cfg.serve.engine == "vllm":
        return serve_with_vllm(cfg, targets, fallback)
    engine, _ = build_engine(cfg, targets, fallback)
    app = create_app(engine, cfg.serve)
    print(f"Serving {', '.join(engine.models)} on http://{cfg.serve.host}:{cfg.serve.port}/v1"
          + (" without a key (--no-auth)" if cfg.serve.no_auth else ""), flush=True)
    run_server(app, cfg.serve)


def check_auth(cfg: ServeConfig) -> None:
    """A key is needed, unless --no-auth on a loopback host; an empty or unreadable key is refused."""
    resolve_key(cfg.api_key, "api_key"), resolve_key(cfg.admin_key, "admin_key")
    if cfg.no_auth and cfg.api_key is not None:
        raise UserError("serve.no_auth=true (--no-auth) and serve.api_key are both set: leave one out.")
    if cfg.no_auth and not is_loopback(cfg.host):
        raise UserError(f"--no-auth (serve.no_auth=true) serves without a key, which is allowed on a loopback host "
                        f"only (127.0.0.1, ::1, localhost), not on {cfg.host}. Set serve.api_key=env:NAME or file:PATH.")
    if not cfg.no_auth and cfg.api_key is None:
        raise UserError("No API key: set serve.api_key=env:NAME (an environment variable holding the key) or "
                        "serve.api_key=file:PATH, or pass --no-auth to serve without one on a loopback host.")


def run_server(app, cfg: ServeConfig) -> None:
    """uvicorn until Ctrl-C or SIGTERM. Its shutdown waits serve.shutdown_timeout_s for requests in flight, then
    the app stops what still runs; a model call that cannot be interrupted (one forward pass) is not waited for:
    uvicorn ends the process with the SIGTERM it caught, and after Ctrl-C the interpreter would wait for the model
    thread at exit, so the process ends here."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, cfg))
    try:
        server.run()
    finally:
        if app.state.server.engine.busy_since is not None:
            print("Stopped while a model call was still running; exiting without waiting for it.", flush=True)
            sys.stderr.flush()
            os._exit(130)
