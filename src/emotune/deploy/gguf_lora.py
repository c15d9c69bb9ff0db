"""The LoRA adapter alone as a llama.cpp adapter GGUF, applied at load time over the base model's GGUF
(`llama-cli -m base.gguf --lora adapter.gguf`, llama-cpp-python's `lora_path`, Ollama's ADAPTER line).

llama.cpp adds `scale * B(A x)` with scale = alpha / rank, rank read from each A's shape, one alpha per file.
PEFT's scale is alpha / r per module (alpha / sqrt(r) with rsLoRA; rank_pattern and alpha_pattern change it per
module), so where a module's PEFT scale differs from the file's alpha / rank the difference is folded into its B:
the product is the same. B of Llama's q/k projections gets the same row order as the base weights (gguf_arch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, get_tensor_name_map

from emotune.core.errors import UserError
from emotune.core.rundir import atomic_file
from emotune.deploy import gguf_arch
from emotune.deploy.gguf_write import arch_name

PEFT_PREFIX = "base_model.model."


def write_lora_gguf(adapter_dir: Path, base_config, target: Path, name: str) -> Path:
    """The PEFT adapter in `adapter_dir`, trained on a base whose transformers config is `base_config`."""
    from safetensors.torch import load_file

    peft_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    _check_plain_lora(peft_config)
    model_type, family, text = gguf_arch.family_of(base_config)
    weights_file = adapter_dir / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise UserError(f"`{adapter_dir}` has no adapter_model.safetensors; the adapter GGUF is written from PEFT's "
                        "safetensors file. Re-save the adapter with safe_serialization=True.")
    weights = load_file(weights_file)
    names = get_tensor_name_map(family.arch, int(text.num_hidden_layers))
    alpha = float(peft_config.get("lora_alpha", 8))
    writer = GGUFWriter(path=None, arch=arch_name(family))
    writer.add_type("adapter")
    writer.add_name(name)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for module, (a, b) in sorted(_pairs(weights).items()):
        text_name = gguf_arch_text_name(module)
        stem = names.get_name(text_name)
        if text_name.rpartition(".")[2] in family.no_lora:
            raise UserError(f"The adapter trains `{module}`, which llama.cpp's {arch_name(family)} graph multiplies "
                            "without applying adapters, so the adapter GGUF would silently lose it. Export the merged "
                            "model instead (its GGUF has the change folded in).")
        if stem is None:
            raise UserError(f"The adapter trains `{module}`, which has no place in llama.cpp's "
                            f"{arch_name(family)} layout, so llama.cpp cannot apply it. Export the merged model instead.")
        rank = a.shape[0]
        fold = _peft_scale(peft_config, module, rank) / (alpha / rank)
        b = b * np.float32(fold)
        if family.permute_qk and text_name.endswith("self_attn.q_proj"):
            b = gguf_arch.permute_rows(b, int(text.num_attention_heads))
        elif family.permute_qk and text_name.endswith("self_attn.k_proj"):
            b = gguf_arch.permute_rows(b, int(text.num_key_value_heads))
        writer.add_tensor(f"{stem}.weight.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{stem}.weight.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    with atomic_file(target) as partial:
        writer.write_header_to_file(partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target


def gguf_arch_text_name(module: str) -> str:
    """`base_model.model.model.language_model.layers.0.self_attn.q_proj` -> `model.layers.0.self_attn.q_proj`."""
    from emotune.deploy.gguf_write import _text_name

    name = _text_name(module.removeprefix(PEFT_PREFIX))
    if name is None:
        raise UserError(f"The adapter trains `{module}` in the vision tower; a GGUF adapter holds the text model only. "
                        "Train with LoRA on the language model's layers, or export the merged model.")
    return name


def _check_plain_lora(config: dict) -> None:
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"it is a {config['peft_type']} adapter")
    if config.get("use_dora"):
        problems.append("it is DoRA (use_dora=true), whose magnitude vectors llama.cpp does not apply")
    if config.get("modules_to_save"):
        problems.append(f"it trains whole modules besides LoRA ({config['modules_to_save']})")
    if config.get("target_parameters"):
        problems.append("it adapts routed expert weights (target_parameters), which a LoRA GGUF does not carry")
    if problems:
        raise UserError(f"llama.cpp cannot apply this adapter as a LoRA GGUF: {'; '.join(problems)}. Export the merged "
                        "model as GGUF instead (--format gguf writes both; the adapter file is then left out).")


def _pairs(weights: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module: (A [r, in], B [out, r])} from PEFT's `<module>.lora_A.weight` / `.lora_B.weight`."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in weights.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if key.endswith(marker):
                pairs.setdefault(key.removesuffix(marker), {})[part] = tensor.float().numpy()
        if ".lora_embedding_" in key or ".lora_magnitude_vector" in key:
            raise UserError(f"The adapter holds `{key}` (LoRA on an embedding, or DoRA); llama.cpp applies LoRA on "
                            "linear layers only. Export the merged model as GGUF instead.")
    missing = [m for m, p in pairs.items() if len(p) != 2]
    if missing:
        raise UserError(f"The adapter's weights file lacks half of the LoRA pair for {missing[:3]}; it is damaged.")
    return {m: (p["lora_A"], p["lora_B"]) for m, p in pairs.items()}


def _peft_scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of `module`: its alpha (alpha_pattern) over its rank, or over sqrt(rank) with rsLoRA."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module.endswith(pattern) or f".{pattern}." in f".{module}.":
            alpha = float(value)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
