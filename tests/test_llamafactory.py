"""LLaMA-Factory training YAMLs: translated to `task: sft` with LLaMA-Factory's defaults, refused clearly where
emotune cannot train the same way, and run end to end through `emotune run` on the tiny model.

The YAML and its dataset_info.json folder are written here in the shape of LLaMA-Factory's
examples/train_lora/*_lora_sft.yaml (sections, comma-separated datasets), not copied from it.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import yaml

from conftest import CUES, FILLER, LABELS, write_jsonl
from emotune.cli import main
from emotune.core.config.load import load_config
from emotune.core.errors import UserError

LORA_SFT_YAML = """\
### model
model_name_or_path: {model}
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 4
lora_target: all

### dataset
dataset: emotion_alpaca,emotion_chat
dataset_dir: {data}
template: gemma3
cutoff_len: 128
max_samples: 40
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: {out}/saves/tiny-gemma/lora/sft
logging_steps: 1
save_steps: 1
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none  # choices: [none, wandb, tensorboard, swanlab, mlflow]

### train
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
learning_rate: 1.0e-2
max_steps: 2
lr_scheduler_type: cosine
warmup_steps: 1
ddp_timeout: 180000000
resume_from_checkpoint: null
my_own_note: kept for later
"""


def _emotion_rows(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(LABELS)
        rows.append((" ".join(rng.sample(FILLER, 4) + [rng.choice(CUES[label])]), label))
    return rows


@pytest.fixture
def lf_folder(tmp_path):
    """A dataset_info.json folder: an alpaca file, a sharegpt file and a ranking (preference) entry."""
    folder = tmp_path / "data"
    folder.mkdir()
    alpaca = [{"instruction": "classify the emotion of this text", "input": text, "output": label}
              for text, label in _emotion_rows(30, seed=1)]
    (folder / "emotion_alpaca.json").write_text(json.dumps(alpaca), encoding="utf-8")
    write_jsonl(folder / "emotion_chat.jsonl",
                [{"conversations": [{"from": "human", "value": f"classify {text}"}, {"from": "gpt", "value": label}]}
                 for text, label in _emotion_rows(30, seed=2)])
    info = {"emotion_alpaca": {"file_name": "emotion_alpaca.json"},
            "emotion_chat": {"file_name": "emotion_chat.jsonl", "formatting": "sharegpt"},
            "emotion_prefs": {"file_name": "emotion_alpaca.json", "ranking": True,
                              "columns": {"prompt": "instruction", "chosen": "output", "rejected": "output"}}}
    (folder / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    return folder


@pytest.fixture
def lf_yaml(tmp_path, lf_folder, tiny_model_dir):
    def write(text: str = LORA_SFT_YAML, name: str = "tiny_lora_sft.yaml", **changes):
        lines = text.format(model=tiny_model_dir, data=lf_folder, out=tmp_path).splitlines()
        for key, value in changes.items():  # replace a key's line, or add it
            lines = [line for line in lines if not line.startswith(f"{key}:")]
            if value is not None:
                lines.append(f"{key}: {value}")
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path
    return write


def test_a_lora_sft_file_translates_to_the_expected_config(lf_yaml, lf_folder, tiny_model_dir, tmp_path):
    cfg = load_config(lf_yaml())
    assert cfg.task == "sft"
    assert (cfg.model.source, cfg.data.source) == (str(tiny_model_dir), str(lf_folder))
    assert cfg.data.datasets == ["emotion_alpaca", "emotion_chat"] and cfg.data.eval_datasets is None
    assert (cfg.data.max_samples, cfg.train.max_length) == (40, 128)
    assert cfg.lora.model_dump() == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear", "target_parameters": None,
                                     "use_rslora": False, "use_dora": False, "modules_to_save": None, "init": "default",
                                     "pissa_iter": 16, "adapter": None, "layers": None}
    train = cfg.train
    assert (train.batch_size, train.gradient_accumulation_steps, train.learning_rate) == (4, 1, 0.01)
    assert (train.max_steps, train.num_train_epochs, train.lr_scheduler_type) == (2, 3.0, "cosine")
    assert (train.warmup_steps, train.warmup_ratio, train.optim) == (1, 0.0, "adamw_torch_fused")
    assert (train.logging_steps, train.save_steps, train.eval_steps) == (1, 1, 1)  # eval_strategy no: every checkpoint
    assert (train.precision, train.gradient_checkpointing, train.report_to, train.group_by_length) == ("auto", True, [], False)
    assert (cfg.output_dir, cfg.name, cfg.overwrite, cfg.seed) == (f"{tmp_path}/saves/tiny-gemma/lora", "sft", True, 42)
    assert cfg.run_dir == tmp_path / "saves" / "tiny-gemma" / "lora" / "sft"  # LLaMA-Factory's output_dir
    assert cfg.eval.batch_size == 8 and cfg.prompt.mask_history is False


def test_alpaca_rows_of_a_llamafactory_file_join_instruction_and_input_with_one_newline(lf_yaml, lf_folder):
    """LLaMA-Factory's AlpacaDatasetConverter joins them with "\\n"; emotune's blank line made every translated run
    train on other prompts than LLaMA-Factory's, without a word. A history pair is the turns it holds."""
    from emotune.data.conversation_data import load_conversations

    rows = [{"instruction": f"classify the emotion {i}", "input": f"text {i}", "output": f"label {i}",
             "history": [[f"earlier question {i}", f"earlier answer {i}"]]} for i in range(20)]
    (lf_folder / "emotion_alpaca.json").write_text(json.dumps(rows), encoding="utf-8")
    cfg = load_config(lf_yaml(dataset="emotion_alpaca"))
    assert cfg.data.input_separator == "\n"
    every = {c.response: c for split in load_conversations(cfg.data, cfg.seed).splits.values() for c in split}
    assert every["label 3"].messages == (("user", "earlier question 3"), ("assistant", "earlier answer 3"),
                                         ("user", "classify the emotion 3\ntext 3"), ("assistant", "label 3"))


