"""TXT data files: one `text;label` per line (the common copies of the emotion dataset), or fastText's
`__label__name text` lines; lines counted as editors count them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from emotune.core.errors import UserError, listed

FASTTEXT = "__label__"  # fastText's label prefix; its lines were split at a `;` in the text, or refused for having none

def text_lines(text: str) -> list[str]:
    """The lines of a text file as editors and line-numbering tools count them: ends at \\n, \\r\\n or \\r only.
    str.splitlines also ends a line at U+2028/U+2029, U+0085, form feeds and \\x1c-\\x1e, which texts hold (pasted
    web text): a text with one became two lines, one of them without its `;label`."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def tab_header(text: str) -> bool:
    """The first line has tabs and no `;`: a header of tab-separated columns, not a `text;label` row."""
    first = next((line for line in text_lines(text[:1 << 16]) if line.strip()), "")
    return "\t" in first and ";" not in first


def read_txt(path: Path, text: str, text_column: str, label_column: str) -> pa.Table:
    """The `text;label` format of the common copies of the emotion dataset (the label follows the last `;`), or
    fastText's lines (`__label__joy I am happy`)."""
    numbered = [(number, line) for number, line in enumerate(text_lines(text), start=1) if line.strip()]
    if numbered and all(line.startswith(FASTTEXT) for _, line in numbered):
        return _fasttext(path, numbered, text_column, label_column)
    if numbered and numbered[0][1].strip().lower() in (f"{text_column};{label_column}", "text;label"):
        numbered = numbered[1:]  # a header row
    bad = [number for number, line in numbered if ";" not in line]
    if bad:
        raise UserError(f"`{path}`: {len(bad)} line(s) have no `;` between text and label (first: line "
                        f"{', '.join(map(str, bad[:5]))}). TXT files hold one `text;label` per line.")
    lines = [line for _, line in numbered]
    parts = pc.split_pattern(pa.array(lines, pa.string()), ";", max_splits=1, reverse=True)
    return pa.table({text_column: pc.list_element(parts, 0), label_column: pc.list_element(parts, 1)})


def _fasttext(path: Path, numbered: list[tuple[int, str]], text_column: str, label_column: str) -> pa.Table:
    """fastText's supervised lines: the label after `__label__`, the text after the first space."""
    pairs = [(number, *line.split(maxsplit=1)) for number, line in numbered]
    several = [number for number, *rest in pairs if len(rest) > 1 and rest[1].startswith(FASTTEXT)]
    if several:
        raise UserError(f"`{path}` is in fastText's format with several labels on lines {listed(several)}; the classify "
                        "tasks give each text one label: keep one `__label__` per line.")
    return pa.table({text_column: [rest[1] if len(rest) > 1 else "" for _, *rest in pairs],
                     label_column: [rest[0][len(FASTTEXT):] for _, *rest in pairs]})
