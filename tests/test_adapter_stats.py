"""Training observability on small cases: the gradient norm the log records (before clipping; the window's mean and
largest step), and emotune.model.adapter_stats against PEFT's own weight change (rsLoRA scaling) and a head trained in full."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from emotune.model.adapter_stats import adapter_stats, group_of, layer_of
from emotune.train.log import Window
from emotune.train.optim import clip_gradients


def test_the_logged_gradient_norm_is_the_norm_before_clipping():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients(params, max_norm=1.0) == pytest.approx(5.0)
    assert float(torch.cat([p.grad for p in params]).norm()) == pytest.approx(1.0)  # the step used the clipped one


def test_a_log_line_carries_the_window_s_mean_and_largest_gradient_norm():
    window = Window()
    for norm in (1.0, 3.0, math.inf, 2.0):  # the non-finite step was skipped: it is counted elsewhere, not averaged
        window.add(0.5, 10, norm)
    plan = SimpleNamespace(micro_per_step=1, batches_per_epoch=10)
    entry = window.entry(SimpleNamespace(step=4, nonfinite_total=1), plan, 1e-4, grad_norm=2.0)
    assert (entry["grad_norm"], entry["grad_norm_mean"], entry["grad_norm_max"]) == (2.0, 2.0, 3.0)
    empty = Window().entry(SimpleNamespace(step=1, nonfinite_total=0), plan, 1e-4, grad_norm=math.nan)
    assert math.isnan(empty["grad_norm_mean"]) and math.isnan(empty["grad_norm_max"])


def test_module_groups_and_layers_from_module_names():
    assert group_of("model.layers.3.self_attn.q_proj") == "q_proj" and layer_of("model.layers.3.self_attn.q_proj") == 3
    assert group_of("model.altup_projections.0") == "altup_projections" and layer_of("score") is None


def test_rslora_norms_equal_the_weight_change_peft_computes(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                                      target_modules="all-linear"))  # B != 0: a real weight change
    model.save_pretrained(tmp_path)
    stats = adapter_stats(tmp_path)
    assert stats["use_rslora"] and all(m["scaling"] == pytest.approx(8 / 2) for m in stats["modules"])  # 8 / sqrt(4)
    assert len(stats["modules"]) == 14
    for m in stats["modules"]:  # ΔW as PEFT adds it to the weight when merging
        delta = model.base_model.model.get_submodule(m["module"]).get_delta_weight("default")
        assert float(torch.linalg.norm(delta)) == pytest.approx(m["delta_norm"], rel=1e-5), m["module"]


def test_a_head_trained_in_full_is_reported_by_its_weights(tmp_path):
    from peft import get_peft_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from emotune.core.config.train import LoraSettings
    from emotune.model.head import classifier_from_causal
    from emotune.model.lora import lora_config
    from emotune.tasks.classify_head.objective import head_objective

    config = Gemma3TextConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                              sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    classifier = classifier_from_causal(Gemma3ForCausalLM(config), ["a", "b", "c"])
    objective = head_objective("macro_f1", 3)
    adapted = get_peft_model(classifier, lora_config(LoraSettings(r=4, target_modules=["q_proj", "v_proj"]), classifier,
                                                      objective.lora_task_type, objective.modules_to_save))
    adapted.save_pretrained(tmp_path)
    stats = adapter_stats(tmp_path)
    assert list(stats["groups"]) == ["q_proj", "v_proj", "score"]  # LoRA groups first
    head = stats["groups"]["score"]
    saved = next(t for k, t in load_file(tmp_path / "adapter_model.safetensors").items() if k.endswith("score.weight"))
    assert head["kind"] == "full" and head["entries"] == saved.numel() == 3 * 32
    assert head["weight_norm_total"] == pytest.approx(float(saved.norm()), rel=1e-6)
    fresh = stats["groups"]["q_proj"]  # untrained: B is all zeros, so ΔW is 0 whatever A holds
    assert fresh["entries_zero_share"] == 1.0 and fresh["delta_norm_max"] == 0.0 and fresh["a_norm_mean"] > 0
    assert np.sum(fresh["histogram"]["counts"]) == fresh["entries"]
