"""`emotune compare`: run folders written by the product's own writers (config, run.json, evaluations,
comparison) from synthetic predictions, no model; the table's rows, the mismatch refusal, the CLI."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from emotune.cli import main
from emotune.core.config.build import dump_config
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.core.rundir import RunLog, open_run, write_json
from emotune.eval import stats
from emotune.eval.evaluate import EvalResult, compute_metrics, write_results
from emotune.report.compare import compare_runs
from emotune.tasks import TASKS

LABELS = ["sadness", "joy", "anger"]
ROWS = 45
GOLD = [LABELS[i % 3] for i in range(ROWS)]
TEXTS = [f"text number {i}" for i in range(ROWS)]


def _predictions(right: float, seed: int) -> list[str]:
    """Right on about `right` of the rows, a wrong label elsewhere."""
    rng = np.random.default_rng(seed)
    return [g if rng.random() < right else LABELS[(LABELS.index(g) + 1) % 3] for g in GOLD]


def make_run(root: Path, name: str, predicted: dict[str, list[str]], task: str = "classify", labels=LABELS,
             texts=TEXTS, gold=GOLD, overrides: tuple[str, ...] = (), finish: bool = True) -> Path:
    """A finished run folder: resolved config, run.json with a timed train stage, the training log, adapter
    weights, both evaluations (written by emotune.eval.evaluate) and the task's own comparison.json."""
    cfg = load_config(None, [*([f"task={task}"] if task != "classify" else []), f"name={name}", f"output_dir={root}",
                             *overrides])
    run = open_run(root / name, dump_config(cfg), overwrite=False)
    log = RunLog(run, {"task": task, "labels": labels, "rows": {"test": len(gold)}})
    with log.stage("train"):
        write_json(run.train / "log_history.json", [
            {"step": 1, "loss": 1.5, "tokens_per_s": 100.0, "peak_memory_mb": 500.0},
            {"step": 1, "eval_loss": 1.4},
            {"step": 2, "loss": 1.2, "tokens_per_s": 300.0, "peak_memory_mb": 700.0}])
        run.adapter.mkdir(parents=True)
        (run.adapter / "adapter_model.safetensors").write_bytes(b"\0" * 3 * 2**20)

    def results(stage_predictions: dict[str, list[str]]) -> dict[str, EvalResult]:
        return {m: EvalResult([{"text": t, "gold": g, "predicted": p} for t, g, p in zip(texts, gold, preds, strict=False)],
                              {**compute_metrics(gold, preds, labels), "method": m, "rows_per_s": 12.5})
                for m, preds in stage_predictions.items()}

    before, after = results({m: [labels[0]] * len(gold) for m in predicted}), results(predicted)
    write_results(before, run.baseline)
    write_results(after, run.finetuned)
    module = TASKS[task]
    module.write_comparison(module.compare(before, after, SimpleNamespace(labels=labels)), run)
    if finish:
        log.finish([run.finetuned / "metrics.json", run.finetuned / "predictions.csv", run.comparison_json])
    return run.root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    weak = _predictions(0.4, seed=1)
    order = list(range(ROWS))[::-1]  # the same rows measured in another order
    return {
        "generative": make_run(root, "generative", {"generate": weak, "score": _predictions(0.5, seed=2)},
                               overrides=("eval.method=both",)),
        "head": make_run(root, "head", {"head": _predictions(0.95, seed=3)}, task="classify_head",
                         overrides=("lora.r=32", "lora.alpha=64", "train.learning_rate=5e-4", "train.batch_size=4",
                                    "train.gradient_accumulation_steps=2", "train.max_length=128",
                                    "lora.dropout=0", "lora.target_parameters=experts")),
        "reordered": make_run(root, "reordered", {"generate": [weak[i] for i in order]},
                              texts=[TEXTS[i] for i in order], gold=[GOLD[i] for i in order]),
        "other_rows": make_run(root, "other_rows", {"generate": weak}, texts=[t + "!" for t in TEXTS]),
        "other_labels": make_run(root, "other_labels", {"generate": [g.replace("anger", "fear") for g in weak]},
                                 labels=["sadness", "joy", "fear"], gold=[g.replace("anger", "fear") for g in GOLD]),
        "unfinished": make_run(root, "unfinished", {"generate": weak}, finish=False),
        "sft_a": make_sft_run(root, "sft_a", ["a cat sat", "the dog ran", "blue sky", "red sun"] * 3),
        "sft_b": make_sft_run(root, "sft_b", ["a cat sat on", "the dog", "sky", "red sun"] * 3),
    }


