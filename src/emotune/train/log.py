"""What training shows and leaves behind: log lines, the loss history, the loss plot, peak memory."""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

import torch

from emotune.core.rundir import atomic_file, json_text, write_json


class TrainLog:
    """log_history.jsonl (rewritten from the resumed checkpoint, so no replayed line appears twice) and the trackers."""

    def __init__(self, path: Path, history: list[dict], accelerator, report_to: list[str], hyperparameters: dict):
        self.path, self.history, self.accelerator, self.trackers = path, history, accelerator, bool(report_to)
        self.main = accelerator.is_main_process
        if self.main:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json_text(e, indent=None) + "\n" for e in history), encoding="utf-8")
            if self.trackers:
                accelerator.init_trackers("emotune", config=_flat(hyperparameters))

    def __call__(self, entry: dict) -> None:
        self.history.append(entry)
        if self.main:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json_text(entry, indent=None) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def close(self) -> None:
        if self.trackers:
            self.accelerator.end_training()


class Window:
    """Loss, gradient norms, tokens and time since the last log line."""

    def __init__(self):
        self.started, self.losses, self.grad_norms, self.tokens = time.perf_counter(), [], [], 0

    @classmethod
    def resumed(cls, carried: dict | None) -> Window:
        """A window holding the losses and gradient norms a checkpoint carried (`carried`), or an empty one."""
        window = cls()
        if carried:
            window.losses, window.grad_norms = list(carried["losses"]), list(carried["grad_norms"])
        return window

    def carried(self) -> dict:
        """What a checkpoint keeps of the window: its losses and gradient norms (tokens and time restart on resume)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def add(self, loss: float | None, tokens: int, grad_norm: float | None = None) -> None:
        if loss is not None:
            self.losses.append(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
        self.tokens += tokens

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def entry(self, progress, plan, lr: float, grad_norm: float) -> dict:
        """The log line. `grad_norm` is the last step's gradient norm; `grad_norm_mean` / `grad_norm_max` cover every
        finite step of the window. All are the total L2 norm over the trainable parameters before clipping."""
        norms = self.grad_norms
        return {"step": progress.step, "epoch": round(progress.step * plan.micro_per_step / plan.batches_per_epoch, 4),
                "loss": sum(self.losses) / len(self.losses) if self.losses else math.nan, "learning_rate": lr,
                "grad_norm": grad_norm, "grad_norm_mean": sum(norms) / len(norms) if norms else math.nan,
                "grad_norm_max": max(norms, default=math.nan), "tokens_per_s": round(self.tokens_per_s(), 1),
                "peak_memory_mb": round(peak_memory_mb(), 1), "skipped_steps": progress.nonfinite_total}


def peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def write_history(history: list[dict], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "log_history.json", history)
    plot_losses(history, folder / "loss_curve.png")


def plot_losses(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "training"), ("eval_loss", "validation")):
        points = [(e["step"], e[key]) for e in history if key in e]
        if points:
            ax.plot(*zip(*points, strict=False), marker="o" if key == "eval_loss" else None, label=label)
    ax.set(xlabel="optimizer step", ylabel="loss per completion token", title="emotune training")
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as partial:
        fig.savefig(partial, format="png")
    plt.close(fig)


def _flat(tree: dict, prefix: str = "") -> dict:
    """Trackers want flat scalar hyperparameters (TensorBoard's hparams do)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
