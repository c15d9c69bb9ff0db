"""`emotune predict RUN --file FILE` reads the file with the data layer's readers (emotune.data.read), as training
reads its data: Parquet, Arrow/Feather, compressed files, spreadsheets' UTF-16 exports, save_to_disk folders, a
text column named in other capitals, cells as written. Every row is answered in the file's order, every column kept;
the probabilities are those of the same texts given as arguments, so what is checked is which texts were read."""

from __future__ import annotations

import csv
import gzip
import json

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from conftest import LABELS
from emotune.cli import main

TEXTS = ["i am so happy today", "my friend was furious", "lonely and lost this morning"]
GOLD = ["joy", "anger", "sadness"]


def _argument_probs(run, texts, capsys) -> list[dict]:
    """Each text's probabilities, the texts given as arguments."""
    assert main(["predict", str(run), *texts]) == 0
    return [json.loads(line)["probs"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def _predicted(run, source, tmp_path) -> list[dict]:
    out = tmp_path / "out.csv"
    assert main(["predict", str(run), "--file", str(source), "--out", str(out), "--batch-size", "2"]) == 0
    with out.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _same_probs(rows: list[dict], expected: list[dict]) -> None:
    assert len(rows) == len(expected)
    for row, probs in zip(rows, expected, strict=True):
        for label in LABELS:
            assert float(row[f"p_{label}"]) == pytest.approx(probs[label], abs=1e-5)


def _table() -> pa.Table:
    return pa.table({"id": pa.array([1, 2, 3], pa.int64()), "text": TEXTS, "label": GOLD})


def test_predict_reads_a_parquet_file(tiny_run_dir, tmp_path, capsys):
    """A Parquet file (a hub dataset's test split, the file the run trained on) was refused: `unsupported type
    .parquet`."""
    source = tmp_path / "test.parquet"
    pq.write_table(_table(), source)
    expected = _argument_probs(tiny_run_dir, TEXTS, capsys)
    rows = _predicted(tiny_run_dir, source, tmp_path)
    assert [(r["id"], r["text"], r["label"]) for r in rows] == list(zip(["1", "2", "3"], TEXTS, GOLD, strict=True))
    assert all(r["predicted_label"] in LABELS for r in rows)  # the gold label kept, the prediction beside it
    _same_probs(rows, expected)


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_predict_reads_an_arrow_file(tiny_run_dir, tmp_path, capsys, kind):
    """An Arrow IPC stream (`datasets`' cache and save_to_disk files, .arrow) or file (Feather v2) was refused:
    `unsupported type .arrow`."""
    if kind == "stream":
        source = tmp_path / "data-00000-of-00001.arrow"
        with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_stream(sink, _table().schema) as writer:
            writer.write_table(_table())
    else:
        source = tmp_path / "test.feather"
        feather.write_feather(_table(), source)
    expected = _argument_probs(tiny_run_dir, TEXTS, capsys)
    rows = _predicted(tiny_run_dir, source, tmp_path)
    assert [r["text"] for r in rows] == TEXTS and [r["id"] for r in rows] == ["1", "2", "3"]
    _same_probs(rows, expected)


def test_predict_finds_a_text_column_named_in_other_capitals(tiny_run_dir, tmp_path, capsys):
    """A spreadsheet's header `Text` was refused as `no column text`, though training reads it as the text column."""
    source = tmp_path / "in.csv"
    with source.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["Id", "Text"], *[[i, t] for i, t in enumerate(TEXTS)]])
    expected = _argument_probs(tiny_run_dir, TEXTS, capsys)
    rows = _predicted(tiny_run_dir, source, tmp_path)
    assert "read the column `Text` as text" in capsys.readouterr().out
    assert [r["Text"] for r in rows] == TEXTS and [r["Id"] for r in rows] == ["0", "1", "2"]
    _same_probs(rows, expected)


