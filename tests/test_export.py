"""`emotune export` (adapter, merged model, vLLM hand-off) and `emotune predict`, on the tiny model."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import torch

from conftest import LABELS, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.deploy.export import export, max_lora_rank, merge_parity_gap
from emotune.model.artifacts import find_artifact

TEXTS = ["i am so happy today", "my friend was furious", "lonely and lost this morning"]


def test_merged_model_matches_base_plus_adapter(tiny_run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(tiny_run_dir), "--merge", "--vllm", "--dtype", "float32", "--out", str(out)]) == 0
    for name in ("adapter/adapter_model.safetensors", "adapter/emotune.json", "adapter/chat_template.jinja",
                 "merged/model.safetensors", "merged/config.json", "merged/generation_config.json",
                 "merged/tokenizer.json", "merged/chat_template.jinja", "merged/emotune.json", "config.yaml",
                 "vllm/serve_lora.sh", "vllm/serve_merged.sh", "vllm/client.py"):
        assert (out / name).is_file(), name
    assert not list(tmp_path.glob("export*.partial"))

    # the adapter really moves the logits, so a merge that dropped it would fail the parity check below
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(find_artifact(tiny_run_dir).model_cfg.source, dtype=torch.float32)
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-3

    assert merge_parity_gap(tiny_run_dir, TEXTS, merged_dir=out / "merged") < 1e-4
    assert merge_parity_gap(tiny_run_dir, TEXTS) < 1e-4
    generation = json.loads((out / "merged" / "generation_config.json").read_text())
    assert 5 in generation["eos_token_id"]  # <end_of_turn> ends a chat turn


def test_merge_keeps_the_base_dtype_by_default(tiny_run_dir, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(tiny_run_dir), "--merge", "--out", str(out)]) == 0
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["dtype"] == "float32"  # the tiny base is saved in fp32
    assert not (out / "vllm").exists()


def test_vllm_launch_scripts_pass_the_right_flags(tiny_run_dir, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(tiny_run_dir), "--merge", "--vllm", "--out", str(out)]) == 0
    # a stand-in `vllm` that prints its arguments shows what the scripts really run, paths resolved
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "vllm").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake_bin / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}

    lora = subprocess.run(["bash", str(out / "vllm" / "serve_lora.sh"), "--port", "8001"], env=env,
                          capture_output=True, text=True, check=True).stdout.splitlines()
    model_dir = find_artifact(tiny_run_dir).model_cfg.source
    assert lora[:2] == ["serve", str(model_dir)]
    assert lora[lora.index("--lora-modules") + 1] == f"tiny={out.resolve()}/adapter"
    assert lora[lora.index("--max-lora-rank") + 1] == "8"  # r=4 rounds up to vLLM's smallest rank above 1
    assert "--enable-lora" in lora and lora[-2:] == ["--port", "8001"]
    assert lora[lora.index("--chat-template") + 1] == f"{out.resolve()}/adapter/chat_template.jinja"

    merged = subprocess.run(["bash", str(out / "vllm" / "serve_merged.sh")], env=env, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    assert merged[:2] == ["serve", f"{out.resolve()}/merged"]
    assert merged[merged.index("--served-model-name") + 1] == "tiny"

    client = (out / "vllm" / "client.py").read_text()
    compile(client, "client.py", "exec")
    assert '{"structured_outputs": {"choice": LABELS}}' in client and f"LABELS = {LABELS!r}" in client


def test_the_vllm_client_cleans_a_text_as_the_training_rows_were(tiny_run_dir, tmp_path):
    """vLLM receives a text as sent; the exported client cleans it first, as `emotune serve` does (the run's
    recorded steps: by default control characters removed, whitespace collapsed, NFC)."""
    out = export(tiny_run_dir, out=tmp_path / "export", vllm=True)
    spec = importlib.util.spec_from_file_location("client_cleaning", out / "vllm" / "client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.CLEANING == find_artifact(tiny_run_dir).meta["cleaning"]
    sent = []

    class Completions:
        def create(self, **request):
            sent.append(request["messages"][-1]["content"])
            return type("Reply", (), {"choices": [type("Choice", (), {"message": type("M", (), {"content": "x"})})]})

    client = type("Client", (), {"chat": type("Chat", (), {"completions": Completions()})})
    module.classify(client, "i\u200b am\n\n  so happy ")
    assert sent == [module.USER_TEMPLATE.replace("{text}", "i am so happy")]


def test_a_newline_in_the_export_path_cannot_put_a_command_into_the_launch_script(tiny_run_dir, tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / f"export\ntouch {marker}\nend"
    assert main(["export", str(tiny_run_dir), "--vllm", "--out", str(out)]) == 0
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "vllm").write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@"\n')  # NUL-separated: paths hold newlines
    (fake_bin / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    lora = subprocess.run(["bash", str(out / "vllm" / "serve_lora.sh")], env=env, capture_output=True, text=True,
                          check=True).stdout.split("\0")
    assert not marker.exists()  # the path stayed inside its comment
    assert lora[lora.index("--lora-modules") + 1] == f"tiny={out.resolve()}/adapter"


def test_dora_adapter_gets_the_merged_route(tiny_model_dir, tmp_path, capsys):
    run_dir = write_tiny_adapter(tiny_model_dir, tmp_path / "dora", use_dora=True)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--vllm", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "vLLM cannot hot-load" in said and "DoRA" in said
    assert (out / "merged" / "model.safetensors").is_file() and (out / "vllm" / "serve_merged.sh").is_file()
    assert not (out / "vllm" / "serve_lora.sh").exists()


def test_max_lora_rank_rounds_up_to_a_vllm_rank():
    assert max_lora_rank({"r": 16}) == 16
    assert max_lora_rank({"r": 4}) == 8
    assert max_lora_rank({"r": 16, "rank_pattern": {"q_proj": 48}}) == 64


def test_export_errors(tiny_run_dir, tmp_path, capsys):
    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(tmp_path)]) == 2
    assert "no emotune adapter" in capsys.readouterr().err
    assert main(["export", str(tiny_run_dir), "--out", str(tiny_run_dir)]) == 2
    assert "delete the source" in capsys.readouterr().err
    assert (tiny_run_dir / "adapter" / "adapter_config.json").is_file()
    mine = tmp_path / "project"  # --force replaces an earlier export whole; a folder it did not write is refused
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("the user's own file")
    other_run = tmp_path / "other-run"
    shutil.copytree(tiny_run_dir, other_run)
    (other_run / "run.json").write_text('{"status": "finished"}')
    for out in (mine, mine / "notes.txt", other_run):
        assert main(["export", str(tiny_run_dir), "--out", str(out), "--force"]) == 2
        assert "is not a folder `emotune export` wrote" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "the user's own file" and (mine / "src").is_dir()
    assert (other_run / "run.json").is_file() and (other_run / "adapter" / "adapter_config.json").is_file()


def test_an_out_folder_inside_the_adapter_is_refused_before_anything_is_copied(tiny_run_dir, tmp_path, capsys):
    """`--out RUN/adapter/exp` copied the adapter into a temporary folder inside the adapter, and so on, until the path
    was too long: a traceback of thousands of nested names. `push --dry-run RUN/adapter/up` left a copy of the upload
    inside the adapter (pushed with it next time). Both are refused naming the folder, the adapter unchanged."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    before = sorted(p.name for p in (run / "adapter").iterdir())
    assert main(["export", str(run), "--out", str(run / "adapter" / "exp")]) == 2
    assert "is inside the folder being exported" in capsys.readouterr().err
    assert main(["push", str(run), "--to", "hf:me/tiny", "--dry-run", str(run / "adapter" / "up")]) == 2
    assert "is inside the folder being uploaded" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "adapter").iterdir()) == before


