"""LoRA initialisations from PEFT that start from the base weights: PiSSA, OLoRA and LoftQ (`lora.init`).

The default LoRA starts at zero (B = 0), so the adapted model starts as the base. PiSSA (Meng et al. 2024) starts A
and B at the top-r singular vectors of each weight, OLoRA (Büyükakyüz 2024) at its QR factors, LoftQ (Li et al.
2023) at the low-rank part that best makes up for quantizing the weight; all three subtract that start from the
base weight, so the model still starts as the base, but its base weights are no longer the checkpoint's.

An adapter saved as trained would then only work on that changed base. So the adapter written at the end is
PEFT's conversion onto the original base (`save_pretrained(path_initial_model_for_weight_conversion=...)`, which
LLaMA-Factory's `pissa_convert` runs too): the trained (A, B) minus the starting (A0, B0), as one LoRA of rank
2r, which export, serving and vLLM load over the unchanged checkpoint. The starting adapter is saved when
training starts, in train/initial_adapter, for that.

Refused before loading: LoftQ off a CUDA/XPU GPU (PEFT's LoftQ runs its quantization there only), and PiSSA, OLoRA
or LoftQ together with `model.quantization` (they rewrite base weights, which bitsandbytes' 4/8-bit layers
cannot hold exactly; LoftQ quantizes by itself).
"""

from __future__ import annotations

from pathlib import Path

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError

CONVERTED = ("pissa", "olora", "loftq")  # inits that change the base weights: the adapter is converted when saved


def check(lora: LoraSettings, model: ModelConfig, device: torch.device) -> None:
    """Refuse, before any weight loads, an initialisation that cannot run here."""
    problems = []
    if lora.init == "loftq" and device.type not in ("cuda", "xpu"):
        problems.append(f"lora.init=loftq runs PEFT's LoftQ, which quantizes on a CUDA or XPU GPU only, and this run is "
                        f"on {device.type}; use lora.init=pissa (or default) here")
    if lora.init in CONVERTED and model.quantization != "none":
        problems.append(f"lora.init={lora.init} rewrites the base weights, which a {model.quantization} base cannot hold "
                        "exactly" + (" (LoftQ quantizes by itself)" if lora.init == "loftq" else "")
                        + "; set model.quantization=none, or lora.init=default for QLoRA")
    if lora.init in CONVERTED and lora.use_dora:
        problems.append(f"lora.init={lora.init} with DoRA is not converted back by PEFT; set lora.use_dora=false")
    if problems:
        raise UserError("; ".join(problems) + ".")


def peft_init(lora: LoraSettings) -> dict:
    """PEFT LoraConfig arguments for `lora.init`."""
    if lora.init == "pissa":
        return {"init_lora_weights": "pissa" if lora.pissa_iter == -1 else f"pissa_niter_{lora.pissa_iter}"}
    if lora.init == "olora":
        return {"init_lora_weights": "olora"}
    if lora.init == "loftq":
        from peft import LoftQConfig

        return {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=4)}
    return {}


def save_initial(model, folder: Path) -> Path:
    """The starting adapter (A0, B0), saved before training for the conversion at the end. Saved with
    `init_lora_weights: true` so that reading it back does not initialise (run the SVD) again."""
    config = model.peft_config[model.active_adapter]
    kept, config.init_lora_weights = config.init_lora_weights, True
    try:
        model.save_pretrained(folder)
    finally:
        config.init_lora_weights = kept
    return folder


def describe(lora: LoraSettings) -> str:
    return (f"LoRA initialised by {lora.init} (the base weights minus its start); the adapter is saved converted onto "
            "the original base (rank 2 x lora.r), as PEFT's path_initial_model_for_weight_conversion does")


# --------------------------------------------------------------------------------------------------
# Training on from an existing adapter (lora.adapter)


def check_start(lora: LoraSettings, artifact) -> None:
    """Refuse a starting adapter this run cannot train on from (found and label-checked by the task already)."""
    problems = []
    if artifact.merged:
        problems.append(f"`{lora.adapter}` holds a merged model, not an adapter; set model.source to it instead")
    if artifact.has_head:
        problems.append("training on from a classification-head adapter is not supported yet; start fresh adapters")
    if lora.init != "default":
        problems.append(f"lora.init={lora.init} initialises fresh adapters, and lora.adapter starts from trained ones; "
                        "set one of them")
    if problems:
        raise UserError(f"lora.adapter cannot be used: {'; '.join(problems)}.")


def train_on_from(model, artifact):
    """`model` with the adapter of `artifact` attached as trainable: what the run measures "before" and trains on."""
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(model, artifact.path, is_trainable=True)
    config = adapted.peft_config[adapted.active_adapter]
    print(f"Training on from the adapter {artifact.path} (lora.adapter): its settings (r={config.r}, "
          f"alpha={config.lora_alpha}, use_dora={config.use_dora}) replace the lora section's; the \"before\" "
          "measured is this adapter's score, not the bare base's.", flush=True)
    return adapted


def mark_adapters_trainable(model) -> None:
    """After k-bit preparation froze everything: the adapters (and modules saved with them) train again."""
    for name, param in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            param.requires_grad_(True)
