"""load → validate → clean → split → limit → balance, all before anything is written.

Problems are collected and raised once, as one UserError that names the file, row or column and the
fix. Every cleaning step's effect is counted in `LabeledData.report`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset

from emotune.core.config.data import CleaningConfig, DataConfig
from emotune.core.errors import UserError, raise_problems
from emotune.core.replies import INVALID
from emotune.data import clean
from emotune.data import splits as split_ops
from emotune.data.labels import (
    choose_label_names,
    coerce_columns,
    example_rows,
    is_unlabelled,
    label_key,
    map_labels,
)
from emotune.data.sources import SPLITS, packaged_labels, read_source


@dataclass
class LabeledData:
    splits: dict[str, Dataset]  # train / validation / test, string columns `text` and `label`
    labels: list[str]
    source: str
    report: dict = field(default_factory=dict)  # what was read, what cleaning changed, how it was split
    class_weights: dict[str, float] | None = None  # set by data.balance=class_weight, for the trainer's loss

    def counts(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, ds in self.splits.items():
            column = ds.with_format("arrow")[:]["label"]  # counted by Arrow: rows never become Python objects
            found = {entry["values"]: entry["counts"] for entry in pc.value_counts(column).to_pylist()}
            out[name] = {label: found.get(label, 0) for label in self.labels}
        return out


# a training split whose largest class has more than this many times the rows of its smallest is called imbalanced
IMBALANCE_RATIO = 3.0


def load_data(cfg: DataConfig, seed: int, tokenizer=None) -> LabeledData:
    """Read, validate, clean and split the data; `tokenizer` is needed only for data.cleaning.long_rows."""
    if cfg.cleaning.long_rows != "keep" and tokenizer is None:
        raise UserError("data.cleaning.long_rows needs the model's tokenizer to count tokens; prepare the data with "
                        "`emotune data` or `emotune run`, or set data.cleaning.long_rows=keep.")
    tables, labels, report = _read_and_map(cfg)
    tables, report["cleaning"] = clean_splits(tables, cfg.cleaning, tokenizer)
    given = [s for s in tables if s != "all"]
    # leakage is checked after splitting: a single file only has train and evaluation rows once split
    tables, report["split"] = _split(tables, cfg, seed)
    tables, report["cleaning"]["dropped"]["leakage"] = remove_leakage(tables, cfg.cleaning.leakage)
    _raise(check_splits(tables, labels, given, _removed_by_step(report["cleaning"]["dropped"])))

    limits = {"train": cfg.train_limit, "validation": cfg.validation_limit, "test": cfg.test_limit}
    tables = {name: split_ops.limit(tables[name], limits[name], seed) for name in SPLITS}
    report["imbalance"] = imbalance(split_ops.label_counts(tables["train"], labels), cfg.balance)
    tables["train"], weights, report["balance"] = _balance(tables["train"], labels, cfg.balance, seed)
    data = LabeledData(splits={name: in_memory_dataset(tables[name]) for name in SPLITS}, labels=labels,
                       source=cfg.source, report=report, class_weights=weights)
    report["rows"] = {name: len(ds) for name, ds in data.splits.items()}
    report["label_counts"] = data.counts()
    return data


def _read_and_map(cfg: DataConfig) -> tuple[dict[str, pa.Table], list[str], dict]:
    """Every split as `text`/`label` string columns with known label names, or one UserError."""
    raw = read_source(cfg)
    problems: list[str] = []
    tables = {split: coerce_columns(r, problems) for split, r in raw.items()}
    _raise(problems)
    for split in [s for s in ("validation", "test") if "train" in tables and is_unlabelled(tables.get(s))]:
        raw["train"].notes.append(f"the {split} split {raw[split].origin} has no labels (every row is -1, how Hugging "
                                  f"Face datasets publish a split without them, as GLUE's test splits); it is left "
                                  f"out, and {split} rows are held out of train instead.")
        del tables[split], raw[split]
    default = packaged_labels(cfg.source)
    labels, labels_from = choose_label_names(cfg, tables, raw, default, problems)
    problems += _alias_problems(cfg, labels)
    _raise(problems)
    tables = {split: map_labels(t, labels, cfg, raw[split].origin, problems) for split, t in tables.items()}
    problems += [f"{raw[split].origin} has no rows (a header only); give it rows" if split == "all" else
                 f"the {split} split ({raw[split].origin}) has no rows; give it rows or remove the file"
                 for split, t in tables.items() if t is not None and len(t) == 0]
    _raise(problems)
    _raise(_labels_missing_from_train(tables, raw))
    notes = [note for r in raw.values() for note in r.notes]
    for note in notes:
        print(f"Note: {note}", flush=True)
    report = {"source": cfg.source, "labels": labels, "labels_from": labels_from,
              "files": {split: r.origin.replace("`", "") for split, r in raw.items()},
              "rows_read": {split: len(t) for split, t in tables.items()}, "notes": notes}
    return tables, labels, report


def _labels_missing_from_train(tables: dict[str, pa.Table], raw: dict) -> list[str]:
    """Labels of a given validation/test file that train never shows, with the rows that hold them."""
    if "train" not in tables:
        return []
    in_train = set(pc.unique(tables["train"].column("label")).to_pylist())
    problems = []
    for split in ("validation", "test"):
        if split not in tables:
            continue
        extra = sorted(set(pc.unique(tables[split].column("label")).to_pylist()) - in_train)
        if extra:
            problems.append(f"labels {extra} have no training rows but occur in the {split} split {raw[split].origin} "
                            f"({example_rows(tables[split], extra)}); add training rows for them, fix those rows, or map "
                            "them to a label train has with data.label_aliases")
    return problems


def _split(tables: dict[str, pa.Table], cfg: DataConfig, seed: int) -> tuple[dict[str, pa.Table], str]:
    if "all" in tables:
        return split_ops.stratified_split(tables["all"], cfg.validation_size, cfg.test_size, seed), f"stratified {_sizes(cfg)}, seed {seed}"
    carved = [s for s in SPLITS if s not in tables]
    how = "as given" + (f"; {' and '.join(carved)} held out of train (stratified, seed {seed})" if carved else "")
    return split_ops.carve_missing(tables, cfg.validation_size, cfg.test_size, seed), how


def _balance(train: pa.Table, labels: list[str], how: str, seed: int) -> tuple[pa.Table, dict[str, float] | None, dict]:
    if how == "oversample":
        train, added = split_ops.oversample(train, seed)
        return train, None, {"method": "oversample", "rows_added": added}
    if how == "class_weight":
        weights = split_ops.class_weights(train, labels)
        return train, weights, {"method": "class_weight", "class_weights": weights}
    return train, None, {"method": "none"}


def imbalance(counts: dict[str, int], balance: str) -> dict:
    """The training split's largest and smallest class and their ratio, measured before any balancing;
    `flagged` when the ratio exceeds IMBALANCE_RATIO (a 3:1 split already lets a model ignore the small class)."""
    present = {label: n for label, n in counts.items() if n}
    if not present:
        return {"flagged": False}
    largest, smallest = max(present, key=present.get), min(present, key=present.get)
    ratio = present[largest] / present[smallest]
    return {"largest": {"label": largest, "rows": present[largest]},
            "smallest": {"label": smallest, "rows": present[smallest]},
            "ratio": round(ratio, 2), "flagged": ratio > IMBALANCE_RATIO, "balance": balance}


def in_memory_dataset(table: pa.Table) -> Dataset:
    # a given fingerprint spares `datasets` from hashing (pickling) the whole table to make one
    return Dataset(table, fingerprint=uuid.uuid4().hex)


def _sizes(cfg: DataConfig) -> str:
    """80/10/10 for shares; `500 validation and 500 test rows` where a size is a count of rows."""
    sizes = cfg.validation_size, cfg.test_size
    if all(isinstance(size, float) for size in sizes):
        return "/".join(f"{round(100 * f):g}" for f in (1 - sum(sizes), *sizes))
    if all(isinstance(size, int) for size in sizes):
        return f"{sizes[0]} validation and {sizes[1]} test rows"
    shown = [f"{size} rows" if isinstance(size, int) else f"{round(100 * size):g} %" for size in sizes]
    return f"{shown[0]} for validation and {shown[1]} for test"


def _raise(problems: list[str]) -> None:
    raise_problems("The data", problems)


def _alias_problems(cfg: DataConfig, labels: list[str]) -> list[str]:
    known = {label_key(name) for name in labels}
    return [f"data.label_aliases maps {alias!r} to {target!r}, which is not one of the labels {labels}"
            for alias, target in cfg.label_aliases.items() if labels and label_key(target) not in known]


# --------------------------------------------------------------------------------------------------
# Cleaning across splits


def clean_splits(tables: dict[str, pa.Table], cfg: CleaningConfig, tokenizer=None) -> tuple[dict[str, pa.Table], dict]:
    """Text steps, then short rows, long rows and duplicates inside each split; each counted per split."""
    report: dict = {"changed": {}, "dropped": {"too_short": {}, "too_long": {}, "duplicates": {}}, "truncated": {},
                    "conflicting_labels": {}}
    out = {}
    for split, table in tables.items():
        text, changed = clean.clean_text(table.column("text"), cfg)
        for step, count in changed.items():
            report["changed"].setdefault(step, {})[split] = count
        table = table.set_column(0, "text", text)
        if cfg.min_chars > 0:
            table, report["dropped"]["too_short"][split] = _drop(table, clean.too_short(table.column("text"), cfg.min_chars))
        if cfg.long_rows != "keep":
            table, dropped, truncated = _long_rows(table, cfg, tokenizer)
            report["dropped"]["too_long"][split], report["truncated"][split] = dropped, truncated
        if cfg.duplicates != "keep":
            keys = clean.key_hashes(table.column("text"), cfg.duplicates)
            report["conflicting_labels"][split] = clean.conflicting_labels(keys, clean.codes(table.column("label")))
            firsts = clean.first_occurrences(keys)
            report["dropped"]["duplicates"][split] = len(table) - len(firsts)
            table = table.take(firsts)
        out[split] = table
    return out, report


def _drop(table: pa.Table, mask: pa.ChunkedArray | np.ndarray) -> tuple[pa.Table, int]:
    kept = table.filter(pc.invert(mask if isinstance(mask, pa.ChunkedArray) else pa.array(mask, pa.bool_())))
    return kept, len(table) - len(kept)


def _long_rows(table: pa.Table, cfg: CleaningConfig, tokenizer) -> tuple[pa.Table, int, int]:
    texts = table.column("text").to_pylist()
    too_long = clean.token_lengths(texts, tokenizer) > cfg.max_tokens
    if cfg.long_rows == "drop":
        kept, dropped = _drop(table, too_long)
        return kept, dropped, 0
    index = np.flatnonzero(too_long)
    if len(index) == 0:
        return table, 0, 0
    cut = clean.truncate_to_tokens([texts[i] for i in index], tokenizer, cfg.max_tokens)
    for i, text in zip(index, cut, strict=False):
        texts[i] = text
    return table.set_column(0, "text", pa.array(texts, pa.string())), 0, len(index)


def remove_leakage(tables: dict[str, pa.Table], how: str) -> tuple[dict[str, pa.Table], dict[str, int]]:
    """Drop validation/test rows whose text occurs in train: the model would be measured on rows it saw."""
    if how == "keep":
        return tables, {}
    train_keys = clean.key_hashes(tables["train"].column("text"), how)
    out, removed = dict(tables), {}
    for split in ("validation", "test"):
        keys = clean.key_hashes(tables[split].column("text"), how)
        out[split], removed[split] = _drop(tables[split], clean.occurs_in(keys, train_keys))
    return out, removed


# --------------------------------------------------------------------------------------------------
# Validation of the final splits, before limits


def _removed_by_step(dropped: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for step, per_split in dropped.items():
        for split, count in per_split.items():
            if count:
                out.setdefault(split, {})[step] = count
    return out


def _not_the_word(label: str) -> str:
    """`label`, or for INVALID a spelling that is the same label (labels match ignoring case) but not the word."""
    return label.lower() if label == INVALID else label


def check_splits(tables: dict[str, pa.Table], labels: list[str], given: list[str],
                 removed: dict[str, dict[str, int]]) -> list[str]:
    problems = []
    if len(labels) < 2:
        problems.append(f"a classifier needs at least two labels, found {labels}")
    if INVALID in labels:
        problems.append(f"a label is named {INVALID!r}, the word emotune writes for a reply that names no label, so such "
                        "replies would score as right answers of it and its row of the confusion matrix would be lost; "
                        f"spell it another way with data.label_names (e.g. {[_not_the_word(x) for x in labels]})")
    present = {name: set(pc.unique(t.column("label")).to_pylist()) for name, t in tables.items()}
    for name in SPLITS:
        if len(tables[name]) == 0:
            steps = ", ".join(f"{step} {count}" for step, count in removed.get(name, {}).items()) or "none"
            problems.append(f"the {name} split is empty after cleaning (rows removed: {steps}); give it other rows, or "
                            "switch off the step that removed them (data.cleaning.leakage=keep, data.cleaning.duplicates=keep, ...)")
    if len(tables["train"]):
        missing = [label for label in labels if label not in present["train"]]
        if missing:
            problems.append(f"labels {missing} have no training rows; add rows or drop them from data.label_names")
    for name in ("validation", "test"):
        absent = [label for label in labels if label in present["train"] and label not in present[name]]
        if name in given and len(tables[name]) and absent:
            problems.append(f"the label set differs between splits: the {name} split has no rows of {absent}, which "
                            "train has; add such rows to it, or give one file and let emotune split it (stratified)")
    return problems
