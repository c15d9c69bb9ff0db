"""Figures draw Chinese text with a font that has its glyphs: the packaged Noto Sans SC is registered with
matplotlib, Latin text keeps DejaVu Sans, and the check itself fails where no CJK font is in the family list.

Coverage is checked the way matplotlib resolves fonts, with public API only: every family of a Text's family list
through `font_manager.findfont(..., fallback_to_default=False)`, then the file's cmap read with fontTools."""

from __future__ import annotations

import warnings
from functools import cache
from importlib import metadata

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from fontTools.ttLib import TTFont  # noqa: E402
from matplotlib.font_manager import FontProperties, findfont, font_family_aliases  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from emotune.core import figures as fonts  # noqa: E402

LABELS = ["喜悦", "愤怒", "悲伤", "恐惧", "惊讶", "厌恶", "中性"]


def glyph_sources(text: Text) -> dict[str, str | None]:
    """For each character of a drawn Text: the file of the first family in its family list whose cmap has it (None:
    no family has it, so it draws as a box). Generic names (`sans-serif`) stand for their rcParams list."""
    files = []
    for family in text.get_fontfamily():
        for name in (matplotlib.rcParams[f"font.{family}"] if family in font_family_aliases else [family]):
            try:
                files.append(findfont(FontProperties(family=name), fallback_to_default=False))
            except ValueError:
                continue
    return {ch: next((p for p in files if ord(ch) in cmap(p)), None) for ch in text.get_text() if not ch.isspace()}


@cache
def cmap(path: str) -> dict[int, str]:
    return TTFont(path, lazy=True).getBestCmap()


def draw_chinese_figure():
    fig, ax = plt.subplots()
    ax.bar(range(len(LABELS)), [1, 2, 3, 4, 5, 6, 7])
    ax.set_xticks(range(len(LABELS)), LABELS)
    ax.set_title("Per-class F1 (score): 喜悦 vs 中性")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.canvas.draw()
    texts = [t for t in fig.findobj(Text) if t.get_text()]
    return fig, texts, [str(w.message) for w in caught]


def test_chinese_labels_draw_from_a_font_that_covers_every_glyph_and_latin_keeps_dejavu():
    with fonts.figure_fonts() as chain:
        fig, texts, warned = draw_chinese_figure()
    plt.close(fig)
    assert chain[0] == "DejaVu Sans" and "Noto Sans SC" in chain
    drawn = "".join(t.get_text() for t in texts)
    assert all(label in drawn for label in LABELS)
    for text in texts:
        sources = glyph_sources(text)
        assert None not in sources.values(), (text.get_text(), sources)
        for ch, path in sources.items():
            expected = "NotoSansSC" if "\u4e00" <= ch <= "\u9fff" else "DejaVuSans"
            assert expected in path, (ch, path)
    assert not [w for w in warned if "missing from font" in w]


def test_without_a_cjk_family_the_same_check_finds_the_missing_glyphs():
    with matplotlib.rc_context({"font.family": ["DejaVu Sans"]}):
        fig, texts, warned = draw_chinese_figure()
    plt.close(fig)
    missing = {ch for t in texts for ch, path in glyph_sources(t).items() if path is None}
    assert set("喜悦中性") <= missing
    assert any("missing from font" in w for w in warned)  # matplotlib agrees: these would be boxes
    assert fonts.missing_glyphs("喜悦", FontProperties(family=["DejaVu Sans"])) == {"喜", "悦"}
    assert fonts.missing_glyphs("F1 喜悦", FontProperties(family=fonts.families())) == set()


def test_the_cjk_font_comes_from_an_installed_package_under_the_open_font_license():
    path = fonts.packaged_cjk_font()
    assert path is not None and path.suffix == ".otf"
    licence = metadata.metadata("pylopdf-fonts-zh-cn")
    assert "SIL Open Font License" in (licence.get("License") or "") + " ".join(licence.get_all("Classifier") or [])
    assert set(map(ord, "".join(LABELS))) <= fonts.covered(path)


def test_the_report_says_when_no_font_has_a_label_s_characters(capsys):
    from emotune.report.page import _note_missing_glyphs

    _note_missing_glyphs(["喜悦", "joy", "中性"])
    assert capsys.readouterr().out == ""
    _note_missing_glyphs(["喜悦", "\U00012000"])  # a cuneiform sign: in neither DejaVu Sans nor Noto Sans SC
    assert "\U00012000" in capsys.readouterr().out


def test_labels_with_dollar_signs_are_drawn_as_written_not_as_mathtext(tmp_path):
    """A label set like ["$x^$", "a $5 fee", "b$10$"] made the data stage's label figure (and the report's) fail:
    matplotlib read the text between two `$` as mathtext, which `x^` is not."""
    from datasets import Dataset

    from emotune.data.load import LabeledData
    from emotune.data.prepare import plot_label_distribution

    labels = ["$x^$", "a $5 fee", "b$10$"]
    rows = Dataset.from_dict({"text": ["t"] * 3, "label": labels})
    data = LabeledData(splits={"train": rows, "test": rows}, labels=labels, source="$HOME/data$")
    plot_label_distribution(data, tmp_path / "labels.png")
    assert (tmp_path / "labels.png").stat().st_size > 0
    with fonts.figure_fonts():
        fig, ax = plt.subplots()
        ax.set_xticks(range(3), labels)
        fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
    plt.close(fig)


