"""The plan of a training run: how many optimizer steps and which rows each one sees (how big a forward pass
may be: emotune.train.pass_size). Printed before the first step; the same on one process or N (emotune.train.loop
runs it).

With `train.time_budget` the number of steps is measured rather than configured: before the scheduler is
built (its schedule needs the last step), `Calibration` runs the first few steps' forward and backward
passes on the real model and rows without applying them (gradients discarded, RNG restored, so the update
is the one an unmeasured run would make), and a validation of a few rows. Seconds per padded token, times
an epoch's mean padded tokens per step, give the seconds of a typical step (the first steps' batches
alone may all be short or long ones); `steps_within` then finds the most steps whose time, with the
validations they make and the measuring itself, fits the budget. The plan is written to
`checkpoints/plan.json`, and a resumed run reads it back instead of measuring again: its schedule, and
the data order after the checkpoint, depend on that step count.

A few timed steps are not the run's pace: they meet every batch shape for the first time (oneDNN and
allocator caches are cold for each), and on two CPU cores they came out 12 % (bf16) to 37 % (fp32) slower
than the steps that followed (bench/quality.py). So the plan is made once more, early: after `REPLAN_AT` of its steps
(at least `REPLAN_MIN_STEPS`), `replan` spends what is left of the budget at the pace the real steps kept,
and the learning-rate schedule is rebuilt for the new last step (its warm-up steps unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from time import perf_counter

import torch

from emotune.core.config.train import TrainConfig, duration_seconds
from emotune.core.errors import UserError
from emotune.core.rundir import read_json, write_json
from emotune.train import checkpoints as ckpt
from emotune.train.batches import Example, Objective, completion_loss, epoch_batches, epoch_updates, update_passes

CALIBRATION_STEPS = 3
"""Steps whose passes are timed before training; the first warms up (kernel selection, allocator growth) and
is not counted."""
PLAN_FILE = "plan.json"
REPLAN_AT = 0.1
"""The share of a time-budget plan's steps after which it is made again at the real steps' pace."""
REPLAN_MIN_STEPS = 10
"""No re-plan before this many steps (fewer are too few to time), nor in a plan of no more steps."""


@dataclass(frozen=True)
class Speed:
    """Seconds measured before training (the slowest process's, since every step waits for it)."""
    per_step: float
    """One optimizer step, forward and backward of all its passes, at an epoch's mean batch length."""
    per_validation: float
    """One validation of all validation rows (0 without validation)."""
    calibration: float
    """What measuring took; it counts against the budget."""


@dataclass
class Plan:
    """Derived numbers, printed before training."""
    steps: int
    micro_per_step: int
    global_batch_rows: int
    batches_per_epoch: int
    world_size: int
    speed: Speed | None = None
    """What calibration measured, for a plan made by `train.time_budget` (after a re-plan: the real steps' pace)."""
    replanned: dict | None = None
    """After a re-plan: the step it was made at, and the steps and seconds per step it replaced."""


def make_plan(t: TrainConfig, rows: int, world_size: int) -> Plan:
    global_batch_rows = t.batch_size * world_size
    if rows < world_size:
        raise UserError(f"The training split has {rows} rows, fewer than the {world_size} processes. Add rows or "
                        "launch fewer processes.")
    batches_per_epoch = rows // global_batch_rows + (rows % global_batch_rows >= world_size)
    steps_per_epoch = max(1, batches_per_epoch // t.gradient_accumulation_steps)
    steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * steps_per_epoch)
    return Plan(steps, t.gradient_accumulation_steps, global_batch_rows, batches_per_epoch, world_size)


def best_word(objective: Objective) -> str:
    return "highest" if objective.higher_is_better else "lowest"


def announce(plan: Plan, t: TrainConfig, rows: int, val_rows: int, passes: str, objective: Objective) -> None:
    """The derived numbers, before training; `passes`: how updates are cut into forward passes
    (emotune.train.pass_size.PassSize.words)."""
    effective = plan.global_batch_rows * plan.micro_per_step
    print(f"Training rows {rows}; batch {t.batch_size} x accumulation {t.gradient_accumulation_steps} x processes "
          f"{plan.world_size} => effective batch {effective}; optimizer steps "
          + (f"{plan.steps} (≈ {epochs(plan):.2f} epochs)" if not t.time_budget else
             f"as many as fit the {t.time_budget} time budget, at most {plan.steps} "
             f"(train.num_train_epochs={t.num_train_epochs:g})")
          + f"; batches grouped by length: {t.group_by_length}; {passes}", flush=True)
    if val_rows:
        print(f"Validation on {val_rows} rows every {t.eval_steps} steps; the adapter kept is the one with the "
              f"{best_word(objective)} {objective.select}" + (f"; early stopping after {t.early_stopping_patience} validations without "
                                    "improvement" if t.early_stopping_patience else ""), flush=True)


def epochs(plan: Plan) -> float:
    """The epochs `plan`'s steps train: their micro-batches over an epoch's. A training split smaller than the batch is
    one batch of all its rows, so one micro-batch is a whole epoch (not the batch's rows over the split's)."""
    return plan.steps * plan.micro_per_step / plan.batches_per_epoch


def global_batch(plan: Plan, t: TrainConfig, rows: list[Example], seed: int, micro_index: int) -> list[int]:
    epoch, position = divmod(micro_index, plan.batches_per_epoch)
    # Recomputed per call for clarity; an epoch's plan costs microseconds next to a training step.
    return epoch_batches([len(r.input_ids) for r in rows], plan.global_batch_rows, plan.world_size, seed, epoch,
                         t.group_by_length)[position]


# --------------------------------------------------------------------------------------------------
# Training by time budget


def validations(steps: int, eval_steps: int) -> int:
    """Validations a run of `steps` steps makes: every `eval_steps` steps and after the last."""
    return steps // eval_steps + (steps % eval_steps > 0)


def expected_seconds(steps: int, speed: Speed, eval_steps: int) -> float:
    """How long a run of `steps` steps should take, measuring included."""
    return speed.calibration + steps * speed.per_step + validations(steps, eval_steps) * speed.per_validation


def steps_within(budget_s: float, speed: Speed, eval_steps: int, most: int) -> int:
    """The most steps, at most `most`, whose expected time fits `budget_s` seconds; 0 when not even one does."""
    low, high = 0, most  # the expected time grows with the steps: bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if expected_seconds(middle, speed, eval_steps) <= budget_s else (low, middle - 1)
    return low


@dataclass
class Calibration:
    """What measuring the speed runs, and how much work each part is. `run_pass(rows)`: forward and backward of
    these training rows (indices), without an update; `run_validation(rows)`: a validation of these validation
    rows; `discard()`: drop the gradients the passes left. Work is counted in padded tokens (rows x longest row
    of a pass), from the rows' token lengths; `cap` and `rank` cut updates into this process's passes as the
    training loop does."""
    run_pass: Callable[[list[int]], None]
    run_validation: Callable[[list[int]], None]
    discard: Callable[[], None]
    lengths: list[int]
    val_lengths: list[int]
    val_batch: int
    cap: int
    rank: int

    def measure(self, plan: Plan, t: TrainConfig, seed: int, clock: Callable[[], float] = perf_counter) -> Speed:
        """Time the first CALIBRATION_STEPS steps' passes (the first as a warm-up) and a validation of a spread of
        up to two batches of validation rows; scale each by its share of the work a typical step or a whole
        validation does."""
        started = clock()
        epochs: dict[int, list[list[int]]] = {}

        def epoch(number: int) -> list[list[int]]:  # as train_plan.global_batch does, from the lengths alone
            if number not in epochs:
                epochs[number] = epoch_batches(self.lengths, plan.global_batch_rows, plan.world_size, seed, number,
                                               t.group_by_length)
            return epochs[number]

        seconds, work = [], []
        for step in range(CALIBRATION_STEPS):
            micro = range(step * plan.micro_per_step, (step + 1) * plan.micro_per_step)
            passes = self._passes([epoch(k // plan.batches_per_epoch)[k % plan.batches_per_epoch] for k in micro], plan)
            begin = clock()
            for rows in passes:
                self.run_pass(rows)
            seconds.append(clock() - begin)
            work.append(sum(_padded(rows, self.lengths) for rows in passes))
        self.discard()
        timed = slice(1, None) if CALIBRATION_STEPS > 1 else slice(None)
        per_token = sum(seconds[timed]) / max(sum(work[timed]), 1)
        updates = epoch_updates(epoch(0), plan.micro_per_step)  # an update's work, per micro-batch it holds
        per_micro = (sum(_padded(rows, self.lengths) for u in updates for rows in self._passes(u, plan))
                     / sum(len(u) for u in updates))
        return Speed(per_token * per_micro * plan.micro_per_step, self._validation_seconds(clock), clock() - started)

    def _passes(self, micro_batches: list[list[int]], plan: Plan) -> list[list[int]]:
        return update_passes(micro_batches, self.lengths, plan.world_size, self.cap)[self.rank]

    def _validation_seconds(self, clock: Callable[[], float]) -> float:
        if not self.val_lengths:
            return 0.0
        count = len(self.val_lengths)
        taken = min(count, 2 * self.val_batch)
        sample = [i * count // taken for i in range(taken)]  # spread over the rows, whatever their order
        begin = clock()
        self.run_validation(sample)
        took = clock() - begin
        return took * _validation_work(range(count), self.val_lengths, self.val_batch) / max(
            _validation_work(sample, self.val_lengths, self.val_batch), 1)


def _padded(rows: list[int], lengths: list[int]) -> int:
    return len(rows) * max(lengths[i] for i in rows)


def _validation_work(rows, lengths: list[int], batch_size: int) -> int:
    """Padded tokens of a validation of `rows`: sorted by length and cut into batches, as emotune.train.loop.validate does."""
    order = sorted(rows, key=lambda i: lengths[i])
    return sum(_padded(order[s:s + batch_size], lengths) for s in range(0, len(order), batch_size))


def calibration(model: torch.nn.Module, optimizer: torch.optim.Optimizer, objective: Objective, rows: list[Example],
                val_rows: list[Example], pad_id: int, cap: int, accelerator, autocast,
                validate: Callable[[list[Example]], object], val_batch: int) -> Calibration:
    """The calibration of a real training: `model`'s passes in training mode, `validate` on validation rows."""

    def run_pass(indices: list[int]) -> None:
        model.train()
        batch = objective.collate([rows[i] for i in indices], pad_id, accelerator.device)
        with autocast:
            parts = (objective.loss or completion_loss)(model, batch)
        parts.loss_sum.backward()
        _finished(accelerator.device)

    def run_validation(indices: list[int]) -> None:
        validate([val_rows[i] for i in indices])
        _finished(accelerator.device)

    return Calibration(run_pass, run_validation,
                       lambda: optimizer.zero_grad(set_to_none=True),
                       [len(r.input_ids) - len(objective.prefix) for r in rows],  # as the loop's passes count them
                       [len(r.input_ids) for r in val_rows], val_batch, cap, accelerator.process_index)


def _finished(device: torch.device) -> None:
    """Wait for the device's queued work: GPUs run it after the call returns, and the clock must see all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def fit_budget(plan: Plan, t: TrainConfig, rows: int, seed: int, folder: Path, measure: Calibration,
               accelerator) -> Plan:
    """`plan` with as many steps as fit `t.time_budget` (its own steps, the epochs' count, stay the most): measured
    now, or read back from `folder/plan.json` when this run started before, so a resumed run keeps its plan."""
    saved = _saved_plan(folder)
    if saved is not None:
        plan = replace(plan, steps=saved["steps"], speed=Speed(**saved["speed"]), replanned=saved.get("replanned"))
        if accelerator.is_main_process:
            print(f"Time budget {t.time_budget}: the plan made when this run started is kept ({folder / PLAN_FILE}); "
                  + _plan_words(plan, t, rows), flush=True)
        return plan
    state = ckpt.rng_state()  # the passes draw dropout masks; the real steps must draw the ones they would have
    speed = _slowest(measure.measure(plan, t, seed), accelerator)
    ckpt.set_rng_state(state)
    steps = steps_within(duration_seconds(t.time_budget), speed, t.eval_steps, plan.steps)
    if steps == 0:
        least = math.ceil(expected_seconds(1, speed, t.eval_steps))
        raise UserError(f"train.time_budget={t.time_budget} is too short for one optimizer step here: measuring took "
                        f"{speed.calibration:.1f} s, a step takes about {speed.per_step:.1f} s and a validation "
                        f"{speed.per_validation:.1f} s. Give it at least {least} s (train.time_budget={least}s), or "
                        "validate fewer rows (data.validation_limit).")
    plan = replace(plan, steps=steps, speed=speed)
    if accelerator.is_main_process:
        write_json(folder / PLAN_FILE, {**describe_plan(plan, t, rows), "speed": asdict(speed)})
        print(f"Time budget {t.time_budget}: " + _plan_words(plan, t, rows), flush=True)
    return plan


def replan_step(plan: Plan) -> int:
    """The step after which a time-budget plan is made again; 0 for none (no budget, or too few steps)."""
    if plan.speed is None or plan.replanned is not None:
        return 0
    at = max(REPLAN_MIN_STEPS, math.ceil(REPLAN_AT * plan.steps))
    return at if at < plan.steps else 0


def replan(plan: Plan, t: TrainConfig, rows: int, done: int, step_seconds: float, validation_seconds: list[float],
           elapsed: float, warmup: int, folder: Path, accelerator) -> Plan:
    """`plan` with the steps that fit what is left of the budget: `done` steps took `step_seconds` (validations
    left out; `validation_seconds` lists those made), and `elapsed` seconds of the budget are gone (measuring
    included). The remaining steps run at the pace of those done, validations at the pace of those made (or as
    measured, when none was); at least one more step, at most the epochs' count. `warmup`, the schedule's warm-up
    steps, is kept with it: the rebuilt schedule (and a resumed one) keeps them. Written to plan.json."""
    per_validation = (sum(validation_seconds) / len(validation_seconds) if validation_seconds
                      else plan.speed.per_validation)
    # the slowest process's pace, and its seconds gone (in the `calibration` slot), since every step waits for it
    pace = _slowest(Speed(step_seconds / done, per_validation, elapsed), accelerator)
    left, most = duration_seconds(t.time_budget) - pace.calibration, make_plan(t, rows, plan.world_size).steps

    def more(steps: int) -> float:  # seconds from step `done` to step `steps`, with the validations between
        checks = steps // t.eval_steps - done // t.eval_steps + (steps % t.eval_steps > 0)
        return (steps - done) * pace.per_step + (checks * pace.per_validation if pace.per_validation else 0.0)

    low, high = done + 1, max(most, done + 1)  # bisect, as steps_within does
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if more(middle) <= left else (low, middle - 1)
    new = replace(plan, steps=low, speed=Speed(pace.per_step, pace.per_validation, plan.speed.calibration),
                  replanned={"at_step": done, "steps_before": plan.steps, "warmup_steps": warmup,
                             "seconds_per_step_before": round(plan.speed.per_step, 4),
                             "elapsed_seconds": round(pace.calibration, 1)})
    if accelerator.is_main_process:
        write_json(folder / PLAN_FILE, {**describe_plan(new, t, rows), "speed": asdict(new.speed)})
    return new


def replan_words(plan: Plan, t: TrainConfig, rows: int) -> str:
    r = plan.replanned
    return (f"Time budget {t.time_budget}, planned again after {r['at_step']} steps at their own pace "
            f"({plan.speed.per_step:.2f} s per step; measured before training: {r['seconds_per_step_before']:.2f}): "
            f"{r['steps_before']} -> " + _plan_words(plan, t, rows))


def _saved_plan(folder: Path) -> dict | None:
    path = folder / PLAN_FILE
    saved = read_json(path)
    if saved is not None and isinstance(saved.get("steps"), int) and isinstance(saved.get("speed"), dict):
        return saved
    if ckpt.complete_checkpoints(folder):  # missing too: a new measurement would give them another step count
        raise UserError(f"{path} is {'unreadable' if path.exists() else 'missing'}, and the checkpoints beside it were "
                        f"made with the number of steps it "
                        f"held, so the run cannot resume. Delete {folder} to start training over.")
    return None  # no step was saved yet: the plan can be made again


def _slowest(speed: Speed, accelerator) -> Speed:
    """The same speed on every process: the slowest one's, since every step waits for it."""
    if accelerator.num_processes == 1:
        return speed
    values = torch.tensor([[speed.per_step, speed.per_validation, speed.calibration]], device=accelerator.device)
    return Speed(*accelerator.gather(values).max(dim=0).values.tolist())


def describe_plan(plan: Plan, t: TrainConfig, rows: int) -> dict:
    """The plan as run.json and checkpoints/plan.json hold it: rows, steps, epochs, what ends training, and with a
    time budget the measured speeds and the expected time."""
    effective = plan.global_batch_rows * plan.micro_per_step
    most = make_plan(t, rows, plan.world_size).steps  # the epochs' (or max_steps') count
    out = {"rows": rows, "effective_batch": effective, "steps": plan.steps, "rows_trained": plan.steps * effective,
           "epochs": round(epochs(plan), 4),
           "limited_by": "max_steps" if t.max_steps > 0 else "time_budget" if plan.steps < most else "num_train_epochs"}
    if plan.speed is not None:
        out.update(time_budget=t.time_budget, budget_seconds=duration_seconds(t.time_budget),
                   seconds_per_step=round(plan.speed.per_step, 4),
                   seconds_per_validation=round(plan.speed.per_validation, 3),
                   validations=validations(plan.steps, t.eval_steps) if plan.speed.per_validation else 0,
                   calibration_seconds=round(plan.speed.calibration, 2),
                   expected_seconds=round(expected_seconds(plan.steps, plan.speed, t.eval_steps), 1))
    if plan.replanned is not None:
        out["replanned"] = plan.replanned
    return out


def _plan_words(plan: Plan, t: TrainConfig, rows: int) -> str:
    d = describe_plan(plan, t, rows)
    count = d["validations"]
    validation = (f", {count} validation{'s' if count > 1 else ''} of {d['seconds_per_validation']:.1f} s" if count
                  else "")
    ends = (f"; train.num_train_epochs={t.num_train_epochs:g} ends it before the budget"
            if d["limited_by"] == "num_train_epochs" else "")
    return (f"{d['steps']} optimizer step{'s' if d['steps'] > 1 else ''} of {d['effective_batch']} rows "
            f"({d['rows_trained']} rows, {d['epochs']:.2f} "
            f"epochs) at {d['seconds_per_step']:.2f} s per step (measured){validation}, measuring "
            f"{d['calibration_seconds']:.1f} s: expected {_duration(d['expected_seconds'])} of "
            f"{_duration(d['budget_seconds'])}{ends}.")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
