"""LLaMA-Factory training YAMLs, run as emotune `task: sft` configs.

`emotune run X.yaml` accepts a file written for `llamafactory-cli train X.yaml` (flat keys: `stage`,
`model_name_or_path`, `lora_rank`, `dataset`, ...). Each key becomes its emotune equivalent; a key the file
leaves out takes LLaMA-Factory's default, not emotune's, so the same file trains the same way in both tools.
What emotune cannot do the same way (another stage, GPTQ-style quantization, preference data, ...)
is refused with the key named; keys that change nothing emotune measures are listed as ignored, with why.
`key=value` overrides apply on top: dotted emotune keys (`train.max_steps=2`), or LLaMA-Factory keys
(`max_steps=2`) for any key emotune's own top level lacks.

Where the defaults come from (hiyouga/LLaMA-Factory, `src/llamafactory/hparams/`): finetuning_args.py,
data_args.py and model_args.py; the trainer's own keys from transformers' `Seq2SeqTrainingArguments`, which
LLaMA-Factory's `TrainingArguments` (training_args.py) extends, read in the transformers emotune installs.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from emotune.core.config.base import is_run_name
from emotune.core.config.build import _parse_value, _set_dotted, build_config, yaml_text
from emotune.core.config.llamafactory_files import not_training, purpose, refuse_v1
from emotune.core.config.llamafactory_keys import (
    FINETUNING,
    IGNORED,
    KEY_DEFAULTS,
    OPTIMIZER_ALIASES,
    OPTIMIZERS,
    REFUSED,
    SCHEDULES,
    TRACKERS,
)
from emotune.core.config.llamafactory_templates import template_check
from emotune.core.config.run import RunConfigBase
from emotune.core.config.sft import LLAMAFACTORY_INPUT_SEPARATOR
from emotune.core.errors import UserError

# every translated key with its default: LLaMA-Factory's `stage` (which names emotune's task) and the rest
DEFAULTS: dict[str, tuple[Any, str]] = {"stage": ("sft", FINETUNING), **KEY_DEFAULTS}


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """A LLaMA-Factory file: flat keys emotune's configs never have at their top level."""
    return "model_name_or_path" in raw or {"stage", "finetuning_type"} <= raw.keys()


@dataclass
class Translation:
    """What a LLaMA-Factory file becomes: the emotune config (before overrides) and what was done to each key."""

    raw: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)  # the emotune overrides left after LLaMA-Factory ones
    rows: list[tuple[str, str]] = field(default_factory=list)  # (LLaMA-Factory key: value, emotune key: value)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    template: str | None = None
    given: set[str] = field(default_factory=set)  # the keys the file (or a LLaMA-Factory override) sets
    settings: dict[str, Any] = field(default_factory=dict)  # every translated key: the file's value or the default

    def set(self, emotune_key: str, value: Any, *lf_keys: str, note: str = "") -> None:
        _set_dotted(self.raw, emotune_key, value)
        source = ", ".join(f"{k}: {_show(self.settings.get(k))}" + ("" if k in self.given else " (default)")
                           for k in lf_keys)
        self.rows.append((source, f"{emotune_key}: {_show(value)}" + (f"  ({note})" if note else "")))


def translate(file: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Translation:
    """The emotune `task: sft` config a LLaMA-Factory file means; refusals go to `problems`, not raised."""
    file, rest = _split_overrides(dict(file), overrides)
    t = Translation(overrides=rest, given=set(file))
    t.settings = {key: default for key, (default, _) in DEFAULTS.items()} | file
    _numbers(t)
    t.set("task", "sft", "stage")
    for step in (_refusals, _model, _method, _dataset, _schedule, _precision, _steps, _output):
        step(t)
    known = [*DEFAULTS, *REFUSED, *IGNORED]
    for key in file:
        if key in DEFAULTS or key in REFUSED:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.85) if key not in IGNORED else []
        if close:  # a misspelt key would be one setting silently left at its default; LLaMA-Factory refuses it too
            t.problems.append(f"`{key}` is not a LLaMA-Factory key; did you mean `{close[0]}`?")
        else:
            t.ignored.append((key, IGNORED.get(key, "not a LLaMA-Factory key emotune translates")))
    return t


