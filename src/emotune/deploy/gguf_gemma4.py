"""Gemma 4's text model as llama.cpp's `gemma4` architecture: its hyperparameters, the `rope_freqs` tensor and the
configurations llama.cpp computes the same way as transformers.

Learned from llama.cpp's converter (conversion/gemma.py, Gemma4Model) and its graph (src/models/gemma4.cpp),
checked against transformers' Gemma 4 (models/gemma4/modeling_gemma4.py):
- Norms: Gemma4RMSNorm computes x * w (not Gemma 3's x * (1 + w)), as llama.cpp does, so weights go as they are.
  The value norm has no weight in either. Queries are not scaled (transformers' `scaling = 1.0`, llama.cpp's fixed
  attention scale 1.0).
- Two head sizes: full-attention layers use `global_head_dim` (written as attention.key_length), sliding layers
  `head_dim` (key_length_swa); the full layers' KV head count may differ too (`num_global_key_value_heads`), which
  becomes a per-layer head_count_kv array.
- RoPE: sliding layers rotate their whole head with the sliding base (rope.freq_base_swa). Full layers use
  "proportional" RoPE: only the first `partial_rotary_factor` of each half-head's frequencies turn, with exponents
  over the whole head size. llama.cpp rotates the whole head and divides each frequency by a `rope_freqs` factor,
  so the factors are 1 for the turning frequencies and 1e30 (an angle of ~0) for the rest.
- Shared KV layers: the last `num_kv_shared_layers` layers reuse the keys/values of the last earlier layer of their
  own type (transformers); llama.cpp hard-wires those producers as the two layers just before the shared block
  (sliding: the second to last, full: the last), so a model whose layer pattern puts them elsewhere is refused.
- Per-layer embeddings (PLE): `embed_tokens_per_layer` [vocab, layers * d] and its projection go as they are;
  llama.cpp applies the same scales (sqrt(d), 1/sqrt(hidden), 1/sqrt(2)) and reads one row per token of the main
  vocabulary, so both vocabularies must have the same size.
- `use_double_wide_mlp`: the shared layers' MLP is twice as wide, written as a per-layer feed_forward_length.
- `layer_scalar` (one number per layer multiplying its output) is llama.cpp's `layer_output_scale`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

SLIDING, FULL = "sliding_attention", "full_attention"
UNROTATED_FACTOR = 1e30  # divides a frequency to ~0: cos 1, sin 0, the dimension passes through unrotated


def _layers(config) -> list[str]:
    return list(config.layer_types)


def _layer(config, index: int):
    """One layer's resolved settings (transformers keeps head_dim and KV heads per layer for Gemma 4)."""
    return config.per_layer_config[index]


def head_dims(config) -> tuple[int, int]:
    """(full-attention head size, sliding head size)."""
    layers = _layers(config)
    full = next((i for i, t in enumerate(layers) if t == FULL), None)
    sliding = next((i for i, t in enumerate(layers) if t == SLIDING), None)
    full_dim = int(_layer(config, full).head_dim) if full is not None else None
    sliding_dim = int(_layer(config, sliding).head_dim) if sliding is not None else None
    return full_dim or sliding_dim, sliding_dim or full_dim


def _rope(config, layer_type: str) -> dict:
    return dict((config.rope_parameters or {}).get(layer_type) or {})


def layout_problems(config) -> list[str]:
    """What in this Gemma 4 text config llama.cpp's gemma4 graph would compute differently (empty: exportable)."""
    problems = []
    layers = _layers(config)
    if set(layers) - {SLIDING, FULL}:
        problems.append(f"layer types {sorted(set(layers) - {SLIDING, FULL})} (llama.cpp knows sliding and full attention)")
    if getattr(config, "enable_moe_block", False):
        problems.append("its mixture-of-experts blocks (enable_moe_block=true, as in the 26B-A4B), not written here")
    if getattr(config, "attention_bias", False):
        problems.append("attention biases (attention_bias=true), which llama.cpp's gemma4 graph has no place for")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        problems.append("bidirectional attention on text (use_bidirectional_attention=all); llama.cpp's is causal")
    if config.hidden_activation not in ("gelu_pytorch_tanh", "gelu_new"):
        problems.append(f"hidden_activation={config.hidden_activation} (llama.cpp uses tanh-approximated GELU)")
    if getattr(config, "hidden_size_per_layer_input", 0) and config.vocab_size_per_layer_input != config.vocab_size:
        problems.append(f"vocab_size_per_layer_input={config.vocab_size_per_layer_input} differs from vocab_size="
                        f"{config.vocab_size} (llama.cpp looks up per-layer embeddings by the main token id)")
    problems += _rope_problems(config)
    problems += _shared_kv_problems(config, layers)
    return problems


