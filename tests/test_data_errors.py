"""Bad data gives one clear UserError naming the file, line or column and the fix; never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LABELS, make_rows, write_jsonl
from emotune.core.config.data import DataConfig
from emotune.core.errors import UserError
from emotune.data import LabeledData, load_data


def _load(path: Path, **kwargs) -> LabeledData:
    return load_data(DataConfig(source=str(path), **kwargs), seed=0)


def _jsonl_lines(rows) -> list[str]:
    return [json.dumps(r, ensure_ascii=False) for r in rows]


def test_fake_parquet(tmp_path):
    (tmp_path / "d.parquet").write_text("text,label\nhello,joy\n")
    with pytest.raises(UserError, match=r"`.*d.parquet` is not a readable Parquet file.*ending matches its real format"):
        _load(tmp_path / "d.parquet")


def test_malformed_json_line_names_the_line(tmp_path):
    lines = _jsonl_lines(make_rows(3, seed=1))
    lines[6] = '{"text": "broken, "label": "joy"}'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"line 7 is not valid JSON"):
        _load(tmp_path / "d.jsonl")
    lines[6] = '["a list"]'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"line 7 is a JSON list, not an object"):
        _load(tmp_path / "d.jsonl")
    lines[6] = '{"text": "one", "text": "two", "label": "joy"}'  # Arrow refuses it, Python's json keeps the last
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"d.jsonl` line 7 has the key `text` twice"):
        _load(tmp_path / "d.jsonl")


def test_non_utf8_names_line_and_encoding_option(tmp_path):
    rows = make_rows(3, seed=1)
    rows[4]["text"] = "café crème"
    body = "text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows)
    (tmp_path / "d.csv").write_bytes(body.encode("latin-1"))
    with pytest.raises(UserError, match=r"line 6, column \d+: byte 0xe9 is not valid utf-8.*data.encoding"):
        _load(tmp_path / "d.csv")
    data = _load(tmp_path / "d.csv", encoding="latin-1")
    assert "café crème" in [t for ds in data.splits.values() for t in ds["text"]]


def test_unknown_encoding_is_a_config_error():
    with pytest.raises(ValueError, match="encoding"):
        DataConfig(encoding="no-such-codec")


def test_csv_with_wrong_field_count_names_the_line(tmp_path):
    body = "text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in make_rows(2, seed=1))
    body += "one,two,three\n"
    (tmp_path / "d.csv").write_text(body)
    with pytest.raises(UserError, match=r"line 14 has 3 fields, the header has 2"):
        _load(tmp_path / "d.csv")


def test_unknown_labels_listed_with_example_rows(tmp_path):
    rows = make_rows(3, seed=1) + [{"text": "so bored today", "label": "boredom"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"\['boredom'\].*row 19: 'boredom' 'so bored today'.*data.label_aliases"):
        _load(tmp_path / "d.jsonl", label_names=LABELS)


def test_empty_split_file(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", make_rows(3, seed=1))
    write_jsonl(tmp_path / "validation.jsonl", make_rows(1, seed=2))
    (tmp_path / "test.csv").write_text("text,label\n")
    with pytest.raises(UserError, match=r"the test split \(`.*test.csv`\) has no rows"):
        _load(tmp_path)
    (tmp_path / "test.csv").write_text("")
    with pytest.raises(UserError, match=r"test.csv` is empty"):
        _load(tmp_path)


def test_a_single_file_with_a_header_only_is_named_without_split_jargon(tmp_path):
    """One file given as data.source, a header and no rows, was "the all split (`d.csv`) has no rows"."""
    (tmp_path / "d.csv").write_text("text,label\n")
    with pytest.raises(UserError, match=r"  - `.*d.csv` has no rows \(a header only\); give it rows\.$") as err:
        _load(tmp_path / "d.csv")
    assert "all split" not in str(err.value)


def test_split_emptied_by_cleaning_names_the_step(tmp_path):
    rows = make_rows(3, seed=1)
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "validation.jsonl", rows)  # every row also in train
    write_jsonl(tmp_path / "test.jsonl", make_rows(1, seed=3))
    with pytest.raises(UserError, match=r"validation split is empty after cleaning \(rows removed: leakage 18\)"):
        _load(tmp_path)
    data = _load(tmp_path, cleaning={"leakage": "keep"})
    assert len(data.splits["validation"]) == 18


def test_label_set_differs_between_given_splits(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", make_rows(3, seed=1))
    write_jsonl(tmp_path / "validation.jsonl", make_rows(1, seed=2))
    write_jsonl(tmp_path / "test.jsonl", [r for r in make_rows(1, seed=3) if r["label"] != "love"])
    with pytest.raises(UserError, match=r"label set differs between splits: the test split has no rows of \['love'\]"):
        _load(tmp_path)


def test_label_only_in_an_evaluation_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [r for r in make_rows(3, seed=1) if r["label"] != "fear"])
    write_jsonl(tmp_path / "validation.jsonl", make_rows(1, seed=2))
    write_jsonl(tmp_path / "test.jsonl", make_rows(1, seed=3))
    with pytest.raises(UserError, match=r"\['fear'\] have no training rows"):
        _load(tmp_path)  # names as found: `fear` appears in validation and test only


def test_every_problem_at_once(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", make_rows(3, seed=1))
    (tmp_path / "validation.parquet").write_text("not parquet")
    (tmp_path / "test.jsonl").write_text("{oops\n")
    with pytest.raises(UserError) as err:
        _load(tmp_path)
    assert "validation.parquet" in str(err.value) and "line 1 is not valid JSON" in str(err.value)


def test_null_labels_and_wrong_column_types(tmp_path):
    rows = make_rows(2, seed=1)
    rows[3]["label"] = None
    write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"1 row\(s\) have no label \(rows 4\)"):
        _load(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "d.jsonl", [{"text": {"nested": 1}, "label": "joy"}] * 4)
    with pytest.raises(UserError, match="text column holds struct"):
        _load(tmp_path / "d.jsonl")


def test_no_train_file_in_folder(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", make_rows(1, seed=1))
    write_jsonl(tmp_path / "dev.jsonl", make_rows(1, seed=1))
    with pytest.raises(UserError, match="no train file"):
        _load(tmp_path)


@pytest.mark.parametrize("inside", ["\u2028", "\u2029", "\x85", "\x0c", "\x1c", "\x1e"])
def test_a_txt_text_holding_a_unicode_line_separator_stays_one_row(tmp_path, inside):
    """str.splitlines ends a line at U+2028, U+0085, form feeds and \\x1c-\\x1e too, which pasted web texts hold:
    such a row became two lines and the file was refused (`a line has no ; between text and label`)."""
    rows = make_rows(4, seed=1)
    rows[0]["text"] = rows[0]["text"].replace(" ", f" {inside}", 1)
    (tmp_path / "d.txt").write_text("".join(f"{r['text']};{r['label']}\r\n" for r in rows), encoding="utf-8")
    data = _load(tmp_path / "d.txt")
    assert sum(len(split) for split in data.splits.values()) == len(rows)


# --------------------------------------------------------------------------------------------------
# Random bytes and truncated files: a clear error or a valid dataset, never anything else.

FORMAT_ENDINGS = [".csv", ".tsv", ".jsonl", ".json", ".parquet", ".txt", ".arrow"]


def _valid_file(tmp_path: Path, ending: str) -> bytes:
    import pandas as pd

    rows = make_rows(4, seed=7)
    frame = pd.DataFrame(rows)
    path = tmp_path / f"valid{ending}"
    if ending == ".parquet":
        frame.to_parquet(path)
    elif ending == ".arrow":  # the IPC stream `datasets` writes
        import pyarrow as pa

        table = pa.Table.from_pandas(frame)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    elif ending == ".json":
        path.write_text(json.dumps(rows))
    elif ending == ".txt":
        path.write_text("".join(f"{r['text']};{r['label']}\n" for r in rows))
    elif ending == ".jsonl":
        write_jsonl(path, rows)
    else:
        frame.to_csv(path, index=False, sep="\t" if ending == ".tsv" else ",")
    return path.read_bytes()


def _assert_clear_error_or_valid(path: Path) -> None:
    try:
        data = _load(path)
    except UserError as err:
        assert str(err) and "Traceback" not in str(err)
        return
    assert set(data.splits) == {"train", "validation", "test"}
    assert all(ds.column_names == ["text", "label"] and len(ds) for ds in data.splits.values())
    assert all(label in data.labels for ds in data.splits.values() for label in ds["label"])


@pytest.mark.parametrize("ending", FORMAT_ENDINGS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400))
def test_random_bytes_give_a_clear_error(tmp_path, ending, data):
    path = tmp_path / f"random{ending}"
    path.write_bytes(data)
    _assert_clear_error_or_valid(path)


@pytest.mark.parametrize("ending", FORMAT_ENDINGS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(min_value=0.0, max_value=1.0), flip=st.integers(min_value=-1, max_value=10_000))
def test_truncated_or_corrupted_files_give_a_clear_error_or_a_valid_dataset(tmp_path, ending, cut, flip):
    body = bytearray(_valid_file(tmp_path, ending))
    body = body[: int(len(body) * cut)]
    if 0 <= flip < len(body):
        body[flip] ^= 0xFF  # one corrupted byte as well
    path = tmp_path / f"cut{ending}"
    path.write_bytes(bytes(body))
    _assert_clear_error_or_valid(path)


# --------------------------------------------------------------------------------------------------
# CSV pitfalls that used to pass silently or end in a traceback


def _csv(rows, delimiter=",") -> str:
    return f"text{delimiter}label\n" + "".join(f"{r['text']}{delimiter}{r['label']}\n" for r in rows)


def test_csv_empty_label_cell_is_refused(tmp_path):
    rows = make_rows(3, seed=1)
    rows[2]["label"] = ""
    (tmp_path / "d.csv").write_text(_csv(rows))
    with pytest.raises(UserError, match=r"d.csv`: 1 row\(s\) have no label \(rows 3\): the label is empty, NaN or null"):
        _load(tmp_path / "d.csv")


def test_csv_nan_label_is_refused(tmp_path):
    rows = make_rows(3, seed=1)
    for i in (1, 4, 6, 8, 10, 12, 14):
        rows[i]["label"] = "NaN" if i % 4 else " nan "
    (tmp_path / "d.csv").write_text(_csv(rows))
    with pytest.raises(UserError, match=r"7 row\(s\) have no label \(rows 2, 5, 7, 9, 11 and 2 more\)"):
        _load(tmp_path / "d.csv")


def test_nan_float_label_is_a_missing_label_at_its_row(tmp_path):
    rows = [{"text": r["text"], "label": float(LABELS.index(r["label"]))} for r in make_rows(3, seed=1)]
    rows[4]["label"] = float("nan")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN
    with pytest.raises(UserError, match=r"1 row\(s\) have no label \(rows 5\): the label is empty, NaN or null"):
        _load(tmp_path / "d.jsonl", label_names=LABELS)
    rows[4]["label"] = 2.5
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"fractional numbers \(rows 5, e.g. 2.5\)"):
        _load(tmp_path / "d.jsonl", label_names=LABELS)


def test_csv_unclosed_quote_that_swallows_a_row_is_refused(tmp_path):
    lines = [f"{r['text']},{r['label']}" for r in make_rows(14, seed=1)[:81]]
    lines[10] = '"' + lines[10]  # never closed here; the quote on the next line closes it
    lines[11] = lines[11].replace(",", '",')
    (tmp_path / "d.csv").write_text("text,label\n" + "\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"d.csv` lines 12-13: a quoted field runs from line 12 to line 13 and swallows "
                                        r"line 12 \('.*'\), which looks like a row of its own.*never closed"):
        _load(tmp_path / "d.csv")


def test_tsv_written_without_quoting_keeps_its_quotes_as_text(tmp_path, capsys):
    """GLUE's TSV files are written without quoting (its readers use quotechar=None): a sentence that opens with a
    quote it never closes swallowed the rows after it and the file was refused, with a fix (`""`) no one can make to
    a published dataset. A TSV whose fields are never wrapped in quotes whole is read with quotes as text, with a note;
    one that quotes its fields and has one quote wrong keeps its error."""
    rows = make_rows(5, seed=1)
    rows[4]["text"] = '" opens a quote it never closes'
    rows[9]["text"] = 'a "quoted" word'
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in rows))
    data = _load(tmp_path / "train.tsv")
    texts = {t for ds in data.splits.values() for t in ds["text"]}
    assert {'" opens a quote it never closes', 'a "quoted" word'} <= texts and len(texts) == 30
    assert "read with quotes as part of the text" in capsys.readouterr().out
    rows[0]["text"] = '"a field quoted whole"'
    (tmp_path / "quoted.tsv").write_text("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in rows))
    with pytest.raises(UserError, match=r"quoted.tsv` lines 6-11: a quoted field runs from line 6"):
        _load(tmp_path / "quoted.tsv")


def test_csv_unclosed_quote_to_the_end_of_the_file_names_its_line(tmp_path):
    lines = [f"{r['text']},{r['label']}" for r in make_rows(3, seed=1)]
    lines[4] = '"' + lines[4]
    (tmp_path / "d.csv").write_text("text,label\n" + "\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"lines 6-19 are one row of 1 field\(s\) .*quote \(`\"`\) on line 6 is probably never closed"):
        _load(tmp_path / "d.csv")


def test_csv_quoted_field_that_spans_lines_is_noted_with_its_line(tmp_path, capsys):
    rows = make_rows(3, seed=1)
    rows[3]["text"] = '"first line\nsecond line, still the same text"'
    (tmp_path / "d.csv").write_text(_csv(rows))
    data = _load(tmp_path / "d.csv")
    assert data.report["rows_read"] == {"all": 18}
    note = "1 row(s) have a quoted field that spans lines (rows starting on lines 5)"
    assert any(note in n for n in data.report["notes"]) and note in capsys.readouterr().out


def test_duplicated_header_column_names_the_column_and_file(tmp_path):
    rows = make_rows(2, seed=1)
    (tmp_path / "d.csv").write_text("text,label,label\n" + "".join(f"{r['text']},{r['label']},x\n" for r in rows))
    with pytest.raises(UserError, match=r"d.csv` has 2 columns named `label` \(columns: text, label, label\).*Rename"):
        _load(tmp_path / "d.csv")
    write_jsonl(tmp_path / "d.jsonl", make_rows(2, seed=1))
    (tmp_path / "d.tsv").write_text("text\ttext\tlabel\n" + "".join(f"a\tb\t{r['label']}\n" for r in rows))
    with pytest.raises(UserError, match=r"d.tsv` has 2 columns named `text`"):
        _load(tmp_path / "d.tsv")


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_csv_rows_longer_than_arrows_block_are_read(tmp_path, delimiter):
    rows = make_rows(3, seed=1)
    rows[3]["text"] = "word " * 400_000  # 2 MB: over Arrow's 1 MB block and the csv module's 128 KiB field limit
    path = tmp_path / ("d.tsv" if delimiter == "\t" else "d.csv")
    path.write_text(_csv(rows, delimiter))
    data = _load(path, cleaning={"duplicates": "keep"})
    assert max(len(t) for ds in data.splits.values() for t in ds["text"]) == len("word " * 400_000) - 1


def test_csv_long_field_does_not_hide_the_real_problem(tmp_path):
    rows = make_rows(3, seed=1)
    rows[3]["text"] = "word " * 400_000
    (tmp_path / "d.csv").write_text(_csv(rows) + "one,two,three\n")
    with pytest.raises(UserError, match=r"line 20 has 3 fields, the header has 2"):
        _load(tmp_path / "d.csv")


def test_unknown_label_in_test_shows_example_rows(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", make_rows(3, seed=1))
    write_jsonl(tmp_path / "validation.jsonl", make_rows(1, seed=2))
    test = make_rows(1, seed=3) + [{"text": "so bored of waiting", "label": "boredom"}]
    write_jsonl(tmp_path / "test.jsonl", test)
    with pytest.raises(UserError, match=r"labels \['boredom'\] have no training rows but occur in the test split "
                                        r"`.*test.jsonl` \(row 7: 'boredom' 'so bored of waiting'\)"):
        _load(tmp_path)


def test_too_few_rows_to_split_says_how_many_are_needed(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", make_rows(1, seed=1)[:3])
    with pytest.raises(UserError, match=r"has 3 row\(s\) left after cleaning, too few to split .* data.validation_size=0.1 "
                                        r"and data.test_size=0.1: that needs at least 6 rows"):
        _load(tmp_path / "d.jsonl")
    one_row = [{"text": "so happy today", "label": "joy"}]
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", one_row)
    write_jsonl(tmp_path / "folder" / "validation.jsonl", one_row)
    with pytest.raises(UserError, match=r"train split has 1 row\(s\) left after cleaning, too few to hold data.test_size=0.1"):
        _load(tmp_path / "folder")


def test_a_csv_without_a_header_says_so(tmp_path):
    """AG News', Yelp's and DBpedia's CSVs have no header, and Excel may write a `sep=;` line above it: both were told
    to 'set data.text_column / data.label_column to the right names', which no name fixes."""
    rows = make_rows(3, seed=1)
    (tmp_path / "train.csv").write_text("".join(f'"{i % 4 + 1}","{r["text"]}"\n' for i, r in enumerate(rows)))
    with pytest.raises(UserError, match=r"The first line looks like a row, not a header \('1', .*add a header line naming "
                                        r"the 2 columns \(e.g. `label,text`\)"):
        _load(tmp_path / "train.csv")
    (tmp_path / "excel.csv").write_text("sep=;\ntext;label\n" + "".join(f"{r['text']};{r['label']}\n" for r in rows))
    with pytest.raises(UserError, match=r"first line `sep=` is Excel's delimiter hint, not the header: remove that line"):
        _load(tmp_path / "excel.csv")
    (tmp_path / "named.csv").write_text("Sentence,Emotion\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows))
    with pytest.raises(UserError, match=r"columns found: Sentence, Emotion\)\. Set data.text_column / data.label_column"):
        _load(tmp_path / "named.csv")  # names that look like names keep the plain fix


def test_a_label_named_like_the_invalid_answer_is_refused_with_a_spelling_that_works(tmp_path):
    """A data set labelled VALID / INVALID trained and measured: a reply that named no label was read as INVALID, the
    word emotune writes for such replies, so it scored as a right answer of that label, and the confusion matrix (one
    more INVALID column) lost the label's row."""
    from emotune.eval.evaluate import compute_metrics

    rows = [{"text": f"input number {i}", "label": ["VALID", "INVALID"][i % 2]} for i in range(60)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"a label is named 'INVALID'.*data\.label_names \(e\.g\. \['invalid', 'VALID'\]\)"):
        _load(path)
    data = _load(path, label_names=["invalid", "VALID"])  # the spelling the message gives
    assert data.labels == ["invalid", "VALID"]
    gold = list(data.splits["test"]["label"])
    metrics = compute_metrics(gold, ["INVALID"] * len(gold), data.labels)  # a model that never names a label
    assert metrics["accuracy"] == 0 and metrics["invalid"] == len(gold)
