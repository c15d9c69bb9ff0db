"""Before/after comparison: comparison.json, comparison.csv and the table printed at the end of a run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

# Lower is better for these; everything else compared is higher-is-better.
LOWER_IS_BETTER = {"invalid"}


def compare(before: dict, after: dict, labels: list[str]) -> dict:
    """{"metrics": {name: {"before", "after", "delta"}}} over headline and per-class metrics."""
    metrics: dict[str, dict[str, float]] = {}
    for name in ("accuracy", "macro_f1", "weighted_f1", "invalid"):
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
    }


def _row(before: float, after: float) -> dict[str, float]:
    return {"before": before, "after": after, "delta": round(after - before, 6)}


def write_comparison(comparison: dict, run_dir: Path) -> None:
    tmp = run_dir / "comparison.json.tmp"
    tmp.write_text(json.dumps(comparison, indent=2, ensure_ascii=False))
    csv_tmp = run_dir / "comparison.csv.tmp"
    with csv_tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["metric", "before", "after", "delta"])
        for name, row in comparison["metrics"].items():
            writer.writerow([name, row["before"], row["after"], row["delta"]])
    csv_tmp.replace(run_dir / "comparison.csv")
    tmp.replace(run_dir / "comparison.json")


def format_table(comparison: dict, labels: list[str]) -> str:
    """The terminal table: headline metrics, then per-class F1."""
    rows = [("accuracy", "accuracy"), ("macro-F1", "macro_f1"), ("weighted-F1", "weighted_f1"), ("invalid", "invalid")]
    rows += [(f"F1 {label}", f"{label}/f1") for label in labels]
    width = max(len(title) for title, _ in rows) + 2
    lines = [f"{'metric':<{width}}{'before':>10}{'after':>10}{'delta':>10}", "-" * (width + 30)]
    for title, key in rows:
        row = comparison["metrics"].get(key)
        if row is None:
            continue
        if key == "invalid":
            lines.append(f"{title:<{width}}{row['before']:>10d}{row['after']:>10d}{row['delta']:>+10d}")
        else:
            lines.append(f"{title:<{width}}{row['before']:>10.3f}{row['after']:>10.3f}{row['delta']:>+10.3f}")
    return "\n".join(lines)
