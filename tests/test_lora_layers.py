"""`lora.layers`: adapters on some decoder layers only (PEFT's layers_to_transform), the backward pass that stops
at the lowest adapted layer, the checks against the model's layer count, resume, and export/merge."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import write_tiny_adapter
from emotune.core.config.build import dump_config
from emotune.core.config.load import load_config
from emotune.core.config.train import LoraSettings
from emotune.core.errors import UserError
from emotune.model.lora import attach_lora, check_layers, checkpoint_activations, resolve_layers
from test_lora import _tiny_gemma3n_multimodal, _tiny_gemma4_multimodal

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _four_layer_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config)


def _adapted(model) -> list[str]:
    return [name.removeprefix("base_model.model.") for name, module in model.named_modules()
            if hasattr(module, "lora_A") and name]


def _layers_of(names: list[str]) -> set[int]:
    return {int(LAYER.search(n).group(1)) for n in names}


# --------------------------------------------------------------------------------------------------
# Which modules get adapters


@pytest.mark.parametrize("layers, expected", [([1, 2], {1, 2}), (2, {2, 3}), (-1, {0}), (4, {0, 1, 2, 3}),
                                              (None, {0, 1, 2, 3})])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_adapters_sit_on_exactly_the_chosen_layers(layers, expected, targets):
    """A count is LLaMA-Factory's: N = the last N layers, -N = the first N; a list names the indices."""
    names = _adapted(attach_lora(_four_layer_gemma3(), LoraSettings(layers=layers, target_modules=targets)))
    per_layer = 7 if targets == "all-linear" else 2  # q, k, v, o, gate, up, down
    assert _layers_of(names) == expected and len(names) == per_layer * len(expected)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_gemma4_dir"])
def test_gemma3_and_gemma4_text_models_and_their_head_classifier(fixture, request):
    from emotune.model.head import classifier_from_causal
    from emotune.tasks.classify_head.objective import head_objective

    folder = request.getfixturevalue(fixture)
    names = _adapted(attach_lora(_load(folder), LoraSettings(layers=[1])))
    assert names and all(n.startswith("model.layers.1.") for n in names)

    objective = head_objective("macro_f1", 3)
    classifier = classifier_from_causal(_load(folder), ["a", "b", "c"])
    adapted = attach_lora(classifier, LoraSettings(layers=1, target_modules=["q_proj", "o_proj"]),
                          objective.lora_task_type, objective.modules_to_save)
    assert _layers_of(_adapted(adapted)) == {1} and len(_adapted(adapted)) == 2
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert any("score" in n and "modules_to_save" in n for n in trained)  # the head in full, whatever the layers


@pytest.mark.parametrize("build", [_tiny_gemma4_multimodal, _tiny_gemma3n_multimodal], ids=["gemma4", "gemma3n"])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_multimodal_checkpoints_adapt_their_language_model_layers_only(build, targets):
    """The vision and audio towers have `layers.N` of their own (Gemma 4's `vision_tower.encoder.layers.0.self_attn.q_proj`): PEFT's
    bare `layers` pattern would adapt them too, the language model's full path does not."""
    model = build()
    names = _adapted(attach_lora(model, LoraSettings(layers=[0], target_modules=targets)))
    assert names and all(n.startswith("model.language_model.layers.0.") for n in names)


# --------------------------------------------------------------------------------------------------
# The point: no backward pass below the lowest adapted layer


