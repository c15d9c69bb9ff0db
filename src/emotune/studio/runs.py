"""What the studio reads from the runs folder: one summary per run folder, files resolved safely, the training history.

Everything here only reads. A path the browser names is resolved and must stay inside the runs folder (symbolic
links and `..` included): anything else is `NotInRuns`, which the pages answer with 404.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from emotune.core.rundir import PARTIAL, PREVIOUS, RunDir, read_json

HISTORY_LIVE = "log_history.jsonl"  # appended by emotune.train.log.TrainLog while training
HISTORY_DONE = "log_history.json"  # written whole when training ends (emotune.train.log.write_history)
HEADLINE_METRICS = ("macro_f1", "accuracy", "rouge_l")  # the first one a comparison has is the table's before → after


class NotInRuns(Exception):
    """A requested path that is missing or lies outside the runs folder."""


@dataclass
class RunSummary:
    name: str
    task: str
    model: str
    data: str
    status: str
    metric: str
    before: float | None
    after: float | None
    minutes: float | None

    def as_row(self) -> dict:
        return self.__dict__.copy()


def inside(runs: Path, relative: str) -> Path:
    """`runs / relative`, resolved; NotInRuns when it leaves the runs folder or does not exist."""
    root = runs.resolve()
    try:
        path = (root / relative).resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise NotInRuns(relative) from err
    if path != root and root not in path.parents:
        raise NotInRuns(relative)
    return path


def run_folder(runs: Path, name: str) -> RunDir:
    """The run folder `name` directly under the runs folder; NotInRuns for anything else."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise NotInRuns(name)
    path = inside(runs, name)
    if path.parent != runs.resolve() or not is_run_folder(path):
        raise NotInRuns(name)
    return RunDir(path)


def is_run_folder(path: Path) -> bool:
    """A folder a run made (config.yaml or run.json), not a half-written one nor an old run kept aside."""
    return (path.is_dir() and not path.name.startswith(".") and not path.name.endswith((PARTIAL, PREVIOUS))
            and ((path / "run.json").is_file() or (path / "config.yaml").is_file()))


def list_runs(runs: Path) -> list[RunSummary]:
    """Every run folder under `runs` (one with a config.yaml or run.json), newest first."""
    if not runs.is_dir():
        return []
    folders = [p for p in runs.iterdir() if is_run_folder(p)]
    folders.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [summarize(RunDir(p)) for p in folders]


def summarize(run: RunDir) -> RunSummary:
    info = read_json(run.run_json) or {}
    config = saved_config(run)
    stages = info.get("stages") or {}
    seconds = sum(s.get("seconds", 0) for s in stages.values() if isinstance(s, dict))
    metric, before, after = headline(read_json(run.comparison_json) or {})
    status = "finished" if run.is_finished() else info.get("status") or ("prepared" if run.data.exists() else "new")
    return RunSummary(run.root.name, str(info.get("task") or config.get("task") or ""),
                      str((config.get("model") or {}).get("source") or ""), str((config.get("data") or {}).get("source") or ""),
                      status, metric, before, after, round(seconds / 60, 2) if stages else None)


def headline(comparison: dict) -> tuple[str, float | None, float | None]:
    """The first of HEADLINE_METRICS the comparison has (else its first metric): name, before, after."""
    metrics = {k: v for k, v in (comparison.get("metrics") or {}).items() if isinstance(v, dict)}
    for name in (*HEADLINE_METRICS, *metrics):
        row = metrics.get(name)
        if row and isinstance(row.get("before"), (int, float)) and isinstance(row.get("after"), (int, float)):
            return name, float(row["before"]), float(row["after"])
    return "", None, None


def saved_config(run: RunDir) -> dict:
    try:
        value = yaml.safe_load(run.saved_config() or "")
    except yaml.YAMLError:
        return {}
    return value if isinstance(value, dict) else {}


def history(run: RunDir) -> list[dict]:
    """The training log so far: the live JSON-lines file while training, else the finished log_history.json.

    A line being appended may be cut short; it is left out until it is whole."""
    live = run.train / HISTORY_LIVE
    entries: list[dict] = []
    if live.is_file():
        for line in live.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                break
            if isinstance(entry, dict):
                entries.append(entry)
    return entries if entries else run.history()


def artifacts(run: RunDir) -> list[tuple[str, int]]:
    """Files of the run (relative path, bytes), checkpoints left out, sorted by path."""
    found = []
    for path in sorted(run.root.rglob("*")):
        relative = path.relative_to(run.root)
        if path.is_file() and relative.parts[0] != "checkpoints" and not path.name.endswith(PARTIAL):
            found.append((relative.as_posix(), path.stat().st_size))
    return found


def log_tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a text file ('' when missing), read from its end."""
    if not path.is_file():
        return ""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024))
        text = handle.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])
