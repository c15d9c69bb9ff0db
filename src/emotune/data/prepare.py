"""The prepared-data folder `data/` of a run, written by the data stage of `emotune data` and `emotune run` alike.

The folder holds the final splits (Parquet), `data_report.json` (what was read, what cleaning removed,
label counts, token lengths, class weights) and `label_distribution.png`. A fingerprint of the data
config, the seed and the source files decides whether a later run may reuse it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from emotune.core import terminal
from emotune.core.config.run import RunConfig
from emotune.core.figures import figure_fonts, short_label, short_labels
from emotune.core.rundir import RunDir, atomic_dir, json_text, read_json
from emotune.data.clean import token_lengths
from emotune.data.load import LabeledData, in_memory_dataset, load_data
from emotune.data.read import is_data_file
from emotune.data.sources import HUB_PREFIXES, SPLITS, embedded_dataset_dir, packaged_name
from emotune.model.loading import load_tokenizer_only

TOKEN_SAMPLE_ROWS = 20_000  # per split: percentiles of a seeded sample are stable and fast on any size


def prepare_data(cfg: RunConfig) -> LabeledData:
    """The prepared data of this run folder when its fingerprint matches, else freshly loaded (and validated) data."""
    fingerprint = data_fingerprint(cfg)
    reused = load_prepared(RunDir(cfg.run_dir), fingerprint)
    if reused is not None:
        print(f"Reusing the prepared data in {RunDir(cfg.run_dir).data} (same data config and source files)", flush=True)
        return reused
    tokenizer = load_tokenizer_only(cfg.model) if cfg.data.cleaning.long_rows != "keep" else None
    data = load_data(cfg.data, cfg.seed, tokenizer)
    data.report["fingerprint"] = fingerprint
    return data


# --------------------------------------------------------------------------------------------------
# Fingerprint, save, reuse


def data_fingerprint(cfg: RunConfig) -> str:
    parts = {"data": cfg.data.model_dump(mode="json"), "seed": cfg.seed, "files": _source_stamp(cfg.data.source)}
    if cfg.data.cleaning.long_rows != "keep":
        parts["tokenizer"] = cfg.model.source  # token limits depend on the tokenizer
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _source_stamp(source: str) -> list:
    """Path, size and modification time of every data file, so an edited file is never reused stale."""
    if source.startswith(HUB_PREFIXES):
        return [source]  # the snapshot is downloaded once per revision and never changes
    packaged = packaged_name(source)
    path = embedded_dataset_dir(packaged) if packaged else Path(source).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files
            if is_data_file(f) or f.suffix in (".arrow", ".json")]


def saved_fingerprint(run: RunDir) -> str | None:
    return (read_json(run.data_report) or {}).get("fingerprint")


def save_prepared(data: LabeledData, run: RunDir, tokenizer, cfg: RunConfig) -> Path:
    """Write the run folder's data/ (splits, data_report.json with token lengths, label plot) in one swap."""
    report = {**data.report, "token_lengths": token_length_stats(data, tokenizer, cfg), "class_weights": data.class_weights,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    data.report = report
    with atomic_dir(run.data) as partial:
        for split, ds in data.splits.items():
            pq.write_table(ds.with_format("arrow")[:], partial / f"{split}.parquet")
        (partial / run.data_report.name).write_text(json_text(report), encoding="utf-8")
        plot_label_distribution(data, partial / "label_distribution.png")
    return run.data


def load_prepared(run: RunDir, fingerprint: str) -> LabeledData | None:
    if saved_fingerprint(run) != fingerprint:
        return None
    try:
        report = json.loads(run.data_report.read_text(encoding="utf-8"))
        splits = {split: in_memory_dataset(pq.read_table(run.data / f"{split}.parquet")) for split in SPLITS}
    except Exception:  # a damaged folder is prepared again, never trusted
        return None
    return LabeledData(splits=splits, labels=report["labels"], source=report["source"], report=report,
                       class_weights=report.get("class_weights"))


# --------------------------------------------------------------------------------------------------
# Token statistics and summary


def token_length_stats(data: LabeledData, tokenizer, cfg: RunConfig) -> dict:
    """Token-length percentiles of each split's texts with the model's tokenizer (seeded sample on big splits)."""
    stats = {"tokenizer": cfg.model.source}  # the same whichever command loaded it, from GGUF or the converted folder
    rng = np.random.default_rng(cfg.seed)
    for split, ds in data.splits.items():
        rows = len(ds)
        index = np.sort(rng.choice(rows, TOKEN_SAMPLE_ROWS, replace=False)) if rows > TOKEN_SAMPLE_ROWS else None
        texts = ds.select(index)["text"] if index is not None else ds["text"]
        lengths = token_lengths(list(texts), tokenizer)
        if not len(lengths):
            continue
        # percentiles interpolate between lengths: one decimal, or the JSON shows float noise (16.700000000000003)
        p50, p90, p95, p99 = (round(float(p), 1) for p in np.percentile(lengths, [50, 90, 95, 99]))
        stats[split] = {"rows_measured": int(len(lengths)), "mean": round(float(lengths.mean()), 1), "p50": p50,
                        "p90": p90, "p95": p95, "p99": p99, "max": int(lengths.max()),
                        f"over_{cfg.data.cleaning.max_tokens}": int((lengths > cfg.data.cleaning.max_tokens).sum())}
    return stats


def format_summary(data: LabeledData) -> str:
    report, counts = data.report, data.counts()
    lines = [f"Data {data.source}: {len(data.labels)} labels from {report.get('labels_from', '?')}; split {report.get('split', '?')}",
             f"  rows read: {', '.join(f'{k} {v}' for k, v in report.get('rows_read', {}).items())}"]
    width = max([terminal.width(label) for label in data.labels] + [8])
    lines.append("  " + "split".ljust(11) + "rows".rjust(8) + "".join(terminal.rjust(label, width + 2) for label in data.labels))
    for split, per_label in counts.items():
        lines.append("  " + split.ljust(11) + str(sum(per_label.values())).rjust(8)
                     + "".join(str(per_label[label]).rjust(width + 2) for label in data.labels))
    lines.append(format_cleaning(report))
    tokens = report.get("token_lengths")
    if tokens:
        lines.append(f"  token lengths of the texts ({tokens['tokenizer']}):")
        for split in SPLITS:
            if split in tokens:
                t = tokens[split]
                lines.append(f"    {split:<10} p50 {t['p50']:g}  p90 {t['p90']:g}  p95 {t['p95']:g}  p99 {t['p99']:g}  "
                             f"max {t['max']}  ({t['rows_measured']} rows)")
    lines.extend(format_imbalance(report.get("imbalance") or {}))
    if data.class_weights:
        lines.append("  class weights for the loss: " + ", ".join(f"{k} {v:.3f}" for k, v in data.class_weights.items()))
    if "balance" in report and report["balance"].get("method") == "oversample":
        lines.append(f"  oversampling added {report['balance']['rows_added']} training rows")
    return "\n".join(lines)


def format_imbalance(imbalance: dict) -> list[str]:
    """A warning with the counts and the key to set when the training classes are far from balanced."""
    if not imbalance.get("flagged"):
        return []
    big, small = imbalance["largest"], imbalance["smallest"]
    line = (f"  imbalanced: the largest training class ({big['label']}, {big['rows']} rows) has {imbalance['ratio']:g}x "
            f"the rows of the smallest ({small['label']}, {small['rows']} rows)")
    if imbalance.get("balance", "none") == "none":
        return [line + "; small classes may never be predicted. Set data.balance=class_weight to weight the loss "
                "by inverse class frequency (or data.balance=oversample to repeat their rows)."]
    return [line + f"; data.balance={imbalance['balance']} compensates."]


def format_cleaning(report: dict) -> str:
    cleaning = report.get("cleaning", {})
    parts = []
    for step, per_split in cleaning.get("changed", {}).items():
        if sum(per_split.values()):
            parts.append(f"{step} changed {sum(per_split.values())}")
    for step, per_split in cleaning.get("dropped", {}).items():
        if sum(per_split.values()):
            parts.append(f"{step} removed {sum(per_split.values())} ({', '.join(f'{s} {n}' for s, n in per_split.items() if n)})")
    truncated = sum(cleaning.get("truncated", {}).values())
    if truncated:
        parts.append(f"truncated {truncated}")
    return "  cleaning: " + ("; ".join(parts) if parts else "nothing to change")


def plot_label_distribution(data: LabeledData, path: Path) -> None:
    from matplotlib.figure import Figure

    counts = data.counts()
    with figure_fonts():  # Chinese labels draw from a CJK font, Latin text from matplotlib's default
        fig = Figure(figsize=(max(6.0, 1.2 * len(data.labels)), 4.0))
        ax = fig.subplots()
        width = 0.8 / len(counts)
        x = np.arange(len(data.labels))
        for i, (split, per_label) in enumerate(counts.items()):
            ax.bar(x + i * width, [per_label[label] for label in data.labels], width, label=split)
        ax.set_xticks(x + width * (len(counts) - 1) / 2, short_labels(data.labels))
        ax.set_ylabel("rows")
        ax.set_title(f"Label distribution: {short_label(data.source, 60)}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
