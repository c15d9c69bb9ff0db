"""Shared-prefix training (emotune.model.prefix, batches.collate_after_prefix): the prompt head run once per forward pass
gives whole rows' loss and LoRA gradients (padding on either side, sliding-window layers crossed by prefix + row,
gradient accumulation, gradient checkpointing, Gemma 4's shared keys and values, several loss spans); the
automatic choice and its fallbacks; and the training command end to end, with its choice in run.json."""

from __future__ import annotations

import json
import runpy
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from conftest import LABELS, build_tokenizer, make_rows
from emotune.cli import main
from emotune.core.config.data import PromptConfig
from emotune.tasks.classify.task import encode_examples
from emotune.tasks.classify_head.objective import head_objective
from emotune.tasks.classify_head.task import encode_texts
from emotune.train.batches import (
    CHUNK_TOKENS,
    LANGUAGE_MODEL,
    SHARED_PREFIX_MIN_TOKENS,
    collate,
    collate_after_prefix,
    completion_loss,
    share_prefix,
    shared_prefix_length,
)

WINDOW = 12  # far below the ~50-token prefix: sliding-window layers hide prefix keys from the rows' later tokens
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _rows(tokenizer, n: int = 6):
    rows = make_rows(1, seed=5)[:n]
    for i, row in enumerate(rows):  # rows of different lengths, so padding really happens
        row["text"] = " ".join([row["text"]] * (1 + i % 3))
    return encode_examples(Dataset.from_list(rows), tokenizer, PromptConfig(), LABELS, max_length=256)


def _gemma3(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                              sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                              final_logit_softcapping=3.0, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config)


def _gemma4(tokenizer):
    """Gemma 4 text with its last layer reusing an earlier layer's keys and values (KV sharing)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                              max_position_embeddings=256, sliding_window=WINDOW, num_kv_shared_layers=1,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              vocab_size_per_layer_input=len(tokenizer), hidden_size_per_layer_input=8,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config)


def _gpt2(tokenizer):
    """GPT-2 (learned positions, Conv1D projections), without its dropout: its model drops the cache itself when
    checkpointing (not only its layers do)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _lora(model, checkpointing: bool):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B != 0, so the adapters change the prefix's keys and values from the first step
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                               init_lora_weights=False))
    if checkpointing:
        adapted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return adapted.train()


