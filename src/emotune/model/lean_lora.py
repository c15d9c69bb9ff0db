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

Where the base layer is a plain `torch.nn.Linear` (frozen, not quantized, no hooks) `_Linear` goes one step
further: the base layer's product, the branch, the scaled sum and the cast back are one autograd function on the
input flattened once, and the transposed weights are views made once (`_transposed`), so a layer's pass is 12 aten
calls forward and 15 backward instead of PEFT's 20 and 29 (30 with `_Branch` beside the base layer), and autograd
keeps three tensors, not five; the forward values are again PEFT's op for op, the gradients differ only in the order
bf16 sums are rounded (x's gradient from the base and the branch is summed in the function by one `addmm`, not by
autograd). Other base layers (quantized, hooked) call their own forward beside `_Branch`.

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


class _Linear(torch.autograd.Function):
    """`(base(x) + dropout(x) · Aᵀ · Bᵀ · scaling).to(base's dtype)`: PEFT's adapted linear layer over a plain, frozen
    `nn.Linear`, keeping x (flattened), the boolean mask and `x·Aᵀ`. The parameters are held on `ctx`, not saved
    through `save_for_backward`: they outlive the pass anyway, and under gradient checkpointing every saved tensor
    costs a `detach` per recomputation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                settings: tuple[float, float, tuple[torch.Tensor, ...]]) -> torch.Tensor:
        p, scaling, (weight_t, a_t, b_t) = settings  # the transposed views: `_transposed`
        flat = x.reshape(-1, x.shape[-1])
        # F.linear's own products for a 2-d input (addmm with a bias, mm without), on the views made once
        result = flat.mm(weight_t) if bias is None else torch.addmm(bias, flat, weight_t)
        keep = None
        if p > 0:
            keep = torch.empty(flat.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p)  # as CPU dropout draws
            dropped = flat * _scale(keep, p, a.dtype)
        else:
            dropped = flat.to(a.dtype)
        low = dropped.mm(a_t)
        summed = result + low.mm(b_t) * scaling  # PEFT adds in the wider dtype and casts back
        out = summed.to(result.dtype)
        ctx.save_for_backward(flat, keep, low)
        ctx.weights, ctx.p, ctx.scaling, ctx.shape, ctx.wide = (weight, a, b), p, scaling, x.shape, summed.dtype
        # as F.linear returns a product of a 3-d input: not a view (autograd forbids in-place changes of a Function's views)
        return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, keep, low = ctx.saved_tensors
        weight, a, b = ctx.weights
        grad = grad.reshape(-1, grad.shape[-1])
        # PEFT's graph: the base gets the gradient as it came; the branch gets it in the sum's dtype, times the scaling
        grad_branch = (grad.to(ctx.wide) * ctx.scaling).to(a.dtype)
        grad_b = grad_branch.t().mm(low) if ctx.needs_input_grad[4] else None
        grad_low = grad_branch.mm(b)
        scale = _scale(keep, ctx.p, a.dtype) if keep is not None else None
        grad_a = None
        if ctx.needs_input_grad[3]:
            grad_a = grad_low.t().mm(flat * scale if scale is not None else flat.to(a.dtype))
        grad_x = None
        if ctx.needs_input_grad[0]:
            branch_x = grad_low.mm(a)
            branch_x = (branch_x * scale if scale is not None else branch_x).to(flat.dtype)
            grad_x = torch.addmm(branch_x, grad, weight).view(ctx.shape)  # the base's product and the branch's, summed
        return grad_x, None, None, grad_a, grad_b, None


def _transposed(module: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`t.t()` of each tensor, as views made once and kept on `module` (the optimizer's in-place updates show through
    them): one `t` call per product fewer in every pass. Made again when a tensor was replaced, or its storage was
    (`module.to(...)` swaps `.data`); a compiled region (train.compile) transposes in its own graph."""
    if torch.compiler.is_compiling():
        return tuple(t.t() for t in tensors)
    cached = module.__dict__.get("_lean_transposed")
    if cached is not None and all(
            kept is t and view.data_ptr() == t.data_ptr() and view.shape == t.shape[::-1] and view.dtype == t.dtype
            for kept, view, t in zip(cached[0], cached[1], tensors, strict=True)):
        return cached[1]
    with torch.no_grad():
        views = tuple(t.detach().t() for t in tensors)
    module.__dict__["_lean_transposed"] = (tensors, views)
    return views


