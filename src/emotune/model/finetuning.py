"""Full and freeze fine-tuning (`train.finetuning: full | freeze`): which weights of the model itself train.

LoRA (emotune.model.lora) trains adapters beside frozen weights. `full` trains the weights themselves: every
parameter of the language model (embeddings, decoder layers, final norm), the output layer and a classification
head; the towers of a multimodal checkpoint (vision, audio), which a text task never runs, stay frozen. `freeze`
trains part of them, as LLaMA-Factory's `_setup_freeze_tuning` chooses (hiyouga/LLaMA-Factory,
src/llamafactory/model/adapter.py): `freeze_trainable_layers` N > 0 = the last N decoder layers, N < 0 = the first
|N|; `freeze_trainable_modules` = the parts of those layers (`all`, or names such as mlp and self_attn);
`freeze_extra_modules` = modules outside the layers (embed_tokens, norm). Two choices differ from LLaMA-Factory's on
purpose: a count beyond the model's layers is refused rather than clipped (a config written for a deeper model would
silently change meaning), and modules are chosen as modules, not by a substring of parameter names, so a name
chooses the module it names (and a tied output layer its shared weight) and nothing that merely contains it.

Trained weights stored in bf16 or fp16 are kept in fp32 while training (the optimizer's updates are often smaller
than a bf16 weight's resolution; fp16's grad scaler refuses fp16 gradients) and cast back to their own dtype at the
end, so the model measured by the fine-tuned stage is the one saved (emotune.model.artifacts.write_full_model).
"""

from __future__ import annotations

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings, TrainConfig
from emotune.core.errors import UserError
from emotune.model.lora import count_parameters, decoder_layer_count, decoder_layers_path
from emotune.model.text import language_model

WHOLE = ("full", "freeze")  # the finetuning kinds that train the model's own weights and save a whole model


def check(train: TrainConfig, lora: LoraSettings, model: ModelConfig, model_config) -> None:
    """Refuse, before any weights load, full or freeze fine-tuning with what only LoRA does, and freeze layer counts
    the model (known by its config.json, `model_config`) does not have. Every problem is named at once."""
    if train.finetuning not in WHOLE:
        return
    kind = f"train.finetuning={train.finetuning}"
    problems = []
    if model.quantization != "none":
        problems.append(f"model.quantization={model.quantization} stores the base weights in {model.quantization}, which "
                        f"cannot be trained themselves; set model.quantization=none, or train.finetuning=lora (QLoRA)")
    lora_only = [(train.loraplus_lr_ratio is not None, f"train.loraplus_lr_ratio={train.loraplus_lr_ratio} (LoRA+)",
                  "train.loraplus_lr_ratio=null"),
                 (lora.init != "default", f"lora.init={lora.init}", "lora.init=default"),
                 (lora.use_dora, "lora.use_dora=true (DoRA)", "lora.use_dora=false"),
                 (lora.adapter is not None, f"lora.adapter={lora.adapter} (training on from an adapter)", "lora.adapter=null"),
                 (lora.layers is not None, f"lora.layers={lora.layers}", "train.freeze_trainable_layers instead")]
    for given, what, fix in lora_only:
        if given:
            problems.append(f"{what} is a LoRA method, and {kind} trains no adapters; set {fix}, or train.finetuning=lora")
    if train.fsdp:
        problems.append(f"train.fsdp=true is not supported with {kind} yet; train on one process, or with "
                        "train.finetuning=lora")
    if train.finetuning == "freeze":
        count = decoder_layer_count(model_config)
        if abs(train.freeze_trainable_layers) > count:
            problems.append(f"train.freeze_trainable_layers={train.freeze_trainable_layers} asks for "
                            f"{abs(train.freeze_trainable_layers)} layers, but the model has {count} decoder layers; set it "
                            f"from 1 to {count} (the last N layers; -N for the first N), or train.finetuning=full")
    if problems:
        raise UserError(f"{kind} cannot run with this config: " + "; ".join(problems) + ".")


def trainable_layers(n: int, count: int) -> list[int]:
    """LLaMA-Factory's `freeze_trainable_layers` as layer indices: N > 0 the last N, N < 0 the first |N|."""
    return list(range(count - n, count)) if n > 0 else list(range(-n))


def prepare(model: torch.nn.Module, train: TrainConfig, always: tuple[str, ...] = ()) -> dict[str, torch.dtype]:
    """Mark what trains (`always`: modules that train whatever is chosen, such as a fresh classification head), keep
    trained bf16/fp16 weights in fp32, print what trains; returns {parameter name: its own dtype} for those upcast."""
    where = mark(model, train, always)
    upcast = upcast_trained(model)
    trainable, total = count_parameters(model)
    print(f"{train.finetuning.capitalize()} fine-tuning: {where}; trainable parameters: {trainable:,} / {total:,} "
          f"({100 * trainable / total:.2f}%)" + (f"; {len(upcast)} tensors kept in fp32 while training" if upcast else ""),
          flush=True)
    return upcast


