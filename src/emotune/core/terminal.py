"""Terminal tables padded by display width, not by character count: a CJK character takes two columns of a
terminal and a combining mark none, so `str.ljust` misaligns every table that holds Chinese labels or run names.
The widths come from wcwidth (the Unicode East Asian Width and zero-width tables)."""

from __future__ import annotations

from wcwidth import wcswidth


def width(text: str) -> int:
    """Columns `text` takes in a terminal (its length where it holds a control character)."""
    columns = wcswidth(text)
    return len(text) if columns < 0 else columns


def ljust(text: str, columns: int) -> str:
    return text + " " * max(0, columns - width(text))


def rjust(text: str, columns: int) -> str:
    return " " * max(0, columns - width(text)) + text
