"""LoRA adapters from our config: which modules, which variant (rsLoRA, DoRA), and a check of the result.

`all-linear` is resolved here rather than by PEFT, because PEFT's `all-linear` adapts every linear
layer of the checkpoint, including the vision and audio towers of multimodal Gemma 3n / Gemma 4
checkpoints, which a text classifier never runs. We restrict it to the language model (the module
`emotune.model.text.language_model` returns) and write the result as a regex PEFT full-matches against module names.

`lora.layers` restricts the adapters to some decoder layers. A list of targets gets PEFT's own
`layers_to_transform`, with `layers_pattern` set to the full path of the language model's layer list
(`model.layers`, or `model.language_model.layers` in multimodal Gemma 3n / Gemma 4): PEFT takes the layer
index from the first `<layers_pattern>.<N>.` in a module name, and the bare `layers` would also match the
vision and audio towers' own `...encoder.layers.N` / `audio_tower.layers.N`. PEFT refuses
`layers_to_transform` beside a regex (LoraConfig.__post_init__), so `all-linear` writes the layers into its regex.

Why it pays: autograd runs the backward pass only through what leads to a parameter that requires grad, so the
frozen layers below the lowest adapted one get no backward pass at all. transformers' (and PEFT's) hook that
makes the input embeddings' output require grad would undo that; non-reentrant checkpointing does not need it,
so `checkpoint_activations` removes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model import init_methods
from emotune.model.text import causal_lm_class, expert_weights, is_router, language_model

LINEAR = (torch.nn.Linear, Conv1D)
"""What `all-linear` adapts, as PEFT's own `all-linear` does: GPT-2's projections are transformers' Conv1D (a linear
layer with its weight stored transposed), which PEFT's LoRA wraps like an nn.Linear."""


_PEFT_REFUSED = {"out_proj", "conv1d"}
_READ_DIRECTLY = {"x_proj", "dt_proj"}
MAMBA_SKIPPED = {**dict.fromkeys(("mamba2", "falcon_h1", "nemotron_h", "bamba", "granitemoehybrid", "zamba2"),
                                 _PEFT_REFUSED),
                 **dict.fromkeys(("mamba", "falcon_mamba"), _PEFT_REFUSED | _READ_DIRECTLY), "jamba": {"dt_proj"}}
"""Linear layers of Mamba-based model types that `all-linear` leaves out, by model type: those whose weights the
model's own code reads directly, so a LoRA there would train nothing or, on a GPU with the fused kernels, be skipped
in training yet merged. PEFT refuses LoRA on `out_proj` and `conv1d` of Mamba-2, Falcon-H1 and Nemotron-H
(peft.tuners.tuners_utils' `_check_target_module_compatiblity`); Bamba's, Granite 4's and Zamba2's Mamba-2 mixers pass
`out_proj.weight` to the same kernel. Mamba's and Falcon-Mamba's mixers read `dt_proj.weight` on every path
(`dt_proj.weight @ time_step`) and `x_proj.weight` in the fused training kernel (they adapt `in_proj`); Jamba's reads
`dt_proj.weight`."""


def _adaptable(module: torch.nn.Module) -> bool:
    """A linear layer `all-linear` adapts. Mixture-of-experts routers are left out: Llama 4's and PhiMoE's subclass
    nn.Linear but return the routing (scores and logits, a tuple), which a LoRA branch cannot add to; Gemma 4's, DBRX's
    and AFMoE's hold their projection as a linear layer inside (`router.proj`), which `language_model_linear_targets`
    leaves out with its router; the other families' routers are no linear layers at all. So no family's routing
    changes under `all-linear`."""
    return isinstance(module, LINEAR) and not is_router(module)