def make_sft_run(root: Path, name: str, outputs: list[str]) -> Path:
    from emotune.eval.textmetrics import exact_match, rouge_l, sentence_bleu, summarize
    from emotune.tasks.sft.eval import SftResult, write_result

    references = ["a cat sat", "the dog ran", "blue sky", "red sun"] * 3
    cfg = load_config(None, ["task=sft", f"name={name}", f"output_dir={root}"])
    run = open_run(root / name, dump_config(cfg), overwrite=False)
    log = RunLog(run, {"task": "sft"})
    rows = [{"prompt": f"question {i}", "reference": ref, "output": out, "kind": ["qa", "chat"][i % 2], "rouge_l": score,
             "bleu": sentence_bleu(out, ref), "exact_match": float(exact_match(out, ref))}
            for i, (ref, out, score) in enumerate(zip(references, outputs, rouge_l(outputs, references), strict=False))]
    summary = summarize([{**r, "prediction": r["output"]} for r in rows])
    metrics = {"rows": len(rows), "loss": 1.0, "perplexity": 2.72, "rouge_l": summary["rouge_l"], "bleu": summary["corpus_bleu"],
               "exact_match": summary["exact_match"], "per_kind": summary["per_kind"], "seconds": 2.0}
    write_result(SftResult(rows, metrics), run.finetuned)
    log.finish([run.finetuned / "metrics.json"])
    return run.root


