"""`emotune plan`: will this config fit the device, before any weights load?

    emotune plan configs/gemma4-e4b-emotion.yaml --device-memory 24GB

From the model's config alone (emotune.train.memory: the model on the `meta` device and a one-layer-per-kind
probe), the peak memory of a training step, with and without gradient checkpointing, and of each evaluation
method at its batch; compared with this machine's device (free GPU memory, or available RAM on a CPU) or
the memory named by `--device-memory`; and, when it does not fit, the changes that make it fit in the order
training's own out-of-memory recovery takes them: the same update in smaller passes first, then gradient
checkpointing, then shorter rows, then fewer adapted modules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError
from emotune.model import finetuning
from emotune.runtime.device import Precision, choose_precision, resolve_device
from emotune.train.memory import Architecture, Workload, auto_eval_rows, describe, evaluation_parts, size_text, training_parts
from emotune.train.pass_size import auto_size, decide_checkpointing

FITS = 0.8  # the estimate is checked to within about ±30% of measured peaks (tests/test_plan.py): keep that room
GiB = 2**30
_UNITS = {"": GiB, "b": 1, "k": 2**10, "m": 2**20, "g": GiB, "t": 2**40}


def parse_memory(text: str) -> int:
    """`24GB`, `24GiB`, `24G`, `500MB` or `24` (GiB) in bytes. GB means GiB here, as on GPU spec sheets (a "24 GB"
    card holds 24 GiB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|(b))?\s*", text.lower())
    if not match or float(match[1]) <= 0:
        raise UserError(f"--device-memory `{text}` is not an amount of memory. Write it like 24GB, 80GiB or 512MB.")
    return int(float(match[1]) * _UNITS[match[2] or match[3] or ""])


@dataclass
class Target:
    """The memory the plan is checked against."""
    description: str
    kind: str  # cuda | mps | cpu
    memory: int  # bytes a run may use: free GPU memory, available RAM, or the named amount
    precision: Precision
    runtime: int = 0  # bytes of the Python process itself, counted on CPUs (where tensors share its memory)


@dataclass
class Plan:
    model: str
    task: str
    target: Target
    arch: Architecture
    pass_rows: int
    length: int
    checkpointing: bool
    training: dict[bool, dict[str, int]]  # gradient checkpointing on/off -> parts
    evaluations: dict[str, tuple[int, dict[str, int]]]  # method -> (rows, parts)
    fixes: list[dict] = field(default_factory=list)
    auto_passes: bool = False  # train.max_tokens_per_pass=auto: pass_rows as training would size them here
    checkpointing_note: str = ""  # train.gradient_checkpointing=auto: what decided it

    def peak(self) -> tuple[str, int]:
        needs = {"training": _total(self.training[self.checkpointing], self.target)}
        needs.update({f"evaluation ({m})": _total(parts, self.target) for m, (_, parts) in self.evaluations.items()})
        stage = max(needs, key=needs.get)
        return stage, needs[stage]

    def verdict(self) -> str:
        share = self.peak()[1] / max(self.target.memory, 1)
        return "fits" if share <= FITS else "tight" if share <= 1 else "does not fit"


def _total(parts: dict[str, int], target: Target) -> int:
    return sum(parts.values()) + target.runtime