def parameter_targets(model: PreTrainedModel, cfg: LoraSettings, layers: list[int] | None = None) -> list[str]:
    """The full names of the weights `lora.target_parameters` adapts (inside decoder `layers` only, when given);
    empty when it is null. Names a list gives must each match a weight (by its name or last dotted parts)."""
    if cfg.target_parameters is None:
        return []
    if cfg.target_parameters == "experts":
        names = expert_weights(model)
        if not names:
            raise UserError(f"lora.target_parameters=experts: {type(model).__name__} has no routed experts (no "
                            "mixture-of-experts layer with 3-D expert weights in its language model), so nothing would be "
                            "adapted. Set lora.target_parameters=null; lora.target_modules adapts its linear layers.")
    else:
        weights = [name for name, _ in model.named_parameters()]
        missing = [t for t in cfg.target_parameters if not any(n == t or n.endswith(f".{t}") for n in weights)]
        if missing:
            raise UserError(f"lora.target_parameters: {', '.join(f'`{t}`' for t in missing)} names no weight of "
                            f"{type(model).__name__}, so it would not be adapted. Use the weights' names as "
                            "model.named_parameters() gives them (e.g. mlp.experts.gate_up_proj), or `experts`.")
        names = [n for n in weights if any(n == t or n.endswith(f".{t}") for t in cfg.target_parameters)]
    if layers is not None:
        path = decoder_layers_path(model)
        names = [n for n in names if any(n.startswith(f"{path}.{i}.") for i in layers)]
    return names


def peft_renames(model: PreTrainedModel) -> set[str]:
    """The module names PEFT rewrites for this model type under transformers 5: for mixture-of-experts families whose
    experts became 3-D weights (Qwen2-MoE's pattern: Qwen3-Next, DeepSeek V2/V3, GLM-4 MoE, ...; Mixtral's), PEFT
    reads `gate_proj`, `up_proj` and `down_proj` (`w1`-`w3`) as transformers 4's expert layers and adds LoRA on the
    routed experts' weights for them (peft.utils.transformers_weight_conversion). A regex is resolved to such leaf
    names first, so `all-linear` over a shared expert's projections put LoRA on every routed expert too (and with
    dropout the run stopped: 'ParamWrapper does not work with lora_dropout != 0'); full module names of linear
    layers stay modules (PEFT 0.22, huggingface/peft#3711). Empty for every other model type."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:  # a PEFT without the conversion
        return set()
    pattern = _MODEL_TO_CONVERSION_PATTERN.get(getattr(model.config, "model_type", None))
    return set(_MOE_TARGET_MODULE_MAPPING.get(pattern, {}))


def language_model_linear_targets(model: PreTrainedModel, layers: list[int] | None = None) -> str | list[str]:
    """A regex matching every linear layer inside the language model (inside decoder `layers` only, when given),
    and nothing outside it; the full names of those layers instead where PEFT would rewrite the regex's names
    (`peft_renames`)."""
    decoder = language_model(model)
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    output = model.get_output_embeddings()
    routers = [name for name, module in decoder.named_modules() if is_router(module)]
    linears = {f"{prefix}.{name}".lstrip(".") for name, module in decoder.named_modules()
               if _adaptable(module) and module is not output and name
               and not any(name.startswith(f"{router}.") for router in routers)}
    skipped = MAMBA_SKIPPED.get(getattr(model.config, "model_type", None), set())
    linears = {name for name in linears if name.rsplit(".", 1)[-1] not in skipped}
    if layers is not None:
        path = decoder_layers_path(model)
        linears = {name for name in linears if any(name.startswith(f"{path}.{i}.") for i in layers)}
    if not linears:
        raise UserError(f"lora.target_modules=all-linear: the language model of {type(model).__name__} has no linear "
                        "layer to adapt. Name the modules to adapt in lora.target_modules.")
    if peft_renames(model) & {_leaf(name) for name in linears}:
        return sorted(linears)  # names PEFT keeps as modules (see peft_renames)
    if layers is not None:
        inside = rf"{re.escape(decoder_layers_path(model))}\.(?:{'|'.join(map(str, layers))})\.(?:.*\.)?"
    else:
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


def decoder_layers_path(model: PreTrainedModel) -> str:
    """The module name of the language model's list of decoder layers: `model.layers`, `model.language_model.layers`,
    `transformer.h` (GPT-2, Falcon): the language model's `layers`, else its one child list of `num_hidden_layers`."""
    decoder = language_model(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        count = decoder_layer_count(model.config)
        lists = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
        layers = lists[0] if len(lists) == 1 else None
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"lora.layers: emotune could not find the decoder layers of {type(model).__name__} (no "
                        "`layers` list in its language model). Set lora.layers=null to adapt every layer.")
    return next(name for name, module in model.named_modules() if module is layers)


