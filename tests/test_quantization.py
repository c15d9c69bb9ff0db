"""QLoRA: a base quantized to 4 or 8 bits by bitsandbytes (on this CPU), LoRA and DoRA on top, k-bit preparation that
keeps embeddings in the compute dtype, refusals before any weight loads, LLaMA-Factory's quantization keys, and the
export that merges onto the unquantized base. Tiny random Gemma 3 models (conftest: tiny_model_dir)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import fixed_batch_losses
from emotune.cli import main
from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model import quantization
from emotune.model.loading import load_base
from emotune.model.lora import attach_lora, checkpoint_activations

pytest.importorskip("bitsandbytes")
CPU = torch.device("cpu")


@pytest.fixture
def tiny_model_dir(tiny_gemma3_64_dir):
    return tiny_gemma3_64_dir


@pytest.fixture
def tiny_overrides(tiny_overrides, tiny_model_dir):
    return [*tiny_overrides, f"model.source={tiny_model_dir}"]


def _quantized(tiny_model_dir, precision: str = "fp32", **model):
    base = load_base(ModelConfig(source=str(tiny_model_dir), **model), CPU, precision)
    quantization.prepare_for_training(base.model)
    return base.model


def test_bitsandbytes_config_follows_the_model_section():
    q = quantization.bnb_config(ModelConfig(quantization="4bit", quant_type="fp4", double_quant=False), torch.bfloat16)
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.bnb_4bit_compute_dtype) == (
        True, "fp4", False, torch.bfloat16)
    assert quantization.bnb_config(ModelConfig(quantization="8bit"), torch.float32).load_in_8bit
    assert quantization.bnb_config(ModelConfig(), torch.float32) is None


@pytest.mark.parametrize("setting", [{"quantization": "4bit"}, {"quantization": "4bit", "quant_type": "fp4"},
                                     {"quantization": "8bit"}])
@pytest.mark.parametrize("dora", [False, True])
def test_lora_and_dora_train_on_a_quantized_base(tiny_model_dir, setting, dora):
    import bitsandbytes as bnb

    if dora and setting["quantization"] == "8bit":  # refused on the CPU, before loading
        with pytest.raises(UserError, match="DoRA .* over 8-bit layers fails on the CPU"):
            quantization.check(ModelConfig(**setting), tiny_model_dir, CPU, torch.float32, use_dora=True)
        return
    model = _quantized(tiny_model_dir, **setting)
    layer = bnb.nn.Linear4bit if setting["quantization"] == "4bit" else bnb.nn.Linear8bitLt
    assert sum(isinstance(m, layer) for m in model.modules()) == 14  # 7 projections x 2 layers
    adapted = attach_lora(model, LoraSettings(r=4, use_dora=dora))
    checkpoint_activations(adapted)
    losses = fixed_batch_losses(adapted)
    assert losses[-1] < losses[0] - 0.05


def test_kbit_preparation_keeps_embeddings_in_the_compute_dtype_and_norms_in_fp32(tiny_model_dir):
    model = _quantized(tiny_model_dir, "bf16", quantization="4bit")
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16  # PEFT's preparation would make it fp32
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(p.dtype == torch.float32 for p in norms)
    assert not any(p.requires_grad for p in model.parameters())
    quantized = [p for p in model.parameters() if not p.is_floating_point()]
    assert quantized and all(p.dtype == torch.uint8 for p in quantized)


# --------------------------------------------------------------------------------------------------
# Refused before loading


def test_missing_bitsandbytes_is_refused_with_what_to_install(tiny_model_dir, monkeypatch):
    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(quantization.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(UserError, match=r"model.quantization=4bit cannot be used here: the bitsandbytes package is not "
                                        r"installed: pip install 'bitsandbytes>=0.50.2'"):
        quantization.check(ModelConfig(quantization="4bit"), tiny_model_dir, CPU, torch.float32)


def test_a_device_the_library_does_not_cover_is_refused(tiny_model_dir, monkeypatch):
    import bitsandbytes.functional as F

    def no_kernel(*args, **kwargs):
        raise RuntimeError("HIP error: invalid device function")

    monkeypatch.setattr(F, "quantize_4bit", no_kernel)
    with pytest.raises(UserError, match=r"cannot run 4-bit kernels on CPU \(RuntimeError: HIP error: invalid device "
                                        r"function\).*upgrade bitsandbytes"):
        quantization.check(ModelConfig(quantization="4bit"), tiny_model_dir, CPU, torch.float32)


def test_mps_and_an_already_quantized_folder_are_refused_together(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(UserError) as err:
        quantization.check(ModelConfig(quantization="8bit"), tmp_path, torch.device("mps"), torch.float32)
    assert "no Apple MPS backend" in str(err.value) and "quantized already (gptq)" in str(err.value)


def test_run_is_refused_before_the_run_folder_exists(tiny_overrides, tmp_path, monkeypatch, capsys):
    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(quantization.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    assert main(["run", *tiny_overrides, "model.quantization=4bit"]) == 2
    assert "bitsandbytes package is not installed" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "tiny").exists()


def test_quantization_values_are_checked_by_the_config():
    from emotune.core.config.load import load_config

    with pytest.raises(UserError, match="model.quantization"):
        load_config(None, ["model.quantization=3bit"])


# --------------------------------------------------------------------------------------------------
# End to end: run, evaluate unmerged, export merged onto the unquantized base


@pytest.mark.slow
def test_a_4bit_run_trains_evaluates_and_exports_merged_onto_the_unquantized_base(tiny_overrides, tmp_path, capsys):
    overrides = [*tiny_overrides, "model.quantization=4bit", "train.gradient_checkpointing=true", "train.max_steps=6"]
    assert main(["run", *overrides]) == 0
    run = tmp_path / "runs" / "tiny"
    info = json.loads((run / "run.json").read_text())
    assert info["status"] == "finished" and info["quantization"].startswith("4-bit NF4 + double quantization")
    history = json.loads((run / "train" / "log_history.json").read_text())
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert losses[-1] < losses[0]
    merge = json.loads((run / "finetuned" / "metrics.json").read_text()).get("merge", {})
    assert merge.get("merged") is False and "quantized" in merge.get("note", "")

    out = tmp_path / "export"
    assert main(["export", str(run), "--merge", "--out", str(out), "--dtype", "float32"]) == 0
    record = json.loads((out / "merged" / "emotune_merge.json").read_text())
    assert record["parity_max_abs_logit_diff"] < 1e-4  # merged == adapter on the unquantized base
    assert record["quantized_base_max_abs_logit_diff"] > 1e-4  # the 4-bit base differs, and it is said
    assert "Merged onto the unquantized base" in capsys.readouterr().out
    config = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain full-precision model


# --------------------------------------------------------------------------------------------------
# Optimizers: 8-bit AdamW, paged (GPU only), LoRA+


def test_adamw_8bit_keeps_8bit_state_and_trains_on_the_cpu(tiny_model_dir):
    from emotune.core.config.train import TrainConfig
    from emotune.train.optim import build_optimizer

    adapted = attach_lora(_quantized(tiny_model_dir, quantization="4bit"), LoraSettings(r=64))  # 4,096-entry A matrices
    optimizer = build_optimizer(TrainConfig(optim="adamw_8bit", learning_rate=1e-2), adapted)
    assert type(optimizer).__name__ == "AdamW8bit"
    losses = fixed_batch_losses(adapted, optimizer=optimizer)
    assert losses[-1] < losses[0] - 0.05
    states = [s for s in optimizer.state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # bitsandbytes' blockwise 8-bit moments


def test_paged_adamw_8bit_is_refused_off_the_gpu():
    from emotune.core.config.train import TrainConfig
    from emotune.train.optim import check

    with pytest.raises(UserError, match="paged_adamw_8bit pages optimizer state .* set train.optim=adamw_8bit"):
        check(TrainConfig(optim="paged_adamw_8bit"), CPU)
    check(TrainConfig(optim="adamw_8bit"), CPU)


def test_paged_adamw_32bit_is_bitsandbytes_paged_optimizer_and_refused_off_the_gpu():
    """The QLoRA paper's `paged_adamw_32bit` (TRL notebooks', LLaMA-Factory's and Axolotl's examples) was refused by
    the config; it is bitsandbytes' PagedAdamW32bit, with the AdamW settings, and GPU-only as the 8-bit one."""
    import bitsandbytes as bnb

    from emotune.core.config.train import TrainConfig
    from emotune.train.optim import check, optimizer_class

    cls, settings = optimizer_class(TrainConfig(optim="paged_adamw_32bit", adam_beta2=0.95))
    assert cls is bnb.optim.PagedAdamW32bit and settings["betas"] == (0.9, 0.95)
    with pytest.raises(UserError, match="paged_adamw_32bit pages optimizer state .* set train.optim=adamw_torch "
                                        r"\(the same 32-bit state, unpaged\)"):
        check(TrainConfig(optim="paged_adamw_32bit"), CPU)


