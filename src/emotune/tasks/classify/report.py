"""Generative classification's comparison and report sections: before/after tables with 95 % intervals and the
paired test, confusion matrices, per-class F1, rows that changed, invalid outputs (emotune.report.page builds the page
around them)."""

from __future__ import annotations

import csv
import html
from pathlib import Path

import numpy as np

from emotune.core import terminal
from emotune.core.errors import UserError
from emotune.core.figures import embed_figure, short_labels
from emotune.core.rundir import RunDir, atomic_file, read_json, write_json
from emotune.core.spreadsheet import spreadsheet_row
from emotune.eval.evaluate import EvalResult
from emotune.eval.stats import RESAMPLES, VERDICT_NOTES, classification_intervals, format_interval, paired_comparison

MAX_LISTED_ROWS = 30
NUMBERED_CELLS_UP_TO = 15  # labels up to which the confusion matrix writes each cell's share in it

TITLES = {"accuracy": "accuracy", "macro_f1": "macro-F1", "weighted_f1": "weighted-F1", "invalid": "invalid",
          "top2_accuracy": "top-2 accuracy", "log_loss": "log-loss", "ece": "calibration error (ECE)"}
# Lower is better for these; everything else compared is higher-is-better.
LOWER_IS_BETTER = {"invalid", "log_loss", "ece"}
HEADLINE = ("accuracy", "macro_f1", "weighted_f1", "invalid", "top2_accuracy", "log_loss", "ece")


def compare(before: dict, after: dict, labels: list[str]) -> dict:
    """{"metrics": {name: {"before", "after", "delta"}}} over headline and per-class metrics."""
    metrics: dict[str, dict[str, float]] = {}
    for name in HEADLINE:
        if name in before and name in after:
            metrics[name] = _row(before[name], after[name])
    for label in labels:
        for score in ("precision", "recall", "f1"):
            b = before["per_class"][label][score]
            a = after["per_class"][label][score]
            metrics[f"{label}/{score}"] = _row(b, a)
    return {
        "method": {"before": before.get("method"), "after": after.get("method")},
        "rows": after.get("rows"),
        "metrics": metrics,
        "never_predicted": {"before": never_predicted(before, labels), "after": never_predicted(after, labels)},
    }


def never_predicted(metrics: dict, labels: list[str]) -> list[str]:
    """Labels that occur in the split but that the model never answered (from the confusion matrix's columns)."""
    confusion = metrics.get("confusion_matrix")
    if not confusion:
        return []
    predicted = dict(zip(confusion["labels"], np.asarray(confusion["matrix"]).sum(axis=0).tolist(), strict=False))
    return [label for label in labels
            if predicted.get(label, 0) == 0 and metrics["per_class"][label].get("support", 0) > 0]


def compare_methods(before: dict[str, EvalResult], after: dict[str, EvalResult], labels: list[str]) -> dict:
    """The first method's comparison at the top level (the headline), every method's under "methods", and the
    chance levels of the measured split under "chance" (the same split for every method).

    Each method's comparison also holds `intervals` (95 % bootstrap intervals of accuracy and macro-F1 before and
    after, and of their change) and `paired` (the exact McNemar test and the verdict), from the predictions."""
    methods = {m: {**compare(before[m].metrics, after[m].metrics, labels), **uncertainty(before[m].rows, after[m].rows, labels)}
               for m in before if m in after}
    first = next(iter(before.values())).metrics
    return {**next(iter(methods.values())), "methods": methods, "chance": chance_levels(_support(first, labels))}


def uncertainty(before_rows: list[dict], after_rows: list[dict], labels: list[str]) -> dict:
    """{"intervals", "paired"} (emotune.eval.stats.paired_comparison) of two measurements of the same rows, in order."""
    if [(r["text"], r["gold"]) for r in before_rows] != [(r["text"], r["gold"]) for r in after_rows]:
        raise UserError("The baseline and fine-tuned predictions.csv hold different rows, so they cannot be compared "
                        "row by row. Measure both on the same data: delete the run's finetuned/ folder and re-run "
                        "`emotune run` with the same config.")
    if not before_rows:
        return {}
    return paired_comparison([r["gold"] for r in before_rows], [r["predicted"] for r in before_rows],
                             [r["predicted"] for r in after_rows], labels)