def test_an_out_folder_that_cannot_be_made_is_refused_naming_why(tiny_run_dir, tmp_path, capsys):
    """`--out notes.txt/exp` (a file on the path) or a folder where nothing can be made (/proc on Linux; a read-only
    disk alike): mkdir's NotADirectoryError / FileNotFoundError came out of export and push --dry-run as tracebacks."""
    import sys
    from pathlib import Path

    (tmp_path / "notes.txt").write_text("mine")
    targets = [(tmp_path / "notes.txt" / "exp", "is a file, so"), *([(Path("/proc/emotune-exp"), "Nothing can be "
                                                                    "written in `/proc`")] if sys.platform == "linux" else [])]
    for out, said in targets:
        assert main(["export", str(tiny_run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and "--out" in err and "Traceback" not in err
        assert main(["push", str(tiny_run_dir), "--to", "hf:me/tiny", "--dry-run", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and "--dry-run" in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_base_model_moved_since_training_is_named_with_the_file_that_records_it(tiny_model_dir, tmp_path, capsys):
    """The base folder a run was trained on, moved since: export, predict and push said "model.source `...` is neither
    ... Fix the path or use model.source=embedded", which none of them takes (and another base would be wrong). The
    message names the run's config.yaml (an export's own, for an export) that records it and the fix."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    run = write_tiny_adapter(base, tmp_path / "run")
    assert main(["export", str(run)]) == 0
    base.rename(tmp_path / "base-moved")
    commands = [(["export", str(run), "--merge", "--out", str(tmp_path / "e")], run / "config.yaml"),
                (["predict", str(run), "i feel fine"], run / "config.yaml"),
                (["predict", str(run / "export"), "i feel fine"], run / "export" / "config.yaml"),
                (["push", str(run), "--to", "hf:me/x", "--merged", "--dry-run", str(tmp_path / "up")], run / "config.yaml")]
    for args, config in commands:
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"is not at `{base}` any more (model.source in `{config}` names it)" in err, args
        assert "model.source=embedded" not in err


def test_an_adapter_folder_given_itself_exports_beside_it_not_into_it(tiny_run_dir, tmp_path, capsys):
    """`emotune export RUN/adapter` (the help's "or adapter folder") put its default export at RUN/adapter/export, inside
    the folder being copied: it copied itself into itself until the path was too long. The default is the run's
    export/ for a run's adapter, `<adapter>-export` beside a bare adapter folder."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    assert main(["export", str(run / "adapter")]) == 0
    assert (run / "export" / "adapter" / "adapter_config.json").is_file() and not (run / "adapter" / "export").exists()
    bare = tmp_path / "adapters" / "mine"
    shutil.copytree(tiny_run_dir / "adapter", bare)
    assert main(["export", str(bare)]) == 0
    assert (tmp_path / "adapters" / "mine-export" / "adapter" / "adapter_config.json").is_file()
    assert sorted(p.name for p in bare.iterdir()) == sorted(p.name for p in (tiny_run_dir / "adapter").iterdir())


def test_predict_texts_and_file(tiny_run_dir, tmp_path, capsys):
    assert main(["predict", str(tiny_run_dir), *TEXTS]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["text"] for line in lines] == TEXTS
    for line in lines:
        assert list(line["probs"]) == LABELS
        assert sum(line["probs"].values()) == pytest.approx(1.0, abs=1e-4)
        assert line["label"] == max(line["probs"], key=line["probs"].get)

    source = tmp_path / "in.csv"
    with source.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "text"])
        writer.writerows([[i, t] for i, t in enumerate(TEXTS)])
    out = tmp_path / "out.csv"
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(out), "--batch-size", "2"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["text"] for r in rows] == TEXTS and [r["id"] for r in rows] == ["0", "1", "2"]
    for row, line in zip(rows, lines, strict=False):  # file and argument paths agree
        assert row["label"] == line["label"]
        assert float(row["p_joy"]) == pytest.approx(line["probs"]["joy"], abs=1e-5)


def test_predict_out_reads_back_row_for_row_whatever_the_texts_hold(tiny_run_dir, tmp_path):
    """A text holding a bare carriage return went into --out unquoted (pandas' `\\n` line ending, Python's csv writer
    before 3.11.9 quoting only its characters), so every CSV reader split that row in two and shifted the rest. The
    texts come back exactly, formula-looking ones too: --out is data (docs/serving.md)."""
    import pandas as pd

    texts = ["i am happy\rtoday", "so sad\r\nreally", 'she said "fine", then left', "tab\there", "=HYPERLINK(\"x\")",
             "-2 + 3", "@friend joy"]
    source = tmp_path / "in.csv"
    with source.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text"], *[[t] for t in texts]])
    out = tmp_path / "out.csv"
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(out)]) == 0
    with out.open(newline="", encoding="utf-8") as handle:
        assert [r["text"] for r in csv.DictReader(handle)] == texts
    assert pd.read_csv(out, dtype=str, keep_default_na=False)["text"].tolist() == texts


def test_predict_keeps_a_label_column_the_input_file_already_has(tiny_run_dir, tmp_path, capsys):
    """Predicting on a labelled test file wrote the predicted label over the file's gold `label` column."""
    source = tmp_path / "labelled.csv"
    with source.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["text", "label"], *[[t, "gold"] for t in TEXTS]])
    out = tmp_path / "out.csv"
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(out)]) == 0
    assert "prediction written as `predicted_label`" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert [r["label"] for r in rows] == ["gold"] * len(TEXTS)
    assert all(r["predicted_label"] in LABELS and "p_joy" in r for r in rows)


