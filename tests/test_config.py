"""Config: precedence, unknown keys with suggestions, every problem at once, shipped YAMLs parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from emotune.config import RunConfig, dump_config, field_docs, load_config
from emotune.errors import UserError

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
