"""Splits: stratified and seeded hold-outs, per-split limits, and class balancing of the training split.

Everything here works on row indices and the label column, then takes rows with one Arrow `take`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from sklearn.model_selection import train_test_split

from emotune.core.errors import UserError
from emotune.data.clean import codes


def stratified_split(table: pa.Table, validation_size: float | int, test_size: float | int, seed: int) -> dict[str, pa.Table]:
    """train / validation / test from one collection, each label in proportion (default 80/10/10)."""
    needed = _rows_to_split(validation_size, test_size)
    if len(table) < needed:
        raise UserError(f"The data has {len(table)} row(s) left after cleaning, too few to split into train, validation "
                        f"and test with data.validation_size={validation_size:g} and data.test_size={test_size:g}: that "
                        f"needs at least {needed} rows (one or more in each split). Give more rows, give separate "
                        "train/validation/test files, or change data.validation_size and data.test_size.")
    labels = codes(table.column("label"))
    index = np.arange(len(table))
    held, of_held = _cuts(validation_size, test_size, len(table))
    train_idx, rest_idx = _split(index, labels, held, seed)
    val_idx, test_idx = _split(rest_idx, labels[rest_idx], of_held, seed)
    return {"train": table.take(train_idx), "validation": table.take(val_idx), "test": table.take(test_idx)}


def carve_missing(splits: dict[str, pa.Table], validation_size: float | int, test_size: float | int, seed: int) -> dict[str, pa.Table]:
    """Hold a missing validation or test split out of train (stratified); given splits stay as given."""
    out = dict(splits)
    for name, size in (("test", test_size), ("validation", validation_size)):
        if name in out:
            continue
        train = out["train"]
        if _held_rows(size, len(train)) >= len(train):
            raise UserError(f"The train split has {len(train)} row(s) left after cleaning, too few to hold data.{name}_size="
                            f"{size:g} of them out as the {name} split and keep the rest for training. Give more training "
                            f"rows, or give a {name} file.")
        labels = codes(train.column("label"))
        keep, held = _split(np.arange(len(train)), labels, size, seed)
        out[name], out["train"] = train.take(np.sort(held)), train.take(np.sort(keep))
    return out


def limit(table: pa.Table, rows: int | None, seed: int) -> pa.Table:
    """At most `rows` rows: a stratified, seeded sample, kept in the original order."""
    if rows is None or rows >= len(table):
        return table
    labels = codes(table.column("label"))
    keep, _ = _split(np.arange(len(table)), labels, len(table) - rows, seed)
    return table.take(np.sort(keep))


def _held_rows(held: float | int, rows: int) -> int:
    return held if isinstance(held, int) else int(np.ceil(held * rows))


def _cuts(validation_size: float | int, test_size: float | int, rows: int) -> tuple[float | int, float | int]:
    """What `stratified_split` holds out of all rows, then what of those goes to test: shares when both sizes are
    shares (scikit-learn rounds each cut up), row counts when either is a count."""
    if isinstance(validation_size, float) and isinstance(test_size, float):
        return validation_size + test_size, test_size / (validation_size + test_size)
    test_rows = _held_rows(test_size, rows)
    return _held_rows(validation_size, rows) + test_rows, test_rows


def _rows_to_split(validation_size: float | int, test_size: float | int) -> int:
    """The fewest rows `stratified_split` can cut into three non-empty splits at these sizes."""

    def works(rows: int) -> bool:
        held, of_held = _cuts(validation_size, test_size, rows)
        held_rows = _held_rows(held, rows)
        return 0 < held_rows < rows and 0 < _held_rows(of_held, held_rows) < held_rows

    # both conditions only get easier with more rows, so bisect: tiny sizes need millions of rows
    low, high = 2, 3
    while not works(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if works(middle) else (middle, high)
    return high


def _split(index: np.ndarray, labels: np.ndarray, held: float | int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    _, counts = np.unique(labels, return_counts=True)
    held_rows = _held_rows(held, len(index))
    if not 0 < held_rows < len(index):  # the callers check their sizes first; this guards the arithmetic
        raise UserError(f"{len(index)} rows are too few to hold out {held if isinstance(held, int) else f'{held:.0%}'} of "
                        "them and keep the rest; give more rows, or give train, validation and test files.")
    # stratifying needs two rows of every label and room for every label on both sides
    can_stratify = counts.min() >= 2 and min(held_rows, len(index) - held_rows) >= len(counts)
    return train_test_split(index, test_size=held, random_state=seed, stratify=labels if can_stratify else None)


def oversample(table: pa.Table, seed: int) -> tuple[pa.Table, int]:
    """Repeat rows of every smaller class (seeded draw) up to the largest class; (table, rows added)."""
    labels = codes(table.column("label"))
    names, counts = np.unique(labels, return_counts=True)
    rng = np.random.default_rng(seed)
    extra = [rng.choice(np.flatnonzero(labels == name), counts.max() - count, replace=True)
             for name, count in zip(names, counts, strict=False) if count < counts.max()]
    if not extra:
        return table, 0
    index = np.concatenate([np.arange(len(table)), *extra])
    rng.shuffle(index)  # repeated rows spread through the epoch instead of trailing at the end
    return table.take(index), len(index) - len(table)


def label_counts(table: pa.Table, labels: list[str]) -> dict[str, int]:
    """Rows per label, in label order (0 for a label the table lacks)."""
    values, counts = np.unique(table.column("label").to_numpy(zero_copy_only=False), return_counts=True)
    found = dict(zip(values, counts.tolist(), strict=False))
    return {label: int(found.get(label, 0)) for label in labels}


def class_weights(table: pa.Table, labels: list[str]) -> dict[str, float]:
    """n / (classes x n_class): the usual 'balanced' weights; a class weighs 1.0 when all are equal."""
    count = label_counts(table, labels)
    total = len(table)
    return {label: round(total / (len(labels) * count[label]), 6) for label in labels if count.get(label)}
