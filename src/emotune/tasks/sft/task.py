"""`task: sft`: supervised fine-tuning on conversations (instruction tuning), measured before and after.

Rows are conversations (Alpaca, ShareGPT, OpenAI messages, LLaMA-Factory's dataset_info.json;
emotune.data.conversation_data); the training loss falls on every assistant turn, end-of-turn token
included (only the last with prompt.mask_history; tasks/sft/rows.py); the measurement is response
perplexity, ROUGE-L / BLEU / exact match of greedy generations per kind, and the forgetting probe
(tasks/sft/eval.py); comparison and report sections are in tasks/sft/report.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from emotune.core.config.sft import INPUT_SEPARATOR, SftConfig, SftDataConfig
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, atomic_dir, json_text, read_json
from emotune.data.clean import text_steps
from emotune.data.conversation_data import ConversationData, embedded_instruct_dir, load_conversations, turn_cleaning
from emotune.data.sources import HUB_PREFIXES, SPLITS
from emotune.eval.probe import load_probe
from emotune.model.artifacts import Artifact, Fallback, find_artifact, trained_outputs
from emotune.tasks.sft import eval as sft_eval
from emotune.tasks.sft.report import compare, format_comparison, measurements, report_sections, write_comparison
from emotune.tasks.sft.rows import encode_all
from emotune.train.batches import LANGUAGE_MODEL, Example, Objective

__all__ = ["COMPARED_METRICS", "CONFIG", "DEFAULT_METRIC", "MEASUREMENT", "SHOWN_METRICS", "SWEEP_COLUMNS",
           "adapter_meta", "compare", "data_fingerprint", "describe_data", "evaluate", "find_adapter",
           "format_comparison", "has_results", "load_adapted", "load_data", "measurements", "memory_workload",
           "merge_check_inputs", "outputs", "read_results", "report_sections", "run_info", "save_data",
           "saved_fingerprint", "training_rows", "training_setup", "write_comparison", "write_results"]

CONFIG = SftConfig  # the config class of this task (emotune.core.config.build.TASK_CONFIGS)
SHOWN_METRICS = ("rouge_l", "bleu", "exact_match", "perplexity", "probe_accuracy")  # printed by `emotune eval`
COMPARED_METRICS = ("rouge_l", "bleu", "sentence_bleu", "exact_match", "perplexity", "loss", "probe_accuracy")
DEFAULT_METRIC = "rouge_l"  # what a sweep ranks by
SWEEP_COLUMNS = ("rouge_l", "perplexity")  # shown in sweep tables
MEASUREMENT = "generation"  # `emotune compare`: free text, scored by ROUGE-L and perplexity
DATA_REPORT = "data_report.json"


# --------------------------------------------------------------------------------------------------
# Data


def load_data(cfg: SftConfig) -> ConversationData:
    """Validated conversations; with eval.probe, the probe's questions are checked too (before any weights load)."""
    data = load_conversations(cfg.data, cfg.seed)
    if cfg.eval.probe:
        load_probe(limit=cfg.eval.probe_limit)
    data.report["fingerprint"] = data_fingerprint(cfg)
    return data


