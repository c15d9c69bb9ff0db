"""The training stage: LoRA on the language model, loss on the completion only, in our own short loop.

Why not TRL's SFTTrainer (the reference recipe, kept in bench/train_speed.py): its completion-only
loss projects every position onto the vocabulary and masks afterwards, and what this stage needs
besides — skipping a non-finite step, checkpoints written atomically, a data order that resumes
exactly and is identical on 1 or N processes — are not Trainer hooks. So the loop is ours, readable
top to bottom (setup → resume → steps → best adapter → outputs); PEFT builds the adapters,
Accelerate does the multi-process work (DDP under `torchrun` / `accelerate launch`, or FSDP2 with
`train.fsdp=true` / `accelerate launch --use_fsdp --fsdp_version 2`) and the trackers.

Loss normalisation: the summed cross-entropy of one optimizer step is divided by the number of
completion tokens in the whole global step (all micro-batches, all processes), so one process with
batch B x N and N processes with batch B compute the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from emotune.core.config.run import RunConfig
from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, remove_partial_writes
from emotune.model import finetuning, init_methods, lean_lora, lean_norm, quantization
from emotune.model.artifacts import write_adapter, write_full_model
from emotune.model.lora import attach_lora, checkpoint_activations
from emotune.runtime.device import Precision, mixed_precision
from emotune.runtime.oom import free_memory, is_out_of_memory
from emotune.runtime.parallel import any_process, average_gradients, fsdp_dtypes, make_accelerator, prepare, refuse_tied_modules_to_save
from emotune.train import checkpoints as ckpt
from emotune.train import compiling, pass_size
from emotune.train import recovery as oom
from emotune.train.batches import LANGUAGE_MODEL, Example, LossParts, Objective, completion_loss
from emotune.train.log import TrainLog, Window, peak_memory_mb, write_history
from emotune.train.optim import build_optimizer, clip_gradients, schedule_after
from emotune.train.passes import (
    Plan,
    announce,
    best_word,
    calibration,
    describe_plan,
    fit_budget,
    global_batch,
    make_plan,
    replan,
    replan_step,
    replan_words,
)


@dataclass
class Progress:
    """Everything about the run so far that is not a tensor; saved in every checkpoint."""
    step: int = 0
    best_loss: float | None = None
    """The best value of the objective's selection metric so far (the validation loss unless the task picks another)."""
    best_step: int | None = None
    evals_without_improvement: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    log_history: list[dict] = field(default_factory=list)
    window: dict | None = None
    """The losses and gradient norms of the steps since the last log line (emotune.train.log.Window.carried), so the
    first line of a resumed run averages the steps it began with before the checkpoint, as an uninterrupted run's does."""
    memory: dict | None = None
    """Out-of-memory recovery's limits (emotune.train.recovery.MemoryLimits), kept so a resumed run carries on with what fitted."""


