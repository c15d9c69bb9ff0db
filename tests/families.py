"""Tiny random models of every family emotune is tested on, each keeping what changes the computation.

One builder per family. Each takes its values from the released checkpoint's config.json (named beside it) and
scales down only the sizes (hidden size, layers, heads, vocabulary, windows); every feature that changes the
arithmetic stays: Gemma 4's multimodal wrapper, final soft-cap 30, key/value-shared layers, per-layer inputs,
sliding and full layers with different head dims, proportional RoPE and tied embeddings; Gemma 3n's AltUp, LAuReL
and activation sparsity; Qwen3's query/key norms; Qwen2.5's qkv bias; Llama 3's RoPE scaling; Phi-3/4's fused qkv
and gate-up projections and partial rotary. Every model uses the suite's word-level tokenizer (conftest), whose
chat template is Gemma's: the template decides which tokens a row holds, not how the model computes on them.
The Gemma builders live in tests/gemma_families.py (imported here).

Sliding windows are scaled to a few tokens so that the suite's ~60-token prompts cross them. The final norm's
scale is set so that the logits spread as a trained checkpoint's do (a standard deviation of about `LOGIT_STD`,
largest values beyond Gemma's soft-cap of 30): random weights at initializer_range 0.02 give logits near 0, where
a soft-cap of 30 changes nothing and a wrong one would go unseen.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from gemma_families import (  # noqa: F401 (imported from here by the tests)
    WINDOW,
    gemma3_multimodal,
    gemma3_text,
    gemma3n_multimodal,
    gemma4_moe,
    gemma4_multimodal,
    gemma4_text,
)

LOGIT_STD = 12.0


def qwen3(tokenizer):
    """Qwen/Qwen3-0.6B config.json: hidden 1,024, 28 layers, 16 heads / 8 KV heads, head dim 128 (heads x head dim
    2,048 != hidden), per-head query/key RMSNorm, RoPE 1e6, tied embeddings. Scaled: hidden 64, 2 layers, head dim
    32 (4 x 32 = 128 != 64 kept)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       max_position_embeddings=512, **_ids(tokenizer)))


def qwen2_5(tokenizer):
    """Qwen/Qwen2.5-0.5B-Instruct config.json: hidden 896, 24 layers, 14 heads / 2 KV heads, bias on q/k/v, RoPE
    1e6, tied embeddings. Scaled: hidden 64, 2 layers, 4 heads / 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                        max_position_embeddings=512, **_ids(tokenizer)))


def llama3(tokenizer):
    """meta-llama/Llama-3.2-1B-Instruct config.json: hidden 2,048, 16 layers, 32 heads / 8 KV heads, head dim 64,
    RoPE 500,000 with `llama3` scaling (factor 32, low/high frequency factors 1/4, original context 8,192), tied
    embeddings. Scaled: hidden 64, 2 layers, 4 heads / 2 KV heads; the RoPE scaling as released."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                        max_position_embeddings=512, **_ids(tokenizer)))


def mistral(tokenizer):
    """mistralai/Mistral-7B-Instruct-v0.3 config.json: hidden 4,096, 32 layers, 32 heads / 8 KV heads, RoPE 1e6,
    no sliding window, separate output weights. Scaled: hidden 64, 2 layers, 4 heads / 2 KV heads."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            rope_theta=1_000_000.0, sliding_window=None, rms_norm_eps=1e-5,
                                            tie_word_embeddings=False, max_position_embeddings=512, **_ids(tokenizer)))


def phi3_mini(tokenizer):
    """microsoft/Phi-3-mini-4k-instruct config.json: hidden 3,072, 32 layers, 32 heads = 32 KV heads, fused qkv_proj
    and gate_up_proj, sliding window 2,047, separate output weights. Scaled: hidden 64, 2 layers, 4 heads, window 8."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      sliding_window=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      max_position_embeddings=512, original_max_position_embeddings=512,
                                      **_ids(tokenizer)))


