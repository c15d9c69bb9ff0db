"""`train.max_tokens_per_pass=auto` (emotune.train.pass_size): passes sized from the free memory, a whole optimizer
update in one pass when it fits, the same update as gradient accumulation's micro-batches, and the choice in run.json."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from emotune.core.config.load import load_config
from emotune.core.config.train import LoraSettings
from emotune.pipeline import train_only
from emotune.train import pass_size
from emotune.train.batches import update_passes
from emotune.train.memory import Workload, describe, pass_bytes


class PassCounter:
    """Training's fault hook: the forward passes of each step and the rows of each."""

    def __init__(self):
        self.passes: Counter = Counter()
        self.rows: dict[int, list[int]] = {}

    def __call__(self, step: int, batch: dict) -> None:
        self.passes[step] += 1
        self.rows.setdefault(step, []).append(int(batch["input_ids"].shape[0]))


def _run(tmp_path: Path, name: str) -> tuple[dict, list[float], dict[str, torch.Tensor]]:
    folder = tmp_path / "runs" / name
    run = json.loads((folder / "run.json").read_text())
    losses = [e["loss"] for e in json.loads((folder / "train" / "log_history.json").read_text()) if "loss" in e]
    return run["stages"]["train"]["passes"], losses, load_file(folder / "adapter" / "adapter_model.safetensors")


def test_one_pass_per_update_gives_the_micro_batched_update(tiny_overrides, tmp_path, capsys, monkeypatch):
    """6 rows a step as 2 x 3 accumulation: `auto` with this machine's RAM runs each update as one pass of all 6
    rows, `0` as three micro-batches, `auto` with no memory free as every row alone; the losses and the adapter agree.
    The loss of each is the update's summed token losses over the update's completion tokens, so only the float
    summation order differs (fp32: ~1e-7 relative); Adam's normalised step amplifies that where a gradient entry is
    near zero, to ~3e-5 on weights of ~0.2 after 3 steps at lr 0.01 (the same bound as splitting a batch into passes,
    tests/test_train.py), hence atol 1e-4 on the weights and rel 1e-5 on the losses."""
    common = [*tiny_overrides, "device=cpu", "train.max_steps=3", "train.batch_size=2",
              "train.gradient_accumulation_steps=3", "lora.dropout=0.0", "train.eval_steps=3", "train.save_steps=10"]
    counted = {}
    for name, setting in (("merged", "auto"), ("micro", "0")):
        counted[name] = PassCounter()
        train_only(load_config(None, [*common, f"name={name}", f"train.max_tokens_per_pass={setting}"]),
                   fault=counted[name])
        counted[name + "_out"] = capsys.readouterr().out
    monkeypatch.setattr(pass_size, "free_bytes", lambda device: 0)  # a device with nothing free
    counted["alone"] = PassCounter()
    train_only(load_config(None, [*common, "name=alone"]), fault=counted["alone"])

    assert counted["merged"].passes == {0: 1, 1: 1, 2: 1} and counted["merged"].rows[0] == [6]
    assert counted["micro"].passes == {0: 3, 1: 3, 2: 3} and counted["micro"].rows[0] == [2, 2, 2]
    assert counted["alone"].passes == {0: 6, 1: 6, 2: 6}
    merged, micro, alone = (_run(tmp_path, n) for n in ("merged", "micro", "alone"))
    # run.json: the passes per update and how auto chose the cap
    assert merged[0]["setting"] == "auto" and merged[0]["passes_per_update"]["max"] == 1
    assert merged[0]["free_bytes"] > 0 and merged[0]["bytes_per_token"] > 0 and merged[0]["cap"] >= 6 * 10
    assert merged[0]["memory_share"] == pass_size.MEMORY_SHARE
    assert micro[0] == {"setting": 0, "cap": 0, "passes_per_update": {"min": 3, "max": 3, "mean": 3, "updates": 6},
                        "note": "set in the config", "checkpointing": False, "checkpointing_note": "set in the config"}
    assert alone[0]["free_bytes"] == 0 and alone[0]["cap"] == 1 and alone[0]["passes_per_update"]["min"] == 6
    assert "train.max_tokens_per_pass=auto" in counted["merged_out"] and ": 1 per update" in counted["merged_out"]
    assert "one forward pass per batch (micro-batch): 3 per update" in counted["micro_out"]
    for other in (micro, alone):
        assert other[1] == pytest.approx(merged[1], rel=1e-5)
        assert other[2].keys() == merged[2].keys()
        assert all(torch.allclose(other[2][k], merged[2][k], atol=1e-4) for k in merged[2])
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in merged[2].items() if "lora_B" in k)  # it trained


