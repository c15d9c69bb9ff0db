"""emotune.model.lean_lora: the LoRA branch as one autograd function gives PEFT's forward values (dropout masks included,
on a CPU), its gradients within float rounding (with and without gradient checkpointing, bf16 and fp32), keeps
far less for the backward pass, and leaves everything it does not cover to PEFT."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from emotune.model import lean_lora


def _model(dtype: torch.dtype = torch.float32, dropout: float = 0.1, **lora):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(dtype)
    model.config.use_cache = False
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                                               **lora))
    with torch.no_grad():  # B starts at zero; random B makes every gradient (A's, the input's) non-zero
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    adapted.train()
    return adapted


def _loss_and_grads(model, seed: int = 7):
    ids = torch.randint(1, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_loss_as_peft_and_gradients_within_rounding(dtype, dropout, checkpointing):
    model = _model(dtype, dropout)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_loss, peft_grads = _loss_and_grads(model)
    assert lean_lora.install(model) == 14  # 7 linear layers x 2 decoder layers
    lean_loss, lean_grads = _loss_and_grads(model)
    assert torch.equal(lean_loss, peft_loss)  # the same ops forward, and the same dropout masks
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name, grad in peft_grads.items():
        assert grad.abs().sum() > 0, name
        assert torch.allclose(lean_grads[name], grad, rtol=tolerance, atol=tolerance * grad.abs().max()), name


def test_dropout_masks_differ_between_layers_and_steps():
    """One mask per layer and call, as PEFT draws them: a shared or frozen mask would change the training."""
    model = _model(dropout=0.5)
    lean_loss_1, _ = _loss_and_grads(model, seed=1)
    lean_loss_2, _ = _loss_and_grads(model, seed=2)
    assert lean_lora.install(model)
    assert torch.equal(_loss_and_grads(model, seed=1)[0], lean_loss_1)
    assert torch.equal(_loss_and_grads(model, seed=2)[0], lean_loss_2)
    assert not torch.equal(lean_loss_1, lean_loss_2)


def _saved_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in storages:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    ids = torch.randint(1, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def test_keeps_far_less_for_the_backward_pass():
    model = _model(torch.bfloat16, dropout=0.05)
    peft_bytes = _saved_bytes(model)
    lean_lora.install(model)
    lean_bytes = _saved_bytes(model)
    assert lean_bytes < 0.7 * peft_bytes, (lean_bytes, peft_bytes)


def test_uncovered_layers_and_calls_run_peft():
    model = _model(use_dora=True)
    assert lean_lora.install(model) == 0  # DoRA is a LoRA variant: PEFT's forward
    model = _model()
    lean_lora.install(model)
    ids = torch.randint(1, 64, (2, 10))
    lean = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(lean) == 14
    model.eval()
    with torch.no_grad():
        evaluated = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    lean_lora.restore(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, evaluated)
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, base)
    assert not torch.equal(evaluated, base)


def _aten_calls(model) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        _loss_and_grads(model)
    return Count.calls


def test_plain_base_layers_run_in_the_same_function_with_fewer_operator_calls():
    """A frozen nn.Linear base is computed inside `_Linear`: the same loss, fewer aten calls than base + `_Branch`;
    a base layer with a hook keeps its own forward (the hook must run)."""
    fused, hooked = _model(torch.bfloat16), _model(torch.bfloat16)
    calls = []
    for m in hooked.modules():
        if type(m) is torch.nn.Linear and "base_layer" not in m.__dict__ and m is not hooked.get_output_embeddings():
            m.register_forward_hook(lambda module, args, out: calls.append(1))
    assert lean_lora.install(fused) == lean_lora.install(hooked) == 14
    assert lean_lora.describe(fused) == {"layers": 14, "fused_base": 14, "own_forward": 0}
    assert lean_lora.describe(hooked)["fused_base"] == 0
    assert torch.equal(_loss_and_grads(fused)[0], _loss_and_grads(hooked)[0])
    assert len(calls) >= 14  # every hooked base layer ran its forward
    fused_calls, branch_calls = _aten_calls(fused), _aten_calls(hooked)
    assert branch_calls - fused_calls >= 10 * 14, (fused_calls, branch_calls)  # 20 -> 16 forward, ~32 -> ~24 backward


def test_transposed_views_follow_in_place_updates_and_replaced_storage():
    """`_Linear` multiplies by transposed views made once: an optimizer's in-place update shows through them, and a
    weight whose storage was swapped (`module.to(...)` sets `.data`) gets new views, so the loss stays PEFT's."""
    model = _model(torch.bfloat16)
    lean_lora.install(model)
    _loss_and_grads(model)  # the views are made
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.25)  # in place, as AdamW updates
            elif "proj" in name:
                param.data = param.data * 1.5  # a new storage behind the same Parameter
    lean_loss, _ = _loss_and_grads(model)
    lean_lora.restore(model)
    peft_loss, _ = _loss_and_grads(model)
    assert torch.equal(lean_loss, peft_loss)


def test_fused_layers_call_fewer_operators_than_peft():
    """14 adapted layers (2 decoder layers x 7): PEFT's forward and backward against `_Linear`'s (12 calls forward,
    ~16 backward per layer, the transposed weights made once)."""
    model = _model(torch.bfloat16)
    peft_calls = _aten_calls(model)
    lean_lora.install(model)
    _aten_calls(model)  # the first pass makes the transposed views
    assert peft_calls - _aten_calls(model) >= 17 * 14, peft_calls
