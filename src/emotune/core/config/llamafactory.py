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

import json
from pathlib import Path, PurePosixPath
from typing import Any

from emotune.core.config.base import is_run_name
from emotune.core.config.build import _set_dotted, build_config
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
from emotune.core.config.translation import (
    Translation,
    adam_settings,
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
    with_overrides,
)
from emotune.core.config.translation import describe as shared_describe
from emotune.core.errors import UserError

# every translated key with its default: LLaMA-Factory's `stage` (which names emotune's task) and the rest
DEFAULTS: dict[str, tuple[Any, str]] = {"stage": ("sft", FINETUNING), **KEY_DEFAULTS}


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """A LLaMA-Factory file: flat keys emotune's configs never have at their top level."""
    return "model_name_or_path" in raw or {"stage", "finetuning_type"} <= raw.keys()


def translate(file: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Translation:
    """The emotune `task: sft` config a LLaMA-Factory file means; refusals go to `problems`, not raised."""
    file, rest = split_overrides(dict(file), overrides, DEFAULTS.keys() | REFUSED.keys() | IGNORED.keys())
    t = Translation(overrides=rest, given=set(file))
    # a key left empty (`lora_target:`) is the key unset: it became the text "None" (a target module, a data folder)
    t.settings = {key: default for key, (default, _) in DEFAULTS.items()} | {k: v for k, v in file.items() if v is not None}
    numbers(t, DEFAULTS, kinds={"quantization_bit": int} | flags(REFUSED))
    t.set("task", "sft", "stage")
    for step in (_refusals, _model, _method, _dataset, _schedule, _precision, _steps, _output):
        step(t)
    sort_unknown(t, file, DEFAULTS.keys() | REFUSED.keys(), IGNORED, "a LLaMA-Factory")  # LLaMA-Factory refuses misspellings too
    return t


def load(file: dict[str, Any], path: Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfigBase:
    """The resolved config of a LLaMA-Factory file: translated, then overridden, then validated, all problems at once."""
    t = translate(file, overrides)
    return build_config(t.raw, t.overrides, path, t.problems, check=lambda raw: template_check(t.template, raw)[0],
                        named=named_as_given(t, t.overrides))


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
    for key, (harmless_value, why) in REFUSED.items():
        if not harmless(s.get(key, harmless_value), harmless_value):
            t.problems.append(f"`{key}: {show(s[key])}` is not supported: {why}")


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
    rank = s["lora_rank"]  # a rank that is no number is left as it is: the config's check names what it expected
    alpha = s["lora_alpha"] if s["lora_alpha"] is not None else rank * 2 if type(rank) in (int, float) else rank
    t.set("lora.alpha", alpha, "lora_alpha", note="" if s["lora_alpha"] is not None else "lora_rank x 2")
    t.set("lora.dropout", s["lora_dropout"], "lora_dropout")
    targets = name_list(s["lora_target"])
    t.set("lora.target_modules", "all-linear" if targets == ["all"] else targets, "lora_target")
    if s["additional_target"]:
        t.set("lora.modules_to_save", name_list(s["additional_target"]), "additional_target")
    t.set("lora.use_dora", s["use_dora"], "use_dora")
    names = name_list(s["adapter_name_or_path"]) if s["adapter_name_or_path"] else []
    if len(names) > 1:
        t.problems.append("`adapter_name_or_path` lists several adapters; emotune trains on from one: merge the "
                          "others into the base first (`emotune export --merge`)")
    elif names:
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
        modules = name_list(s["freeze_trainable_modules"])
        t.set("train.freeze_trainable_modules", "all" if modules == ["all"] else modules, "freeze_trainable_modules")
        if s["freeze_extra_modules"]:
            t.set("train.freeze_extra_modules", name_list(s["freeze_extra_modules"]), "freeze_extra_modules")
    for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "additional_target", "use_rslora"):
        if key in t.given:
            t.ignored.append((key, f"a LoRA setting; finetuning_type: {kind} trains no adapters"))
    if s["use_dora"]:
        t.set("lora.use_dora", True, "use_dora")
    if s["pissa_init"]:
        t.set("lora.init", "pissa", "pissa_init")
    if s["adapter_name_or_path"]:
        t.set("lora.adapter", ", ".join(name_list(s["adapter_name_or_path"])), "adapter_name_or_path")


def _dataset(t: Translation) -> None:
    s = t.settings
    names = name_list(s["dataset"]) if s["dataset"] else []
    if not names and purpose(t.given, t.settings) is None:  # a file for another command is refused as that, not for its dataset
        t.problems.append("`dataset` is missing; name the dataset_info.json entries to train on, e.g. "
                          "dataset: alpaca_en_demo")
    if s["dataset_dir"] == "ONLINE":
        t.problems.append("`dataset_dir: ONLINE` is not supported; register the hub datasets in a "
                          "dataset_info.json (hf_hub_url) and give its folder")
    elif str(s["dataset_dir"]).startswith("REMOTE:"):  # a hub dataset repository holding dataset_info.json
        repo = str(s["dataset_dir"])[len("REMOTE:"):]
        t.problems.append(f"`dataset_dir: {s['dataset_dir']}` (dataset_info.json in a hub repository) is not supported; "
                          f"download the repository (`hf download {repo} --repo-type dataset --local-dir "
                          f"data/{repo.split('/')[-1]}`) and give that folder as dataset_dir")
    t.set("data.source", str(s["dataset_dir"]), "dataset_dir")
    t.set("data.datasets", names, "dataset")
    _set_dotted(t.raw, "data.input_separator", LLAMAFACTORY_INPUT_SEPARATOR)
    t.rows.append(("(alpaca rows: instruction + input)", f"data.input_separator: {show(LLAMAFACTORY_INPUT_SEPARATOR)}  "
                   "(one newline, as LLaMA-Factory joins them; emotune's default is a blank line)"))
    if s["eval_dataset"]:
        t.set("data.eval_datasets", name_list(s["eval_dataset"]), "eval_dataset",
              note="the test split, measured before and after training")
    else:
        t.notes.append("No eval_dataset: the test split measured before and after training is data.test_size of "
                       "the rows, held out of training.")
    _preference_data(t, names + (name_list(s["eval_dataset"]) if s["eval_dataset"] else []))
    held_out(t, "val_size", "LLaMA-Factory trains on every row")
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
        info = json.loads((Path(str(t.settings["dataset_dir"])) / "dataset_info.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return  # reported with the data, where the folder is read
    for name in names:
        entry = info.get(name) if isinstance(info, dict) else None
        if isinstance(entry, dict) and entry.get("ranking"):
            t.problems.append(f"`dataset`: `{name}` is a ranking (preference) dataset, for stage dpo, rm or kto; "
                              "stage sft trains on one answer per prompt, so name SFT datasets only")


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
    if not warmup_share(t):
        t.set("train.warmup_ratio", s["warmup_ratio"], "warmup_ratio")
        t.set("train.warmup_steps", s["warmup_steps"], "warmup_steps", note="when above 0 it replaces warmup_ratio")
    t.set("train.weight_decay", s["weight_decay"], "weight_decay")
    t.set("train.max_grad_norm", s["max_grad_norm"], "max_grad_norm")
    adam_settings(t)
    t.set("train.group_by_length", bool(s["group_by_length"]), "group_by_length",
          note="rows in the order the shuffle gives" if not s["group_by_length"] else "")
    if isinstance(s["optim"], str) and (s["optim"] in OPTIMIZERS or s["optim"] in OPTIMIZER_ALIASES):
        t.set("train.optim", OPTIMIZER_ALIASES.get(s["optim"], s["optim"]), "optim")
    else:
        t.problems.append(f"`optim: {show(s['optim'])}` is not supported; emotune has {', '.join(OPTIMIZERS)}")
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
    for key in ("logging_steps", "save_steps", "eval_steps"):
        if isinstance(s[key], float) and not s[key].is_integer():  # transformers reads a value below 1 so
            t.problems.append(f"`{key}: {s[key]}` (a share of the training steps) is not supported: give a number of "
                              f"steps, e.g. {key}: 50")
            s[key] = DEFAULTS[key][0]  # so the emotune key is not refused a second time
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
    trackers = [] if s["report_to"] in (None, "none") else name_list(s["report_to"])
    kept = [name for name in trackers if name in TRACKERS]
    t.set("train.report_to", kept, "report_to")
    if set(trackers) - set(kept):
        t.notes.append(f"report_to: {', '.join(n for n in trackers if n not in kept)} dropped: emotune reports to "
                       f"{', '.join(TRACKERS)} (name them; `all` is not expanded).")
    t.rows.append((f"plot_loss: {show(s['plot_loss'])}" + ("" if "plot_loss" in t.given else " (default)"),
                   "(always) train/loss_curve.png"))


# --------------------------------------------------------------------------------------------------
# What is printed


def describe(t: Translation, path: Path) -> str:
    """Each key's emotune equivalent, the keys ignored and why, and the notes: printed before a run."""
    heading = f"LLaMA-Factory config {path} -> emotune task: sft (keys the file leaves out: LLaMA-Factory's defaults)"
    return shared_describe(t, path, heading, (template_check(t.template, with_overrides(t))[1],))


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
    build_config(json.loads(json.dumps(t.raw)), t.overrides, path, t.problems,
                 check=lambda r: template_check(t.template, r)[0])
    return commented_yaml(t, describe(t, Path(path)))