@pytest.mark.parametrize("export", ["csv", "utf-16 tsv"])
def test_predict_keeps_cells_that_look_like_numbers_as_written(tiny_run_dir, tmp_path, capsys, export):
    """Texts and ids such as `007`, `1.50` or a date are scored and written back as written, never as the numbers
    they look like (7, 1.5); also in a spreadsheet's "Unicode text" export (UTF-16, tab-separated), which was refused
    as undecodable."""
    texts, ids = ["007", "1.50", "2020-01-02", "1e5"], ["0012", "0013", "0014", "0015"]
    if export == "csv":
        source = tmp_path / "in.csv"
        with source.open("w", newline="", encoding="utf-8") as handle:
            csv.writer(handle).writerows([["id", "text"], *zip(ids, texts, strict=True)])
    else:
        source = tmp_path / "in.tsv"
        lines = ["id\ttext", *(f"{i}\t{t}" for i, t in zip(ids, texts, strict=True))]
        source.write_bytes("\r\n".join(lines).encode("utf-16"))  # with its byte-order mark, as Excel writes it
    expected = _argument_probs(tiny_run_dir, texts, capsys)
    rows = _predicted(tiny_run_dir, source, tmp_path)
    assert [r["text"] for r in rows] == texts and [r["id"] for r in rows] == ids
    _same_probs(rows, expected)


def test_predict_reads_compressed_files_and_json_arrays_under_jsonl(tiny_run_dir, tmp_path, capsys):
    """A gzipped CSV (train.csv.gz, as hubs ship them) and a JSON array saved as .jsonl (which `datasets` reads) were
    refused; a `.ndjson` file too."""
    expected = _argument_probs(tiny_run_dir, TEXTS, capsys)
    gzipped = tmp_path / "in.csv.gz"
    gzipped.write_bytes(gzip.compress(("text\n" + "\n".join(TEXTS) + "\n").encode("utf-8")))
    array = tmp_path / "in.jsonl"
    array.write_text(json.dumps([{"text": t, "n": i} for i, t in enumerate(TEXTS)]), encoding="utf-8")
    ndjson = tmp_path / "in.ndjson"
    ndjson.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    for source in (gzipped, array, ndjson):
        rows = _predicted(tiny_run_dir, source, tmp_path)
        assert [r["text"] for r in rows] == TEXTS, source
        _same_probs(rows, expected)


def test_predict_reads_a_labelled_txt_file_as_training_does(tiny_run_dir, tmp_path, capsys):
    """The emotion dataset's `text;label` TXT files, which a classifier trains on: its text is the part before the
    last `;`, the label kept beside the prediction, every row in order (duplicates too: nothing is cleaned away)."""
    texts = [*TEXTS, TEXTS[0]]
    source = tmp_path / "test.txt"
    source.write_text("".join(f"{t};{g}\n" for t, g in zip(texts, [*GOLD, "joy"], strict=True)), encoding="utf-8")
    expected = _argument_probs(tiny_run_dir, texts, capsys)
    rows = _predicted(tiny_run_dir, source, tmp_path)
    assert [(r["text"], r["label"]) for r in rows] == list(zip(texts, [*GOLD, "joy"], strict=True))
    _same_probs(rows, expected)


