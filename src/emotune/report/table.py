"""`emotune compare`'s table as text, Markdown, CSV and HTML, from the summary emotune.report.compare builds.

Two tables: quality (the fine-tuned scores with 95 % intervals, the paired test against the first row)
and setup and cost (model, hyper-parameters, time, speed, memory, adapter size). The HTML page shows both
and the per-class F1 of every row side by side (generation, e.g. sft: ROUGE-L per kind of instruction).
"""

from __future__ import annotations

import csv
import html
import io
from pathlib import Path

from emotune.core import terminal
from emotune.core.errors import UserError
from emotune.core.rundir import atomic_dir, json_text
from emotune.core.spreadsheet import spreadsheet_row
from emotune.eval.stats import RESAMPLES, VERDICT_NOTES, format_interval
from emotune.report.page import html_page as page

SCORES = {"classification": (("accuracy", "accuracy"), ("macro_f1", "macro-F1")),
          "generation": (("rouge_l", "ROUGE-L"), ("exact_match", "exact match"))}
EXTRA = {"classification": (("invalid", "invalid"),), "generation": (("bleu", "BLEU"), ("perplexity", "perplexity"))}
SETUP = (("model", "model"), ("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_targets", "targets"),
         ("learning_rate", "lr"), ("steps", "steps"), ("batch", "batch"), ("max_length", "max_length"),
         ("train_seconds", "train s"), ("tokens_per_s", "tokens/s"), ("peak_memory_mb", "peak MB"),
         ("eval_rows_per_s", "eval rows/s"), ("adapter_mb", "adapter MB"))


# --------------------------------------------------------------------------------------------------
# Cells


def _cell(value, digits: int | None = None) -> str:
    """`digits` decimals for scores; otherwise 3 significant digits below 1 (a learning rate), one decimal above."""
    if value is None:
        return "—"
    if isinstance(value, float):
        if digits is not None:
            return f"{value:.{digits}f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    return str(value)


def vs_first_text(row: dict, index: int) -> str:
    if index == 0:
        return "reference"
    if not row["comparable"]:
        return "not comparable"
    found = row["vs_first"]
    if found is None:
        return "—"
    if "rouge_l_delta" in found:
        delta = found["rouge_l_delta"]
        return f"{found['verdict']} (ΔROUGE-L {delta['delta']:+.3f} {format_interval([delta['low'], delta['high']], True)})"
    delta, test = found["macro_f1_delta"], found["mcnemar"]
    return (f"{found['verdict']} (ΔF1 {delta['delta']:+.3f} {format_interval([delta['low'], delta['high']], True)}, "
            f"p={test['p_value']:.2g})")


def quality_table(table: dict) -> tuple[list[str], list[list[str]]]:
    kind = table["kind"]
    header = ["run", "task/method"]
    for _, title in SCORES[kind]:
        header += [title, "95% interval"]
    header += [title for _, title in EXTRA[kind]] + ["vs first run"]
    rows = []
    for i, row in enumerate(table["rows"]):
        cells = [row["run"], row["name"]]
        for key, _ in SCORES[kind]:
            score = row["scores"].get(key, {})
            cells += [_cell(score.get("value"), 3), format_interval(score["interval"]) if "interval" in score else "—"]
        cells += [_cell(row["metrics"].get(key), 3) for key, _ in EXTRA[kind]] + [vs_first_text(row, i)]
        rows.append(cells)
    return header, rows


def setup_table(table: dict) -> tuple[list[str], list[list[str]]]:
    header = ["run", "task/method"] + [title for _, title in SETUP]
    rows = [[row["run"], row["name"]] + [_cell(row[key]) for key, _ in SETUP] for row in table["rows"]]
    return header, rows


# --------------------------------------------------------------------------------------------------
# Text, Markdown, CSV


