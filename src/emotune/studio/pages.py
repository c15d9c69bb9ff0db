"""The studio's HTML, rendered on the server: plain strings with every value escaped, one small local script.

No template engine: the pages are few and short, and `html.escape` on every value from a run folder is easy to
check by reading. Nothing is loaded from another host: the script is served by the studio itself and the fonts
are the system's (with CJK fallbacks, so Chinese labels render).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from html import escape
from urllib.parse import quote

from emotune.studio.runs import RunSummary, telemetry_row

FONTS = ('system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "emotune CJK", "Noto Sans CJK SC", "Noto Sans SC", '
         '"PingFang SC", "Microsoft YaHei", "WenQuanYi Micro Hei", sans-serif')
# the packaged Noto Sans SC, served by the studio itself; fetched only for characters in these ranges (CJK)
CJK_FACE = ('@font-face { font-family: "emotune CJK"; src: url("/static/cjk.otf") format("opentype"); font-display: swap; '
            'unicode-range: U+2E80-2FDF, U+3000-30FF, U+3100-31FF, U+3400-4DBF, U+4E00-9FFF, U+F900-FAFF, U+FF00-FFEF; }')
STYLE = CJK_FACE + f"""
body {{ font-family: {FONTS}; margin: 1.5rem auto; max-width: 72rem; padding: 0 1rem; color: #1d2430; }}
table {{ border-collapse: collapse; width: 100%; }} th, td {{ text-align: left; padding: .3rem .6rem; border-bottom: 1px solid #dde; }}
th[data-key] {{ cursor: pointer; }} th[data-key]:after {{ content: " ↕"; color: #99a; }}
.status-finished {{ color: #17663a; }} .status-failed {{ color: #a11; }} .status-running {{ color: #a56300; }}
pre {{ background: #f5f6f8; padding: .6rem; overflow: auto; max-height: 24rem; }}
.field {{ margin: .5rem 0; }} .field small {{ display: block; color: #556; }} .problem {{ color: #a11; margin-left: .5rem; }}
.invalid input, .invalid select, .invalid textarea {{ border: 2px solid #a11; }} form.inline {{ display: inline; }}
#curve {{ border: 1px solid #dde; }} nav a {{ margin-right: 1rem; }} .num {{ font-variant-numeric: tabular-nums; }}
.bar {{ display: inline-block; height: .8rem; background: #2563eb; vertical-align: middle; }}
.error {{ color: #a11; }} figure img {{ max-width: 100%; }} caption {{ text-align: left; color: #556; }}
#reply {{ white-space: pre-wrap; }} .message {{ margin: .3rem 0; }} .message b {{ margin-right: .4rem; }}
"""


def layout(title: str, body: str) -> str:
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · emotune studio</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style>'
            f'<script src="/static/studio.js" defer></script></head><body>'
            f'<nav><a href="/">Runs</a><a href="/new">New run</a></nav><h1>{escape(title)}</h1>{body}</body></html>')


def _pre(value) -> str:
    """A value as preformatted text: JSON for dicts and lists."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)
    return f"<pre>{escape(text)}</pre>"


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def before_after(r: RunSummary) -> str:
    """`macro_f1 0.250 [0.10, 0.40] → 0.750 [0.50, 0.85]`: the headline metric with its 95% intervals."""
    def one(value, interval):
        return _number(value) + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
    if r.after is None:
        return ""
    return f"{r.metric} {one(r.before, r.before_interval)} → {one(r.after, r.after_interval)}"


def runs_page(runs: list[RunSummary], folder: str, queue: str = "", sweeps: list | None = None) -> str:
    head = '<th>Compare</th>' + "".join(f'<th data-key="{key}">{label}</th>' for key, label in (
        ("name", "Run"), ("task", "Task"), ("model", "Model"), ("data", "Data"), ("status", "Status"),
        ("after", "Before → after (95% interval)"), ("minutes", "Minutes")))
    rows = "".join(
        f'<tr data-row=\'{escape(json.dumps(r.as_row(), ensure_ascii=False))}\'>'
        f'<td><input type="checkbox" name="run" value="{escape(r.name)}" form="compare" '
        f'aria-label="compare {escape(r.name)}"{"" if r.status == "finished" else " disabled"}></td>'
        f'<td><a href="/runs/{quote(r.name)}">{escape(r.name)}</a></td><td>{escape(r.task)}</td>'
        f'<td>{escape(r.model)}</td><td>{escape(r.data)}</td><td class="status-{escape(r.status)}">{escape(r.status)}</td>'
        f'<td class="num">{escape(before_after(r))}</td>'
        f'<td class="num">{"" if r.minutes is None else r.minutes}</td></tr>' for r in runs)
    empty = "" if runs else f"<p>No run folders in <code>{escape(folder)}</code> yet.</p>"
    body = (f'<p>{len(runs)} run folder(s) in <code>{escape(folder)}</code>.</p>'
            f'<label>Filter <input id="filter" type="search" placeholder="text in any column"></label> '
            f'<form id="compare" method="get" action="/compare" class="inline"><button type="submit">Compare the '
            f'ticked runs</button></form>'
            f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{empty}'
            f'{sweeps_list(sweeps or [])}<h2>Queue</h2>{queue}')
    return layout("Runs", body)


def sweeps_list(sweeps: list) -> str:
    if not sweeps:
        return ""
    items = "".join(f'<tr><td><a href="/sweeps/{quote(w.name)}">{escape(w.name)}</a></td><td>{escape(w.mode)}</td>'
                    f'<td>{escape(w.metric)}</td><td class="num">{len(w.trials)}</td>'
                    f'<td class="status-{escape(w.status)}">{escape(w.status)}</td></tr>' for w in sweeps)
    return (f'<h2>Sweeps</h2><table id="sweeps"><thead><tr><th>sweep</th><th>mode</th><th>metric</th><th>trials</th>'
            f'<th>status</th></tr></thead><tbody>{items}</tbody></table>')


@dataclass
class RunView:
    """What a run page shows."""

    summary: RunSummary
    config_text: str
    history_count: int
    files: list[tuple[str, int]]
    log: str  # the tail of the job's log
    has_report: bool
    job_html: str = ""  # the job's state and Stop button
    details: dict | None = None  # emotune.studio.runs.run_details


def run_page(view: RunView) -> str:
    summary, files, details = view.summary, view.files, view.details
    config_text, history_count, log, has_report, job_html = (view.config_text, view.history_count, view.log,
                                                             view.has_report, view.job_html)
    name = quote(summary.name)
    report = (f'<p><a id="report" href="/runs/{name}/files/report.html">Open the report</a></p>' if has_report
              else "<p>No report yet (it is written by the report stage).</p>")
    listing = "".join(f'<li><a href="/runs/{name}/files/{quote(path)}">{escape(path)}</a> '
                      f'<span class="num">({size:,} bytes)</span></li>' for path, size in files)
    result = (f"<p>{escape(before_after(summary))} (95% intervals)</p>" if summary.after is not None else "")
    details = details or {}
    tryout = (f'<p><a id="try" href="/runs/{name}/try">Try it</a>: classify a text or chat with this run\'s model</p>'
              if any(path.startswith("adapter/") for path, _ in files) else "")
    plan = f'<details><summary>Training plan</summary>{_pre(details["plan"])}</details>' if details.get("plan") else ""
    telemetry = _telemetry(details.get("telemetry"))
    body = (f'<p>Status: <strong id="status" class="status-{escape(summary.status)}">{escape(summary.status)}</strong> · '
            f'task {escape(summary.task)} · model <code>{escape(summary.model)}</code> · data <code>{escape(summary.data)}</code></p>'
            f'{job_html}{result}{report}{tryout}'
            f'<h2>Progress</h2><p id="progress" data-events="/runs/{name}/events" data-count="{history_count}" '
            f'data-max-steps="{details.get("max_steps") or ""}">'
            f'{history_count} log entries so far.</p><p id="eta"></p>'
            f'<canvas id="curve" width="720" height="240" aria-label="training and validation loss"></canvas>'
            f'<table id="history"><thead><tr><th>step</th><th>loss</th><th>eval loss</th><th>tokens/s</th>'
            f'<th>peak memory (MB)</th><th>learning rate</th></tr></thead><tbody></tbody></table>'
            f'{plan}{telemetry}<h2>Config</h2><pre id="config">{escape(config_text)}</pre>'
            f'<h2>Log tail</h2><pre id="log">{escape(log) or "(no log file in this run folder)"}</pre>'
            f'<h2>Artifacts</h2><ul id="artifacts">{listing}</ul>')
    return layout(f"Run {summary.name}", body)


def _telemetry(sample: dict | None) -> str:
    """The latest telemetry sample (memory, CPU; GPU utilisation, temperature, power) of the stage running the model;
    the progress stream's telemetry events replace it while the run goes on."""
    row = telemetry_row(sample) if sample else {"stage": None, "values": {}}
    cells = "".join(f"<tr><th>{escape(key)}</th><td class=num>{value:.1f} {escape(unit)}</td></tr>"
                    for key, (value, unit) in row["values"].items())
    return (f'<h2>Device</h2><table id="telemetry"><caption>latest sample, stage <span id="telemetry-stage">'
            f'{escape(str(row["stage"] or "—"))}</span></caption><tbody>{cells}</tbody></table>')


def not_found(what: str) -> str:
    return layout("Not found", f"<p>{escape(what)}</p>")


def form_page(task: str, tasks: list[str], fields: list, values: dict[str, str], problems: dict[str, list[str]],
              csrf: str, translation: str = "") -> str:
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
    upload = (f'<details id="llamafactory"><summary>From a LLaMA-Factory or Axolotl YAML</summary><form method="post" '
              f'action="/new/llamafactory"><input type="hidden" name="csrf" value="{escape(csrf)}">'
              f'<p><input type="file" id="llamafactory-file" accept=".yaml,.yml"> or paste it:</p>'
              f'<textarea name="llamafactory" id="llamafactory-text" rows="8" cols="80"></textarea>'
              f'<p><button type="submit">Translate into the sft form</button></p></form></details>')
    shown = (f'<details open id="translation"><summary>The training file, translated</summary>{_pre(translation)}'
             f'<p>Check the fields below, then queue the run.</p></details>' if translation else "")
    body = (f'<p>Task: {picker}</p>{upload}{shown}{general}<form method="post" action="/new" id="new-run">'
            f'<input type="hidden" name="csrf" value="{escape(csrf)}"><input type="hidden" name="task" value="{escape(task)}">'
            f'{blocks}<p><button type="submit">Queue this run</button></p></form>')
    return layout("New run", body)


def _field_html(field, value: str, problems: list[str]) -> str:
    key = escape(field.key)
    if field.choices:
        choices = field.choices + (["null"] if field.default == "null" and "null" not in field.choices else [])
        options = "".join(f'<option{" selected" if c == value else ""}>{escape(c)}</option>' for c in choices)
        control = f'<select id="f-{key}" name="{key}">{options}</select>'
    elif field.multiline:  # a browser drops one line break right after <textarea>: the one written there, not the value's
        control = f'<textarea id="f-{key}" name="{key}" rows="3" cols="80">\n{escape(value)}</textarea>'
    else:
        control = f'<input id="f-{key}" name="{key}" value="{escape(value)}" size="40">'
    wrong = "".join(f'<span class="problem" role="alert">{escape(p)}</span>' for p in problems)
    default = json.dumps(field.default) if field.default and not field.default.strip() else field.default  # "\n\n", not blank
    return (f'<div class="field{" invalid" if problems else ""}"><label for="f-{key}"><code>{key}</code></label> {control}'
            f'{wrong}<small>default <code>{escape(default)}</code> · {escape(field.doc)}</small></div>')


def jobs_list(jobs: list, csrf: str) -> str:
    """The queue: every job with its state, and a stop button on those not ended."""
    if not jobs:
        return "<p>No jobs started from the studio yet.</p>"
    items = "".join(
        f'<tr><td>{j.id}</td><td><a href="/runs/{quote(j.name)}">{escape(j.name)}</a></td>'
        f'<td>{escape(j.device or "?")}</td><td class="status-{escape(j.status)}">{escape(j.status)}{_stopping(j)}</td>'
        f'<td>{stop_button(j, csrf)}</td></tr>' for j in reversed(jobs))
    return (f'<p>One job at a time per device, in the order queued.</p><table id="jobs"><thead><tr><th>job</th><th>run</th>'
            f'<th>device</th><th>state</th><th></th></tr></thead><tbody>{items}</tbody></table>')


def _stopping(job) -> str:
    return " (stopping)" if job.stop_requested and job.status == "running" else ""


def stop_button(job, csrf: str) -> str:
    if job.status not in ("queued", "running") or job.stop_requested:
        return ""
    return (f'<form method="post" action="/jobs/{job.id}/stop" class="inline"><input type="hidden" name="csrf" '
            f'value="{escape(csrf)}"><button type="submit" id="stop-{job.id}">{"Cancel" if job.status == "queued" else "Stop"}'
            f'</button></form>')


def login_page(problem: str) -> str:
    """The token form of a studio bound beyond loopback (posted, so the token never sits in a URL or history)."""
    wrong = f'<p class="error" role="alert">{escape(problem)}</p>' if problem else ""
    return layout("Sign in", f'{wrong}<form method="post" action="/login"><label>Studio token <input type="password" '
                             f'name="token" id="token" autocomplete="current-password" size="40"></label> '
                             f'<button type="submit">Sign in</button></form><p>The token is in EMOTUNE_STUDIO_TOKEN or '
                             f'the --token-file the studio was started with.</p>')


def compare_page(names: list[str], sections: list[str], problem: str, offer_mismatch: bool = False) -> str:
    picked = ", ".join(f'<a href="/runs/{quote(n)}">{escape(n)}</a>' if "/" not in n else escape(n) for n in names)
    error = f'<p class="error" role="alert" id="compare-error">{escape(problem)}</p>' if problem else ""
    if offer_mismatch and len(names) >= 2:
        query = "&".join(f"run={quote(n, safe='')}" for n in names)
        error += f'<p><a href="/compare?{query}&mismatch=1">Show them anyway, marked not comparable</a></p>'
    return layout("Compare", f"<p>Runs: {picked or 'none'}</p>{error}" + "".join(sections))


def sweep_page(sweep, trials_with_report: list[str]) -> str:
    """A sweep's trials as sweep.json has them now, its tables (the ablation table first) once it wrote them, and
    best.yaml; trials with a report link to it, and any of them can be compared."""
    name = quote(sweep.name)
    rows = ""
    for trial in sweep.trials:
        trial_name = str(trial.get("name", ""))
        value = trial.get("value")
        link = (f'<a href="/sweeps/{name}/files/{quote(trial_name)}/report.html">{escape(trial_name)}</a>'
                if trial_name in trials_with_report else escape(trial_name))
        rows += (f'<tr><td><input type="checkbox" name="run" value="{escape(sweep.name)}/{escape(trial_name)}" '
                 f'form="compare"{"" if trial.get("status") == "finished" else " disabled"}></td><td>{link}</td>'
                 f'<td class="status-{escape(str(trial.get("status")))}">{escape(str(trial.get("status")))}</td>'
                 f'<td class="num">{"" if not isinstance(value, (int, float)) else f"{value:.4f}"}</td>'
                 f'<td><code>{escape(_overrides(trial.get("overrides")))}</code></td></tr>')
    tables = "".join(f'<h2>{escape(title.capitalize())} table</h2><table id="table-{escape(title)}"><thead><tr>'
                     + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr></thead><tbody>"
                     + "".join("<tr>" + "".join(f"<td>{escape(_short_number(c))}</td>" for c in row) + "</tr>"
                               for row in body) + "</tbody></table>" for title, header, body in sweep.tables)
    best = f"<h2>best.yaml</h2>{_pre(sweep.best)}" if sweep.best else ""
    body = (f'<p>Status: <strong class="status-{escape(sweep.status)}">{escape(sweep.status)}</strong> · mode '
            f'{escape(sweep.mode)} · metric {escape(sweep.metric)}</p>{tables or "<p>The tables are written when the sweep ends.</p>"}'
            f'<h2>Trials</h2><form id="compare" method="get" action="/compare" class="inline"><button type="submit">'
            f'Compare the ticked trials</button></form><table id="trials"><thead><tr><th></th><th>trial</th><th>status</th>'
            f'<th>{escape(sweep.metric)}</th><th>overrides</th></tr></thead><tbody>{rows}</tbody></table>{best}')
    return layout(f"Sweep {sweep.name}", body)


def _overrides(value) -> str:
    """A trial's overrides (a list of `key=value`) as one line; anything else sweep.json holds there as it is."""
    return " ".join(map(str, value)) if isinstance(value, list) else "" if value is None else str(value)


def _short_number(cell: str) -> str:
    """A CSV cell with a long float shown to 4 significant digits; anything else as it is."""
    try:
        value = float(cell)
    except ValueError:
        return cell
    return cell if value.is_integer() or len(cell) <= 6 else f"{value:.4g}"


def try_page(name: str, chats: bool | None, labels: list[str], csrf: str, problem: str, max_tokens: int) -> str:
    """Classify a text with the run's model (every label's probability), or chat with a model that answers in free
    text (streamed); `chats` None: nothing to try, `problem` says why."""
    head = f'<p>Run <a href="/runs/{quote(name)}">{escape(name)}</a></p>'
    if chats is None:
        return layout(f"Try {name}", head + f'<p class="error" role="alert">{escape(problem)}</p>')
    hidden = f'<input type="hidden" name="csrf" value="{escape(csrf)}">'
    if not chats:
        form = (f'<form id="try-classify" data-url="/runs/{quote(name)}/classify">{hidden}'
                f'<p>Labels: {escape(", ".join(labels))}</p><textarea name="text" id="try-text" rows="4" cols="80" '
                f'maxlength="4000" required></textarea><p><button type="submit">Classify</button></p></form>'
                f'<p id="try-error" class="error" role="alert"></p><table id="probs"><tbody></tbody></table>')
    else:
        form = (f'<div id="conversation"></div><form id="try-chat" data-url="/runs/{quote(name)}/chat">{hidden}'
                f'<textarea name="message" id="try-text" rows="3" cols="80" maxlength="4000" required></textarea>'
                f'<p><label>max tokens <input name="max_tokens" type="number" min="1" max="{max_tokens}" value="128">'
                f'</label> <button type="submit">Send</button></p></form>'
                f'<p id="try-error" class="error" role="alert"></p>')
    note = ("<p>One try at a time; while a studio job is training, the device is its and trying is refused.</p>")
    return layout(f"Try {name}", head + form + note)
