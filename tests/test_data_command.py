"""`emotune data`: validates with the tokenizer only, writes run_dir/data/, which `emotune run` reuses;
nothing is written when validation fails. Plus the real emotion dataset's known leakage (when present)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import LABELS, make_rows, write_jsonl
from emotune.cli import main
from emotune.core.config.data import DataConfig

# The research-only emotion dataset beside the checkout (../shared/datasets/emotion), or where
# EMOTUNE_EMOTION_DATA points; never copied into the project.
REAL_EMOTION = Path(os.environ.get("EMOTUNE_EMOTION_DATA") or Path(__file__).resolve().parents[2] / "shared" / "datasets" / "emotion")


def _data_overrides(tiny_model_dir, source, tmp_path) -> list[str]:
    return [f"model.source={tiny_model_dir}", f"data.source={source}", f"output_dir={tmp_path / 'runs'}", "name=d"]


def test_data_command_writes_the_prepared_folder(tiny_model_dir, data_dir, tmp_path, capsys):
    assert main(["data", *_data_overrides(tiny_model_dir, data_dir, tmp_path), "data.balance=class_weight"]) == 0
    out = capsys.readouterr().out
    assert "token lengths" in out and "p95" in out and "cleaning:" in out and "class weights" in out
    folder = tmp_path / "runs" / "d" / "data"
    report = json.loads((folder / "data_report.json").read_text())
    assert report["rows"] == {"train": 36, "validation": 12, "test": 12}
    assert report["label_counts"]["test"] == {label: 2 for label in sorted(LABELS)}
    assert report["token_lengths"]["train"]["max"] == 5  # the fixture rows are five words, one token each
    assert set(report["cleaning"]) >= {"changed", "dropped"} and report["class_weights"]
    assert (folder / "label_distribution.png").stat().st_size > 1000
    assert pq.read_table(folder / "train.parquet").num_rows == 36
    assert not (tmp_path / "runs" / "d" / "run.json").exists()  # no weights, no run: data only


def test_data_command_writes_nothing_when_validation_fails(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": "joy"}\n{"text": broken}\n')
    assert main(["data", *_data_overrides(tiny_model_dir, bad, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "line 2 is not valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_run_reuses_the_prepared_data(tiny_overrides, tmp_path, capsys, monkeypatch):
    assert main(["data", *tiny_overrides]) == 0
    prepared = tmp_path / "runs" / "tiny" / "data" / "data_report.json"
    created = json.loads(prepared.read_text())["created"]
    capsys.readouterr()

    import emotune.data.prepare as prepare

    def refuse(*args, **kwargs):
        raise AssertionError("the data should have been reused, not loaded again")

    monkeypatch.setattr(prepare, "load_data", refuse)
    assert main(["run", *tiny_overrides]) == 0
    assert "Reusing the prepared data" in capsys.readouterr().out
    assert json.loads(prepared.read_text())["created"] == created  # left as `emotune data` wrote it


def test_changed_data_config_is_not_reused(tiny_model_dir, data_dir, tmp_path, capsys):
    args = _data_overrides(tiny_model_dir, data_dir, tmp_path)
    assert main(["data", *args]) == 0
    assert main(["data", *args, "data.test_limit=6"]) == 0
    report = json.loads((tmp_path / "runs" / "d" / "data" / "data_report.json").read_text())
    assert report["rows"]["test"] == 6


def test_chinese_labels_through_emotune_data(tiny_zh_labels_dir, tmp_path, capsys):
    names = ["喜悦", "愤怒", "悲伤"]
    for seed, split in enumerate(("train", "validation", "test")):
        rows = [{"text": f"{r['text']} {seed}", "label": names[LABELS.index(r["label"]) % 3]} for r in make_rows(2, seed)]
        write_jsonl(tmp_path / f"{split}.jsonl", rows)
    assert main(["data", *_data_overrides(tiny_zh_labels_dir, tmp_path, tmp_path), "data.label_names=[喜悦, 愤怒, 悲伤]"]) == 0
    assert "喜悦" in capsys.readouterr().out
    report = json.loads((tmp_path / "runs" / "d" / "data" / "data_report.json").read_text(encoding="utf-8"))
    assert report["labels"] == names and report["label_counts"]["train"] == {n: 4 for n in names}


@pytest.mark.skipif(not REAL_EMOTION.is_dir(), reason="the emotion dataset is not on this machine")
def test_real_emotion_dataset_known_leakage_and_duplicates():
    from emotune.data import load_data

    data = load_data(DataConfig(source=str(REAL_EMOTION), label_names=["sadness", "joy", "love", "anger", "fear", "surprise"],
                                cleaning={"duplicates": "exact", "leakage": "exact"}), seed=0)
    dropped = data.report["cleaning"]["dropped"]
    assert dropped["leakage"]["test"] == 11  # the dataset README: 11 test texts also occur in train
    assert dropped["duplicates"]["train"] == 31  # and 31 duplicate texts inside train
    assert data.report["rows"]["test"] == 2000 - 11
    train = set(data.splits["train"]["text"])
    assert not train & set(data.splits["test"]["text"]) and not train & set(data.splits["validation"]["text"])


def test_labels_the_tokenizer_cannot_tell_apart_are_refused_before_any_weights_load(tiny_model_dir, tmp_path, capsys):
    """The fixture tokenizer reads words it lacks (an emoji, another script) as its unknown token: such labels were
    trained as one answer and tied in scoring, without a word."""
    rows = [{"text": r["text"], "label": {"joy": "😀", "sadness": "حزن", "fear": "恐惧"}.get(r["label"], r["label"])}
            for r in make_rows(3, seed=1)]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    assert main(["data", *_data_overrides(tiny_model_dir, source, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'حزن', '恐惧', '😀' are the same tokens to this model's tokenizer" in err and "data.label_aliases" in err
    assert not (tmp_path / "runs" / "d" / "data").exists()
    aliases = "data.label_aliases={😀: joy, حزن: sadness, 恐惧: fear}"
    assert main(["data", *_data_overrides(tiny_model_dir, source, tmp_path), aliases]) == 0


def test_chinese_labels_through_a_whole_run(tiny_zh_labels_dir, tiny_overrides, tmp_path):
    names = ["喜悦", "愤怒", "悲伤"]
    folder = tmp_path / "zh"
    folder.mkdir()
    for seed, split in enumerate(("train", "validation", "test")):
        rows = [{"text": f"{r['text']} {seed}", "label": names[LABELS.index(r["label"]) % 3]} for r in make_rows(2, seed)]
        write_jsonl(folder / f"{split}.jsonl", rows)
    overrides = [o for o in tiny_overrides if not o.startswith(("data.source=", "data.label_names=", "model.source="))]
    assert main(["run", *overrides, f"data.source={folder}", "data.label_names=[喜悦, 愤怒, 悲伤]",
                 f"model.source={tiny_zh_labels_dir}"]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    meta = json.loads((run_dir / "adapter" / "emotune.json").read_text(encoding="utf-8"))
    assert meta["labels"] == names and "喜悦, 愤怒, 悲伤" in meta["system_prompt"]
    metrics = json.loads((run_dir / "finetuned" / "metrics.json").read_text(encoding="utf-8"))
    assert set(metrics["per_class"]) == set(names) and metrics["rows"] == 12


def test_data_command_never_swaps_the_data_under_an_existing_run(tiny_model_dir, data_dir, tmp_path, capsys):
    args = _data_overrides(tiny_model_dir, data_dir, tmp_path)
    assert main(["data", *args]) == 0
    (tmp_path / "runs" / "d" / "run.json").write_text('{"status": "finished"}')  # a run used this data
    assert main(["data", *args, "data.test_limit=6"]) == 2
    assert "holds a finished run made with other data" in capsys.readouterr().err
    report = json.loads((tmp_path / "runs" / "d" / "data" / "data_report.json").read_text())
    assert report["rows"]["test"] == 12  # untouched
    assert main(["data", *args, "data.test_limit=6", "overwrite=true"]) == 0
    assert not (tmp_path / "runs" / "d" / "run.json").exists()


def test_token_length_percentiles_are_rounded_in_the_report():
    from types import SimpleNamespace

    from datasets import Dataset

    from emotune.core.config.load import load_config
    from emotune.data.prepare import token_length_stats

    def words(texts, add_special_tokens):  # one token per word
        return {"input_ids": [text.split() for text in texts]}

    lengths = [3, 5, 8, 13, 21, 17, 4, 9, 2, 30]  # numpy's p95 of these is 25.94999999999999
    data = SimpleNamespace(splits={"train": Dataset.from_dict({"text": ["w " * n for n in lengths]})})
    stats = token_length_stats(data, words, load_config(None, []))["train"]
    assert stats["p50"] == 8.5 and stats["p95"] == 25.9 and stats["p99"] == 29.2
    assert all(len(repr(v).partition(".")[2]) <= 1 for v in stats.values())


def test_a_prompt_longer_than_max_length_is_refused_before_training_learns_nothing(tiny_model_dir, data_dir, tmp_path,
                                                                                   capsys):
    """With train.max_length below the prompt's own length every row lost its label: the run trained on no answer
    token (loss 0.0000), printed two warnings and reported the base model as the trained one."""
    from datasets import Dataset

    from emotune.core.config.data import PromptConfig
    from emotune.core.config.model import ModelConfig
    from emotune.core.errors import UserError
    from emotune.model.loading import load_tokenizer
    from emotune.tasks.classify.task import encode_examples

    assert main(["data", *_data_overrides(tiny_model_dir, data_dir, tmp_path), "train.max_length=16"]) == 2
    err = capsys.readouterr().err
    assert "take 55 tokens before any text" in err and "train.max_length=16" in err
    assert not (tmp_path / "runs" / "d" / "data").exists()
    tokenizer = load_tokenizer(tiny_model_dir, ModelConfig())
    rows = Dataset.from_list(make_rows(1, seed=1))
    with pytest.raises(UserError, match="Every one of the 6 rows lost its label"):
        encode_examples(rows, tokenizer, PromptConfig(), LABELS, max_length=16)
    assert len(encode_examples(rows, tokenizer, PromptConfig(), LABELS, max_length=256)) == 6


@pytest.mark.parametrize(("command", "made"), [(["data"], "the run folder"), (["run"], "the run folder"),
                                               (["eval"], "the results folder"),
                                               (["sweep", "--grid", "lora.r=2,4"], "the sweep folder")])
@pytest.mark.parametrize("where", ["output_dir", "output_dir/name"])
def test_a_file_where_the_output_folder_goes_is_refused_by_name(tiny_model_dir, data_dir, tmp_path, capsys, command,
                                                                made, where):
    """output_dir (or the run folder itself) naming an existing file ended in FileExistsError or NotADirectoryError
    tracebacks; `emotune eval` measured the model first and failed only when writing its results."""
    runs = tmp_path / "runs"
    file = runs if where == "output_dir" else runs / ("d-sweep" if command[0] == "sweep" else "d")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text("not a folder")
    assert main([command[0], *_data_overrides(tiny_model_dir, data_dir, tmp_path), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("emotune: error: ") and f"`{file}` is a file, so {made}" in err and "Traceback" not in err
    assert file.read_text() == "not a folder"


def test_a_run_folder_inside_another_run_s_folder_is_refused(tiny_model_dir, data_dir, tmp_path, capsys):
    """`output_dir=runs/d name=adapter` wrote its config.yaml and data/ into the run `runs/d`'s adapter folder."""
    overrides = _data_overrides(tiny_model_dir, data_dir, tmp_path)
    assert main(["data", *overrides]) == 0
    first = tmp_path / "runs" / "d"
    (first / "run.json").write_text('{"status": "finished"}')  # a run's folder, as `emotune run` leaves it
    assert main(["data", *overrides, f"output_dir={first}", "name=adapter"]) == 2
    assert f"would be inside the run folder `{first.resolve()}`" in capsys.readouterr().err
    assert not (first / "adapter").exists()