def _text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(terminal.width(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(terminal.ljust(cell, width) for cell, width in zip(line, widths, strict=False)).rstrip() for line in [header, *rows]]
    return "\n".join([lines[0], "-" * terminal.width(lines[0]), *lines[1:]])


def markdown_line(text) -> str:
    """Text as one line of Markdown, each line break a `<br>` (GitHub and the model hubs render it as one): a break
    would end the table row or bullet the text is in, and a blank line, `- ...`, `# ...` or `---` after it would
    start a paragraph, list, heading or rule of its own. `<`, `>` and `&` are written as entities: Markdown passes
    HTML through, so a label `<unk>` or `<b>` vanished or changed the text after it where the file is shown."""
    return "<br>".join(html.escape(line, quote=False) for line in str(text).splitlines())


def markdown_cell(cell) -> str:
    """A value as one cell of a Markdown table: a `|` in a label or a run name would start a new column, and a line
    break would end the row."""
    return markdown_line(str(cell).replace("|", "\\|"))


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(map(markdown_cell, cells)) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def notes(table: dict) -> list[str]:
    out = [f"Scores after fine-tuning on {table['rows'][0]['rows']} test rows; 95% intervals: percentile bootstrap, "
           f"{RESAMPLES} resamples of the rows. \"vs first run\": the paired test against {table['reference']} on "
           "the same rows."]
    shown = {(row["vs_first"] or {}).get("verdict") for row in table["rows"]}
    if table["kind"] == "classification":
        out += [f"{verdict}: {note}." for verdict, note in VERDICT_NOTES.items() if verdict in shown]
    elif shown - {None}:
        out.append("better / worse: the 95% interval of the paired ROUGE-L difference lies above / below 0; "
                   "within noise: it contains 0.")
    out += [f"{row['run']} ({row['name']}) is not comparable: {row['note']}." for row in table["rows"] if not row["comparable"]]
    return out


def render(table: dict) -> str:
    """The terminal text: the quality table, the setup and cost table, and what the verdicts mean."""
    # a note's later lines indented under its first, so each note still reads as one
    return "\n".join(["", _text(*quality_table(table)), "", _text(*setup_table(table)), "",
                      *["\n  ".join(note.splitlines()) for note in notes(table)]])


def markdown(table: dict) -> str:
    return "\n".join(["## Quality", "", _markdown(*quality_table(table)), "", "## Setup and cost", "",
                      _markdown(*setup_table(table)), "", *[f"- {markdown_line(note)}" for note in notes(table)], ""])


def csv_text(table: dict) -> str:
    """One line per row with raw values: scores with their interval bounds, the paired test, per-class F1 (a name that
    looks like a formula written as text: emotune.core.spreadsheet)."""
    kind = table["kind"]
    labels = list(dict.fromkeys(label for row in table["rows"] for label in row["per_class"]))
    per_class = "rouge_l" if kind == "generation" else "f1"
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    score_columns = [f"{key}{part}" for key, _ in SCORES[kind] for part in ("", "_low", "_high")]
    writer.writerow(spreadsheet_row(["run", "path", "task", "method", *score_columns, *[k for k, _ in EXTRA[kind]], *[k for k, _ in SETUP],
                     "rows", "fingerprint", "comparable", "vs_first_verdict", "vs_first_delta", "vs_first_low",
                     "vs_first_high", "vs_first_p_value", *[f"{per_class}/{label}" for label in labels], "note"]))
    for row in table["rows"]:
        scores = [v for key, _ in SCORES[kind] for v in (row["scores"].get(key, {}).get("value"),
                                                         *row["scores"].get(key, {}).get("interval", [None, None]))]
        found = row["vs_first"] or {}
        delta = found.get("macro_f1_delta") or found.get("rouge_l_delta") or {}
        writer.writerow(spreadsheet_row([row["run"], row["path"], row["task"], row["method"], *scores,
                         *[row["metrics"].get(k) for k, _ in EXTRA[kind]], *[row.get(k) for k, _ in SETUP], row["rows"],
                         row["fingerprint"], row["comparable"], found.get("verdict"), delta.get("delta"), delta.get("low"),
                         delta.get("high"), found.get("mcnemar", {}).get("p_value"),
                         *[row["per_class"].get(label) for label in labels], row["note"]]))
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------
# HTML


def _html_table(header: list[str], rows: list[list[str]], caption: str) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><caption>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"


def _per_class_table(table: dict) -> str:
    """Labels down, rows across, each cell shaded by its F1 so a weak class stands out."""
    labels = list(dict.fromkeys(label for row in table["rows"] for label in row["per_class"]))
    head = "".join(f"<th>{html.escape(row['run'])}<br>{html.escape(row['name'])}</th>" for row in table["rows"])
    body = ""
    for label in labels:
        cells = ""
        for row in table["rows"]:
            value = row["per_class"].get(label)
            shade = f" style='background: rgba(10, 122, 47, {0.6 * value:.2f})'" if value is not None else ""
            cells += f"<td class=num{shade}>{_cell(value, 3)}</td>"
        body += f"<tr><th>{html.escape(label)}</th>{cells}</tr>"
    what = "ROUGE-L per kind of instruction" if table["kind"] == "generation" else "F1 per class"
    return (f"<section id=per-class><h2>{what}, side by side</h2><table><tr><th></th>{head}</tr>{body}</table>"
            "</section>")


def html_sections(table: dict) -> list[str]:
    """The page's sections: quality, the headline scores as a figure, setup and cost, per class, notes."""
    return [f"<section id=quality><h2>Quality</h2>{_html_table(*quality_table(table), 'after fine-tuning')}</section>",
            f"<section id=figure><h2>Headline scores</h2>{score_figure(table)}</section>",
            f"<section id=setup><h2>Setup and cost</h2>"
            f"{_html_table(*setup_table(table), 'from config.yaml, run.json and the training log')}</section>",
            _per_class_table(table),
            "<section id=notes><h2>Notes</h2>" + "".join(f"<p>{_html_lines(n)}</p>" for n in notes(table)) + "</section>"]


def _html_lines(text: str) -> str:
    """`text` escaped, its line breaks kept (HTML would run its lines together)."""
    return "<br>".join(html.escape(line) for line in text.splitlines())


def html_page(table: dict) -> str:
    return page("emotune compare", html_sections(table))


def score_figure(table: dict) -> str:
    """Each row's headline scores (macro-F1 and accuracy; generation: ROUGE-L and exact match) as points with their
    95% intervals as whiskers, one line per row: overlapping whiskers are the first hint that a difference is noise
    (the paired test in the quality table is the real answer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from emotune.core.figures import embed_figure, figure_fonts, short_labels

    rows, scores = table["rows"], SCORES[table["kind"]]
    with figure_fonts():
        fig, axes = plt.subplots(1, len(scores), figsize=(4.2 * len(scores), 0.5 * len(rows) + 1.4), squeeze=False)
        names = short_labels([f"{row['run']} ({row['name']})" for row in rows], 40)
        for ax, (key, title) in zip(axes[0], scores, strict=True):
            for y, row in enumerate(rows):
                score = row["scores"].get(key) or {}
                value, interval = score.get("value"), score.get("interval")
                if value is None:
                    continue
                if interval:
                    ax.plot(interval, [y, y], color="#2563eb", linewidth=2)
                ax.plot([value], [y], "o", color="#1d2430")
            ax.set_yticks(range(len(rows)), names if ax is axes[0][0] else [""] * len(rows))
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_title(f"{title} (95% interval)")
            ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        return embed_figure(fig, None, "headline scores with 95% intervals, one line per run")


def check_out(out: Path) -> None:
    """Refuse an --out that holds anything but an earlier comparison: it is replaced whole."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "compare.json").is_file())):
        raise UserError(f"--out `{out}` exists and is not a folder `emotune compare` wrote (it has no compare.json), "
                        "and it would be replaced whole. Give a new or empty folder, e.g. --out compare-heads.")


def write_outputs(table: dict, out: Path) -> None:
    """compare.csv, .md, .html and .json into `out`, replacing an earlier comparison there whole."""
    check_out(out)
    with atomic_dir(out) as tmp:
        (tmp / "compare.csv").write_text(csv_text(table), encoding="utf-8")
        (tmp / "compare.md").write_text(markdown(table), encoding="utf-8")
        (tmp / "compare.html").write_text(html_page(table), encoding="utf-8")
        (tmp / "compare.json").write_text(json_text(table), encoding="utf-8")
