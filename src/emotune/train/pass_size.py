"""`train.max_tokens_per_pass=auto`: forward passes as large as the device's free memory allows.

Gradient accumulation cuts an optimizer update into micro-batches, each at least one forward and backward pass;
where the device has memory to spare, each extra pass is launch and host overhead for the same arithmetic. With a
token cap the loop cuts the rows of the whole update into length-sorted passes
(emotune.train.batches.update_passes), so a cap the update fits under runs it as one pass, and a smaller one as
few as fit. The loss is divided by the update's completion tokens either way, so the update is the same.

`auto` sizes the cap once training is set up (the model placed, its adapters attached, the optimizer built):

1. free memory: on a GPU what the driver reports free (`torch.cuda.mem_get_info`, which ROCm builds answer too)
   plus the blocks PyTorch's allocator holds unused; on a CPU the RAM the kernel reports available (psutil); on
   Apple GPUs the recommended limit less what the driver holds;
2. less what the first step still allocates outside its passes: the trained parameters' gradients, the
   optimizer's state (AdamW's moments are created at the first step), a quantized base's dequantized layer and,
   on a CPU, the two host copies of what trains (the best so far, a checkpoint's);
3. `MEMORY_SHARE` (half) of what is left: the estimate came within about ±30 % of measured peaks
   (tests/test_plan.py), and allocator caches and fragmentation (on CPUs glibc's heap keeps freed pass buffers),
   other processes on the device and validation's batches need room too;
4. divided by the memory of one pass from emotune.train.memory, the planner's model for this model and these
   settings: what each decoder layer keeps for the backward pass (measured on a one-layer-per-kind probe with
   these adapters, lean forwards and dtype), gradient checkpointing, the loss's buffers. Passes are costed with
   every row as long as the shortest and as the longest training row; the cap is the most padded tokens whose
   estimate fits at both.

`train.gradient_checkpointing=auto` is decided from the same estimate: recomputing each layer's activations in the
backward pass only buys room for larger passes, so it is off when, without it, an update needs no more passes than
with it (a cap set in the config: when the widest pass it allows fits without it), and on otherwise; on where no
estimate can be made (the free memory unknown, a model the memory model cannot build) and under FSDP.

Every process takes the smallest cap any process chose (all must run the same number of passes), and checkpointing
when any process needs it. The choice is
printed with the plan and recorded in run.json (`stages.train.passes`); out-of-memory recovery lowers it like any
cap (emotune.train.recovery), and a resumed run keeps the cap its checkpoint recorded. Devices whose free memory
cannot be read, and models the memory model cannot build, run one pass per micro-batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from statistics import mean

import torch

from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError
from emotune.train import checkpoints as ckpt
from emotune.train.batches import Example, epoch_batches, epoch_updates, update_passes
from emotune.train.memory import Architecture, Workload, describe, pass_bytes, size_text

MEMORY_SHARE = 0.5
"""The share of the free memory (after the step's fixed needs) that `auto`'s passes may take: the safety margin."""
MOST_ROWS = 1 << 24  # the search's bound; a cap past any update changes nothing


@dataclass(frozen=True)
class PassSize:
    """The cap on a forward pass's padded tokens and how it was chosen; recorded in run.json."""
    setting: int | str
    """`train.max_tokens_per_pass` as configured."""
    cap: int
    """Padded tokens per pass (0: no cap, one pass per micro-batch)."""
    passes_per_update: dict | None = None
    """Forward passes per optimizer update over the first epoch's updates: min, max, mean, updates counted."""
    free_bytes: int | None = None
    """`auto`: the free memory seen after setup."""
    reserved_bytes: int | None = None
    """`auto`: what the step allocates besides its passes (gradients, optimizer state, host copies)."""
    bytes_per_token: float | None = None
    """`auto`: the estimated bytes of one padded token in a pass of the cap's size, at the binding row length."""
    note: str = ""
    checkpointing: bool | None = None
    """Whether the decoder layers recompute their activations in the backward pass (gradient checkpointing)."""
    checkpointing_note: str = ""
    """Why: `set in the config`, or what `train.gradient_checkpointing=auto` saw."""

    def as_record(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None and v != ""}
        if self.setting == "auto" and self.free_bytes is not None:
            out["memory_share"] = MEMORY_SHARE
        return out

    def words(self) -> str:
        """For the start-of-training line."""
        counts = self.passes_per_update or {}
        per_update = (f"{counts['min']}" if counts.get("min") == counts.get("max") else
                      f"{counts.get('min')}-{counts.get('max')} (mean {counts.get('mean')})")
        if not self.cap:
            what = "one forward pass per batch (micro-batch)"
        else:
            what = f"forward passes of at most {self.cap} padded tokens cut from each update's rows"
        what += f": {per_update} per update" if counts else ""
        if self.setting == "auto" and self.free_bytes is not None:
            what += (f" (train.max_tokens_per_pass=auto: {size_text(self.free_bytes)} free, {size_text(self.reserved_bytes)} "
                     f"kept for gradients, optimizer state and copies of the trained weights, {MEMORY_SHARE:.0%} of the rest at about "
                     f"{size_text(self.bytes_per_token)} per padded token)")
        elif self.note:
            what += f" ({self.note})"
        if self.checkpointing is not None:
            what += f"; gradient checkpointing {'on' if self.checkpointing else 'off'} ({self.checkpointing_note})"
        return what


def choose(cfg: RunConfig, model, rows: list[Example], shared_tokens: int, plan, accelerator,
           sharded: bool) -> PassSize:
    """The cap for this training (`train.max_tokens_per_pass`, or `auto` sized now), with its passes per update, and
    whether layers recompute their activations (`train.gradient_checkpointing`, or `auto` decided now).
    `plan`: emotune.train.passes.Plan; `shared_tokens`: a shared prefix's, which a pass does not count per row."""
    t = cfg.train
    lengths = [len(r.input_ids) - shared_tokens for r in rows]
    count = lambda cap: passes_per_update(lengths, plan, t, cfg.seed, cap)  # noqa: E731
    checkpointing = t.gradient_checkpointing
    size, why = None, "set in the config"
    if checkpointing == "auto":
        checkpointing, size, why = _auto_checkpointing(cfg, model, rows, lengths, accelerator.device, sharded, count)
    if accelerator.num_processes > 1 and (t.max_tokens_per_pass == "auto" or t.gradient_checkpointing == "auto"):
        size = size or _fixed_or_auto(cfg, model, rows, lengths, accelerator.device, sharded, checkpointing)
        # every process must cut the same passes (the smallest cap wins) and recompute alike (any process's need wins)
        mine = torch.tensor([size.cap, int(checkpointing)], device=accelerator.device)
        everyone = accelerator.gather(mine).reshape(-1, 2)
        size = replace(size, cap=int(everyone[:, 0].min()))
        if t.gradient_checkpointing == "auto" and bool(everyone[:, 1].max()) != checkpointing:
            checkpointing, why = True, "auto: another process needs it"
    size = size or _fixed_or_auto(cfg, model, rows, lengths, accelerator.device, sharded, checkpointing)
    return replace(size, passes_per_update=count(size.cap), checkpointing=bool(checkpointing), checkpointing_note=why)


def _fixed_or_auto(cfg: RunConfig, model, rows, lengths, device, sharded: bool, checkpointing: bool) -> PassSize:
    t = cfg.train
    if t.max_tokens_per_pass != "auto":
        return PassSize(t.max_tokens_per_pass, t.max_tokens_per_pass, note="set in the config")
    estimate = _estimate(cfg, model, rows, device, sharded)
    if isinstance(estimate, PassSize):
        return estimate
    arch, work, free = estimate
    return auto_size(arch, work, _shortest_longest(lengths), checkpointing, device.type == "cpu", free)


def check_checkpointing(t, auto_class, config) -> None:
    """Refuse, from config.json before any weight loads, `train.gradient_checkpointing=true` on a model class that
    transformers cannot checkpoint (JetMoe, GPT-NeoX-Japanese, CPM-Ant: `supports_gradient_checkpointing` false):
    the run stopped with transformers' ValueError after the baseline evaluation. `auto_class` loads `config`."""
    if t.gradient_checkpointing is not True or type(config) not in auto_class._model_mapping:
        return
    model_class = auto_class._model_mapping[type(config)]
    if not getattr(model_class, "supports_gradient_checkpointing", False):
        raise UserError(f"train.gradient_checkpointing=true: {model_class.__name__} does not support gradient "
                        "checkpointing in transformers (its layers cannot recompute their activations). Set "
                        "train.gradient_checkpointing=auto (off for this model) or false, and lower train.batch_size or "
                        "train.max_length if memory is short.")


def _auto_checkpointing(cfg: RunConfig, model, rows, lengths, device, sharded: bool,
                        count) -> tuple[bool, PassSize | None, str]:
    """`train.gradient_checkpointing=auto`: (on?, the pass size that goes with it or None, why)."""
    t = cfg.train
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False, None, "auto: off, this model does not support it"
    if sharded:
        return True, None, "auto: on under FSDP"
    estimate = _estimate(cfg, model, rows, device, sharded)
    if isinstance(estimate, PassSize):  # no free memory or no estimate: the choice that saves memory
        return True, (estimate if t.max_tokens_per_pass == "auto" else None), f"auto: on ({estimate.note})"
    arch, work, free = estimate
    return decide_checkpointing(arch, work, _shortest_longest(lengths), device.type == "cpu", free, t, count)


def decide_checkpointing(arch: Architecture, work: Workload, extremes: tuple[int, int], host: bool, free: int, t,
                         count) -> tuple[bool, PassSize | None, str]:
    """`train.gradient_checkpointing=auto` with `free` bytes free and rows from `extremes[0]` to `extremes[1]` tokens:
    (on?, with `max_tokens_per_pass=auto` the pass size that goes with it, why); `count(cap)`: passes per update
    under a cap ({"max": ...}). Off when, without it, an update needs no more passes than with it (a fixed cap:
    when its widest pass fits without it), within the same share of the free memory as the cap's."""
    if t.max_tokens_per_pass == "auto":
        on, off = (auto_size(arch, work, extremes, gc, host, free) for gc in (True, False))
        most_on, most_off = count(on.cap)["max"], count(off.cap)["max"]
        if not off.note and most_off <= most_on:
            return False, off, (f"auto: off, an update fits in {_passes(most_off)} without it "
                                f"({_passes(most_on)} with it)")
        return True, on, f"auto: on, without it an update would need {_passes(most_off)} instead of {_passes(most_on)}"
    cap = t.max_tokens_per_pass
    update_rows = t.batch_size * t.gradient_accumulation_steps
    budget = MEMORY_SHARE * (free - reserved_bytes(arch, host))
    widest = [(min(update_rows, max(1, cap // n)) if cap else t.batch_size, n) for n in extremes]
    need = max(pass_bytes(arch, work, n_rows, n, False) for n_rows, n in widest)
    if need <= budget:
        return False, None, f"auto: off, a pass needs about {size_text(need)} without it ({size_text(budget)} to spare)"
    return True, None, f"auto: on, a pass would need about {size_text(need)} without it ({size_text(budget)} to spare)"


def _passes(n: int) -> str:
    return f"{n} forward pass{'es' if n != 1 else ''}"


def _shortest_longest(lengths: list[int]) -> tuple[int, int]:
    positive = [n for n in lengths if n > 0] or [1]
    return min(positive), max(positive)


def _estimate(cfg: RunConfig, model, rows: list[Example], device: torch.device, sharded: bool):
    """(architecture, workload, free bytes) for the memory model, or a PassSize of one pass per micro-batch that
    says why there is none (free memory unknown, a model the memory model cannot build)."""
    t = cfg.train
    free = free_bytes(device)
    if free is None:
        return PassSize("auto", 0, note=f"the free memory of a {device.type} device is not known")
    work = workload(rows)
    state = ckpt.rng_state()  # the probe seeds its own model: training's random streams must not notice
    try:
        arch = describe(model.config, cfg.lora, t.optim, _stored_dtype(model), work,
                        getattr(model.config, "_attn_implementation", None),
                        (t.lean_lora and not sharded, t.lean_norm and not sharded), cfg.model, t)
    except Exception as err:  # noqa: BLE001 (an estimate that fails must not stop training: one pass per micro-batch)
        detail = str(err).splitlines()[0][:200] if str(err) else "no details"
        what = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {detail}"
        return PassSize("auto", 0, note=f"no memory estimate for this model ({what})")
    finally:
        ckpt.set_rng_state(state)
    return arch, work, free


def _stored_dtype(model) -> torch.dtype:
    """The dtype the model's weights were loaded in: its frozen weights', or (full fine-tuning, every weight trained
    and kept in fp32 while training) the one its config records."""
    frozen = next((p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)
    recorded = getattr(model.config, "dtype", None)
    return frozen or (recorded if isinstance(recorded, torch.dtype) else getattr(model, "dtype", torch.float32))


def auto_size(arch: Architecture, work: Workload, lengths: tuple[int, int], checkpointing: bool, host: bool,
              free: int) -> PassSize:
    """The cap `auto` takes with `free` bytes free: the most padded tokens of a pass whose estimated memory fits
    `MEMORY_SHARE` of what the step's fixed needs leave, with rows all as long as each of `lengths` (the shortest
    and longest row); at least 1 (every row alone), which out-of-memory recovery takes over from."""
    reserved = reserved_bytes(arch, host)
    budget = MEMORY_SHARE * (free - reserved)
    fits = []
    for length in sorted(set(lengths)):
        rows = _most_rows(lambda n, length=length: pass_bytes(arch, work, n, length, checkpointing), budget)
        fits.append((rows * length, rows, length))
    cap, rows, length = min(fits)
    per_token = pass_bytes(arch, work, max(rows, 1), length, checkpointing) / (max(rows, 1) * length)
    note = "" if rows else f"the estimate says even one row of {length} tokens may not fit: every row alone"
    return PassSize("auto", max(cap, 1), free_bytes=int(free), reserved_bytes=int(reserved),
                    bytes_per_token=round(per_token, 1), note=note)


def reserved_bytes(arch: Architecture, host: bool) -> int:
    """What a step allocates besides its passes: gradients, optimizer state, a quantized base's dequantized layer and,
    on a CPU, the two host copies of what trains."""
    return (arch.trainable_bytes + arch.optimizer_bytes + arch.dequantized_bytes
            + (2 * arch.trainable_bytes if host else 0))


def _most_rows(cost, budget: float) -> int:
    """The most rows (up to MOST_ROWS) whose `cost(rows)`, which grows with the rows, is within `budget`; 0: none."""
    if cost(1) > budget:
        return 0
    low, high = 1, 2
    while high < MOST_ROWS and cost(high) <= budget:
        low, high = high, 2 * high
    while high - low > 1:  # cost(low) fits, cost(high) does not (or high is the bound)
        middle = (low + high) // 2
        low, high = (middle, high) if cost(middle) <= budget else (low, middle)
    return low


def workload(rows: list[Example]) -> Workload:
    """What the rows ask of the loss, in the memory model's terms: a classification head's rows (they carry a label)
    read a head, others project their loss positions (at most the most any row has) onto the vocabulary."""
    labels = [r.label for r in rows if r.label is not None]
    if labels:
        return Workload(loss_tokens_per_row=None, vocabulary_loss=False, head_outputs=max(labels) + 1)
    return Workload(loss_tokens_per_row=max((r.completion_tokens for r in rows), default=1))


def free_bytes(device: torch.device) -> int | None:
    """Memory this process may still allocate on `device` (see the module docstring); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "mps":
        return max(0, torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


def passes_per_update(lengths: list[int], plan, t, seed: int, cap: int) -> dict:
    """Forward passes per update under `cap`, over the first epoch's updates (the data order alone decides them)."""
    batches = epoch_batches(lengths, plan.global_batch_rows, plan.world_size, seed, 0, t.group_by_length)
    counts = [len(update_passes(u, lengths, plan.world_size, cap)[0]) for u in epoch_updates(batches, plan.micro_per_step)]
    return {"min": min(counts), "max": max(counts), "mean": round(mean(counts), 2), "updates": len(counts)}


