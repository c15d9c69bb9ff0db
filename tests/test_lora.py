"""LoRA options, `all-linear` restricted to the language model of multimodal checkpoints, and Gemma's
RMSNorm computing in fp32 under half precision."""

from __future__ import annotations

import pytest
import torch

from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model.lora import attach_lora, language_model_linear_targets


def _tiny_gemma3(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _tiny_gemma4_multimodal():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=300, max_position_embeddings=256, sliding_window=32,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, boi_token_id=290, eoi_token_id=291,
                          image_token_id=292, video_token_id=293, boa_token_id=294, eoa_token_index=295, audio_token_id=296)
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(config)


class _VisionTowerWithoutTimm(torch.nn.Module):
    """Stands in for Gemma 3n's vision tower, which transformers builds with `timm.create_model` (MobileNetV5).
    timm imports torchvision, and PyPI's torchvision wheels link against CUDA torch (`libtorch_cuda.so`), so
    they do not load next to the CPU build of torch the tests run on. Same module names as the real
    tower (`timm_model.*`), with a linear layer that `all-linear` must leave alone."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.timm_model = torch.nn.ModuleDict({"conv_stem": torch.nn.Conv2d(3, 8, 3),
                                               "head": torch.nn.Linear(8, config.hidden_size)})


def _tiny_gemma3n_multimodal():
    """Real Gemma 3n text model and audio tower (Conformer) from tiny configs; only the vision tower is a stand-in."""
    from unittest import mock

    from transformers import AutoModel, Gemma3nConfig, Gemma3nForConditionalGeneration, Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    def from_config(config, **kwargs):
        if isinstance(config, Gemma3nVisionConfig):
            return _VisionTowerWithoutTimm(config)
        return AutoModel.from_config(config, **kwargs)

    text = dict(vocab_size=300, vocab_size_per_layer_input=300, hidden_size=32, hidden_size_per_layer_input=8,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                num_kv_shared_layers=0, laurel_rank=4, layer_types=["sliding_attention", "full_attention"],
                activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2)
    audio = dict(hidden_size=32, conf_num_hidden_layers=1, conf_num_attention_heads=2, sscp_conv_channel_size=[8, 4])
    vision = dict(hidden_size=32)
    config = Gemma3nConfig(text_config=text, vision_config=vision, audio_config=audio)
    torch.manual_seed(0)
    with mock.patch.object(modeling_gemma3n, "AutoModel", mock.Mock(from_config=from_config)):
        return Gemma3nForConditionalGeneration(config)


def _adapted_modules(model) -> list[str]:
    return [name for name, module in model.named_modules() if hasattr(module, "lora_A") and name]


@pytest.mark.parametrize("build", [_tiny_gemma4_multimodal, _tiny_gemma3n_multimodal], ids=["gemma4", "gemma3n"])
def test_all_linear_adapts_the_language_model_only(build):
    model = build()
    towers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "language_model" not in n]
    assert any("vision" in n for n in towers) and any("audio" in n for n in towers)  # the towers are there to avoid
    language_linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".language_model." in n}
    adapted = attach_lora(model, LoraSettings(target_modules="all-linear"))
    names = _adapted_modules(adapted)
    assert names and all(".language_model." in n for n in names)
    assert not any(n.endswith("lm_head") or "vision" in n or "audio" in n for n in names)
    assert {n.removeprefix("base_model.model.") for n in names} == language_linears  # and all of it


def test_all_linear_on_a_text_model_matches_every_decoder_linear(tiny_model_dir):
    model = _tiny_gemma3(tiny_model_dir)
    pattern = language_model_linear_targets(model)
    assert pattern.startswith("^model\\.")
    adapted = attach_lora(model, LoraSettings())
    assert len(_adapted_modules(adapted)) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)


def test_all_linear_and_layers_on_gpt2_conv1d(tiny_gpt2_dir):
    """GPT-2's projections are transformers' Conv1D and its decoder layers are `transformer.h`: `all-linear` adapts
    the four per block (not the tied output layer), and `lora.layers` finds the blocks by their count."""
    from transformers import AutoModelForCausalLM

    def build():
        return AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32)

    every = _adapted_modules(attach_lora(build(), LoraSettings()))
    assert {n.split(".", 3)[-1] for n in every} == {"h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc",
                                                   "h.0.mlp.c_proj", "h.1.attn.c_attn", "h.1.attn.c_proj",
                                                   "h.1.mlp.c_fc", "h.1.mlp.c_proj"}
    top = _adapted_modules(attach_lora(build(), LoraSettings(layers=[1])))
    assert len(top) == 4 and all(".transformer.h.1." in n for n in top)


def test_rslora_dora_and_modules_to_save(tiny_model_dir, capsys):
    plain = attach_lora(_tiny_gemma3(tiny_model_dir), LoraSettings(r=4, alpha=8))
    stable = attach_lora(_tiny_gemma3(tiny_model_dir), LoraSettings(r=4, alpha=8, use_rslora=True))
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert plain.get_submodule(q).scaling["default"] == pytest.approx(8 / 4)
    assert stable.get_submodule(q).scaling["default"] == pytest.approx(8 / 4**0.5)

    dora = attach_lora(_tiny_gemma3(tiny_model_dir), LoraSettings(r=4, use_dora=True, modules_to_save=["lm_head"]))
    trainable = [n for n, p in dora.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in trainable)
    assert any("lm_head" in n and "modules_to_save" in n for n in trainable)
    assert "rsLoRA" in capsys.readouterr().out


def test_targets_that_match_nothing_are_a_clear_error(tiny_model_dir):
    with pytest.raises(UserError, match="lora.target_modules"):
        attach_lora(_tiny_gemma3(tiny_model_dir), LoraSettings(target_modules=["no_such_proj"]))


@pytest.mark.parametrize("module", ["gemma3.modeling_gemma3.Gemma3RMSNorm", "gemma3n.modeling_gemma3n.Gemma3nRMSNorm",
                                    "gemma4.modeling_gemma4.Gemma4RMSNorm"])
def test_gemma_rmsnorm_computes_in_fp32_under_fp16(module):
    """Squaring 300 overflows fp16 (max 65504); transformers' Gemma norms upcast, so no extra upcast is needed."""
    import importlib

    path, name = module.rsplit(".", 1)
    norm = getattr(importlib.import_module(f"transformers.models.{path}"), name)(8).half()
    out = norm(torch.full((2, 8), 300.0, dtype=torch.float16))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.isinf(torch.full((2, 8), 300.0, dtype=torch.float16).pow(2).sum())  # the overflow it avoids
