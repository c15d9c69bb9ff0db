"""Generated CSV, TSV and JSON Lines files (empty, NaN and quoted fields, unclosed quotes, repeated header
columns and keys, long rows): each reads exactly the rows a reference parser reads (Python's csv module with
the same dialect, or json), or fails with a UserError naming the file. Never another exception, never rows
merged without a word, never a missing label turned into a class.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pyarrow.csv as pa_csv
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import LABELS
from emotune.core.config.data import DataConfig
from emotune.core.errors import UserError
from emotune.data import load_data
from emotune.data.labels import MISSING_SPELLINGS
from emotune.data.sources import RawSplit, read_source

pytestmark = pytest.mark.slow
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
ARROW_NULLS = set(pa_csv.ConvertOptions().null_values)  # what Arrow reads as null in a number column
LONG_TEXT = "word " * 260_000  # 1.3 MB: over Arrow's 1 MB block and the csv module's 128 KiB field limit

PIECES = ["i feel", " so", " happy", "sad,", "a\tb", 'quote"d', '"', "line\nbreak", "crlf\r\nend", "NaN", "", " ",
          "naïve", "开心", ","]
pieces = st.lists(st.sampled_from(PIECES), max_size=4).map("".join)
# mostly distinct texts, so that cleaning (duplicates) leaves enough rows to split and loads do succeed
texts = st.one_of(st.tuples(st.integers(0, 10**6), pieces).map(lambda t: f"row {t[0]}{t[1]}"), pieces)
odd_labels = st.sampled_from(["", "NaN", "nan", " joy ", "null", "N/A", 'jo"y', "a,b", "x\ny"])


class Body(str):
    """A generated file; shown shortened when hypothesis reports a failing case (long rows are 1.3 MB)."""

    def __repr__(self) -> str:
        text = str.__repr__(self)
        return text if len(text) < 2000 else f"{text[:1000]} ... ({len(self)} characters) ... {text[-500:]}"


# --------------------------------------------------------------------------------------------------
# CSV and TSV


def _cell(value: str, how: str, delimiter: str) -> str:
    quoted = '"' + value.replace('"', '""') + '"'
    if how == "quoted":
        return quoted
    if how == "minimal":
        return quoted if any(c in value for c in (delimiter, '"', "\n", "\r")) else value
    return value  # raw: a quote or line break in it may break the row, which is the point


@st.composite
def delimited_files(draw):
    delimiter = draw(st.sampled_from([",", "\t"]))
    header = ["text", "label"]
    for extra in draw(st.lists(st.sampled_from(["id", "note", "id", "note", "text", "label"]), max_size=2)):
        header.insert(draw(st.integers(0, len(header))), extra)
    rows = [[draw(st.sampled_from(LABELS)) if name == "label" else draw(texts) for name in header]
            for _ in range(draw(st.integers(1, 30)))]
    some_row, some_column = st.integers(0, len(rows) - 1), st.integers(0, len(header) - 1)
    if draw(st.integers(0, 3)) == 0:
        rows[draw(some_row)][header.index("label")] = draw(odd_labels)
    if draw(st.integers(0, 4)) == 0:
        rows[draw(some_row)][header.index("text")] = LONG_TEXT
    cells = [[_cell(v, draw(st.sampled_from(["minimal"] * 3 + ["quoted"])), delimiter) for v in row] for row in rows]
    damage = draw(st.sampled_from(["none", "none", "raw cell", "unclosed quote"]))
    if damage == "raw cell":  # written without quoting: its delimiter, quote or line break may break the row
        row, column = draw(some_row), draw(some_column)
        cells[row][column] = rows[row][column]
    elif damage == "unclosed quote":
        row, column = draw(some_row), draw(some_column)
        cells[row][column] = '"' + rows[row][column]
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    lines = [delimiter.join(header)] + [delimiter.join(row) for row in cells]
    body = newline.join(lines) + (newline if draw(st.booleans()) else "")
    return delimiter, Body(body), len(rows)


def _csv_reference(body: str, delimiter: str, quoting: int = csv.QUOTE_MINIMAL) -> tuple[list[str], list[list[str]]] | None:
    """(header, rows) as Python's csv module reads them, or None when the rows disagree with the header."""
    limit = csv.field_size_limit(1 << 30)
    try:
        records = list(csv.reader(io.StringIO(body, newline=""), delimiter=delimiter, quoting=quoting))
    except csv.Error:
        return None
    finally:
        csv.field_size_limit(limit)
    header, rows = records[0], [r for r in records[1:] if r]
    return None if any(len(r) != len(header) for r in rows) else (header, rows)


def _same_label(got, written: str) -> bool:
    if got is None:  # Arrow typed the column as numbers or nulls and read this cell as null
        return written in ARROW_NULLS
    return str(got) == written or (isinstance(got, float) and float(written) == got)


