"""Full and freeze fine-tuning (`train.finetuning`, emotune.model.finetuning): what trains, the refusals before any
weights load, the run folder's model/ that predict, serve and export use, resuming, and LLaMA-Factory's keys."""

from __future__ import annotations

import csv
import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import LABELS, crash_after_checkpoint, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.deploy.predict import Classifier
from emotune.model import finetuning
from emotune.model.artifacts import find_artifact
from emotune.pipeline import run
from emotune.serve import build_engine, create_app
from server_harness import running

# model.dtype: predict and serve load in it (train.precision is a training setting), so all three read fp32 weights
LONGER = ["train.max_steps=4", "eval.method=score", "device=cpu", "model.dtype=float32"]


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _losses(run_dir) -> list[float]:
    return [e["loss"] for e in json.loads((run_dir / "train" / "log_history.json").read_text()) if "loss" in e]


def _finetuned_probs(run_dir) -> tuple[list[str], list[list[float]]]:
    with open(run_dir / "finetuned" / "predictions.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [[float(r[f"p_{label}"]) for label in LABELS] for r in rows]


def _same_probs(answered: list[list[float]], measured: list[list[float]]) -> None:
    """The probabilities predict or serve gave, against those the fine-tuned evaluation wrote (6 decimals)."""
    assert len(answered) == len(measured)
    assert max(abs(a - m) for one, other in zip(answered, measured, strict=True)
               for a, m in zip(one, other, strict=True)) < 2e-6


# --------------------------------------------------------------------------------------------------
# Config and refusals (before any weights load)


def test_freeze_settings_read_as_llamafactory_writes_them(tiny_overrides):
    cfg = load_config(None, [*tiny_overrides, "train.finetuning=freeze", "train.freeze_trainable_modules=mlp,self_attn",
                             "train.freeze_extra_modules=embed_tokens"])
    assert cfg.train.freeze_trainable_modules == ["mlp", "self_attn"]
    assert cfg.train.freeze_extra_modules == ["embed_tokens"]
    assert cfg.train.freeze_trainable_layers == 2  # LLaMA-Factory's default
    with pytest.raises(UserError, match="0 layers would train nothing"):
        load_config(None, [*tiny_overrides, "train.freeze_trainable_layers=0"])


@pytest.mark.parametrize(("change", "expected"), [
    ("model.quantization=4bit", "model.quantization=4bit stores the base weights in 4bit"),
    ("model.quantization=8bit", "set model.quantization=none, or train.finetuning=lora (QLoRA)"),
    ("train.loraplus_lr_ratio=16", "train.loraplus_lr_ratio=16.0 (LoRA+) is a LoRA method"),
    ("lora.init=olora", "lora.init=olora is a LoRA method"),
    ("lora.use_dora=true", "lora.use_dora=true (DoRA) is a LoRA method"),
    ("lora.layers=1", "lora.layers=1 is a LoRA method"),
    ("train.freeze_trainable_layers=3", "asks for 3 layers, but the model has 2 decoder layers"),
    ("train.freeze_trainable_layers=-5", "asks for 5 layers, but the model has 2 decoder layers"),
])
def test_what_full_or_freeze_cannot_do_is_refused_before_loading(tiny_overrides, tmp_path, change, expected):
    kind = "freeze" if "freeze_" in change else "full"
    with pytest.raises(UserError, match=f"train.finetuning={kind} cannot run with this config") as err:
        run(load_config(None, [*tiny_overrides, f"train.finetuning={kind}", change]))
    assert expected in str(err.value)
    assert not (tmp_path / "runs" / "tiny").exists()  # refused before the run folder (and the weights)


def test_training_on_from_an_adapter_is_refused_with_full(tiny_model_dir, tiny_overrides, tmp_path):
    start = write_tiny_adapter(tiny_model_dir, tmp_path / "start")
    with pytest.raises(UserError, match=r"lora.adapter=.* \(training on from an adapter\) is a LoRA method"):
        run(load_config(None, [*tiny_overrides, "train.finetuning=full", f"lora.adapter={start}"]))


def test_freeze_chooses_the_layers_and_modules_llamafactory_would(tiny_model_dir, tiny_overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    cfg = load_config(None, [*tiny_overrides, "train.finetuning=freeze", "train.freeze_trainable_layers=-1",
                             "train.freeze_trainable_modules=[self_attn]", "train.freeze_extra_modules=[norm]"])
    upcast = finetuning.prepare(model, cfg.train)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if n.startswith("model.layers.0.self_attn.")} | {"model.norm.weight"}
    assert set(upcast) == trained and all(model.get_parameter(n).dtype == torch.float32 for n in trained)
    finetuning.restore_dtypes(model, upcast)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cfg.train.freeze_trainable_modules = ["attention"]
    with pytest.raises(UserError, match="choose from input_layernorm, mlp, .*self_attn"):
        finetuning.prepare(model, cfg.train)
    cfg.train.freeze_trainable_modules, cfg.train.freeze_extra_modules = "all", ["vision_tower"]
    with pytest.raises(UserError, match="names `vision_tower`.*choose from .*embed_tokens"):
        finetuning.prepare(model, cfg.train)


def test_full_trains_every_weight_of_a_text_model(tiny_model_dir, tiny_overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.requires_grad_(False)
    finetuning.prepare(model, load_config(None, [*tiny_overrides, "train.finetuning=full"]).train)
    assert all(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# LLaMA-Factory's keys


def test_llamafactory_freeze_keys_translate_as_they_are(tmp_path, tiny_model_dir, capsys):
    from emotune.core.config.llamafactory import announce

    path = tmp_path / "freeze.yaml"
    path.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\ndo_train: true\nfinetuning_type: freeze\n"
                    "freeze_trainable_layers: -1\nfreeze_trainable_modules: mlp,self_attn\nfreeze_extra_modules: norm\n"
                    f"lora_rank: 4\ndataset: x\ndataset_dir: {tmp_path}\noutput_dir: {tmp_path}/out\n")
    cfg = load_config(path)
    assert (cfg.train.finetuning, cfg.train.freeze_trainable_layers) == ("freeze", -1)
    assert (cfg.train.freeze_trainable_modules, cfg.train.freeze_extra_modules) == (["mlp", "self_attn"], ["norm"])
    announce(path)
    out = " ".join(capsys.readouterr().out.split())
    assert "finetuning_type: freeze -> train.finetuning: freeze" in out
    assert "freeze_trainable_layers: -1 -> train.freeze_trainable_layers: -1" in out
    assert "lora_rank: a LoRA setting; finetuning_type: freeze trains no adapters" in out


# --------------------------------------------------------------------------------------------------
# End to end (slow)


@pytest.mark.slow
def test_a_full_run_trains_every_weight_and_serves_what_it_measured(tiny_model_dir, tiny_overrides, tmp_path):
    comparison = run(load_config(None, [*tiny_overrides, *LONGER, "train.finetuning=full"]))
    folder = tmp_path / "runs" / "tiny"
    assert set(comparison["methods"]["score"]["metrics"]["accuracy"]) >= {"before", "after"}
    losses = _losses(folder)
    assert losses[-1] < losses[0]
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "finished" and info["finetuning"] == {"kind": "full"}
    assert "full: every weight of the language model" in (folder / "report.html").read_text()
    assert not (folder / "adapter").exists() and (folder / "model" / "emotune.json").is_file()
    base, trained = _weights(tiny_model_dir), _weights(folder / "model")
    assert {k for k in base if not torch.equal(base[k], trained[k])} == set(base)  # every tensor moved

    texts, measured = _finetuned_probs(folder)
    artifact = find_artifact(folder)
    assert artifact.merged and artifact.path == folder / "model" and artifact.name == "tiny"
    _same_probs(Classifier(artifact, "cpu").probs(texts).tolist(), measured)
    engine, _ = build_engine(load_config(None, ["device=cpu"]), [str(folder)])
    with running(create_app(engine, ServeConfig())) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/classify", json={"model": "tiny", "input": texts[:3]})
        assert answer.status_code == 200, answer.text
        _same_probs([[row["probs"][label] for label in LABELS] for row in answer.json()["data"]], measured[:3])
    assert main(["export", str(folder), "--vllm"]) == 0
    exported = folder / "export" / "merged"
    assert torch.equal(_weights(exported)["model.norm.weight"], trained["model.norm.weight"])
    assert (folder / "export" / "vllm" / "serve_merged.sh").is_file()


@pytest.mark.slow
def test_a_freeze_run_changes_exactly_the_chosen_weights(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    main(["run", *tiny_overrides, *LONGER, "train.finetuning=freeze", "train.freeze_trainable_layers=1",
          "train.freeze_trainable_modules=[mlp]", "train.freeze_extra_modules=[norm]"])
    folder = tmp_path / "runs" / "tiny"
    assert json.loads((folder / "run.json").read_text())["status"] == "finished"
    assert "freeze: modules mlp of the last 1 decoder layers, plus norm" in (folder / "report.html").read_text()
    losses = _losses(folder)
    assert losses[-1] < losses[0]
    base, trained = _weights(tiny_model_dir), _weights(folder / "model")
    assert base.keys() == trained.keys()
    changed = {k for k in base if not torch.equal(base[k], trained[k])}
    assert changed == {k for k in base if k.startswith("model.layers.1.mlp.")} | {"model.norm.weight"}
    texts, measured = _finetuned_probs(folder)
    assert main(["predict", str(folder), *texts[:2]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    _same_probs([[line["probs"][label] for label in LABELS] for line in lines], measured[:2])


@pytest.mark.slow
def test_a_full_run_resumes_from_its_checkpoint_as_if_never_stopped(tiny_overrides, tmp_path, monkeypatch, capsys):

    common = ["train", *tiny_overrides, *LONGER, "train.finetuning=full", "train.save_total_limit=3", "seed=7"]
    assert main(common + ["name=straight"]) == 0
    crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="step-2 checkpoint"):
        main(common + ["name=cut"])
    monkeypatch.undo()
    assert not (tmp_path / "runs" / "cut" / "model").exists()
    capsys.readouterr()
    assert main(common + ["name=cut"]) == 0
    assert "(step 2), the newest intact checkpoint" in capsys.readouterr().out
    straight, resumed = _weights(tmp_path / "runs" / "straight" / "model"), _weights(tmp_path / "runs" / "cut" / "model")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_plan_counts_what_full_and_freeze_train_and_proposes_lora_when_they_do_not_fit(tiny_overrides, tiny_model_dir,
                                                                                      tmp_path):
    """The plan marks the weightless model as training marks the real one: full = every weight in fp32 with its
    gradient and AdamW's two moments; freeze = the chosen layers only, the frozen layers below them keeping nothing
    for the backward pass. What does not fit is offered LoRA; freeze counts beyond the model are refused as
    training refuses them."""
    from emotune.tasks import task_for
    from emotune.train.plan import FITS, make_plan

    def plan(*overrides: str, memory: str = "24GB"):
        cfg = load_config(None, [*tiny_overrides, "train.precision=bf16", "train.gradient_checkpointing=false",
                                 *overrides])
        return make_plan(cfg, task_for(cfg), memory)

    lora, full, freeze = plan(), plan("train.finetuning=full"), plan("train.finetuning=freeze",
                                                                     "train.freeze_trainable_layers=1")
    full_parts = full.training[False]
    assert full.arch.trainable == full.arch.parameters and "adapters" not in full_parts
    assert full_parts["trained weights (fp32)"] == 4 * full.arch.trainable == full_parts["gradients"]
    assert full_parts["optimizer state"] == 2 * full_parts["gradients"]
    assert 0 < freeze.arch.trainable < full.arch.trainable
    assert freeze.arch.layers[0](64) == 0 < freeze.arch.layers[-1](64)  # the frozen lowest layer keeps nothing
    assert all(q(64) > 0 for q in full.arch.layers)
    # the lowest layer frozen: less kept than LoRA (adapters on both layers) and full fine-tuning
    assert freeze.training[False]["activations"] < min(lora.training[False]["activations"], full_parts["activations"])
    assert sum(freeze.training[False].values()) < sum(full_parts.values())
    # evaluation holds the trained weights in their own dtype, and no adapters
    assert full.evaluations and all("adapters" not in parts for _, parts in full.evaluations.values())
    # wider layers (the tiny model's tokenizer, a config only: the plan loads no weights), where the weights dominate:
    # a memory that full fine-tuning's weights, gradients and AdamW state alone overfill is offered LoRA
    wide = tmp_path / "wide"
    shutil.copytree(tiny_model_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    config.update(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, layer_types=["sliding_attention"] * 4)
    (wide / "config.json").write_text(json.dumps(config))
    wide_full = plan(f"model.source={wide}", "train.finetuning=full").training[False]
    steady = sum(wide_full[k] for k in ("weights", "trained weights (fp32)", "gradients", "optimizer state"))
    tight = plan(f"model.source={wide}", "train.finetuning=full", memory=f"{steady * 0.95 / FITS / 2**20:.3f}MB")
    fix = next(f for f in tight.fixes if f["for"] == "training")
    assert tight.verdict() != "fits" and "train.finetuning=lora" in fix["overrides"] and fix["peak"] < steady, fix
    with pytest.raises(UserError, match="freeze_trainable_layers=99"):
        plan("train.finetuning=freeze", "train.freeze_trainable_layers=99")


@pytest.mark.slow
def test_a_freeze_run_of_a_head_task_trains_its_head_and_predicts_what_it_measured(tiny_model_dir, tiny_overrides,
                                                                                   tmp_path):
    run(load_config(None, [*tiny_overrides, *LONGER[:1], "device=cpu", "model.dtype=float32", "task=classify_head",
                           "train.finetuning=freeze", "train.freeze_trainable_layers=-1"]))
    folder = tmp_path / "runs" / "tiny"
    trained, base = _weights(folder / "model"), _weights(tiny_model_dir)
    assert any(k.endswith("score.weight") for k in trained)  # the head, saved in the model folder
    changed = {k for k in trained if k in base and not torch.equal(base[k], trained[k])}
    assert changed == {k for k in base if k.startswith("model.layers.0.")}
    texts, measured = _finetuned_probs(folder)
    artifact = find_artifact(folder)
    assert artifact.merged and artifact.has_head
    _same_probs(Classifier(artifact, "cpu").probs(texts).tolist(), measured)
