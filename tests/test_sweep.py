"""`emotune sweep`: grids and their names, range specs, Optuna on a toy objective (with a crash and a resume),
trials spread over a faked list of GPUs, the table from synthetic results, the sweep folder's life cycle; slow:
a 4-trial sweep on the tiny model killed in trial 3 and re-run, and the Ray backend on a local instance.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from emotune.cli import main
from emotune.core.config.load import load_config
from emotune.core.config.sweep import Param, parse_grid, parse_param
from emotune.core.errors import UserError
from emotune.core.rundir import PREVIOUS, STAGE_MARKER, RunDir, read_json, write_json
from emotune.sweep.backends import Job, Slot, device_slots, run_local, run_logged
from emotune.sweep.runner import Plan, load_sweep_config, make_plan, open_sweep, parse_cli_grid
from emotune.sweep.search import ListSource, OptunaSource, Outcome
from emotune.sweep.space import Trial, ablation_trials, grid_trials, trial_name
from emotune.sweep.table import Result, ablation_table, format_markdown, format_text, read_result, trial_table, write_tables
from killable import run_emotune, snapshot

# --------------------------------------------------------------------------------------------------
# Grids, ablations and their names


def test_grid_is_the_cartesian_product_with_readable_stable_names():
    params = parse_grid({"lora.r": [8, 16], "train.learning_rate": ["1e-4", "2e-4"]})
    trials = grid_trials(params)
    assert [t.name for t in trials] == ["trial-000-r8-lr1e-4", "trial-001-r8-lr2e-4", "trial-002-r16-lr1e-4",
                                        "trial-003-r16-lr2e-4"]
    assert trials[1].overrides == ["lora.r=8", "train.learning_rate=2e-4"]
    assert grid_trials(parse_grid({"lora.r": [8, 16], "train.learning_rate": ["1e-4", "2e-4"]})) == trials  # stable

    seeded = grid_trials(parse_grid({"lora.r": [8, 16]}), seeds=[42, 43])
    assert [t.name for t in seeded] == ["trial-000-r8-seed42", "trial-001-r8-seed43", "trial-002-r16-seed42",
                                        "trial-003-r16-seed43"]
    assert seeded[1].overrides == ["lora.r=8", "seed=43"] and seeded[0].variant == seeded[1].variant

    # the same last part twice, list values, booleans and long floats all make plain folder names
    odd = grid_trials(parse_grid({"train.batch_size": [4], "eval.batch_size": [8], "lora.target_modules": [["q_proj", "v_proj"]],
                                  "train.gradient_checkpointing": [False], "train.weight_decay": ["0.000123456789"]}))
    assert odd[0].name == "trial-000-train_batch_size4-eval_batch_size8-modules-q_proj-v_proj-gc-false-wd0.000123"
    assert odd[0].overrides[2] == 'lora.target_modules=["q_proj", "v_proj"]'
    assert len(trial_name(7, tuple((f"k.key{i}", "x" * 30) for i in range(9)))) <= 100
    # a swept Chinese prompt: cut to whole characters that fit 200 bytes, not to 100 characters (300 bytes)
    long = trial_name(7, (("prompt.system_prompt", "情" * 120),))
    assert len(long.encode()) <= 200 and long.startswith("trial-007-system_prompt-情")


def test_ablation_changes_one_factor_at_a_time_from_the_base_with_seeds():
    cfg = load_sweep_config(None, ["lora.r=16", "seed=7"], ["lora.r=8,16,32", "train.learning_rate=1e-4,3e-4"],
                            ["sweep.mode=ablation", "sweep.seeds=2"])
    plan = make_plan(cfg, None, ["lora.r=16", "seed=7"])
    variants = [(t.extra["factor"], t.extra["value"], t.seed) for t in plan.trials]
    # lora.r=16 and train.learning_rate=1e-4 are the base config's values: the base trial, not repeated
    assert variants == [("", "base", 7), ("", "base", 8), ("lora.r", "8", 7), ("lora.r", "8", 8),
                        ("lora.r", "32", 7), ("lora.r", "32", 8), ("train.learning_rate", "3e-4", 7),
                        ("train.learning_rate", "3e-4", 8)]
    assert plan.trials[0].name == "trial-000-base-seed7" and plan.trials[0].overrides == ["seed=7"]
    assert plan.trials[2].overrides == ["lora.r=8", "seed=7"]
    assert ablation_trials(plan.params, lambda key, text: False)[0].name == "trial-000-base"


def test_the_plan_validates_every_value_and_the_metric_before_anything_runs():
    cfg = load_sweep_config(None, [], ["lora.r=8,0", "train.learning_rate=1e-4,7", "lora.dropout=0.1"],
                            ["sweep.metric=rouge_l"])
    with pytest.raises(UserError) as err:
        make_plan(cfg, None, [])
    message = str(err.value)
    assert "The sweep has 3 problems" in message
    assert "lora.r=0: `lora.r`" in message and "train.learning_rate=7: `train.learning_rate`" in message
    assert "'rouge_l' is not a metric of task classify" in message and "macro_f1" in message
    with pytest.raises(UserError, match="nothing to sweep"):
        make_plan(load_config(None, []), None, [])


# --------------------------------------------------------------------------------------------------
# Range specs


def test_range_specs_parse():
    assert parse_param("train.learning_rate", "loguniform(1e-5, 1e-3)") == Param("train.learning_rate", kind="loguniform",
                                                                                 low=1e-5, high=1e-3)
    assert parse_param("lora.dropout", "uniform(0,0.2)") == Param("lora.dropout", kind="uniform", low=0.0, high=0.2)
    assert parse_param("lora.r", "int(2,64)") == Param("lora.r", kind="int", low=2, high=64)
    assert parse_param("lora.target_modules", "choice(all-linear, [q_proj,v_proj])").values == ("all-linear",
                                                                                               "[q_proj,v_proj]")
    assert parse_param("lora.r", 8).values == ("8",) and parse_param("lora.use_dora", [True, False]).values == ("true", "false")
    assert parse_cli_grid(["lora.r=8,16", "train.learning_rate=loguniform(1e-5,1e-3)", "lora.target_modules=[q,v],all-linear"]) == {
        "lora.r": ["8", "16"], "train.learning_rate": "loguniform(1e-5,1e-3)", "lora.target_modules": ["[q,v]", "all-linear"]}


@pytest.mark.parametrize("key, value, message", [
    ("train.learning_rate", "logunif(1e-5,1e-3)", "`logunif(...)` is not a range emotune knows; use loguniform"),
    ("train.learning_rate", "uniform(1e-3)", "uniform takes two bounds"),
    ("train.learning_rate", "uniform(1e-3,1e-5)", "low bound must be below the high bound"),
    ("train.learning_rate", "loguniform(0,1e-3)", "loguniform needs a low bound above 0"),
    ("lora.r", "int(2.5,8)", "the bounds of int must be integers"),
    ("lora.r", "uniform(a,b)", "the bounds of uniform must be numbers"),
    ("lora.r", [], "has no values"),
    ("lora.r", [8, 8], "lists 8 more than once"),
    ("name", [1, 2], "set by the sweep itself"),
    ("sweep.seeds", [1, 2], "set by the sweep itself"),
    ("lora r", [1], "is not a dotted config key"),
    ("lora.r", {"a": 1}, "not a mapping"),
])
def test_range_spec_errors_say_what_to_write(key, value, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        parse_param(key, value)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_sweep_section_is_checked_against_its_mode_when_the_config_loads():
    with pytest.raises(UserError, match=r"`sweep.grid`.*logunif"):
        load_config(None, ['sweep.grid={"train.learning_rate": "logunif(1,2)"}'])
    with pytest.raises(UserError, match="a range is drawn from, so it needs sweep.mode=random or tpe"):
        load_sweep_config(None, [], ["train.learning_rate=loguniform(1e-5,1e-3)"], [])
    with pytest.raises(UserError, match="set sweep.trials"):
        load_sweep_config(None, [], ["lora.r=8,16"], ["sweep.mode=tpe"])
    with pytest.raises(UserError, match="set sweep.seeds=1"):
        load_sweep_config(None, [], ["lora.r=8,16"], ["sweep.mode=random", "sweep.trials=4", "sweep.seeds=2"])
    with pytest.raises(UserError, match="--grid takes key=value1,value2"):
        parse_cli_grid(["lora.r"])
    with pytest.raises(UserError, match="empty value between commas"):
        parse_cli_grid(["lora.r=8,,16"])
    assert main(["sweep", "--grid", "lora.r=8,16", "--search", "tpe"]) == 2  # refused before anything runs


def test_a_key_named_twice_in_grid_is_refused_not_cut_to_its_last_values():
    """`--grid lora.r=2,4 lora.r=8` swept lora.r=8 alone: the later item replaced the earlier one unsaid."""
    with pytest.raises(UserError, match="names lora.r more than once; give all its values in one item"):
        parse_cli_grid(["lora.r=2,4", "train.learning_rate=1e-4", " lora.r =8"])


def test_cli_grid_replaces_the_same_keys_of_the_yaml_grid(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("sweep:\n  grid:\n    lora.r: [4, 8]\n    train.learning_rate: [1.0e-4]\n")
    cfg = load_sweep_config(str(path), [], ["lora.r=16,32"], ["sweep.seeds=2"])
    assert cfg.sweep.grid == {"lora.r": ["16", "32"], "train.learning_rate": [1e-4]} and cfg.sweep.seeds == 2


# --------------------------------------------------------------------------------------------------
# Optuna on a toy objective, with a crash and a resume


def _toy(trial: Trial) -> float:
    """Best at learning_rate 3e-4, r = 16, drop = 0.1; nothing to do with a model."""
    params = dict(trial.params)
    return (-(math.log10(float(params["train.learning_rate"])) + 3.5) ** 2 - abs(int(params["lora.r"]) - 16) / 16
            - (0.3 if params["lora.dropout"] != "0.1" else 0.0))


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_optuna_search_on_a_toy_objective_resumes_from_its_journal(sampler, tmp_path):
    params = parse_grid({"train.learning_rate": "loguniform(1e-5,1e-2)", "lora.r": "int(2,64)", "lora.dropout": [0.0, 0.1]})
    journal = tmp_path / "optuna.journal"
    first = OptunaSource(journal, params, sampler, "maximize", budget=12, seed=0)
    drawn = [first.next() for _ in range(4)]
    for trial in drawn[:3]:
        first.finish(trial, Outcome(0, _toy(trial)))
    del first  # the sweep dies here, with drawn[3] running

    again = OptunaSource(journal, params, sampler, "maximize", budget=12, seed=0)
    assert again.interrupted == [drawn[3]]  # same number, same values, so the same run folder
    assert again.next() == drawn[3]
    again.finish(drawn[3], Outcome(0, _toy(drawn[3])))
    while (trial := again.next()) is not None:
        again.finish(trial, Outcome(0, _toy(trial)) if trial.index != 7 else Outcome(1))  # one trial fails
    trials = again.study.get_trials()
    assert len(trials) == 12 and [t.number for t in trials] == list(range(12))
    assert [t.state.name for t in trials].count("FAIL") == 1 and trials[7].state.name == "FAIL"
    for t in trials:
        assert 1e-5 <= t.params["train.learning_rate"] <= 1e-2 and 2 <= t.params["lora.r"] <= 64
        assert t.params["lora.dropout"] in ("0.0", "0.1")
    assert again.study.best_value == max(_toy(t) for t in again.trials() if t.index != 7)
    assert again.trials()[0].name.startswith("trial-000-lr") and "-drop0." in again.trials()[0].name
    # the budget is met: a third start draws nothing
    assert OptunaSource(journal, params, sampler, "maximize", budget=12, seed=0).next() is None


# --------------------------------------------------------------------------------------------------
# Devices


def test_device_slots_narrow_the_visible_devices_variable_in_force():
    assert device_slots("cpu", gpus=_never) == [Slot("cpu")]
    assert device_slots("auto", gpus=lambda: (0, False)) == [Slot("cpu")]
    assert device_slots("auto", gpus=lambda: (2, False), environ={}) == [
        Slot("cuda:0", {"CUDA_VISIBLE_DEVICES": "0"}), Slot("cuda:1", {"CUDA_VISIBLE_DEVICES": "1"})]
    # the parent already sees a subset: each trial gets one of those, not GPU 0 and 1 of the machine
    assert [s.env for s in device_slots("cuda", gpus=lambda: (2, False), environ={"CUDA_VISIBLE_DEVICES": "4, 7"})] == [
        {"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    assert [s.env for s in device_slots("auto", gpus=lambda: (2, True), environ={"HIP_VISIBLE_DEVICES": "2,3"})] == [
        {"HIP_VISIBLE_DEVICES": "2"}, {"HIP_VISIBLE_DEVICES": "3"}]
    assert [s.env for s in device_slots("auto", gpus=lambda: (1, True), environ={})] == [{"HIP_VISIBLE_DEVICES": "0"}]
    with pytest.raises(UserError, match="PyTorch sees no CUDA or ROCm GPU"):
        device_slots("cuda", gpus=lambda: (0, False))


def _never():
    raise AssertionError("a CPU sweep must not look for GPUs")


def _spread(slots: list[Slot], tmp_path: Path, count: int) -> list[dict]:
    """`count` trials through run_local, each a real process that prints the GPU it sees and sleeps."""
    runs, lock = [], threading.Lock()
    script = "import os, time; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'none')); time.sleep(0.1)"

    def trial_fn(job, trial, slot):
        started = time.monotonic()
        log = tmp_path / f"{trial.name}.log"
        code = run_logged([sys.executable, "-c", script], {**os.environ, **slot.env}, log, f"{trial.name} | ")
        with lock:
            runs.append({"slot": slot.label, "start": started, "end": time.monotonic(),
                         "seen": log.read_text().splitlines()[-1], "env": slot.env.get("CUDA_VISIBLE_DEVICES", "none")})
        return Outcome(code, 1.0)

    class Events:
        def started(self, trial, slot):
            pass

        def finished(self, trial, slot, outcome):
            assert outcome == Outcome(0, 1.0)

    trials = [Trial(i, f"trial-{i:03d}") for i in range(count)]
    run_local(ListSource(trials), slots, Job(None, (), str(tmp_path), str(tmp_path), "macro_f1"), Events(), trial_fn)
    assert len(runs) == count
    return runs


def _overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def test_trials_spread_over_faked_gpus_one_per_device_at_a_time(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    runs = _spread(device_slots("auto", gpus=lambda: (2, False), environ=env), tmp_path, count=5)
    assert {r["slot"] for r in runs} == {"cuda:0", "cuda:1"}
    assert all(r["seen"] == r["env"] for r in runs) and {r["seen"] for r in runs} == {"3", "5"}
    for slot in ("cuda:0", "cuda:1"):
        mine = [r for r in runs if r["slot"] == slot]
        assert not any(_overlap(a, b) for i, a in enumerate(mine) for b in mine[i + 1:]), slot
    # and on a CPU, one after another
    runs = _spread(device_slots("cpu"), tmp_path, count=2)
    assert not any(_overlap(a, b) for i, a in enumerate(runs) for b in runs[i + 1:])


# --------------------------------------------------------------------------------------------------
# The table


def _result(f1: float | None, acc: float = 0.5, interval: bool = True, status: str = "finished") -> Result:
    if f1 is None:
        return Result(status, seconds=3.0)
    return Result(status, {"macro_f1": f1, "accuracy": acc},
                  {"macro_f1": (f1 - 0.05, f1 + 0.05), "accuracy": (acc - 0.1, acc + 0.1)} if interval else {}, 12.34, 512.0)


def test_trial_table_sorts_by_the_metric_and_shows_intervals_or_a_dash(tmp_path):
    trials = grid_trials(parse_grid({"lora.r": [8, 16, 32, 64]}))
    results = {"trial-000-r8": _result(0.40), "trial-001-r16": _result(0.55, interval=False),
               "trial-002-r32": _result(None, status="failed"), "trial-003-r64": _result(0.47, acc=0.6)}
    table = trial_table(trials, results, ["lora.r"], "macro_f1", "maximize", "classify")
    assert [row[0] for row in table.rows] == ["trial-001-r16", "trial-003-r64", "trial-000-r8", "trial-002-r32"]
    assert table.headers[:6] == ["trial", "lora.r", "macro-F1", "95% CI", "accuracy", "95% CI"]
    assert table.rows[0][2:6] == ["0.550", "—", "0.500", "—"]  # no intervals in its comparison.json
    assert table.rows[1][2:6] == ["0.470", "[0.420, 0.520]", "0.600", "[0.500, 0.700]"]
    assert table.rows[3][-1] == "failed" and table.rows[3][2] == "—"
    assert table.best == [trials[1]]
    lower = trial_table(trials, results, ["lora.r"], "accuracy", "minimize", "classify")
    assert lower.rows[0][0] == "trial-000-r8" and lower.headers[2] == "accuracy"  # the ranking metric first
    write_tables(tmp_path, [("trials", table)])
    rows = list(csv.DictReader((tmp_path / "trials.csv").open(encoding="utf-8")))
    assert rows[1]["macro_f1_low"] == "0.42" and rows[0]["macro_f1_low"] == "" and rows[0]["seconds"] == "12.34"
    assert "| trial-001-r16 | 16 | 0.550 | — |" in (tmp_path / "table.md").read_text(encoding="utf-8")
    assert format_text(table).splitlines()[3].startswith("trial-001-r16  16")
    drawn = Trial(0, "trial-000-lr0.000123", (("train.learning_rate", "0.000123456789"),))
    table = trial_table([drawn], {drawn.name: _result(0.5)}, ["train.learning_rate"], "macro_f1", "maximize", "classify")
    assert table.rows[0][1] == "0.0001235" and table.records[0]["train.learning_rate"] == "0.000123456789"


def test_ablation_table_is_mean_and_sd_over_seeds_with_the_difference_from_the_base():
    params = parse_grid({"lora.r": [8, 32], "train.learning_rate": ["3e-4"]})
    trials = ablation_trials(params, lambda key, text: False, seeds=[1, 2])
    f1 = {"base": (0.50, 0.52), "r8": (0.40, 0.44), "r32": (0.60, 0.58), "lr3e-4": (0.55, None)}
    results = {}
    for trial in trials:
        variant = trial.name.split("-", 2)[2].rsplit("-seed", 1)[0]
        value = f1[variant][trial.seed - 1]
        results[trial.name] = _result(value) if value is not None else _result(None, status="interrupted")
    table = ablation_table(trials, results, "macro_f1", "maximize", "classify")
    assert [row[:2] for row in table.rows] == [["lora.r", "32"], ["train.learning_rate", "3e-4"], ["—", "base"],
                                               ["lora.r", "8"]]
    first = table.rows[0]
    assert first[2] == f"0.590 ± {0.01414:.3f}" and first[3] == "—"  # over seeds the spread is the sd
    assert first[6] == "+0.080" and first[7] == "2/2"
    assert table.rows[1][2] == "0.550" and table.rows[1][7] == "1/2"  # one seed done: no sd yet
    assert [t.seed for t in table.best] == [1, 2] and table.best[0].params == (("lora.r", "32"),)
    assert table.records[0]["delta_macro_f1"] == pytest.approx(0.08) and "mean ± sd" in table.title
    assert "| lora.r | 32 | 0.590 ± 0.014 | — | 0.500 ± 0.000 | — | +0.080 | 2/2 |" in format_markdown(table)


def test_read_result_takes_the_headline_method_with_its_intervals_from_the_run_folder(tmp_path):
    run = RunDir(tmp_path / "trial")
    (run.root / "train").mkdir(parents=True)
    write_json(run.train / "log_history.json", [{"step": 1, "peak_memory_mb": 700.5}, {"step": 2, "peak_memory_mb": 812.0},
                                                {"step": 2, "eval_loss": 1.0}])
    metrics = {"macro_f1": {"before": 0.1, "after": 0.4, "delta": 0.3}, "accuracy": {"before": 0.2, "after": 0.5, "delta": 0.3}}
    comparison = {"method": {"before": "generate", "after": "generate"}, "metrics": metrics,
                  "methods": {"generate": {"metrics": metrics, "intervals": {"macro_f1": {"before": [0, 0.2], "after": [0.3, 0.5]}}}}}
    write_json(run.comparison_json, comparison)
    write_json(run.run_json, {"status": "running", "stages": {"data": {"seconds": 1.5}, "train": {"seconds": 10.25}}})
    assert read_result(run.root, "interrupted") == Result("interrupted", seconds=11.75)
    write_json(run.run_json, {"status": "finished", "outputs": ["comparison.json"],
                              "stages": {"data": {"seconds": 1.5}, "train": {"seconds": 10.25}}})
    result = read_result(run.root)
    assert result == Result("finished", {"macro_f1": 0.4, "accuracy": 0.5}, {"macro_f1": (0.3, 0.5)}, 11.8, 812.0)


# --------------------------------------------------------------------------------------------------
# The sweep folder


def _plan(values: list[int]) -> Plan:
    params = parse_grid({"lora.r": values})
    return Plan("grid", "macro_f1", "maximize", params, grid_trials(params), None, "base: config\n", "classify", 42)


def test_sweep_folder_resumes_the_same_plan_and_refuses_another_unless_overwrite(tmp_path):
    folder = tmp_path / "tiny-sweep"
    manifest, lock = open_sweep(folder, _plan([8, 16]), overwrite=False)
    write_json(folder / "sweep.json", manifest)
    with pytest.raises(UserError, match="Another `emotune sweep` is running"):
        open_sweep(folder, _plan([8, 16]), overwrite=False)
    lock.close()
    again, lock = open_sweep(folder, _plan([8, 16]), overwrite=False)
    assert again["plan"] == manifest["plan"]
    lock.close()
    with pytest.raises(UserError, match=r"different grid \(sweep.grid / --grid.*overwrite=true"):
        open_sweep(folder, _plan([8, 32]), overwrite=False)
    (folder / "trial-000-r8").mkdir()
    fresh, lock = open_sweep(folder, _plan([8, 32]), overwrite=True)
    lock.close()
    assert (tmp_path / f"tiny-sweep{PREVIOUS}" / "trial-000-r8").is_dir() and not (folder / "trial-000-r8").exists()
    assert fresh["trials"] == [] and read_json(tmp_path / f"tiny-sweep{PREVIOUS}" / "sweep.json") == manifest
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    for overwrite in (False, True):  # overwrite=true moved a folder of other files aside, then deleted it
        with pytest.raises(UserError, match="holds no sweep.json"):
            open_sweep(tmp_path / "other", _plan([8]), overwrite=overwrite)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["file"]
    assert not (tmp_path / f"other{PREVIOUS}").exists()


# --------------------------------------------------------------------------------------------------
# Slow: the real thing, on the tiny model


TIMEOUT_S = 900  # for a hang only: a loaded machine can take minutes over each tiny trial
TINY = ["device=cpu", "train.max_steps=1", "train.eval_steps=1", "train.save_steps=1", "data.test_limit=6"]


def _sweep_process(args: list[str], kill_when=None) -> tuple[int, str]:
    """`python -m emotune sweep ARGS`; with `kill_when`, SIGKILL the sweep (and so its trial) at the first output line
    for which it is true (asserted to have happened: a watchdog's kill is not that)."""
    result = run_emotune(["sweep", *args], kill_when, TIMEOUT_S)
    out = result.stdout + result.stderr
    assert kill_when is None or result.killed, f"the kill point never came:\n{out[-3000:]}"
    return result.returncode, out


def _ray_stays_on_this_machine(monkeypatch) -> None:
    """For the Ray instance a test starts, and the drivers it runs (both inherit the environment; the conftest's socket
    guard is only in this process): no usage statistics, and no HTTP beyond this machine. Ray's API server asks the
    cloud metadata addresses (169.254.169.254, metadata.google.internal) which cloud it runs on at every start, with
    `requests`, usage statistics or not; sent through a proxy at a closed loopback port, those requests fail at once
    on this machine. Ray's own gRPC ignores HTTP proxies, and this machine's addresses are exempt."""
    import psutil

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family in (socket.AF_INET, socket.AF_INET6)}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, ",".join(["localhost", "127.0.0.1", "::1", *sorted(own)]))


