"""The stages of a run and the commands made of them.

    data → baseline → train → finetuned → report

Each stage is a function of the run's `Context` (its config and run folder, plus the data and model
loaded once for all stages of one command) with a `done` check read from the run folder. `emotune run`
runs them in order and skips what is done, so re-running a crashed run resumes it; `emotune data`,
`train` and `eval` call the same functions, so whichever command wrote a file, it is the same file.
What a stage measures or writes for a task comes from the task's module (emotune.tasks).

Order matters for safety: the config, the data and the model source validate before the run folder
is touched (`Context.validate`), so a bad input never costs a finished run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, set_seed

from emotune.core.config.build import dump_config
from emotune.core.config.run import RunConfig
from emotune.core.errors import UserError
from emotune.core.rundir import (
    RunDir,
    RunLog,
    check_folder_path,
    drop_previous,
    holds_run_lock,
    old_run_back_on_refusal,
    open_run,
    read_json,
)
from emotune.eval.merged import CHECK_ROWS, describe, merged_for_eval
from emotune.model import finetuning, init_methods, quantization
from emotune.model.artifacts import find_artifact, has_trained, is_adapter, load_artifact_model
from emotune.model.attention import check_attention
from emotune.model.loading import Base, load_base, load_tokenizer, load_tokenizer_only, resolve_model_dir, weights_dtype
from emotune.model.lora import check_layers, check_targets
from emotune.model.text import causal_lm_class
from emotune.model.weight_files import check_weight_files
from emotune.runtime import device as device_mod
from emotune.tasks import task_for
from emotune.train import compiling, optim
from emotune.train.batches import describe_shared_prefix, share_prefix
from emotune.train.pass_size import check_checkpointing


class Context:
    """What the stages of one command share. Data and model are loaded on first use, once."""

    def __init__(self, cfg: RunConfig, device=None):
        self.cfg = cfg
        self.task = task_for(cfg)
        self.run = RunDir(cfg.run_dir)
        self.device = device or device_mod.resolve_device(cfg.device)
        device_mod.make_current(self.device)
        self.precision = device_mod.choose_precision(self.device, cfg.train.precision)
        self.data = None
        self.tokenizer = None
        self.fingerprint: str | None = None
        self.log: RunLog | None = None
        self._base: Base | None = None
        self._adapted = None  # the model with its trained adapter, once there is one
        self.start = None  # lora.adapter: the adapter training starts from (its score is the "before")
        self.train_fault = None  # tests: called before every training forward pass (emotune.train.loop.train's `fault`)
        self._telemetry = None

    def validate(self, model_source: bool = True) -> None:
        """Data (and, for commands that load weights, the model source) before anything is written."""
        self.fingerprint = self.task.data_fingerprint(self.cfg)
        self.data = self.task.load_data(self.cfg)
        if model_source:
            model_dir = resolve_model_dir(self.cfg.model)
            model_config = AutoConfig.from_pretrained(model_dir)
            check_checkpointing(self.cfg.train, causal_lm_class(model_config), model_config)  # refuses encoders too
            check_weight_files(model_dir)  # shards missing or cut short: refused before the data stage, not halfway
            self.tokenizer = load_tokenizer(model_dir, self.cfg.model, announce=True)
            dtype = weights_dtype(self.cfg.model, self.device, self.cfg.train.precision)
            check_attention(self.cfg.model, model_dir, self.device, dtype)
            quantization.check(self.cfg.model, model_dir, self.device, dtype, self.cfg.lora.use_dora)
            optim.check(self.cfg.train, self.device)
            compiling.check(self.cfg.train, self.device)
            init_methods.check(self.cfg.lora, self.cfg.model, self.device, model_dir)
            if self.cfg.lora.adapter:
                self.start = self.task.find_adapter(self.cfg.lora.adapter, self.cfg, self.data)
                init_methods.check_start(self.cfg.lora, self.start)
            if self.cfg.train.finetuning == "lora" and not self.cfg.lora.adapter:
                check_targets(self.cfg.lora, AutoConfig.from_pretrained(model_dir), model_dir, self.cfg.model)
            if self.cfg.lora.layers is not None or self.cfg.train.finetuning in finetuning.WHOLE:
                model_config = AutoConfig.from_pretrained(model_dir)  # the layer count, from config.json alone
                finetuning.check(self.cfg.train, self.cfg.lora, self.cfg.model, model_config)
                if self.cfg.lora.layers is not None:
                    check_layers(self.cfg.lora, model_config)

    def open(self) -> None:
        """Claim the run folder (resume, refuse, or move an old run aside) and start run.json."""
        self.run = open_run(self.cfg.run_dir, dump_config(self.cfg), self.cfg.overwrite, self.fingerprint)
        report = device_mod.doctor()
        self.log = RunLog(self.run, {
            **self.task.run_info(self.cfg, self.data),  # first: a task cannot overwrite the generic keys below
            "task": self.cfg.task, "emotune": report.versions.get("emotune"), "versions": report.versions,
            "hardware": report.as_dict(), "device": str(self.device),
            "precision": {"name": self.precision.name, "reason": self.precision.reason},
            "before": (f"the adapter {self.start.path} (lora.adapter), which training starts from" if self.start
                       else "the base model"),
            "quantization": quantization.describe(self.cfg.model, weights_dtype(self.cfg.model, self.device,
                                                                                 self.cfg.train.precision)),
            "finetuning": finetuning.describe(self.cfg.train),
        })

    @property
    def base(self) -> Base:
        if self._base is None:
            with_log = self.log.stage("model") if self.log else _nothing()
            with with_log:
                self._base = load_base(self.cfg.model, self.device, self.cfg.train.precision, self.tokenizer)
            self.tokenizer = self._base.tokenizer
            if self.start is not None and not is_adapter(self.run.adapter):  # before and during training: base + it
                self._base = self._base._replace(model=init_methods.train_on_from(self._base.model, self.start))
        return self._base

    @property
    def telemetry(self):
        """What telemetry can sample here, looked for once per command (and the note on what is missing, once)."""
        if self._telemetry is None:
            from emotune.runtime.telemetry import find_sources

            self._telemetry = find_sources(self.device)
            if self._telemetry.note():
                print(self._telemetry.note(), flush=True)
        return self._telemetry

    @property
    def adapted(self):
        """The fine-tuned model: trained in this process, or the base with the run folder's adapter, or (full / freeze
        fine-tuning) the run folder's model, loaded alone with its own tokenizer in place of the base's."""
        if self._adapted is None and self.cfg.train.finetuning in finetuning.WHOLE:
            dtype = weights_dtype(self.cfg.model, self.device, self.cfg.train.precision)
            model, tokenizer = load_artifact_model(find_artifact(self.run.root), dtype, self.device)
            self._base, self._adapted = Base(model, tokenizer, self.precision, self.run.model), model
        if self._adapted is None:
            self._adapted = self.task.load_adapted(self.base.model, self.run.adapter, self.cfg, self.data)
        return self._adapted


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------------------------------
# The stages


def data_stage(ctx: Context) -> None:
    ctx.task.save_data(ctx.data, ctx.run, ctx.tokenizer or load_tokenizer_only(ctx.cfg.model), ctx.cfg)


def baseline_stage(ctx: Context) -> None:
    results = ctx.task.evaluate(ctx.base.model, ctx.base.tokenizer, ctx.data, ctx.cfg, desc="baseline")
    write_measurement(ctx, results, ctx.run.baseline)


def write_measurement(ctx: Context, results, folder: Path) -> None:
    """A stage's results, after removing the comparison of the measurements they replace: the report stage counts as
    done while comparison.json exists, so a resumed run that measured again (a deleted finetuned/, a retrained
    adapter) kept the old comparison and printed its numbers as the run's result."""
    ctx.run.comparison_json.unlink(missing_ok=True)
    ctx.task.write_results(results, folder)