def test_predict_reads_one_split_of_a_save_to_disk_folder(tiny_run_dir, tmp_path, capsys):
    """A DatasetDict written by save_to_disk: its root names its splits, a split's folder is read whole."""
    import datasets

    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x", "y"]}),
                          "test": datasets.Dataset.from_dict({"text": TEXTS, "id": [7, 8, 9]})}).save_to_disk(str(folder))
    out = tmp_path / "out.csv"
    assert main(["predict", str(tiny_run_dir), "--file", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "save_to_disk folder of the splits test, train" in err and f"--file {folder / 'test'}" in err
    assert not out.exists()
    expected = _argument_probs(tiny_run_dir, TEXTS, capsys)
    rows = _predicted(tiny_run_dir, folder / "test", tmp_path)
    assert [r["text"] for r in rows] == TEXTS and [r["id"] for r in rows] == ["7", "8", "9"]
    _same_probs(rows, expected)


def test_a_damaged_file_is_one_clear_error_and_the_output_is_kept(tiny_run_dir, tmp_path, capsys):
    """A Parquet file cut short is refused with what to check, before weights load; the --out of an earlier good run
    is left as it was."""
    source = tmp_path / "test.parquet"
    pq.write_table(_table(), source)
    source.write_bytes(source.read_bytes()[:-40])
    out = tmp_path / "out.csv"
    out.write_text("text,label\nearlier,joy\n", encoding="utf-8")
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"`{source}` is not a readable Parquet file" in err and "fully downloaded" in err
    assert out.read_text(encoding="utf-8") == "text,label\nearlier,joy\n"
    workbook = tmp_path / "test.xlsx"  # not a format emotune reads: what to save it as, and where to point predict
    workbook.write_bytes(b"PK\x03\x04")
    assert main(["predict", str(tiny_run_dir), "--file", str(workbook), "--out", str(out)]) == 2
    assert "Save the sheet as CSV" in (err := capsys.readouterr().err) and "`emotune predict --file`" in err
    assert out.read_text(encoding="utf-8") == "text,label\nearlier,joy\n"


@pytest.mark.parametrize(("case", "says"), [("--out is --file", "is the --file being read"),
                                             ("header only", "holds no rows"), ("empty JSON array", "holds no rows"),
                                             ("--out without --file", "where the predictions of a --file go")])
def test_predict_refuses_what_it_cannot_do_and_leaves_the_input_as_it_was(tiny_run_dir, tmp_path, capsys, monkeypatch,
                                                                         case, says):
    """`--out` naming the --file itself replaced the input with the predictions; a file with a header and no rows
    ended in an IndexError traceback from the tokenizer; `--out` with texts as arguments was ignored, exit 0 and
    no file written."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / ("e.json" if case == "empty JSON array" else "in.csv")
    text = {"header only": "text\n", "empty JSON array": "[]"}.get(case, "text\nhappy joy day\n")
    source.write_text(text, encoding="utf-8")
    files = ["--file", source.name, "--out", {"--out is --file": f"./{source.name}"}.get(case, "out.csv")]
    argv = ["predict", str(tiny_run_dir), *(["a text", "--out", "out.csv"] if case == "--out without --file" else files)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("emotune: error: ") and says in err and "Traceback" not in err
    assert source.read_text(encoding="utf-8") == text and not (tmp_path / "out.csv").exists()


def test_predict_reads_the_column_the_run_trained_on_by_default(tiny_model_dir, tmp_path, capsys):
    """A run trained with data.text_column=sentence was refused on a file like its own data ('no column `text`') until
    --text-column was given: the default is the column the run trained on (emotune.json's `text_column`)."""
    from conftest import write_tiny_adapter

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "runs" / "sentences", overrides=["data.text_column=sentence"])
    source = tmp_path / "test.parquet"
    pq.write_table(pa.table({"sentence": TEXTS, "label": GOLD}), source)
    expected = _argument_probs(run, TEXTS, capsys)
    rows = _predicted(run, source, tmp_path)
    assert [r["sentence"] for r in rows] == TEXTS
    _same_probs(rows, expected)


def test_predict_reads_a_file_in_the_encoding_its_run_read_data_in_or_in_the_one_given(tiny_model_dir, tiny_run_dir,
                                                                                      tmp_path, capsys):
    """predict read every file as UTF-8: a run trained on GBK files (data.encoding=gbk) had a file like its own data
    refused ("byte 0xbd is not valid utf-8 ... set data.encoding", a setting predict does not read)."""
    from conftest import write_tiny_adapter

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "runs" / "gbk", overrides=["data.encoding=gbk"])
    texts = ["今天很开心", "我的朋友很生气"]
    source = tmp_path / "test.csv"
    source.write_text("text\n" + "\n".join(texts) + "\n", encoding="gbk")
    expected = _argument_probs(run, texts, capsys)
    rows = _predicted(run, source, tmp_path)
    assert [r["text"] for r in rows] == texts
    _same_probs(rows, expected)
    out = str(tmp_path / "other.csv")
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", out]) == 2  # a UTF-8 run
    assert "is not valid utf-8" in capsys.readouterr().err
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", out, "--encoding", "gbk"]) == 0
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", out, "--encoding", "klingon"]) == 2
    assert "--encoding `klingon` is not an encoding Python knows" in capsys.readouterr().err
    assert main(["predict", str(tiny_run_dir), "so happy", "--encoding", "gbk"]) == 2
    assert "--encoding is the text encoding of --file" in capsys.readouterr().err