# --------------------------------------------------------------------------------------------------
# Chance levels: what guessing without reading the text scores on the measured split


def chance_levels(support: dict[str, int]) -> dict:
    """Accuracy and macro-F1 of three guessers that ignore the text, from the split's label counts alone.

    With N rows, K labels and p_k = n_k / N the share of label k:
    - uniform: every label with probability 1/K. Accuracy 1/K.
    - majority: always the most frequent label m (the first of equals in label order). Accuracy p_m; only m
      has an F1, 2 p_m / (1 + p_m) (precision p_m, recall 1), so macro-F1 = 2 p_m / (1 + p_m) / K. Exact.
    - stratified: label k with probability p_k, the split's own proportions. Accuracy sum_k p_k^2.
    Accuracy of a random guesser is its exact expectation, sum_k p_k q_k for guess shares q_k. Its F1 is
    taken from the expected confusion matrix (true positives of k: N p_k q_k; predicted k: N q_k), so
    class k has precision p_k and recall q_k, F1_k = 2 p_k q_k / (p_k + q_k): what a large split converges
    to (F1 is a ratio, so the exact expectation over N rows differs by O(1/N)). Uniform: F1_k =
    2 p_k / (K p_k + 1); stratified: F1_k = p_k, so macro-F1 = 1/K. Macro-F1 averages the labels the split holds
    or the guesser guesses, as compute_metrics does; a label absent from the split scores 0 only when guessed.
    """
    rows, k = sum(support.values()), len(support)
    share = {label: n / rows if rows else 0.0 for label, n in support.items()}

    def guesser(guess: dict[str, float]) -> dict[str, float]:
        f1 = [2 * share[lb] * guess[lb] / (share[lb] + guess[lb]) if share[lb] + guess[lb] else 0.0 for lb in support]
        scored = max(sum(share[lb] + guess[lb] > 0 for lb in support), 1)
        return {"accuracy": round(sum(share[lb] * guess[lb] for lb in support), 6), "macro_f1": round(sum(f1) / scored, 6)}

    majority = max(support, key=support.get)
    return {"rows": rows,
            "uniform": guesser({label: 1 / k for label in support}),
            "majority": {"label": majority, **guesser({label: float(label == majority) for label in support})},
            "stratified": guesser(share)}


def _support(metrics: dict, labels: list[str]) -> dict[str, int]:
    return {label: int(metrics["per_class"][label]["support"]) for label in labels}


CHANCE_NOTE = ("Chance levels: what guessing without reading the text scores on this split — uniform (every label "
               "equally often), majority (always {majority}), stratified (labels in the split's own proportions); "
               "a model knows something about the task only where it beats all three.")
PRETRAINED_NOTE = ("The generate baseline has {invalid} of {rows} invalid answers: a pretrained (not instruction-tuned) "
                   "base model continues the prompt instead of answering it, so no label name is found in its reply, "
                   "while the score method reads the probability of each label directly and so measures what the base "
                   "model knows{hint}.")


def baseline_notes(baseline: dict[str, dict], chance: dict) -> list[str]:
    """The sentences under the before/after tables: what the chance levels are and, when the generate baseline is
    mostly invalid, why (and where to look instead). `baseline`: {method: metrics before training}."""
    notes = [CHANCE_NOTE.format(majority=chance["majority"]["label"])]
    generate = baseline.get("generate")
    if generate and generate["rows"] and generate["invalid"] >= generate["rows"] / 2:
        hint = "" if "score" in baseline else " (set eval.method=both to measure it)"
        notes.append(PRETRAINED_NOTE.format(invalid=generate["invalid"], rows=generate["rows"], hint=hint))
    return notes


def beats_chance(value: float, metric: str, chance: dict) -> bool:
    return value > max(chance[guess][metric] for guess in CHANCE_GUESSES)


