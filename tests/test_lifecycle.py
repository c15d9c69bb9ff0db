"""The run folder's life cycle, with real processes killed by SIGKILL at a stage's start marker.

`python -m emotune ...` runs as a subprocess; its stdout is read line by line and the process is killed
the moment it prints `[emotune] stage NAME: start`. Nothing in the product knows it is being tested.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import make_rows, write_jsonl
from emotune.cli import main
from emotune.core.rundir import PARTIAL, PREVIOUS, STAGE_MARKER, RunDir
from killable import Result, run_emotune, snapshot

TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def emotune(args: list[str], kill_at: str | None = None) -> Result:
    """Run `python -m emotune ARGS`; with `kill_at`, SIGKILL it as soon as that stage's start marker is printed."""
    marker = f"{STAGE_MARKER} {kill_at}: start" if kill_at else None
    result = run_emotune(args, (lambda line: line.rstrip("\n") == marker) if marker else None, TIMEOUT_S)
    returncode = result.returncode
    if kill_at:
        output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        assert result.killed and returncode == -signal.SIGKILL, f"never reached {marker!r}:\n{output}"
    return result


def run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text(encoding="utf-8"))


def leftovers(runs: Path) -> list[str]:
    return sorted(p.name for p in runs.rglob("*") if p.name.endswith((PARTIAL, PREVIOUS)))


def finished_run(tiny_overrides, tmp_path) -> tuple[Path, dict[str, str]]:
    """A finished run made in-process (faster than a subprocess), with its snapshot."""
    assert main(["run", *tiny_overrides]) == 0
    root = tmp_path / "runs" / "tiny"
    assert RunDir(root).is_finished() and (root / "report.html").is_file()
    return root, snapshot(root)


# --------------------------------------------------------------------------------------------------
# a. a run killed before it finished is not finished, and the same command completes it


def test_run_killed_at_the_report_resumes_to_a_finished_run(tiny_overrides, tmp_path, capsys):
    root = tmp_path / "runs" / "tiny"
    killed = emotune(["run", *tiny_overrides], kill_at="report")
    assert f"{STAGE_MARKER} finetuned: done" in killed.stdout
    assert run_json(root)["status"] != "finished" and not RunDir(root).is_finished()
    assert not (root / "report.html").exists()
    adapter = snapshot(root / "adapter")

    assert main(["run", *tiny_overrides]) == 0  # the resume in-process: only the kill needs a subprocess
    again = capsys.readouterr().out
    for stage in ("data", "baseline", "train", "finetuned"):
        assert f"{STAGE_MARKER} {stage}: skipped" in again, stage
    assert f"{STAGE_MARKER} report: start" in again and f"{STAGE_MARKER} report: done" in again
    assert run_json(root)["status"] == "finished" and RunDir(root).is_finished()
    assert (root / "report.html").is_file()
    assert snapshot(root / "adapter") == adapter  # resumed, not trained again
    assert leftovers(tmp_path / "runs") == []


# --------------------------------------------------------------------------------------------------
# b. overwrite=true with a new run that does not validate leaves the finished run as it was


def test_overwrite_with_an_invalid_new_run_keeps_the_finished_run(tiny_overrides, tmp_path, capsys):
    root, before = finished_run(tiny_overrides, tmp_path)
    capsys.readouterr()
    bad_data = write_jsonl(tmp_path / "bad.jsonl", [{"text": "so happy", "label": "joy"}, {"text": "meh", "label": "boredom"}] * 3)
    invalid = {
        "model source": [f"model.source={tmp_path / 'no-such-model'}"],
        "data": [f"data.source={bad_data}"],
    }
    # in-process (no kill here, so a subprocess would prove nothing more): main() is the console script's entry
    assert main(["run", *tiny_overrides, "overwrite=true", "train.learning_rate=5"]) == 2
    assert snapshot(root) == before and leftovers(tmp_path / "runs") == []
    for what, change in invalid.items():
        code = main(["run", *tiny_overrides, "overwrite=true", *change])
        out, err = capsys.readouterr()
        assert code == 2, (what, out[-2000:], err[-2000:])
        assert "emotune: error:" in err and "Traceback" not in err, what
        assert STAGE_MARKER not in out, what  # nothing started
        assert snapshot(root) == before, what  # adapter, metrics, report.html, run.json: byte for byte
        assert run_json(root)["status"] == "finished" and RunDir(root).is_finished(), what
        assert leftovers(tmp_path / "runs") == [], what  # no .previous, no .partial
    # found only in the data stage, with the tokenizer, after the old run was moved aside: it is put back
    unknown = {"joy": "😀", "sadness": "حزن", "fear": "恐惧"}
    rows = [{"text": f"row {i}", "label": unknown[name]} for i, name in enumerate(["joy", "sadness", "fear"] * 4)]
    tokenizer_refuses = [f"data.source={write_jsonl(tmp_path / 'unk.jsonl', rows)}", "data.label_names=[😀, حزن, 恐惧]"]
    for command in ("run", "train", "data"):
        code = main([command, *tiny_overrides, "overwrite=true", *tokenizer_refuses])
        out, err = capsys.readouterr()
        assert code == 2 and "are the same tokens to this model's tokenizer" in err and "Traceback" not in err, command
        assert f"the old run is back in {root}" in out, command
        assert snapshot(root) == before and RunDir(root).is_finished(), command
        assert leftovers(tmp_path / "runs") == [], command


