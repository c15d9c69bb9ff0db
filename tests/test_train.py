"""Training engine on the tiny model: the fast loss equals the plain one, batching, outputs, validation
and early stopping, non-finite guards, exact resume after kill -9, and 2 processes under torchrun (DDP, and
FSDP2 killed and resumed under accelerate launch)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from conftest import LABELS, collate_row_by_row, crash_after_checkpoint, make_rows
from emotune.cli import main
from emotune.core.config.data import PromptConfig
from emotune.tasks.classify.task import encode_examples
from emotune.train import loop as train_mod
from emotune.train.batches import collate, completion_loss, epoch_batches, forward_passes, rank_share

SRC = Path(__file__).resolve().parent.parent / "src"


def _tiny_model(tiny_model_dir, softcap: float | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.final_logit_softcapping = softcap
    return model


def test_completion_loss_equals_full_vocabulary_loss(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = make_rows(1, seed=5)
    for i, row in enumerate(rows):  # rows of different lengths, so padding really happens
        row["text"] = " ".join([row["text"]] * (1 + i % 3))
    examples = encode_examples(Dataset.from_list(rows), tokenizer, PromptConfig(), LABELS, max_length=256)
    assert len({len(e.input_ids) for e in examples}) > 1
    model = _tiny_model(tiny_model_dir, softcap=3.0)  # soft-capping must be applied on the kept positions too

    parts = completion_loss(model, collate(examples, tokenizer.pad_token_id, torch.device("cpu")))
    parts.loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    total, tokens = 0.0, 0
    for e in examples:  # the plain way: one unpadded row, every position projected, prompt masked
        ids = torch.tensor([e.input_ids])
        targets = ids[0, 1:].clone()
        targets[: e.completion_start - 1] = -100
        total += float(torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], targets, reduction="sum"))
        tokens += e.completion_tokens
    assert parts.tokens == tokens
    assert float(parts.loss_sum) / parts.tokens == pytest.approx(total / tokens, rel=1e-5)


def test_epoch_batches_are_seeded_grouped_and_split_across_processes():
    lengths = [(i * 37) % 50 + 10 for i in range(100)]
    first = epoch_batches(lengths, batch_rows=8, min_rows=2, seed=1, epoch=0, group_by_length=True)
    assert first == epoch_batches(lengths, 8, 2, 1, 0, True)  # a resumed run sees the same order
    assert first != epoch_batches(lengths, 8, 2, 1, 1, True)  # a new epoch reshuffles
    assert sorted(i for b in first for i in b) == list(range(100))  # 100 = 12 x 8 + 4: the last batch is kept
    spread = lambda batches: sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)  # noqa: E731
    assert spread(first) < spread(epoch_batches(lengths, 8, 2, 1, 0, False)) / 3  # little padding left
    batch = first[0]
    shares = [rank_share(batch, r, 2) for r in range(2)]
    assert shares[0] + shares[1] == batch and len(shares[0]) == len(shares[1])


def test_forward_passes_cover_each_share_under_the_cap_with_one_count_for_all_processes():
    lengths = [10, 90, 20, 80, 30, 70, 40, 60, 50, 50, 15, 25, 35]
    batch = list(range(13))
    for world in (1, 2, 3):
        passes = forward_passes(batch, lengths, world, max_tokens=160)
        assert len({len(mine) for mine in passes}) == 1  # under FSDP every pass is collective
        for rank, mine in enumerate(passes):
            assert sorted(i for p in mine for i in p) == sorted(rank_share(batch, rank, world))
            order = [i for p in mine for i in p]
            assert order == sorted(order, key=lambda i: -lengths[i])  # longest first: the largest pass first
            assert all(len(p) * lengths[p[0]] <= 160 for p in mine)
    assert [len(p) for p in forward_passes(batch, lengths, 1, max_tokens=160)[0]] == [1, 2, 2, 3, 5]
    # A share with short rows is cut further to match the count a share with long rows needs ...
    uneven = forward_passes([1, 3, 5, 7, 0, 2, 10, 4], lengths, 2, max_tokens=90)
    assert [len(mine) for mine in uneven] == [4, 4] and all(len(p) == 1 for p in uneven[0])
    # ... but never below one row a pass: a share of 1 row caps the count, and the other share's rows merge.
    assert [len(mine) for mine in forward_passes([1, 3, 0], lengths, 2, max_tokens=10)] == [1, 1]
    assert forward_passes(batch, lengths, 2, max_tokens=0) == [[sorted(batch[:6], key=lambda i: -lengths[i])],
                                                               [sorted(batch[6:], key=lambda i: -lengths[i])]]


def test_splitting_a_batch_into_passes_leaves_the_update_unchanged(tiny_overrides, tmp_path, capsys):
    common = ["train", *tiny_overrides, "train.max_steps=2", "train.batch_size=6", "lora.dropout=0.0", "device=cpu"]
    assert main(common + ["name=whole", "train.max_tokens_per_pass=0"]) == 0
    assert "one forward pass per batch" in capsys.readouterr().out
    assert main(common + ["name=rows", "train.max_tokens_per_pass=1"]) == 0  # every row is its own pass
    assert "forward passes of at most 1 padded tokens" in capsys.readouterr().out
    runs = tmp_path / "runs"
    losses = {n: [e["loss"] for e in json.loads((runs / n / "train" / "log_history.json").read_text()) if "loss" in e]
              for n in ("whole", "rows")}
    assert losses["rows"] == pytest.approx(losses["whole"], rel=1e-5)
    whole, rows = _adapter(runs / "whole"), _adapter(runs / "rows")
    # Equal up to float summation order (Adam's normalised step amplifies it to ~3e-5 on weights of ~0.2).
    assert all(torch.allclose(whole[k], rows[k], atol=1e-4) for k in whole)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in rows.items() if "lora_B" in k)  # it trained


def _run_dir(tmp_path) -> Path:
    return tmp_path / "runs" / "tiny"


def test_train_command_writes_adapter_history_and_curve(tiny_overrides, tmp_path, capsys):
    args = ["train", *tiny_overrides, "train.max_steps=4", "train.eval_steps=2", "train.save_steps=2",
            "lora.use_rslora=true", "lora.use_dora=true"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "effective batch 4" in out and "trainable parameters" in out and "rsLoRA + DoRA" in out
    run_dir = _run_dir(tmp_path)
    for name in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "adapter/emotune.json",
                 "train/log_history.json", "train/log_history.jsonl", "train/loss_curve.png", "config.yaml"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "train" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(line) for line in (run_dir / "train" / "log_history.jsonl").read_text().splitlines()]
    assert lines == json.loads((run_dir / "train" / "log_history.json").read_text())
    assert [e["step"] for e in lines if "loss" in e] == [1, 2, 3, 4]
    assert [e["step"] for e in lines if "eval_loss" in e] == [2, 4]
    assert all(e["tokens_per_s"] > 0 and e["peak_memory_mb"] > 0 for e in lines if "loss" in e)
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["use_dora"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]

    assert main(args) == 2  # a trained adapter is not trained over silently
    assert "already holds a trained adapter" in capsys.readouterr().err


def test_early_stopping_keeps_the_best_adapter(tiny_overrides, tmp_path, monkeypatch, capsys):
    losses = iter([2.0, 1.0, 1.5, 1.7, 1.9, 2.1])  # best at the second validation, then worse
    monkeypatch.setattr(train_mod, "validate", lambda *a, **k: {"eval_loss": next(losses), "eval_token_accuracy": 0.5})
    assert main(["train", *tiny_overrides, "train.max_steps=10", "train.save_steps=1", "train.save_total_limit=10",
                 "train.early_stopping_patience=2"]) == 0
    assert "Early stopping at step 4" in capsys.readouterr().out
    run_dir = _run_dir(tmp_path)
    history = json.loads((run_dir / "train" / "log_history.json").read_text())
    assert max(e["step"] for e in history) == 4
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    at_best = {k.replace(".default", ""): v for k, v in
               load_file(run_dir / "checkpoints" / "step-000002" / "trainable.safetensors").items()}
    at_third = load_file(run_dir / "checkpoints" / "step-000003" / "trainable.safetensors")
    assert adapter.keys() == at_best.keys()
    assert all(torch.equal(adapter[k], at_best[k]) for k in adapter)
    assert not all(torch.equal(adapter[k], at_third[k.replace("lora_A.", "lora_A.default.").replace(
        "lora_B.", "lora_B.default.")]) for k in adapter)


def test_a_nan_best_so_far_is_beaten_by_the_next_validation_as_a_resumed_run_reads_it():
    from dataclasses import replace

    from emotune.train.batches import LANGUAGE_MODEL

    for objective in (LANGUAGE_MODEL, replace(LANGUAGE_MODEL, select="eval_macro_f1", higher_is_better=True)):
        assert objective.better(0.5, float("nan")) and objective.better(0.5, None)  # progress.json writes NaN as null
        assert not objective.better(0.5, 0.5)


def _poison_losses(monkeypatch, bad_steps: set[int]):
    """Make the loss NaN on the given optimizer steps (1-based), as an fp16 overflow would."""
    calls = {"n": 0}

    def loss(model, batch):
        parts = completion_loss(model, batch)
        if model.training:
            calls["n"] += 1
            if calls["n"] in bad_steps:
                parts.loss_sum = parts.loss_sum * float("nan")
        return parts

    monkeypatch.setattr(train_mod, "completion_loss", loss)


def test_a_nonfinite_step_is_skipped_and_counted(tiny_overrides, tmp_path, monkeypatch):
    _poison_losses(monkeypatch, {2})
    assert main(["train", *tiny_overrides, "train.max_steps=3", "train.save_steps=1", "train.save_total_limit=5"]) == 0
    run_dir = _run_dir(tmp_path)
    history = json.loads((run_dir / "train" / "log_history.json").read_text())
    assert [e["skipped_steps"] for e in history if "loss" in e] == [0, 1, 1]
    # No checkpoint at the skipped step: a checkpoint is only written when the last step was good.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_nonfinite_steps_in_a_row_stop_with_the_cause(tiny_overrides, tmp_path, monkeypatch, capsys):
    _poison_losses(monkeypatch, {3, 4, 5})
    assert main(["train", *tiny_overrides, "train.max_steps=8", "train.save_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "step 5" in err and "3 steps in a row" in err and "train.learning_rate" in err
    assert "step-000002" in err and "intact" in err, err[-800:]
    checkpoints = _run_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002"]
    assert not (_run_dir(tmp_path) / "adapter").exists()


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_good_one(tiny_overrides, tmp_path, monkeypatch,
                                                                          capsys):
    """A checkpoint spoiled after it was written (here its weights cut in half): no traceback on resume; the
    run says which checkpoint it uses and why, keeps the bad one aside, and ends as if never interrupted."""

    common = ["train", *tiny_overrides, "train.max_steps=4", "train.save_steps=1", "train.save_total_limit=3",
              "lora.dropout=0.1", "seed=7", "device=cpu"]
    assert main(common + ["name=straight"]) == 0
    crash_after_checkpoint(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="step-3 checkpoint"):
        main(common + ["name=cut"])
    monkeypatch.undo()
    checkpoints = tmp_path / "runs" / "cut" / "checkpoints"
    weights = checkpoints / "step-000003" / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    capsys.readouterr()

    assert main(common + ["name=cut"]) == 0
    out = capsys.readouterr().out
    assert "Checkpoint step-000003 cannot be resumed from: trainable.safetensors is unreadable" in out
    assert f"Resuming from {checkpoints / 'step-000002'} (step 2), the newest intact checkpoint" in out
    assert (checkpoints / "step-000003.unreadable").is_dir()
    straight, resumed = _adapter(tmp_path / "runs" / "straight"), _adapter(tmp_path / "runs" / "cut")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_an_unreadable_checkpoint_file_is_named_with_the_reason(tmp_path):
    from emotune.train import checkpoints as ckpt

    folder = tmp_path / "step-000001"
    folder.mkdir()
    assert ckpt.checkpoint_problem(folder) == "trainable.safetensors, optimizer.pt, rng.pt, progress.json are missing"
    for name in ckpt.FILES:
        (folder / name).write_bytes(b"")
    assert "trainable.safetensors is unreadable" in ckpt.checkpoint_problem(folder)
    ckpt.save_file({"w": torch.zeros(2)}, folder / "trainable.safetensors")
    assert "optimizer.pt is unreadable" in ckpt.checkpoint_problem(folder)
    for name in ("optimizer.pt", "rng.pt"):
        torch.save({}, folder / name)
    assert ckpt.checkpoint_problem(folder) == "progress.json is unreadable (Expecting value: line 1 column 1 (char 0))"
    (folder / "progress.json").write_text('{"step": 1}')
    assert ckpt.checkpoint_problem(folder) is None


def test_fsdp_on_one_process_is_a_plain_run(tiny_overrides, tmp_path, capsys):
    assert main(["train", *tiny_overrides, "train.max_steps=1", "train.fsdp=true"]) == 0
    assert "nothing to shard across" in capsys.readouterr().out
    assert (_run_dir(tmp_path) / "adapter" / "adapter_model.safetensors").is_file()


def test_a_checkpoint_resumes_only_the_way_it_was_written(tiny_model_dir, tmp_path):
    """An FSDP checkpoint names its parameters; a plain run refuses it with a clear message, not a KeyError."""
    from emotune.core.errors import UserError
    from emotune.train import checkpoints as ckpt

    model = _tiny_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    written_by_fsdp = {"state": {}, "param_groups": [{**optimizer.param_groups[0], "params": ["model.norm.weight"]}]}
    with pytest.raises(UserError, match="written with FSDP"):
        ckpt.load_optimizer_state(model, optimizer, written_by_fsdp, tmp_path / "checkpoints" / "step-000002")
    ckpt.load_optimizer_state(model, optimizer, optimizer.state_dict(), tmp_path)  # the plain format still loads


def test_fsdp_refuses_a_modules_to_save_copy_of_a_tied_embedding(tiny_model_dir):
    from emotune.core.errors import UserError
    from emotune.runtime.parallel import refuse_tied_modules_to_save

    model = _tiny_model(tiny_model_dir)  # Gemma ties lm_head to embed_tokens
    for tied in (["lm_head"], ["model.embed_tokens"]):
        with pytest.raises(UserError, match="ties to its output layer"):
            refuse_tied_modules_to_save(model, tied)
    refuse_tied_modules_to_save(model, ["model.norm"])
    refuse_tied_modules_to_save(model, None)


def test_missing_tracker_is_a_clear_error(tiny_overrides, capsys):
    from accelerate.utils import is_wandb_available

    if is_wandb_available():
        pytest.skip("wandb is installed here")
    assert main(["train", *tiny_overrides, "train.report_to=[wandb]"]) == 2
    assert "pip install wandb" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Subprocesses: kill -9 and resume; torchrun with 2 processes

KILLER = """
import os, signal, sys
import emotune.train.checkpoints as ckpt

