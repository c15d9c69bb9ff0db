"""bench/host_overhead.py and bench/gpu_speed.py --dry-run: both scripts' whole code path (emotune's trainer timed
update by update and its operators counted, TRL's SFTTrainer the same way, on a Gemma 4 model built from a config)
on the CPU with a small model, one JSON line each."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("trl")


@pytest.mark.slow  # three short trainings of a 12-layer model
def test_host_overhead_times_and_counts_each_side(capsys):
    script = runpy.run_path(str(ROOT / "bench" / "host_overhead.py"))
    assert script["main"](["--steps", "6", "--layers", "12"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["layers"] == 12 and line["rows_per_update"] == 16
    for side in ("auto", "off", "trl"):
        result = line[side]
        assert result["seconds_per_update"] > 0 and result["updates_timed"] == 2  # 6 steps: 2 warm-up, 1 counted, 1 last
        assert result["ops_per_pass"] > 100 and result["passes_per_update"] >= 1 and result["last_loss"] > 0
    assert line["off"]["settings"]["lean_lora"] is False and line["auto"]["settings"] == "defaults"
    # auto sizes its passes from the free RAM (a whole update in one pass where it fits); off: one per micro-batch
    assert line["auto"]["pass_size"]["setting"] == "auto" and line["auto"]["pass_size"]["free_bytes"] > 0
    assert line["off"]["passes_per_update"] == 4 and line["auto"]["passes_per_update"] <= 4
    assert line["trl"]["passes_per_update"] == 4  # 4 x 4: one forward pass per micro-batch
    assert line["speedup"] > 0 and line["ratio"] > 0 and line["ops_ratio"] != 1  # the switches change the work
    assert line["ops_ratio_update"] < 1  # fewer operator calls for the same update
    with pytest.raises(SystemExit):
        script["main"](["--layers", "7"])


@pytest.mark.slow
def test_gpu_speed_dry_run_compares_both_sides(capsys):
    script = runpy.run_path(str(ROOT / "bench" / "gpu_speed.py"))
    assert script["main"](["--dry-run", "--steps", "6"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    emotune, trl, summary = lines
    assert (emotune["side"], trl["side"], summary["summary"]) == ("emotune", "trl", True)
    assert emotune["tokens_per_s"] > 0 and trl["tokens_per_s"] > 0 and emotune["parameters"] == trl["parameters"]
    assert summary["ratio"] == round(emotune["tokens_per_s"] / trl["tokens_per_s"], 2)
    assert emotune["mfu"] is None and summary["peak_tflops"] is None  # a CPU has no bf16 peak in the table
    dense = script["_dense_parameters"]

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj, self.head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10)

        def get_output_embeddings(self):
            return self.head

    untied = Tiny()
    assert dense(untied) == 4 * 4 + 4 + 10 * 4 + 10  # the embedding table left out, the output projection in
    untied.head.weight = untied.embed.weight  # tied, as Gemma's are
    assert dense(untied) == 4 * 4 + 4 + 10 * 4 + 10  # still counted once
