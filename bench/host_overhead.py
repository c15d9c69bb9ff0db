"""Host overhead per optimizer step, on the CPU: emotune with its `auto` settings, emotune with its speed-ups
switched off, and TRL's SFTTrainer, on one tiny random model with Gemma 4 E4B's layer structure.

    PYTHONPATH=src python bench/host_overhead.py [--steps 8] [--rows-per-update 16]

The model keeps E4B's structure (bench/gpu_check.py's E4B_TEXT: 42 decoder layers, 5 sliding-window then 1 global
seven times, the last 18 sharing earlier layers' keys and values, per-layer input embeddings, two head sizes, the
final soft-cap) with every width scaled down (hidden 64, heads 2/1, head dims 16/32), so the arithmetic is
negligible and the time of an update is the host's: Python, the dispatcher, autograd, the optimizer's loops.
The rows: the packaged emotion data with the reference recipe's prompt (configs/gemma4-e4b-emotion.yaml), through
gpu_check's word-level tokenizer (about the real token counts); the recipe's update of 4 rows x 4 accumulation
(16 rows), LoRA r16 on all linear layers, the recipe's train.gradient_checkpointing=auto, AdamW, the precision
emotune picks here.

Measured per side in this one process, one after the other (a fresh model each, the same seed):
  seconds_per_update  the median time from the start of one optimizer step to the start of the next, over the
                      steps after the first two (warm-up); emotune: through train()'s per-pass hook, TRL: through
                      a TrainerCallback's on_step_begin
  ops_per_pass        PyTorch (aten) operator calls of one whole update (forward, backward, clipping, the
                      optimizer) counted with a TorchDispatchMode, divided by the update's forward passes
  ops_per_update      the same calls, not divided: what a whole update (the same 16 rows on every side) launches
  passes_per_update   forward passes in an update (emotune: train.max_tokens_per_pass cuts the update's rows)
  pass_size           emotune `auto`: how train.max_tokens_per_pass=auto sized the passes (run.json's
                      stages.train.passes: the free RAM seen, bytes per padded token estimated, the cap, and
                      whether train.gradient_checkpointing=auto kept checkpointing, with why)
Sides: `auto` (emotune's defaults: lean LoRA forwards, with the base layer's product in the same function, and lean
norm forwards, the shared prompt prefix, passes sized from the free RAM by train.max_tokens_per_pass=auto, a whole
update in one pass when it fits, gradient checkpointing only where the passes need it, the optimizer and clipping
in their foreach implementations; train.compile=auto is eager on a CPU), `off` (every one of those off: OFF below; one
pass per accumulation micro-batch, checkpointing on), and `trl` (SFTTrainer, prompt-completion rows, loss on the
completion only, the same LoRA, batch and optimizer, gradient checkpointing on as in the recipe's 16-24 GB setting).
A TorchDispatchMode makes compiled regions run eager, so on a GPU with train.compile on the counted update's
operators are the eager ones (and that update is left out of the timing).
Prints one JSON line: speedup = off / auto, ratio = trl / auto (seconds per update), ops_ratio = auto / off (per
pass, the issue's measure; a pass of `auto` may hold a whole update), ops_ratio_update = auto / off per update.
Measure with nothing else running: on a 2-core machine a second job skews it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import E4B_TEXT, RECIPE, build_model, word_tokenizer  # noqa: E402

HOST_TEXT = {**E4B_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16, "global_head_dim": 32, "hidden_size_per_layer_input": 8, "vocab_size": 0,
             "vocab_size_per_layer_input": 0}  # the vocabulary: the word tokenizer's
OFF = {"lean_lora": False, "lean_norm": False, "shared_prefix": "off", "max_tokens_per_pass": 0, "foreach": "off",
       "compile": "off", "gradient_checkpointing": True}
"""Every switch that changes how much work a pass launches, off: the `off` side (and bench/gpu_speed.py's `off`)."""
WARMUP = 2  # updates left out of the median


def scaled_layers(layers: int) -> dict:
    """E4B's layer pattern (5 sliding-window, 1 global) and its share of KV-sharing layers (18 of 42) for `layers`."""
    if layers % 6 or layers < 12:
        raise SystemExit("--layers must be a multiple of 6 and at least 12 (E4B's pattern, a global layer to share)")
    return {"num_hidden_layers": layers, "layer_types": E4B_TEXT["layer_types"][:layers],
            "num_kv_shared_layers": round(E4B_TEXT["num_kv_shared_layers"] * layers / E4B_TEXT["num_hidden_layers"])}


class OpCounter(TorchDispatchMode):
    """Counts every aten operator call while active."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class StepClock:
    """Start times of updates and the passes in each; counts the operators of update `counted` (the last one)."""

    top = 6  # operators listed in top_ops

    def __init__(self, counted: int, device: torch.device | None = None):
        self.device = device
        self.starts: dict[int, float] = {}
        self.passes: Counter = Counter()
        self.counted, self.counter = counted, OpCounter()
        self.active = False

    def begin(self, step: int) -> None:
        if step not in self.starts:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the update before has run, not only been queued
            self.starts[step] = time.perf_counter()
            if step == self.counted and not self.active:
                self.counter.__enter__()
                self.active = True
            elif step == self.counted + 1 and self.active:
                self.stop()
        self.passes[step] += 1

    def stop(self) -> None:
        if self.active:
            self.counter.__exit__(None, None, None)
            self.active = False

    def result(self) -> dict:
        steps = sorted(self.starts)
        durations = [self.starts[b] - self.starts[a] for a, b in zip(steps, steps[1:], strict=False)
                     if a >= WARMUP and a != self.counted]  # the counted update runs slower under the counter
        passes = self.passes[self.counted] or 1
        return {"seconds_per_update": round(statistics.median(durations), 4), "updates_timed": len(durations),
                "timed_seconds": round(sum(durations), 4),
                "passes_per_update": passes, "ops_per_pass": round(sum(self.counter.calls.values()) / passes, 1),
                "ops_per_update": sum(self.counter.calls.values()),
                "top_ops": dict(self.counter.calls.most_common(self.top))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per side (the first two are warm-up)")
    parser.add_argument("--sides", default="auto,off,trl", help="which sides to run, comma-separated")
    parser.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                        help="another train.* setting for both emotune sides (e.g. optim=adamw_torch_fused; the `off` side's "
                             "switches win over it); repeatable")
    parser.add_argument("--top", type=int, default=6, help="operators listed per side in top_ops, most called first")
    parser.add_argument("--layers", type=int, default=42, help="decoder layers (E4B: 42), E4B's pattern and share of "
                                                                 "KV-sharing layers kept; fewer for a quick check")
    args = parser.parse_args(argv)
    StepClock.top = args.top
    if args.steps < WARMUP + 4:
        parser.error(f"--steps must be at least {WARMUP + 4}: {WARMUP} warm-up updates, two timed, one counted, the last")

    from emotune.cli import process_defaults
    from emotune.core.config.load import load_config
    from emotune.runtime.device import choose_precision
    from emotune.tasks.classify.task import encode_examples, load_data

    process_defaults()  # as the `emotune` command starts: threads, allocator
    device = torch.device("cpu")
    cfg = load_config(RECIPE, ["data.source=embedded", "data.train_limit=400", "train.logging_steps=1",
                               f"train.max_steps={args.steps}", "train.save_steps=1000000", "train.eval_steps=1000000",
                               "device=cpu", *(f"train.{setting}" for setting in args.train)])
    precision = choose_precision(device, cfg.train.precision)
    with contextlib.redirect_stdout(sys.stderr):
        data = load_data(cfg)
        tokenizer = word_tokenizer([t for split in data.splits.values() for t in split["text"]], cfg)
        rows = encode_examples(data.splits["train"], tokenizer, cfg.prompt, data.labels, cfg.train.max_length)
    text = {**HOST_TEXT, "vocab_size": len(tokenizer), "vocab_size_per_layer_input": len(tokenizer),
            **scaled_layers(args.layers)}
    line = {"model": "Gemma 4 E4B's layer structure, widths scaled down", "layers": text["num_hidden_layers"],
            "hidden": text["hidden_size"], "precision": precision.name,
            "rows_per_update": cfg.train.batch_size * cfg.train.gradient_accumulation_steps,
            "batch": f"{cfg.train.batch_size} x {cfg.train.gradient_accumulation_steps}",
            "mean_tokens_per_row": round(statistics.mean(len(r.input_ids) for r in rows), 1),
            "gradient_checkpointing": cfg.train.gradient_checkpointing, "steps": args.steps,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    sides = {}
    for side in args.sides.split(","):
        model, _ = build_model(text, tokenizer, precision.dtype, device)
        with contextlib.redirect_stdout(sys.stderr):
            sides[side] = trl_side(model, tokenizer, data, cfg, precision, args.steps) if side == "trl" else \
                emotune_side(model, tokenizer, rows, cfg, precision, args.steps, OFF if side == "off" else {})
        line[side] = sides[side]
    if {"auto", "off"} <= sides.keys():
        line["speedup"] = round(sides["off"]["seconds_per_update"] / sides["auto"]["seconds_per_update"], 2)
        line["ops_ratio"] = round(sides["auto"]["ops_per_pass"] / sides["off"]["ops_per_pass"], 3)
        line["ops_ratio_update"] = round(sides["auto"]["ops_per_update"] / sides["off"]["ops_per_update"], 3)
    if {"auto", "trl"} <= sides.keys():
        line["ratio"] = round(sides["trl"]["seconds_per_update"] / sides["auto"]["seconds_per_update"], 2)
    print(json.dumps(line), flush=True)
    return 0


def emotune_side(model, tokenizer, rows, cfg, precision, steps: int, overrides: dict, device=None) -> dict:
    from emotune.core.rundir import RunDir
    from emotune.train.loop import train

    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update=overrides)})
    clock = StepClock(steps - 2, device)  # steps run 0 .. steps-1; the update counted ends where the last begins
    recorded = {}  # what run.json's train stage would say
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as folder:
        try:
            train(model, tokenizer, rows, [], cfg, precision, RunDir(Path(folder)), {"labels": []},
                  record=recorded.__setitem__, fault=lambda step, batch: clock.begin(step))
        finally:
            clock.stop()
        history = json.loads((Path(folder) / "train" / "log_history.json").read_text())
    losses = [e["loss"] for e in history if "loss" in e]
    passes = recorded.get("passes", {})
    pass_size = {k: passes[k] for k in ("setting", "cap", "free_bytes", "bytes_per_token", "checkpointing",
                                         "checkpointing_note") if k in passes}
    return {**clock.result(), "settings": overrides or "defaults", "pass_size": pass_size,
            "last_loss": round(losses[-1], 4)}


def trl_side(model, tokenizer, data, cfg, precision, steps: int, device=None, **extra) -> dict:
    """TRL's SFTTrainer on the same rows as prompt-completion conversations (its loss on the completion only);
    `extra`: more SFTConfig settings (bench/gpu_speed.py: use_liger_kernel)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from emotune.model.lora import lora_config
    from emotune.model.prompt import system_prompt

    clock = StepClock(steps - 2, device)  # TRL's global_step at on_step_begin: 0 .. steps-1, as emotune's

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            clock.stop()

    system = system_prompt(cfg.prompt, data.labels)
    train = data.splits["train"]
    rows = [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": cfg.prompt.user_template.format(text=text)}],
             "completion": [{"role": "assistant", "content": label}]}
            for text, label in zip(train["text"], train["label"], strict=True)]
    t = cfg.train
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=t.batch_size,
                           gradient_accumulation_steps=t.gradient_accumulation_steps, learning_rate=t.learning_rate,
                           max_length=t.max_length, packing=False, gradient_checkpointing=t.gradient_checkpointing is not False,
                           bf16=precision.name == "bf16", logging_steps=1, save_strategy="no", report_to="none",
                           seed=cfg.seed, use_cpu=device is None or device.type == "cpu", dataloader_num_workers=0,
                           disable_tqdm=True, optim="adamw_torch", max_grad_norm=t.max_grad_norm, **extra)
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             peft_config=lora_config(cfg.lora, model), callbacks=[Clock()])
        clock.passes.clear()
        environ = dict(os.environ)
        try:
            trainer.train()
        finally:  # transformers/accelerate leave settings behind (environment, the shared accelerator state) that
            os.environ.clear()  # would change later training in this process (e.g. the tests that run this bench)
            os.environ.update(environ)
            from accelerate.state import AcceleratorState, PartialState

            AcceleratorState._reset_state(reset_partial_state=True)
            PartialState._reset_state()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = clock.result()
    # TRL runs one forward pass per micro-batch: on_step_begin sees an update, not its passes
    result["passes_per_update"] = t.gradient_accumulation_steps
    result["ops_per_pass"] = round(sum(clock.counter.calls.values()) / t.gradient_accumulation_steps, 1)
    return {**result, "settings": "SFTTrainer, completion-only loss", "last_loss": round(losses[-1], 4) if losses else None}


if __name__ == "__main__":
    sys.exit(main())
