"""sft training rows: a conversation rendered by the model's chat template, the loss on its assistant turns.

The token ids are the template's rendering of the whole conversation, with one exception: where the rendering of
the conversation up to its last answer, with the generation prompt, is not where the finished rendering's last
answer starts (Gemma 4's generation prompt opens and closes an empty thought channel, Mistral v0.3's puts the system
prompt into the last user turn), the row is that generation prompt followed by the last answer as the finished
rendering writes it: the context the model answers in when it generates, evaluated, served or run by vLLM.
The loss spans come from the template too: turn k's answer starts where the rendering of the turns before it, with
the generation prompt, stops agreeing with the rendering of the turns up to it (TRL's prompt-completion rule), and
runs to the end of that rendering, so it includes the end-of-turn token. That needs each shorter rendering to be a
prefix of the row. Some templates rewrite earlier turns (those that drop past reasoning from the history, for one):
for a turn whose rendering is not a prefix, the span is found in the row itself, by comparing it with the row where
that turn's text is empty (the tokens that differ are the text), then extended through the next end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from emotune.data.conversations import Conversation
from emotune.model.turns import chat_ids, stop_token_ids
from emotune.train.batches import Example, common_prefix_length, truncated


@dataclass
class Encoded:
    examples: list[Example]
    truncated: int = 0
    """Rows cut at max_length."""
    lost: int = 0
    """Rows cut so far that no answer token was left to learn from."""


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The template's rendering as token ids; a special token's text inside a message is plain text (`chat_ids`)."""
    return chat_ids(tokenizer, messages, generation_prompt)


class _Prefixes:
    """The renderings of one conversation's first n messages, each made once: a row and its loss spans ask for the
    same ones (the whole conversation; the turns before its last answer with the generation prompt)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, messages: list[dict]):
        self.tokenizer, self.messages, self.done = tokenizer, messages, {}

    def __call__(self, n: int, generation_prompt: bool = False) -> list[int]:
        key = (n, generation_prompt)
        if key not in self.done:
            self.done[key] = render(self.tokenizer, self.messages[:n], generation_prompt)
        return self.done[key]


def row_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
            prefixes: _Prefixes | None = None) -> tuple[list[int], int | None]:
    """(the row's token ids, where its last answer starts when the row is the generation prompt followed by that
    answer, else None: the finished rendering is the row; see the module docstring)."""
    prefixes = prefixes or _Prefixes(tokenizer, messages)
    full = prefixes(len(messages))
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str) or set(last) - {"role", "content"}:
        return full, None  # tool calls, reasoning fields or content parts: the template's own rendering decides
    asked = prefixes(len(messages) - 1, generation_prompt=True)
    if full[:len(asked)] == asked:
        return full, None
    start = common_prefix_length(full, render(tokenizer, [*messages[:-1], {**last, "content": ""}]))
    if start >= len(full):
        return full, None
    return asked + full[start:], len(asked)


def loss_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """(the row's token ids, [start, end) of every assistant turn, end-of-turn token included)."""
    prefixes = _Prefixes(tokenizer, messages)
    full, last_start = row_ids(tokenizer, messages, prefixes)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if last_start is not None and k == len(messages) - 1:
            spans.append((last_start, len(full)))
            continue
        upto = prefixes(k + 1)
        if full[:len(upto)] == upto:
            asked = prefixes(k, generation_prompt=True)
            start = common_prefix_length(asked, upto)
            if start < len(asked):  # the template renders the turns before differently once answered (Mistral v0.3's
                blank = render(tokenizer, [*messages[:k], {**message, "content": ""}])  # system prompt): where the
                start = max(start, common_prefix_length(upto, blank))  # answer's own text starts
            spans.append((start, len(upto)))
        else:
            spans.append(_span_by_difference(tokenizer, messages, k, full))
    return full, spans


def _span_by_difference(tokenizer: PreTrainedTokenizerBase, messages: list[dict], k: int, full: list[int]) -> tuple[int, int]:
    blank, _ = row_ids(tokenizer, [*messages[:k], {**messages[k], "content": ""}, *messages[k + 1:]])
    start = common_prefix_length(full, blank)
    suffix = common_prefix_length(full[::-1], blank[::-1])
    end = max(start, len(full) - suffix)
    stops = set(stop_token_ids(tokenizer))
    while end < len(full) and full[end] not in stops:  # the turn's closing tokens, through its end-of-turn token
        end += 1
    return start, min(end + 1, len(full))


def encode(conversation: Conversation, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
           mask_history: bool) -> Example:
    """One conversation as token ids with its loss spans (only the last answer's with `mask_history`; never those of
    the answers the data marks untrained, OpenAI's `"weight": 0`)."""
    ids, spans = loss_spans(tokenizer, conversation.chat(system_prompt))
    spans = [span for k, span in enumerate(spans) if k not in conversation.untrained]
    if mask_history:
        spans = spans[-1:]
    return Example(ids, spans[0][0], spans=tuple(spans))


def encode_all(conversations: list[Conversation], tokenizer: PreTrainedTokenizerBase, system_prompt: str | None,
               mask_history: bool, max_length: int) -> Encoded:
    """Every conversation encoded and cut at `max_length`, counting the rows cut and those left without loss."""
    out = Encoded([])
    for conversation in conversations:
        example = encode(conversation, tokenizer, system_prompt, mask_history)
        if len(example.input_ids) > max_length:
            out.truncated += 1
            example = truncate(example, max_length)
            out.lost += example.completion_tokens == 0
        out.examples.append(example)
    return out


truncate = truncated  # the one cut of a row at max_length, shared with training's out-of-memory recovery
