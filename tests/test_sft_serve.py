"""An sft adapter through `emotune export` and `emotune predict` on the tiny model: free-text replies under the
adapter's own system prompt."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import write_tiny_adapter

from emotune.cli import main
from emotune.config import load_config

SYSTEM = "reply with one word"
TEXTS = ["i am so happy today", "my friend was furious"]
TRAINED_MAX_NEW_TOKENS = 5  # the adapter's eval.max_new_tokens: predict's default length


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
    assert any(len(a.split()) > len(b.split()) for a, b in zip(longer, expected))

    source, out = tmp_path / "in.csv", tmp_path / "out.csv"
    source.write_text("id,prompt\n" + "".join(f"{i},{t}\n" for i, t in enumerate(TEXTS)), encoding="utf-8")
    assert main(["predict", str(sft_run), "--file", str(source), "--out", str(out), "--text-column", "prompt",
                 "--max-new-tokens", "8", "--batch-size", "2"]) == 0  # batched with left padding: same replies
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert [r["id"] for r in rows] == ["0", "1"] and [r["output"] for r in rows] == longer


def test_predict_refuses_max_new_tokens_for_a_classifier(tiny_run_dir, sft_run, capsys):
    assert main(["predict", str(tiny_run_dir), "happy", "--max-new-tokens", "4"]) == 2
    assert "--max-new-tokens is for sft models" in capsys.readouterr().err
    assert main(["predict", str(sft_run), "happy", "--max-new-tokens", "0"]) == 2
    assert "positive" in capsys.readouterr().err


def test_export_merges_an_sft_adapter_and_writes_a_free_text_client(sft_run, tmp_path, capsys):
    from emotune.export import merge_parity_gap

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

    from emotune.artifacts import fallback_from, find_artifact

    folder = tmp_path / "lf-sft"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).save_pretrained(folder)
    cfg = load_config(None, ["task=sft", f"model.source={tiny_model_dir}", f"prompt.system_prompt={SYSTEM}"])
    artifact = find_artifact(folder, fallback=fallback_from(cfg))
    assert artifact.task == "sft" and artifact.foreign and artifact.sft_system_prompt == SYSTEM
    assert artifact.model_cfg.source == str(tiny_model_dir)