def train_stage(ctx: Context) -> None:
    from emotune.runtime.parallel import fsdp_requested
    from emotune.train.loop import train

    train_rows, val_rows = ctx.task.training_rows(ctx.data, ctx.base.tokenizer, ctx.cfg)
    model, objective = ctx.task.training_setup(ctx.base.model, ctx.cfg, ctx.data)
    objective, shared = share_prefix(objective, train_rows + val_rows, ctx.cfg.train.shared_prefix, model,
                                     sharded=fsdp_requested(ctx.cfg.train))
    if ctx.log is not None:  # the main process
        print(describe_shared_prefix(shared), flush=True)
        ctx.log.record("train", shared_prefix=shared)
    ctx._adapted = train(model, ctx.base.tokenizer, train_rows, val_rows, ctx.cfg, ctx.base.precision, ctx.run,
                         ctx.task.adapter_meta(ctx.cfg, ctx.data) | {"measured_dtype": device_mod.dtype_name(ctx.base.model.dtype)},
                         objective,
                         record=(lambda key, value: ctx.log.record("train", **{key: value})) if ctx.log else None,
                         fault=ctx.train_fault)


def finetuned_stage(ctx: Context) -> None:
    results, merge = evaluate_adapted(ctx, ctx.adapted, desc="fine-tuned")
    write_measurement(ctx, results, ctx.run.finetuned)
    ctx.log.note("merged_eval", merge)  # how the fine-tuned numbers were measured


