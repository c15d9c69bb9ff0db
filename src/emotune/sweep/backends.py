"""Where a sweep's trials run: here, one per visible GPU at a time (one after another on a CPU), or on Ray.

A trial is one `python -m emotune run` process (`run_trial`): the base config, the trial's overrides, and its
own folder in the sweep folder. A process per trial keeps each trial's memory, seeds and peak-memory
figure its own, and lets a GPU trial see exactly one GPU (CUDA_VISIBLE_DEVICES, or HIP_VISIBLE_DEVICES
where a ROCm build reads that one). The process gets SIGKILL if the sweep dies (Linux), so a killed sweep
never leaves a trial writing into a folder that the next sweep resumes. Its output goes to
`logs/<trial>.log` and, each line prefixed with the trial's number, to the terminal.

Ray (`sweep.backend: ray`) runs the same `run_trial` as Ray Tune trials, each with one GPU where the cluster
has GPUs (Ray sets CUDA_VISIBLE_DEVICES itself) and `sweep.ray_cpus_per_trial` cores.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from emotune.core.errors import UserError
from emotune.sweep.search import Outcome
from emotune.sweep.space import Trial
from emotune.sweep.table import read_result


@dataclass(frozen=True)
class Job:
    """What every trial of one sweep shares: how to start its `emotune run`, and what it is measured by."""

    config: str | None  # absolute path of the base config file, or None for the defaults
    overrides: tuple[str, ...]  # the command line's key=value overrides of the base config
    folder: str  # the sweep folder, absolute
    cwd: str  # where relative paths in the config resolve (the directory `emotune sweep` ran in)
    metric: str

    def trial_dir(self, trial: Trial) -> Path:
        return Path(self.folder) / trial.name

    def log_path(self, trial: Trial) -> Path:
        return Path(self.folder) / "logs" / f"{trial.name}.log"

    def command(self, trial: Trial) -> list[str]:
        # last, so nothing before can change them: the trial's folder, no sweep inside a trial, and never replacing
        # a finished trial (an unfinished one with the same config resumes, as any run does)
        fixed = ["sweep={}", f"output_dir={self.folder}", f"name={trial.name}", "overwrite=false"]
        return [sys.executable, "-m", "emotune", "run", *([self.config] if self.config else []), *self.overrides,
                *trial.overrides, *fixed]


@dataclass(frozen=True)
class Slot:
    """A place one trial runs at a time: its label and what its process sees on top of this one's environment."""

    label: str
    env: dict[str, str] = field(default_factory=dict)


class Events(Protocol):
    def started(self, trial: Trial, slot: str) -> None: ...
    def finished(self, trial: Trial, slot: str, outcome: Outcome) -> None: ...


# --------------------------------------------------------------------------------------------------
# Devices


def local_gpus() -> tuple[int, bool]:
    """(GPUs PyTorch sees, whether this is a ROCm build)."""
    import torch

    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), bool(getattr(torch.version, "hip", None))


def device_slots(device: str, gpus: Callable[[], tuple[int, bool]] = local_gpus,
                 environ: Mapping[str, str] = os.environ) -> list[Slot]:
    """One slot per visible GPU, each narrowing the visible-devices variable in force to its own GPU; one slot for a
    CPU or MPS. `gpus` is asked only when `device` may be a GPU."""
    if device in ("cpu", "mps"):
        return [Slot(device)]
    count, rocm = gpus()
    if count == 0:
        if device == "cuda":
            raise UserError("`device: cuda` was asked for but PyTorch sees no CUDA or ROCm GPU, so no trial could run. "
                            "Run `emotune doctor` to see why, or set device=auto to run the trials on this CPU.")
        return [Slot("cpu")]
    # ROCm builds read HIP_VISIBLE_DEVICES before CUDA_VISIBLE_DEVICES: narrow whichever one is in force
    names = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if rocm else ("CUDA_VISIBLE_DEVICES",)
    variable = next((name for name in names if environ.get(name, "").strip()), names[0])
    tokens = [t.strip() for t in environ.get(variable, "").split(",") if t.strip()] or [str(i) for i in range(count)]
    return [Slot(f"cuda:{i}", {variable: tokens[i]}) for i in range(min(count, len(tokens)))]


# --------------------------------------------------------------------------------------------------
# One trial


def run_trial(job: Job, trial: Trial, slot: Slot) -> Outcome:
    """`emotune run` for the trial in its folder (resuming it when unfinished); its metric when it finished."""
    env = {**os.environ, **slot.env, "PYTHONUNBUFFERED": "1"}  # unbuffered: its lines reach the log as they happen
    returncode = run_logged(job.command(trial), env, job.log_path(trial), f"{trial.name[:9]} | ", job.cwd)
    result = read_result(job.trial_dir(trial))
    value = result.after.get(job.metric) if returncode == 0 and result.status == "finished" else None
    return Outcome(returncode, value)


