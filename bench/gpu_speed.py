"""emotune against TRL's SFTTrainer on one GPU, in one run: the reference recipe on a random-weight model of
Gemma 4 E4B's full text size (bench/gpu_check.py's E4B_TEXT), for when a GPU machine is lent.

    PYTHONPATH=src python bench/gpu_speed.py [--steps 10] [--peak-tflops 989]
    PYTHONPATH=src python bench/gpu_speed.py --dry-run     # the same code on the CPU with a tiny model, in seconds

Both sides train the same model (rebuilt with the same seed for each) on the same rows (the packaged emotion data
with the recipe's prompt, gpu_check's word-level tokenizer) with the same LoRA (r16, all linear layers), AdamW,
learning rate, gradient checkpointing and one update of 16 rows:
  emotune  16 x 1, its `auto` settings (bigger passes, lean LoRA and norm forwards, the shared prompt prefix)
  off      (with --sides emotune,off,trl) emotune with host_overhead.py's OFF switches: lean forwards, shared prefix,
           pass cap, foreach optimizer and train.compile all off, to see on the device what they give
  trl      SFTTrainer at its best: 16 x 1, bf16, `use_liger_kernel` when liger-kernel is installed, completion-only
           loss on prompt-completion rows
Per side (bench/host_overhead.py measures the updates): seconds per update (median after two warm-up updates),
tokens/s (rows per update x mean tokens per row / seconds per update: the same rows on both sides), peak allocated
memory, GPU busy % (NVML or amdsmi through torch.cuda, sampled while training), MFU and the loss of the last update.
MFU: the model FLOPs of forward and backward with frozen base weights, 4 x (non-embedding parameters) per token
(2 forward, 2 for the activations' gradients; no weight gradients; LoRA's and attention's are left out, the
recomputation of gradient checkpointing is not counted), over the device's dense bf16 peak (--peak-tflops, else
from the device name: H100/H200 989, MI300X 1307, A100 312, L4 121, RTX 4090 165, RX 7900 XTX 123).
One JSON line per side, then the summary (ratio = emotune tokens/s / TRL's, mem_ratio = emotune peak / TRL's, with the off
side speedup = emotune tokens/s / off's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import E4B_TEXT, RECIPE, TINY_TEXT, Telemetry, build_model, memory, word_tokenizer  # noqa: E402
from host_overhead import OFF, emotune_side, trl_side  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989, "H200": 989, "MI300X": 1307, "MI325X": 1307, "A100": 312, "L4": 121,
                    "RTX 4090": 165, "RX 7900 XTX": 123, "W7900": 123}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side (two warm-up, one counted)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU with a tiny model")
    parser.add_argument("--sides", default="emotune,trl", help="emotune, off (emotune with every switch off), trl")
    args = parser.parse_args(argv)

    from emotune.cli import process_defaults
    from emotune.core.config.load import load_config
    from emotune.runtime.device import choose_precision, resolve_device
    from emotune.tasks.classify.task import encode_examples, load_data

    process_defaults()
    device = torch.device("cpu") if args.dry_run else resolve_device("cuda")
    cfg = load_config(RECIPE, ["data.source=embedded", f"data.train_limit={64 if args.dry_run else 800}",
                               "train.batch_size=16", "train.gradient_accumulation_steps=1", "train.logging_steps=1",
                               f"train.max_steps={args.steps}", "train.save_steps=1000000", "train.eval_steps=1000000",
                               f"device={device.type}"])
    precision = choose_precision(device, cfg.train.precision)
    with contextlib.redirect_stdout(sys.stderr):
        data = load_data(cfg)
        tokenizer = word_tokenizer([t for split in data.splits.values() for t in split["text"]], cfg)
        rows = encode_examples(data.splits["train"], tokenizer, cfg.prompt, data.labels, cfg.train.max_length)
    text = TINY_TEXT if args.dry_run else E4B_TEXT
    tokens_per_update = 16 * statistics.mean(len(r.input_ids) for r in rows)
    peak = args.peak_tflops or _peak_tflops(device)
    liger = _liger_available(device)
    lines = {}
    sides = args.sides.split(",")
    if not {"emotune", "trl"} <= set(sides) or not set(sides) <= {"emotune", "off", "trl"}:
        parser.error("--sides: emotune and trl, optionally off (e.g. emotune,off,trl)")
    for side in sides:
        model, built = build_model(text, tokenizer, precision.dtype, device)
        flops_per_token = 4 * _dense_parameters(model)
        _reset(device)
        with contextlib.redirect_stdout(sys.stderr), Telemetry(device) as telemetry:
            if side != "trl":
                result = emotune_side(model, tokenizer, rows, cfg, precision, args.steps, OFF if side == "off" else {},
                                      device)
            else:
                result = trl_side(model, tokenizer, data, cfg, precision, args.steps, device, use_liger_kernel=liger)
        tokens_per_s = tokens_per_update / result["seconds_per_update"]
        lines[side] = {"side": side, "device": _device_name(device), "parameters": built["parameters"],
                       "tokens_per_s": round(tokens_per_s, 1), "seconds_per_update": result["seconds_per_update"],
                       **memory(device), "telemetry": telemetry.summary(),
                       "mfu": round(tokens_per_s * flops_per_token / (peak * 1e12), 4) if peak else None,
                       "last_loss": result["last_loss"], "ops_per_pass": result["ops_per_pass"],
                       "settings": result["settings"] if side != "trl" else {"use_liger_kernel": liger}}
        print(json.dumps(lines[side]), flush=True)
        del model
        _empty(device)
    emotune, trl = lines["emotune"], lines["trl"]
    peak_key = "peak_allocated_gib" if "peak_allocated_gib" in emotune else None
    print(json.dumps({"summary": True, "device": emotune["device"], "steps": args.steps, "precision": precision.name,
                      "tokens_per_update": round(tokens_per_update), "ratio": round(emotune["tokens_per_s"] / trl["tokens_per_s"], 2),
                      "mem_ratio": round(emotune[peak_key] / trl[peak_key], 3) if peak_key and trl.get(peak_key) else None,
                      "mfu": {"emotune": emotune["mfu"], "trl": trl["mfu"]}, "peak_tflops": peak,
                      "last_loss": {"emotune": emotune["last_loss"], "trl": trl["last_loss"]},
                      **({"speedup": round(emotune["tokens_per_s"] / lines["off"]["tokens_per_s"], 2)} if "off" in lines else {})}),
          flush=True)
    return 0


def _dense_parameters(model) -> int:
    """Parameters a token's forward pass multiplies with: all but the embedding tables (lookups, not products)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings()
    # the output projection is a product: counted once, also when it shares its weight with the input embedding
    tied = head is not None and id(head.weight) in embeddings
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings) + (head.weight.numel() if tied else 0)


def _peak_tflops(device: torch.device) -> float | None:
    name = _device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _liger_available(device: torch.device) -> bool:
    """TRL's `use_liger_kernel` needs liger-kernel, a GPU (Triton) and a model it patches (gemma4: partly)."""
    if device.type != "cuda":
        return False
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _empty(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
