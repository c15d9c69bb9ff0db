"""The same Gemma 4 text weights saved as `Gemma4ForCausalLM` and inside `Gemma4ForConditionalGeneration` (the class
the released E4B/E2B load as) give, through `emotune run`, the same baseline label probabilities (eval.method=score)
and the same first SFT loss on passes longer than CHUNK_TOKENS (the chunked loss). Both read the final soft-cap (30)
from the text config; before that was so, the wrapper's probabilities differed by up to 0.2 and its first SFT loss
was twice the text class's (issue 28)."""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch

from conftest import CUES, FILLER, LABELS, build_tokenizer, write_jsonl
from emotune.cli import main
from emotune.train.batches import CHUNK_TOKENS
from families import build, gemma4_multimodal

RESPONSE_WORDS = 160  # per row; 8 rows in one pass (no per-pass token cap): more loss positions than CHUNK_TOKENS


@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory):
    """(text folder, multimodal folder) holding the same tiny Gemma 4 E4B-shaped text weights, soft-cap 30."""
    text_dir, wrapped_dir = tmp_path_factory.mktemp("gemma4-text"), tmp_path_factory.mktemp("gemma4-wrapped")
    tokenizer = build_tokenizer(text_dir)
    build_tokenizer(wrapped_dir)
    text = build("gemma4-text", text_dir)
    torch.manual_seed(1)
    wrapped = gemma4_multimodal(tokenizer).float()
    missing, unexpected = wrapped.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing and not unexpected
    assert wrapped.lm_head.weight.data_ptr() == wrapped.model.language_model.embed_tokens.weight.data_ptr()  # tied
    text.save_pretrained(text_dir)
    wrapped.save_pretrained(wrapped_dir)
    return text_dir, wrapped_dir


def test_transformers_gives_both_folders_the_same_logits(gemma4_pair):
    from transformers import AutoModelForCausalLM

    text, wrapped = (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) for folder in gemma4_pair)
    assert type(text).__name__ == "Gemma4ForCausalLM" and type(wrapped).__name__ == "Gemma4ForConditionalGeneration"
    assert wrapped.config.get_text_config().final_logit_softcapping == 30.0
    assert getattr(wrapped.config, "final_logit_softcapping", None) is None  # what emotune read before issue 28
    ids = torch.tensor([list(range(3, 60))])
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids).logits, text(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _run(overrides: list[str], folder, tmp_path, name: str):
    assert main(["run", f"model.source={folder}", f"output_dir={tmp_path / 'runs'}", f"name={name}",
                 f"model.cache_dir={tmp_path / 'cache'}", "train.precision=fp32", "model.dtype=float32",
                 "train.gradient_checkpointing=false", "train.max_steps=1", "train.logging_steps=1",
                 "train.eval_steps=1", "train.save_steps=1", *overrides]) == 0
    return tmp_path / "runs" / name


def _baseline_probabilities(run_dir) -> torch.Tensor:
    with (run_dir / "baseline" / "predictions.csv").open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return torch.tensor([[float(row[f"p_{label}"]) for label in LABELS] for row in rows])


def test_baseline_label_probabilities_are_the_same_through_emotune_run(gemma4_pair, data_dir, tmp_path):
    overrides = [f"data.source={data_dir}", "data.label_names=[sadness, joy, love, anger, fear, surprise]",
                 "eval.method=score", "train.batch_size=4", "eval.batch_size=5"]
    runs = [_run(overrides, folder, tmp_path, name) for folder, name in zip(gemma4_pair, ("text", "wrapped"), strict=True)]
    text, wrapped = (_baseline_probabilities(run_dir) for run_dir in runs)
    assert text.shape == (12, len(LABELS))
    assert float(text.max(-1).values.min()) < 0.99  # probabilities a soft-cap moves, not one-hot
    torch.testing.assert_close(wrapped, text, rtol=0, atol=1e-3)
    # run.json says which layers ran the lean forwards: on Gemma 4 every LoRA layer and every norm
    stage = json.loads((runs[1] / "run.json").read_text())["stages"]["train"]
    lean = stage["lean"]
    assert lean["lora"]["layers"] > 0 and lean["lora"]["own_forward"] == 0
    assert lean["lora"]["fused_base"] == lean["lora"]["layers"]  # plain nn.Linear bases: product and branch in one
    assert stage["compile"]["setting"] == "auto" and stage["compile"]["layers"] == 0  # auto: eager on a CPU
    assert lean["norm"]["norms"] > 0 and lean["norm"]["own_forward"] == {}, lean


def _long_sft_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = FILLER + [w for cues in CUES.values() for w in cues]
    return [{"instruction": "read the text and reply", "input": " ".join(rng.sample(FILLER, 5)),
             "output": " ".join(rng.choice(words) for _ in range(RESPONSE_WORDS))} for _ in range(n)]


@pytest.mark.slow
def test_first_sft_loss_is_the_same_through_emotune_run_with_the_chunked_loss(gemma4_pair, tmp_path):
    write_jsonl(tmp_path / "sft.jsonl", _long_sft_rows(40, seed=1))
    overrides = ["task=sft", f"data.source={tmp_path / 'sft.jsonl'}", "train.batch_size=8",
                 "train.gradient_accumulation_steps=1", "train.max_length=512", "train.max_tokens_per_pass=0", "eval.batch_size=8",
                 "eval.max_new_tokens=2", "eval.probe=false", "data.test_limit=4"]
    losses = []
    for folder, name in zip(gemma4_pair, ("text", "wrapped"), strict=True):
        run_dir = _run(overrides, folder, tmp_path, name)
        history = json.loads((run_dir / "train" / "log_history.json").read_text())
        losses.append(next(entry["loss"] for entry in history if "loss" in entry and entry.get("step") == 1))
    assert 8 * RESPONSE_WORDS > CHUNK_TOKENS  # every pass runs the chunked loss
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