def decoder_layer_count(config) -> int:
    """The number of decoder layers a transformers config declares (the text model's, for multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def resolve_layers(layers: list[int] | int | None, count: int) -> list[int] | None:
    """`lora.layers` as the sorted layer indices of a model with `count` decoder layers (None: every layer).

    A count counts as LLaMA-Factory's `freeze_trainable_layers`: N > 0 = the last N layers (the top ones, nearest the
    output), -N = the first N (nearest the embeddings). Indices past the last layer and counts larger than the
    model are refused rather than clipped, so a config written for a deeper model does not silently change meaning."""
    if layers is None:
        return None
    if isinstance(layers, int):
        if abs(layers) > count:
            raise UserError(f"lora.layers={layers} asks for {abs(layers)} layers, but the model has {count} decoder "
                            f"layers. Set lora.layers to a count from 1 to {count} (the last N layers; -N for the first "
                            "N), a list of indices, or null for every layer.")
        return list(range(count - layers, count)) if layers > 0 else list(range(-layers))
    beyond = [i for i in layers if i >= count]
    if beyond:
        raise UserError(f"lora.layers lists layer {', '.join(map(str, beyond))}, but the model has {count} decoder "
                        f"layers (indices 0 to {count - 1}). Use indices from 0 to {count - 1}, a count such as "
                        f"lora.layers={min(4, count)} for the last layers, or null for every layer.")
    return sorted(layers)


def _module_names(model: PreTrainedModel, names: list[str], layers: list[int] | None) -> list[str]:
    """The full names of the modules a `lora.target_modules` list names (as PEFT matches a list: the name itself or
    its last dotted parts), inside decoder `layers` when given: for the model types whose names PEFT would rewrite
    into routed-expert weights (`peft_renames`); the experts are `lora.target_parameters`' to adapt."""
    path = decoder_layers_path(model) if layers is not None else ""
    return sorted(name for name, _ in model.named_modules()
                  if any(name == t or name.endswith(f".{t}") for t in names)
                  and (layers is None or any(name.startswith(f"{path}.{i}.") for i in layers)))


def check_layers(cfg: LoraSettings, model_config) -> None:
    """Refuse, before any weights load, a `lora.layers` the model (known by its config.json) does not have."""
    resolve_layers(cfg.layers, decoder_layer_count(model_config))


def lora_config(cfg: LoraSettings, model: PreTrainedModel, task_type: str = "CAUSAL_LM",
                extra_modules_to_save: tuple[str, ...] = ()) -> PeftLoraConfig:
    """PEFT's config; `task_type` SEQ_CLS with the head in `extra_modules_to_save` for a classification head."""
    layers = resolve_layers(cfg.layers, decoder_layer_count(model.config))
    if cfg.target_modules == "all-linear":
        targets, by_index = language_model_linear_targets(model, layers), {}
    elif isinstance(cfg.target_modules, list) and peft_renames(model) & {t.rsplit(".", 1)[-1] for t in cfg.target_modules}:
        targets, by_index = _module_names(model, cfg.target_modules, layers), {}
    else:
        targets = cfg.target_modules
        by_index = ({} if layers is None else
                    {"layers_to_transform": layers, "layers_pattern": re.escape(decoder_layers_path(model))})
    weights = parameter_targets(model, cfg, layers)
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
        **by_index,
        **init_methods.peft_init(cfg, model),
        **({"target_parameters": weights} if weights else {}),
    )


