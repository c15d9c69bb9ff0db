"""Issue 34: a chat reply is generated a slice of tokens at a time on the model thread, so classification waiting
for the model runs between slices; the reply is the one a single call gives, and a seed still fixes a sampled one."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_harness import running
from test_serve import AUTH
from test_serve_hardening import adapters_root, start  # noqa: F401 (a fixture, used by name)

MESSAGES = [{"role": "user", "content": "tell me something happy"}]


def _chat(url: str, **body) -> dict:
    reply = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 12, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed(url: str, **body) -> str:
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=120,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "stream": True, **body}) as reply:
        text = "".join(line for line in reply.iter_lines())
    pieces = [json.loads(event)["choices"][0]["delta"].get("content", "") for event in text.split("data: ")[1:]
              if event.strip() and event.strip() != "[DONE]"]
    return "".join(pieces)


@pytest.mark.parametrize("seed", [None, 7])
def test_the_reply_is_the_same_whatever_the_slice(tiny_model_dir, adapters_root, seed):  # noqa: F811
    replies = {}
    for slice_tokens in (1, 5, 64):
        _, app = start(tiny_model_dir, adapters_root, chat_slice_tokens=slice_tokens)
        with running(app) as (url, _):
            sampling = {"temperature": 0.9, "seed": seed} if seed is not None else {}
            plain = _chat(url, **sampling)
            replies[slice_tokens] = (plain["choices"][0]["message"]["content"], plain["usage"]["completion_tokens"])
            assert _streamed(url, **sampling).strip() == replies[slice_tokens][0]
    assert replies[1] == replies[5] == replies[64] and replies[1][1] > 1, replies


def test_classification_runs_between_the_slices_of_a_long_reply(tiny_model_dir, adapters_root):  # noqa: F811
    from transformers import LogitsProcessor, LogitsProcessorList

    engine, app = start(tiny_model_dir, adapters_root, chat_slice_tokens=2, max_new_tokens=64)
    generate, finished = engine.model.generate, {}

    class Slow(LogitsProcessor):  # 50 ms a token: the reply takes 3 s
        def __call__(self, input_ids, scores):
            time.sleep(0.05)
            return scores

    def slow_generate(**kwargs):
        return generate(**kwargs, logits_processor=LogitsProcessorList([Slow()]), min_new_tokens=kwargs["max_new_tokens"])

    engine.model.generate = slow_generate
    try:
        with running(app) as (url, _):
            def long_chat():
                _chat(url, max_tokens=60)
                finished["chat"] = time.perf_counter()

            chat = threading.Thread(target=long_chat)
            chat.start()
            time.sleep(0.5)  # the reply is generating
            started = time.perf_counter()
            classified = httpx.post(url + "/v1/classify", headers=AUTH, timeout=60, json={"model": "tiny", "input": "happy"})
            finished["classify"] = time.perf_counter()
            chat.join(timeout=60)
    finally:
        del engine.model.generate
    assert classified.status_code == 200, classified.text
    assert finished["classify"] < finished["chat"] - 1.0, finished  # not after the whole reply
    assert finished["classify"] - started < 1.5
