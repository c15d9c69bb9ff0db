"""`emotune sweep`: many runs of one config, each with a few keys changed, and the table that compares them.

    plan (validate every value) → claim the sweep folder → run the trials → table, best.yaml

A trial is a normal `emotune run` of the base config with its overrides (emotune.sweep.backends), in its
own run folder inside the sweep folder `<output_dir>/<name>-sweep/`:

    sweep.json            the plan and every trial with its overrides and status (written atomically)
    trial-000-r8-lr1e-4/  a run folder, as `emotune run` makes it
    logs/<trial>.log      each trial's output, every attempt appended
    optuna.journal        random/tpe only: the Optuna study, appended as it goes
    trials.csv, ablation.csv, table.md, best.yaml   written at the end

Re-running the same command skips the finished trials (their folders are not touched) and resumes an
unfinished one in its own folder through the run folder's own life cycle (emotune.core.rundir). A sweep
folder made with another plan (grid, mode, metric, seeds, or base config) is refused unless
`overwrite=true`, which keeps the old sweep as `<folder>.previous` until the new one finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from emotune.core.config.build import dump_config
from emotune.core.config.load import load_config
from emotune.core.config.run import RunConfig
from emotune.core.config.sweep import SEARCH_MODES, Param, is_spec, parse_grid, split_values
from emotune.core.errors import UserError, raise_problems
from emotune.core.rundir import PARTIAL, PREVIOUS, RunDir, check_folder_path, read_json, remove_partial_writes, write_json, write_text
from emotune.sweep.backends import Job, device_slots, require_ray, run_local, run_ray
from emotune.sweep.search import ListSource, OptunaSource, Outcome, require_optuna
from emotune.sweep.space import Trial, ablation_trials, grid_trials
from emotune.sweep.table import (
    ablation_table,
    direction_of,
    format_text,
    read_result,
    trial_table,
    write_tables,
)
from emotune.tasks import task_for

MANIFEST = "sweep.json"
JOURNAL = "optuna.journal"
LOCK = "sweep.lock"


# --------------------------------------------------------------------------------------------------
# The config: the command line's --grid merged into sweep.grid


def parse_cli_grid(items: list[str]) -> dict[str, list[str] | str]:
    """`--grid lora.r=8,16 train.learning_rate=loguniform(1e-5,1e-3)` → {key: values or range}."""
    grid, problems = {}, []
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or not text.strip():
            problems.append(f"`{item}`: --grid takes key=value1,value2,... or key=range, e.g. lora.r=8,16,32")
            continue
        if key.strip() in grid:  # the later one replaced the earlier: a sweep over fewer values than asked for
            problems.append(f"`{item}`: --grid names {key.strip()} more than once; give all its values in one item, "
                            f"e.g. {key.strip()}=8,16,32")
            continue
        try:
            grid[key.strip()] = text.strip() if is_spec(text) else split_values(text)
        except ValueError as err:
            problems.append(f"--grid {item}: {err}")
    raise_problems("The --grid argument", problems, "Fix them and run again.")
    return grid


def load_sweep_config(config: str | None, overrides: list[str], grid: list[str], flags: list[str]) -> RunConfig:
    """The resolved config with the command line's sweep options; `--grid` keys replace the same keys of sweep.grid."""
    cli_grid = parse_cli_grid(grid)
    cfg = load_config(config, [*overrides, *flags])
    if cli_grid:
        merged = json.dumps({**cfg.sweep.grid, **cli_grid}, ensure_ascii=False, default=str)
        cfg = load_config(config, [*overrides, *flags, f"sweep.grid={merged}"])
    return cfg


# --------------------------------------------------------------------------------------------------
# The plan: everything checked before any trial starts


@dataclass
class Plan:
    mode: str
    metric: str
    direction: str
    params: list[Param]
    trials: list[Trial]  # grid and ablation: all of them; random/tpe: drawn as the sweep goes
    budget: int | None
    base_config: str  # what every trial starts from (its resolved config, without the sweep's own keys)
    task: str
    seed: int

    def comparable(self) -> dict:
        """What must match for a sweep folder to be resumed (the number of random/tpe trials may grow)."""
        return {"mode": self.mode, "metric": self.metric, "direction": self.direction,
                "trials": [t.as_dict() for t in self.trials],
                "space": {p.key: list(p.values) if not p.is_range else f"{p.kind}({p.low},{p.high})" for p in self.params},
                "base_config": self.base_config}