def test_a_run_folder_that_holds_other_files_is_refused(tiny_model_dir, data_dir, tmp_path, capsys):
    """`name=` a project folder (or output_dir=. name=.) wrote the run's config.yaml and data/ among the user's files,
    and a later overwrite=true moved the folder aside and deleted it, the user's files with it, once the new run
    finished. An empty folder, or one holding a run's files only, is still taken."""
    overrides = _data_overrides(tiny_model_dir, data_dir, tmp_path)
    project = tmp_path / "runs" / "d"
    (project / "src").mkdir(parents=True)
    (project / "notes.md").write_text("mine")
    for extra in ([], ["overwrite=true"]):
        assert main(["data", *overrides, *extra]) == 2
        err = capsys.readouterr().err
        assert "already holds files that are not a run's (`notes.md`, `src`)" in err and "Traceback" not in err
    assert sorted(p.name for p in project.iterdir()) == ["notes.md", "src"]
    (project / "config.yaml").write_text("my: project\n")  # a project's own config.yaml makes it no run folder
    assert main(["data", *overrides]) == 2
    assert "already holds files that are not a run's (`notes.md`, `src`)" in capsys.readouterr().err
    (project / "config.yaml").unlink()
    for name in ("notes.md", "src"):
        (project / name).unlink() if name == "notes.md" else (project / name).rmdir()
    (project / ".DS_Store").write_text("")
    assert main(["data", *overrides]) == 0
    assert main(["data", *overrides, "overwrite=true"]) == 0  # its own folder, prepared before
