"""What the studio reads from the runs folder: one summary per run folder, files resolved safely, the training history.

Everything here only reads. A path the browser names is resolved and must stay inside the runs folder (symbolic
links and `..` included): anything else is `NotInRuns`, which the pages answer with 404.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from emotune.core.rundir import PARTIAL, PREVIOUS, RunDir, read_json
from emotune.core.spreadsheet import from_spreadsheet_cell
from emotune.sweep.runner import MANIFEST

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
    before_interval: list[float] | None = None  # 95% bootstrap interval (comparison.json's `intervals`)
    after_interval: list[float] | None = None

    def as_row(self) -> dict:
        return self.__dict__.copy()


def inside(runs: Path, relative: str) -> Path:
    """`runs / relative`, resolved; NotInRuns when it leaves the runs folder or does not exist."""
    root = runs.resolve()
    try:
        path = (root / relative).resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as err:  # ValueError: a NUL byte, which no path can hold
        raise NotInRuns(relative) from err
    if path != root and root not in path.parents:
        raise NotInRuns(relative)
    return path


def child(runs: Path, name: str, kind) -> Path:
    """The folder `name` directly under the runs folder for which `kind(path)` holds; NotInRuns for anything else."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise NotInRuns(name)
    path = inside(runs, name)
    if path.parent != runs.resolve() or not kind(path):
        raise NotInRuns(name)
    return path


def run_folder(runs: Path, name: str) -> RunDir:
    """The run folder `name` directly under the runs folder; NotInRuns for anything else."""
    return RunDir(child(runs, name, is_run_folder))


def any_run(runs: Path, relative: str) -> RunDir:
    """A run folder under the runs folder: `NAME`, or a sweep's trial `SWEEP/TRIAL`; NotInRuns for anything else."""
    parts = relative.split("/")
    if len(parts) == 1:
        return run_folder(runs, relative)
    if len(parts) != 2 or "\\" in relative or any(not p or p.startswith(".") for p in parts):
        raise NotInRuns(relative)
    sweep = sweep_folder(runs, parts[0])
    path = inside(runs, relative)
    if path.parent != sweep or not is_run_folder(path):
        raise NotInRuns(relative)
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
    """The run's row; a run.json, comparison.json or config.yaml that holds something else than emotune writes there
    (a list, text for a number, NaN) gives blanks in its place, never an error that takes the runs table down."""
    info = read_json(run.run_json) or {}
    config = saved_config(run)
    stages = _dict(info.get("stages"))
    seconds = sum(_finite(s.get("seconds")) or 0.0 for s in stages.values() if isinstance(s, dict))
    comparison = read_json(run.comparison_json) or {}
    metric, before, after = headline(comparison)
    intervals = _dict(_dict(comparison.get("intervals")).get(metric)) if metric else {}
    status = "finished" if run.is_finished() else _text(info.get("status")) or ("prepared" if run.data.exists() else "new")
    return RunSummary(run.root.name, _text(info.get("task")) or _text(config.get("task")),
                      _text(_dict(config.get("model")).get("source")), _text(_dict(config.get("data")).get("source")),
                      status, metric, before, after, round(seconds / 60, 2) if stages and math.isfinite(seconds) else None,
                      _interval(intervals.get("before")), _interval(intervals.get("after")))


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _text(value) -> str:
    """A value a page shows as a word (a status, a task, a model's name): text as it is, a number as text, else ''."""
    return str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""


def _finite(value) -> float | None:
    """A finite number (not a bool), else None: a JSON answer cannot hold NaN or infinity."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _interval(value) -> list[float] | None:
    ok = isinstance(value, list) and len(value) == 2 and all(_finite(v) is not None for v in value)
    return [float(v) for v in value] if ok else None


def headline(comparison: dict) -> tuple[str, float | None, float | None]:
    """The first of HEADLINE_METRICS the comparison has (else its first metric): name, before, after."""
    metrics = {k: v for k, v in _dict(comparison.get("metrics")).items() if isinstance(v, dict)}
    for name in (*HEADLINE_METRICS, *metrics):
        row = metrics.get(name)
        if row and _finite(row.get("before")) is not None and _finite(row.get("after")) is not None:
            return name, float(row["before"]), float(row["after"])
    return "", None, None


def config_text(run: RunDir) -> str:
    """config.yaml's text ('' when there is none); bytes that are not UTF-8 shown as \ufffd, not an error."""
    return run.config.read_bytes().decode("utf-8", errors="replace") if run.config.is_file() else ""


