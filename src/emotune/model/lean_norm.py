"""Gemma's RMSNorm as one autograd function while training: the module's values, less kept memory.

Gemma's RMSNorm computes in float32: `x.float() * rsqrt(mean(x.float()²) + eps) * (1 + w.float())`, cast back.
Run op by op, autograd keeps the float32 copy of its input for the backward pass: 4 bytes per element, in the
four norms of every decoder layer and the per-head query and key norms. `_GemmaRMSNorm` computes the same ops
and keeps the input as it came (bf16: 2 bytes, and often a tensor kept anyway) and one float per row; its
backward pass is RMSNorm's gradient, computed in float32 (tests/test_lean_norm.py holds it to autograd's).

A norm takes it only when the module's own forward gives bit for bit the same output as this function on a
probe input at install time (so a transformers release that changes the norm's arithmetic keeps its own
forward), and only while gradients are recorded without autocast; evaluation and generation run the module's
forward. `restore` takes the instance override away again.
"""

from __future__ import annotations

import types

import torch

NORMS = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Gemma3nRMSNorm", "Gemma4RMSNorm"}


class _GemmaRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = (xf * rstd) * (1.0 + weight.float())
        ctx.save_for_backward(x, weight, rstd)
        return out.type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad = grad.float()
        scaled = grad * (1.0 + weight.float())
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True)) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        return (grad_x.to(x.dtype) if grad_x is not None else None), grad_w, None


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return type(self).forward(self, x)
    return _GemmaRMSNorm.apply(x, self.weight, self.eps)


def _same_as_module(module: torch.nn.Module) -> bool:
    """Whether the module's own forward and `_GemmaRMSNorm` agree exactly on a probe input of its dtype."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(getattr(module, "eps", None), float):
        return False
    probe = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            return torch.equal(type(module).forward(module, probe), _GemmaRMSNorm.apply(probe, weight, module.eps))
        except Exception:  # noqa: BLE001 (a norm of another shape or signature keeps its own forward)
            return False


def install(model: torch.nn.Module) -> int:
    """Give every Gemma RMSNorm of `model` whose arithmetic this matches the lean forward; returns how many took it."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in NORMS and "forward" not in module.__dict__ and _same_as_module(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def restore(model: torch.nn.Module) -> None:
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is _forward:
            del module.forward
