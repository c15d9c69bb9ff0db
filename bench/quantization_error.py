"""What 4-bit quantization costs the base model before any training, and whether emotune's 4-bit path is NF4 itself.

    PYTHONPATH=src python bench/quantization_error.py [--texts 48] [--quant-type nf4]

On the packaged emotion test texts, the embedded base model's (Gemma 3 270M) mean next-token loss, one JSON line:
`bf16` (the weights as loaded), `bnb_4bit` (loaded through `model.quantization=4bit`: bitsandbytes' Linear4bit,
computing in bf16), and `simulated` (the bf16 model with every quantized layer's weight replaced by bitsandbytes'
own quantize -> dequantize of it: blocks of 64, scales quantized again as `model.double_quant` does). `bnb_4bit`
equal to `simulated` says the 4-bit path computes what NF4 weights give, so a gap to `bf16` is the quantization's,
not the path's; `simulated_block32` shows what blocks of 32 (not exposed by transformers' BitsAndBytesConfig) would
give.
"""

from __future__ import annotations

import argparse
import copy
import json
from importlib.resources import files

import torch

from emotune.core.config.model import ModelConfig
from emotune.model import quantization
from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir


def mean_loss(model, tokenizer, texts: list[str]) -> float:
    total = tokens = 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            n = ids.shape[1] - 1
            total += float(model(input_ids=ids, labels=ids).loss) * n
            tokens += n
    return total / tokens


def simulated(model, quant_type: str, blocksize: int, double_quant: bool = True):
    """`model` with the weights 4-bit loading quantizes (every linear layer but the output layer) rounded through
    bitsandbytes' quantize_4bit / dequantize_4bit."""
    import bitsandbytes.functional as bnb

    rounded = copy.deepcopy(model)
    for name, module in rounded.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            packed, state = bnb.quantize_4bit(module.weight.data.float(), blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=double_quant)
            module.weight.data = bnb.dequantize_4bit(packed, state).to(module.weight.dtype)
    return rounded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=48, help="the first N texts of the packaged test split")
    parser.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    args = parser.parse_args()
    quantization.import_bitsandbytes_offline()
    cfg = ModelConfig(quantization="4bit", quant_type=args.quant_type)  # double quantization, as a run has it
    model_dir = resolve_model_dir(ModelConfig())
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    lines = (files("emotune.datasets") / "emotion" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines[: args.texts]]
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    base = load_model(model_dir, dtype, cpu).eval()
    found = {"texts": len(texts), "quant_type": args.quant_type, "bf16": mean_loss(base, tokenizer, texts),
             "simulated": mean_loss(simulated(base, args.quant_type, 64), tokenizer, texts),
             "simulated_block32": mean_loss(simulated(base, args.quant_type, 32), tokenizer, texts)}
    del base
    four_bit = load_model(model_dir, dtype, cpu, quantized=quantization.bnb_config(cfg, dtype)).eval()
    found["bnb_4bit"] = mean_loss(four_bit, tokenizer, texts)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in found.items()}), flush=True)


if __name__ == "__main__":
    main()
