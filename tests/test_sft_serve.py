"""An sft adapter through `emotune export`, `emotune predict` and `emotune serve` on the tiny model: free-text
replies under the adapter's own system prompt, chat completions through the `openai` client (streaming, `stop`),
and /v1/classify refused for it."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import httpx
import openai
import pytest
import torch

from conftest import LABELS, trained_conversation, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.serve import build_engine, create_app
from emotune.serve.chat import StopFilter
from server_harness import running

SYSTEM = "reply with one word"
TEXTS = ["i am so happy today", "my friend was furious"]
TRAINED_MAX_NEW_TOKENS = 5  # the adapter's eval.max_new_tokens: predict's default length
USER, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {USER}"}


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory):
    """Seed 2 gives replies of several different words on the tiny model, so a stop word can cut them."""
    return write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp("sft-runs") / "chat", seed=2, task="sft",
                              overrides=(f"prompt.system_prompt={SYSTEM}",
                                         f"eval.max_new_tokens={TRAINED_MAX_NEW_TOKENS}"))


def reference_replies(model_dir, adapter_dir, texts, max_new_tokens, system=SYSTEM) -> list[str]:
    """Greedy replies computed here with PEFT and transformers alone: the system prompt, then the text as the user."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir).eval()
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    replies = []
    for text in texts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                                 pad_token_id=tokenizer.pad_token_id)
        replies.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return replies


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# --------------------------------------------------------------------------------------------------
# predict and export


def test_predict_answers_in_free_text_under_the_system_prompt(sft_run, tiny_model_dir, tmp_path, capsys):
    assert main(["predict", str(sft_run), *TEXTS]) == 0  # default length: the one the run evaluated with
    lines = _json_lines(capsys.readouterr().out)
    expected = reference_replies(tiny_model_dir, sft_run / "adapter", TEXTS, TRAINED_MAX_NEW_TOKENS)
    assert [line["text"] for line in lines] == TEXTS and [line["output"] for line in lines] == expected
    assert all(expected) and set(lines[0]) == {"text", "output"}

    assert main(["predict", str(sft_run), *TEXTS, "--max-new-tokens", "8"]) == 0
    longer = [line["output"] for line in _json_lines(capsys.readouterr().out)]
    assert longer == reference_replies(tiny_model_dir, sft_run / "adapter", TEXTS, 8)
    assert any(len(a.split()) > len(b.split()) for a, b in zip(longer, expected, strict=False))

    source, out = tmp_path / "in.csv", tmp_path / "out.csv"
    source.write_text("id,prompt\n" + "".join(f"{i},{t}\n" for i, t in enumerate(TEXTS)), encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "prompt",
                 "--max-new-tokens", "8", "--batch-size", "2"]) == 0  # batched with left padding: same replies
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert [r["id"] for r in rows] == ["0", "1"] and [r["output"] for r in rows] == longer


def test_predict_refuses_prompts_whose_reply_would_run_past_the_context(sft_run, tmp_path, capsys):
    """A prompt that with --max-new-tokens runs past the model's context (the tiny model's 512 positions; the
    word-level tokenizer reads each comma as a token) was generated from positions the model never had."""
    assert main(["predict", str(sft_run), "hi", "," * 400, "--max-new-tokens", "200"]) == 2
    err = capsys.readouterr().err
    assert "text 2 with a reply of up to 200 tokens come to more tokens" in err and "context of 512" in err
    source, out = tmp_path / "in.csv", tmp_path / "out.csv"
    source.write_text('prompt\nhi\n"' + "," * 400 + '"\n', encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "prompt",
                 "--max-new-tokens", "200"]) == 2
    assert "in.csv: row 2 with a reply" in capsys.readouterr().err and not out.exists()
    assert main(["predict", str(sft_run), "," * 400, "--max-new-tokens", "2"]) == 0  # room for a short reply


