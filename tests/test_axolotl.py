"""Axolotl training YAMLs: translated to `task: sft` with Axolotl's defaults, refused clearly where emotune cannot
train the same way, and run end to end through `emotune run` on the tiny model.

The YAML is written here in the shape of Axolotl's examples/llama-3/qlora-1b.yml (flat keys, a `datasets` list),
not copied from it.
"""

from __future__ import annotations

import json
import random

import pytest

from conftest import CUES, FILLER, LABELS, write_jsonl
from emotune.cli import main
from emotune.core.config.load import load_config
from emotune.core.errors import UserError

QLORA_YAML = """\
base_model: {model}
load_in_4bit: true
adapter: qlora
lora_r: 8
lora_alpha: 16
lora_target_linear: true

datasets:
  - path: {data}
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.2
output_dir: {out}/outputs/qlora-out

sequence_len: 128
sample_packing: false
pad_to_sequence_len: true

wandb_project:
wandb_log_model:

gradient_accumulation_steps: 2
micro_batch_size: 4
num_epochs: 2
optimizer: adamw_bnb_8bit
learning_rate: 2e-4
bf16: auto
tf32: false
gradient_checkpointing: true
flash_attention: true
logging_steps: 1
evals_per_epoch: 4
special_tokens:
  pad_token: "<pad>"
"""


def _alpaca_rows(n: int) -> list[dict]:
    rng = random.Random(1)
    rows = []
    for _ in range(n):
        label = rng.choice(LABELS)
        text = " ".join(rng.sample(FILLER, 4) + [rng.choice(CUES[label])])
        rows.append({"instruction": "classify the emotion of this text", "input": text, "output": label})
    return rows


@pytest.fixture
def ax_yaml(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "emotion_alpaca.jsonl", _alpaca_rows(40))

    def write(text: str = QLORA_YAML, **changes):
        lines = text.format(model=tiny_model_dir, data=data, out=tmp_path).splitlines()
        for key, value in changes.items():  # replace a top-level key's line, or add it
            lines = [line for line in lines if not line.startswith(f"{key}:")]
            if value is not None:
                lines.append(f"{key}: {value}")
        path = tmp_path / "qlora.yml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path
    return write


def test_a_qlora_alpaca_file_translates_to_the_expected_config(ax_yaml, tiny_model_dir, tmp_path):
    cfg = load_config(ax_yaml())
    assert cfg.task == "sft"
    assert (cfg.model.source, cfg.model.quantization, cfg.model.quant_type, cfg.model.double_quant) == (
        str(tiny_model_dir), "4bit", "nf4", True)
    assert (cfg.data.source, cfg.data.format, cfg.data.input_separator) == (
        str(tmp_path / "emotion_alpaca.jsonl"), "alpaca", "\n\n")
    assert (cfg.data.validation_size, cfg.data.cleaning.duplicates, cfg.train.max_length) == (0.2, "keep", 128)
    assert cfg.lora.model_dump() == {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear",
                                     "target_parameters": None, "use_rslora": False, "use_dora": False,
                                     "modules_to_save": None, "init": "default", "pissa_iter": 16, "adapter": None,
                                     "layers": None}
    train = cfg.train
    assert (train.finetuning, train.batch_size, train.gradient_accumulation_steps) == ("lora", 4, 2)
    assert (train.learning_rate, train.num_train_epochs, train.max_steps) == (2e-4, 2.0, -1)
    # Axolotl's defaults where the file is silent: cosine, 3% warmup, no weight decay, clipping at 1.0, no grouping
    assert (train.lr_scheduler_type, train.warmup_ratio, train.warmup_steps) == ("cosine", 0.03, 0)
    assert (train.weight_decay, train.max_grad_norm, train.group_by_length) == (0.0, 1.0, False)
    assert (train.optim, train.precision, train.gradient_checkpointing, train.logging_steps) == (
        "adamw_8bit", "auto", True, 1)
    assert (cfg.output_dir, cfg.name, cfg.seed) == (f"{tmp_path}/outputs", "qlora-out", 42)


