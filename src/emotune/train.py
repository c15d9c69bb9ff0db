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

import json
import math
import resource
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from emotune import checkpoints as ckpt
from emotune.artifacts import write_adapter
from emotune.batches import Example, collate, completion_loss, epoch_batches, forward_passes
from emotune.config import RunConfig, TrainConfig
from emotune.device import Precision
from emotune.errors import UserError
from emotune.lora import attach_lora
from emotune.rundir import RunDir, atomic_file, remove_partial_writes, write_json

FSDP1_REFUSED = ("accelerate launch asks for FSDP version 1; emotune trains with FSDP2 only. Pass --fsdp_version 2 "
                 "(or fsdp_version: 2 in the accelerate config), or set train.fsdp=true and launch with torchrun.")


@dataclass
class Plan:
    """Derived numbers, printed before training."""
    steps: int
    micro_per_step: int
    global_batch_rows: int
    batches_per_epoch: int
    world_size: int


@dataclass
class Progress:
    """Everything about the run so far that is not a tensor; saved in every checkpoint."""
    step: int = 0
    best_loss: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    log_history: list[dict] = field(default_factory=list)


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train_rows: list[Example], val_rows: list[Example],
          cfg: RunConfig, precision: Precision, run: RunDir, adapter_meta: dict) -> PreTrainedModel:
    """Fine-tune `model` with LoRA on the task's encoded rows (each carries its loss positions), save the adapter
    with `adapter_meta` into the run folder, and return the adapted model (in memory).

    The task encodes the rows before this is called, so a row problem surfaces before any optimizer state exists."""
    t = cfg.train
    accelerator, fsdp = _accelerator(t, model, run.train)
    main = accelerator.is_main_process
    plan = _plan(t, len(train_rows), accelerator.num_processes)
    cap = _pass_token_cap(t, accelerator.device)
    _announce(plan, t, len(train_rows), len(val_rows), cap)

    model.config.use_cache = False
    if fsdp:
        _refuse_tied_modules_to_save(model, cfg.lora.modules_to_save)
    adapted = attach_lora(model, cfg.lora)
    if t.gradient_checkpointing:
        adapted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    upcast = _fsdp_dtypes(fsdp, adapted) if fsdp else {}
    autocast, scaler = _mixed_precision(precision, adapted)
    optimizer = _optimizer(t, [p for p in adapted.parameters() if p.requires_grad])
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(t.warmup_ratio * plan.steps),
                              num_training_steps=plan.steps)
    wrapped, trainable = _prepare(accelerator, adapted, optimizer, fsdp)

    folder = run.checkpoints
    progress, best = _resume(folder, adapted, optimizer, scheduler, scaler, accelerator)
    log_path = run.train / "log_history.jsonl"
    if main:
        log_path.parent.mkdir(parents=True, exist_ok=True)  # rewritten from the checkpoint: no replayed lines twice
        log_path.write_text("".join(json.dumps(e) + "\n" for e in progress.log_history))
        if t.report_to:
            accelerator.init_trackers("emotune", config=_flat(cfg.model_dump(mode="json")))

    def log(entry: dict) -> None:
        progress.log_history.append(entry)
        if main:
            with log_path.open("a") as handle:
                handle.write(json.dumps(entry) + "\n")
        if t.report_to:
            accelerator.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    pad_id = tokenizer.pad_token_id
    lengths = [len(r.input_ids) for r in train_rows]
    bar = tqdm(total=plan.steps, initial=progress.step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
    window = _Window()
    wrapped.train()
    while progress.step < plan.steps:
        globals_ = [_global_batch(plan, t, train_rows, cfg.seed, k)
                    for k in range(progress.step * plan.micro_per_step, (progress.step + 1) * plan.micro_per_step)]
        mine = [collate([train_rows[i] for i in rows], pad_id, accelerator.device) for b in globals_
                for rows in forward_passes(b, lengths, plan.world_size, cap)[accelerator.process_index]]
        step_tokens = sum(train_rows[i].completion_tokens for b in globals_ for i in b)
        loss, grad_norm, finite = _optimizer_step(wrapped, optimizer, scaler, mine, step_tokens, accelerator, autocast,
                                                  trainable, t.max_grad_norm)
        scheduler.step()  # also on a skipped step: the schedule follows the data position
        progress.step += 1
        window.add(loss if finite else None, sum(len(train_rows[i].input_ids) for b in globals_ for i in b))
        _guard(progress, finite, loss, grad_norm, t, precision, folder)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{window.tokens_per_s():.0f}", peak_mb=f"{peak_memory_mb():.0f}")

        if progress.step % t.logging_steps == 0 or progress.step == plan.steps:
            log(window.entry(progress, plan, scheduler.get_last_lr()[0], grad_norm))
            window = _Window()
        stop = False
        if val_rows and (progress.step % t.eval_steps == 0 or progress.step == plan.steps):
            metrics = validate(wrapped, val_rows, _val_batch_size(cfg), pad_id, accelerator, autocast)
            log({"step": progress.step, **metrics})
            best, stop = _track_best(progress, metrics["eval_loss"], adapted, best, t.early_stopping_patience)
            if main:
                bar.write(f"step {progress.step}: validation loss {metrics['eval_loss']:.4f}, token accuracy "
                          f"{metrics['eval_token_accuracy']:.3f} (best {progress.best_loss:.4f} at step {progress.best_step})")
            wrapped.train()
        # No checkpoint inside a run of non-finite steps: the last one written stays the last good one.
        if progress.step % t.save_steps == 0 and progress.step < plan.steps and not stop and not progress.nonfinite_in_a_row:
            _save(folder, progress, adapted, optimizer, scheduler, scaler, best, accelerator, t.save_total_limit)
        if stop:
            print(f"Early stopping at step {progress.step}: no lower validation loss in "
                  f"{t.early_stopping_patience} validations.", flush=True)
            break
    bar.close()

    if best is not None:
        ckpt.load_trainable_state(adapted, best)
        if main:
            print(f"Adapter: step {progress.best_step}, the lowest validation loss ({progress.best_loss:.4f}).", flush=True)
    adapted.config.use_cache = True  # training turned the KV cache off; generation wants it back
    if t.gradient_checkpointing:
        adapted.gradient_checkpointing_disable()
    adapted.eval()
    # Sharded weights are gathered on every process, then written by the main one like a single process's.
    weights = {k: v.to(upcast.get(k, v.dtype)) for k, v in ckpt.trainable_state(adapted).items()} if fsdp else None
    if main:
        write_adapter(adapted, tokenizer, run.adapter, adapter_meta, state_dict=weights)
        _write_history(progress, run.train)
    if t.report_to:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return adapted


# --------------------------------------------------------------------------------------------------
# Setup


def _accelerator(t: TrainConfig, model: PreTrainedModel, tracker_dir: Path
                 ) -> tuple[Accelerator, FullyShardedDataParallelPlugin | None]:
    """The accelerator, and the FSDP2 settings when training sharded (None: one process, or DDP)."""
    for tracker in t.report_to:
        if not _tracker_installed(tracker):
            raise UserError(f"train.report_to lists `{tracker}`, which is not installed. Install it "
                            f"(pip install {tracker}) or remove it from train.report_to.")
    cpu = model.device.type == "cpu"
    plugin = _fsdp_plugin(t, cpu)
    # Mixed precision is handled in this module (autocast only where needed, see _mixed_precision), so
    # Accelerate keeps its default; it would otherwise refuse a second training in the same process.
    accelerator = Accelerator(cpu=cpu, log_with=list(t.report_to) or None, project_dir=str(tracker_dir),
                              fsdp_plugin=plugin)
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise UserError(FSDP1_REFUSED)
    return accelerator, accelerator.state.fsdp_plugin if accelerator.is_fsdp2 else plugin


def _fsdp_plugin(t: TrainConfig, cpu: bool) -> FullyShardedDataParallelPlugin | None:
    """FSDP2 settings from `train.fsdp`, else from `accelerate launch --use_fsdp` (its FSDP_* environment)."""
    launcher = parse_flag_from_env("ACCELERATE_USE_FSDP")
    if not (t.fsdp or launcher):
        return None
    processes = PartialState(cpu=cpu).num_processes
    if processes == 1:  # under `accelerate launch` Accelerate decides (FSDP on one GPU, e.g. to offload to CPU)
        if not launcher:
            print("train.fsdp=true on a single process: nothing to shard across, so training runs as a plain "
                  "single-process run.", flush=True)
        return None
    if t.fsdp:  # each decoder layer (the model's `_no_split_modules`) is one unit, re-gathered for backward
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    else:
        plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise UserError(FSDP1_REFUSED)
    if PartialState().is_main_process:
        print(f"FSDP2 over {processes} processes ({'train.fsdp' if t.fsdp else 'accelerate launch config'}): "
              f"wrap policy {getattr(plugin.auto_wrap_policy, '__name__', plugin.auto_wrap_policy)}, reshard after "
              f"forward {plugin.reshard_after_forward}, CPU offload {type(plugin.cpu_offload).__name__ == 'CPUOffloadPolicy'}",
              flush=True)
    return plugin


def _refuse_tied_modules_to_save(model: PreTrainedModel, modules_to_save: list[str] | None) -> None:
    """A `modules_to_save` copy of an embedding tied to the output layer leaves the tied weight in two
    FSDP units, which torch refuses at the first forward; say so before any weight is sharded."""
    embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is None or embeddings.weight is not output.weight:
        return
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is embeddings or module is output}
    clash = [name for name in modules_to_save or [] if name.rsplit(".", 1)[-1] in names]
    if clash:
        raise UserError(f"lora.modules_to_save={clash} copies an embedding that {type(model).__name__} ties to its output "
                        "layer, and FSDP2 cannot shard a tied weight split across units. Leave it out of "
                        "lora.modules_to_save, or train without FSDP (drop train.fsdp / --use_fsdp).")