def test_predict_answers_a_file_of_conversations(sft_run, tiny_model_dir, tmp_path, capsys):
    """A JSONL file of the run's own rows (`messages` of turns): each cell's Python text (`[{'role': ...}]`) was
    sent as one user turn. Now the conversation is the prompt, its reference answer left out, its own system turn
    in place of the run's."""
    source, out = tmp_path / "conv.jsonl", tmp_path / "out.csv"
    rows = [{"id": 0, "messages": [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": "glad"}]},
            {"id": 1, "messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": TEXTS[1]}]}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "messages"]) == 0
    replies = [r["output"] for r in csv.DictReader(out.open(encoding="utf-8"))]
    adapter = sft_run / "adapter"
    assert replies == [reference_replies(tiny_model_dir, adapter, TEXTS[:1], TRAINED_MAX_NEW_TOKENS)[0],
                       reference_replies(tiny_model_dir, adapter, TEXTS[1:], TRAINED_MAX_NEW_TOKENS, "be kind")[0]]
    # tool turns as the run's data reads them: OpenAI's tool_calls and tool role, ShareGPT's function_call/observation
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    tool_rows = [{"messages": [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": None, "tool_calls": call},
                               {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ref"}]},
                 {"messages": [{"from": "human", "value": TEXTS[0]}, {"from": "function_call", "value": json.dumps(call)},
                               {"from": "observation", "value": "sunny"}]},
                 {"messages": [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": json.dumps(call)},
                               {"role": "user", "content": "sunny"}]}]
    source.write_text("".join(json.dumps(r) + "\n" for r in tool_rows), encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "messages",
                 "--max-new-tokens", "8"]) == 0
    replies = [r["output"] for r in csv.DictReader(out.open(encoding="utf-8"))]
    assert replies[0] == replies[1] == replies[2] and replies[0]
    source.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n", encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "messages"]) == 2
    assert "Row 1 of column `messages` has no user turn" in capsys.readouterr().err


def test_predict_refuses_max_new_tokens_for_a_classifier(tiny_run_dir, sft_run, capsys):
    assert main(["predict", str(tiny_run_dir), "happy", "--max-new-tokens", "4"]) == 2
    assert "--max-new-tokens is for sft models" in capsys.readouterr().err
    assert main(["predict", str(sft_run), "happy", "--max-new-tokens", "0"]) == 2
    assert "positive" in capsys.readouterr().err


def test_export_merges_an_sft_adapter_and_writes_a_free_text_client(sft_run, tmp_path, capsys):
    from emotune.deploy.export import merge_parity_gap

    out = tmp_path / "export"
    assert main(["export", str(sft_run), "--merge", "--vllm", "--dtype", "float32", "--out", str(out)]) == 0
    for name in ("adapter/adapter_model.safetensors", "adapter/emotune.json", "merged/model.safetensors",
                 "merged/emotune.json", "vllm/serve_lora.sh", "vllm/serve_merged.sh", "vllm/client.py"):
        assert (out / name).is_file(), name
    assert json.loads((out / "merged" / "emotune.json").read_text())["task"] == "sft"
    # the parity prompts are the sft chat prompts (system prompt + text), which the adapter really moves
    assert merge_parity_gap(sft_run, TEXTS, merged_dir=out / "merged") < 1e-4

    capsys.readouterr()
    assert main(["predict", str(sft_run), *TEXTS]) == 0
    from_adapter = _json_lines(capsys.readouterr().out)
    assert main(["predict", str(out / "merged"), *TEXTS]) == 0
    assert _json_lines(capsys.readouterr().out) == from_adapter

    client = (out / "vllm" / "client.py").read_text()
    compile(client, "client.py", "exec")
    assert f"SYSTEM_PROMPT = {SYSTEM!r}" in client and "MODEL = 'chat'" in client
    assert "structured_outputs" not in client and "guided_choice" not in client and "LABELS" not in client


def test_a_foreign_adapter_served_with_an_sft_config_is_an_sft_model(tiny_model_dir, tmp_path):
    """An adapter from another tool (no emotune.json) takes the sft config's system prompt and base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from emotune.model.artifacts import fallback_from, find_artifact

    folder = tmp_path / "lf-sft"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).save_pretrained(folder)
    cfg = load_config(None, ["task=sft", f"model.source={tiny_model_dir}", f"prompt.system_prompt={SYSTEM}"])
    artifact = find_artifact(folder, fallback=fallback_from(cfg))
    assert artifact.task == "sft" and artifact.foreign and artifact.sft_system_prompt == SYSTEM
    assert artifact.model_cfg.source == str(tiny_model_dir)


# --------------------------------------------------------------------------------------------------
# serve


@pytest.fixture(scope="module")
def server(sft_run, tiny_run_dir):
    cfg = load_config(None, ["device=cpu"])
    engine, _ = build_engine(cfg, [str(sft_run), str(tiny_run_dir)])
    serve_cfg = ServeConfig(api_key=USER, admin_key=ADMIN, adapter_dirs=[str(sft_run.parent)], max_new_tokens=16)
    with running(create_app(engine, serve_cfg)) as (url, _):
        yield url


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=USER, max_retries=0)


def ask(client, text, **kwargs):
    return client.chat.completions.create(model="chat", messages=[{"role": "user", "content": text}], temperature=0,
                                          **kwargs)


def streamed(client, text, **kwargs) -> tuple[str, str]:
    chunks = list(ask(client, text, stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def test_models_list_the_task_and_classify_is_refused_for_sft(http, client):
    assert [m.id for m in client.models.list().data] == ["base", "chat", "tiny"]
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["chat"]["task"] == "sft" and "labels" not in cards["chat"]
    assert cards["tiny"]["task"] == "classify" and cards["tiny"]["labels"] == LABELS
    assert "task" not in cards["base"]

    refused = http.post("/v1/classify", json={"model": "chat", "input": "i am happy"})
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert "`chat` is an sft model" in message and "/v1/chat/completions" in message
    assert http.post("/v1/classify", json={"model": "tiny", "input": "i am happy"}).status_code == 200

    loaded = http.post("/v1/adapters", headers={"Authorization": f"Bearer {ADMIN}"}, json={"name": "again", "path": "chat"})
    assert loaded.status_code == 201, loaded.text
    assert loaded.json()["task"] == "sft" and "labels" not in loaded.json()
    assert http.post("/v1/classify", json={"model": "again", "input": "x"}).status_code == 422
    assert http.delete("/v1/adapters/again", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_chat_answers_under_the_adapters_own_system_prompt(client, sft_run, tiny_model_dir):
    reply = ask(client, TEXTS[1], max_tokens=6)
    assert reply.choices[0].message.content == reference_replies(tiny_model_dir, sft_run / "adapter", TEXTS[1:], 6)[0]
    explicit = client.chat.completions.create(model="chat", max_tokens=6, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": TEXTS[1]}])
    assert explicit.choices[0].message.content == reply.choices[0].message.content
    assert explicit.usage.prompt_tokens == reply.usage.prompt_tokens
    other = client.chat.completions.create(model="chat", max_tokens=6, messages=[
        {"role": "system", "content": "reply"}, {"role": "user", "content": TEXTS[1]}])
    assert other.usage.prompt_tokens == reply.usage.prompt_tokens - 3  # the request's own system prompt wins

    # a classify adapter's chat is as before: no system prompt added
    plain = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 2}
    assert (client.chat.completions.create(model="tiny", **plain).usage.prompt_tokens
            == client.chat.completions.create(model="base", **plain).usage.prompt_tokens)


def test_chat_renders_tool_turns_as_the_adapter_trained_on_them(client, sft_run):
    """An sft run trains tool calls as the JSON after the answer's text and tool results as user turns. The server sent
    the `tool` role to the template (Gemma's refused it: 422) and an assistant message with `tool_calls` and null
    content was refused as having no content."""
    from transformers import AutoTokenizer

    from emotune.core.config.sft import SftColumns
    from emotune.data.conversations import normalise
    from emotune.data.roles import OPENAI_TAGS

    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    messages = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    reply = client.chat.completions.create(model="chat", max_tokens=2, temperature=0, messages=messages)
    trained = normalise({"messages": [*messages, {"role": "assistant", "content": "x"}]}, "messages", SftColumns(),
                        OPENAI_TAGS, "f")
    tokenizer = AutoTokenizer.from_pretrained(sft_run / "adapter")
    prompt = tokenizer.apply_chat_template(trained.chat(SYSTEM, turns=trained.prompt_turns), tokenize=False,
                                           add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with_tools = client.chat.completions.create(model="chat", max_tokens=2, temperature=0, messages=messages, tools=tools)
    trained = normalise({"messages": [*messages, {"role": "assistant", "content": "x"}], "tools": tools}, "messages",
                        SftColumns(), OPENAI_TAGS, "f")
    prompt = tokenizer.apply_chat_template(trained.chat(SYSTEM, turns=trained.prompt_turns), tokenize=False,
                                           add_generation_prompt=True)
    assert "Tools available" in prompt  # the tools follow the adapter's own system prompt, as in its training rows
    assert with_tools.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    with pytest.raises(openai.UnprocessableEntityError, match="null only in an assistant message with `tool_calls`"):
        client.chat.completions.create(model="chat", max_tokens=2, messages=[{"role": "user", "content": None}])


def test_chat_turns_are_cleaned_as_the_training_turns_were(client, http, sft_run, tmp_path, monkeypatch):
    """An sft run cleans every turn of its rows (control and invisible characters removed, NFC), not the system prompt;
    chat completions rendered the messages as sent, so the same words were another prompt than the one trained on
    (here a bell inside `today` made it an unknown word). An adapter whose emotune.json records no cleaning (saved
    before it did) reads them as sent, as before."""
    from transformers import AutoTokenizer

    from emotune.serve import routes

    jobs, chat_job = [], routes.chat_job

    def recorded(*args):  # the rendered prompt and its token ids, as generation gets them
        jobs.append(chat_job(*args))
        return jobs[-1]

    monkeypatch.setattr(routes, "chat_job", recorded)
    messages = [{"role": "system", "content": "be\u200b kind"}, {"role": "user", "content": "is it\u200b sunny to\x07day"},
                {"role": "assistant", "content": "a mo\u200bdel"}, {"role": "user", "content": "and the cafe\u0301"}]
    trained = trained_conversation({"messages": [*messages, {"role": "assistant", "content": "x"}]}, tmp_path / "data")
    assert [text for _, text in trained.messages[:3]] == ["is it sunny today", "a model", "and the caf\u00e9"]
    tokenizer = AutoTokenizer.from_pretrained(sft_run / "adapter")
    prompt = tokenizer.apply_chat_template(trained.chat(SYSTEM, turns=trained.prompt_turns), tokenize=False,
                                           add_generation_prompt=True)
    assert "be\u200b kind" in prompt  # the system prompt as written, as training left it
    reply = client.chat.completions.create(model="chat", max_tokens=2, temperature=0, messages=messages)
    assert jobs[-1]["prompt"] == prompt
    assert jobs[-1]["prompt_ids"] == tokenizer.apply_chat_template(trained.chat(SYSTEM, turns=trained.prompt_turns),
                                                                   add_generation_prompt=True, return_dict=False)
    assert reply.usage.prompt_tokens == len(jobs[-1]["prompt_ids"])

    old = sft_run.parent / "old-chat"
    shutil.copytree(sft_run, old)
    meta = json.loads((old / "adapter" / "emotune.json").read_text(encoding="utf-8"))
    del meta["cleaning"]
    (old / "adapter" / "emotune.json").write_text(json.dumps(meta), encoding="utf-8")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert http.post("/v1/adapters", headers=admin, json={"name": "old", "path": "old-chat"}).status_code == 201
    try:
        client.chat.completions.create(model="old", max_tokens=2, temperature=0, messages=messages)
        assert jobs[-1]["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    finally:
        assert http.delete("/v1/adapters/old", headers=admin).status_code == 200


def test_streaming_equals_the_plain_reply(client):
    reply = ask(client, TEXTS[1], max_tokens=10)
    text, finish = streamed(client, TEXTS[1], max_tokens=10)
    assert text.strip() == reply.choices[0].message.content and finish == reply.choices[0].finish_reason


def test_stop_cuts_the_reply_before_the_first_stop_text(client):
    full = ask(client, TEXTS[1], max_tokens=12)
    words = full.choices[0].message.content.split()
    stop = next(w for w in words if w != words[0])  # a word after the start, so something comes before it
    expected = " ".join(words[:words.index(stop)])
    assert expected and full.choices[0].finish_reason == "length"

    for given in ([stop], stop, ["never said", stop]):
        cut = ask(client, TEXTS[1], max_tokens=12, stop=given)
        assert cut.choices[0].message.content == expected, given
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == words.index(stop) + 1  # generation ended at the stop text
        assert streamed(client, TEXTS[1], max_tokens=12, stop=given) == (expected + " ", "stop")

    # a stop text the reply starts but never completes: the held-back tail is sent after all
    never = f"{words[1]} zzz"
    assert ask(client, TEXTS[1], max_tokens=12, stop=[never]).choices[0].message.content == " ".join(words)
    text, finish = streamed(client, TEXTS[1], max_tokens=12, stop=[never])
    assert text.strip() == " ".join(words) and finish == "length"


def test_n_and_stop_limits_are_refused_clearly(http, client):
    for body, said in (({"n": 2}, "n=2"), ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
                       ({"stop": ["a", ""]}, "empty stop"), ({"stop": 5}, "stop")):
        answer = http.post("/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                                         **body})
        assert answer.status_code == 422 and said in answer.json()["error"]["message"], (body, answer.text)
    with pytest.raises(openai.UnprocessableEntityError):
        ask(client, "hi", n=3)


def _tools(text: str) -> dict:
    return {"tools": [{"type": "function", "function": {"name": text}}]}


def _tool_calls(text: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": text}}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}


def _function_call(text: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "x", "function_call": {"name": text, "arguments": "{}"}},
                         {"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, field", [(_tools, "`tools`"), (_tool_calls, "`tool_calls`"),
                                          (_function_call, "`function_call`")], ids=["tools", "tool_calls", "function_call"])
def test_a_lone_surrogate_in_tools_or_tool_calls_is_422_and_the_next_chat_is_answered(http, extra, field):
    """`tools` and an assistant's tool calls are written into an sft adapter's prompt as JSON: a lone surrogate there
    (JSON may escape one, `"\\ud800"`) failed its tokenizer with a 500."""
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = http.post("/v1/chat/completions", content=json.dumps({**body, **extra("w\ud800")}),
                        headers={"Content-Type": "application/json"})
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert field in message and "not valid Unicode" in message, message
    assert http.post("/v1/chat/completions", json={**body, **extra("weather")}).status_code == 200


def test_tools_count_toward_serve_max_prompt_chars_where_the_model_reads_them(http):
    """An sft adapter's prompt holds the request's `tools` as JSON: they were not counted, so a body of tools up to
    serve.max_body_bytes was rendered and tokenized, past the limit meant to stop that first."""
    tools = [{"type": "function", "function": {"name": "weather", "description": "happy " * 11_000}}]  # 66,000+ chars
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    refused = http.post("/v1/chat/completions", json={"model": "chat", **body})
    assert refused.status_code == 422, refused.text
    message = refused.json()["error"]["message"]
    assert "serve.max_prompt_chars=64000" in message and "`tools`" in message, message
    assert http.post("/v1/chat/completions", json={"model": "tiny", **body}).status_code == 200  # a classifier: unread


def test_exported_chat_client_runs_against_this_server(client, sft_run, tmp_path):
    from emotune.deploy.export import export

    out = export(sft_run, out=tmp_path / "export", vllm=True)
    spec = importlib.util.spec_from_file_location("chat_client_example", out / "vllm" / "client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = ask(client, TEXTS[0], max_tokens=6).choices[0].message.content
    assert module.chat(client, TEXTS[0], max_tokens=6) == expected
    assert module.chat(client, TEXTS[0], max_tokens=6, stream=True).strip() == expected
    # vLLM takes a text as sent: the client cleans the user turn as training cleaned turns (emotune.json's steps)
    assert module.CLEANING and module.clean("hi\u200b there\x00") == "hi there"


# --------------------------------------------------------------------------------------------------
# the stop filter of streamed text


@pytest.mark.parametrize(("pieces", "stops", "shown"), [
    (["hello E", "N", "D more"], ["END"], "hello "),  # a stop text split over three pieces
    (["hello E", "x"], ["END"], "hello Ex"),  # a started one that does not finish is sent after all
    (["ab", "c"], ["bcd", "c"], "ab"),  # the earliest of several stop texts
    (["tail E"], ["END"], "tail E"),  # held back at the end: flushed
    (["no stops"], [], "no stops"),
])
def test_stop_filter(pieces, stops, shown):
    visible = StopFilter(stops)
    assert "".join(visible.feed(p) for p in pieces) + visible.flush() == shown
