"""Training on settings the other tests leave alone: a resume whose checkpoint falls between two log lines,
and other edges of the loop (tiny model, in-process runs)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import crash_after_checkpoint
from emotune.cli import main


def _history(run_dir):
    return json.loads((run_dir / "train" / "log_history.json").read_text())


def _strip(history):
    return [{k: v for k, v in e.items() if k not in ("tokens_per_s", "peak_memory_mb")} for e in history]


def _adapter(run_dir):
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow  # several runs
def test_a_resume_between_two_log_lines_logs_what_the_uninterrupted_run_logs(tiny_overrides, tmp_path, monkeypatch):
    """A log line averages the steps since the one before; a checkpoint written between two of them carries the
    steps already taken, so the resumed run's line at step 3 averages steps 1-3 as the uninterrupted one's does."""
    common = ["train", *tiny_overrides, "train.max_steps=6", "train.logging_steps=3", "train.save_steps=2",
              "train.eval_steps=3", "lora.dropout=0.1", "seed=7", "device=cpu"]
    assert main(common + ["name=straight"]) == 0
    crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="step-2 checkpoint"):
        main(common + ["name=resumed"])
    monkeypatch.undo()
    assert main(common + ["name=resumed"]) == 0
    runs = tmp_path / "runs"
    straight, resumed = _history(runs / "straight"), _history(runs / "resumed")
    assert [e["step"] for e in straight if "loss" in e] == [3, 6]
    assert _strip(resumed) == _strip(straight)
    expected, got = _adapter(runs / "straight"), _adapter(runs / "resumed")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow  # several runs
def test_a_checkpoint_that_lost_its_best_weights_is_not_resumed_from(tiny_overrides, tmp_path, monkeypatch, capsys):
    """progress.json names the best validation step, whose weights live in best.safetensors: a checkpoint without
    that file is set aside like any other damaged one. Resumed from, it kept the last weights as "the adapter" once
    no later validation beat the lost best (the step-1 weights here)."""
    from emotune.train import loop as train_mod

    def validations(losses):  # best at the first validation; every later one worse
        values = iter(losses)
        monkeypatch.setattr(train_mod, "validate", lambda *a, **k: {"eval_loss": next(values), "eval_token_accuracy": 0.5})

    common = ["train", *tiny_overrides, "train.max_steps=6", "train.eval_steps=1", "train.save_steps=2",
              "train.save_total_limit=10", "device=cpu"]
    crash_after_checkpoint(monkeypatch, 4)
    validations([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(RuntimeError, match="step-4 checkpoint"):
        main(common)
    monkeypatch.undo()
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    (checkpoints / "step-000004" / "best.safetensors").unlink()
    validations([3.0, 4.0, 5.0, 6.0])
    capsys.readouterr()
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "Checkpoint step-000004 cannot be resumed from: best.safetensors is missing" in out
    best = {k.replace(".default", ""): v for k, v in load_file(checkpoints / "step-000002" / "best.safetensors").items()}
    adapter = _adapter(tmp_path / "runs" / "tiny")
    assert adapter.keys() == best.keys()
    assert all(torch.equal(adapter[k], best[k]) for k in adapter)


def test_a_batch_larger_than_the_training_split_counts_the_epochs_it_trains(tiny_overrides, tmp_path, capsys):
    """6 training rows in batches of 8: every step is one batch of the 6 rows, so 2 epochs are 2 steps. The plan said
    ≈ 2.67 epochs (steps x the configured batch over the rows), as if some rows were seen twice."""
    from conftest import make_rows, write_jsonl

    data = tmp_path / "data"
    data.mkdir()
    for split, seed in (("train", 1), ("validation", 2), ("test", 3)):
        write_jsonl(data / f"{split}.jsonl", make_rows(1, seed=seed))
    overrides = [o for o in tiny_overrides if not o.startswith("data.source=")]
    assert main(["train", *overrides, f"data.source={data}", "train.max_steps=-1", "train.num_train_epochs=2",
                 "train.batch_size=8", "train.save_steps=100"]) == 0
    assert "optimizer steps 2 (≈ 2.00 epochs)" in capsys.readouterr().out
    run = json.loads((tmp_path / "runs" / "tiny" / "run.json").read_text())
    plan = run["stages"]["train"]["plan"]
    assert plan["epochs"] == 2.0
    history = _history(tmp_path / "runs" / "tiny")
    assert [e["epoch"] for e in history if "loss" in e] == [1.0, 2.0]


def test_a_run_killed_while_writing_its_training_log_trains_again_rather_than_keep_an_adapter_without_it(
        tiny_overrides, tmp_path, monkeypatch):
    """The saved adapter marks training done (a re-run skips it): the training log and loss curve are written before it,
    so a run stopped between the two is resumed, not left for good without train/log_history.json."""
    from emotune.train import loop as train_mod

    def stopped(*args, **kwargs):
        raise RuntimeError("killed while writing the training log")

    common = ["train", *tiny_overrides, "train.max_steps=3", "train.save_steps=2"]
    monkeypatch.setattr(train_mod, "write_history", stopped)
    with pytest.raises(RuntimeError, match="killed while writing"):
        main(common)
    monkeypatch.undo()
    assert main(common) == 0
    run_dir = tmp_path / "runs" / "tiny"
    assert [e["step"] for e in _history(run_dir) if "loss" in e] == [1, 2, 3]
    assert (run_dir / "train" / "loss_curve.png").is_file() and (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_resuming_with_a_changed_setting_is_refused_naming_it(tiny_overrides, tmp_path, monkeypatch, capsys):
    """An unfinished run resumed with another learning rate is refused, and the message says which setting differs
    and what the run had, so the user can put it back (it said only "a different config or data")."""
    common = ["train", *tiny_overrides, "train.max_steps=3", "train.save_steps=1"]
    crash_after_checkpoint(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="step-1 checkpoint"):
        main(common)
    monkeypatch.undo()
    capsys.readouterr()
    assert main(common + ["train.learning_rate=0.02", "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "different config or data" in err and "Traceback" not in err
    assert "train.max_steps: 4 (the run's: 3); train.learning_rate: 0.02 (the run's: 0.01)" in err, err
    assert main(common + ["overwrite=false"]) == 0  # overwrite is not compared: the run resumes
    assert "Resuming from" in capsys.readouterr().out


def test_early_stopping_between_two_log_lines_logs_the_steps_since_the_last(tiny_overrides, tmp_path, monkeypatch,
                                                                            capsys):
    """A run that ends early at step 4 with a log line every 3 steps: the training loss of step 4 was never logged (the
    loss curve stopped at step 3); the last line is written when training ends, early or not."""
    from emotune.train import loop as train_mod

    losses = iter([2.0, 1.0, 1.5, 1.7, 1.9])  # best at the second validation, then worse
    monkeypatch.setattr(train_mod, "validate", lambda *a, **k: {"eval_loss": next(losses), "eval_token_accuracy": 0.5})
    assert main(["train", *tiny_overrides, "train.max_steps=10", "train.logging_steps=3",
                 "train.early_stopping_patience=2"]) == 0
    assert "Early stopping at step 4" in capsys.readouterr().out
    history = _history(tmp_path / "runs" / "tiny")
    assert [e["step"] for e in history if "loss" in e] == [3, 4]
    assert [e["step"] for e in history if "eval_loss" in e] == [1, 2, 3, 4]


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_by_name(tiny_overrides, tiny_model_dir, tiny_gpt2_dir,
                                                                     tmp_path, monkeypatch, capsys):
    """The folder model.source points at now holds another model than the one the run began with (same config, same
    data): resuming raised a RuntimeError traceback from the checkpoint loader; it is a UserError naming the checkpoint."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    overrides = [o for o in tiny_overrides if not o.startswith("model.source=")] + [f"model.source={model}"]
    common = ["train", *overrides, "train.max_steps=3", "train.save_steps=1"]
    crash_after_checkpoint(monkeypatch, 1)
    with pytest.raises(RuntimeError, match="step-1 checkpoint"):
        main(common)
    monkeypatch.undo()
    shutil.rmtree(model)
    shutil.copytree(tiny_gpt2_dir, model)
    capsys.readouterr()
    assert main(common) == 2
    err = capsys.readouterr().err
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoints" / "step-000001"
    assert f"The checkpoint {checkpoint} holds trained weights that do not fit this model" in err, err[-1000:]
    assert "overwrite=true" in err