def test_predict_errors(tiny_run_dir, tmp_path, capsys):
    assert main(["predict", str(tiny_run_dir)]) == 2
    assert "Give texts" in capsys.readouterr().err
    source = tmp_path / "in.csv"
    source.write_text("sentence\nhello\n")
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(tmp_path / "o.csv")]) == 2
    assert "--text-column" in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()
    source.write_text("text\nhello\n")
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(tmp_path)]) == 2
    assert f"--out `{tmp_path}` is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
def test_predict_reads_a_file_whose_header_uses_another_delimiter(tmp_path, delimiter, capsys):
    """A `;`-separated .csv was one column `text;id` and refused as having no column `text`."""
    from emotune.deploy.predict import _read_table

    source = tmp_path / "in.csv"
    source.write_text(f"id{delimiter}text\n007{delimiter}so happy, really\n", encoding="utf-8")
    rows, column = _read_table(source, "text")
    assert rows.to_dict("records") == [{"id": "007", "text": "so happy, really"}] and column == "text"
    assert "header is separated by" in capsys.readouterr().out
    source.write_text("sentence;id\nhello;1\n")
    with pytest.raises(UserError, match="--text-column"):
        _read_table(source, "text")


def test_predict_reads_a_jsonl_file_that_starts_with_a_byte_order_mark(tmp_path):
    """A JSONL file saved as UTF-8 with a BOM (PowerShell, Notepad) was refused: "Expected object or value at
    position 0"; training data in the same file loaded, as the data readers skip the mark."""
    from emotune.deploy.predict import _read_table

    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "今天很开心", "id": 1}\n{"text": "so happy", "id": 2}\n', encoding="utf-8-sig")
    assert _read_table(source, "text")[0].to_dict("records") == [{"text": "今天很开心", "id": 1}, {"text": "so happy", "id": 2}]