kill_step, mid_write = int(sys.argv[1]), sys.argv[2] == "mid-write"
if mid_write:  # die after the first file of the checkpoint is written, before the rename
    original_save = ckpt.save_file
    def save_then_die(tensors, path, *a, **k):
        original_save(tensors, path, *a, **k)
        if f"step-{kill_step:06d}" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save_file = save_then_die
else:  # die right after the checkpoint is complete
    original_write = ckpt.write_checkpoint
    def write_then_die(folder, step, *a, **k):
        path = original_write(folder, step, *a, **k)
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    ckpt.write_checkpoint = write_then_die
from emotune.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _emotune(args: list[str], killer: tuple[int, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", KILLER, str(killer[0]), killer[1]] if killer else [sys.executable, "-m", "emotune"]
    return subprocess.run(command + args, capture_output=True, text=True, env=_env(), timeout=300)


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow  # subprocesses / several runs
def test_resume_after_kill_9_gives_the_uninterrupted_adapter(tiny_overrides, tmp_path):
    common = ["train", *tiny_overrides, "train.max_steps=6", "train.save_steps=2", "train.eval_steps=3",
              "lora.dropout=0.1", "seed=7"]
    straight = _emotune(common + ["name=straight"])
    assert straight.returncode == 0, straight.stderr[-2000:]

    first = _emotune(common + ["name=killed"], killer=(2, "after"))
    assert first.returncode == -9
    second = _emotune(common + ["name=killed"], killer=(4, "mid-write"))
    assert second.returncode == -9 and "Resuming from" in second.stdout
    checkpoints = tmp_path / "runs" / "killed" / "checkpoints"
    assert [p.is_dir() for p in checkpoints.glob("step-000004.*.partial")] == [True]  # unique temp names
    assert not (checkpoints / "step-000004").exists()
    last = _emotune(common + ["name=killed"])
    assert last.returncode == 0, last.stderr[-2000:]
    assert "step-000002" in last.stdout  # the half-written step 4 was ignored
    assert not list(checkpoints.glob("step-000004*.partial"))

    expected, resumed = _adapter(tmp_path / "runs" / "straight"), _adapter(tmp_path / "runs" / "killed")
    assert expected.keys() == resumed.keys()
    # Same data order, dropout masks and optimizer state: bit-identical on CPU.
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)
    history = [json.loads((tmp_path / "runs" / n / "train" / "log_history.json").read_text()) for n in ("straight", "killed")]
    strip = lambda h: [{k: v for k, v in e.items() if k not in ("tokens_per_s", "peak_memory_mb")} for e in h]  # noqa: E731
    assert strip(history[0]) == strip(history[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # subprocesses / several runs
def test_two_processes_match_one_with_the_same_global_batch(tiny_overrides, tmp_path):
    common = ["train", *tiny_overrides, "train.max_steps=3", "train.save_steps=2", "train.eval_steps=3",
              "lora.dropout=0.0", "device=cpu", "train.gradient_checkpointing=auto"]  # both processes decide it alike
    assert main(common + ["name=single", "train.batch_size=8"]) == 0  # in-process: one process needs no launcher
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "emotune", *common, "name=ddp", "train.batch_size=4"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "x 2 processes" in ddp.stdout and "effective batch 8" in ddp.stdout
    assert "gradient checkpointing off (auto: off, an update fits in 1 forward pass without it" in ddp.stdout

    runs = tmp_path / "runs"
    histories = {n: json.loads((runs / n / "train" / "log_history.json").read_text()) for n in ("single", "ddp")}
    for key in ("loss", "eval_loss"):
        one, two = ([e[key] for e in histories[n] if key in e] for n in ("single", "ddp"))
        assert len(one) == len(two) > 0
        assert two == pytest.approx(one, rel=1e-4)
    one, two = _adapter(runs / "single"), _adapter(runs / "ddp")
    assert all(torch.allclose(one[k], two[k], atol=1e-5) for k in one)
    # Only rank 0 writes: the same files as the single process, and every log line once.
    files = {n: sorted(str(p.relative_to(runs / n)) for p in (runs / n).rglob("*")) for n in ("single", "ddp")}
    assert files["single"] == files["ddp"]
    lines = (runs / "ddp" / "train" / "log_history.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) == len(histories["ddp"])


@pytest.mark.slow  # subprocesses / several runs
def test_fsdp_on_two_processes_matches_one_and_resumes_under_accelerate_launch(tiny_overrides, tmp_path):
    """FSDP2 on CPU/gloo: train.fsdp=true under torchrun, killed after the step-2 checkpoint, then resumed by
    `accelerate launch --use_fsdp` (the launcher's own switch); the result is the single-process run's."""
    common = ["train", *tiny_overrides, "train.max_steps=4", "train.save_steps=2", "train.eval_steps=2",
              "lora.dropout=0.0", "device=cpu", "train.gradient_checkpointing=true", "train.gradient_accumulation_steps=2"]
    # FSDP runs PEFT's LoRA forward and the model's own norms (emotune.model.lean_lora / lean_norm stay off under it), so
    # the single process does too: the same ops, and Adam's steps stay within the tolerance below
    assert main(common + ["name=single", "train.batch_size=4", "train.max_tokens_per_pass=0", "train.lean_lora=false",
                          "train.lean_norm=false"]) == 0

    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    fsdp = common + ["name=fsdp", "train.batch_size=2", "train.max_tokens_per_pass=1"]  # 2 passes a batch, in step
    first = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(_free_port()), str(killer), "2", "after", *fsdp, "train.fsdp=true"],
                           capture_output=True, text=True, env=_env(), timeout=300)
    assert first.returncode != 0 and "FSDP2 over 2 processes (train.fsdp)" in first.stdout, first.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "fsdp" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-000002"]
    assert not (tmp_path / "runs" / "fsdp" / "adapter").exists()

    second = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines",
                             "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--use_fsdp", "--fsdp_version", "2",
                             "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--main_process_port",
                             str(_free_port()), "-m", "emotune", *fsdp], capture_output=True, text=True, env=_env(), timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "accelerate launch config" in second.stdout and "Resuming from" in second.stdout
    assert "batch 2 x accumulation 2 x processes 2 => effective batch 8" in second.stdout

    runs = tmp_path / "runs"
    histories = {n: json.loads((runs / n / "train" / "log_history.json").read_text()) for n in ("single", "fsdp")}
    for key in ("loss", "eval_loss", "grad_norm"):  # the norm of the gathered gradient, not of one shard
        one, two = ([e[key] for e in histories[n] if key in e] for n in ("single", "fsdp"))
        assert len(one) == len(two) > 0
        assert two == pytest.approx(one, rel=1e-4)
    one, two = _adapter(runs / "single"), _adapter(runs / "fsdp")
    # 2 processes reduce gradients in another order than 1: the same 1e-4 as the pass-splitting comparison above
    assert one.keys() == two.keys() and all(torch.allclose(one[k], two[k], atol=1e-4) for k in one)
    files = {n: sorted(str(p.relative_to(runs / n)) for p in (runs / n).rglob("*")) for n in ("single", "fsdp")}
    assert files["single"] == files["fsdp"]  # only rank 0 wrote, and the adapter has the single-process layout
    assert json.loads((runs / "fsdp" / "adapter" / "adapter_config.json").read_text()) == \
        json.loads((runs / "single" / "adapter" / "adapter_config.json").read_text())

    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_tiny_model(tiny_overrides[0].split("=", 1)[1]), runs / "fsdp" / "adapter")
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(state) == len(two) and all(torch.equal(v, two[k.replace(".default", "")]) for k, v in state.items())


