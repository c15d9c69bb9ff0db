"""`emotune predict` and `emotune serve` answer as the run's own evaluation did: a run measured in fp32
(`train.precision: fp32`) is loaded in fp32, not in `auto`'s bf16, unless `model.dtype` says otherwise."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from conftest import LABELS
from emotune.cli import main
from emotune.core.config.load import load_config
from emotune.core.config.model import ModelConfig
from emotune.model import loading
from emotune.model.artifacts import find_artifact
from emotune.model.loading import serving_dtype

TEXTS = ["i am so happy today", "my friend was furious with me"]


@pytest.fixture(scope="module")
def fp32_run(tiny_model_dir, data_dir, tmp_path_factory):
    """A tiny classify run trained and measured in fp32; `model.dtype` left at `auto`."""
    root = tmp_path_factory.mktemp("measured")
    overrides = [f"model.source={tiny_model_dir}", f"data.source={data_dir}", f"output_dir={root}", "name=fp32",
                 f"data.label_names=[{', '.join(LABELS)}]", "train.max_steps=2", "train.batch_size=4",
                 "train.gradient_accumulation_steps=1", "train.gradient_checkpointing=false", "train.precision=fp32",
                 "train.eval_steps=2", "train.save_steps=2", "train.learning_rate=0.01", "eval.method=score",
                 "eval.batch_size=5", "device=cpu", f"model.cache_dir={root / 'cache'}"]
    assert main(["run", *overrides]) == 0
    return root / "fp32"


def test_the_run_records_the_dtype_it_was_measured_in(fp32_run):
    meta = json.loads((fp32_run / "adapter" / "emotune.json").read_text())
    assert meta["measured_dtype"] == "float32"
    assert find_artifact(str(fp32_run)).measured_dtype == "float32"


def test_predict_answers_with_the_probabilities_the_run_measured(fp32_run, capsys):
    with open(fp32_run / "finetuned" / "predictions.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:3]
    capsys.readouterr()
    assert main(["predict", str(fp32_run), *[r["text"] for r in rows]]) == 0
    answered = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    for got, row in zip(answered, rows, strict=True):
        measured = [float(row[f"p_{label}"]) for label in LABELS]
        # predictions.csv keeps 6 decimals; bf16 weights were off by ~1e-4 here
        assert got["probs"] == pytest.approx(dict(zip(LABELS, measured, strict=True)), abs=2e-6)


def test_serve_loads_the_base_in_the_measured_dtype(fp32_run):
    from emotune.serve.engine import build_engine

    engine, _ = build_engine(load_config(None, ["device=cpu"]), [str(fp32_run)])
    assert engine.dtype == torch.float32


def test_model_dtype_and_the_device_decide_before_the_record(monkeypatch):
    cpu = torch.device("cpu")
    assert serving_dtype(ModelConfig(dtype="bfloat16"), cpu, "float32") == torch.bfloat16  # model.dtype wins
    assert serving_dtype(ModelConfig(), cpu, "float32") == torch.float32
    auto = serving_dtype(ModelConfig(), cpu, None)  # runs from before the record, other tools' adapters
    assert auto == loading.weights_dtype(ModelConfig(), cpu)
    assert serving_dtype(ModelConfig(), cpu, "float16") == auto  # fp16 is not computed on a CPU
    monkeypatch.setattr(loading, "bf16_supported", lambda device: False)  # a CPU without native bf16
    assert serving_dtype(ModelConfig(), cpu, "bfloat16") == loading.weights_dtype(ModelConfig(), cpu)
