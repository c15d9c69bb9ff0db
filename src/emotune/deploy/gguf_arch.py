"""What llama.cpp needs to know per model family: its GGUF architecture, hyperparameters and weight layout.

Learned from llama.cpp's own converter (convert_hf_to_gguf.py), written here for the families emotune supports:
- Gemma 3: RMSNorm weights are stored as w where the model computes x * (1 + w); llama.cpp computes x * w, so
  every norm weight gets +1. llama.cpp also fixes what transformers reads from config.json: one sliding layer
  pattern (every 6th layer global), a local RoPE base of 10,000 and the query scale 1/sqrt(head_dim); a model
  that differs is refused rather than exported to compute something else.
- Llama and Mistral: llama.cpp applies RoPE to interleaved pairs (x0, x1), (x2, x3) ... where transformers
  rotates the two halves of each head (x0, x_d/2) ...; the rows of q_proj and k_proj are reordered per head so
  the same pairs meet. Llama 3.1's `llama3` RoPE scaling becomes a `rope_freqs` tensor of per-frequency divisors.
- Qwen2 and Qwen3: rotate halves in llama.cpp too (NEOX order), so the weights go as they are.
- Gemma 4: its own module, emotune.deploy.gguf_gemma4 (two head sizes, shared KV layers, per-layer embeddings).
A multimodal base (Gemma 3's vision-language checkpoint, Gemma 4's vision-and-audio one) exports its text model only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, RopeScalingType

from emotune.core.errors import UserError
from emotune.deploy import gguf_gemma4


@dataclass(frozen=True)
class Family:
    arch: MODEL_ARCH
    permute_qk: bool = False  # Llama's interleaved RoPE (see the module docstring)
    norm_offset: float = 0.0  # Gemma's x * (1 + w)
    key_length: bool = False  # writes attention.key_length/value_length (head_dim differs from hidden / heads)
    vocab_model: str = ""  # llama.cpp tokenizer model to write for a tokenizer.json BPE with byte fallback ("" = `llama`)
    no_lora: tuple[str, ...] = ()  # modules llama.cpp multiplies without applying a LoRA adapter


FAMILIES = {
    "gemma3_text": Family(MODEL_ARCH.GEMMA3, norm_offset=1.0, key_length=True),
    # llama.cpp's gemma4 graph projects the per-layer inputs with a plain matrix product (no adapter applied there)
    "gemma4_text": Family(MODEL_ARCH.GEMMA4, vocab_model="gemma4", no_lora=("per_layer_model_projection",)),
    "llama": Family(MODEL_ARCH.LLAMA, permute_qk=True),
    "mistral": Family(MODEL_ARCH.LLAMA, permute_qk=True),
    "qwen2": Family(MODEL_ARCH.QWEN2),
    "qwen3": Family(MODEL_ARCH.QWEN3, key_length=True),
}
# multimodal checkpoints whose text model is one of the families above (their vision and audio towers are left out)
TEXT_OF = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
NOT_YET = {"gemma3n": "Gemma 3n", "gemma3n_text": "Gemma 3n", "gemma2": "Gemma 2", "gemma": "Gemma 1"}


def family_of(config) -> tuple[str, Family, object]:
    """(model type, Family, text config) of a transformers config, or a UserError naming what is supported."""
    model_type = TEXT_OF.get(config.model_type, config.model_type)
    text_config = config.get_text_config() if config.model_type in TEXT_OF else config
    if model_type not in FAMILIES:
        what = NOT_YET.get(config.model_type, f"model type `{config.model_type}`")
        raise UserError(f"GGUF export does not support {what}. Supported: Gemma 4 and Gemma 3 (text and multimodal "
                        "bases, the text model is exported), Llama, Mistral, Qwen2 and Qwen3. Export with --format hf (the merged "
                        "Hugging Face folder) and convert it with llama.cpp's convert_hf_to_gguf.py if it knows the model.")
    return model_type, FAMILIES[model_type], text_config


def _rope(config) -> dict:
    """The RoPE parameters of full-attention layers (transformers 5: rope_parameters, per layer type for Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    return dict(params) or {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}


def check_layout(model_type: str, config) -> None:
    """Refuse a model whose computation llama.cpp would not reproduce (see the module docstring)."""
    problems = gguf_gemma4.layout_problems(config) if model_type == "gemma4_text" else _layout_problems(model_type, config)
    if problems:
        raise UserError(f"This {model_type} model cannot be exported to GGUF as it is: llama.cpp would compute it "
                        f"differently because of {'; '.join(problems)}. Use the merged Hugging Face folder (--merge) with "
                        "vLLM or transformers instead.")


def _layout_problems(model_type: str, config) -> list[str]:
    problems = []
    rope_type = _rope(config).get("rope_type", "default")
    allowed = {"gemma3_text": ("default", "linear"), "llama": ("default", "linear", "llama3")}.get(model_type, ("default",))
    if rope_type not in allowed:
        problems.append(f"its RoPE scaling `{rope_type}` (written here: {', '.join(allowed)})")
    if model_type != "gemma3_text" and (window := _sliding_window(config)):
        problems.append(f"its sliding window of {window} tokens (the file carries none, so llama.cpp's {model_type} "
                        f"graph attends to all {config.max_position_embeddings} positions of the context)")
    if model_type == "gemma3_text":
        layers = list(getattr(config, "layer_types", []) or [])
        expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(len(layers))]
        if layers != expected:
            problems.append("its sliding/global layer pattern (llama.cpp uses every 6th layer global)")
        local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention", {}).get("rope_theta", 10000.0)
        if float(local) != 10000.0:
            problems.append(f"its local RoPE base {local} (llama.cpp uses 10000)")
        scale = config.query_pre_attn_scalar
        if scale != config.head_dim and not (config.num_hidden_layers == 62 and scale == config.hidden_size // config.num_attention_heads):
            problems.append(f"query_pre_attn_scalar={scale} (llama.cpp scales queries by head_dim={config.head_dim})")
    return problems


def _sliding_window(config) -> int | None:
    """The window of a config whose layers slide, where it is shorter than the context: every layer without
    `layer_types` (Mistral v0.1: 4,096 of 32,768), those typed `sliding_attention` (Qwen2 with use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    slides = "sliding_attention" in types if types else bool(window)
    return window if slides and window and window < int(config.max_position_embeddings) else None


def write_hparams(writer: GGUFWriter, model_type: str, family: Family, config, vocab_size: int) -> None:
    if model_type == "gemma4_text":
        gguf_gemma4.write_hparams(writer, config, vocab_size)
        return
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(vocab_size)
    rope = _rope(config)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    # llama.cpp takes a head's width as hidden / heads unless told: Mistral Nemo (hidden 5,120, 32 heads of 128)
    # and any config whose head_dim differs must say it, or llama.cpp refuses to load the file
    if family.key_length or head_dim * int(config.num_attention_heads) != int(config.hidden_size):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family.arch == MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if model_type == "gemma3_text":
        writer.add_sliding_window(int(config.sliding_window))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def rope_freqs(model_type: str, config) -> np.ndarray | None:
    """Llama 3.1's `llama3` RoPE scaling as llama.cpp reads it: per-frequency divisors of the default angles;
    Gemma 4's proportional RoPE (emotune.deploy.gguf_gemma4)."""
    if model_type == "gemma4_text":
        return gguf_gemma4.rope_freqs(config)
    rope = _rope(config)
    if rope.get("rope_type") != "llama3":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    default = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return (default / scaled.double().numpy()).astype(np.float32)


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from transformers' half-split RoPE to llama.cpp's interleaved pairs: row j of the
    first half and row j of the second half become rows 2j and 2j+1. Works on weights and on LoRA B alike."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def transform(name: str, data: np.ndarray, family: Family, config) -> np.ndarray:
    """A text-model weight (transformers' name) as llama.cpp expects it."""
    if family.norm_offset and name.endswith("norm.weight"):
        data = data + np.float32(family.norm_offset)
    # a bias adds to the same rows, so it moves with them (Llama-type checkpoints with attention_bias=true)
    if family.permute_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        data = permute_rows(data, int(config.num_attention_heads))
    elif family.permute_qk and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        data = permute_rows(data, int(config.num_key_value_heads))
    return data
