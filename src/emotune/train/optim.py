"""The optimizer of a training run: `train.optim`, and LoRA+ learning rates on top of any of them.

(Belongs in `train/` once the package layout lands.)

    adamw_torch / adamw_torch_fused   PyTorch's AdamW (fused: one kernel for all parameters)
    sgd / adafactor                   PyTorch's
    (adamw_torch, sgd and adafactor run their `foreach` implementations unless `train.foreach=off`, as the
    gradient clipping does: on a CPU PyTorch's default is a Python loop over the tensors)
    adamw_8bit                        bitsandbytes' AdamW8bit: both moments in 8 bits (blockwise quantized), a
                                      quarter of AdamW's state memory; CPU, CUDA and ROCm
    paged_adamw_8bit                  the same with its state in paged memory that the GPU driver moves to host
                                      memory when the GPU runs short; GPU only (on a CPU bitsandbytes falls
                                      back silently to unpaged memory, so it is refused there)
    paged_adamw_32bit                 bitsandbytes' PagedAdamW32bit: AdamW's 32-bit moments in paged memory (the
                                      QLoRA paper's optimizer); GPU only, as above

LoRA+ (`train.loraplus_lr_ratio`, Hayou et al. 2024) gives the LoRA B matrices a learning rate that many times
the A matrices' (`train.learning_rate`); PEFT's `create_loraplus_optimizer` sorts the parameters into those
groups, and LoRA on embedding layers gets `train.loraplus_lr_embedding`.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import torch
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError

BITSANDBYTES = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw_32bit": "PagedAdamW32bit"}
"""train.optim values that are bitsandbytes' optimizers, and their class names in `bitsandbytes.optim`."""


def check(t: TrainConfig, device: torch.device) -> None:
    """Refuse, before any weights load, an optimizer that cannot run on `device`."""
    problems = []
    if t.optim in BITSANDBYTES and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"train.optim={t.optim} needs bitsandbytes: pip install 'bitsandbytes>=0.50.2' (or "
                        "`pip install emotune[qlora]`), or set train.optim=adamw_torch")
    if t.optim.startswith("paged_") and device.type != "cuda":
        unpaged = "adamw_8bit (the same 8-bit state" if "8bit" in t.optim else "adamw_torch (the same 32-bit state"
        problems.append(f"train.optim={t.optim} pages optimizer state between GPU and host memory, and this run "
                        f"is on {device.type}, where bitsandbytes would silently fall back to ordinary memory; set "
                        f"train.optim={unpaged}, unpaged)")
    if problems:
        raise UserError("; ".join(problems) + ".")


def optimizer_class(t: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class for `train.optim` and its settings besides the learning rate."""
    decay = {"weight_decay": t.weight_decay}
    if t.optim == "sgd":
        return torch.optim.SGD, {**decay, **_foreach(t)}
    if t.optim == "adafactor":
        return torch.optim.Adafactor, {**decay, **_foreach(t)}
    adam = {**decay, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_epsilon}
    if t.optim in BITSANDBYTES:
        import bitsandbytes as bnb

        return getattr(bnb.optim, BITSANDBYTES[t.optim]), adam
    if t.optim == "adamw_torch_fused":
        return torch.optim.AdamW, {**adam, "fused": True}
    return torch.optim.AdamW, {**adam, **_foreach(t)}


def _foreach(t: TrainConfig) -> dict:
    """PyTorch's optimizers loop over the tensors one by one on a CPU unless told `foreach=True`; its foreach kernels
    give the same update there (on a CPU they run the same per-tensor ops in C++), with one call per operation."""
    return {"foreach": True} if t.foreach == "auto" else {}


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float, foreach: bool = True) -> float:
    """Clip the gradients' total norm to `max_norm` (0: no clipping, only the norm); returns the norm before clipping.
    `foreach`: in one call per operation on every device (False: PyTorch's default, a loop on a CPU)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=foreach or None)
    # Under FSDP2 the norm is a replicated DTensor: the same float on every process.
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def build_optimizer(t: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer over `model`'s trainable parameters (LoRA+ groups when `train.loraplus_lr_ratio` is set)."""
    cls, settings = optimizer_class(t)
    if t.loraplus_lr_ratio is None:
        return cls(_decay_groups(model, t.weight_decay), lr=t.learning_rate, **settings)
    from peft.optimizers import create_loraplus_optimizer

    decay = settings.pop("weight_decay")
    optimizer = create_loraplus_optimizer(model, cls, lr=t.learning_rate, loraplus_lr_ratio=t.loraplus_lr_ratio,
                                          loraplus_lr_embedding=t.loraplus_lr_embedding, loraplus_weight_decay=decay,
                                          **settings)
    b_share = sum(p.numel() for g in optimizer.param_groups if g["lr"] == t.learning_rate * t.loraplus_lr_ratio
                  for p in g["params"])
    print(f"LoRA+: learning rate {t.learning_rate:g} for the A matrices, {t.learning_rate * t.loraplus_lr_ratio:g} "
          f"(x{t.loraplus_lr_ratio:g}) for {b_share:,} parameters of the B matrices", flush=True)
    return optimizer


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters as optimizer groups: with `train.weight_decay`, the normalization layers' weights and
    every bias apart, without decay (as transformers' Trainer, and so LLaMA-Factory, keep them): decay pulls a weight
    towards 0, and a norm's scale at 0 silences its layer. One group when every parameter decays (LoRA's A and B)."""
    exempt = {id(p) for module in model.modules() if "norm" in type(module).__name__.lower()
              for p in module.parameters(recurse=False)}
    exempt |= {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}
    trained = [p for p in model.parameters() if p.requires_grad]
    kept = [p for p in trained if id(p) in exempt]
    if not weight_decay or not kept:
        return [{"params": trained}]
    return [{"params": [p for p in trained if id(p) not in exempt]}, {"params": kept, "weight_decay": 0.0}]


def schedule_after(optimizer: torch.optim.Optimizer, t: TrainConfig, warmup: int, steps: int, done: int):
    """The learning-rate schedule of a run of `steps` steps, `done` of them taken: what the scheduler built for
    that many steps at the start would say now (its base rates are the optimizer groups' `initial_lr`)."""
    scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    with warnings.catch_warnings():  # stepping it without optimizer steps is the point here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(done):
            scheduler.step()
    return scheduler
