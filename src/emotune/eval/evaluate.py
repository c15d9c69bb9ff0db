"""The evaluation stage: the same prompts before and after training, two ways to read a label, then metrics.

`generate` is the reference recipe's method: chat template, greedy decoding with `max_new_tokens`,
a regex that takes the first label name in the output, INVALID when none matches. Batched with left
padding, which gives the same greedy tokens as one row at a time up to floating-point ties.

`score` reads the same prompt's exact probability of every label (`LabelScorer`) and predicts the most
likely one, so it can never emit an invalid label; its probabilities also give top-2 accuracy, log-loss
and calibration. Both sort rows by length to cut padding and halve the batch on out-of-memory, and both refuse a
model that computes NaN or infinity (`refuse_nonfinite`) before anything is written.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
from datasets import Dataset
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, log_loss, precision_recall_fscore_support, top_k_accuracy_score
from transformers import GenerationConfig, LogitsProcessorList

from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import EvalConfig
from emotune.core.errors import listed
from emotune.core.replies import INVALID, extract_label, label_pattern
from emotune.core.rundir import atomic_file, read_json, write_json
from emotune.data import system_prompt
from emotune.eval.scoring import LabelScorer, prompt_token_ids
from emotune.model.finite import NonFiniteOutput, NonFiniteSeen, nonfinite_rows, nonfinite_weights, not_finite_message
from emotune.model.text import context_length, unwrapped
from emotune.model.turns import RenderedChat, stop_text, stop_token_ids
from emotune.runtime.oom import run_in_batches


@dataclass(frozen=True)
class LabelPrompt:
    """What a classifier is asked: the prompt settings and the label set it answers from (together they make the
    system prompt and the labels a reply is read for)."""

    prompt: PromptConfig
    labels: list[str]


@dataclass
class EvalResult:
    rows: list[dict]  # text, gold, predicted; generate: raw_output; score: p_<label> for every label
    metrics: dict


@torch.inference_mode()
def generate_outputs(model, tokenizer, texts: list[str], asked: LabelPrompt, cfg: EvalConfig, desc: str | None,
                     batch_size: int | None = None) -> list[str]:
    """Greedy-decode up to `max_new_tokens` for every text; batches sorted by length to cut padding."""
    prompts = prompt_token_ids(tokenizer, asked.prompt, asked.labels, texts)  # the very tokens scoring reads
    return generate_texts(model, tokenizer, prompts, cfg.max_new_tokens,
                          batch_size or (cfg.batch_size if cfg.batch_size != "auto" else 16), desc)


@torch.inference_mode()
def generate_texts(model, tokenizer, prompts: list[str] | list[list[int]], max_new_tokens: int, batch_size: int, desc: str | None,
                   logits_processor=None) -> list[str]:
    """Greedy continuations of chat-templated `prompts` (texts, their token ids, or RenderedChat; each stops at EOS
    or the end of the turn), stripped; batched with left padding, rows sorted by length. A reply ends at the model's
    context: a model with a learned position table (GPT-2's 1,024) failed inside its forward past it, a rotary one
    generates from positions it never saw; a prompt that fills the context gets an empty reply.
    `logits_processor`: generate's (a LogitsProcessorList).

    A batch in which the model computed NaN or infinite logits raises NonFiniteOutput with `rows` (indices into
    `prompts`): greedy decoding reads token 0 from NaN logits, a reply of padding that would pass for an answer."""
    device = next(model.parameters()).device
    seen = NonFiniteSeen()
    processors = LogitsProcessorList([*(logits_processor or []), seen])
    outputs: list[str] = [""] * len(prompts)
    tokenizer.padding_side = "left"  # decoder-only batching: new tokens must follow the real prompt directly
    context = context_length(model)
    stop = stop_text(tokenizer)  # a template closing answers with plain text: the reply ends where that text begins
    until_text = {"stop_strings": [stop], "tokenizer": tokenizer} if stop else {}

    def step(batch: list[int]) -> None:
        ids = [_prompt_ids(tokenizer, prompts[i]) for i in batch]
        enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding=True).to(device)
        room = max_new_tokens if context is None else min(max_new_tokens, context - enc["input_ids"].shape[1])
        if room < 1:
            return  # the prompt fills the context: nothing can follow it
        generated = model.generate(**enc, max_new_tokens=room, do_sample=False, num_beams=1, **until_text,
                                   eos_token_id=stop_token_ids(tokenizer, getattr(model, "generation_config", None)),
                                   pad_token_id=tokenizer.pad_token_id, top_p=None, top_k=None, temperature=None,
                                   logits_processor=processors)
        bad = seen.rows()  # one check per batch
        if bad:
            raise NonFiniteOutput("The model computed logits that are not numbers (NaN or infinity).",
                                  rows=sorted(batch[i] for i in bad))
        new_tokens = generated[:, enc["input_ids"].shape[1]:]
        for i, text in zip(batch, tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=False):
            outputs[i] = (text.split(stop)[0] if stop else text).strip()

    was_training = model.training
    model.eval()
    inner = unwrapped(model)
    checkpoints = getattr(inner, "generation_config", None)
    if checkpoints is not None:
        inner.generation_config = _plain_decoding(checkpoints)
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        run_in_batches(order, batch_size, step, desc)
    finally:
        model.train(was_training)
        if checkpoints is not None:
            inner.generation_config = checkpoints
    return outputs


def _prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, RenderedChat):  # special-token text inside a message read as plain text, as training did
        return prompt.ids(tokenizer)
    # the chat template already holds <bos>; adding special tokens again would double it
    return tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else list(prompt)


def _plain_decoding(checkpoints: GenerationConfig) -> GenerationConfig:
    """The checkpoint's special token ids alone. transformers fills every decoding setting generate() is not given from
    the model's generation_config.json, so a released one's repetition penalty (Qwen/Qwen2.5-0.5B-Instruct: 1.1), banned
    words or minimum length reshaped the logits of an evaluation that is greedy over the model's own."""
    return GenerationConfig(bos_token_id=checkpoints.bos_token_id, eos_token_id=checkpoints.eos_token_id,
                            pad_token_id=checkpoints.pad_token_id)


def eval_methods(cfg: EvalConfig) -> list[str]:
    """The methods to run, the reference first: its numbers are the run's headline (`baseline/metrics.json`)."""
    return ["generate", "score"] if cfg.method == "both" else [cfg.method]


def evaluate(model, tokenizer, dataset: Dataset, asked: LabelPrompt, cfg: EvalConfig, desc: str = "evaluate",
             method: str | None = None) -> EvalResult:
    """One method (default: the first of `eval.method`) over `dataset`: rows for predictions.csv, and metrics."""
    method = method or eval_methods(cfg)[0]
    prompt, labels = asked.prompt, asked.labels
    started = time.perf_counter()
    texts, gold = list(dataset["text"]), list(dataset["label"])
    batch_size = choose_batch_size(model, tokenizer, texts, prompt, labels, cfg, method)
    if method == "score":
        log_probs = LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, batch_size, desc=f"{desc} (score)")
        probs = log_probs.softmax(-1)
        check_finite(model, probs, cfg.split, desc)
        predicted = [labels[i] for i in probs.argmax(-1).tolist()]
        metrics = {**compute_metrics(gold, predicted, labels), **probability_metrics(gold, probs.numpy(), labels)}
        rows = [{"text": t, "gold": g, "predicted": p, **{f"p_{label}": round(float(q), 6) for label, q in zip(labels, row, strict=False)}}
                for t, g, p, row in zip(texts, gold, predicted, probs.tolist(), strict=False)]
    else:
        try:
            raw = generate_outputs(model, tokenizer, texts, asked, cfg, f"{desc} (generate)", batch_size)
        except NonFiniteOutput as err:
            refuse_nonfinite(model, split_rows(err.rows, cfg.split), desc)
        pattern = label_pattern(labels)
        predicted = [extract_label(output, labels, pattern) for output in raw]
        metrics = compute_metrics(gold, predicted, labels)
        rows = [{"text": t, "gold": g, "raw_output": r, "predicted": p} for t, g, r, p in zip(texts, gold, raw, predicted, strict=False)]
    seconds = time.perf_counter() - started
    metrics.update(method=method, batch_size=batch_size, seconds=round(seconds, 2),
                   rows_per_s=round(len(texts) / seconds, 2) if seconds else None)
    if method == "generate":
        metrics["max_new_tokens"] = cfg.max_new_tokens
    return EvalResult(rows=rows, metrics=metrics)