def attach_lora(model: PreTrainedModel, cfg: LoraSettings, task_type: str = "CAUSAL_LM",
                extra_modules_to_save: tuple[str, ...] = ()) -> PeftModel:
    """Wrap `model` with fresh adapters and print what is trained; fail clearly when nothing is. A model that has
    its adapter already (lora.adapter: training on from it) keeps it."""
    if isinstance(model, PeftModel):
        init_methods.mark_adapters_trainable(model)
        trainable, total = count_parameters(model)
        print(f"Adapter {model.active_adapter} kept; trainable parameters: {trainable:,} / {total:,}", flush=True)
        return model
    if isinstance(cfg.target_modules, list):
        _check_named_targets(model, cfg.target_modules)
    count = decoder_layer_count(model.config)
    layers = resolve_layers(cfg.layers, count)
    experts, weights = expert_weights(model), parameter_targets(model, cfg, layers)  # named as before PEFT wraps them
    try:
        adapted = get_peft_model(model, lora_config(cfg, model, task_type, extra_modules_to_save))
    except ValueError as err:  # PEFT names the module it could not find
        raise UserError(f"LoRA matched no module of {type(model).__name__} (or could not be attached): {err} Check lora.target_modules "
                        "and lora.modules_to_save against the model's module names.") from None
    init_methods.start(adapted, cfg)
    trainable, total = count_parameters(adapted)
    if trainable == 0:
        raise UserError(f"LoRA matched no module: lora.target_modules={cfg.target_modules!r} found nothing to adapt "
                        f"in {type(model).__name__}. Use `all-linear` or names of its linear layers (e.g. [q_proj, v_proj]).")
    variant = " + ".join(["rsLoRA" if cfg.use_rslora else "LoRA"] + (["DoRA"] if cfg.use_dora else []))
    where = "" if layers is None else f" on decoder layers {_ranges(layers)} of 0-{count - 1}"
    also = f" and {len(weights)} weights (lora.target_parameters)" if weights else ""
    print(f"{variant} r={cfg.r} alpha={cfg.alpha} dropout={cfg.dropout}{where}{also}; trainable parameters: "
          f"{trainable:,} / {total:,} ({100 * trainable / total:.2f}%)", flush=True)
    if experts and cfg.target_parameters is None:
        print(f"Note: the routed experts of {type(model).__name__} ({len(experts)} 3-D weights) stay frozen: "
              "lora.target_modules adapts linear layers only. lora.target_parameters=experts (with lora.dropout=0) "
              "adapts them too.", flush=True)
    return adapted


def check_targets(cfg: LoraSettings, model_config, model_dir: Path | None = None, model_cfg: ModelConfig | None = None) -> None:
    """Refuse, before any weights load, what the adapted modules cannot take, read from an empty (meta-device) copy
    built from config.json: names in a `lora.target_modules` list that match no module, `lora.target_parameters` that
    match no weight, and OLoRA on transformers'
    Conv1D layers (GPT-2's), whose weights PEFT's OLoRA factors untransposed: the first forward pass stopped with a
    shape error (PEFT's PiSSA transposes them; issue huggingface/peft#2991 is the same gap in CoRDA)."""
    loftq_weights = (cfg.init == "loftq" and model_dir is not None and model_cfg is not None
                     and model_cfg.quantization == "4bit")
    if not isinstance(cfg.target_modules, list) and cfg.init != "olora" and cfg.target_parameters is None and not loftq_weights:
        return
    try:
        with torch.device("meta"):
            model = causal_lm_class(model_config).from_config(model_config)
    except (ImportError, RuntimeError, ValueError):  # a part that cannot be built empty here: attach_lora checks
        return
    if isinstance(cfg.target_modules, list):
        _check_named_targets(model, cfg.target_modules)
    if cfg.init == "olora":
        _check_olora(model, cfg)
    parameter_targets(model, cfg)
    if loftq_weights:
        _check_loftq_names(model, cfg, model_dir)