def _trial_processes(folder: Path) -> list:
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        if f"output_dir={folder}" in (process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.mark.slow
def test_sweep_killed_in_trial_3_resumes_on_ray_with_trials_1_and_2_untouched(tiny_overrides, tmp_path, monkeypatch):
    """The issue's acceptance test, and the Ray backend's: a 4-trial grid killed in the middle of trial 3 (its
    training), then re-run with `--backend ray` against a local Ray instance, which finishes trials 3 and 4
    through Ray Tune (one real trial on Ray, not a separate sweep: each trial costs a process start)."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.tune")
    grid = ["--grid", "lora.r=2,4", "train.learning_rate=0.01,0.02"]
    folder = (tmp_path / "runs" / "tiny-sweep").resolve()
    code, out = _sweep_process([*tiny_overrides, *TINY, *grid], kill_when=lambda line: line.startswith("trial-002") and
                               line.rstrip().endswith(f"{STAGE_MARKER} train: start"))
    assert code == -signal.SIGKILL, out[-3000:]
    names = ["trial-000-r2-lr0.01", "trial-001-r2-lr0.02", "trial-002-r4-lr0.01", "trial-003-r4-lr0.02"]
    for _ in range(50):  # the trial's process dies with the sweep (PR_SET_PDEATHSIG)
        if not _trial_processes(folder):
            break
        time.sleep(0.1)
    assert not _trial_processes(folder)
    assert RunDir(folder / names[0]).is_finished() and RunDir(folder / names[1]).is_finished()
    assert not RunDir(folder / names[2]).is_finished() and not (folder / names[3]).exists()
    assert read_json(folder / "sweep.json")["trials"][2]["status"] == "running"
    kept = {name: snapshot(folder / name) for name in names[:2]}

    _ray_stays_on_this_machine(monkeypatch)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:  # the re-run is a Ray driver of this instance, as `emotune sweep` is of a cluster's
        address = ray.get_runtime_context().gcs_address
        code, out = _sweep_process([*tiny_overrides, *TINY, f"sweep.ray_address={address}", "--backend", "ray", *grid])
    finally:
        ray.shutdown()
    assert code == 0, out[-3000:]
    assert f"[emotune] sweep {names[0]}: skipped (finished)" in out and f"sweep {names[1]}: skipped (finished)" in out
    resumed = (folder / "logs" / f"{names[2]}.log").read_text(encoding="utf-8")
    assert f"{STAGE_MARKER} baseline: skipped (already measured in this run folder)" in resumed, resumed[-3000:]
    assert sum(line.startswith("# ") and " $ " in line for line in resumed.splitlines()) == 2  # both attempts
    assert {name: snapshot(folder / name) for name in names[:2]} == kept  # byte for byte
    assert all(RunDir(folder / name).is_finished() for name in names)
    manifest = read_json(folder / "sweep.json")
    assert manifest["status"] == "finished" and [t["status"] for t in manifest["trials"]] == ["finished"] * 4
    assert [t["device"] for t in manifest["trials"]] == ["cpu", "cpu", "ray", "ray"] and (folder / "ray").is_dir()
    assert manifest["trials"][2]["attempts"] == 2
    assert manifest["trials"][3]["value"] == read_result(folder / names[3]).after["macro_f1"]
    rows = list(csv.DictReader((folder / "trials.csv").open(encoding="utf-8")))
    assert sorted(r["trial"] for r in rows) == names and all(r["status"] == "finished" and r["macro_f1"] for r in rows)
    assert all(float(r["seconds"]) > 0 and float(r["peak_memory_mb"]) > 0 for r in rows)
    values = [float(r["macro_f1"]) for r in rows]
    assert values == sorted(values, reverse=True)
    table = (folder / "table.md").read_text(encoding="utf-8")
    assert all(f"| {name} |" in table for name in names)
    best, top = load_config(folder / "best.yaml"), rows[0]
    assert best.name == "tiny-best" and str(best.lora.r) == top["lora.r"]
    assert best.train.learning_rate == float(top["train.learning_rate"]) and best.train.max_steps == 1


def test_a_changed_grid_is_named_once_in_the_refusal_to_resume():
    """A sweep folder made with another grid was refused as made with "a different grid (...) and grid (...)"."""
    from emotune.sweep.runner import _differences

    assert len(_differences({"trials": [1], "space": {"lora.r": [1]}}, {"trials": [2], "space": {"lora.r": [2]}})) == 1


def test_a_grid_over_the_test_rows_or_labels_is_refused_before_anything_runs(tmp_path):
    """A grid over data.test_limit, data.source or eval.split ranked trials measured on other test rows (or labels)
    against each other, and named a "best" by numbers that measured other things; such keys are refused by name.
    Keys that change only the training rows stay allowed."""
    cfg = load_sweep_config(None, [], ["data.test_limit=50,100", "eval.split=validation,test",
                                       "data.label_names=[a, b],[a, c]"], [])
    with pytest.raises(UserError) as err:
        make_plan(cfg, None, [])
    message = str(err.value)
    assert "data.test_limit=50: changes the test rows or labels" in message and "data.test_limit=100" in message
    assert "eval.split=validation: changes" in message and "eval.split=test:" not in message  # test is the base's
    assert "data.label_names=[a, b]: changes" in message
    plan = make_plan(load_sweep_config(None, [], ["data.train_limit=50,100", "data.balance=none,oversample"], []),
                     None, [])
    assert len(plan.trials) == 4
    # sft's training mix over a fixed test split (LLaMA-Factory's eval_dataset) is a training setting
    fixed = ["task=sft", "data.eval_datasets=[held_out]"]
    assert len(make_plan(load_sweep_config(None, fixed, ["data.datasets=[a],[a, b]"], []), None, fixed).trials) == 2
    with pytest.raises(UserError, match=r"data.datasets=\[a\]: changes the test rows"):
        make_plan(load_sweep_config(None, ["task=sft"], ["data.datasets=[a],[a, b]"], []), None, ["task=sft"])
