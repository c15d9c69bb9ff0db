"""Read one data file into an Arrow table, or raise a UserError naming the file, line and fix.

The fast path hands the whole file to Arrow's C++ readers. Only when they fail (or, for CSV, when a
quoted field spans lines: csvfile.py) does a slow Python pass stream the lines, so the message can say
where the problem is and what to do.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import lzma
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from emotune.core.errors import UserError, first_line
from emotune.data.csvfile import EVERY_COLUMN, Lines, read_csv
from emotune.data.jsontext import TOO_DEEP, deep_line, without_lone_surrogates
from emotune.data.txtfile import read_txt, tab_header, text_lines

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
           ".txt": "txt", ".arrow": "arrow", ".feather": "arrow"}  # Arrow IPC: `datasets`' cache and save_to_disk files
SPREADSHEETS = (".xlsx", ".xls", ".xlsm", ".ods", ".numbers")
BOM = b"\xef\xbb\xbf"
BOM_TEXT = "\ufeff"  # at a JSON line's start: the mark of a file joined to the one before it (`cat a.jsonl b.jsonl`)
UTF32_BOMS = (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff", *UTF32_BOMS)  # the byte-order marks of UTF-16 and UTF-32
_SPACE = re.compile(r"\s*")
JSON_BLOCK_BYTES = 16 << 20  # Arrow's JSON reader needs each line to fit in one block
# compressed files as hubs and papers ship them (train.jsonl.gz): read whole into memory, then like the plain file
COMPRESSED = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}


def data_suffix(path: Path) -> str:
    """The ending that names the file's format, under a compression ending: `.jsonl` for train.jsonl.gz."""
    suffix = path.suffix.lower()
    return Path(path.stem).suffix.lower() if suffix in COMPRESSED else suffix


def is_data_file(path: Path) -> bool:
    return data_suffix(path) in FORMATS


def read_table(path: Path, encoding: str, text_column: str, label_column: str, notes: list[str]) -> pa.Table:
    """One file as a table; things worth a look that are not errors go to `notes`."""
    fmt = FORMATS.get(data_suffix(path))
    if fmt is None and path.suffix.lower() in SPREADSHEETS:
        raise UserError(f"`{path}` is a spreadsheet workbook, which emotune does not read. Save the sheet as CSV "
                        "(\"CSV UTF-8\" in Excel; File > Download > CSV in Google Sheets) and point data.source (or "
                        "`emotune predict --file`) at it.")
    if fmt is None:
        raise UserError(f"`{path}`: unsupported file type `{''.join(path.suffixes[-2:]) or '(no ending)'}`. Use one "
                        f"of {', '.join(FORMATS)} (TXT holds one `text;label` per line), also compressed with "
                        f"{', '.join(COMPRESSED)} (e.g. train.jsonl.gz).")
    if fmt == "parquet":
        return _read_parquet(path)
    if fmt == "arrow":
        return _read_arrow(path)
    compressed = path.suffix.lower() in COMPRESSED
    if (fmt != "json" and fmt != "txt" and not compressed and _is_utf8(encoding) and _valid_utf8_file(path)
            and not _has_bom(path)):
        # the common case: Arrow streams the file itself; a Python string of a large file would cost up
        # to four bytes per character, so Python reads the lines (streamed) only to explain a problem
        if _is_blank(path):
            raise UserError(f"`{path}` is empty. Give it a header and rows, or remove it.")
        lines: Lines = lambda: _file_lines(path)  # noqa: E731
        source: str | pa.Buffer = str(path)
    else:
        raw = read_bytes(path)
        text = _decode(path, raw, encoding)
        text = without_lone_surrogates(text) if fmt in ("json", "jsonl") else text
        if not text.strip():
            raise UserError(f"`{path}` is empty. Give it a header and rows, or remove it.")
        if fmt == "txt" and tab_header(text):
            fmt = "tsv"  # a spreadsheet's "Unicode text" export: tab-separated, UTF-16, under .txt
            notes.append(f"`{path}`: the header is separated by tabs, not the `;` of a `text;label` TXT file; read as "
                         "tab-separated (a spreadsheet's \"Unicode text\").")
        if fmt in ("json", "txt"):
            if fmt == "json":
                return _read_json(path, text, (text_column, label_column))
            return read_txt(path, text, "text" if text_column == EVERY_COLUMN else text_column, label_column)
        lines = lambda: io.StringIO(text, newline="")  # noqa: E731
        source = pa.py_buffer(text.encode("utf-8"))
    if fmt == "jsonl":
        return _read_jsonl(path, source, lines, (text_column, label_column))
    return read_csv(path, source, _delimiter(path, fmt, lines, notes), lines, text_column, label_column, notes)


