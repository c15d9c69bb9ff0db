"""LoftQ (`lora.init: loftq`), both ways: over an unquantized base (PEFT rounds the weights to NF4 itself) and over a
4-bit base (QLoRA + LoftQ: PEFT's replace_lora_weights_loftq from the original safetensors). Either starts the
adapters at the best rank-r part of what the rounding lost, with LoRA's scaling taken into account, so the adapted
model starts nearer the unquantized one. Tiny random Gemma 3 with 64-wide layers (conftest: tiny_gemma3_64_dir; NF4
rounds in blocks of 64)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import fixed_batch_losses
from emotune.cli import main
from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model import init_methods, quantization
from emotune.model.lora import attach_lora, check_targets
from test_quantization import CPU, _quantized


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _best_rank(matrix: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    return u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def _start(layer) -> torch.Tensor:
    """What the adapters add to a layer's weight at the start: scaling x B A."""
    return layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight


def test_loftq_over_an_unquantized_base_starts_at_the_best_rank_r_part_of_the_rounding_scaled(tiny_gemma3_64_dir):
    original = _load(tiny_gemma3_64_dir).model.layers[0].self_attn.q_proj.weight
    adapted = attach_lora(_load(tiny_gemma3_64_dir), LoraSettings(r=4, alpha=16, dropout=0.0, init="loftq"))
    layer = adapted.get_base_model().model.layers[0].self_attn.q_proj
    rounded = layer.base_layer.weight
    assert not torch.equal(rounded, original)  # PEFT's LoftQ rounded the base to NF4
    # alpha / r = 4: PEFT sets B A to that part itself, so unscaled the start would add it 4 times
    torch.testing.assert_close(_start(layer), _best_rank(original - rounded, 4), atol=1e-5, rtol=1e-4)


def test_loftq_over_a_4bit_base_starts_nearer_the_unquantized_model_and_trains(tiny_gemma3_64_dir):
    import bitsandbytes.functional as F

    original = _load(tiny_gemma3_64_dir).eval()
    # a fixed batch of 256 tokens: over 2x12 random tokens drawn from whatever state the process's generator is in,
    # the ratio below ranged 0.66-1.02 (300 draws); over 8x32 it ranged 0.73-0.85 (100 draws)
    ids = torch.randint(6, 40, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = original(input_ids=ids).logits
    plain = attach_lora(_quantized(tiny_gemma3_64_dir, quantization="4bit"), LoraSettings(r=8, alpha=16, dropout=0.0)).eval()
    loftq = attach_lora(_quantized(tiny_gemma3_64_dir, quantization="4bit"), LoraSettings(r=8, alpha=16, dropout=0.0, init="loftq"))
    layer = loftq.get_base_model().model.layers[1].mlp.down_proj
    weight = original.model.layers[1].mlp.down_proj.weight
    rounded = F.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).float()
    torch.testing.assert_close(_start(layer), _best_rank(weight - rounded, 8), atol=1e-5, rtol=1e-4)
    loftq.eval()
    with torch.no_grad():
        gap_plain = (plain(input_ids=ids).logits - want).abs().mean()
        gap_loftq = (loftq(input_ids=ids).logits - want).abs().mean()
    assert gap_loftq < 0.9 * gap_plain  # the quantized weights stay; the adapters make up part of their rounding
    loftq.train()
    losses = fixed_batch_losses(loftq)
    assert losses[-1] < losses[0] - 0.05


def test_loftq_runs_on_the_cpu_and_what_it_cannot_use_is_refused(tiny_gemma3_64_dir, tmp_path, monkeypatch):
    init_methods.check(LoraSettings(init="loftq"), ModelConfig(), CPU)  # bitsandbytes rounds to NF4 on the CPU
    init_methods.check(LoraSettings(init="loftq"), ModelConfig(quantization="4bit"), CPU, tiny_gemma3_64_dir)
    with pytest.raises(UserError, match="LoftQ over a quantized base .* is 4-bit only"):
        init_methods.check(LoraSettings(init="loftq"), ModelConfig(quantization="8bit"), CPU)
    binary = tmp_path / "binary"
    shutil.copytree(tiny_gemma3_64_dir, binary)
    (binary / "model.safetensors").rename(binary / "pytorch_model.bin")
    with pytest.raises(UserError, match="reads the original weights from safetensors files, and .* has no model.safetensors"):
        init_methods.check(LoraSettings(init="loftq"), ModelConfig(quantization="4bit"), CPU, binary)
    monkeypatch.setattr(quantization.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="rounds the weights to NF4 with bitsandbytes, and the bitsandbytes package is not installed"):
        init_methods.check(LoraSettings(init="loftq"), ModelConfig(), CPU)


def test_loftq_over_a_4bit_base_refuses_weights_stored_under_other_names(tiny_gemma3_64_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_gemma3_64_dir)
    settings, four_bit = LoraSettings(init="loftq"), ModelConfig(quantization="4bit")
    check_targets(settings, config, tiny_gemma3_64_dir, four_bit)
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_gemma3_64_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in tensors.items()}, renamed / "model.safetensors")
    with pytest.raises(UserError, match=r"are not stored under their layer's name \(e.g. `model.layers.0.self_attn.q_proj.weight`"):
        check_targets(settings, config, renamed, four_bit)
    check_targets(settings, config, renamed, ModelConfig())  # PEFT's own LoftQ rounds the loaded weights: no file read


@pytest.mark.slow
def test_a_4bit_loftq_run_saves_its_adapter_as_trained_for_the_4bit_base(tiny_overrides, tiny_gemma3_64_dir, tmp_path,
                                                                         capsys):
    overrides = [*tiny_overrides, f"model.source={tiny_gemma3_64_dir}", "model.quantization=4bit", "lora.init=loftq",
                 "lora.r=4", "train.max_steps=4", "eval.method=score"]
    assert main(["run", *overrides]) == 0
    assert "LoRA initialised by LoftQ over the 4-bit base" in capsys.readouterr().out
    run = tmp_path / "runs" / "tiny"
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 4  # not converted (2r)
    assert not (run / "train" / "initial_adapter").exists()
    assert main(["eval", *overrides, f"adapter={run}"]) == 0  # the saved adapter, read back over the 4-bit base
    trained = json.loads((run / "finetuned" / "metrics.json").read_text())["log_loss"]
    read_back = json.loads((run / "eval" / "test-finetuned" / "metrics.json").read_text())["log_loss"]
    assert read_back == pytest.approx(trained, abs=1e-4)
