"""How training spreads over processes: the Accelerator, FSDP2 settings and the wrapped model.

One process, DDP (`torchrun` / `accelerate launch`) or FSDP2 (`train.fsdp=true`, or `accelerate launch
--use_fsdp --fsdp_version 2`). The training loop (emotune.train.loop) calls these once, before its first step.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env
from transformers import PreTrainedModel

from emotune.core.config.train import TrainConfig
from emotune.core.errors import UserError

FSDP1_REFUSED = ("accelerate launch asks for FSDP version 1; emotune trains with FSDP2 only. Pass --fsdp_version 2 "
                 "(or fsdp_version: 2 in the accelerate config), or set train.fsdp=true and launch with torchrun.")


def make_accelerator(t: TrainConfig, model: PreTrainedModel, tracker_dir: Path
                 ) -> tuple[Accelerator, FullyShardedDataParallelPlugin | None]:
    """The accelerator, and the FSDP2 settings when training sharded (None: one process, or DDP)."""
    for tracker in t.report_to:
        if not _tracker_installed(tracker):
            raise UserError(f"train.report_to lists `{tracker}`, which is not installed. Install it "
                            f"(pip install {tracker}) or remove it from train.report_to.")
    cpu = model.device.type == "cpu"
    plugin = _fsdp_plugin(t, cpu)
    # Mixed precision is handled in this module (autocast only where needed, see emotune.runtime.device.mixed_precision), so
    # Accelerate keeps its default; it would otherwise refuse a second training in the same process.
    # DDP keeps every gradient local (no_sync) and emotune averages them once all processes finished the step's
    # passes (`average_gradients`), so an out-of-memory error on one process can be agreed on first (emotune.train.recovery).
    # Buffer broadcasting is off for the same reason: it is a collective at the start of every forward pass,
    # and a language model's buffers (rotary frequencies, scales) are constants anyway.
    accelerator = Accelerator(cpu=cpu, log_with=list(t.report_to) or None, project_dir=str(tracker_dir),
                              fsdp_plugin=plugin, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise UserError(FSDP1_REFUSED)
    return accelerator, accelerator.state.fsdp_plugin if accelerator.is_fsdp2 else plugin


def fsdp_requested(t: TrainConfig) -> bool:
    """Whether FSDP2 is asked for: `train.fsdp`, or `accelerate launch --use_fsdp` (on one process it is not used)."""
    return t.fsdp or parse_flag_from_env("ACCELERATE_USE_FSDP")


def _fsdp_plugin(t: TrainConfig, cpu: bool) -> FullyShardedDataParallelPlugin | None:
    """FSDP2 settings from `train.fsdp`, else from `accelerate launch --use_fsdp` (its FSDP_* environment)."""
    launcher = parse_flag_from_env("ACCELERATE_USE_FSDP")
    if not fsdp_requested(t):
        return None
    processes = PartialState(cpu=cpu).num_processes
    if processes == 1:  # under `accelerate launch` Accelerate decides (FSDP on one GPU, e.g. to offload to CPU)
        if not launcher:
            print("train.fsdp=true on a single process: nothing to shard across, so training runs as a plain "
                  "single-process run.", flush=True)
        return None
    if t.fsdp:  # each decoder layer (the model's `_no_split_modules`) is one unit, re-gathered for backward
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
    else:
        plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise UserError(FSDP1_REFUSED)
    if PartialState().is_main_process:
        print(f"FSDP2 over {processes} processes ({'train.fsdp' if t.fsdp else 'accelerate launch config'}): "
              f"wrap policy {getattr(plugin.auto_wrap_policy, '__name__', plugin.auto_wrap_policy)}, reshard after "
              f"forward {plugin.reshard_after_forward}, CPU offload {type(plugin.cpu_offload).__name__ == 'CPUOffloadPolicy'}",
              flush=True)
    return plugin


def refuse_tied_modules_to_save(model: PreTrainedModel, modules_to_save: list[str] | None) -> None:
    """A `modules_to_save` copy of an embedding tied to the output layer leaves the tied weight in two
    FSDP units, which torch refuses at the first forward; say so before any weight is sharded."""
    embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
    if output is None or embeddings.weight is not output.weight:
        return
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is embeddings or module is output}
    clash = [name for name in modules_to_save or [] if name.rsplit(".", 1)[-1] in names]
    if clash:
        raise UserError(f"lora.modules_to_save={clash} copies an embedding that {type(model).__name__} ties to its output "
                        "layer, and FSDP2 cannot shard a tied weight split across units. Leave it out of "
                        "lora.modules_to_save, or train without FSDP (drop train.fsdp / --use_fsdp).")


def fsdp_dtypes(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> dict[str, torch.dtype]:
    """FSDP2 needs one dtype across the trainable parameters of a shard unit. LoRA adapters are fp32
    over a bf16 base (PEFT upcasts them), which is fine: frozen weights may differ. A `modules_to_save`
    copy keeps the base dtype, though; then the trainable weights are upcast to fp32 and computed in
    the base dtype (the usual FSDP mixed-precision recipe, as Accelerate's own). Returns the original
    dtypes of the upcast weights, which the saved adapter keeps, as a single process's would."""
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if len({p.dtype for p in trainable.values()}) == 1:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    upcast = {name: p.dtype for name, p in trainable.items() if p.dtype != torch.float32}
    for name in upcast:
        trainable[name].data = trainable[name].data.float()
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=next(iter(upcast.values())),
                                                         reduce_dtype=torch.float32)
    return upcast


def prepare(accelerator: Accelerator, model, optimizer, fsdp: FullyShardedDataParallelPlugin | None
             ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """(the model to call, its trainable parameters). DDP wraps the model when launched on several
    processes; FSDP2 shards model and optimizer together, in place, replacing every parameter with a
    DTensor, so the trainable ones are listed again afterwards."""
    if fsdp is None:
        wrapped = accelerator.prepare_model(model)
    else:
        if accelerator.distributed_type != DistributedType.FSDP:
            # Accelerate switches to FSDP only on GPU-like process groups (accelerate/state.py) and would
            # run DDP on CPUs, where PyTorch's fully_shard works too (gloo). So FSDP is switched on for this
            # call only: Accelerate later rebuilds its state from the (multi-CPU) process group's, so the
            # code after it asks the model whether it is sharded (ckpt.is_sharded), not Accelerate.
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = fsdp
        wrapped, _ = accelerator.prepare(model, optimizer)
    return wrapped, [p for p in wrapped.parameters() if p.requires_grad]


def any_process(flag: bool, accelerator: Accelerator) -> bool:
    """Whether `flag` is true on any process: every process gets the same answer (one all-reduce)."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor([int(flag)], device=accelerator.device), reduction="sum").item())


def average_gradients(params: list[torch.nn.Parameter], accelerator: Accelerator) -> None:
    """DDP's gradient averaging, done once per step after every process finished its passes (see make_accelerator):
    one all-reduce per dtype over the flattened gradients of the parameters that train. No-op on one process; not
    for FSDP2, whose sharded gradients are reduce-scattered in the backward pass."""
    if accelerator.num_processes == 1:
        return
    training = [p for p in params if p.requires_grad]
    for dtype in dict.fromkeys(p.dtype for p in training):
        group = [p for p in training if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        torch.distributed.all_reduce(flat)
        flat /= accelerator.num_processes
        for p, piece in zip(group, flat.split([p.numel() for p in group]), strict=False):
            p.grad = piece.view_as(p)


def _tracker_installed(name: str) -> bool:
    from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

    return {"tensorboard": is_tensorboard_available, "mlflow": is_mlflow_available, "wandb": is_wandb_available}[name]()
