"""LoRA dropout under the shared prompt head: does one mask per pass for the head move the final loss?

    PYTHONPATH=src python bench/prefix_dropout.py [--seeds 1 2 3 4 5] [--rows 256] [--data FILE]

With `train.shared_prefix=auto` the prompt head every row shares runs once per forward pass, so with
`lora.dropout` > 0 its tokens draw one dropout mask per pass instead of one per row (docs/training.md, "The
shared prompt head"). This trains emotune's side of bench/train_speed.py (the packaged Gemma 3 270M, one epoch
of the first --rows emotion rows, LoRA r 16 / dropout 0.05 on all linear layers, batch 8, no gradient
checkpointing) once per seed with the head shared (`auto`) and once with whole rows (`off`): each run in its own
subprocess, one after the other. The final loss is train_speed's: the completion-only loss of the trained model,
in eval mode, over all the training rows.

The seed sets the row order, the initial adapter and the dropout masks, so the `off` runs' spread over seeds is
the run-to-run variation a user sees anyway. The same seed under `auto` and `off` orders the rows alike and
starts from the same adapter; only the masks differ. Prints one JSON line: the final losses per mode and seed,
each mode's mean and sample standard deviation, the paired differences (auto - off, per seed), and
`within_spread`: the largest |paired difference| is at most the `off` runs' range over seeds and the difference
of the means at most their standard deviation. `--model` trains another model folder (the test runs it tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TRAIN_SPEED = Path(__file__).resolve().with_name("train_speed.py")
DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "emotion" / "train.jsonl"
MODES = ("auto", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--model", help="model folder (default: the packaged Gemma 3 270M)")
    args = parser.parse_args()
    if len(args.seeds) < 2 or len(set(args.seeds)) != len(args.seeds):
        sys.exit("--seeds: give at least two different seeds; the spread over seeds is what the difference is "
                 "compared with.")
    if not args.data.is_file():
        print(json.dumps({"skipped": f"{args.data} not found; this benchmark needs the emotion dataset there"}))
        return
    runs = {mode: {seed: run(mode, seed, args) for seed in args.seeds} for mode in MODES}
    print(json.dumps(summarise(runs, args)))


def run(mode: str, seed: int, args: argparse.Namespace) -> dict:
    """emotune's side of bench/train_speed.py, in a subprocess: its RESULT line."""
    command = [sys.executable, str(TRAIN_SPEED), "--side", "ours", "--rows", str(args.rows), "--data", str(args.data),
               "--seed", str(seed), "--ours-shared-prefix", mode, "--ours-no-gradient-checkpointing",
               *(["--model", args.model] if args.model else [])]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"the run with train.shared_prefix={mode}, seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summarise(runs: dict[str, dict[int, dict]], args: argparse.Namespace) -> dict:
    final = {mode: {seed: r["losses"]["final"] for seed, r in by_seed.items()} for mode, by_seed in runs.items()}
    seeds = list(final["off"])
    paired = [final["auto"][s] - final["off"][s] for s in seeds]
    off = list(final["off"].values())
    mean = {mode: statistics.fmean(values.values()) for mode, values in final.items()}
    std = {mode: statistics.stdev(values.values()) for mode, values in final.items()}
    off_range = max(off) - min(off)
    shared_tokens = {r["shared_prefix_tokens"] for r in runs["auto"].values()}
    return {
        "final_loss": {mode: {str(s): v for s, v in values.items()} for mode, values in final.items()},
        "mean": {m: round(v, 5) for m, v in mean.items()}, "std": {m: round(v, 5) for m, v in std.items()},
        "off_range": round(off_range, 5),
        "paired_diff": {str(s): round(d, 5) for s, d in zip(seeds, paired, strict=False)},
        "max_abs_paired_diff": round(max(map(abs, paired)), 5),
        "mean_diff": round(mean["auto"] - mean["off"], 5),
        "within_spread": max(map(abs, paired)) <= off_range and abs(mean["auto"] - mean["off"]) <= std["off"],
        "shared_prefix_tokens": sorted(shared_tokens), "seeds": seeds, "rows": args.rows,
        "steps": runs["off"][seeds[0]]["steps"], "precision": runs["off"][seeds[0]]["precision"],
        "seconds": {mode: round(sum(r["seconds"] for r in by_seed.values()), 1) for mode, by_seed in runs.items()},
    }


if __name__ == "__main__":
    main()