CHANCE_GUESSES = ("uniform", "majority", "stratified")
CHANCE_METRICS = ("accuracy", "macro_f1")


def _row(before: float, after: float) -> dict[str, float]:
    return {"before": before, "after": after, "delta": round(after - before, 6)}


def write_comparison(comparison: dict, run: RunDir) -> None:
    """comparison.csv (a label that looks like a formula written as text: emotune.core.spreadsheet), then comparison.json
    (its presence marks the comparison as written)."""
    with atomic_file(run.comparison_csv) as tmp, tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["metric", "before", "after", "delta", "method"])
        for method, one in comparison.get("methods", {comparison["method"]["after"]: comparison}).items():
            for name, row in one["metrics"].items():
                writer.writerow(spreadsheet_row([name, row["before"], row["after"], row["delta"], method]))
    write_json(run.comparison_json, comparison)


def format_table(comparison: dict, labels: list[str], chance: dict | None = None) -> str:
    """The terminal table: headline metrics, then per-class F1; with `chance`, the split's chance levels beside
    accuracy and macro-F1, and whether the model beats them before and after."""
    rows = ([(TITLES[key], key) for key in HEADLINE] + [(f"F1 {label}", f"{label}/f1") for label in labels]
            + [(f"recall {label}", f"{label}/recall") for label in labels])
    width = max(terminal.width(title) for title, _ in rows) + 2
    guesses = CHANCE_GUESSES if chance else ()
    lines = [f"{'metric':<{width}}{'before':>10}{'after':>10}{'delta':>10}" + "".join(f"{g:>12}" for g in guesses),
             "-" * (width + 30 + 12 * len(guesses))]
    for title, key in rows:
        row = comparison["metrics"].get(key)
        if row is None:
            continue
        if key == "invalid":
            lines.append(f"{terminal.ljust(title, width)}{row['before']:>10d}{row['after']:>10d}{row['delta']:>+10d}")
            continue
        levels = "".join(f"{chance[g][key]:>12.3f}" for g in guesses) if key in CHANCE_METRICS else ""
        lines.append(f"{terminal.ljust(title, width)}{row['before']:>10.3f}{row['after']:>10.3f}{row['delta']:>+10.3f}{levels}")
    if chance:
        verdicts = [f"{stage}: " + ", ".join(
            f"{TITLES[m]} {'yes' if beats_chance(comparison['metrics'][m][stage], m, chance) else 'no'}"
            for m in CHANCE_METRICS if m in comparison["metrics"]) for stage in ("before", "after")]
        lines.append("above every chance level? " + " · ".join(verdicts))
    missing = comparison.get("never_predicted", {}).get("after")
    if missing:
        lines.append(f"Warning: after training the model never predicted {', '.join(missing)}, though the split has "
                     "rows of it; if the training data is imbalanced, data.balance=class_weight weights the loss toward "
                     "small classes.")
    if comparison.get("intervals"):  # absent from comparisons written before intervals existed
        lines += ["", *format_uncertainty(comparison, width)]
    return "\n".join(lines)


def format_uncertainty(comparison: dict, width: int) -> list[str]:
    """The 95 % intervals of accuracy and macro-F1 and the paired test's verdict, as terminal lines."""
    lines = [f"{'95% interval':<{width}}{'before':>17}{'after':>17}   delta (paired)"]
    for key in CHANCE_METRICS:
        one = comparison["intervals"][key]
        delta = one["delta"]
        lines.append(f"{TITLES[key]:<{width}}{format_interval(one['before']):>17}{format_interval(one['after']):>17}   "
                     f"{delta['delta']:+.3f} {format_interval([delta['low'], delta['high']], signed=True)}")
    lines.append(paired_sentence(comparison["paired"]))
    return lines


def paired_sentence(paired: dict) -> str:
    test = paired["mcnemar"]
    return (f"paired test on the same rows: {test['c']} wrong → right, {test['b']} right → wrong, exact McNemar "
            f"p = {test['p_value']:.3g}.\nVerdict: {paired['verdict']} — {VERDICT_NOTES[paired['verdict']]}.")