def test_the_cap_follows_the_free_memory(tiny_model_dir):
    """From the planner's estimate of the tiny model: memory for about two rows a pass cuts an update of 6 rows into
    several passes; plenty runs it as one; what the step holds besides its passes is kept out of the budget."""
    from transformers import AutoConfig

    work = Workload(loss_tokens_per_row=3)
    arch = describe(AutoConfig.from_pretrained(tiny_model_dir), LoraSettings(r=4), "adamw_torch", torch.float32, work)
    lengths = {i: 40 - 3 * i for i in range(6)}  # rows of 40 down to 25 tokens
    reserved = arch.trainable_bytes + arch.optimizer_bytes + 2 * arch.trainable_bytes  # on a CPU: two host copies too
    two_rows = reserved + pass_bytes(arch, work, 2, 40, False) / pass_size.MEMORY_SHARE
    small = pass_size.auto_size(arch, work, (25, 40), False, True, int(two_rows) + 1)
    assert small.reserved_bytes == reserved and 2 * 25 <= small.cap < 3 * 40
    several = update_passes([[0, 1], [2, 3], [4, 5]], lengths, 1, small.cap)[0]
    assert 2 <= len(several) < 6 and sorted(i for p in several for i in p) == list(range(6))

    large = pass_size.auto_size(arch, work, (25, 40), False, True, 64 * 2**30)
    assert large.cap >= 6 * 40 and update_passes([[0, 1], [2, 3], [4, 5]], lengths, 1, large.cap)[0] == [[0, 1, 2, 3, 4, 5]]
    # gradient checkpointing keeps less per token: a larger cap from the same memory
    assert pass_size.auto_size(arch, work, (25, 40), True, True, int(two_rows) + 1).cap >= small.cap
    nothing = pass_size.auto_size(arch, work, (25, 40), False, True, reserved)
    assert nothing.cap == 1 and "every row alone" in nothing.note


def test_update_passes_keep_each_process_rows_and_cut_them_together():
    """Two processes, two micro-batches: each process's passes hold the rows its micro-batch shares held (the update's
    rows per process do not move), cut together under the cap; without a cap, one pass per micro-batch."""
    lengths = {i: 10 + i for i in range(8)}
    micro = [[0, 1, 2, 3], [4, 5, 6, 7]]
    merged = update_passes(micro, lengths, 2, max_tokens=100)
    assert merged == [[[5, 4, 1, 0]], [[7, 6, 3, 2]]]  # longest first, one pass each
    assert update_passes(micro, lengths, 2, max_tokens=0) == [[[1, 0], [5, 4]], [[3, 2], [7, 6]]]
    split = update_passes(micro, lengths, 2, max_tokens=40)
    assert [len(p) for p in split] == [2, 2] and all(sum(map(len, p)) == 4 for p in split)


