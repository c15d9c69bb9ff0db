"""PiSSA, OLoRA and LoftQ initialisations (`lora.init`): the adapter trained from them is saved converted onto the
original base, so it loads over the unchanged checkpoint with the logits the trained model had; PiSSA and OLoRA are
refused beside a quantized base (LoftQ: tests/test_loftq.py). Tiny random Gemma 3 (conftest: tiny_model_dir)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import fixed_batch_losses
from emotune.cli import main
from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model import init_methods
from emotune.model.artifacts import write_adapter
from emotune.model.lora import attach_lora


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_the_converted_adapter_works_on_the_original_base(tiny_model_dir, tmp_path, init):
    from peft import PeftModel
    from transformers import AutoTokenizer

    original = _load(tiny_model_dir)
    adapted = attach_lora(_load(tiny_model_dir), LoraSettings(r=4, dropout=0.0, init=init, pissa_iter=-1))
    changed = adapted.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(changed, original.model.layers[0].self_attn.q_proj.weight)  # the base was rewritten
    initial = init_methods.save_initial(adapted, tmp_path / "initial")
    losses = fixed_batch_losses(adapted, steps=8)
    assert losses[-1] < losses[0]
    adapted.eval()
    ids = torch.randint(6, 40, (2, 10))
    trained = adapted(input_ids=ids).logits
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    write_adapter(adapted, tokenizer, tmp_path / "converted", {}, convert_from=initial)
    config = json.loads((tmp_path / "converted" / "adapter_config.json").read_text())
    assert (config["r"], config["init_lora_weights"]) == (8, True)  # rank 2r, loads without initialising again
    on_original = PeftModel.from_pretrained(_load(tiny_model_dir), tmp_path / "converted").eval()
    assert (on_original(input_ids=ids).logits - trained).abs().max() < 1e-4
    merged = PeftModel.from_pretrained(_load(tiny_model_dir), tmp_path / "converted").merge_and_unload().eval()
    assert (merged(input_ids=ids).logits - trained).abs().max() < 1e-4  # plain W + BA, as vLLM and merges apply it


def test_rewriting_inits_over_a_quantized_base_are_refused():
    cpu = torch.device("cpu")
    with pytest.raises(UserError, match="lora.init=pissa rewrites the base weights, which a 4bit base cannot hold"):
        init_methods.check(LoraSettings(init="pissa"), ModelConfig(quantization="4bit"), cpu)
    init_methods.check(LoraSettings(init="pissa"), ModelConfig(), cpu)


@pytest.mark.slow
def test_a_pissa_run_exports_and_its_merge_matches_the_adapter(tiny_overrides, tmp_path):
    from emotune.deploy.export import merge_parity_gap

    assert main(["run", *tiny_overrides, "lora.init=pissa", "lora.r=4"]) == 0
    run = tmp_path / "runs" / "tiny"
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert main(["export", str(run), "--merge", "--out", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    assert merge_parity_gap(run, ["i am so happy today"], merged_dir=tmp_path / "export" / "merged") < 1e-4


# --------------------------------------------------------------------------------------------------
# Training on from an existing adapter (lora.adapter)


@pytest.mark.slow
def test_training_on_from_an_adapter_measures_it_as_the_before(tiny_overrides, tmp_path):
    assert main(["run", *tiny_overrides, "eval.method=score"]) == 0
    first = tmp_path / "runs" / "tiny"
    assert main(["run", *tiny_overrides, "eval.method=score", "name=tiny-on", f"lora.adapter={first}"]) == 0
    second = tmp_path / "runs" / "tiny-on"
    after_first = json.loads((first / "finetuned" / "metrics.json").read_text())
    before_second = json.loads((second / "baseline" / "metrics.json").read_text())
    assert before_second["log_loss"] == pytest.approx(after_first["log_loss"], abs=1e-4)  # its before = that adapter
    assert json.loads((second / "run.json").read_text())["before"].startswith(f"the adapter {first / 'adapter'}")
    from safetensors.torch import load_file

    old, new = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (first, second))
    assert old.keys() == new.keys() and any(not torch.equal(old[k], new[k]) for k in old)  # trained on


def test_a_start_adapter_with_a_fresh_initialisation_is_refused(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    from conftest import write_tiny_adapter

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "old")
    assert main(["run", *tiny_overrides, f"lora.adapter={run}", "lora.init=pissa"]) == 2
    assert "lora.init=pissa initialises fresh adapters, and lora.adapter starts from trained ones" in capsys.readouterr().err
