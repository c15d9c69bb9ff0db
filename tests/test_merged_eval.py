"""The fine-tuned evaluation with the adapter merged into the weights (emotune.eval.merged), on the tiny model
with a random non-zero adapter: the merge matches the unmerged model in fp32, the bf16 difference is measured
and reported, `auto` falls back above the tolerance, and afterwards the model is exactly the trained one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import make_rows
from emotune.cli import main
from emotune.eval.merged import describe, last_logits, merged_for_eval


def load_adapted(model_dir, run_dir, dtype):
    from peft import PeftModel

    from emotune.model.loading import load_model

    return PeftModel.from_pretrained(load_model(model_dir, dtype, torch.device("cpu")), run_dir / "adapter").eval()


def sample_ids(model_dir, rows: int = 6) -> list[list[int]]:
    from emotune.core.config.data import PromptConfig
    from emotune.core.config.model import ModelConfig
    from emotune.data import prompt_messages
    from emotune.model.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir, ModelConfig())
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    return [tokenizer.apply_chat_template(prompt_messages(r["text"], PromptConfig(), labels), tokenize=True,
                                          add_generation_prompt=True, return_dict=False) for r in make_rows(1, seed=5)][:rows]


def lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_fp32_merge_gives_the_unmerged_logits_and_is_used(tiny_model_dir, tiny_run_dir):
    model = load_adapted(tiny_model_dir, tiny_run_dir, torch.float32)
    sample = sample_ids(tiny_model_dir)
    unmerged = last_logits(model, sample)
    with model.disable_adapter():  # the adapter really moves the logits, so a merge that lost it would show
        assert (last_logits(model, sample) - unmerged).abs().max() > 1e-3
    with merged_for_eval(model, sample, "auto", 0.5) as record:
        assert all(layer.merged for layer in lora_layers(model))
        inside = last_logits(model, sample)
    assert record["merged"] is True and record["mode"] == "auto" and record["dtype"] == "float32"
    assert record["rows_checked"] == len(sample) and record["agreement"] == 1.0
    assert record["max_logit_diff"] < 1e-4
    assert (inside - unmerged).abs().max() < 1e-4
    assert not any(layer.merged for layer in lora_layers(model))


def test_bf16_difference_is_measured_and_reported(tiny_model_dir, tiny_run_dir):
    model = load_adapted(tiny_model_dir, tiny_run_dir, torch.bfloat16)
    sample = sample_ids(tiny_model_dir)
    unmerged = last_logits(model, sample)
    with merged_for_eval(model, sample, "always", 0.5) as record:
        merged = last_logits(model, sample)
    measured = float((merged - unmerged).abs().max())
    agree = float((merged.argmax(-1) == unmerged.argmax(-1)).float().mean())
    assert record["dtype"] == "bfloat16" and record["merged"] is True
    assert measured > 0  # rounding the merged weights to bf16 moves the logits
    assert record["max_logit_diff"] == pytest.approx(measured, abs=1e-6)
    assert record["agreement"] == pytest.approx(agree, abs=1e-4)


def test_auto_falls_back_to_the_unmerged_adapter_above_the_tolerance(tiny_model_dir, tiny_run_dir):
    model = load_adapted(tiny_model_dir, tiny_run_dir, torch.bfloat16)
    sample = sample_ids(tiny_model_dir)
    unmerged = last_logits(model, sample)
    with merged_for_eval(model, sample, "auto", 1e-9) as record:
        assert not any(layer.merged for layer in lora_layers(model))
        inside = last_logits(model, sample)
    assert record["merged"] is False and record["max_logit_diff"] > 1e-9
    assert "above eval.merge_tolerance=1e-09" in record["note"]
    assert torch.equal(inside, unmerged)  # evaluated exactly as trained
    assert describe(record).startswith("Note: adapter evaluated unmerged: merging moved a logit by")
    # `always` keeps the merge whatever the check found, and `never` checks nothing
    with merged_for_eval(model, sample, "always", 1e-9) as record:
        assert record["merged"] is True and all(layer.merged for layer in lora_layers(model))
    with merged_for_eval(model, sample, "never", 0.5) as record:
        assert record == {"mode": "never", "merged": False, "note": "evaluated unmerged: eval.merge_adapters=never"}
        assert not any(layer.merged for layer in lora_layers(model))


def test_model_and_adapter_are_exactly_as_trained_afterwards(tiny_model_dir, tiny_run_dir, tmp_path):
    """bf16, where unmerging by subtraction would leave rounding error behind; also when the evaluation fails."""
    model = load_adapted(tiny_model_dir, tiny_run_dir, torch.bfloat16)
    sample = sample_ids(tiny_model_dir)
    before = weights(model)
    model.save_pretrained(tmp_path / "before")
    with pytest.raises(RuntimeError, match="evaluation failed"):
        with merged_for_eval(model, sample, "always", 0.5):
            assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # merged
            raise RuntimeError("evaluation failed")
    with merged_for_eval(model, sample, "auto", 10.0) as record:
        assert record["merged"] is True
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not any(layer.merged for layer in lora_layers(model))
    model.save_pretrained(tmp_path / "after")
    saved = [(tmp_path / stage / "adapter_model.safetensors").read_bytes() for stage in ("before", "after")]
    assert saved[0] == saved[1]


def test_a_model_without_adapter_is_evaluated_as_it_is(tiny_model_dir):
    from emotune.model.loading import load_model

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    with merged_for_eval(model, sample_ids(tiny_model_dir), "auto", 0.5) as record:
        pass
    assert record == {"mode": "auto", "merged": False, "note": "evaluated unmerged: the model has no adapter layers to merge"}


def test_emotune_eval_records_the_merge_in_every_method_s_metrics(tiny_overrides, tiny_run_dir, tmp_path, capsys):
    run_dir = shutil.copytree(tiny_run_dir, tmp_path / "copy")
    assert main(["eval", *tiny_overrides, f"adapter={run_dir}", "eval.method=both"]) == 0
    assert "Adapter merged into the float32 weights" in capsys.readouterr().out
    folder = run_dir / "eval" / "test-finetuned"
    for metrics_file in (folder / "metrics.json", folder / "score" / "metrics.json"):
        merge = json.loads(metrics_file.read_text())["merge"]
        assert merge["merged"] is True and merge["mode"] == "auto" and merge["rows_checked"] == 8
        assert merge["max_logit_diff"] < 1e-4 and merge["agreement"] == 1.0
    assert main(["eval", *tiny_overrides, f"adapter={run_dir}", "eval.merge_adapters=never"]) == 0
    assert json.loads((folder / "metrics.json").read_text())["merge"]["merged"] is False


@pytest.mark.slow  # the whole benchmark, tiny
def test_eval_speed_bench_runs_tiny_on_the_merged_path(monkeypatch, capsys):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "eval_speed.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke", "--dtype", "float32"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["rows"] == 12 and line["adapter"] == "seeded-random-b"
    assert line["merged"] is True and line["merge_max_logit_diff"] < 1e-4 and line["merge_agreement"] == 1.0
    assert line["merged_same_outputs"] is True
    assert line["lora_vs_base_generate"] > 0 and line["lora_unmerged_vs_base_generate"] > 0