def make_plan(cfg: RunConfig, task, device_memory: str | None = None) -> Plan:
    """The memory plan of `cfg`'s run; `task` (emotune.tasks.task_for(cfg)) says what its training and evaluation
    hold (`memory_workload`), so this layer never looks tasks up itself."""
    from emotune.model.loading import load_model_config

    target = _target(cfg, device_memory)
    dtype = target.precision.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    config = load_model_config(cfg.model)
    finetuning.check(cfg.train, cfg.lora, cfg.model, config)  # what training refuses, before any estimate
    work = task.memory_workload(cfg, target.kind)
    arch = _describe(config, cfg, dtype, work)
    t = cfg.train
    host = target.kind == "cpu"
    update_rows = t.batch_size * t.gradient_accumulation_steps
    # sized as training sizes it (emotune.train.pass_size) from what this memory leaves once the weights and adapters
    # are placed, rows as long as train.max_length: up to the whole update in one pass
    free = max(0, target.memory - target.runtime - arch.frozen_bytes - arch.trainable_bytes)
    extremes = (t.max_length, t.max_length)
    checkpointing, sized, why = (decide_checkpointing(arch, work, extremes, host, free, t, lambda cap: {
        "max": math.ceil(update_rows / max(1, min(update_rows, cap // t.max_length)))})
        if t.gradient_checkpointing == "auto" else (t.gradient_checkpointing, None, ""))
    if t.max_tokens_per_pass == "auto":
        cap = (sized or auto_size(arch, work, extremes, checkpointing, host, free)).cap
        rows = max(1, min(update_rows, cap // t.max_length))
    else:
        cap = t.max_tokens_per_pass
        rows = t.batch_size if not cap else min(t.batch_size, max(1, cap // t.max_length))
    training = {gc: training_parts(arch, work, rows, t.max_length, gc, host) for gc in (True, False)}
    evaluations = {}
    for method, ev in work.evaluations.items():
        batch = auto_eval_rows(arch, ev, target.memory - target.runtime)
        evaluations[method] = (batch, evaluation_parts(arch, ev, batch))
    plan = Plan(cfg.model.source, cfg.task, target, arch, rows, t.max_length, checkpointing, training,
                evaluations, auto_passes=t.max_tokens_per_pass == "auto", checkpointing_note=why)
    if plan.verdict() != "fits":
        plan.fixes = _fixes(plan, cfg, config, dtype, work)
    return plan


@dataclass(frozen=True)
class Variant:
    """A change to the config the fixes try: other adapter targets, `model.quantization`, optimizer or
    `train.finetuning` (None: as configured)."""
    targets: object = None
    quantized: str | None = None
    optim: str | None = None
    kind: str | None = None


def _describe(config, cfg: RunConfig, dtype: torch.dtype, work: Workload, variant: Variant = Variant()) -> Architecture:
    """The architecture facts of this config, or of it changed by `variant`."""
    targets, quantized, optim, kind = variant.targets, variant.quantized, variant.optim, variant.kind
    lora = cfg.lora.model_copy(update={"target_modules": targets if targets is not None else cfg.lora.target_modules})
    model = cfg.model.model_copy(update={"quantization": quantized}) if quantized else cfg.model
    train = cfg.train.model_copy(update={"finetuning": kind}) if kind else cfg.train
    return describe(config, lora, optim or train.optim, dtype, work, getattr(cfg.model, "attn_implementation", None),
                    (train.lean_lora and not train.fsdp, train.lean_norm and not train.fsdp), model, train)


# --------------------------------------------------------------------------------------------------
# The device


def _target(cfg: RunConfig, device_memory: str | None) -> Target:
    import psutil

    runtime = psutil.Process().memory_info().rss
    requested = cfg.train.precision
    if device_memory is not None:
        kind = cfg.device.split(":")[0] if cfg.device != "auto" else "cuda"
        if requested == "auto":
            precision = Precision("bf16", "assumed for the named GPU; set train.precision=fp16 for one without bf16") \
                if kind != "cpu" else Precision("fp32", "assumed for the named CPU; set train.precision=bf16 if it has it")
        elif requested == "fp16" and kind == "cpu":
            raise UserError("`train.precision: fp16` is not supported for training on a CPU. Set train.precision=auto or fp32.")
        else:
            precision = Precision(requested, "asked for in the config (train.precision)")
        what = "a GPU" if kind != "cpu" else "a CPU machine"
        return Target(f"{what} with {size_text(parse_memory(device_memory))} (--device-memory)", kind,
                      parse_memory(device_memory), precision, runtime if kind == "cpu" else 0)
    device = resolve_device(cfg.device)
    precision = choose_precision(device, requested)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        return Target(f"{device} ({name}): {size_text(free)} free of {size_text(total)}", "cuda", free, precision)
    if device.type == "mps":
        limit = torch.mps.recommended_max_memory()
        return Target(f"mps: {size_text(limit)} recommended at most", "mps", limit, precision)
    memory = psutil.virtual_memory()
    # the process's own memory is counted apart (`runtime`), so it is added back to what is available
    return Target(f"this machine's RAM: {size_text(memory.available)} available of {size_text(memory.total)}", "cpu",
                  memory.available + runtime, precision, runtime)


# --------------------------------------------------------------------------------------------------
# What to change when it does not fit


def _fixes(plan: Plan, cfg: RunConfig, config, dtype: torch.dtype, work: Workload) -> list[dict]:
    fixes = []
    limit = FITS * plan.target.memory
    if _total(plan.training[plan.checkpointing], plan.target) > limit:
        fixes.append(_training_fix(plan, cfg, config, dtype, work, limit))
    for method, (rows, parts) in plan.evaluations.items():
        if _total(parts, plan.target) <= limit:
            continue
        ev = work.evaluations[method]
        fitting = [k for k in range(rows - 1, 0, -1) if _total(evaluation_parts(plan.arch, ev, k), plan.target) <= limit]
        if fitting and not ev.auto:
            fixes.append({"for": f"evaluation ({method})", "overrides": [f"eval.batch_size={fitting[0]}"],
                          "peak": _total(evaluation_parts(plan.arch, ev, fitting[0]), plan.target),
                          "note": f"{fitting[0]} rows per evaluation batch"})
        elif not fitting:
            fixes.append({"for": f"evaluation ({method})", "overrides": [], "peak": None,
                          "note": "even one row per batch does not fit: a device with more memory, or a smaller model"})
    return fixes


def _training_fix(plan: Plan, cfg: RunConfig, config, dtype: torch.dtype, work: Workload, limit: float) -> dict:
    """The first change, in the order of least change to the training, whose estimate fits."""
    arch, target, t = plan.arch, plan.target, cfg.train
    host = target.kind == "cpu"

    def peak(arch_: Architecture, rows: int, length: int, gc: bool) -> int:
        return _total(training_parts(arch_, work, rows, length, gc, host), target)

    def passes(rows: int, length: int) -> list[str]:
        return _cap(plan, cfg, rows, length)

    for rows in range(plan.pass_rows - 1, 0, -1):  # the same update, in passes of fewer rows
        if peak(arch, rows, plan.length, plan.checkpointing) <= limit:
            same = (f"; or train.batch_size={rows} train.gradient_accumulation_steps="
                    f"{t.gradient_accumulation_steps * t.batch_size // rows}" if t.batch_size % rows == 0 else "")
            return _fix(passes(rows, plan.length), peak(arch, rows, plan.length, plan.checkpointing),
                        f"the same update in forward passes of {_rows(rows)}{same}")
    gc = ["train.gradient_checkpointing=true"] if not plan.checkpointing else []
    for rows in range(plan.pass_rows, 0, -1):
        if gc and peak(arch, rows, plan.length, True) <= limit:
            return _fix(gc + passes(rows, plan.length), peak(arch, rows, plan.length, True),
                        f"gradient checkpointing (about 30% slower), passes of {_rows(rows)}")
    if arch.whole:  # the model's own weights, before rows are cut: LoRA trains the same rows on far less state
        lora = _lora_fix(plan, cfg, config, dtype, work, limit, gc)
        if lora is not None:
            return lora
    quantized = None if arch.whole else _quantized_fix(plan, cfg, config, dtype, work, limit, gc)
    if quantized is not None:
        return quantized
    length = plan.length // 2
    while length >= 16:
        if peak(arch, 1, length, True) <= limit:
            return _fix(gc + passes(1, length) + [f"train.max_length={length}"], peak(arch, 1, length, True),
                        f"rows cut at {length} tokens (longer rows lose their end), passes of 1 row")
        length //= 2
    fewer = None if arch.whole else _fewer_targets(arch, cfg, config, dtype, work)
    if fewer is not None:
        for length in (plan.length, plan.length // 2, plan.length // 4):
            if length >= 16 and peak(fewer[1], 1, length, True) <= limit:
                return _fix(gc + passes(1, length) + ([f"train.max_length={length}"] if length != plan.length else [])
                            + [f"lora.target_modules=[{','.join(fewer[0])}]"], peak(fewer[1], 1, length, True),
                            f"adapters on {' and '.join(fewer[0])} only")
    return {"for": "training", "overrides": [], "peak": None,
            "note": f"nothing in the config makes it fit: the weights alone take "
                    f"{size_text(arch.frozen_bytes + arch.trained_rest_bytes)}; use a "
                    "device with more memory or a smaller model"}


def _quantized_fix(plan: Plan, cfg: RunConfig, config, dtype: torch.dtype, work: Workload, limit: float,
                   gc: list[str]) -> dict | None:
    """The base stored in 8, then 4 bits (QLoRA), with 8-bit AdamW where AdamW is used: what the weights need
    when the configured passes do not fit. Before cutting rows, which changes what is learned more."""
    host = plan.target.kind == "cpu"
    optim = "adamw_8bit" if cfg.train.optim.startswith("adamw") and "8bit" not in cfg.train.optim else None
    steps = {"none": ("8bit", "4bit"), "8bit": ("4bit",)}.get(cfg.model.quantization, ())
    for bits in steps:
        arch = _describe(config, cfg, dtype, work, Variant(quantized=bits, optim=optim))
        for rows in range(plan.pass_rows, 0, -1):
            peak = _total(training_parts(arch, work, rows, plan.length, True, host), plan.target)
            if peak <= limit:
                passes = _cap(plan, cfg, rows)
                return _fix([*gc, f"model.quantization={bits}", *([f"train.optim={optim}"] if optim else []), *passes],
                            peak, f"the base's linear layers in {bits[0]} bits (bitsandbytes; embeddings unquantized)"
                            + (", 8-bit optimizer state" if optim else "") + f", passes of {_rows(rows)}")
    return None


def _lora_fix(plan: Plan, cfg: RunConfig, config, dtype: torch.dtype, work: Workload, limit: float,
              gc: list[str]) -> dict | None:
    """Full / freeze fine-tuning that does not fit: LoRA adapters instead (the config's lora settings), with the
    configured passes or fewer rows in each."""
    arch = _describe(config, cfg, dtype, work, Variant(kind="lora"))
    for rows in range(max(plan.pass_rows, cfg.train.batch_size), 0, -1):  # full's own passes may have shrunk to 1
        peak = _total(training_parts(arch, work, rows, plan.length, True, plan.target.kind == "cpu"), plan.target)
        if peak <= limit:
            passes = _cap(plan, cfg, rows)
            return _fix([*gc, "train.finetuning=lora", *passes], peak,
                        f"LoRA adapters (lora.r={cfg.lora.r}) instead of training the model's own weights, passes of "
                        f"{_rows(rows)}")
    return None


def _cap(plan: Plan, cfg: RunConfig, rows: int, length: int | None = None) -> list[str]:
    """The pass cap that holds `rows` rows of `length` tokens, where the config would otherwise pass more."""
    fewer = rows < cfg.train.batch_size or (plan.auto_passes and rows < plan.pass_rows)  # auto would take more
    return [f"train.max_tokens_per_pass={rows * (length or plan.length)}"] if fewer else []


def _rows(n: int) -> str:
    return f"{n} row" + ("s" if n != 1 else "")


def _fix(overrides: list[str], peak: int, note: str) -> dict:
    return {"for": "training", "overrides": overrides, "peak": peak, "note": note}


def _fewer_targets(arch: Architecture, cfg: RunConfig, config, dtype, work) -> tuple[list[str], Architecture] | None:
    """Adapters on the query and value projections only, where the model has them and the config adapts more."""
    targets = cfg.lora.target_modules
    if targets != "all-linear" and len(targets) <= 2:
        return None
    names = ["q_proj", "v_proj"]
    try:
        return names, _describe(config, cfg, dtype, work, Variant(targets=names))
    except UserError:
        return None


# --------------------------------------------------------------------------------------------------
# Output




def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def format_plan(plan: Plan) -> str:
    arch, target = plan.arch, plan.target
    share = 100 * arch.trainable / max(arch.parameters, 1)
    lines = [f"Memory plan for {plan.model} (task {plan.task}); precision {target.precision.name}: {target.precision.reason}",
             f"  parameters {_count(arch.parameters)}, weights {size_text(arch.frozen_bytes + arch.trained_rest_bytes)}; trained "
             f"{_count(arch.trainable)} "
             f"({share:.2f}%)",
             f"  training: forward passes of {plan.pass_rows} rows x {plan.length} tokens (every row as long as "
             "train.max_length: the worst case" + ("; train.max_tokens_per_pass=auto sized them for this memory"
                                                   if plan.auto_passes else "") + "); * = this config"
             + (f" (train.gradient_checkpointing={plan.checkpointing_note})" if plan.checkpointing_note else "")]
    # three header lines per column: what, how, batch
    columns = [(("training", "checkpointing" + ("*" if plan.checkpointing else ""), ""), plan.training[True]),
               (("training", "no checkpointing" + ("" if plan.checkpointing else "*"), ""), plan.training[False])]
    columns += [(("evaluation", method, f"{rows} rows"), parts) for method, (rows, parts) in plan.evaluations.items()]
    names = list(dict.fromkeys(name for _, parts in columns for name in parts))
    runtime = "runtime (this Python process)"
    width = max(len(n) for n in [*names, runtime]) + 2
    cell = max(18, *(len(h) + 2 for head, _ in columns for h in head))
    lines.append("")
    for line in range(3):
        lines.append(" " * width + "".join(f"{head[line]:>{cell}}" for head, _ in columns).rstrip())
    rows = [(name, [parts.get(name) for _, parts in columns]) for name in names]
    if target.runtime:
        rows.append((runtime, [target.runtime] * len(columns)))
    rows.append(("total", [_total(parts, target) for _, parts in columns]))
    for name, cells in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{size_text(c) if c else '':>{cell}}" for c in cells))
    stage, peak = plan.peak()
    lines += ["", f"Device: {target.description}",
              f"Verdict: {plan.verdict()} — the largest need is {stage}, {size_text(peak)} "
              f"({100 * peak / max(target.memory, 1):.0f}% of {size_text(target.memory)}). The estimate came within about ±30% "
              f"of measured peaks in emotune's tests; 'fits' keeps {100 - 100 * FITS:.0f}% free for that."]
    for fix in plan.fixes:
        change = " ".join(fix["overrides"])
        lines.append(f"To fit {fix['for']}: " + (f"{change}  → {size_text(fix['peak'])} ({fix['note']})" if change
                                                 else fix["note"]))
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    stage, peak = plan.peak()
    arch = plan.arch
    return {
        "model": plan.model, "task": plan.task,
        "device": {"description": plan.target.description, "kind": plan.target.kind, "memory_bytes": plan.target.memory,
                   "runtime_bytes": plan.target.runtime},
        "precision": {"name": plan.target.precision.name, "reason": plan.target.precision.reason},
        "parameters": arch.parameters, "trainable_parameters": arch.trainable,
        "training": {"pass_rows": plan.pass_rows, "auto_passes": plan.auto_passes, "length": plan.length,
                     "gradient_checkpointing": plan.checkpointing, "checkpointing_note": plan.checkpointing_note,
                     "checkpointing": plan.training[True], "no_checkpointing": plan.training[False]},
        "evaluation": {m: {"rows": rows, "parts": parts} for m, (rows, parts) in plan.evaluations.items()},
        "peak": {"stage": stage, "bytes": peak}, "verdict": plan.verdict(), "fits_below": FITS, "fixes": plan.fixes,
    }