def report_sections(run: RunDir, info: dict) -> list[str]:
    """One section per evaluation method: before/after table, figures, changed and invalid rows."""
    baseline, finetuned = read_stage(run.baseline), read_stage(run.finetuned)
    # run.json's label list; a run.json edited without one falls back on the measurement's own (as `measurements`)
    labels = info.get("labels") or list(next(iter(baseline.values()))["metrics"]["per_class"])
    chance = chance_levels(_support(next(iter(baseline.values()))["metrics"], labels))
    notes = baseline_notes({m: stage["metrics"] for m, stage in baseline.items()}, chance)
    intro = "<section id=chance>" + "".join(f"<p>{html.escape(note)}</p>" for note in notes) + "</section>"
    return [intro, *(_method_section(method, before, finetuned.get(method), labels, run.figures, chance)
                     for method, before in baseline.items())]


def measurements(stage: Path, info: dict) -> list[dict]:
    """What `emotune compare` reads of a finished stage: one measurement per method, with the run's label set. A
    method whose metrics.json is damaged is refused by name: read as none, a two-method run was compared on its other
    method without a word."""
    damaged = [path for path in _stage_folders(stage) if (path / "predictions.csv").is_file()
               and (path / "metrics.json").is_file() and read_json(path / "metrics.json") is None]
    if damaged:
        raise UserError(f"`{damaged[0] / 'metrics.json'}` cannot be read (cut short, or edited into something else), so "
                        "that method's measurement would be left out of the comparison. Restore the file, or measure "
                        "again: `emotune run` with the run's config and overwrite=true.")
    return [{"method": method, "labels": list(info.get("labels") or found["metrics"]["per_class"]), "metrics": found["metrics"],
             "rows": found["rows"], "rows_per_s": found["metrics"].get("rows_per_s")} for method, found in read_stage(stage).items()]


def read_stage(folder: Path) -> dict[str, dict]:
    """{method: {"metrics", "rows"}} for the stage folder and its per-method subfolders."""
    found = {}
    for candidate in _stage_folders(folder):
        metrics_path, rows_path = candidate / "metrics.json", candidate / "predictions.csv"
        # a metrics.json cut short or edited into something else is no measurement (read_json: None)
        metrics = read_json(metrics_path) if rows_path.is_file() else None
        if metrics is not None:
            with rows_path.open(encoding="utf-8", newline="") as handle:
                found[metrics.get("method", "generate")] = {"metrics": metrics, "rows": list(csv.DictReader(handle))}
    return found


def _stage_folders(folder: Path) -> list[Path]:
    """The stage folder (the headline method's measurement) and its per-method subfolders."""
    return [folder, *sorted(p for p in folder.glob("*") if p.is_dir())] if folder.is_dir() else []


def _method_section(method: str, before: dict, after: dict | None, labels: list[str], figures_dir: Path,
                    chance: dict) -> str:
    title = {"generate": "generate — greedy decoding + regex (the reference method)",
             "score": "score — exact label probabilities (never invalid)"}.get(method, method)
    parts = [f"<section id='method-{method}'><h2>Method: {html.escape(title)}</h2>",
             _metrics_table(method, before["metrics"], after and after["metrics"], labels, chance),
             _uncertainty_table(method, before["rows"], after and after["rows"], labels)]
    pictures = [("confusion", _confusion_figure(before["metrics"], after and after["metrics"], labels, method)),
                ("per_class_f1", _f1_figure(before["metrics"], after and after["metrics"], labels, method))]
    for name, figure in pictures:
        parts.append(embed_figure(figure, figures_dir / f"{name}_{method}.png", f"{name} ({method})"))
    if after is not None:
        parts.append(_changed_rows(before["rows"], after["rows"], method))
    parts.append(_invalid_rows(before["rows"], after and after["rows"]))
    return "\n".join(parts) + "</section>"


