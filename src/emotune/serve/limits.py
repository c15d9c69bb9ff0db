"""What a request may ask for, checked before any work starts, and the one admission gate all model work passes.

Scoring grows with the label count times the labels' length, generation with the prompt and the tokens asked
for: a request over a limit is answered 422 (429 beyond serve.max_chats, 503 when the queue is full) at once, so
one client cannot hold the model thread other clients wait for. Classification and chat share one queue bound (serve.max_queue);
chats are further bounded by serve.max_chats, since each holds the model thread for a whole generation.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from emotune.core.config.eval import ServeConfig
from emotune.serve.http import APIError
from emotune.serve.metrics import Metrics

MIN_TEMPERATURE = 1e-2
"""Below it a reply is greedy (what sampling tends to as the temperature falls): dividing logits by 1e-300 gives
infinities, and sampling from them fails."""


class Admission:
    """The bound on waiting work: texts queued for classification plus chats waiting or generating."""

    def __init__(self, cfg: ServeConfig, metrics: Metrics):
        self.cfg, self.metrics = cfg, metrics
        self.pending = 0  # texts and chats admitted and not finished
        self.chats = 0

    def take(self, texts: int = 0, chats: int = 0) -> Ticket:
        """A place for `texts` texts and `chats` chats, or 503 at once; give it back with `Ticket.release`."""
        if self.pending + texts + chats > self.cfg.max_queue:
            self.metrics.inc("emotune_rejected_total", {"reason": "queue_full"})
            raise APIError(503, f"The server's queue is full ({self.pending} texts and chats waiting, serve.max_queue="
                                f"{self.cfg.max_queue}). Retry shortly.", "server_overloaded")
        if chats and self.chats + chats > self.cfg.max_chats:  # chats are limited, not the server full: 429
            self.metrics.inc("emotune_rejected_total", {"reason": "chats_full"})
            raise APIError(429, f"{self.chats} chat completions are already waiting or generating (serve.max_chats="
                                f"{self.cfg.max_chats}). Retry shortly; classification is still served.",
                           "rate_limit_exceeded")
        self.pending += texts + chats
        self.chats += chats
        return Ticket(self, texts, chats)

    @asynccontextmanager
    async def admit(self, texts: int = 0, chats: int = 0):
        ticket = self.take(texts, chats)
        try:
            yield ticket
        finally:
            ticket.release()


class Ticket:
    """A place `Admission.take` gave; `release` may be called more than once (a stream's end and its response's
    background task both call it, since either may be the one that runs)."""

    def __init__(self, admission: Admission, texts: int, chats: int):
        self.admission, self.texts, self.chats, self.held = admission, texts, chats, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.pending -= self.texts + self.chats
            self.admission.chats -= self.chats


def check_labels(labels: list[str], tokenizer, cfg: ServeConfig) -> None:
    if len(labels) > cfg.max_labels:
        raise APIError(422, f"`labels` holds {len(labels)} labels; the limit is serve.max_labels={cfg.max_labels}. "
                            "Classify into fewer labels per request.")
    if sum(len(label) for label in labels) > cfg.max_label_tokens * 64:  # no tokenizer makes tokens that long
        raise APIError(422, f"`labels` hold more text than serve.max_label_tokens={cfg.max_label_tokens} tokens can.")
    encoded = tokenizer(labels, add_special_tokens=False)["input_ids"]
    tokens = sum(len(ids) for ids in encoded)
    if tokens > cfg.max_label_tokens:
        raise APIError(422, f"`labels` hold {tokens} tokens together; the limit is serve.max_label_tokens="
                            f"{cfg.max_label_tokens}. Use fewer or shorter label names.")
    groups: dict[tuple[int, ...], list[str]] = {}
    for label, ids in zip(labels, encoded, strict=True):
        groups.setdefault(tuple(ids), []).append(label)
    same = [names for names in groups.values() if len(names) > 1]
    if same:  # as training refuses them (tasks.classify.task.check_labels_tell_apart)
        raise APIError(422, f"`labels` {'; '.join(map(repr, same))} are the same tokens to this model's tokenizer "
                            "(characters it does not know read as its unknown token; or they differ only in spacing or "
                            "Unicode form), so their scores would tie and the first would always win. Rename or drop them.")


def check_context(prompt_tokens: int, max_tokens: int, context: int | None) -> None:
    """The prompt and the reply asked for must fit the model's context window."""
    if context is not None and prompt_tokens + max_tokens > context:
        raise APIError(422, f"The prompt holds {prompt_tokens} tokens and max_tokens={max_tokens}; together they "
                            f"exceed the model's context of {context} tokens. Send fewer or shorter messages, or "
                            "ask for fewer tokens.")


def sampling(temperature: float | None, top_p: float | None) -> tuple[float, float | None]:
    """(temperature, top_p) as generation takes them: 0 (greedy) below MIN_TEMPERATURE."""
    temperature = temperature or 0.0
    if temperature < MIN_TEMPERATURE:
        return 0.0, None
    return temperature, top_p