def _fsdp_dtypes(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> dict[str, torch.dtype]:
    """FSDP2 needs one dtype across the trainable parameters of a shard unit. LoRA adapters are fp32
    over a bf16 base (PEFT upcasts them), which is fine: frozen weights may differ. A `modules_to_save`
    copy keeps the base dtype, though; then the trainable weights are upcast to fp32 and computed in
    the base dtype (the usual FSDP mixed-precision recipe, as Accelerate's own). Returns the original
    dtypes of the upcast weights, which the saved adapter keeps, as a single process's would."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if len({p.dtype for p in trainable.values()}) == 1:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    upcast = {name: p.dtype for name, p in trainable.items() if p.dtype != torch.float32}
    for name in upcast:
        trainable[name].data = trainable[name].data.float()
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=next(iter(upcast.values())),
                                                         reduce_dtype=torch.float32)
    return upcast


def _prepare(accelerator: Accelerator, model, optimizer, fsdp: FullyShardedDataParallelPlugin | None
             ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """(the model to call, its trainable parameters). DDP wraps the model when launched on several
    processes; FSDP2 shards model and optimizer together, in place, replacing every parameter with a
    DTensor, so the trainable ones are listed again afterwards."""
    if fsdp is None:
        wrapped = accelerator.prepare_model(model)
    else:
        if accelerator.distributed_type != DistributedType.FSDP:
            # Accelerate switches to FSDP only on GPU-like process groups (accelerate/state.py) and would
            # run DDP on CPUs, where PyTorch's fully_shard works too (gloo). So FSDP is switched on for this
            # call only: Accelerate later rebuilds its state from the (multi-CPU) process group's, so the
            # code after it asks the model whether it is sharded (ckpt.is_sharded), not Accelerate.
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = fsdp
        wrapped, _ = accelerator.prepare(model, optimizer)
    return wrapped, [p for p in wrapped.parameters() if p.requires_grad]


def _tracker_installed(name: str) -> bool:
    from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

    return {"tensorboard": is_tensorboard_available, "mlflow": is_mlflow_available, "wandb": is_wandb_available}[name]()


def _plan(t: TrainConfig, rows: int, world_size: int) -> Plan:
    global_batch_rows = t.batch_size * world_size
    if rows < world_size:
        raise UserError(f"The training split has {rows} rows, fewer than the {world_size} processes. Add rows or "
                        "launch fewer processes.")
    batches_per_epoch = rows // global_batch_rows + (rows % global_batch_rows >= world_size)
    steps_per_epoch = max(1, batches_per_epoch // t.gradient_accumulation_steps)
    steps = t.max_steps if t.max_steps > 0 else math.ceil(t.num_train_epochs * steps_per_epoch)
    return Plan(steps, t.gradient_accumulation_steps, global_batch_rows, batches_per_epoch, world_size)


def _announce(plan: Plan, t: TrainConfig, rows: int, val_rows: int, cap: int) -> None:
    effective = plan.global_batch_rows * plan.micro_per_step
    print(f"Training rows {rows}; batch {t.batch_size} x accumulation {t.gradient_accumulation_steps} x processes "
          f"{plan.world_size} => effective batch {effective}; optimizer steps {plan.steps} "
          f"(≈ {plan.steps * effective / rows:.2f} epochs); batches grouped by length: {t.group_by_length}; "
          + (f"forward passes of at most {cap} padded tokens" if cap else "one forward pass per batch"), flush=True)
    if val_rows:
        print(f"Validation on {val_rows} rows every {t.eval_steps} steps; the adapter kept is the one with the lowest "
              f"validation loss" + (f"; early stopping after {t.early_stopping_patience} validations without "
                                    "improvement" if t.early_stopping_patience else ""), flush=True)


def _mixed_precision(precision: Precision, model: torch.nn.Module):
    """(autocast context, grad scaler). Weights already stored in the training dtype need no autocast:
    Gemma's norms and softmax upcast to fp32 themselves, PEFT keeps the adapters in fp32 and casts at
    their boundary, and autocast on a CPU would re-cast every weight on every forward. fp16 always
    gets a scaler, because its gradients underflow without one."""
    if precision.name == "fp32":
        return nullcontext(), None
    device = next(model.parameters()).device.type
    frozen = next(p for p in model.parameters() if not p.requires_grad)
    autocast = nullcontext() if frozen.dtype == precision.dtype else torch.autocast(device, dtype=precision.dtype)
    scaler = torch.amp.GradScaler(device) if precision.name == "fp16" else None
    return autocast, scaler


def _optimizer(t: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if t.optim == "sgd":
        return torch.optim.SGD(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    if t.optim == "adafactor":
        return torch.optim.Adafactor(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay, fused=t.optim == "adamw_torch_fused")


def _resume(folder: Path, model, optimizer, scheduler, scaler, accelerator: Accelerator):
    if accelerator.is_main_process:
        remove_partial_writes(folder)
    accelerator.wait_for_everyone()
    found = ckpt.complete_checkpoints(folder)
    if not found:
        return Progress(), None
    state, best = ckpt.read_checkpoint(found[-1], model, optimizer, scheduler, scaler, accelerator.process_index)
    print(f"Resuming from {found[-1]} (step {state['step']})", flush=True)
    return Progress(**state), best


# --------------------------------------------------------------------------------------------------
# One step, validation, guards


def _pass_token_cap(t: TrainConfig, device: torch.device) -> int:
    if t.max_tokens_per_pass != "auto":
        return t.max_tokens_per_pass
    # On CPU, glibc's heap keeps what large passes free, fragmented by the next pass's smaller
    # allocations: its footprint follows the size of a pass (bench/train_memory.py). GPU allocators cache.
    return 512 if device.type == "cpu" else 0


def _global_batch(plan: Plan, t: TrainConfig, rows: list[Example], seed: int, micro_index: int) -> list[int]:
    epoch, position = divmod(micro_index, plan.batches_per_epoch)
    # Recomputed per call for clarity; an epoch's plan costs microseconds next to a training step.
    return epoch_batches([len(r.input_ids) for r in rows], plan.global_batch_rows, plan.world_size, seed, epoch,
                         t.group_by_length)[position]


def _optimizer_step(model, optimizer, scaler, batches: list[dict], step_tokens: int, accelerator: Accelerator,
                    autocast, trainable: list[torch.nn.Parameter], max_grad_norm: float) -> tuple[float, float, bool]:
    """Forward/backward over this process's passes (of all its micro-batches), then one optimizer step unless the loss or
    gradient is not finite. Returns (loss per completion token over all processes, gradient norm, stepped)."""
    loss_sum = torch.zeros((), device=accelerator.device)
    # DDP and FSDP average gradients over processes, so each one scales its share up by the process count.
    scale = accelerator.num_processes / max(step_tokens, 1)
    # FSDP2 reduce-scatters after every micro-batch, so each process keeps only its shard of the gradient.
    accumulate_unsynced = not ckpt.is_sharded(model)
    for i, batch in enumerate(batches):
        sync = accelerator.no_sync(model) if accumulate_unsynced and i < len(batches) - 1 else nullcontext()
        with sync:
            with autocast:
                parts = completion_loss(model, batch)
            loss = parts.loss_sum * scale
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += parts.loss_sum.detach().float()
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = _clip_gradients(trainable, max_grad_norm)
    loss = float(accelerator.reduce(loss_sum, reduction="sum")) / max(step_tokens, 1)
    # Under fp16 a non-finite gradient is the scaler's business (it skips the step and lowers the scale).
    finite = math.isfinite(loss) and (scaler is not None or math.isfinite(grad_norm))
    if finite and scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, finite


def _clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    # Under FSDP2 the norm is a replicated DTensor: the same float on every process.
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


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
    last = ckpt.complete_checkpoints(folder)
    kept = f"The last good checkpoint, {last[-1]}, is intact; re-running resumes from it." if last else \
        "No checkpoint had been written yet."
    cause = ("fp16 overflow: Gemma's activations exceed the fp16 range (a known Gemma issue). Set train.precision=bf16 "
             "where supported, else fp32." if precision.name == "fp16" else
             f"a learning rate too high for this model (train.learning_rate={t.learning_rate}). Lower it, e.g. 10x, "
             "or set train.max_grad_norm=1.0 if clipping is off.")
    raise UserError(f"Training stopped at step {progress.step}: the loss or gradient was NaN/inf for "
                    f"{progress.nonfinite_in_a_row} steps in a row (train.max_nonfinite_steps). Likely cause: {cause} "
                    f"{kept}")


def _val_batch_size(cfg: RunConfig) -> int:
    """Validation-loss batch: the evaluation batch, or the training batch when that is `auto`."""
    return cfg.train.batch_size if cfg.eval.batch_size == "auto" else cfg.eval.batch_size


@torch.no_grad()
def validate(model, rows: list[Example], batch_size: int, pad_id: int, accelerator: Accelerator, autocast) -> dict:
    """Completion-only loss and token accuracy on the validation rows, shared across processes."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    totals = torch.zeros(3, device=accelerator.device, dtype=torch.float64)  # loss sum, tokens, correct
    mine = batches[accelerator.process_index::accelerator.num_processes]
    rounds = len(mine)
    if ckpt.is_sharded(model):  # every forward gathers shards from all processes: all must run as many
        inner, rounds = model, math.ceil(len(batches) / accelerator.num_processes)
    else:
        inner = accelerator.unwrap_model(model)  # no gradient, so no DDP hooks needed
    for k in range(rounds):
        batch = mine[k] if k < len(mine) else batches[-1]  # a process short of batches repeats one, unused
        with autocast:
            parts = completion_loss(inner, collate([rows[i] for i in batch], pad_id, accelerator.device))
        if k < len(mine):
            totals += torch.stack([parts.loss_sum.double(), torch.tensor(parts.tokens, dtype=torch.float64,
                                                                         device=totals.device), parts.correct.double()])
    loss_sum, tokens, correct = accelerator.reduce(totals, reduction="sum").tolist()
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_token_accuracy": correct / max(tokens, 1)}


def _track_best(progress: Progress, eval_loss: float, model, best, patience: int):
    """Keep a copy of the best weights (small: the adapters only); say whether to stop early."""
    if progress.best_loss is None or eval_loss < progress.best_loss:
        progress.best_loss, progress.best_step, progress.evals_without_improvement = eval_loss, progress.step, 0
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
        ckpt.write_checkpoint(folder, progress.step, weights, optimizer_state, scheduler, scaler, rng_states,
                              asdict(progress), keep, best)
    accelerator.wait_for_everyone()


# --------------------------------------------------------------------------------------------------
# Visibility


class _Window:
    """Loss, tokens and time since the last log line."""

    def __init__(self):
        self.started, self.losses, self.tokens = time.perf_counter(), [], 0

    def add(self, loss: float | None, tokens: int) -> None:
        if loss is not None:
            self.losses.append(loss)
        self.tokens += tokens

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def entry(self, progress: Progress, plan: Plan, lr: float, grad_norm: float) -> dict:
        return {"step": progress.step, "epoch": round(progress.step * plan.micro_per_step / plan.batches_per_epoch, 4),
                "loss": sum(self.losses) / len(self.losses) if self.losses else math.nan, "learning_rate": lr,
                "grad_norm": grad_norm, "tokens_per_s": round(self.tokens_per_s(), 1),
                "peak_memory_mb": round(peak_memory_mb(), 1), "skipped_steps": progress.nonfinite_total}


def peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _write_history(progress: Progress, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "log_history.json", progress.log_history)
    plot_losses(progress.log_history, folder / "loss_curve.png")


def plot_losses(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "training"), ("eval_loss", "validation")):
        points = [(e["step"], e[key]) for e in history if key in e]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
    ax.set(xlabel="optimizer step", ylabel="loss per completion token", title="emotune training")
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as partial:
        fig.savefig(partial, format="png")
    plt.close(fig)


def _flat(tree: dict, prefix: str = "") -> dict:
    """Trackers want flat scalar hyperparameters (TensorBoard's hparams do)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
