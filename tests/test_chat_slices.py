"""Issue 34: a chat reply is generated a slice of tokens at a time on the model thread, so classification waiting
for the model runs between slices; the reply is the one a single call gives, and a seed still fixes a sampled one."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from emotune.serve.generation import Generation, chunked_prefill_cache
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

    def slow_generate(logits_processor=(), **kwargs):  # after the server's own processors
        return generate(**kwargs, logits_processor=LogitsProcessorList([*logits_processor, Slow()]),
                        min_new_tokens=kwargs["max_new_tokens"])

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
    # answered in less than half of the time the reply still took (relative, so a loaded machine does not fail it)
    assert finished["classify"] - started < (finished["chat"] - started) / 2, finished


# --------------------------------------------------------------------------------------------------
# The prompt's prefill in chunks (serve.prefill_slice_tokens)

PROMPT_WORDS = ["happy", "furious", "scared", "lonely", "wow", "adore", "great", "rage", "dread", "tender"]
CHUNKED_FAMILIES = ["gemma3-1b", "llama3", "gemma4-text", "qwen3"]  # sliding windows of 8, full, KV-shared layers


@pytest.fixture(scope="module", params=CHUNKED_FAMILIES)
def family_engine(request, tmp_path_factory):
    """The engine `emotune serve` builds, over family `param`'s tiny model saved as a Hugging Face folder, in fp32:
    the reply is the same to within float rounding, and in bf16 a chunk's other matrix shapes round the logits
    differently by up to a bf16 step (0.125 near 25), which a near-tie between two tokens turns into another reply."""
    from conftest import build_tokenizer
    from emotune.core.config.model import ModelConfig
    from emotune.serve.engine import Engine
    from families import build

    folder = tmp_path_factory.mktemp(request.param)
    build_tokenizer(folder)
    build(request.param, folder).save_pretrained(folder)
    return Engine(ModelConfig(source=str(folder), dtype="float32"), "cpu")


def _job(engine, words: int = 60, max_tokens: int = 12, temperature: float = 0.0, seed: int | None = None) -> dict:
    text = " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(words))
    prompt = engine.models["base"].tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                                  add_generation_prompt=True)
    return {"id": "test", "created": 0, "model": "base", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": 0.95 if temperature else None, "seed": seed, "stop": [],
            "cancel": threading.Event(), "stopping": threading.Event()}


def _run(engine, job: dict, prefill_tokens: int | None, slice_tokens: int = 4) -> tuple[tuple, list[int]]:
    """The reply, and how many prompt tokens the cache held after each step that made no reply token."""
    generation, prefills = Generation(engine, job, slice_tokens, prefill_tokens), []
    while not generation.step():
        if len(generation.new_tokens) == 0:
            prefills.append(generation.prefilled)
    return (generation.reply(), generation.new_tokens.tolist()), prefills


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_the_reply_is_the_same_whatever_the_prefill_chunk(family_engine, sampling):
    job = _job(family_engine, **sampling)
    length = len(family_engine.models["base"].tokenizer(job["prompt"], add_special_tokens=False)["input_ids"])
    assert length > 60  # well past the sliding windows of 8
    whole, prefills = _run(family_engine, job, None)
    assert prefills == [] and len(whole[1]) > 4, whole  # one pass, then several slices
    for chunk in (1, 7, 32, length + 10):
        chunked, prefills = _run(family_engine, _job(family_engine, **sampling), chunk)
        assert chunked == whole, (chunk, chunked, whole)
        expected = list(range(chunk, length - 1, chunk))  # until at most one chunk is left besides the last token
        assert prefills == expected, (chunk, prefills)  # the prompt went in chunks, the last one with the first slice


def test_the_output_projection_never_reads_a_row_cut_from_a_longer_input(family_engine):
    """PyTorch's bf16 CPU linear takes a slow path (4 s against 0.08 s on Gemma 3's 262k vocabulary) for the last row
    of a longer input, which generate's own prefill hands the output projection; chunks compute no logits, and the
    last prompt token reaches generate alone."""
    seen = []
    hook = family_engine.causal.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append((tuple(args[0].shape), args[0].stride())))
    try:
        _run(family_engine, _job(family_engine), 16)
    finally:
        hook.remove()
    read = [(shape, stride) for shape, stride in seen if shape[1] > 0]
    assert read and all(shape[1] == 1 and stride[0] == shape[2] for shape, stride in read), seen


def test_a_generation_config_asking_for_a_static_cache_still_gives_the_reply_in_slices(family_engine):
    """A generation config may set `cache_implementation` (Gemma 3's say `hybrid`, which transformers 5 builds as a
    dynamic cache); a `static` one is sized for one generate call, and generate refuses a cache passed beside it, so
    every slice after the first failed (a 500)."""
    whole, _ = _run(family_engine, _job(family_engine), None, slice_tokens=100)
    config = family_engine.model.generation_config
    config.cache_implementation = "static"
    try:
        sliced, _ = _run(family_engine, _job(family_engine), 16, slice_tokens=4)
    finally:
        config.cache_implementation = None
    assert sliced == whole


def test_models_whose_cache_is_not_exact_in_chunks_are_prefilled_in_one_pass(tmp_path):
    """Mamba keeps a recurrent state instead of keys and values; fed its prompt in pieces it fails, so the chunked
    prefill is only used for caches of attention layers (tested above) and a Mamba model is prefilled whole."""
    from transformers import DynamicCache, MambaConfig, MambaForCausalLM

    from families import build

    # state-spaces/mamba-130m-hf config.json: hidden 768, 24 layers, state 16, expand 2, conv kernel 4.
    # Scaled: hidden 32, 2 layers, state 8.
    torch.manual_seed(0)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2)).eval()
    assert chunked_prefill_cache(mamba) is None
    ids = torch.randint(4, 60, (1, 20))
    cache = DynamicCache(config=mamba.config)
    with pytest.raises(RuntimeError), torch.no_grad():  # why: in pieces of 7, the convolution's state breaks
        for start in range(0, 20, 7):
            mamba(input_ids=ids[:, start:start + 7], attention_mask=torch.ones(1, min(start + 7, 20), dtype=torch.long),
                  cache=cache, use_cache=True)
    from conftest import build_tokenizer

    for name in CHUNKED_FAMILIES:
        assert chunked_prefill_cache(build(name, _tokenizer_dir(tmp_path, build_tokenizer))) is not None, name


def _tokenizer_dir(tmp_path, build_tokenizer):
    folder = tmp_path / "tokenizer"
    if not folder.exists():
        build_tokenizer(folder)
    return folder


def _slow_prefill(engine, seconds_per_token: float, seen: list):
    """Every forward pass of the language model takes `seconds_per_token` per input token; `seen` gets (tokens, end
    time) of each pass over more than one token of a sequence past 300 tokens (the long prompt's prefill)."""
    inner = engine.causal.get_decoder()

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids")
        tokens = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        time.sleep(seconds_per_token * tokens)

    def after(module, args, kwargs, output):
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids")
        tokens = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        if tokens > 1 and mask is not None and not isinstance(mask, dict) and mask.shape[-1] > 300:
            seen.append((tokens, time.perf_counter()))

    return [inner.register_forward_pre_hook(before, with_kwargs=True),
            inner.register_forward_hook(after, with_kwargs=True)]


LONG_MESSAGES = [{"role": "user", "content": " ".join(PROMPT_WORDS[i % 10] for i in range(400))}]  # 400+ tokens


def test_classification_is_answered_while_a_long_prompt_is_prefilled(tiny_model_dir, adapters_root):  # noqa: F811
    engine, app = start(tiny_model_dir, adapters_root, prefill_slice_tokens=32, max_input_chars=5000)
    prefill, times = [], {}
    hooks = _slow_prefill(engine, 0.005, prefill)  # the prompt's prefill takes 2 s, a short text 0.1 s
    try:
        with running(app) as (url, _):
            def long_chat():
                reply = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,
                                   json={"model": "tiny", "messages": LONG_MESSAGES, "max_tokens": 2})
                times["chat"] = (reply.status_code, time.perf_counter())

            chat = threading.Thread(target=long_chat)
            chat.start()
            time.sleep(0.5)  # the prompt is being prefilled
            classified = httpx.post(url + "/v1/classify", headers=AUTH, timeout=60, json={"model": "tiny", "input": "happy"})
            times["classify"] = time.perf_counter()
            chat.join(timeout=60)
    finally:
        for hook in hooks:
            hook.remove()
    assert classified.status_code == 200 and times["chat"][0] == 200, (classified.text, times)
    prefilled = max(end for _, end in prefill)
    assert times["classify"] < prefilled - 0.5, (times, prefill)  # answered between two chunks, not after the prompt
    assert all(tokens <= 32 for tokens, _ in prefill), prefill


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_whose_client_leaves_during_the_prefill_stops_at_the_next_chunk(tiny_model_dir, adapters_root, stream):  # noqa: F811
    engine, app = start(tiny_model_dir, adapters_root, prefill_slice_tokens=32, max_input_chars=5000)
    prefill = []
    hooks = _slow_prefill(engine, 0.005, prefill)
    generate, generated = engine.model.generate, []
    engine.model.generate = lambda **kwargs: generated.append(1) or generate(**kwargs)
    try:
        with running(app) as (url, _), httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.5)) as client:
            body = {"model": "tiny", "messages": LONG_MESSAGES, "max_tokens": 8, "stream": stream}
            if stream:  # its first event (the role) comes at once; the client leaves after it
                with client.stream("POST", "/v1/chat/completions", headers=AUTH, json=body) as response:
                    next(response.iter_bytes())
                    time.sleep(0.3)  # the prefill has started
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/chat/completions", headers=AUTH, json=body)
            time.sleep(1.5)  # what was not stopped runs on meanwhile
    finally:
        for hook in hooks:
            hook.remove()
        del engine.model.generate
    assert sum(tokens for tokens, _ in prefill) < 300 and not generated, (prefill, generated)
