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


@pytest.mark.slow  # a tiny Gemma 4 multimodal model: loss, scores, two training steps, export and reload, about 20 s
def test_the_multimodal_dry_run_checks_emotune_against_the_model_s_own_numbers(tmp_path, capsys):
    check = runpy.run_path(str(ROOT / "bench" / "gpu_check.py"))
    assert check["main"](["--multimodal", "--dry-run", "--set", "train.precision=fp32"]) == 0
    lines = {line["measure"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(lines) == ["device", "mm_model", "mm_loss", "mm_scores", "mm_train", "mm_export"]
    model = lines["mm_model"]
    assert model["class"] == "Gemma4ForConditionalGeneration" and model["softcap"] == 30.0 and model["dtype"] == "float32"
    loss = lines["mm_loss"]
    assert loss["chunked"]["chunk_tokens"] < loss["loss_tokens"]  # the chunked path really ran
    assert loss["plain"]["relative_gap"] < 1e-6 and loss["chunked"]["relative_gap"] < 1e-3
    assert lines["mm_scores"]["max_abs_gap"] < 1e-3 and lines["mm_scores"]["top1_agreement"] == 1.0
    assert lines["mm_train"]["steps"] == 2 and lines["mm_train"]["finite"]
    export = lines["mm_export"]
    assert export["class"] == "Gemma4ForConditionalGeneration" and export["max_logit_gap"] < 1e-4
    assert {"chat_template.jinja", "generation_config.json", "tokenizer.json", "processor_config.json"} <= set(export["files"])
    assert export["processor"] == "Gemma4Processor" or "torchvision" in export["processor"].lower()
