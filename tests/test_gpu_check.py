"""bench/gpu_check.py --dry-run: the GPU check's whole code path (a Gemma 4 text model built from a config, the
recipe's training with sdpa and eager attention, a forced out-of-memory error that emotune's recovery gets past,
both evaluation methods, telemetry) on the CPU with a tiny model, one JSON line per measure."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # three short trainings and two evaluations, about 10 s
def test_the_gpu_check_dry_run_writes_one_line_per_measure(tmp_path, capsys):
    check = runpy.run_path(str(ROOT / "bench" / "gpu_check.py"))
    out = tmp_path / "gpu_check.jsonl"
    assert check["main"](["--dry-run", "--profile", "--set", "eval.batch_size=4", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # nothing else on stdout
    assert lines == [json.loads(line) for line in out.read_text().splitlines()]
    measures = {line["measure"]: line for line in lines}
    assert list(measures) == ["device", "model", "train_sdpa", "train_eager", "oom_recovery", "profile_step",
                              "eval_score", "eval_generate"]
    assert measures["model"]["class"] == "Gemma4ForCausalLM"
    for name, attention in (("train_sdpa", "sdpa"), ("train_eager", "eager")):
        line = measures[name]
        assert line["attention"] == attention and line["steps"] == 2 and line["tokens_per_s"] > 0
        assert line["telemetry"]["samples"] >= 1 and line["oom_changes"] == []
    oom = measures["oom_recovery"]
    assert oom["finished"] and oom["recovered"] and not oom["gradient_checkpointing"]
    assert oom["oom_changes"][0]["setting"] == "rows per forward pass"  # the GPU path: no cap on passes to lower
    assert all(measures[f"eval_{m}"]["rows"] == 8 and measures[f"eval_{m}"]["rows_per_s"] > 0
               and measures[f"eval_{m}"]["batch_size"] == 4 for m in ("score", "generate"))  # --set reached the config
    profile = measures["profile_step"]
    assert profile["rows"] == 4 and profile["cpu_ms"] > 0 and profile["gpu_ms"] is None  # no GPU timeline on a CPU
    assert any(op["op"] == "aten::mm" for op in profile["top_cpu"])  # the linear layers' matrix products