def make_plan(cfg: RunConfig, config: str | None, overrides: list[str]) -> Plan:
    """The trials, metric and direction; every value of every key is validated as the config it makes."""
    sweep = cfg.sweep
    params = parse_grid(sweep.grid)
    task = task_for(cfg)
    metric = sweep.metric or task.DEFAULT_METRIC
    problems = []
    if metric not in task.COMPARED_METRICS:
        problems.append(f"`sweep.metric`: {metric!r} is not a metric of task {cfg.task}; choose one of "
                        + ", ".join(task.COMPARED_METRICS))
    if not params:
        problems.append("nothing to sweep: give --grid key=value1,value2 (e.g. --grid lora.r=8,16) or sweep.grid in "
                        "the config")
    base = _trial_config(config, overrides, [], problems)
    base_values = base.model_dump(mode="json") if base else {}
    is_base = {}
    for param in params if base is not None else []:  # a broken base config would repeat its problem per value
        texts = param.values if not param.is_range else _bounds(param)
        for text in texts:
            trial_cfg = _trial_config(config, overrides, [f"{param.key}={text}"], problems, f"{param.key}={text}")
            if trial_cfg is not None:
                is_base[param.key, text] = _value_at(trial_cfg.model_dump(mode="json"), param.key) == \
                    _value_at(base_values, param.key)
                if _measured_on(trial_cfg.model_dump(mode="json")) != _measured_on(base_values):
                    problems.append(f"{param.key}={text}: {OTHER_TEST_SET}")
    raise_problems("The sweep", problems, "Fix them in sweep.grid / --grid or the config and run again.")
    seeds = [cfg.seed + i for i in range(sweep.seeds)] if sweep.seeds > 1 else None
    if sweep.mode == "grid":
        trials = grid_trials(params, seeds)
    elif sweep.mode == "ablation":
        trials = ablation_trials(params, lambda key, text: is_base[key, text], seeds)
    else:
        trials = []
    return Plan(sweep.mode, metric, direction_of(metric, sweep.direction), params, trials, sweep.trials,
                dump_config(base), cfg.task, cfg.seed)


# data settings that change only what is trained on, not the rows or labels a trial is measured on
TRAINING_ONLY_DATA = ("train_limit", "validation_limit", "balance", "cache_dir")
OTHER_TEST_SET = ("changes the test rows or labels the trial is measured on, so its numbers could not be ranked "
                  "against the other trials' (a sweep compares settings on one test set); sweep each data setting in "
                  "a sweep of its own, or compare finished runs with `emotune compare --allow-mismatch`")


def _measured_on(values: dict) -> tuple:
    """What decides a trial's measured rows and labels: the data section (its training-only keys aside, and sft's
    `datasets` when `eval_datasets` names the test split) and `eval.split`."""
    data = {k: v for k, v in (values.get("data") or {}).items() if k not in TRAINING_ONLY_DATA}
    if data.get("eval_datasets"):  # sft from a dataset_info.json: the test split is these, whatever is trained on
        data.pop("datasets", None)
    return data, (values.get("eval") or {}).get("split")


def _trial_config(config: str | None, overrides: list[str], extra: list[str], problems: list[str], label: str = ""):
    try:
        return load_config(config, [*overrides, *extra, "sweep={}", "name=trial", "output_dir=.", "overwrite=false"])
    except UserError as err:
        lines = [line.strip()[2:] for line in str(err).splitlines() if line.strip().startswith("- ")] or [str(err)]
        problems += [f"{label}: {line}" if label else line for line in lines]
        return None


def _bounds(param: Param) -> list[str]:
    """A range's two ends as override texts, each validated like a listed value."""
    return [str(int(param.low)), str(int(param.high))] if param.kind == "int" else [repr(param.low), repr(param.high)]