def _scale(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """What dropout multiplies by: 1 / (1 - p) where kept, 0 elsewhere (PyTorch's CPU dropout computes it so). In the
    default dtype (fp32 adapters) one division of the boolean mask, which promotes it inside the same kernel: the
    same values as the cast and division, one operator fewer."""
    if dtype == torch.get_default_dtype():
        return keep.div(1 - p)
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


def _plain_base(layer) -> bool:
    """Whether `layer`'s base is a frozen `nn.Linear` that only computes its product (no hooks, no own forward), so
    `_Linear` may compute it."""
    base = layer.get_base_layer()
    return (type(base) is torch.nn.Linear and "forward" not in base.__dict__ and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad) and not _hooked(base))


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's `Linear.forward` for the case it covers, the base layer's product by its own forward; PEFT's own for
    everything else."""
    name = _lean_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    branch = _Branch.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, _dropout_p(self, name))
    # PEFT adds in the wider dtype and casts back: result + branch * scaling, then .to(result.dtype)
    return (result + branch * self.scaling[name]).to(result.dtype)


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The same with the base layer's product inside the one autograd function (`_Linear`)."""
    name = _lean_adapter(self, x, args, kwargs)
    base = self.base_layer
    if name is None or _hooked(base):  # a hook added after install (offloading, a probe) runs with the base's forward
        return _forward(self, x, *args, **kwargs)
    weight, a, b = base.weight, self.lora_A[name].weight, self.lora_B[name].weight
    return _Linear.apply(x, weight, base.bias, a, b,
                         (_dropout_p(self, name), self.scaling[name], _transposed(self, weight, a, b)))


def _lean_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter when this call is what the lean forwards cover; None otherwise."""
    adapters = self.active_adapters
    if (args or kwargs or not (self.training and torch.is_grad_enabled()) or self.disable_adapters or self.merged
            or len(adapters) != 1 or adapters[0] not in self.lora_A or adapters[0] in self.lora_variant
            or torch.is_autocast_enabled(x.device.type) or not getattr(self, "cast_input_dtype_enabled", True)):
        return None
    return adapters[0]


def _dropout_p(self, name: str) -> float:
    dropout = self.lora_dropout[name]
    return dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0


def install(model: torch.nn.Module) -> int:
    """Give every covered LoRA layer of `model` the lean forward; returns how many layers took it."""
    count = 0
    for module in model.modules():
        if _covered(module):
            module.forward = types.MethodType(_fused_forward if _plain_base(module) else _forward, module)
            count += 1
    return count


def _lean(module: torch.nn.Module):
    """The lean forward `module` runs (`_forward` or `_fused_forward`), or None."""
    bound = module.__dict__.get("forward")
    return bound.__func__ if isinstance(bound, types.MethodType) and bound.__func__ in (_forward, _fused_forward) else None


def restore(model: torch.nn.Module) -> None:
    """Take the lean forward away again: PEFT's class forward answers every call."""
    for module in model.modules():
        if _lean(module) is not None:
            del module.forward
            module.__dict__.pop("_lean_transposed", None)


def describe(model: torch.nn.Module) -> dict:
    """What run.json records: how many LoRA layers run the lean forward (`fused_base`: of them, those that compute
    the base layer's product in the same function), and how many PEFT's own."""
    from peft.tuners.lora.layer import LoraLayer

    kinds = [_lean(m) for m in model.modules() if isinstance(m, LoraLayer)]
    lean = sum(kind is not None for kind in kinds)
    return {"layers": lean, "fused_base": sum(kind is _fused_forward for kind in kinds), "own_forward": len(kinds) - lean}
