"""Families beyond the matrix, end to end on tiny folders: the real commands (run, export, predict) on checkpoints
whose class, layout or kind differs from the tested families' (tests/families.py names each released config)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import build_tokenizer, make_rows, write_jsonl
from emotune.cli import main
from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError
from emotune.model.attention import check_attention
from emotune.model.loading import load_model, load_tokenizer
from emotune.model.lora import language_model_linear_targets
from families import falcon, gemma4_moe, qwen2_5_vl, qwen2_moe, qwen3_moe

CPU = torch.device("cpu")


def _saved(builder, folder):
    tokenizer = build_tokenizer(folder)
    torch.manual_seed(0)
    builder(tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen_vl_dir(tmp_path_factory):
    return _saved(qwen2_5_vl, tmp_path_factory.mktemp("qwen2.5-vl"))


def _run_overrides(model_dir, data_dir, tmp_path, name: str) -> list[str]:
    return [f"model.source={model_dir}", f"data.source={data_dir}", f"output_dir={tmp_path / 'runs'}", f"name={name}",
            "data.label_names=[sadness, joy, love, anger, fear, surprise]", "train.max_steps=2", "train.batch_size=4",
            "train.gradient_checkpointing=false", "train.precision=fp32", "train.eval_steps=1", "train.save_steps=1",
            "train.logging_steps=1", "eval.batch_size=6", f"model.cache_dir={tmp_path / 'cache'}"]


def _task_overrides(task: str, overrides: list[str], tmp_path) -> list[str]:
    """The classify run's overrides, or for sft the same with an alpaca file of the same rows as its data."""
    if task != "sft":
        return overrides
    write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "classify the emotion", "input": row["text"],
                                          "output": row["label"]} for row in make_rows(6, seed=1)])
    kept = [o for o in overrides if not o.startswith(("data.source", "data.label_names"))]
    return [*kept, f"data.source={tmp_path / 'sft.jsonl'}"]


def test_a_vision_language_checkpoint_loads_as_its_wrapper(qwen_vl_dir):
    """Qwen2.5-VL (as Qwen2-VL, Qwen3-VL, Mistral 3, LLaVA) is known to AutoModelForImageTextToText only:
    AutoModelForCausalLM refused its config with a traceback, before any command could start."""
    check_attention(ModelConfig(source=str(qwen_vl_dir), attn_implementation="sdpa"), qwen_vl_dir, CPU, torch.float32)
    model = load_model(qwen_vl_dir, torch.float32, CPU)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    # all-linear adapts the language model's layers only, never the vision tower's
    targets = language_model_linear_targets(model)
    assert targets.startswith(r"^model\.language_model\.")
    adapted = [name for name, _ in model.named_modules() if __import__("re").fullmatch(targets, name)]
    assert adapted and not any("visual" in name for name in adapted)


@pytest.mark.slow  # a run, an export and a prediction
def test_a_vision_language_checkpoint_runs_exports_and_predicts(qwen_vl_dir, data_dir, tmp_path, capsys):
    assert main(["run", *_run_overrides(qwen_vl_dir, data_dir, tmp_path, "vl")]) == 0
    run_dir = tmp_path / "runs" / "vl"
    merge = json.loads((run_dir / "finetuned" / "metrics.json").read_text())["merge"]
    assert merge["merged"] is True and merge["max_logit_diff"] < 1e-4
    assert main(["export", str(run_dir), "--merge", "--dtype", "float32"]) == 0
    merged = run_dir / "export" / "merged"
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    capsys.readouterr()
    assert main(["predict", str(merged), "i am so happy today", "--device", "cpu"]) == 0
    assert any(label in capsys.readouterr().out for label in ("sadness", "joy", "love", "anger", "fear", "surprise"))