@dataclass
class Session:
    """What one training holds between steps besides `Progress`: the model in its three guises, the optimizer
    side, precision handling and the process layout."""
    accelerator: Accelerator
    fsdp: FullyShardedDataParallelPlugin | None
    plan: Plan
    cap: int  # padded tokens per forward pass (0: one pass per micro-batch)
    adapted: PreTrainedModel  # the PEFT model, or the model itself for full / freeze fine-tuning (what is saved)
    wrapped: torch.nn.Module  # what is called (DDP / FSDP wrapper, or `adapted` itself)
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler | None
    autocast: object
    upcast: dict[str, torch.dtype]  # FSDP, full / freeze: trainable weights upcast to fp32, saved in their own dtype
    objective: Objective  # the task's loss and the rule that picks the kept adapter
    warmup: int = 0  # the schedule's warm-up steps
    initial: Path | None = None  # PiSSA/OLoRA/LoftQ: the starting adapter, for the conversion when saving
    passes: pass_size.PassSize | None = None  # how `cap` was chosen, for run.json


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train_rows: list[Example], val_rows: list[Example],
          cfg: RunConfig, precision: Precision, run: RunDir, adapter_meta: dict,
          objective: Objective = LANGUAGE_MODEL, record: Callable[[str, object], None] | None = None,
          fault: Callable[[int, dict], None] | None = None) -> PreTrainedModel:
    """Fine-tune `model` on the task's encoded rows (each carries its loss positions): LoRA adapters, or its own weights
    (`train.finetuning` full / freeze, emotune.model.finetuning); save the adapter (or the whole model) with
    `adapter_meta` into the run folder, and return the trained model (in memory). `objective` (the task's)
    says what the loss is and which validation metric picks the adapter kept. `record(key, value)` puts what
    run.json should say about training under its train stage (the plan; the changes out-of-memory recovery made).
    `fault(step, batch)` is called before every training forward pass: tests raise an out-of-memory error from it
    where a device would.

    The task encodes the rows before this is called, so a row problem surfaces before any optimizer state exists."""
    s = _setup(model, cfg, precision, train_rows, val_rows, tokenizer.pad_token_id, run, objective, record)
    if record is not None:
        record("plan", describe_plan(s.plan, cfg.train, len(train_rows)))
        record("passes", s.passes.as_record())
        # which layers run emotune's lean forwards; the rest (a norm of unknown arithmetic, DoRA, ...) run their own
        record("lean", {"lora": lean_lora.describe(s.adapted), "norm": lean_norm.describe(s.adapted)})
    progress, best = _resume(run.checkpoints, s.adapted, s.optimizer, s.scheduler, s.scaler, s.accelerator)
    recovery = _recovery(s, progress, train_rows, cfg.train, record, fault)
    log = TrainLog(run.train / "log_history.jsonl", progress.log_history, s.accelerator, cfg.train.report_to,
                   cfg.model_dump(mode="json"))
    def replanned(plan: Plan) -> None:
        if record is not None:
            record("plan", describe_plan(plan, cfg.train, len(train_rows)))

    best = _loop(s, progress, best, log, recovery, val_rows, tokenizer.pad_token_id, cfg, precision, run.checkpoints,
                 replanned)
    _finish(s, progress, best, tokenizer, run, adapter_meta, cfg.train)
    log.close()
    s.accelerator.wait_for_everyone()
    return s.adapted


def _setup(model: PreTrainedModel, cfg: RunConfig, precision: Precision, rows: list[Example], val_rows: list[Example],
           pad_id: int, run: RunDir, objective: Objective, record=None) -> Session:
    """Processes, LoRA adapters, precision, optimizer, the steps and their schedule: everything before the first step."""
    t = cfg.train
    accelerator, fsdp = make_accelerator(t, model, run.train)
    plan = make_plan(t, len(rows), accelerator.num_processes)

    model.config.use_cache = False
    whole = t.finetuning in finetuning.WHOLE  # the model's own weights train: no adapters, no PEFT wrapper
    initial, upcast = None, {}
    if whole:  # upcast: {name: own dtype} of the weights kept in fp32 while training, for saving them as they were
        adapted, upcast = model, finetuning.prepare(model, t, objective.modules_to_save)
    else:
        adapted, initial = _attach_adapters(model, cfg, objective, fsdp, run, accelerator.is_main_process)
    if t.lean_norm and not fsdp:
        lean_norm.install(adapted)
    if fsdp and t.gradient_checkpointing:  # before sharding, as Accelerate's FSDP expects (`auto` is on under FSDP)
        checkpoint_activations(adapted)
    upcast = fsdp_dtypes(fsdp, adapted) if fsdp else upcast
    autocast, scaler = mixed_precision(precision, adapted, always=whole)
    optimizer = build_optimizer(t, adapted)
    wrapped, trainable = prepare(accelerator, adapted, optimizer, fsdp)
    # the passes' size and checkpointing once the model, its adapters and the optimizer are in place (`auto`: from
    # the free memory); both change only how the layers run, so they are installed after the wrapping
    passes = pass_size.choose(cfg, model, rows, len(objective.prefix), plan, accelerator, fsdp is not None)
    if passes.checkpointing and not fsdp:
        checkpoint_activations(adapted)  # the frozen layers below the trained ones stay out of the backward pass
    compiling.install(adapted, t, accelerator.device, record)  # train.compile: after the lean forwards it traces
    announce(plan, t, len(rows), len(val_rows), passes.words(), objective)
    cap = passes.cap
    if t.time_budget:  # the steps that fit, measured on the prepared model before the schedule needs them
        measure = calibration(wrapped, optimizer, objective, rows, val_rows, pad_id, cap, accelerator, autocast,
                              lambda some: validate(wrapped, some, _val_batch_size(cfg), pad_id, accelerator, autocast,
                                                    objective), _val_batch_size(cfg))
        plan = fit_budget(plan, t, len(rows), cfg.seed, run.checkpoints, measure, accelerator)
    # steps win over the ratio, as in transformers; a re-planned run keeps the warm-up it started with
    warmup = (plan.replanned["warmup_steps"] if plan.replanned else t.warmup_steps or math.ceil(t.warmup_ratio * plan.steps))
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=plan.steps)
    return Session(accelerator, fsdp, plan, cap, adapted, wrapped, trainable, optimizer, scheduler, scaler, autocast, upcast,
                   objective, warmup, initial, passes)


