"""The forgetting probe's two scoring methods on the packaged Gemma 3 270M base model, side by side.

    python bench/probe_methods.py [--questions 40] [--batch-size 16]

Scores the same stratified probe subset (emotune.eval.probe.load_probe(limit=N)) with `option` (each choice's
own text, mean log-likelihood per token) and `letter` (the letter A-D after a listing of the choices),
and prints one JSON line: accuracy with its 95 % bootstrap interval and seconds per method, and their
ratios. Run it with nothing else on the machine: the seconds are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emotune.core.config.load import load_config
    from emotune.eval.probe import load_probe, score_probe
    from emotune.model.loading import resolve_model_dir

    folder = resolve_model_dir(load_config(None, []).model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    questions = load_probe(limit=args.questions)
    line = {"questions": len(questions), "threads": torch.get_num_threads()}
    for method in ("option", "letter"):
        start = time.perf_counter()
        summary = score_probe(model, tokenizer, questions, batch_size=args.batch_size, method=method).summary()
        line[method] = {"accuracy": round(summary["accuracy"], 4), "low": round(summary["low"], 4),
                        "high": round(summary["high"], 4), "seconds": round(time.perf_counter() - start, 1)}
    line["accuracy_gain"] = round(line["option"]["accuracy"] - line["letter"]["accuracy"], 4)
    line["time_ratio"] = round(line["option"]["seconds"] / max(line["letter"]["seconds"], 1e-9), 2)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
