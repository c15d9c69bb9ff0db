"""Gemma's RMSNorm as one autograd function while training: the module's values, less kept memory.

Gemma's RMSNorm computes in float32: `x.float() * rsqrt(mean(x.float()²) + eps) * (1 + w.float())`, cast back;
Gemma 3n's and 4's compute `x.float() * pow(mean(x.float()²) + eps, -0.5) * w.float()`, some without a weight
(`with_scale=False`: Gemma 4's value norms and its embedding projection norm).
Run op by op, autograd keeps the float32 copy of its input for the backward pass: 4 bytes per element, in the
four norms of every decoder layer and the per-head query and key norms. `_GemmaRMSNorm` computes the same ops
and keeps the input as it came (bf16: 2 bytes, and often a tensor kept anyway) and one float per row; its
backward pass is RMSNorm's gradient, computed in float32 (tests/test_lean_norm.py holds it to autograd's). A frozen
weight's float32 multiplier (`1 + w` or `w`) is cast once at install and kept, not in every call and backward.

A norm takes it only when the module's own forward gives bit for bit the same output as this function on a
probe input at install time (so a transformers release that changes the norm's arithmetic keeps its own
forward), and only while gradients are recorded without autocast; evaluation and generation run the module's
forward. `restore` takes the instance override away again.
"""

from __future__ import annotations

import types

import torch

NORMS = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Gemma3nRMSNorm", "Gemma4RMSNorm"}
SCALE_ONLY = {"Gemma3nRMSNorm", "Gemma4RMSNorm"}
"""Norms that multiply by the weight itself (not 1 + weight) and take the root by `pow(·, -0.5)`."""


class _GemmaRMSNorm(torch.autograd.Function):
    """`factor`: what the normed input is multiplied by, `offset + weight.float()`, when the caller has it already
    (a frozen weight's, computed once: `_factor`); None computes it here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, by_pow: bool,
                factor: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float()
        mean_squared = xf.pow(2).mean(-1, keepdim=True) + eps
        rstd = torch.pow(mean_squared, -0.5) if by_pow else torch.rsqrt(mean_squared)
        out = xf * rstd
        if weight is not None:
            factor = factor if factor is not None else _multiplier(weight, offset)
            out = out * factor
        ctx.save_for_backward(x, weight, rstd)
        ctx.factor = factor  # a frozen weight's is held by its module anyway; a trained one's is this call's own
        return out.type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        # x (bf16) times the float32 rstd promotes inside the one kernel: x.float() * rstd's values, one call fewer;
        # the gradient likewise where a weight scales it
        normed = x * rstd
        scaled = grad * ctx.factor if weight is not None else grad.float()
        grad_x = None
        if ctx.needs_input_grad[0]:  # rstd * (scaled - normed * mean(scaled * normed)), the subtraction in one addcmul
            inner = torch.addcmul(scaled, normed, (scaled * normed).mean(-1, keepdim=True), value=-1)
            grad_x = (rstd * inner).to(x.dtype)
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (grad.float() * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


def _multiplier(weight: torch.Tensor, offset: float) -> torch.Tensor:
    return offset + weight.float() if offset else weight.float()


def _factor(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """A frozen weight's multiplier, cast once at install instead of in every call, recomputation and backward (the
    same float32 values); None for a trained weight, or when the weight was replaced since. Read-only here: a compiled
    layer traces this without side effects (emotune.train.compiling)."""
    cached = module.__dict__.get("_lean_factor")
    return cached[1] if cached is not None and cached[0] is weight else None


def _arithmetic(module: torch.nn.Module) -> tuple[torch.Tensor | None, float, float, bool] | None:
    """(weight or None, eps, weight offset, root by pow) of a Gemma norm; None for a module of another shape."""
    scale_only = type(module).__name__ in SCALE_ONLY
    eps = getattr(module, "variance_epsilon" if scale_only else "eps", None)
    weight = getattr(module, "weight", None)
    if not isinstance(eps, float) or (weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1)):
        return None
    if weight is None and not (scale_only and getattr(module, "with_scale", True) is False):
        return None
    return weight, eps, 0.0 if scale_only else 1.0, scale_only


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return type(self).forward(self, x)
    weight, eps, offset, by_pow = _arithmetic(self)
    return _GemmaRMSNorm.apply(x, weight, eps, offset, by_pow, _factor(self, weight) if weight is not None else None)


def _same_as_module(module: torch.nn.Module) -> bool:
    """Whether the module's own forward and `_GemmaRMSNorm` agree exactly on a probe input of its dtype."""
    arithmetic = _arithmetic(module)
    if arithmetic is None:
        return False
    weight, eps, offset, by_pow = arithmetic
    width = weight.shape[0] if weight is not None else 8
    anchor = weight if weight is not None else next(iter(module.buffers()), torch.empty(0))
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(anchor.device, anchor.dtype)
    with torch.no_grad():
        try:
            return torch.equal(type(module).forward(module, probe), _GemmaRMSNorm.apply(probe, weight, eps, offset, by_pow))
        except Exception:  # noqa: BLE001 (a norm of another shape or signature keeps its own forward)
            return False


def install(model: torch.nn.Module) -> int:
    """Give every Gemma RMSNorm of `model` whose arithmetic this matches the lean forward; returns how many took it."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in NORMS and "forward" not in module.__dict__ and _same_as_module(module):
            module.forward = types.MethodType(_forward, module)
            weight, _, offset, _ = _arithmetic(module)
            if weight is not None and not weight.requires_grad:  # frozen while training (LoRA): its cast, once
                with torch.no_grad():
                    module.__dict__["_lean_factor"] = (weight, _multiplier(weight, offset))
            count += 1
    return count


def restore(model: torch.nn.Module) -> None:
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is _forward:
            del module.forward
        module.__dict__.pop("_lean_factor", None)


def describe(model: torch.nn.Module) -> dict:
    """What run.json records: how many Gemma norms run the lean forward, and those that keep their own (by class)."""
    lean, own = 0, {}
    for module in model.modules():
        if type(module).__name__ not in NORMS:
            continue
        bound = module.__dict__.get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is _forward:
            lean += 1
        else:
            own[type(module).__name__] = own.get(type(module).__name__, 0) + 1
    return {"norms": lean, "own_forward": own}