def _attach_adapters(model: PreTrainedModel, cfg: RunConfig, objective: Objective, fsdp, run: RunDir, main: bool):
    """LoRA: the quantized base prepared, the adapters attached (and, for PiSSA/OLoRA/LoftQ, the starting adapter
    saved for the conversion at the end), their lean forward installed; returns (PEFT model, starting adapter)."""
    if quantization.is_quantized(model):  # before the adapters, which then stay fp32 beside the quantized weights
        print(quantization.describe_preparation(quantization.prepare_for_training(model)), flush=True)
    if fsdp:
        refuse_tied_modules_to_save(model, cfg.lora.modules_to_save)
    adapted = attach_lora(model, cfg.lora, objective.lora_task_type, objective.modules_to_save)
    initial = None
    quantized = quantization.is_quantized(model)
    if cfg.lora.init in init_methods.CONVERTED:
        print(init_methods.describe(cfg.lora, quantized), flush=True)
    if init_methods.converted(cfg.lora, quantized):  # before any step changes the adapters
        initial = init_methods.save_initial(adapted, run.train / "initial_adapter") if main else None
    if cfg.train.lean_lora and not fsdp:  # FSDP's sharded parameters stay with PEFT's own forward
        lean_lora.install(adapted)
    return adapted, initial


def _recovery(s: Session, progress: Progress, train_rows: list[Example], t: TrainConfig, record, fault) -> oom.Recovery:
    """Out-of-memory recovery with the forward-pass limits from the config, or with those a resumed run had reached."""
    limits = (oom.MemoryLimits(**progress.memory) if progress.memory else
              oom.MemoryLimits(s.cap, gradient_checkpointing=bool(s.passes.checkpointing)))
    if limits.changes and s.accelerator.is_main_process:
        print(f"Resuming with the {len(limits.changes)} change(s) out-of-memory recovery made: "
              + "; ".join(f"{c['setting']} {c['from']} -> {c['to']}" for c in limits.changes), flush=True)
        if record is not None:
            record("oom_recovery", {"policy": t.oom_recovery, "changes": limits.changes})
    if record is not None and limits.max_tokens_per_pass != s.cap:  # resumed: the passes of the checkpoint's cap
        record("passes", {**s.passes.as_record(), "resumed_with_cap": limits.max_tokens_per_pass})
    progress.memory = limits.as_dict()
    return oom.Recovery(limits, train_rows, s.adapted, s.optimizer, t, s.plan.world_size,
                        s.accelerator.is_main_process, record, fault, shared_tokens=len(s.objective.prefix))


