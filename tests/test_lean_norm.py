"""emotune.model.lean_norm: Gemma's RMSNorm as one autograd function gives the module's forward values, gradients within
float rounding of autograd's (inputs and, when trained, the weight), keeps less for the backward pass, and is
only put on norms whose arithmetic it matches exactly."""

from __future__ import annotations

import pytest
import torch

from emotune.model import lean_lora, lean_norm
from test_lean_lora import _loss_and_grads, _model, _saved_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_loss_and_gradients_within_rounding(dtype, checkpointing):
    model = _model(dtype, dropout=0.1)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    own_loss, own_grads = _loss_and_grads(model)
    assert lean_norm.install(model) == 13  # 2 layers x (4 norms + query and key norms) + the final norm
    lean_loss, lean_grads = _loss_and_grads(model)
    assert torch.equal(lean_loss, own_loss)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, grad in own_grads.items():
        assert torch.allclose(lean_grads[name], grad, rtol=tolerance, atol=tolerance * grad.abs().max()), name


def _gemma3_norm():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    return Gemma3RMSNorm(16, eps=1e-6)


def _gemma4_norm(with_scale: bool = True):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    return Gemma4RMSNorm(16, eps=1e-6, with_scale=with_scale)


def _gemma3n_norm():
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    return Gemma3nRMSNorm(16, eps=1e-6)


@pytest.mark.parametrize("make", [_gemma3_norm, _gemma4_norm, lambda: _gemma4_norm(with_scale=False), _gemma3n_norm],
                         ids=["gemma3", "gemma4", "gemma4-without-scale", "gemma3n"])
def test_weight_gradient_when_the_norm_trains(make):
    """Gemma 1-3 multiply by (1 + weight) after rsqrt; Gemma 3n and 4 by the weight after pow(-0.5), or by nothing."""
    norm = make()
    params = list(norm.parameters())
    with torch.no_grad():
        for weight in params:
            weight.normal_()
    x = torch.randn(2, 5, 16, requires_grad=True)
    upstream = torch.randn(2, 5, 16)
    own_out = norm(x)
    (own_out * upstream).sum().backward()
    own = [x.grad.clone()] + [w.grad.clone() for w in params]
    x.grad = None
    for weight in params:
        weight.grad = None
    assert lean_norm.install(norm) == 1
    out = norm(x)
    assert torch.equal(out, own_out)
    (out * upstream).sum().backward()
    for lean, reference in zip([x.grad] + [w.grad for w in params], own, strict=True):
        assert torch.allclose(lean, reference, atol=1e-5)


def test_keeps_less_for_the_backward_pass_together_with_lean_lora():
    model = _model(torch.bfloat16, dropout=0.05)
    lean_lora.install(model)
    before = _saved_bytes(model)
    lean_norm.install(model)
    assert _saved_bytes(model) < 0.85 * before


def test_only_norms_it_matches_and_restore():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    class Gemma3RMSNormChanged(Gemma3RMSNorm):  # another arithmetic under a known name keeps its own forward
        def forward(self, x):
            return super().forward(x) * 2

    Gemma3RMSNormChanged.__name__ = "Gemma3RMSNorm"
    assert lean_norm.install(Gemma3RMSNormChanged(8)) == 0
    model = _model()
    lean_norm.install(model)
    lean_norm.restore(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_a_frozen_weight_is_cast_once_and_a_replaced_one_in_every_call():
    """A frozen weight's float32 multiplier is made at install and kept (fewer casts per pass) with the module's values;
    a weight replaced since (a trained or reloaded one) is cast in the call again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Casts.count += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    def casts(norm) -> int:
        Casts.count = 0
        with Casts():
            out = norm(x)
            out.sum().backward()
        return Casts.count

    norm = _gemma3_norm().to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    assert lean_norm.install(norm) == 1
    assert casts(norm) == 3  # forward: x up, out down; backward: the gradient down (x and the gradient are promoted
    # inside the products with float32 tensors); the weight: none
    assert torch.equal(norm(x), type(norm).forward(norm, x))
    norm.weight = torch.nn.Parameter(norm.weight.detach() + 1, requires_grad=False)
    assert casts(norm) == 4  # the weight cast in the call (its backward reuses it)
    assert torch.equal(norm(x), type(norm).forward(norm, x))
    lean_norm.restore(norm)
    assert "_lean_factor" not in norm.__dict__