def test_keys_left_out_take_axolotls_defaults(ax_yaml):
    path = ax_yaml(load_in_4bit=None, adapter="lora", learning_rate="0.0001", micro_batch_size=None,
                   gradient_accumulation_steps=None, num_epochs=None, sequence_len=None, val_set_size=None,
                   optimizer=None)
    cfg = load_config(path)
    assert cfg.model.quantization == "none" and cfg.lora.dropout == 0.0
    assert (cfg.train.batch_size, cfg.train.gradient_accumulation_steps, cfg.train.num_train_epochs) == (1, 1, 1.0)
    assert (cfg.train.max_length, cfg.data.validation_size, cfg.train.optim) == (512, 0.1, "adamw_torch_fused")


def test_a_chat_template_dataset_maps_its_columns_and_roles(ax_yaml, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [
        {"conversations": [{"from": "human", "value": f"classify {row['input']}"}, {"from": "gpt", "value": row["output"]}]}
        for row in _alpaca_rows(20)])
    text = QLORA_YAML.replace("    type: alpaca", "    type: chat_template\n    field_messages: conversations\n"
                              "    message_property_mappings:\n      role: from\n      content: value\n"
                              "    roles:\n      user: [human]\n      assistant: [gpt]")
    cfg = load_config(ax_yaml(text.replace("{data}", str(data))))
    assert (cfg.data.source, cfg.data.format, cfg.data.columns.messages) == (str(data), "sharegpt", "conversations")
    tags = cfg.data.tags
    assert (tags.role_tag, tags.content_tag, tags.user_tag, tags.assistant_tag) == ("from", "value", "human", "gpt")
    # the OpenAI layout, Axolotl's default, is emotune's messages format; a hub id that is no local path is hf:
    plain = QLORA_YAML.replace("    type: alpaca", "    type: chat_template").replace("{data}", "owner/chats")
    cfg = load_config(ax_yaml(plain))
    assert (cfg.data.source, cfg.data.format) == ("hf:owner/chats", "messages")


def test_refused_keys_are_named_all_at_once_with_exit_2_and_no_run_folder(ax_yaml, tmp_path, capsys):
    text = QLORA_YAML.replace("    type: alpaca", "    type: completion\n  - path: other/data\n    type: alpaca")
    path = ax_yaml(text, sample_packing="true", rl="dpo", deepspeed="deepspeed_configs/zero2.json",
                   train_on_inputs="true", lr_scheduler="one_cycle", chat_template="chatml")
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    for expected in ("`sample_packing: true` is not supported", "`rl: dpo` is not supported",
                     "`deepspeed: deepspeed_configs/zero2.json` is not supported",
                     "`train_on_inputs: true` is not supported", "`lr_scheduler: one_cycle` is not supported",
                     "`datasets` lists 2 datasets", "`datasets[0].type: completion` is not supported",
                     "`chat_template: chatml` is not supported"):
        assert expected in message
    assert main(["run", str(path)]) == 2
    assert "`rl: dpo` is not supported" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_the_translation_is_printed_with_ignored_keys(ax_yaml, capsys):
    from emotune.core.config.axolotl import announce

    announce(ax_yaml())
    out = capsys.readouterr().out
    assert out.startswith("Axolotl config ")
    assert "lora_r: 8" in out and "->  lora.r: 8" in out
    assert "lr_scheduler: cosine (default)" in out
    ignored = dict(line.strip().split(": ", 1) for line in out.split("Ignored keys:")[1].split("Notes:")[0].splitlines()
                   if line.strip())
    for key in ("wandb_project", "flash_attention", "tf32", "pad_to_sequence_len", "dataset_prepared_path",
                "evals_per_epoch", "special_tokens.pad_token"):
        assert key in ignored
    assert "changes nothing learned" in ignored["wandb_project"]
    assert "not Axolotl's Alpaca prompt" in out


