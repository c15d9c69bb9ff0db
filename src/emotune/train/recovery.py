"""Out-of-memory recovery in training: what to change when a step does not fit, and in which order.

A step that runs out of memory is thrown away (its partial gradients freed, the random state put back)
and done again from its first micro-batch with the same rows, after one change from the list below; a
step that still does not fit takes the next change, and so on. A later, longer step that does not fit
continues down the same list. The order follows what a change costs:

1. `train.max_tokens_per_pass` lowered, when the run caps its forward passes (below the widest pass that
   failed, so that pass is split; the cap `auto` sized from the free memory is lowered like a configured one);
2. otherwise smaller forward passes: each micro-batch cut in half, as `train.batch_size` halved with
   `train.gradient_accumulation_steps` doubled, though the rows of every optimizer step stay the same;
3. `train.gradient_checkpointing` on.

These three leave every update as it would have been (the same per-row gradients summed; with dropout, the
same in distribution), and are all that `train.oom_recovery=same_update`, the default, allows. With
`train.oom_recovery=any`, what the reference recipe's memory advice changes next, which changes what is trained:

4. `train.max_length` shorter: rows cut to half the longest row of the failed step, as long as at most 1%
   of the training rows lose every loss token (long outliers go, the data stays);
5. LoRA on the attention projections only: the other adapters stop training, kept as trained so far.

Several processes must take the same decision, or one would wait forever in a collective that the others
never join. Under DDP no gradient is exchanged until every process has finished its passes: each one then
says whether it ran out of memory (one all-reduce of a flag, emotune.runtime.parallel.any_process), and only then
are the gradients averaged, or the step thrown away on every process alike, each making the same change
from the same inputs. FSDP gathers weights inside every pass, where no such agreement is possible: there an
out-of-memory error stops the run with advice, and the launcher (torchrun, accelerate launch) stops the
other processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError, first_line
from emotune.model.lora import checkpoint_activations
from emotune.train import checkpoints as ckpt
from emotune.train.batches import Example, truncated, update_passes

MAX_ROWS_LOST = 0.01  # the share of training rows a shorter max_length may leave without any loss token
ATTENTION = re.compile(r"attn|attention")  # module paths of attention projections (self_attn, c_attn, attention)
ROWS, ADAPTERS = "rows per forward pass", "LoRA adapters training"  # the settings without a config key of their own


@dataclass(frozen=True)
class OutOfMemory:
    """A step that ran out of memory on at least one process: each process's error message (None: it did not)."""
    messages: list[str | None]

    @property
    def first(self) -> str:
        return next(m for m in self.messages if m is not None)


@dataclass
class MemoryLimits:
    """How big a forward pass may be and what trains, as configured and as recovery changed it. Saved with every
    checkpoint (in the progress), so a resumed run carries on with the settings that fitted."""
    max_tokens_per_pass: int
    """Padded tokens per forward pass; 0 = no cap."""
    rows_per_pass: int = 0
    """Rows per forward pass; 0 = a whole micro-batch."""
    gradient_checkpointing: bool = False
    max_length: int | None = None
    """Training rows cut to this many tokens; None = as encoded."""
    attention_only: bool = False
    """LoRA adapters outside the attention projections no longer train."""
    changes: list[dict] = field(default_factory=list)
    """Every change made: the step, the setting, its old and new value, and what it means."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FailedStep:
    """What the step that did not fit was made of; the same on every process."""
    step: int
    passes: list[list[int]]
    """Every process's forward passes, as row indices."""
    rows: list[Example]
    """The training rows as trained now (indices above point into them)."""
    batch_size: int
    accumulation: int
    replan: Callable[[MemoryLimits], list[list[int]]]
    """The step's passes (as `passes`) under other limits: a smaller pass size that splits nothing here (passes
    are evened out across processes) is no change."""


@dataclass(frozen=True)
class Change:
    setting: str
    old: object
    new: object
    meaning: str

    def as_dict(self, step: int) -> dict:
        return {"step": step, "setting": self.setting, "from": self.old, "to": self.new, "meaning": self.meaning}