# --------------------------------------------------------------------------------------------------
# c. overwrite=true keeps the old run as <name>.previous until the new run finishes


def test_overwrite_keeps_the_old_run_until_the_new_one_finishes(tiny_overrides, tmp_path):
    root, before = finished_run(tiny_overrides, tmp_path)
    previous = root.with_name(root.name + PREVIOUS)
    command = ["run", *tiny_overrides, "overwrite=true", "lora.r=4"]

    first = emotune(command, kill_at="train")
    assert previous.name in first.stdout  # the user is told where the old run is
    assert snapshot(previous) == before and RunDir(previous).is_finished()
    assert not RunDir(root).is_finished()

    # the same command again, killed again: the old run is still the one kept, not the half-done new one
    emotune(command, kill_at="train")
    assert snapshot(previous) == before and RunDir(previous).is_finished()

    assert main(command) == 0
    assert RunDir(root).is_finished()
    assert json.loads((root / "adapter" / "adapter_config.json").read_text())["r"] == 4  # the new run
    assert not previous.exists()  # dropped once the new run finished
    assert leftovers(tmp_path / "runs") == []


# --------------------------------------------------------------------------------------------------
# d. `emotune data` never deletes a finished run's outputs (no command deletes outputs it did not write)


def test_data_command_never_deletes_a_finished_run(tiny_overrides, tmp_path, capsys):
    root, before = finished_run(tiny_overrides, tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    for seed, split in enumerate(("train", "validation", "test"), start=10):
        write_jsonl(other / f"{split}.jsonl", make_rows(2, seed))
    change = [o for o in tiny_overrides if not o.startswith("data.source=")] + [f"data.source={other}"]

    assert main(["data", *change]) == 2  # refused without overwrite=true
    assert "holds a finished run made with other data" in capsys.readouterr().err
    assert snapshot(root) == before

    assert main(["data", *change, "overwrite=true"]) == 0
    # what the product does: it keeps the whole finished run aside as <name>.previous, and says so
    previous = root.with_name(root.name + PREVIOUS)
    assert previous.name in capsys.readouterr().out
    assert snapshot(previous) == before and RunDir(previous).is_finished()
    report = json.loads((root / "data" / "data_report.json").read_text(encoding="utf-8"))
    assert report["source"] == str(other) and report["rows"]["test"] == 12


# --------------------------------------------------------------------------------------------------
# e. export never replaces an existing folder without --force


def test_export_into_an_existing_folder_needs_force(tiny_run_dir, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(tiny_run_dir), "--out", str(out)]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    (out / "notes.txt").write_text("the user's own file", encoding="utf-8")
    before = snapshot(out)

    capsys.readouterr()
    assert main(["export", str(tiny_run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and "Traceback" not in err
    assert snapshot(out) == before

    assert main(["export", str(tiny_run_dir), "--out", str(out), "--force"]) == 0
    assert not (out / "notes.txt").exists()  # replaced, not merged into
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "config.yaml").is_file()
    assert {k: v for k, v in before.items() if k != "notes.txt"} == snapshot(out)
    assert leftovers(tmp_path) == []
