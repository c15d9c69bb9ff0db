"""Evaluation batching: out-of-memory halves the batch and retries, never loses or repeats a row; `auto` sizing."""

from __future__ import annotations

import pytest
import torch

from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import EvalConfig
from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError
from emotune.eval import evaluate as ev
from emotune.runtime.oom import run_in_batches


def test_out_of_memory_halves_and_retries(capsys):
    seen: list[list[int]] = []

    def step(batch):
        if len(batch) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen.append(batch)

    run_in_batches(list(range(20)), 16, step)
    assert [row for batch in seen for row in batch] == list(range(20))
    assert max(len(b) for b in seen) == 2  # 16 → 8 → 4 → 2, then kept
    assert "retrying with eval batch size 2" in capsys.readouterr().out


def test_cpu_allocator_failure_counts_as_out_of_memory():
    calls = []

    def step(batch):
        calls.append(len(batch))
        if len(batch) > 1:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    run_in_batches([0, 1, 2], 4, step)
    assert calls == [3, 2, 1, 1, 1]


def test_out_of_memory_at_one_row_is_a_user_error_and_other_errors_pass_through():
    def always_oom(batch):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(UserError, match="one row per batch"):
        run_in_batches([0, 1], 2, always_oom)

    def broken(batch):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_in_batches([0, 1], 2, broken)


def test_auto_batch_size_follows_free_memory(tiny_model_dir, monkeypatch):
    from emotune.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir, ModelConfig())
    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    labels, texts = ["joy", "sadness"], ["i am happy"] * 4
    assert ev.choose_batch_size(model, tokenizer, texts, PromptConfig(), labels, EvalConfig(batch_size=7), "score") == 7
    monkeypatch.setattr(ev, "_free_memory", lambda device: 1 << 40)
    assert ev.choose_batch_size(model, tokenizer, texts, PromptConfig(), labels, EvalConfig(), "score") == 32  # CPU cap
    assert ev.choose_batch_size(model, tokenizer, texts, PromptConfig(), labels, EvalConfig(), "generate") == 16
    monkeypatch.setattr(ev, "_free_memory", lambda device: 1)
    assert ev.choose_batch_size(model, tokenizer, texts, PromptConfig(), labels, EvalConfig(), "score") == 1


def test_auto_batch_size_reads_a_config_whose_head_dim_is_none(tmp_path, monkeypatch):
    """mistralai/Mixtral-8x7B-Instruct-v0.1's config.json has no head_dim, which MixtralConfig keeps as None: every run
    with eval.batch_size=auto (the default) stopped at the baseline with "unsupported operand type(s) for *: 'int' and
    'NoneType'". The head dim is then hidden_size / num_attention_heads, as the model computes it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from conftest import build_tokenizer

    tokenizer = build_tokenizer(tmp_path)
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    assert config.head_dim is None
    monkeypatch.setattr(ev, "_free_memory", lambda device: 1 << 40)
    batch = ev.choose_batch_size(MixtralForCausalLM(config), tokenizer, ["i am happy"], PromptConfig(), ["joy", "sadness"],
                                 EvalConfig(), "score")
    assert batch == 32  # the CPU cap: the estimate was computed
