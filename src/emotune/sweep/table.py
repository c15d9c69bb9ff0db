"""A sweep's results table: one row per trial (grid, random, tpe) or per variant (ablation, mean ± sd over seeds).

Everything is read from the trials' run folders: the after-training metrics of the headline method and their
95 % intervals from comparison.json (shown as "—" where the comparison has none), the time from run.json's
stage timings, the peak memory from the training log. The table is written as text for the terminal, CSV
and Markdown; the best trial is the first row.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from emotune.core import terminal
from emotune.core.rundir import RunDir, atomic_file, read_json, write_text
from emotune.core.spreadsheet import spreadsheet_cell
from emotune.report.table import markdown_cell
from emotune.sweep.space import Trial
from emotune.tasks import task_named

LOWER_IS_BETTER = {"invalid", "log_loss", "ece", "perplexity", "loss"}
TITLES = {"macro_f1": "macro-F1", "accuracy": "accuracy", "weighted_f1": "weighted-F1", "top2_accuracy": "top-2 acc.",
          "log_loss": "log-loss", "ece": "ECE", "rouge_l": "ROUGE-L", "perplexity": "perplexity"}
DASH = "—"


def direction_of(metric: str, direction: str = "auto") -> str:
    if direction != "auto":
        return direction
    return "minimize" if metric in LOWER_IS_BETTER else "maximize"


@dataclass
class Result:
    """What one trial's run folder says about it."""

    status: str  # finished, failed, interrupted, running, pending
    after: dict[str, float] = field(default_factory=dict)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: float | None = None
    peak_memory_mb: float | None = None


def read_result(run_dir: str | Path, status: str = "pending") -> Result:
    """The trial's after-training metrics, intervals, time and peak memory; `status` when it is not finished."""
    run = RunDir(run_dir)
    info = read_json(run.run_json) or {}
    seconds = sum(s.get("seconds", 0) for s in info.get("stages", {}).values()) if info.get("stages") else None
    if not run.is_finished():
        return Result(status, seconds=seconds)
    comparison = read_json(run.comparison_json) or {}
    after = {name: row["after"] for name, row in comparison.get("metrics", {}).items() if isinstance(row, dict)}
    return Result("finished", after, _intervals(comparison), round(seconds, 1) if seconds is not None else None,
                  _peak_memory(run))


def _intervals(comparison: dict) -> dict[str, tuple[float, float]]:
    """`intervals: {metric: {after: [lo, hi]}}` of the headline method (at the top level or under its method)."""
    headline = (comparison.get("method") or {}).get("after")
    found = {**((comparison.get("methods") or {}).get(headline) or {}).get("intervals", {}),
             **(comparison.get("intervals") or {})}
    out = {}
    for name, entry in found.items():
        after = entry.get("after") if isinstance(entry, dict) else None
        if isinstance(after, (list, tuple)) and len(after) == 2 and all(isinstance(x, (int, float)) for x in after):
            out[name] = (float(after[0]), float(after[1]))
    return out


def _peak_memory(run: RunDir) -> float | None:
    peaks = [e["peak_memory_mb"] for e in run.history() if "peak_memory_mb" in e]
    return max(peaks) if peaks else None


# --------------------------------------------------------------------------------------------------
# Rows


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]  # shown text
    records: list[dict]  # the same rows as numbers, for the CSV
    best: list[Trial]  # the trials of the best row (one, or one per seed)


def _sort_key(value: float | None, direction: str) -> tuple:
    if value is None:
        return (1, 0.0)
    return (0, -value if direction == "maximize" else value)


def _fmt(value: float | None) -> str:
    return DASH if value is None else f"{value:.3f}"


def _ci(interval: tuple[float, float] | None) -> str:
    return DASH if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def _shown(metric: str, task: str) -> list[str]:
    return list(dict.fromkeys([metric, *task_named(task).SWEEP_COLUMNS]))


def trial_table(trials: list[Trial], results: dict[str, Result], keys: list[str], metric: str, direction: str,
                task: str) -> Table:
    """One row per trial (grid and searches), best first by `metric`."""
    shown = _shown(metric, task)
    order = sorted(trials, key=lambda t: _sort_key(results[t.name].after.get(metric), direction))
    headers = ["trial", *keys, *(h for m in shown for h in (TITLES.get(m, m), "95% CI")), "time (s)", "peak MB", "status"]
    rows, records = [], []
    for trial in order:
        result, params = results[trial.name], dict(trial.params)
        rows.append([trial.name, *(_short(params.get(k, DASH)) for k in keys),
                     *(c for m in shown for c in (_fmt(result.after.get(m)), _ci(result.intervals.get(m)))),
                     _fmt_number(result.seconds, 1), _fmt_number(result.peak_memory_mb, 0), result.status])
        record = {"trial": trial.name, **{k: params.get(k, "") for k in keys}, "seed": trial.seed, "status": result.status,
                  "seconds": result.seconds, "peak_memory_mb": result.peak_memory_mb}
        for m in shown:
            low, high = result.intervals.get(m, (None, None))
            record.update({m: result.after.get(m), f"{m}_low": low, f"{m}_high": high})
        records.append(record)
    best = [order[0]] if order and results[order[0].name].after.get(metric) is not None else []
    return Table(_title(len(trials), metric, direction), headers, rows, records, best)


