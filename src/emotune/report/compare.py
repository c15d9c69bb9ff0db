"""`emotune compare RUN_DIR...`: finished runs side by side in one table (terminal, CSV, Markdown, HTML).

One row per run and evaluation method (a classify run measured with `eval.method=both` gives two). Each
row holds what the run folder says: task and method, model, the key hyper-parameters from config.yaml,
the fine-tuned result with 95 % bootstrap intervals (from the predictions, so the same numbers as
comparison.json's `intervals.*.after`), training time, tokens/s and peak memory from the training log,
evaluation rows/s and the adapter's size on disk.

Rows are comparable only when they measured the same thing: the same label set, and the same test rows.
A run's test rows are identified by a fingerprint of its fine-tuned predictions.csv: the SHA-256 of the
sorted (text, gold label) pairs (sft: (prompt, reference)). That is independent of row order, method,
task, data path and training settings, and changes with anything that changes what was measured: another
`eval.split`, limit, seed-dependent split, cleaning setting or data file. Runs that differ are refused
(or, with `--allow-mismatch`, shown and marked not comparable). Comparable rows after the first are
tested against the first on the same rows, paired (emotune.eval.stats; sft: ROUGE-L's paired bootstrap).
Classification and sft runs never share a table: they have no metric in common.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, read_json
from emotune.eval import stats
from emotune.report.table import check_out, render, write_outputs
from emotune.tasks import DEFAULT_TASK, TASKS

DEFAULT_OUT = Path("compare")
FILES = ("compare.csv", "compare.md", "compare.html", "compare.json")
GENERATION = "generation"  # the kind of measurement of free-text tasks (Task.MEASUREMENT)


@dataclass
class Entry:
    """One row of the table: one run measured by one method."""

    run: str  # the run folder's name (its path when two share a name)
    path: Path
    task: str
    method: str
    labels: list[str]  # classification: the label set; sft: the kinds of instruction
    metrics: dict  # the fine-tuned stage's metrics.json
    rows: list[dict]  # its predictions.csv
    setup: dict  # model and key hyper-parameters
    cost: dict  # training time, tokens/s, peak memory, eval rows/s, adapter size
    fingerprint: str = ""
    scores: dict = field(default_factory=dict)  # headline scores with their 95% intervals
    comparable: bool = True
    note: str = ""  # why not comparable
    vs_first: dict | None = None  # the paired test against the first row

    @property
    def kind(self) -> str:
        """The kind of measurement: "classification" or "generation" (the task's MEASUREMENT)."""
        return TASKS[self.task].MEASUREMENT

    @property
    def name(self) -> str:
        return f"{self.task}/{self.method}" if self.method != self.task else self.task


def compare_runs(run_dirs: list[str], out: str | Path | None = None, allow_mismatch: bool = False) -> dict:
    """Read, check and pair the runs, print the table and write it into `out` (default ./compare)."""
    target = Path(out) if out is not None else DEFAULT_OUT
    check_out(target)  # before the work, so a wrong --out costs nothing
    table = comparison_table(run_dirs, allow_mismatch)
    print(render(table))
    write_outputs(table, target)
    print(f"\nWritten: {', '.join(str(target / name) for name in FILES)}")
    return table


def comparison_table(run_dirs: list[str | Path], allow_mismatch: bool = False) -> dict:
    """The runs read, checked, scored with intervals and paired with the first: the summary every output shows
    (also the studio's compare page). UserError when a folder is no finished run or the runs measured other rows."""
    entries = [entry for path in run_dirs for entry in read_run(Path(path))]
    _name_runs(entries)
    check_comparable(entries, allow_mismatch)
    for entry in entries:
        entry.scores = headline_scores(entry)
    pair_with_first(entries)
    return summary(entries)


# --------------------------------------------------------------------------------------------------
# Reading a run folder


def read_run(path: Path) -> list[Entry]:
    """The run's rows of the table, one per method measured after fine-tuning; refuses what is not a finished run."""
    run = RunDir(path)
    info = read_json(run.run_json)
    if info is None:
        raise UserError(f"`{path}` is not a run folder (it has no readable run.json). Give the folders `emotune run` "
                        "wrote, e.g. runs/cpu runs/head-cpu.")
    task = info.get("task", DEFAULT_TASK)
    if task not in TASKS:
        raise UserError(f"`{path}` is a run of task {task!r}, which this emotune does not know. Upgrade emotune to "
                        "the version that made the run.")
    if not run.is_finished():
        raise UserError(f"`{path}` is not a finished run (status {info.get('status')!r}, or an output it lists is "
                        "missing). Finish it first: re-run `emotune run` with its config resumes it.")
    found = TASKS[task].measurements(run.finetuned, info)
    if not found:
        raise UserError(f"`{run.finetuned}` holds no complete measurement; re-run `emotune run` with the run's config.")
    setup, cost = _setup(run), _cost(run, info)
    return [Entry(path.name, path, task, one["method"], one["labels"], one["metrics"], one["rows"], setup,
                  {**cost, "eval_rows_per_s": one["rows_per_s"]}) for one in found]


def _setup(run: RunDir) -> dict:
    """The model and the hyper-parameters that most change a result, from the run's resolved config."""
    config = run.saved_settings()
    model, lora, train = (section if isinstance(section := config.get(name), dict) else {}
                          for name in ("model", "lora", "train"))
    targets = lora.get("target_modules")
    batch, accumulation = train.get("batch_size"), train.get("gradient_accumulation_steps", 1)
    return {"model": model.get("source"), "lora_r": lora.get("r"), "lora_alpha": lora.get("alpha"),
            "lora_targets": _targets(targets, lora.get("target_parameters")),
            "learning_rate": train.get("learning_rate"),
            "batch": batch * accumulation if isinstance(batch, int) and isinstance(accumulation, int) else batch,
            "max_length": train.get("max_length"), "max_steps": train.get("max_steps")}


def _targets(modules, weights) -> str | None:
    """lora.target_modules as the table shows it, with lora.target_parameters (the routed experts) after a `+`."""
    shown = ",".join(modules) if isinstance(modules, list) else modules
    if weights:
        return f"{shown} + {','.join(weights) if isinstance(weights, list) else weights}"
    return shown


def _cost(run: RunDir, info: dict) -> dict:
    """Training time (the train stage's seconds in run.json), the training log's mean tokens/s over its log lines
    and highest peak memory, the optimizer steps taken, and the adapter's weights on disk (PEFT's weight file,
    which holds a head task's head too; not the tokenizer copied beside it)."""
    training = [e for e in run.history() if "tokens_per_s" in e]
    weights = [p for p in run.adapter.glob("adapter_model.*") if p.is_file()] if run.adapter.is_dir() else []
    return {"train_seconds": info.get("stages", {}).get("train", {}).get("seconds"),
            "steps": max((e["step"] for e in training), default=None),
            "tokens_per_s": round(sum(e["tokens_per_s"] for e in training) / len(training), 1) if training else None,
            "peak_memory_mb": max((e["peak_memory_mb"] for e in training if "peak_memory_mb" in e), default=None),
            "adapter_mb": round(sum(p.stat().st_size for p in weights) / 2**20, 2) if weights else None}


def _name_runs(entries: list[Entry]) -> None:
    """Folder names, unless two different folders share one: then the paths as given."""
    folders = {}
    for entry in entries:
        folders.setdefault(entry.run, set()).add(entry.path)
    for entry in entries:
        if len(folders[entry.run]) > 1:
            entry.run = str(entry.path)


# --------------------------------------------------------------------------------------------------
# What may be compared


def row_key(entry: Entry, row: dict) -> tuple[str, str]:
    """What identifies a measured row: (text, gold) for classification, (prompt, reference) for generation."""
    return (row["prompt"], row["reference"]) if entry.kind == GENERATION else (row["text"], row["gold"])


def rows_fingerprint(entry: Entry) -> str:
    """SHA-256 (16 hex digits) of the sorted (text, gold) pairs the run was measured on; order-independent."""
    pairs = sorted(json.dumps(row_key(entry, row), ensure_ascii=False) for row in entry.rows)
    return hashlib.sha256("\n".join(pairs).encode("utf-8")).hexdigest()[:16]


def check_comparable(entries: list[Entry], allow_mismatch: bool) -> None:
    """Refuse mixing sft with classification; refuse (or, allowed, mark) other label sets and other test rows."""
    kinds = {entry.kind for entry in entries}
    if len(kinds) > 1:
        by_kind = {kind: sorted({e.run for e in entries if e.kind == kind}) for kind in sorted(kinds)}
        raise UserError("emotune compare puts runs with the same measurement in one table, but "
                        + " and ".join(f"{', '.join(runs)} {'are' if len(runs) > 1 else 'is'} {kind}"
                                       for kind, runs in by_kind.items())
                        + " (generation is scored by ROUGE-L and perplexity, classification by accuracy and macro-F1). "
                          "Compare each kind in its own `emotune compare` call.")
    first = entries[0]
    problems = []
    for entry in entries:
        entry.fingerprint = rows_fingerprint(entry)
        reasons = []
        if first.kind != GENERATION and set(entry.labels) != set(first.labels):
            reasons.append(f"labels {entry.labels} instead of {first.labels}")
        if entry.fingerprint != first.fingerprint:
            reasons.append(f"other test rows ({len(entry.rows)} rows, fingerprint {entry.fingerprint}; {first.run} has "
                           f"{len(first.rows)}, {first.fingerprint})")
        if reasons:
            entry.comparable, entry.note = False, "; ".join(reasons)
            problems.append(f"{entry.run} ({entry.name}): {entry.note}")
    if problems and not allow_mismatch:
        measured_on = "test rows" if first.kind == GENERATION else "labels and test rows"
        raise UserError(f"These runs were not measured on the same {measured_on} as {first.run}, so their "
                        f"numbers cannot be compared: {' · '.join(problems)}. Compare runs made with the same data "
                        "section and eval.split, or pass --allow-mismatch to show them marked not comparable.")


# --------------------------------------------------------------------------------------------------
# Scores, intervals and the paired test against the first row


def headline_scores(entry: Entry) -> dict:
    """Classification: accuracy and macro-F1 with 95% intervals; generation: ROUGE-L and exact match with theirs."""
    if entry.kind == GENERATION:
        scores = {}
        for name in ("rouge_l", "exact_match"):
            values = [float(r[name]) for r in entry.rows]
            low, high = stats.bootstrap_ci(values) if values else (0.0, 0.0)
            scores[name] = {"value": entry.metrics.get(name), "interval": [round(low, 6), round(high, 6)]}
        return scores
    gold, predicted = [r["gold"] for r in entry.rows], [r["predicted"] for r in entry.rows]
    return stats.classification_intervals(gold, predicted, entry.labels) if entry.rows else {}


def pair_with_first(entries: list[Entry]) -> None:
    """`vs_first` of every comparable row after the first: the paired test on the same rows, aligned by row key."""
    first = entries[0]
    for entry in entries[1:]:
        if not entry.comparable or not entry.rows:
            continue
        reference, other = _aligned(first), _aligned(entry)
        if entry.kind == GENERATION:
            delta = stats.paired_bootstrap_delta([float(r["rouge_l"]) for r in reference],
                                                 [float(r["rouge_l"]) for r in other])
            delta = {k: round(v, 6) for k, v in delta.items()}
            verdict = "better" if delta["low"] > 0 else ("worse" if delta["high"] < 0 else "within noise")
            entry.vs_first = {"rouge_l_delta": delta, "verdict": verdict}
            continue
        found = stats.paired_comparison([r["gold"] for r in reference], [r["predicted"] for r in reference],
                                        [r["predicted"] for r in other], first.labels)
        entry.vs_first = {"macro_f1_delta": found["intervals"]["macro_f1"]["delta"],
                          "accuracy_delta": found["intervals"]["accuracy"]["delta"], **found["paired"]}


def _aligned(entry: Entry) -> list[dict]:
    """Rows sorted by their key, so two runs of the same rows line up whatever order each measured them in."""
    return sorted(entry.rows, key=lambda row: row_key(entry, row))


def summary(entries: list[Entry]) -> dict:
    """Everything the table shows, JSON-serialisable (compare.json)."""
    first = entries[0]
    return {"kind": first.kind, "reference": f"{first.run} ({first.name})", "labels": first.labels,
            "rows": [{"run": e.run, "path": str(e.path), "task": e.task, "method": e.method, "name": e.name,
                      **e.setup, **e.cost, "steps": e.cost["steps"] if e.cost["steps"] is not None else e.setup["max_steps"],
                      "rows": len(e.rows), "fingerprint": e.fingerprint, "scores": e.scores,
                      "metrics": _shown_metrics(e), "per_class": _per_class(e), "comparable": e.comparable,
                      "note": e.note, "vs_first": e.vs_first} for e in entries]}


def _shown_metrics(entry: Entry) -> dict:
    names = ("rouge_l", "exact_match", "bleu", "perplexity") if entry.kind == GENERATION else ("accuracy", "macro_f1", "invalid")
    return {name: entry.metrics.get(name) for name in names}


def _per_class(entry: Entry) -> dict:
    """Per-class F1 (generation: ROUGE-L per kind of instruction), for the side-by-side table."""
    if entry.kind == GENERATION:
        return {kind: one.get("rouge_l") for kind, one in entry.metrics.get("per_kind", {}).items()}
    return {label: one["f1"] for label, one in entry.metrics.get("per_class", {}).items()}
