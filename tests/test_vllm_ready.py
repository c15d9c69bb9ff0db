"""The vLLM hand-off: adapters vLLM cannot serve are refused (target modules, rank), and --max-model-len is set from
the run's longest prompt rather than the base's whole context."""

from __future__ import annotations

import json
import os
import subprocess

import yaml

from conftest import write_tiny_adapter
from emotune.cli import main
from emotune.deploy.vllm_ready import lora_blockers, max_model_len


def test_lora_blockers():
    assert lora_blockers({"r": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}) == []
    found = lora_blockers({"r": 1024, "target_modules": ["q_proj", "lm_head", "input_layernorm"]})
    assert "input_layernorm, lm_head" in found[0] and "1024" in found[1] and "512" in found[1]
    assert lora_blockers({"r": 8, "rank_pattern": {"layers.0.self_attn.q_proj": 640}, "target_modules": ["q_proj"]})


def test_max_model_len_follows_the_run_config(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"train": {"max_length": 300}, "eval": {"max_new_tokens": 4}}))
    assert max_model_len(tmp_path / "adapter", 32768) == 512
    assert max_model_len(tmp_path / "adapter", 400) == 400  # never past the base's context


def test_export_refuses_the_lora_route_and_scripts_set_max_model_len(tiny_model_dir, tmp_path, capsys):
    run_dir = write_tiny_adapter(tiny_model_dir, tmp_path / "run", overrides=("train.max_length=200",))
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--vllm", "--out", str(out)]) == 0
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "vllm").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (fake_bin / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    args = subprocess.run(["bash", str(out / "vllm" / "serve_lora.sh")], env=env, capture_output=True, text=True,
                          check=True).stdout.splitlines()
    assert args[args.index("--max-model-len") + 1] == "256"  # 200 + the run's eval.max_new_tokens, up to 256

    # LoRA on the output head: vLLM would refuse it at start, so the hand-off takes the merged route
    capsys.readouterr()
    run_dir = write_tiny_adapter(tiny_model_dir, tmp_path / "head")
    peft_config = run_dir / "adapter" / "adapter_config.json"
    config = json.loads(peft_config.read_text())
    peft_config.write_text(json.dumps({**config, "target_modules": [*config["target_modules"], "lm_head"]}))
    assert main(["export", str(run_dir), "--vllm", "--out", str(tmp_path / "export2")]) == 0
    said = capsys.readouterr().out
    assert "vLLM cannot hot-load" in said and "lm_head" in said
    assert not (tmp_path / "export2" / "vllm" / "serve_lora.sh").exists()


def test_an_all_linear_adapter_is_judged_by_the_modules_its_weights_adapt(tmp_path):
    """emotune's `all-linear` saves a regex as target_modules; its last dotted part was taken for a module name, so every
    such adapter was told 'it trains modules vLLM's LoRA does not cover ()?(?:down_proj|...)$' and sent to the
    merged route. The modules come from the adapter's weights instead."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from emotune.deploy.export import vllm_blockers

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=["full_attention"])
    for name, pattern in (("plain", r"^model\.(?:.*\.)?(?:down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)$"),
                          ("head", r"^(?:model\.(?:.*\.)?(?:q_proj|v_proj)|lm_head)$")):
        get_peft_model(Gemma3ForCausalLM(config), LoraConfig(r=4, target_modules=pattern)).save_pretrained(tmp_path / name)
    assert vllm_blockers(tmp_path / "plain") == []
    said = vllm_blockers(tmp_path / "head")
    assert len(said) == 1 and "does not cover (lm_head;" in said[0], said
