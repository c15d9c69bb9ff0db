"""sft's comparison and report sections: the before/after metric table (with a paired bootstrap interval
for the per-row scores), scores per kind, sample rows side by side, the rows that got worse, and the
forgetting probe with its interval and flag (emotune.report.page builds the page around them)."""

from __future__ import annotations

import html
from pathlib import Path

from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, write_json
from emotune.eval import stats
from emotune.tasks.sft import eval as sft_eval

MAX_LISTED_ROWS = 30
TITLES = {"rouge_l": "ROUGE-L", "bleu": "BLEU (corpus)", "sentence_bleu": "BLEU (mean per row)",
          "exact_match": "exact match", "perplexity": "response perplexity", "loss": "response loss",
          "probe_accuracy": "probe accuracy (forgetting check)"}
LOWER_IS_BETTER = {"perplexity", "loss"}
ROW_SCORES = ("rouge_l", "bleu", "exact_match")  # per-row scores in predictions.csv
# the metric each per-row score averages to: predictions.csv's `bleu` is the row's sentence BLEU, whose mean is
# metrics.json's `sentence_bleu` (its `bleu` is corpus BLEU, which no per-row interval describes)
ROW_SCORE_METRIC = {"rouge_l": "rouge_l", "bleu": "sentence_bleu", "exact_match": "exact_match"}


def _row(before: float, after: float) -> dict[str, float]:
    return {"before": before, "after": after, "delta": round(after - before, 6)}


def compare(before: dict, after: dict, data=None) -> dict:
    """{"metrics": {name: {before, after, delta}}, "intervals", "per_kind", "probe"} (comparison.json)."""
    b, a = before["metrics"], after["metrics"]
    _same_rows(before["rows"], after["rows"])
    metrics = {name: _row(b[name], a[name]) for name in TITLES if name in b and name in a}
    intervals = {}
    if before["rows"]:
        for score in ROW_SCORES:
            intervals[ROW_SCORE_METRIC[score]] = stats.paired_bootstrap_delta([float(r[score]) for r in before["rows"]],
                                                                  [float(r[score]) for r in after["rows"]])
    per_kind = {kind: {score: _row(one[score], a["per_kind"][kind][score]) for score in ("rouge_l", "bleu", "exact_match")}
                for kind, one in b.get("per_kind", {}).items() if kind in a.get("per_kind", {})}
    comparison = {"task": "sft", "rows": a.get("rows"), "metrics": metrics, "intervals": intervals, "per_kind": per_kind}
    if before.get("probe") and after.get("probe"):
        comparison["probe"] = _compare_probe(before["probe"], after["probe"])
    return comparison


def _same_rows(before: list[dict], after: list[dict]) -> None:
    """Refuse two measurements of other rows: their scores were compared, and paired row by row, as if the same."""
    key = ("prompt", "reference")
    if [tuple(r.get(k) for k in key) for r in before] != [tuple(r.get(k) for k in key) for r in after]:
        raise UserError(f"The baseline and fine-tuned predictions.csv hold different rows ({len(before)} and {len(after)} "
                        "rows, or other prompts and references), so they cannot be compared row by row. Measure both "
                        "on the same data: delete the run's finetuned/ folder and re-run `emotune run` with the same "
                        "config.")


def _compare_probe(before: dict, after: dict) -> dict:
    from dataclasses import fields

    from emotune.eval.probe import ProbeResult, compare_probe

    names = {f.name for f in fields(ProbeResult)}
    return compare_probe(ProbeResult(**{k: v for k, v in before.items() if k in names}),
                         ProbeResult(**{k: v for k, v in after.items() if k in names}))


def measurements(stage: Path, info: dict) -> list[dict]:
    """What `emotune compare` reads of a finished stage: its one measurement, the kinds of instruction as labels."""
    result = sft_eval.read_result(stage)
    if result is None:
        return []
    metrics = result["metrics"]
    seconds = metrics.get("seconds")
    return [{"method": info.get("task", "sft"), "labels": sorted(metrics.get("per_kind", {})), "metrics": metrics,
             "rows": result["rows"], "rows_per_s": round(metrics["rows"] / seconds, 2) if seconds and metrics.get("rows") else None}]


def write_comparison(comparison: dict, run: RunDir) -> None:
    write_json(run.comparison_json, comparison)


def format_comparison(comparison: dict, data=None, cfg=None) -> str:
    lines = [f"\nBefore/after on {comparison.get('rows')} test rows:", f"{'metric':<36}{'before':>10}{'after':>10}{'delta':>10}",
             "-" * 66]
    for name, row in comparison["metrics"].items():
        lines.append(f"{TITLES.get(name, name):<36}{row['before']:>10.3f}{row['after']:>10.3f}{row['delta']:>+10.3f}")
    probe = comparison.get("probe")
    if probe and probe.get("flagged"):
        lines.append("The forgetting probe dropped: its 95% interval excludes zero (see report.html).")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Report sections


def report_sections(run: RunDir, info: dict) -> list[str]:
    from emotune.core.rundir import read_json

    before, after = sft_eval.read_result(run.baseline), sft_eval.read_result(run.finetuned)
    comparison = read_json(run.comparison_json) or (compare(before, after) if before and after else None)
    sections = [_metrics_section(before, after, comparison)]
    if before and after:
        sections += [_kinds_section(comparison), _samples_section(before["rows"], after["rows"], info.get("sample_rows", 12)),
                     _worse_section(before["rows"], after["rows"])]
    sections.append(_probe_section(comparison, before))
    return sections


