"""Config: precedence, unknown keys with suggestions, every problem at once, shipped YAMLs parse."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pytest

from emotune.core.config.build import dump_config, field_docs
from emotune.core.config.load import load_config
from emotune.core.config.run import RunConfig
from emotune.core.config.train import duration_seconds
from emotune.core.errors import UserError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_defaults_yaml_overrides_precedence(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("train:\n  max_steps: 7\n  learning_rate: 2.0e-4\nlora:\n  r: 8\n")
    cfg = load_config(path, ["train.max_steps=2", "lora.target_modules=[q_proj, v_proj]", "data.test_limit=null"])
    assert cfg.train.max_steps == 2  # override beats YAML
    assert cfg.train.learning_rate == 2e-4  # YAML beats default
    assert cfg.train.batch_size == RunConfig().train.batch_size  # default
    assert cfg.lora.r == 8 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.name == "x"  # run name defaults to the config file's name


def test_unknown_keys_suggest_closest_and_all_problems_reported_at_once():
    with pytest.raises(UserError) as err:
        load_config(None, ["train.learning_rat=1", "lora.r=abc", "trian.max_steps=3", "eval.method=magic"])
    message = str(err.value)
    assert "4 problems" in message
    assert "did you mean `train.learning_rate`" in message
    assert "did you mean `train`" in message
    assert "`lora.r`" in message and "`eval.method`" in message


def test_bad_values_name_the_field():
    with pytest.raises(UserError, match="train.max_steps"):
        load_config(None, ["train.max_steps=0"])
    with pytest.raises(UserError, match=r"prompt.user_template.*\{text\}"):
        load_config(None, ["prompt.user_template=no placeholder"])
    with pytest.raises(UserError, match="overrides are written key=value"):
        load_config(None, ["train.max_steps"])


def test_missing_and_malformed_yaml(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="`/dev/null` is not a regular file"):  # it exists: "does not exist" misled
        load_config("/dev/null")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(listy)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse_and_say_how_to_launch(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert f"emotune run configs/{path.name}" in path.read_text()


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.max_steps=3", "seed=7"])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(cfg))
    assert load_config(saved) == cfg.model_copy(update={"name": cfg.name})


def test_every_field_has_a_docstring():
    undocumented = [key for key, _, doc in field_docs() if not doc]
    assert not undocumented


# --------------------------------------------------------------------------------------------------
# Values that used to be accepted although invalid


def _problem(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_bool_for_a_number_field_is_refused():
    # YAML reads `true` as a bool and pydantic used to make it 1
    message = _problem("train.batch_size=true")
    assert "`train.batch_size`: must be an integer >= 1; true/false is not a number" in message
    assert "`train.learning_rate`" in _problem("train.learning_rate=false")


def test_warmup_ratio_outside_0_1_is_refused():
    for value in ("5", "-1", "1"):
        assert "`train.warmup_ratio`: must be a number in [0, 1)" in _problem(f"train.warmup_ratio={value}")
    assert load_config(None, ["train.warmup_ratio=0.1"]).train.warmup_ratio == 0.1


def test_negative_weight_decay_is_refused():
    assert "`train.weight_decay`: must be a number >= 0" in _problem("train.weight_decay=-0.01")


def test_nan_num_train_epochs_is_refused():
    for value in (".nan", "nan", ".inf"):
        assert "`train.num_train_epochs`: must be a number > 0" in _problem(f"train.num_train_epochs={value}")


def test_infinite_max_grad_norm_is_refused_zero_means_no_clipping():
    assert "`train.max_grad_norm`: must be a number >= 0, 0 = no clipping" in _problem("train.max_grad_norm=.inf")
    assert load_config(None, ["train.max_grad_norm=0"]).train.max_grad_norm == 0


def test_duplicate_yaml_key_is_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  batch_size: 2\n  max_steps: 3\n  batch_size: 8\n")
    with pytest.raises(UserError, match=r"dup.yaml`: key `batch_size` appears twice \(lines 2 and 4\).*remove one"):
        load_config(path)
    assert "key `a` appears twice" in _problem("data.label_aliases={a: joy, a: love}")
    merged = tmp_path / "merged.yaml"  # a YAML merge followed by an override is not a duplicate
    merged.write_text("train: &t\n  batch_size: 2\neval:\n  max_new_tokens: 3\nserve:\n  <<: {port: 1}\n  port: 2\n")
    assert load_config(merged).serve.port == 2


def test_a_yaml_alias_bomb_is_quoted_short_in_the_message():
    """Nine aliases of nine make 9^8 items from a few hundred bytes (a studio form field, a key=value override); the
    message quoted the value whole: 738 MB, and seconds per request."""
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 8)]
    said = _problem(f"train.max_steps=[{', '.join(levels)}]")
    assert "`train.max_steps`: must be an integer" in said and len(said) < 2_000


def test_yaml_nested_thousands_of_levels_deep_is_an_error_not_a_traceback(tmp_path):
    """PyYAML reads nesting recursively: 5,000 levels ran into Python's recursion limit (a RecursionError's traceback)."""
    path = tmp_path / "deep.yaml"
    path.write_text("train: " + "[" * 5_000 + "]" * 5_000 + "\n")
    with pytest.raises(UserError, match=r"deep.yaml`: it nests lists or mappings too deeply"):
        load_config(path)
    assert "`train.max_steps`: must be an integer" in _problem("train.max_steps=" + "[" * 5_000 + "]" * 5_000)


def test_run_name_that_escapes_output_dir_is_refused(tmp_path):
    for name in ("../../..", "..", ".", "a/b", "a\\\\b", "/etc", "two words", ""):
        assert "`name`: must be a plain folder name" in _problem(f"name={name}"), name
    for name in ("alpha.previous", "alpha.partial", "alpha.1f3e.partial"):  # what emotune moves aside and deletes
        assert "`name`: must not end in `.partial` or `.previous`" in _problem(f"name={name}"), name
    assert load_config(None, ["name=gemma_r16-v1.2"]).run_dir == Path("runs/gemma_r16-v1.2")
    path = tmp_path / "my config (1).yaml"  # the default taken from the file name is made plain
    path.write_text("train:\n  max_steps: 2\n")
    assert load_config(path).name == "my-config-1"


def test_run_names_are_held_to_what_a_file_system_takes(tmp_path):
    """A run named with 90 Chinese characters passed (90 of 100 characters) and `emotune run` ended in a traceback,
    `OSError: [Errno 36] File name too long`: 270 bytes in UTF-8, where file systems hold 255 per name. The name is
    refused naming the limit; a name taken from a long config file name is cut to fit."""
    said = _problem("name=" + "情" * 90)
    assert "`name`: must be a plain folder name" in said and "200 bytes" in said
    assert load_config(None, ["name=" + "情" * 60]).name == "情" * 60
    path = tmp_path / ("情" * 80 + ".yaml")
    path.write_text("train:\n  max_steps: 2\n")
    assert load_config(path).name == "情" * 66


def test_run_names_windows_cannot_hold_are_refused_by_name(tmp_path):
    """`name=nul`, `name=aux.txt` or `name=run.` passed: on Windows no folder can be named after a device (with any
    extension) and a trailing `.` is dropped (`run.` would be the folder `run`), so the run failed there with an
    OSError, or a run folder copied there could not be. Each is refused naming the reason and a name that works;
    a config file named so gets a default name that works."""
    for name in ("nul", "CON", "aux.txt", "com1", "LPT9.log"):
        said = _problem(f"name={name}")
        assert f"`{name}` is a device name on Windows" in said and f"name={name.split('.')[0]}-run" in said, name
    assert "ends in `.`, which Windows drops" in _problem("name=run.")
    for fine in ("console", "auxiliary", "com10", "a.b"):
        assert load_config(None, [f"name={fine}"]).name == fine
    path = tmp_path / "aux.yaml"
    path.write_text("train:\n  max_steps: 2\n")
    assert load_config(path).name == "aux-run"


def test_a_nul_character_in_a_config_text_is_refused_by_key():
    """`output_dir: "runs\\0x"` (YAML's escape for NUL) passed validation and the run ended in a traceback,
    `ValueError: embedded null byte`, once the folder was made. Any text field holding one is refused by key."""
    for override, key in (('output_dir="runs\\0x"', "output_dir"), ('model.cache_dir="c\\0"', "model.cache_dir"),
                          ('data.label_names=["a\\0", b]', "data.label_names"),
                          ('prompt.system_prompt="a\\0 {labels}"', "prompt.system_prompt")):
        assert f"`{key}`: holds a NUL character" in _problem(override), key


def test_the_saved_config_reads_back_as_the_config(tmp_path):
    """A prompt holding a NEL (U+0085, what "…" becomes when a cp1252 file is read as Latin-1) was written raw into
    config.yaml by PyYAML and read back as a space: the saved config named another prompt, and running it again was
    refused as a different config. The saved text reads back as the config, Chinese still written as it is."""
    from emotune.core.config.build import dump_config

    cfg = load_config(None, ['prompt.system_prompt="Classify\\N{labels} 情绪\\u2028now"', "name=nel"])
    assert "\x85" in cfg.prompt.system_prompt
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(cfg), encoding="utf-8")
    assert load_config(saved).prompt.system_prompt == cfg.prompt.system_prompt
    assert dump_config(load_config(saved)) == dump_config(cfg)
    plain = load_config(None, ["prompt.system_prompt=只回答一个词 {labels}"])
    assert "只回答一个词" in dump_config(plain)


def test_unknown_task_is_named_with_the_known_ones(capsys):
    for bad in ("task=sft_typo", "task=[1, 2]"):
        with pytest.raises(UserError) as err:
            load_config(None, [bad])
        assert "`task`" in str(err.value) and "classify" in str(err.value)


def test_each_task_accepts_only_its_own_sections(monkeypatch):
    """The config is a union keyed on `task`: a key that means nothing for the chosen task is refused."""
    from emotune.core.config import base, build, run

    class TextOnly(base.Section):
        source: str = "embedded"
        """Where the rows come from."""

    class OtherTask(run.RunConfigBase):
        task: Literal["other"] = "other"
        data: TextOnly = TextOnly()

    monkeypatch.setitem(build.TASK_CONFIGS, "other", OtherTask)
    cfg = load_config(None, ["task=other", "data.source=x"])
    assert isinstance(cfg, OtherTask) and cfg.data.source == "x"
    with pytest.raises(UserError, match="prompt"):
        load_config(None, ["task=other", "prompt.user_template={text}"])
    with pytest.raises(UserError, match="label_names"):
        load_config(None, ["task=other", "data.label_names=[a, b]"])
    assert type(load_config(None, [])).__name__ == "ClassifyConfig"


def test_one_tracker_name_is_a_one_item_list():
    assert load_config(None, ["train.report_to=tensorboard"]).train.report_to == ["tensorboard"]
    assert load_config(None, ["train.report_to=[tensorboard, wandb]"]).train.report_to == ["tensorboard", "wandb"]
    assert "`train.report_to.0`" in _problem("train.report_to=tensorbord")


def test_a_time_budget_is_a_duration_with_units():
    for text, seconds in (("20m", 1200), ("1h30m", 5400), ("1h 30m", 5400), ("900s", 900), ("1.5h", 5400),
                          ("2m30s", 150), (" 45S ", 45)):
        assert duration_seconds(text) == seconds, text
    assert load_config(None, ["train.time_budget=1h30m"]).train.time_budget == "1h30m"
    assert load_config(None, []).train.time_budget is None
    assert "a bare number could be seconds or minutes" in _problem("train.time_budget=20")
    for text in ("20min", "30m1h", "m", "1h-5m", "true"):
        assert "`train.time_budget`:" in _problem(f"train.time_budget={text}") and "e.g. 20m, 1h30m or 900s" in \
            _problem(f"train.time_budget={text}")
    assert "must be longer than 0" in _problem("train.time_budget=0m")


def test_a_time_budget_and_a_step_count_are_refused_together():
    message = _problem("train.time_budget=20m", "train.max_steps=100")
    assert "`train.time_budget` (20m) and `train.max_steps` (100) both say how long to train" in message
    assert "train.max_steps=-1" in message and "train.time_budget=null" in message
    assert load_config(None, ["train.time_budget=20m", "train.max_steps=-1"]).train.max_steps == -1


def test_the_own_data_recipe_trains_for_a_time_budget_with_epochs_as_the_upper_bound():
    cfg = load_config(Path(__file__).parent.parent / "configs" / "cpu-own-data.yaml")
    assert (cfg.train.time_budget, cfg.train.max_steps, cfg.train.num_train_epochs) == ("20m", -1, 3)
    assert cfg.eval.method == "score" and cfg.data.balance == "none"
    assert cfg.data.validation_limit is not None  # validations are paid from the budget


def test_text_fields_keep_what_was_written_where_yaml_reads_booleans_and_numbers(tmp_path):
    """YAML 1.1 makes `yes`/`no`/`on` booleans and `007`, `1.10` numbers: binary yes/no labels, star ratings and a run
    named 2024 failed as "not a valid string" (or would lose their spelling) before text fields got the text back."""
    path = tmp_path / "x.yaml"
    path.write_text("data:\n  label_names: [yes, no, on, 1.10]\n  label_aliases: {y: yes, 1: no}\nname: 007\n")
    cfg = load_config(path)
    assert cfg.data.label_names == ["yes", "no", "on", "1.10"]
    assert cfg.data.label_aliases == {"y": "yes", "1": "no"}
    assert cfg.name == "007"
    cfg = load_config(None, ["data.label_names=[1, 2, 3]", "name=2024", "data.label_column=true", "seed=007"])
    assert cfg.data.label_names == ["1", "2", "3"] and cfg.name == "2024" and cfg.data.label_column == "true"
    assert cfg.seed == 7  # a number field still reads YAML's number


def test_a_template_override_is_the_text_typed_and_a_yaml_mapping_in_a_file_says_to_quote_it(tmp_path):
    cfg = load_config(None, ["prompt.user_template=Review: {text}", "prompt.system_prompt={labels}"])
    assert cfg.prompt.user_template == "Review: {text}" and cfg.prompt.system_prompt == "{labels}"
    path = tmp_path / "x.yaml"
    path.write_text("prompt:\n  user_template: {text}\n")
    with pytest.raises(UserError, match=r"`prompt.user_template`.*YAML read a mapping there: put the value in quotes"):
        load_config(path)
    with pytest.raises(UserError, match=r"`data.label_names`.*write a list in brackets, e.g. data.label_names=\[joy\]"):
        load_config(None, ["data.label_names=joy"])
    # an item of a list of texts read as a list or mapping: the hint is about the items, not a template's braces
    path.write_text("data:\n  label_names: [joy, [sad], {angry: 1}]\n")
    with pytest.raises(UserError) as raised:
        load_config(path)
    said = str(raised.value)
    assert "`data.label_names.1`: Input should be a valid string (YAML read a list there, where one text belongs" in said
    assert "`data.label_names.2`" in said and "Review: {text}" not in said
    path.write_text("name: {a: b}\n")
    with pytest.raises(UserError, match=r"`name`.*put the value in quotes, e.g. name: 'the text'"):
        load_config(path)


def test_other_tools_keys_and_section_keys_at_the_top_level_name_emotunes_key(tmp_path):
    """`learning_rate:` at the top level, or an Axolotl file's `base_model:`, were answered with the top-level keys or a
    section's name, not the key that holds the setting."""
    path = tmp_path / "x.yaml"
    path.write_text("base_model: google/gemma-3-270m-it\nmicro_batch_size: 2\nlora_r: 16\nlearning_rate: 2.0e-4\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    for key, meant in (("base_model", "model.source"), ("micro_batch_size", "train.batch_size"), ("lora_r", "lora.r"),
                       ("learning_rate", "train.learning_rate")):
        assert f"`{key}` is not a config key; did you mean `{meant}`" in message


def test_an_axolotl_config_without_datasets_is_named_first(tmp_path):
    """An Axolotl config (examples/llama-3/lora-1b.yml's shape) is translated (tests/test_axolotl.py); one that does
    not name its data yet got thirty lines, one per key, and nothing said that the file is another tool's."""
    path = tmp_path / "lora-1b.yml"
    path.write_text("base_model: NousResearch/Llama-3.2-1B\nval_set_size: 0.1\nadapter: lora\nsequence_len: 2048\n"
                    "lora_r: 16\nmicro_batch_size: 2\nnum_epochs: 1\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    first = str(err.value).splitlines()[1]
    assert "lora-1b.yml` looks like an Axolotl config (base_model, micro_batch_size, sequence_len" in first
    assert "without `datasets`" in first
    assert "`lora_r` is not a config key; did you mean `lora.r`" in str(err.value)  # each key's line still follows


H2O_CFG = """architecture:
    backbone_dtype: int4
dataset:
    answer_column: output
    parent_id_column: parent_id
    prompt_column:
    - instruction
    train_dataframe: examples/data_oasst2/train_full.csv
    validation_size: 0.01
experiment_name: example_oasst2
llm_backbone: h2oai/h2o-danube2-1.8b-base
output_directory: examples/output_oasst2
problem_type: {problem}
training:
    lora_r: 4
"""


@pytest.mark.parametrize(("problem", "says"), [
    ("text_causal_language_modeling", "write an emotune config instead: task: sft, model.source: "
     "h2oai/h2o-danube2-1.8b-base, data.source: examples/data_oasst2/train_full.csv, data.columns.prompt: instruction, "
     "data.columns.response: output; the lines below go through its keys. Rows chained by parent_id"),
    ("text_causal_classification_modeling", "task: classify_head, model.source: h2oai/h2o-danube2-1.8b-base, data.source: "
     "examples/data_oasst2/train_full.csv, data.text_column: instruction, data.label_column: output"),
    ("text_dpo_modeling", "its problem_type `text_dpo_modeling` has no emotune task"),
])
def test_an_h2o_llm_studio_config_is_named_with_where_its_backbone_and_data_go(tmp_path, problem, says):
    """H2O LLM Studio's experiment config (examples/example_oasst2.yaml's shape) got one 'not a config key' line per
    section and nothing said the file is another tool's; `llm_backbone`, `experiment_name` and `problem_type` were
    offered the closest spelling or the valid keys instead of their emotune names."""
    path = tmp_path / "cfg.yaml"
    path.write_text(H2O_CFG.format(problem=problem))
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    first = message.splitlines()[1]
    assert "cfg.yaml` is an H2O LLM Studio experiment config (llm_backbone, problem_type, dataset)" in first
    assert says in first
    for key, meant in (("llm_backbone", "model.source"), ("experiment_name", "name"), ("problem_type", "task"),
                       ("output_directory", "output_dir"), ("training", "train")):
        assert f"`{key}` is not a config key; did you mean `{meant}`" in message


def test_a_run_folder_or_a_data_file_given_as_the_config_says_what_it_is(tmp_path):
    """`emotune run runs/x` said the config "does not exist", and `emotune run reviews.jsonl` showed a YAML syntax
    error in the first row of data."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("name: run\n")
    with pytest.raises(UserError, match=r"is a folder; it looks like a run folder, whose config is `.*run/config.yaml`"):
        load_config(tmp_path / "run")
    (tmp_path / "d.jsonl").write_text('{"text": "hi", "label": "joy"}\n')
    with pytest.raises(UserError, match=r"is a data file, not a config. Give it as data.source"):
        load_config(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_text('[{"text": "hi", "label": "joy"}]')
    with pytest.raises(UserError, match=r"not a list \(rows of data\? give a data file as data.source=FILE\)"):
        load_config(tmp_path / "d.json")


@pytest.mark.parametrize(("overrides", "says"), [
    (["data.label_column=text"], "data.text_column and data.label_column name the same column `text`"),
    (["data.text_column=label"], "name the same column `label`"),
    (["data.label_names=[joy, ' Joy']"], "names [' Joy', 'joy'] as more than one label"),
    (["data.label_names=[joy, '']"], "holds an empty name"),
    # an empty source is the working directory to pathlib: `data.source=` read the train.* files found under it
    (["data.source="], "`data.source`: is empty; name a file, a folder, a hub id or `embedded`"),
    (["task=sft", "data.source= "], "`data.source`: is empty"),
    (["model.source="], "`model.source`: is empty"),
])
def test_label_settings_that_cannot_mean_anything_are_refused(overrides, says):
    """The same column as text and label ended in "labels [...] have no training rows" (a label per text); two names
    that differ in case only are one label to the data, which then had no rows for the other."""
    with pytest.raises(UserError, match=re.escape(says)):
        load_config(None, overrides)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-8-sig"])
def test_a_config_saved_with_a_byte_order_mark_reads_as_its_utf8_text(tmp_path, encoding):
    """PowerShell's `>` and Windows editors save UTF-16 with a byte-order mark, as YAML allows: such a config was
    refused as "not UTF-8 text". Bytes that are none of these are still refused."""
    text = "model:\n  source: embedded\ntrain:\n  max_steps: 7\ndata:\n  label_names: [喜悦, 悲伤]\n"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain, marked = tmp_path / "a" / "job.yaml", tmp_path / "b" / "job.yaml"  # the run's name is the file's
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(("\ufeff" + text).encode(encoding) if encoding == "utf-16-be" else text.encode(encoding))
    assert dump_config(load_config(marked)) == dump_config(load_config(plain))
    assert load_config(marked).train.max_steps == 7
    broken = tmp_path / "broken.yaml"
    broken.write_bytes(b"train:\n  max_steps: \xff\xfe\n")
    with pytest.raises(UserError, match="not UTF-8 text"):
        load_config(broken)