def test_loraplus_gives_the_b_matrices_the_ratio(tiny_model_dir, capsys):
    from emotune.core.config.train import TrainConfig
    from emotune.train.optim import build_optimizer

    adapted = attach_lora(_quantized(tiny_model_dir, quantization="4bit"), LoraSettings(r=4))
    optimizer = build_optimizer(TrainConfig(learning_rate=1e-3, loraplus_lr_ratio=16), adapted)
    rate = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    for name, param in adapted.named_parameters():
        if param.requires_grad:
            assert rate[id(param)] == pytest.approx(1.6e-2 if "lora_B" in name else 1e-3), name
    assert "LoRA+: learning rate 0.001 for the A matrices, 0.016 (x16)" in capsys.readouterr().out
    losses = fixed_batch_losses(adapted, optimizer=optimizer)
    assert losses[-1] < losses[0] - 0.05


def _gradients(tiny_model_dir, evaluate_first: bool, keep_layout: bool) -> dict[str, torch.Tensor]:
    from emotune.model.loading import load_model

    cfg = ModelConfig(source=str(tiny_model_dir), quantization="4bit")
    model = load_model(tiny_model_dir, torch.bfloat16, CPU, quantized=quantization.bnb_config(cfg, torch.bfloat16))
    if keep_layout:
        quantization.keep_trainable_layout(model)  # what load_base does
    torch.manual_seed(1)
    ids = torch.randint(6, 40, (2, 12))
    if evaluate_first:  # an evaluation (eval mode, no grad) before training, as a run's baseline
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)
    adapted = attach_lora(model, LoraSettings(r=4, dropout=0.0))
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # non-zero, so the lower layers' A matrices get gradients too
    adapted.train()
    adapted(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float() for n, p in adapted.named_parameters() if p.grad is not None}


