"""Checkpoints that survive `kill -9` at any moment, and exact resumption from them.

A checkpoint is written into `step-NNNNNN.partial` and then renamed to `step-NNNNNN` (emotune.core.rundir's
atomic_dir): a rename is atomic, so every `step-*` folder is complete and a crash leaves at most a
`.partial` folder, which the next run deletes. It holds the trainable weights, optimizer, scheduler and grad-scaler state,
every process's RNG state (dropout masks), the weights with the best validation loss so far, and the progress (step, best
validation loss, log history); the data position is the step itself, because batch order is a pure function of the seed and the epoch.

Under FSDP2 every parameter is a DTensor holding this process's shard. The functions below gather
the trainable weights and the optimizer state to full tensors (collectives: every process calls them,
in the same order) so that a checkpoint, and the adapter, look the same as a single process's; on
resume every process reads the files and keeps its own shard.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from emotune.core.errors import UserError, first_line
from emotune.core.rundir import atomic_dir, json_text

STEP_FOLDER = re.compile(r"^step-(\d+)$")
BEST_FILE = "best.safetensors"
FILES = ("trainable.safetensors", "optimizer.pt", "rng.pt", "progress.json")  # every checkpoint has these
SET_ASIDE = ".unreadable"
FROZEN = "emotune_frozen"
"""Set on an adapter weight that out-of-memory recovery stopped training (emotune.train.recovery): it is still part of the
trained state, saved in checkpoints and the kept best weights and restored from them, as if it still trained."""


def is_trained(param: torch.Tensor) -> bool:
    """A weight of the trained state: one that trains, or one that trained until out-of-memory recovery froze it."""
    return param.requires_grad or getattr(param, FROZEN, False)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the trainable weights on the CPU (under FSDP2 a collective, see the module docstring)."""
    return {name: _full_copy(p) for name, p in model.named_parameters() if is_trained(p)}


@torch.no_grad()
def _full_copy(param: torch.Tensor) -> torch.Tensor:
    full = param.detach()
    full = full.full_tensor() if isinstance(full, DTensor) else full
    # A copy, not a view: on a CPU `.cpu()` would alias the live weights the optimizer keeps changing.
    return full.to("cpu", copy=True).contiguous()


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _reshard(model: torch.nn.Module) -> None:
    """Put back the shards of units a forward left gathered (FSDP2 keeps the root's and the output
    layer's after an evaluation forward): the state-dict helpers expect every parameter sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Mismatch(RuntimeError):
    """Saved trained weights whose names or shapes are not the model's."""


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = {name: p.shape for name, p in model.named_parameters() if is_trained(p)}
    if set(tensors) != set(expected):
        raise Mismatch(f"missing {sorted(set(expected) - set(tensors))[:3]}, unexpected "
                       f"{sorted(set(tensors) - set(expected))[:3]}")
    if wrong := [f"{name} {tuple(t.shape)} for {tuple(expected[name])}" for name, t in tensors.items()
                 if t.shape != expected[name]]:
        raise Mismatch(f"other shapes: {'; '.join(wrong[:3])}")
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        _reshard(model)
        set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(tensors, strict=False)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state to save. Under FSDP2 it is gathered to full tensors keyed by parameter
    name, and only the main process receives it (a collective)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    _reshard(model)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                         path: Path) -> None:
    by_name = isinstance(state["param_groups"][0]["params"][0], str)  # FSDP2's full state names its parameters
    sharded = is_sharded(model)
    if by_name != sharded:
        raise UserError(f"The checkpoint {path} was written {'with' if by_name else 'without'} FSDP, and this run "
                        f"trains {'with' if sharded else 'without'} it. Resume it the way it was launched (train.fsdp, "
                        f"or accelerate launch --use_fsdp), or delete {path.parent} to start over.")
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        _reshard(model)
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    elif len(state["param_groups"]) != len(optimizer.param_groups):
        raise UserError(f"The checkpoint {path} holds {len(state['param_groups'])} optimizer parameter group(s) and "
                        f"this run builds {len(optimizer.param_groups)}: it was written by an earlier emotune, whose "
                        "train.weight_decay also covered normalization weights and biases. Delete "
                        f"{path.parent} to start training over, or pass overwrite=true.")
    else:
        optimizer.load_state_dict(state)


def rng_state() -> dict[str, Any]:
    """Every generator's state in types `torch.load(weights_only=True)` reads: numpy's as a tensor and plain values."""
    numpy_state = np.random.get_state(legacy=False)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {**numpy_state, "state": {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                                                "pos": int(numpy_state["state"]["pos"])}}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # written as above
        key = numpy_state["state"]["key"].numpy().astype(np.uint32)
        numpy_state = {**numpy_state, "state": {"key": key, "pos": numpy_state["state"]["pos"]}}
    np.random.set_state(numpy_state)  # or the legacy tuple of checkpoints written before, its array allow-listed
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list:
    """What a pickled numpy array needs (checkpoints before the safe format held numpy's RNG state as one)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_load(path: str | Path) -> Any:
    """A checkpoint's .pt file, read without running code from it (`weights_only=True`: tensors, numbers, strings
    and containers; numpy arrays allow-listed for checkpoints written by earlier versions). Anything else is refused
    with how to start over."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpoint(f"The checkpoint file {path} holds objects other than tensors and plain values, which "
                               "emotune does not load: unpickling them could run code from the file "
                               f"({first_line(err)[:200]}). If you wrote it yourself with an older emotune, "
                               f"restart training: delete the checkpoints folder {path.parent.parent} and run the same "
                               "command again, or pass overwrite=true to start the run over.") from None