def next_change(limits: MemoryLimits, policy: str, failed: FailedStep, model: torch.nn.Module) -> Change | None:
    """The first change of the list (module docstring) that `policy` allows and that changes something for
    this step; it is applied to `limits` (the caller applies it to the model and rows). None: nothing is left."""
    same_update = [_lower_token_cap, _smaller_passes, _gradient_checkpointing]
    rungs = {"none": [], "same_update": same_update, "any": [*same_update, _shorter_rows, _attention_only]}[policy]
    for rung in rungs:
        change = rung(limits, failed, model)
        if change is not None:
            limits.changes.append(change.as_dict(failed.step + 1))
            return change
    return None


class Recovery:
    """Out-of-memory recovery during one training: the limits forward passes keep to, the training rows as trained
    under them, and the step that is redone until it fits."""

    def __init__(self, limits: MemoryLimits, encoded: list[Example], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, t: TrainConfig, world_size: int, main: bool,
                 record: Callable[[str, object], None] | None, fault: Callable[[int, dict], None] | None,
                 shared_tokens: int = 0):
        self.limits, self.encoded, self.model, self.optimizer, self.t = limits, encoded, model, optimizer, t
        self.world_size, self.main, self.record, self.fault = world_size, main, record, fault
        self.shared_tokens = shared_tokens  # a shared prefix's: run once per pass, not counted per row
        self.rows = apply(limits, model, optimizer, encoded)  # the data order follows `encoded`, the passes these

    def passes(self, globals_: list[list[int]], limits: MemoryLimits | None = None) -> list[list[list[int]]]:
        """[process][pass] -> rows: a step's micro-batches cut into forward passes under `limits`
        (emotune.train.batches.update_passes: with a token cap, the update's rows together)."""
        limits = limits or self.limits
        lengths = {i: len(self.rows[i].input_ids) - self.shared_tokens for b in globals_ for i in b}
        return update_passes(globals_, lengths, self.world_size, limits.max_tokens_per_pass, limits.rows_per_pass)

    def step(self, step: int, globals_: list[list[int]], attempt: Callable, checkpoint_note: Callable[[], str]):
        """`attempt(passes, rows)` (one optimizer step) until it does not run out of memory; after each failure the next
        change, and the same step again with the same rows and random state. Returns what `attempt` returned."""
        random_state = ckpt.rng_state()  # dropout masks: the redone step draws the ones the failed attempt drew
        while True:
            passes = self.passes(globals_)
            outcome = attempt(passes, self.rows)
            if not isinstance(outcome, OutOfMemory):
                return outcome
            ckpt.set_rng_state(random_state)
            failed = FailedStep(step, [p for share in passes for p in share], self.rows, self.t.batch_size,
                                self.t.gradient_accumulation_steps,
                                lambda limits: [p for share in self.passes(globals_, limits) for p in share])
            change = next_change(self.limits, self.t.oom_recovery, failed, self.model)
            if change is None:
                longest = max(len(self.rows[i].input_ids) for b in globals_ for i in b)
                raise give_up(self.limits, self.t.oom_recovery, step, outcome.first, longest, checkpoint_note())
            self.rows = apply(self.limits, self.model, self.optimizer, self.encoded)
            if self.main:
                print(announce(change, step, outcome.messages), flush=True)
                if self.record is not None:
                    self.record("oom_recovery", {"policy": self.t.oom_recovery, "changes": self.limits.changes})


def _padded(rows: list[Example], indices: list[int]) -> int:
    return len(indices) * max(len(rows[i].input_ids) for i in indices)


def _lower_token_cap(limits: MemoryLimits, failed: FailedStep, model) -> Change | None:
    if not limits.max_tokens_per_pass:
        return None
    cap = min(limits.max_tokens_per_pass, max(_padded(failed.rows, p) for p in failed.passes))
    while cap > 1:
        cap //= 2
        if failed.replan(replace(limits, max_tokens_per_pass=cap)) != failed.passes:
            old, limits.max_tokens_per_pass = limits.max_tokens_per_pass, cap
            return Change("train.max_tokens_per_pass", old, cap, "the same update, in smaller forward passes")
    return None