def _delimiter(path: Path, fmt: str, lines: Lines, notes: list[str]) -> str:
    """The file ending's delimiter, unless the header has none of it and another one instead: spreadsheets set to
    a locale with a decimal comma write `;`-separated `.csv` files, which read as one column named `text;label`."""
    expected = "\t" if fmt == "tsv" else ","
    header = next(iter(lines()), "")
    if expected in header:
        return expected
    found = next((d for d in (";", "\t", ",", "|") if d != expected and d in header), None)
    if found is None:
        return expected
    names = {";": "`;`", "\t": "tabs", ",": "commas", "|": "`|`"}
    notes.append(f"`{path}`: the header is separated by {names[found]}, not {names[expected]}; read with "
                 f"{names[found]} as the delimiter.")
    return found


def read_records(path: Path, encoding: str, text_column: str, label_column: str, notes: list[str] | None = None,
                 txt_lines: bool = True) -> tuple[list[str], list[dict]]:
    """One file's column names and rows as Python objects, for conversation data (and `emotune predict --file`, which
    keeps every column). JSON and JSON Lines are parsed by Python's json, not Arrow: Arrow wants one type per field
    across all rows, and conversations legally mix them (an OpenAI message's content is a string in one message and a
    list of parts in the next; tool arguments are text or an object), so Arrow refused valid files whole. Things worth
    a look that are not errors (a `;`-separated .csv read with `;`) go to `notes` where it is given. A .txt file is one
    document per line (`txt_lines`, as sft data reads it), else `text;label` lines as a classifier's data reads them."""
    if path.is_dir():  # one split of a save_to_disk folder (emotune.data.sources.saved_splits)
        return _saved_rows(path)
    fmt = FORMATS.get(data_suffix(path))
    if fmt not in ("json", "jsonl", "txt") or (fmt == "txt" and not txt_lines):
        # CSV and TSV cells as written, every column (a conversation's `0.50` is no number; an id `007` stays `007`)
        table = read_table(path, encoding, EVERY_COLUMN, label_column, [] if notes is None else notes)
        return table.column_names, columnar_rows(table.to_pylist(), table.schema)
    text = _decode(path, read_bytes(path), encoding)
    text = without_lone_surrogates(text) if fmt != "txt" else text
    if not text.strip():
        raise UserError(f"`{path}` is empty. Give it rows, or remove it.")
    if fmt == "txt":  # one document per line, as LLaMA-Factory's text loader reads it (wiki_demo.txt): not text;label
        return ["text"], [{"text": line} for line in text_lines(text) if line.strip()]
    if fmt == "jsonl" and not text.lstrip().startswith("["):
        rows = _json_lines(path, text)
    else:  # a JSON array under .jsonl too, as `datasets` reads one
        rows = _json_rows(path, text, text_column, label_column)
    return list(dict.fromkeys(key for row in rows for key in row)), rows