def saved_config(run: RunDir) -> dict:
    try:
        value = yaml.safe_load(config_text(run))
    except (yaml.YAMLError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def history(run: RunDir) -> list[dict]:
    """The training log so far: the live JSON-lines file while training, else the finished log_history.json.

    A line being appended may be cut short; it is left out until it is whole."""
    live = run.train / HISTORY_LIVE
    entries: list[dict] = []
    if live.is_file():
        for line in live.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                break
            if isinstance(entry, dict):
                entries.append(entry)
    return entries if entries else run.history()


def run_details(run: RunDir) -> dict:
    """What the run page shows beside the curve: the training plan run.json records (micro-batch, accumulation, what
    fits), the step count asked for (for the ETA), and the latest telemetry sample (memory, CPU, GPU)."""
    info = read_json(run.run_json) or {}
    train = _dict(_dict(info.get("stages")).get("train"))
    max_steps = _dict(saved_config(run).get("train")).get("max_steps")
    return {"plan": train.get("plan"),
            "max_steps": max_steps if isinstance(max_steps, int) else None, "telemetry": last_line(run.telemetry)}


def telemetry_row(sample: dict) -> dict:
    """A telemetry sample as the page shows it: {"stage": ..., "values": {name: [value, unit]}}."""
    from emotune.runtime.telemetry import UNITS

    return {"stage": sample.get("stage"), "values": {k: [v, UNITS[k]] for k, v in sample.items()
                                                     if k in UNITS and isinstance(v, (int, float))}}


def last_line(path: Path) -> dict | None:
    """The last whole JSON line of a file (None when there is none)."""
    for line in reversed(log_tail(path, 5).splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def artifacts(run: RunDir) -> list[tuple[str, int]]:
    """Files of the run (relative path, bytes), checkpoints left out, sorted by path; a link to a file outside the run
    folder is left out too (its page would answer 404, and its size is not the run's to tell)."""
    found, root = [], run.root.resolve()
    for path in sorted(run.root.rglob("*")):
        relative = path.relative_to(run.root)
        if path.is_symlink() and root not in path.resolve().parents:
            continue
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


# --------------------------------------------------------------------------------------------------
# Sweeps


@dataclass
class SweepSummary:
    name: str
    status: str
    mode: str
    metric: str
    trials: list[dict]  # sweep.json's entries: name, status, value, overrides, ...
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)  # (name, header, rows)
    best: str | None = None  # best.yaml's text


def is_sweep_folder(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith(".") and not path.name.endswith((PARTIAL, PREVIOUS)) \
        and (path / MANIFEST).is_file()


def sweep_folder(runs: Path, name: str) -> Path:
    """The sweep folder `name` directly under the runs folder (`emotune sweep` writes `<name>-sweep/`)."""
    return child(runs, name, is_sweep_folder)


def list_sweeps(runs: Path) -> list[SweepSummary]:
    if not runs.is_dir():
        return []
    folders = sorted((p for p in runs.iterdir() if is_sweep_folder(p)), key=lambda p: p.stat().st_mtime, reverse=True)
    return [summarize_sweep(p) for p in folders]


def summarize_sweep(folder: Path) -> SweepSummary:
    """sweep.json (the plan and every trial's state, rewritten as trials start and end) and the tables the sweep
    wrote when it ended (ablation.csv first, then trials.csv), each cell as the value it holds (the `'` the CSV puts
    before a text a spreadsheet would run as a formula taken off: emotune.core.spreadsheet)."""
    manifest = read_json(folder / MANIFEST) or {}
    plan, trials = _dict(manifest.get("plan")), manifest.get("trials")
    tables = []
    for name in ("ablation", "trials"):
        path = folder / f"{name}.csv"
        if path.is_file():
            with path.open(encoding="utf-8", errors="replace", newline="") as handle:
                rows = [[from_spreadsheet_cell(cell) for cell in row] for row in csv.reader(handle)]
            if rows:
                tables.append((name, rows[0], rows[1:]))
    best = folder / "best.yaml"
    return SweepSummary(folder.name, _text(manifest.get("status")) or "?", _text(plan.get("mode")),
                        _text(plan.get("metric")), [t for t in trials if isinstance(t, dict)] if isinstance(trials, list) else [],
                        tables, best.read_bytes().decode("utf-8", errors="replace") if best.is_file() else None)
