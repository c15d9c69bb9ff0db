"""Cells of the summary tables emotune writes for people to open in a spreadsheet (comparison.csv, compare.csv, a
sweep's tables).

Excel, LibreOffice and Google Sheets read a cell that starts with `=`, `+`, `-` or `@` (or a tab or a carriage
return) as a formula, quoted or not: a label named `=HYPERLINK("http://…","joy")` becomes a link, and older Excel
runs `=cmd|…` as a command after a warning (OWASP's "CSV injection"). Label names, run names and data paths come from
the data and the user, so such a text cell is written with a `'` before it, which every spreadsheet takes as text.
Numbers (`-0.032`) are written as they are.

The data files (predictions.csv, `emotune predict --out`) are not summaries: emotune and other programs read them
back, so every text stays exactly as it was there (docs/evaluation.md says how to open them in a spreadsheet).
"""

from __future__ import annotations

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_cell(value):
    """`value`, with a `'` before a text a spreadsheet would read as a formula; numbers and anything else unchanged.
    A text that already starts with `'` before such a start gets one more, so `from_spreadsheet_cell` undoes it
    exactly."""
    if isinstance(value, str) and _formula_like(value.lstrip("'")):
        return "'" + value
    return value


def from_spreadsheet_cell(text: str) -> str:
    """The value `spreadsheet_cell` wrote as `text` (a page that shows the table, where no formula runs)."""
    return text[1:] if text.startswith("'") and _formula_like(text.lstrip("'")) else text


def spreadsheet_row(cells) -> list:
    return [spreadsheet_cell(cell) for cell in cells]


def _formula_like(text: str) -> bool:
    if not text.startswith(FORMULA_STARTS):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False  # a number written as text: `-2`, `-1e-4`