def data_fingerprint(cfg: SftConfig) -> str:
    """What decides whether a run folder's prepared rows are reused: every data key, the seed and the files. The blank
    line data.input_separator defaults to is left out, as it joined the rows of runs made before the key existed: their
    prepared data stays theirs, and any other separator is other rows."""
    data = cfg.data.model_dump(mode="json", exclude={"input_separator"} if cfg.data.input_separator == INPUT_SEPARATOR
                               else None)
    parts = {"data": data, "seed": cfg.seed, "files": _source_stamp(cfg.data.source)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _source_stamp(source: str) -> list:
    if source.startswith(HUB_PREFIXES):
        return [source]
    path = embedded_instruct_dir() if source == "embedded" else Path(source).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def saved_fingerprint(run: RunDir) -> str | None:
    return (read_json(run.data / DATA_REPORT) or {}).get("fingerprint")


def save_data(data: ConversationData, run: RunDir, tokenizer: PreTrainedTokenizerBase, cfg: SftConfig) -> None:
    """The splits as JSON lines (normalised conversations) and data_report.json with token counts."""
    report = {**data.report, "tokens": _token_report(data, tokenizer, cfg)}
    with atomic_dir(run.data) as folder:
        for split, rows in data.splits.items():
            (folder / f"{split}.jsonl").write_text("".join(json_text(c.as_row(), indent=None) + "\n" for c in rows),
                                                   encoding="utf-8")
        (folder / DATA_REPORT).write_text(json_text(report), encoding="utf-8")
    data.report = report


def _token_report(data: ConversationData, tokenizer, cfg: SftConfig) -> dict:
    """Tokens per training row and how many train.max_length cuts (and leaves without any answer token)."""
    encoded = encode_all(data.splits["train"], tokenizer, cfg.prompt.system_prompt, cfg.prompt.mask_history,
                         10 ** 9)
    lengths = np.array([len(e.input_ids) for e in encoded.examples] or [0])
    limit = cfg.train.max_length
    return {"train_row_tokens": {"median": int(np.median(lengths)), "p95": int(np.percentile(lengths, 95)),
                                 "max": int(lengths.max())},
            "max_length": limit, "train_rows_truncated": int((lengths > limit).sum())}


def describe_data(data: ConversationData) -> str:
    rows = data.report.get("rows", {s: len(r) for s, r in data.splits.items()})
    lines = [f"Data: {data.source} ({data.report.get('split', '')}); rows " + ", ".join(f"{s} {n}" for s, n in rows.items())]
    kinds = data.kinds()
    if kinds:
        counts = {k: sum(c.kind == k for c in data.splits["test"]) for k in kinds}
        lines.append("Test rows per kind: " + ", ".join(f"{k} {n}" for k, n in counts.items()))
    tokens = data.report.get("tokens")
    if tokens:
        lines.append(f"Training row tokens: median {tokens['train_row_tokens']['median']}, p95 "
                     f"{tokens['train_row_tokens']['p95']}, max {tokens['train_row_tokens']['max']}; "
                     f"{tokens['train_rows_truncated']} rows longer than train.max_length={tokens['max_length']} are cut")
    skipped = sum(data.report.get("skipped_bad_rows", {}).values())
    if skipped:
        lines.append(f"Skipped {skipped} malformed rows (data.skip_bad_rows=true)")
    return "\n".join(lines)


def run_info(cfg: SftConfig, data: ConversationData) -> dict:
    return {"rows": {s: len(r) for s, r in data.splits.items()}, "kinds": data.kinds(),
            "system_prompt": cfg.prompt.system_prompt or "", "sample_rows": cfg.eval.sample_rows}


# --------------------------------------------------------------------------------------------------
# Training rows


def training_rows(data: ConversationData, tokenizer: PreTrainedTokenizerBase, cfg: SftConfig
                  ) -> tuple[list[Example], list[Example]]:
    out = []
    for split in ("train", "validation"):
        encoded = encode_all(data.splits[split], tokenizer, cfg.prompt.system_prompt, cfg.prompt.mask_history,
                             cfg.train.max_length)
        if encoded.examples and encoded.lost == len(encoded.examples):  # training would learn nothing, loss 0
            raise UserError(f"Every one of the {encoded.lost} {split} rows is cut at train.max_length="
                            f"{cfg.train.max_length} before its answer, so training would learn nothing; raise "
                            "train.max_length.")
        if encoded.truncated:
            print(f"{split}: {encoded.truncated} of {len(encoded.examples)} rows cut at train.max_length="
                  f"{cfg.train.max_length}" + (f"; {encoded.lost} of them kept no answer token and teach nothing — raise "
                                               "train.max_length" if encoded.lost else ""), flush=True)
        out.append(encoded.examples)
    return out[0], out[1]


def find_adapter(path: str, cfg: SftConfig, data: ConversationData) -> Artifact:
    """The adapter `emotune eval adapter=PATH` measures: an emotune sft adapter, or one from another tool (PEFT,
    LLaMA-Factory), measured with this config's prompt."""
    artifact = find_artifact(path, fallback=Fallback(task="sft", system_prompt=cfg.prompt.system_prompt,
                                                     base_model=cfg.model.source, source="the config"))
    if artifact.meta.get("task", "sft") != "sft":
        raise UserError(f"`{artifact.path}` is a {artifact.meta.get('task')} adapter; `task: sft` measures sft adapters. "
                        "Use that adapter's own config.")
    return artifact


def adapter_meta(cfg: SftConfig, data: ConversationData) -> dict:
    """emotune.json: besides the system prompt and base, the text steps every turn was cleaned with (predict and serve
    clean their prompts' turns the same way) and how the rows were read (predict reads a file of rows with it where
    the run's config.yaml is not at hand: an export, an adapter folder alone)."""
    return {"task": "sft", "system_prompt": cfg.prompt.system_prompt, "base_model": cfg.model.source,
            "eval": cfg.eval.model_dump(), "cleaning": text_steps(turn_cleaning(cfg.data.cleaning)),
            "data": _data_record(cfg.data)}


def _data_record(data: SftDataConfig) -> dict:
    """data.format and data.input_separator, and the data.columns and data.tags that differ from the defaults: a key at
    its default counts as not set, as predict reads the run's config (emotune.deploy.predict_rows.data_settings)."""
    record = {"format": data.format, "input_separator": data.input_separator}
    for name in ("columns", "tags"):
        changed = getattr(data, name).model_dump(exclude_defaults=True)
        if changed:
            record[name] = changed
    return record


# --------------------------------------------------------------------------------------------------
# Measurement


def evaluate(model, tokenizer, data: ConversationData, cfg: SftConfig, desc: str) -> dict:
    return {"sft": sft_eval.measure(model, tokenizer, data.splits[cfg.eval.split], cfg, desc)}


def merge_check_inputs(tokenizer: PreTrainedTokenizerBase, data: ConversationData, cfg: SftConfig, rows: int
                       ) -> list[list[int]]:
    """The first `rows` evaluated conversations' prompts as token ids, as the generations read them."""
    return [tokenizer.apply_chat_template(c.chat(cfg.prompt.system_prompt, c.prompt_turns), tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            for c in data.splits[cfg.eval.split][:rows]]


def write_results(results: dict, folder: Path) -> None:
    sft_eval.write_result(results["sft"], folder)


def read_results(folder: Path, cfg: SftConfig | None = None) -> dict | None:
    return sft_eval.read_result(folder)


def has_results(folder: Path) -> bool:
    return sft_eval.read_result(folder) is not None


def outputs(run: RunDir, cfg: SftConfig) -> list[Path]:
    stages = [stage / name for stage in (run.baseline, run.finetuned) for name in (sft_eval.METRICS, sft_eval.PREDICTIONS)]
    probe = [stage / sft_eval.PROBE for stage in (run.baseline, run.finetuned)] if cfg.eval.probe else []
    return [*stages, *probe, *trained_outputs(run, cfg.train.finetuning), run.comparison_json, run.report_html,
            *(run.data / f"{s}.jsonl" for s in SPLITS)]


# --------------------------------------------------------------------------------------------------
# The model trained and measured: the causal LM itself, with CAUSAL_LM adapters and the completion loss


def training_setup(model, cfg, data) -> tuple[object, Objective]:
    return model, LANGUAGE_MODEL


def load_adapted(model, adapter_dir: Path, cfg, data):
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir)


def memory_workload(cfg: SftConfig, device_type: str):
    """What `emotune plan` models: the loss on every token of a row at most (the assistant turns); the measurement's
    response loss (a forward pass projecting the answers) and greedy generations of `eval.max_new_tokens`."""
    from emotune.train.memory import Evaluation, Workload

    auto = cfg.eval.batch_size == "auto"
    rows = sft_eval.auto_rows(device_type) if auto else cfg.eval.batch_size
    length = cfg.train.max_length
    return Workload(loss_tokens_per_row=None, evaluations={
        "response loss": Evaluation(rows, auto, length, projected=length),
        "generate": Evaluation(rows, auto, length, cfg.eval.max_new_tokens, projected=1, cache="model")})