def _layer_outputs_and_grads(model, checkpointing: str) -> tuple[list[bool], torch.Tensor]:
    """Whether each decoder layer's output requires grad in a training forward pass, and the input embeddings'
    output (retained) after backward."""
    if checkpointing == "emotune":
        checkpoint_activations(model)
    elif checkpointing == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    outputs, embedded = [], []
    decoder = model.get_decoder()
    for layer in decoder.layers:
        layer.register_forward_hook(lambda m, i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    decoder.embed_tokens.register_forward_hook(lambda m, i, out: embedded.append(out))
    ids = torch.tensor([[2, 10, 11, 12, 13, 14]])
    loss = model(input_ids=ids, labels=ids).loss
    if embedded[0].requires_grad:
        embedded[0].retain_grad()
    loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    return [o.requires_grad for o in outputs], embedded[0]


def _adapted_with_nonzero_b(folder, layers):
    """PEFT starts B at 0, so A would get a zero gradient; a non-zero B lets every LoRA weight get one."""
    model = attach_lora(_load(folder), LoraSettings(r=2, layers=layers))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    return model


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_gemma4_dir"])
@pytest.mark.parametrize("checkpointing", ["off", "emotune"])
def test_frozen_layers_below_the_adapters_get_no_backward_pass(fixture, checkpointing, request):
    folder = request.getfixturevalue(fixture)
    requires, embedded = _layer_outputs_and_grads(_adapted_with_nonzero_b(folder, [1]), checkpointing)
    # Layer 0 is frozen and below every adapter: autograd recorded nothing there, so backward never runs it.
    assert requires == [False, True]
    assert not embedded.requires_grad and embedded.grad is None

    requires, _ = _layer_outputs_and_grads(_adapted_with_nonzero_b(folder, None), checkpointing)
    assert requires == [True, True]


def test_transformers_checkpointing_alone_would_run_backward_through_the_frozen_layers(tiny_model_dir):
    """Why emotune.model.lora.checkpoint_activations removes transformers' input-embeddings hook: with it, the embeddings'
    output requires grad and every frozen layer below the adapters joins the backward pass."""
    requires, embedded = _layer_outputs_and_grads(_adapted_with_nonzero_b(tiny_model_dir, [1]), "transformers")
    assert requires == [True, True] and embedded.grad is not None


# --------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("value, message", [
    ("[]", "empty list"), ("0", "0 layers"), ("[1, 1, 2]", "layer 1 is listed more than once"),
    ("[-1]", "count from 0"), ("true", "true/false is not a number"), ("1.5", "an integer in [-1000, 1000], not 0"),
    ("[a]", "whole number"), ("-1001", "an integer in [-1000, 1000]"),
])
def test_config_values_that_can_never_be_right(value, message):
    with pytest.raises(UserError, match="lora.layers") as err:
        load_config(None, [f"lora.layers={value}"])
    assert message in str(err.value)


def test_layers_the_model_does_not_have_are_refused():
    assert resolve_layers([3, 0], 4) == [0, 3] and resolve_layers(-4, 4) == [0, 1, 2, 3]
    with pytest.raises(UserError, match=r"lora.layers lists layer 4, 7.*indices 0 to 3"):
        resolve_layers([1, 4, 7], 4)
    with pytest.raises(UserError, match=r"lora.layers=-5 asks for 5 layers.*4 decoder layers"):
        resolve_layers(-5, 4)
    with pytest.raises(UserError, match="lora.layers"):
        attach_lora(_four_layer_gemma3(), LoraSettings(layers=[4]))


def test_multimodal_configs_count_their_text_models_layers():
    from transformers import Gemma4Config

    config = Gemma4Config(text_config=dict(num_hidden_layers=3))
    check_layers(LoraSettings(layers=[2]), config)
    with pytest.raises(UserError, match="3 decoder layers"):
        check_layers(LoraSettings(layers=[3]), config)


def test_run_refuses_a_layer_past_the_model_before_loading_weights(tiny_overrides, tmp_path, capsys):
    from emotune.cli import main

    assert main(["run", *tiny_overrides, "lora.layers=[0, 2]"]) == 2
    err = capsys.readouterr().err
    assert "lora.layers lists layer 2" in err and "indices 0 to 1" in err
    assert not (tmp_path / "runs" / "tiny").exists()


def test_plan_counts_the_adapters_of_the_chosen_layers_and_refuses_missing_ones(tiny_model_dir):
    """`emotune plan` builds the model from its config alone; its memory probe (one layer of each kind) adapts every
    probe layer, an upper bound."""
    from emotune.tasks import task_for
    from emotune.train.plan import make_plan

    settings = [f"model.source={tiny_model_dir}", "train.precision=fp32", "train.max_length=32", "lora.layers=[1]"]
    cfg = load_config(None, settings)
    plan = make_plan(cfg, task_for(cfg), "8GB")
    adapted = attach_lora(_load(tiny_model_dir), LoraSettings(layers=[1]))
    assert plan.arch.trainable == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    with pytest.raises(UserError, match="lora.layers lists layer 2"):
        make_plan(load_config(None, [*settings, "lora.layers=[2]"]), task_for(cfg), "8GB")


# --------------------------------------------------------------------------------------------------
# Resume and export


def _config_text(*overrides: str) -> str:
    return dump_config(load_config(None, list(overrides)))


def _unfinished_run(root, config_text: str):
    from emotune.core.rundir import RunDir, write_json, write_text

    run = RunDir(root)
    write_text(run.config, config_text)
    write_json(run.run_json, {"status": "failed"})


