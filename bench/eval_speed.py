"""Evaluation speed: the reference recipe's decoding vs emotune's batched `generate` vs emotune's `score`.

    PYTHONPATH=src python bench/eval_speed.py [--rows 400] [--dtype bfloat16] [--generate-batch-size 16]
                                              [--score-batch-size 32] [--data PATH]

The packaged Gemma 3 270M on the first `--rows` rows of ../shared/datasets/emotion/test.jsonl (relative
to the repository; skipped with a message when absent), all three methods in one process, one dtype,
the same prompts. Prints one JSON line:
    rows, reference_rows_per_s, generate_rows_per_s, score_rows_per_s, ratio (score / reference),
    score_vs_generate, agreement (share of rows where score and generate agree), invalid_*, accuracy_*,
    lora_generate_rows_per_s (emotune `generate` once fresh LoRA adapters are attached, as after training:
    same outputs, since a fresh adapter adds zero), lora_vs_base_generate (its speed / the base's; ≈ 1)
    and lora_same_outputs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from peft import get_peft_model

from emotune.config import EvalConfig, LoraSettings, ModelConfig, PromptConfig
from emotune.data import prompt_messages
from emotune.evaluate import generate_outputs
from emotune.lora import lora_config
from emotune.models import load_model, load_tokenizer, resolve_model_dir, stop_token_ids
from emotune.replies import INVALID, extract_label, label_pattern
from emotune.scoring import LabelScorer

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "datasets" / "emotion" / "test.jsonl"


def reference_generate_label(model, tokenizer, text: str, prompt: PromptConfig, labels: list[str]) -> str:
    """The recipe's generate_label(): one row, chat template, greedy, 4 new tokens, first label name by regex."""
    inputs = tokenizer.apply_chat_template(prompt_messages(text, prompt, labels), add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(model.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=stop_token_ids(tokenizer),
                             pad_token_id=tokenizer.pad_token_id, top_p=None, top_k=None, temperature=None)
    generated = tokenizer.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip().lower()
    match = re.search("(" + "|".join(labels) + ")", generated)
    return match.group(1) if match else INVALID


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--generate-batch-size", type=int, default=16, help="emotune generate (the lead's measured setting)")
    parser.add_argument("--score-batch-size", type=int, default=32, help="emotune score (what eval.batch_size=auto picks on CPU)")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if not args.data.is_file():
        print(f"skipped: {args.data} not found (the emotion test split is needed for this benchmark)")
        return 0

    records = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = [name for _, name in sorted({(r["label_id"], r["label"]) for r in records})]
    rows = records[:args.rows]
    texts, gold = [r["text"] for r in rows], [r["label"] for r in rows]
    prompt = PromptConfig()
    torch.manual_seed(0)
    model_dir = resolve_model_dir(ModelConfig())
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    model = load_model(model_dir, getattr(torch, args.dtype), torch.device("cpu")).eval()

    reference, reference_s = timed(lambda: [reference_generate_label(model, tokenizer, t, prompt, labels) for t in texts])
    cfg = EvalConfig(batch_size=args.generate_batch_size)
    pattern = label_pattern(labels)
    raw, generate_s = timed(lambda: generate_outputs(model, tokenizer, texts, prompt, labels, cfg, desc=None))
    generated = [extract_label(output, labels, pattern) for output in raw]
    log_probs, score_s = timed(lambda: LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, args.score_batch_size))
    scored = [labels[i] for i in log_probs.argmax(-1).tolist()]
    # Last: attaching adapters changes `model` in place. The fine-tuned evaluation's model, minus the training.
    adapted = get_peft_model(model, lora_config(LoraSettings(), model)).eval()
    lora_raw, lora_generate_s = timed(lambda: generate_outputs(adapted, tokenizer, texts, prompt, labels, cfg, desc=None))

    def accuracy(predicted: list[str]) -> float:
        return round(sum(p == g for p, g in zip(predicted, gold)) / len(gold), 4)

    n = len(texts)
    print(json.dumps({
        "rows": n,
        "reference_rows_per_s": round(n / reference_s, 2),
        "generate_rows_per_s": round(n / generate_s, 2),
        "score_rows_per_s": round(n / score_s, 2),
        "ratio": round(reference_s / score_s, 2),
        "score_vs_generate": round(generate_s / score_s, 2),
        "lora_generate_rows_per_s": round(n / lora_generate_s, 2),
        "lora_vs_base_generate": round(generate_s / lora_generate_s, 2),
        "lora_same_outputs": lora_raw == raw,
        "agreement": round(sum(s == g for s, g in zip(scored, generated)) / n, 4),
        "invalid_reference": sum(p == INVALID for p in reference),
        "invalid_generate": sum(p == INVALID for p in generated),
        "invalid_score": sum(p not in labels for p in scored),
        "accuracy_reference": accuracy(reference),
        "accuracy_generate": accuracy(generated),
        "accuracy_score": accuracy(scored),
        "dtype": args.dtype,
        "generate_batch_size": args.generate_batch_size,
        "score_batch_size": args.score_batch_size,
        "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