def test_axolotls_gemma4_moe_example_translates(ax_yaml, capsys):
    """Keys of Axolotl's Gemma 4 26B-A4B QLoRA example (examples/gemma4/26b-a4b-moe-qlora.yaml, its shape): LoRA on the
    routed experts (lora_target_parameters), the family's own named template, bnb_config_kwargs, torch's 8-bit AdamW,
    the kernels plugin; unfrozen_parameters and eot_tokens are what emotune does under an adapter anyway."""
    from emotune.core.config.axolotl import announce

    path = ax_yaml(lora_target_parameters="[experts.gate_up_proj, experts.down_proj]", chat_template="gemma3",
                   bnb_config_kwargs="{bnb_4bit_use_double_quant: false}", optimizer="adamw_torch_8bit",
                   plugins="[axolotl.integrations.kernels.KernelsPlugin]", unfrozen_parameters="['^lm_head.*']",
                   eot_tokens="['<end_of_turn>']", quantize_moe_experts="true", lora_mlp_kernel="true",
                   base_model="google/gemma-3-270m-it")
    cfg = load_config(path)
    assert cfg.lora.target_parameters == ["experts.gate_up_proj", "experts.down_proj"]
    assert (cfg.model.double_quant, cfg.train.optim, cfg.model.chat_template) == (False, "adamw_8bit", None)
    announce(path)
    out = capsys.readouterr().out
    assert "chat_template: gemma3: the template of google/gemma-3-270m-it's own family" in out
    assert "unfrozen_parameters: with an adapter only the adapters train" in out
    assert "eot_tokens: ['<end_of_turn>']: emotune trains each answer through the chat template's own" in out
    assert "quantize_moe_experts: true: emotune keeps a mixture-of-experts model's routed experts" in out
    with pytest.raises(UserError, match="`chat_template: gemma3` is not supported"):
        load_config(ax_yaml(chat_template="gemma3", base_model="meta-llama/Llama-3.2-1B"))  # another family's
    with pytest.raises(UserError, match="`unfrozen_parameters: .*` is not supported"):
        load_config(ax_yaml(adapter=None, load_in_4bit=None, unfrozen_parameters="['^lm_head.*']"))
    with pytest.raises(UserError, match="`bnb_config_kwargs: .*` is not supported beyond"):
        load_config(ax_yaml(bnb_config_kwargs="{llm_int8_threshold: 5.0}"))


def test_the_trainers_adam_settings_are_translated(ax_yaml):
    cfg = load_config(ax_yaml(adam_beta2="0.95", adam_epsilon="1e-6"))  # YAML reads 1e-6 as text
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_epsilon) == (0.9, 0.95, 1e-6)


