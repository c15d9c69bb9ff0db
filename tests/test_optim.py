"""emotune.train.optim: the optimizers and the gradient clipping run their foreach implementations on every device
(train.foreach=auto), and the update is the one PyTorch's per-tensor loop makes: bit for bit for AdamW and SGD, within
a rounding step for Adafactor."""

from __future__ import annotations

import pytest
import torch

from emotune.core.config.train import TrainConfig
from emotune.train.optim import clip_gradients, optimizer_class


def _train(optim: str, foreach: str, dtype: torch.dtype, steps: int = 4) -> tuple[list[torch.Tensor], list[float]]:
    """`steps` clipped updates of a few tensors of LoRA-like shapes with seeded gradients; their values and norms."""
    t = TrainConfig(optim=optim, foreach=foreach, weight_decay=0.01)
    start = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=start).to(dtype)) for shape in ((16, 64), (64, 16), (7,), (3, 5))]
    cls, settings = optimizer_class(t)
    optimizer = cls(params, lr=1e-2, **settings)
    grads = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads).to(dtype)
        norms.append(clip_gradients(params, 1.0, foreach == "auto"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], norms


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd", "adafactor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_gives_the_per_tensor_loop_s_update_bit_for_bit(optim, dtype):
    looped, looped_norms = _train(optim, "off", dtype)
    together, together_norms = _train(optim, "auto", dtype)
    assert looped_norms == together_norms
    if optim == "adafactor":  # its foreach branch rounds a few products differently: a rounding step at |values| < 4
        assert all(torch.allclose(a, b, rtol=0, atol=4 * torch.finfo(dtype).eps) for a, b in zip(looped, together, strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(looped, together, strict=True))


def test_auto_asks_for_foreach_where_pytorch_loops_and_leaves_fused_and_8bit_alone():
    assert optimizer_class(TrainConfig())[1]["foreach"] is True
    assert optimizer_class(TrainConfig(optim="sgd"))[1]["foreach"] is True
    assert "foreach" not in optimizer_class(TrainConfig(foreach="off"))[1]  # PyTorch's own default: a loop on a CPU
    assert optimizer_class(TrainConfig(optim="adamw_torch_fused"))[1] == {"weight_decay": 0.0, "fused": True,
                                                                       "betas": (0.9, 0.999), "eps": 1e-8}
    assert TrainConfig.model_validate({"foreach": False}).foreach == "off"  # YAML's bare `off`


def test_foreach_calls_one_operator_per_operation_not_one_per_tensor():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # AdamW reads each tensor's step count as a number either way (`_local_scalar_dense`): not counted
            Count.calls += func is not torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    def calls(foreach: str) -> int:
        params = [torch.nn.Parameter(torch.ones(4)) for _ in range(50)]
        for p in params:
            p.grad = torch.ones(4)
        cls, settings = optimizer_class(TrainConfig(foreach=foreach))
        optimizer = cls(params, lr=1e-3, **settings)
        optimizer.step()  # the first step makes the state (a zeros_like per tensor either way)
        Count.calls = 0
        with Count():
            clip_gradients(params, 1.0, foreach == "auto")
            optimizer.step()
        return Count.calls

    assert calls("auto") < 30 < 300 < calls("off")  # 50 tensors: about 8 operators each in a loop


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_8bit"])
def test_adam_settings_reach_every_adamw(optim):
    """train.adam_beta1/adam_beta2/adam_epsilon reach the AdamW the run builds (torch's, fused, bitsandbytes' 8-bit);
    at their defaults the optimizer is the one built before they existed (torch's own defaults)."""
    if optim == "adamw_8bit":
        pytest.importorskip("bitsandbytes")
    cls, settings = optimizer_class(TrainConfig(optim=optim, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6))
    group = cls([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, **settings).param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.8, 0.95), 1e-6)
    cls, settings = optimizer_class(TrainConfig(optim=optim))
    assert (settings["betas"], settings["eps"]) == ((0.9, 0.999), 1e-8)


def test_adam_settings_with_an_optimizer_without_moments_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="train.adam_beta2=0.95 sets AdamW's moments, and train.optim=sgd has none"):
        TrainConfig(optim="sgd", adam_beta2=0.95)
    TrainConfig(optim="sgd")  # the defaults are no setting


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd", "adafactor"])
def test_weight_decay_leaves_norms_and_biases_alone_in_whole_model_training(tiny_gpt2_dir, optim):
    """train.finetuning=full trains every weight: decay pulled GPT-2's LayerNorm scales (which start at 1) and every
    bias towards 0 as well. They form their own group without decay, as transformers' Trainer keeps them."""
    from transformers import AutoModelForCausalLM

    from emotune.train.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32)
    optimizer = build_optimizer(TrainConfig(optim=optim, weight_decay=0.1, finetuning="full"), model)
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    names = dict(model.named_parameters())
    assert len(decay) == len(names)
    for name in ("transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.ln_f.weight",
                 "transformer.h.0.attn.c_attn.bias", "transformer.h.1.mlp.c_fc.bias"):
        assert decay[id(names[name])] == 0.0, name
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight", "transformer.wte.weight"):
        assert decay[id(names[name])] == 0.1, name
    assert len(build_optimizer(TrainConfig(optim=optim), model).param_groups) == 1  # no decay: one group, as before


def test_a_checkpoint_with_one_decay_group_is_refused_by_name_not_with_a_traceback(tiny_gpt2_dir, tmp_path):
    """A whole-model checkpoint written when decay covered every weight (one group) cannot load into the two groups."""
    from transformers import AutoModelForCausalLM

    from emotune.core.errors import UserError
    from emotune.train import checkpoints as ckpt
    from emotune.train.optim import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir, dtype=torch.float32)
    earlier = torch.optim.AdamW([p for p in model.parameters()], lr=1e-3, weight_decay=0.1)
    optimizer = build_optimizer(TrainConfig(weight_decay=0.1, finetuning="full"), model)
    with pytest.raises(UserError, match="1 optimizer parameter group.*builds 2.*overwrite=true"):
        ckpt.load_optimizer_state(model, optimizer, earlier.state_dict(), tmp_path / "step-000002" / "optimizer.pt")
