"""The plan of a training run: how many optimizer steps, which rows each one sees, and how big a forward
pass may be. Printed before the first step; the same on one process or N (emotune.train runs it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from emotune.batches import Example, Objective, epoch_batches
from emotune.config import TrainConfig
from emotune.errors import UserError


@dataclass
class Plan:
    """Derived numbers, printed before training."""
    steps: int
    micro_per_step: int
    global_batch_rows: int
    batches_per_epoch: int
    world_size: int


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


def announce(plan: Plan, t: TrainConfig, rows: int, val_rows: int, cap: int, objective: Objective) -> None:
    effective = plan.global_batch_rows * plan.micro_per_step
    print(f"Training rows {rows}; batch {t.batch_size} x accumulation {t.gradient_accumulation_steps} x processes "
          f"{plan.world_size} => effective batch {effective}; optimizer steps {plan.steps} "
          f"(≈ {plan.steps * effective / rows:.2f} epochs); batches grouped by length: {t.group_by_length}; "
          + (f"forward passes of at most {cap} padded tokens" if cap else "one forward pass per batch"), flush=True)
    if val_rows:
        print(f"Validation on {val_rows} rows every {t.eval_steps} steps; the adapter kept is the one with the "
              f"{best_word(objective)} {objective.select}" + (f"; early stopping after {t.early_stopping_patience} validations without "
                                    "improvement" if t.early_stopping_patience else ""), flush=True)


def pass_token_cap(t: TrainConfig, device: torch.device) -> int:
    if t.max_tokens_per_pass != "auto":
        return t.max_tokens_per_pass
    # On CPU, glibc's heap keeps what large passes free, fragmented by the next pass's smaller
    # allocations: its footprint follows the size of a pass (bench/train_memory.py). GPU allocators cache.
    return 512 if device.type == "cpu" else 0


def global_batch(plan: Plan, t: TrainConfig, rows: list[Example], seed: int, micro_index: int) -> list[int]:
    epoch, position = divmod(micro_index, plan.batches_per_epoch)
    # Recomputed per call for clarity; an epoch's plan costs microseconds next to a training step.
    return epoch_batches([len(r.input_ids) for r in rows], plan.global_batch_rows, plan.world_size, seed, epoch,
                         t.group_by_length)[position]
