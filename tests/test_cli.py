"""The command line itself: flags and help texts that no stage owns."""

from __future__ import annotations

import pytest

from emotune import __version__
from emotune.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"emotune {__version__}"


def test_package_version_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert __version__ == pyproject["project"]["version"]


def test_config_fields_lists_the_choices_of_choice_fields(capsys):
    assert main(["config", "--fields"]) == 0
    entries = {}
    for block in capsys.readouterr().out.splitlines():
        if not block.startswith(" ") and " = " in block:
            key = block.partition(" = ")[0]
        elif block.strip():
            entries[key] = block.strip()
    assert entries["eval.method"].endswith("Allowed: one of `generate`, `score`, `both`.")
    assert entries["data.cleaning.urls"].endswith("Allowed: one of `keep`, `replace`, `drop`.")
    assert "`tensorboard`, `mlflow`, `wandb`" in entries["train.report_to"]
    assert entries["eval.batch_size"].endswith("Allowed: an integer >= 1, or `auto`.")
    assert "Allowed" not in entries["model.source"]  # free text has no list of values


def test_config_fields_refuses_a_config_or_overrides_it_would_ignore(capsys):
    """`config --fields lora.r=2` printed every field and exited 0, the override dropped unsaid."""
    assert main(["config", "--fields", "lora.r=2"]) == 2
    assert "--fields lists every config key" in capsys.readouterr().err


def test_predict_device_help_says_rocm_is_cuda_and_takes_a_gpu_number(capsys):
    from emotune.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["predict", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "ROCm (AMD) GPUs are `cuda` in PyTorch" in help_text and "cuda:N" in help_text
    assert parser.parse_args(["predict", "runs/x", "hi", "--device", "cuda:1"]).device == "cuda:1"
    with pytest.raises(SystemExit):
        parser.parse_args(["predict", "runs/x", "hi", "--device", "rocm"])
    assert "ROCm (AMD) GPUs are cuda" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["data", "eval"])
def test_data_and_eval_help_show_overrides_of_their_own(command, capsys):
    from emotune.cli import OVERRIDE_EXAMPLES
    from emotune.core.config.load import load_config

    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert OVERRIDE_EXAMPLES[command] in help_text and "train." not in help_text
    examples = [item.rstrip(",") for item in OVERRIDE_EXAMPLES[command].split() if "=" in item]
    assert all(item.startswith(f"{command}.") or item.partition("=")[0] in ("adapter", "split") for item in examples)
    load_config(None, [item for item in examples if "." in item.partition("=")[0]])  # real keys, valid values


def test_help_of_the_cli_and_of_every_command_exits_cleanly(capsys):
    """`emotune --help` and each `emotune <command> --help` print their text and exit 0 (a literal % in a help
    text once ended the top-level help in a TypeError)."""
    from emotune.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "95% intervals" in top and all(name in top for name in COMMANDS)
    for name, (_, help_text) in COMMANDS.items():
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0, name
        assert " ".join(help_text.split())[:40] in " ".join(capsys.readouterr().out.split()), name


def test_help_runs_as_a_user_types_it():
    import subprocess
    import sys

    for argv in (["--help"], ["compare", "--help"]):
        done = subprocess.run([sys.executable, "-m", "emotune", *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
def test_ctrl_c_stops_a_run_that_inherited_sigint_ignored(tiny_overrides, tmp_path):
    """A background job of a non-interactive shell starts with SIGINT ignored; the studio's Stop (and `kill -INT`)
    must still interrupt training: exit 130, the stage marked failed, resumable. Without emotune.cli.interruptible
    the run goes on to its last step."""
    import signal
    import subprocess
    import sys
    import time

    runs = tmp_path / "runs"
    overrides = [o for o in tiny_overrides if not o.startswith(("train.max_steps=", "train.eval_steps=", "train.save_steps="))]
    process = subprocess.Popen(
        [sys.executable, "-m", "emotune", "train", *overrides, "train.max_steps=100000", "train.eval_steps=100000",
         "train.save_steps=100000", "device=cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` in a script starts it
    log = runs / "tiny" / "train" / "log_history.jsonl"
    deadline = time.monotonic() + 240
    while not (log.is_file() and log.read_text().strip()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process.poll() is None, process.stderr.read()[-2000:]
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=60)
    finally:
        process.kill()
    assert code == 130, process.stderr.read()[-2000:]


@pytest.mark.parametrize(("argv", "field", "expected"), [
    (["serve", "runs/x", "--no-auth", "serve.port=8001"], "items", ["runs/x", "serve.port=8001"]),
    (["predict", "runs/x", "--device", "cpu", "i am happy", "so sad"], "texts", ["i am happy", "so sad"]),
    (["plan", "c.yaml", "--json", "train.batch_size=8"], "overrides", ["train.batch_size=8"]),
])
def test_positional_arguments_after_a_flag_join_their_list(argv, field, expected, monkeypatch):
    """argparse ends a command's trailing list at the first flag: `emotune serve RUN --no-auth serve.port=8001` (the
    README's command with a port) stopped with "unrecognized arguments"."""
    from emotune import cli

    seen = {}
    monkeypatch.setitem(cli.COMMANDS, argv[0], (lambda args: seen.update(vars(args)) or 0, cli.COMMANDS[argv[0]][1]))
    assert main(argv) == 0
    assert seen[field] == expected


def test_an_override_without_its_value_after_a_flag_is_still_refused(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "c.yaml", "--json", "train.batch_size"])
    assert "unrecognized arguments: train.batch_size" in capsys.readouterr().err


def test_serve_takes_overrides_and_targets_after_its_flags(monkeypatch, tmp_path):
    """`emotune serve RUN --no-auth serve.port=8001`: what follows a flag is still a target or an override, as
    before it (argparse alone ends the positional list at the flag and calls the rest unrecognized)."""
    import emotune.serve

    seen = {}
    monkeypatch.setattr(emotune.serve, "serve", lambda cfg, targets, fallback: seen.update(cfg=cfg, targets=targets))
    assert main(["serve", str(tmp_path / "a"), "--no-auth", "serve.port=8123", str(tmp_path / "b")]) == 0
    assert seen["cfg"].serve.port == 8123 and seen["cfg"].serve.no_auth
    assert seen["targets"] == [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "a"), "--no-auth", "--bogus"])


@pytest.mark.parametrize("adapter", ["adapter=", "adapter= "])
def test_eval_with_an_empty_adapter_is_refused_not_searched_in_the_current_folder(adapter, monkeypatch, tmp_path, capsys):
    """`emotune eval adapter=` took the empty path for the current folder: the error named `.`, and a run folder that
    was the working folder would have been measured as the adapter asked for."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("emotune.pipeline.eval_only", lambda *a, **k: pytest.fail("eval ran"))
    assert main(["eval", adapter]) == 2
    err = capsys.readouterr().err
    assert err.startswith("emotune: error: adapter= names no folder")