def test_keys_the_file_leaves_out_take_llamafactorys_defaults(lf_yaml):
    minimal = "model_name_or_path: {model}\nstage: sft\ndo_train: true\ndataset: emotion_alpaca\ndataset_dir: {data}\n"
    cfg = load_config(lf_yaml(minimal))
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules) == (8, 16, 0.0, "all-linear")
    train = cfg.train
    assert (train.batch_size, train.gradient_accumulation_steps, train.learning_rate) == (8, 1, 5e-5)
    assert (train.num_train_epochs, train.max_steps, train.lr_scheduler_type) == (3.0, -1, "linear")
    assert (train.logging_steps, train.save_steps, train.eval_steps, train.max_length) == (500, 500, 500, 2048)
    assert (train.warmup_ratio, train.warmup_steps, train.weight_decay, train.max_grad_norm) == (0.0, 0, 0.0, 1.0)
    assert train.gradient_checkpointing is True  # LLaMA-Factory enables it unless disable_gradient_checkpointing
    assert cfg.name == "tiny_lora_sft" and cfg.overwrite is False


def test_yaml_spellings_and_older_key_names(lf_yaml):
    cfg = load_config(lf_yaml(learning_rate="1e-4", lora_target="q_proj,v_proj", evaluation_strategy="steps",
                              eval_steps=3, bf16="true", val_size=0.2, eval_dataset="emotion_chat",
                              default_system="be brief", mask_history="true", lora_alpha=32, use_rslora="true"))
    assert cfg.train.learning_rate == 1e-4  # YAML reads 1e-4 as text; LLaMA-Factory's parser makes it a number
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and (cfg.lora.alpha, cfg.lora.use_rslora) == (32, True)
    assert (cfg.train.eval_steps, cfg.train.precision, cfg.data.validation_size) == (3, "bf16", 0.2)
    assert cfg.data.eval_datasets == ["emotion_chat"]
    assert (cfg.prompt.system_prompt, cfg.prompt.mask_history) == ("be brief", True)


