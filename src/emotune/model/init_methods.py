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

LoftQ comes two ways. Over an unquantized base (`model.quantization: none`), PEFT's LoftQ rounds each adapted weight
to NF4 itself and starts the adapters at the low-rank part of what the rounding lost, as above. Over a 4-bit base
(QLoRA + LoftQ, the paper's own setting), bitsandbytes has quantized the weights already, and PEFT's
`replace_lora_weights_loftq` starts the adapters at the low-rank part of what that quantization lost, reading the
original weights from the model folder's safetensors: the quantized weights stay as they are, so the adapter is
saved as trained and works over the same 4-bit base, as any QLoRA adapter (export merges it onto the unquantized
checkpoint and says what that changes, emotune.deploy.quantized_merge). Both start the adapted model nearer the
unquantized one than the rounded base alone. PEFT sets the adapters to that low-rank part without LoRA's scaling
(alpha / r: huggingface/peft#1982), so with alpha != r the start would add it alpha / r times; emotune divides B by
the scaling.

Refused before loading: PiSSA or OLoRA together with `model.quantization`, and LoftQ with 8 bits (they rewrite base
weights, which bitsandbytes' layers cannot hold exactly; PEFT's LoftQ over a quantized base is 4-bit only); LoftQ
over a 4-bit base whose folder has no safetensors weights, or whose weights are stored under other names than the
model's modules (emotune.model.lora.check_targets); LoftQ where bitsandbytes cannot quantize (it rounds with
bitsandbytes' NF4).
"""

from __future__ import annotations

from pathlib import Path

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model import quantization

CONVERTED = ("pissa", "olora", "loftq")  # inits that change the base weights: the adapter is converted when saved


def check(lora: LoraSettings, model: ModelConfig, device: torch.device, model_dir: Path | None = None) -> None:
    """Refuse, before any weight loads, an initialisation that cannot run here."""
    problems = []
    if lora.init == "loftq" and model.quantization == "none":
        problem = quantization.nf4_problem(device)
        if problem:
            problems.append(f"lora.init=loftq rounds the weights to NF4 with bitsandbytes, and {problem}")
    if lora.init == "loftq" and model.quantization == "4bit" and model_dir is not None and not _safetensors(model_dir):
        problems.append(f"lora.init=loftq over a 4-bit base reads the original weights from safetensors files, and "
                        f"{model_dir} has no model.safetensors (nor model.safetensors.index.json); save the checkpoint "
                        "as safetensors, or set lora.init=default")
    if lora.init in ("pissa", "olora") and model.quantization != "none":
        problems.append(f"lora.init={lora.init} rewrites the base weights, which a {model.quantization} base cannot hold "
                        "exactly; set model.quantization=none, or lora.init=default (or loftq) for QLoRA")
    if lora.init == "loftq" and model.quantization == "8bit":
        problems.append("LoftQ over a quantized base (PEFT's replace_lora_weights_loftq) is 4-bit only: set "
                        "model.quantization=4bit or none")
    if lora.init in CONVERTED and lora.use_dora:
        problems.append(f"lora.init={lora.init} with DoRA is not converted back by PEFT; set lora.use_dora=false")
    if problems:
        raise UserError("; ".join(problems) + ".")


def converted(lora: LoraSettings, quantized: bool) -> bool:
    """Whether the adapter is saved converted onto the original base: the inits that rewrite the base weights (LoftQ
    over a quantized base leaves them, and its adapter works over that base as trained)."""
    return lora.init in CONVERTED and not (lora.init == "loftq" and quantized)


def peft_init(lora: LoraSettings, model=None) -> dict:
    """PEFT LoraConfig arguments for `lora.init` over `model`; LoftQ over a quantized base starts after attaching
    (`start`)."""
    if lora.init == "pissa":
        return {"init_lora_weights": "pissa" if lora.pissa_iter == -1 else f"pissa_niter_{lora.pissa_iter}"}
    if lora.init == "olora":
        return {"init_lora_weights": "olora"}
    if lora.init == "loftq" and not (model is not None and quantization.is_quantized(model)):
        from peft import LoftQConfig

        return {"init_lora_weights": "loftq", "loftq_config": LoftQConfig(loftq_bits=4)}
    return {}


def start(adapted, lora: LoraSettings) -> None:
    """After PEFT attached the adapters: LoftQ's start over a 4-bit base, and LoftQ's start scaled (module docstring)."""
    if lora.init != "loftq":
        return
    if quantization.is_quantized(adapted):
        from peft import replace_lora_weights_loftq

        folder = Path(adapted.get_base_model().name_or_path)
        if not _safetensors(folder):
            raise UserError(f"lora.init=loftq over a 4-bit base reads the original weights from safetensors files, and "
                            f"{folder} has none; save the checkpoint as safetensors, or set lora.init=default.")
        quantization.keep_trainable_layout(adapted)  # the layout bitsandbytes' dequantize reads
        replace_lora_weights_loftq(adapted, model_path=str(folder), adapter_name=adapted.active_adapter)
    from peft.tuners.lora import LoraLayer

    name = adapted.active_adapter
    with torch.no_grad():
        for module in adapted.modules():
            if isinstance(module, LoraLayer) and name in module.lora_B and module.scaling.get(name):
                module.lora_B[name].weight.div_(module.scaling[name])


def _safetensors(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


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


def describe(lora: LoraSettings, quantized: bool = False) -> str:
    if lora.init == "loftq" and quantized:
        return ("LoRA initialised by LoftQ over the 4-bit base (PEFT's replace_lora_weights_loftq: the low-rank part of "
                "what quantizing lost, from the original safetensors weights); the adapter is saved as trained, for "
                "this 4-bit base")
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
