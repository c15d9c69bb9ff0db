"""Chat completions: a request checked and rendered with the chat template, then generated on the model thread.

An sft adapter's own system prompt leads the conversation when the request sends none. `stop` texts end
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
from contextlib import contextmanager

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
    return render_conversation([m.model_dump(include={"role", "content"}) for m in body.messages], loaded)


def render_conversation(messages: list[dict], loaded: Loaded) -> str:
    """The prompt for `messages` ({"role", "content"} each) through the model's chat template, the sft adapter's own
    system prompt first when the conversation has none; APIError 422 when the template rejects the messages."""
    messages = list(messages)
    system = loaded.artifact.sft_system_prompt if loaded.artifact is not None else None
    if system and not any(m["role"] == "system" for m in messages):  # answer under the prompt it was trained with
        messages.insert(0, {"role": "system", "content": system})
    try:
        return loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja raise_exception: e.g. roles that do not alternate
        raise APIError(422, f"The chat template rejected the messages: {err}") from None


class Generation:
    """One chat's reply, generated `serve.chat_slice_tokens` tokens at a time on the model thread, the KV cache kept
    between slices: classify work waiting for the model thread runs between two slices instead of after the whole
    reply (emotune.serve.modelthread). Greedy slices give the tokens one call would; a sampled reply keeps its
    own random stream across slices, so a seed gives the same reply whatever runs in between."""

    def __init__(self, engine: Engine, job: dict, slice_tokens: int):
        self.engine, self.job, self.slice_tokens = engine, job, slice_tokens
        self.ids: torch.Tensor | None = None  # prompt and reply so far
        self.cache = None
        self.rng: list[torch.Tensor] | None = None
        self.prompt_length, self.stops, self.finish = 0, [], None
        self.text = ""  # the reply decoded so far

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.ids[0, self.prompt_length:] if self.ids is not None else torch.empty(0, dtype=torch.long)

    def step(self) -> bool:
        """Generate the next slice (on the model thread); True once the reply is finished."""
        job = self.job
        with self.engine.using(job["model"]) as loaded:
            tokenizer = loaded.tokenizer
            if self.ids is None:
                self.ids = tokenizer(job["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.engine.device)
                self.prompt_length = self.ids.shape[1]
                self.stops = stop_token_ids(tokenizer, getattr(self.engine.model, "generation_config", None))
            budget = min(self.slice_tokens, job["max_tokens"] - len(self.new_tokens))
            before = len(self.new_tokens)
            with self._own_random_stream():
                self._generate(tokenizer, budget)
            self.text = tokenizer.decode(self.new_tokens, skip_special_tokens=True)
        made = len(self.new_tokens) - before
        text, stopped = cut_at_stop(self.text, job["stop"])
        ended_by_token = made > 0 and int(self.new_tokens[-1]) in self.stops
        if stopped or ended_by_token:
            self.finish = "stop"
        elif len(self.new_tokens) >= job["max_tokens"] or made < budget:  # the budget, or the client or server left
            self.finish = "length"
        return self.finish is not None

    def _generate(self, tokenizer, budget: int) -> None:
        job, sampling = self.job, self.job["temperature"] > 0
        criteria = [Cancelled(job["cancel"], job["stopping"])]
        if job["stop"]:
            criteria.append(StopAtText(tokenizer, job["stop"], self.prompt_length))
        output = self.engine.model.generate(
            input_ids=self.ids, attention_mask=torch.ones_like(self.ids), past_key_values=self.cache,
            max_new_tokens=budget, do_sample=sampling, temperature=job["temperature"] if sampling else None,
            top_p=job["top_p"] if sampling else None, top_k=None, eos_token_id=self.stops,
            pad_token_id=tokenizer.pad_token_id, stopping_criteria=criteria, return_dict_in_generate=True)
        self.ids, self.cache = output.sequences, output.past_key_values

    @contextmanager
    def _own_random_stream(self):
        """The reply's random stream: seeded once (`seed`), then carried from slice to slice; the global one untouched."""
        devices = [self.engine.device] if self.engine.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.rng is not None:
                torch.set_rng_state(self.rng[0])
                if devices:
                    torch.cuda.set_rng_state(self.rng[1], self.engine.device)
            elif self.job["seed"] is not None:
                torch.manual_seed(self.job["seed"])
            yield
            self.rng = [torch.get_rng_state(), *([torch.cuda.get_rng_state(self.engine.device)] if devices else [])]

    def reply(self) -> tuple[str, str, dict]:
        text, _ = cut_at_stop(self.text, self.job["stop"])
        made = len(self.new_tokens)
        usage = {"prompt_tokens": self.prompt_length, "completion_tokens": made, "total_tokens": self.prompt_length + made}
        return text.strip(), self.finish or "length", usage


async def generate_reply(generation: Generation, executor, on_slice=None) -> tuple[str, str, dict]:
    """Run `generation` slice by slice on the model thread's chat lane; `on_slice(text)` sees the reply so far."""
    loop = asyncio.get_running_loop()
    while True:
        done = await loop.run_in_executor(executor, generation.step)
        if on_slice is not None:
            await on_slice(generation.text)
        if done:
            return generation.reply()


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
    """The reply as SSE chunks, a slice at a time. A failure after the first chunk (the 200 is sent by then) ends the
    stream with an error event, and the request counts as failed in /metrics. A client that goes away ends the
    generation."""
    generation = Generation(engine, job, state.cfg.chat_slice_tokens)
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
        done.cancel()  # a slice still waiting for the model thread never starts
        ticket.release()
    yield "data: [DONE]\n\n"


def _chunk(job: dict, delta: dict, finish: str | None = None) -> str:
    payload = {"id": job["id"], "object": "chat.completion.chunk", "created": job["created"], "model": job["model"],
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
