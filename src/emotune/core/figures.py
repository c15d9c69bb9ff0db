"""Figures: fonts (Latin text in matplotlib's own DejaVu Sans, Chinese and other CJK text in Noto Sans SC), and
a figure embedded in an HTML page as an inline PNG (report.html and the tasks' report sections).

matplotlib ships no CJK font and a bare machine has none, so a figure with Chinese labels would draw empty
boxes. emotune depends on the PyPI package `pylopdf-fonts-zh-cn`, which holds Noto Sans SC (the Simplified-
Chinese subset of Noto Sans CJK, SIL Open Font License 1.1) as a plain file; `figure_fonts()` registers it
with matplotlib's font manager and sets a family list, DejaVu Sans first. matplotlib (3.6 and later) takes
each glyph from the first family in the list that has it, so Latin text keeps its usual font and only the
characters DejaVu Sans lacks come from the CJK font. Without the package, CJK fonts installed on the system
(found by name) take its place.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from emotune.core import terminal
from emotune.core.rundir import atomic_file

LATIN = "DejaVu Sans"  # matplotlib's default, shipped inside matplotlib itself
# Families whose name says CJK, tried when the packaged font is missing (order: most common on Linux first).
SYSTEM_CJK_HINTS = ("Noto Sans CJK", "Noto Sans SC", "Source Han Sans", "WenQuanYi", "Droid Sans Fallback",
                    "AR PL", "Microsoft YaHei", "PingFang", "Hiragino Sans GB", "SimHei", "Heiti")
GENERIC = ("serif", "sans-serif", "cursive", "fantasy", "monospace")
TICK_COLUMNS = 28  # the widest name a figure draws whole (short_label)


def packaged_cjk_font() -> Path | None:
    """Noto Sans SC from pylopdf-fonts-zh-cn; None when the package is not installed."""
    try:
        import pylopdf_fonts_zh_cn as package
    except ImportError:
        return None
    path = package.sans_path()
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def cjk_families() -> tuple[str, ...]:
    """Register the packaged CJK font with matplotlib's font manager (once per process) and return the CJK families
    to fall back on: the packaged one, then those installed on the system; () when there is none."""
    from matplotlib import font_manager

    manager = font_manager.fontManager
    packaged = packaged_cjk_font()
    if packaged is not None and str(packaged) not in {entry.fname for entry in manager.ttflist}:
        manager.addfont(str(packaged))
    found = [entry.name for entry in manager.ttflist if packaged is not None and entry.fname == str(packaged)]
    found += [entry.name for hint in SYSTEM_CJK_HINTS for entry in manager.ttflist if entry.name.startswith(hint)]
    return tuple(dict.fromkeys(found))


def families() -> list[str]:
    """The family list figures use: DejaVu Sans, then the CJK fallbacks."""
    return [LATIN, *cjk_families()]


@contextmanager
def figure_fonts() -> Iterator[list[str]]:
    """Within this block, new figures draw with `families()`, and every text as written: a label or data source with
    two `$` in it would otherwise be read as mathtext, drawn mangled or, where it does not parse (`$x^$`), fail the
    whole figure. matplotlib's rc_context restores the settings after."""
    import matplotlib

    chain = families()
    with matplotlib.rc_context({"font.family": chain, "text.parse_math": False}):
        yield chain


def font_files(prop) -> list[Path]:
    """The files matplotlib draws a `FontProperties` with, in fallback order: each family of the list (generic names
    like `sans-serif` expanded through rcParams), as `findfont` resolves it; families it cannot find are skipped."""
    import matplotlib
    from matplotlib.font_manager import FontProperties, findfont

    names = []
    for family in prop.get_family():
        names += matplotlib.rcParams[f"font.{family}"] if family in GENERIC else [family]
    files = []
    for name in names:
        try:
            files.append(Path(findfont(FontProperties(family=name, style=prop.get_style(), weight=prop.get_weight()),
                                       fallback_to_default=False)))
        except ValueError:  # not installed: matplotlib skips it the same way
            continue
    return list(dict.fromkeys(files))


@lru_cache(maxsize=32)
def covered(path: Path) -> frozenset[int]:
    """Code points the font file has a glyph for (its best cmap, read with fontTools)."""
    from fontTools.ttLib import TTFont

    with TTFont(str(path), lazy=True, fontNumber=0) as font:
        return frozenset(font.getBestCmap() or {})


def missing_glyphs(text: str, prop) -> set[str]:
    """Characters of `text` (besides whitespace) that no font of `prop`'s fallback list has: they would draw as
    boxes."""
    files = font_files(prop)
    return {ch for ch in text if not ch.isspace() and not any(ord(ch) in covered(f) for f in files)}


def short_label(text: str, columns: int = TICK_COLUMNS) -> str:
    """A name as a figure's tick, title or legend shows it: on one line (a line break in a label stacked its lines over
    the next tick) and at most `columns` wide (a Chinese character counts two), the middle cut to `…` so that names
    sharing a beginning stay apart. A 400-character label pushed the confusion matrix off its own figure; the tables
    beside every figure hold the whole name."""
    flat = " ".join(str(text).split())
    if terminal.width(flat) <= columns:
        return flat
    head, tail = _fit(flat, (columns - 1) * 2 // 3), _fit(flat[::-1], (columns - 1) // 3)[::-1]
    return f"{head}…{tail}"


def short_labels(texts: list[str], columns: int = TICK_COLUMNS) -> list[str]:
    """`short_label` of each name, kept apart: names that would cut to the same tick (sharing their first and last
    columns) end with their place in the list instead (`…ending #3`), so two bars or matrix rows never read alike."""
    shown = [short_label(text, columns) for text in texts]
    clashes = {tick for tick in shown if shown.count(tick) > 1}
    return [short_label(text, columns - len(f" #{i + 1}")) + f" #{i + 1}" if tick in clashes else tick
            for i, (text, tick) in enumerate(zip(texts, shown, strict=True))]


def _fit(text: str, columns: int) -> str:
    """The longest beginning of `text` at most `columns` wide."""
    out = ""
    for ch in text:
        if terminal.width(out + ch) > columns:
            break
        out += ch
    return out


def embed_figure(fig, path: Path | None, alt: str) -> str:
    """The figure as an inline <img>, saved as a PNG at `path` too (None: inline only)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    data = buffer.getvalue()
    if path is not None:
        with atomic_file(path) as tmp:
            tmp.write_bytes(data)
    return f"<figure><img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(data).decode()}'></figure>"