def _smaller_passes(limits: MemoryLimits, failed: FailedStep, model) -> Change | None:
    rows = min(limits.rows_per_pass or failed.batch_size, max(len(p) for p in failed.passes))
    while rows > 1:
        rows //= 2
        if failed.replan(replace(limits, rows_per_pass=rows)) != failed.passes:
            old, limits.rows_per_pass = limits.rows_per_pass or failed.batch_size, rows
            same = (f"as train.batch_size={rows} with train.gradient_accumulation_steps="
                    f"{failed.accumulation * failed.batch_size // rows}; " if failed.batch_size % rows == 0 else "")
            return Change(ROWS, old, rows, f"{same}the same rows per optimizer step, the same update")
    return None


def _gradient_checkpointing(limits: MemoryLimits, failed: FailedStep, model) -> Change | None:
    if limits.gradient_checkpointing or not getattr(model, "supports_gradient_checkpointing", False):
        return None
    limits.gradient_checkpointing = True
    return Change("train.gradient_checkpointing", False, True,
                  "the same update; activations recomputed in the backward pass, about 30% slower")


def _shorter_rows(limits: MemoryLimits, failed: FailedStep, model) -> Change | None:
    longest = max(len(failed.rows[i].input_ids) for p in failed.passes for i in p)
    new = longest // 2
    if new < 2:
        return None
    cut = [r for r in failed.rows if len(r.input_ids) > new]
    lost = sum(r.completion_tokens > 0 and truncated(r, new).completion_tokens == 0 for r in cut)
    if lost > MAX_ROWS_LOST * len(failed.rows):
        return None
    old = limits.max_length or longest
    limits.max_length = new
    return Change("train.max_length", old, new, f"train.oom_recovery=any: {len(cut)} training rows cut, {lost} of them "
                  "left without a loss token; this changes what is trained")


def _attention_only(limits: MemoryLimits, failed: FailedStep, model) -> Change | None:
    if limits.attention_only:
        return None
    names = _adapted_modules(model)
    outside = [n for n in names if not ATTENTION.search(n)]
    if not outside or len(outside) == len(names):  # nothing to stop, or nothing left training
        return None
    limits.attention_only = True
    return Change(ADAPTERS, len(names), len(names) - len(outside),
                  f"train.oom_recovery=any: LoRA on the attention projections only; the {len(outside)} adapted modules "
                  "outside attention stop training and keep what they learnt so far; this changes what is trained")


def _adapted_modules(model: torch.nn.Module) -> list[str]:
    from peft.tuners.lora import LoraLayer

    return [name for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and any(p.requires_grad for p in module.parameters())]


def apply(limits: MemoryLimits, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          rows: list[Example]) -> list[Example]:
    """Bring the model in line with `limits` (after a change, or on resume) and return the training rows as
    they are trained now. Forward-pass sizes need nothing here: the loop reads them from `limits`."""
    if limits.gradient_checkpointing and not model.is_activation_checkpointing:
        checkpoint_activations(model)
    if limits.attention_only:
        _freeze_outside_attention(model, optimizer)
    return [truncated(r, limits.max_length) for r in rows] if limits.max_length else rows


