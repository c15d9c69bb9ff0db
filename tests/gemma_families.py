"""The Gemma families' tiny random models (Gemma 4 text, MoE and multimodal; Gemma 3 text and multimodal; Gemma 3n),
split from tests/families.py, which imports them from here; its docstring says how every builder is scaled."""

from __future__ import annotations

WINDOW = 8  # sliding window, scaled from 512 (Gemma 3/3n/4) and 2,047 (Phi-3-mini)


def ids(tokenizer) -> dict:
    return dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


def _text_gemma4_e4b(vocab: int, ids: dict) -> dict:
    # google/gemma-4-E4B-it config.json text_config (as bench/gpu_check.py's E4B_TEXT): hidden 2,560, 42 layers
    # (5 sliding : 1 full), the last 18 sharing earlier layers' keys/values, 8 heads / 2 KV heads, head dim 256
    # sliding / 512 full, per-layer inputs 256, intermediate 10,240, soft-cap 30, tied embeddings.
    # Scaled: hidden 64, 6 layers (2 sliding : 1 full, the last 2 shared), head dim 16 / 32, per-layer 8.
    return dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, intermediate_size=128,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                hidden_size_per_layer_input=8, num_kv_shared_layers=2, sliding_window=WINDOW,
                max_position_embeddings=512, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, **ids)


def _text_gemma4_e2b(vocab: int, ids: dict) -> dict:
    # google/gemma-4-E2B-it config.json text_config: hidden 1,536, 35 layers (4 sliding : 1 full), the last 20
    # shared, 8 heads / 1 KV head, head dim 256 / 512, per-layer inputs 256, intermediate 6,144 with the double-wide
    # MLP in the shared layers, soft-cap 30, tied embeddings. Scaled: hidden 48, 5 layers (the last 2 shared).
    return dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=48, intermediate_size=96,
                num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                sliding_window=WINDOW, max_position_embeddings=512, final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                             "full_attention"], **ids)


def gemma4_text(tokenizer, variant: str = "e4b"):
    """Gemma 4's text class (`Gemma4ForCausalLM`, what a text-only `gemma4_text` checkpoint loads as)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    text = (_text_gemma4_e4b if variant == "e4b" else _text_gemma4_e2b)(len(tokenizer), ids(tokenizer))
    return Gemma4ForCausalLM(Gemma4TextConfig(**text))


def gemma4_moe(tokenizer):
    """google/gemma-4-26B-A4B-it config.json text_config: hidden 2,816, 30 layers (5 sliding : 1 full), 16 heads / 8 KV
    heads (2 for full attention, keys reused as values), head dim 256 / 512, a dense MLP (intermediate 2,112) beside
    128 routed experts (8 per token, intermediate 704) whose router holds its projection as a linear layer (`router.proj`),
    no per-layer inputs or shared KV layers, soft-cap 30, tied embeddings. Scaled: hidden 64, 4 layers (3 : 1), 8
    experts (2 per token)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
        top_k_experts=2, enable_moe_block=True, attention_k_eq_v=True, num_global_key_value_heads=1,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW, max_position_embeddings=512,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], **ids(tokenizer)))


def gemma4_multimodal(tokenizer, variant: str = "e4b"):
    """`Gemma4ForConditionalGeneration`, the class `AutoModelForCausalLM` loads the released E4B/E2B as: the text
    model above inside the wrapper, with a vision tower and an audio tower (tiny; released: SigLIP-style vision of 16
    layers, Conformer audio of 12)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vocab = len(tokenizer)
    text = (_text_gemma4_e4b if variant == "e4b" else _text_gemma4_e2b)(vocab, ids(tokenizer))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    # the multimodal special tokens are ids past the text vocabulary's words, as the released ones (255,999+) are
    specials = dict(boi_token_id=vocab - 7, eoi_token_id=vocab - 6, image_token_id=vocab - 5, video_token_id=vocab - 4,
                    boa_token_id=vocab - 3, eoa_token_index=vocab - 2, audio_token_id=vocab - 1)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, tie_word_embeddings=True,
                          **specials)
    return Gemma4ForConditionalGeneration(config)


def _text_gemma3(vocab: int, ids: dict) -> dict:
    # google/gemma-3-1b-it config.json: hidden 1,152, intermediate 6,912, 26 layers (5 sliding : 1 full), 4 heads /
    # 1 KV head, head dim 256, query_pre_attn_scalar 256 (= head dim), sliding window 512, RoPE 1e6 global / 1e4
    # local, no final soft-cap, tied embeddings. Scaled: hidden 64, 6 layers, head dim 16.
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                layer_types=["sliding_attention"] * 5 + ["full_attention"], **ids)


def gemma3_text(tokenizer):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_text_gemma3(len(tokenizer), ids(tokenizer))))


def gemma3_multimodal(tokenizer):
    """google/gemma-3-4b-it config.json: `Gemma3ForConditionalGeneration`, text hidden 2,560, 34 layers, 8 heads /
    4 KV heads, RoPE scaled linearly by 8 on the full layers; SigLIP vision (27 layers, 896 px, 256 tokens per
    image). Scaled: the 1B-shaped text above with 4 KV heads' grouping kept at 2, a 1-layer SigLIP of 4 patches."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vocab = len(tokenizer)
    text = {**_text_gemma3(vocab, ids(tokenizer)), "num_key_value_heads": 2,
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=vocab - 3,
                          eoi_token_index=vocab - 2, image_token_index=vocab - 1, tie_word_embeddings=True)
    return Gemma3ForConditionalGeneration(config)


def gemma3n_multimodal(tokenizer):
    """google/gemma-3n-E2B-it config.json text_config: hidden 2,048, 30 layers (4 sliding : 1 full), the last 10
    sharing keys/values, 8 heads / 2 KV heads, head dim 256, AltUp with 4 inputs, LAuReL rank 64, activation
    sparsity 0.95 in the first 10 layers, per-layer inputs 256, soft-cap 30, tied embeddings. Scaled: hidden 64,
    5 layers (the last 2 shared, the first sparse), LAuReL rank 4. The audio tower is the real Conformer, tiny;
    the vision tower is a stand-in (transformers builds it with timm, whose torchvision does not load beside CPU
    torch: tests/test_lora.py)."""
    from unittest import mock

    from transformers import AutoModel, Gemma3nConfig, Gemma3nForConditionalGeneration, Gemma3nVisionConfig
    from transformers.models.gemma3n import modeling_gemma3n

    from test_lora import _VisionTowerWithoutTimm

    def from_config(config, **kwargs):
        if isinstance(config, Gemma3nVisionConfig):
            return _VisionTowerWithoutTimm(config)
        return AutoModel.from_config(config, **kwargs)

    vocab = len(tokenizer)
    text = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, hidden_size_per_layer_input=8,
                intermediate_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=4, sliding_window=WINDOW,
                final_logit_softcapping=30.0, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0, 0.0],
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                             "full_attention"], max_position_embeddings=512, **ids(tokenizer))
    audio = dict(hidden_size=32, conf_num_hidden_layers=1, conf_num_attention_heads=2, sscp_conv_channel_size=[8, 4])
    config = Gemma3nConfig(text_config=text, vision_config=dict(hidden_size=32), audio_config=audio)
    with mock.patch.object(modeling_gemma3n, "AutoModel", mock.Mock(from_config=from_config)):
        return Gemma3nForConditionalGeneration(config)
