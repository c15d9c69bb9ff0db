"""Files of other tools that are not LLaMA-Factory v0 training files: LLaMA-Factory's v1 layout (examples/v1), the
files of its other commands (export, chat/api, do_predict evaluation), Axolotl configs without datasets, H2O LLM
Studio configs, and the launcher files beside them (accelerate and DeepSpeed configs), each named as what it is, with
emotune's way to do it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emotune.core.config.head import ClassifyHeadConfig
from emotune.core.config.sft import SftConfig
from emotune.core.errors import UserError

V1_KEYS = ("model_class", "peft_config", "train_dataset", "dist_config", "kernel_config", "quant_config")


def refuse_v1(file: dict[str, Any], path: str | Path) -> None:
    """LLaMA-Factory's v1 layout (examples/v1: `model: NAME`, peft_config, train_dataset) is no emotune config and no
    v0 training file; it was answered with a dozen 'not a config key' lines about its own keys."""
    found = [key for key in V1_KEYS if key in file]
    if found and isinstance(file.get("model"), str):
        raise UserError(f"`{path}` is a LLaMA-Factory v1 config (`model: {file['model']}` with {', '.join(found)}). emotune "
                        "reads LLaMA-Factory training files in the layout of its examples/train_lora/*.yaml "
                        "(model_name_or_path, stage: sft, do_train: true, finetuning_type, lora_rank, dataset and "
                        "dataset_dir of a dataset_info.json); write the file that way, or write an emotune config "
                        "(task: sft, model.source, data.source naming the data file).")



def not_training(given: set[str], settings: dict[str, Any]) -> str:
    """What a file without do_train is for: LLaMA-Factory's examples/merge_lora, examples/inference and extras/nlg_eval
    files have model_name_or_path too, and were told to add do_train (and a dataset) to a file that trains nothing."""
    kind = purpose(given, settings)
    if kind == "export":
        return ("this is a `llamafactory-cli export` file (it has export_dir and no do_train): it merges an adapter into "
                "its base, it does not train. emotune merges a finished run with `emotune export RUN_FOLDER --merge`; "
                "to train, give a training file (do_train: true, dataset)")
    if kind == "predict":
        # it said "or alone with `emotune eval CONFIG`", which is what was refused when the file was given to eval
        return ("`do_predict` without do_train only evaluates, with `llamafactory-cli train`; emotune measures the "
                "model before and after every run. To measure an adapter alone, make it a training file (do_train: true "
                "and a dataset; its eval_dataset is the test split) and run `emotune eval FILE adapter=ADAPTER_DIR`")
    if kind == "chat":
        return ("this is a `llamafactory-cli chat`/`api` file (a model to talk to, no do_train and no dataset): it "
                "trains nothing. emotune serves a finished run with `emotune serve RUN_FOLDER` (an OpenAI-compatible "
                "API); to train, give a training file (do_train: true, dataset)")
    return "`do_train` is not true, so `llamafactory-cli train` would not train with this file; add do_train: true"


def purpose(given: set[str], settings: dict[str, Any]) -> str | None:
    """`export`, `predict` or `chat` for a file LLaMA-Factory runs with another command than training; None otherwise."""
    if "do_train" in given:
        return None
    if "export_dir" in given:
        return "export"
    if settings.get("do_predict"):
        return "predict"
    if not settings["dataset"] and {"infer_backend", "adapter_name_or_path"} & given:
        return "chat"
    return None


AXOLOTL_KEYS = ("micro_batch_size", "sequence_len", "adapter", "num_epochs", "lora_r")


def axolotl_lead(file: dict[str, Any], path: str | Path) -> list[str]:
    """The first problem of an Axolotl config without `datasets` (one with them is translated,
    emotune.core.config.axolotl): what the file is and what it lacks. Empty for other files."""
    found = [key for key in AXOLOTL_KEYS if key in file]
    if "base_model" not in file or "datasets" in file or not found:
        return []
    return [f"`{path}` looks like an Axolotl config (base_model, {', '.join(found)}) without `datasets`: emotune runs "
            "Axolotl files as they are once they name their data (datasets: [{path: ..., type: alpaca | "
            "chat_template}]); the lines below give each key's emotune name."]


# H2O's problem types emotune has a task for: causal LM fine-tuning, and classification with a head on the last token
H2O_TASKS = {"text_causal_language_modeling": SftConfig.model_fields["task"].default,
             "text_causal_classification_modeling": ClassifyHeadConfig.model_fields["task"].default}


def h2o_lead(file: dict[str, Any], path: str | Path) -> list[str]:
    """The first problem of an H2O LLM Studio experiment config (`llm_backbone`, `problem_type`, sections `dataset`,
    `training`, ...): what the file is and where its backbone, data and columns go. Empty for other files."""
    if "llm_backbone" not in file or not isinstance(file.get("dataset"), dict):
        return []
    problem, dataset = str(file.get("problem_type", "")), file["dataset"]
    task = H2O_TASKS.get(problem)
    prompt, answer = dataset.get("prompt_column"), dataset.get("answer_column")
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
    language_modelling = problem == "text_causal_language_modeling"  # rows of prompt and answer, not text and label
    if language_modelling:
        columns = f"data.columns.prompt: {prompt}, data.columns.response: {answer}"
    else:
        columns = f"data.text_column: {prompt}, data.label_column: {answer}"
    data = f", data.source: {dataset['train_dataframe']}" if dataset.get("train_dataframe") else ""
    if task is None:
        what = (f"its problem_type `{problem or 'unset'}` has no emotune task (emotune trains text_causal_language_modeling "
                "as task: sft and text_causal_classification_modeling as task: classify_head)")
    else:
        chained = (" Rows chained by parent_id are read as H2O writes them (columns id and parent_id)."
                   if language_modelling and str(dataset.get("parent_id_column", "None")) not in ("None", "") else "")
        what = (f"write an emotune config instead: task: {task}, model.source: {file['llm_backbone']}{data}, "
                f"{columns}; the lines below go through its keys.{chained}")
    return [f"`{path}` is an H2O LLM Studio experiment config (llm_backbone, problem_type, dataset): emotune does not "
            f"read H2O files; {what}"]


ACCELERATE_KEYS = ("compute_environment", "distributed_type", "num_processes", "mixed_precision", "fsdp_config")
DEEPSPEED_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")


def launcher_lead(file: dict[str, Any], path: str | Path) -> list[str]:
    """The first problem of an accelerate or DeepSpeed config (LLaMA-Factory's examples/accelerate and
    examples/deepspeed, Axolotl's deepspeed_configs): a launcher's file given as the training config, which was answered
    with a 'not a config key' line per key. Empty for other files."""
    accelerate = [key for key in ACCELERATE_KEYS if key in file]
    if "compute_environment" in file or len(accelerate) >= 2:
        return [f"`{path}` is an accelerate config ({', '.join(accelerate)}), for `accelerate launch --config_file`, not "
                "a training config: give emotune a training config (emotune's, LLaMA-Factory's or Axolotl's), and for "
                "several processes launch `accelerate launch --num_processes N -m emotune train CONFIG` (train.fsdp=true "
                "to shard the model)."]
    deepspeed = [key for key in DEEPSPEED_KEYS if key in file]
    if "zero_optimization" in file or len(deepspeed) >= 2:
        return [f"`{path}` is a DeepSpeed config ({', '.join(deepspeed)}), not a training config; emotune does not run "
                "DeepSpeed: give a training config, and for several processes launch `torchrun --nproc_per_node N -m "
                "emotune train CONFIG` (train.fsdp=true to shard the model)."]
    return []
