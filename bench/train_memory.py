"""Peak memory of emotune's training step under allocator, cache and batching settings, on the packaged model.

    PYTHONPATH=src python bench/train_memory.py [--micro-rows N] [--lru-cache-capacity N] [--trim]
        [--mmap-threshold BYTES] [--arena-max N] [--pad-multiple N] [--no-gradient-checkpointing]

Trains LoRA (r 16, all-linear, AdamW) on the packaged Gemma 3 270M for 12 steps of 8 rows from
../shared/datasets/emotion/train.jsonl with emotune's completion-only loss, and prints one JSON line:
seconds per step (steps 3-12), the process's peak RSS, and the peak after loading. One setting per
process: glibc and oneDNN read theirs once. `--micro-rows` cuts each batch (sorted longest first)
into forward passes of N rows, as train.max_tokens_per_pass does; `--lru-cache-capacity` bounds
ideep's per-shape kernel cache (emotune.cli.process_defaults sets it); `--trim` calls malloc_trim(0)
after each step; `--mmap-threshold` fixes glibc's M_MMAP_THRESHOLD (and M_TRIM_THRESHOLD) via
mallopt, as MALLOC_MMAP_THRESHOLD_ would: buffers at least that large go back to the system when
freed; `--arena-max` sets M_ARENA_MAX; `--pad-multiple` pads every batch to a multiple of N tokens.
Used to find where the trainer's peak RSS goes (docs/training.md, Memory on CPUs). Its micro-rows figure is why
train.max_tokens_per_pass=auto used to cap CPU passes at 512 padded tokens; `auto` is now sized from the free RAM
(emotune.train.pass_size) and can take a whole update in one pass, and train.max_tokens_per_pass=512 keeps the
smaller footprint measured here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "emotion" / "train.jsonl"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mmap-threshold", type=int, default=0, help="bytes; 0 keeps glibc's dynamic default")
    parser.add_argument("--pad-multiple", type=int, default=0, help="pad every batch to a multiple of N tokens")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--micro-rows", type=int, default=0, help="split each batch of 8 rows into parts of N rows")
    parser.add_argument("--lru-cache-capacity", type=int, default=0, help="ideep's LRU_CACHE_CAPACITY, set after importing torch")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after every step")
    parser.add_argument("--arena-max", type=int, default=0, help="glibc M_ARENA_MAX; 0 keeps the default")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if not args.data.is_file():
        print(json.dumps({"skipped": f"{args.data} not found; this benchmark needs the emotion dataset there"}))
        return
    libc = ctypes.CDLL("libc.so.6")
    if args.arena_max:
        libc.mallopt(M_ARENA_MAX, args.arena_max)
    if args.mmap_threshold:
        libc.mallopt(M_MMAP_THRESHOLD, args.mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, args.mmap_threshold)

    import torch
    import torch.nn.functional as F

    if args.lru_cache_capacity:
        os.environ["LRU_CACHE_CAPACITY"] = str(args.lru_cache_capacity)
    from datasets import load_dataset

    from emotune.core.config.load import load_config
    from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir
    from emotune.model.lora import attach_lora
    from emotune.tasks.classify.task import encode_examples
    from emotune.train.batches import collate, completion_loss

    cfg = load_config(None, ["lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear", "device=cpu"])
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    rows = load_dataset("json", data_files=str(args.data), split="train").select(range(96))
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    examples = encode_examples(rows, tokenizer, cfg.prompt, labels, 256)
    model.config.use_cache = False
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    adapted = attach_lora(model, cfg.lora)
    adapted.train()
    if not args.no_gradient_checkpointing:
        adapted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-4)
    for step in range(12):
        if step == 2:
            started = time.perf_counter()
        rows_of_step = sorted(examples[step * 8:(step + 1) * 8], key=lambda e: -len(e.input_ids))
        micro = args.micro_rows or 8
        for part in range(0, 8, micro):
            batch = collate(rows_of_step[part:part + micro], tokenizer.pad_token_id, torch.device("cpu"))
            if args.pad_multiple:
                extra = -batch["input_ids"].shape[1] % args.pad_multiple
                batch["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=tokenizer.pad_token_id)
                batch["attention_mask"] = F.pad(batch["attention_mask"], (0, extra))
                batch["predicts"] = F.pad(batch["predicts"], (0, extra))
            completion_loss(adapted, batch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.trim:
            libc.malloc_trim(0)
    print(json.dumps({"seconds_per_step": round((time.perf_counter() - started) / 10, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "load_peak_rss_mb": round(load_peak, 1), "trim": args.trim, "lru_cache_capacity": args.lru_cache_capacity,
                      "micro_rows": args.micro_rows, "arena_max": args.arena_max,
                      "mmap_threshold": args.mmap_threshold, "pad_multiple": args.pad_multiple,
                      "gradient_checkpointing": not args.no_gradient_checkpointing}))


if __name__ == "__main__":
    main()
