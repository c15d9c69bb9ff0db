"""Data loading, label mapping, splitting, validation errors, and the embedded dataset's promises."""

from __future__ import annotations

import json
import math
import re

import pytest

from conftest import LABELS, make_rows, write_jsonl
from emotune.core.config.data import DataConfig, PromptConfig
from emotune.core.errors import UserError
from emotune.data import EMBEDDED_LABELS, embedded_dataset_dir, load_data, prompt_messages, to_prompt_completion


def test_embedded_dataset_is_large_clean_and_leak_free():
    folder = embedded_dataset_dir()
    splits = {}
    for name in ("train", "validation", "test"):
        rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        assert all(set(r) == {"text", "label"} and r["label"] in EMBEDDED_LABELS for r in rows)
        splits[name] = rows
    norm = lambda t: re.sub(r"\s+", " ", t.lower()).strip()  # noqa: E731
    texts = [norm(r["text"]) for rows in splits.values() for r in rows]
    assert len(texts) >= 1200
    assert len(set(texts)) == len(texts), "duplicates within or across splits"
    for rows in splits.values():
        assert {r["label"] for r in rows} == set(EMBEDDED_LABELS)
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[0] <= 5 and lengths[-1] >= 40  # varied length
    assert (folder / "DATASHEET.md").is_file()


def test_embedded_source_loads_with_reference_label_order():
    data = load_data(DataConfig(), seed=0)
    assert data.labels == ["sadness", "joy", "love", "anger", "fear", "surprise"]
    assert {name: len(ds) for name, ds in data.splits.items()} == {"train": 1079, "validation": 181, "test": 240}


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".json", ".parquet"])
def test_each_file_format_with_custom_columns(tmp_path, suffix):
    import pandas as pd

    rows = make_rows(10, seed=5)
    frame = pd.DataFrame({"sentence": [r["text"] for r in rows], "emotion": [r["label"] for r in rows]})
    path = tmp_path / f"all{suffix}"
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    elif suffix == ".json":
        path.write_text(json.dumps(frame.to_dict(orient="records")))
    else:
        frame.to_parquet(path)
    data = load_data(DataConfig(source=str(path), text_column="sentence", label_column="emotion"), seed=0)
    assert sorted(data.labels) == sorted(LABELS)
    sizes = {name: len(ds) for name, ds in data.splits.items()}
    assert sizes == {"train": 48, "validation": 6, "test": 6}  # stratified 80/10/10 of 60 rows
    assert set(data.splits["test"]["label"]) == set(LABELS)  # one row of each label per held-out split


def test_integer_labels_with_names_and_limits(tmp_path):
    for seed, name in enumerate(("train", "validation", "test")):
        rows = [{"text": r["text"], "label": LABELS.index(r["label"])} for r in make_rows(8, seed=seed)]
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
    cfg = DataConfig(source=str(tmp_path), label_names=LABELS, train_limit=12, test_limit=6)
    data = load_data(cfg, seed=0)
    assert data.labels == LABELS
    assert len(data.splits["train"]) == 12 and len(data.splits["test"]) == 6
    assert set(data.splits["train"]["label"]) == set(LABELS)  # the limit is a stratified sample
    again = load_data(cfg, seed=0)
    assert again.splits["train"]["text"] == data.splits["train"]["text"]  # reproducible


def test_integer_labels_without_names_is_a_clear_error(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}", "label": i % 7} for i in range(30)])
    with pytest.raises(UserError, match="data.label_names"):
        load_data(DataConfig(source=str(tmp_path / "d.jsonl"), label_names=["a", "b"]), seed=0)


def test_missing_column_lists_what_was_found(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"sentence": "x", "label": "joy"}] * 10)
    with pytest.raises(UserError, match=r"no column 'text'.*columns found: sentence, label.*data.text_column"):
        load_data(DataConfig(source=str(tmp_path / "d.jsonl")), seed=0)


