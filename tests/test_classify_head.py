"""task: classify_head — the head on tiny Gemma 3 and Gemma 4 text models, pooling by the attention mask,
the class-weighted loss, adapter selection by validation macro-F1, a 2-step `emotune run`, and the
language-model objective (classify, sft) left as it was."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from emotune.cli import main
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model.head import classifier_from_causal, has_library_class, last_token_index
from emotune.model.lora import lora_config
from emotune.tasks.classify_head.objective import class_metrics, collate_rows, head_loss, head_objective
from emotune.train import loop as train_mod
from emotune.train.batches import LANGUAGE_MODEL, Example, collate, completion_loss

LABELS = ["sadness", "joy", "love"]


def _gemma3(pad_is_eos: bool = False):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                              sliding_window=64, pad_token_id=1 if pad_is_eos else 0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()


def _gemma4(pad_is_eos: bool = False):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                              max_position_embeddings=128, sliding_window=64, layer_types=["sliding_attention",
                                                                                            "full_attention"],
                              vocab_size_per_layer_input=40, hidden_size_per_layer_input=8,
                              pad_token_id=1 if pad_is_eos else 0,
                              eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return Gemma4ForCausalLM(config).eval()


# --------------------------------------------------------------------------------------------------
# Pooling


def test_last_token_comes_from_the_mask_with_either_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert last_token_index(right).tolist() == [2, 4, 0]
    assert last_token_index(left).tolist() == [4, 4, 4]


@pytest.mark.parametrize("build", [_gemma3, _gemma4], ids=["gemma3", "gemma4-text"])
def test_head_reads_the_last_real_token_when_pad_equals_eos(build):
    causal = build(pad_is_eos=True)
    eos = causal.config.eos_token_id
    assert causal.config.pad_token_id == eos
    classifier = classifier_from_causal(causal, LABELS, init_std=0.02).eval()  # a random head: positions differ
    # pad = eos and both rows end with a real eos: pooling by `input_ids != pad` would read the token before it
    short, long = [2, 5, 6, eos], [2, 7, 8, 9, 10, eos]
    alone = [classifier(input_ids=torch.tensor([ids])).logits[0] for ids in (short, long)]
    right = classifier(input_ids=torch.tensor([short + [eos, eos], long]),
                       attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])).logits
    assert torch.allclose(right[0], alone[0], atol=1e-5) and torch.allclose(right[1], alone[1], atol=1e-5)
    before_eos = classifier(input_ids=torch.tensor([short[:-1]])).logits[0]
    assert not torch.allclose(alone[0], before_eos, atol=1e-4)  # the eos itself is what is read
    # left padding: the last position is the real token; the head reads the body's state there
    ids, mask = torch.tensor([[eos, eos] + short, long]), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    left = classifier(input_ids=ids, attention_mask=mask).logits
    hidden = classifier.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
    assert torch.allclose(left, classifier.score(hidden.float()), atol=1e-6)


def test_a_fresh_head_starts_at_zero_so_every_class_starts_at_one_over_k():
    classifier = classifier_from_causal(_gemma3(), LABELS).eval()
    assert not classifier.score.weight.any()
    probs = classifier(input_ids=torch.tensor([[2, 5, 6, 7]])).logits.softmax(-1)
    assert torch.allclose(probs, torch.full_like(probs, 1 / len(LABELS)))


def test_library_class_where_transformers_has_one_and_emotune_s_own_otherwise():
    gemma3, gemma4 = _gemma3(), _gemma4()
    assert has_library_class(gemma3) and not has_library_class(gemma4)
    assert type(classifier_from_causal(gemma3, LABELS)).__name__ == "Gemma3TextForSequenceClassification"
    own = classifier_from_causal(gemma4, LABELS)
    assert type(own).__name__ == "EmotuneGemma4ForSequenceClassification"
    assert own.model is gemma4.get_decoder()  # the language model is shared, not copied
    assert own.config.id2label == dict(enumerate(LABELS)) and own.score.weight.dtype == torch.float32


@pytest.mark.parametrize("build", [_gemma3, _gemma4], ids=["gemma3", "gemma4-text"])
def test_lora_trains_the_head_and_saves_it_with_the_adapter(build, tmp_path):
    from peft import PeftModel, get_peft_model

    classifier = classifier_from_causal(build(), LABELS)
    objective = head_objective("macro_f1", len(LABELS))
    adapted = get_peft_model(classifier, lora_config(LoraSettings(r=4, dropout=0.0), classifier, objective.lora_task_type,
                                                      objective.modules_to_save))
    rows = [Example([2, 5, 6, 7], 3, label=0), Example([2, 8, 9], 2, label=2)]
    batch = collate_rows(rows, 0, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=0.01)
    first = head_loss(adapted, batch).loss_sum
    for _ in range(4):
        head_loss(adapted, batch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert head_loss(adapted, batch).loss_sum < first
    adapted.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert any(k.endswith("score.weight") for k in saved) and any("lora_A" in k for k in saved)
    reloaded = PeftModel.from_pretrained(classifier_from_causal(build(), LABELS, seed=1), tmp_path).eval()
    adapted.eval()
    assert torch.allclose(reloaded(**batch).logits, adapted(**batch).logits, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Loss and selection


def test_class_weighted_loss_is_the_weighted_sum_of_per_row_losses():
    classifier = classifier_from_causal(_gemma3(), LABELS).eval()
    plain = [Example([2, 5, 6, 7], 3, label=0), Example([2, 8, 9], 2, label=1), Example([2, 10, 11, 12, 13], 4, label=2)]
    weights = [0.5, 2.0, 1.25]
    weighted = [Example(e.input_ids, e.completion_start, w, label=e.label) for e, w in zip(plain, weights, strict=False)]
    with torch.no_grad():
        per_row = [torch.nn.functional.cross_entropy(
            classifier(input_ids=torch.tensor([e.input_ids])).logits.float(), torch.tensor([e.label])) for e in plain]
        parts = head_loss(classifier, collate_rows(weighted, 0, torch.device("cpu")))
    assert parts.tokens == 3 and sum(e.completion_tokens for e in weighted) == 3  # the loop normalises by rows
    assert torch.allclose(parts.loss_sum, sum(w * loss for w, loss in zip(weights, per_row, strict=False)), atol=1e-5)


def test_the_kept_adapter_is_the_best_by_macro_f1_not_by_loss():
    model = torch.nn.Linear(2, 2)
    model.weight.requires_grad_(True)
    evals = [{"eval_loss": 0.9, "eval_macro_f1": 0.30, "eval_accuracy": 0.5},
             {"eval_loss": 0.7, "eval_macro_f1": 0.45, "eval_accuracy": 0.4},   # best F1
             {"eval_loss": 0.5, "eval_macro_f1": 0.40, "eval_accuracy": 0.6},   # lowest loss, best accuracy
             {"eval_loss": 0.6, "eval_macro_f1": 0.20, "eval_accuracy": 0.3}]

    def kept(select: str, patience: int = 0) -> tuple[int, int]:
        progress, best, objective = train_mod.Progress(), None, head_objective(select, 3)
        for step, metrics in enumerate(evals, 1):
            progress.step = step
            best, stop = train_mod._track_best(progress, metrics, model, best, patience, objective)
            if stop:
                break
        return progress.best_step, progress.step

    assert kept("macro_f1") == (2, 4)
    assert kept("loss") == (3, 4)
    assert kept("accuracy") == (3, 4)
    assert kept("macro_f1", patience=2) == (2, 4)  # steps 3 and 4 do not beat 0.45: stop after the second
    assert kept("loss", patience=1) == (3, 4)


def test_validation_macro_f1_counts_every_label():
    metrics = class_metrics(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 2]), num_labels=3)
    assert metrics["eval_accuracy"] == 0.75
    assert metrics["eval_macro_f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    # a label the validation rows lack and the head never predicts has no F1: it capped a perfect head at 2/3
    assert class_metrics(torch.tensor([0, 1]), torch.tensor([0, 1]), num_labels=3)["eval_macro_f1"] == 1.0


# --------------------------------------------------------------------------------------------------
# The language-model objective is unchanged


def test_language_model_objective_is_the_completion_loss_as_before(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert LANGUAGE_MODEL.collate is collate and LANGUAGE_MODEL.loss is None  # None: train.completion_loss
    assert LANGUAGE_MODEL.select == "eval_loss" and not LANGUAGE_MODEL.higher_is_better
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    config = lora_config(LoraSettings(r=4, modules_to_save=["lm_head"]), model)
    assert config.task_type == "CAUSAL_LM" and list(config.modules_to_save) == ["lm_head"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [Example(tokenizer("i am happy today joy")["input_ids"], 4, 1.5),
            Example(tokenizer("so lonely sadness")["input_ids"], 2)]
    batch = collate(rows, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        direct = completion_loss(model, batch)
        seam = train_mod._loss(LANGUAGE_MODEL, model, batch)
    assert torch.equal(direct.loss_sum, seam.loss_sum) and torch.equal(direct.correct, seam.correct)
    assert seam.predicted is None


# --------------------------------------------------------------------------------------------------
# End to end


def test_emotune_run_with_the_head_task(tiny_overrides, tmp_path, capsys):
    overrides = [o for o in tiny_overrides if not o.startswith("train.max_steps")]
    assert main(["run", "task=classify_head", *overrides, "train.max_steps=3", "data.balance=class_weight"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "tiny"
    meta = json.loads((run / "adapter" / "emotune.json").read_text())
    assert meta["task"] == "classify_head" and meta["labels"] == ["sadness", "joy", "love", "anger", "fear", "surprise"]
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    assert any(k.endswith("score.weight") for k in load_file(run / "adapter" / "adapter_model.safetensors"))
    before = json.loads((run / "baseline" / "metrics.json").read_text())
    after = json.loads((run / "finetuned" / "metrics.json").read_text())
    assert "zero-shot" in before["measured_by"] and "head" in after["measured_by"]
    for key in ("accuracy", "macro_f1", "weighted_f1", "per_class", "confusion_matrix", "top2_accuracy", "log_loss", "ece"):
        assert key in before and key in after
    assert "p_joy" in (run / "finetuned" / "predictions.csv").read_text().splitlines()[0]
    # the head's evaluation ran with the LoRA merged, checked on the head's class logits
    assert after["merge"]["merged"] is True and after["merge"]["max_logit_diff"] < 1e-4 and "merge" not in before
    assert "before = zero-shot label scoring" in out and "zero-shot" in (run / "report.html").read_text()
    comparison = json.loads((run / "comparison.json").read_text())
    assert comparison["methods"]["head"]["paired"]["verdict"] in ("better", "worse", "within noise", "mixed")
    assert "Verdict: " in out and "<table class=intervals" in (run / "report.html").read_text()
    history = [e for e in json.loads((run / "train" / "log_history.json").read_text()) if "eval_macro_f1" in e]
    best = max(history, key=lambda e: e["eval_macro_f1"])  # the first of equals, as _track_best keeps it
    assert f"Adapter: step {best['step']}, the highest eval_macro_f1" in out
    # the finetuned numbers come back from the saved adapter (a resumed run's finetuned stage loads it)
    assert main(["eval", "task=classify_head", *overrides, f"adapter={run}"]) == 0
    again = json.loads((run / "eval" / "test-finetuned" / "metrics.json").read_text())
    assert again["accuracy"] == after["accuracy"] and again["log_loss"] == pytest.approx(after["log_loss"], abs=1e-6)


def test_a_head_adapter_is_found_and_one_without_its_head_is_refused_clearly(tmp_path):
    from peft import get_peft_model

    from emotune.model.artifacts import find_artifact
    from emotune.model.head import causal_adapter

    causal = _gemma3()
    classifier = classifier_from_causal(causal, LABELS)
    adapter = tmp_path / "run" / "adapter"
    # no task type: PEFT saves LoRA only (SEQ_CLS would add the head to modules_to_save by itself)
    get_peft_model(classifier, lora_config(LoraSettings(r=4), classifier, None)).save_pretrained(adapter)
    (adapter / "emotune.json").write_text(json.dumps({"task": "classify_head", "labels": LABELS, "base_model": "x"}))
    artifact = find_artifact(tmp_path / "run")
    assert artifact.has_head and artifact.max_length == 256 and not artifact.merged
    with pytest.raises(UserError, match="holds no trained `score` head"):
        causal_adapter(causal, adapter)


@pytest.mark.slow
def test_two_training_steps_on_a_tiny_gemma4_text_model(tiny_gemma4_dir, tiny_overrides, tmp_path, capsys):
    """emotune's training loop on the architecture without a library class (emotune's own head), then the trained
    adapter merged: the merged model gives the adapter's logits."""
    from emotune.deploy.export import merge_parity_gap

    overrides = [o for o in tiny_overrides if not o.startswith("model.source=")]
    assert main(["train", "task=classify_head", f"model.source={tiny_gemma4_dir}", *overrides,
                 "data.balance=class_weight", "train.eval_steps=2"]) == 0  # step 1 moves only the zero-started head
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "tiny"
    history = json.loads((run / "train" / "log_history.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == [1, 2]
    evals = [e for e in history if "eval_macro_f1" in e]
    assert [e["step"] for e in evals] == [2]
    best = max(evals, key=lambda e: e["eval_macro_f1"])
    assert f"Adapter: step {best['step']}, the highest eval_macro_f1" in out
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("score.weight") for k in saved) and any("lora_B" in k for k in saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)  # two steps moved the LoRA
    assert main(["export", str(run), "--merge", "--dtype", "float32"]) == 0
    assert merge_parity_gap(run, ["i am so happy today", "lonely"], merged_dir=run / "export" / "merged") < 1e-4
