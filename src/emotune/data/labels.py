"""Labels: decide the label names once, then turn every split's label column into those names.

Names come from `data.label_names`, else a `ClassLabel`, else the values found. Integer labels are ids
into the names (unless data.label_names are all numbers that hold every value: then they are those names);
string labels match a name or an alias ignoring case, surrounding whitespace and Unicode form (`café` composed
or as `e` + combining accent is one label, written composed, NFC, when it comes from the values found).
All work is on the few distinct values, then one Arrow `take` maps the whole column.
"""

from __future__ import annotations

import unicodedata
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from emotune.core.config.data import DataConfig
from emotune.core.errors import listed
from emotune.data.clean import CONTROL_CHARS
from emotune.data.sources import RawSplit

# How a missing label is written in CSV exports (pandas writes NaN as an empty cell or `NaN`). Never a class:
# a model trained on `NaN` as an emotion would be measured on it too. (`none` and `NA` are left alone: both
# are real labels in some datasets.)
MISSING_SPELLINGS = ["", "nan", "null", "n/a", "#n/a"]


def label_key(value: str) -> str:
    return unicodedata.normalize("NFC", value.strip()).casefold()


def coerce_columns(raw: RawSplit, problems: list[str]) -> pa.Table | None:
    """Text as strings (nulls become empty, numbers become text); labels as strings or integers."""
    table = raw.table
    text, label = (_plain_strings(table.column(name)) for name in ("text", "label"))
    if not (pa.types.is_string(text.type) or pa.types.is_null(text.type)
            or pa.types.is_integer(text.type) or pa.types.is_floating(text.type)):
        problems.append(f"{raw.origin}: the text column holds {text.type} values, not text. Point data.text_column "
                        "at the column with the text")
        return None
    text = pc.fill_null(text.cast(pa.string()), "")
    if pa.types.is_boolean(label.type) or pa.types.is_null(label.type):
        label = label.cast(pa.string())
    if pa.types.is_string(label.type):  # invisible characters (zero-width space, direction marks, a stray BOM), as
        label = pc.replace_substring_regex(label, CONTROL_CHARS, "")  # cleaning removes them from texts
    missing = _missing(label)
    if pc.any(missing).as_py():
        rows = [r + 1 for r in pc.indices_nonzero(missing).to_pylist()]
        problems.append(f"{raw.origin}: {len(rows)} row(s) have no label (rows {listed(rows)}): the label is empty, "
                        "NaN or null. Label those rows or remove them")
        return None
    if pa.types.is_floating(label.type):
        fractional = pc.indices_nonzero(pc.not_equal(label, pc.floor(label))).to_pylist()
        if fractional:
            problems.append(f"{raw.origin}: the label column holds fractional numbers (rows {listed([r + 1 for r in fractional])}, "
                            f"e.g. {label[fractional[0]].as_py()}); labels are names or integer ids")
            return None
        label = label.cast(pa.int64())
    if pa.types.is_list(label.type) or pa.types.is_large_list(label.type):
        label = _one_label_each(label, raw, problems)
        if label is None:
            return None
    if not (pa.types.is_string(label.type) or pa.types.is_integer(label.type)):
        problems.append(f"{raw.origin}: the label column holds {label.type} values; labels must be names or integer "
                        "ids. Point data.label_column at the label column")
        return None
    return pa.table({"text": text, "label": label})