def test_long_and_multi_line_labels_stay_inside_their_figures(tmp_path):
    """A 400-character label pushed the confusion matrix and the F1 bars off their figures (matplotlib: "Tight layout
    not applied") and a label with line breaks stacked its lines over the next tick; figures now draw each name on
    one line, at most 28 columns wide with the middle cut, and the tables keep the whole name."""
    import warnings

    from datasets import Dataset

    from emotune.data.load import LabeledData
    from emotune.data.prepare import plot_label_distribution
    from emotune.eval.evaluate import compute_metrics
    from emotune.tasks.classify.report import _confusion_figure, _f1_figure

    labels = ["x" * 400, "line1\nline2\nline3", "$x^$", "喜悦" * 50]
    assert fonts.short_label("line1\nline2") == "line1 line2" and fonts.short_label("joy") == "joy"
    assert [len(fonts.short_label(label)) for label in labels] == [28, 17, 4, 14]
    metrics = compute_metrics(labels * 2, labels[1:] + labels[:1] + labels, labels)
    rows = Dataset.from_dict({"text": ["t"] * 4, "label": labels})
    with warnings.catch_warnings(), fonts.figure_fonts():
        warnings.simplefilter("error")  # "Tight layout not applied" is how an overflowing figure shows
        for figure in (_confusion_figure(metrics, metrics, labels, "score"), _f1_figure(metrics, metrics, labels, "score")):
            figure.canvas.draw()
            ticks = [t.get_text() for ax in figure.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
            assert "\n" not in "".join(ticks) and max(map(len, ticks)) <= 28
            plt.close(figure)
        plot_label_distribution(LabeledData(splits={"train": rows}, labels=labels, source="d" * 300), tmp_path / "l.png")


def test_labels_that_cut_to_the_same_tick_are_kept_apart():
    """Two long labels sharing their first 18 and last 9 columns cut to one tick: a figure drew two identical bars or
    matrix rows. The clashing ones end with their place in the list; the others stay as they were."""
    from emotune.eval.evaluate import compute_metrics
    from emotune.tasks.classify.report import _f1_figure

    first, second = "a" * 18 + "first middle" + "z" * 9, "a" * 18 + "second middle" + "z" * 9
    labels = [first, second, "joy"]
    assert fonts.short_label(first) == fonts.short_label(second)
    ticks = fonts.short_labels(labels)
    assert len(set(ticks)) == 3 and ticks[2] == "joy" and ticks[0].endswith(" #1") and ticks[1].endswith(" #2")
    assert all(fonts.terminal.width(t) <= fonts.TICK_COLUMNS for t in ticks)
    metrics = compute_metrics(labels * 2, labels[1:] + labels[:1] + labels, labels)
    with fonts.figure_fonts():
        figure = _f1_figure(metrics, metrics, labels, "score")
        figure.canvas.draw()
        drawn = [t.get_text() for ax in figure.axes for t in ax.get_xticklabels()]
        plt.close(figure)
    assert drawn[:3] == ticks


@pytest.mark.parametrize("count", [6, 15, 16, 50])
def test_a_confusion_matrix_of_many_labels_keeps_its_names_and_numbers_apart(count):
    """The confusion matrix was 4.6 inches whatever the label count: at 50 labels its names were drawn over each other
    and 2,500 cell numbers over the cells and each other, a black block. The figure grows with the labels, and past
    15 labels the cells show their share by colour alone."""
    from emotune.eval.evaluate import compute_metrics
    from emotune.tasks.classify.report import _confusion_figure

    labels = [f"emotion label {i}" for i in range(count)]
    gold = labels * 3
    metrics = compute_metrics(gold, labels[1:] + labels[:1] + labels * 2, labels)
    with fonts.figure_fonts():
        figure = _confusion_figure(metrics, metrics, labels, "score")
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for ax in figure.axes:
            names = [t.get_window_extent(renderer) for t in ax.get_yticklabels()]
            assert len(names) == count
            assert not any(a.overlaps(b) for a, b in zip(names, names[1:], strict=False))
            numbers = [t.get_window_extent(renderer) for t in ax.texts]
            assert len(numbers) == (count * count if count <= 15 else 0)
            assert not any(a.overlaps(b) for a, b in zip(numbers, numbers[1:], strict=False))
            assert all(name.x1 <= ax.get_window_extent(renderer).x0 + 1 and name.x0 >= 0 for name in names)
            page = figure.bbox
            for text in (ax.title, ax.xaxis.label, ax.yaxis.label):  # the whole figure on its page
                box = text.get_window_extent(renderer)
                assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, text
        plt.close(figure)