def load(file: dict[str, Any], path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfigBase:
    """The resolved config of a LLaMA-Factory file: translated, then overridden, then validated, all problems at once."""
    t = translate(file, overrides)
    return build_config(t.raw, t.overrides, path, t.problems, check=lambda raw: template_check(t.template, raw)[0])


def _split_overrides(file: dict[str, Any], overrides) -> tuple[dict[str, Any], list[str]]:
    """`max_steps=2` (a LLaMA-Factory key emotune's top level lacks) changes the file; the rest are emotune's."""
    known = DEFAULTS.keys() | REFUSED.keys() | IGNORED.keys()
    rest = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() in known and key.strip() not in RunConfigBase.model_fields:
            file[key.strip()] = _parse_value(value)
        else:
            rest.append(item)
    return file, rest


def _numbers(t: Translation) -> None:
    """YAML reads `1e-4` as text; LLaMA-Factory's argument parser makes it the number its field holds."""
    for key, (default, _) in DEFAULTS.items():
        value = t.settings[key]
        if isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(value, str):
            try:
                t.settings[key] = float(value) if isinstance(default, float) or "." in value or "e" in value else int(value)
            except ValueError:
                t.problems.append(f"`{key}`: {value!r} is not a number")
                t.settings[key] = default  # so the rest of the translation can go on and find the other problems


def _refusals(t: Translation) -> None:
    s = t.settings
    if s["stage"] != "sft":
        t.problems.append(f"`stage: {s['stage']}` is not supported: emotune runs LLaMA-Factory's `sft` stage only "
                          "(pt, rm, ppo, dpo and kto train other objectives); use stage: sft")
    if s["finetuning_type"] not in ("lora", "full", "freeze"):
        t.problems.append(f"`finetuning_type: {s['finetuning_type']}` is not supported: emotune trains LoRA adapters, "
                          "or the model itself (full, freeze); use finetuning_type: lora, full or freeze")
    if s["do_train"] is not True:
        t.problems.append(not_training(t.given, t.settings))
    for key, (harmless, why) in REFUSED.items():
        if not _harmless(s.get(key, harmless), harmless):
            t.problems.append(f"`{key}: {_show(s[key])}` is not supported: {why}")


def _harmless(value: Any, harmless: Any) -> bool:
    """The value changes nothing emotune does; YAML reads `1e-8` as text, which the parser makes a number."""
    if isinstance(harmless, float) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return value is None or value is False or value == harmless


def _model(t: Translation) -> None:
    s = t.settings
    if not s["model_name_or_path"]:
        t.problems.append("`model_name_or_path` is missing; name the base model (a hub id or a local folder)")
    else:
        t.set("model.source", str(s["model_name_or_path"]), "model_name_or_path")
    if "model_revision" in t.given:
        t.set("model.revision", str(s["model_revision"]), "model_revision")
    _quantization(t)
    t.template = s["template"]  # checked once the overrides are in (template_check)


def _quantization(t: Translation) -> None:
    """QLoRA: `quantization_bit: 4 | 8` with bitsandbytes, LLaMA-Factory's on-the-fly quantization of the base."""
    s = t.settings
    bit = s["quantization_bit"]
    if bit is None:
        return
    if s["quantization_method"] != "bnb":
        t.problems.append(f"`quantization_method: {s['quantization_method']}` is not supported: emotune quantizes with "
                          "bitsandbytes only; use quantization_method: bnb")
    if bit not in (4, 8):
        t.problems.append(f"`quantization_bit: {bit}` is not supported: bitsandbytes quantizes to 4 or 8 bits; use "
                          "quantization_bit: 4 (QLoRA) or 8")
        return
    t.set("model.quantization", f"{bit}bit", "quantization_bit", "quantization_method")
    if bit == 4:
        if s["quantization_type"] not in ("nf4", "fp4"):
            t.problems.append(f"`quantization_type: {s['quantization_type']}` is not supported; use nf4 or fp4")
        else:
            t.set("model.quant_type", s["quantization_type"], "quantization_type")
        t.set("model.double_quant", bool(s["double_quantization"]), "double_quantization")


def _method(t: Translation) -> None:
    s = t.settings
    if s["finetuning_type"] in ("full", "freeze"):
        _whole_model(t)
        return
    for key in ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"):
        if key in t.given:
            t.ignored.append((key, "a freeze-tuning setting; finetuning_type: lora does not read it"))
    t.set("lora.r", s["lora_rank"], "lora_rank")
    alpha = s["lora_alpha"] if s["lora_alpha"] is not None else s["lora_rank"] * 2
    t.set("lora.alpha", alpha, "lora_alpha", note="" if s["lora_alpha"] is not None else "lora_rank x 2")
    t.set("lora.dropout", s["lora_dropout"], "lora_dropout")
    targets = _names(s["lora_target"])
    t.set("lora.target_modules", "all-linear" if targets == ["all"] else targets, "lora_target")
    if s["additional_target"]:
        t.set("lora.modules_to_save", _names(s["additional_target"]), "additional_target")
    t.set("lora.use_dora", s["use_dora"], "use_dora")
    if s["adapter_name_or_path"]:
        names = _names(s["adapter_name_or_path"])
        if len(names) > 1:
            t.problems.append("`adapter_name_or_path` lists several adapters; emotune trains on from one: merge the "
                              "others into the base first (`emotune export --merge`)")
        else:
            t.set("lora.adapter", names[0], "adapter_name_or_path", note="its score is the run's before")
    if s["pissa_init"]:
        t.set("lora.init", "pissa", "pissa_init")
        t.set("lora.pissa_iter", s["pissa_iter"], "pissa_iter")
        if not s["pissa_convert"]:
            t.notes.append("pissa_convert: false: emotune always saves the PiSSA adapter converted onto the original base "
                           "(rank 2 x lora_rank), so that export and serving load the checkpoint as it is.")
    t.set("lora.use_rslora", s["use_rslora"], "use_rslora")


def _whole_model(t: Translation) -> None:
    """`finetuning_type: full | freeze`: the model's own weights train (emotune.model.finetuning). LoRA's shape settings
    are ignored, as LLaMA-Factory ignores them; LoRA's methods (DoRA, PiSSA, an adapter to train on from, LoRA+) are
    passed on, so the run refuses them with the reason before any weights load."""
    s = t.settings
    kind = s["finetuning_type"]
    t.set("train.finetuning", kind, "finetuning_type")
    if kind == "freeze":
        t.set("train.freeze_trainable_layers", s["freeze_trainable_layers"], "freeze_trainable_layers",
              note="N > 0: the last N decoder layers; -N: the first N")
        modules = _names(s["freeze_trainable_modules"])
        t.set("train.freeze_trainable_modules", "all" if modules == ["all"] else modules, "freeze_trainable_modules")
        if s["freeze_extra_modules"]:
            t.set("train.freeze_extra_modules", _names(s["freeze_extra_modules"]), "freeze_extra_modules")
    for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target", "use_rslora"):
        if key in t.given:
            t.ignored.append((key, f"a LoRA setting; finetuning_type: {kind} trains no adapters"))
    if s["use_dora"]:
        t.set("lora.use_dora", True, "use_dora")
    if s["pissa_init"]:
        t.set("lora.init", "pissa", "pissa_init")
    if s["adapter_name_or_path"]:
        t.set("lora.adapter", ", ".join(_names(s["adapter_name_or_path"])), "adapter_name_or_path")


def _dataset(t: Translation) -> None:
    s = t.settings
    names = _names(s["dataset"]) if s["dataset"] else []
    if not names and purpose(t.given, t.settings) is None:  # a file for another command is refused as that, not for its dataset
        t.problems.append("`dataset` is missing; name the dataset_info.json entries to train on, e.g. "
                          "dataset: alpaca_en_demo")
    if s["dataset_dir"] == "ONLINE":
        t.problems.append("`dataset_dir: ONLINE` is not supported; register the hub datasets in a "
                          "dataset_info.json (hf_hub_url) and give its folder")
    t.set("data.source", str(s["dataset_dir"]), "dataset_dir")
    t.set("data.datasets", names, "dataset")
    _set_dotted(t.raw, "data.input_separator", LLAMAFACTORY_INPUT_SEPARATOR)
    t.rows.append(("(alpaca rows: instruction + input)", f"data.input_separator: {_show(LLAMAFACTORY_INPUT_SEPARATOR)}  "
                   "(one newline, as LLaMA-Factory joins them; emotune's default is a blank line)"))
    if s["eval_dataset"]:
        t.set("data.eval_datasets", _names(s["eval_dataset"]), "eval_dataset",
              note="the test split, measured before and after training")
    else:
        t.notes.append("No eval_dataset: the test split measured before and after training is data.test_size of "
                       "the rows, held out of training.")
    _preference_data(t, names + (_names(s["eval_dataset"]) if s["eval_dataset"] else []))
    _val_size(t)
    if s["max_samples"] is not None:
        t.set("data.max_samples", s["max_samples"], "max_samples")
    t.set("train.max_length", s["cutoff_len"], "cutoff_len",
          note="longer rows are cut at the end and counted; LLaMA-Factory shortens prompt and answer in proportion")
    t.set("prompt.mask_history", s["mask_history"], "mask_history")
    if s["default_system"] is not None:
        t.set("prompt.system_prompt", str(s["default_system"]), "default_system")


def _preference_data(t: Translation, names: list[str]) -> None:
    """Ranking entries are for dpo/rm/kto; say so here, with the key, before anything else is read."""
    try:
        info = json.loads((Path(str(t.settings["dataset_dir"])) / "dataset_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # reported with the data, where the folder is read
    for name in names:
        entry = info.get(name) if isinstance(info, dict) else None
        if isinstance(entry, dict) and entry.get("ranking"):
            t.problems.append(f"`dataset`: `{name}` is a ranking (preference) dataset, for stage dpo, rm or kto; "
                              "stage sft trains on one answer per prompt, so name SFT datasets only")


def _val_size(t: Translation) -> None:
    """LLaMA-Factory's split_dataset: a val_size above 1 is a count of rows (int(val_size)), below it a share."""
    size = t.settings["val_size"]
    number = isinstance(size, (int, float)) and not isinstance(size, bool)
    if number and 0 < size < 0.5:
        t.set("data.validation_size", float(size), "val_size")
    elif number and size > 1:
        t.set("data.validation_size", int(size), "val_size")
    elif number and size == 0:
        t.notes.append("val_size: 0 (LLaMA-Factory trains on every row): emotune still holds out "
                       "data.validation_size of the training rows to pick the adapter with the lowest validation loss.")
    else:
        t.problems.append(f"`val_size: {size}` is not supported: emotune holds out a share of the rows in (0, 0.5), "
                          "e.g. val_size: 0.1, or a count of rows, e.g. val_size: 500")


def _schedule(t: Translation) -> None:
    s = t.settings
    t.set("train.batch_size", s["per_device_train_batch_size"], "per_device_train_batch_size")
    t.set("train.gradient_accumulation_steps", s["gradient_accumulation_steps"], "gradient_accumulation_steps")
    t.set("train.learning_rate", s["learning_rate"], "learning_rate")
    t.set("train.num_train_epochs", s["num_train_epochs"], "num_train_epochs")
    t.set("train.max_steps", s["max_steps"] if s["max_steps"] > 0 else -1, "max_steps")
    if s["lr_scheduler_type"] in SCHEDULES:
        t.set("train.lr_scheduler_type", s["lr_scheduler_type"], "lr_scheduler_type")
    else:
        t.problems.append(f"`lr_scheduler_type: {s['lr_scheduler_type']}` is not supported; emotune has "
                          f"{', '.join(SCHEDULES)}")
    t.set("train.warmup_ratio", s["warmup_ratio"], "warmup_ratio")
    t.set("train.warmup_steps", s["warmup_steps"], "warmup_steps", note="when above 0 it replaces warmup_ratio")
    t.set("train.weight_decay", s["weight_decay"], "weight_decay")
    t.set("train.max_grad_norm", s["max_grad_norm"], "max_grad_norm")
    if s["optim"] in OPTIMIZERS or s["optim"] in OPTIMIZER_ALIASES:
        t.set("train.optim", OPTIMIZER_ALIASES.get(s["optim"], s["optim"]), "optim")
    else:
        t.problems.append(f"`optim: {s['optim']}` is not supported; emotune has {', '.join(OPTIMIZERS)}")
    t.set("eval.batch_size", s["per_device_eval_batch_size"], "per_device_eval_batch_size")
    if s["loraplus_lr_ratio"] is not None:
        t.set("train.loraplus_lr_ratio", s["loraplus_lr_ratio"], "loraplus_lr_ratio")
        t.set("train.loraplus_lr_embedding", s["loraplus_lr_embedding"], "loraplus_lr_embedding")


def _precision(t: Translation) -> None:
    s = t.settings
    if s["bf16"] and s["fp16"]:
        t.problems.append("`bf16` and `fp16` are both true; choose one")
    precision = "bf16" if s["bf16"] else "fp16" if s["fp16"] else "auto"
    t.set("train.precision", precision, "bf16", "fp16")
    if precision == "auto":
        t.notes.append("Neither bf16 nor fp16: LLaMA-Factory then loads the weights in bf16 where the GPU has it, "
                       "else fp16 on GPUs, else fp32 (infer_optim_dtype), as emotune's `auto` does on GPUs; on a CPU "
                       "`auto` may pick bf16 where LLaMA-Factory uses fp32: set train.precision=fp32 to match.")
    # LLaMA-Factory enables checkpointing itself unless disable_gradient_checkpointing is set (model_utils/
    # checkpointing.py), whatever the trainer's gradient_checkpointing says
    t.set("train.gradient_checkpointing", not s["disable_gradient_checkpointing"], "disable_gradient_checkpointing")
    if "gradient_checkpointing" in t.given and not s["gradient_checkpointing"] and not s["disable_gradient_checkpointing"]:
        t.notes.append("gradient_checkpointing: false does not turn checkpointing off in LLaMA-Factory (it enables "
                       "it itself); disable_gradient_checkpointing: true does, here too.")


def _steps(t: Translation) -> None:
    s = t.settings
    t.set("train.logging_steps", s["logging_steps"], "logging_steps")
    t.set("train.save_steps", s["save_steps"], "save_steps")
    if s.get("save_total_limit"):  # unset, transformers keeps every checkpoint; that changes nothing learned
        t.set("train.save_total_limit", s["save_total_limit"], "save_total_limit")
    key = "evaluation_strategy" if "evaluation_strategy" in t.given and "eval_strategy" not in t.given else "eval_strategy"
    strategy = s[key]
    if strategy == "steps":
        every = s["eval_steps"] or s["logging_steps"]
        t.set("train.eval_steps", every, key, "eval_steps", note="" if s["eval_steps"] else "eval_steps unset: logging_steps")
    else:
        t.set("train.eval_steps", s["save_steps"], key, "save_steps", note="every checkpoint")
        t.notes.append(f"{key}: {strategy}: LLaMA-Factory does not validate by steps; emotune validates at every "
                       "checkpoint to keep the adapter with the lowest validation loss.")
    t.notes.append("emotune keeps the adapter with the lowest validation loss; LLaMA-Factory keeps the last weights "
                   "(load_best_model_at_end: false).")


def _output(t: Translation) -> None:
    s = t.settings
    if s["output_dir"]:
        folder = PurePosixPath(str(s["output_dir"]).rstrip("/"))
        if not is_run_name(folder.name):
            t.problems.append(f"`output_dir: {s['output_dir']}` must end in a plain folder name (letters, digits, "
                              "`.`, `-`, `_`; at most 100 characters and 200 bytes), e.g. saves/gemma/lora/sft")
        t.set("output_dir", str(folder.parent), "output_dir", note="the run folder is output_dir/name")
        t.set("name", folder.name, "output_dir")
    t.set("overwrite", bool(s["overwrite_output_dir"]), "overwrite_output_dir")
    t.set("seed", s["seed"], "seed")
    trackers = [] if s["report_to"] in (None, "none") else _names(s["report_to"])
    kept = [name for name in trackers if name in TRACKERS]
    t.set("train.report_to", kept, "report_to")
    if set(trackers) - set(kept):
        t.notes.append(f"report_to: {', '.join(n for n in trackers if n not in kept)} dropped: emotune reports to "
                       f"{', '.join(TRACKERS)} (name them; `all` is not expanded).")
    t.rows.append((f"plot_loss: {_show(s['plot_loss'])}" + ("" if "plot_loss" in t.given else " (default)"),
                   "(always) train/loss_curve.png"))


# --------------------------------------------------------------------------------------------------
# What is printed


def describe(t: Translation, path: Path) -> str:
    """Each key's emotune equivalent, the keys ignored and why, and the notes: printed before a run."""
    width = min(max((len(source) for source, _ in t.rows), default=0), 48)  # a long path just pushes its row out
    lines = [f"LLaMA-Factory config {path} -> emotune task: sft (keys the file leaves out: LLaMA-Factory's defaults)"]
    lines += [f"  {source:<{width}}  ->  {target}" for source, target in t.rows]
    if t.overrides:
        lines.append(f"Then the emotune overrides on top: {' '.join(t.overrides)}")
    if t.ignored:
        lines.append("Ignored keys:")
        lines += [f"  {key}: {why}" for key, why in t.ignored]
    lines.append("Notes:")
    template_note = template_check(t.template, _with_overrides(t))[1]
    lines += [f"  - {note}" for note in [template_note, *t.notes] if note]
    return "\n".join(lines)


def announce(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """Print the translation when `path` is a LLaMA-Factory file; nothing otherwise."""
    from emotune.core.config.build import read_yaml

    file = read_yaml(Path(path))
    if is_llamafactory(file):
        print(describe(translate(file, overrides), Path(path)) + "\n", flush=True)


def translated_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """`emotune config --from-llamafactory FILE`: the emotune YAML the file means (overrides applied), with the
    translation as comments. The file need not look like one; every problem is reported at once, as by `run`."""
    from emotune.core.config.build import TASK_CONFIGS, read_yaml

    file = read_yaml(Path(path))
    refuse_v1(file, path)
    emotune_keys = {key for schema in TASK_CONFIGS.values() for key in schema.model_fields}
    if file and not is_llamafactory(file) and set(file) <= emotune_keys:
        raise UserError(f"`{path}` is an emotune config already (its keys {', '.join(map(str, file))} are emotune's), "
                        f"not a LLaMA-Factory training file; it needs no translation: `emotune config {path}` prints it "
                        "resolved.")
    t = translate(file, overrides)
    raw = _with_overrides(t)
    build_config(json.loads(json.dumps(t.raw)), t.overrides, path, t.problems,
                 check=lambda r: template_check(t.template, r)[0])
    comments = "\n".join(f"# {line}" for line in describe(t, Path(path)).splitlines())
    return comments + "\n" + yaml_text(raw, sort_keys=False, width=100)


def _with_overrides(t: Translation) -> dict[str, Any]:
    raw = json.loads(json.dumps(t.raw))
    for item in t.overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip():
            _set_dotted(raw, key.strip(), _parse_value(value))
    return raw


def _names(value: Any) -> list[str]:
    """LLaMA-Factory's comma lists (`identity,alpaca_en_demo`), or a YAML list."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def _show(value: Any) -> str:
    """A value as the translation prints it; text with a line break or a tab as JSON (`"\\n"`), on one line."""
    if isinstance(value, str) and any(c in value for c in "\n\r\t"):
        return json.dumps(value, ensure_ascii=False)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
