"""Chat completions: a request checked and rendered with the chat template, then generated on the model thread.

An sft adapter's own system prompt leads the conversation when the request sends none, and its user and assistant
turns are cleaned as its training turns were (emotune.json's `cleaning`). `stop` texts end
generation as soon as the decoded reply holds one, and the reply is cut before it (OpenAI's rule).
A reply is generated a slice of tokens at a time on the model thread (`Generation`), so classify work does not
wait for whole replies; streaming sends each slice's text as OpenAI `chat.completion.chunk` events, holding back
any tail that could still turn into a stop text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from emotune.core.config.eval import ServeConfig
from emotune.data.conversation_data import clean_chats_for_inference
from emotune.data.conversations import with_tools
from emotune.model.turns import encode_rendered, stop_text
from emotune.serve.engine import Engine, Loaded
from emotune.serve.generation import Generation, cut_at_stop
from emotune.serve.http import STREAM_FAILED, APIError
from emotune.serve.limits import Ticket, check_context, sampling
from emotune.serve.schemas import ChatRequest
from emotune.serve.state import Server

log = logging.getLogger("emotune.serve")


def check_chat(body: ChatRequest, loaded: Loaded, cfg: ServeConfig, state: Server) -> None:
    """The limits a chat request can be refused by (422) before anything is rendered or counted: cheap, on the event
    loop, before the request takes its place among serve.max_chats (a bad request is told what is wrong, not 429)."""
    artifact = loaded.artifact
    if artifact is not None and artifact.has_head:
        raise APIError(422, f"`{loaded.name}` is a classification-head model (task {artifact.task}): it answers with "
                            f"probabilities over its labels {artifact.labels}, not with text, so it has no chat "
                            f"completions. Send its texts to /v1/classify with model `{loaded.name}`.")
    if body.n != 1:
        raise APIError(422, f"n={body.n}: this server returns one choice per request (n=1). For several different "
                            "replies send several requests with temperature > 0 and different seeds.")
    _refuse_what_is_not_done(body)
    if not body.messages:
        raise APIError(422, "`messages` is empty; send at least one user message.")
    if len(body.messages) > cfg.max_messages:
        raise APIError(422, f"`messages` holds {len(body.messages)} messages; the limit is serve.max_messages="
                            f"{cfg.max_messages}. Send a shorter conversation.")
    for i, message in enumerate(body.messages):
        state.check_text(message.content, f"messages[{i}].content")
    tools = tools_text(body, loaded)  # written into the prompt too: counted with the messages
    total = sum(len(message.content) for message in body.messages) + len(tools or "")
    if total > cfg.max_prompt_chars:
        raise APIError(422, f"The messages{' and `tools`' if tools else ''} hold {total} characters together; the limit "
                            f"is serve.max_prompt_chars={cfg.max_prompt_chars}. Send a shorter conversation"
                            f"{' or fewer tools' if tools else ''}.")
    # the schema holds each field's own range (max_tokens ≥ 1, 0 < top_p ≤ 1, ...); the server's limit is checked here
    max_tokens = _asked(body) or _default_tokens(cfg)
    if max_tokens > cfg.max_new_tokens:
        raise APIError(422, f"max_tokens={max_tokens} is outside 1..serve.max_new_tokens={cfg.max_new_tokens}.")


def _refuse_what_is_not_done(body: ChatRequest) -> None:
    """OpenAI fields whose answer would silently differ from what the client asked for (no log-probabilities in the
    reply, text that is not JSON, no tool call where one was required): 422 naming the field, not a reply without it."""
    if body.logprobs or body.top_logprobs:
        raise APIError(422, "logprobs: this server does not return log-probabilities. Leave `logprobs` and "
                            "`top_logprobs` out; /v1/classify answers every label's probability.")
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(422, f"response_format type {body.response_format.type!r}: this server cannot constrain a reply to "
                            "JSON. Leave `response_format` out (or send type `text`) and ask for JSON in the prompt.")
    if body.tool_choice not in (None, "auto", "none"):
        raise APIError(422, f"tool_choice {body.tool_choice!r:.80}: this server does not make the model call a tool. "
                            "Send `auto` or `none`, or leave it out.")


def _asked(body: ChatRequest) -> int | None:
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def _default_tokens(cfg: ServeConfig) -> int:
    return min(64, cfg.max_new_tokens)


def chat_job(body: ChatRequest, loaded: Loaded, cfg: ServeConfig, state: Server) -> dict:
    """A request that passed check_chat: its conversation rendered and its tokens counted against the context, the
    job a Generation runs. Rendering and counting a long conversation take a while: call it off the event loop."""
    asked = _asked(body)
    max_tokens = asked if asked is not None else _default_tokens(cfg)
    prompt = _render(body, loaded)
    # as training read it: special-token text inside a message (`<|im_end|>` typed by a user) is plain text
    contents = [loaded.artifact.sft_system_prompt if loaded.artifact is not None else None,
                *(m.content for m in body.messages)]
    prompt_ids = encode_rendered(loaded.tokenizer, prompt, [c for c in contents if isinstance(c, str)])
    prompt_tokens = len(prompt_ids)
    check_context(prompt_tokens, max_tokens if asked is not None else 1, state.context)
    max_tokens = min(max_tokens, state.context - prompt_tokens) if state.context else max_tokens
    temperature, top_p = sampling(body.temperature, body.top_p)
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": loaded.name,
            "prompt": prompt, "prompt_ids": prompt_ids, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "seed": body.seed, "stop": [*(body.stop or []), *_closing(loaded)], "cancel": threading.Event(),
            "stopping": state.stopping, "include_usage": bool(body.stream_options and body.stream_options.include_usage)}


def _closing(loaded: Loaded) -> list[str]:
    """The text a template closes answers with when no token ends the turn (emotune.model.turns.stop_text): training
    taught no token after it, so the reply ends where it begins."""
    closing = stop_text(loaded.tokenizer)
    return [closing] if closing else []


def tools_text(body: ChatRequest, loaded: Loaded) -> str | None:
    """The request's `tools` as the prompt holds them (JSON), for a model that reads them: a conversation-trained
    model (the artifact answers freely) read tools after its system prompt while training. None for other models."""
    tools = (body.model_extra or {}).get("tools")
    if tools and loaded.artifact is not None and loaded.artifact.answers_freely:
        return json.dumps(tools, ensure_ascii=False)
    return None


def _render(body: ChatRequest, loaded: Loaded) -> str:
    messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
    text = tools_text(body, loaded)
    if text is not None:
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": with_tools(messages[0]["content"], text)}
        else:
            messages.insert(0, {"role": "system", "content": with_tools(loaded.artifact.sft_system_prompt, text)})
    return render_conversation(messages, loaded)


def render_conversation(messages: list[dict], loaded: Loaded) -> str:
    """The prompt for `messages` ({"role", "content"} each) through the model's chat template, the sft adapter's own
    system prompt first when the conversation has none, its tool results as user turns and its user and assistant
    turns cleaned by the steps its emotune.json records, as it trained; APIError 422 when the template rejects the
    messages."""
    messages = list(messages)
    if loaded.artifact is not None and loaded.artifact.answers_freely:  # tool results were trained as user turns
        messages = [{**m, "role": "user"} if m["role"] == "tool" else m for m in messages]
        messages = clean_chats_for_inference([messages], loaded.artifact.meta.get("cleaning"))[0]
    system = loaded.artifact.sft_system_prompt if loaded.artifact is not None else None
    if system and not any(m["role"] == "system" for m in messages):  # answer under the prompt it was trained with
        messages.insert(0, {"role": "system", "content": system})
    try:
        return loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raise_exception: e.g. roles that do not alternate
        raise APIError(422, f"The chat template rejected the messages: {err}") from None


async def generate_reply(generation: Generation, executor, on_slice=None) -> tuple[str, str, dict]:
    """Run `generation` slice by slice on the model thread's chat lane; `on_slice(text)` sees the reply so far."""
    loop = asyncio.get_running_loop()
    while True:
        done = await loop.run_in_executor(executor, generation.step)
        if on_slice is not None:
            await on_slice(generation.text)
        if done:
            return generation.reply()


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
    """The reply as SSE chunks, a slice at a time. A failure after the first chunk (the 200 is sent by then) ends the
    stream with an error event, and the request counts as failed in /metrics. A client that goes away ends the
    generation."""
    generation = Generation(engine, job, state.cfg.chat_slice_tokens, state.cfg.prefill_slice_tokens)
    pieces: asyncio.Queue[str | None] = asyncio.Queue()
    sent = 0

    async def on_slice(text: str) -> None:
        nonlocal sent
        whole = text if not text.endswith("\ufffd") else text.rstrip("\ufffd")  # a character cut between slices
        if len(whole) > sent:
            await pieces.put(whole[sent:])
            sent = len(whole)

    async def produce():
        try:
            return await generate_reply(generation, state.chat_executor, on_slice)
        finally:
            await pieces.put(None)

    done = asyncio.ensure_future(produce())
    try:
        yield _chunk(job, {"role": "assistant", "content": ""})
        visible = StopFilter(job["stop"])
        while (piece := await pieces.get()) is not None:
            piece = visible.feed(piece)
            if piece:
                yield _chunk(job, {"content": piece})
        _, finish, usage = await done
        rest = visible.flush()
        if rest:
            yield _chunk(job, {"content": rest})
        yield _chunk(job, {}, finish)
        if job.get("include_usage"):  # stream_options.include_usage: OpenAI's last chunk, no choices and the usage
            yield _chunk(job, None, usage=usage)
    except Exception as err:  # noqa: BLE001 (the status line is sent: the error can only go in-band)
        log.error("chat stream %s failed", job["id"], exc_info=err)
        setattr(request_state, STREAM_FAILED, True)
        message = str(err) if isinstance(err, APIError | LookupError) else f"The server failed on this request ({type(err).__name__})."
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': 500}})}\n\n"
    finally:
        job["cancel"].set()  # a client gone mid-stream: the generation stops at its next token
        done.cancel()  # a slice still waiting for the model thread never starts
        ticket.release()
    yield "data: [DONE]\n\n"


def _chunk(job: dict, delta: dict | None, finish: str | None = None, usage: dict | None = None) -> str:
    payload = {"id": job["id"], "object": "chat.completion.chunk", "created": job["created"], "model": job["model"],
               "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        payload["usage"] = usage
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
