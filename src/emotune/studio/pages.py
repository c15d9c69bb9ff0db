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
.field {{ margin: .5rem 0; }} .field small {{ display: block; color: #556; }} .problem {{ color: #a11; margin-left: .5rem; }}
.invalid input, .invalid select, .invalid textarea {{ border: 2px solid #a11; }} form.inline {{ display: inline; }}
#curve {{ border: 1px solid #dde; }} nav a {{ margin-right: 1rem; }} .num {{ font-variant-numeric: tabular-nums; }}
"""


def layout(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · emotune studio</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style>'
            f'<script src="/static/studio.js" defer></script></head><body>'
            f'<nav><a href="/">Runs</a><a href="/new">New run</a></nav><h1>{escape(title)}</h1>{body}</body></html>')


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def runs_page(runs: list[RunSummary], folder: str, queue: str = "") -> str:
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
            f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{empty}<h2>Queue</h2>{queue}')
    return layout("Runs", body)


def run_page(summary: RunSummary, config_text: str, history_count: int, files: list[tuple[str, int]], log: str,
             has_report: bool, job_html: str = "") -> str:
    name = quote(summary.name)
    report = (f'<p><a id="report" href="/runs/{name}/files/report.html">Open the report</a></p>' if has_report
              else "<p>No report yet (it is written by the report stage).</p>")
    listing = "".join(f'<li><a href="/runs/{name}/files/{quote(path)}">{escape(path)}</a> '
                      f'<span class="num">({size:,} bytes)</span></li>' for path, size in files)
    result = (f"<p>{escape(summary.metric)}: {_number(summary.before)} → {_number(summary.after)}</p>"
              if summary.after is not None else "")
    body = (f'<p>Status: <strong id="status" class="status-{escape(summary.status)}">{escape(summary.status)}</strong> · '
            f'task {escape(summary.task)} · model <code>{escape(summary.model)}</code> · data <code>{escape(summary.data)}</code></p>'
            f'{job_html}{result}{report}'
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


def form_page(task: str, tasks: list[str], fields: list, values: dict[str, str], problems: dict[str, list[str]],
              csrf: str) -> str:
    """The new-run form: the task picker, then every field of the task's config by section, each with its doc and
    default and, after a refused submit, its problems beside it."""
    picker = " ".join(f'<a href="/new?task={quote(t)}"{" aria-current=page" if t == task else ""}>{escape(t)}</a>'
                      for t in tasks)
    general = "".join(f'<p class="problem" role="alert">{escape(p)}</p>' for p in problems.get("", []))
    sections: dict[str, list[str]] = {}
    for field in fields:
        section = field.key.split(".")[0] if "." in field.key else "run"
        sections.setdefault(section, []).append(_field_html(field, values.get(field.key, field.default),
                                                            problems.get(field.key, [])))
    shut = {name for name in sections if name not in ("run", "model", "data", "train")} - {k.split(".")[0] for k in problems}
    blocks = "".join(f'<details{"" if name in shut else " open"}><summary>{escape(name)}'
                     f'</summary>{"".join(items)}</details>' for name, items in sections.items())
    body = (f'<p>Task: {picker}</p>{general}<form method="post" action="/new" id="new-run">'
            f'<input type="hidden" name="csrf" value="{escape(csrf)}"><input type="hidden" name="task" value="{escape(task)}">'
            f'{blocks}<p><button type="submit">Queue this run</button></p></form>')
    return layout("New run", body)


def _field_html(field, value: str, problems: list[str]) -> str:
    key = escape(field.key)
    if field.choices:
        choices = field.choices + (["null"] if field.default == "null" and "null" not in field.choices else [])
        options = "".join(f'<option{" selected" if c == value else ""}>{escape(c)}</option>' for c in choices)
        control = f'<select id="f-{key}" name="{key}">{options}</select>'
    elif field.multiline:
        control = f'<textarea id="f-{key}" name="{key}" rows="3" cols="80">{escape(value)}</textarea>'
    else:
        control = f'<input id="f-{key}" name="{key}" value="{escape(value)}" size="40">'
    wrong = "".join(f'<span class="problem" role="alert">{escape(p)}</span>' for p in problems)
    return (f'<div class="field{" invalid" if problems else ""}"><label for="f-{key}"><code>{key}</code></label> {control}'
            f'{wrong}<small>default <code>{escape(field.default)}</code> · {escape(field.doc)}</small></div>')


def jobs_list(jobs: list, csrf: str) -> str:
    """The queue: every job with its state, and a stop button on those not ended."""
    if not jobs:
        return "<p>No jobs started from the studio yet.</p>"
    items = "".join(
        f'<tr><td>{j.id}</td><td><a href="/runs/{quote(j.name)}">{escape(j.name)}</a></td>'
        f'<td class="status-{escape(j.status)}">{escape(j.status)}{_stopping(j)}</td>'
        f'<td>{stop_button(j, csrf)}</td></tr>' for j in reversed(jobs))
    return f'<table id="jobs"><thead><tr><th>job</th><th>run</th><th>state</th><th></th></tr></thead><tbody>{items}</tbody></table>'


def _stopping(job) -> str:
    return " (stopping)" if job.stop_requested and job.status == "running" else ""


def stop_button(job, csrf: str) -> str:
    if job.status not in ("queued", "running") or job.stop_requested:
        return ""
    return (f'<form method="post" action="/jobs/{job.id}/stop" class="inline"><input type="hidden" name="csrf" '
            f'value="{escape(csrf)}"><button type="submit" id="stop-{job.id}">{"Cancel" if job.status == "queued" else "Stop"}'
            f'</button></form>')
