"""The adapter folder format: emotune's own adapters, and adapters made by other tools (plain PEFT, also
the older `adapter_model.bin`), which load when the labels and prompt are given by a config or a flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import LABELS
from emotune.cli import main
from emotune.core.config.data import PromptConfig
from emotune.core.errors import UserError
from emotune.model.artifacts import META, Fallback, find_artifact, load_artifact_model


def _foreign_adapter(model_dir: Path, folder: Path, safetensors: bool) -> Path:
    """What PEFT (and LLaMA-Factory, TRL, which save through it) writes: no emotune.json, no tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(folder, safe_serialization=safetensors)
    assert (folder / ("adapter_model.safetensors" if safetensors else "adapter_model.bin")).is_file()
    return folder


@pytest.fixture(scope="module", params=["safetensors", "bin"])
def foreign(request, tiny_model_dir, tmp_path_factory) -> Path:
    return _foreign_adapter(tiny_model_dir, tmp_path_factory.mktemp("foreign") / "lf-adapter", request.param == "safetensors")


def test_own_adapter_round_trips_through_the_writer(tiny_run_dir):
    artifact = find_artifact(tiny_run_dir)
    assert artifact.path == tiny_run_dir / "adapter" and not artifact.merged and not artifact.foreign
    assert artifact.labels == LABELS and artifact.name == "tiny"
    assert json.loads((artifact.path / META).read_text(encoding="utf-8"))["task"] == "classify"


def test_a_label_holding_a_comma_is_quoted_in_the_prompt_and_older_adapters_keep_theirs(tiny_run_dir, tmp_path):
    """`joy, really` among the labels made the system prompt list `anger, joy, really, fear`: four labels to read,
    two of them not labels. Labels are quoted when one holds a comma; an adapter trained with the old list is
    still served the prompt it was trained with (emotune.json records it)."""
    import shutil

    from emotune.model.prompt import system_prompt

    labels = ["anger", "joy, really", "喜悦、开心"]
    template = PromptConfig().system_prompt
    assert '"anger", "joy, really", "喜悦、开心"' in system_prompt(PromptConfig(), labels)
    assert "sadness, joy, love" in system_prompt(PromptConfig(), LABELS)  # no comma in any label: unchanged
    for recorded in (template.replace("{labels}", ", ".join(labels)), system_prompt(PromptConfig(), labels)):
        run = shutil.copytree(tiny_run_dir, tmp_path / str(len(list(tmp_path.iterdir()))))
        meta_path = run / "adapter" / META
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        meta_path.write_text(json.dumps({**meta, "labels": labels, "system_prompt_template": template,
                                         "system_prompt": recorded}), encoding="utf-8")
        artifact = find_artifact(run)
        assert system_prompt(artifact.prompt, artifact.labels) == recorded


def test_foreign_adapter_without_labels_or_prompt_names_what_is_missing(foreign):
    with pytest.raises(UserError) as err:
        find_artifact(foreign)
    message = str(err.value)
    assert "another tool" in message and "the label set or the prompt" in message and "--config" in message
    with pytest.raises(UserError, match="the prompt"):
        find_artifact(foreign, fallback=Fallback(labels=LABELS, source="--labels"))


def test_foreign_adapter_loads_its_own_weights(foreign, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    artifact = find_artifact(foreign, fallback=Fallback(labels=LABELS, prompt=PromptConfig(),
                                                        base_model=str(tiny_model_dir)))
    assert artifact.foreign and artifact.labels == LABELS
    model, tokenizer = load_artifact_model(artifact, torch.float32, torch.device("cpu"))
    ids = tokenizer("i am happy today", return_tensors="pt").input_ids
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), foreign).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs, plain = model(ids).logits, reference(ids).logits, base(ids).logits
    torch.testing.assert_close(ours, theirs)
    assert (ours - plain).abs().max() > 1e-4  # the adapter's weights were really loaded


def test_eval_measures_a_foreign_adapter_with_the_configs_labels_and_prompt(foreign, tiny_overrides, capsys):
    assert main(["eval", *tiny_overrides, f"adapter={foreign}", "eval.method=score"]) == 0
    out = foreign.parent / "eval" / "test-lf-adapter"
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["rows"] == 12 and set(metrics["per_class"]) <= set(LABELS)


def test_predict_takes_labels_and_prompt_from_a_config(foreign, tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "lf.yaml"
    config.write_text(f"model:\n  source: {tiny_model_dir}\ndata:\n  label_names: [sadness, joy, love, anger, fear, surprise]\n",
                      encoding="utf-8")
    assert main(["predict", str(foreign), "i am so happy", "--device", "cpu"]) == 2
    assert "another tool" in capsys.readouterr().err
    assert main(["predict", str(foreign), "i am so happy", "--device", "cpu", "--config", str(config)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["label"] in LABELS and abs(sum(line["probs"].values()) - 1) < 1e-4
    assert main(["predict", str(foreign), "i am so happy", "--config", str(config), "--labels", "joy,,joy"]) == 2
    assert "--labels" in capsys.readouterr().err


@pytest.mark.parametrize("meta", [[1, 2], {"labels": 5}, {"labels": ["", "joy"]}, {"labels": ["joy", "joy"]},
                                  {"labels": [], "user_template": 3}, {"task": ["classify"]}])
def test_an_edited_emotune_json_is_a_clear_error(tiny_model_dir, tmp_path, meta):
    from conftest import write_tiny_adapter

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "edited")
    path = run / "adapter" / META
    good = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**good, **meta} if isinstance(meta, dict) else meta), encoding="utf-8")
    with pytest.raises(UserError, match="emotune.json"):
        find_artifact(run)


@pytest.mark.parametrize("damage", ["missing", "empty", "cut short"])
@pytest.mark.parametrize("command", [["predict", "{run}", "joy"], ["export", "{run}", "--out", "{tmp}/exported"],
                                     ["eval", "adapter={run}"]])
def test_an_adapter_without_whole_weights_is_refused_by_name_before_loading(tiny_model_dir, tmp_path, capsys, damage,
                                                                             command):
    """An adapter folder whose adapter_model.safetensors was missing, empty or cut short: predict and eval ended in
    safetensors' `header too small` traceback (a missing file: `HFValidationError: Repo id must be a string`, PEFT
    took the folder for a hub id), and export wrote the broken adapter out as a good export."""
    from conftest import write_tiny_adapter

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "damaged")
    weights = run / "adapter" / "adapter_model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:100])
    argv = [a.format(run=run, tmp=tmp_path) for a in command]
    if command[0] == "eval":
        argv += [f"model.source={tiny_model_dir}", "data.label_names=[sadness, joy, love, anger, fear, surprise]"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "emotune: error: " in err and "adapter_model.safetensors" in err and "Traceback" not in err
    assert not (tmp_path / "exported").exists()
