"""`task: classify_head`: a linear classification head on the last token, trained with LoRA.

Rows are classify's (text, label), through the same data pipeline and run folder. The head (`score`,
emotune.model.head) reads the bare text, pooled at the last real token; the loss is the class-weighted
cross-entropy of its logits, and the adapter kept is the best by `head.select` (macro-F1 by default).

The honest "before": an untrained head is chance, so the baseline is the base causal model's zero-shot
label scoring (the classify task's `score` method, with `prompt`) on the same split and labels; the
"after" is the head's. Both are stored under the method name `head`, each with `measured_by` saying
which of the two it is, so classify's metrics, comparison and report code serve unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from emotune.core.config.eval import EvalConfig
from emotune.core.config.head import ClassifyHeadConfig
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, read_json
from emotune.data import LabeledData, system_prompt
from emotune.data.clean import text_steps
from emotune.data.prepare import data_fingerprint, format_summary, prepare_data, save_prepared, saved_fingerprint
from emotune.eval.evaluate import (
    EvalResult,
    LabelPrompt,
    auto_batch_cap,
    check_finite,
    compute_metrics,
    probability_metrics,
    read_predictions,
    write_results,
)
from emotune.eval.evaluate import evaluate as evaluate_method
from emotune.model.artifacts import Artifact, check_matches, find_artifact, trained_outputs
from emotune.model.head import classifier_from_causal, encode_texts, head_probabilities, is_classifier
from emotune.tasks.classify.report import measurements
from emotune.tasks.classify_head.objective import head_objective
from emotune.tasks.classify_head.report import compare, format_comparison, report_sections, write_comparison
from emotune.train.batches import Example, Objective

__all__ = ["COMPARED_METRICS", "CONFIG", "DEFAULT_METRIC", "MEASUREMENT", "SHOWN_METRICS", "SWEEP_COLUMNS",
           "adapter_meta", "compare", "data_fingerprint", "describe_data", "evaluate", "find_adapter",
           "format_comparison", "has_results", "load_adapted", "load_data", "measurements", "memory_workload",
           "merge_check_inputs", "outputs", "read_results", "report_sections", "run_info", "save_data",
           "saved_fingerprint", "training_rows", "training_setup", "write_comparison", "write_results"]

CONFIG = ClassifyHeadConfig  # the config class of this task (emotune.core.config.build.TASK_CONFIGS)
SHOWN_METRICS = ("accuracy", "macro_f1", "weighted_f1", "top2_accuracy", "log_loss", "ece")
COMPARED_METRICS = ("accuracy", "macro_f1", "weighted_f1", "invalid", "top2_accuracy", "log_loss", "ece")  # in comparison.json
DEFAULT_METRIC = "macro_f1"  # what a sweep ranks by
SWEEP_COLUMNS = ("macro_f1", "accuracy")  # shown in sweep tables
MEASUREMENT = "classification"  # `emotune compare` puts it beside classify runs of the same labels and rows
METHOD = "head"
BEFORE = "zero-shot label scoring by the base causal model (the classify task's `score` method, with the prompt section)"
AFTER = "the classification head (`score` on the last token) with the LoRA adapter"


# --------------------------------------------------------------------------------------------------
# Data: classify's


def load_data(cfg: ClassifyHeadConfig) -> LabeledData:
    return prepare_data(cfg)


def save_data(data: LabeledData, run: RunDir, tokenizer, cfg: ClassifyHeadConfig) -> None:
    save_prepared(data, run, tokenizer, cfg)


def describe_data(data: LabeledData) -> str:
    return format_summary(data)


def run_info(cfg: ClassifyHeadConfig, data: LabeledData) -> dict:
    return {"labels": data.labels, "rows": {name: len(ds) for name, ds in data.splits.items()},
            "system_prompt": system_prompt(cfg.prompt, data.labels), "head_select": cfg.head.select,
            "baseline": BEFORE}


# --------------------------------------------------------------------------------------------------
# Training: the bare text, one class per row


def training_rows(data: LabeledData, tokenizer: PreTrainedTokenizerBase, cfg: ClassifyHeadConfig
                  ) -> tuple[list[Example], list[Example]]:
    index = {label: i for i, label in enumerate(data.labels)}
    out = []
    for split, weights in (("train", data.class_weights), ("validation", None)):  # weights: data.balance=class_weight
        ds = data.splits[split]
        ids = encode_texts(ds["text"], tokenizer, cfg.train.max_length)
        # The loss "span" is the last token, where the head reads the row: each row counts once in the normalisation.
        out.append([Example(row_ids, len(row_ids) - 1, weights[label] if weights else 1.0, label=index[label])
                    for row_ids, label in zip(ids, ds["label"], strict=False)])
    return out[0], out[1]


def training_setup(model, cfg: ClassifyHeadConfig, data: LabeledData) -> tuple[torch.nn.Module, Objective]:
    """The base model's language model under a fresh head, and the head's objective."""
    return classifier_from_causal(model, data.labels, cfg.seed), head_objective(cfg.head.select, len(data.labels))


def load_adapted(model, adapter_dir: Path, cfg: ClassifyHeadConfig, data: LabeledData):
    from peft import PeftModel

    return PeftModel.from_pretrained(classifier_from_causal(model, data.labels, cfg.seed), adapter_dir)


def adapter_meta(cfg: ClassifyHeadConfig, data: LabeledData) -> dict:
    return {"task": "classify_head", "labels": data.labels, "base_model": cfg.model.source,
            "max_length": cfg.train.max_length, "head_select": cfg.head.select, "eval": cfg.eval.model_dump(),
            "cleaning": text_steps(cfg.data.cleaning), "text_column": cfg.data.text_column}  # predict --file's default


# --------------------------------------------------------------------------------------------------
# Measurement: zero-shot scoring for the base model, the head for the adapted one


def evaluate(model, tokenizer, data: LabeledData, cfg: ClassifyHeadConfig, desc: str) -> dict[str, EvalResult]:
    split = data.splits[cfg.eval.split]
    if is_classifier(model):
        result = evaluate_head(model, tokenizer, split["text"], split["label"], data.labels, cfg, desc)
    else:
        zero_shot = EvalConfig(method="score", batch_size=cfg.eval.batch_size, split=cfg.eval.split)
        result = evaluate_method(model, tokenizer, split, LabelPrompt(cfg.prompt, data.labels), zero_shot, desc, method="score")
    result.metrics.update(method=METHOD, measured_by=AFTER if is_classifier(model) else BEFORE)
    return {METHOD: result}


def evaluate_head(model, tokenizer, texts: list[str], gold: list[str], labels: list[str], cfg: ClassifyHeadConfig,
                  desc: str) -> EvalResult:
    import time

    started = time.perf_counter()
    device_type = next(model.parameters()).device.type
    batch_size = cfg.eval.batch_size if cfg.eval.batch_size != "auto" else auto_batch_cap("score", device_type)
    probs = head_probabilities(model, tokenizer, list(texts), cfg.train.max_length, batch_size, f"{desc} (head)")
    check_finite(model, probs, cfg.eval.split, desc)  # NaN probabilities: no metrics (scikit-learn refuses them)
    predicted = [labels[i] for i in probs.argmax(-1).tolist()]
    metrics = {**compute_metrics(list(gold), predicted, labels), **probability_metrics(list(gold), probs.numpy(), labels)}
    seconds = time.perf_counter() - started
    metrics.update(batch_size=batch_size, seconds=round(seconds, 2), rows_per_s=round(len(texts) / seconds, 2) if seconds else None)
    rows = [{"text": t, "gold": g, "predicted": p, **{f"p_{label}": round(float(q), 6) for label, q in zip(labels, row, strict=False)}}
            for t, g, p, row in zip(texts, gold, predicted, probs.tolist(), strict=False)]
    return EvalResult(rows=rows, metrics=metrics)


def merge_check_inputs(tokenizer: PreTrainedTokenizerBase, data: LabeledData, cfg: ClassifyHeadConfig, rows: int
                       ) -> list[list[int]]:
    """The first `rows` evaluated texts as token ids, as the head reads them (the bare text, cut at max_length)."""
    split = data.splits[cfg.eval.split]
    return encode_texts(split.select(range(min(rows, len(split))))["text"], tokenizer, cfg.train.max_length)


def read_results(folder: Path, cfg: ClassifyHeadConfig | None = None) -> dict[str, EvalResult] | None:
    metrics = read_json(folder / "metrics.json") if (folder / "predictions.csv").is_file() else None
    if not isinstance(metrics, dict) or metrics.get("method") != METHOD:
        return None
    return {METHOD: EvalResult(rows=read_predictions(folder), metrics=metrics)}


def has_results(folder: Path) -> bool:
    return read_results(folder) is not None


def find_adapter(path: str, cfg: ClassifyHeadConfig, data: LabeledData) -> Artifact:
    """A classify_head adapter, or its merged classifier, trained on this config's labels (`emotune eval CONFIG
    adapter=PATH`)."""
    artifact = find_artifact(path)
    if artifact.meta.get("task") != "classify_head":
        raise UserError(f"`{artifact.path}` is a {artifact.meta.get('task', 'classify')} adapter; `task: classify_head` "
                        "measures classification-head adapters. Use that adapter's own config.")
    check_matches(artifact, data.labels, "")
    return artifact


def outputs(run: RunDir, cfg: ClassifyHeadConfig) -> list[Path]:
    results = [stage / name for stage in (run.baseline, run.finetuned) for name in ("metrics.json", "predictions.csv")]
    return [*results, *trained_outputs(run, cfg.train.finetuning), run.comparison_json, run.comparison_csv,
            run.report_html]


def memory_workload(cfg: ClassifyHeadConfig, device_type: str):
    """What `emotune plan` models: no vocabulary projection in training, a float32 head trained in full; the
    baseline is zero-shot label scoring (the classify task's `score`), the fine-tuned measurement one forward pass."""
    from emotune.tasks.classify.task import ASSUMED_LABELS, LABEL_TOKENS
    from emotune.train.memory import Evaluation, Workload

    labels = len(cfg.data.label_names or []) or ASSUMED_LABELS
    auto = cfg.eval.batch_size == "auto"
    rows = auto_batch_cap("score", device_type) if auto else cfg.eval.batch_size
    length = cfg.train.max_length
    return Workload(loss_tokens_per_row=None, vocabulary_loss=False, head_outputs=labels, evaluations={
        "zero-shot score": Evaluation(rows, auto, length + LABEL_TOKENS * labels, projected=labels + 1, cache="full"),
        "head": Evaluation(rows, auto, length, projected=0)})