def test_missing_source_and_unsupported_type(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_data(DataConfig(source=str(tmp_path / "nope.csv")), seed=0)
    (tmp_path / "d.docx").write_text("x")
    with pytest.raises(UserError, match="unsupported file type"):
        load_data(DataConfig(source=str(tmp_path / "d.docx")), seed=0)
    (tmp_path / "d.xlsx").write_text("x")  # was "unsupported file type", a list of endings that did not say to export
    with pytest.raises(UserError, match=r"d.xlsx` is a spreadsheet workbook.*Save the sheet as CSV"):
        load_data(DataConfig(source=str(tmp_path / "d.xlsx")), seed=0)


def test_ndjson_is_json_lines(tmp_path):
    """`.ndjson`, JSON Lines' other name (BigQuery and many loggers write it), was an unsupported file type."""
    write_jsonl(tmp_path / "d.ndjson", make_rows(4, 1))
    assert sum(len(ds) for ds in load_data(DataConfig(source=str(tmp_path / "d.ndjson")), seed=0).splits.values()) == 24


def test_label_without_training_rows(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [r for r in make_rows(4, 1) if r["label"] != "fear"])
    write_jsonl(tmp_path / "validation.jsonl", make_rows(1, 2))
    write_jsonl(tmp_path / "test.jsonl", make_rows(1, 3))
    with pytest.raises(UserError, match=r"\['fear'\] have no training rows"):
        load_data(DataConfig(source=str(tmp_path), label_names=LABELS), seed=0)


def test_prompt_completion_rows_match_the_reference_recipe():
    prompt = PromptConfig()
    messages = prompt_messages("i miss her", prompt, LABELS)
    assert messages[0]["role"] == "system" and "sadness, joy, love, anger, fear, surprise" in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Classify the emotion of this text:\n\ni miss her"}
    data = load_data(DataConfig(), seed=0)
    rows = to_prompt_completion(data.splits["test"].select(range(3)), prompt, data.labels)
    assert rows.column_names == ["prompt", "completion"]
    assert rows[0]["completion"] == [{"role": "assistant", "content": data.splits["test"][0]["label"]}]


def test_imbalanced_training_classes_are_called_out_with_the_key_to_set(tmp_path):
    from emotune.data.prepare import format_summary

    counts = dict(zip(LABELS, [40, 12, 12, 12, 12, 10], strict=False))
    rows = [{"text": f"{label} sample number {i} with some words", "label": label}
            for label, n in counts.items() for i in range(n)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", [{"text": f"held out {label} {i}", "label": label}
                                          for label in LABELS for i in range(2)])
    data = load_data(DataConfig(source=str(tmp_path), validation_size=0.1), seed=0)
    imbalance = data.report["imbalance"]
    train = data.counts()["train"]
    assert imbalance["largest"] == {"label": LABELS[0], "rows": train[LABELS[0]]}
    assert imbalance["smallest"]["rows"] == min(train.values())
    assert imbalance["ratio"] == round(max(train.values()) / min(train.values()), 2) and imbalance["flagged"]
    assert "data.balance=class_weight" in format_summary(data)

    weighted = load_data(DataConfig(source=str(tmp_path), validation_size=0.1, balance="class_weight"), seed=0)
    assert "compensates" in format_summary(weighted) and "data.balance=class_weight to" not in format_summary(weighted)

    even = [{"text": f"{label} even {i}", "label": label} for label in LABELS for i in range(10)]
    write_jsonl(tmp_path / "train.jsonl", even)
    balanced = load_data(DataConfig(source=str(tmp_path), validation_size=0.1), seed=0)
    assert not balanced.report["imbalance"]["flagged"] and "imbalanced:" not in format_summary(balanced)


@pytest.mark.parametrize(("validation_size", "test_size", "expected"), [
    (7, 11, {"validation": 7, "test": 11}),
    (7, 0.25, {"validation": 7, "test": 30}),  # a count beside a share: the share is of all 120 rows, rounded up
    (0.1, 0.1, {"validation": 12, "test": 12}),  # shares as before
])
def test_hold_out_sizes_are_shares_or_counts_of_rows(tmp_path, validation_size, test_size, expected):
    """validation_size/test_size as scikit-learn's and datasets' train_test_split read them (and LLaMA-Factory's
    val_size, Axolotl's val_set_size): an integer is a count of rows. A count was refused as out of (0, 0.5)."""
    write_jsonl(tmp_path / "d.jsonl", make_rows(20, seed=1))  # 120 rows
    data = load_data(DataConfig(source=str(tmp_path / "d.jsonl"), validation_size=validation_size, test_size=test_size),
                     seed=0)
    sizes = {name: len(split) for name, split in data.splits.items()}
    assert sizes == {"train": 120 - sum(expected.values()), **expected}
    assert data.report["split"] == {(7, 11): "stratified 7 validation and 11 test rows, seed 0",
                                    (7, 0.25): "stratified 7 rows for validation and 25 % for test, seed 0",
                                    (0.1, 0.1): "stratified 80/10/10, seed 0"}[(validation_size, test_size)]
    assert {r["text"] for r in data.splits["train"]}.isdisjoint({r["text"] for r in data.splits["test"]})
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", make_rows(20, seed=1))  # one split file: both carved from train
    carved = load_data(DataConfig(source=str(tmp_path / "folder"), validation_size=validation_size, test_size=test_size),
                       seed=0)
    test_rows = expected["test"]
    assert len(carved.splits["test"]) == test_rows
    assert len(carved.splits["validation"]) == (validation_size if isinstance(validation_size, int)
                                                else math.ceil(validation_size * (120 - test_rows)))
    with pytest.raises(UserError, match=r"has 120 row\(s\) .* data.validation_size=100 and data.test_size=20: that needs "
                                        r"at least 121 rows"):
        load_data(DataConfig(source=str(tmp_path / "d.jsonl"), validation_size=100, test_size=20), seed=0)


@pytest.mark.parametrize("value", [0, 0.5, 100.0, True, -3])
def test_a_hold_out_size_that_is_neither_a_share_nor_a_count_is_refused(value):
    with pytest.raises(ValueError, match=r"must be a number in \(0, 0.5\), e.g. 0.1, or a whole number of rows >= 1 "
                                         r"\(an integer, e.g. 500\)"):
        DataConfig(validation_size=value)