def test_predict_reads_a_json_file_of_rows(tmp_path):
    """A JSON array of rows (as Alpaca datasets and LLaMA-Factory's demos ship) was refused as an unsupported type."""
    from emotune.deploy.predict import _read_table

    source = tmp_path / "in.json"
    source.write_text(json.dumps([{"text": "so happy", "id": 1}, {"text": "今天很开心", "tags": ["a"]}], ensure_ascii=False),
                      encoding="utf-8")
    rows, _ = _read_table(source, "text")
    assert rows["text"].tolist() == ["so happy", "今天很开心"] and rows["tags"].tolist()[1] == ["a"]


def test_serve_with_vllm_engine_needs_vllm(tiny_run_dir, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    assert main(["serve", "--no-auth", str(tiny_run_dir), "--engine", "vllm"]) == 2
    assert "needs the `vllm` package" in capsys.readouterr().err


def test_predict_and_serve_clean_texts_as_the_training_rows_were(tiny_model_dir, tmp_path, capsys):
    """emotune.json records the text steps of `data.cleaning`; predict and serve's classifier apply them, so a text
    reads as the training and evaluation rows did (here: a URL replaced, whitespace and a zero-width space gone). An
    adapter whose emotune.json records none (older, or another tool's) reads texts as sent."""
    from emotune.serve import build_engine

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "runs" / "urls", overrides=("data.cleaning.urls=replace",))
    meta = json.loads((run / "adapter" / "emotune.json").read_text())
    assert meta["cleaning"]["urls"] == "replace" and meta["cleaning"]["whitespace"] is True
    raw, cleaned = "so\u200b happy  about\n http://example.com/x ", "so happy about <url>"

    def probs(folder, texts):
        assert main(["predict", str(folder), *texts]) == 0
        return [json.loads(line)["probs"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]

    first, second = probs(run, [raw, cleaned])
    assert first == pytest.approx(second, abs=1e-6)
    engine, _ = build_engine(load_config(None, ["device=cpu"]), [str(run)])
    with engine.using("urls") as loaded:
        prompt, labels = loaded.artifact.prompt, loaded.artifact.labels
    served = engine.classify("urls", [raw, cleaned], prompt, labels, 2)
    assert torch.allclose(served[0], served[1], atol=1e-6)
    assert served[0].tolist() == pytest.approx(list(first.values()), abs=1e-4)

    del meta["cleaning"]  # as an adapter from before it was recorded
    (run / "adapter" / "emotune.json").write_text(json.dumps(meta))
    first, second = probs(run, [raw, cleaned])
    assert first != pytest.approx(second, abs=1e-6)


def test_predict_refuses_texts_past_the_context_and_warns_past_the_trained_length(tiny_run_dir, tmp_path, capsys):
    """A text whose prompt runs past the model's context (the tiny model's 512 positions) was scored anyway (position
    ids past the model's range); one longer than the run trained on was scored without a word."""
    from emotune.model.artifacts import find_artifact

    trained = find_artifact(str(tiny_run_dir)).meta["max_length"]
    words = lambda n: " ".join(["happy"] * n)  # noqa: E731
    assert main(["predict", str(tiny_run_dir), "fine", words(600)]) == 2
    err = capsys.readouterr().err
    assert "text 2 with the prompt and the longest label come to more tokens" in err and "context of 512" in err
    source = tmp_path / "in.csv"
    source.write_text("text\n" + "\n".join(["fine", words(trained + 10), "ok", words(trained + 20)]) + "\n")
    out = tmp_path / "out.csv"
    assert main(["predict", str(tiny_run_dir), "--file", str(source), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "in.csv: rows 2, 4 with the prompt" in err and f"train.max_length={trained}" in err
    assert len(list(csv.DictReader(out.open()))) == 4
    assert main(["predict", str(tiny_run_dir), "fine"]) == 0 and "Warning" not in capsys.readouterr().err


@pytest.mark.parametrize("force", [False, True])
def test_export_writes_into_an_empty_folder_made_for_it(tiny_run_dir, tmp_path, capsys, force):
    """`mkdir out; emotune export RUN --out out` was refused as `already exists (an earlier export?)`, and with
    --force as `not a folder emotune export wrote`: an empty folder could not take an export at all."""
    from emotune.cli import main

    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", str(tiny_run_dir), "--out", str(out), *(["--force"] if force else [])]) == 0, capsys.readouterr().err
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert main(["export", str(tiny_run_dir), "--out", str(out)]) == 2  # now an earlier export: --force to replace it
    assert "already exists" in capsys.readouterr().err
