"""Which attention kernels a model's shapes allow, read from its config.json alone (no weights).

FlashAttention-2's kernels are built for head dims up to 256. Gemma 4's full-attention layers use
`global_head_dim` 512 (its sliding-window layers 256), so a Gemma 4 model cannot run flash_attention_2
although its sliding layers could; transformers refuses it for the multimodal class
(Gemma4ForConditionalGeneration) but builds the text-only `gemma4_text` class with it, and the first
forward pass then fails inside flash-attn. PyTorch's SDPA and the eager path take any head dim.
"""

from __future__ import annotations

FLASH_MAX_HEAD_DIM = 256  # flash-attn 2.x: "FlashAttention forward only supports head dimension at most 256"


def head_dims(config) -> dict[int, list[int]]:
    """{head dim: the text model's layers with it}, read through get_text_config() so multimodal wrappers give their
    text model's. transformers 5 loads Gemma 4's `global_head_dim` as per-layer head dims (`per_layer_config`);
    a config without head_dim has hidden_size / num_attention_heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    per_layer = getattr(text, "per_layer_config", None)
    dims: dict[int, list[int]] = {}
    for layer in range(layers):
        dim = getattr(per_layer[layer], "head_dim", None) if per_layer is not None else None
        if not isinstance(dim, int):
            dim = _uniform_head_dim(text)
        if dim:
            dims.setdefault(dim, []).append(layer)
    return dims


def _uniform_head_dim(text) -> int | None:
    try:
        dim = getattr(text, "head_dim", None)
    except Exception:  # noqa: BLE001 (a heterogeneous config refuses the global read: per_layer_config answered above)
        dim = None
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    if not isinstance(dim, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        dim = hidden // heads
    return dim if isinstance(dim, int) else None


def flash_attention_problem(config) -> str | None:
    """Why FlashAttention-2 cannot run this model's attention layers (None when it can)."""
    too_wide = {dim: layers for dim, layers in head_dims(config).items() if dim > FLASH_MAX_HEAD_DIM}
    if not too_wide:
        return None
    which = "; ".join(f"head dim {dim} in {len(layers)} of its layers (layer {layers[0]} first)"
                      for dim, layers in sorted(too_wide.items()))
    return (f"this model's config.json gives {which}, and FlashAttention-2 supports head dims up to "
            f"{FLASH_MAX_HEAD_DIM} (sdpa and eager take any head dim)")