def _loop(s: Session, progress: Progress, best, log: TrainLog, recovery: oom.Recovery, val_rows: list[Example],
          pad_id: int, cfg: RunConfig, precision: Precision, folder: Path, replanned: Callable[[Plan], None]):
    """Optimizer steps until the plan's last (or early stopping); returns the best weights seen (None without
    validation). Validation, logging and checkpoints follow their step counts. A time-budget plan is made again
    once, early, at the pace the steps keep (emotune.train.passes.replan); a resumed run keeps the plan it had."""
    t, plan, main = cfg.train, s.plan, s.accelerator.is_main_process
    bar = tqdm(total=plan.steps, initial=progress.step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
    window = Window.resumed(progress.window)
    s.wrapped.train()
    replan_at = replan_step(plan) if progress.step == 0 else 0
    started, validation_seconds = perf_counter(), []
    while progress.step < plan.steps:
        globals_ = [global_batch(plan, t, recovery.encoded, cfg.seed, k)
                    for k in range(progress.step * plan.micro_per_step, (progress.step + 1) * plan.micro_per_step)]
        loss, grad_norm, finite = recovery.step(
            progress.step, globals_, lambda passes, rows: _optimizer_step(s, passes, rows, pad_id, t,
                                                                          progress.step, recovery.fault),
            lambda: _checkpoint_note(folder))
        progress.memory = recovery.limits.as_dict()
        s.scheduler.step()  # also on a skipped step: the schedule follows the data position
        progress.step += 1
        window.add(loss if finite else None, sum(len(recovery.rows[i].input_ids) for b in globals_ for i in b), grad_norm)
        _guard(progress, finite, loss, grad_norm, t, precision, folder)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{window.tokens_per_s():.0f}", peak_mb=f"{peak_memory_mb():.0f}")

        if progress.step % t.logging_steps == 0 or progress.step == plan.steps:
            log(window.entry(progress, plan, s.scheduler.get_last_lr()[0], grad_norm))
            window = Window()
        stop = False
        if val_rows and (progress.step % t.eval_steps == 0 or progress.step == plan.steps):
            began = perf_counter()
            best, stop = _validate_and_track(s, progress, best, log, val_rows, pad_id, cfg, bar)
            validation_seconds.append(perf_counter() - began)
        # No checkpoint inside a run of non-finite steps: the last one written stays the last good one.
        if progress.step % t.save_steps == 0 and progress.step < plan.steps and not stop and not progress.nonfinite_in_a_row:
            progress.window = window.carried()
            _save(folder, progress, s.adapted, s.optimizer, s.scheduler, s.scaler, best, s.accelerator, t.save_total_limit)
        if stop:  # the steps since the last log line, as the last step of a run that goes on to the end logs them
            if progress.step % t.logging_steps and progress.step != plan.steps:
                log(window.entry(progress, plan, s.scheduler.get_last_lr()[0], grad_norm))
            print(f"Early stopping at step {progress.step}: no better {s.objective.select} in "
                  f"{t.early_stopping_patience} validations.", flush=True)
            break
        if progress.step == replan_at:
            took = perf_counter() - started
            plan = s.plan = replan(plan, t, len(recovery.rows), progress.step, took - sum(validation_seconds),
                                   validation_seconds, plan.speed.calibration + took, s.warmup, folder, s.accelerator)
            s.scheduler = schedule_after(s.optimizer, t, s.warmup, plan.steps, progress.step)
            bar.total = plan.steps
            bar.refresh()
            if main:
                bar.write(replan_words(plan, t, len(recovery.rows)))
            replanned(plan)
    bar.close()
    return best


def _validate_and_track(s: Session, progress: Progress, best, log: TrainLog, val_rows: list[Example], pad_id: int,
                        cfg: RunConfig, bar) -> tuple[object, bool]:
    metrics = validate(s.wrapped, val_rows, _val_batch_size(cfg), pad_id, s.accelerator, s.autocast, s.objective)
    log({"step": progress.step, **metrics})
    best, stop = _track_best(progress, metrics, s.adapted, best, cfg.train.early_stopping_patience, s.objective)
    if s.accelerator.is_main_process:
        extra = "".join(f", {k.removeprefix('eval_')} {v:.3f}" for k, v in metrics.items()
                        if k not in ("eval_loss", "eval_token_accuracy"))
        bar.write(f"step {progress.step}: validation loss {metrics['eval_loss']:.4f}, token accuracy "
                  f"{metrics['eval_token_accuracy']:.3f}{extra} (best {s.objective.select} {progress.best_loss:.4f} at "
                  f"step {progress.best_step})")
    s.wrapped.train()
    return best, stop


def _finish(s: Session, progress: Progress, best, tokenizer: PreTrainedTokenizerBase, run: RunDir, adapter_meta: dict,
            t: TrainConfig) -> None:
    """Back to the best weights, inference settings, then the adapter and the loss history on disk."""
    main = s.accelerator.is_main_process
    adapted = s.adapted
    if best is not None:
        ckpt.load_trainable_state(adapted, best)
        if main:
            print(f"Adapter: step {progress.best_step}, the {best_word(s.objective)} {s.objective.select} "
                  f"({progress.best_loss:.4f}).", flush=True)
    adapted.config.use_cache = True  # training turned the KV cache off; generation wants it back
    lean_lora.restore(adapted)
    lean_norm.restore(adapted)
    compiling.restore(adapted)
    if (s.passes is not None and s.passes.checkpointing) or progress.memory["gradient_checkpointing"]:
        adapted.gradient_checkpointing_disable()
    if progress.memory["changes"] and main:
        print(oom.summary(oom.MemoryLimits(**progress.memory), t.batch_size, t.gradient_accumulation_steps), flush=True)
    adapted.eval()
    if t.finetuning in finetuning.WHOLE:  # the weights as loaded: the fine-tuned stage measures what is saved
        finetuning.restore_dtypes(adapted, s.upcast)
        if main:  # the log first: the saved model marks training done, so a re-run would never write it
            write_history(progress.log_history, run.train)
            write_full_model(adapted, tokenizer, run.model, {**adapter_meta, "finetuning": finetuning.describe(t)})
        return
    # Sharded weights are gathered on every process, then written by the main one like a single process's.
    weights = ({k: v.to(s.upcast.get(k, v.dtype)) for k, v in ckpt.trainable_state(adapted).items()}
               if s.fsdp else None)
    if main:
        write_history(progress.log_history, run.train)
        write_adapter(adapted, tokenizer, run.adapter, adapter_meta, state_dict=weights, convert_from=s.initial)


# --------------------------------------------------------------------------------------------------
# Precision, optimizer, resume


def _resume(folder: Path, model, optimizer, scheduler, scaler, accelerator: Accelerator):
    """Continue from the newest checkpoint that reads back whole; say which one, and why any newer one is not."""
    if accelerator.is_main_process:
        remove_partial_writes(folder)
        for path, aside, problem in ckpt.set_aside_unreadable(folder):
            print(f"Checkpoint {path.name} cannot be resumed from: {problem}. Kept it as {aside.name}; "
                  "trying the one before.", flush=True)
    accelerator.wait_for_everyone()
    found = ckpt.complete_checkpoints(folder)
    if not found:
        if folder.is_dir() and any(folder.glob("*" + ckpt.SET_ASIDE)):
            print("No intact checkpoint is left: training starts again from step 0.", flush=True)
        return Progress(), None
    state, best = ckpt.read_checkpoint(found[-1], model, optimizer, scheduler, scaler, accelerator.process_index)
    print(f"Resuming from {found[-1]} (step {state['step']}), the newest intact checkpoint", flush=True)
    return Progress(**state), best


# --------------------------------------------------------------------------------------------------
# One step, validation, guards


def _optimizer_step(s: Session, passes: list[list[list[int]]], rows: list[Example], pad_id: int, t: TrainConfig,
                    step: int, fault: Callable[[int, dict], None] | None = None
                    ) -> tuple[float, float, bool] | oom.OutOfMemory:
    """Forward/backward over this process's passes (of all its micro-batches), then one optimizer step unless the loss or
    gradient is not finite. `passes` are every process's ([process][pass] -> row indices); the loss of the step is
    divided by its completion tokens, those of all of them. Returns (loss per completion token, gradient norm,
    stepped), or, when any process ran out of memory, what each one said (the step's gradients freed everywhere)."""
    accelerator, model = s.accelerator, s.wrapped
    step_tokens = sum(rows[i].completion_tokens for share in passes for p in share for i in p)
    loss_sum = torch.zeros((), device=accelerator.device)
    # DDP and FSDP average gradients over processes, so each one scales its share up by the process count.
    scale = accelerator.num_processes / max(step_tokens, 1)
    # FSDP2 reduce-scatters after every pass (each process keeps only its shard of the gradient); DDP's stay local
    # until every process has finished, so that an out-of-memory error can be agreed on first (emotune.train.recovery).
    sharded = ckpt.is_sharded(model)
    failure = None
    try:
        for indices in passes[accelerator.process_index]:
            batch = s.objective.collate([rows[i] for i in indices], pad_id, accelerator.device)
            if fault is not None:
                fault(step, batch)
            with nullcontext() if sharded else accelerator.no_sync(model):
                with s.autocast:
                    parts = _loss(s.objective, model, batch)
                loss = parts.loss_sum * scale
                (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
            loss_sum += parts.loss_sum.detach().float()
    except Exception as err:  # noqa: BLE001 (only out-of-memory errors are kept; the rest re-raised)
        if not is_out_of_memory(err):
            raise
        if sharded:
            raise oom.sharded_failure(step, oom.describe(err)) from None
        failure = oom.describe(err)  # a string: the error's frames, and the activations they hold, go with it
    batch = parts = loss = None
    if any_process(failure is not None, accelerator):
        free_memory(s.optimizer)
        from accelerate.utils import gather_object

        return oom.OutOfMemory(gather_object([failure]) if accelerator.num_processes > 1 else [failure])
    if not sharded:  # FSDP2 reduce-scattered them already
        average_gradients(s.trainable, accelerator)
    if s.scaler is not None:
        s.scaler.unscale_(s.optimizer)
    grad_norm = clip_gradients(s.trainable, t.max_grad_norm, t.foreach == "auto")
    loss = float(accelerator.reduce(loss_sum, reduction="sum")) / max(step_tokens, 1)
    # Under fp16 a non-finite gradient is the scaler's business (it skips the step and lowers the scale).
    finite = math.isfinite(loss) and (s.scaler is not None or math.isfinite(grad_norm))
    try:
        if finite and s.scaler is not None:
            s.scaler.step(s.optimizer)
            s.scaler.update()
        elif finite:
            s.optimizer.step()
    except Exception as err:  # noqa: BLE001
        if is_out_of_memory(err):
            raise oom.optimizer_failure(step, oom.describe(err)) from None
        raise
    s.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, finite


def _guard(progress: Progress, finite: bool, loss: float, grad_norm: float, t: TrainConfig, precision: Precision,
           folder: Path) -> None:
    if finite:
        progress.nonfinite_in_a_row = 0
        return
    progress.nonfinite_in_a_row += 1
    progress.nonfinite_total += 1
    print(f"Step {progress.step}: loss {loss} / gradient norm {grad_norm} is not finite; step skipped "
          f"({progress.nonfinite_in_a_row} in a row).", flush=True)
    if progress.nonfinite_in_a_row < t.max_nonfinite_steps:
        return
    cause = ("fp16 overflow: Gemma's activations exceed the fp16 range (a known Gemma issue). Set train.precision=bf16 "
             "where supported, else fp32." if precision.name == "fp16" else
             f"a learning rate too high for this model (train.learning_rate={t.learning_rate}). Lower it, e.g. 10x, "
             "or set train.max_grad_norm=1.0 if clipping is off.")
    raise UserError(f"Training stopped at step {progress.step}: the loss or gradient was NaN/inf for "
                    f"{progress.nonfinite_in_a_row} steps in a row (train.max_nonfinite_steps). Likely cause: {cause} "
                    f"{_checkpoint_note(folder)}")


def _checkpoint_note(folder: Path) -> str:
    last = ckpt.complete_checkpoints(folder)
    return (f"The last checkpoint, {last[-1]}, is intact; re-running the same config resumes from it (a changed setting "
            "is a new config: pass overwrite=true with it to start over)." if last else "No checkpoint had been written yet.")


def _val_batch_size(cfg: RunConfig) -> int:
    """Validation-loss batch: the evaluation batch, or the training batch when that is `auto`."""
    return cfg.train.batch_size if cfg.eval.batch_size == "auto" else cfg.eval.batch_size


def _loss(objective: Objective, model, batch: dict) -> LossParts:
    # completion_loss is looked up here, at call time, so tests can substitute it
    return (objective.loss or completion_loss)(model, batch)


@torch.no_grad()
def validate(model, rows: list[Example], batch_size: int, pad_id: int, accelerator: Accelerator, autocast,
             objective: Objective = LANGUAGE_MODEL) -> dict:
    """The objective's loss and token accuracy on the validation rows (plus its row metrics), shared across processes."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    totals = torch.zeros(3, device=accelerator.device, dtype=torch.float64)  # loss sum, tokens, correct
    classes: list[torch.Tensor] = []  # a classification head's [predicted; gold] per batch
    mine = batches[accelerator.process_index::accelerator.num_processes]
    rounds = len(mine)
    if ckpt.is_sharded(model):  # every forward gathers shards from all processes: all must run as many
        inner, rounds = model, math.ceil(len(batches) / accelerator.num_processes)
    else:
        inner = accelerator.unwrap_model(model)  # no gradient, so no DDP hooks needed
    for k in range(rounds):
        batch = mine[k] if k < len(mine) else batches[-1]  # a process short of batches repeats one, unused
        with autocast:
            parts = _loss(objective, inner, objective.collate([rows[i] for i in batch], pad_id, accelerator.device))
        if k < len(mine):
            totals += torch.stack([parts.loss_sum.double(), torch.tensor(parts.tokens, dtype=torch.float64,
                                                                         device=totals.device), parts.correct.double()])
            if parts.predicted is not None:
                classes.append(torch.stack([parts.predicted, parts.gold]).cpu())
    loss_sum, tokens, correct = accelerator.reduce(totals, reduction="sum").tolist()
    metrics = {"eval_loss": loss_sum / max(tokens, 1), "eval_token_accuracy": correct / max(tokens, 1)}
    if objective.row_metrics is not None:
        from accelerate.utils import gather_object

        shares = gather_object([torch.cat(classes, 1) if classes else None])  # one [2, rows] per process
        pairs = torch.cat([share for share in shares if share is not None], 1)
        metrics.update(objective.row_metrics(pairs[0], pairs[1]))
    return metrics


def _track_best(progress: Progress, metrics: dict, model, best, patience: int, objective: Objective = LANGUAGE_MODEL):
    """Keep a copy of the best weights by the objective's metric (small: the adapters only); say whether to stop early."""
    value = metrics[objective.select]
    if objective.better(value, progress.best_loss):
        progress.best_loss, progress.best_step, progress.evals_without_improvement = value, progress.step, 0
        return ckpt.trainable_state(model), False
    progress.evals_without_improvement += 1
    return best, bool(patience) and progress.evals_without_improvement >= patience


def _save(folder: Path, progress: Progress, model, optimizer, scheduler, scaler, best, accelerator: Accelerator,
          keep: int) -> None:
    from accelerate.utils import gather_object

    rng_states = gather_object([ckpt.rng_state()])  # every process's dropout stream, written by the main one
    # Sharded: a collective every process joins; otherwise only the writer needs the copies.
    gather = accelerator.is_main_process or ckpt.is_sharded(model)
    weights, optimizer_state = (ckpt.trainable_state(model), ckpt.optimizer_state(model, optimizer)) if gather else (None, None)
    if accelerator.is_main_process:
        state = ckpt.TrainingState(weights, optimizer_state, scheduler, scaler, rng_states, asdict(progress), best)
        ckpt.write_checkpoint(folder, progress.step, state, keep)
    accelerator.wait_for_everyone()
