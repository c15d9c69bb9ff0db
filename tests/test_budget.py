"""Training by time budget (train.time_budget): the planner's arithmetic, the speed measurement with an injected
clock, tiny runs whose budget fits exactly two steps or whose epochs end first (with the update of an unmeasured
run), a budget too short for one step, a resumed run that keeps its plan instead of measuring again, and the
re-plan at the real steps' pace (its arithmetic, and a run whose measured speed was far too slow)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from conftest import crash_after_checkpoint
from emotune.cli import main
from emotune.core.config.train import TrainConfig
from emotune.train import checkpoints as ckpt
from emotune.train.batches import epoch_batches, update_passes
from emotune.train.passes import (
    CALIBRATION_STEPS,
    PLAN_FILE,
    Calibration,
    Speed,
    expected_seconds,
    make_plan,
    replan,
    replan_step,
    steps_within,
    validations,
)


def test_validations_are_every_eval_steps_and_after_the_last_step():
    assert [validations(steps, 5) for steps in (1, 4, 5, 6, 10, 11)] == [1, 1, 1, 2, 2, 3]


def test_the_steps_that_fit_are_the_most_whose_expected_time_is_within_the_budget():
    speed = Speed(per_step=2.0, per_validation=30.0, calibration=10.0)
    # 10 s measuring + 2 s a step + 30 s a validation (every 100 steps and after the last)
    assert expected_seconds(505, speed, 100) == 10 + 1010 + 6 * 30
    assert steps_within(1200, speed, 100, most=10_000) == 505
    assert steps_within(1200, speed, 100, most=300) == 300  # the epochs end it first
    assert steps_within(41.9, speed, 100, most=300) == 0  # 10 + 2 + 30: not even one step
    assert steps_within(42, speed, 100, most=300) == 1
    for budget in range(0, 700, 7):  # bisection agrees with counting up
        fits = [n for n in range(0, 301) if expected_seconds(n, speed, 100) <= budget]
        assert steps_within(budget, speed, 100, most=300) == max(fits, default=0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _padded(rows: list[int], lengths: list[int]) -> int:
    return len(rows) * max(lengths[i] for i in rows)


def test_the_measured_step_is_the_timed_steps_per_token_cost_at_an_epochs_mean_length():
    """Passes cost 2 ms per padded token (the first also a 100 s warm-up), validation 1 ms per padded token: the
    measured step is the cost of an epoch's mean step, not of the first steps' batches, and the measured
    validation the cost of all validation rows."""
    lengths = [8 + (i * 7) % 50 for i in range(40)]
    val_lengths = [5 + (i * 3) % 20 for i in range(30)]
    clock, passes, discarded = FakeClock(), [], []

    def run_pass(rows):
        passes.append(rows)
        clock.now += (100.0 if len(passes) == 1 else 0.0) + 0.002 * _padded(rows, lengths)

    def run_validation(rows):
        order = sorted(rows, key=lambda i: val_lengths[i])
        clock.now += 0.001 * sum(_padded(order[s:s + 4], val_lengths) for s in range(0, len(order), 4))

    t = TrainConfig(batch_size=8, gradient_accumulation_steps=2, max_tokens_per_pass=64, time_budget="10m")
    plan = make_plan(t, len(lengths), 1)
    measure = Calibration(run_pass, run_validation, lambda: discarded.append(True), lengths, val_lengths,
                          val_batch=4, cap=64, rank=0)
    speed = measure.measure(plan, t, seed=3, clock=clock)

    epoch = epoch_batches(lengths, 8, 1, 3, 0, True)
    updates = [epoch[0:2], epoch[2:4]]  # the epoch's whole updates of 2 micro-batches, each cut into passes as a whole
    mean_update = sum(_padded(p, lengths) for u in updates for p in update_passes(u, lengths, 1, 64)[0]) / len(updates)
    assert speed.per_step == pytest.approx(0.002 * mean_update)
    by_length = sorted(range(30), key=lambda i: val_lengths[i])
    assert speed.per_validation == pytest.approx(0.001 * sum(_padded(by_length[s:s + 4], val_lengths)
                                                             for s in range(0, 30, 4)))
    assert speed.calibration == pytest.approx(clock.now)
    following = epoch + epoch_batches(lengths, 8, 1, 3, 1, True)  # 5 batches an epoch: the 6th is the next epoch's first
    first_steps = [p for k in range(CALIBRATION_STEPS) for p in update_passes(following[2 * k:2 * k + 2], lengths, 1, 64)[0]]
    assert passes == first_steps and discarded == [True]


def _measured_as(speed: Speed, calls: list):
    def measure(self, plan, t, seed):
        calls.append(plan.steps)
        return speed
    return measure


def test_a_budget_run_trains_the_steps_that_fit_and_records_its_plan(tiny_overrides, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(Calibration, "measure", _measured_as(Speed(per_step=10.0, per_validation=5.0, calibration=3.0),
                                                            calls))
    # a validation after every step: 2 steps take 3 + 2 x (10 + 5) = 33 s, 3 steps 48 s
    assert main(["train", *tiny_overrides, "train.max_steps=-1", "train.time_budget=35s",
                 "train.num_train_epochs=3", "train.save_steps=100"]) == 0
    out = capsys.readouterr().out
    assert "optimizer steps as many as fit the 35s time budget, at most 27 (train.num_train_epochs=3)" in out
    assert ("Time budget 35s: 2 optimizer steps of 4 rows (8 rows, 0.22 epochs) at 10.00 s per step (measured), "
            "2 validations of 5.0 s, measuring 3.0 s: expected 33 s of 35 s.") in out
    assert calls == [27]
    run_dir = tmp_path / "runs" / "tiny"
    assert max(e["step"] for e in json.loads((run_dir / "train" / "log_history.json").read_text())) == 2
    plan = json.loads((run_dir / "checkpoints" / PLAN_FILE).read_text())
    assert plan == {"rows": 36, "effective_batch": 4, "steps": 2, "rows_trained": 8, "epochs": 0.2222,
                    "limited_by": "time_budget", "time_budget": "35s", "budget_seconds": 35.0,
                    "seconds_per_step": 10.0, "seconds_per_validation": 5.0, "validations": 2,
                    "calibration_seconds": 3.0, "expected_seconds": 33.0,
                    "speed": {"per_step": 10.0, "per_validation": 5.0, "calibration": 3.0}}
    run_json = json.loads((run_dir / "run.json").read_text())
    assert run_json["stages"]["train"]["plan"] == {k: v for k, v in plan.items() if k != "speed"}


def test_measuring_leaves_the_update_of_an_unmeasured_run(tiny_overrides, tmp_path, capsys):
    """The real measurement (passes with dropout, a validation) before a run that its epochs end (9 batches an epoch,
    0.2 epochs = 2 steps): the adapter is the one a 2-step run without a budget trains."""
    common = ["train", *tiny_overrides, "lora.dropout=0.1", "seed=5", "train.num_train_epochs=0.2", "device=cpu",
              "train.eval_steps=100", "train.save_steps=100"]
    assert main(common + ["name=steps", "train.max_steps=2"]) == 0
    assert main(common + ["name=budget", "train.max_steps=-1", "train.time_budget=1h"]) == 0
    assert "train.num_train_epochs=0.2 ends it before the budget" in capsys.readouterr().out
    runs = tmp_path / "runs"
    plan = json.loads((runs / "budget" / "checkpoints" / PLAN_FILE).read_text())
    assert plan["steps"] == 2 and plan["limited_by"] == "num_train_epochs"
    assert plan["seconds_per_step"] > 0 and plan["seconds_per_validation"] > 0 and plan["calibration_seconds"] > 0
    unmeasured = load_file(runs / "steps" / "adapter" / "adapter_model.safetensors")
    measured = load_file(runs / "budget" / "adapter" / "adapter_model.safetensors")
    assert unmeasured.keys() == measured.keys()
    assert all(torch.equal(unmeasured[k], measured[k]) for k in unmeasured)


def test_a_budget_too_short_for_one_step_says_how_long_one_takes(tiny_overrides, monkeypatch, capsys):
    monkeypatch.setattr(Calibration, "measure", _measured_as(Speed(per_step=10.0, per_validation=5.0, calibration=3.0),
                                                            []))
    assert main(["train", *tiny_overrides, "train.max_steps=-1", "train.time_budget=15s"]) == 2
    err = capsys.readouterr().err
    assert "train.time_budget=15s is too short for one optimizer step" in err
    assert "at least 18 s (train.time_budget=18s)" in err


def test_a_resumed_run_keeps_its_plan(tiny_overrides, tmp_path, monkeypatch, capsys):
    """Interrupted after the step-2 checkpoint of a 4-step plan, then resumed on a machine that measures 10x faster:
    the run keeps its 4 steps (its schedule and data order depend on them) and does not measure again."""
    calls = []
    common = ["train", *tiny_overrides, "train.max_steps=-1", "train.time_budget=40s", "train.num_train_epochs=3",
              "train.eval_steps=100"]
    monkeypatch.setattr(Calibration, "measure", _measured_as(Speed(10.0, 0.0, 0.0), calls))
    write = ckpt.write_checkpoint
    crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="step-2 checkpoint"):
        main(common)
    assert calls == [27]
    run_dir = tmp_path / "runs" / "tiny"
    saved = (run_dir / "checkpoints" / PLAN_FILE).read_text()
    assert json.loads(saved)["steps"] == 4

    monkeypatch.setattr(ckpt, "write_checkpoint", write)
    monkeypatch.setattr(Calibration, "measure", _measured_as(Speed(1.0, 0.0, 0.0), calls))
    capsys.readouterr()
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "the plan made when this run started is kept" in out and "4 optimizer steps of 4 rows" in out
    assert "(step 2)" in out  # resumed from the checkpoint
    assert calls == [27]  # not measured again
    assert (run_dir / "checkpoints" / PLAN_FILE).read_text() == saved
    assert max(e["step"] for e in json.loads((run_dir / "train" / "log_history.json").read_text())) == 4
    assert json.loads((run_dir / "run.json").read_text())["stages"]["train"]["plan"]["steps"] == 4


class OneProcess:
    num_processes, is_main_process = 1, True


def test_the_replan_spends_what_is_left_of_the_budget_at_the_steps_own_pace(tmp_path):
    t = TrainConfig(batch_size=4, gradient_accumulation_steps=1, time_budget="300s", eval_steps=50, num_train_epochs=100)
    plan = replace(make_plan(t, 400, 1), steps=100, speed=Speed(per_step=2.0, per_validation=10.0, calibration=5.0))
    assert replan_step(plan) == 10 and replan_step(replace(plan, steps=10)) == 0  # no re-plan at the last step
    assert replan_step(replace(plan, steps=400)) == 40 and replan_step(replace(plan, speed=None)) == 0

    # 10 steps took 10 s (1 s each, half the measured 2 s) and 15 s of the 300 s are gone: the rest, 285 s, holds
    # steps 11..245 with validations at 50, 100, 150, 200 and after 245 (5 x 10 s): 235 + 50 = 285
    faster = replan(plan, t, 400, done=10, step_seconds=10.0, validation_seconds=[], elapsed=15.0, warmup=5,
                    folder=tmp_path, accelerator=OneProcess())
    assert faster.steps == 245
    assert faster.speed == Speed(per_step=1.0, per_validation=10.0, calibration=5.0)
    assert faster.replanned == {"at_step": 10, "steps_before": 100, "warmup_steps": 5, "seconds_per_step_before": 2.0,
                                "elapsed_seconds": 15.0}
    saved = json.loads((tmp_path / PLAN_FILE).read_text())
    assert saved["steps"] == 245 and saved["replanned"] == faster.replanned and saved["speed"]["per_step"] == 1.0

    # slower than measured (4 s a step, one validation of 20 s already made): fewer steps than planned
    slower = replan(plan, t, 400, done=10, step_seconds=40.0, validation_seconds=[20.0], elapsed=65.0, warmup=5,
                    folder=tmp_path, accelerator=OneProcess())
    # 235 s left: (N - 10) x 4 + (N // 50 + (N % 50 > 0)) x 20 <= 235 holds for N = 58 (192 + 40), not 59 (196 + 40)
    assert slower.steps == 58 and slower.speed.per_validation == 20.0
    # the budget is already spent: one more step, so the run ends with its last validation
    assert replan(plan, t, 400, 10, 40.0, [], 400.0, 5, tmp_path, OneProcess()).steps == 11
    # the epochs' count stays the most: 400 rows / 4 = 100 steps an epoch, 1 epoch here
    one_epoch = t.model_copy(update={"num_train_epochs": 1})
    assert replan(plan, one_epoch, 400, 10, 1.0, [], 6.0, 5, tmp_path, OneProcess()).steps == 100


def test_a_run_measured_too_slow_is_planned_again_and_its_schedule_ends_at_its_new_last_step(
        tiny_overrides, tmp_path, monkeypatch, capsys):
    """Measured at 1 s a step, a 20 s budget plans 20 steps; the real steps take milliseconds, so after 10 the plan is
    made again and takes every step the epochs allow (27); the linear schedule reaches 0 at step 27, not 20."""
    monkeypatch.setattr(Calibration, "measure", _measured_as(Speed(per_step=1.0, per_validation=0.0, calibration=0.0),
                                                            []))
    assert main(["train", *tiny_overrides, "train.max_steps=-1", "train.time_budget=20s", "train.num_train_epochs=3",
                 "train.eval_steps=100", "train.save_steps=100", "train.warmup_ratio=0.1"]) == 0
    out = capsys.readouterr().out
    assert "Time budget 20s: 20 optimizer steps" in out
    assert "Time budget 20s, planned again after 10 steps at their own pace" in out
    assert "; measured before training: 1.00): 20 -> 27 optimizer steps" in out
    assert "train.num_train_epochs=3 ends it before the budget" in out
    run_dir = tmp_path / "runs" / "tiny"
    plan = json.loads((run_dir / "checkpoints" / PLAN_FILE).read_text())
    assert plan["steps"] == 27 and plan["limited_by"] == "num_train_epochs"
    assert plan["replanned"] == {"at_step": 10, "steps_before": 20, "warmup_steps": 2, "seconds_per_step_before": 1.0,
                                 "elapsed_seconds": plan["replanned"]["elapsed_seconds"]}
    assert 0 < plan["seconds_per_step"] < 1.0
    assert json.loads((run_dir / "run.json").read_text())["stages"]["train"]["plan"] == {
        k: v for k, v in plan.items() if k != "speed"}
    history = [e for e in json.loads((run_dir / "train" / "log_history.json").read_text()) if "loss" in e]
    assert [e["step"] for e in history] == list(range(1, 28))
    rates = {e["step"]: e["learning_rate"] for e in history}
    assert rates[1] == pytest.approx(0.005) and rates[2] == pytest.approx(0.01)  # the 2 warm-up steps, kept
    # linear decay from 0.01 at step 2 to 0 at step 27: before the re-plan towards step 20, after it towards 27
    assert rates[10] == pytest.approx(0.01 * (20 - 10) / (20 - 2))
    assert rates[11] == pytest.approx(0.01 * (27 - 11) / (27 - 2)) and rates[27] == 0.0
