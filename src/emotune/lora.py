"""LoRA adapters from our config: which modules, which variant (rsLoRA, DoRA), and a check of the result.

`all-linear` is resolved here rather than by PEFT, because PEFT's `all-linear` adapts every linear
layer of the checkpoint, including the vision and audio towers of multimodal Gemma 3n / Gemma 4
checkpoints, which a text classifier never runs. We restrict it to the language model (the module
`get_decoder()` returns) and write the result as a regex PEFT full-matches against module names.
"""

from __future__ import annotations

import re

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from emotune.config import LoraSettings
from emotune.errors import UserError


def language_model_linear_targets(model: PreTrainedModel) -> str:
    """A regex matching every linear layer inside the language model, and nothing outside it."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    output = model.get_output_embeddings()
    linears = {f"{prefix}.{name}".lstrip(".") for name, module in decoder.named_modules()
               if isinstance(module, torch.nn.Linear) and module is not output and name}
    if not linears:
        raise UserError(f"lora.target_modules=all-linear: the language model of {type(model).__name__} has no linear "
                        "layer to adapt. Name the modules to adapt in lora.target_modules.")
    inside = rf"{re.escape(prefix)}\.(?:.*\.)?" if prefix else r"(?:.*\.)?"
    pattern = rf"^{inside}(?:{'|'.join(map(re.escape, sorted({_leaf(name) for name in linears})))})$"
    if {name for name, _ in model.named_modules() if re.fullmatch(pattern, name)} == linears:
        return pattern
    # A leaf name shared with a non-linear module (Gemma 3n's `altup_projections.0` vs `layers.0`): list them all.
    return rf"^(?:{'|'.join(map(re.escape, sorted(linears)))})$"


def _leaf(name: str) -> str:
    """The last part of a module name, with the list it indexes when it is a number (`altup_projections.0`)."""
    parts = name.split(".")
    keep = 1
    while keep < len(parts) and parts[-keep].isdigit():
        keep += 1
    return ".".join(parts[-keep:])


def lora_config(cfg: LoraSettings, model: PreTrainedModel, task_type: str = "CAUSAL_LM",
                extra_modules_to_save: tuple[str, ...] = ()) -> PeftLoraConfig:
    """PEFT's config; `task_type` SEQ_CLS with the head in `extra_modules_to_save` for a classification head."""
    targets = language_model_linear_targets(model) if cfg.target_modules == "all-linear" else cfg.target_modules
    modules_to_save = cfg.modules_to_save
    if extra_modules_to_save:
        modules_to_save = [*(modules_to_save or []), *(m for m in extra_modules_to_save if m not in (modules_to_save or []))]
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        use_rslora=cfg.use_rslora,
        use_dora=cfg.use_dora,
        modules_to_save=modules_to_save,
        task_type=task_type,
    )


def attach_lora(model: PreTrainedModel, cfg: LoraSettings, task_type: str = "CAUSAL_LM",
                extra_modules_to_save: tuple[str, ...] = ()) -> PeftModel:
    """Wrap `model` with fresh adapters and print what is trained; fail clearly when nothing is."""
    try:
        adapted = get_peft_model(model, lora_config(cfg, model, task_type, extra_modules_to_save))
    except ValueError as err:  # PEFT names the module it could not find
        raise UserError(f"LoRA matched no module of {type(model).__name__} (or could not be attached): {err} Check lora.target_modules "
                        "and lora.modules_to_save against the model's module names.") from None
    trainable, total = count_parameters(adapted)
    if trainable == 0:
        raise UserError(f"LoRA matched no module: lora.target_modules={cfg.target_modules!r} found nothing to adapt "
                        f"in {type(model).__name__}. Use `all-linear` or names of its linear layers (e.g. [q_proj, v_proj]).")
    variant = " + ".join(["rsLoRA" if cfg.use_rslora else "LoRA"] + (["DoRA"] if cfg.use_dora else []))
    print(f"{variant} r={cfg.r} alpha={cfg.alpha} dropout={cfg.dropout}; trainable parameters: {trainable:,} / "
          f"{total:,} ({100 * trainable / total:.2f}%)", flush=True)
    return adapted


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