def _plain_strings(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Arrow's other string types as `string`: `string_view` (Polars' strings, which its Parquet files keep) and
    `large_string`; a dictionary (pandas' categories) as its values."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if pa.types.is_large_string(column.type) or _is_string_view(column.type):
        return column.cast(pa.string())
    return column


def _is_string_view(kind: pa.DataType) -> bool:
    return bool(getattr(pa.types, "is_string_view", lambda _: False)(kind))  # the type is new in pyarrow 16


def _one_label_each(label: pa.ChunkedArray, raw: RawSplit, problems: list[str]) -> pa.ChunkedArray | None:
    """A list column whose every list holds one label is that label (a multi-label layout with single-label rows);
    a row with more or none is refused: a classify task gives each text one label."""
    lengths = pc.fill_null(pc.list_value_length(label), 0)
    other = pc.indices_nonzero(pc.not_equal(lengths, 1)).to_pylist()
    if not other:
        raw.notes.append(f"{raw.origin}: every label is a list of one label; read as that label.")
        return pc.list_flatten(label)
    problems.append(f"{raw.origin}: the label column holds lists of labels, and {len(other)} row(s) have more than one "
                    f"label or none (multi-label rows, e.g. row {other[0] + 1}: {label[other[0]].as_py()!r:.80}); the "
                    "classify tasks give each text exactly one label. Keep one label per row, write each combination as "
                    "a label of its own (e.g. `joy+surprise`), or point data.label_column at a single-label column")
    return None


def _missing(label: pa.ChunkedArray) -> pa.ChunkedArray:
    """Rows without a label: null, NaN, or text that spreadsheets and pandas write for a missing value."""
    absent = pc.is_null(label, nan_is_null=True)
    if pa.types.is_string(label.type):
        spelled = pc.is_in(pc.utf8_lower(pc.utf8_trim_whitespace(label)), value_set=pa.array(MISSING_SPELLINGS))
        absent = pc.or_(absent, pc.fill_null(spelled, False))
    return absent


def choose_label_names(cfg: DataConfig, tables: dict[str, pa.Table], raw: dict[str, RawSplit],
                       default: list[str] | None, problems: list[str]) -> tuple[list[str], str]:
    """(names, where they came from)."""
    if cfg.label_names:
        return list(cfg.label_names), "data.label_names"
    if default:
        return list(default), "the packaged dataset"
    for split in tables:
        if raw[split].class_names:
            return raw[split].class_names, f"the ClassLabel of {raw[split].origin}"
    integer = [t.column("label") for t in tables.values() if pa.types.is_integer(t.column("label").type)]
    if integer:
        ids = sorted({i for column in integer for i in pc.unique(column).to_pylist()})
        shown = ", ".join(map(str, ids[:12])) + (f" ... ({len(ids)} values)" if len(ids) > 12 else "")
        problems.append(f"the labels are integer ids ({shown}) but there are no names for them (no ClassLabel in the "
                        f"data). Set data.label_names to the names in id order, one for each id from 0 to {ids[-1]}, "
                        f"e.g. data.label_names=[negative, positive] for ids 0 and 1; where the numbers are the labels "
                        f"themselves (star ratings), list them as the names: data.label_names=[{', '.join(map(str, ids[:12]))}]")
        return [], "none"
    names = _names_as_found(cfg, tables)
    numbers = [n for n in names if n.strip().lstrip("+-").isdigit()]
    if numbers and len(numbers) < len(names):  # JSON refuses such a column as of two types; CSV cells are all text
        words = [n for n in names if n not in numbers]
        problems.append(f"the labels mix whole numbers ({', '.join(numbers[:6])}) with names ({', '.join(words[:6])}), "
                        "as integer ids written beside the names they stand for do; each would be a label of its own. "
                        "Write every label one way (names, or ids with data.label_names in id order), or, where the "
                        "numbers are labels themselves, list every label in data.label_names")
        return [], "none"
    return names, "the values found"


def _names_as_found(cfg: DataConfig, tables: dict[str, pa.Table]) -> list[str]:
    """Distinct labels merged by case and whitespace; each written as its most frequent spelling."""
    spellings: dict[str, Counter] = {}
    aliases = {label_key(a): t for a, t in cfg.label_aliases.items()}
    for table in tables.values():
        counts = pc.value_counts(pc.utf8_trim_whitespace(table.column("label")))
        for entry in counts.to_pylist():
            spelling = aliases.get(label_key(entry["values"]), unicodedata.normalize("NFC", entry["values"]))
            spellings.setdefault(label_key(spelling), Counter())[spelling] += entry["counts"]
    return sorted(counter.most_common(1)[0][0] for counter in spellings.values())


def map_labels(table: pa.Table, names: list[str], cfg: DataConfig, origin: str, problems: list[str]) -> pa.Table | None:
    """The label column as names from `names`, or None with a problem listing unknown labels and example rows."""
    label = table.column("label")
    if pa.types.is_integer(label.type) and names == cfg.label_names:
        label = _numbers_as_names(label, names) or label
    if pa.types.is_integer(label.type):
        bad = pc.or_(pc.less(label, 0), pc.greater_equal(label, len(names)))
        if pc.any(bad).as_py():
            values = sorted(set(pc.filter(label, bad).to_pylist()))[:10]
            if values == [-1]:  # how `datasets` writes a ClassLabel row without a label
                rows = [r + 1 for r in pc.indices_nonzero(pc.equal(label, -1)).to_pylist()]
                problems.append(f"{origin}: {len(rows)} row(s) have the label -1 (rows {listed(rows)}), which is how "
                                "Hugging Face datasets write a row without a label; label those rows or remove them")
                return None
            problems.append(f"{origin}: column `{cfg.label_column}` holds integer ids {values} outside 0..{len(names) - 1} "
                            f"for the {len(names)} label names {names}. Set data.label_names to the full list of names in id order")
            return None
        return table.set_column(1, "label", pc.take(pa.array(names, pa.string()), label))
    lookup = {label_key(n): n for n in names}
    lookup.update({label_key(alias): target for alias, target in cfg.label_aliases.items() if label_key(target) in lookup})
    distinct = pc.unique(label).to_pylist()
    mapped = [lookup.get(label_key(value)) for value in distinct]
    ids = _ids_written_as_text(label) if not any(mapped) else None
    if ids is not None:
        return map_labels(table.set_column(1, "label", ids), names, cfg, origin, problems)
    unknown = [value for value, name in zip(distinct, mapped, strict=False) if name is None]
    if unknown:
        problems.append(f"{origin}: column `{cfg.label_column}` has labels {sorted(unknown)[:10]} that are not in the label "
                        f"set {names} (e.g. {example_rows(table, unknown)}). Fix those rows, map them with data.label_aliases, "
                        "or set data.label_names to include them")
        return None
    positions = pc.index_in(label, value_set=pa.array(distinct, pa.string()))
    return table.set_column(1, "label", pc.take(pa.array(mapped, pa.string()), positions))


def _numbers_as_names(label: pa.ChunkedArray, names: list[str]) -> pa.ChunkedArray | None:
    """Ids of the names the integer labels spell, when data.label_names are all numbers and hold every value: star
    ratings 1..5 with data.label_names=[1, 2, 3, 4, 5] are those names. Read as ids they shifted every rating one
    name down (without a word unless the data held a 5, which then failed as an id out of range)."""
    try:
        numbers = [int(name) for name in names]
    except ValueError:
        return None
    if [str(n) for n in numbers] != [name.strip() for name in names] or len(set(numbers)) != len(numbers):
        return None
    if not set(pc.unique(label).to_pylist()) <= set(numbers):
        return None  # 0..4 with names 1..5: ids after all
    return pc.index_in(label, value_set=pa.array(numbers, pa.int64())).cast(pa.int64())


def _ids_written_as_text(label: pa.ChunkedArray) -> pa.ChunkedArray | None:
    """Ids stored as text ("0", "1", ...), as some CSV/JSON exports do; None when they are not ids."""
    try:
        return pc.cast(pc.utf8_trim_whitespace(label), pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None


def example_rows(table: pa.Table, labels: list[str]) -> str:
    """`row 7: 'boredom' 'so bored today'; ...`: the first three rows holding any of `labels`, to find them in the file."""
    rows = pc.indices_nonzero(pc.is_in(table.column("label"), value_set=pa.array(labels, pa.string()))).to_pylist()[:3]
    texts, labels = table.column("text"), table.column("label")
    return "; ".join(f"row {r + 1}: {labels[r].as_py()!r} {texts[r].as_py()[:60]!r}" for r in rows)


def is_unlabelled(table: pa.Table | None) -> bool:
    """Every label is -1: a split published without its labels (GLUE's and SuperGLUE's test splits)."""
    label = None if table is None else table.column("label")
    return (label is not None and len(label) > 0 and pa.types.is_integer(label.type)
            and bool(pc.all(pc.equal(label, -1)).as_py()))
