"""Crash points: a run killed (SIGKILL, as a subprocess) at every stage boundary in turn, then re-run,
finishes with every output present and, on CPU, the same comparison.json as a run never interrupted.
(Kills inside training, right after a checkpoint or half-way through writing one, are in test_train.py.)
"""

from __future__ import annotations

import json

import pytest

from emotune.core.rundir import STAGE_MARKER, RunDir
from test_lifecycle import emotune, leftovers, run_json

pytestmark = pytest.mark.slow

STAGES = ("data", "baseline", "train", "finetuned", "report")


def test_killed_at_each_stage_boundary_then_resumed_gives_the_uninterrupted_result(tiny_overrides, tmp_path):
    overrides = [o for o in tiny_overrides if not o.startswith("name=")]
    reference = emotune(["run", *overrides, "name=straight"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    straight = RunDir(tmp_path / "runs" / "straight")

    crashed = RunDir(tmp_path / "runs" / "crashed")
    for stage in STAGES:  # each attempt gets one stage further, then dies as that stage starts
        killed = emotune(["run", *overrides, "name=crashed"], kill_at=stage)
        assert not crashed.is_finished(), stage
        assert run_json(crashed.root)["stages"][stage]["status"] == "running", stage
        for earlier in STAGES[:STAGES.index(stage)]:
            assert f"{STAGE_MARKER} {earlier}: " in killed.stdout, (stage, earlier)
    last = emotune(["run", *overrides, "name=crashed"])
    assert last.returncode == 0, last.stderr[-3000:]
    assert crashed.is_finished() and run_json(crashed.root)["status"] == "finished"
    for path in (crashed.report_html, crashed.comparison_json, crashed.comparison_csv, crashed.adapter / "emotune.json",
                 crashed.baseline / "metrics.json", crashed.finetuned / "metrics.json", crashed.data_report):
        assert path.is_file(), path
    assert json.loads(crashed.comparison_json.read_text(encoding="utf-8")) == \
        json.loads(straight.comparison_json.read_text(encoding="utf-8"))
    assert leftovers(tmp_path / "runs") == []
