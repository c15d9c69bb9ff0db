"""Reading the label a generated reply names: the first label name in it, INVALID when none matches."""

from __future__ import annotations

import unicodedata

import regex

INVALID = "INVALID"
UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN")


def label_pattern(labels: list[str]) -> regex.Pattern[str]:
    """Whole-word, case-insensitive match of any label; longer names first so `joyful` never reads as `joy`.

    Scripts written without spaces (Chinese, Japanese, Thai, ...) have no word boundaries to test, so
    a label edge in such a script matches next to anything (`我觉得是喜悦。` -> 喜悦). Labels are matched in NFC
    form (`extract_label` normalises the reply too), and a space inside a label matches any run of
    whitespace (`very\\npositive`). Alternative `_<i>` is `labels[i]`. A combining mark counts as part of a word
    (`regex`'s \\p{M}; Python's `\\w` lacks it), so Hindi `खुश` is not read inside `खुशी`, whose last letter is a
    vowel sign.
    """
    def bounded(label: str) -> str:
        label = unicodedata.normalize("NFC", label).strip()
        before = "" if _unspaced(label[:1]) else r"(?<![\w\p{M}])"
        after = "" if _unspaced(label[-1:]) else r"(?![\w\p{M}])"
        return before + r"\s+".join(regex.escape(word) for word in label.split()) + after

    order = sorted(range(len(labels)), key=lambda i: len(labels[i]), reverse=True)
    return regex.compile("|".join(f"(?P<_{i}>{bounded(labels[i])})" for i in order), regex.IGNORECASE)


def _unspaced(char: str) -> bool:
    return bool(char) and unicodedata.name(char, "").startswith(UNSPACED_SCRIPTS)


def extract_label(output: str, labels: list[str], pattern: regex.Pattern[str] | None = None) -> str:
    """The label whose alternative matched first in the reply (by group, not by comparing case-folded text:
    `iyi` matches `İyi` under IGNORECASE, though their case folds differ)."""
    match = (pattern or label_pattern(labels)).search(unicodedata.normalize("NFC", output))
    if match is None:
        return INVALID
    return labels[int(match.lastgroup[1:])]
