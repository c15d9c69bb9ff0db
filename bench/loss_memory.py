"""Peak memory of the answer-token loss: emotune's chunked projection + cross-entropy against the plain one.

    PYTHONPATH=src python bench/loss_memory.py [--positions 2048] [--vocab 262144] [--hidden 640]

The loss of a batch whose answers hold `--positions` tokens in all, through a vocabulary projection of the
size of Gemma 3's (262,144 entries, hidden size 640 for the 270M model; Gemma 4 E4B: --hidden 2560): the
hidden states at the answer positions (requires grad), the frozen output embedding, forward and backward.
  full:    logits = hidden @ W.T for every position at once (what a trainer that projects the whole batch
           keeps, before it even counts the prompt positions emotune skips), then cross-entropy;
  chunked: emotune.train.batches.chunked_loss, CHUNK_TOKENS positions at a time, each chunk recomputed in backward.
Each mode runs in its own subprocess; its peak RSS above the RSS after building the inputs is its own. The
two losses and the gradients of the hidden states are compared (they must agree). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2048, help="answer tokens in the batch")
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--mode", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    results = {}
    for mode in ("full", "chunked"):
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--positions", str(args.positions),
                               "--vocab", str(args.vocab), "--hidden", str(args.hidden)], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(lines[-1].removeprefix("RESULT "))
    full, chunked = results["full"], results["chunked"]
    from emotune.train.batches import CHUNK_TOKENS

    print(json.dumps({
        "positions": args.positions, "vocab": args.vocab, "hidden": args.hidden, "chunk_tokens": CHUNK_TOKENS,
        "full_logits_mb": round(args.positions * args.vocab * 4 / 2 ** 20),
        "full_peak_mb": full["peak_above_inputs_mb"], "chunked_peak_mb": chunked["peak_above_inputs_mb"],
        "mem_ratio": round(chunked["peak_above_inputs_mb"] / full["peak_above_inputs_mb"], 3),
        "loss_rel_diff": float(f"{abs(full['loss'] - chunked['loss']) / abs(full['loss']):.3g}"),
        "grad_max_abs_diff": max(abs(a - b) for a, b in zip(full["grad_sample"], chunked["grad_sample"], strict=False)),
        "full_seconds": full["seconds"], "chunked_seconds": chunked["seconds"],
    }))


def measure(args: argparse.Namespace) -> dict:
    import time

    import torch
    import torch.nn.functional as F

    from emotune.train.batches import chunked_loss

    torch.manual_seed(0)
    hidden = torch.randn(args.positions, args.hidden, requires_grad=True)
    # frozen, like the tied embedding; in place: no transient copy in the baseline peak
    weight = torch.randn(args.vocab, args.hidden).mul_(args.hidden ** -0.5)
    targets = torch.randint(0, args.vocab, (args.positions,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    started = time.perf_counter()
    if args.mode == "full":
        loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    else:
        loss = chunked_loss(hidden, weight, targets, None).loss_sum
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"loss": float(loss), "grad_sample": hidden.grad.flatten()[:: max(1, hidden.numel() // 1000)].tolist(),
            "peak_above_inputs_mb": round((peak - before) / 1024, 1), "seconds": round(seconds, 2)}


if __name__ == "__main__":
    main()
