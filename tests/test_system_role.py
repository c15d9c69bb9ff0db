"""Checkpoints whose chat template has no system role (Gemma 2, Gemma 1, Mixtral and Mistral 7B Instruct v0.1/v0.2):
every command runs, with the system text opening the first user message (emotune.model.system_role)."""

from __future__ import annotations

import json

import pytest
import torch

from chat_families import GEMMA2
from conftest import build_tokenizer, make_rows, write_jsonl
from emotune.cli import main
from emotune.core.config.model import ModelConfig
from emotune.model.loading import load_tokenizer
from emotune.model.system_role import FOLD_MARK
from families import gemma3_text


def _gemma2_templated(folder):
    """The tiny Gemma 3 model of tests/families.py with google/gemma-2-2b-it's chat template (same turn tokens)."""
    tokenizer = build_tokenizer(folder)
    tokenizer.chat_template = GEMMA2
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    gemma3_text(tokenizer).save_pretrained(folder)
    return folder


def _overrides(model_dir, tmp_path, name: str) -> list[str]:
    return [f"model.source={model_dir}", f"output_dir={tmp_path / 'runs'}", f"name={name}", "train.max_steps=1",
            "train.batch_size=4", "train.precision=fp32", "eval.batch_size=6", f"model.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.slow
def test_a_template_without_a_system_role_trains_scores_and_predicts(data_dir, tmp_path, capsys):
    """`emotune run` stopped in the data stage with jinja's `TemplateError: System role not supported`."""
    model_dir = _gemma2_templated(tmp_path / "model")
    assert main(["run", "task=classify", f"data.source={data_dir}", "data.label_names=[sadness, joy, love, anger, fear, "
                 "surprise]", "prompt.system_prompt=be brief", *_overrides(model_dir, tmp_path, "g2")]) == 0
    assert "its chat template has no system role" in capsys.readouterr().out
    adapter = tmp_path / "runs" / "g2" / "adapter"
    assert (adapter / "chat_template.jinja").read_text(encoding="utf-8").startswith(FOLD_MARK)
    tokenizer = load_tokenizer(adapter, ModelConfig())  # as serve and predict load it: wrapped once
    assert tokenizer.chat_template.count(FOLD_MARK) == 1
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                             tokenize=False, add_generation_prompt=True)
    assert rendered == "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert main(["predict", str(tmp_path / "runs" / "g2"), "i feel so happy today"]) == 0


@pytest.mark.slow
def test_sft_rows_with_a_system_prompt_on_a_template_without_one(tmp_path):
    model_dir = _gemma2_templated(tmp_path / "model")
    rows = [{"instruction": "classify the emotion", "input": row["text"], "output": row["label"], "system": "be brief"}
            for row in make_rows(6, seed=1)]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    assert main(["run", "task=sft", f"data.source={tmp_path / 'sft.jsonl'}", "data.test_limit=4", "eval.max_new_tokens=3",
                 "eval.probe=false",
                 *_overrides(model_dir, tmp_path, "s2")]) == 0
    assert json.loads((tmp_path / "runs" / "s2" / "run.json").read_text(encoding="utf-8"))["status"] == "finished"
