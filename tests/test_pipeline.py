"""`emotune run` end to end, in-process, on the tiny model: the run folder is complete and self-consistent."""

from __future__ import annotations

import csv
import json

import pytest

from emotune.cli import main


def _read_predictions(path):
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_run_end_to_end(tiny_overrides, tmp_path, capsys):
    assert main(["run", *tiny_overrides]) == 0
    out = capsys.readouterr().out
    assert "Before/after" in out and "macro-F1" in out
    run_dir = tmp_path / "runs" / "tiny"

    for name in ("config.yaml", "run.json", "comparison.csv", "comparison.json",
                 "baseline/metrics.json", "baseline/predictions.csv", "finetuned/metrics.json",
                 "finetuned/predictions.csv", "adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "adapter/emotune.json", "train/log_history.json", "data/data_report.json", "data/test.parquet"):
        assert (run_dir / name).is_file(), name

    run_info = json.loads((run_dir / "run.json").read_text())
    assert run_info["status"] == "finished"
    assert {s["status"] for s in run_info["stages"].values()} == {"done"}
    assert run_info["versions"]["torch"]

    comparison = json.loads((run_dir / "comparison.json").read_text())
    for stage in ("baseline", "finetuned"):
        metrics = json.loads((run_dir / stage / "metrics.json").read_text())
        rows = _read_predictions(run_dir / stage / "predictions.csv")
        assert metrics["rows"] == len(rows) == 12
        share = sum(r["gold"] == r["predicted"] for r in rows) / len(rows)
        assert metrics["accuracy"] == pytest.approx(share)
        assert metrics["invalid"] == sum(r["predicted"] == "INVALID" for r in rows)
        matrix = metrics["confusion_matrix"]["matrix"]
        assert sum(map(sum, matrix)) == len(rows)
        key = "before" if stage == "baseline" else "after"
        assert comparison["metrics"]["accuracy"][key] == metrics["accuracy"]
        assert comparison["metrics"]["macro_f1"][key] == metrics["macro_f1"]
    acc = comparison["metrics"]["accuracy"]
    assert acc["delta"] == pytest.approx(acc["after"] - acc["before"])
    # the fine-tuned evaluation ran with the adapter merged (fp32: the same logits), and says so
    merge = json.loads((run_dir / "finetuned" / "metrics.json").read_text())["merge"]
    assert merge["merged"] is True and merge["max_logit_diff"] < 1e-4 and merge["rows_checked"] == 8
    assert run_info["merged_eval"] == merge and "merge" not in json.loads((run_dir / "baseline" / "metrics.json").read_text())
    assert "Adapter merged into the float32 weights" in out
    report = (run_dir / "report.html").read_text()
    assert "Adapter merged into the float32 weights" in report
    # the page is written during its own stage; the finished run's page says finished, every stage done
    assert "<td>finished (started" in report and ">running<" not in report and "running (started" not in report

    meta = json.loads((run_dir / "adapter" / "emotune.json").read_text())
    assert meta["labels"] == ["sadness", "joy", "love", "anger", "fear", "surprise"]
    assert "sadness, joy, love" in meta["system_prompt"]
    history = json.loads((run_dir / "train" / "log_history.json").read_text())
    assert any("loss" in entry for entry in history)


def test_finished_run_is_not_overwritten(tiny_overrides, tmp_path, capsys):
    assert main(["run", *tiny_overrides]) == 0
    metrics = (tmp_path / "runs" / "tiny" / "finetuned" / "metrics.json").read_text()
    capsys.readouterr()
    assert main(["run", *tiny_overrides]) == 2
    assert "finished run" in capsys.readouterr().err
    assert (tmp_path / "runs" / "tiny" / "finetuned" / "metrics.json").read_text() == metrics
    assert main(["run", *tiny_overrides, "overwrite=true"]) == 0


def test_bad_data_fails_before_run_folder(tiny_overrides, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello", "label": "joy"}\n{"text": "x", "label": "boredom"}\n' * 5)
    assert main(["run", *tiny_overrides, f"data.source={bad}"]) == 2
    err = capsys.readouterr().err
    assert "boredom" in err and "data.label_names" in err
    assert not (tmp_path / "runs" / "tiny").exists()


def test_lora_matching_no_module_refuses_to_train(tiny_overrides, tmp_path, capsys):
    assert main(["run", *tiny_overrides, "lora.target_modules=[no_such_proj]"]) == 2
    err = capsys.readouterr().err
    assert "`no_such_proj` names no module" in err and "lora.target_modules" in err
    assert not (tmp_path / "runs" / "tiny").exists()  # refused from config.json, before the run folder


@pytest.mark.slow  # subprocesses / several runs
def test_interrupted_run_resumes_and_skips_finished_stages(tiny_overrides, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    assert main(["run", *tiny_overrides]) == 0
    baseline = (run_dir / "baseline" / "metrics.json").read_text()
    # Simulate a crash after training: the fine-tuned evaluation never happened.
    info = json.loads((run_dir / "run.json").read_text())
    info["status"] = "failed"
    (run_dir / "run.json").write_text(json.dumps(info))
    for name in ("finetuned", "comparison.json", "comparison.csv"):
        path = run_dir / name
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink()
    capsys.readouterr()
    assert main(["run", *tiny_overrides]) == 0
    assert (run_dir / "baseline" / "metrics.json").read_text() == baseline  # not re-measured
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished"
    assert "already" in info["stages"]["train"]["note"]
    assert (run_dir / "finetuned" / "metrics.json").is_file()
    assert info["merged_eval"]["merged"] is True  # measured again by the resumed fine-tuned stage
    # a crash after the fine-tuned evaluation: the resumed run skips it and keeps its record in run.json
    info["status"] = "failed"
    (run_dir / "run.json").write_text(json.dumps(info))
    (run_dir / "comparison.json").unlink()
    assert main(["run", *tiny_overrides]) == 0
    resumed = json.loads((run_dir / "run.json").read_text())
    assert "already" in resumed["stages"]["finetuned"]["note"] and resumed["merged_eval"] == info["merged_eval"]


def test_resume_with_a_different_config_is_refused(tiny_overrides, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    assert main(["run", *tiny_overrides]) == 0
    info = json.loads((run_dir / "run.json").read_text())
    info["status"] = "failed"
    (run_dir / "run.json").write_text(json.dumps(info))
    capsys.readouterr()
    assert main(["run", *tiny_overrides, "lora.r=4"]) == 2
    assert "different config" in capsys.readouterr().err


@pytest.mark.slow  # two runs
def test_a_resumed_run_that_measures_again_writes_the_comparison_again(tiny_overrides, tmp_path, capsys):
    """The report stage counted as done while comparison.json existed, so a finished run whose finetuned/ was deleted
    (measured again on resume) kept the comparison of the measurement it replaced, and printed it as the result."""
    import shutil

    run_dir = tmp_path / "runs" / "tiny"
    assert main(["run", *tiny_overrides]) == 0
    comparison = json.loads((run_dir / "comparison.json").read_text())
    comparison["metrics"]["accuracy"]["after"] = 0.123456  # what an earlier measurement said
    (run_dir / "comparison.json").write_text(json.dumps(comparison))
    shutil.rmtree(run_dir / "finetuned")
    capsys.readouterr()
    assert main(["run", *tiny_overrides]) == 0
    measured = json.loads((run_dir / "finetuned" / "metrics.json").read_text())["accuracy"]
    assert json.loads((run_dir / "comparison.json").read_text())["metrics"]["accuracy"]["after"] == measured
    assert "0.123" not in capsys.readouterr().out
