"""Chat completions: a request checked and rendered with the chat template, then generated on the model thread.

Streaming reads a `TextIteratorStreamer` from a helper thread and sends OpenAI `chat.completion.chunk` events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import torch

from emotune.config import ServeConfig
from emotune.models import stop_token_ids
from emotune.serve.engine import Engine, Loaded
from emotune.serve.http import APIError
from emotune.serve.schemas import ChatRequest
from emotune.serve.state import Server


def chat_job(body: ChatRequest, loaded: Loaded, cfg: ServeConfig, state: Server) -> dict:
    if body.n != 1:
        raise APIError(422, "Only n=1 is supported.")
    if not body.messages:
        raise APIError(422, "`messages` is empty; send at least one user message.")
    for i, message in enumerate(body.messages):
        state.check_text(message.content, f"messages[{i}].content")
    # the schema holds each field's own range (max_tokens ≥ 1, 0 < top_p ≤ 1, ...); the server's limit is checked here
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = asked if asked is not None else min(64, cfg.max_new_tokens)
    if max_tokens > cfg.max_new_tokens:
        raise APIError(422, f"max_tokens={max_tokens} is outside 1..serve.max_new_tokens={cfg.max_new_tokens}.")
    try:
        prompt = loaded.tokenizer.apply_chat_template([m.model_dump(include={"role", "content"}) for m in body.messages],
                                                      tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raise_exception: e.g. roles that do not alternate
        raise APIError(422, f"The chat template rejected the messages: {err}") from None
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": loaded.name,
            "prompt": prompt, "max_tokens": max_tokens, "temperature": body.temperature or 0.0,
            "top_p": body.top_p, "seed": body.seed}


def generate_reply(engine: Engine, job: dict, streamer) -> tuple[str, str, dict]:
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


async def stream_chat(job: dict, engine: Engine, state: Server):
    from transformers import TextIteratorStreamer

    loaded = engine.models[job["model"]]
    streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(state.executor, generate_reply, engine, job, streamer)

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