def phi4_mini(tokenizer):
    """microsoft/Phi-4-mini-instruct config.json: hidden 3,072, 32 layers, 24 heads / 8 KV heads, fused qkv_proj and
    gate_up_proj, partial rotary 0.75, tied embeddings. Scaled: hidden 96, 2 layers, 6 heads / 2 KV heads."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                      partial_rotary_factor=0.75, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      max_position_embeddings=512, original_max_position_embeddings=512,
                                      **_ids(tokenizer)))


def granite(tokenizer):
    """ibm-granite/granite-3.3-2b-instruct config.json: hidden 2,048, 40 layers, 32 heads / 8 KV heads, embeddings
    times 12, residual branches times 0.22, attention scale 1/64 and logits divided by 8 after the output layer, tied
    embeddings. Scaled: hidden 64, 2 layers, 4 heads / 2 KV heads; the multipliers as released."""
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            embedding_multiplier=12.0, residual_multiplier=0.22,
                                            attention_multiplier=0.015625, logits_scaling=8.0, rms_norm_eps=1e-5,
                                            tie_word_embeddings=True, max_position_embeddings=512, **_ids(tokenizer)))


def cohere(tokenizer):
    """CohereForAI/aya-23-8B config.json (Command R's architecture): hidden 4,096, 32 layers, 32 heads / 8 KV heads,
    parallel attention and MLP after one LayerNorm, logits times 0.0625 after the output layer, tied embeddings.
    Scaled: hidden 64, 2 layers, 4 heads / 2 KV heads; the logit scale as released."""
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          logit_scale=0.0625, use_qk_norm=False, tie_word_embeddings=True,
                                          max_position_embeddings=512, **_ids(tokenizer)))


def llama4_text(tokenizer):
    """meta-llama/Llama-4-Scout-17B-16E-Instruct config.json text_config, as `Llama4ForCausalLM`: hidden 5,120, 48
    layers, 40 heads / 8 KV heads, head dim 128, chunked attention (8,192) in the RoPE layers and full attention
    without RoPE in every 4th, query/key norms, 16 routed experts (1 per token) beside a shared one in every layer,
    untied. Scaled: hidden 64, 2 layers (chunked + RoPE, full + no RoPE), chunks of `WINDOW`, 2 experts."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64,
                                              intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                              num_experts_per_tok=1, interleave_moe_layer_step=1,
                                              no_rope_layers=[1, 0], attention_chunk_size=WINDOW, use_qk_norm=True,
                                              tie_word_embeddings=False, max_position_embeddings=512,
                                              **_ids(tokenizer)))


def qwen2_5_vl(tokenizer):
    """Qwen/Qwen2.5-VL-3B-Instruct config.json, `Qwen2_5_VLForConditionalGeneration` (transformers maps it to
    AutoModelForImageTextToText only, not AutoModelForCausalLM): text hidden 2,048, 36 layers, 16 heads / 2 KV heads,
    multimodal RoPE 1e6 with mrope_section [16, 24, 24] (temporal, height, width: text alone gets one position on all
    three), tied embeddings; a windowed ViT (32 blocks of 1,280, full attention in blocks 7/15/23/31, patches of 14
    merged 2x2). Scaled: text hidden 64, 2 layers, 4 heads / 2 KV heads, head dim 16 with mrope_section [2, 3, 3];
    a 2-block ViT of 32."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = len(tokenizer)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters=rope, rms_norm_eps=1e-6, max_position_embeddings=512,
                tie_word_embeddings=True, **_ids(tokenizer))
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1])
    # the multimodal special tokens are ids past the text vocabulary's words, as the released ones (151,652+) are
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab - 1,
                              video_token_id=vocab - 2, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4,
                              tie_word_embeddings=True)
    return Qwen2_5_VLForConditionalGeneration(config)


def gpt2(tokenizer):
    """openai-community/gpt2 config.json: n_embd 768, 12 layers, 12 heads, a learned position table of 1,024,
    transformers' Conv1D projections (weights stored transposed: PEFT's `fan_in_fan_out`) with q/k/v fused in `c_attn`,
    tied embeddings, dropout 0.1. Scaled: n_embd 64, 2 layers, 4 heads; dropout 0 so that training is deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_ids(tokenizer)))


def pythia(tokenizer):
    """EleutherAI/pythia-160m config.json (GPT-NeoX): hidden 768, 12 layers, 12 heads, q/k/v fused in
    `query_key_value`, rotary on 25% of each head (rotary_pct 0.25), parallel attention and MLP residuals, untied.
    Scaled: hidden 64, 2 layers, 4 heads."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.25,
                                            use_parallel_residual=True, tie_word_embeddings=False,
                                            max_position_embeddings=512, **_ids(tokenizer)))


def falcon(tokenizer, alibi: bool):
    """tiiuae/falcon-rw-1b config.json (`alibi`): hidden 2,048, 24 layers, 32 heads, ALiBi position biases (counted from
    the attention mask), biases on every projection, q/k/v fused, sequential attention and MLP. tiiuae/falcon-7b:
    hidden 4,544, 32 layers, 71 heads sharing one key/value head (multi_query), rotary, parallel attention and MLP, no
    biases. Scaled: hidden 64, 2 layers, 4 heads."""
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, alibi=alibi, bias=alibi, multi_query=not alibi,
                                          parallel_attn=not alibi, new_decoder_architecture=False,
                                          max_position_embeddings=512, **_ids(tokenizer)))


def bloom(tokenizer):
    """bigscience/bloom-560m config.json: hidden 1,024, 24 layers, 16 heads, ALiBi (its forward takes no position
    ids), a LayerNorm on the embeddings, q/k/v fused, tied. Scaled: hidden 64, 2 layers, 4 heads."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=64, n_layer=2, n_head=4,
                                        **_ids(tokenizer)))


