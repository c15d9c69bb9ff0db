"""`task: toy`, defined under tests/ to show that a task is one folder plus a registry line.

Its config class is its own (`task: toy`, one key of its own); its data, training rows, measurement and
comparison are built from the library's pieces (the classify task's hooks, which any task may use as a library),
and its report adds a section of its own. Nothing outside this folder names it: tests/test_toy_task.py registers
it with emotune.tasks.register and runs `emotune run` on it end to end.
"""

from __future__ import annotations

from typing import Literal

from emotune.core.config.run import ClassifyConfig
from emotune.core.rundir import RunDir
from emotune.tasks.classify import task as classify

SECTION = "<section id='toy'><h2>Toy task</h2><p>{rows} test rows measured before and after.</p></section>"


class ToyConfig(ClassifyConfig):
    """`task: toy`: a labelled text dataset, answered with the label's name (classify's data and prompt)."""

    task: Literal["toy"] = "toy"
    """The test-only toy task."""
    toy_note: str = "made in tests/toy_task"
    """A key only the toy task has: its config class is its own."""


CONFIG = ToyConfig
SHOWN_METRICS = classify.SHOWN_METRICS
COMPARED_METRICS = classify.COMPARED_METRICS
DEFAULT_METRIC = "accuracy"
SWEEP_COLUMNS = ("accuracy",)

# the library's pieces: classify's hooks, unchanged
load_data, data_fingerprint, saved_fingerprint = classify.load_data, classify.data_fingerprint, classify.saved_fingerprint
save_data, describe_data, run_info = classify.save_data, classify.describe_data, classify.run_info
training_rows, training_setup, load_adapted = classify.training_rows, classify.training_setup, classify.load_adapted
adapter_meta, memory_workload, evaluate = classify.adapter_meta, classify.memory_workload, classify.evaluate
merge_check_inputs, write_results, read_results = classify.merge_check_inputs, classify.write_results, classify.read_results
has_results, find_adapter, compare = classify.has_results, classify.find_adapter, classify.compare
write_comparison, format_comparison, outputs = classify.write_comparison, classify.format_comparison, classify.outputs
MEASUREMENT, measurements = classify.MEASUREMENT, classify.measurements


def report_sections(run: RunDir, info: dict) -> list[str]:
    """classify's sections, then the toy task's own."""
    rows = sum(1 for _ in (run.baseline.glob("*/predictions.csv")))
    return [*classify.report_sections(run, info), SECTION.format(rows=rows)]