def evaluate_adapted(ctx: Context, model, desc: str) -> tuple[dict, dict]:
    """The task's evaluation of a model with an adapter, merged for it as `eval.merge_adapters` and the check
    decide (emotune.eval.merged); every result's metrics record how (`merge`). The adapter is unmerged after."""
    sample = ctx.task.merge_check_inputs(ctx.base.tokenizer, ctx.data, ctx.cfg, CHECK_ROWS)
    with merged_for_eval(model, sample, ctx.cfg.eval.merge_adapters, ctx.cfg.eval.merge_tolerance) as merge:
        print(describe(merge), flush=True)
        results = ctx.task.evaluate(model, ctx.base.tokenizer, ctx.data, ctx.cfg, desc=desc)
    for result in results.values():
        result.metrics["merge"] = merge
    return results, merge


def report_stage(ctx: Context) -> None:
    from emotune.report.page import write_report

    before = ctx.task.read_results(ctx.run.baseline, ctx.cfg)
    after = ctx.task.read_results(ctx.run.finetuned, ctx.cfg)
    ctx.task.write_comparison(ctx.task.compare(before, after, ctx.data), ctx.run)
    write_report(ctx.run.root)


def _report_finished(ctx: Context) -> None:
    """report.html once more, now that run.json says finished: the report stage wrote it while that stage (and so
    the run) was still running, and a page that says "running" for a finished run is wrong forever."""
    from emotune.report.page import write_report

    write_report(ctx.run.root)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Context], None]
    done: Callable[[Context], bool]
    why_done: str
    sampled: bool = False  # runs the model: telemetry samples it (train.telemetry_interval)


DATA = Stage("data", data_stage, lambda ctx: ctx.task.saved_fingerprint(ctx.run) == ctx.fingerprint,
             "the same data is prepared in this run folder")
BASELINE = Stage("baseline", baseline_stage, lambda ctx: ctx.task.read_results(ctx.run.baseline, ctx.cfg) is not None,
                 "already measured in this run folder", sampled=True)
TRAIN = Stage("train", train_stage, lambda ctx: has_trained(ctx.run), "adapter (or model) already saved in this run folder",
              sampled=True)
FINETUNED = Stage("finetuned", finetuned_stage, lambda ctx: ctx.task.read_results(ctx.run.finetuned, ctx.cfg) is not None,
                  "already measured in this run folder", sampled=True)
REPORT = Stage("report", report_stage, lambda ctx: ctx.run.comparison_json.is_file() and ctx.run.report_html.is_file(),
               "comparison and report already written")