def run_logged(command: list[str], env: Mapping[str, str], log: Path, prefix: str, cwd: str | None = None) -> int:
    """Run `command`, appending its output to `log` and echoing each line with `prefix`; its exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"\n# {datetime.now(timezone.utc).isoformat(timespec='seconds')} $ {shlex.join(command)}\n")
        handle.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace", env=dict(env), cwd=cwd,
                                   preexec_fn=_die_with_parent if _LIBC is not None else None)
        try:
            for line in process.stdout:
                handle.write(line)
                handle.flush()
                print(prefix + line, end="", flush=True)
            return process.wait()
        finally:
            if process.poll() is None:  # this process is being interrupted: take the trial down with it
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
            process.stdout.close()


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the trial's process before exec (Linux): SIGKILL it when the sweep process dies, however it dies."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# --------------------------------------------------------------------------------------------------
# Local: a worker per slot


def run_local(source, slots: list[Slot], job: Job, events: Events,
              trial_fn: Callable[[Job, Trial, Slot], Outcome] = run_trial) -> None:
    """Each slot runs one trial at a time, taking the next one from `source` until it has none."""

    def work(slot: Slot) -> None:
        while (trial := source.next()) is not None:
            events.started(trial, slot.label)
            outcome = trial_fn(job, trial, slot)
            events.finished(trial, slot.label, outcome)
            source.finish(trial, outcome)

    if len(slots) == 1:
        work(slots[0])  # in this thread, so Ctrl-C reaches the loop directly
        return
    errors: list[BaseException] = []

    def guarded(slot: Slot) -> None:
        try:
            work(slot)
        except BaseException as err:  # reported from the main thread below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(slot,), daemon=True, name=slot.label) for slot in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=0.5)  # short waits: Ctrl-C interrupts the main thread between them
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------------------------------
# Ray Tune


def require_ray():
    try:
        import ray
        from ray import tune
    except ImportError:
        raise UserError("sweep.backend=ray needs Ray Tune, which is not installed. Install it with pip install "
                        "'emotune[ray]' (or pip install 'ray[tune]'), or use sweep.backend=local.") from None
    return ray, tune


def _tune_trial(config: dict, job: Job) -> dict:
    """The Ray Tune trainable: the same `run_trial`; Ray has already narrowed the visible GPUs of this worker."""
    outcome = run_trial(job, Trial.from_dict(config["trial"]), Slot("ray"))
    return {"returncode": outcome.returncode, "value": outcome.value}


def run_ray(source, job: Job, events: Events, address: str | None, cpus_per_trial: int) -> None:
    """The trials as Ray Tune trials on the cluster at `address` (or a Ray instance started here). An adaptive
    search (TPE) is asked for as many trials as run at once, and asked again once they have finished."""
    ray, tune = require_ray()
    if not ray.is_initialized():  # a cluster's address, or a Ray instance of this machine's cores without a dashboard
        ray.init(address=address) if address else ray.init(include_dashboard=False)
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    concurrent = gpus or max(1, int(resources.get("CPU", 1)) // cpus_per_trial)
    trainable = tune.with_resources(tune.with_parameters(_tune_trial, job=job),
                                    {"cpu": cpus_per_trial, "gpu": 1 if gpus else 0})
    started = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    round_ = 0
    while batch := _take(source, concurrent if source.adaptive else None):
        for trial in batch:
            events.started(trial, "ray")
        tuner = tune.Tuner(trainable, param_space={"trial": tune.grid_search([t.as_dict() for t in batch])},
                           tune_config=tune.TuneConfig(max_concurrent_trials=concurrent),
                           run_config=tune.RunConfig(name=f"{started}-round-{round_:03d}", storage_path=str(Path(job.folder) / "ray"),
                                                     verbose=0))
        ended = {r.config["trial"]["name"]: r.metrics or {} for r in tuner.fit()}
        for trial in batch:
            metrics = ended.get(trial.name, {})
            outcome = Outcome(metrics.get("returncode", 1), metrics.get("value"))
            events.finished(trial, "ray", outcome)
            source.finish(trial, outcome)
        round_ += 1


def _take(source, limit: int | None) -> list[Trial]:
    batch = []
    while (limit is None or len(batch) < limit) and (trial := source.next()) is not None:
        batch.append(trial)
    return batch
