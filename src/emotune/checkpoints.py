"""Checkpoints that survive `kill -9` at any moment, and exact resumption from them.

A checkpoint is written into a hidden temporary folder and then renamed to `step-NNNNNN`: a rename is
atomic, so every `step-*` folder is complete and a crash leaves at most a `.tmp-*` folder, which the
next run deletes. It holds the trainable weights, optimizer, scheduler and grad-scaler state, every
process's RNG state (dropout masks), the weights with the best validation loss so far, and the progress (step, best validation loss, log history); the
data position is the step itself, because batch order is a pure function of the seed and the epoch.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STEP_FOLDER = re.compile(r"^step-(\d+)$")
BEST_FILE = "best.safetensors"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # A copy, not a view: on a CPU `.cpu()` would alias the live weights the optimizer keeps changing.
    return {name: p.detach().to("cpu", copy=True).contiguous() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != expected:
        raise RuntimeError(f"checkpoint does not match the model's trainable parameters "
                           f"(missing {sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]})")
    model.load_state_dict(tensors, strict=False)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(folder: Path, step: int, model: torch.nn.Module, optimizer, scheduler, scaler,
                     rng_states: list[dict[str, Any]], progress: dict[str, Any], keep: int,
                     best: dict[str, torch.Tensor] | None) -> Path:
    """Write `folder/step-NNNNNN` atomically and delete all but the `keep` newest. Main process only."""
    target = folder / f"step-{step:06d}"
    partial = folder / f".tmp-step-{step:06d}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(trainable_state(model), partial / "trainable.safetensors")
    if best is not None:
        save_file(best, partial / BEST_FILE)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None}, partial / "optimizer.pt")
    torch.save(rng_states, partial / "rng.pt")
    (partial / "progress.json").write_text(json.dumps(progress, indent=1))
    shutil.rmtree(target, ignore_errors=True)  # only after a resume that replays this very step
    os.replace(partial, target)
    for old in complete_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first; leftovers of an interrupted write are not among them."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := STEP_FOLDER.match(p.name))]
    return [p for _, p in sorted(found)]


def remove_partial_writes(folder: Path) -> None:
    if folder.is_dir():
        for leftover in folder.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()


def read_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, scaler,
                    rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Restore everything `write_checkpoint` saved into the live objects; return the progress and the
    best weights so far."""
    load_trainable_state(model, load_file(path / "trainable.safetensors"))
    states = torch.load(path / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(states["optimizer"])
    scheduler.load_state_dict(states["scheduler"])
    if scaler is not None and states["scaler"] is not None:
        scaler.load_state_dict(states["scaler"])
    rng_states = torch.load(path / "rng.pt", weights_only=False)
    # A run resumed on a different number of processes cannot replay every dropout mask; rank 0's
    # state is the closest start.
    set_rng_state(rng_states[rank] if rank < len(rng_states) else rng_states[0])
    best = load_file(path / BEST_FILE) if (path / BEST_FILE).is_file() else None
    return json.loads((path / "progress.json").read_text()), best