def test_plan_on_a_vision_language_checkpoint_measures_its_text_model(qwen_vl_dir, data_dir, capsys):
    """Qwen2.5-VL's text model (`qwen2_5_vl_text`) has no causal class of its own for plan's one-layer probe, which
    refused it; the probe runs transformers' base text model under an output layer, as the checkpoint's forward runs
    it on text (tests/test_plan.py holds the estimate to a measured step)."""
    assert main(["plan", f"model.source={qwen_vl_dir}", f"data.source={data_dir}", "--json",
                 "data.label_names=[sadness, joy, love, anger, fear, surprise]"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["training"]["checkpointing"]["activations"] > 0


def _bert(tokenizer):
    """google-bert/bert-base-uncased config.json: hidden 768, 12 layers, 12 heads, intermediate 3,072, absolute
    positions 512, bidirectional attention (a masked-LM encoder). Scaled: hidden 64, 2 layers, 4 heads."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=128, pad_token_id=tokenizer.pad_token_id))


def _t5(tokenizer):
    """google-t5/t5-small config.json: d_model 512, 6 encoder and 6 decoder layers, 8 heads of 64, relative position
    buckets. Scaled: d_model 64, 2 + 2 layers, 4 heads of 16."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               decoder_start_token_id=tokenizer.pad_token_id))


@pytest.mark.parametrize(("builder", "kind"), [(_bert, "encoder-only"), (_t5, "encoder-decoder")], ids=["bert", "t5"])
@pytest.mark.parametrize("task", ["classify", "classify_head", "sft"])
def test_encoder_models_are_refused_by_name_before_the_run_starts(builder, kind, task, data_dir, tmp_path, capsys):
    """A BERT loaded as transformers' BertLMHeadModel trained and scored without an error, attending in both
    directions (every position saw the answer it predicted), and classify_head and T5 stopped with tracebacks."""
    model_dir = _saved(builder, tmp_path / "model")
    overrides = _task_overrides(task, _run_overrides(model_dir, data_dir, tmp_path, "enc"), tmp_path)
    assert main(["run", f"task={task}", *overrides]) == 2
    err = capsys.readouterr().err
    assert kind in err and "decoder-only" in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "enc").exists()
    with pytest.raises(UserError, match=kind):  # predict, serve and export load through the same door
        load_model(model_dir, torch.float32, CPU)


@pytest.mark.slow  # a run
def test_an_alibi_checkpoint_trains_and_scores_whole_rows(data_dir, tmp_path, capsys):
    """Falcon-RW (tiiuae/falcon-rw-1b) counts its ALiBi positions from the attention mask: `emotune run` stopped with
    a traceback inside Falcon's forward (the shared prefix's and the scorer's explicit masks); it now trains and
    scores whole rows, and says why."""
    model_dir = _saved(lambda tokenizer: falcon(tokenizer, alibi=True), tmp_path / "falcon-rw")
    assert main(["run", *_run_overrides(model_dir, data_dir, tmp_path, "alibi"), "eval.method=score"]) == 0
    assert "ALiBi position bias is counted from the attention mask" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "runs" / "alibi" / "finetuned" / "metrics.json").read_text())
    assert metrics["rows"] == 12 and metrics["method"] == "score" and metrics["invalid"] == 0


def _base_model_tokenizer(folder, keep_unk: bool = True):
    """The suite's tokenizer as many base models ship theirs: no chat template, no pad token, and here no
    end-of-sequence token either (and no unknown token unless `keep_unk`); a GPT-2 body beside it."""
    from families import gpt2

    tokenizer = build_tokenizer(folder)
    torch.manual_seed(0)
    gpt2(tokenizer).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    tokenizer.chat_template = None
    tokenizer.pad_token = tokenizer.eos_token = None
    if not keep_unk:
        tokenizer.unk_token = None
    tokenizer.save_pretrained(folder)
    return folder


def test_a_tokenizer_without_pad_or_eos_pads_with_its_unknown_token(tmp_path, capsys):
    """Without a pad or end-of-sequence token, classify and sft stopped with transformers' "Asking to pad but the
    tokenizer does not have a padding token" and classify_head with a TypeError in its collate; now the unknown token
    pads (every batch masks it), and the run says what it filled in."""
    folder = _base_model_tokenizer(tmp_path / "base")
    tokenizer = load_tokenizer(folder, ModelConfig(), announce=True)
    assert tokenizer.pad_token == "<unk>" and tokenizer.chat_template
    said = capsys.readouterr().out
    assert "no chat template" in said and "model.chat_template=FILE" in said and "unk_token `<unk>`" in said
    bare = _base_model_tokenizer(tmp_path / "bare", keep_unk=False)
    with pytest.raises(UserError, match="pad_token.*tokenizer_config.json"):
        load_tokenizer(bare, ModelConfig())