class UnsafeCheckpoint(UserError):
    """A checkpoint file that `weights_only=True` cannot read: refused, never set aside as merely damaged."""


@dataclass
class TrainingState:
    """What a checkpoint holds of a training, to resume it exactly: `weights` and `optimizer` from
    `trainable_state` and `optimizer_state` (which every process calls), the scheduler and the gradient scaler
    (None without fp16), every process's random streams, the loop's progress, and the best weights kept so far."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: Any
    scaler: Any
    rng_states: list[dict[str, Any]]
    progress: dict[str, Any]
    best: dict[str, torch.Tensor] | None


def write_checkpoint(folder: Path, step: int, state: TrainingState, keep: int) -> Path:
    """Write `folder/step-NNNNNN` atomically and delete all but the `keep` newest. Main process only."""
    target = folder / f"step-{step:06d}"
    with atomic_dir(target) as partial:  # replaces a same-step folder only after a resume that replays this very step
        save_file(state.weights, partial / "trainable.safetensors")
        if state.best is not None:
            save_file(state.best, partial / BEST_FILE)
        torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler.state_dict(),
                    "scaler": state.scaler.state_dict() if state.scaler is not None else None}, partial / "optimizer.pt")
        torch.save(state.rng_states, partial / "rng.pt")
        # standard JSON: a NaN validation loss (best_loss) or log entry is null, as in log_history.jsonl; files of earlier
        # versions, which wrote the bare word NaN, still read back (json.loads accepts it)
        (partial / "progress.json").write_text(json_text(state.progress, indent=1), encoding="utf-8")
    for old in complete_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first; leftovers of an interrupted write are not among them."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (a file missing, cut short or unreadable), or None.

    The rename makes a checkpoint complete when written; a disk that fills up, a copy cut short or a
    damaged file can still spoil it later, so each file is read back once before the run trusts it."""
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    for name in ("trainable.safetensors", BEST_FILE):
        if (path / name).is_file():
            try:
                with safe_open(path / name, "pt"):  # reads the header and checks the data covers it
                    pass
            except Exception as err:  # noqa: BLE001 (safetensors has one error type for every kind of damage)
                return f"{name} is unreadable ({err})"
    for name in ("optimizer.pt", "rng.pt"):
        try:
            safe_load(path / name)
        except UnsafeCheckpoint:
            raise
        except Exception as err:  # noqa: BLE001 (a cut pickle or zip fails in many ways)
            return f"{name} is unreadable ({type(err).__name__}: {err})"
    try:
        progress = json.loads((path / "progress.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"progress.json is unreadable ({err})"
    if not isinstance(progress, dict) or "step" not in progress:
        return "progress.json has no step"
    if progress.get("best_step") is not None and not (path / BEST_FILE).is_file():  # the kept adapter's weights
        return f"{BEST_FILE} is missing (progress.json keeps the weights of step {progress['best_step']} as the best)"
    return None


def set_aside_unreadable(folder: Path) -> list[tuple[Path, Path, str]]:
    """Rename the newest checkpoints that cannot be resumed from to `step-NNNNNN.unreadable` (kept for a
    look, no longer counted as checkpoints), until an intact one is newest. Main process only.
    Returns (checkpoint, where it went, why) for each one set aside."""
    moved = []
    for path in reversed(complete_checkpoints(folder)):
        problem = checkpoint_problem(path)
        if problem is None:
            break
        aside = path.with_name(path.name + SET_ASIDE)
        shutil.rmtree(aside, ignore_errors=True)  # an older copy set aside at this step
        path.rename(aside)
        moved.append((path, aside, problem))
    return moved


def read_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, scaler,
                    rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Restore everything `write_checkpoint` saved into the live objects; return the progress and the
    best weights so far."""
    try:
        load_trainable_state(model, load_file(path / "trainable.safetensors"))
    except Mismatch as err:
        raise UserError(f"The checkpoint {path} holds trained weights that do not fit this model ({first_line(err)}): "
                        "the model at model.source is not the one the run began with (replaced, or a hub model "
                        "updated without model.revision pinned). Point model.source at that model to resume, or pass "
                        "overwrite=true to start the run over on this one.") from None
    states = safe_load(path / "optimizer.pt")
    load_optimizer_state(model, optimizer, states["optimizer"], path)
    scheduler.load_state_dict(states["scheduler"])
    if scaler is not None and states["scaler"] is not None:
        scaler.load_state_dict(states["scaler"])
    rng_states = safe_load(path / "rng.pt")
    # A run resumed on a different number of processes cannot replay every dropout mask; rank 0's
    # state is the closest start.
    set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
    best = load_file(path / BEST_FILE) if (path / BEST_FILE).is_file() else None
    return json.loads((path / "progress.json").read_text(encoding="utf-8")), best
