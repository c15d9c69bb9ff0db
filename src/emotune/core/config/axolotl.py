"""Axolotl training YAMLs, run as emotune `task: sft` configs.

`emotune run X.yml` accepts a file written for `axolotl train X.yml` (flat keys: `base_model`, `datasets`,
`adapter`, `lora_r`, `micro_batch_size`, `sequence_len`, ...). Each key becomes its emotune equivalent; a key the
file leaves out takes Axolotl's default, not emotune's, where it changes what is trained. What emotune cannot do the
same way (sample packing, RL, pretraining text, DeepSpeed, several datasets, ...) is refused with the key named; keys
that change nothing emotune measures are listed as ignored, with why. `key=value` overrides apply on top: dotted
emotune keys (`train.max_steps=2`), or Axolotl keys (`max_steps=2`) for any key emotune's own top level lacks.

Where the defaults come from (axolotl-ai-cloud/axolotl, `src/axolotl/utils/schemas/`): config.py, peft.py,
training.py and model.py; warmup and logging when unset from core/builders/base.py
(`_configure_warmup_and_logging`), the 4-bit settings from loaders/model.py (nf4, double quantization).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from emotune.core.config.axolotl_data import chat_template, dataset
from emotune.core.config.axolotl_keys import (
    FLAGS,
    IGNORED,
    KERNEL_PLUGINS,
    KEY_DEFAULTS,
    REFUSED,
    TRACKER_PLUGINS,
    TRACKING,
)
from emotune.core.config.base import is_run_name
from emotune.core.config.build import build_config, read_yaml
from emotune.core.config.llamafactory_keys import OPTIMIZER_ALIASES, OPTIMIZERS, SCHEDULES
from emotune.core.config.run import RunConfigBase
from emotune.core.config.sft import SftConfig
from emotune.core.config.translation import (
    Translation,
    adam_settings,
    as_flag,
    commented_yaml,
    flags,
    harmless,
    held_out,
    name_list,
    named_as_given,
    numbers,
    show,
    sort_unknown,
    split_overrides,
    warmup_share,
)
from emotune.core.config.translation import describe as shared_describe
from emotune.core.errors import UserError


def is_axolotl(raw: dict[str, Any]) -> bool:
    """An Axolotl training file: `base_model` and `datasets`, keys emotune's configs never have at their top level."""
    return "base_model" in raw and "datasets" in raw