@pytest.mark.slow  # three runs (sft's with its forgetting probe)
@pytest.mark.parametrize("task", ["classify", "classify_head", "sft"])
def test_a_base_model_tokenizer_runs_every_task(task, data_dir, tmp_path):
    model_dir = _base_model_tokenizer(tmp_path / "base")
    overrides = _task_overrides(task, _run_overrides(model_dir, data_dir, tmp_path, "base"), tmp_path)
    assert main(["run", f"task={task}", *overrides]) == 0
    assert main(["predict", str(tmp_path / "runs" / "base"), "i am so happy today", "--device", "cpu"]) == 0


def test_a_target_that_names_the_experts_weights_is_refused_before_the_run(data_dir, tmp_path, capsys):
    """Qwen3-MoE's routed experts are 3-D parameters in transformers 5 (`experts.gate_up_proj`), not modules: PEFT
    adapted `[q_proj, gate_up_proj]` as q_proj alone, without a word, since it refuses a list only when no name
    matches. Refused now, naming the weight and what LoRA adapts, before the run folder exists."""
    model_dir = _saved(qwen3_moe, tmp_path / "qwen3-moe")
    overrides = _run_overrides(model_dir, data_dir, tmp_path, "moe")
    assert main(["run", *overrides, "lora.target_modules=[q_proj, gate_up_proj]"]) == 2
    err = capsys.readouterr().err
    assert "`gate_up_proj` is a weight of Qwen3MoeExperts" in err and "lora.target_modules" in err
    assert not (tmp_path / "runs" / "moe").exists()
    with pytest.raises(UserError, match="`no_such_proj` names no module"):
        from emotune.core.config.train import LoraSettings
        from emotune.model.lora import attach_lora

        attach_lora(load_model(model_dir, torch.float32, CPU), LoraSettings(target_modules=["q_proj", "no_such_proj"]))


