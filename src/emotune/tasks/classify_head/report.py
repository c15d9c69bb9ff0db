"""The head task's comparison and report: classify's tables and figures, with what "before" and "after" measured
said in the terminal table, comparison.json and the page."""

from __future__ import annotations

import html

from emotune.core.rundir import RunDir
from emotune.data import LabeledData
from emotune.eval.evaluate import EvalResult
from emotune.tasks.classify import report as classify_report
from emotune.tasks.classify.report import baseline_notes, compare_methods, format_table, write_comparison

__all__ = ["compare", "format_comparison", "report_sections", "write_comparison"]


def compare(before: dict[str, EvalResult], after: dict[str, EvalResult], data: LabeledData) -> dict:
    comparison = compare_methods(before, after, data.labels)
    comparison["measured_by"] = {"before": _measured_by(before), "after": _measured_by(after)}
    return comparison


def _measured_by(results: dict[str, EvalResult]) -> str | None:
    return next(iter(results.values())).metrics.get("measured_by")


def format_comparison(comparison: dict, data: LabeledData, cfg) -> str:
    measured = comparison.get("measured_by", {})
    lines = [f"\nBefore/after on the {cfg.eval.split} split ({comparison['rows']} rows), classification head:",
             f"  before = {measured.get('before')}", f"  after  = {measured.get('after')}\n",
             format_table(comparison, data.labels, comparison.get("chance"))]
    if comparison.get("chance"):
        lines += ["", *baseline_notes({}, comparison["chance"])]
    return "\n".join(lines)


def report_sections(run: RunDir, info: dict) -> list[str]:
    """A note on what before and after measured, then classify's sections (tables, confusion, F1, changed rows)."""
    note = ("<section id=head-baseline><h2>What is compared</h2><p>Before: "
            + html.escape(info.get("baseline", "the base model's zero-shot label scoring"))
            + ". An untrained head predicts at chance, so the base model's own best reading of the labels is the "
            "honest baseline. After: the classification head (<code>score</code> on the last token) with the LoRA "
            f"adapter, kept by validation {html.escape(str(info.get('head_select', 'macro_f1')))}.</p></section>")
    return [note, *classify_report.report_sections(run, info)]