def test_gradients_after_an_evaluation_are_those_of_a_fresh_model(tiny_model_dir):
    """bitsandbytes repacks 4-bit weights for a faster CPU inference kernel (AVX512-BF16 CPUs) at the first eval-mode
    forward, and that kernel has no backward: training after the baseline evaluation got wrong gradients."""
    from bitsandbytes.functional import has_avx512bf16

    reference = _gradients(tiny_model_dir, evaluate_first=False, keep_layout=True)
    after_eval = _gradients(tiny_model_dir, evaluate_first=True, keep_layout=True)
    assert max((after_eval[k] - reference[k]).abs().max().item() for k in reference) == 0
    if has_avx512bf16():  # where bitsandbytes repacks, the layout is what made the difference
        unguarded = _gradients(tiny_model_dir, evaluate_first=True, keep_layout=False)
        assert max((unguarded[k] - reference[k]).abs().max().item() for k in reference) > 1e-2


@pytest.mark.slow
def test_importing_bitsandbytes_asks_no_hub_for_kernels(tmp_path):
    """bitsandbytes 0.50 asks the hub for a compiled CPU kernel at import (AVX512-BF16 CPUs), and PEFT imports it
    whenever it is installed; emotune's commands import it first with the hub offline."""
    import os
    import subprocess
    import sys

    script = """
import socket
asked = []
def record(host, *args, **kwargs):
    asked.append(host)
    raise OSError("no network in this test")
socket.getaddrinfo = record
from emotune.cli import process_defaults
process_defaults()
import huggingface_hub.constants as hub
import peft  # imports bitsandbytes
print(asked, hub.HF_HUB_OFFLINE)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["[]", "False"]  # no lookup, and the hub is online again for model downloads


def test_norms_in_fp32_hand_on_the_compute_dtype_in_llama_style_and_moe_models(tmp_path):
    """Llama's, Qwen's, Mistral's, OLMo's and SmolLM3's norms return `weight * x.to(input dtype)`, which the fp32 norm
    weight promoted to fp32: in bf16 the output layer (and a mixture-of-experts router and its 3-D experts) then
    multiplied fp32 activations by bf16 weights, and every 4-bit run of those families stopped with 'expected m1 and
    m2 to have the same dtype'. Gemma's norms cast back themselves, which is why the Gemma runs passed."""
    from conftest import build_tokenizer
    from families import qwen3_moe

    tokenizer = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    qwen3_moe(tokenizer).save_pretrained(tmp_path)
    model = _quantized(tmp_path, "bf16", quantization="4bit")
    assert {p.dtype for n, p in model.named_parameters() if "norm" in n} == {torch.float32}
    adapted = attach_lora(model, LoraSettings(r=4))
    ids = torch.randint(6, 40, (2, 12))
    loss = adapted(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32


def test_a_model_whose_linear_layers_are_subclasses_is_refused_before_loading(tmp_path):
    """transformers' bitsandbytes integration replaces layers whose type is exactly nn.Linear (and Conv1D): Falcon's
    are FalconLinear, so a 4-bit Falcon run quantized nothing and trained the base at full size, saying only '0 weights
    quantized'. Refused from config.json now, naming the layer class and model.quantization=none."""
    from conftest import build_tokenizer
    from families import falcon

    tokenizer = build_tokenizer(tmp_path)
    falcon(tokenizer, alibi=False).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="FalconLinear.*model.quantization=none"):
        quantization.check(ModelConfig(quantization="4bit"), tmp_path, CPU, torch.bfloat16)


