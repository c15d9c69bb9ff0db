"""sft's measurement, the same code before and after training, on `eval.split`:

1. response loss and perplexity: the cross-entropy of the reference answer (the last assistant turn,
   end-of-turn token included) given the conversation before it, the training loss's own code path;
2. greedy generations (`eval.max_new_tokens`, stopping at the end of the turn, batched with left
   padding) scored against the reference with ROUGE-L, BLEU and exact match (emotune.eval.textmetrics),
   overall and per kind;
3. the forgetting probe (emotune.eval.probe), when `eval.probe` is on.

Files in a stage folder: predictions.csv (prompt, reference, output, kind, scores), probe.json, and
metrics.json last (it marks the folder complete). A model that computes NaN or infinity in any of the three is
refused (emotune.eval.evaluate.refuse_nonfinite) and nothing is written.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from emotune.core.config.sft import SftConfig
from emotune.core.errors import listed
from emotune.core.rundir import atomic_file, read_json, write_json
from emotune.data.conversations import Conversation
from emotune.eval import textmetrics
from emotune.eval.evaluate import generate_texts, refuse_nonfinite, split_rows
from emotune.model.finite import NonFiniteOutput, nonfinite_rows
from emotune.model.turns import chat_ids
from emotune.runtime.oom import run_in_batches
from emotune.tasks.sft.rows import encode
from emotune.train.batches import collate, completion_loss

METRICS, PREDICTIONS, PROBE = "metrics.json", "predictions.csv", "probe.json"
COLUMNS = ["prompt", "reference", "output", "kind", "rouge_l", "bleu", "exact_match"]


@dataclass
class SftResult:
    rows: list[dict]
    metrics: dict
    probe: dict | None = None


def batch_size(model, cfg: SftConfig) -> int:
    if cfg.eval.batch_size != "auto":
        return cfg.eval.batch_size
    return auto_rows(next(model.parameters()).device.type)


def auto_rows(device_type: str) -> int:
    """The rows of one batch under `eval.batch_size: auto` (also `emotune plan`'s assumption)."""
    return 8 if device_type == "cpu" else 32


def measure(model, tokenizer, conversations: list[Conversation], cfg: SftConfig, desc: str) -> SftResult:
    started = time.perf_counter()
    rows, split = batch_size(model, cfg), cfg.eval.split
    try:
        loss, tokens = response_loss(model, tokenizer, conversations, cfg.prompt.system_prompt, rows)
    except NonFiniteOutput as err:  # a NaN loss: the perplexity and its comparison would be NaN too
        refuse_nonfinite(model, f"the reference answers of {split_rows(err.rows, split)} (one batch's loss)", desc)
    prompts = [chat_ids(tokenizer, c.chat(cfg.prompt.system_prompt, c.prompt_turns), generation_prompt=True)
               for c in conversations]  # as the rows read them: special-token text inside a message is plain text
    try:
        outputs = generate_texts(model, tokenizer, prompts, cfg.eval.max_new_tokens, rows, f"{desc} (generate)")
    except NonFiniteOutput as err:  # greedy replies read from NaN logits: padding, scored as if answered
        refuse_nonfinite(model, f"the replies to {split_rows(err.rows, split)}", desc)
    scored = score_rows(conversations, outputs)
    summary = textmetrics.summarize([{**r, "prediction": r["output"]} for r in scored])
    metrics = {"rows": len(conversations), "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "response_tokens": tokens,
               "rouge_l": summary["rouge_l"], "bleu": summary["corpus_bleu"], "sentence_bleu": summary["bleu"],
               "exact_match": summary["exact_match"], "per_kind": summary["per_kind"],
               "max_new_tokens": cfg.eval.max_new_tokens, "batch_size": rows}
    probe = run_probe(model, tokenizer, cfg, rows, desc) if cfg.eval.probe else None
    if probe is not None:
        metrics["probe_accuracy"] = probe["accuracy"]
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    return SftResult(scored, metrics, probe)


@torch.inference_mode()
def response_loss(model, tokenizer, conversations: list[Conversation], system_prompt: str | None,
                  rows: int) -> tuple[float, int]:
    """(mean cross-entropy per reference token, reference tokens) over every conversation's last answer.
    NonFiniteOutput (`rows`: the batch's) for a batch whose loss is NaN or infinite, checked on the float the sum is
    read as anyway."""
    examples = [encode(c, tokenizer, system_prompt, mask_history=True) for c in conversations]
    device = next(model.parameters()).device
    totals = [0.0, 0]
    was_training = model.training
    model.eval()

    def step(batch: list[int]) -> None:
        parts = completion_loss(model, collate([examples[i] for i in batch], tokenizer.pad_token_id, device))
        loss_sum = float(parts.loss_sum)
        if not math.isfinite(loss_sum):
            raise NonFiniteOutput("The model computed a loss that is not a number (NaN or infinity).", rows=sorted(batch))
        totals[0] += loss_sum
        totals[1] += parts.tokens

    try:
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
        run_in_batches(order, rows, step, None)
    finally:
        model.train(was_training)
    return totals[0] / max(totals[1], 1), totals[1]


def score_rows(conversations: list[Conversation], outputs: list[str]) -> list[dict]:
    references = [c.response for c in conversations]
    rouge = textmetrics.rouge_l(outputs, references)
    return [{"prompt": c.messages[-2][1], "reference": ref, "output": out, "kind": c.kind or "",
             "rouge_l": round(r, 6), "bleu": round(textmetrics.sentence_bleu(out, ref), 6),
             "exact_match": float(textmetrics.exact_match(out, ref))}
            for c, ref, out, r in zip(conversations, references, outputs, rouge, strict=False)]


def run_probe(model, tokenizer, cfg: SftConfig, rows: int, desc: str) -> dict:
    """The forgetting probe's result as JSON: `accuracy` and per-question outcomes; refused when the model scored a
    question's options with NaN or infinity (its answer would be whichever option came first)."""
    from emotune.eval.probe import load_probe, score_probe

    result = score_probe(model, tokenizer, load_probe(limit=cfg.eval.probe_limit), rows)
    bad = [n for n, scores in enumerate(result.option_scores, start=1) if nonfinite_rows(torch.tensor([scores]))]
    if bad:
        refuse_nonfinite(model, f"question{'s' if len(bad) > 1 else ''} {listed(bad)} of the forgetting probe", desc)
    return {**dataclasses.asdict(result), "accuracy": float(result.accuracy)}


# --------------------------------------------------------------------------------------------------
# Files


def write_result(result: SftResult, folder: Path) -> None:
    with atomic_file(folder / PREDICTIONS) as tmp, tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(result.rows)
    if result.probe is not None:
        write_json(folder / PROBE, result.probe)
    write_json(folder / METRICS, result.metrics)  # last: marks the folder complete


def read_result(folder: Path) -> dict | None:
    """{"metrics", "rows", "probe"} when `folder` holds a complete measurement, else None."""
    metrics = read_json(folder / METRICS)
    if metrics is None or "perplexity" not in metrics or not (folder / PREDICTIONS).is_file():
        return None
    with (folder / PREDICTIONS).open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    probe = read_json(folder / PROBE)  # None when there is none, or it is unreadable
    return {"metrics": metrics, "rows": rows, "probe": probe}
