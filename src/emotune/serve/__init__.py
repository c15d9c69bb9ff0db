"""`emotune serve`: an OpenAI-compatible HTTP API over one base model and any number of LoRA adapters.

    GET  /v1/models                 the base model and every loaded adapter, with its task
    POST /v1/classify               {"model", "input": str | [str]} -> label + per-label probabilities (not sft)
    POST /v1/chat/completions       OpenAI chat completions (stop, max_tokens), streaming (SSE) or not (not
                                    classification-head models, which have no text to give)
    POST /v1/adapters               {"name", "path"} load an adapter (admin key; only from serve.adapter_dirs)
    DELETE /v1/adapters/{name}      unload it (admin key)
    GET  /health, GET /metrics      liveness; Prometheus text format

Classification-head adapters (task classify_head) share the base with the others; a merged head model is
served alone. Every model call runs on one worker thread holding `Engine.lock`, so an adapter switch never lands in
the middle of a forward pass. Classify requests wait in a bounded queue and are scored together
(micro-batching): one forward pass serves many requests, which is where the throughput comes from.

    engine.py    the base model, adapters by name, the lock; `build_engine` from run or adapter folders
    batching.py  the bounded classify queue and the micro-batcher
    state.py     `Server`: what every route shares, and the checks a request passes (key, model, sizes, paths)
    routes.py    `create_app`: the routes, error handlers and middlewares
    chat.py      chat completions, plain and streaming
    http.py      errors as OpenAI JSON, API keys, the body-limit and request-metrics middlewares
    metrics.py   counters and latency histograms in the Prometheus text format
    schemas.py   request bodies
    vllm.py      serve.engine=vllm: the same adapters handed to `vllm serve`
"""

from __future__ import annotations

from emotune.core.config.run import RunConfig
from emotune.model.artifacts import Fallback
from emotune.serve.engine import build_engine
from emotune.serve.http import resolve_key
from emotune.serve.routes import create_app
from emotune.serve.vllm import serve_with_vllm

__all__ = ["build_engine", "create_app", "serve", "serve_with_vllm"]


def serve(cfg: RunConfig, targets: list[str], fallback: Fallback | None = None) -> None:
    if cfg.serve.engine == "vllm":
        return serve_with_vllm(cfg, targets, fallback)
    import uvicorn

    resolve_key(cfg.serve.api_key, "api_key"), resolve_key(cfg.serve.admin_key, "admin_key")  # fail before loading weights
    engine, _ = build_engine(cfg, targets, fallback)
    app = create_app(engine, cfg.serve)
    if cfg.serve.host not in ("127.0.0.1", "localhost", "::1") and cfg.serve.api_key is None:
        print(f"Warning: listening on {cfg.serve.host} without serve.api_key; anyone who can reach it can use it.", flush=True)
    print(f"Serving {', '.join(engine.models)} on http://{cfg.serve.host}:{cfg.serve.port}/v1", flush=True)
    uvicorn.run(app, host=cfg.serve.host, port=cfg.serve.port, timeout_graceful_shutdown=cfg.serve.shutdown_timeout_s,
                log_level="info")