def olmo2(tokenizer):
    """allenai/OLMo-2-0425-1B-Instruct config.json: hidden 2,048, 16 layers, 16 heads, RMSNorm after attention and
    MLP (not before), query/key RMSNorm over the whole projection, RoPE 500,000, untied. Scaled: hidden 64, 2 layers."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        rope_theta=500_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                        max_position_embeddings=512, **_ids(tokenizer)))


def lfm2(tokenizer):
    """LiquidAI/LFM2-350M's text config: hidden 1,024, 16 layers of which 10 are gated short convolutions (`conv`,
    kernel conv_L_cache 3) and 6 grouped-query attention (16 heads / 8 KV heads), the schedule conv, conv,
    full_attention, ...; SwiGLU 6,656 (block_multiple_of 256), RMSNorm 1e-5, RoPE 1,000,000, tied. Scaled: hidden 64,
    the schedule's first 3 layers (conv, conv, full_attention), heads 4 / 2. The convolutions carry a state from token
    to token: label scoring and training run whole rows (emotune.model.prefix.other_layers)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM(Lfm2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      layer_types=["conv", "conv", "full_attention"], conv_L_cache=3,
                                      block_multiple_of=16, norm_eps=1e-5, max_position_embeddings=512,
                                      tie_word_embeddings=True, **_ids(tokenizer)))


def mamba(tokenizer):
    """state-spaces/mamba-130m-hf config.json: hidden 768, 24 Mamba (selective state-space) blocks, no attention,
    state 16, expand 2, convolution kernel 4, RMSNorm 1e-5, tied. Scaled: hidden 64, 2 blocks, state 8. PEFT refuses
    LoRA on its `out_proj` and its mixer reads `x_proj` and `dt_proj` weights directly, so `all-linear` adapts `in_proj`
    (emotune.model.lora.MAMBA_SKIPPED);
    its forward takes no positions: whole rows."""
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, state_size=8,
                                        expand=2, conv_kernel=4, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                                        **_ids(tokenizer)))


def gemma2(tokenizer):
    """google/gemma-2-2b-it config.json: hidden 2,304, 26 layers alternating sliding (4,096) and full, 8 heads / 4 KV
    heads, head dim 256, attention logits soft-capped at 50 and final logits at 30 (transformers runs it eager: sdpa
    has no soft-cap), tied. Scaled: hidden 64, 2 layers, head dim 16, window 16 (more than the padding of a batch: a
    padded position that sees no key is NaN in the float64 reference)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, query_pre_attn_scalar=16, sliding_window=2 * WINDOW,
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                          max_position_embeddings=512, **_ids(tokenizer)))


def smollm3(tokenizer):
    """HuggingFaceTB/SmolLM3-3B config.json: hidden 2,048, 36 layers, 16 heads / 4 KV heads, every 4th layer without
    RoPE (NoPE, no_rope_layer_interval 4), RoPE 5e6, tied. Scaled: hidden 64, 4 layers (the last one NoPE)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return SmolLM3ForCausalLM(SmolLM3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                            no_rope_layer_interval=4, tie_word_embeddings=True,
                                            max_position_embeddings=512, **_ids(tokenizer)))


def qwen3_moe(tokenizer):
    """Qwen/Qwen3-30B-A3B config.json: hidden 2,048, 48 layers, 32 heads / 4 KV heads, head dim 128, 128 routed experts
    (8 per token, weights renormalised) in every layer, kept by transformers 5 as fused 3-D parameters, untied.
    Scaled: hidden 64, 2 layers, 4 experts (2 per token)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=True, tie_word_embeddings=False,
                                              max_position_embeddings=512, **_ids(tokenizer)))


def qwen2_moe(tokenizer):
    """Qwen/Qwen1.5-MoE-A2.7B-Chat config.json: hidden 2,048, 24 layers, 16 heads, 60 routed experts (4 per token, not
    renormalised; transformers 5 keeps them as fused 3-D weights) beside one shared expert (intermediate 5,632) behind
    a sigmoid gate, untied. Its shared expert's linear layers are named `gate_proj`, `up_proj` and `down_proj`, which PEFT
    reads as transformers 4's expert layers (emotune.model.lora.peft_renames). Scaled: hidden 64, 2 layers, 4 experts
    (2 per token), shared expert 64."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                              tie_word_embeddings=False, max_position_embeddings=512, **_ids(tokenizer)))


def phi2(tokenizer):
    """microsoft/phi-2 config.json: hidden 2,560, 32 layers, 32 heads, parallel attention and MLP after one LayerNorm,
    rotary on 40% of each head, biases, untied, residual dropout 0.1. Scaled: hidden 64, 2 layers, 4 heads, dropout 0."""
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
                                    num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.4,
                                    resid_pdrop=0.0, tie_word_embeddings=False, max_position_embeddings=512,
                                    **_ids(tokenizer)))


