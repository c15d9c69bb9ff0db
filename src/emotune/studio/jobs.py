"""The studio's job queue: runs started from the form wait in a FIFO kept on disk and run one at a time, each as
its own `emotune run` process, so a run goes on when the browser closes and even when the studio stops.

The queue is a folder, `<runs>/.studio/jobs/`: one `<number>.json` per job (its state) beside `<number>.yaml` (the
config it runs) and `<number>.log` (its output). A restarted studio reads the folder again: a job it finds
`running` whose process still holds the run folder's lock (emotune.core.locks) is followed until the lock is
given back; one whose process is gone is marked by what its run.json says.

Stopping sends Ctrl-C (SIGINT) to the job's process group: `emotune run` marks the stage it was in as failed,
gives the run folder's lock back and exits, and the run resumes from its last checkpoint when started again.
After STOP_GRACE_S a job still running is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from emotune.core import locks
from emotune.core.config.base import is_run_name
from emotune.core.rundir import RunDir, read_json, run_lock, write_json, write_text

STOP_GRACE_S = 30.0
FINAL = ("finished", "failed", "stopped")
STATES = ("queued", "running", *FINAL)


class NameTaken(Exception):
    """A run name a queued or running job holds."""


@dataclass
class Job:
    id: int
    name: str
    status: str = "queued"  # queued → running → finished | failed | stopped
    pid: int | None = None
    submitted: float = 0.0
    started: float | None = None
    ended: float | None = None
    stop_requested: bool = False
    exit_code: int | None = None
    device: str = ""  # the device it trains on (device_key); "" (a job of an older studio): any device


def device_key(preference: str) -> str:
    """The device a config's `device:` trains on, named so two jobs on the same device get the same name: `auto` and
    `cuda` are the first visible GPU (`cuda:0`) when PyTorch sees one, else the CPU (MPS where there is one)."""
    from emotune.runtime.device import resolve_device

    preference = str(preference or "auto")
    if preference.startswith("cuda:"):
        return preference
    try:
        device = resolve_device(preference)
    except Exception:  # noqa: BLE001 - a device not there: its job fails with the run's own clear error
        return preference
    return f"cuda:{device.index or 0}" if device.type == "cuda" else device.type


def same_device(a: str, b: str) -> bool:
    return a == b or "" in (a, b)


class JobQueue:
    """The FIFO of runs under one runs folder; `tick()` moves it on (the studio calls it every second)."""

    def __init__(self, runs: Path, ready: Callable[[], bool] | None = None):
        """`ready()`: asked before a job starts; False keeps it waiting (the studio's model being tried frees the
        device first, emotune.studio.tryout)."""
        self.runs, self.ready = Path(runs), ready
        self.folder = self.runs / ".studio" / "jobs"
        self.children: dict[int, subprocess.Popen] = {}  # the jobs this studio process started
        self.lock = threading.Lock()

    def submit(self, name: str, config_yaml: str) -> Job:
        """Queue a run; NameTaken when a job not yet ended will write the same run folder (checked under the lock, so
        two forms sent at once cannot both get the name)."""
        device = device_key((yaml.safe_load(config_yaml) or {}).get("device", "auto"))
        with self.lock:
            pending = self.job_for(name)
            if pending is not None and pending.status not in FINAL:
                raise NameTaken(f"job {pending.id} ({pending.status}) will write the run folder `{name}` already; choose "
                                "another name, or stop that job first")
            self.folder.mkdir(parents=True, exist_ok=True)
            job = Job(max((j.id for j in self.jobs()), default=0) + 1, name, submitted=time.time(), device=device)
            write_text(self.folder / f"{job.id}.yaml", config_yaml)
            self._save(job)
            return job

    def jobs(self) -> list[Job]:
        if not self.folder.is_dir():
            return []
        found = (_job(read_json(p) or {}) for p in self.folder.glob("*.json"))
        return sorted((j for j in found if j is not None), key=lambda j: j.id)

    def job_for(self, name: str) -> Job | None:
        """The latest job of the run folder `name`."""
        return next((j for j in reversed(self.jobs()) if j.name == name), None)

    def log(self, job: Job) -> Path:
        return self.folder / f"{job.id}.log"

    def stop(self, job_id: int) -> Job | None:
        """Take a queued job out of the queue, or ask a running one to stop (Ctrl-C to its process group)."""
        with self.lock:
            job = next((j for j in self.jobs() if j.id == job_id), None)
            if job is None or job.status in FINAL:
                return job
            if job.status == "queued":
                job.status, job.ended = "stopped", time.time()
            else:
                job.stop_requested = True
                _signal(job.pid, signal.SIGINT)
            self._save(job)
            return job

    def tick(self) -> None:
        """Follow the running jobs; then start, in the order they were queued, each waiting job whose device is
        free: one job at a time per device, first in first out on each."""
        with self.lock:
            for job in self.jobs():
                if job.status == "running":
                    self._follow(job)
            busy = [j.device for j in self.jobs() if j.status == "running"]
            for job in self.jobs():
                if job.status != "queued" or any(same_device(job.device, d) for d in busy):
                    continue
                if self.ready is not None and not self.ready():
                    return
                self._start(job)
                busy.append(job.device)

    def training(self) -> str | None:
        """"Training job N (run NAME) on DEVICE" for a job running now, else None."""
        running = next((j for j in self.jobs() if j.status == "running"), None)
        return (f"Training job {running.id} (run `{running.name}`{f' on {running.device}' if running.device else ''})"
                if running is not None else None)

    def _start(self, job: Job) -> None:
        with self.log(job).open("ab") as log:
            # its own session, so Ctrl-C reaches the run and the processes it starts, and not the studio
            process = subprocess.Popen([sys.executable, "-m", "emotune", "run", str(self.folder / f"{job.id}.yaml")],
                                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.children[job.id] = process
        job.status, job.pid, job.started = "running", process.pid, time.time()
        self._save(job)

    def _follow(self, job: Job) -> None:
        process = self.children.get(job.id)
        if process is not None:
            code = process.poll()
            if code is None:
                self._kill_if_overdue(job)
                return
            self.children.pop(job.id)
        elif _alive(job.pid) and (locks.is_held(run_lock(self.runs / job.name)) or not job.started
                                  or time.time() - job.started < 60):
            self._kill_if_overdue(job)  # a job a studio before this one started: followed through its lock
            return
        else:
            code = None
        status = RunDir(self.runs / job.name).status() if code is None else None
        job.exit_code = code
        job.status = ("stopped" if job.stop_requested else "finished" if code == 0 or status == "finished" else "failed")
        job.ended = time.time()
        self._save(job)

    def _kill_if_overdue(self, job: Job) -> None:
        stopping_since = (read_json(self.folder / f"{job.id}.stop") or {}).get("since")
        if job.stop_requested and stopping_since is None:
            write_json(self.folder / f"{job.id}.stop", {"since": time.time()})
        elif job.stop_requested and time.time() - stopping_since > STOP_GRACE_S:
            _signal(job.pid, signal.SIGKILL)

    def _save(self, job: Job) -> None:
        write_json(self.folder / f"{job.id}.json", asdict(job))


def _job(state: dict) -> Job | None:
    """The job a `<number>.json` of the queue folder holds; None for one that is not a job's state (keys of another
    version or a hand edit, a name that is no run folder's, text for a number): it is left out, and the queue, the
    runs table and the run pages go on without it."""
    known = {f.name for f in fields(Job)}
    try:
        job = Job(**{k: v for k, v in state.items() if k in known})
    except TypeError:  # `id` or `name` missing
        return None
    numbers = all(v is None or type(v) in (int, float) for v in (job.submitted, job.started, job.ended, job.exit_code))
    ok = (type(job.id) is int and isinstance(job.name, str) and is_run_name(job.name) and job.status in STATES
          and (job.pid is None or type(job.pid) is int) and isinstance(job.device, str) and numbers)
    return job if ok else None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int | None, sig: int) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig)  # the job leads its own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def worker(queue: JobQueue, stop: threading.Event, interval_s: float = 1.0) -> threading.Thread:
    """A daemon thread that ticks the queue until `stop` is set."""
    def loop() -> None:
        while not stop.is_set():
            queue.tick()
            stop.wait(interval_s)
    thread = threading.Thread(target=loop, name="emotune-studio-jobs", daemon=True)
    thread.start()
    return thread
