"""The run folder: every file and folder of a run by name, atomic writes, and the run's life cycle.

The run's top-level files and folders are named here only; other modules ask a `RunDir` for the path
(the files inside a stage's folder, such as metrics.json, are named by the module that writes them). Every writer in the
package writes through `atomic_file` / `atomic_dir`: the output appears whole under its final name or
not at all, so a crash never leaves a half-written file where a good one was.

Life cycle (`open_run`):
- a folder is `finished` only when run.json says so *and* every output it lists exists;
- `overwrite=true` moves an old run aside (`<name>.previous`) only after the new run's config, data and
  model source have validated, and deletes it when the new run finishes; input the data stage refuses (checks
  that need the tokenizer) puts it back;
- an unfinished folder made with the same config is resumed stage by stage; one made with another
  config is refused.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import yaml

from emotune.core import locks
from emotune.core.errors import UserError

PARTIAL = ".partial"  # suffix of a file or folder while it is being written
PREVIOUS = ".previous"  # suffix of a run folder moved aside by overwrite=true until the new run finishes
STAGE_MARKER = "[emotune] stage"  # printed at every stage start and end; tests kill runs on it


# --------------------------------------------------------------------------------------------------
# Atomic writes: one convention for the whole package


def partial_path(path: Path, unique: bool = False) -> Path:
    """`<name>.partial`; `unique`: `<name>.<random>.partial`, so two writers of one file never share a temp file."""
    return path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}{PARTIAL}" if unique else path.name + PARTIAL)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path, unique=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on success it takes `path`'s place.

    An existing `path` is removed only once the new folder is complete (`replace=True`), else
    FileExistsError. A failed write removes the temporary folder and leaves `path` as it was."""
    path = Path(path)
    tmp = partial_path(path, unique=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        if not replace:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(path)
        old = partial_path(path.with_name(path.name + ".replaced"), unique=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def write_text(path: str | Path, text: str) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | Path, data) -> Path:
    return write_text(path, json_text(data))


def json_text(data, indent: int | None = 2) -> str:
    """`data` as standard JSON: a float that is not finite (a diverged loss, an overflowed gradient norm) is written as
    null. Python would write the bare words NaN and Infinity, which JSON does not have: JavaScript's JSON.parse, jq
    and most other readers refuse the whole file."""
    return json.dumps(finite(data), indent=indent, ensure_ascii=False, allow_nan=False)


def finite(data):
    """`data` with every non-finite float in it replaced by None (dicts, lists and tuples are walked)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(value) for value in data]
    return data


def read_json(path: str | Path) -> dict | None:
    """The JSON object at `path`, or None when it is missing or unreadable (e.g. cut short by a crash)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def remove_partial_writes(folder: Path) -> None:
    """Delete leftovers of writes a crash interrupted (never a complete file)."""
    if folder.is_dir():
        for leftover in folder.glob("*" + PARTIAL):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def remove_stale_partials(path: Path) -> list[Path]:
    """Delete what killed writers of `path` left beside it (`<name>.<random>.partial`, and the `<name>.replaced`
    copies of an interrupted replacement); never `path` itself. Only for a caller that holds the lock every writer
    of `path` takes, so no live writer's folder is among them. Returns what was removed."""
    path = Path(path)
    stale = [p for pattern in (f"{path.name}.*{PARTIAL}", f"{path.name}.replaced.*{PARTIAL}") for p in path.parent.glob(pattern)]
    for leftover in stale:
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return stale


# --------------------------------------------------------------------------------------------------
# The layout


class RunDir:
    """Every file and folder of one run, by name."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.replacing = False  # open_run moved an old run aside for this one (overwrite=true)

    def __fspath__(self) -> str:
        return str(self.root)

    def __truediv__(self, other: str) -> Path:
        return self.root / other

    config = property(lambda self: self.root / "config.yaml")
    """The resolved config the run was made with."""
    run_json = property(lambda self: self.root / "run.json")
    """Versions, hardware, precision, status and timing of every stage, and the outputs of a finished run."""
    data = property(lambda self: self.root / "data")
    """The prepared splits (Parquet), data_report.json and label_distribution.png."""
    data_report = property(lambda self: self.root / "data" / "data_report.json")
    baseline = property(lambda self: self.root / "baseline")
    """The base model's evaluation: metrics.json and predictions.csv per method."""
    finetuned = property(lambda self: self.root / "finetuned")
    """The fine-tuned model's evaluation, in the same layout as baseline/."""
    adapter = property(lambda self: self.root / "adapter")
    """The trained adapter (see emotune.model.artifacts)."""
    model = property(lambda self: self.root / "model")
    """The trained model itself, a whole model folder, when `train.finetuning` is full or freeze (emotune.model.artifacts)."""
    checkpoints = property(lambda self: self.root / "checkpoints")
    train = property(lambda self: self.root / "train")
    """Training log (log_history.jsonl while training, log_history.json after) and loss_curve.png."""
    def history(self) -> list[dict]:
        """The finished training log (train/log_history.json): one entry per logged step or validation; [] when the
        run has none (not trained yet) or it is unreadable."""
        try:
            value = json.loads((self.train / "log_history.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return []
        return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []

    telemetry = property(lambda self: self.root / "telemetry.jsonl")
    """Telemetry samples of the stages that run the model, one JSON line each (emotune.runtime.telemetry)."""
    comparison_json = property(lambda self: self.root / "comparison.json")
    comparison_csv = property(lambda self: self.root / "comparison.csv")
    report_html = property(lambda self: self.root / "report.html")
    figures = property(lambda self: self.root / "report")
    """The report's figures as PNGs."""
    adapter_stats = property(lambda self: self.root / "report" / "adapter_stats.json")
    """The adapter's weight norms and B histograms per target module group (emotune.model.adapter_stats), with the report."""
    evals = property(lambda self: self.root / "eval")
    """Results of `emotune eval` on its own."""
    export = property(lambda self: self.root / "export")
    """Default output of `emotune export`."""

    @property
    def previous(self) -> Path:
        return self.root.with_name(self.root.name + PREVIOUS)

    def status(self) -> str | None:
        return (read_json(self.run_json) or {}).get("status")

    def is_finished(self) -> bool:
        """run.json says finished and every output it lists (paths inside the run folder) is there; a run.json that
        holds something else than emotune writes (a list, outputs that are not paths) is no finished run."""
        run = read_json(self.run_json)
        outputs = run.get("outputs", []) if isinstance(run, dict) else None
        return (isinstance(outputs, list) and run.get("status") == "finished"
                and all(isinstance(p, str) and (self.root / p).exists() for p in outputs))

    def saved_config(self) -> str | None:
        # emotune writes it in UTF-8; bytes an editor saved otherwise show as replacement characters, no traceback
        return self.config.read_text(encoding="utf-8", errors="replace") if self.config.is_file() else None

    def saved_settings(self) -> dict:
        """config.yaml as a mapping of sections, for reports that show a few of its values; {} when it is missing,
        unreadable, not YAML or not a mapping (an edited or cut-short file must not stop a report)."""
        try:
            value = yaml.safe_load(self.saved_config() or "")
        except (OSError, ValueError, yaml.YAMLError):
            return {}
        return value if isinstance(value, dict) else {}

    def has_run(self) -> bool:
        """Something beyond prepared data: a run (finished or not) lives here."""
        return self.run_json.is_file() or self.adapter.exists() or self.model.exists() or self.baseline.exists()


# --------------------------------------------------------------------------------------------------
# Life cycle


def run_lock(root: str | Path) -> Path:
    """The lock of a run folder: beside it (`.NAME.lock`), so it stays put when overwrite moves the run aside."""
    root = Path(root)
    return root.with_name(f".{root.name}{locks.LOCK_SUFFIX}")


def lock_run(root: str | Path) -> None:
    """Hold `root` for this process (until `release_run_lock` or the process ends); LockHeld names another holder."""
    locks.acquire(run_lock(root), f"the run folder {root}")


def release_run_lock(root: str | Path) -> None:
    locks.release(run_lock(root))


def holds_run_lock(command):
    """A command on `cfg.run_dir` that gives the run folder's lock back when it returns or fails."""
    @functools.wraps(command)
    def wrapper(cfg, *args, **kwargs):
        try:
            return command(cfg, *args, **kwargs)
        finally:
            release_run_lock(cfg.run_dir)
    return wrapper


def open_run(root: Path, config_text: str, overwrite: bool, data_fingerprint: str | None = None) -> RunDir:
    """Claim `root` for a run whose config, data and model source have already validated.

    Locks it against other processes first (emotune.core.locks). Resumes an unfinished run made with the same
    config and data; refuses a finished run, and an unfinished one made with another config or data; with
    `overwrite`, moves any old run aside instead."""
    check_folder_path(root, "the run folder (output_dir/name)")
    check_not_inside_a_run(root)
    check_not_foreign(RunDir(root))
    lock_run(root)
    run = RunDir(root)
    other_data = _other_data(run, data_fingerprint)
    if run.has_run():  # prepared data alone (`emotune data`) is simply prepared again
        if overwrite:
            move_aside(run)
            run.replacing = True  # the old run waits as `.previous`; bad input found next puts it back
        elif run.is_finished():
            raise UserError(f"The run folder `{root}` holds a finished run{' made with other data' if other_data else ''}. "
                            "Pass overwrite=true to replace it (the old "
                            f"run is kept as `{run.previous.name}` until the new one finishes), or name=<new name> to keep both.")
        elif other_data or _comparable(run.saved_config()) != _comparable(config_text):
            raise UserError(f"The run folder `{root}` holds an unfinished run made with a different config or data, so it "
                            f"cannot be resumed ({_differences(run.saved_config(), config_text, other_data)}). Pass "
                            "overwrite=true to start over, name=<new name>, or the run's own settings to resume it.")
    run.root.mkdir(parents=True, exist_ok=True)
    for folder in (run.root, run.data, run.baseline, run.finetuned, run.checkpoints):
        remove_partial_writes(folder)
    write_text(run.config, config_text)
    return run


def check_folder_path(folder: Path, what: str, fix: str | None = None) -> None:
    """Refuse a folder to be made where it or a folder above it is an existing file (mkdir's FileExistsError or
    NotADirectoryError otherwise, a traceback), or where nothing can be made (a read-only file system, a folder of
    another user's, /proc): names the file or folder, and `fix` (default: set output_dir or name=)."""
    fix = fix or ("Set output_dir to a folder (it is made if missing, e.g. output_dir=runs) or another name=.")
    for path in (Path(folder), *Path(folder).parents):
        if path.exists() and not path.is_dir():
            where = " in it" if path != Path(folder) else ""
            raise UserError(f"`{path}` is a file, so {what} `{folder}` cannot be made{where}. Move or rename that "
                            f"file, or {fix[0].lower()}{fix[1:]}")
        if path.exists():
            _check_writable(path, folder, what, fix)
            return


def _check_writable(existing: Path, folder: Path, what: str, fix: str) -> None:
    """Make and remove an empty folder in `existing` (the nearest folder of `folder` that exists), as the write will."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".emotune-probe-", dir=existing))
    except OSError as err:
        raise UserError(f"Nothing can be written in `{existing}` ({err.strerror or type(err).__name__}), so {what} "
                        f"`{folder}` cannot be made. {fix}") from None


def check_not_inside_a_run(root: Path) -> None:
    """Refuse a run folder inside another run's folder (`output_dir=runs/cpu`, `name=adapter`): its config.yaml,
    data/ and results would be written among the other run's own (into its adapter/, say), and either run's
    commands would read the mix."""
    for parent in Path(root).resolve().parents:
        if (parent / "run.json").is_file():
            raise UserError(f"The run folder `{root}` would be inside the run folder `{parent}` (its run.json is there), "
                            "where that run keeps its own adapter and results. Set output_dir to a folder of runs (e.g. "
                            "output_dir=runs, where runs are made by default) and name= to this run's own name.")


RUN_ENTRIES = ("config.yaml", "run.json", "data", "baseline", "finetuned", "adapter", "model", "checkpoints", "train",
               "telemetry.jsonl", "comparison.json", "comparison.csv", "report.html", "report", "eval", "export")
"""What a run writes into its folder (RunDir's paths): a folder holding only these (and partial writes) is a run's."""
IGNORED_ENTRIES = (".DS_Store", "Thumbs.db", "desktop.ini", ".gitkeep")


def check_not_foreign(run: RunDir) -> None:
    """Refuse a run folder that already holds files emotune did not write (`output_dir=.`, or a project folder as
    name=): the run's outputs would be mixed with them, and a later overwrite=true moves the whole folder aside and
    deletes it when the new run finishes, the user's files with it."""
    if not run.root.is_dir() or run.has_run():  # a run's own folder: resumed, refused or replaced as open_run says
        return
    foreign = sorted(p.name for p in run.root.iterdir()
                     if p.name not in RUN_ENTRIES + IGNORED_ENTRIES and not p.name.endswith(PARTIAL))
    if foreign:
        shown = ", ".join(f"`{name}`" for name in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"The run folder `{run.root}` already holds files that are not a run's ({shown}). A run writes "
                        "its config, data, adapter and results into a folder of its own, and overwrite=true later "
                        "replaces that folder as a whole, so emotune does not mix them with other files. Set name= to a "
                        "new name (the run folder is output_dir/name; output_dir=runs by default), or empty the folder.")


def move_aside(run: RunDir) -> None:
    """Keep an old run as `<name>.previous` until the run replacing it finishes.

    With a `.previous` already there, an unfinished run in `root` is an earlier attempt at the same
    replacement that never finished: it is the one discarded, and the run kept aside stays."""
    if run.previous.exists():
        if not run.is_finished():
            shutil.rmtree(run.root)
            print(f"The unfinished run in {run.root} is discarded; the old run stays kept as {run.previous} until "
                  "this run finishes.", flush=True)
            return
        shutil.rmtree(run.previous)  # an older run emotune itself moved aside earlier
    os.replace(run.root, run.previous)
    print(f"The old run in {run.root} is kept as {run.previous} until this run finishes.", flush=True)


@contextmanager
def old_run_back_on_refusal(run: RunDir) -> Iterator[None]:
    """Checks that need the tokenizer (labels it cannot tell apart, prompts longer than `train.max_length`) run in
    the data stage, after `overwrite=true` moved the old run aside: when one refuses the input, the new run's folder
    is removed and the old run put back where it was, so a refused run never leaves the user without the run they had."""
    try:
        yield
    except UserError:
        if run.replacing and run.previous.exists():
            shutil.rmtree(run.root, ignore_errors=True)
            os.replace(run.previous, run.root)
            run.replacing = False
            print(f"Nothing was changed: the old run is back in {run.root}.", flush=True)
        raise


def drop_previous(run: RunDir) -> None:
    if run.previous.exists():
        shutil.rmtree(run.previous, ignore_errors=True)


def _other_data(run: RunDir, fingerprint: str | None) -> bool:
    saved = (read_json(run.data_report) or {}).get("fingerprint")
    return fingerprint is not None and saved is not None and saved != fingerprint


# Keys that change how a run is carried out, not what it computes: a run may resume with them changed
# (e.g. FSDP under torchrun with train.fsdp=true, resumed by `accelerate launch --use_fsdp`; a run begun before
# train.shared_prefix or train.telemetry_interval existed, or with them changed).
NOT_COMPARED = ("overwrite:", "  fsdp:", "  shared_prefix:", "  telemetry_interval:")
# Keys compared like any other, except at a default that computes what the config meant before the key existed: a
# run begun before lora.layers resumes with it null (every layer), and not with any other value; one begun before
# data.input_separator with its blank line (how sft rows joined an instruction and its input then); one begun before
# lora.target_parameters with it null (LoRA on modules only); one begun before train.adam_* with AdamW's defaults.
SAME_AS_ABSENT = ("  layers: null", '  input_separator: "\\n\\n"', "  target_parameters: null", "  adam_beta1: 0.9",
                  "  adam_beta2: 0.999", "  adam_epsilon: 1.0e-08")


def _comparable(config_yaml: str | None) -> str | None:
    if config_yaml is None:
        return None
    return "\n".join(line for line in config_yaml.splitlines()
                     if not line.startswith(NOT_COMPARED) and line not in SAME_AS_ABSENT)


def _differences(saved: str | None, config_text: str, other_data: bool) -> str:
    """What differs from the unfinished run: its data, and up to 5 settings as `key: now (the run's: before)`."""
    def flat(text: str | None, prefix: str = "") -> dict:
        tree = yaml.safe_load(_comparable(text) or "") if isinstance(text, str) else text
        if not isinstance(tree, dict):
            return {}
        return {k: v for key, value in tree.items()
                for k, v in (flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}).items()}
    try:
        before, now = flat(saved), flat(config_text)
    except yaml.YAMLError:
        before, now = {}, {}
    keys = [k for k in dict.fromkeys([*now, *before]) if before.get(k, "absent") != now.get(k, "absent")]
    said = [f"{k}: {now.get(k, 'absent')} (the run's: {before.get(k, 'absent')})" for k in keys[:5]]
    said += [f"and {len(keys) - 5} more"] if len(keys) > 5 else []
    return "; ".join((["the data differs from the data it was made with"] if other_data else []) + said) or "its config"


class RunLog:
    """run.json: versions, hardware, precision, and status and timing of every stage."""

    CARRIED = ("merged_eval",)  # facts `record`ed by a stage, kept when a resumed run skips that stage

    def __init__(self, run: RunDir, base: dict):
        self.run = run
        previous = read_json(run.run_json) or {}
        self.data = {**base, "stages": previous.get("stages", {}), "started": previous.get("started", _now()),
                     **{key: previous[key] for key in self.CARRIED if key in previous}}
        self.data["status"] = "running"
        self.write()

    @contextmanager
    def stage(self, name: str):
        entry = self.data["stages"].setdefault(name, {})
        entry.update(status="running", started=_now())
        entry.pop("note", None)
        self.write()
        print(f"{STAGE_MARKER} {name}: start", flush=True)
        started = time.perf_counter()
        try:
            yield entry
        except BaseException:
            entry.update(status="failed", seconds=round(time.perf_counter() - started, 2))
            self.data["status"] = "failed"
            self.write()
            raise
        entry.update(status="done", seconds=round(time.perf_counter() - started, 2))
        self.write()
        print(f"{STAGE_MARKER} {name}: done", flush=True)

    def note(self, key: str, value) -> None:
        """Put what a stage has to say into run.json under `key` (e.g. training's out-of-memory changes), now."""
        self.data[key] = value
        self.write()

    def skip(self, name: str, why: str) -> None:
        self.data["stages"].setdefault(name, {}).update(status="done", note=why)
        self.write()
        print(f"{STAGE_MARKER} {name}: skipped ({why})", flush=True)

    def record(self, stage: str, **fields) -> None:
        """Add what a stage decided (e.g. the train stage's shared prefix) to its entry."""
        self.data["stages"].setdefault(stage, {}).update(fields)
        self.write()

    def finish(self, outputs: list[Path]) -> None:
        """Mark the run finished; refused while any of `outputs` is missing."""
        missing = [p for p in outputs if not p.exists()]
        if missing:
            raise RuntimeError(f"run cannot finish: missing {', '.join(map(str, missing))}")
        self.data.update(status="finished", finished=_now(),
                         outputs=[str(p.relative_to(self.run.root)) for p in outputs])
        self.write()

    def write(self) -> None:
        write_json(self.run.run_json, self.data)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