def test_a_mixture_of_experts_base_says_its_routed_experts_stay_unquantized(tiny_model_dir, tmp_path, capsys):
    """bitsandbytes quantizes linear layers only, and transformers 5 keeps routed experts as 3-D weights: a 4-bit
    Qwen3-MoE (or Gemma 4 26B-A4B) keeps most of its parameters in the compute dtype. Said before loading, with how
    much; a dense model says nothing."""
    from conftest import build_tokenizer
    from families import qwen3_moe

    torch.manual_seed(0)
    qwen3_moe(build_tokenizer(tmp_path)).save_pretrained(tmp_path)
    quantization.check(ModelConfig(quantization="4bit"), tmp_path, CPU, torch.bfloat16)
    note = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM's routed experts (49,152 of its 110,016 parameters, 45%; 0.00 GiB" in note
    assert "stay unquantized" in note and "in bfloat16" in note
    quantization.check(ModelConfig(quantization="4bit"), tiny_model_dir, CPU, torch.bfloat16)
    assert "routed experts" not in capsys.readouterr().out


def test_a_router_holding_a_linear_layer_stays_unquantized(tiny_model_dir, tmp_path):
    """Gemma 4 26B-A4B's router holds its projection as a linear layer (`router.proj`), which a 4-bit load rounded to
    4 bits, changing which experts each token takes; it is kept in the compute dtype, with the output layer as before,
    while the attention and MLP layers are quantized. `emotune plan` counts it unquantized. A dense model's load keeps
    transformers' own list."""
    import bitsandbytes as bnb

    from conftest import build_tokenizer
    from emotune.model.loading import load_model
    from families import gemma4_moe

    torch.manual_seed(0)
    gemma4_moe(build_tokenizer(tmp_path)).save_pretrained(tmp_path)
    config = quantization.bnb_config(ModelConfig(quantization="4bit"), torch.float32, tmp_path)
    kept = set(config.llm_int8_skip_modules)  # transformers' own list, the routers added
    assert {"lm_head", *(f"model.layers.{i}.router" for i in range(4))} <= kept and not any("proj" in k for k in kept)
    model = load_model(tmp_path, torch.float32, CPU, quantized=config)
    layer = model.model.layers[0]
    assert type(layer.router.proj) is torch.nn.Linear and layer.router.proj.weight.dtype == torch.float32
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit) and isinstance(layer.mlp.down_proj, bnb.nn.Linear4bit)
    assert type(model.lm_head) is torch.nn.Linear
    assert layer.router.proj not in quantization._quantized_linears(model)
    dense = quantization.bnb_config(ModelConfig(quantization="4bit"), torch.float32, tiny_model_dir)
    assert dense.llm_int8_skip_modules is None
