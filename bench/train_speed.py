"""Training speed and memory: emotune's trainer against the reference recipe, side by side.

    pip install -e ".[bench]"   # TRL, for the reference side
    PYTHONPATH=src python bench/train_speed.py [--rows 256]
    PYTHONPATH=src python bench/train_speed.py --model DIR --data FILE --rows 16   # tiny, as the test runs it

Both sides train the packaged Gemma 3 270M for one epoch on the same first `--rows` rows of
../shared/datasets/emotion/train.jsonl, with the same LoRA (r 16, alpha 32, dropout 0.05,
all-linear), optimiser (AdamW, lr 3e-4, linear schedule, 5% warmup, clip 1.0), batch 8 and dtype
(bf16 where the CPU has it, else fp32):
  (a) the reference recipe: plain TRL SFTTrainer, completion_only_loss, gradient checkpointing;
  (b) emotune.train.loop.train: completion-only projection, the prompt head all rows share run once per
      forward pass (train.shared_prefix=auto; --ours-shared-prefix off runs whole rows),
      length-grouped batches cut into forward passes under train.max_tokens_per_pass=auto (sized from the free
      RAM, a whole update in one pass where it fits; --ours-max-tokens-per-pass 512 is the cap docs/benchmarks.md's
      lines were measured with), gradient
      checkpointing like the reference (--ours-no-gradient-checkpointing keeps activations instead:
      faster steps, more memory), the LoRA branch as one autograd function (train.lean_lora, on by
      default: PEFT's values, less kept memory), and the process settings the `emotune` command applies at start
      (emotune.cli.process_defaults: a bounded oneDNN kernel cache). --ref-process-defaults gives the
      reference those settings too, to show what they alone are worth.
Each side runs in its own fresh subprocess, so each peak RSS is its own. The objectives must agree: a third
subprocess loads the model in float32 and computes the loss of the same first 8 rows under each side's code
(adapters start as a no-op, so this is the base model's loss; TRL's SFTTrainer.compute_loss, and emotune's
batch, through its shared prefix when it trains with one, and loss): `identical_batch_rel_diff`. Each
training side computes the same in the precision it trains in too (`identical_batch_rel_diff_trained_precision`):
in bf16 the prefix, run apart from the rows, rounds differently from whole rows. After training, the final training loss of
each side is measured the same way on both: the completion-only loss of the trained model (eval mode)
over all the training rows, by one function (emotune.train.batches.completion_loss, which the identical-batch
check shows equals TRL's loss). The last-quarter mean of the logged step losses is printed too; it
depends on which rows fell in those steps, and the two sides order rows differently.
`--model` trains another model folder than the packaged one (the tests run it with a tiny random model).
Prints one JSON line.
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

DATA = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "emotion" / "train.jsonl"
LORA = ["lora.r=16", "lora.alpha=32", "lora.dropout=0.05", "lora.target_modules=all-linear"]
TRAIN = ["train.batch_size=8", "train.gradient_accumulation_steps=1", "train.learning_rate=3e-4",
         "train.lr_scheduler_type=linear", "train.warmup_ratio=0.05", "train.max_length=256", "train.max_steps=-1",
         "train.num_train_epochs=1", "train.logging_steps=1", "train.optim=adamw_torch", "train.max_grad_norm=1.0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--ours-no-gradient-checkpointing", action="store_true",
                        help="keep activations on emotune's side instead of recomputing them (faster, more memory)")
    parser.add_argument("--ours-max-tokens-per-pass", default="auto", help="train.max_tokens_per_pass on emotune's side")
    parser.add_argument("--ours-shared-prefix", choices=["auto", "off"], default="auto",
                        help="train.shared_prefix on emotune's side (auto: the shared prompt head runs once per pass)")
    parser.add_argument("--model", help="model folder to train on both sides (default: the packaged Gemma 3 270M)")
    parser.add_argument("--seed", type=int, default=42, help="the run's seed on both sides (row order, dropout); 42 is the config default")
    parser.add_argument("--ref-process-defaults", action="store_true",
                        help="run the reference with emotune.cli.process_defaults() too")
    parser.add_argument("--side", choices=["ref", "ours", "identical"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side != "ours" and importlib.util.find_spec("trl") is None:  # emotune's side alone does not need it
        sys.exit("bench/train_speed.py runs the reference recipe with TRL's SFTTrainer, and TRL is not installed "
                 "(emotune itself does not need it). Install the benchmark extra: pip install -e \".[bench]\"")
    if args.side:
        defaults = args.side == "ours" or args.ref_process_defaults
        overrides = [f"train.gradient_checkpointing={str(args.side == 'ref' or not args.ours_no_gradient_checkpointing).lower()}",
                     f"train.max_tokens_per_pass={args.ours_max_tokens_per_pass}", f"seed={args.seed}",
                     f"train.shared_prefix={args.ours_shared_prefix}", *([f"model.source={args.model}"] * bool(args.model))]
        result = (identical_batch(args.data, args.rows, overrides) if args.side == "identical" else
                  run_side(args.side, args.data, args.rows, overrides, defaults))
        print("RESULT " + json.dumps(result), flush=True)
        return
    if not args.data.is_file():
        print(json.dumps({"skipped": f"{args.data} not found; this benchmark needs the emotion dataset there"}))
        return
    results = {side: _subprocess(side, args) for side in ("ref", "ours", "identical")}
    ref, ours, fp32 = results["ref"], results["ours"], results["identical"]
    print(json.dumps({
        "ref_tokens_per_s": ref["tokens_per_s"], "ours_tokens_per_s": ours["tokens_per_s"],
        "ratio": round(ours["tokens_per_s"] / ref["tokens_per_s"], 2),
        "ref_peak_rss_mb": ref["peak_rss_mb"], "ours_peak_rss_mb": ours["peak_rss_mb"],
        "mem_ratio": round(ours["peak_rss_mb"] / ref["peak_rss_mb"], 2),
        "ref_losses": ref["losses"], "ours_losses": ours["losses"],
        "identical_batch_fp32": fp32, "identical_batch_rel_diff": _rel(fp32["ours"], fp32["ref"]),
        "identical_batch_rel_diff_trained_precision": _rel(ours["losses"]["identical_batch"], ref["losses"]["identical_batch"]),
        "final_loss_rel_diff": _rel(ours["losses"]["final"], ref["losses"]["final"]),
        "last_quarter_rel_diff": _rel(ours["losses"]["last_quarter"], ref["losses"]["last_quarter"]),
        "rows": args.rows, "tokens": ours["tokens"], "steps": ours["steps"], "precision": ours["precision"],
        "ref_seconds": ref["seconds"], "ours_seconds": ours["seconds"],
        "ours_gradient_checkpointing": not args.ours_no_gradient_checkpointing,
        "ref_process_defaults": args.ref_process_defaults, "ours_max_tokens_per_pass": args.ours_max_tokens_per_pass,
        "ours_shared_prefix_tokens": ours["shared_prefix_tokens"], "seed": args.seed,
    }))


def _rel(a: float, b: float) -> float:
    return round(abs(a - b) / abs(b), 6)


def _subprocess(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--side", side, "--rows", str(args.rows), "--data", str(args.data)]
    flags = ["--ours-no-gradient-checkpointing"] * args.ours_no_gradient_checkpointing + \
        ["--ref-process-defaults"] * args.ref_process_defaults + \
        ["--ours-max-tokens-per-pass", str(args.ours_max_tokens_per_pass), "--seed", str(args.seed),
         "--ours-shared-prefix", args.ours_shared_prefix] + ["--model", args.model] * bool(args.model)
    done = subprocess.run(command + flags,
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


# --------------------------------------------------------------------------------------------------
# One side, in its own process


def _load_side(data_path: Path, rows: int, overrides: list[str], precision_name: str):
    """The config, rows, model and tokenizer one side trains (or checks) with, the model in `precision_name`."""
    import torch
    from datasets import Dataset, load_dataset
    from transformers import set_seed

    from emotune.core.config.load import load_config
    from emotune.data import LabeledData
    from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir
    from emotune.runtime import device as device_mod
    from emotune.tasks.classify.task import encode_examples

    cfg = load_config(None, [*LORA, *TRAIN, *overrides, "device=cpu"])
    set_seed(cfg.seed)
    train_rows = load_dataset("json", data_files=str(data_path), split="train").select(range(rows))
    labels = sorted(set(train_rows["label"]), key=train_rows["label"].index)
    empty = Dataset.from_dict({"text": [], "label": []})
    data = LabeledData(splits={"train": train_rows, "validation": empty, "test": empty}, labels=labels, source=str(data_path))
    precision = device_mod.choose_precision(torch.device("cpu"), precision_name)
    model_dir = resolve_model_dir(cfg.model)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_model(model_dir, precision.dtype, torch.device("cpu"))
    examples = encode_examples(train_rows, tokenizer, cfg.prompt, labels, cfg.train.max_length)
    return cfg, data, precision, model, tokenizer, examples


def _ours_first_batch_loss(model, tokenizer, examples, cfg):
    """emotune's loss of the first 8 rows, through the batch the train stage builds (shared prefix when it is
    used) and its loss function; returns (loss per completion token, what share_prefix chose)."""
    import torch

    from emotune.train.batches import LANGUAGE_MODEL, completion_loss, share_prefix

    objective, shared = share_prefix(LANGUAGE_MODEL, examples, cfg.train.shared_prefix, model)
    with torch.no_grad():
        parts = completion_loss(model, objective.collate(examples[:8], tokenizer.pad_token_id, torch.device("cpu")))
    return float(parts.loss_sum) / parts.tokens, objective, shared


def identical_batch(data_path: Path, rows: int, overrides: list[str]) -> dict:
    """The first 8 rows' loss under each side's code in float32, in one process: TRL's SFTTrainer.compute_loss
    and emotune's batch and loss. This checks that the objectives are the same; in bf16 the shared prefix, run
    apart from the rows, is rounded differently from whole rows (other matrix shapes), which is not the objective."""
    cfg, data, precision, model, tokenizer, examples = _load_side(data_path, rows, overrides, "fp32")
    ours, _, _ = _ours_first_batch_loss(model, tokenizer, examples, cfg)
    with tempfile.TemporaryDirectory() as out:
        ref = _reference_first_batch_loss(_reference_trainer(model, tokenizer, data, cfg, precision, out))
    return {"ref": round(ref, 6), "ours": round(ours, 6)}


def run_side(side: str, data_path: Path, rows: int, overrides: list[str], process_defaults: bool) -> dict:
    if process_defaults:  # as the `emotune` command starts
        from emotune.cli import process_defaults as emotune_process_defaults

        emotune_process_defaults()
    cfg, data, precision, model, tokenizer, examples = _load_side(data_path, rows, overrides, "auto")
    tokens = sum(len(e.input_ids) for e in examples)
    shared_tokens = 0

    if side == "ours":
        from emotune.core.rundir import RunDir
        from emotune.train.loop import train

        # as the pipeline's train stage chooses it; the identical batch goes through the same collate and loss
        identical, objective, shared = _ours_first_batch_loss(model, tokenizer, examples, cfg)
        shared_tokens = shared["tokens"] if shared["used"] else 0
        with tempfile.TemporaryDirectory() as run_dir:
            started = time.perf_counter()
            trained = train(model, tokenizer, examples, [], cfg, precision, RunDir(run_dir), {"labels": data.labels},
                            objective)
            seconds = time.perf_counter() - started
            history = json.loads((Path(run_dir) / "train" / "log_history.json").read_text())
    else:
        identical, seconds, history, trained = _reference(model, tokenizer, data, cfg, precision)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    final = _loss_over(trained, examples, tokenizer.pad_token_id)
    step_losses = [round(e["loss"], 5) for e in history if "loss" in e]
    tail = step_losses[-max(1, len(step_losses) // 4):]  # the last quarter of the epoch, averaged: less noisy
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 1),
            "steps": len(step_losses), "precision": precision.name, "shared_prefix_tokens": shared_tokens,
            "peak_rss_mb": round(peak_rss_mb, 1),
            "losses": {"identical_batch": round(identical, 6), "final": round(final, 5),
                       "last_quarter": round(sum(tail) / len(tail), 5), "per_step": step_losses}}


def _loss_over(model, examples, pad_id: int, batch_size: int = 8) -> float:
    """Completion-only loss per token of `model` over all `examples`, in eval mode (no dropout)."""
    import torch

    from emotune.train.batches import collate, completion_loss

    model.eval()
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            parts = completion_loss(model, collate(examples[start:start + batch_size], pad_id, torch.device("cpu")))
            loss_sum, tokens = loss_sum + float(parts.loss_sum), tokens + parts.tokens
    return loss_sum / tokens


def _reference_trainer(model, tokenizer, data, cfg, precision, out: str):
    """The reference recipe as the foundation ran it: plain TRL SFTTrainer with completion-only loss."""
    from trl import SFTConfig, SFTTrainer

    from emotune.data import to_prompt_completion
    from emotune.model.lora import lora_config

    t = cfg.train
    args = SFTConfig(output_dir=out, num_train_epochs=1, per_device_train_batch_size=t.batch_size,
                     learning_rate=t.learning_rate, lr_scheduler_type="linear", warmup_steps=t.warmup_ratio,
                     max_length=t.max_length, completion_only_loss=True, gradient_checkpointing=True,
                     bf16=precision.name == "bf16", logging_steps=1, save_strategy="no", report_to="none",
                     seed=cfg.seed, data_seed=cfg.seed, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                     optim="adamw_torch", max_grad_norm=t.max_grad_norm)
    tokenizer.padding_side = "right"
    rows = to_prompt_completion(data.splits["train"], cfg.prompt, data.labels)
    return SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                      peft_config=lora_config(cfg.lora, model))


def _reference_first_batch_loss(trainer) -> float:
    """TRL's loss of the first 8 rows, in eval mode (no dropout: the same deterministic loss as the other side)."""
    import torch

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    trainer.model.eval()
    with torch.no_grad(), trainer.compute_loss_context_manager():
        return float(trainer.compute_loss(trainer.model, batch))


def _reference(model, tokenizer, data, cfg, precision):
    with tempfile.TemporaryDirectory() as out:
        trainer = _reference_trainer(model, tokenizer, data, cfg, precision, out)
        identical = _reference_first_batch_loss(trainer)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        trainer.model.gradient_checkpointing_disable()
        return identical, seconds, trainer.state.log_history, trainer.model


if __name__ == "__main__":
    main()
