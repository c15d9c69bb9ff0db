"""`emotune run`: check → data → baseline → train → re-measure → compare, each stage writing into the run folder.

A stage whose output is already complete in the run folder is skipped, so re-running a crashed run
resumes it; a finished run folder is never overwritten unless `overwrite=true`.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import set_seed

from emotune import device as device_mod
from emotune.config import RunConfig, dump_config
from emotune.data import LabeledData, system_prompt
from emotune.data.prepare import format_cleaning, prepare_data, save_prepared
from emotune.errors import UserError
from emotune.evaluate import eval_methods, evaluate_methods, read_metrics, write_results
from emotune.models import load_model, load_tokenizer, resolve_model_dir
from emotune.report import compare_methods, format_table, write_comparison, write_report


class RunLog:
    """run.json: versions, hardware, precision, and status and timing of every stage."""

    def __init__(self, path: Path, base: dict):
        self.path = path
        previous = json.loads(path.read_text()) if path.is_file() else {}
        self.data = {**base, "stages": previous.get("stages", {}), "started": previous.get("started", _now())}
        self.data["status"] = "running"
        self.write()

    @contextmanager
    def stage(self, name: str):
        entry = self.data["stages"].setdefault(name, {})
        entry.update(status="running", started=_now())
        self.write()
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

    def skip(self, name: str, why: str) -> None:
        self.data["stages"].setdefault(name, {}).update(status="done", note=why)
        self.write()

    def finish(self) -> None:
        self.data.update(status="finished", finished=_now())
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, ensure_ascii=False))
        tmp.replace(self.path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Refuse to clobber a finished run or reuse a folder made with a different config."""
    run_dir = cfg.run_dir
    run_json, saved = run_dir / "run.json", run_dir / "config.yaml"
    if run_json.is_file():
        status = json.loads(run_json.read_text()).get("status")
        if cfg.overwrite:
            shutil.rmtree(run_dir)
        elif status == "finished":
            raise UserError(f"The run folder `{run_dir}` holds a finished run. Pass overwrite=true to replace it, "
                            f"or name=<new name> to keep both.")
        elif saved.is_file() and _comparable(saved.read_text()) != _comparable(dump_config(cfg)):
            raise UserError(f"The run folder `{run_dir}` holds an unfinished run made with a different config, so it "
                            "cannot be resumed. Pass overwrite=true to start over, or name=<new name>.")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _comparable(config_yaml: str) -> str:
    return "\n".join(line for line in config_yaml.splitlines() if not line.startswith("overwrite:"))


def run(cfg: RunConfig) -> dict:
    set_seed(cfg.seed)
    # Data first: a bad file must fail in seconds, before any weights load and before the run folder exists.
    data = prepare_data(cfg)  # reuses run_dir/data/ written by `emotune data` with the same data config
    _print_data(data)
    print(format_cleaning(data.report), flush=True)
    device = device_mod.resolve_device(cfg.device)
    precision = device_mod.choose_precision(device, cfg.train.precision)
    print(f"Device {device}; precision {precision.name}: {precision.reason}", flush=True)

    run_dir = prepare_run_dir(cfg)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    save_prepared(data, run_dir)
    report = device_mod.doctor()
    log = RunLog(run_dir / "run.json", {
        "emotune": report.versions.get("emotune"), "versions": report.versions, "hardware": report.as_dict(),
        "device": str(device), "precision": {"name": precision.name, "reason": precision.reason},
        "labels": data.labels, "rows": {name: len(ds) for name, ds in data.splits.items()},
        "system_prompt": system_prompt(cfg.prompt, data.labels),
    })

    with log.stage("model"):
        model_dir = resolve_model_dir(cfg.model)
        tokenizer = load_tokenizer(model_dir, cfg.model)
        dtype = precision.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
        model = load_model(model_dir, dtype, device)
    eval_split = data.splits[cfg.eval.split]

    methods = eval_methods(cfg.eval)
    before = read_metrics(run_dir / "baseline", methods)
    if before is not None:
        log.skip("baseline", "already measured in this run folder")
    else:
        with log.stage("baseline"):
            results = evaluate_methods(model, tokenizer, eval_split, data.labels, cfg.prompt, cfg.eval, desc="baseline")
            write_results(results, run_dir / "baseline")
            before = {m: r.metrics for m, r in results.items()}
    for method, metrics in before.items():
        print(f"Baseline ({method}): accuracy {metrics['accuracy']:.3f}, macro-F1 {metrics['macro_f1']:.3f}, "
              f"invalid {metrics['invalid']}", flush=True)

    if (run_dir / "adapter" / "adapter_config.json").is_file():
        from peft import PeftModel

        log.skip("train", "adapter already saved in this run folder")
        model = PeftModel.from_pretrained(model, run_dir / "adapter")
    else:
        from emotune.train import train

        with log.stage("train"):
            model = train(model, tokenizer, data, cfg, precision, run_dir)

    with log.stage("finetuned"):
        results = evaluate_methods(model, tokenizer, eval_split, data.labels, cfg.prompt, cfg.eval, desc="fine-tuned")
        write_results(results, run_dir / "finetuned")
        after = {m: r.metrics for m, r in results.items()}

    comparison = compare_methods(before, after, data.labels)
    write_comparison(comparison, run_dir)
    log.finish()
    for method, one in comparison["methods"].items():
        print(f"\nBefore/after on the {cfg.eval.split} split ({one['rows']} rows, method {method}):")
        print(format_table(one, data.labels))
    print(f"\nReport: {write_report(run_dir)}")
    print(f"Run folder: {run_dir}")
    return comparison


def _print_data(data: LabeledData) -> None:
    counts = data.counts()
    print(f"Data {data.source}: labels {data.labels}", flush=True)
    for split, per_label in counts.items():
        print(f"  {split:<10} {sum(per_label.values()):>6} rows  " + "  ".join(f"{k} {v}" for k, v in per_label.items()))


def train_only(cfg: RunConfig) -> Path:
    """`emotune train`: data → model → LoRA training into the run folder, without the evaluations.

    Safe under `torchrun` / `accelerate launch`: every process loads data and model, only the main
    process writes; `emotune run` on the same folder later picks up the saved adapter."""
    from accelerate import PartialState

    from emotune.train import train

    set_seed(cfg.seed)
    data = prepare_data(cfg)
    state = PartialState(cpu=cfg.device == "cpu")  # joins the process group when launched on several
    device = state.device if state.num_processes > 1 else device_mod.resolve_device(cfg.device)
    precision = device_mod.choose_precision(device, cfg.train.precision)
    if state.is_main_process:
        _print_data(data)
        print(f"Device {device} x {state.num_processes} processes; precision {precision.name}: {precision.reason}", flush=True)
        run_dir = prepare_run_dir(cfg)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        save_prepared(data, run_dir)
    state.wait_for_everyone()
    run_dir = cfg.run_dir
    if (run_dir / "adapter" / "adapter_config.json").is_file():
        raise UserError(f"`{run_dir}/adapter` already holds a trained adapter. Run `emotune run` with the same config to "
                        "evaluate it, or pass overwrite=true to train again.")
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    dtype = precision.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    model = load_model(model_dir, dtype, device)
    train(model, tokenizer, data, cfg, precision, run_dir)
    if state.is_main_process:
        print(f"Adapter: {run_dir / 'adapter'}", flush=True)
    return run_dir