def _value_at(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


# --------------------------------------------------------------------------------------------------
# The sweep folder


def sweep_folder(cfg: RunConfig) -> Path:
    return (Path.cwd() / cfg.output_dir / f"{cfg.name or 'default'}-sweep").resolve()


def open_sweep(folder: Path, plan: Plan, overwrite: bool) -> tuple[dict, object]:
    """Claim the folder: resume a sweep with the same plan, refuse another plan (or move it aside with `overwrite`).
    Returns the manifest and the held lock (released when the process ends)."""
    check_folder_path(folder, "the sweep folder (output_dir/name-sweep)")
    manifest = read_json(folder / MANIFEST)
    if folder.exists() and any(folder.iterdir()):
        if manifest is None and any(p.name != LOCK and not p.name.endswith(PARTIAL) for p in folder.iterdir()):
            # overwrite=true would move it aside and delete it when the new sweep finishes, whatever it holds
            raise UserError(f"`{folder}` exists but holds no {MANIFEST}, so it is not a sweep folder emotune can resume "
                            "or replace. Move it away, or set name=<new name> for another folder.")
        held = _lock(folder)
        if overwrite:
            _move_aside(folder, manifest)
            manifest = None
        elif (changed := _differences(manifest.get("plan", {}), plan.comparable())):
            raise UserError(f"The sweep folder `{folder}` was made with a different {' and '.join(changed)}, so it cannot "
                            "be resumed. Run the same command as before to resume it, pass overwrite=true to start this "
                            f"sweep over (the old one is kept as `{folder.name}{PREVIOUS}` until the new one finishes), "
                            "or name=<new name> for another sweep folder.")
        held.close()
    folder.mkdir(parents=True, exist_ok=True)
    remove_partial_writes(folder)
    held = _lock(folder)
    if manifest is None:
        manifest = {"plan": plan.comparable(), "trials": [], "started": _now()}
    manifest.update(status="running", budget=plan.budget)
    write_json(folder / MANIFEST, manifest)  # from the start: a folder without one is not a sweep's
    return manifest, held


def _differences(saved: dict, now: dict) -> list[str]:
    names = {"mode": "sweep.mode", "metric": "sweep.metric", "direction": "sweep.direction",
             "trials": "grid (sweep.grid / --grid, or sweep.seeds)", "space": "grid (sweep.grid / --grid, or sweep.seeds)",
             "base_config": "base config (the YAML file or its key=value overrides)"}
    return list(dict.fromkeys(names[key] for key in names if saved.get(key) != now.get(key)))


def _lock(folder: Path):
    """An exclusive lock on the folder's lock file: one `emotune sweep` per sweep folder at a time."""
    handle = (folder / LOCK).open("a")
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one sweep per folder is then up to the user
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise UserError(f"Another `emotune sweep` is running in `{folder}`. Wait for it to finish (or stop it) and "
                        "run this command again.") from None
    return handle


def _move_aside(folder: Path, manifest: dict | None) -> None:
    """Keep the old sweep as `<folder>.previous` until the new one finishes; an unfinished replacement of an
    earlier overwrite is discarded instead (as emotune.core.rundir.move_aside does for runs)."""
    previous = folder.with_name(folder.name + PREVIOUS)
    if previous.exists():
        if (manifest or {}).get("status") != "finished":
            shutil.rmtree(folder)
            print(f"The unfinished sweep in {folder} is discarded; the old sweep stays kept as {previous}.", flush=True)
            return
        shutil.rmtree(previous)
    os.replace(folder, previous)
    print(f"The old sweep in {folder} is kept as {previous} until this sweep finishes.", flush=True)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Manifest:
    """sweep.json, rewritten atomically after every change of a trial's status (from several threads)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data, self._lock = path, data, threading.Lock()
        self.entries = {entry["name"]: entry for entry in data["trials"]}

    def add(self, trial: Trial, status: str) -> None:
        with self._lock:
            if trial.name not in self.entries:
                self.entries[trial.name] = {**trial.as_dict(), "overrides": trial.overrides}
                self.data["trials"].append(self.entries[trial.name])
            self.entries[trial.name]["status"] = status
            self.write()

    def started(self, trial: Trial, slot: str) -> None:
        self.add(trial, "running")
        with self._lock:
            entry = self.entries[trial.name]
            entry.update(device=slot, attempts=entry.get("attempts", 0) + 1, started=_now())
            self.write()
        print(f"[emotune] sweep {trial.name}: start on {slot}", flush=True)

    def finished(self, trial: Trial, slot: str, outcome: Outcome) -> None:
        status = "finished" if outcome.returncode == 0 else "failed"  # a finished run without the metric shows "—"
        with self._lock:
            self.entries[trial.name].update(status=status, returncode=outcome.returncode, value=outcome.value,
                                            ended=_now())
            self.write()
        print(f"[emotune] sweep {trial.name}: {status}" + (f" (exit status {outcome.returncode})" if status == "failed"
                                                            else ""), flush=True)

    def write(self) -> None:
        self.data["updated"] = _now()
        write_json(self.path, self.data)


# --------------------------------------------------------------------------------------------------
# The command


def sweep(cfg: RunConfig, config: str | None, overrides: list[str]) -> Path:
    """`emotune sweep`: plan, claim the folder, run what is not finished, write the table and best.yaml."""
    plan = make_plan(cfg, config, overrides)
    if plan.mode in SEARCH_MODES:
        require_optuna()
    if cfg.sweep.backend == "ray":
        require_ray()  # before anything is written; Ray decides where each trial runs
        slots = []
    else:
        slots = device_slots(cfg.device)
    folder = sweep_folder(cfg)
    data, held = open_sweep(folder, plan, cfg.overwrite)
    manifest = Manifest(folder / MANIFEST, data)
    job = Job(str(Path(config).resolve()) if config else None, tuple(overrides), str(folder), str(Path.cwd()), plan.metric)
    where = "on Ray" if cfg.sweep.backend == "ray" else (
        f"on {', '.join(s.label for s in slots)}, one trial per device at a time" if len(slots) > 1
        else f"on {slots[0].label}, one after another")
    print(f"Sweep folder: {folder}\nTrials run {where}; each trial's output is also in {folder / 'logs'}.", flush=True)
    try:
        source = _source(plan, folder, manifest)
        if cfg.sweep.backend == "ray":
            run_ray(source, job, manifest, cfg.sweep.ray_address, cfg.sweep.ray_cpus_per_trial)
        else:
            run_local(source, slots, job, manifest)
        trials = plan.trials or source.trials()
        _finish(folder, plan, trials, manifest, job)
    finally:
        held.close()
    return folder


def _source(plan: Plan, folder: Path, manifest: Manifest):
    """The trials still to run: a list with the finished ones skipped, or the Optuna study."""
    if plan.mode in SEARCH_MODES:
        source = OptunaSource(folder / JOURNAL, plan.params, plan.mode, plan.direction, plan.budget, plan.seed)
        for trial in source.interrupted:
            print(f"[emotune] sweep {trial.name}: interrupted earlier, resumed in its folder", flush=True)
        return source
    pending = []
    for trial in plan.trials:
        if RunDir(folder / trial.name).is_finished():
            manifest.add(trial, "finished")
            print(f"[emotune] sweep {trial.name}: skipped (finished)", flush=True)
        else:
            manifest.add(trial, "pending")
            pending.append(trial)
    print(f"{len(plan.trials)} trials: {len(plan.trials) - len(pending)} finished, {len(pending)} to run.", flush=True)
    return ListSource(pending)


def _finish(folder: Path, plan: Plan, trials: list[Trial], manifest: Manifest, job: Job) -> None:
    """The table (terminal, CSV, Markdown), best.yaml, and the sweep's status."""
    results = {t.name: read_result(folder / t.name, manifest.entries.get(t.name, {}).get("status", "pending"))
               for t in trials}
    keys = [p.key for p in plan.params]
    per_trial = trial_table(trials, results, keys, plan.metric, plan.direction, plan.task)
    tables = [("trials", per_trial)]
    if plan.mode == "ablation":
        tables.insert(0, ("ablation", ablation_table(trials, results, plan.metric, plan.direction, plan.task)))
    write_tables(folder, tables)
    print("\n" + "\n\n".join(format_text(table) for _, table in tables), flush=True)
    best = tables[0][1].best
    if best:
        write_text(folder / "best.yaml", _best_yaml(best[0], plan, job, folder))
        print(f"\nBest: {best[0].name if len(best) == 1 else best[0].extra.get('factor') or 'base'}; its config: "
              f"{folder / 'best.yaml'}", flush=True)
    failed = [t.name for t in trials if results[t.name].status != "finished"]
    manifest.data["status"] = "finished" if not failed else "incomplete"
    manifest.write()
    print(f"Tables: {folder / 'table.md'}", flush=True)
    if failed:
        retry = ("re-run the same command to retry them in their folders" if plan.mode not in SEARCH_MODES
                 else "a search does not retry a failed draw: raise sweep.trials to draw more")
        raise UserError(f"{len(failed)} of {len(trials)} trials did not finish: {', '.join(failed)}. Their output is in "
                        f"{folder / 'logs'}; {retry}.")
    shutil.rmtree(folder.with_name(folder.name + PREVIOUS), ignore_errors=True)


def _best_yaml(trial: Trial, plan: Plan, job: Job, folder: Path) -> str:
    """The best trial's config as a config file of its own (its name `<name>-best`, so running it keeps the sweep)."""
    changes = [f"{key}={text}" for key, text in trial.params]
    base = load_config(job.config, list(job.overrides))
    cfg = load_config(job.config, [*job.overrides, *changes, "sweep={}", "overwrite=false",
                                   f"name={base.name or 'default'}-best"])
    head = (f"# The best trial of the sweep in {folder} by {plan.metric} ({plan.direction}): "
            f"{', '.join(changes) or 'the base config'}.\n# Run it with: emotune run {folder / 'best.yaml'}\n")
    return head + dump_config(cfg)
