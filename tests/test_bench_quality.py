"""bench/quality.py: its JSON lines, from a real `emotune run` (--smoke: a tiny random model and 36 rows), and the
line that says it skipped when the emotion set is absent."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "quality.py"


def _bench(monkeypatch, capsys, *args: str) -> tuple[int, list[dict]]:
    monkeypatch.setattr(sys, "argv", [str(BENCH), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(BENCH), run_name="__main__")
    return exit_info.value.code, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_without_the_emotion_set_it_says_it_skipped(monkeypatch, capsys, tmp_path):
    code, lines = _bench(monkeypatch, capsys, "--data", str(tmp_path), "--budget", "15m")
    assert code == 0 and len(lines) == 1 and "the emotion set is needed" in lines[0]["skipped"]


def test_a_bad_budget_is_refused_before_anything_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--data", str(tmp_path), "--budget", "15"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert exit_info.value.code == 2 and "--budget 15 must be a duration; write it with units" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess running every stage of `emotune run`
def test_smoke_prints_one_line_per_budget_from_a_real_run(monkeypatch, capsys):
    code, lines = _bench(monkeypatch, capsys, "--smoke")
    assert code == 0 and len(lines) == 1
    line = lines[0]
    assert line["smoke"] and line["budget"] == "20s" and line["test_rows"] == 12
    for scores in (line, line["generate"]):
        for metric in ("accuracy", "macro_f1"):
            low, high = scores[f"{metric}_ci"]
            assert 0 <= low <= scores[metric] <= high <= 1
    assert set(line["baseline"]) == {"score", "generate"} and "invalid" in line["generate"]
    # the smoke run's epoch (36 rows, batches of 8) ends training before its budget
    assert line["steps"] == 5 and line["rows_trained"] == 40 and line["limited_by"] == "num_train_epochs"
    assert line["train_minutes"] > 0 and line["seconds_per_step"] > 0 and line["tokens_per_s"] > 0
    assert "target" not in line  # the targets are for 15m and 30m