def test_resume_with_other_layers_is_refused_like_another_rank(tmp_path):
    from emotune.core.rundir import open_run

    _unfinished_run(tmp_path / "run", _config_text("lora.layers=[1]"))
    for other in (_config_text("lora.layers=[0]"), _config_text(), _config_text("lora.layers=1", "lora.r=4")):
        with pytest.raises(UserError, match="different config"):
            open_run(tmp_path / "run", other, overwrite=False)
    open_run(tmp_path / "run", _config_text("lora.layers=[1]"), overwrite=False)  # the same config resumes


def test_a_run_begun_before_the_key_existed_resumes_with_every_layer_only(tmp_path):
    from emotune.core.rundir import open_run

    older = "\n".join(line for line in _config_text().splitlines() if line != "  layers: null")
    assert older != _config_text()
    _unfinished_run(tmp_path / "run", older)
    with pytest.raises(UserError, match="different config"):
        open_run(tmp_path / "run", _config_text("lora.layers=[1]"), overwrite=False)
    open_run(tmp_path / "run", _config_text(), overwrite=False)


@pytest.mark.parametrize(("line", "other"), [("  target_parameters: null", ("lora.target_parameters=experts", "lora.dropout=0")),
                                             ("  adam_beta2: 0.999", ("train.adam_beta2=0.95",))])
def test_a_run_begun_before_a_key_existed_resumes_with_its_default_only(tmp_path, line, other):
    from emotune.core.rundir import open_run

    older = "\n".join(text for text in _config_text().splitlines() if text != line)
    assert older != _config_text()
    _unfinished_run(tmp_path / "run", older)
    with pytest.raises(UserError, match="different config"):
        open_run(tmp_path / "run", _config_text(*other), overwrite=False)
    open_run(tmp_path / "run", _config_text(), overwrite=False)


@pytest.mark.parametrize("task", ["classify", "classify_head"])
def test_merged_export_of_a_top_layer_adapter(task, tiny_model_dir, tmp_path):
    """The saved adapter holds layer 1's LoRA only; merging it leaves layer 0 as the base had it and matches the
    adapter's outputs."""
    from safetensors.torch import load_file

    from emotune.cli import main
    from emotune.deploy.export import merge_parity_gap

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "run", task=task, layers=[1])
    saved = [k for k in load_file(run / "adapter" / "adapter_model.safetensors") if "lora_" in k]
    assert saved and _layers_of(saved) == {1}
    assert "layers:\n  - 1" in (run / "config.yaml").read_text()
    out = tmp_path / "export"
    assert main(["export", str(run), "--merge", "--dtype", "float32", "--out", str(out)]) == 0
    merged = load_file(out / "merged" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    body = {k.removeprefix("model."): v for k, v in merged.items() if ".layers." in k}
    base_body = {k.removeprefix("model."): v for k, v in base.items() if ".layers." in k}
    q = "layers.{}.self_attn.q_proj.weight"
    assert torch.equal(body[q.format(0)], base_body[q.format(0)])
    assert not torch.equal(body[q.format(1)], base_body[q.format(1)])
    assert merge_parity_gap(run, ["i am so happy today", "my friend was furious"], merged_dir=out / "merged") < 1e-4


@pytest.mark.slow  # three training commands
@pytest.mark.parametrize("task", ["classify", "sft", "classify_head"])
def test_training_adapts_the_chosen_layers_in_every_task(task, tiny_overrides, tmp_path, capsys):
    """`emotune train` with lora.layers=1 (the last layer) and gradient checkpointing on: the adapter holds layer 1's
    LoRA only (and a head task's `score` in full), and the start says which layers are adapted."""
    from safetensors.torch import load_file

    from conftest import write_jsonl
    from emotune.cli import main
    from test_sft import _sft_rows

    overrides = [*tiny_overrides, "lora.layers=1", "train.gradient_checkpointing=true", f"task={task}"]
    if task == "sft":
        write_jsonl(tmp_path / "sft.jsonl", _sft_rows(40, seed=1))
        overrides = [o for o in overrides if not o.startswith(("data.", "eval."))] + [f"data.source={tmp_path / 'sft.jsonl'}"]
    assert main(["train", *overrides]) == 0, capsys.readouterr().err
    assert "on decoder layers 1 of 0-1" in capsys.readouterr().out
    weights = load_file(tmp_path / "runs" / "tiny" / "adapter" / "adapter_model.safetensors")
    assert _layers_of([k for k in weights if "lora_" in k]) == {1}
    assert any(k.endswith("score.weight") for k in weights) == (task == "classify_head")