def upcast_trained(model: torch.nn.Module) -> dict[str, torch.dtype]:
    """The trained bf16/fp16 weights in fp32 (in place); returns {parameter name: its own dtype} for those upcast."""
    upcast = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            upcast[name] = param.dtype
            param.data = param.data.float()
    return upcast


def mark(model: torch.nn.Module, train: TrainConfig, always: tuple[str, ...] = ()) -> str:
    """Set `requires_grad` on what `train.finetuning` (full / freeze) trains, and nothing else; returns what trains in
    words. The memory plan marks its weightless model with it, as training marks the real one."""
    if train.finetuning == "full":
        frozen = _beside_language_model(model)
        model.requires_grad_(True)
        for name in frozen:
            model.get_submodule(name).requires_grad_(False)
        where = "every weight of the language model" + (f" (frozen, as a text task never runs them: "
                                                         f"{', '.join(frozen)})" if frozen else "")
    else:
        chosen = _freeze_modules(model, train)
        model.requires_grad_(False)
        for module in chosen.values():
            module.requires_grad_(True)
        where = ", ".join(chosen)
    fresh = _named(model, always, "the task's trained modules")
    for module in fresh.values():
        module.requires_grad_(True)
    if fresh and train.finetuning == "freeze":
        where += f", and the task's {', '.join(fresh)}"
    if count_parameters(model)[0] == 0:
        raise UserError("train.finetuning=freeze chose no parameter to train; name modules that hold weights in "
                        "train.freeze_trainable_modules / train.freeze_extra_modules.")
    return where


def restore_dtypes(model: torch.nn.Module, upcast: dict[str, torch.dtype]) -> None:
    """The trained weights back in the dtypes they were loaded in: what is saved, and what the fine-tuned stage measures."""
    for name, param in model.named_parameters():
        if name in upcast:
            param.data = param.data.to(upcast[name])


def describe(train: TrainConfig) -> dict:
    """What run.json (and so report.html) says about the kind of fine-tuning."""
    if train.finetuning == "freeze":
        return {"kind": "freeze", "trainable_layers": train.freeze_trainable_layers,
                "trainable_modules": train.freeze_trainable_modules, "extra_modules": train.freeze_extra_modules}
    return {"kind": train.finetuning}


# --------------------------------------------------------------------------------------------------
# Choosing modules


def _beside_language_model(model: torch.nn.Module) -> list[str]:
    """Modules beside the language model under its ancestors: a multimodal checkpoint's vision and audio towers and
    their projections (Gemma 3n / Gemma 4: `model.vision_tower`, ... beside `model.language_model`); none in a text
    model, whose language model hangs off the root next to the output layer (and a classification head)."""
    decoder = language_model(model)
    path = next(name for name, module in model.named_modules() if module is decoder)
    parts = path.split(".") if path else []
    on_path = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]  # strict, without the root
    return sorted(f"{a}.{child}" for a in ancestors for child, _ in model.get_submodule(a).named_children()
                  if f"{a}.{child}" not in on_path)


def _freeze_modules(model: torch.nn.Module, train: TrainConfig) -> dict[str, torch.nn.Module]:
    """The chosen parts of the chosen decoder layers, and the extra modules, by name."""
    path = decoder_layers_path(model)
    layers = model.get_submodule(path)
    indices = trainable_layers(train.freeze_trainable_layers, len(layers))
    chosen: dict[str, torch.nn.Module] = {}
    parts = train.freeze_trainable_modules
    if parts == "all":
        chosen.update({f"{path}.{i}": layers[i] for i in indices})
    else:
        known = sorted({name for name, _ in layers[indices[0]].named_children()})
        missing = [p for p in parts if p not in known]
        if missing:
            raise UserError(f"train.freeze_trainable_modules names {', '.join(missing)}, which the decoder layers of "
                            f"{type(model).__name__} do not have; choose from {', '.join(known)}, or `all`.")
        chosen.update({f"{path}.{i}.{p}": layers[i].get_submodule(p) for i in indices for p in parts})
    if train.freeze_extra_modules:
        chosen.update(_named(model, tuple(train.freeze_extra_modules), "train.freeze_extra_modules", outside=path))
    return chosen


def _named(model: torch.nn.Module, names: tuple[str, ...], field: str, outside: str | None = None
           ) -> dict[str, torch.nn.Module]:
    """Modules by full path or by their own (last) name, outside the decoder layers' list `outside`; each name must
    find one at least."""
    found: dict[str, torch.nn.Module] = {}
    candidates = [(name, module) for name, module in model.named_modules()
                  if name and not (outside and (name == outside or name.startswith(outside + ".")))]
    for wanted in names:
        matches = {name: module for name, module in candidates if name == wanted or name.rsplit(".", 1)[-1] == wanted}
        if not matches:
            known = sorted({name.rsplit(".", 1)[-1] for name, module in candidates
                            if any(True for _ in module.parameters(recurse=False))})
            raise UserError(f"{field} names `{wanted}`, which {type(model).__name__} has no module of outside its "
                            f"decoder layers; choose from {', '.join(known)}.")
        found.update(matches)
    return found
