"""The LoRA branch of a linear layer as one autograd function while training: PEFT's values, less kept memory.

PEFT computes an adapted linear layer as `base(x) + lora_B(lora_A(dropout(x.to(fp32)))) * scaling` in separate
autograd ops, so for the backward pass every adapted layer keeps its own float32 copy of its input after dropout,
and on a CPU the float32 dropout mask as well: 8 bytes per input element per layer, for q, k and v (one input)
three times over. For Gemma 3 270M in bf16 that was more than half of all a training pass keeps
(docs/training.md). `_Branch` computes the same products and keeps, instead, the layer's input as it came (bf16;
one tensor for q/k/v, as for gate/up), the dropout mask as booleans and the rank-r product `x·Aᵀ`; the backward
pass rebuilds the dropped input from those. The forward values are PEFT's op for op, and on a CPU the masks are
drawn as PyTorch's CPU dropout draws them (the same Bernoulli draws from the same generator), so a seeded run gives
the same losses; only the gradients' float rounding differs (tests/test_lean_lora.py). On GPUs dropout's fused
kernel draws its masks differently; ours are still independent Bernoulli(1 - p) per element.

Only what this covers takes it: a plain `peft.tuners.lora.Linear` (no DoRA or other variant, no quantized base
layer, no LoRA bias) with one active adapter, neither merged nor disabled, dropout or none, called with the input
alone while gradients are recorded and no autocast is on. Anything else (evaluation, generation, mixed-adapter
batches) runs PEFT's own forward, which stays on the class; `restore` takes the instance override away again.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class _Branch(torch.autograd.Function):
    """`dropout(x) · Aᵀ · Bᵀ` in A's dtype, keeping x, the boolean mask and `x·Aᵀ` for the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
        keep = None
        if p > 0:
            keep = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p)  # as CPU dropout draws
            dropped = x * _scale(keep, p, a.dtype)  # x promoted to A's dtype (float32) by the product, as PEFT casts
        else:
            dropped = x.to(a.dtype)
        low = F.linear(dropped, a)
        ctx.save_for_backward(x, keep, a, b, low)
        ctx.p = p
        return F.linear(low, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, keep, a, b, low = ctx.saved_tensors
        grad = grad.to(a.dtype)
        flat_grad, flat_low = grad.reshape(-1, grad.shape[-1]), low.reshape(-1, low.shape[-1])
        grad_b = flat_grad.t().mm(flat_low) if ctx.needs_input_grad[2] else None
        grad_low = grad.matmul(b)
        scale = _scale(keep, ctx.p, a.dtype) if keep is not None else None
        grad_a = None
        if ctx.needs_input_grad[1]:
            dropped = x * scale if scale is not None else x.to(a.dtype)
            grad_a = grad_low.reshape(-1, grad_low.shape[-1]).t().mm(dropped.reshape(-1, dropped.shape[-1]))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_low.matmul(a)
            grad_x = (grad_x * scale if scale is not None else grad_x).to(x.dtype)
        return grad_x, grad_a, grad_b, None


def _scale(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """What dropout multiplies by: 1 / (1 - p) where kept, 0 elsewhere (PyTorch's CPU dropout computes it so)."""
    return keep.to(dtype).div_(1 - p)


def _covered(layer) -> bool:
    """Whether `layer` is a PEFT LoRA linear layer of the plain kind `_Branch` computes (checked once, at install)."""
    from peft.tuners.lora.layer import Linear

    if type(layer) is not Linear or not isinstance(layer.get_base_layer(), torch.nn.Linear):
        return False
    if (getattr(layer, "fan_in_fan_out", False) or any(getattr(layer, "lora_bias", {}).values())
            or getattr(layer, "lora_variant", {})):
        return False
    return all(type(d) in (torch.nn.Dropout, torch.nn.Identity) for d in layer.lora_dropout.values())


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's `Linear.forward` for the case it covers; PEFT's own for everything else."""
    adapters = self.active_adapters
    if (args or kwargs or not (self.training and torch.is_grad_enabled()) or self.disable_adapters or self.merged
            or len(adapters) != 1 or adapters[0] not in self.lora_A or adapters[0] in self.lora_variant
            or torch.is_autocast_enabled(x.device.type) or not getattr(self, "cast_input_dtype_enabled", True)):
        return type(self).forward(self, x, *args, **kwargs)
    name = adapters[0]
    dropout = self.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0
    result = self.base_layer(x)
    branch = _Branch.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, p)
    # PEFT adds in the wider dtype and casts back: result + branch * scaling, then .to(result.dtype)
    return (result + branch * self.scaling[name]).to(result.dtype)


def install(model: torch.nn.Module) -> int:
    """Give every covered LoRA layer of `model` the lean forward; returns how many layers took it."""
    count = 0
    for module in model.modules():
        if _covered(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def restore(model: torch.nn.Module) -> None:
    """Take the lean forward away again: PEFT's class forward answers every call."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), types.MethodType) and module.__dict__["forward"].__func__ is _forward:
            del module.forward


def describe(model: torch.nn.Module) -> dict:
    """What run.json records: how many LoRA layers run the lean forward, and how many PEFT's own."""
    from peft.tuners.lora.layer import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    lean = sum(isinstance(m.__dict__.get("forward"), types.MethodType) and m.__dict__["forward"].__func__ is _forward
               for m in layers)
    return {"layers": lean, "own_forward": len(layers) - lean}
