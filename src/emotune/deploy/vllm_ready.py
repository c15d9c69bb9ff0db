"""What the vLLM hand-off checks beyond the adapter type: the modules LoRA trains and its rank, and how long a
sequence vLLM must hold (`--max-model-len`), so it neither refuses the adapter at start nor reserves KV cache for
the base's whole context (Gemma 3: 32,768 tokens per sequence) when a classifier's prompts are a few hundred.
"""

from __future__ import annotations

from pathlib import Path

import yaml

# vLLM applies LoRA to the attention and MLP projections (it packs q/k/v and gate/up and splits the LoRA with them);
# LoRA on norms, embeddings or the output head is not served (extra-vocabulary embedding LoRA was removed in 0.11).
VLLM_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"}
VLLM_MAX_LORA_RANK = 512
DEFAULT_MAX_LENGTH = 512  # train.max_length's default when the run's config is not beside the adapter


def lora_blockers(config: dict, adapted: set[str] | None = None) -> list[str]:
    """Why vLLM cannot serve this LoRA (target modules, rank), empty when it can. `adapted`: the names of the modules
    the adapter's weights hold LoRA for (`adapted_modules`), which decide where `target_modules` is a pattern
    (emotune's `all-linear` is a regex PEFT resolved at training); without them a pattern's modules go unchecked."""
    blockers = []
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = sorted(adapted or [])
    unsupported = sorted({t.rsplit(".", 1)[-1] for t in targets} - VLLM_LORA_MODULES)
    if unsupported:
        blockers.append(f"it trains modules vLLM's LoRA does not cover ({', '.join(unsupported)}; vLLM covers "
                        f"{', '.join(sorted(VLLM_LORA_MODULES))})")
    if config.get("target_parameters"):
        blockers.append(f"it adapts weights rather than modules (target_parameters: {len(config['target_parameters'])} "
                        "routed expert weights), which vLLM's LoRA loader does not apply as PEFT trained them")
    ranks = [int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())]
    if max(ranks) > VLLM_MAX_LORA_RANK:
        blockers.append(f"its rank {max(ranks)} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANK})")
    return blockers


def adapted_modules(adapter_dir: Path, config: dict) -> set[str]:
    """The modules `adapter_dir`'s weights hold LoRA for (`...q_proj.lora_A.weight` -> `...q_proj`), less the modules
    whose weights `target_parameters` adapts (a mixture-of-experts layer's `experts`, checked on their own); empty
    when the weights are not a safetensors file."""
    from safetensors import safe_open

    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        return set()
    with safe_open(str(path), framework="pt") as weights:
        names = {key.split(".lora_A", 1)[0] for key in weights.keys() if ".lora_A" in key}  # noqa: SIM118 (no __iter__)
    by_weight = {t.rsplit(".", 1)[0].rsplit(".", 1)[-1] for t in config.get("target_parameters") or []}
    return {name for name in names if name.rsplit(".", 1)[-1] not in by_weight}


def max_model_len(adapter_dir: Path, base_context: int | None) -> int:
    """Tokens per sequence for vLLM: the run's train.max_length plus eval.max_new_tokens (the longest prompt it
    was trained and measured on, and its answer), rounded up to a multiple of 256, at most the base's context."""
    config = _run_config(adapter_dir)
    train, evaluation = config.get("train") or {}, config.get("eval") or {}
    needed = int(train.get("max_length") or DEFAULT_MAX_LENGTH) + int(evaluation.get("max_new_tokens") or 16)
    rounded = -(-needed // 256) * 256
    return min(rounded, base_context) if base_context else rounded


def _run_config(adapter_dir: Path) -> dict:
    for candidate in (adapter_dir.parent / "config.yaml", adapter_dir / "config.yaml"):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text(encoding="utf-8")) or {}
    return {}


def base_context(model_dir: Path) -> int | None:
    """The base model's context length (max_position_embeddings of its text config), None if it says none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


def max_model_len_args(*artifacts) -> list[str]:
    """`--max-model-len N` for serving these adapters (or merged models) together: the longest any of them needs."""

    lengths = [max_model_len(a.path, base_context(a.path if a.merged else a.base_dir())) for a in artifacts]
    return ["--max-model-len", str(max(lengths))]
