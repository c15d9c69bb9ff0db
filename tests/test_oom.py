"""Out-of-memory recovery in training (emotune.train.recovery), with the error injected on CPU through training's fault hook:
a step that fails is redone from its first micro-batch with the same rows and random state, so the result is
the one the fitting settings give without any failure; what is changed, and when nothing is left; two processes
that must take the same decision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.model.lora import attach_lora
from emotune.pipeline import train_only
from emotune.train import checkpoints as ckpt
from emotune.train import recovery as oom
from emotune.train.batches import Example
from test_train import _env, _free_port


class TransientOOM:
    """Raises a CUDA-style out-of-memory error once: at the `on_pass`-th forward pass (1-based) of step `step`
    (0-based), as a device that was short of memory only then would."""

    def __init__(self, step: int, on_pass: int):
        self.step, self.on_pass, self.seen, self.raised = step, on_pass, 0, 0

    def __call__(self, step: int, batch: dict) -> None:
        if step != self.step or self.raised:
            return
        self.seen += 1
        if self.seen == self.on_pass:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def always_oom(step: int, batch: dict) -> None:
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:119] DefaultCPUAllocator: can't allocate memory: you tried to "
                       "allocate 4294967296 bytes (simulated)")


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def test_a_step_redone_after_an_oom_gives_the_update_of_the_settings_that_fit(tiny_overrides, tmp_path, capsys):
    """The cap `auto` sized from this machine's free memory runs each update (4 + 4 rows) as one pass; the OOM strikes
    that pass of step 1, after it has drawn dropout masks: they are discarded, the cap on a pass's tokens is lowered
    from auto's figure, and the step runs again in smaller passes. The adapter is bit-identical to a run that had that
    cap from the start (same rows, same dropout masks, no gradient counted twice)."""
    common = [*tiny_overrides, "train.max_steps=2", "train.gradient_accumulation_steps=2", "lora.dropout=0.1",
              "device=cpu", "train.save_steps=1", "train.eval_steps=2"]
    train_only(load_config(None, [*common, "name=failed"]), fault=TransientOOM(step=0, on_pass=1))
    out = capsys.readouterr().out
    run = json.loads((tmp_path / "runs" / "failed" / "run.json").read_text())
    auto = run["stages"]["train"]["passes"]
    assert auto["setting"] == "auto" and auto["passes_per_update"]["max"] == 1 and auto["free_bytes"] > 0
    assert "Step 1 ran out of memory (CUDA out of memory" in out and f"train.max_tokens_per_pass {auto['cap']} -> " in out
    [change] = run["stages"]["train"]["oom_recovery"]["changes"]
    assert run["stages"]["train"]["oom_recovery"]["policy"] == "same_update"
    assert change["step"] == 1 and change["setting"] == "train.max_tokens_per_pass" and change["from"] == auto["cap"]
    assert f"train.max_tokens_per_pass={change['to']}" in out  # the summary: what to start with next time
    progress = json.loads((tmp_path / "runs" / "failed" / "checkpoints" / "step-000001" / "progress.json").read_text())
    assert progress["memory"]["max_tokens_per_pass"] == change["to"]  # a resumed run carries on with it

    train_only(load_config(None, [*common, "name=fitting", f"train.max_tokens_per_pass={change['to']}"]))
    failed, fitting = _adapter(tmp_path / "runs" / "failed"), _adapter(tmp_path / "runs" / "fitting")
    assert failed.keys() == fitting.keys() and all(torch.equal(failed[k], fitting[k]) for k in failed)


def test_when_nothing_is_left_the_error_names_what_to_change(tiny_overrides, tmp_path, capsys):
    common = [*tiny_overrides, "device=cpu", "train.batch_size=4"]
    with pytest.raises(UserError) as stopped:
        train_only(load_config(None, [*common, "name=same"]), fault=always_oom)
    message = str(stopped.value)
    assert "step 1 (" in message and "DefaultCPUAllocator" in message
    for advice in ("train.max_length", "lora.target_modules", "train.oom_recovery=any", "No checkpoint"):
        assert advice in message, advice
    changes = json.loads((tmp_path / "runs" / "same" / "run.json").read_text())["stages"]["train"]["oom_recovery"]["changes"]
    # the cap is halved until every pass is one row, then gradient checkpointing; nothing else is allowed
    assert [c["setting"] for c in changes][-1] == "train.gradient_checkpointing"
    assert {c["setting"] for c in changes[:-1]} == {"train.max_tokens_per_pass"}
    assert "ran out of memory" in capsys.readouterr().out


def test_with_recovery_off_nothing_changes_and_the_error_says_how_to_turn_it_on():
    limits = oom.MemoryLimits(512)
    rows = [Example(list(range(30)), 28) for _ in range(4)]
    failed = oom.FailedStep(0, [[0, 1, 2, 3]], rows, 4, 1, replan=lambda limits: [[0, 1], [2, 3]])
    assert oom.next_change(limits, "none", failed, torch.nn.Linear(2, 2)) is None and limits == oom.MemoryLimits(512)
    message = str(oom.give_up(limits, "none", 0, "CUDA out of memory", 30, "No checkpoint had been written yet."))
    assert "train.oom_recovery=none, so nothing was changed" in message and "train.oom_recovery=same_update" in message
    assert "train.batch_size" in message and "train.gradient_checkpointing" in message


def test_any_shortens_rows_then_narrows_the_adapters_and_frozen_adapters_stay_saved(tiny_model_dir):
    """With the changes that keep the update exhausted, `any` cuts rows (only when at most 1% lose their loss tokens),
    then stops the adapters outside attention; they stay in the trained state that checkpoints save."""
    from transformers import AutoModelForCausalLM

    from emotune.core.config.train import LoraSettings

    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoraSettings(r=2))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    rows = [Example(list(range(40)), 36)] + [Example(list(range(12)), 10) for _ in range(99)]
    limits = oom.MemoryLimits(0, rows_per_pass=1, gradient_checkpointing=True)
    failed = oom.FailedStep(0, [[0], [1]], rows, 2, 1, replan=lambda limits: [[0], [1]])
    assert oom.next_change(limits, "same_update", failed, model) is None

    shorter = oom.next_change(limits, "any", failed, model)
    assert (shorter.setting, shorter.old, shorter.new) == ("train.max_length", 40, 20)
    assert "1 training rows cut, 1 of them left without a loss token" in shorter.meaning  # 1 of 100 rows: allowed
    cut = oom.apply(limits, model, optimizer, rows)
    assert len(cut[0].input_ids) == 20 and cut[0].completion_tokens == 0 and cut[1] is rows[1]

    narrower = oom.next_change(limits, "any", oom.FailedStep(0, [[0], [1]], cut, 2, 1, lambda limits: [[0], [1]]), model)
    assert narrower.setting == oom.ADAPTERS and narrower.new < narrower.old
    before = set(ckpt.trainable_state(model))
    oom.apply(limits, model, optimizer, rows)
    training = {name for name, p in model.named_parameters() if p.requires_grad}
    assert training and all("self_attn" in name for name in training)
    assert any("mlp" in name for name in before - training)
    assert set(ckpt.trainable_state(model)) == before  # frozen, still saved and restored
    assert oom.next_change(limits, "any", oom.FailedStep(0, [[0], [1]], cut, 2, 1, lambda limits: [[0], [1]]),
                           model) is None


TWO_PROCESS_FAULT = """
import os, sys
import torch
from emotune.core.config.load import load_config
from emotune.pipeline import train_only

