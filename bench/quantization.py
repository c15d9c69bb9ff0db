"""QLoRA and the LoRA methods side by side on the packaged Gemma 3 270M, on the CPU: one JSON line per setting.

    PYTHONPATH=src python bench/quantization.py [--steps 40] [--test-limit 100] [--only none,4bit,...] [--out DIR]
                                                [--seed N]

Each setting is one `emotune run configs/cpu.yaml` in its own process (so the peak memory is its own), with the same
data, seed and number of optimizer steps: `none`, `8bit` and `4bit` (model.quantization; NF4 + double quantization)
and `4bit-loftq` (QLoRA + LoftQ: lora.init=loftq over the 4-bit base), then the methods at equal steps over the
unquantized base: `adamw_8bit`, `loraplus` (ratio 16), `pissa`, `olora`, `loftq` and `dora`, and the whole-weight
methods `full` and `freeze` (the last 2 layers; each at the learning rate LLaMA-Factory's examples use for it). A
line holds the process's peak RSS after the last step (`peak_memory_mb`, the training log's), training tokens per
second over the last logging window, and macro-F1 of the packaged test split (data.test_limit rows) before and
after, by label scoring and by generation. Timings depend on what else the machine runs: compare lines of one
invocation, not across machines. `--seed N` runs every setting with `seed=N` (LoRA's start, dropout and the order of
the rows; the packaged splits stay), its run folders named `<setting>-seed<N>`: the spread between seeds says how much
of a difference between settings is the seed's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "none": [],
    "8bit": ["model.quantization=8bit"],
    "4bit": ["model.quantization=4bit"],
    "4bit-loftq": ["model.quantization=4bit", "lora.init=loftq"],
    "adamw_8bit": ["train.optim=adamw_8bit"],
    "loraplus": ["train.loraplus_lr_ratio=16"],
    "pissa": ["lora.init=pissa"],
    "olora": ["lora.init=olora"],
    "loftq": ["lora.init=loftq"],
    "dora": ["lora.use_dora=true"],
    # Whole-weight tuning at the learning rates LLaMA-Factory's examples use for it (LoRA's 3e-4 is too high for them).
    "full": ["train.finetuning=full", "train.learning_rate=1e-5"],
    "freeze": ["train.finetuning=freeze", "train.freeze_trainable_layers=2", "train.learning_rate=1e-4"],
}


def run_setting(name: str, overrides: list[str], args: argparse.Namespace, out: Path) -> dict:
    seeded = [] if args.seed is None else [f"seed={args.seed}"]
    folder = out / (name if args.seed is None else f"{name}-seed{args.seed}")
    command = [sys.executable, "-m", "emotune", "run", str(ROOT / "configs" / "cpu.yaml"), f"name={folder.name}",
               f"output_dir={out}", f"train.max_steps={args.steps}", f"data.test_limit={args.test_limit}",
               f"train.logging_steps={args.steps}", *seeded, *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return {"setting": name, "overrides": overrides, "error": done.stderr.strip().splitlines()[-1:]}
    log = [e for e in json.loads((folder / "train" / "log_history.json").read_text()) if "tokens_per_s" in e]
    metrics = json.loads((folder / "comparison.json").read_text())["metrics"]
    f1 = {key: metrics[key] for key in metrics if "macro_f1" in key}
    seed = {} if args.seed is None else {"seed": args.seed}
    return {"setting": name, "overrides": overrides, **seed, "steps": args.steps, "test_rows": args.test_limit,
            "peak_memory_mb": log[-1]["peak_memory_mb"], "tokens_per_s": log[-1]["tokens_per_s"],
            "last_loss": round(log[-1]["loss"], 4), "macro_f1": f1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--test-limit", type=int, default=100)
    parser.add_argument("--only", default=",".join(SETTINGS), help="comma-separated settings to run")
    parser.add_argument("--out", type=Path, default=None, help="where the run folders go (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=None, help="seed= for every run (default: the config's)")
    args = parser.parse_args()
    unknown = [name for name in args.only.split(",") if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        for name in args.only.split(","):
            print(json.dumps(run_setting(name, SETTINGS[name], args, out)), flush=True)


if __name__ == "__main__":
    main()