def test_quoted_true_false_and_whole_numbers_are_read_as_meant(lf_yaml):
    """A quoted 'no' is text, true to Python: `bf16: 'no'` with `fp16: 'yes'` was refused as both true; a quoted
    `quantization_bit: '4'` was refused saying to use 4, and `4.0` became the quantization `4.0bit`."""
    cfg = load_config(lf_yaml(do_train="'true'", bf16="'no'", fp16="'yes'", pure_bf16="'false'", quantization_bit="'4'"))
    assert (cfg.train.precision, cfg.model.quantization) == ("fp16", "4bit")
    assert load_config(lf_yaml(quantization_bit=8.0)).model.quantization == "8bit"
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(use_dora="'sometimes'"))
    assert "`use_dora`: 'sometimes' is not true or false" in str(err.value)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("max_steps", "[10]", "`max_steps`: [10] is not a number"),
    ("bf16", "{on: 1}", "`bf16`: {True: 1} is not true or false"),
    ("optim", "[adamw_torch]", "`optim: ['adamw_torch']` is not supported; emotune has"),
    # a share of the steps, as transformers reads it, was refused under the emotune key with no fix
    ("eval_steps", "0.1", "`eval_steps: 0.1` (a share of the training steps) is not supported: give a number of steps"),
    ("save_steps", "0.25", "`save_steps: 0.25` (a share of the training steps) is not supported"),
])
def test_a_value_of_the_wrong_kind_is_a_problem_naming_the_key(lf_yaml, key, value, expected):
    """`max_steps: [10]` and `optim: [adamw_torch]` raised TypeError out of the translation."""
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(**{key: value}))
    assert expected in str(err.value)


def test_keys_left_empty_are_unset(lf_yaml):
    """`max_steps:` (null) raised TypeError; `adapter_name_or_path: ' '` raised IndexError; `lora_target:` became the
    target module "None", `dataset_dir:` the data folder "None" and `model_revision:` the revision "None"."""
    cfg = load_config(lf_yaml(max_steps="", lora_dropout="null", adapter_name_or_path="' '"))
    assert (cfg.train.max_steps, cfg.lora.dropout, cfg.lora.adapter) == (-1, 0.0, None)
    cfg = load_config(lf_yaml(lora_target="", model_revision="", lr_scheduler_type=""))
    assert (cfg.lora.target_modules, cfg.model.revision, cfg.train.lr_scheduler_type) == ("all-linear", "main", "linear")
    assert load_config(lf_yaml(dataset_dir="")).data.source == "data"  # LLaMA-Factory's default folder


def test_relative_paths_are_read_from_the_folder_emotune_runs_in_and_a_miss_says_so(lf_yaml, tmp_path, monkeypatch):
    """As LLaMA-Factory reads `dataset_dir: data`. A miss said only "does not exist", so a file run from another
    folder than the one its paths were written for was not understood."""
    from emotune.data.conversation_data import load_conversations
    from emotune.model.loading import resolve_model_dir

    monkeypatch.chdir(tmp_path)
    cfg = load_config(lf_yaml(dataset_dir="data"))
    assert len(load_conversations(cfg.data, cfg.seed).splits["train"]) > 0
    monkeypatch.chdir(tmp_path / "data")
    with pytest.raises(UserError, match=re.escape(f"data.source `data` does not exist (a relative path is read from "
                                                  f"the folder emotune runs in, {tmp_path / 'data'})")):
        load_conversations(cfg.data, cfg.seed)
    with pytest.raises(UserError, match=re.escape(f"(a relative path is read from the folder emotune runs in, "
                                                  f"{tmp_path / 'data'})")):
        resolve_model_dir(load_config(lf_yaml(model_name_or_path="../models/tiny")).model)


def test_a_dataset_dir_on_the_hub_is_refused_saying_how_to_download_it(lf_yaml):
    """LLaMA-Factory's examples write `dataset_dir: REMOTE:llamafactory/demo_data`; it was read as a local folder of
    that name and refused when the data was read, as a path that does not exist."""
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(dataset_dir="REMOTE:llamafactory/demo_data"))
    assert ("`dataset_dir: REMOTE:llamafactory/demo_data` (dataset_info.json in a hub repository) is not supported; "
            "download the repository (`hf download llamafactory/demo_data --repo-type dataset --local-dir "
            "data/demo_data`) and give that folder as dataset_dir") in str(err.value)