def _update(model, batches: list[dict], chunk_tokens: int = CHUNK_TOKENS) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss summed over the micro-batches and the LoRA gradients they accumulate, as one optimizer step sees them."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        parts = completion_loss(model, batch, chunk_tokens)
        parts.loss_sum.backward()
        total += float(parts.loss_sum.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _left_padded(batch: dict) -> dict:
    """The same batch with each row's tokens moved to the right end (the kept positions keep their row-major order)."""
    out = dict(batch)
    shifts = (batch["attention_mask"] == 0).sum(1).tolist()
    for key in ("input_ids", "attention_mask", "predicts"):
        out[key] = torch.stack([row.roll(shift) for row, shift in zip(batch[key], shifts, strict=False)])
    return out


def _assert_same_update(whole, shared) -> None:
    (loss, grads), (shared_loss, shared_grads) = whole, shared
    assert shared_loss == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == shared_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


@pytest.mark.parametrize("build, padding, checkpointing", [
    (_gemma3, "right", False), (_gemma3, "left", False), (_gemma3, "right", True), (_gemma3, "left", True),
    (_gemma4, "left", True), (_gpt2, "right", True)],
    ids=["gemma3-right", "gemma3-left", "gemma3-right-checkpointing", "gemma3-left-checkpointing",
         "gemma4-text-left-checkpointing", "gpt2-right-checkpointing"])
def test_shared_prefix_gives_the_update_of_whole_rows(tokenizer, build, padding, checkpointing):
    rows = _rows(tokenizer)
    model = _lora(build(tokenizer), checkpointing)
    shared, choice = share_prefix(LANGUAGE_MODEL, rows, "auto", model)
    assert choice["used"] and choice["tokens"] > WINDOW and len({len(r.input_ids) for r in rows}) > 1
    pad = tokenizer.pad_token_id
    halves = [rows[:3], rows[3:]]  # two micro-batches accumulated into one update
    whole = _update(model, [collate(h, pad, CPU) for h in halves])

    batches = [shared.collate(h, pad, CPU) for h in halves]
    assert all(b["prefix_ids"].shape == (1, choice["tokens"]) for b in batches)
    if padding == "left":
        batches = [_left_padded(b) for b in batches]
    calls = []
    attention = next(m for n, m in model.named_modules() if n.endswith(("layers.0.self_attn", "h.0.attn")))
    handle = attention.register_forward_hook(lambda *args: calls.append(1))
    _assert_same_update(whole, _update(model, batches))
    handle.remove()
    # the prefix pass and the rows' pass per micro-batch; under checkpointing the rows' is replayed in the backward
    assert len(calls) == len(batches) * (3 if checkpointing else 2)


@pytest.mark.parametrize("chunk_tokens", [CHUNK_TOKENS, 4], ids=["one-projection", "chunked"])
def test_rows_with_several_loss_spans(tokenizer, chunk_tokens):
    """Conversation-like rows (a loss span inside the row besides the completion): the spans move with the cut; long
    responses' chunked projection works after a shared prefix too."""
    rows = _rows(tokenizer, 4)
    n = shared_prefix_length(rows)
    rows = [replace(r, spans=((n, n + 3), (r.completion_start, len(r.input_ids)))) for r in rows]
    assert shared_prefix_length(rows) == n - 1  # the first loss token's prediction stays in the rows' part
    model = _lora(_gemma3(tokenizer), checkpointing=False)
    shared, choice = share_prefix(LANGUAGE_MODEL, rows, "auto", model)
    pad = tokenizer.pad_token_id
    _assert_same_update(_update(model, [collate(rows, pad, CPU)], chunk_tokens),
                        _update(model, [shared.collate(rows, pad, CPU)], chunk_tokens))


def test_the_choice_falls_back_to_whole_rows(tokenizer):
    rows = _rows(tokenizer)
    model = _gemma3(tokenizer)
    objective, choice = share_prefix(LANGUAGE_MODEL, rows, "off", model)
    assert objective is LANGUAGE_MODEL and not choice["used"] and choice["reason"] == "train.shared_prefix=off"

    # Per-row system prompts: the rows part after a few tokens.
    varied = [replace(r, input_ids=r.input_ids[:5] + [i] + r.input_ids[6:]) for i, r in enumerate(rows)]
    objective, choice = share_prefix(LANGUAGE_MODEL, varied, "auto", model)
    assert objective is LANGUAGE_MODEL and choice["tokens"] == 5 < SHARED_PREFIX_MIN_TOKENS
    assert f"fewer than {SHARED_PREFIX_MIN_TOKENS}" in choice["reason"]

    objective, choice = share_prefix(LANGUAGE_MODEL, rows, "auto", model, sharded=True)
    assert objective is LANGUAGE_MODEL and "FSDP2" in choice["reason"]

    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    objective, choice = share_prefix(LANGUAGE_MODEL, rows, "auto", flash)
    assert objective is LANGUAGE_MODEL and "flash_attention_2" in choice["reason"]

    # classify_head reads the bare text: its rows share only <bos>, and its loss reads whole rows anyway.
    texts = [row["text"] for row in make_rows(1, seed=5)]
    head_rows = [replace(r, input_ids=ids, completion_start=len(ids) - 1, label=0)
                 for r, ids in zip(rows, encode_texts(texts, tokenizer, 256), strict=False)]
    head = head_objective("macro_f1", len(LABELS))
    objective, choice = share_prefix(head, head_rows, "auto", model)
    assert objective is head and choice["reason"] == "the task's loss reads whole rows" and choice["tokens"] <= 1


def test_a_batch_with_a_row_outside_the_prefix_is_collated_whole(tokenizer):
    rows = _rows(tokenizer)
    shared, choice = share_prefix(LANGUAGE_MODEL, rows[:4], "auto", _gemma3(tokenizer))
    pad = tokenizer.pad_token_id
    assert "prefix_ids" in shared.collate(rows[4:], pad, CPU)
    other = replace(rows[5], input_ids=[rows[5].input_ids[0] + 1] + rows[5].input_ids[1:])
    batch = shared.collate([rows[4], other], pad, CPU)
    expected = collate([rows[4], other], pad, CPU)
    assert "prefix_ids" not in batch and all(torch.equal(batch[k], expected[k]) for k in expected)
    assert collate_after_prefix([rows[4]], pad, CPU, shared.prefix)["input_ids"].shape[1] == \
        len(rows[4].input_ids) - choice["tokens"]


@pytest.mark.slow  # two training runs
def test_training_with_a_shared_prefix_equals_whole_rows(tiny_overrides, tmp_path, capsys):
    """The training command with gradient checkpointing and accumulation: the same losses, validation losses and
    adapter with `train.shared_prefix=auto` as with `off`; the choice printed once and recorded in run.json."""
    common = ["train", *tiny_overrides, "lora.dropout=0.0", "train.gradient_checkpointing=true",
              "train.gradient_accumulation_steps=2", "train.save_steps=5", "train.eval_steps=2"]
    assert main(common + ["name=shared"]) == 0
    out = capsys.readouterr().out
    assert out.count("Shared prefix: every row starts with the same") == 1
    assert main(common + ["name=whole", "train.shared_prefix=off"]) == 0
    assert "Shared prefix: not used (train.shared_prefix=off)" in capsys.readouterr().out

    runs = tmp_path / "runs"
    recorded = {n: json.loads((runs / n / "run.json").read_text())["stages"]["train"]["shared_prefix"]
                for n in ("shared", "whole")}
    assert recorded["shared"]["used"] and recorded["shared"]["tokens"] >= SHARED_PREFIX_MIN_TOKENS
    assert not recorded["whole"]["used"]
    histories = {n: json.loads((runs / n / "train" / "log_history.json").read_text()) for n in ("shared", "whole")}
    for key in ("loss", "eval_loss"):
        shared, whole = ([e[key] for e in histories[n] if key in e] for n in ("shared", "whole"))
        assert len(shared) == len(whole) > 0 and shared == pytest.approx(whole, rel=1e-5)
    from safetensors.torch import load_file

    shared, whole = (load_file(runs / n / "adapter" / "adapter_model.safetensors") for n in ("shared", "whole"))
    assert shared.keys() == whole.keys() and all(torch.allclose(shared[k], whole[k], atol=1e-5) for k in whole)


@pytest.mark.slow  # TRL's trainer and emotune's, one step each
def test_train_speed_bench_runs_tiny_with_the_shared_prefix(tiny_model_dir, data_dir, monkeypatch, capsys):
    """bench/train_speed.py's sides on the tiny model, in this process (the script runs each in a subprocess of its
    own, only to measure its peak memory apart): emotune's side trains with the shared prefix, and its loss of the
    identical batch (through the shared-prefix batch) is the reference's, in the trained precision and in the
    float32 check."""
    pytest.importorskip("trl")
    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "bench" / "train_speed.py"))
    results = {}
    for side in ("ref", "ours", "identical"):
        monkeypatch.setattr(sys, "argv", ["train_speed.py", "--side", side, "--model", str(tiny_model_dir),
                                          "--data", str(data_dir / "train.jsonl"), "--rows", "8"])
        bench["main"]()
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT "))
        results[side] = json.loads(line.removeprefix("RESULT "))
    ref, ours = results["ref"], results["ours"]
    assert ours["shared_prefix_tokens"] >= SHARED_PREFIX_MIN_TOKENS and ours["steps"] == ref["steps"] == 1
    assert bench["_rel"](ours["losses"]["identical_batch"], ref["losses"]["identical_batch"]) < 1e-3
    fp32 = results["identical"]
    assert bench["_rel"](fp32["ours"], fp32["ref"]) < 1e-5 and fp32["ours"] > 0