def test_config_from_axolotl_writes_an_equivalent_emotune_yaml(ax_yaml, tmp_path, capsys):
    path = ax_yaml()
    assert main(["config", "--from-axolotl", str(path), "max_steps=5"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Axolotl config ")
    saved = tmp_path / "translated.yaml"
    saved.write_text(text, encoding="utf-8")
    assert load_config(saved) == load_config(path, ["max_steps=5"])
    assert main(["config", "--from-axolotl", str(saved)]) == 2  # an emotune config needs no translation
    assert "is not an Axolotl training config" in capsys.readouterr().err


def test_key_value_overrides_apply_on_top(ax_yaml):
    cfg = load_config(ax_yaml(), ["train.max_steps=7", "lora_r=2", "seed=3", "sequence_len=64"])
    assert (cfg.train.max_steps, cfg.lora.r, cfg.seed, cfg.train.max_length) == (7, 2, 3, 64)
    with pytest.raises(UserError, match="`micro_batchsize` is not an Axolotl key; did you mean `micro_batch_size`"):
        load_config(ax_yaml(), ["micro_batchsize=2"])


def test_emotune_and_llamafactory_files_are_not_taken_for_axolotl(tmp_path):
    from emotune.core.config.axolotl import is_axolotl

    emotune_cfg = tmp_path / "own.yaml"
    emotune_cfg.write_text("task: sft\nmodel:\n  source: x\ndata:\n  source: d.jsonl\ntrain:\n  max_steps: 2\n")
    assert load_config(emotune_cfg).data.source == "d.jsonl"
    assert not is_axolotl({"model_name_or_path": "x", "stage": "sft", "dataset": "a", "lora_rank": 8})
    assert not is_axolotl({"task": "sft", "model": {"source": "x"}, "data": {"source": "d"}})


@pytest.mark.slow
def test_emotune_run_on_an_axolotl_file(ax_yaml, tmp_path):
    path = ax_yaml(load_in_4bit=None, adapter="lora", max_steps=2)
    code = main(["run", str(path), "train.precision=fp32", "eval.max_new_tokens=3", "eval.probe=false",
                 "data.test_limit=4", f"model.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    folder = tmp_path / "outputs" / "qlora-out"
    assert json.loads((folder / "run.json").read_text())["status"] == "finished"
    saved = (folder / "config.yaml").read_text()
    assert "lr_scheduler_type: cosine" in saved and "format: alpaca" in saved


def test_peft_loftq_config_is_loras_loftq_start(ax_yaml):
    """Axolotl's examples/llama-2/loftq.yml shape: `peft: {loftq_config: {loftq_bits: 4}}` starts the adapters with
    LoftQ; it changes what is learned, so it is lora.init: loftq, never ignored."""
    cfg = load_config(ax_yaml(load_in_4bit=None, adapter="lora", peft="{loftq_config: {loftq_bits: 4}}"))
    assert cfg.lora.init == "loftq"
    with pytest.raises(UserError, match=r"`peft: .*` is not supported: emotune reads peft.loftq_config with "
                                        r"loftq_bits: 4 only"):
        load_config(ax_yaml(load_in_4bit=None, adapter="lora", peft="{loftq_config: {loftq_bits: 2}}"))
    with pytest.raises(UserError, match=r"`peft: .*` is not supported"):
        load_config(ax_yaml(load_in_4bit=None, adapter="lora", peft="[loftq]"))


def test_keys_that_change_the_model_are_refused_not_ignored(ax_yaml):
    """Keys of Axolotl's Mixtral, Falcon-E, vision and Phi examples (their shape) that change the model or its loss:
    each was listed as an unknown key and ignored, so the run would have trained something else."""
    path = ax_yaml(model_config="{output_router_logits: true}", use_onebitllms="true",
                   processor_type="AutoProcessor", resize_token_embeddings_to_32x="true")
    with pytest.raises(UserError) as err:
        load_config(path)
    for expected in ("`model_config: {'output_router_logits': True}` is not supported: it overrides the model's own "
                     "config", "`use_onebitllms: true` is not supported", "`processor_type: AutoProcessor` is not "
                     "supported: it loads an image or audio processor", "`resize_token_embeddings_to_32x: true` is "
                     "not supported"):
        assert expected in str(err.value)
    assert load_config(ax_yaml(resize_token_embeddings_to_32x="false", use_onebitllms="false")).task == "sft"


def test_speed_packing_and_rl_only_keys_are_ignored_with_why(ax_yaml, capsys):
    """Keys of Axolotl's Falcon-E, vision, sample-packing and KTO examples (their shape) that change nothing emotune
    trains get the reason, not "not an Axolotl key emotune translates"."""
    from emotune.core.config.axolotl import announce

    announce(ax_yaml(use_sonicmoe="false", accelerator_config="{gradient_accumulation_kwargs: {sync_each_batch: true}}",
                     remove_unused_columns="false", skip_prepare_dataset="true", sample_packing_sequentially="true",
                     rl_beta="0.1"))
    out = capsys.readouterr().out
    ignored = dict(line.strip().split(": ", 1) for line in out.split("Ignored keys:")[1].split("Notes:")[0].splitlines()
                   if line.strip())
    for key in ("use_sonicmoe", "accelerator_config", "remove_unused_columns", "skip_prepare_dataset"):
        assert ignored[key].startswith("a speed or memory setting")
    assert ignored["sample_packing_sequentially"].startswith("a sample-packing setting")
    assert ignored["rl_beta"].startswith("a preference (rl) or reward-model setting")


def test_axolotls_swanlab_and_qwen3_5_examples_keys_are_accepted(ax_yaml, capsys):
    """Keys of Axolotl's examples/swanlab and examples/qwen3.5: `swanlab_project` was refused as a near miss of
    wandb_project, the SwanLab plugin as a plugin emotune does not run, and `chat_template: qwen3_5` for a Qwen3.5
    base as another family's template."""
    from emotune.core.config.axolotl import announce

    path = ax_yaml(plugins="[axolotl.integrations.swanlab.SwanLabPlugin]", use_swanlab="true",
                   swanlab_project="lora-profiling", swanlab_mode="cloud")
    assert load_config(path).task == "sft"
    announce(path)
    out = capsys.readouterr().out
    assert "swanlab_project: experiment tracking" in out and "plugins: axolotl.integrations.swanlab.SwanLabPlugin: " \
        "experiment tracking" in out
    cfg = load_config(ax_yaml(base_model="Qwen/Qwen3.5-27B", chat_template="qwen3_5"))
    assert cfg.model.source == "Qwen/Qwen3.5-27B"


def test_warmup_steps_below_one_is_a_share_of_the_steps(ax_yaml):
    """transformers 5 reads it so, and Axolotl's examples/expert_parallel write `warmup_steps: 0.1`; it was refused as
    train.warmup_steps 'must be an integer >= 0'."""
    train = load_config(ax_yaml(warmup_steps=0.1)).train
    assert (train.warmup_ratio, train.warmup_steps) == (0.1, 0)
    assert load_config(ax_yaml(warmup_steps=10)).train.warmup_steps == 10


def test_emotune_keys_inside_an_axolotl_file_are_refused_not_ignored(ax_yaml):
    with pytest.raises(UserError, match="`lora` is emotune's key, not an Axolotl key, so this file does not read it"):
        load_config(ax_yaml(QLORA_YAML + "lora:\n  r: 4\n"))


def test_keys_left_empty_are_unset_but_bf16_left_empty_is_not_auto(ax_yaml):
    """`output_dir:` left empty made the run folder ./None; `optimizer:` and `lr_scheduler:` were refused as None,
    which Axolotl reads as its defaults."""
    cfg = load_config(ax_yaml(output_dir="", optimizer="", lr_scheduler="", bf16=""))
    assert (cfg.output_dir, cfg.name) == (".", "model-out")
    assert (cfg.train.optim, cfg.train.lr_scheduler_type, cfg.train.precision) == ("adamw_torch_fused", "cosine", "fp32")


def test_a_sliced_split_is_refused_saying_what_to_change(ax_yaml):
    """Axolotl's Qwen3 and Gemma examples (their shape) train on `split: train[:20%]`: the refusal says to remove it
    and how to train on fewer rows instead."""
    text = QLORA_YAML.replace("    type: alpaca", "    type: alpaca\n    split: train[:20%]")
    with pytest.raises(UserError, match=r"`datasets\[0\].split: train\[:20%\]` is not supported: emotune reads the "
                                        r"whole train split, not a slice of it; remove split, and to train on fewer "
                                        r"rows set data.train_limit=N"):
        load_config(ax_yaml(text))
    with pytest.raises(UserError, match=r"`datasets\[0\].split: test` is not supported: .*; remove split"):
        load_config(ax_yaml(QLORA_YAML.replace("    type: alpaca", "    type: alpaca\n    split: test")))


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("eval_steps", "[10]", "`eval_steps: [10]` is not supported: give a number of steps"),
    ("save_steps", "often", "`save_steps: often` is not supported: give a number of steps"),
    ("optimizer", "[adamw_torch]", "`optimizer: ['adamw_torch']` is not supported"),
    ("bnb_config_kwargs", "4", "`bnb_config_kwargs: 4` is not supported"),
    ("bnb_config_kwargs", "[1, a]", "`bnb_config_kwargs: [1, 'a']` is not supported"),
])
def test_a_malformed_value_is_a_problem_naming_the_key_not_a_traceback(ax_yaml, key, value, expected):
    with pytest.raises(UserError) as err:
        load_config(ax_yaml(**{key: value}))
    assert expected in str(err.value)


def test_quoted_true_and_false_are_read_as_axolotls_schema_reads_them(ax_yaml):
    """A quoted 'false' is text, true to Python: it quantized the model and put LoRA on every linear layer."""
    cfg = load_config(ax_yaml(adapter="lora", load_in_4bit="'false'", lora_target_linear="'False'",
                              lora_target_modules="[q_proj, v_proj]", bf16="'true'", gradient_checkpointing="'no'",
                              sample_packing="'false'"))
    assert (cfg.model.quantization, cfg.lora.target_modules) == ("none", ["q_proj", "v_proj"])
    assert (cfg.train.precision, cfg.train.gradient_checkpointing) == ("bf16", False)
    with pytest.raises(UserError) as err:
        load_config(ax_yaml(load_in_4bit="'maybe'"))
    assert "`load_in_4bit`: 'maybe' is not true or false" in str(err.value)


@pytest.mark.parametrize(("path", "expected"), [
    ("../data/emotion_alpaca.jsonl", "is not a file or folder here (a relative path is read from the folder emotune runs in"),
    ("/no/such/emotion.jsonl", "is not a file or folder here"),
    ("emotion_alpaca.jsonl", "is not a file or folder here"),
    ("file:///data/emotion_alpaca.jsonl", "is not supported: give the file's plain path, without file://"),
])
def test_a_missing_local_dataset_path_is_named_not_taken_for_a_hub_id(ax_yaml, tmp_path, monkeypatch, path, expected):
    """Axolotl tries a path that is not there on the hub; `hf:../data/x.jsonl` was refused as a badly written hub id."""
    monkeypatch.chdir(tmp_path / "..")  # the data file is in tmp_path, so these relative paths miss it
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(ax_yaml(QLORA_YAML.replace("path: {data}", f"path: {path}")))
    assert f"`datasets[0].path: {path}` {expected}" in str(err.value)
    assert load_config(ax_yaml(QLORA_YAML.replace("path: {data}", "path: tatsu-lab/alpaca"))).data.source == "hf:tatsu-lab/alpaca"


def test_chat_template_jinja_is_a_file_a_missing_file_is_named_and_template_text_is_refused(ax_yaml, tmp_path):
    """A missing file was refused as "not supported as template text", sending the user to write a file they had."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert load_config(ax_yaml(chat_template="jinja", chat_template_jinja=str(template))).model.chat_template == str(template)
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(ax_yaml(chat_template="jinja", chat_template_jinja=str(tmp_path / "nope.jinja")))
    assert f"`chat_template_jinja: {tmp_path / 'nope.jinja'}`: no such file" in str(err.value)
    with pytest.raises(UserError, match="`chat_template_jinja` is not supported as template text"):
        load_config(ax_yaml(chat_template="jinja", chat_template_jinja="\"{{ bos_token }}{% for m in messages %}{% endfor %}\""))


@pytest.mark.parametrize(("typo", "meant"), [("message_property_mapping", "message_property_mappings"),
                                              ("feild_messages", "field_messages"), ("typ", "type")])
def test_a_misspelt_dataset_key_is_named_with_the_key_it_misses(ax_yaml, typo, meant):
    """A misspelt key of a `datasets` entry was dropped silently: the rows were then read with the default turn keys,
    and refused as rows without `role`, or the type as null."""
    value = "\n      role: from\n      content: value" if typo == "message_property_mapping" else " dialog"
    text = QLORA_YAML.replace("    type: alpaca", f"    type: chat_template\n    {typo}:{value}")
    if typo == "typ":
        text = QLORA_YAML.replace("    type: alpaca", "    typ: alpaca")
    with pytest.raises(UserError) as err:
        load_config(ax_yaml(text))
    assert f"`datasets[0].{typo}` is not an Axolotl dataset key; did you mean `{meant}`?" in str(err.value)


def test_special_tokens_the_tokenizer_has_already_are_accepted_others_refused(ax_yaml, capsys):
    """Mistral and Llama 2 examples restate the tokenizer's own bos/eos/unk; such a file was refused as a whole."""
    own = QLORA_YAML.replace('  pad_token: "<pad>"', '  pad_token: "<pad>"\n  bos_token: "<bos>"\n  eos_token: "<eos>"\n'
                             '  unk_token: "<unk>"')
    assert load_config(ax_yaml(own)).task == "sft"
    assert main(["config", "--from-axolotl", str(ax_yaml(own))]) == 0
    assert "special_tokens.eos_token: the tokenizer's own already" in capsys.readouterr().out
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(ax_yaml(QLORA_YAML.replace('  pad_token: "<pad>"', '  pad_token: "<pad>"\n  eos_token: "<|im_end|>"')))
    assert "`special_tokens: {'pad_token': '<pad>', 'eos_token': '<|im_end|>'}` is not supported" in str(err.value)


def test_dataset_keys_emotune_does_not_read_are_listed_as_ignored(ax_yaml, capsys):
    """`system_prompt` and `system_format` of an alpaca entry (they change Axolotl's prompt) were dropped unsaid."""
    from emotune.core.config.axolotl import announce

    announce(ax_yaml(QLORA_YAML.replace("    type: alpaca", "    type: alpaca\n    system_prompt: Be brief.\n"
                                                         "    system_format: '<<SYS>> [system] <</SYS>>'")))
    ignored = capsys.readouterr().out.split("Ignored keys:")[1].split("Notes:")[0]
    assert "datasets[0].system_prompt: not a dataset key emotune translates" in ignored
    assert "datasets[0].system_format: not a dataset key emotune translates" in ignored


def test_malformed_turn_keys_are_a_problem_naming_the_key(ax_yaml):
    text = QLORA_YAML.replace("    type: alpaca", "    type: chat_template\n    message_property_mappings: [role]")
    with pytest.raises(UserError, match=r"`datasets\[0\].message_property_mappings: \['role'\]` is not supported"):
        load_config(ax_yaml(text))
    assert load_config(ax_yaml(eval_steps="'10'")).train.eval_steps == 10  # quoted numbers still read


def test_a_value_out_of_range_is_named_by_the_file_s_own_key(ax_yaml):
    """`sequence_len: 0` was reported as `train.max_length`, a key the Axolotl file does not have; an emotune
    override of the same key keeps its own name."""
    with pytest.raises(UserError, match=r"`sequence_len` \(read as `train.max_length`\): must be an integer >= 1"):
        load_config(ax_yaml(sequence_len=0))
    with pytest.raises(UserError, match=r"  - `train.max_length`: must be an integer >= 1"):
        load_config(ax_yaml(), ["train.max_length=0"])


USER_DEFINED_TYPE = """\
    type:
      system_prompt: You label emotions.
      field_system: persona
      field_instruction: question
      field_input: passage
      field_output: answer
      format: "[INST] {{instruction}}\\n{{input}} [/INST]"
      no_input_format: "[INST] {{instruction}} [/INST]"\
"""


def test_a_user_defined_prompt_type_reads_its_columns_and_runs(ax_yaml, tmp_path, capsys):
    """Axolotl's `type:` given as a mapping (prompt_strategies/user_defined.py: the columns under other names, prompt
    strings around them) was refused as an unknown type. The columns are read as an Alpaca row's, its system_prompt
    goes to rows without their own, the text between {instruction} and {input} joins them, and the prompt strings are
    left to the chat template, saying so."""
    from emotune.core.config.axolotl import announce

    renamed = [{"question": r["instruction"], "passage": r["input"], "answer": r["output"]} for r in _alpaca_rows(40)]
    renamed[0]["persona"] = "You are a careful annotator."
    data = write_jsonl(tmp_path / "renamed.jsonl", renamed)
    text = QLORA_YAML.replace("    type: alpaca", USER_DEFINED_TYPE).replace("{data}", str(data))
    path = ax_yaml(text, load_in_4bit=None, adapter="lora", max_steps=1)
    cfg = load_config(path)
    columns = cfg.data.columns
    assert (cfg.data.format, columns.prompt, columns.query, columns.response, columns.system) == (
        "alpaca", "question", "passage", "answer", "persona")
    assert (cfg.data.input_separator, cfg.prompt.system_prompt) == ("\n", "You label emotions.")
    announce(path)
    assert "not the prompt strings of format, no_input_format and system_format" in capsys.readouterr().out
    code = main(["run", str(path), "train.precision=fp32", "eval.max_new_tokens=2", "eval.probe=false",
                 "data.test_limit=2", f"model.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    assert json.loads((tmp_path / "outputs" / "qlora-out" / "run.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("spec, expected", [
    ("    type:\n      field_instructions: question", r"`datasets\[0\].type` names `field_instructions`, which"),
    ("    type:\n      format: '{{input}} {{instruction}}'", r"does not put \{instruction\} before \{input\}"),
    ("    type:\n      field_output: [a, b]", r"`datasets\[0\].type.field_output: \['a', 'b'\]` must be text"),
])
def test_a_user_defined_prompt_type_emotune_cannot_read_is_named(ax_yaml, spec, expected):
    with pytest.raises(UserError, match=expected):
        load_config(ax_yaml(QLORA_YAML.replace("    type: alpaca", spec)))