def test_warmup_steps_below_one_is_a_share_of_the_steps(lf_yaml):
    """transformers 5, whose TrainingArguments LLaMA-Factory extends, reads it so; it was refused as train.warmup_steps."""
    train = load_config(lf_yaml(warmup_steps="0.05")).train
    assert (train.warmup_ratio, train.warmup_steps) == (0.05, 0)


def test_emotune_keys_inside_a_llamafactory_file_are_refused_not_ignored(lf_yaml):
    """`train: {max_steps: 2}` in a LLaMA-Factory file was listed as 'not a LLaMA-Factory key emotune translates' and
    the run trained LLaMA-Factory's 3 epochs."""
    text = LORA_SFT_YAML + "train:\n  max_steps: 2\ndevice: cpu\n"
    with pytest.raises(UserError, match="2 problems") as err:
        load_config(lf_yaml(text))
    assert ("`train` is emotune's key, not a LLaMA-Factory key, so this file does not read it: give it as an override "
            "(`train.KEY=VALUE`), or save the translation with `emotune config --from-llamafactory FILE > run.yaml`") \
        in str(err.value)
    assert "(`device=cpu`)" in str(err.value)


@pytest.mark.parametrize(("val_size", "held_out"), [(500, 500), (100.7, 100), (0.05, 0.05)])
def test_val_size_above_one_is_a_count_of_rows(lf_yaml, val_size, held_out):
    """LLaMA-Factory's split_dataset holds out int(val_size) rows when val_size > 1; such a file was refused."""
    held = load_config(lf_yaml(val_size=val_size)).data.validation_size
    assert held == held_out and type(held) is type(held_out)


def test_refusals_name_their_keys_all_at_once(lf_yaml):
    path = lf_yaml(stage="dpo", quantization_bit=3, finetuning_type="oft", dataset="emotion_alpaca,emotion_prefs")
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    assert "4 problems" in message
    for expected in ("`stage: dpo` is not supported", "`quantization_bit: 3` is not supported",
                     "`finetuning_type: oft` is not supported", "`dataset`: `emotion_prefs` is a ranking"):
        assert expected in message


@pytest.mark.parametrize(("change", "expected"), [
    ({"do_train": None}, "`do_train` is not true"),
    ({"model_name_or_path": None}, "`model_name_or_path` is missing"),
    ({"lr_scheduler_type": "polynomial"}, "`lr_scheduler_type: polynomial` is not supported"),
    ({"val_size": 0.7}, "`val_size: 0.7` is not supported"),
    ({"template": "gemma33"}, "`template: gemma33` is not a LLaMA-Factory template; did you mean gemma3?"),
    ({"template": "llama3"}, "`template: llama3` writes <|start_header_id|> turns"),
    # these families' turns were not compared, so a Gemma model passed with them
    ({"template": "deepseek3"}, "`template: deepseek3` writes <｜User｜> turns"),
    ({"template": "phi4"}, "`template: phi4` writes <|im_sep|> turns"),
    ({"template": "glm4"}, "`template: glm4` writes <|user|> turns"),
    ({"learning_rate": "fast"}, "`learning_rate`: 'fast' is not a number"),
    # keys that were ignored as "not a LLaMA-Factory key emotune translates" although they change what is learned,
    # or are a typo of one it translates (left at its default without a word; LLaMA-Factory refuses unknown keys)
    ({"neftune_noise_alpha": 5}, "`neftune_noise_alpha: 5` is not supported: emotune adds no noise"),
    ({"rope_scaling": "linear"}, "`rope_scaling: linear` is not supported"),
    ({"train_from_scratch": True}, "`train_from_scratch: true` is not supported"),
    ({"lora_rnak": 16}, "`lora_rnak` is not a LLaMA-Factory key; did you mean `lora_rank`?"),
    ({"dataset_name": "trl-lib/Capybara"}, "it is a TRL script's key, not LLaMA-Factory's"),
    # the loss and optimizer switches of LLaMA-Factory's examples/extras (dft, asft, eaft, muon, mod) and the trainer's
    # own AdamW settings were ignored as "not a LLaMA-Factory key emotune translates": another loss, silently
    ({"use_dft_loss": "true"}, "`use_dft_loss: true` is not supported: DFT reweights"),
    ({"use_asft_loss": "true"}, "`use_asft_loss: true` is not supported"),
    ({"use_eaft_loss": "true"}, "`use_eaft_loss: true` is not supported"),
    ({"use_muon": "true"}, "`use_muon: true` is not supported: Muon"),
    ({"mixture_of_depths": "convert"}, "`mixture_of_depths: convert` is not supported"),
    ({"adam_beta2": 1.5}, "`adam_beta2` (read as `train.adam_beta2`): must be a number in [0, 1)"),
    ({"push_to_hub": "true"}, "`emotune push RUN_FOLDER`"),
    ({"freeze_language_model": "true"}, "`freeze_language_model: true` is not supported"),
])
def test_each_refusal_is_a_clear_user_error(lf_yaml, change, expected):
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(**change))
    assert expected in str(err.value)