def test_auto_falls_back_to_one_pass_per_micro_batch_where_memory_is_not_modelled(tiny_overrides, tiny_model_dir):
    """A device whose free memory is unknown: `auto` runs one pass per micro-batch and says why; a configured cap is
    taken as it is; full fine-tuning is sized as LoRA is (the memory model covers it)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from emotune.train.batches import Example
    from emotune.train.passes import make_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [Example(list(range(8 + i)), 6 + i) for i in range(8)]
    one_process = SimpleNamespace(device=torch.device("cpu"), num_processes=1)

    def chosen(*overrides: str, device=one_process) -> pass_size.PassSize:
        cfg = load_config(None, [*tiny_overrides, "train.batch_size=2", "train.gradient_accumulation_steps=2", *overrides])
        return pass_size.choose(cfg, model, rows, 0, make_plan(cfg.train, len(rows), 1), device, False)

    full = chosen("train.finetuning=full")
    assert full.cap >= 4 * 15 and full.passes_per_update["max"] == 1 and full.bytes_per_token > 0
    unknown = chosen(device=SimpleNamespace(device=torch.device("meta"), num_processes=1))
    assert unknown.cap == 0 and "not known" in unknown.note
    fixed = chosen("train.max_tokens_per_pass=20")
    assert fixed.cap == 20 and fixed.free_bytes is None and fixed.passes_per_update["max"] >= 2
    assert chosen().cap >= 4 * 15 and chosen().passes_per_update == {"min": 1, "max": 1, "mean": 1, "updates": 2}


def test_checkpointing_auto_is_off_only_where_the_update_needs_no_more_passes_without_it(tiny_model_dir, tiny_overrides,
                                                                                         monkeypatch):
    """`train.gradient_checkpointing=auto`: with memory to spare the update runs as one pass without recomputation;
    with just enough free memory for the whole update's pass with checkpointing but not without it, on (without it
    the update would take more passes); where the free memory is unknown, on; with a cap in the config, off when its
    widest pass fits without it; `true`/`false` are taken as written; a model without checkpointing support, off."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from emotune.train.batches import Example
    from emotune.train.passes import make_plan

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [Example(list(range(30 + i)), 6) for i in range(8)]  # 30-37 tokens, 4 rows an update
    one_process = SimpleNamespace(device=torch.device("cpu"), num_processes=1)

    def chosen(*overrides: str, free: int | None = 64 * 2**30, device=one_process) -> pass_size.PassSize:
        monkeypatch.setattr(pass_size, "free_bytes", lambda device: free)
        cfg = load_config(None, [*tiny_overrides, "train.batch_size=2", "train.gradient_accumulation_steps=2",
                                 "train.gradient_checkpointing=auto", *overrides])
        return pass_size.choose(cfg, model, rows, 0, make_plan(cfg.train, len(rows), 1), device, False)

    spare = chosen()
    assert not spare.checkpointing and spare.passes_per_update["max"] == 1
    assert spare.checkpointing_note == "auto: off, an update fits in 1 forward pass without it (1 forward pass with it)"
    assert "gradient checkpointing off (auto: off" in spare.words()

    cfg = load_config(None, [*tiny_overrides, "train.batch_size=2", "train.gradient_accumulation_steps=2",
                             "train.gradient_checkpointing=auto"])
    arch, work, _ = pass_size._estimate(cfg, model, rows, torch.device("cpu"), False)  # what choose() estimates
    # the cap is the fewest tokens that fit at either length (rows of 30 and of 37): the update's 4 rows padded to 37
    # (148 tokens) pass as one where 5 rows of 30 (150) fit too
    on_bytes = max(pass_bytes(arch, work, 4, 37, True), pass_bytes(arch, work, 5, 30, True))
    assert pass_bytes(arch, work, 4, 37, False) > 1.2 * on_bytes  # what recomputation saves here
    just = pass_size.reserved_bytes(arch, True) + int(on_bytes / pass_size.MEMORY_SHARE) + 1
    tight = chosen(free=just)
    assert tight.checkpointing and tight.passes_per_update["max"] == 1, tight
    assert tight.checkpointing_note.startswith("auto: on, without it an update would need 2 forward passes")

    unknown = chosen(free=None)
    assert unknown.checkpointing and unknown.cap == 0 and "not known" in unknown.checkpointing_note
    fixed = chosen("train.max_tokens_per_pass=80")
    assert not fixed.checkpointing and fixed.cap == 80 and "a pass needs about" in fixed.checkpointing_note
    assert chosen("train.max_tokens_per_pass=80", free=just // 4).checkpointing
    assert chosen("train.gradient_checkpointing=true").checkpointing_note == "set in the config"
    assert chosen("train.gradient_checkpointing=true").checkpointing
    assert not chosen("train.gradient_checkpointing=off", free=0).checkpointing
    monkeypatch.setattr(type(model), "supports_gradient_checkpointing", False)
    assert not chosen().checkpointing and "does not support" in chosen().checkpointing_note


def test_checkpointing_auto_trains_as_checkpointing_does(tiny_overrides, tmp_path, monkeypatch):
    """A run with `train.gradient_checkpointing=auto` and memory to spare trains without recomputation, records so,
    and ends with the adapter a run with checkpointing on gives (recomputation changes memory, not the gradients;
    the dropout masks are the same draws: non-reentrant checkpointing restores the random state); with no memory
    free, `auto` turns it on."""
    common = [*tiny_overrides, "device=cpu", "train.max_steps=2", "train.batch_size=2", "lora.dropout=0.1",
              "train.gradient_accumulation_steps=2", "train.eval_steps=2", "train.save_steps=10"]
    train_only(load_config(None, [*common, "name=auto", "train.gradient_checkpointing=auto"]))
    train_only(load_config(None, [*common, "name=on", "train.gradient_checkpointing=true"]))
    monkeypatch.setattr(pass_size, "free_bytes", lambda device: 0)
    train_only(load_config(None, [*common, "name=none_free", "train.gradient_checkpointing=auto"]))
    auto, on, none_free = (_run(tmp_path, n) for n in ("auto", "on", "none_free"))
    assert auto[0]["checkpointing"] is False and auto[0]["checkpointing_note"].startswith("auto: off")
    assert on[0]["checkpointing"] is True and none_free[0]["checkpointing"] is True
    assert auto[1] == pytest.approx(on[1], rel=1e-5)
    assert all(torch.allclose(auto[2][k], on[2][k], atol=1e-5) for k in on[2])