def ablation_table(trials: list[Trial], results: dict[str, Result], metric: str, direction: str, task: str) -> Table:
    """One row per variant (the base, and each value of each key), mean ± sd over its seeds, best first; Δ is the
    difference of the mean `metric` from the base's."""
    shown = _shown(metric, task)
    groups: dict[tuple, list[Trial]] = {}
    for trial in trials:
        groups.setdefault(trial.variant, []).append(trial)
    summary = {variant: _summarise(members, results, shown) for variant, members in groups.items()}
    base = summary.get(())
    order = sorted(groups, key=lambda v: _sort_key(summary[v]["mean"].get(metric), direction))
    headers = ["factor", "value", *(h for m in shown for h in (TITLES.get(m, m), "95% CI")),
               f"Δ {TITLES.get(metric, metric)} vs base", "seeds done", "time (s)", "peak MB"]
    rows, records = [], []
    for variant in order:
        one, first = summary[variant], groups[variant][0]
        mean = one["mean"].get(metric)
        delta = mean - base["mean"][metric] if base and mean is not None and metric in base["mean"] else None
        factor, value = first.extra.get("factor") or DASH, first.extra.get("value", "base")
        rows.append([factor, value, *(c for m in shown for c in (_mean_sd(one, m), _ci(one["interval"].get(m)))),
                     DASH if delta is None else f"{delta:+.3f}", f"{one['done']}/{len(groups[variant])}",
                     _fmt_number(one["seconds"], 1), _fmt_number(one["peak"], 0)])
        record = {"factor": first.extra.get("factor", ""), "value": value, "seeds": len(groups[variant]),
                  "seeds_done": one["done"], f"delta_{metric}": delta, "seconds_mean": one["seconds"],
                  "peak_memory_mb": one["peak"]}
        for m in shown:
            low, high = one["interval"].get(m, (None, None))
            record.update({f"{m}_mean": one["mean"].get(m), f"{m}_sd": one["sd"].get(m), f"{m}_low": low, f"{m}_high": high})
        records.append(record)
    best = groups[order[0]] if order and summary[order[0]]["mean"].get(metric) is not None else []
    return Table(_title(len(trials), metric, direction, variants=len(groups)), headers, rows, records, best)


def _summarise(members: list[Trial], results: dict[str, Result], shown: list[str]) -> dict:
    done = [results[t.name] for t in members if results[t.name].status == "finished"]
    values = {m: [r.after[m] for r in done if m in r.after] for m in shown}
    seconds = [r.seconds for r in done if r.seconds is not None]
    peaks = [r.peak_memory_mb for r in done if r.peak_memory_mb is not None]
    return {"done": len(done),
            "mean": {m: statistics.fmean(v) for m, v in values.items() if v},
            "sd": {m: statistics.stdev(v) for m, v in values.items() if len(v) > 1},
            # a trial's bootstrap interval describes that one run; over several seeds the spread is the sd
            "interval": done[0].intervals if len(members) == 1 and done else {},
            "seconds": statistics.fmean(seconds) if seconds else None, "peak": max(peaks) if peaks else None}


def _mean_sd(summary: dict, metric: str) -> str:
    mean, sd = summary["mean"].get(metric), summary["sd"].get(metric)
    return _fmt(mean) if sd is None else f"{mean:.3f} ± {sd:.3f}"


def _short(text: str) -> str:
    """A drawn number as the table shows it (0.000123456789 → 0.0001235); the CSV keeps every digit."""
    if len(text) <= 8:
        return text
    try:
        return f"{float(text):.4g}"
    except ValueError:
        return text


def _fmt_number(value: float | None, digits: int) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _title(trials: int, metric: str, direction: str, variants: int | None = None) -> str:
    better = "higher" if direction == "maximize" else "lower"
    what = f"{variants} variants ({trials} trials, mean ± sd over seeds)" if variants is not None else f"{trials} trials"
    return f"{what}, best first by {TITLES.get(metric, metric)} after training ({better} is better)"


# --------------------------------------------------------------------------------------------------
# Writing


def format_text(table: Table) -> str:
    widths = [max(terminal.width(str(cell)) for cell in column) for column in zip(table.headers, *table.rows, strict=False)]
    line = lambda cells: "  ".join(terminal.ljust(str(c), w) for c, w in zip(cells, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([table.title, line(table.headers), "  ".join("-" * w for w in widths), *map(line, table.rows)])


def format_markdown(table: Table) -> str:
    lines = [f"**{table.title}**", "", "| " + " | ".join(map(markdown_cell, table.headers)) + " |",
             "|" + "|".join("---" for _ in table.headers) + "|"]
    lines += ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def write_csv(table: Table, path: Path) -> None:
    columns = list(dict.fromkeys(key for record in table.records for key in record))
    with atomic_file(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: "" if v is None else spreadsheet_cell(v) for k, v in record.items()} for record in table.records)


def write_tables(folder: Path, tables: list[tuple[str, Table]]) -> None:
    """Each table as `<name>.csv`, and all of them in table.md."""
    for name, table in tables:
        write_csv(table, folder / f"{name}.csv")
    write_text(folder / "table.md", "\n".join(f"## {name}\n\n{format_markdown(table)}" for name, table in tables))