FAMILIES: dict[str, Callable] = {
    "gemma4-e4b": gemma4_multimodal,
    "gemma4-e2b": lambda tokenizer: gemma4_multimodal(tokenizer, "e2b"),
    "gemma4-text": gemma4_text,
    "gemma3-1b": gemma3_text,
    "gemma3-4b": gemma3_multimodal,
    "gemma3n": gemma3n_multimodal,
    "qwen3": qwen3,
    "qwen2.5": qwen2_5,
    "llama3": llama3,
    "mistral": mistral,
    "phi3": phi3_mini,
    "phi4": phi4_mini,
}
# Beyond the matrix: families with one thing the matrix lacks, each checked on the paths it changes
# (tests/test_equivalence.py): logits scaled after the output layer (Granite, Cohere), chunked attention and a
# `get_decoder()` that returns the causal model itself (Llama 4), a vision-language wrapper that only
# AutoModelForImageTextToText loads, with multimodal RoPE (Qwen2.5-VL).
MORE_FAMILIES: dict[str, Callable] = {"granite": granite, "cohere": cohere, "llama4-text": llama4_text,
                                      "qwen2.5-vl": qwen2_5_vl}
# Families users bring, each with what changes its arithmetic (the builders name it): checked like MORE_FAMILIES.
# Falcon-RW's and BLOOM's ALiBi counts positions from the attention mask, so they run whole rows (no shared prefix).
WHOLE_ROWS = {"falcon-rw", "bloom", "lfm2", "mamba"}
BROUGHT_FAMILIES: dict[str, Callable] = {
    "gpt2": gpt2, "pythia": pythia, "falcon-rw": lambda tokenizer: falcon(tokenizer, alibi=True),
    "falcon-7b": lambda tokenizer: falcon(tokenizer, alibi=False), "bloom": bloom, "olmo2": olmo2, "gemma2": gemma2,
    "smollm3": smollm3, "qwen3-moe": qwen3_moe, "phi2": phi2, "gemma4-moe": gemma4_moe, "lfm2": lfm2,
    "mamba": mamba, "qwen2-moe": qwen2_moe}
SOFT_CAPPED = {"gemma4-e4b", "gemma4-e2b", "gemma4-text", "gemma3n", "gemma2", "gemma4-moe"}


def _ids(tokenizer) -> dict:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


@cache
def _built(name: str, tokenizer_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = {**FAMILIES, **MORE_FAMILIES, **BROUGHT_FAMILIES}[name](tokenizer).float().eval()
    spread_logits(model, tokenizer)
    sharpen_attention(model)
    return model


def build(name: str, tokenizer_dir: Path):
    """A fresh copy of family `name`'s tiny model (float32, eval mode), built once per process."""
    return copy.deepcopy(_built(name, str(tokenizer_dir)))


def final_norm(model) -> torch.nn.Module:
    """The text model's last norm, before the output projection: `norm`, or GPT-2's and Falcon's `ln_f`, GPT-NeoX's
    `final_layer_norm`, Phi-2's `final_layernorm`, MPT's `norm_f`, LFM2's `embedding_norm` (run last, despite its name),
    RecurrentGemma's `final_norm`."""
    from emotune.model.text import language_model

    decoder = language_model(model)
    for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "embedding_norm", "final_norm"):
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return getattr(decoder, name)
    raise AttributeError(f"no final norm found in {type(decoder).__name__}")


@torch.no_grad()
def spread_logits(model, tokenizer) -> None:
    """Scale the final norm so that the logits' standard deviation is `LOGIT_STD` on a probe row. Gemma 1-3's norms
    multiply by (1 + weight), the others by weight."""
    probe = torch.tensor([tokenizer("i feel lonely today my friend was so happy")["input_ids"]])
    std = float(model(input_ids=probe).logits.float().std())
    norm = final_norm(model)
    factor = LOGIT_STD / std
    if type(norm).__name__ in {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "RecurrentGemmaRMSNorm"}:
        norm.weight.copy_((1 + norm.weight) * factor - 1)
    else:
        norm.weight.mul_(factor)


ATTENTION_SCALE = 30.0


@torch.no_grad()
def sharpen_attention(model) -> None:
    """Scale the query and key projections of a model with an attention soft-cap (Gemma 2: 50) by `ATTENTION_SCALE`
    each, so that attention logits reach past the cap as a trained model's do (~70; random weights give ~0.1, where a cap
    of 50 changes nothing and a path that lost it would go unseen)."""
    from emotune.model.text import text_config

    if not getattr(text_config(model.config), "attn_logit_softcapping", None):
        return
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj")):
            module.weight.mul_(ATTENTION_SCALE)
