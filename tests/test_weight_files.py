"""A model folder whose weights cannot load (a shard missing, a file cut short, none at all) is refused by name
before the run folder is opened, on every command that loads weights; transformers stopped halfway with a traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from emotune.cli import main
from emotune.core.errors import UserError
from emotune.model.loading import load_model
from emotune.model.weight_files import check_weight_files


def _copy(tiny_model_dir, folder, shards: bool = False):
    shutil.copytree(tiny_model_dir, folder)
    if shards:
        (folder / "model.safetensors").unlink()
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(folder, max_shard_size="20KB")
        assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def test_damaged_weights_are_refused_before_the_run_folder_is_made(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    cut = _copy(tiny_model_dir, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    sharded = _copy(tiny_model_dir, tmp_path / "sharded", shards=True)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    empty = _copy(tiny_model_dir, tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    said = {cut: "(", sharded: "lacks 1 of the", empty: "holds config.json but no weights"}
    for folder, why in said.items():
        for command in ("run", "eval"):
            assert main([command, *tiny_overrides, f"model.source={folder}"]) == 2
            err = capsys.readouterr().err
            assert why in err and "Traceback" not in err and "Download or copy the model again" in err
            assert not (tmp_path / "runs").exists()
    with pytest.raises(UserError, match=r"cut/model.safetensors` \([\d,]+ bytes\) is not a complete safetensors"):
        load_model(cut, torch.float32, torch.device("cpu"))  # predict, serve and export load through it


def test_whole_weights_pass_in_one_file_and_in_shards(tiny_model_dir, tmp_path):
    check_weight_files(tiny_model_dir)
    sharded = _copy(tiny_model_dir, tmp_path / "sharded", shards=True)
    check_weight_files(sharded)
    assert load_model(sharded, torch.float32, torch.device("cpu")) is not None


def test_a_model_folder_without_a_readable_tokenizer_is_refused_by_name(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    """No tokenizer files: transformers 5 built an empty tokenizer of the config's class, and the run refused the
    labels as "the same tokens"; a broken tokenizer.json ended `emotune run` in a JSONDecodeError traceback."""
    bare = _copy(tiny_model_dir, tmp_path / "bare")
    for file in bare.glob("tokenizer*"):
        file.unlink()
    broken = _copy(tiny_model_dir, tmp_path / "broken")
    (broken / "tokenizer.json").write_text((broken / "tokenizer.json").read_text()[:200])
    said = {bare: "holds no tokenizer files (tokenizer.json", broken: "cannot be loaded (JSONDecodeError"}
    for folder, why in said.items():
        for command in ("run", "data"):
            assert main([command, *tiny_overrides, f"model.source={folder}"]) == 2
            err = capsys.readouterr().err
            assert why in err and "Traceback" not in err and "same tokens" not in err
    assert not (tmp_path / "runs").exists()


def test_weights_that_do_not_fill_the_config_are_refused(tiny_model_dir, tiny_overrides, tmp_path, capsys):
    """A config.json edited to more layers left the new layers at random values and the run measured that model
    without a word; one edited to a wider MLP ended in transformers' RuntimeError traceback."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    deeper = _copy(tiny_model_dir, tmp_path / "deeper")
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1,
                                                    "layer_types": None}))
    wider = _copy(tiny_model_dir, tmp_path / "wider")
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    said = {deeper: r"no values for \d+ of the parameters its config.json gives \(model.layers.\d+",
            wider: r"\d+ tensors whose shapes are not what its config.json gives \(model.layers.0.mlp.down_proj.weight"}
    for folder, why in said.items():
        assert main(["eval", *tiny_overrides, f"model.source={folder}"]) == 2
        err = capsys.readouterr().err
        assert re.search(why, err) and "Traceback" not in err
        with pytest.raises(UserError, match="do not fit its config.json"):
            load_model(folder, torch.float32, torch.device("cpu"))
