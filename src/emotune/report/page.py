"""The HTML report of a run folder: the run summary, the task's own sections, the loss curves, and what training did
(gradient norms, adapter weights: emotune.report.training).

`write_report(run_dir)` reads only the run folder (run.json, config.yaml, the evaluations,
train/log_history.json), so `emotune report RUN_DIR` can rebuild it at any time. The page is one
self-contained file: figures are inlined as base64 PNGs (also saved under `report/`), no scripts, no CDN.
The sections of each task (before/after tables, confusion matrices, ...) come from its module in
emotune.tasks.
"""

from __future__ import annotations

import html
import math
import os
import shutil
from pathlib import Path

from emotune.core.errors import UserError
from emotune.core.figures import embed_figure, families, figure_fonts, missing_glyphs
from emotune.core.rundir import RunDir, check_folder_path, partial_path, read_json, write_text
from emotune.eval.merged import describe

# --------------------------------------------------------------------------------------------------
# The HTML report

def write_report(run_dir: str | Path) -> Path:
    """report.html (self-contained) and report/*.png from whatever the run folder holds; returns the page's path."""
    from emotune.report.training import training_section
    from emotune.tasks import DEFAULT_TASK, TASKS

    run = RunDir(run_dir)
    info = read_json(run.run_json)
    task = TASKS.get((info or {}).get("task", DEFAULT_TASK))
    if info is not None and task is None:
        raise UserError(f"`{run.run_json}` names task {info.get('task')!r}, which this emotune does not know. "
                        "Upgrade emotune to the version that made the run.")
    if info is None or not task.has_results(run.baseline):
        raise UserError(f"`{run.root}` is not a run folder with a measured baseline (run.json or the baseline's results "
                        f"are missing or unreadable). Give the folder `emotune run` printed, e.g. runs/cpu.")
    check_folder_path(run.figures, "the report's figures folder")
    _note_missing_glyphs(info.get("labels") or [])
    # the figures are drawn into a folder of their own and moved into report/ (each in one rename) with the page: a
    # report that failed half-way (a method's rows that do not pair up) left the old page beside half of the new figures
    staged = partial_path(run.figures, unique=True)
    staged.mkdir(parents=True)
    try:
        drawn = StagedFigures(run.root, staged)
        with figure_fonts():  # labels and texts in any script: Chinese glyphs fall back to a CJK font
            sections = [_summary_section(info, drawn), *task.report_sections(drawn, info), _loss_section(drawn),
                        training_section(drawn), _telemetry_section(drawn, info)]
        run.figures.mkdir(exist_ok=True)
        for figure in staged.iterdir():
            os.replace(figure, run.figures / figure.name)
        return write_text(run.report_html, html_page(f"emotune report: {run.root.name}", sections))
    finally:
        shutil.rmtree(staged, ignore_errors=True)


class StagedFigures(RunDir):
    """The run folder, with the report's figures (and adapter_stats.json) going to `staged` instead of report/."""

    def __init__(self, root: Path, staged: Path):
        super().__init__(root)
        self.staged = Path(staged)

    figures = property(lambda self: self.staged)
    adapter_stats = property(lambda self: self.staged / "adapter_stats.json")


def html_page(title: str, sections: list[str]) -> str:
    """A self-contained page in the report's style (also `emotune compare`'s)."""
    return _PAGE.format(title=html.escape(title), body="\n".join(sections))


def _note_missing_glyphs(labels: list[str]) -> None:
    """Say so when no font has a glyph for a label's characters: the figures would draw them as empty boxes."""
    from matplotlib.font_manager import FontProperties

    missing = missing_glyphs("".join(labels), FontProperties(family=families()))
    if missing:
        print(f"Note: no font here has the characters {''.join(sorted(missing))} of the labels, so the figures draw "
              "them as boxes (the tables are right). Install a font that covers them; emotune uses any font "
              "matplotlib finds after DejaVu Sans and Noto Sans SC.", flush=True)


def _sources(config: dict) -> tuple[str, str]:
    """model.source and data.source as the config holds them (YAML's quoting undone), `?` where it does not say."""

    def source(section: str) -> str:
        value = config.get(section, {}).get("source") if isinstance(config.get(section), dict) else None
        return str(value) if value is not None else "?"

    return source("model"), source("data")


def _summary_section(run: dict, folder: RunDir) -> str:
    hardware = run.get("hardware", {})
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in hardware.get("gpus", [])) or "none"
    config_text = folder.saved_config() or ""
    model, data = _sources(folder.saved_settings())
    facts = [
        ("status", f"{run.get('status')} (started {run.get('started')}, finished {run.get('finished', '—')})"),
        ("model", model),
        ("data", f"{data} — " + ", ".join(f"{k} {v} rows" for k, v in run.get("rows", {}).items())),
        *([("labels", ", ".join(run["labels"]))] if run.get("labels") else []),
        *([("kinds of instruction", ", ".join(run["kinds"]))] if run.get("kinds") else []),
        ("hardware", f"{run.get('device')} · backend {hardware.get('backend')} · GPUs: {gpus} · "
                     f"{hardware.get('cpu_count')} CPU cores · {hardware.get('platform')}"),
        ("precision", f"{run.get('precision', {}).get('name')}: {run.get('precision', {}).get('reason')}"),
        ("fine-tuning", _finetuning_words(run.get("finetuning") or {"kind": "lora"})),
        *([("fine-tuned evaluation", describe(run["merged_eval"]))] if run.get("merged_eval") else []),
        ("versions", ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items())),
        ("system prompt", run.get("system_prompt", "")),
    ]
    timing = "".join(f"<tr><td>{html.escape(name)}</td><td>{html.escape(str(stage.get('status')))}</td>"
                     f"<td class=num>{stage.get('seconds', '—')}</td><td>{html.escape(stage.get('note', ''))}</td></tr>"
                     for name, stage in run.get("stages", {}).items())
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    return (f"<section id=summary><h2>Run summary</h2><table class=facts>{rows}</table>"
            f"<h3>Stages</h3><table><tr><th>stage</th><th>status</th><th>seconds</th><th>note</th></tr>{timing}</table>"
            f"<details><summary>Resolved config</summary><pre>{html.escape(config_text)}</pre></details></section>")