def test_class_weights_scale_each_rows_completion_loss(tiny_model_dir):
    """data.balance=class_weight: a row's completion tokens count with its label's weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = make_rows(1, seed=4)[:2]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain = encode_examples(Dataset.from_list(rows), tokenizer, PromptConfig(), LABELS, max_length=256)
    weights = {label: 1.0 for label in LABELS} | {rows[0]["label"]: 3.0}
    weighted = encode_examples(Dataset.from_list(rows), tokenizer, PromptConfig(), LABELS, max_length=256,
                               class_weights=weights)
    with torch.no_grad():
        per_row = [completion_loss(model, collate([e], tokenizer.pad_token_id, torch.device("cpu"))).loss_sum for e in plain]
        both = completion_loss(model, collate(weighted, tokenizer.pad_token_id, torch.device("cpu"))).loss_sum
    assert both.item() == pytest.approx(3.0 * per_row[0].item() + per_row[1].item(), rel=1e-5)


def _collate_by_tensor_ops(examples, pad_id: int):
    """collate as it was written before it built lists: tensors filled row by row (the reference)."""
    return collate_row_by_row(examples, pad_id, lambda e: e.loss_spans)


def test_collate_gives_the_tensors_row_by_row_filling_gives_on_random_batches():
    """Random rows: lengths 1-12, completion starts anywhere (also 0 and past the end), several spans, empty and
    overlapping ones, weights; every tensor equal in dtype, shape and value."""
    import random

    from emotune.train.batches import Example, collate

    rng = random.Random(0)
    for _ in range(500):
        rows = []
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 12)
            ids = [rng.randint(0, 99) for _ in range(n)]
            points = sorted(rng.randint(0, n) for _ in range(2 * rng.randint(1, 3)))
            spans = None if rng.random() < 0.5 else tuple(zip(points[::2], points[1::2], strict=True))
            rows.append(Example(ids, rng.randint(0, n) if spans is None else spans[0][0], rng.choice([1.0, 0.3, 2.0]), spans))
        got, want = collate(rows, 7, torch.device("cpu")), _collate_by_tensor_ops(rows, 7)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