RUN = (DATA, BASELINE, TRAIN, FINETUNED, REPORT)


def run_stages(ctx: Context, stages: tuple[Stage, ...]) -> None:
    from emotune.runtime import telemetry

    for stage in stages:
        if stage.done(ctx):
            ctx.log.skip(stage.name, stage.why_done)
            continue
        interval = ctx.cfg.train.telemetry_interval if stage.sampled else 0
        with ctx.log.stage(stage.name) as entry:
            entry.pop("telemetry", None)  # an earlier attempt's
            with telemetry.recording(ctx.telemetry if interval else None, interval, ctx.run.telemetry, stage.name,
                                     into=entry):
                stage.run(ctx)
        if "telemetry" in entry:
            print(f"{stage.name} {telemetry.describe(entry['telemetry'])}", flush=True)


# --------------------------------------------------------------------------------------------------
# The commands


@holds_run_lock
def run(cfg: RunConfig) -> dict:
    """`emotune run`: every stage in order, then the before/after table."""
    set_seed(cfg.seed)
    ctx = Context(cfg)
    ctx.validate()
    print(f"Device {ctx.device}; precision {ctx.precision.name}: {ctx.precision.reason}", flush=True)
    ctx.open()
    with old_run_back_on_refusal(ctx.run):
        run_stages(ctx, (DATA,))
    print(ctx.task.describe_data(ctx.data), flush=True)
    run_stages(ctx, RUN[1:])
    ctx.log.finish(ctx.task.outputs(ctx.run, cfg))
    _report_finished(ctx)
    drop_previous(ctx.run)
    comparison = _read_comparison(ctx)
    print(ctx.task.format_comparison(comparison, ctx.data, cfg))
    print(f"\nReport: {ctx.run.report_html}")
    print(f"Run folder: {ctx.run.root}")
    return comparison


@holds_run_lock
def data_only(cfg: RunConfig) -> None:
    """`emotune data`: validate and prepare the data with the tokenizer only (no weights), the run's data stage."""
    ctx = Context(cfg, device=torch.device("cpu"))
    ctx.validate(model_source=False)
    if not DATA.done(ctx):
        ctx.tokenizer = load_tokenizer_only(cfg.model)
        ctx.run = open_run(cfg.run_dir, dump_config(cfg), cfg.overwrite, ctx.fingerprint)
        with old_run_back_on_refusal(ctx.run):
            data_stage(ctx)
    print(ctx.task.describe_data(ctx.data))
    print(f"\nPrepared data: {ctx.run.data}; `emotune run` with the same config reuses it.")


@holds_run_lock
def train_only(cfg: RunConfig, fault=None) -> Path:
    """`emotune train`: the data and train stages, without the evaluations.

    Safe under `torchrun` / `accelerate launch`: every process loads data and model, only the main
    process writes; `emotune run` on the same folder later picks up the saved adapter. `fault` is for tests
    (see emotune.train.loop.train)."""
    from accelerate import PartialState

    set_seed(cfg.seed)
    state = PartialState(cpu=cfg.device == "cpu")  # joins the process group when launched on several
    if state.num_processes > 1 and cfg.device.startswith("cuda:"):
        raise UserError(f"device={cfg.device} picks one GPU, but this training runs {state.num_processes} processes, "
                        "each on the GPU of its local rank. Set device=cuda (or auto) and choose the GPUs with "
                        "CUDA_VISIBLE_DEVICES (NVIDIA) or HIP_VISIBLE_DEVICES (ROCm), e.g. CUDA_VISIBLE_DEVICES=1,2.")
    ctx = Context(cfg, device=state.device if state.num_processes > 1 else None)
    ctx.train_fault = fault
    ctx.validate()
    if has_trained(ctx.run) and not cfg.overwrite:
        raise UserError(f"`{ctx.run.root}` already holds a trained adapter or model. Run `emotune run` with the same config "
                        "to evaluate it, or pass overwrite=true to train again.")
    if state.is_main_process:
        print(f"Device {ctx.device} x {state.num_processes} processes; precision {ctx.precision.name}: "
              f"{ctx.precision.reason}", flush=True)
        ctx.open()
        with old_run_back_on_refusal(ctx.run):
            run_stages(ctx, (DATA,))
        print(ctx.task.describe_data(ctx.data), flush=True)
    state.wait_for_everyone()
    if not state.is_main_process:
        ctx.run = RunDir(cfg.run_dir)
    train_stage(ctx) if ctx.log is None else run_stages(ctx, (TRAIN,))
    if state.is_main_process:
        print(f"{'Model' if cfg.train.finetuning in finetuning.WHOLE else 'Adapter'}: "
              f"{ctx.run.model if cfg.train.finetuning in finetuning.WHOLE else ctx.run.adapter}", flush=True)
    return ctx.run.root


