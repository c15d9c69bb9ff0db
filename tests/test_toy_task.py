"""Adding a task touches only its own folder and the registry line: the toy task of tests/toy_task/ is registered
explicitly and runs `emotune run` end to end (data, baseline, LoRA training, re-measure, comparison, report),
while no module of the product names it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from emotune.cli import main
from emotune.tasks import TASKS, register, unregister

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "emotune"


@pytest.fixture
def toy_task():
    from toy_task import task

    register("toy", task)
    yield task
    unregister("toy")
    assert "toy" not in TASKS


def test_no_product_module_names_the_toy_task():
    naming = [p for p in PACKAGE.rglob("*.py") if re.search(r"\btoy\b", p.read_text(encoding="utf-8"))]
    assert not naming


def test_toy_config_is_refused_until_the_task_is_registered(tmp_path, tiny_model_dir, data_dir, capsys):
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"task": "toy", "model": {"source": str(tiny_model_dir)},
                                      "data": {"source": str(data_dir)}}), encoding="utf-8")
    assert main(["config", str(config)]) != 0
    assert "`task`: 'toy' is not a task emotune knows" in capsys.readouterr().err


@pytest.mark.slow
def test_a_registered_toy_task_runs_end_to_end(toy_task, tiny_model_dir, data_dir, tmp_path, capsys):
    config = {
        "task": "toy", "toy_note": "end to end", "name": "toy", "output_dir": str(tmp_path / "runs"),
        "model": {"source": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "data": {"source": str(data_dir), "label_names": ["sadness", "joy", "love", "anger", "fear", "surprise"]},
        "train": {"max_steps": 2, "batch_size": 4, "gradient_accumulation_steps": 1, "gradient_checkpointing": False,
                  "precision": "fp32", "eval_steps": 1, "save_steps": 1, "logging_steps": 1, "learning_rate": 0.01},
        "eval": {"batch_size": 6},
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    assert main(["run", str(path)]) == 0
    run = tmp_path / "runs" / "toy"
    info = json.loads((run / "run.json").read_text(encoding="utf-8"))
    assert info["task"] == "toy" and info["status"] == "finished"
    assert "toy_note: end to end" in (run / "config.yaml").read_text(encoding="utf-8")
    comparison = json.loads((run / "comparison.json").read_text(encoding="utf-8"))
    assert comparison["metrics"]
    assert "<h2>Toy task</h2>" in (run / "report.html").read_text(encoding="utf-8")
