"""CSV and TSV files: Arrow parses them; Python's csv module, which reads the same dialect, explains problems.

A quoted field may hold line breaks, which is also exactly what an unclosed quote looks like: the rest of
its line and the lines after it become one field, and rows vanish without an error. So every quoted field
that spans lines is reported with its line numbers, and the file is refused when a line inside one looks
like a row of its own (the header's number of fields, with a label other rows have in the label column).
"""

from __future__ import annotations

import contextlib
import csv
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from emotune.core.errors import UserError, first_line, listed

MAX_ROW_BYTES = 64 << 20  # longest row read; Arrow must fit a whole row in one block, the csv module in its limit
LINE_BREAK = re.compile(r"\r\n|\r|\n")

Lines = Callable[[], Iterable[str]]  # the file's lines, decoded, with their line endings (newline="")
EVERY_COLUMN = "\0every column"
"""As the text column: every column is text, as written (conversations: an answer `0.50` or `007` is not a number)."""


def read_csv(path: Path, source: str | pa.Buffer, delimiter: str, lines: Lines, text_column: str,
             label_column: str, notes: list[str]) -> pa.Table:
    """The file as a table (the text column, or with EVERY_COLUMN every column, always as strings, so `1.50` or a date
    stay as written)."""
    texts = _header(lines, delimiter) if text_column == EVERY_COLUMN else [text_column]
    try:
        return _read_quoted(path, source, delimiter, lines, texts, label_column, notes)
    except UserError:
        if delimiter != "\t":
            raise
        unquoted = _unquoted_tsv(source, texts)  # GLUE-style TSV: a quote is text, never a field's fence
        if unquoted is None:
            raise
        notes.append(f"`{path}`: read with quotes as part of the text (a TSV without quoting, as GLUE's files are): "
                     "read as quoted fields, a quote in the text ran over the rows after it.")
        return unquoted


def _header(lines: Lines, delimiter: str) -> list[str]:
    """The header's names, as the csv module reads them (none when it cannot: Arrow's read then says what is wrong)."""
    with _field_limit(MAX_ROW_BYTES), contextlib.closing(iter(lines())) as source:
        try:
            return next(csv.reader(source, delimiter=delimiter), [])
        except csv.Error:
            return []


def _read_quoted(path: Path, source: str | pa.Buffer, delimiter: str, lines: Lines, texts: list[str],
                 label_column: str, notes: list[str]) -> pa.Table:
    kind = "TSV" if delimiter == "\t" else "CSV"
    try:
        table = _arrow_read(source, delimiter, texts)
    except Exception as err:  # Arrow's message has no line number; find the first bad row ourselves
        where = _bad_row(lines, delimiter) or first_line(err)
        raise UserError(f"`{path}` is not valid {kind}: {where}. Quote fields that contain the delimiter or a "
                        "newline, and give every row the header's number of fields.") from None
    if _has_line_breaks(table):
        _check_multiline_fields(path, table, delimiter, lines, label_column, notes)
    return table


def _unquoted_tsv(source: str | pa.Buffer, texts: list[str]) -> pa.Table | None:
    """The file read with no quoting, when every row then has the header's number of fields and no field is wrapped
    in quotes whole (a file that quotes its fields and has one quote wrong keeps its error); None otherwise."""
    try:
        table = _arrow_read(source, "\t", texts, quoting=False)
    except Exception:  # rows of other lengths: the quotes were fences after all, and the first error stands
        return None
    fenced = any(pc.any(pc.match_substring_regex(column, '^".*"$')).as_py()
                 for column in table.columns if pa.types.is_string(column.type) or pa.types.is_large_string(column.type))
    return None if fenced else table


def _arrow_read(source: str | pa.Buffer, delimiter: str, texts: list[str], quoting: bool = True) -> pa.Table:
    """The table, the `texts` columns as strings."""
    parse = (pa_csv.ParseOptions(delimiter=delimiter, newlines_in_values=True) if quoting else
             pa_csv.ParseOptions(delimiter=delimiter, quote_char=False, newlines_in_values=False))
    convert = pa_csv.ConvertOptions(column_types=dict.fromkeys(texts, pa.string()))

    def attempt(block_size: int | None) -> pa.Table:
        reader = source if isinstance(source, str) else pa.BufferReader(source)
        options = pa_csv.ReadOptions(block_size=block_size) if block_size else None
        return pa_csv.read_csv(reader, read_options=options, parse_options=parse, convert_options=convert)

    try:
        return attempt(None)  # Arrow's default blocks (1 MB) parse in parallel
    except pa.ArrowInvalid as err:
        if "straddl" not in str(err):
            raise
        return attempt(MAX_ROW_BYTES)  # a row longer than a block: read again with blocks that hold any row we accept