def _saved_rows(folder: Path) -> tuple[list[str], list[dict]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as err:  # a damaged or foreign folder
        raise UserError(f"`{folder}` looks like a `save_to_disk` folder but could not be loaded "
                        f"({first_line(err) or type(err).__name__}). Save it again.") from None
    return list(saved.column_names), columnar_rows(saved.to_list(), saved.data.schema)


def columnar_rows(rows: list[dict], schema: pa.Schema) -> list[dict]:
    """Rows of a columnar file (Parquet, Arrow, save_to_disk) as they were written: Arrow gives every object inside a
    column every key any of them has, null where one had none, so a tool's JSON schema read as `"properties": {"city":
    null}` from another row's tool, and `"required": null`. Keys that are null inside a column's values are left out;
    a top-level column stays (null there is the row's value)."""
    if not any(_has_struct(field.type) for field in schema):
        return rows
    return [{key: _without_null_keys(value) for key, value in row.items()} for row in rows]


def _has_struct(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        return True
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _has_struct(kind.value_type)
    return pa.types.is_map(kind) and _has_struct(kind.item_type)


def _without_null_keys(value: object) -> object:
    if isinstance(value, dict):
        return {key: _without_null_keys(inner) for key, inner in value.items() if inner is not None}
    if isinstance(value, list):
        return [_without_null_keys(inner) for inner in value]
    return value


def _json_rows(path: Path, text: str, text_column: str, label_column: str) -> list[dict]:
    try:
        value = _loads(path, text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):
            try:
                return _json_lines(path, text)  # many `.json` files are really JSON Lines
            except UserError:
                objects = _json_objects(path, text)  # or objects one after another over several lines (jq's output)
                if objects is None:
                    raise
                return objects
        value = None
    value = _pandas_rows(value) or value
    if isinstance(value, dict):
        lists = [v for v in value.values() if isinstance(v, list)]
        value = lists[0] if len(lists) == 1 and all(isinstance(r, dict) for r in lists[0]) else value
    if isinstance(value, dict) and _columns(value):  # an object of columns, as json.dump(df.to_dict("list")): row by row
        return [dict(zip(value, cells, strict=True)) for cells in zip(*value.values(), strict=True)]
    if isinstance(value, list) and all(isinstance(r, dict) for r in value):
        return value
    return _read_json(path, text).to_pylist()  # columns of an object, or the error that says what is wrong


def _pandas_rows(value: object) -> list[dict] | None:
    """The rows of a DataFrame as pandas' to_json writes it by default (orient="columns": {column: {index: value}}), with
    orient="index" ({index: {column: value}}) or orient="split" ({"columns": [...], "index": [...], "data": [[...]]});
    None when `value` is none of them. An index is told from column names by its labels: pandas' default, 0, 1, 2..."""
    if not isinstance(value, dict) or not value:
        return None
    columns, data = value.get("columns"), value.get("data")
    if (set(value) <= {"columns", "index", "data"} and isinstance(columns, list) and isinstance(data, list)
            and all(isinstance(row, list) and len(row) == len(columns) for row in data)):
        return [dict(zip(columns, row, strict=True)) for row in data]
    inner = list(value.values())
    if not all(isinstance(v, dict) and v for v in inner) or len({tuple(v) for v in inner}) != 1:
        return None
    if all(key.isdigit() for key in inner[0]):  # orient="columns"
        return [{column: value[column][at] for column in value} for at in inner[0]]
    if all(key.isdigit() for key in value):  # orient="index"
        return inner
    return None


def _columns(value: dict) -> bool:
    """An object of equally long lists that are not all lists of rows (those are splits, {"train": [...], ...})."""
    lists = list(value.values())
    return (bool(lists) and all(isinstance(v, list) for v in lists) and len({len(v) for v in lists}) == 1
            and not all(isinstance(r, dict) for v in lists for r in v))


def _json_objects(path: Path, text: str) -> list[dict] | None:
    """JSON objects one after another, each over any number of lines (`jq '.[]'` writes them so); None if it is not."""
    decoder, objects, at = json.JSONDecoder(object_pairs_hook=_refuse_repeated_keys), [], 0
    while (at := _SPACE.match(text, at).end()) < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        except _RepeatedKey as err:
            raise UserError(f"`{path}` has an object with the key `{err}` twice, so it is unclear which value to read; "
                            "keep one of them.") from None
        except RecursionError:
            raise UserError(f"`{path}` {TOO_DEEP}; no dataset needs that: fix the file.") from None
        if not isinstance(value, dict):
            return None
        objects.append(value)
    return objects


def _json_lines(path: Path, text: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        line = line.lstrip(BOM_TEXT)
        if not line.strip():
            continue
        problem = _bad_json_line(iter([line]))
        if problem is not None:
            raise UserError(f"`{path}` {problem.replace('line 1 ', f'line {number} ', 1)}. Each line must be one JSON "
                            "object; fix or remove that line.")
        rows.append(json.loads(line))
    return rows


def read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when its ending names a compression."""
    decompress = COMPRESSED.get(path.suffix.lower())
    if decompress is None:
        return path.read_bytes()
    try:
        return decompress(path.read_bytes())
    except (OSError, EOFError, ValueError, lzma.LZMAError) as err:  # gzip raises BadGzipFile (an OSError), bz2 OSError
        raise UserError(f"`{path}` could not be decompressed as {path.suffix.lower()} ({first_line(err) or type(err).__name__}); "
                        "check that it was fully downloaded and that its ending matches its compression.") from None


def _file_lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", newline="") as handle:  # newline="": line ends as written, like Arrow reads them
        yield from handle


def _has_bom(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(len(BOM)) == BOM


def _is_blank(path: Path) -> bool:
    with path.open("rb") as handle:
        head = handle.read(1 << 16)
    return not head.strip() and path.stat().st_size <= len(head)


def _valid_utf8_file(path: Path, chunk: int = 1 << 22) -> bool:
    """Validate in chunks, so memory stays flat however large the file (and non-ASCII text is)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as handle:
            while block := handle.read(chunk):
                decoder.decode(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _is_utf8(encoding: str) -> bool:
    return encoding.replace("_", "-").lower() in ("utf-8", "utf8", "utf-8-sig")


def _read_parquet(path: Path) -> pa.Table:
    try:
        table = pq.read_table(pa.BufferReader(read_bytes(path)) if path.suffix.lower() in COMPRESSED else path)
        table.validate(full=True)  # corrupt pages can decode into invalid UTF-8 that would fail much later
        return table
    except Exception as err:  # Arrow raises several types for bad files; the user needs the file and the cause
        raise UserError(f"`{path}` is not a readable Parquet file ({first_line(err)}). Check that it was fully "
                        "downloaded and that its ending matches its real format.") from None


def _read_arrow(path: Path) -> pa.Table:
    """An Arrow IPC file (Feather v2) or stream (what `datasets` writes: its cache files, save_to_disk's shards)."""
    data = read_bytes(path) if path.suffix.lower() in COMPRESSED else pa.memory_map(str(path))
    try:
        try:
            table = pa.ipc.open_file(data).read_all()
        except pa.ArrowInvalid:  # no file footer: a stream
            table = pa.ipc.open_stream(data if isinstance(data, bytes) else pa.memory_map(str(path))).read_all()
        table.validate(full=True)
        return table
    except Exception as err:  # Arrow raises several types for bad files; the user needs the file and the cause
        raise UserError(f"`{path}` is not a readable Arrow file ({first_line(err)}). Check that it was fully "
                        "downloaded and that its ending matches its real format.") from None


def _decode(path: Path, raw: bytes, encoding: str) -> str:
    """The file as text, or a UserError naming the line and column of the first byte that does not decode."""
    codec = "utf-8-sig" if _is_utf8(encoding) else encoding
    if _is_utf8(encoding) and raw.startswith(UTF16_BOMS):  # e.g. a spreadsheet's "Unicode text": the mark says which
        codec = "utf-32" if raw.startswith(UTF32_BOMS) else "utf-16"
    try:
        return raw.decode(codec)
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise UserError(f"`{path}` line {line}, column {column}: byte 0x{raw[err.start]:02x} is not valid {encoding}. "
                        "If the file uses another encoding, set data.encoding (e.g. data.encoding=latin-1, cp1252 "
                        "or gbk; `emotune predict --file`: --encoding); otherwise fix or remove that line.") from None
    except UnicodeError as err:  # e.g. utf-16 without a byte-order mark
        raise UserError(f"`{path}` cannot be decoded as {encoding} ({err}). Set data.encoding (`emotune predict --file`: "
                        "--encoding) to the file's encoding.") from None


def _read_jsonl(path: Path, source: str | pa.Buffer, lines: Lines, used: tuple[str, ...] = ()) -> pa.Table:
    deep = deep_line(source)
    if deep is not None:  # Arrow's reader overflows its stack on them (a segmentation fault, from 20,000 levels)
        raise UserError(f"`{path}` line {deep} {TOO_DEEP}; no dataset needs that: fix or remove that line.")
    try:
        reader = source if isinstance(source, str) else pa.BufferReader(source)
        return pa_json.read_json(reader, read_options=pa_json.ReadOptions(block_size=JSON_BLOCK_BYTES))
    except Exception as err:
        problem = _bad_json_line(lines())
        if problem and "".join(lines()).lstrip().startswith("["):  # a JSON array under .jsonl, as `datasets` reads one
            return _read_json(path, "".join(lines()), used)
        if problem:
            raise UserError(f"`{path}` {problem}. Each line must be one JSON object such as "
                            '{"text": "...", "label": "..."}; fix or remove that line.') from None
        if used:
            return _rows_table(path, [json.loads(without_lone_surrogates(line.lstrip(BOM_TEXT))) for line in lines()
                                       if line.strip()], used)
        raise UserError(f"`{path}` could not be read as JSON Lines ({first_line(err)}). Give every row the "
                        "same fields with the same types (e.g. all labels strings, or all integers).") from None


def _rows_table(path: Path, rows: list[dict], used: tuple[str, ...]) -> pa.Table:
    """Rows that are valid JSON, yet Arrow wants one type per field across all rows, also in fields emotune never
    reads (an `id` that is a number here and text there, nested metadata): the table built from Python's values.
    The fields emotune uses keep their values (a text that is a number becomes its text); every other field is kept
    as its JSON text, so its name is still there for messages."""
    names = list(dict.fromkeys(key for row in rows for key in row))
    text_column = used[0]
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        if name in used:  # NaN: how Python's json writes pandas' missing values; no value, not the text "nan"
            values = [None if isinstance(v, float) and v != v else v for v in values]
        if name == text_column:
            values = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in values]
        elif name not in used:
            values = [None if v is None else json.dumps(v, ensure_ascii=False) for v in values]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            kinds = sorted({type(v).__name__ for v in values if v is not None})
            raise UserError(f"`{path}`: the `{name}` field holds values of several types ({', '.join(kinds)}); give "
                            "it one type in every row (e.g. all labels names, or all integer ids).") from None
    return pa.table(columns)


class _RepeatedKey(Exception):
    pass


def _refuse_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """Python keeps the last of two equal keys, Arrow refuses the row: name the key instead of guessing."""
    found = dict(pairs)
    if len(found) < len(pairs):
        keys = [key for key, _ in pairs]
        raise _RepeatedKey(next(key for key in keys if keys.count(key) > 1))
    return found


def _loads(path: Path, text: str) -> object:
    """A whole JSON file's value; an object with a key twice is refused by name, as a JSON Lines file's line is (Python
    keeps the last of them, so a row's second `label` or `output` was read without a word)."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_repeated_keys)
    except _RepeatedKey as err:
        raise UserError(f"`{path}` has an object with the key `{err}` twice, so it is unclear which value to read; "
                        "keep one of them.") from None
    except RecursionError:
        raise UserError(f"`{path}` {TOO_DEEP}; no dataset needs that: fix the file.") from None


def _bad_json_line(lines: Iterator[str]) -> str | None:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.lstrip(BOM_TEXT), object_pairs_hook=_refuse_repeated_keys)
        except json.JSONDecodeError as err:
            return f"line {number} is not valid JSON ({err.msg} at column {err.colno})"
        except _RepeatedKey as err:
            return f"line {number} has the key `{err}` twice"
        except RecursionError:
            return f"line {number} {TOO_DEEP}"
        if not isinstance(value, dict):
            return f"line {number} is a JSON {type(value).__name__}, not an object"
    return None


def _read_json(path: Path, text: str, used: tuple[str, ...] = ()) -> pa.Table:
    """A JSON array of objects, an object of columns, or `{"data": [...]}`; JSON Lines under .json too."""
    try:
        value = _loads(path, text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().startswith("{"):
            # many `.json` files are really JSON Lines
            return _read_jsonl(path, pa.py_buffer(text.encode("utf-8")), lambda: io.StringIO(text, newline=""), used)
        raise UserError(f"`{path}` is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}. "
                        "Fix the file there.") from None
    value = _pandas_rows(value) or value
    if isinstance(value, dict):
        lists = [v for v in value.values() if isinstance(v, list)]
        if len(lists) == 1 and all(isinstance(r, dict) for r in lists[0]):
            value = lists[0]  # {"data": [{...}, ...]}
        elif len(lists) > 1 and all(v and all(isinstance(r, dict) for r in v) for v in lists):
            keys = ", ".join(repr(k) for k, v in value.items() if isinstance(v, list))
            raise UserError(f"`{path}` holds {len(lists)} lists of rows, under the keys {keys} (splits, as some "
                            "datasets ship them in one file). Write each list to a file of its own named after its "
                            "split (train.json, validation.json, test.json) in one folder and point data.source at "
                            "the folder, or keep one list.")
        elif value and all(isinstance(v, list) for v in value.values()):
            return _arrow(path, lambda: pa.table(value))  # columns
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise UserError(f"`{path}` must hold a JSON array of objects such as "
                        '[{"text": "...", "label": "..."}] (or JSON Lines); it holds something else. From pandas, '
                        'write it with df.to_json(path, orient="records", lines=True).')
    if used:
        try:
            return pa.Table.from_pylist(value)
        except (pa.ArrowException, ValueError, TypeError):
            return _rows_table(path, value, used)
    return _arrow(path, lambda: pa.Table.from_pylist(value))


def _arrow(path: Path, build) -> pa.Table:
    try:
        return build()
    except (pa.ArrowException, ValueError, TypeError) as err:
        raise UserError(f"`{path}` has fields whose types differ between rows ({first_line(err)}). "
                        "Give every row the same fields with the same types.") from None
