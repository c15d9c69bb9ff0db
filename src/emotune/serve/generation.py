"""A chat reply on the model thread, one bounded step at a time: its prompt in chunks, then its reply in slices.

`Generation.step` runs one step and returns: a chunk of the prompt's forward pass (the prefill,
`serve.prefill_slice_tokens` tokens) or a slice of the reply (`serve.chat_slice_tokens` tokens), the KV cache kept
between steps. The model thread (emotune.serve.modelthread) runs classify batches between two steps, so a classify
request waits for one step, never for a whole prompt (up to the model's context) or a whole reply; a step whose
client has gone, or whose server is stopping, computes nothing and ends the reply.

A prefill in chunks gives the one-pass result where the cache keeps every key a later prompt token attends to and
the masks are built from the cache's positions: caches of full-attention layers, sliding-window layers and layers
that read another layer's keys (Gemma 3n, Gemma 4), tested on every family of tests/families.py. Any other cache
(recurrent or linear-attention layers: Mamba fails when prefilled in pieces) is prefilled in one pass, with the
first slice.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteria
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from emotune.model.finite import FiniteLogits, NonFiniteOutput, not_finite_message
from emotune.model.turns import stop_token_ids
from emotune.serve.engine import Engine
from emotune.serve.http import APIError

log = logging.getLogger("emotune.serve")
EXACT_IN_CHUNKS = (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)
"""Cache layers a chunked prefill fills as one pass does (exact classes: a subclass may keep keys differently)."""


def chunked_prefill_cache(model) -> DynamicCache | None:
    """An empty cache to prefill `model`'s prompts into in chunks: the DynamicCache generate itself would build, or
    None where chunks would not give the one-pass result (a model with a cache of its own, or layers outside
    EXACT_IN_CHUNKS)."""
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is None or not supports_dynamic():
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    layers = getattr(cache, "layers", [])
    return cache if layers and all(type(layer) in EXACT_IN_CHUNKS for layer in layers) else None


class Generation:
    """One chat's reply: its prompt prefilled `prefill_tokens` tokens at a time (None: in one pass), then generated
    `slice_tokens` tokens at a time, the KV cache kept between steps. Greedy steps give the tokens one call would;
    a sampled reply keeps its own random stream across slices, so a seed gives the same reply whatever runs in
    between. `job["prompt_ids"]`, when given, are the prompt's tokens as counted when the request was checked."""

    def __init__(self, engine: Engine, job: dict, slice_tokens: int, prefill_tokens: int | None = None):
        self.engine, self.job, self.slice_tokens, self.prefill_tokens = engine, job, slice_tokens, prefill_tokens
        self.ids: torch.Tensor | None = None  # prompt and reply so far
        self.cache = None
        self.rng: list[torch.Tensor] | None = None
        self.prompt_length, self.prefilled, self.stops, self.finish = 0, 0, [], None
        self.text = ""  # the reply decoded so far

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.ids[0, self.prompt_length:] if self.ids is not None else torch.empty(0, dtype=torch.long)

    def step(self) -> bool:
        """The next chunk of the prompt or slice of the reply (on the model thread); True once the reply is
        finished, at once when its client has left or the server is stopping."""
        job = self.job
        if job["cancel"].is_set() or job["stopping"].is_set():
            self.finish = self.finish or "length"
            return True
        with self.engine.using(job["model"]) as loaded:
            tokenizer = loaded.tokenizer
            if self.ids is None:
                self._start(tokenizer)
            if self._prefill_left() > (self.prefill_tokens or 0):  # a chunk of the prompt is this step's work
                self._prefill_chunk()
                return False
            self._prefill_chunk()  # the rest of the prompt but its last token, which goes with the first slice
            self.prefilled = self.prompt_length
            budget = min(self.slice_tokens, job["max_tokens"] - len(self.new_tokens))
            before = len(self.new_tokens)
            with self._own_random_stream():
                try:
                    self._generate(tokenizer, budget)
                except NonFiniteOutput:  # NaN logits: greedy would reply with token 0, sampling fail in torch
                    message = not_finite_message(f"The model `{loaded.name}`", "the next token of this reply",
                                                 self.engine.dtype_of(loaded))
                    log.error("%s", message)
                    raise APIError(500, message, "server_error") from None
            self.text = tokenizer.decode(self.new_tokens, skip_special_tokens=True)
        made = len(self.new_tokens) - before
        text, stopped = cut_at_stop(self.text, job["stop"])
        ended_by_token = made > 0 and int(self.new_tokens[-1]) in self.stops
        if stopped or ended_by_token:
            self.finish = "stop"
        elif len(self.new_tokens) >= job["max_tokens"] or made < budget:  # the budget, or the client or server left
            self.finish = "length"
        return self.finish is not None

    def _start(self, tokenizer) -> None:
        ids = self.job.get("prompt_ids")
        if ids is None:
            ids = tokenizer(self.job["prompt"], add_special_tokens=False)["input_ids"]
        self.ids = torch.tensor([ids], dtype=torch.long, device=self.engine.device)
        self.prompt_length = self.ids.shape[1]
        self.stops = stop_token_ids(tokenizer, getattr(self.engine.model, "generation_config", None))
        if self.prefill_tokens is not None and self.prompt_length > 1:
            causal = self.engine.causal if self.engine.causal is not None else self.engine.model
            self.cache = chunked_prefill_cache(causal)

    def _prefill_left(self) -> int:
        """Prompt tokens still to prefill in chunks: all but the last, which generate reads with the first slice.
        Leaving it one token also keeps generate off a slow path: PyTorch's bf16 CPU linear, given the last row of a
        longer prompt as the output projection's input, took 4 s here against 0.08 s for a one-token input."""
        return self.prompt_length - 1 - self.prefilled if self.cache is not None and self.ids is not None else 0

    def _prefill_chunk(self) -> None:
        """Run the next prompt tokens (at most `prefill_tokens`, never the last) into the cache."""
        end = self.prefilled + min(self.prefill_tokens or 0, self._prefill_left())
        if end <= self.prefilled:
            return
        mask = torch.ones(1, end, dtype=torch.long, device=self.ids.device)
        no_logits = torch.empty(0, dtype=torch.long, device=self.ids.device)  # a chunk's logits are never read
        with torch.no_grad():
            self.engine.model(input_ids=self.ids[:, self.prefilled:end], attention_mask=mask, cache=self.cache,
                              use_cache=True, logits_to_keep=no_logits)
        self.prefilled = end

    def _generate(self, tokenizer, budget: int) -> None:
        job, sampling = self.job, self.job["temperature"] > 0
        criteria = [Cancelled(job["cancel"], job["stopping"])]
        if job["stop"]:
            criteria.append(StopAtText(tokenizer, job["stop"], self.prompt_length))
        # cache_implementation=None: this reply keeps one growing cache across its slices, which a static cache
        # (sized by a generation config for one call) cannot be, and generate refuses a cache beside one
        output = self.engine.model.generate(
            input_ids=self.ids, attention_mask=torch.ones_like(self.ids), cache=self.cache, cache_implementation=None,
            max_new_tokens=budget, do_sample=sampling, temperature=job["temperature"] if sampling else None,
            top_p=job["top_p"] if sampling else None, top_k=None, eos_token_id=self.stops,
            pad_token_id=tokenizer.pad_token_id, stopping_criteria=criteria, return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([FiniteLogits()]))
        self.ids, self.cache = output.sequences, output.cache

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

    def __init__(self, *events):
        self.events = events

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        stop = any(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)
