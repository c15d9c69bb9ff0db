"""Chat completions: a request checked and rendered with the chat template, then generated on the model thread.

An sft adapter's own system prompt leads the conversation when the request sends none. `stop` texts end
generation as soon as the decoded reply holds one, and the reply is cut before it (OpenAI's rule).
Streaming reads a `TextIteratorStreamer` from a helper thread and sends OpenAI `chat.completion.chunk`
events, holding back any tail that could still turn into a stop text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

import torch
from transformers import StoppingCriteria

from emotune.core.config.eval import ServeConfig
from emotune.model.turns import stop_token_ids
from emotune.serve.engine import Engine, Loaded
from emotune.serve.http import STREAM_FAILED, APIError
from emotune.serve.limits import Ticket, check_context, sampling
from emotune.serve.schemas import ChatRequest
from emotune.serve.state import Server

log = logging.getLogger("emotune.serve")


def chat_job(body: ChatRequest, loaded: Loaded, cfg: ServeConfig, state: Server) -> dict:
    artifact = loaded.artifact
    if artifact is not None and artifact.has_head:
        raise APIError(422, f"`{loaded.name}` is a classification-head model (task {artifact.task}): it answers with "
                            f"probabilities over its labels {artifact.labels}, not with text, so it has no chat "
                            f"completions. Send its texts to /v1/classify with model `{loaded.name}`.")
    if body.n != 1:
        raise APIError(422, f"n={body.n}: this server returns one choice per request (n=1). For several different "
                            "replies send several requests with temperature > 0 and different seeds.")
    if not body.messages:
        raise APIError(422, "`messages` is empty; send at least one user message.")
    if len(body.messages) > cfg.max_messages:
        raise APIError(422, f"`messages` holds {len(body.messages)} messages; the limit is serve.max_messages="
                            f"{cfg.max_messages}. Send a shorter conversation.")
    for i, message in enumerate(body.messages):
        state.check_text(message.content, f"messages[{i}].content")
    total = sum(len(message.content) for message in body.messages)
    if total > cfg.max_prompt_chars:
        raise APIError(422, f"The messages hold {total} characters together; the limit is serve.max_prompt_chars="
                            f"{cfg.max_prompt_chars}. Send a shorter conversation.")
    # the schema holds each field's own range (max_tokens ≥ 1, 0 < top_p ≤ 1, ...); the server's limit is checked here
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = asked if asked is not None else min(64, cfg.max_new_tokens)
    if max_tokens > cfg.max_new_tokens:
        raise APIError(422, f"max_tokens={max_tokens} is outside 1..serve.max_new_tokens={cfg.max_new_tokens}.")
    prompt = _render(body, loaded)
    prompt_tokens = len(loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    check_context(prompt_tokens, max_tokens if asked is not None else 1, state.context)
    max_tokens = min(max_tokens, state.context - prompt_tokens) if state.context else max_tokens
    temperature, top_p = sampling(body.temperature, body.top_p)
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": loaded.name,
            "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": body.seed,
            "stop": body.stop or [], "cancel": threading.Event(), "stopping": state.stopping}


def _render(body: ChatRequest, loaded: Loaded) -> str:
    messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
    system = loaded.artifact.sft_system_prompt if loaded.artifact is not None else None
    if system and not any(m["role"] == "system" for m in messages):  # answer under the prompt it was trained with
        messages.insert(0, {"role": "system", "content": system})
    try:
        return loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raise_exception: e.g. roles that do not alternate
        raise APIError(422, f"The chat template rejected the messages: {err}") from None


def generate_reply(engine: Engine, job: dict, streamer) -> tuple[str, str, dict]:
    """Runs on the worker thread; with a streamer, the text also flows out token by token."""
    try:
        with engine.using(job["model"]) as loaded:
            tokenizer = loaded.tokenizer
            enc = tokenizer(job["prompt"], return_tensors="pt", add_special_tokens=False).to(engine.device)
            sampling = job["temperature"] > 0
            if sampling and job["seed"] is not None:
                torch.manual_seed(job["seed"])
            prompt_length = enc["input_ids"].shape[1]
            criteria = [Cancelled(job["cancel"], job["stopping"])]
            if job["stop"]:
                criteria.append(StopAtText(tokenizer, job["stop"], prompt_length))
            stops = stop_token_ids(tokenizer, getattr(engine.model, "generation_config", None))
            output = engine.model.generate(
                **enc, max_new_tokens=job["max_tokens"], do_sample=sampling, streamer=streamer,
                temperature=job["temperature"] if sampling else None, top_p=job["top_p"] if sampling else None,
                top_k=None, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                stopping_criteria=criteria)
    except BaseException:
        if streamer is not None:
            streamer.end()  # unblock the reader, which would otherwise wait for tokens that never come
        raise
    new = output[0, prompt_length:]
    text, stopped = cut_at_stop(tokenizer.decode(new, skip_special_tokens=True), job["stop"])
    finish = "stop" if stopped or (len(new) and int(new[-1]) in stops) else "length"
    usage = {"prompt_tokens": prompt_length, "completion_tokens": len(new), "total_tokens": prompt_length + len(new)}
    return text.strip(), finish, usage


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest stop text, and whether there was one."""
    found = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return (text[:min(found)], True) if found else (text, False)