def check_finite(model, scores: torch.Tensor, split: str, desc: str) -> None:
    """Refuse the `desc` evaluation when [rows, values] `scores` of the `split` split's rows hold a row that is no
    answer (NaN or infinity, as `nonfinite_rows` counts them): one check on what was computed anyway."""
    bad = nonfinite_rows(scores)
    if bad:
        refuse_nonfinite(model, split_rows(bad, split), desc)


def refuse_nonfinite(model, where: str, desc: str) -> NoReturn:
    """NonFiniteOutput for the `desc` evaluation (`baseline`, `fine-tuned`, the split's name) of a model that computed
    NaN or infinity for `where`, naming the weights at fault (one pass over them, on the way out). Its metrics would
    be no numbers either: scikit-learn failed on them ("Input contains NaN"), and replies read from NaN logits
    (padding) passed for a model that answers nothing. Raised before anything is written, so a stage folder keeps
    the results it held."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    raise NonFiniteOutput(not_finite_message("The evaluated model", where, dtype, nonfinite_weights(model))
                          + f" The {desc} evaluation stopped and wrote no results.")


def split_rows(rows: list[int] | None, split: str) -> str:
    """`rows 3, 7 of the test split` for 0-based `rows` of the split (None: the split itself)."""
    if not rows:
        return f"the {split} split"
    return f"row{'s' if len(rows) > 1 else ''} {listed([r + 1 for r in rows])} of the {split} split"


def evaluate_methods(model, tokenizer, dataset: Dataset, asked: LabelPrompt, cfg: EvalConfig,
                     desc: str = "evaluate") -> dict[str, EvalResult]:
    return {m: evaluate(model, tokenizer, dataset, asked, cfg, desc, method=m) for m in eval_methods(cfg)}


def choose_batch_size(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str], cfg: EvalConfig,
                      method: str) -> int:
    """`eval.batch_size`, or for `auto` the most rows that fit in 40% of free memory, capped (see EvalConfig).

    The estimate covers the KV cache, one layer's activations and the float32 logits at the projected
    positions for the longest prompt; out-of-memory still halves the batch (`run_in_batches`).
    """
    if cfg.batch_size != "auto":
        return cfg.batch_size
    device = next(model.parameters()).device
    cap = auto_batch_cap(method, device.type)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest = max((len(t) for t in texts), default=0) // 2 + len(system_prompt(prompt, labels)) // 2 + 64  # ≥ 1 token / 2 chars
    per_row = _bytes_per_row(config, longest, cfg.max_new_tokens, method, next(model.parameters()).element_size(), len(labels))
    free = _free_memory(device)
    fits = int(0.4 * free // per_row) if free else cap
    return max(1, min(cap, fits))


def auto_batch_cap(method: str, device_type: str) -> int:
    """The most rows `eval.batch_size: auto` puts in one batch of `method` (also `emotune plan`'s assumption)."""
    return (32 if method == "score" else 16) if device_type == "cpu" else (128 if method == "score" else 64)


def _bytes_per_row(config, tokens: int, new_tokens: int, method: str, element: int, n_labels: int) -> int:
    def size(name: str, default: int) -> int:
        # a config may hold a field as None: Mixtral's head_dim (its config.json has none), GPT-2 has no KV heads
        value = getattr(config, name, None)
        return value if isinstance(value, int) and value > 0 else default

    hidden, layers, heads = size("hidden_size", 4096), size("num_hidden_layers", 32), size("num_attention_heads", 32)
    kv = size("num_key_value_heads", heads) * size("head_dim", hidden // heads)
    tokens += new_tokens if method == "generate" else 2 * n_labels
    cache = 2 * layers * kv * tokens * element
    activations = tokens * (4 * hidden + 2 * size("intermediate_size", 4 * hidden) + heads * tokens) * 4
    positions = (n_labels + 1) if method == "score" else 1
    logits = 3 * positions * size("vocab_size", 32000) * 4
    return cache + activations + logits


def _free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available


def compute_metrics(gold: list[str], predicted: list[str], labels: list[str]) -> dict:
    """Accuracy, macro/weighted F1 over the label set, per-class scores, invalid count, confusion matrix.

    INVALID predictions count as wrong for every class; the confusion matrix has an INVALID column
    (and row, always zero, so the matrix stays square). Macro-F1 averages the labels the split holds or the model
    predicts: a label with neither has no F1 (its per-class row shows support 0), and counting it as 0 capped a
    perfect model's macro-F1 below 1 wherever a rare label had no test rows (scikit-learn's own label set when
    none is given).
    """
    matrix_labels = [*labels, INVALID]
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=labels, zero_division=0)
    seen = set(gold) | set(predicted)
    scored = [label for label in labels if label in seen] or labels
    return {
        "rows": len(gold),
        "accuracy": float(accuracy_score(gold, predicted)),
        "macro_f1": float(f1_score(gold, predicted, labels=scored, average="macro", zero_division=0)),
        "weighted_f1": float(f1_score(gold, predicted, labels=labels, average="weighted", zero_division=0)),
        "invalid": sum(p == INVALID for p in predicted),
        "per_class": {
            label: {"precision": float(p), "recall": float(r), "f1": float(s), "support": int(n)}
            for label, p, r, s, n in zip(labels, precision, recall, f1, support, strict=False)
        },
        "confusion_matrix": {
            "labels": matrix_labels,
            "matrix": confusion_matrix(gold, predicted, labels=matrix_labels).tolist(),
        },
    }


def probability_metrics(gold: list[str], probs: np.ndarray, labels: list[str], bins: int = 10) -> dict:
    """Top-2 accuracy, log-loss and expected calibration error of per-label probabilities [rows, labels].

    Read in float64: scikit-learn clips probabilities at the epsilon of their dtype, float32's 1.2e-7, so every row
    whose true label the model gave less than that (a confident mistake, 1e-12) counted as 15.9 nats, not 27.6, and
    a fine-tuned model's log-loss read lower than it was."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum(axis=1, keepdims=True)  # rows summed in float32 may miss 1 by more than float64 allows
    index = {label: i for i, label in enumerate(labels)}
    truth = np.array([index[g] for g in gold])
    classes = list(range(len(labels)))
    top2 = 1.0 if len(labels) <= 2 else float(top_k_accuracy_score(truth, probs, k=2, labels=classes))
    return {
        "top2_accuracy": top2,
        "log_loss": float(log_loss(truth, probs, labels=classes)),
        "ece": expected_calibration_error(truth, probs, bins),
        "ece_bins": bins,
    }


def expected_calibration_error(truth: np.ndarray, probs: np.ndarray, bins: int = 10) -> float:
    """Σ_b (rows in b / rows) · |accuracy(b) − mean confidence(b)| over equal-width bins of the top probability."""
    confidence = probs.max(1)
    correct = probs.argmax(1) == truth
    which = np.minimum((confidence * bins).astype(int), bins - 1)  # confidence 1.0 falls in the last bin
    ece = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


def write_result(result: EvalResult, folder: Path) -> None:
    """metrics.json and predictions.csv, each written to a temporary name and renamed into place."""
    with atomic_file(folder / "predictions.csv") as tmp, tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result.rows[0]) if result.rows else ["text", "gold", "raw_output", "predicted"])
        writer.writeheader()
        writer.writerows(result.rows)
    write_json(folder / "metrics.json", result.metrics)  # metrics last: its presence marks the stage as complete


def method_folder(folder: Path, method: str, methods: list[str]) -> Path:
    """The first method's results live in `folder` itself, any other method's in `folder/<method>/`."""
    return folder if method == methods[0] else folder / method


def write_results(results: dict[str, EvalResult], folder: Path) -> None:
    methods = list(results)
    for method in reversed(methods):  # the first method last: `folder/metrics.json` marks the stage complete
        write_result(results[method], method_folder(folder, method, methods))


def read_evaluation(folder: Path, methods: list[str]) -> dict[str, EvalResult] | None:
    """What `write_results` wrote: {method: EvalResult} with predictions.csv's rows (values as text), when every
    method is complete in `folder`, else None."""
    metrics = read_metrics(folder, methods)
    if metrics is None:
        return None
    return {method: EvalResult(rows=read_predictions(method_folder(folder, method, methods)), metrics=found)
            for method, found in metrics.items()}


def read_predictions(folder: Path) -> list[dict]:
    """predictions.csv's rows (text, gold, predicted, ...), as text."""
    with (folder / "predictions.csv").open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def read_metrics(folder: Path, methods: list[str]) -> dict[str, dict] | None:
    """{method: metrics} when every method's metrics.json exists in `folder` (and matches its method), else None."""
    found = {}
    for method in methods:
        path = method_folder(folder, method, methods) / "metrics.json"
        metrics = read_json(path)  # None when missing, cut short or no object: measured again
        if metrics is None or metrics.get("method", "generate") != method:
            return None
        found[method] = metrics
    return found