@pytest.mark.slow  # four emotune training runs, each in its own subprocess
def test_prefix_dropout_bench_compares_shared_and_whole_rows_over_seeds(tiny_model_dir, data_dir, monkeypatch, capsys):
    """bench/prefix_dropout.py on the tiny model: each seed trains with the head shared and with whole rows; the
    shared runs really share a head, the whole-row runs train the same rows, and the summary's numbers are the
    runs' own (paired differences, means, spread)."""
    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "bench" / "prefix_dropout.py"))
    monkeypatch.setattr(sys, "argv", ["prefix_dropout.py", "--seeds", "1", "2", "--rows", "24", "--model", str(tiny_model_dir),
                                      "--data", str(data_dir / "train.jsonl")])
    bench["main"]()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = result["final_loss"]
    assert set(final) == {"auto", "off"} and set(final["auto"]) == set(final["off"]) == {"1", "2"}
    assert min(result["shared_prefix_tokens"]) >= SHARED_PREFIX_MIN_TOKENS and result["steps"] == 3
    for seed in ("1", "2"):
        assert result["paired_diff"][seed] == pytest.approx(final["auto"][seed] - final["off"][seed], abs=1e-5)
    assert result["off_range"] == pytest.approx(abs(final["off"]["1"] - final["off"]["2"]), abs=1e-5)
    assert result["mean"]["off"] == pytest.approx((final["off"]["1"] + final["off"]["2"]) / 2, abs=1e-5)
    assert final["off"]["1"] != final["off"]["2"]  # the seed changes the run (the first step's learning rate is 0: warm-up)


def test_prefix_dropout_bench_needs_two_seeds(monkeypatch):
    bench = runpy.run_path(str(Path(__file__).resolve().parent.parent / "bench" / "prefix_dropout.py"))
    monkeypatch.setattr(sys, "argv", ["prefix_dropout.py", "--seeds", "3"])
    with pytest.raises(SystemExit) as exit_info:
        bench["main"]()
    assert "--seeds" in str(exit_info.value.code)