seen = []
def fault(step, batch):  # rank 1 alone runs out of memory, once, in step 2
    if os.environ["RANK"] == "1" and step == 1 and not seen:
        seen.append(step)
        raise torch.OutOfMemoryError("CUDA out of memory on rank 1 (simulated)")
train_only(load_config(None, sys.argv[1:]), fault=fault)
"""


@pytest.mark.slow  # torchrun with 2 processes
def test_two_processes_take_the_same_decision_when_one_runs_out_of_memory(tiny_overrides, tmp_path, capsys):
    """Only rank 1 fails; rank 0 finishes its passes, then both learn of it, both change the same setting and redo
    the step; nobody hangs, and the adapter is the single process's with the same global batch."""
    from emotune.cli import main

    common = ["train", *tiny_overrides, "train.max_steps=3", "train.save_steps=5", "train.eval_steps=3",
              "lora.dropout=0.0", "device=cpu"]
    assert main([*common, "name=single", "train.batch_size=8"]) == 0
    script = tmp_path / "fault.py"
    script.write_text(TWO_PROCESS_FAULT)
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), str(script), *common[1:], "name=ddp", "train.batch_size=4"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert ddp.stdout.count("Step 2 ran out of memory on 1 of 2 processes (CUDA out of memory on rank 1") == 1
    runs = tmp_path / "runs"
    assert json.loads((runs / "ddp" / "run.json").read_text())["stages"]["train"]["oom_recovery"]["changes"][0]["step"] == 2
    one, two = _adapter(runs / "single"), _adapter(runs / "ddp")
    assert all(torch.allclose(one[k], two[k], atol=1e-4) for k in one)