@FUZZ
@given(case=delimited_files())
@example(case=("\t", Body('text\tlabel\n"' + LONG_TEXT + "\tjoy\n"), 1))  # an unclosed quote, read GLUE-style
def test_generated_csv_and_tsv_read_like_pythons_csv_or_fail_clearly(tmp_path, case):
    delimiter, body, intended_rows = case
    path = tmp_path / ("d.tsv" if delimiter == "\t" else "d.csv")
    raw = _read_or_refuse(path, body)
    if raw is None:
        return
    unquoted = any("read with quotes as part of the text" in note for note in raw.notes)  # a GLUE-style TSV, said
    reference = _csv_reference(body, delimiter, csv.QUOTE_NONE if unquoted else csv.QUOTE_MINIMAL)
    assert reference is not None, "read although Python's csv module finds rows of the wrong length"
    header, rows = reference
    assert header.count("text") == 1 and header.count("label") == 1, "a repeated text/label column was read"
    table = raw.table.to_pydict()
    assert table["text"] == [r[header.index("text")] for r in rows]
    assert all(_same_label(got, r[header.index("label")]) for got, r in zip(table["label"], rows, strict=False))
    if len(rows) != intended_rows:  # a quoted field joined lines: allowed only when it is reported
        assert raw.notes, "rows were merged without a word"
    _loads_or_refuses_clearly(path)


# --------------------------------------------------------------------------------------------------
# JSON Lines

json_values = st.one_of(texts, st.none(), st.integers(-3, 9), st.sampled_from([float("nan"), 2.0, 1.5]))


@st.composite
def jsonl_files(draw):
    rows = [{"text": draw(texts), "label": draw(st.sampled_from(LABELS))} for _ in range(draw(st.integers(1, 30)))]
    some_row = st.integers(0, len(rows) - 1)
    if draw(st.integers(0, 3)) == 0:
        rows[draw(some_row)]["label"] = draw(st.one_of(odd_labels, json_values))
    if draw(st.integers(0, 3)) == 0:
        rows[draw(some_row)]["text"] = draw(json_values)
    if draw(st.integers(0, 5)) == 0:
        del rows[draw(some_row)][draw(st.sampled_from(["text", "label"]))]
    if draw(st.integers(0, 4)) == 0:
        rows[draw(some_row)]["text"] = LONG_TEXT
    lines = [json.dumps(row, ensure_ascii=draw(st.booleans())) for row in rows]
    damage, row = draw(st.sampled_from(["none", "none", "none", "repeated key", "cut", "blank line"])), draw(some_row)
    if damage == "repeated key":
        lines[row] = lines[row][:-1] + ', "label": "again"}'
    elif damage == "cut":
        lines[row] = lines[row][: draw(st.integers(0, max(0, len(lines[row]) - 1)))]
    elif damage == "blank line":
        lines[row] += "\n"
    return Body("\n".join(lines) + "\n")


def _json_reference(body: str) -> list[dict] | None:
    rows = []
    for line in body.split("\n"):
        if not line.strip():
            continue
        try:
            value = json.loads(line, object_pairs_hook=_no_repeats)
        except (json.JSONDecodeError, KeyError):
            return None
        if not isinstance(value, dict):
            return None
        rows.append(value)
    return rows


def _no_repeats(pairs):
    if len({k for k, _ in pairs}) != len(pairs):
        raise KeyError("repeated key")
    return dict(pairs)


def _same_text(got, written) -> bool:
    """A text written as a number is that number, or its text where the file mixes texts and numbers (read then
    by Python's json: emotune.data.read._rows_table); a text written as NaN is no text there, never "nan"."""
    number = isinstance(written, (int, float)) and not isinstance(written, bool)
    if number and math.isnan(written) and isinstance(got, str):
        return False
    return (_same(got, written) or (number and isinstance(got, str) and got == str(written))
            or (number and math.isnan(written) and got is None))


def _same(got, written) -> bool:
    if isinstance(written, float) and math.isnan(written):  # a missing value: NaN as read, or null beside texts
        return got is None or (isinstance(got, float) and math.isnan(got))
    return got == written


@FUZZ
@given(body=jsonl_files())
def test_generated_jsonl_reads_like_pythons_json_or_fails_clearly(tmp_path, body):
    path = tmp_path / "d.jsonl"
    raw = _read_or_refuse(path, body)
    if raw is None:
        return
    reference = _json_reference(body)
    assert reference is not None, "read although Python's json finds a broken line"
    table = raw.table.to_pydict()
    assert len(table["text"]) == len(reference)
    assert all(_same_text(got, row.get("text")) for got, row in zip(table["text"], reference, strict=False))
    assert all(_same(got, row.get("label")) for got, row in zip(table["label"], reference, strict=False))
    _loads_or_refuses_clearly(path)


def _read_or_refuse(path: Path, body: str) -> RawSplit | None:
    """The file's rows as read, or None after checking that the refusal names the file."""
    path.write_bytes(body.encode("utf-8"))
    try:
        return read_source(DataConfig(source=str(path)))["all"]
    except UserError as err:
        assert path.name in str(err), str(err)
        return None


def _loads_or_refuses_clearly(path: Path) -> None:
    """The whole load (labels, cleaning, splits) ends in data or a UserError, and no missing label is a class."""
    try:
        data = load_data(DataConfig(source=str(path)), seed=0)
    except UserError as err:
        assert str(err).strip() and "Traceback" not in str(err)
        return
    assert not [label for label in data.labels if label.strip().casefold() in MISSING_SPELLINGS]
