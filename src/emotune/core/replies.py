"""Reading the label a generated reply names: the first label name in it, INVALID when none matches."""

from __future__ import annotations

import re
import unicodedata

INVALID = "INVALID"
UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN")


def label_pattern(labels: list[str]) -> re.Pattern[str]:
    """Whole-word, case-insensitive match of any label; longer names first so `joyful` never reads as `joy`.

    Scripts written without spaces (Chinese, Japanese, Thai, ...) have no word boundaries to test, so
    a label edge in such a script matches next to anything (`我觉得是喜悦。` -> 喜悦).
    """
    def bounded(label: str) -> str:
        before = "" if _unspaced(label[:1]) else r"(?<!\w)"
        after = "" if _unspaced(label[-1:]) else r"(?!\w)"
        return before + re.escape(label) + after

    alternatives = "|".join(bounded(label) for label in sorted(labels, key=len, reverse=True))
    return re.compile(rf"({alternatives})", re.IGNORECASE)


def _unspaced(char: str) -> bool:
    return bool(char) and unicodedata.name(char, "").startswith(UNSPACED_SCRIPTS)


def extract_label(output: str, labels: list[str], pattern: re.Pattern[str] | None = None) -> str:
    match = (pattern or label_pattern(labels)).search(output)
    if match is None:
        return INVALID
    found = match.group(1).casefold()
    return next(label for label in labels if label.casefold() == found)