def _rope_problems(config) -> list[str]:
    problems = []
    sliding, full = _rope(config, SLIDING), _rope(config, FULL)
    if sliding.get("rope_type", "default") != "default":
        problems.append(f"sliding-layer RoPE `{sliding.get('rope_type')}` (llama.cpp: the default RoPE on sliding layers)")
    if full.get("rope_type", "default") not in ("default", "proportional"):
        problems.append(f"full-layer RoPE `{full.get('rope_type')}` (written here: default, proportional)")
    for name, params in ((SLIDING, sliding), (FULL, full)):
        if float(params.get("factor", 1.0) or 1.0) != 1.0:
            problems.append(f"RoPE scaling factor {params['factor']} on {name} layers (not written here)")
    return problems


def _shared_kv_problems(config, layers: list[str]) -> list[str]:
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not shared:
        return []
    first = len(layers) - shared
    if first < 2 or layers[first - 1] != FULL or layers[first - 2] != SLIDING:
        return [f"where its {shared} KV-sharing layers read from: llama.cpp takes the keys/values of layer {first - 2} for "
                f"sliding and layer {first - 1} for full layers, but those are {layers[max(first - 2, 0):first]}; the "
                "released E2B/E4B put a sliding then a full layer just before the shared block"]
    return []


def write_hparams(writer: GGUFWriter, config, vocab_size: int) -> None:
    layers = _layers(config)
    n_layer = len(layers)
    full_dim, sliding_dim = head_dims(config)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(n_layer)
    writer.add_head_count(int(config.num_attention_heads))
    kv_heads = [int(_layer(config, i).num_key_value_heads) for i in range(n_layer)]
    writer.add_head_count_kv(kv_heads[0] if len(set(kv_heads)) == 1 else kv_heads)
    writer.add_feed_forward_length(_feed_forward(config, n_layer))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(vocab_size)
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(sliding_dim)
    writer.add_value_length_swa(sliding_dim)
    writer.add_rope_dimension_count(full_dim)  # the unrotated part is left to rope_freqs (see the module docstring)
    writer.add_rope_dimension_count_swa(sliding_dim)
    writer.add_rope_freq_base(float(_rope(config, FULL).get("rope_theta", 1_000_000.0)))
    writer.add_rope_freq_base_swa(float(_rope(config, SLIDING).get("rope_theta", 10_000.0)))
    writer.add_sliding_window(int(config.sliding_window))
    writer.add_sliding_window_pattern([t == SLIDING for t in layers])
    writer.add_shared_kv_layers(int(getattr(config, "num_kv_shared_layers", 0) or 0))
    writer.add_embedding_length_per_layer_input(int(getattr(config, "hidden_size_per_layer_input", 0) or 0))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def _feed_forward(config, n_layer: int) -> int | list[int]:
    width = int(config.intermediate_size)
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if not getattr(config, "use_double_wide_mlp", False) or not shared:
        return width
    return [width if i < n_layer - shared else 2 * width for i in range(n_layer)]


def rope_freqs(config) -> np.ndarray:
    """The full layers' per-frequency divisors: 1 where proportional RoPE turns, ~infinite where it does not."""
    full_dim, _ = head_dims(config)
    params = _rope(config, FULL)
    fraction = float(params.get("partial_rotary_factor", 1.0)) if params.get("rope_type") == "proportional" else 1.0
    turning = int(fraction * full_dim // 2)
    return np.array([1.0] * turning + [UNROTATED_FACTOR] * (full_dim // 2 - turning), dtype=np.float32)