def test_routed_experts_take_lora_through_target_parameters(data_dir, tmp_path, capsys):
    """`lora.target_parameters=experts` adapts every routed expert weight of the language model (lora.layers
    restricts it like the modules); left out, the run says the experts stay frozen; a list naming no weight, or
    `experts` on a model without routed experts, is refused before the run folder exists."""
    from emotune.core.config.train import LoraSettings
    from emotune.model.lora import attach_lora
    from emotune.model.text import expert_weights

    model_dir = _saved(qwen3_moe, tmp_path / "qwen3-moe")
    experts = ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
               "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    assert sorted(expert_weights(load_model(model_dir, torch.float32, CPU))) == experts
    adapted = attach_lora(load_model(model_dir, torch.float32, CPU), LoraSettings(target_parameters="experts", dropout=0))
    assert sorted(adapted.peft_config["default"].target_parameters) == experts
    top = attach_lora(load_model(model_dir, torch.float32, CPU),
                      LoraSettings(target_parameters=["experts.down_proj"], dropout=0, layers=[1]))
    assert set(top.peft_config["default"].target_parameters) == {"model.layers.1.mlp.experts.down_proj"}
    assert "on decoder layers 1 of 0-1 and 1 weights (lora.target_parameters)" in capsys.readouterr().out
    attach_lora(load_model(model_dir, torch.float32, CPU), LoraSettings())
    assert "routed experts of Qwen3MoeForCausalLM (4 3-D weights) stay frozen" in capsys.readouterr().out

    overrides = _run_overrides(model_dir, data_dir, tmp_path, "moe")
    assert main(["run", *overrides, "lora.target_parameters=experts"]) == 2  # lora.dropout's default 0.05
    assert "set lora.dropout=0" in capsys.readouterr().err
    assert main(["run", *overrides, "lora.dropout=0", "lora.target_parameters=[experts.up_proj]"]) == 2
    assert "`experts.up_proj` names no weight of Qwen3MoeForCausalLM" in capsys.readouterr().err
    dense = _saved(qwen2_5_vl, tmp_path / "dense")
    assert main(["run", *_run_overrides(dense, data_dir, tmp_path, "dense"), "lora.dropout=0",
                 "lora.target_parameters=experts"]) == 2
    assert "has no routed experts" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_gemma4_moe_keeps_its_router_frozen_and_merges_expert_lora(tmp_path):
    """Gemma 4 26B-A4B's router holds its projection as a linear layer (`router.proj`): `all-linear` leaves it out,
    as every family's routing; `lora.target_parameters=experts` adapts its 3-D experts, and the merged weights give
    the adapter's logits after training steps."""
    from emotune.core.config.train import LoraSettings
    from emotune.model.lora import attach_lora

    tokenizer = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    base = gemma4_moe(tokenizer).float().eval()
    targets = language_model_linear_targets(base)
    adapted = [name for name, _ in base.named_modules() if __import__("re").fullmatch(targets, name)]
    assert "model.layers.0.mlp.gate_proj" in adapted and not any("router" in name for name in adapted)
    model = attach_lora(copy.deepcopy(base), LoraSettings(target_parameters="experts", dropout=0))
    assert len(model.peft_config["default"].target_parameters) == 8  # gate_up_proj and down_proj of 4 layers
    ids = torch.randint(3, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = model.eval()(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
        assert (trained - base(input_ids=ids).logits).abs().max() > 1e-3
    assert torch.allclose(merged, trained, atol=1e-5)


@pytest.mark.slow  # a run and a prediction
def test_a_run_with_lora_on_the_routed_experts_merges_and_predicts(data_dir, tmp_path, capsys):
    """The experts' LoRA trains, the merge check holds (PEFT merges each expert's update into its 3-D weight),
    predict reads the run folder, and the vLLM hand-off names the merged model instead of the adapter."""
    from safetensors.torch import load_file

    from emotune.deploy.export import vllm_blockers

    model_dir = _saved(qwen3_moe, tmp_path / "qwen3-moe")
    overrides = _run_overrides(model_dir, data_dir, tmp_path, "moe")
    assert main(["run", *overrides, "lora.dropout=0", "lora.target_parameters=experts", "train.max_steps=3",
                 "train.learning_rate=5e-3"]) == 0
    run_dir = tmp_path / "runs" / "moe"
    merge = json.loads((run_dir / "finetuned" / "metrics.json").read_text())["merge"]
    assert merge["merged"] is True and merge["max_logit_diff"] < 1e-4
    weights = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    expert_b = [w for name, w in weights.items() if "experts" in name and "lora_B" in name]
    assert len(expert_b) == 4 and all(w.abs().max() > 0 for w in expert_b)  # trained from zero
    assert any("target_parameters" in b for b in vllm_blockers(run_dir / "adapter"))
    capsys.readouterr()
    assert main(["predict", str(run_dir), "i am so happy today", "--device", "cpu"]) == 0
    assert any(label in capsys.readouterr().out for label in ("sadness", "joy", "love", "anger", "fear", "surprise"))


def test_olora_on_gpt2_conv1d_layers_is_refused_before_the_run(data_dir, tmp_path, capsys):
    """GPT-2's projections are transformers' Conv1D (weights stored transposed), which PEFT's OLoRA factors as they are:
    the first training pass stopped with 'mat1 and mat2 shapes cannot be multiplied' after the baseline evaluation.
    Refused from config.json now, naming PiSSA (which transposes them) as the fix."""
    from families import gpt2

    model_dir = _saved(gpt2, tmp_path / "gpt2")
    assert main(["run", *_run_overrides(model_dir, data_dir, tmp_path, "olora"), "lora.init=olora"]) == 2
    err = capsys.readouterr().err
    assert "lora.init=olora" in err and "Conv1D" in err and "lora.init=pissa" in err
    assert not (tmp_path / "runs" / "olora").exists()


def test_generation_ends_at_a_learned_position_table(tmp_path):
    """GPT-2's learned positions (openai-community/gpt2: n_positions 1,024; here 40): sft evaluation generated past the
    table and stopped with an IndexError inside the model's forward; a reply now ends at the context, and a prompt
    that fills it gets an empty reply."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from emotune.eval.evaluate import generate_texts

    tokenizer = build_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=40,
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    prompts = [" ".join(["happy"] * n) for n in (30, 12, 40)]
    replies = generate_texts(model, tokenizer, prompts, max_new_tokens=64, batch_size=2, desc=None)
    lengths = [len(tokenizer(reply, add_special_tokens=False)["input_ids"]) for reply in replies]
    assert lengths[0] <= 10 and lengths[1] <= 28 and replies[2] == ""


def test_all_linear_on_a_shared_expert_leaves_the_routed_experts_alone(tmp_path):
    """Qwen2-MoE's shared expert has linear layers named gate_proj, up_proj and down_proj, which PEFT (transformers 5)
    reads as the routed experts' old names: the all-linear regex put LoRA on every routed expert as well, and with
    dropout the run stopped ('ParamWrapper does not work with lora_dropout != 0'). Full names keep them modules."""
    from peft import get_peft_model

    from emotune.core.config.train import LoraSettings
    from emotune.model.lora import lora_config

    model = qwen2_moe(build_tokenizer(tmp_path))
    targets = language_model_linear_targets(model)
    assert isinstance(targets, list) and "model.layers.0.mlp.shared_expert.down_proj" in targets
    adapted = get_peft_model(model, lora_config(LoraSettings(dropout=0.05), model))
    assert not adapted.peft_config["default"].target_parameters
    wrapped = {name for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert {n.removeprefix("base_model.model.") for n in wrapped} == set(targets)
    assert not any("experts" in n and "shared_expert" not in n for n in wrapped)


def test_all_linear_leaves_out_the_mamba_weights_the_model_reads_directly(tmp_path):
    """ai21labs/AI21-Jamba-Mini-1.5's mixer (attention every 8th layer, Mamba otherwise) reads `dt_proj.weight` directly
    (`dt_proj.weight @ time_step`): a LoRA there trained nothing and was merged all the same. Scaled: hidden 64, 2 layers
    (Mamba, then attention), 2 experts."""
    import re

    from transformers import JambaConfig, JambaForCausalLM

    tokenizer = build_tokenizer(tmp_path)
    model = JambaForCausalLM(JambaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attn_layer_period=2, attn_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4))
    targets = language_model_linear_targets(model)
    adapted = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if re.fullmatch(targets, name)}
    assert {"in_proj", "x_proj", "out_proj", "q_proj"} <= adapted and "dt_proj" not in adapted


@pytest.mark.parametrize("layers", [None, [1]])
def test_a_target_list_naming_a_shared_experts_layers_adapts_those_modules_only(tmp_path, layers):
    """`lora.target_modules: [q_proj, gate_proj, up_proj, down_proj]` on Qwen2-MoE: PEFT read gate_proj etc. as
    transformers 4's routed experts and wrapped the experts' weights too, which with dropout stopped the run
    (ParamWrapper); the list names modules, and the routed experts are lora.target_parameters' to adapt."""
    from peft import get_peft_model

    from emotune.core.config.train import LoraSettings
    from emotune.model.lora import lora_config

    model = qwen2_moe(build_tokenizer(tmp_path))
    settings = LoraSettings(dropout=0.05, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], layers=layers)
    adapted = get_peft_model(model, lora_config(settings, model))
    assert not adapted.peft_config["default"].target_parameters
    wrapped = sorted(n.removeprefix("base_model.model.") for n, m in adapted.named_modules() if hasattr(m, "lora_A"))
    kept = [0, 1] if layers is None else layers
    assert wrapped == sorted(f"model.layers.{i}.{leaf}" for i in kept for leaf in (
        "self_attn.q_proj", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"))


def test_gpt_neo_local_layers_score_whole_rows(tmp_path):
    """EleutherAI/gpt-neo-125m config.json: hidden 768, 12 layers alternating global and local attention
    (`attention_layers`, window_size 256), learned positions, tied. Scaled: hidden 64, 2 layers (global, local), window
    4. Its local layers cut the window from a fixed causal buffer by index: label scoring put the label paths side by
    side after one prompt, whose indices run past their positions, and a path lost prompt keys inside its window
    (log-probabilities off by up to 17 against the model's own forward, without an error)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from emotune.eval.scoring import LabelScorer
    from emotune.model.prefix import cannot_share
    from families import spread_logits
    from test_equivalence import SHORT_PROMPT, TEXTS, TRIE_LABELS, brute_force_log_probs

    tokenizer = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = GPTNeoForCausalLM(GPTNeoConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=512, resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.eval()
    spread_logits(model, tokenizer)
    expected = brute_force_log_probs(model, tokenizer, TEXTS, SHORT_PROMPT, TRIE_LABELS)
    got = LabelScorer(model, tokenizer, SHORT_PROMPT, TRIE_LABELS).log_probs(TEXTS, batch_size=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert "(local)" in cannot_share(model)


def test_checkpointing_a_model_transformers_cannot_checkpoint_is_refused_before_the_run(data_dir, tmp_path, capsys):
    """jetmoe/jetmoe-8b config.json: hidden 2,048, 24 layers, mixture-of-attention-heads and 8 MLP experts (2 per token),
    a class transformers marks `supports_gradient_checkpointing = False`. Scaled: hidden 64, 2 layers, 4 experts.
    `train.gradient_checkpointing=true` stopped the run with transformers' ValueError after the baseline evaluation."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    def jetmoe(tokenizer):
        return JetMoeForCausalLM(JetMoeConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                              num_key_value_heads=2, kv_channels=16, intermediate_size=64,
                                              num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                              eos_token_id=tokenizer.eos_token_id))

    model_dir = _saved(jetmoe, tmp_path / "jetmoe")
    overrides = _run_overrides(model_dir, data_dir, tmp_path, "gc")
    assert main(["run", *overrides, "train.gradient_checkpointing=true"]) == 2
    err = capsys.readouterr().err
    assert "JetMoeForCausalLM does not support gradient checkpointing" in err and "Traceback" not in err
    assert "train.gradient_checkpointing=auto" in err and not (tmp_path / "runs" / "gc").exists()


def test_recurrent_gemma_scores_and_trains_under_its_own_soft_cap(tmp_path):
    """google/recurrentgemma-2b config.json: hidden 2,560, 26 layers (recurrent, recurrent, local attention of 2,048),
    10 heads / 1 KV head, final logits soft-capped at 30 under the name `logits_soft_cap` (Gemma's is
    `final_logit_softcapping`), tied. Scaled: hidden 64, 3 layers, window 8; the cap as released. Label scores came
    without the cap, and the chunked loss (SFT, more than CHUNK_TOKENS positions a pass) capped the hidden states
    instead of the logits: the model's forward caps by dividing by the field unconditionally, so it cannot be
    suspended; that model takes the one-projection path."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    from emotune.eval.scoring import LabelScorer
    from emotune.model.text import logit_softcap
    from emotune.train.batches import collate, completion_loss
    from families import spread_logits
    from test_equivalence import SHORT_PROMPT, TEXTS, TRIE_LABELS, brute_force_log_probs, classify_rows, reference_update

    tokenizer = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, attention_window_size=8, logits_soft_cap=30.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.eval()
    spread_logits(model, tokenizer)
    texts = TEXTS[1:3]  # a short and a long one (past the window)
    expected = brute_force_log_probs(model, tokenizer, texts, SHORT_PROMPT, TRIE_LABELS)
    got = LabelScorer(model, tokenizer, SHORT_PROMPT, TRIE_LABELS).log_probs(texts, batch_size=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    rows = classify_rows(tokenizer, n=3)
    own, _ = reference_update(model, rows, tokenizer.pad_token_id)
    with torch.no_grad():
        parts = completion_loss(model, collate(rows, tokenizer.pad_token_id, CPU), chunk_tokens=5)
    assert float(parts.loss_sum) / parts.tokens == pytest.approx(own, rel=1e-5)
    assert logit_softcap(model) == 30.0