class StopAtText(StoppingCriteria):
    """Ends generation once the decoded reply holds a stop text. Decoding, not token matching: a stop text may
    span tokens or start inside one, and the tokenizer's own spacing decides what the reply says."""

    def __init__(self, tokenizer, stops: list[str], prompt_length: int):
        self.tokenizer, self.stops, self.prompt_length = tokenizer, stops, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = [cut_at_stop(self.tokenizer.decode(row[self.prompt_length:], skip_special_tokens=True), self.stops)[1]
                for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Cancelled(StoppingCriteria):
    """Ends generation at the next token once its client has gone or the server is stopping."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = any(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class StopFilter:
    """Streamed text in, the text a client may see out: nothing from the first stop text on, and a tail that
    could still grow into a stop text held back until the next piece (or the end) decides."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text, self.held = self.held + piece, ""
        text, self.stopped = cut_at_stop(text, self.stops)
        if self.stopped:
            return text
        keep = next((k for k in range(min(len(text), max(map(len, self.stops), default=1) - 1), 0, -1)
                     if any(stop.startswith(text[-k:]) for stop in self.stops)), 0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, once generation ended without reaching a stop text."""
        held, self.held = ("" if self.stopped else self.held), ""
        return held


async def stream_chat(job: dict, engine: Engine, state: Server, ticket: Ticket, request_state):
    """The reply as SSE chunks. A failure after the first chunk (the 200 is sent by then) ends the stream with an
    error event, and the request counts as failed in /metrics. A client that goes away ends the generation."""
    from transformers import TextIteratorStreamer

    loaded = engine.models[job["model"]]
    streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=600)
    loop = asyncio.get_running_loop()
    done = loop.run_in_executor(state.chat_executor, generate_reply, engine, job, streamer)
    try:
        yield _chunk(job, {"role": "assistant", "content": ""})
        visible = StopFilter(job["stop"])
        async for piece in aiter_streamer(streamer, loop):
            piece = visible.feed(piece)
            if piece:
                yield _chunk(job, {"content": piece})
        _, finish, _ = await done
        rest = visible.flush()
        if rest:
            yield _chunk(job, {"content": rest})
        yield _chunk(job, {}, finish)
    except Exception as err:  # noqa: BLE001 (the status line is sent: the error can only go in-band)
        log.error("chat stream %s failed", job["id"], exc_info=err)
        setattr(request_state, STREAM_FAILED, True)
        message = str(err) if isinstance(err, APIError | LookupError) else f"The server failed on this request ({type(err).__name__})."
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': 500}})}\n\n"
    finally:
        job["cancel"].set()  # a client gone mid-stream: the generation stops at its next token
        done.cancel()  # one still waiting for the model thread never starts
        ticket.release()
    yield "data: [DONE]\n\n"


def _chunk(job: dict, delta: dict, finish: str | None = None) -> str:
    payload = {"id": job["id"], "object": "chat.completion.chunk", "created": job["created"], "model": job["model"],
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def aiter_streamer(streamer, loop):
    """TextIteratorStreamer blocks on a queue; read it from a helper thread so the event loop stays free."""
    sentinel = object()
    while True:
        piece = await loop.run_in_executor(None, next, streamer, sentinel)
        if piece is sentinel:
            return
        yield piece
