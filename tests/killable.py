"""`python -m emotune ...` as a real subprocess, killed with SIGKILL at a chosen line of its output (the life-cycle,
crash-point and sweep tests). Nothing in the product knows it is being tested."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    killed: bool


def run_emotune(args: list[str], kill_when: Callable[[str], bool] | None = None, timeout_s: float = 300) -> Result:
    """Run `python -m emotune ARGS`; with `kill_when`, SIGKILL it at the first stdout line for which it is true.
    A watchdog kills a hung process after `timeout_s` (that kill does not count as `killed`)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+", encoding="utf-8") as err:  # a file, so a full stderr pipe never blocks it
        proc = subprocess.Popen([sys.executable, "-m", "emotune", *args], stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
        watchdog = threading.Timer(timeout_s, proc.kill)
        watchdog.start()
        lines, killed = [], False
        try:
            for line in proc.stdout:
                lines.append(line)
                if kill_when is not None and kill_when(line):
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
            lines.append(proc.stdout.read())
            returncode = proc.wait()
        finally:
            watchdog.cancel()
            proc.stdout.close()
        err.seek(0)
        return Result(returncode, "".join(lines), err.read(), killed)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` by relative path, with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}