def eval_only(cfg: RunConfig, adapter: str | None = None) -> Path:
    """`emotune eval`: the evaluation of the base model, an adapter folder or a run folder, on `eval.split`.

    Results go to `<run>/eval/<split>-base`, `<run>/eval/<split>-finetuned` for a run folder, or
    `<adapter's parent>/eval/<split>-<adapter name>`; an adapter made by another tool is measured with
    this config's labels and prompt."""
    ctx = Context(cfg)
    ctx.validate()
    artifact = ctx.task.find_adapter(adapter, cfg, ctx.data) if adapter is not None else None
    out = _eval_folder(cfg, adapter, artifact)
    check_folder_path(out, "the results folder")  # before the model is loaded and measured, not after
    what = "the base model" if artifact is None else f"{'merged model' if artifact.merged else 'adapter'} {artifact.path}"
    print(f"Evaluating {what} on the {cfg.eval.split} split, {ctx.precision.name} on {ctx.device}", flush=True)
    if artifact is None:
        results = ctx.task.evaluate(ctx.base.model, ctx.base.tokenizer, ctx.data, cfg, desc=cfg.eval.split)
    elif artifact.merged:
        results = _evaluate_merged(ctx, artifact)
    else:
        model = ctx.task.load_adapted(ctx.base.model, artifact.path, cfg, ctx.data)
        results, _ = evaluate_adapted(ctx, model, desc=cfg.eval.split)
    ctx.task.write_results(results, out)
    for method, result in results.items():
        print(f"{method}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in result.metrics.items() if k in ctx.task.SHOWN_METRICS))
    print(f"Results: {out}")
    return out


def _evaluate_merged(ctx: Context, artifact) -> dict:
    """A merged folder (`emotune export --merge`) is the fine-tuned model itself: it is loaded with its own tokenizer
    in place of the base, which is never loaded, and measured as saved; there is no adapter to merge or check."""
    from emotune.model.artifacts import load_artifact_model

    dtype = weights_dtype(ctx.cfg.model, ctx.device, ctx.cfg.train.precision)
    model, tokenizer = load_artifact_model(artifact, dtype, ctx.device)
    ctx._base = Base(model, tokenizer, ctx.precision, artifact.path)
    results = ctx.task.evaluate(model, tokenizer, ctx.data, ctx.cfg, desc=ctx.cfg.eval.split)
    record = {"mode": ctx.cfg.eval.merge_adapters, "merged": True,
              "note": f"a merged model folder, evaluated as saved in {str(dtype).removeprefix('torch.')}"}
    for result in results.values():
        result.metrics["merge"] = record
    return results


def _eval_folder(cfg: RunConfig, adapter: str | None, artifact) -> Path:
    split = cfg.eval.split
    if artifact is None:
        return RunDir(cfg.run_dir).evals / f"{split}-base"
    target = Path(adapter).expanduser()
    if artifact.path != target:  # a run folder: its adapter/
        return RunDir(target).evals / f"{split}-finetuned"
    return RunDir(target.parent).evals / f"{split}-{target.name}"


def _read_comparison(ctx: Context) -> dict:
    return read_json(ctx.run.comparison_json)