def test_the_nonfinite_stop_says_a_changed_setting_starts_over_and_that_works(tiny_overrides, tmp_path, monkeypatch,
                                                                             capsys):
    """The stop advises a lower learning rate and said re-running resumes from the last checkpoint; a re-run with the
    lower rate is another config, refused as such. The message says so, and its way (overwrite=true) trains."""
    from emotune.train import loop as train_mod

    calls = {"n": 0}

    def loss(model, batch):  # NaN from the third training forward pass on, as a too-high learning rate would give
        parts = real(model, batch)
        if model.training:
            calls["n"] += 1
            if calls["n"] >= 3:
                parts.loss_sum = parts.loss_sum * float("nan")
        return parts

    real = train_mod.completion_loss
    monkeypatch.setattr(train_mod, "completion_loss", loss)
    common = ["train", *tiny_overrides, "train.max_steps=8", "train.save_steps=2"]
    assert main(common) == 2
    err = capsys.readouterr().err
    assert "train.learning_rate" in err and "step-000002" in err and "intact" in err
    assert "a changed setting is a new config: pass overwrite=true with it" in err, err[-600:]
    monkeypatch.undo()
    assert main(common + ["train.learning_rate=0.001"]) == 2  # as the message says: refused without overwrite
    assert main(common + ["train.learning_rate=0.001", "overwrite=true"]) == 0


def test_a_budget_run_whose_plan_file_is_gone_is_not_resumed_on_a_new_plan(tiny_overrides, tmp_path, monkeypatch,
                                                                           capsys):
    """checkpoints/plan.json holds the step count a time-budget run's schedule and data order follow. Deleted beside
    its checkpoints, the run measured again and resumed the step-2 checkpoint of a 4-step plan as a 27-step run (a
    new learning-rate schedule under the old scheduler state); it is refused like an unreadable plan file."""
    from emotune.train.passes import PLAN_FILE, Calibration, Speed

    def measured(per_step):
        monkeypatch.setattr(Calibration, "measure", lambda self, plan, t, seed: Speed(per_step, 0.0, 0.0))

    common = ["train", *tiny_overrides, "train.max_steps=-1", "train.time_budget=40s", "train.num_train_epochs=3",
              "train.eval_steps=100"]
    measured(10.0)
    crash_after_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="step-2 checkpoint"):
        main(common)
    monkeypatch.undo()
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    (checkpoints / PLAN_FILE).unlink()
    measured(1.0)  # a faster machine now: 27 steps would fit
    capsys.readouterr()
    assert main(common) == 2
    err = capsys.readouterr().err
    assert f"{checkpoints / PLAN_FILE} is missing, and the checkpoints beside it" in err, err[-800:]
