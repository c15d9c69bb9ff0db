"""The studio's HTML, rendered on the server: plain strings with every value escaped, one small local script.

No template engine: the pages are few and short, and `html.escape` on every value from a run folder is easy to
check by reading. Nothing is loaded from another host: the script is served by the studio itself and the fonts
are the system's (with CJK fallbacks, so Chinese labels render).
"""

from __future__ import annotations

import json
from html import escape
from urllib.parse import quote

from emotune.studio.runs import RunSummary

FONTS = ('system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "Noto Sans CJK SC", "Noto Sans SC", '
         '"PingFang SC", "Microsoft YaHei", "WenQuanYi Micro Hei", sans-serif')
STYLE = f"""
body {{ font-family: {FONTS}; margin: 1.5rem auto; max-width: 72rem; padding: 0 1rem; color: #1d2430; }}
table {{ border-collapse: collapse; width: 100%; }} th, td {{ text-align: left; padding: .3rem .6rem; border-bottom: 1px solid #dde; }}
th[data-key] {{ cursor: pointer; }} th[data-key]:after {{ content: " ↕"; color: #99a; }}
.status-finished {{ color: #17663a; }} .status-failed {{ color: #a11; }} .status-running {{ color: #a56300; }}
pre {{ background: #f5f6f8; padding: .6rem; overflow: auto; max-height: 24rem; }}
#curve {{ border: 1px solid #dde; }} nav a {{ margin-right: 1rem; }} .num {{ font-variant-numeric: tabular-nums; }}
"""


def layout(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · emotune studio</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style>'
            f'<script src="/static/studio.js" defer></script></head><body>'
            f'<nav><a href="/">Runs</a></nav><h1>{escape(title)}</h1>{body}</body></html>')


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def runs_page(runs: list[RunSummary], folder: str) -> str:
    head = "".join(f'<th data-key="{key}">{label}</th>' for key, label in (
        ("name", "Run"), ("task", "Task"), ("model", "Model"), ("data", "Data"), ("status", "Status"),
        ("after", "Before → after"), ("minutes", "Minutes")))
    rows = "".join(
        f'<tr data-row=\'{escape(json.dumps(r.as_row(), ensure_ascii=False))}\'>'
        f'<td><a href="/runs/{quote(r.name)}">{escape(r.name)}</a></td><td>{escape(r.task)}</td>'
        f'<td>{escape(r.model)}</td><td>{escape(r.data)}</td><td class="status-{escape(r.status)}">{escape(r.status)}</td>'
        f'<td class="num">{escape(r.metric)} {_number(r.before)}{" → " if r.after is not None else ""}{_number(r.after)}</td>'
        f'<td class="num">{"" if r.minutes is None else r.minutes}</td></tr>' for r in runs)
    empty = "" if runs else f"<p>No run folders in <code>{escape(folder)}</code> yet.</p>"
    body = (f'<p>{len(runs)} run folder(s) in <code>{escape(folder)}</code>.</p>'
            f'<label>Filter <input id="filter" type="search" placeholder="text in any column"></label>'
            f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{empty}')
    return layout("Runs", body)


def run_page(summary: RunSummary, config_text: str, history_count: int, files: list[tuple[str, int]], log: str,
             has_report: bool) -> str:
    name = quote(summary.name)
    report = (f'<p><a id="report" href="/runs/{name}/files/report.html">Open the report</a></p>' if has_report
              else "<p>No report yet (it is written by the report stage).</p>")
    listing = "".join(f'<li><a href="/runs/{name}/files/{quote(path)}">{escape(path)}</a> '
                      f'<span class="num">({size:,} bytes)</span></li>' for path, size in files)
    result = (f"<p>{escape(summary.metric)}: {_number(summary.before)} → {_number(summary.after)}</p>"
              if summary.after is not None else "")
    body = (f'<p>Status: <strong id="status" class="status-{escape(summary.status)}">{escape(summary.status)}</strong> · '
            f'task {escape(summary.task)} · model <code>{escape(summary.model)}</code> · data <code>{escape(summary.data)}</code></p>'
            f'{result}{report}'
            f'<h2>Progress</h2><p id="progress" data-events="/runs/{name}/events" data-count="{history_count}">'
            f'{history_count} log entries so far.</p>'
            f'<canvas id="curve" width="720" height="240" aria-label="training and validation loss"></canvas>'
            f'<table id="history"><thead><tr><th>step</th><th>loss</th><th>eval loss</th><th>tokens/s</th>'
            f'<th>peak memory (MB)</th><th>learning rate</th></tr></thead><tbody></tbody></table>'
            f'<h2>Config</h2><pre id="config">{escape(config_text)}</pre>'
            f'<h2>Log tail</h2><pre id="log">{escape(log) or "(no log file in this run folder)"}</pre>'
            f'<h2>Artifacts</h2><ul id="artifacts">{listing}</ul>')
    return layout(f"Run {summary.name}", body)


def not_found(what: str) -> str:
    return layout("Not found", f"<p>{escape(what)}</p>")
