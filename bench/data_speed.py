"""Data preparation at scale: generate a 1,000,000-row CSV, then prepare it as `emotune data` does
(read, validate, clean with every text step on, deduplicate, split 80/10/10, remove leakage, write the
prepared folder). Prints one JSON line: rows, seconds, rows_per_s, peak_rss_mb.

The preparation runs in a child process so its peak RSS is its own, not the generator's.
Targets on a 2-core machine: under 60 s and under 2 GiB peak RSS.

    PYTHONPATH=src python bench/data_speed.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]
SHARES = [0.29, 0.34, 0.08, 0.13, 0.12, 0.04]  # the emotion dataset's imbalance


def generate_csv(path: Path, rows: int, seed: int = 0) -> None:
    """Tweet-like rows: 6-40 words, some URLs, @mentions, emoji, messy spacing and repeated texts."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(5000)] + ["i", "feel", "so", "really", "today", "the", "my"])
    labels = rng.choice(len(LABELS), size=rows, p=SHARES)
    lengths = rng.integers(6, 40, size=rows)
    words = vocab[rng.integers(0, len(vocab), size=int(lengths.sum()))]
    cuts = np.cumsum(lengths)[:-1]
    texts = [" ".join(chunk) for chunk in np.split(words, cuts)]
    extras = rng.random(rows)
    for i in np.flatnonzero(extras < 0.02):
        texts[i] += " https://t.co/" + str(i)
    for i in np.flatnonzero((extras >= 0.02) & (extras < 0.04)):
        texts[i] = "@user" + str(i % 97) + "  " + texts[i]
    for i in np.flatnonzero((extras >= 0.04) & (extras < 0.05)):
        texts[i] += " 😀"
    for i in np.flatnonzero((extras >= 0.05) & (extras < 0.06)):
        texts[i] = texts[i - 1].upper()  # a normalised duplicate
    table = pa.table({"text": texts, "label": pa.array(np.array(LABELS)[labels])})
    pa_csv.write_csv(table, path)


def prepare(csv_path: str, out_dir: str) -> None:
    """The child: prepare the file and print its own timing."""
    from emotune.core.config.load import load_config
    from emotune.data.load import load_data
    from emotune.data.prepare import data_fingerprint, save_prepared

    cfg = load_config(None, [f"data.source={csv_path}", f"output_dir={out_dir}", "name=bench",
                             "data.cleaning.urls=replace", "data.cleaning.mentions=replace", "data.cleaning.emoji=replace"])
    started = time.perf_counter()
    data = load_data(cfg.data, cfg.seed)
    data.report["fingerprint"] = data_fingerprint(cfg)
    save_prepared(data, cfg.run_dir)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "rows_out": data.report["rows"], "cleaning": data.report["cleaning"]["dropped"]}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prepare(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "data.csv"
        generate_csv(csv_path, args.rows)
        child = subprocess.run([sys.executable, __file__, "--child", str(csv_path), str(Path(tmp) / "runs")],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.exit(child.stderr)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
        print(json.dumps({"rows": args.rows, "seconds": round(result["seconds"], 2),
                          "rows_per_s": round(args.rows / result["seconds"]), "peak_rss_mb": round(peak_mb),
                          "csv_mb": round(csv_path.stat().st_size / 2**20), "rows_out": result["rows_out"],
                          "removed": result["cleaning"]}))


if __name__ == "__main__":
    main()
