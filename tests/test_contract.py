"""Command contracts: whichever command prepares the data, it is the same data; every command that takes a
config prints it resolved (defaults < YAML < key=value) before doing anything else."""

from __future__ import annotations

import json
from datetime import datetime

import pyarrow.parquet as pq
import pytest
import yaml

from emotune.cli import main
from emotune.core.config.build import dump_config
from emotune.core.config.load import load_config
from emotune.core.config.run import RunConfig

HEADER = "Resolved config (defaults < YAML < key=value):\n"
TIME_KEYS = {"created"}  # the keys of data_report.json that hold a wall-clock time


def _write_config(path, tiny_model_dir, data_dir, tmp_path, **sections) -> str:
    """A YAML config for the tiny model and fixture data; `sections` add or replace top-level blocks."""
    config = {
        "output_dir": str(tmp_path / "runs"),
        "model": {"source": str(tiny_model_dir), "cache_dir": str(tmp_path / "cache")},
        "data": {"source": str(data_dir), "label_names": ["sadness", "joy", "love", "anger", "fear", "surprise"]},
        "train": {"max_steps": 2, "batch_size": 4, "gradient_accumulation_steps": 1, "gradient_checkpointing": False,
                  "precision": "fp32", "eval_steps": 1, "save_steps": 1, "logging_steps": 1, "learning_rate": 0.01},
        "eval": {"batch_size": 6},
        **sections,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return str(path)


def _is_time(value) -> bool:
    if not isinstance(value, str) or "T" not in value:
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def _without_times(value, removed: set[str]):
    """`value` with every key whose value is an ISO date-time dropped, at any depth; their names go to `removed`."""
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            if _is_time(item):
                removed.add(key)
            else:
                kept[key] = _without_times(item, removed)
        return kept
    if isinstance(value, list):
        return [_without_times(item, removed) for item in value]
    return value


@pytest.mark.slow
def test_data_then_run_prepares_the_same_data_as_run_alone(tiny_model_dir, data_dir, tmp_path, capsys):
    config = _write_config(tmp_path / "tiny.yaml", tiny_model_dir, data_dir, tmp_path)
    assert main(["data", config, "name=prepared"]) == 0
    assert main(["run", config, "name=prepared"]) == 0
    assert "[emotune] stage data: skipped" in capsys.readouterr().out  # the run reused what `data` wrote
    assert main(["run", config, "name=alone"]) == 0
    assert "[emotune] stage data: start" in capsys.readouterr().out  # this one prepared its own

    runs = tmp_path / "runs"
    reports, removed = [], set()
    for name in ("prepared", "alone"):
        raw = json.loads((runs / name / "data" / "data_report.json").read_text(encoding="utf-8"))
        reports.append(_without_times(raw, removed))
    assert removed == TIME_KEYS  # the only differences allowed are wall-clock times, and these are all of them
    assert reports[0] == reports[1]
    for split in ("train", "validation", "test"):
        tables = [pq.read_table(runs / name / "data" / f"{split}.parquet") for name in ("prepared", "alone")]
        assert tables[0].equals(tables[1]), split


# --------------------------------------------------------------------------------------------------
# The resolved config is printed first, by every command that takes one


@pytest.fixture
def layered(tiny_model_dir, data_dir, tmp_path):
    """A YAML file that changes defaults (lora.r, train.max_steps) and overrides that change it again."""
    path = _write_config(tmp_path / "layered.yaml", tiny_model_dir, data_dir, tmp_path,
                         lora={"r": 4}, name="layered")
    overrides = ["train.max_steps=3", "eval.batch_size=4"]  # the YAML says 2 and 6
    expected = load_config(path, overrides)
    resolved = yaml.safe_load(dump_config(expected))
    # the precedence itself, checked against literal values rather than the loader alone
    assert resolved["train"]["max_steps"] == 3 and resolved["eval"]["batch_size"] == 4  # key=value beats YAML
    assert resolved["lora"]["r"] == 4 and resolved["name"] == "layered"  # YAML beats the defaults
    assert resolved["lora"]["alpha"] == RunConfig().lora.alpha  # untouched default
    return path, overrides, dump_config(expected)


def _assert_printed_first(out: str, resolved_yaml: str) -> None:
    assert out.startswith(HEADER + resolved_yaml), out[:2000]


@pytest.mark.parametrize("command", ["data", "eval", "train", "run"])
def test_config_commands_print_the_resolved_config_first(command, layered, tmp_path, capsys):
    path, overrides, resolved_yaml = layered
    assert main([command, path, *overrides]) == 0
    _assert_printed_first(capsys.readouterr().out, resolved_yaml)


def test_eval_shorthands_still_print_the_resolved_config(layered, capsys):
    path, overrides, _ = layered
    assert main(["eval", path, *overrides, "split=validation"]) == 0
    expected = dump_config(load_config(path, [*overrides, "eval.split=validation"]))
    assert "split: validation" in expected and "max_steps: 3" in expected
    _assert_printed_first(capsys.readouterr().out, expected)


def test_config_command_prints_the_same_resolution(layered, capsys):
    path, overrides, resolved_yaml = layered
    assert main(["config", path, *overrides]) == 0
    assert capsys.readouterr().out == resolved_yaml


def test_serve_prints_the_resolved_config_first(layered, tiny_run_dir, monkeypatch, capsys):
    import emotune.serve

    served = {}
    monkeypatch.setattr(emotune.serve, "run_server", lambda app, cfg: served.update(port=cfg.port))  # no socket here
    path, overrides, _ = layered
    assert main(["serve", "--no-auth", path, *overrides, "serve.port=8123", str(tiny_run_dir)]) == 0
    assert served["port"] == 8123
    expected = dump_config(load_config(path, [*overrides, "serve.port=8123", "serve.no_auth=true"]))
    _assert_printed_first(capsys.readouterr().out, expected)
