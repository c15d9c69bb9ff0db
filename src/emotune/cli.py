"""The `emotune` command: a table from sub-command to stage function, and one error boundary."""

from __future__ import annotations

import argparse
import json
import os
import sys

from emotune.errors import UserError


def _cmd_run(args: argparse.Namespace) -> int:
    from emotune.config import dump_config
    from emotune.pipeline import run

    cfg = _load(args)
    print("Resolved config (defaults < YAML < key=value):\n" + dump_config(cfg), flush=True)
    run(cfg)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from emotune.pipeline import train_only

    train_only(_load(args))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from emotune.device import doctor, format_report

    report = doctor()
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from emotune.config import dump_config, field_docs

    if args.fields:
        for key, default, doc in field_docs():
            print(f"{key} = {default}\n    {doc}")
        return 0
    print(dump_config(_load(args)), end="")
    return 0


def _load(args: argparse.Namespace):
    from emotune.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # `emotune run train.max_steps=2` without a file
    return load_config(config, overrides)


COMMANDS = {
    "run": (_cmd_run, "baseline → LoRA fine-tune → re-measure → compare, into runs/<name>/"),
    "train": (_cmd_train, "LoRA fine-tune only, resumable; also under torchrun / accelerate launch"),
    "doctor": (_cmd_doctor, "report backend (ROCm/CUDA/MPS/CPU), devices, precision support, versions, hints"),
    "config": (_cmd_config, "print the resolved config (or every field with its documentation)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emotune", description="Turn an instruction-tuned LLM into a measured classifier with LoRA.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("run", "train", "config"):
            p.add_argument("config", nargs="?", help="YAML config file (optional; defaults are the embedded CPU recipe)")
            p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=2")
        if name == "config":
            p.add_argument("--fields", action="store_true", help="list every config key with its default and docstring")
        if name == "doctor":
            p.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    handler = COMMANDS[args.command][0]
    try:
        return handler(args)
    except UserError as err:
        print(f"emotune: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emotune: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