def test_trainer_keys_at_values_that_change_nothing_are_accepted_and_said_ignored(lf_yaml):
    """transformers' own keys in LLaMA-Factory's examples: at emotune's values (YAML's `1e-8` is text) they change
    nothing; gradient_checkpointing_kwargs was refused as a misspelt gradient_checkpointing (examples/train_full/
    mossvl_full_sft.yaml), and the translated save_total_limit was listed as ignored too."""
    from emotune.core.config.llamafactory import translate

    path = lf_yaml(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon="1e-8", use_dft_loss="false",
                   gradient_checkpointing_kwargs="{use_reentrant: false}", image_max_pixels=262144,
                   freeze_vision_tower="true", pref_beta=0.1, save_total_limit=3)
    cfg = load_config(path)
    assert cfg.train.save_total_limit == 3
    ignored = dict(translate(yaml.safe_load(path.read_text())).ignored)
    assert "save_total_limit" not in ignored
    assert "does not change what is learned" in ignored["gradient_checkpointing_kwargs"]
    assert "emotune trains on text" in ignored["image_max_pixels"] and "stage sft" in ignored["pref_beta"]


def test_the_trainers_adam_settings_are_translated(lf_yaml):
    """adam_beta1/adam_beta2/adam_epsilon (transformers' TrainingArguments, which LLaMA-Factory passes on) were refused
    at any value but the default; they are emotune's train.adam_* now (YAML reads `1e-6` as text)."""
    cfg = load_config(lf_yaml(adam_beta1=0.85, adam_beta2=0.95, adam_epsilon="1e-6"))
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_epsilon) == (0.85, 0.95, 1e-6)
    assert (load_config(lf_yaml()).train.adam_beta2, load_config(lf_yaml()).train.adam_epsilon) == (0.999, 1e-8)
    assert load_config(lf_yaml(optim="paged_adamw_32bit")).train.optim == "paged_adamw_32bit"  # the QLoRA paper's


def test_the_translation_is_printed_with_ignored_keys(lf_yaml, capsys):
    from emotune.core.config.llamafactory import announce

    announce(lf_yaml())
    out = capsys.readouterr().out
    assert "lora_rank: 4" in out and "->  lora.r: 4" in out
    assert re.search(r"lora_dropout: 0.0 \(default\) +->  lora.dropout: 0.0", out)
    assert re.search(r"stage: sft +->  task: sft", out)
    ignored = out.split("Ignored keys:")[1].split("Notes:")[0]
    for key in ("trust_remote_code", "preprocessing_num_workers", "dataloader_num_workers", "save_only_model",
                "ddp_timeout", "resume_from_checkpoint"):
        assert f"  {key}: " in ignored
    assert "  my_own_note: not a LLaMA-Factory key emotune translates" in ignored
    assert "template: gemma3 matches the model's own chat template" in out