@contextlib.contextmanager
def _field_limit(limit: int) -> Iterator[None]:
    """The csv module refuses fields over 128 KiB by default; our limit is the longest row Arrow reads."""
    before = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(before)


class Unparsable(Exception):
    """`line N: what the csv module found there`."""


def _records(lines: Lines, delimiter: str) -> Iterator[tuple[int, int, list[str]]]:
    """(first line, last line, fields) of every record, the header included; Unparsable names the line."""
    with _field_limit(MAX_ROW_BYTES), contextlib.closing(iter(lines())) as source:
        reader = csv.reader(source, delimiter=delimiter)
        end = 0
        try:
            for row in reader:
                start, end = end + 1, reader.line_num
                yield start, end, row
        except csv.Error as err:
            if "field limit" in str(err):
                raise Unparsable(f"line {reader.line_num}: a field longer than {MAX_ROW_BYTES >> 20} MiB ends here, "
                                 "longer than any row emotune reads") from None
            raise Unparsable(f"line {reader.line_num}: {err}") from None


def _bad_row(lines: Lines, delimiter: str) -> str | None:
    """Where Python's csv module, parsing the same dialect, finds the first bad row."""
    header: list[str] | None = None
    try:
        for start, end, row in _records(lines, delimiter):
            if header is None:
                header = row
            elif row and len(row) != len(header):
                if end > start:
                    return (f"lines {start}-{end} are one row of {len(row)} field(s) (the header has {len(header)}), "
                            f"joined by a quoted field; a quote (`\"`) on line {start} is probably never closed")
                return f"line {start} has {len(row)} fields, the header has {len(header)}"
    except Unparsable as err:
        return str(err)
    return None


def _has_line_breaks(table: pa.Table) -> bool:
    return any(pc.any(pc.match_substring_regex(column, "[\r\n]")).as_py()
               for column in table.columns if pa.types.is_string(column.type) or pa.types.is_large_string(column.type))


def _check_multiline_fields(path: Path, table: pa.Table, delimiter: str, lines: Lines, label_column: str,
                            notes: list[str]) -> None:
    """Refuse when a quoted field swallowed a line that looks like a row; otherwise note where fields span lines."""
    labels = _label_spellings(table, label_column)
    spans, swallowed, header = [], [], None
    try:
        for start, end, row in _records(lines, delimiter):
            if header is None:
                header, label_at = row, row.index(label_column) if label_column in row else None
            elif end > start:
                spans.append(start)
                line = _row_like_line(row, start, header, label_at, labels, delimiter)
                if line is not None:
                    swallowed.append((start, end, line))
    except Unparsable as err:  # Arrow read it, the csv module cannot: say where rather than guess
        raise UserError(f"`{path}` {err}. Fix that line (its quotes) and run again.") from None
    if swallowed:
        start, end, (number, fragment) = swallowed[0]
        starts = [s for s, _, _ in swallowed]
        more = f" ({len(swallowed)} such rows, starting on lines {listed(starts)})" if len(swallowed) > 1 else ""
        raise UserError(f"`{path}` lines {start}-{end}: a quoted field runs from line {start} to line {end} and "
                        f"swallows line {number} ({fragment[:80]!r}), which looks like a row of its own{more}. "
                        f"A quote (`\"`) that is never closed does this and silently merges rows: close it, or write "
                        f"a quote that is part of the text as `\"\"` inside a quoted field.")
    if spans:
        notes.append(f"`{path}`: {len(spans)} row(s) have a quoted field that spans lines (rows starting on lines "
                     f"{listed(spans)}); their line breaks are kept as text. If those rows were meant to be one "
                     "line each, check their quotes.")


def _row_like_line(row: list[str], start: int, header: list[str], label_at: int | None, labels: set[str],
                   delimiter: str) -> tuple[int, str] | None:
    """(line number, text) of the first line inside this record's fields that parses as a row with a known label."""
    if label_at is None:
        return None
    line = start
    for field in row:
        for i, fragment in enumerate(LINE_BREAK.split(field)):
            parts = next(csv.reader([fragment], delimiter=delimiter), [])
            if len(parts) == len(header) and parts[label_at] in labels:
                return line + i, fragment
        line += len(LINE_BREAK.findall(field))
    return None


def _label_spellings(table: pa.Table, label_column: str) -> set[str]:
    if label_column not in table.column_names:
        return set()
    spellings = set()  # by position: a repeated header name is refused later, with its own message
    for value in pc.unique(table.column(table.column_names.index(label_column))).to_pylist():
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is not None and str(value).strip():
            spellings.add(str(value))
    return spellings