def translate(file: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Translation:
    """The emotune `task: sft` config an Axolotl file means; refusals go to `problems`, not raised."""
    file, rest = split_overrides(dict(file), overrides, KEY_DEFAULTS.keys() | REFUSED.keys() | IGNORED.keys())
    t = Translation(overrides=rest, given=set(file))
    # a key left empty (`output_dir:`, as Axolotl's examples leave keys) is the key unset: output_dir became the run
    # folder ./None; but `bf16:` empty is not Axolotl's `auto`, it trains in fp32
    t.settings = {key: default for key, (default, _) in KEY_DEFAULTS.items()} | {
        key: value for key, value in file.items() if value is not None or key == "bf16"}
    # gradient_checkpointing may also be `offload`; bf16 `auto` or `full`: read with as_flag where they are used
    numbers(t, KEY_DEFAULTS, kinds={**dict.fromkeys(FLAGS, bool), "gradient_checkpointing": object} | flags(REFUSED))
    t.raw["task"] = SftConfig.model_fields["task"].default  # the task Axolotl's supervised fine-tuning is
    for step in (_refusals, _model, _method, _notes, dataset, _data_rest, _schedule, _precision, _steps, _output):
        step(t)
    sort_unknown(t, file, KEY_DEFAULTS.keys() | REFUSED.keys(), IGNORED, "an Axolotl")
    return t


def load(file: dict[str, Any], path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfigBase:
    """The resolved config of an Axolotl file: translated, then overridden, then validated, all problems at once."""
    t = translate(file, overrides)
    return build_config(t.raw, t.overrides, path, t.problems, named=named_as_given(t, t.overrides))


def _refusals(t: Translation) -> None:
    s = t.settings
    for key, (harmless_value, why) in REFUSED.items():
        if not harmless(s.get(key, harmless_value), harmless_value):
            t.problems.append(f"`{key}: {show(s[key])}` is not supported: {why}")
    if s["train_on_inputs"]:
        t.problems.append("`train_on_inputs: true` is not supported: emotune's loss is on the assistant turns only; "
                          "remove train_on_inputs")
    _special_tokens(t)
    plugins = name_list(s["plugins"]) if s["plugins"] else []
    kernels = [p for p in plugins if any(k in p.lower() for k in KERNEL_PLUGINS)]
    if kernels:
        t.ignored.append(("plugins: " + ", ".join(kernels), "the same loss in fewer kernels: speed and memory only"))
    trackers = [p for p in plugins if any(k in p.lower() for k in TRACKER_PLUGINS)]
    if trackers:
        t.ignored.append(("plugins: " + ", ".join(trackers), TRACKING))
    if set(plugins) - set(kernels) - set(trackers):
        t.problems.append(f"`plugins: {', '.join(p for p in plugins if p not in kernels + trackers)}` is not supported: "
                          "emotune runs no Axolotl plugins; remove them")


def _special_tokens(t: Translation) -> None:
    """`special_tokens`: the pad token changes nothing learned, nor does a token the tokenizer has already (Mistral and
    Llama 2 examples restate `bos_token: "<s>"`, `eos_token: "</s>"`, `unk_token: "<unk>"`); any other is refused."""
    given = t.settings["special_tokens"]
    tokens = given if isinstance(given, dict) else {}
    own = _own_special_tokens(t.settings.get("base_model"))
    same = [key for key, value in tokens.items() if key != "pad_token" and own.get(key) == value]
    others = {key: value for key, value in tokens.items() if key != "pad_token" and key not in same}
    if others or (given is not None and not isinstance(given, dict)):
        t.problems.append(f"`special_tokens: {show(given)}` is not supported: emotune keeps the tokenizer's special "
                          "tokens (the chat template's end of turn ends each answer); remove them" +
                          ("" if own else " (those the tokenizer has already are accepted where base_model is a "
                                          "local folder, which says what they are)"))
        return
    if "pad_token" in tokens:
        t.ignored.append(("special_tokens.pad_token", "padding is masked out of the loss, so the pad token changes "
                          "nothing learned; emotune pads with the tokenizer's own (its end-of-text token if it has none)"))
    t.ignored += [(f"special_tokens.{key}", "the tokenizer's own already") for key in same]


def _own_special_tokens(base_model: Any) -> dict[str, str]:
    """The special tokens of a local base_model folder's tokenizer (`bos_token`: "<s>", ...), read from its files
    without loading it; none for a hub id or a folder without them."""
    own: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            found = json.loads((Path(str(base_model)).expanduser() / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key, value in (found.items() if isinstance(found, dict) else ()):
            value = value.get("content") if isinstance(value, dict) else value  # {"content": "<s>", "lstrip": ...}
            if key.endswith("_token") and isinstance(value, str):
                own.setdefault(key, value)
    return own


def _model(t: Translation) -> None:
    s = t.settings
    if not s["base_model"]:
        t.problems.append("`base_model` is missing; name the base model (a hub id or a local folder)")
        return
    t.set("model.source", str(s["base_model"]), "base_model")
    for key in ("base_model_config", "tokenizer_config"):
        if s[key] not in (None, s["base_model"]):
            t.problems.append(f"`{key}: {s[key]}` is not supported: emotune reads the model's config and tokenizer "
                              "from base_model; remove it, or give a folder holding all three as base_model")
    if s["revision_of_model"]:
        t.set("model.revision", str(s["revision_of_model"]), "revision_of_model")
    if s["load_in_4bit"] and s["load_in_8bit"]:
        t.problems.append("`load_in_4bit` and `load_in_8bit` are both true; choose one")
    elif s["load_in_4bit"] or s["load_in_8bit"]:
        if s["adapter"] not in ("lora", "qlora"):
            t.problems.append("`load_in_4bit`/`load_in_8bit` need `adapter: lora` or `qlora`: a quantized model "
                              "trains through an adapter (Axolotl refuses it too)")
        bits = "4bit" if s["load_in_4bit"] else "8bit"
        t.set("model.quantization", bits, "load_in_4bit", "load_in_8bit")
        if bits == "4bit":  # Axolotl's BitsAndBytesConfig (loaders/model.py), bnb_config_kwargs over it
            kwargs = s["bnb_config_kwargs"] if isinstance(s["bnb_config_kwargs"], dict) else {}
            t.set("model.quant_type", kwargs.get("bnb_4bit_quant_type", "nf4"), "load_in_4bit", "bnb_config_kwargs",
                  note="as Axolotl quantizes")
            t.set("model.double_quant", bool(kwargs.get("bnb_4bit_use_double_quant", True)), "load_in_4bit",
                  "bnb_config_kwargs", note="as Axolotl quantizes")
    kwargs = s["bnb_config_kwargs"] if isinstance(s["bnb_config_kwargs"], dict) else {}
    other = sorted(map(str, set(kwargs) - {"bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                                           "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"}))
    if other or (s["bnb_config_kwargs"] is not None and not isinstance(s["bnb_config_kwargs"], dict)):
        t.problems.append(f"`bnb_config_kwargs: {show(s['bnb_config_kwargs'])}` is not supported beyond "
                          "bnb_4bit_quant_type and bnb_4bit_use_double_quant (model.quant_type, model.double_quant); "
                          "emotune computes in the training precision and stores the weights as bitsandbytes packs them")
    if s["adapter"] == "qlora" and not s["load_in_4bit"]:
        t.problems.append("`adapter: qlora` needs `load_in_4bit: true` (Axolotl refuses it without too); or use "
                          "adapter: lora")


def _method(t: Translation) -> None:
    s = t.settings
    lora_keys = [k for k in KEY_DEFAULTS if (k == "peft" or k.startswith(("lora_", "peft_", "loraplus_")))
                 and k in t.given]
    if s["adapter"] is None:
        t.set("train.finetuning", "full", "adapter", note="no adapter: Axolotl trains every parameter")
        t.ignored += [(key, "a LoRA setting; without `adapter` no adapters are trained") for key in lora_keys]
        if s["unfrozen_parameters"]:
            t.problems.append(f"`unfrozen_parameters: {show(s['unfrozen_parameters'])}` is not supported: emotune "
                              "freezes by decoder layers and modules (train.finetuning: freeze), not by parameter-name "
                              "patterns")
        return
    if s["unfrozen_parameters"]:
        t.ignored.append(("unfrozen_parameters", "with an adapter only the adapters train (PEFT freezes the base); "
                          "emotune's all-linear adapts the language model only, never a vision or audio tower"))
    if s["adapter"] not in ("lora", "qlora"):
        t.problems.append(f"`adapter: {s['adapter']}` is not supported: emotune trains LoRA adapters (adapter: lora "
                          "or qlora), or the whole model (no adapter)")
        return
    t.set("train.finetuning", "lora", "adapter")
    for key in ("lora_r", "lora_alpha"):
        if s[key] is None:
            t.problems.append(f"`{key}` is missing; Axolotl has no default for it (PEFT would fail), e.g. lora_r: 16, "
                              "lora_alpha: 32")
        else:
            t.set(f"lora.{'r' if key == 'lora_r' else 'alpha'}", s[key], key)
    t.set("lora.dropout", s["lora_dropout"], "lora_dropout")
    _targets(t)
    if s["lora_target_parameters"]:
        t.set("lora.target_parameters", name_list(s["lora_target_parameters"]), "lora_target_parameters",
              note="LoRA on the routed experts' 3-D weights")
    if s["lora_modules_to_save"]:
        t.set("lora.modules_to_save", name_list(s["lora_modules_to_save"]), "lora_modules_to_save")
    if s["peft_layers_to_transform"] is not None:
        t.set("lora.layers", s["peft_layers_to_transform"], "peft_layers_to_transform")
    _init(t)
    t.set("lora.use_rslora", bool(s["peft_use_rslora"]), "peft_use_rslora")
    t.set("lora.use_dora", bool(s["peft_use_dora"]), "peft_use_dora")
    if s["lora_model_dir"]:
        t.set("lora.adapter", str(s["lora_model_dir"]), "lora_model_dir", note="trains on from this adapter")
    if s["loraplus_lr_ratio"] is not None:
        t.set("train.loraplus_lr_ratio", s["loraplus_lr_ratio"], "loraplus_lr_ratio")
        t.set("train.loraplus_lr_embedding", s["loraplus_lr_embedding"], "loraplus_lr_embedding")


def _init(t: Translation) -> None:
    """`peft: {loftq_config: {loftq_bits: 4}}`: LoftQ's start (loaders/adapter.py), emotune's lora.init: loftq, which
    quantizes to 4 bits as Axolotl's LoftQConfig does by default."""
    peft = t.settings["peft"]
    if peft is None:
        return
    loftq = peft.get("loftq_config") if isinstance(peft, dict) else None
    bits = (loftq or {}).get("loftq_bits", 4) if isinstance(loftq, dict) or loftq is None else None
    if not isinstance(peft, dict) or set(peft) - {"loftq_config"} or (loftq is not None and bits not in (4, 0, None)):
        t.problems.append(f"`peft: {show(peft)}` is not supported: emotune reads peft.loftq_config with loftq_bits: 4 "
                          "only (LoftQ's 4-bit start, lora.init: loftq); remove the rest")
    elif loftq is not None and bits:
        t.set("lora.init", "loftq", "peft", note="LoftQ's start: adapters that make up for 4-bit rounding")


def _notes(t: Translation) -> None:
    """Keys emotune takes as they are meant but carries out its own way, each said in the translation's notes."""
    s = t.settings
    if s["eot_tokens"]:
        t.notes.append(f"eot_tokens: {show(s['eot_tokens'])}: emotune trains each answer through the chat template's own "
                       "end-of-turn token and stops generation on it and on EOS (emotune.model.turns); other tokens "
                       "listed there are not trained as turn ends.")
    if s["quantize_moe_experts"] and (s["load_in_4bit"] or s["load_in_8bit"]):
        t.notes.append("quantize_moe_experts: true: emotune keeps a mixture-of-experts model's routed experts (3-D "
                       "weights) unquantized, as bitsandbytes' linear layers cannot hold them: more memory than "
                       "Axolotl's, and the experts compute at full precision (`emotune plan` shows how much).")


def _targets(t: Translation) -> None:
    """lora_target_linear: every linear layer but the output layer (find_all_linear_names), as PEFT's all-linear."""
    s = t.settings
    named = name_list(s["lora_target_modules"]) if s["lora_target_modules"] else []
    if s["lora_target_linear"]:
        t.set("lora.target_modules", "all-linear", "lora_target_linear", "lora_target_modules")
    elif named:
        t.set("lora.target_modules", named, "lora_target_modules")
    else:
        t.problems.append("`lora_target_modules` is missing and `lora_target_linear` is not true: name the layers "
                          "to adapt, e.g. lora_target_linear: true (every linear layer)")


def _data_rest(t: Translation) -> None:
    s = t.settings
    held_out(t, "val_set_size", "Axolotl trains on every row and validates on none")
    t.notes.append("emotune also holds out data.test_size of the rows to measure the model before and after training; "
                   "Axolotl trains on them.")
    t.set("train.max_length", s["sequence_len"], "sequence_len")
    strategy = s["excess_length_strategy"] or "drop"
    if strategy != "truncate":
        t.notes.append(f"excess_length_strategy: {strategy}{'' if s['excess_length_strategy'] else ' (default)'}: "
                       "Axolotl leaves out rows longer than sequence_len; emotune cuts them at the end and counts them "
                       "in data_report.json.")
    dedup = bool(s["dataset_exact_deduplication"])
    t.set("data.cleaning.duplicates", "exact" if dedup else "keep", "dataset_exact_deduplication",
          note="" if dedup else "Axolotl trains on repeated rows as they are")
    if s["default_system_message"] is not None:
        t.set("prompt.system_prompt", str(s["default_system_message"]), "default_system_message")
    chat_template(t, s["chat_template"], s["chat_template_jinja"])


def _schedule(t: Translation) -> None:
    s = t.settings
    t.set("train.batch_size", s["micro_batch_size"], "micro_batch_size")
    t.set("train.gradient_accumulation_steps", s["gradient_accumulation_steps"], "gradient_accumulation_steps")
    rate = s["learning_rate"]
    try:
        t.set("train.learning_rate", float(rate), "learning_rate")
    except (TypeError, ValueError):
        t.problems.append("`learning_rate` is missing; Axolotl has no default for it, e.g. learning_rate: 2e-4"
                          if rate is None else f"`learning_rate`: {rate!r} is not a number")
    t.set("train.num_train_epochs", s["num_epochs"], "num_epochs")
    t.set("train.max_steps", s["max_steps"] if s["max_steps"] else -1, "max_steps")
    if s["lr_scheduler"] in SCHEDULES:
        t.set("train.lr_scheduler_type", s["lr_scheduler"], "lr_scheduler")
    else:
        t.problems.append(f"`lr_scheduler: {s['lr_scheduler']}` is not supported; emotune has {', '.join(SCHEDULES)}")
    if s["warmup_steps"] is not None:
        if not warmup_share(t):
            t.set("train.warmup_steps", s["warmup_steps"], "warmup_steps")
    elif s["warmup_ratio"] is not None:
        t.set("train.warmup_ratio", s["warmup_ratio"], "warmup_ratio")
    else:
        t.set("train.warmup_ratio", 0.03, "warmup_steps", "warmup_ratio", note="Axolotl's 3% of the steps")
        t.notes.append("No warmup_steps or warmup_ratio: Axolotl warms up for 3% of the steps but at most 100; on runs "
                       "over 3,333 steps set train.warmup_steps=100 to match.")
    t.set("train.weight_decay", s["weight_decay"], "weight_decay")
    t.set("train.max_grad_norm", 1.0 if s["max_grad_norm"] is None else s["max_grad_norm"], "max_grad_norm",
          note="" if s["max_grad_norm"] is not None else "transformers' default")
    adam_settings(t)
    optimizer = s["optimizer"]
    if isinstance(optimizer, str) and (optimizer in OPTIMIZERS or optimizer in OPTIMIZER_ALIASES):
        t.set("train.optim", OPTIMIZER_ALIASES.get(optimizer, optimizer), "optimizer")
    else:
        t.problems.append(f"`optimizer: {show(optimizer)}` is not supported; emotune has {', '.join(OPTIMIZERS)}")
    t.set("train.group_by_length", bool(s["group_by_length"]), "group_by_length")


def _precision(t: Translation) -> None:
    s = t.settings
    s["bf16"] = as_flag(s["bf16"])
    bf16 = s["bf16"] in (True, "full")
    if bf16 and s["fp16"]:
        t.problems.append("`bf16` and `fp16` are both true; choose one")
    precision = "bf16" if bf16 else "fp16" if s["fp16"] else "auto" if s["bf16"] == "auto" else "fp32"
    t.set("train.precision", precision, "bf16", "fp16")
    if precision == "auto":
        t.notes.append("bf16: auto: Axolotl trains in bf16 where the GPU has it, else in fp32; emotune's `auto` picks "
                       "fp16 on GPUs without bf16: set train.precision=fp32 there to match.")
    t.set("train.gradient_checkpointing", bool(as_flag(s["gradient_checkpointing"])), "gradient_checkpointing")


def _steps(t: Translation) -> None:
    s = t.settings
    for key in ("logging_steps", "eval_steps", "save_steps"):
        value = s[key]
        if value is None:
            continue
        if isinstance(value, str):  # YAML reads a quoted "10" as text
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            t.problems.append(f"`{key}: {show(value)}` is not supported: give a number of steps")
        elif isinstance(value, float) and not value.is_integer():
            t.problems.append(f"`{key}: {value}` (a share of the steps) is not supported: give a number of steps")
        else:
            t.set(f"train.{key}", int(value), key)
    if s["eval_steps"] is None or s["save_steps"] is None:
        t.notes.append("eval_steps or save_steps unset: Axolotl validates and saves once an epoch; emotune validates "
                       "and checkpoints every train.eval_steps / train.save_steps optimizer steps (25 unless set).")
    if s["save_total_limit"]:
        t.set("train.save_total_limit", s["save_total_limit"], "save_total_limit")
    if s["early_stopping_patience"]:
        t.set("train.early_stopping_patience", s["early_stopping_patience"], "early_stopping_patience")
    t.notes.append("emotune keeps the adapter with the lowest validation loss; Axolotl keeps the last weights "
                   "(load_best_model_at_end: false).")


def _output(t: Translation) -> None:
    s = t.settings
    folder = PurePosixPath(str(s["output_dir"]).rstrip("/"))
    if not is_run_name(folder.name):
        t.problems.append(f"`output_dir: {s['output_dir']}` must end in a plain folder name (letters, digits, `.`, "
                          "`-`, `_`; at most 100 characters and 200 bytes), e.g. ./outputs/lora-out")
    t.set("output_dir", str(folder.parent), "output_dir", note="the run folder is output_dir/name")
    t.set("name", folder.name, "output_dir")
    t.set("seed", 42 if s["seed"] is None else s["seed"], "seed", note="" if s["seed"] is not None else "transformers' default")


# --------------------------------------------------------------------------------------------------
# What is printed


def describe(t: Translation, path: Path) -> str:
    """Each key's emotune equivalent, the keys ignored and why, and the notes: printed before a run."""
    return shared_describe(t, path, f"Axolotl config {path} -> emotune task: sft (keys the file leaves out: "
                                    "Axolotl's defaults)")


def announce(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """Print the translation when `path` is an Axolotl file; nothing otherwise."""
    from emotune.core.config.build import read_yaml

    file = read_yaml(Path(path))
    if is_axolotl(file):
        print(describe(translate(file, overrides), Path(path)) + "\n", flush=True)


def translated_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """`emotune config --from-axolotl FILE`: the emotune YAML the file means (overrides applied), with the translation
    as comments; every problem is reported at once, as by `run`."""
    file = read_yaml(Path(path))
    if not isinstance(file, dict) or not is_axolotl(file):
        raise UserError(f"`{path}` is not an Axolotl training config: it has no `base_model` with `datasets`. Give the "
                        "YAML you pass to `axolotl train` (an emotune config needs no translation: `emotune config "
                        f"{path}` prints it resolved).")
    t = translate(file, overrides)
    build_config(json.loads(json.dumps(t.raw)), t.overrides, path, t.problems)
    return commented_yaml(t, describe(t, Path(path)))
