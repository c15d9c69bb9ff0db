"""`emotune run` with both methods, the HTML report (also in headless Chromium), and `emotune eval` / `emotune report`."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess

import pytest

from emotune.cli import main


@pytest.fixture(scope="module")
def both_run(tiny_model_dir, data_dir, tmp_path_factory):
    """One tiny 2-step run measured with both methods; tests only read it."""
    root = tmp_path_factory.mktemp("both")
    overrides = [
        f"model.source={tiny_model_dir}", f"data.source={data_dir}", f"output_dir={root / 'runs'}", "name=both",
        "data.label_names=[sadness, joy, love, anger, fear, surprise]", "train.max_steps=2", "train.batch_size=4",
        "train.gradient_accumulation_steps=1", "train.gradient_checkpointing=false", "train.precision=fp32",
        "train.eval_steps=1", "train.save_steps=1", "train.logging_steps=1", "train.learning_rate=0.01",
        "eval.method=both", f"model.cache_dir={root / 'cache'}",
    ]
    assert main(["run", *overrides]) == 0
    return root / "runs" / "both", overrides


def _rows(path):
    with path.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


def test_both_methods_are_measured_and_compared(both_run, capsys):
    run_dir, _ = both_run
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    for stage in ("baseline", "finetuned"):
        generate = json.loads((run_dir / stage / "metrics.json").read_text())
        score = json.loads((run_dir / stage / "score" / "metrics.json").read_text())
        assert generate["method"] == "generate" and score["method"] == "score"
        assert score["invalid"] == 0 and {"top2_accuracy", "log_loss", "ece"} <= set(score)
        rows = _rows(run_dir / stage / "score" / "predictions.csv")
        assert len(rows) == score["rows"] == generate["rows"]
        for row in rows:
            probs = {label: float(row[f"p_{label}"]) for label in labels}
            assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
            assert row["predicted"] == max(probs, key=probs.get)
    comparison = json.loads((run_dir / "comparison.json").read_text())
    assert set(comparison["methods"]) == {"generate", "score"}
    assert comparison["method"] == {"before": "generate", "after": "generate"}  # the reference is the headline
    assert "log_loss" in comparison["methods"]["score"]["metrics"]
    assert {r["method"] for r in _rows(run_dir / "comparison.csv")} == {"generate", "score"}
    for one in comparison["methods"].values():  # 95% intervals and the paired test per method (test_stats.py)
        assert set(one["intervals"]) == {"accuracy", "macro_f1"} and set(one["paired"]) == {"mcnemar", "verdict"}


def test_report_is_self_contained(both_run):
    run_dir, _ = both_run
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert page.count("class='before-after'") == 2
    assert "data-method='generate'" in page and "data-method='score'" in page
    assert "<script" not in page and "src='http" not in page and 'src="http' not in page
    assert page.count("src='data:image/png;base64,") == 8  # 2 confusion + 2 F1, loss, gradient norm, B histogram, telemetry
    for name in ("confusion_generate", "confusion_score", "per_class_f1_generate", "per_class_f1_score", "loss",
                 "telemetry"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 1000
    assert "Wrong → right" in page and "Right → wrong" in page and "Invalid outputs before" in page


def test_report_shows_gradient_norms_and_adapter_weights_of_the_trained_adapter(both_run, tiny_model_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir, _ = both_run
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<section id=training>" in page and "train.max_grad_norm = 1" in page and "class=adapter-norms" in page
    for name in ("grad_norm", "lora_b_histogram"):
        assert (run_dir / "report" / f"{name}.png").stat().st_size > 1000
    # logging_steps=1: each window is one step, so its mean and maximum are that step's norm
    logged = [e for e in json.loads((run_dir / "train" / "log_history.json").read_text()) if "grad_norm" in e]
    assert [e["step"] for e in logged] == [1, 2]
    assert all(e["grad_norm_mean"] == e["grad_norm_max"] == e["grad_norm"] > 0 for e in logged)

    stats = json.loads((run_dir / "report" / "adapter_stats.json").read_text())
    assert set(stats["groups"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {m["layer"] for m in stats["modules"]} == {0, 1} and len(stats["modules"]) == 14
    # ΔW as PEFT merges it into the weights: the reported ‖ΔW‖ of every module
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       run_dir / "adapter").merge_and_unload()
    for m in stats["modules"]:
        delta = merged.get_submodule(m["module"]).weight - base.get_submodule(m["module"]).weight
        assert float(torch.linalg.norm(delta)) == pytest.approx(m["delta_norm"], rel=1e-4), m["module"]
    # each group's histogram holds every B entry of the group; B left its zero start everywhere
    saved = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    for group, g in stats["groups"].items():
        b_entries = [t for k, t in saved.items() if k.endswith(f"{group}.lora_B.weight")]
        assert sum(g["histogram"]["counts"]) == g["entries"] == sum(t.numel() for t in b_entries) == 2 * b_entries[0].numel()
        assert g["entries_max_abs"] == pytest.approx(max(float(t.abs().max()) for t in b_entries))
        assert g["entries_zero_share"] < 0.5 and g["delta_norm_max"] > 0


def test_report_command_rebuilds_and_rejects_other_folders(both_run, tmp_path, capsys):
    run_dir, _ = both_run
    assert main(["report", str(run_dir)]) == 0
    assert str(run_dir / "report.html") in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_eval_command_on_run_folder_and_base_model(both_run, capsys):
    run_dir, overrides = both_run
    overrides = [o for o in overrides if not o.startswith("eval.method")]
    assert main(["eval", *overrides, f"adapter={run_dir}", "split=validation", "eval.method=score"]) == 0
    metrics = json.loads((run_dir / "eval" / "validation-finetuned" / "metrics.json").read_text())
    assert metrics["method"] == "score" and metrics["rows"] == 12
    assert main(["eval", *overrides]) == 0
    assert json.loads((run_dir / "eval" / "test-base" / "metrics.json").read_text())["method"] == "generate"
    assert main(["eval", *overrides, f"adapter={run_dir / 'nothing'}"]) == 2
    assert "neither an adapter folder" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(both_run, tmp_path):
    import matplotlib.image

    run_dir, _ = both_run
    shot = tmp_path / "report.png"
    common = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND",
              f"--user-data-dir={tmp_path / 'profile'}"]  # the resolver rule: no name lookups (Chromium's own services)
    url = (run_dir / "report.html").resolve().as_uri()
    subprocess.run([*common, f"--screenshot={shot}", "--window-size=1280,2000", url], check=True, timeout=120,
                   capture_output=True)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    assert pixels.std() > 0.05  # not a blank page
    assert (pixels.mean(-1) < 0.5).mean() > 0.005  # some dark text and figure ink
    dom = subprocess.run([*common, "--dump-dom", url], check=True, timeout=120, capture_output=True, text=True).stdout
    assert "Before/after, method <b>generate</b>" in dom and "Before/after, method <b>score</b>" in dom
    assert "macro-F1" in dom


def test_comparison_terminal_and_report_show_the_chance_levels(both_run):
    from types import SimpleNamespace

    from emotune.core.config.load import load_config
    from emotune.tasks.classify.task import format_comparison

    run_dir, overrides = both_run
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    comparison = json.loads((run_dir / "comparison.json").read_text())
    chance = comparison["chance"]  # the test split holds 2 rows of each of the 6 labels
    assert chance["rows"] == 12 and chance["majority"]["label"] == "sadness"
    for guess in ("uniform", "majority", "stratified"):
        assert chance[guess]["accuracy"] == pytest.approx(1 / 6, abs=1e-6)
    assert chance["uniform"]["macro_f1"] == chance["stratified"]["macro_f1"] == pytest.approx(1 / 6, abs=1e-6)
    assert chance["majority"]["macro_f1"] == pytest.approx(2 / 7 / 6, abs=1e-6)

    text = format_comparison(comparison, SimpleNamespace(labels=labels), load_config(None, overrides))
    assert text.count("uniform    majority  stratified") == 2  # the header of both methods' tables
    assert text.count("above every chance level?") == 2 and "always sadness" in text
    accuracy = next(line for line in text.splitlines() if line.startswith("accuracy"))
    assert accuracy.split()[-3:] == ["0.167", "0.167", "0.167"]
    invalid = json.loads((run_dir / "baseline" / "metrics.json").read_text())["invalid"]
    assert ("pretrained (not instruction-tuned)" in text) == (invalid >= 6)  # explained when half or more are invalid

    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<th>majority class (sadness)</th>" in page and page.count("<th>stratified guess</th>") == 2
    assert "always sadness" in page and ("pretrained (not instruction-tuned)" in page) == (invalid >= 6)
    assert text.count("Verdict: ") == 2 and page.count("<table class=intervals") == 2
    assert page.count(f"Verdict: {comparison['paired']['verdict']}") >= 1


def test_the_cpu_recipe_measures_both_methods():
    from pathlib import Path

    from emotune.core.config.load import load_config

    assert load_config(Path(__file__).resolve().parents[1] / "configs" / "cpu.yaml").eval.method == "both"


def test_report_page_takes_labels_with_a_slash():
    """A label such as `anger/disgust` ended the run's report stage in "ValueError: too many values to unpack": the
    per-class key `anger/disgust/f1` was split at every slash."""
    from emotune.eval.evaluate import compute_metrics
    from emotune.tasks.classify.report import _metrics_table, chance_levels

    labels = ["anger/disgust", "</b>joy"]
    gold, predicted = ["anger/disgust", "</b>joy", "</b>joy"], ["anger/disgust", "anger/disgust", "</b>joy"]
    metrics = compute_metrics(gold, predicted, labels)
    chance = chance_levels({label: int(metrics["per_class"][label]["support"]) for label in labels})
    table = _metrics_table("score", metrics, metrics, labels, chance)
    assert "F1 anger/disgust" in table and "F1 &lt;/b&gt;joy" in table and "</b>joy" not in table


def _strict_json(text: str):
    """JSON as JavaScript's JSON.parse, jq and Go read it: the bare words NaN and Infinity are refused."""
    def refuse(word):
        raise ValueError(f"{word} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_diverged_training_log_is_standard_json_and_the_report_still_draws_it(tmp_path):
    """A window whose every step was skipped as non-finite logged `"loss": NaN, "grad_norm": Infinity` into
    log_history.json(l) (Python's bare words, which JSON has not): the studio's and any other strict reader refused the
    whole file. They are null now, and the report's gradient and loss parts draw around them."""
    import math
    from types import SimpleNamespace

    from emotune.core.rundir import RunDir, write_json
    from emotune.report.page import _loss_section
    from emotune.report.training import _gradient_part
    from emotune.train.log import TrainLog, Window, write_history

    window = Window()
    window.add(None, 0, grad_norm=math.inf)  # an overflowed step: skipped, its loss never counted
    entry = window.entry(SimpleNamespace(step=2, nonfinite_total=1), SimpleNamespace(micro_per_step=1, batches_per_epoch=4),
                         1e-3, math.inf)
    good = {**entry, "step": 1, "loss": 2.5, "grad_norm": 1.0, "grad_norm_mean": 1.0, "grad_norm_max": 1.5}
    run = RunDir(tmp_path / "run")
    log = TrainLog(run.train / "log_history.jsonl", [], SimpleNamespace(is_main_process=True), [], {})
    log(good)
    log(entry)
    lines = [_strict_json(line) for line in (run.train / "log_history.jsonl").read_text().splitlines()]
    assert lines[1]["loss"] is None and lines[1]["grad_norm"] is None and lines[1]["grad_norm_max"] is None
    write_history([good, {**entry, "grad_norm": 3.0}, {"step": 2, "eval_loss": math.nan}], run.train)
    assert _strict_json((run.train / "log_history.json").read_text())[2]["eval_loss"] is None
    run.figures.mkdir()
    (run.root / "config.yaml").write_text("train:\n  max_grad_norm: 1.0\n")  # the clipping line: each window's largest
    assert "exceeded in 2 of 2" in _gradient_part(run)
    assert "<img" in _gradient_part(run) and "<img" in _loss_section(run)
    assert _strict_json(write_json(tmp_path / "m.json", {"a": [math.nan, -math.inf, 1.0]}).read_text()) == {"a": [None, None, 1.0]}


def test_summary_csvs_write_a_formula_looking_name_as_text(tmp_path):
    """A label named `=HYPERLINK("http://evil.example","joy")` (or `@SUM(...)`, `+cmd`) opened in comparison.csv, compare.csv
    or a sweep's table ran as a formula in Excel, LibreOffice and Google Sheets: quoting the cell does not stop it. Such
    a text cell is written with a leading `'` now; numbers (a negative delta) are written as they are."""
    from emotune.core.rundir import RunDir
    from emotune.core.spreadsheet import spreadsheet_cell
    from emotune.eval.evaluate import compute_metrics
    from emotune.sweep.table import Table, write_csv
    from emotune.tasks.classify.report import compare, write_comparison

    evil = '=HYPERLINK("http://evil.example","joy")'
    assert [spreadsheet_cell(v) for v in (evil, "@SUM(A1)", "+1", "-x", "\tx", "-0.25", "-1e-4", "joy", -0.5, None)] == [
        "'" + evil, "'@SUM(A1)", "+1", "'-x", "'\tx", "-0.25", "-1e-4", "joy", -0.5, None]
    labels = [evil, "joy"]
    before = {**compute_metrics([evil, "joy"], ["joy", "joy"], labels), "method": "generate"}
    after = {**compute_metrics([evil, "joy"], [evil, evil], labels), "method": "generate"}
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    write_comparison(compare(before, after, labels), run)
    with run.comparison_csv.open(newline="", encoding="utf-8") as handle:
        rows = {r["metric"]: r for r in csv.DictReader(handle)}
    assert f"'{evil}/f1" in rows and evil + "/f1" not in rows
    assert float(rows["joy/recall"]["delta"]) == -1.0  # numbers stay numbers
    table = Table("trials", [], [], [{"trial": "trial-000", "prompt.system_prompt": "=1+1", "value": -0.5}], [])
    write_csv(table, tmp_path / "trials.csv")
    with (tmp_path / "trials.csv").open(newline="", encoding="utf-8") as handle:
        assert list(csv.DictReader(handle)) == [{"trial": "trial-000", "prompt.system_prompt": "'=1+1", "value": "-0.5"}]



def test_the_studio_shows_a_sweep_table_cell_as_the_value_it_holds(tmp_path):
    """The `'` a sweep's trials.csv puts before a formula-looking text is the CSV's, not the value's: the studio's sweep
    page (HTML, where no formula runs) showed `'=1+1`. Reading takes exactly one off, so every value comes back."""
    from emotune.core.spreadsheet import from_spreadsheet_cell, spreadsheet_cell
    from emotune.studio.runs import summarize_sweep
    from emotune.sweep.table import Table, write_csv

    values = ["=1+1", "'=1+1", "''@x", "-2", "'-2", "'", "", "'plain", "+", "-x", "joy"]
    assert [from_spreadsheet_cell(spreadsheet_cell(v)) for v in values] == values
    write_csv(Table("trials", [], [], [{"trial": "t", "value": v} for v in values], []), tmp_path / "trials.csv")
    (_, header, rows), = summarize_sweep(tmp_path).tables
    assert header == ["trial", "value"] and [row[1] for row in rows] == values


def test_the_summary_names_the_sources_as_the_config_holds_them():
    """The summary read model.source and data.source out of config.yaml with a regular expression, so a path YAML
    quotes (a colon and space, a leading @ or quote) was shown with YAML's quoting; and a source the dump wrote on
    two lines was shown cut."""
    import yaml

    from emotune.report.page import _sources

    model, data = "C:/models/gemma: it", "@team/'reviews'.csv"
    text = yaml.safe_dump({"task": "classify", "model": {"source": model}, "data": {"source": data}})
    assert "'" in text  # YAML quotes both
    assert _sources(yaml.safe_load(text)) == (model, data)
    assert _sources({"task": "classify"}) == ("?", "?")


def test_a_score_of_a_whole_number_is_shown_as_a_score_and_a_count_as_a_count():
    """A log-loss of exactly 2.0 (JSON `2.0`) showed as `2`, as the invalid-reply count is shown; a change of +2.0
    as `+2`."""
    from emotune.tasks.classify.report import _fmt

    assert (_fmt(2.0), _fmt(2.0, signed=True), _fmt(0.5)) == ("2.000", "+2.000", "0.500")
    assert (_fmt(3), _fmt(-2, signed=True)) == ("3", "-2")
