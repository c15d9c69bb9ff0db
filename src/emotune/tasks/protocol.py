"""The Task protocol: what a task contributes to a run, as the hooks generic code calls.

A task is one folder under tasks/ whose `task.py` module provides every member below (plain functions and
constants; a module satisfies the protocol structurally), and one line in emotune.tasks.TASKS. The pipeline,
the training loop, the evaluation stage, the report, `compare` and `sweep` call these and nothing task-specific.
docs/tasks.md describes each hook with its types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """One task's hooks, grouped by the stage that calls them."""

    CONFIG: type  # its config class (a RunConfigBase subclass with `task: Literal["<name>"]`)
    # data: validated before any weights load, saved into run/data/, described, recorded in run.json
    load_data: Callable[..., Any]
    data_fingerprint: Callable[..., str]
    saved_fingerprint: Callable[..., str | None]
    save_data: Callable[..., None]
    describe_data: Callable[..., str]
    run_info: Callable[..., dict]
    # training batches: encoded rows with their loss masks, the model to train and its Objective
    training_rows: Callable[..., Any]
    training_setup: Callable[..., Any]
    load_adapted: Callable[..., Any]
    adapter_meta: Callable[..., dict]
    memory_workload: Callable[..., Any]  # what `emotune plan` models of training and evaluation
    # evaluation: the same measurement before and after
    evaluate: Callable[..., Any]
    merge_check_inputs: Callable[..., Any]
    write_results: Callable[..., None]
    read_results: Callable[..., Any]
    has_results: Callable[..., bool]
    find_adapter: Callable[..., Any]  # an adapter to measure with `emotune eval adapter=...`
    SHOWN_METRICS: tuple[str, ...]  # printed by `emotune eval`
    # comparison: comparison.json, its table, what a finished run holds
    compare: Callable[..., dict]
    write_comparison: Callable[..., None]
    format_comparison: Callable[..., str]
    outputs: Callable[..., list]
    COMPARED_METRICS: tuple[str, ...]  # the after-training metrics of comparison.json (`sweep.metric` picks one)
    DEFAULT_METRIC: str  # what a sweep ranks by when sweep.metric is not set
    SWEEP_COLUMNS: tuple[str, ...]  # the metrics a sweep's table shows beside the ranked one
    # `emotune compare`: which kind of measurement the task makes ("classification": predicted labels, scored by
    # accuracy and macro-F1; "generation": free text, scored by ROUGE-L and perplexity), and a finished stage's
    # measurements, [{"method", "labels", "metrics", "rows", "rows_per_s"}] ([] when none is complete)
    MEASUREMENT: str
    measurements: Callable[..., list[dict]]
    # report: the task's HTML sections of report.html
    report_sections: Callable[..., list[str]]


def missing_hooks(task: object) -> list[str]:
    """The protocol's members `task` lacks (empty when it implements the protocol)."""
    names = [n for n in Task.__annotations__]
    return [n for n in names if not hasattr(task, n)]