def _finetuning_words(finetuning: dict) -> str:
    """What trained (run.json's `finetuning`; runs from before it existed trained LoRA adapters)."""
    kind = finetuning.get("kind")
    if kind == "full":
        return "full: every weight of the language model (train.finetuning=full), saved as a whole model"
    if kind == "freeze":
        n = finetuning.get("trainable_layers")
        layers = f"the last {n}" if isinstance(n, int) and n > 0 else f"the first {-n}" if isinstance(n, int) else "some"
        modules = finetuning.get("trainable_modules")
        parts = "whole" if modules == "all" else f"modules {', '.join(modules or [])} of"
        extra = finetuning.get("extra_modules")
        return (f"freeze: {parts} {layers} decoder layers" + (f", plus {', '.join(extra)}" if extra else "")
                + " (train.finetuning=freeze), saved as a whole model")
    return "LoRA adapters over the frozen base (train.finetuning=lora)"


def _loss_section(run: RunDir) -> str:
    history = run.history()
    if not history:
        return "<section id=loss><h2>Training and validation loss</h2><p>No training log in this run folder.</p></section>"
    # a diverged loss is null in the JSON: NaN leaves a gap in the curve, as it did before it was written as null
    train = [(e["step"], _number(e["loss"])) for e in history if "loss" in e and "step" in e]
    val = [(e["step"], _number(e["eval_loss"])) for e in history if "eval_loss" in e and "step" in e]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for points, name, marker in ((train, "training", "."), (val, "validation", "o")):
        if points:
            ax.plot(*zip(*points, strict=False), marker=marker, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Training and validation loss")
    ax.legend()
    fig.tight_layout()
    return ("<section id=loss><h2>Training and validation loss</h2>"
            + embed_figure(fig, run.figures / "loss.png", "training and validation loss") + "</section>")


def _number(value) -> float:
    return value if isinstance(value, (int, float)) else math.nan


def _telemetry_section(run: RunDir, info: dict) -> str:
    from emotune.runtime import telemetry

    rows = telemetry.read_series(run.telemetry)
    head = "<section id=telemetry><h2>Telemetry</h2>"
    if not rows:
        return head + "<p>No telemetry in this run folder (it is recorded when train.telemetry_interval > 0).</p></section>"
    summaries = {name: stage["telemetry"] for name, stage in info.get("stages", {}).items() if "telemetry" in stage}
    fields = list(dict.fromkeys(f for summary in summaries.values() for f in summary["fields"]))
    header = "".join(f"<th>{html.escape(f)} ({html.escape(telemetry.UNITS[f])})</th>" for f in fields)
    body = "".join(
        f"<tr><td>{html.escape(name)}</td><td class=num>{summary['samples']}</td>"
        + "".join(f"<td class=num>{_peak_mean(summary['fields'].get(f))}</td>" for f in fields) + "</tr>"
        for name, summary in summaries.items())
    interval = next((summary["interval_s"] for summary in summaries.values()), None)
    table = (f"<table><caption>Peak / mean per stage (a sample every {interval} s; the series is in "
             f"{run.telemetry.name})</caption><tr><th>stage</th><th>samples</th>{header}</tr>{body}</table>")
    return head + table + embed_figure(telemetry.figure(rows), run.figures / "telemetry.png", "telemetry") + "</section>"


def _peak_mean(values: dict | None) -> str:
    return "—" if values is None else f"{values['peak']:g} / {values['mean']:g}"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px; color: #222;
       padding: 0 1rem; }}
h1 {{ font-size: 1.6rem; }} h2 {{ border-bottom: 2px solid #ddd; padding-bottom: .3rem; margin-top: 2.5rem; }}
table {{ border-collapse: collapse; margin: .8rem 0; }}
td, th {{ border: 1px solid #ddd; padding: .3rem .6rem; text-align: left; vertical-align: top; }}
th {{ background: #f5f5f5; }} caption {{ text-align: left; padding: .3rem 0; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.good {{ color: #0a7a2f; font-weight: 600; }} .bad {{ color: #b3261e; font-weight: 600; }}
table.rows td:first-child {{ max-width: 640px; }}
figure {{ margin: 1rem 0; }} img {{ max-width: 100%; }}
pre {{ background: #f7f7f7; padding: 1rem; overflow-x: auto; }}
</style></head>
<body><h1>{title}</h1>
{body}
</body></html>
"""