def test_the_table_holds_setup_scores_intervals_and_the_paired_test(runs, tmp_path, capsys):
    out = tmp_path / "table"
    table = compare_runs([str(runs["generative"]), str(runs["head"]), str(runs["reordered"])], out=out)
    rows = {(r["run"], r["method"]): r for r in table["rows"]}
    assert list(rows) == [("generative", "generate"), ("generative", "score"), ("head", "head"), ("reordered", "generate")]
    head = rows[("head", "head")]
    assert head["name"] == "classify_head/head" and head["lora_r"] == 32 and head["lora_alpha"] == 64
    assert head["lora_targets"] == "all-linear + experts" and rows[("generative", "score")]["lora_targets"] == "all-linear"
    assert head["learning_rate"] == 5e-4 and head["batch"] == 8 and head["max_length"] == 128
    assert head["steps"] == 2 and head["tokens_per_s"] == 200.0 and head["peak_memory_mb"] == 700.0
    assert head["adapter_mb"] == 3.0 and head["eval_rows_per_s"] == 12.5 and head["train_seconds"] is not None
    # the after's intervals are comparison.json's, and the head, far better on the same rows, is "better"
    saved = json.loads((runs["head"] / "comparison.json").read_text())
    assert head["scores"]["macro_f1"]["interval"] == saved["intervals"]["macro_f1"]["after"]
    assert head["scores"]["accuracy"]["value"] == pytest.approx(saved["metrics"]["accuracy"]["after"], abs=1e-6)
    assert head["vs_first"]["verdict"] == "better" and head["vs_first"]["mcnemar"]["c"] > head["vs_first"]["mcnemar"]["b"]
    # the same predictions in another row order: aligned by row, identical, within noise
    reordered = rows[("reordered", "generate")]
    assert reordered["fingerprint"] == rows[("generative", "generate")]["fingerprint"]
    assert reordered["vs_first"]["mcnemar"] == {"b": 0, "c": 0, "p_value": 1.0}
    assert reordered["vs_first"]["verdict"] == "within noise" and reordered["vs_first"]["macro_f1_delta"]["delta"] == 0
    assert rows[("generative", "generate")]["vs_first"] is None

    text = capsys.readouterr().out
    assert "vs first run" in text and "reference" in text and "better (ΔF1 +" in text and "classify_head/head" in text
    assert stats.format_interval(head["scores"]["macro_f1"]["interval"]) in text
    with (out / "compare.csv").open(encoding="utf-8", newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert [line["run"] for line in lines] == ["generative", "generative", "head", "reordered"]
    assert float(lines[2]["macro_f1_low"]) == head["scores"]["macro_f1"]["interval"][0]
    assert lines[2]["vs_first_verdict"] == "better" and float(lines[2]["f1/joy"]) == head["per_class"]["joy"]
    assert "| head | classify_head/head |" in (out / "compare.md").read_text(encoding="utf-8")
    page = (out / "compare.html").read_text(encoding="utf-8")
    assert "F1 per class, side by side" in page and page.count("<th>anger</th>") == 1 and "<script" not in page
    assert page.count("<img alt='headline scores with 95% intervals") == 1 and "src='data:image/png;base64," in page
    assert json.loads((out / "compare.json").read_text(encoding="utf-8")) == json.loads(json.dumps(table))


def test_other_test_rows_or_labels_are_refused_or_marked_not_comparable(runs, tmp_path, capsys):
    for other, why in (("other_rows", "other test rows"), ("other_labels", "labels ['sadness', 'joy', 'fear']")):
        with pytest.raises(UserError, match="--allow-mismatch") as refused:
            compare_runs([str(runs["generative"]), str(runs[other])], out=tmp_path / other)
        assert why in str(refused.value) and not (tmp_path / other).exists()
    table = compare_runs([str(runs["head"]), str(runs["other_rows"]), str(runs["other_labels"]), str(runs["generative"])],
                         out=tmp_path / "allowed", allow_mismatch=True)
    marks = [(r["run"], r["comparable"], (r["vs_first"] or {}).get("verdict")) for r in table["rows"]]
    assert marks == [("head", True, None), ("other_rows", False, None), ("other_labels", False, None),
                     ("generative", True, "worse"), ("generative", True, "worse")]
    text = capsys.readouterr().out
    assert text.count("not comparable") == 4  # two rows of the table, two notes under it


def test_cli_exit_codes_and_messages(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(runs["generative"]), str(runs["head"])]) == 0  # default --out: ./compare
    assert (tmp_path / "compare" / "compare.html").is_file() and "compare/compare.csv" in capsys.readouterr().out
    assert main(["compare", str(runs["head"])]) == 0  # an earlier comparison is replaced
    assert [r["run"] for r in json.loads((tmp_path / "compare" / "compare.json").read_text())["rows"]] == ["head"]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    cases = [(["compare", str(runs["head"]), "--out", "notes"], "not a folder `emotune compare` wrote"),
             (["compare", str(runs["head"]), str(runs["other_rows"])], "--allow-mismatch"),
             (["compare", str(tmp_path / "nothing")], "is not a run folder"),
             (["compare", str(runs["unfinished"])], "is not a finished run"),
             (["compare", str(runs["head"]), str(runs["sft_a"])], "in its own `emotune compare` call")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("emotune: error: ") and message in err and "Traceback" not in err
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


def test_sft_runs_show_rouge_l_and_perplexity(runs, tmp_path, capsys):
    table = compare_runs([str(runs["sft_a"]), str(runs["sft_b"])], out=tmp_path / "sft")
    first, second = table["rows"]
    assert table["kind"] == "generation" and first["scores"]["rouge_l"]["value"] == 1.0
    assert first["scores"]["rouge_l"]["interval"] == [1.0, 1.0] and first["metrics"]["perplexity"] == 2.72
    assert second["vs_first"]["verdict"] == "worse" and second["vs_first"]["rouge_l_delta"]["high"] < 0
    assert set(first["per_class"]) == {"qa", "chat"}
    text = capsys.readouterr().out
    assert "ROUGE-L" in text and "perplexity" in text and "worse (ΔROUGE-L -" in text
    assert "ROUGE-L per kind of instruction" in (tmp_path / "sft" / "compare.html").read_text(encoding="utf-8")


def test_a_note_with_line_breaks_stays_one_note_in_every_output(runs, tmp_path, capsys):
    import shutil

    from emotune.report.table import notes

    # a folder name may hold line breaks; the notes quote run names, and a blank line or `- ` after a break would
    # end the Markdown bullet and start a paragraph or another bullet
    first = shutil.copytree(runs["head"], tmp_path / "head\n\n# copy")
    other = shutil.copytree(runs["other_rows"], tmp_path / "other\n- rows")
    table = compare_runs([str(first), str(other)], out=tmp_path / "out", allow_mismatch=True)
    shown = notes(table)
    assert any("\n" in note for note in shown)
    bullets = (tmp_path / "out" / "compare.md").read_text(encoding="utf-8").split("## Setup and cost")[1]
    bullets = [line for line in bullets.splitlines() if line and not line.startswith("|")]
    assert len(bullets) == len(shown) and all(line.startswith("- ") for line in bullets)
    assert "- Scores after fine-tuning" in bullets[0] and "head<br><br># copy (classify_head/head)" in bullets[0]
    assert bullets[-1].startswith("- other<br>- rows (classify/generate) is not comparable: other test rows")
    page = (tmp_path / "out" / "compare.html").read_text(encoding="utf-8")
    section = page.split("<section id=notes>")[1].split("</section>")[0]
    assert section.count("<p>") == len(shown) and "other<br>- rows (classify/generate) is not comparable" in section
    printed = capsys.readouterr().out  # a note's later lines indented under its first
    assert "\nother\n  - rows (classify/generate) is not comparable" in printed


@pytest.mark.parametrize(("name", "text", "compare_says", "report_says"), [
    ("finetuned/metrics.json", "{cut sho", "metrics.json` cannot be read (cut short", None),
    ("finetuned/metrics.json", "[1, 2]", "metrics.json` cannot be read (cut short", None),
    ("baseline/metrics.json", "", None, "missing or unreadable"),
    ("config.yaml", "- a list\n- not sections\n", None, None),
    ("config.yaml", "train: {cut sho", None, None),
    ("config.yaml", b"train:\n  learning_rate: \xff\xfe\n", None, None),
    ("telemetry.jsonl", '[1]\n"a"\n{"stage": "train", "elapsed_s": 1}\n{"stage": "train"}\n', None, None),
])
def test_a_damaged_file_of_a_run_folder_is_refused_by_name_or_passed_over(runs, tmp_path, capsys, name, text,
                                                                          compare_says, report_says):
    """A run folder with one file cut short or edited into something else (a list for an object, YAML that does
    not parse, bytes that are not UTF-8, JSON lines that are no telemetry sample): `compare` and `report` ended in
    a traceback (JSONDecodeError, 'list' object has no attribute 'get', matplotlib's `0 rows`). A damaged
    measurement is now no measurement (a one-line error when the command needs it); a damaged config or
    telemetry series only loses what the page shows of it."""
    run = tmp_path / "damaged"
    shutil.copytree(runs["reordered"], run)
    path = run / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for argv, says in ((["compare", str(runs["reordered"]), str(run), "--out", str(tmp_path / "out")], compare_says),
                       (["report", str(run)], report_says)):
        code = main(argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if says is None:
            assert code == 0, err
        else:
            assert code == 2 and err.startswith("emotune: error: ") and says in err


def test_a_two_method_run_with_one_damaged_measurement_is_refused_by_name(runs, tmp_path, capsys):
    """A two-method run whose headline metrics.json was cut short was compared on its other method alone, unsaid."""
    run = shutil.copytree(runs["generative"], tmp_path / "damaged")
    (run / "finetuned" / "metrics.json").write_text("{cut sho")
    assert main(["compare", str(runs["generative"]), str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"`{run / 'finetuned' / 'metrics.json'}` cannot be read" in err and "Traceback" not in err


def test_a_damaged_measurement_reads_as_none_so_a_resumed_run_measures_again(tmp_path):
    """read_metrics (a resumed run's "already measured?") and the sft reader raised JSONDecodeError on a metrics.json
    cut short, FileNotFoundError on an sft stage without predictions.csv, and on a probe.json cut short."""
    from emotune.eval.evaluate import read_metrics
    from emotune.tasks.sft.eval import read_result

    (tmp_path / "metrics.json").write_text("{cut sho")
    assert read_metrics(tmp_path, ["generate"]) is None
    (tmp_path / "metrics.json").write_text(json.dumps({"perplexity": 2.0}))
    assert read_result(tmp_path) is None
    (tmp_path / "predictions.csv").write_text("prompt,output\nq,a\n")
    (tmp_path / "probe.json").write_text("[")
    assert read_result(tmp_path)["probe"] is None


def test_report_refuses_a_file_where_its_figures_folder_goes(runs, tmp_path, capsys):
    """A file named `report` in the run folder ended `emotune report` in a FileExistsError traceback."""
    run = tmp_path / "run"
    shutil.copytree(runs["reordered"], run)
    shutil.rmtree(run / "report", ignore_errors=True)
    (run / "report").write_text("notes")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("emotune: error: ") and f"`{run / 'report'}` is a file" in err
    assert (run / "report").read_text() == "notes"


def test_a_run_json_without_its_label_list_still_gets_a_report_and_a_comparison(runs, tmp_path, capsys):
    """A run.json edited without `labels` ended `emotune report` in a KeyError traceback (compare already read the
    labels off the measurement); the report reads them there too."""
    run = shutil.copytree(runs["reordered"], tmp_path / "unlabelled")
    info = json.loads((run / "run.json").read_text())
    del info["labels"]
    (run / "run.json").write_text(json.dumps(info))
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    page = (run / "report.html").read_text()
    assert all(f"<th>F1 {label}</th>" in page for label in LABELS)
    assert main(["compare", str(runs["reordered"]), str(run), "--out", str(tmp_path / "out")]) == 0


def test_an_sft_baseline_of_other_rows_is_refused_not_paired_row_by_row(runs, tmp_path, capsys):
    """sft's comparison paired the baseline's and the fine-tuned rows by position, whatever rows they were (classify
    refuses other rows): a baseline of other questions gave a paired ROUGE-L interval of unrelated rows, unsaid."""
    run = shutil.copytree(runs["sft_b"], tmp_path / "sft")
    shutil.copytree(run / "finetuned", run / "baseline")
    shutil.copytree(runs["sft_a"] / "finetuned", tmp_path / "other")
    assert main(["report", str(run)]) == 0  # the same rows: compared
    predictions = (tmp_path / "other" / "predictions.csv").read_text().replace("question ", "other question ")
    (run / "baseline" / "predictions.csv").write_text(predictions)
    capsys.readouterr()
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "predictions.csv hold different rows" in err and "Traceback" not in err


def test_a_report_that_fails_half_way_leaves_the_earlier_report_and_its_figures_whole(runs, tmp_path, capsys):
    """`emotune report` wrote each figure into report/ as it drew it: a two-method run whose second method's rows did
    not pair up was refused after the first method's figures had replaced the earlier ones, so report/ held half of
    a page that was never written. The figures now replace report/ only with the page."""
    run = shutil.copytree(runs["generative"], tmp_path / "run")
    assert main(["report", str(run)]) == 0
    for figure in (run / "report").glob("*.png"):
        figure.write_bytes(b"an earlier report's figure")  # so that a figure drawn again shows
    earlier = {p.name: p.read_bytes() for p in (run / "report").iterdir()}
    page = (run / "report.html").read_text()
    assert "confusion_generate.png" in earlier and "confusion_score.png" in earlier
    rows = run / "finetuned" / "score" / "predictions.csv"
    rows.write_text(rows.read_text().replace("text number 1,", "text number one,"))  # rows that do not pair up
    capsys.readouterr()
    assert main(["report", str(run)]) == 2
    assert "hold different rows" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (run / "report").iterdir()} == earlier
    assert (run / "report.html").read_text() == page and not list(tmp_path.glob("run/*partial*"))


def test_html_in_a_run_name_or_label_shows_as_text_in_the_markdown(runs, tmp_path):
    """Markdown passes HTML through: a run (or a label) named `<b>` or `<unk>` vanished from compare.md where it is
    shown, and made the rest of the cell bold; written as entities, it renders as the text it is."""
    import shutil

    from markdown_it import MarkdownIt

    first = shutil.copytree(runs["head"], tmp_path / "<b>bold & <unk>")
    compare_runs([str(first), str(runs["head"])], out=tmp_path / "out", allow_mismatch=True)
    text = (tmp_path / "out" / "compare.md").read_text(encoding="utf-8")
    assert "&lt;b&gt;bold &amp; &lt;unk&gt;" in text
    rendered = MarkdownIt("commonmark").enable("table").render(text)
    assert "&lt;b&gt;bold &amp; &lt;unk&gt;" in rendered and "<b>bold" not in rendered