def _check_loftq_names(model: PreTrainedModel, cfg: LoraSettings, model_dir: Path) -> None:
    """LoftQ over a 4-bit base reads each adapted layer's original weight from the safetensors by the layer's name
    (PEFT's replace_lora_weights_loftq: the name, or without the model's base_model_prefix when in one file); a
    checkpoint stored under other names (an older layout transformers renames while loading) would stop it after
    the baseline evaluation, so it is refused here."""
    targets = lora_config(cfg.model_copy(update={"init": "default"}), model).target_modules
    wanted = [name + ".weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
              and (re.fullmatch(targets, name) if isinstance(targets, str)
                   else any(name == t or name.endswith(f".{t}") for t in targets))]
    stored, sharded = stored_weight_names(model_dir)
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None
    missing = [n for n in wanted if n not in stored
               and (sharded or prefix is None or not n.startswith(prefix) or n[len(prefix):] not in stored)]
    if missing:
        raise UserError(f"lora.init=loftq over a 4-bit base reads the original weights of the adapted layers from "
                        f"{model_dir}'s safetensors by name, and {len(missing)} of {len(wanted)} are not stored under "
                        f"their layer's name (e.g. `{missing[0]}`: the checkpoint uses an older layout that transformers "
                        "renames while loading). Save the model again with save_pretrained (transformers writes the "
                        "names it loads), or set lora.init=default.")


def stored_weight_names(model_dir: Path) -> tuple[set[str], bool]:
    """The tensor names in a folder's safetensors (one file, or the shards' index), and whether it is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})), True
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys()), False


def _check_olora(model: PreTrainedModel, cfg: LoraSettings) -> None:
    targets = lora_config(cfg.model_copy(update={"init": "default"}), model).target_modules
    conv1d = [name for name, module in model.named_modules() if isinstance(module, Conv1D)
              and (re.fullmatch(targets, name) if isinstance(targets, str)
                   else any(name == t or name.endswith(f".{t}") for t in targets))]
    if conv1d:
        raise UserError(f"lora.init=olora cannot start from {type(model).__name__}'s Conv1D layers ({conv1d[0]} and "
                        f"{len(conv1d) - 1} more: weights stored transposed, which PEFT's OLoRA factors as they are, "
                        "so the first forward pass fails). Use lora.init=pissa, which starts from the base weights too "
                        "and handles them, or lora.init=default.")


def _check_named_targets(model: PreTrainedModel, targets: list[str]) -> None:
    """Refuse names in a `lora.target_modules` list that match no module. PEFT refuses a list only when none of its
    names matches, so `[q_proj, gate_up_proj]` on a mixture-of-experts model adapted q_proj alone, without a word:
    transformers 5 keeps each layer's routed experts as 3-D parameters (`experts.gate_up_proj`), not modules. PEFT
    matches a list's name against a module name or its last dotted parts."""
    modules = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in modules)]
    if not missing:
        return
    parameters = {t: owner for t in missing
                  for name, param in model.named_parameters() if name == t or name.endswith(f".{t}")
                  for owner in [type(model.get_submodule(name.rpartition(".")[0])).__name__]}
    said = [f"`{t}` is a weight of {parameters[t]}, not a module (a mixture-of-experts layer keeps its routed experts "
            "as one 3-D tensor, which LoRA's module targets cannot adapt)" if t in parameters
            else f"`{t}` names no module" for t in missing]
    raise UserError(f"lora.target_modules: {'; '.join(said)} in {type(model).__name__}, so it would not be adapted. "
                    "Remove it from lora.target_modules, or use `all-linear` (every linear layer of the language "
                    "model: attention, MLPs and shared experts); routed experts take lora.target_parameters=experts "
                    "(with lora.dropout=0).")


def checkpoint_activations(model: PreTrainedModel) -> None:
    """Non-reentrant activation checkpointing, without the hook that makes the input embeddings' output require grad.

    transformers' `gradient_checkpointing_enable` adds that hook for reentrant checkpointing, which loses the
    gradient when no input of a checkpointed layer requires grad. Non-reentrant checkpointing does not, and with the
    hook the backward pass would run through every frozen layer below the adapters (lora.layers) for nothing."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.disable_input_require_grads()


def _ranges(indices: list[int]) -> str:
    """`0-3, 8, 10-11` for [0, 1, 2, 3, 8, 10, 11]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
