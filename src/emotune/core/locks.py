"""Locks on shared folders: one process at a time works in a run folder or fills a cache entry.

A lock is an operating-system lock (`flock`; `msvcrt.locking` on Windows) on a small file beside what it guards,
and the file says who holds it: pid, host, command and since when. The system drops the lock when its process
ends, however it ends, so a lock left by `kill -9` is simply taken over (and the take-over is announced, with
whom it was left by); a second process while the holder lives gets a `LockHeld` error naming the holder.

A process takes a lock once and holds it until `release` (or its end): taking the same lock again in the same
process is a no-op, so one command may open its run folder from several places.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from emotune.core.errors import UserError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

LOCK_SUFFIX = ".lock"
WAIT_STEP_S = 0.5


class LockHeld(UserError):
    """Another live process holds the lock."""


class _Held:
    """The locks this process holds, by resolved path, with the open file each lock lives on."""

    files: dict[Path, int] = {}


def acquire(lock_file: str | Path, what: str, wait_s: float = 0.0) -> bool:
    """Take the lock on `lock_file` for `what` (words for the error: "the run folder runs/x"), waiting up to `wait_s`
    for a holder to finish. True when taken now, False when this process held it already; LockHeld otherwise."""
    path = Path(lock_file).resolve()
    if path in _Held.files:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, announced = time.monotonic() + wait_s, False
    while not _try_lock(fd):
        holder = _describe(_read_holder(fd))
        if time.monotonic() >= deadline:
            os.close(fd)
            raise LockHeld(f"{what[0].upper()}{what[1:]} is in use by another process: {holder}. Wait for it to "
                           f"finish or stop it; its lock ({path}) is released the moment it ends, even if it is killed.")
        if not announced:
            print(f"Waiting for {what}, in use by {holder} ...", flush=True)
            announced = True
        time.sleep(WAIT_STEP_S)
    left = _read_holder(fd)
    if left and left.get("pid") != os.getpid():  # a holder that ended without releasing: killed, or its machine lost
        print(f"Took over the lock on {what} left by {_describe(left)}, which ended without releasing it.", flush=True)
    _write_holder(fd)
    _Held.files[path] = fd
    return True


def release(lock_file: str | Path) -> None:
    """Give the lock back (a no-op when this process does not hold it); the file stays, empty."""
    fd = _Held.files.pop(Path(lock_file).resolve(), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        _unlock(fd)
        os.close(fd)


def release_all() -> None:
    """Give back every lock this process holds (at the end of a command run in-process)."""
    for path in list(_Held.files):
        release(path)


@contextmanager
def locked(lock_file: str | Path, what: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the lock for the block; released after it unless this process held it before."""
    taken = acquire(lock_file, what, wait_s)
    try:
        yield
    finally:
        if taken:
            release(lock_file)


def holder(lock_file: str | Path) -> dict | None:
    """Who holds the lock, as its file says (None when free or unreadable): pid, host, command, since."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def is_held(lock_file: str | Path) -> bool:
    """Whether some process holds the lock now (another process's lock only: this process may take its own again)."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except OSError:
        return False
    try:
        if not _try_lock(fd):
            return True
        _unlock(fd)
        return False
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _write_holder(fd: int) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:500],
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode())


def _read_holder(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"null")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _describe(info: dict | None) -> str:
    if not info:
        return "a process that has not said who it is yet"
    return (f"pid {info.get('pid')} on {info.get('host')}, running `{info.get('command')}` since "
            f"{info.get('since')}")
