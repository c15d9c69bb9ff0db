"""`train.compile`: regional compilation of the decoder layers while training, with eager as the fallback.

A decoder layer is the block a model repeats, so compiling each layer (`nn.Module.compile`, in place: the module
tree, the adapter's names and emotune's lean forwards stay as they are) gives one compiled graph per kind of layer
(Gemma's sliding-window and global layers, Gemma 4's layers that share keys and values) instead of one for the whole
model, and the rest of the model (embeddings, the loss) runs eager. Accelerate's `compile_regions` does the same on a
shallow copy of the model and compiles the rest too; emotune keeps its model object, so it compiles the layers itself.

Gradient checkpointing: transformers wraps the layer's `forward` in the checkpoint, so the checkpoint is traced inside
the compiled region; its output-capturing hooks set a context variable there, a side effect that stops the trace
unless dynamo is told not to replay forward side effects in the recomputation
(`skip_fwd_side_effects_in_bwd_under_checkpoint`), which is what eager checkpointing with hooks that only record
outputs amounts to. LoRA dropout inside a compiled layer draws its masks with the compiler's random numbers, not
eager's: the same distribution, other masks (with dropout 0 the losses equal eager's within float rounding,
tests/test_compiling.py).

`auto` is on for CUDA and ROCm GPUs where Triton is importable, and off on a CPU: there compiling took about 40 s per
kind of layer on 2 (shared) cores for a 2-layer test model, and a short CPU run's layers are too small for the
compiled kernels to win that back. A failed compilation (no C++ compiler or Triton, a dynamo or inductor error) is
caught at the first call of a layer: training says so in one sentence, every layer runs eager from then on, and
run.json's train stage records why. Evaluation and generation after training run the eager layers (`restore`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError
from emotune.model.text import language_model
from emotune.runtime.oom import is_out_of_memory


def check(t: TrainConfig, device: torch.device) -> None:
    """Refuse, before any weights load, a compile setting that cannot run."""
    if t.compile == "on" and t.fsdp:
        raise UserError("train.compile=on with train.fsdp=true: emotune compiles the decoder layers in place, which "
                        "FSDP2's sharded layers do not support here; set train.compile=off (or auto) with FSDP.")


def wanted(t: TrainConfig, device: torch.device) -> tuple[bool, str]:
    """Whether training compiles the decoder layers, and why (what run.json says)."""
    if t.compile == "off":
        return False, "train.compile=off"
    if t.fsdp:
        return False, "off under FSDP"
    if t.compile == "on":
        return True, "train.compile=on"
    if device.type != "cuda":
        return False, f"auto: off on {device.type} (compiling takes longer than a short run there gains)"
    if importlib.util.find_spec("triton") is None:
        return False, "auto: off, Triton is not installed"
    return True, "auto: on (a GPU with Triton)"


def install(model: torch.nn.Module, t: TrainConfig, device: torch.device,
            record: Callable[[str, object], None] | None = None) -> dict:
    """Compile each decoder layer of `model` in place when `train.compile` asks for it; returns (and records under
    `compile`) what was done: {"layers": n compiled or 0, "reason": ...}, later {"fallback": why} on a failure."""
    on, reason = wanted(t, device)
    layers = _decoder_layers(model) if on else []
    state = {"setting": t.compile, "layers": len(layers), "reason": reason}
    if on and not layers:
        state["reason"] = f"{reason}, but no list of decoder layers was found: eager"
    if layers:
        # transformers' output-capturing hooks set a context variable inside the checkpointed forward; replaying it
        # in the recomputation is not needed (it only records outputs), and without this the trace stops there.
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        # one entry per kind of layer and input shape; the default (8) would leave a deep model's later layers eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
        for layer in layers:
            layer.compile()
            layer._compiled_call_impl = _guarded(layer, layer._compiled_call_impl, layers, state, record)
    if record is not None:
        record("compile", dict(state))
    return state


def restore(model: torch.nn.Module) -> None:
    """The layers eager again (evaluation and generation after training)."""
    for layer in _decoder_layers(model):
        layer._compiled_call_impl = None


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(language_model(model), "layers", None) if callable(getattr(model, "get_decoder", None)) else None
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _guarded(layer: torch.nn.Module, compiled: Callable, layers: list[torch.nn.Module], state: dict,
             record: Callable[[str, object], None] | None) -> Callable:
    """`compiled`, or, when compiling fails, eager for every layer from then on (said once, and recorded)."""
    def call(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 (compiler failures fall back; out-of-memory and the rest re-raised)
            if is_out_of_memory(err) or not _compile_failure(err):
                raise
            for each in layers:
                each._compiled_call_impl = None
            why = _first_line(err)
            print(f"train.compile: compiling the decoder layers failed ({why}); training runs them eager.", flush=True)
            state.update(layers=0, fallback=why)
            if record is not None:
                record("compile", dict(state))
            return layer._call_impl(*args, **kwargs)
    return call


def _compile_failure(err: BaseException) -> bool:
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    return isinstance(err, (TorchDynamoException, InductorError))


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
