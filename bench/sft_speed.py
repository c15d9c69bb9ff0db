"""Instruction-tuning speed and memory: emotune's trainer against TRL's SFTTrainer, side by side.

    pip install -e ".[bench]"   # TRL, for the reference side
    PYTHONPATH=src python bench/sft_speed.py [--rows 32] [--turns 3] [--batch-size 4]

The rows: the packaged instruction dataset's training rows (emotune/datasets/instruct), chained in file
order into multi-turn conversations of `--turns` answered turns each, so every row has several assistant
turns and long stretches of answer tokens (the loss falls on all of them, end-of-turn token included).
Both sides train the same model (the packaged Gemma 3 270M unless --model names a Hugging Face folder) on
the same `--rows` conversations for one epoch, with the same LoRA (r 16, alpha 32, dropout 0.05,
all-linear), optimiser (AdamW, lr 2e-4, linear schedule, 5% warmup, clip 1.0), batch, max length, dtype
(bf16 where the CPU has it, else fp32), gradient checkpointing (on for both; --no-gradient-checkpointing
turns it off for both) and seed:
  (a) the reference: TRL SFTTrainer on `messages` rows with assistant_only_loss=True. TRL finds the
      answer tokens through `{% generation %}` markers in the chat template, which emotune's Gemma turn
      format has no need for: TRL gets a marked copy of the same template. Before training, the reference
      side checks that TRL's tokenized rows and emotune's encoding have identical token ids and identical
      loss masks, row by row (the JSON says so, or the script stops).
  (b) emotune.train.loop.train on the rows emotune.tasks.sft.rows encodes: the vocabulary projection only at
      answer positions, in chunks for long answers, forward passes of at most train.max_tokens_per_pass
      padded tokens (auto: 512 on a CPU), and the `emotune` command's process settings.
Each side runs in its own fresh subprocess, so each peak RSS is its own. Before training, each side computes
the loss of the same first batch (adapters start as a no-op, so this is the base model's answer-token loss
under each side's code): the objectives must agree (`identical_batch_rel_diff`, target < 1e-3). Tokens/s
counts every token of every row (prompt and answer), the same total on both sides.
Prints one JSON line. Measure with nothing else running: on a 2-core machine a second job skews it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LORA = ["lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear"]
TRAIN = ["train.gradient_accumulation_steps=1", "train.learning_rate=2e-4", "train.lr_scheduler_type=linear",
         "train.warmup_ratio=0.05", "train.max_steps=-1", "train.num_train_epochs=1", "train.logging_steps=1",
         "train.optim=adamw_torch", "train.max_grad_norm=1.0", "train.eval_steps=1000000"]
# The one line of emotune's Gemma turn format that writes a turn's text and its end of turn; the reference's copy
# wraps an assistant turn's text and end-of-turn in TRL's generation markers (what TRL's loss mask follows).
TURN_BODY = "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
MARKED_TURN_BODY = ("{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] | trim }}"
                    "{{ '<end_of_turn>\n' }}{% endgeneration %}{%- else -%}{{ message['content'] | trim }}"
                    "{{ '<end_of_turn>\n' }}{%- endif -%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="conversations trained on (one epoch)")
    parser.add_argument("--turns", type=int, default=3, help="answered turns per conversation")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=1024, help="train.max_length; no row may be longer")
    parser.add_argument("--model", default="embedded", help="model.source: embedded, or a local Hugging Face folder")
    parser.add_argument("--no-gradient-checkpointing", action="store_true", help="turn it off on both sides")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--side", choices=["ref", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        sys.exit("bench/sft_speed.py runs the reference with TRL's SFTTrainer, and TRL is not installed (emotune "
                 "itself does not need it). Install the benchmark extra: pip install -e \".[bench]\"")
    if args.side:
        print("RESULT " + json.dumps(run_side(args)), flush=True)
        return
    ref, ours = (_subprocess(side, args) for side in ("ref", "ours"))
    print(json.dumps({
        "ref_tokens_per_s": ref["tokens_per_s"], "ours_tokens_per_s": ours["tokens_per_s"],
        "ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 2),
        "ref_peak_rss_mb": ref["peak_rss_mb"], "ours_peak_rss_mb": ours["peak_rss_mb"],
        "mem_ratio": round(ours["peak_rss_mb"] / ref["peak_rss_mb"], 2),
        "identical_batch_loss": {"ref": ref["identical_batch"], "ours": ours["identical_batch"]},
        "identical_batch_rel_diff": round(abs(ours["identical_batch"] - ref["identical_batch"]) / abs(ref["identical_batch"]), 6),
        "tokenization_identical": ref["tokenization_identical"],
        "final_step_loss": {"ref": ref["last_loss"], "ours": ours["last_loss"]},
        "rows": args.rows, "turns": args.turns, "tokens": ours["tokens"], "answer_tokens": ours["answer_tokens"],
        "steps": ours["steps"], "batch_size": args.batch_size, "precision": ours["precision"],
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "ref_seconds": ref["seconds"], "ours_seconds": ours["seconds"], "model": args.model, "seed": args.seed,
    }))


def _subprocess(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--side", side, "--rows", str(args.rows), "--turns", str(args.turns),
               "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--model", args.model,
               "--seed", str(args.seed)] + ["--no-gradient-checkpointing"] * args.no_gradient_checkpointing
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# --------------------------------------------------------------------------------------------------
# One side, in its own process


def conversations(rows: int, turns: int, seed: int):
    """`rows` conversations of `turns` answered turns, chained from the packaged training rows in file order."""
    from emotune.core.config.sft import SftDataConfig
    from emotune.data.conversation_data import load_conversations
    from emotune.data.conversations import Conversation

    single = load_conversations(SftDataConfig(source="embedded"), seed).splits["train"]
    if len(single) < rows * turns:
        sys.exit(f"--rows {rows} x --turns {turns} needs {rows * turns} packaged rows; there are {len(single)}.")
    return [Conversation(tuple(m for c in single[i * turns:(i + 1) * turns] for m in c.messages))
            for i in range(rows)]


def run_side(args: argparse.Namespace) -> dict:
    if args.side == "ours":  # as the `emotune` command starts
        from emotune.cli import process_defaults

        process_defaults()
    import torch
    from transformers import set_seed

    from emotune.core.config.load import load_config
    from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir
    from emotune.runtime import device as device_mod
    from emotune.tasks.sft.rows import encode_all
    from emotune.train.batches import collate, completion_loss

    checkpointing = str(not args.no_gradient_checkpointing).lower()
    cfg = load_config(None, ["task=sft", f"model.source={args.model}", *LORA, *TRAIN, f"seed={args.seed}",
                             f"train.batch_size={args.batch_size}", f"train.max_length={args.max_length}",
                             f"train.gradient_checkpointing={checkpointing}", "device=cpu"])
    set_seed(cfg.seed)
    rows = conversations(args.rows, args.turns, cfg.seed)
    precision = device_mod.choose_precision(torch.device("cpu"), "auto")
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_model(model_dir, precision.dtype, torch.device("cpu"))
    encoded = encode_all(rows, tokenizer, None, False, cfg.train.max_length)
    if encoded.truncated:
        sys.exit(f"{encoded.truncated} conversations are longer than --max-length {args.max_length}; raise it.")
    examples = encoded.examples
    tokens = sum(len(e.input_ids) for e in examples)
    answer_tokens = sum(end - start for e in examples for start, end in e.loss_spans)
    first = examples[:args.batch_size]

    if args.side == "ours":
        from emotune.core.rundir import RunDir
        from emotune.train.loop import train

        model.eval()
        with torch.no_grad():
            parts = completion_loss(model, collate(first, tokenizer.pad_token_id, torch.device("cpu")))
        identical = float(parts.loss_sum) / parts.tokens
        with tempfile.TemporaryDirectory() as run_dir:
            started = time.perf_counter()
            train(model, tokenizer, examples, [], cfg, precision, RunDir(run_dir), {"task": "sft"})
            seconds = time.perf_counter() - started
            history = json.loads((Path(run_dir) / "train" / "log_history.json").read_text())
        same = None
    else:
        identical, seconds, history, same = _reference(model, tokenizer, rows, examples, cfg, precision)
    losses = [e["loss"] for e in history if "loss" in e]
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "answer_tokens": answer_tokens,
            "seconds": round(seconds, 1), "steps": len(losses), "precision": precision.name,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
            "identical_batch": round(identical, 6), "last_loss": round(losses[-1], 5) if losses else None,
            "tokenization_identical": same}


def _reference(model, tokenizer, rows, examples, cfg, precision):
    """TRL SFTTrainer, assistant-only loss, on a marked copy of the same chat template."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from emotune.model.lora import lora_config

    if TURN_BODY not in tokenizer.chat_template:
        sys.exit("The tokenizer's chat template is not emotune's Gemma turn format, so the reference's marked copy "
                 "cannot be made from it; use the embedded model or a folder without its own template.")
    tokenizer.chat_template = tokenizer.chat_template.replace(TURN_BODY, MARKED_TURN_BODY)
    t = cfg.train
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, num_train_epochs=1, per_device_train_batch_size=t.batch_size,
                         learning_rate=t.learning_rate, lr_scheduler_type="linear", warmup_steps=t.warmup_ratio,  # a float < 1: a ratio
                         max_length=t.max_length, assistant_only_loss=True, packing=False,
                         gradient_checkpointing=t.gradient_checkpointing, bf16=precision.name == "bf16",
                         logging_steps=1, save_strategy="no", report_to="none", seed=cfg.seed, data_seed=cfg.seed,
                         use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch",
                         max_grad_norm=t.max_grad_norm)
        dataset = Dataset.from_list([{"messages": c.chat()} for c in rows])
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=lora_config(cfg.lora, model))
        same = _same_tokens(trainer.train_dataset, examples)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(t.batch_size)])
        trainer.model.eval()  # no dropout: the same deterministic loss as the other side
        with torch.no_grad(), trainer.compute_loss_context_manager():
            identical = float(trainer.compute_loss(trainer.model, batch))
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        return identical, seconds, trainer.state.log_history, same


def _same_tokens(tokenized, examples) -> bool:
    """TRL's ids and assistant mask equal emotune's ids and loss spans for every row, or the script stops."""
    for i, (row, example) in enumerate(zip(tokenized, examples, strict=False)):
        mask = [0] * len(example.input_ids)
        for start, end in example.loss_spans:
            mask[start:end] = [1] * (end - start)
        # TRL folds its assistant mask into a `labels` column (-100 where no loss falls)
        theirs = [int(label != -100) for label in row["labels"]] if "labels" in row else list(row["assistant_masks"])
        if list(row["input_ids"]) != list(example.input_ids) or theirs != mask:
            sys.exit(f"Row {i}: TRL's tokenization differs from emotune's (ids equal: "
                     f"{list(row['input_ids']) == list(example.input_ids)}); the comparison would not be like for like.")
    return True


if __name__ == "__main__":
    main()