def test_config_from_llamafactory_writes_an_equivalent_emotune_yaml(lf_yaml, tmp_path, capsys):
    path = lf_yaml()
    assert main(["config", "--from-llamafactory", str(path), "max_steps=5", "eval.max_new_tokens=3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# LLaMA-Factory config ")
    translated = yaml.safe_load(text)
    assert translated["task"] == "sft" and translated["train"]["max_steps"] == 5  # a LLaMA-Factory key overridden
    saved = tmp_path / "translated.yaml"
    saved.write_text(text, encoding="utf-8")
    assert load_config(saved) == load_config(path, ["max_steps=5", "eval.max_new_tokens=3"])
    # translating the translation (an emotune config) listed LLaMA-Factory's missing keys as its problems
    assert main(["config", "--from-llamafactory", str(saved)]) == 2
    assert "is an emotune config already" in capsys.readouterr().err


def test_key_value_overrides_apply_on_top(lf_yaml):
    cfg = load_config(lf_yaml(), ["train.max_steps=7", "lora_rank=2", "seed=3"])
    assert (cfg.train.max_steps, cfg.lora.r, cfg.lora.alpha, cfg.seed) == (7, 2, 4, 3)
    with pytest.raises(UserError, match="`train.max_stepz` is not a config key"):
        load_config(lf_yaml(), ["train.max_stepz=7"])
    # a misspelt LLaMA-Factory key is named with the key it misses (it was `did you mean lora?`, emotune's section)
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(), ["lora_rnak=16"])
    assert "`lora_rnak` is not a LLaMA-Factory key; did you mean `lora_rank`?" in str(err.value)
    with pytest.raises(UserError, match="`nmae` is not a config key; did you mean `name`"):  # emotune's own still
        load_config(lf_yaml(), ["nmae=x"])