def _freeze_outside_attention(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for name in _adapted_modules(model):
        if ATTENTION.search(name):
            continue
        for param in model.get_submodule(name).parameters():
            if param.requires_grad:
                param.requires_grad_(False)
                setattr(param, ckpt.FROZEN, True)  # still saved and restored with the trained state
                param.grad = None
                optimizer.state.pop(param, None)  # its Adam moments are memory too


# --------------------------------------------------------------------------------------------------
# What is printed


def announce(change: Change, step: int, messages: list[str | None]) -> str:
    failed = [m for m in messages if m is not None]
    where = f"on {len(failed)} of {len(messages)} processes " if len(messages) > 1 else ""
    return (f"Step {step + 1} ran out of memory {where}({failed[0]}). Freed its memory; redoing it from its first "
            f"micro-batch with {change.setting} {change.old} -> {change.new} ({change.meaning}).")


def summary(limits: MemoryLimits, batch_size: int, accumulation: int) -> str:
    """One line for the end of training: the settings that fitted, as overrides to start with next time."""
    changed = {c["setting"] for c in limits.changes}
    overrides = []
    if "train.max_tokens_per_pass" in changed:
        overrides.append(f"train.max_tokens_per_pass={limits.max_tokens_per_pass}")
    if ROWS in changed:
        overrides += ([f"train.batch_size={limits.rows_per_pass}",
                       f"train.gradient_accumulation_steps={accumulation * batch_size // limits.rows_per_pass}"]
                      if batch_size % limits.rows_per_pass == 0 else [f"(forward passes of {limits.rows_per_pass} rows)"])
    if "train.gradient_checkpointing" in changed:
        overrides.append("train.gradient_checkpointing=true")
    if "train.max_length" in changed:
        overrides.append(f"train.max_length={limits.max_length}")
    if ADAPTERS in changed:
        overrides.append("lora.target_modules=[the attention projections, e.g. q_proj, k_proj, v_proj, o_proj]")
    return f"Out-of-memory recovery made {len(limits.changes)} change(s). To start with what fitted: {' '.join(overrides)}"


def give_up(limits: MemoryLimits, policy: str, step: int, message: str, longest: int, checkpoint: str) -> UserError:
    """The one-paragraph error when nothing is left to change: what was tried, and what to change by hand."""
    if policy == "none":
        what = ("train.oom_recovery=none, so nothing was changed. Set train.oom_recovery=same_update to let emotune "
                "redo the step in smaller forward passes and with gradient checkpointing, or by hand lower "
                "train.batch_size (raising train.gradient_accumulation_steps by the same factor), set "
                "train.max_tokens_per_pass, or turn on train.gradient_checkpointing")
    else:
        what = (f"nothing is left that train.oom_recovery={policy} may change ({_reached(limits)}). Shorten "
                f"train.max_length (the longest row of that step has {longest} tokens) or cut long rows before "
                "training (data.cleaning.long_rows=truncate), narrow lora.target_modules (e.g. [q_proj, k_proj, v_proj, "
                "o_proj]) or lower lora.r, shard the model over several GPUs (train.fsdp=true), or use a device with "
                "more memory")
        if policy == "same_update":
            what += "; or set train.oom_recovery=any to let emotune shorten rows and narrow the adapters itself"
    return UserError(f"Training ran out of memory at step {step + 1} ({message}), and {what}. {checkpoint}")


def _reached(limits: MemoryLimits) -> str:
    reached = ["forward passes as small as they go",
               f"gradient checkpointing {'on' if limits.gradient_checkpointing else 'unsupported by this model'}"]
    if limits.max_length:
        reached.append(f"rows cut to {limits.max_length} tokens")
    if limits.attention_only:
        reached.append("LoRA on the attention projections only")
    return ", ".join(reached)


def sharded_failure(step: int, message: str) -> UserError:
    return UserError(f"Training ran out of memory at step {step + 1} under FSDP ({message}). FSDP gathers weights "
                     "inside every forward pass, so the processes cannot agree to redo a step, and nothing was changed. "
                     "Start again with smaller forward passes (train.max_tokens_per_pass, or a lower train.batch_size "
                     "with a higher train.gradient_accumulation_steps), train.gradient_checkpointing=true, a shorter "
                     "train.max_length, or more processes.")


def optimizer_failure(step: int, message: str) -> UserError:
    return UserError(f"Training ran out of memory in the optimizer update of step {step + 1} ({message}), after the "
                     "gradients were computed; an update cut short cannot be redone. Use an optimizer with less state "
                     "(train.optim=adafactor or sgd), lower lora.r, or narrow lora.target_modules.")


def describe(err: BaseException) -> str:
    return first_line(err)
