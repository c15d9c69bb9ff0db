"""The evaluation stage: the same prompts and decoding before and after training, then metrics.

`generate` is the reference recipe's method: chat template, greedy decoding with `max_new_tokens`,
a regex that takes the first label name in the output, INVALID when none matches. Batched with left
padding, which gives the same greedy tokens as one row at a time up to floating-point ties.
"""

from __future__ import annotations

import csv
import json
import re
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support
from tqdm.auto import tqdm

from emotune.config import EvalConfig, PromptConfig
from emotune.data import prompt_messages
from emotune.models import stop_token_ids

INVALID = "INVALID"
UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN")


@dataclass
class EvalResult:
    rows: list[dict[str, str]]  # text, gold, raw_output, predicted
    metrics: dict


def label_pattern(labels: list[str]) -> re.Pattern[str]:
    """Whole-word, case-insensitive match of any label; longer names first so `joyful` never reads as `joy`.

    Scripts written without spaces (Chinese, Japanese, Thai, ...) have no word boundaries to test, so
    a label edge in such a script matches next to anything (`我觉得是喜悦。` -> 喜悦).
    """
    def bounded(label: str) -> str:
        before = "" if _unspaced(label[:1]) else r"(?<!\w)"
        after = "" if _unspaced(label[-1:]) else r"(?!\w)"
        return before + re.escape(label) + after

    alternatives = "|".join(bounded(label) for label in sorted(labels, key=len, reverse=True))
    return re.compile(rf"({alternatives})", re.IGNORECASE)


def _unspaced(char: str) -> bool:
    return bool(char) and unicodedata.name(char, "").startswith(UNSPACED_SCRIPTS)


def extract_label(output: str, labels: list[str], pattern: re.Pattern[str] | None = None) -> str:
    match = (pattern or label_pattern(labels)).search(output)
    if match is None:
        return INVALID
    found = match.group(1).casefold()
    return next(label for label in labels if label.casefold() == found)


@torch.inference_mode()
def generate_outputs(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str],
                     cfg: EvalConfig, desc: str) -> list[str]:
    """Greedy-decode up to `max_new_tokens` for every text; batches sorted by length to cut padding."""
    device = next(model.parameters()).device
    prompts = [tokenizer.apply_chat_template(prompt_messages(t, prompt, labels), tokenize=False, add_generation_prompt=True)
               for t in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[str] = [""] * len(prompts)
    tokenizer.padding_side = "left"  # decoder-only batching: new tokens must follow the real prompt directly
    was_training = model.training
    model.eval()
    with tqdm(total=len(prompts), desc=desc, unit="row") as bar:
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start:start + cfg.batch_size]
            # the chat template already holds <bos>; adding special tokens again would double it
            enc = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            generated = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, do_sample=False, num_beams=1,
                                       eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                       top_p=None, top_k=None, temperature=None)
            new_tokens = generated[:, enc["input_ids"].shape[1]:]
            for i, text in zip(batch, tokenizer.batch_decode(new_tokens, skip_special_tokens=True)):
                outputs[i] = text.strip()
            bar.update(len(batch))
    model.train(was_training)
    return outputs


def evaluate(model, tokenizer, dataset: Dataset, labels: list[str], prompt: PromptConfig, cfg: EvalConfig,
             desc: str = "evaluate") -> EvalResult:
    started = time.perf_counter()
    texts, gold = list(dataset["text"]), list(dataset["label"])
    raw = generate_outputs(model, tokenizer, texts, prompt, labels, cfg, desc)
    pattern = label_pattern(labels)
    predicted = [extract_label(output, labels, pattern) for output in raw]
    metrics = compute_metrics(gold, predicted, labels)
    seconds = time.perf_counter() - started
    metrics.update(method=cfg.method, max_new_tokens=cfg.max_new_tokens, seconds=round(seconds, 2),
                   rows_per_s=round(len(texts) / seconds, 2) if seconds else None)
    rows = [{"text": t, "gold": g, "raw_output": r, "predicted": p} for t, g, r, p in zip(texts, gold, raw, predicted)]
    return EvalResult(rows=rows, metrics=metrics)


def compute_metrics(gold: list[str], predicted: list[str], labels: list[str]) -> dict:
    """Accuracy, macro/weighted F1 over the label set, per-class scores, invalid count, confusion matrix.

    INVALID predictions count as wrong for every class; the confusion matrix has an INVALID column
    (and row, always zero, so the matrix stays square).
    """
    matrix_labels = [*labels, INVALID]
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=labels, zero_division=0)
    return {
        "rows": len(gold),
        "accuracy": float(accuracy_score(gold, predicted)),
        "macro_f1": float(f1_score(gold, predicted, labels=labels, average="macro", zero_division=0)),
        "weighted_f1": float(f1_score(gold, predicted, labels=labels, average="weighted", zero_division=0)),
        "invalid": sum(p == INVALID for p in predicted),
        "per_class": {
            label: {"precision": float(p), "recall": float(r), "f1": float(s), "support": int(n)}
            for label, p, r, s, n in zip(labels, precision, recall, f1, support)
        },
        "confusion_matrix": {
            "labels": matrix_labels,
            "matrix": confusion_matrix(gold, predicted, labels=matrix_labels).tolist(),
        },
    }


def write_result(result: EvalResult, folder: Path) -> None:
    """metrics.json and predictions.csv, each written to a temporary name and renamed into place."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "metrics.json.tmp"
    tmp.write_text(json.dumps(result.metrics, indent=2, ensure_ascii=False))
    csv_tmp = folder / "predictions.csv.tmp"
    with csv_tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result.rows[0]) if result.rows else ["text", "gold", "raw_output", "predicted"])
        writer.writeheader()
        writer.writerows(result.rows)
    csv_tmp.replace(folder / "predictions.csv")
    tmp.replace(folder / "metrics.json")  # metrics last: its presence marks the stage as complete
