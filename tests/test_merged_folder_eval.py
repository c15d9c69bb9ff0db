"""`emotune eval CONFIG adapter=EXPORT/merged`: a merged folder is measured under every task, as its adapter is.

Before, a merged folder reached PEFT's `from_pretrained` as if it were an adapter folder (classify, sft) and
failed inside PEFT, or was refused (classify_head)."""

from __future__ import annotations

import csv
import json

import pytest

from conftest import write_jsonl, write_tiny_adapter
from emotune.cli import main
from emotune.deploy.export import export
from test_sft import _sft_rows


def _task_overrides(task: str, overrides: list[str], tmp_path) -> list[str]:
    if task != "sft":
        return [*([f"task={task}"] if task != "classify" else []), *overrides, "eval.method=both" if task == "classify" else ""]
    sft_data = write_jsonl(tmp_path / "sft.jsonl", _sft_rows(40, seed=1))
    kept = [o for o in overrides if not o.startswith(("data.", "eval.batch_size"))]
    return ["task=sft", *kept, f"data.source={sft_data}", "eval.max_new_tokens=3", "eval.probe=false", "eval.batch_size=4"]


def _number(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def _results(folder) -> dict:
    """Every prediction file and every metric but timings, of one evaluation folder."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".csv":
            with path.open(newline="", encoding="utf-8") as handle:
                out[str(path.relative_to(folder))] = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(handle)]
        elif path.name == "metrics.json":
            metrics = json.loads(path.read_text())
            out[str(path.relative_to(folder))] = {k: v for k, v in metrics.items()
                                                  if k not in ("seconds", "rows_per_s", "merge", "batch_size")}
    return out


def _same(a, b, where: str = "") -> None:
    """Equal texts and labels; numbers within fp32 merge rounding (1e-5, the export tests' parity; the CSVs keep 6 decimals)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and not isinstance(b, str):
        assert a == pytest.approx(b, abs=1e-5), where
    else:
        assert a == b, where


@pytest.mark.slow  # three exports and six evaluations of the tiny model, about 40 s
@pytest.mark.parametrize("task", ["classify", "sft", "classify_head"])
def test_a_merged_folder_is_evaluated_like_its_adapter(task, tiny_model_dir, tiny_overrides, tmp_path, capsys):
    overrides = [o for o in _task_overrides(task, tiny_overrides, tmp_path) if o]
    run = write_tiny_adapter(tiny_model_dir, tmp_path / "runs" / task, task=task)
    export(run, out=tmp_path / "export", merge=True, dtype="float32")
    assert main(["eval", *overrides, f"adapter={run}", "eval.merge_adapters=never"]) == 0
    capsys.readouterr()
    assert main(["eval", *overrides, f"adapter={tmp_path / 'export' / 'merged'}"]) == 0
    printed = capsys.readouterr().out
    assert f"Evaluating merged model {tmp_path / 'export' / 'merged'}" in printed
    from_adapter, from_merged = run / "eval" / "test-finetuned", tmp_path / "export" / "eval" / "test-merged"
    merged = _results(from_merged)
    assert merged
    _same(merged, _results(from_adapter))
    record = json.loads(next(from_merged.rglob("metrics.json")).read_text())["merge"]
    assert record["merged"] is True and "a merged model folder" in record["note"]
