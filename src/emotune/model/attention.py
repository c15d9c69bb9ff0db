"""Which attention kernels a model's shapes allow, read from its config.json alone (no weights).

FlashAttention-2's kernels are built for head dims up to 256. Gemma 4's full-attention layers use
`global_head_dim` 512 (its sliding-window layers 256), so a Gemma 4 model cannot run flash_attention_2
although its sliding layers could; transformers refuses it for the multimodal class
(Gemma4ForConditionalGeneration) but builds the text-only `gemma4_text` class with it, and the first
forward pass then fails inside flash-attn. PyTorch's SDPA and the eager path take any head dim.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError, first_line
from emotune.model.text import causal_lm_class

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


def check_attention(cfg: ModelConfig, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any weights load, a `model.attn_implementation` that this model, device or dtype cannot
    run, with every reason at once, naming the choices that do work. Whether the model class supports one is
    transformers' own check, run on an empty (meta-device) copy built from config.json, so no weight is read."""
    choice = cfg.attn_implementation
    if choice in ("auto", "eager"):  # eager is every model's own code; auto is transformers' choice per part of the model
        return
    problems = []
    config = AutoConfig.from_pretrained(model_dir)
    if choice == "flash_attention_2" and (too_wide := flash_attention_problem(config)):
        problems.append(too_wide)  # first: transformers builds gemma4_text with it and fails in the first forward pass
    refused = _refused_by_class(config, choice)
    if refused and not problems:  # the head dim already says why, in words that name the fix
        problems.append(f"transformers says: {refused}")
    if choice == "flash_attention_2":
        problems += _flash_attention_environment(device, dtype)
    if problems:
        working = [c for c in ("sdpa", "auto", "eager") if c != choice and (c != "sdpa" or not _refused_by_class(config, c))]
        raise UserError(f"model.attn_implementation={choice} cannot be used here: {'; '.join(problems)}. Set "
                        f"model.attn_implementation={working[0]} (or {', or '.join(working[1:])}) instead.")


def _refused_by_class(config, choice: str) -> str | None:
    """transformers' reason for not building this model class with `choice` (None: it builds). A multimodal class
    refuses sdpa when one of its parts has no SDPA path (Gemma 4's audio tower); `auto` then picks per part."""
    try:
        with torch.device("meta"):
            causal_lm_class(config).from_config(config, attn_implementation=choice)
    except ValueError as err:  # the model class does not implement it
        return first_line(err).split(" Please request")[0]
    except ImportError:
        return None  # the flash-attn package is missing: said with what to do by _flash_attention_environment
    return None


def _flash_attention_environment(device: torch.device, dtype: torch.dtype) -> list[str]:
    from transformers.utils import is_flash_attn_2_available

    problems = []
    if device.type != "cuda":
        problems.append(f"FlashAttention-2 runs on CUDA and ROCm GPUs only, and this run is on {device.type}")
    if dtype not in (torch.bfloat16, torch.float16):
        problems.append(f"FlashAttention-2 computes in bf16 or fp16 only, and the weights load as {dtype} here "
                        "(set model.dtype=bfloat16, or train.precision=bf16)")
    if device.type == "cuda" and not is_flash_attn_2_available():
        problems.append("the flash-attn package (2.3.3 or newer) is not installed: `pip install flash-attn "
                        "--no-build-isolation` on CUDA; on ROCm, AMD's build of it (github.com/ROCm/flash-attention)")
    return problems