@pytest.mark.slow
def test_emotune_run_on_a_llamafactory_file(lf_yaml, tmp_path):
    path = lf_yaml()
    code = main(["run", str(path), "train.precision=fp32", "eval.max_new_tokens=3", "eval.probe=false",
                 "data.test_limit=4", f"model.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    folder = tmp_path / "saves" / "tiny-gemma" / "lora" / "sft"
    assert json.loads((folder / "run.json").read_text())["status"] == "finished"
    comparison = json.loads((folder / "comparison.json").read_text())
    assert set(comparison["metrics"]["rouge_l"]) == {"before", "after", "delta"}
    log = json.loads((folder / "train" / "log_history.json").read_text())
    first = next(entry for entry in log if entry.get("step") == 1 and "learning_rate" in entry)
    assert first["learning_rate"] == pytest.approx(0.01)  # warmup_steps: 1 took effect: full rate after step 1
    train_rows = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    assert {row["source"] for row in train_rows} == {"emotion_alpaca", "emotion_chat"}  # both datasets, mixed


@pytest.mark.slow
def test_a_llamafactory_freeze_file_runs_as_it_is(lf_yaml, tmp_path):
    path = lf_yaml(finetuning_type="freeze", freeze_trainable_layers=1, freeze_trainable_modules="mlp")
    code = main(["run", str(path), "train.precision=fp32", "eval.max_new_tokens=3", "eval.probe=false",
                 "data.test_limit=4", f"model.cache_dir={tmp_path / 'cache'}"])
    assert code == 0
    folder = tmp_path / "saves" / "tiny-gemma" / "lora" / "sft"
    run_info = json.loads((folder / "run.json").read_text())
    assert run_info["status"] == "finished"
    assert run_info["finetuning"] == {"kind": "freeze", "trainable_layers": 1, "trainable_modules": ["mlp"],
                                      "extra_modules": None}
    assert (folder / "model" / "config.json").is_file() and not (folder / "adapter").exists()
    assert set(json.loads((folder / "comparison.json").read_text())["metrics"]["rouge_l"]) == {"before", "after", "delta"}


# --------------------------------------------------------------------------------------------------
# LLaMA-Factory's QLoRA keys


QLORA_KEYS = {"quantization_bit": 4, "quantization_method": "bnb", "quantization_type": "fp4",
              "double_quantization": "false", "optim": "adamw_bnb_8bit", "loraplus_lr_ratio": 16.0}


def test_a_llamafactory_qlora_file_translates_as_it_is(lf_yaml):
    cfg = load_config(lf_yaml(**QLORA_KEYS))
    assert (cfg.model.quantization, cfg.model.quant_type, cfg.model.double_quant) == ("4bit", "fp4", False)
    assert (cfg.train.optim, cfg.train.loraplus_lr_ratio, cfg.train.loraplus_lr_embedding) == ("adamw_8bit", 16.0, 1e-6)
    defaults = load_config(lf_yaml(quantization_bit=4))  # LLaMA-Factory's defaults: NF4 with double quantization
    assert (defaults.model.quantization, defaults.model.quant_type, defaults.model.double_quant) == ("4bit", "nf4", True)
    assert load_config(lf_yaml(quantization_bit=8)).model.quantization == "8bit"


@pytest.mark.parametrize(("change", "expected"), [
    ({"quantization_bit": 4, "quantization_method": "hqq"}, "`quantization_method: hqq` is not supported"),
    ({"quantization_bit": 2}, "`quantization_bit: 2` is not supported: bitsandbytes quantizes to 4 or 8 bits"),
])
def test_llamafactory_quantization_emotune_cannot_run_is_refused(lf_yaml, change, expected):
    with pytest.raises(UserError, match="1 problem") as err:
        load_config(lf_yaml(**change))
    assert expected in str(err.value)


@pytest.mark.slow
def test_a_llamafactory_qlora_file_runs_as_it_is(lf_yaml, tiny_gemma3_64_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    path = lf_yaml(model_name_or_path=str(tiny_gemma3_64_dir), quantization_bit=4, optim="adamw_bnb_8bit", max_steps=4)
    assert main(["run", str(path), "train.precision=fp32", "eval.max_new_tokens=3", "eval.probe=false",
                 "data.test_limit=4", f"model.cache_dir={tmp_path / 'cache'}"]) == 0
    folder = tmp_path / "saves" / "tiny-gemma" / "lora" / "sft"
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "finished" and info["quantization"].startswith("4-bit NF4")
    losses = [e["loss"] for e in json.loads((folder / "train" / "log_history.json").read_text()) if "loss" in e]
    assert losses[-1] < losses[0]


def test_llamafactory_pissa_keys_translate(lf_yaml):
    cfg = load_config(lf_yaml(pissa_init="true", pissa_iter=4, pissa_convert="true"))
    assert (cfg.lora.init, cfg.lora.pissa_iter) == ("pissa", 4)


def test_llamafactory_adapter_name_or_path_trains_on_from_one_adapter(lf_yaml, tmp_path):
    assert load_config(lf_yaml(adapter_name_or_path=str(tmp_path / "old"))).lora.adapter == str(tmp_path / "old")
    with pytest.raises(UserError, match="`adapter_name_or_path` lists several adapters"):
        load_config(lf_yaml(adapter_name_or_path="a,b"))
    with pytest.raises(UserError, match="`create_new_adapter: true` is not supported"):
        load_config(lf_yaml(create_new_adapter="true"))


V1_SFT_YAML = """\
model: {model}
model_class: llm
peft_config:
  name: lora
  r: 16
  target_modules: all
train_dataset: data/v1_sft_demo.yaml
output_dir: ./outputs/test_lora
micro_batch_size: 1
cutoff_len: 2048
learning_rate: 1.0e-4
"""


def test_llamafactory_files_of_other_commands_are_named_as_what_they_are(lf_yaml, capsys):
    """examples/v1 (LLaMA-Factory's v1 layout) got fifteen 'not a config key' lines about its own keys; the
    examples/merge_lora, examples/inference and extras/nlg_eval files were told to add do_train and a dataset."""
    with pytest.raises(UserError, match=r"is a LLaMA-Factory v1 config \(`model: .*` with model_class, peft_config, "
                                        r"train_dataset\)\. emotune reads LLaMA-Factory training files in the layout"):
        load_config(lf_yaml(V1_SFT_YAML))
    assert main(["config", "--from-llamafactory", str(lf_yaml(V1_SFT_YAML))]) != 0
    assert "LLaMA-Factory v1 config" in capsys.readouterr().err
    head = "model_name_or_path: {model}\nadapter_name_or_path: saves/lora/sft\ntemplate: gemma3\ntrust_remote_code: true\n"
    cases = [(head + "export_dir: merged\nexport_size: 5\n", "`llamafactory-cli export` file"),
             (head + "infer_backend: huggingface\n", "`llamafactory-cli chat`/`api` file"),
             (head + "stage: sft\ndo_predict: true\neval_dataset: emotion_alpaca\npredict_with_generate: true\n",
              "`do_predict` without do_train only evaluates")]
    for text, says in cases:
        with pytest.raises(UserError, match="1 problem") as err:  # the missing dataset is not a second problem
            load_config(lf_yaml(text))
        assert says in str(err.value)
    # given to `emotune eval`, a predict file was told to use `emotune eval CONFIG`: it now says what CONFIG must hold
    assert main(["eval", str(lf_yaml(cases[2][0]))]) == 2
    assert "make it a training file (do_train: true and a dataset; its eval_dataset is the test split) and run " \
        "`emotune eval FILE adapter=ADAPTER_DIR`" in capsys.readouterr().err


def test_launcher_files_beside_the_training_file_are_named_as_what_they_are(tmp_path, capsys, monkeypatch):
    """An accelerate config (LLaMA-Factory's examples/accelerate) or a DeepSpeed JSON (examples/deepspeed) given as the
    config got a 'not a config key' line per key (`use_cpu`: did you mean `sweep`?)."""
    accelerate = tmp_path / "fsdp_config.yaml"
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: FSDP\n"
                          "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\nmachine_rank: 0\nmain_training_function: "
                          "main\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n", encoding="utf-8")
    deepspeed = tmp_path / "ds_z3_config.json"
    deepspeed.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                                     "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}), encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # where a run would write runs/
    for path, says in ((accelerate, "is an accelerate config (compute_environment, distributed_type"),
                       (deepspeed, "is a DeepSpeed config (zero_optimization")):
        assert main(["run", str(path)]) == 2
        err = capsys.readouterr().err
        assert says in err and "not a config key" not in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_export_given_a_llamafactory_merge_file_says_it_takes_a_run_folder(lf_yaml, capsys):
    """`emotune export merge_lora.yaml` (examples/merge_lora's shape) said the file "holds no emotune adapter ... in
    the folder and in adapter/"."""
    path = lf_yaml("model_name_or_path: {model}\nadapter_name_or_path: saves/lora/sft\ntemplate: gemma3\n"
                   "export_dir: merged\nexport_size: 5\n")
    assert main(["export", str(path), "--merge"]) == 2
    err = capsys.readouterr().err
    assert f"`{path}` is a file, not a folder: give a finished run folder (runs/<name>)" in err
    assert "Traceback" not in err


def test_a_dataset_info_json_saved_with_a_byte_order_mark_is_read(lf_yaml, lf_folder):
    """Windows editors save UTF-8 with a byte-order mark: the ranking entry went unnoticed here (the file unread)."""
    info = lf_folder / "dataset_info.json"
    info.write_bytes(b"\xef\xbb\xbf" + info.read_bytes())
    with pytest.raises(UserError, match="`dataset`: `emotion_prefs` is a ranking"):
        load_config(lf_yaml(dataset="emotion_alpaca,emotion_prefs"))


def test_a_value_out_of_range_is_named_by_the_file_s_own_key(lf_yaml):
    """`cutoff_len: 0` was reported as `train.max_length`, a key the LLaMA-Factory file does not have."""
    with pytest.raises(UserError, match=r"`cutoff_len` \(read as `train.max_length`\): must be an integer >= 1"):
        load_config(lf_yaml(cutoff_len=0))
    with pytest.raises(UserError, match=r"  - `train.max_length`: must be an integer >= 1"):
        load_config(lf_yaml(), ["train.max_length=0"])
