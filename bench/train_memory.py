"""Peak memory of emotune's training step under allocator and padding settings, on the packaged model.

    PYTHONPATH=src python bench/train_memory.py [--mmap-threshold BYTES] [--pad-multiple N] [--no-gradient-checkpointing]

Trains LoRA (r 16, all-linear, AdamW) on the packaged Gemma 3 270M for 12 steps of 8 rows from
../shared/datasets/emotion/train.jsonl with emotune's completion-only loss, and prints one JSON line:
seconds per step (steps 3-12) and the process's peak RSS. Run one setting per process: glibc's
allocator settings apply from the moment they are set. `--mmap-threshold` fixes glibc's
M_MMAP_THRESHOLD (and M_TRIM_THRESHOLD) via mallopt, as the environment variable
MALLOC_MMAP_THRESHOLD_ would: buffers at least that large are returned to the system when freed.
Used to find where the trainer's peak RSS goes (README, Training engine).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "emotion" / "train.jsonl"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mmap-threshold", type=int, default=0, help="bytes; 0 keeps glibc's dynamic default")
    parser.add_argument("--pad-multiple", type=int, default=0, help="pad every batch to a multiple of N tokens")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if not args.data.is_file():
        print(json.dumps({"skipped": f"{args.data} not found; this benchmark needs the emotion dataset there"}))
        return
    if args.mmap_threshold:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, args.mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, args.mmap_threshold)

    import torch
    import torch.nn.functional as F
    from datasets import load_dataset

    from emotune.batches import collate, completion_loss, encode_examples
    from emotune.config import load_config
    from emotune.lora import attach_lora
    from emotune.models import load_model, load_tokenizer, resolve_model_dir

    cfg = load_config(None, ["lora.r=16", "lora.alpha=32", "lora.target_modules=all-linear", "device=cpu"])
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    rows = load_dataset("json", data_files=str(args.data), split="train").select(range(96))
    labels = ["sadness", "joy", "love", "anger", "fear", "surprise"]
    examples = encode_examples(rows, tokenizer, cfg.prompt, labels, 256)
    model.config.use_cache = False
    adapted = attach_lora(model, cfg.lora)
    adapted.train()
    if not args.no_gradient_checkpointing:
        adapted.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-4)
    for step in range(12):
        if step == 2:
            started = time.perf_counter()
        batch = collate(examples[step * 8:(step + 1) * 8], tokenizer.pad_token_id, torch.device("cpu"))
        if args.pad_multiple:
            extra = -batch["input_ids"].shape[1] % args.pad_multiple
            batch["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=tokenizer.pad_token_id)
            batch["attention_mask"] = F.pad(batch["attention_mask"], (0, extra))
            batch["predicts"] = F.pad(batch["predicts"], (0, extra))
        completion_loss(adapted, batch).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"seconds_per_step": round((time.perf_counter() - started) / 10, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "mmap_threshold": args.mmap_threshold, "pad_multiple": args.pad_multiple,
                      "gradient_checkpointing": not args.no_gradient_checkpointing}))


if __name__ == "__main__":
    main()