def _metrics_table(method: str, before: dict, after: dict | None, labels: list[str], chance: dict) -> str:
    keys = [k for k in HEADLINE if k in before]
    body = []
    for key, title in [(k, TITLES[k]) for k in keys] + [(f"{label}/f1", f"F1 {label}") for label in labels]:
        b = _lookup(before, key)
        a = _lookup(after, key) if after else None
        cells = f"<td class=num>{_fmt(b)}</td>"
        if after is not None:
            delta = a - b
            better = (delta < 0) if key in LOWER_IS_BETTER else (delta > 0)
            tone = "good" if better else ("bad" if delta else "")
            cells += f"<td class=num>{_fmt(a)}</td><td class='num {tone}'>{_fmt(delta, signed=True)}</td>"
        cells += "".join(f"<td class='num chance'>{_fmt(chance[g][key])}</td>" if key in CHANCE_METRICS else "<td></td>"
                         for g in CHANCE_GUESSES)
        body.append(f"<tr><th>{html.escape(title)}</th>{cells}</tr>")
    head = "<th>before</th><th>after</th><th>Δ</th>" if after is not None else "<th>baseline</th>"
    head += (f"<th>uniform guess</th><th>majority class ({html.escape(chance['majority']['label'])})</th>"
             "<th>stratified guess</th>")
    rows = before.get("rows")
    return (f"<table class='before-after' data-method='{method}'><caption>Before/after, method <b>{method}</b>, "
            f"{rows} rows</caption><tr><th>metric</th>{head}</tr>{''.join(body)}</table>")


def _uncertainty_table(method: str, before: list[dict], after: list[dict] | None, labels: list[str]) -> str:
    """95 % intervals of accuracy and macro-F1 (and of their change, with the paired test) from the predictions."""
    if not before:
        return ""
    gold = [r["gold"] for r in before]
    if after is None:
        single = classification_intervals(gold, [r["predicted"] for r in before], labels)
        body = "".join(f"<tr><th>{TITLES[k]}</th><td class=num>{format_interval(single[k]['interval'])}</td></tr>"
                       for k in CHANCE_METRICS)
        head, verdict = "<th>baseline</th>", ""
    else:
        found = uncertainty(before, after, labels)
        body = ""
        for key in CHANCE_METRICS:
            one = found["intervals"][key]
            delta = one["delta"]
            tone = "good" if delta["low"] > 0 else ("bad" if delta["high"] < 0 else "")
            body += (f"<tr><th>{TITLES[key]}</th><td class=num>{format_interval(one['before'])}</td>"
                     f"<td class=num>{format_interval(one['after'])}</td><td class='num {tone}'>{delta['delta']:+.3f} "
                     f"{format_interval([delta['low'], delta['high']], signed=True)}</td></tr>")
        head = "<th>before</th><th>after</th><th>Δ (paired)</th>"
        paired = found["paired"]
        tone = {"better": "good", "worse": "bad"}.get(paired["verdict"], "")
        verdict = f"<p class='verdict {tone}' data-method='{method}'>{html.escape(paired_sentence(paired))}</p>"
    return (f"<table class=intervals data-method='{method}'><caption>95% intervals (percentile bootstrap, {RESAMPLES} "
            f"resamples of the rows), method <b>{method}</b></caption><tr><th>metric</th>{head}</tr>{body}</table>"
            + verdict)


def _lookup(metrics: dict, key: str) -> float:
    if "/" in key:
        label, score = key.rsplit("/", 1)  # a label may hold a slash (`anger/disgust`); a score never does
        return metrics["per_class"][label][score]
    return metrics[key]


