"""Terminal tables line up by display width: Chinese labels take two columns a character."""

from __future__ import annotations

from emotune.core import terminal
from emotune.report.table import _text
from emotune.tasks.classify.report import format_table


def test_width_counts_wide_and_zero_width_characters():
    assert terminal.width("喜悦") == 4 and terminal.width("ＡＰＰ") == 6 and terminal.width("joy") == 3
    assert terminal.width("e\u0301") == 1
    assert terminal.width("a\x1bb") == 3  # a control character: its length, never a negative width
    assert terminal.ljust("喜悦", 6) == "喜悦  " and terminal.rjust("喜悦", 6) == "  喜悦"
    assert terminal.ljust("喜悦喜悦", 2) == "喜悦喜悦"  # never cut


def _columns_after(lines: list[str], marker: str) -> set[int]:
    """The display column at which `marker` starts on each line that holds it."""
    return {terminal.width(line[:line.index(marker)]) for line in lines if marker in line}


def test_classify_table_aligns_chinese_label_rows():
    labels = ["喜悦", "愤怒", "neutral", "e\u0301-accent"]  # the last: 8 columns from 9 code points
    metrics = {"accuracy": {"before": 0.25, "after": 0.75, "delta": 0.5}}
    for label in labels:
        metrics[f"{label}/f1"] = {"before": 0.111, "after": 0.999, "delta": 0.888}
        metrics[f"{label}/recall"] = {"before": 0.111, "after": 0.999, "delta": 0.888}
    lines = format_table({"metrics": metrics}, labels).splitlines()
    rows = [line for line in lines if "0.999" in line]
    assert len(rows) == 8 and len(_columns_after(rows, "0.999")) == 1  # every "after" value in one column
    assert len({terminal.width(line) for line in rows}) == 1


def test_compare_text_table_aligns_chinese_run_names():
    text = _text(["run", "macro-F1"], [["中文头-运行", "0.870"], ["cpu", "0.791"]]).splitlines()
    assert len(_columns_after(text, "0.")) == 1
    assert terminal.width(text[1]) == terminal.width(text[0])  # the rule under the header spans it
