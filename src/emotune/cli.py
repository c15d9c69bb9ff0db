"""The `emotune` command: a table from sub-command to stage function, and one error boundary."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from contextlib import nullcontext
from pathlib import Path

from emotune.core.errors import UserError


def _cmd_run(args: argparse.Namespace) -> int:
    from emotune.pipeline import run

    run(_load(args))
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from emotune.pipeline import data_only

    data_only(_load(args))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from emotune.pipeline import eval_only

    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.config, args.overrides = None, [args.config, *args.overrides]
    # `adapter=DIR` and `split=NAME` are shorthands of this command, everything else is a config override
    adapter = next((o.partition("=")[2] for o in args.overrides if o.startswith("adapter=")), None)
    if adapter is not None and not adapter.strip():  # Path("") is the current folder: it was searched for an adapter
        raise UserError("adapter= names no folder; give the run, export or adapter folder to measure, e.g. "
                        "adapter=runs/cpu, or leave it out to measure the base model.")
    args.overrides = [f"eval.{o}" if o.startswith("split=") else o for o in args.overrides if not o.startswith("adapter=")]
    eval_only(_load(args), adapter)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from emotune.report.page import write_report

    print(f"Report: {write_report(args.run_dir)}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from emotune.report.compare import compare_runs

    compare_runs(args.run_dirs, out=args.out, allow_mismatch=args.allow_mismatch)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from emotune.pipeline import train_only

    train_only(_load(args))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from emotune.runtime.device import doctor, format_report

    report = doctor()
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from emotune.tasks import task_for
    from emotune.train.plan import format_plan, make_plan, plan_json

    cfg = _load(args, announce=False)
    plan = make_plan(cfg, task_for(cfg), args.device_memory)
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from emotune.core.config.build import dump_config, field_docs

    if args.fields:
        given = [a for a in (args.config, *args.overrides) if a]
        if given:
            raise UserError(f"--fields lists every config key with its default and documentation, and takes no config or "
                            f"override (given: {' '.join(given)}). Run `emotune config --fields` alone (| grep lora "
                            "for a section), or `emotune config CONFIG key=value` for the resolved config.")
        for key, default, doc in field_docs():
            print(f"{key} = {default}\n    {doc}")
        return 0
    if args.from_llamafactory or args.from_axolotl:
        from emotune.core.config import axolotl, llamafactory

        overrides = [args.config, *args.overrides] if args.config else list(args.overrides)
        tool, path = (llamafactory, args.from_llamafactory) if args.from_llamafactory else (axolotl, args.from_axolotl)
        print(tool.translated_yaml(path, overrides), end="")
        return 0
    print(dump_config(_load(args, announce=False)), end="")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from emotune.core.locks import locked
    from emotune.core.rundir import RunDir, run_lock

    # a run folder is exported while no other process (a resumed `emotune run`, another export) works in it
    folder = Path(args.run_dir).expanduser()
    guard = locked(run_lock(folder), f"the run folder {folder}") if RunDir(folder).has_run() else nullcontext()
    with guard:
        if args.format in ("gguf", "ollama"):
            from emotune.deploy.gguf_export import export_gguf

            export_gguf(args.run_dir, out=args.out, quant=args.quant, ollama=args.format == "ollama", force=args.force,
                        vllm=args.vllm)
            return 0
        from emotune.deploy.export import export

        export(args.run_dir, out=args.out, merge=args.merge, vllm=args.vllm, dtype=args.dtype, force=args.force)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from emotune.deploy.hub import push

    push(args.run_dir, args.to, merged=args.merged, private=args.private, dry_run=args.dry_run)
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from emotune.core.config.load import load_config
    from emotune.deploy.predict import PredictIO, predict_cli
    from emotune.model.artifacts import fallback_from

    cfg = load_config(args.config, []) if args.config else None
    if cfg is not None:
        _announce(cfg)
    labels = [label.strip() for label in args.labels.split(",")] if args.labels else None
    if labels is not None and (not all(labels) or len(set(labels)) != len(labels)):
        raise UserError(f"--labels `{args.labels}` must be distinct, non-empty labels separated by commas, e.g. "
                        "--labels joy,sadness,anger.")
    fallback = fallback_from(cfg, labels, source="--config/--labels") if cfg is not None or labels else None
    io = PredictIO(args.texts, args.file, args.out, args.text_column, args.encoding)
    return predict_cli(args.target, io, args.batch_size, args.device, fallback, args.max_new_tokens)


def _cmd_studio(args: argparse.Namespace) -> int:
    from emotune.studio import run_studio

    run_studio(args.runs, args.host, args.port, args.token_file)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from emotune.core.config.load import load_config
    from emotune.model.artifacts import fallback_from
    from emotune.serve import serve

    config = next((a for a in args.items if a.endswith((".yaml", ".yml"))), None)
    overrides = [a for a in args.items if "=" in a and a != config]
    targets = [a for a in args.items if a not in overrides and a != config]
    if args.engine:
        overrides.append(f"serve.engine={args.engine}")
    if args.no_auth:
        overrides.append("serve.no_auth=true")
    _no_key_on_the_command_line(overrides)
    cfg = load_config(config, overrides)
    _announce(cfg)
    # an adapter made by another tool takes its labels, prompt and base from the config file, if one was given
    serve(cfg, targets, fallback_from(cfg, source=f"the config `{config}`") if config else None)
    return 0


def _no_key_on_the_command_line(overrides: list[str]) -> None:
    for override in overrides:
        key, _, value = override.partition("=")
        if key in ("serve.api_key", "serve.admin_key") and value and not value.startswith(("env:", "file:")):
            raise UserError(f"{key} is given on the command line, where the process list and the shell's history show "
                            f"it to anyone on this machine. Use {key}=env:NAME (an environment variable holding the "
                            f"key) or {key}=file:PATH (a file readable by you only).")


def _cmd_sweep(args: argparse.Namespace) -> int:
    from emotune.sweep.runner import load_sweep_config, sweep

    config, overrides = _config_and_overrides(args)
    flags = [f"sweep.{key}={value}" for key, value in (("mode", "ablation" if args.ablation else args.search),
                                                       ("trials", args.trials), ("seeds", args.seeds),
                                                       ("metric", args.metric), ("backend", args.backend))
             if value is not None]
    cfg = load_sweep_config(config, overrides, args.grid, flags)
    _announce(cfg)
    sweep(cfg, config, overrides)
    return 0


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # `emotune run train.max_steps=2` without a file
    return config, overrides


def _load(args: argparse.Namespace, announce: bool = True):
    from emotune.core.config.load import load_config

    config, overrides = _config_and_overrides(args)
    if announce and config is not None:
        from emotune.core.config.axolotl import announce as announce_axolotl
        from emotune.core.config.llamafactory import announce as announce_llamafactory

        announce_llamafactory(config, overrides)  # a LLaMA-Factory file: each key's emotune equivalent first
        announce_axolotl(config, overrides)  # an Axolotl file: the same
    cfg = load_config(config, overrides)
    if announce:
        _announce(cfg)
    return cfg


def _announce(cfg) -> None:
    """Every command that takes a config prints it resolved first, so a log always says what ran."""
    from emotune.core.config.build import dump_config

    print("Resolved config (defaults < YAML < key=value):\n" + dump_config(cfg), flush=True)


COMMANDS = {
    "run": (_cmd_run, "baseline → LoRA fine-tune → re-measure → compare, into runs/<name>/"),
    "data": (_cmd_data, "validate, clean and split the data with the tokenizer only; write runs/<name>/data/"),
    "eval": (_cmd_eval, "evaluate the base model, an adapter folder or a run folder alone: eval CONFIG [adapter=DIR] [split=test]"),
    "report": (_cmd_report, "write RUN_DIR/report.html (self-contained) and the figures as PNGs"),
    "compare": (_cmd_compare, "finished runs side by side: scores with 95% intervals, paired test against the first, "
                              "setup and cost; terminal, CSV, Markdown, HTML"),
    "train": (_cmd_train, "LoRA fine-tune only, resumable; also under torchrun / accelerate launch"),
    "plan": (_cmd_plan, "estimate training and evaluation memory from the model's config (no weights loaded) and say "
                        "whether the config fits this device or --device-memory, and what to change if not"),
    "doctor": (_cmd_doctor, "report backend (ROCm/CUDA/MPS/CPU), devices, precision support, versions, hints"),
    "export": (_cmd_export, "copy the adapter with its labels and prompt; --merge: a merged full model; --vllm: launch scripts; "
                            "--format gguf|ollama: llama.cpp / Ollama files"),
    "push": (_cmd_push, "upload the adapter (or --merged model) with a model card to the Hugging Face hub or ModelScope"),
    "predict": (_cmd_predict, ("classify texts (arguments or --file in.csv --out out.csv) with a run's adapter or "
                               "merged model; an sft model answers them in free text")),
    "serve": (_cmd_serve, "OpenAI-compatible HTTP server: /v1/classify, /v1/chat/completions, hot-swappable adapters"),
    "sweep": (_cmd_sweep, ("many runs of a config, each with some keys changed (grid, ablation, random/TPE search), "
                           "resumable; one trial per GPU at a time; writes the table and best.yaml")),
    "studio": (_cmd_studio, "a local web page over the runs folder: runs table, run pages, live training progress"),
    "config": (_cmd_config, "print the resolved config (or every field with its documentation, or a LLaMA-Factory "
                            "file's translation)"),
}

# each command's help shows an override that changes what that command does
OVERRIDE_EXAMPLES = {
    "run": "train.max_steps=2",
    "train": "train.max_steps=2",
    "config": "train.max_steps=2",
    "plan": "train.batch_size=8 train.max_length=512",
    "sweep": "train.max_steps=20, before --grid",
    "data": "data.test_limit=200 data.cleaning.duplicates=exact",
    "eval": "eval.method=score, plus this command's adapter=DIR and split=validation",
}


TRAILING = ("overrides", "items", "texts")  # each command's list of positional arguments that takes any number


def build_parser() -> argparse.ArgumentParser:
    from emotune import __version__

    parser = argparse.ArgumentParser(prog="emotune", description=(
        "Turn an instruction-tuned LLM into a measured, deployable model with LoRA: a classifier (tasks classify, "
        "classify_head) or an assistant tuned on instructions (sft)."))
    parser.add_argument("--version", action="version", version=f"emotune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        # argparse %-formats help strings (for %(default)s); a literal % in ours must not reach it
        p = sub.add_parser(name, help=help_text.replace("%", "%%"), description=help_text)
        if name in ("run", "train", "config", "data", "eval", "plan", "sweep"):
            p.add_argument("config", nargs="?", help="YAML config file (optional; defaults are the embedded CPU recipe)")
            p.add_argument("overrides", nargs="*", help=f"dotted key=value overrides, e.g. {OVERRIDE_EXAMPLES[name]}")
        if name == "config":
            p.add_argument("--fields", action="store_true", help="list every config key with its default and docstring")
            p.add_argument("--from-llamafactory", metavar="FILE",
                           help="print the emotune YAML (task: sft) a LLaMA-Factory training YAML translates to, with "
                                "each key's equivalent and the ignored keys as comments; redirect it to save it")
            p.add_argument("--from-axolotl", metavar="FILE",
                           help="the same for an Axolotl training YAML (the file you pass to `axolotl train`)")
        if name == "plan":
            p.add_argument("--device-memory", metavar="SIZE",
                           help="plan for a device with this much memory (e.g. 24GB, 80GiB; GB means GiB) instead of this "
                                "machine's; a GPU unless device=cpu")
            p.add_argument("--json", action="store_true", help="print the plan as JSON")
        if name == "sweep":
            _sweep_options(p)
        if name == "export":
            p.add_argument("run_dir", help="run folder (runs/<name>) or adapter folder")
            p.add_argument("--out", help="output folder (default: RUN_DIR/export)")
            p.add_argument("--merge", action="store_true", help="also write the base with the adapter folded in")
            p.add_argument("--vllm", action="store_true", help="also write vLLM launch scripts and a client example")
            p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                           help="dtype of the merged weights (auto: the base model's own)")
            p.add_argument("--force", action="store_true",
                           help="replace an earlier export in --out (only once the new export is complete; a folder "
                                "export did not write is refused)")
            p.add_argument("--format", default="hf", choices=["hf", "gguf", "ollama"],
                           help="hf: PEFT adapter (+ merged folder with --merge); gguf: also the merged model as one GGUF "
                                "file and the LoRA as a llama.cpp adapter GGUF; ollama: gguf plus a Modelfile")
            p.add_argument("--quant", default="f16", metavar="{f16,bf16,q8_0,q4_0,q4_k_m,...}",
                           help="GGUF weight type (default f16); k-quants are made by llama.cpp's quantizer when installed, "
                                "else the command is printed")
        if name == "push":
            p.add_argument("run_dir", help="run folder (runs/<name>)")
            p.add_argument("--to", required=True, metavar="hf:ORG/NAME|modelscope:ORG/NAME",
                           help="where to upload (the repository is created if missing)")
            p.add_argument("--merged", action="store_true", help="upload the merged model instead of the adapter")
            p.add_argument("--private", action="store_true", help="create the repository as private")
            p.add_argument("--dry-run", metavar="DIR", help="write the folder that would be uploaded to DIR; upload nothing")
        if name == "predict":
            p.add_argument("target", help="run folder, export folder, adapter folder or merged model folder")
            p.add_argument("texts", nargs="*", help="texts to classify (sft models: prompts to answer)")
            p.add_argument("--file", help="file of texts to classify or answer (with --out), read as training data is: "
                                          "CSV, TSV, JSONL, JSON, Parquet, Arrow, TXT, also .gz/.bz2/.xz, or a "
                                          "save_to_disk folder of one split")
            p.add_argument("--out", help="where --file results go (CSV): the input columns + label + p_<label> "
                                         "(sft models: + output); predicted_<name> where the input has that column")
            p.add_argument("--text-column", help="column of --file holding the text (default: the column a classifier "
                                                 "trained on, data.text_column, else text; an sft model reads "
                                                 "a file without one as rows of its training data's format: alpaca, "
                                                 "sharegpt or messages, each prompt built as training built it)")
            p.add_argument("--encoding", help="text encoding of --file (CSV, TSV, JSON, JSONL, TXT), e.g. gbk or "
                                              "latin-1 (default: the run's data.encoding, else utf-8)")
            p.add_argument("--batch-size", type=int, default=16, help="texts per forward pass")
            p.add_argument("--max-new-tokens", type=int,
                           help="sft models: most tokens per greedy reply (default: the run's eval.max_new_tokens)")
            p.add_argument("--device", default="auto", type=_device_name, metavar="{auto,cpu,cuda,cuda:N,mps}",
                           help="where the model runs (default: auto = a GPU if PyTorch sees one, else CPU); ROCm "
                                "(AMD) GPUs are `cuda` in PyTorch; cuda:N picks GPU N")
            p.add_argument("--config", help="for an adapter made by another tool (no emotune.json): a YAML config whose "
                                            "data.label_names, prompt and model.source it was trained with")
            p.add_argument("--labels", help="the same labels as a comma-separated list (overrides the config's)")
        if name == "serve":
            p.add_argument("items", nargs="*", metavar="TARGET|CONFIG|key=value",
                           help="run/adapter folders to serve (name = folder name) or one merged model folder "
                                "(emotune export --merge), an optional YAML config, "
                                "and overrides such as serve.port=8001 serve.api_key=env:EMOTUNE_API_KEY")
            p.add_argument("--engine", choices=["native", "vllm"], help="same as serve.engine=...")
            p.add_argument("--no-auth", action="store_true", help="serve without an API key (serve.no_auth=true); "
                                                                  "loopback hosts only")
        if name == "report":
            p.add_argument("run_dir", help="a run folder, e.g. runs/cpu")
        if name == "compare":
            p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run folders; the first is the "
                                                                            "reference of the paired test")
            p.add_argument("--out", help="folder for compare.csv/.md/.html/.json (default: ./compare, replaced whole)")
            p.add_argument("--allow-mismatch", action="store_true",
                           help="show runs measured on other labels or test rows, marked not comparable, instead of "
                                "refusing them")
        if name == "studio":
            p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only); any other "
                                                               "needs a token (EMOTUNE_STUDIO_TOKEN or --token-file)")
            p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
            p.add_argument("--runs", default="runs", help="the runs folder to show (default: runs)")
            p.add_argument("--token-file", help="file holding the token a non-loopback studio requires")
        if name == "doctor":
            p.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", nargs="+", default=[], metavar="KEY=VALUES",
                   help="what varies: key=v1,v2,... (e.g. lora.r=8,16,32 train.learning_rate=1e-4,2e-4), or for "
                        "--search a range: loguniform(1e-5,1e-3), uniform(a,b), int(a,b), choice(a,b,c); these keys "
                        "replace the same keys of sweep.grid")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ablation", action="store_true",
                      help="one factor at a time: the config as it is, then each value of each key alone (sweep.mode)")
    mode.add_argument("--search", choices=["random", "tpe"], help="draw --trials trials with Optuna (sweep.mode)")
    p.add_argument("--trials", type=int, help="how many trials a search draws in all (sweep.trials)")
    p.add_argument("--seeds", type=int, help="run each grid or ablation trial with this many seeds (sweep.seeds)")
    p.add_argument("--metric", help="after-training metric that ranks trials, e.g. macro_f1, accuracy, rouge_l "
                                    "(sweep.metric)")
    p.add_argument("--backend", choices=["local", "ray"], help="where trials run (sweep.backend)")


def _device_name(text: str) -> str:
    if text in ("auto", "cpu", "cuda", "mps") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"`{text}` is not a device: use auto, cpu, cuda, cuda:N (e.g. cuda:1) or mps; "
                                     "ROCm (AMD) GPUs are cuda in PyTorch")


def interruptible() -> None:
    """Ctrl-C (SIGINT) always stops a command cleanly (the stage marked failed, the lock given back, resumable), also
    when emotune inherited SIGINT ignored: a non-interactive shell starts its background jobs so (`emotune run CFG &`,
    and a studio started that way passes it on to the runs its Stop button must interrupt)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def process_defaults() -> None:
    """Settings that libraries read from the environment on first use; a value the user set wins."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # On CPU, PyTorch's oneDNN bridge (ideep) and oneDNN itself cache kernels per input shape, 1,024 of
    # each by default. Batches change width at nearly every training step, so together they grew by
    # ~10 MB a step (pytorch#27971); bounded, they hold a few steps' shapes (no slower in
    # bench/train_speed.py).
    os.environ.setdefault("LRU_CACHE_CAPACITY", "16")
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
    from emotune.model.quantization import import_bitsandbytes_offline

    import_bitsandbytes_offline()  # before PEFT imports it: no kernel download from the hub (see there)


def main(argv: list[str] | None = None) -> int:
    process_defaults()
    interruptible()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `emotune plan CONFIG --device-memory 24GB train.batch_size=8`, `emotune serve RUN --no-auth serve.port=8001`,
    # `emotune predict RUN --device cpu "text"`: argparse ends a trailing list at the first flag; what follows the
    # flags belongs to it
    trailing = next((name for name in TRAILING if hasattr(args, name)), None)
    if extra and trailing and all(not e.startswith("-") and ("=" in e or trailing != "overrides") for e in extra):
        setattr(args, trailing, getattr(args, trailing) + extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