def _fmt(value) -> str:
    return "—" if value is None else f"{value:+.3f}" if isinstance(value, float) and value < 0 else f"{value:.3f}"


def _metrics_section(before: dict | None, after: dict | None, comparison: dict | None) -> str:
    if before is None:
        return "<section id=sft-metrics><h2>Measurement</h2><p>No baseline measurement in this run folder.</p></section>"
    body = []
    for name, title in TITLES.items():
        if name not in before["metrics"]:
            continue
        row = (comparison or {}).get("metrics", {}).get(name)
        cells = f"<td class=num>{before['metrics'][name]:.3f}</td>"
        if row:
            better = row["delta"] < 0 if name in LOWER_IS_BETTER else row["delta"] > 0
            tone = "good" if better else ("bad" if row["delta"] else "")
            # only a mean of per-row scores has one (an older comparison.json put sentence BLEU's under `bleu`)
            interval = (comparison.get("intervals") or {}).get(name) if name in ROW_SCORE_METRIC.values() else None
            ci = f"[{interval['low']:+.3f}, {interval['high']:+.3f}]" if interval else ""
            cells += f"<td class=num>{row['after']:.3f}</td><td class='num {tone}'>{row['delta']:+.3f}</td><td class=num>{ci}</td>"
        body.append(f"<tr><th>{html.escape(title)}</th>{cells}</tr>")
    head = "<th>before</th><th>after</th><th>Δ</th><th>95% interval of Δ (paired bootstrap)</th>" if after else "<th>baseline</th>"
    rows = before["metrics"].get("rows")
    return (f"<section id=sft-metrics><h2>Before / after</h2><table class=before-after><caption>{rows} test rows, greedy "
            f"decoding, at most {before['metrics'].get('max_new_tokens')} new tokens</caption><tr><th>metric</th>{head}</tr>"
            f"{''.join(body)}</table></section>")


def _kinds_section(comparison: dict) -> str:
    kinds = comparison.get("per_kind") or {}
    if not kinds:
        return ""
    body = "".join(f"<tr><th>{html.escape(kind)}</th>" + "".join(
        f"<td class=num>{s['before']:.3f}</td><td class=num>{s['after']:.3f}</td><td class=num>{s['delta']:+.3f}</td>"
        for s in (scores["rouge_l"], scores["bleu"], scores["exact_match"])) + "</tr>" for kind, scores in kinds.items())
    head = "".join(f"<th colspan=3>{t}</th>" for t in ("ROUGE-L", TITLES["sentence_bleu"], "exact match"))  # per kind: no corpus BLEU
    return (f"<section id=sft-kinds><h2>Per kind of instruction</h2><table><tr><th>kind</th>{head}</tr>"
            f"<tr><th></th>{'<th>before</th><th>after</th><th>Δ</th>' * 3}</tr>{body}</table></section>")


def _pairs_table(pairs: list[tuple[dict, dict]]) -> str:
    rows = "".join(f"<tr><td>{html.escape(b['prompt'])}</td><td>{html.escape(b['reference'])}</td>"
                   f"<td>{html.escape(b['output'])}</td><td>{html.escape(a['output'])}</td>"
                   f"<td class=num>{float(b['rouge_l']):.2f} → {float(a['rouge_l']):.2f}</td></tr>" for b, a in pairs)
    return ("<table class=rows><tr><th>prompt</th><th>reference</th><th>before</th><th>after</th><th>ROUGE-L</th></tr>"
            f"{rows}</table>")


def _samples_section(before: list[dict], after: list[dict], count: int) -> str:
    pairs = list(zip(before, after, strict=False))
    step = max(1, len(pairs) // max(count, 1))
    shown = pairs[::step][:count]
    return f"<section id=sft-samples><h2>Sample rows</h2>{_pairs_table(shown)}</section>" if shown else ""


def _worse_section(before: list[dict], after: list[dict]) -> str:
    worse = sorted(((b, a) for b, a in zip(before, after, strict=False) if float(a["rouge_l"]) < float(b["rouge_l"])),
                   key=lambda p: float(p[1]["rouge_l"]) - float(p[0]["rouge_l"]))
    more = f"<p>… and {len(worse) - MAX_LISTED_ROWS} more (predictions.csv).</p>" if len(worse) > MAX_LISTED_ROWS else ""
    table = _pairs_table(worse[:MAX_LISTED_ROWS]) if worse else ""
    return f"<section id=sft-worse><h2>Rows that got worse (lower ROUGE-L): {len(worse)}</h2>{table}{more}</section>"


def _probe_section(comparison: dict | None, before: dict | None) -> str:
    probe = (comparison or {}).get("probe")
    if probe is None:
        measured = before and before.get("probe")
        text = (f"Baseline accuracy {measured['accuracy']:.3f}; no fine-tuned measurement yet." if measured
                else "The forgetting probe was not run (eval.probe=false).")
        return f"<section id=sft-probe><h2>Forgetting check</h2><p>{html.escape(text)}</p></section>"
    facts = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v) if isinstance(v, float) else str(v))}</td></tr>"
                    for k, v in probe.items() if not isinstance(v, (dict, list)))
    verdict = ("<p class=bad><b>Flagged:</b> the probe's accuracy dropped and the 95% interval of the change excludes "
               "zero: the fine-tune likely cost general ability.</p>" if probe.get("flagged") else
               "<p>No significant drop: the 95% interval of the change includes zero (or the change is positive).</p>")
    return f"<section id=sft-probe><h2>Forgetting check (general-ability probe)</h2>{verdict}<table class=facts>{facts}</table></section>"