def _fmt(value: float, signed: bool = False) -> str:
    if isinstance(value, int):  # a count; a score of exactly 2.0 (a log-loss) is still a score
        return f"{int(value):+d}" if signed else f"{int(value)}"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _confusion_figure(before: dict, after: dict | None, labels: list[str], method: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("before", before)] + ([("after", after)] if after else [])
    numbered = len(labels) <= NUMBERED_CELLS_UP_TO
    cell = 0.4 if numbered else 0.2  # inches: room for "0.00", or for one line of a 7-point tick
    side = max(4.6, cell * (len(labels) + 1) + 2.6)  # the matrix and its tick names (28 columns at most)
    fig, axes = plt.subplots(1, len(panels), figsize=((side + 0.6) * len(panels), side + 1.2), squeeze=False)
    for ax, (name, metrics) in zip(axes[0], panels, strict=False):
        names = metrics["confusion_matrix"]["labels"]
        matrix = np.array(metrics["confusion_matrix"]["matrix"], dtype=float)[:len(labels)]  # gold rows
        if not matrix[:, -1].any():  # no INVALID predictions: drop the empty column
            matrix, names = matrix[:, :-1], names[:-1]
        share = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
        ax.imshow(share, vmin=0, vmax=1, cmap="Blues")
        ticks = {} if numbered else {"fontsize": 7}
        ax.set_xticks(range(len(names)), short_labels(names), rotation=45, ha="right", **ticks)
        ax.set_yticks(range(len(labels)), short_labels(labels), **ticks)
        ax.set_xlabel("predicted")
        ax.set_ylabel("gold")
        ax.set_title(f"{name} ({method}), row-normalised")
        for (i, j), value in np.ndenumerate(share if numbered else np.empty((0, 0))):  # many labels: colour alone
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color="white" if value > 0.6 else "black")
    fig.tight_layout()
    return fig


def _f1_figure(before: dict, after: dict | None, labels: list[str], method: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 3.6))
    width = 0.4 if after else 0.6
    ax.bar(x - (width / 2 if after else 0), [before["per_class"][lb]["f1"] for lb in labels], width, label="before")
    if after:
        ax.bar(x + width / 2, [after["per_class"][lb]["f1"] for lb in labels], width, label="after")
    ax.set_xticks(x, short_labels(labels), rotation=30, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("F1")
    ax.set_title(f"Per-class F1 ({method})")
    ax.legend()
    fig.tight_layout()
    return fig


def _changed_rows(before: list[dict], after: list[dict], method: str) -> str:
    fixed = [(b, a) for b, a in zip(before, after, strict=False) if b["predicted"] != b["gold"] and a["predicted"] == a["gold"]]
    broken = [(b, a) for b, a in zip(before, after, strict=False) if b["predicted"] == b["gold"] and a["predicted"] != a["gold"]]
    parts = []
    for title, pairs in ((f"Wrong → right after fine-tuning ({method})", fixed),
                         (f"Right → wrong after fine-tuning ({method})", broken)):
        rows = "".join(f"<tr><td>{html.escape(b['text'])}</td><td>{html.escape(b['gold'])}</td>"
                       f"<td>{html.escape(b['predicted'])}</td><td>{html.escape(a['predicted'])}</td></tr>"
                       for b, a in pairs[:MAX_LISTED_ROWS])
        more = f"<p>… and {len(pairs) - MAX_LISTED_ROWS} more (predictions.csv).</p>" if len(pairs) > MAX_LISTED_ROWS else ""
        parts.append(f"<h3>{html.escape(title)}: {len(pairs)} rows</h3>" + (
            f"<table class=rows><tr><th>text</th><th>gold</th><th>before</th><th>after</th></tr>{rows}</table>{more}"
            if pairs else ""))
    return "\n".join(parts)


def _invalid_rows(before: list[dict], after: list[dict] | None) -> str:
    if not before or "raw_output" not in before[0]:
        return ""
    parts = []
    for name, rows in (("before", before), ("after", after or [])):
        invalid = [r for r in rows if r["predicted"] == "INVALID"]
        if not rows:
            continue
        listed = "".join(f"<tr><td>{html.escape(r['text'])}</td><td>{html.escape(r['gold'])}</td>"
                         f"<td><code>{html.escape(r['raw_output'])}</code></td></tr>" for r in invalid[:MAX_LISTED_ROWS])
        parts.append(f"<h3>Invalid outputs {name} fine-tuning: {len(invalid)}</h3>" + (
            f"<table class=rows><tr><th>text</th><th>gold</th><th>raw output</th></tr>{listed}</table>" if invalid else ""))
    return "\n".join(parts)
