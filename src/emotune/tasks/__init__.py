"""What each task contributes to a run, and the table from `task` to the module that implements it.

A task module provides, as plain functions (see classify.py, and docs/tasks.md for the contract):

    load_data(cfg)                                   validated data, before any weights load
    data_fingerprint(cfg) / saved_fingerprint(run)   whether run/data/ holds this data
    save_data(data, run, tokenizer, cfg)             the data stage's outputs in run/data/
    describe_data(data) -> str                       the summary printed by `emotune data` and `run`
    run_info(cfg, data) -> dict                      what run.json records about the task
    training_rows(data, tokenizer, cfg)              encoded (train, validation) rows with their loss masks
    training_setup(model, cfg, data)                 the model to train (the base, or a classifier over it) and
                                                     the Objective (loss, adapter selection, PEFT task type)
    load_adapted(model, adapter_dir, cfg, data)      the base model with a trained adapter, as training made it
    adapter_meta(cfg, data) -> dict                  what emotune.json records next to the adapter
    evaluate(model, tokenizer, data, cfg, desc)      the measurement, run identically before and after
    write_results(results, folder) / read_results(folder, cfg)
    has_results(folder) -> bool                      whether a stage folder holds a complete measurement (report)
    find_adapter(path, cfg, data) -> Artifact        an adapter to measure with `emotune eval adapter=...`
    SHOWN_METRICS                                    the metric names `emotune eval` prints
    compare(before, after, data) -> dict             the before/after comparison (comparison.json)
    write_comparison(comparison, run) / format_comparison(comparison, data, cfg) -> str
    outputs(run, cfg) -> list[Path]                  what must exist before a run counts as finished
    report_sections(run, info) -> list[str]          the task's HTML sections of report.html
    memory_workload(cfg, device_type) -> Workload    what `emotune plan` models of its training and evaluation

The pipeline, the training loop and the evaluation stage call these and nothing task-specific, so a new
task is a module here, a line in TASKS, and its config class in emotune.core.config.TASK_CONFIGS.
"""

from __future__ import annotations

from types import ModuleType

from emotune.tasks.classify import task as classify
from emotune.tasks.classify_head import task as classify_head
from emotune.tasks.sft import task as sft

TASKS: dict[str, ModuleType] = {
    "classify": classify,
    "sft": sft,
    "classify_head": classify_head,
}


def task_for(cfg) -> ModuleType:
    return TASKS[cfg.task]
