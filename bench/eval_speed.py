"""Evaluation speed: the reference recipe's decoding vs emotune's batched `generate` vs emotune's `score`, and
the fine-tuned model's `generate` with its adapter unmerged and merged (as the fine-tuned evaluation runs it).

    PYTHONPATH=src python bench/eval_speed.py [--rows 400] [--dtype bfloat16] [--generate-batch-size 16]
                                              [--score-batch-size 32] [--data PATH] [--adapter DIR] [--smoke]

The packaged Gemma 3 270M on the first `--rows` rows of ../shared/datasets/emotion/test.jsonl (relative
to the repository; skipped with a message when absent), every method in one process, one dtype, the
same prompts. The fine-tuned model is the base with a trained-size LoRA adapter: `--adapter DIR` (a run's
`adapter/` folder trained on the packaged model), or by default the config's default LoRA (r 16,
all-linear) with every B matrix drawn from a seeded normal of standard deviation 0.002, the size the
default run's trained adapters have (a fresh adapter has B = 0 and would change nothing, merged or not).
Its `generate` runs unmerged, then merged exactly as the fine-tuned evaluation merges it
(`emotune.eval.merged`, eval.merge_adapters=auto with the default tolerance).

`--smoke`: a 2-layer random model and 12 synthetic rows in a temporary folder, to check the script runs
(its speeds mean nothing).

Prints one JSON line:
    rows, reference_rows_per_s, generate_rows_per_s, score_rows_per_s, ratio (score / reference),
    score_vs_generate, agreement (share of rows where score and generate agree), invalid_*, accuracy_*,
    adapter (`seeded-random-b` or the folder), lora_unmerged_generate_rows_per_s, lora_unmerged_vs_base_generate,
    lora_generate_rows_per_s and lora_vs_base_generate (merged: the fine-tuned evaluation's speed / the base's),
    merged (what the check decided), merge_max_logit_diff and merge_agreement (the check's measure on
    its rows), merged_same_outputs (merged and unmerged `generate` outputs identical on every row).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model

from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import EvalConfig
from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings
from emotune.core.replies import INVALID, extract_label, label_pattern
from emotune.data import prompt_messages
from emotune.eval.evaluate import LabelPrompt, generate_outputs
from emotune.eval.merged import CHECK_ROWS, merged_for_eval
from emotune.eval.scoring import LabelScorer
from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir
from emotune.model.lora import lora_config
from emotune.model.turns import stop_token_ids

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "datasets" / "emotion" / "test.jsonl"
TRAINED_B_STD = 0.002  # std of B in the default run's trained adapters (0.0019 and 0.0025 measured)


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


def with_adapter(model, adapter: Path | None):
    """The fine-tuned model: a trained adapter folder, or the default LoRA with seeded trained-size B matrices."""
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter).eval()
    adapted = get_peft_model(model, lora_config(LoraSettings(), model))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * TRAINED_B_STD)
    return adapted.eval()


def smoke_setup(folder: Path) -> tuple[Path, list[dict]]:
    """A 2-layer random Gemma 3 with the test suite's tokenizer, and 12 rows of its fixture data."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import LABELS, build_tokenizer, make_rows

    tokenizer = build_tokenizer(folder)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                              sliding_window=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder, [{**row, "label_id": LABELS.index(row["label"])} for row in make_rows(2, seed=3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--generate-batch-size", type=int, default=16, help="emotune generate (the lead's measured setting)")
    parser.add_argument("--score-batch-size", type=int, default=32, help="emotune score (what eval.batch_size=auto picks on CPU)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--adapter", type=Path, default=None,
                        help="a trained adapter folder on the packaged model (default: seeded random B of trained size)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and 12 rows: checks the script runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir, records = smoke_setup(Path(tmp))
        elif not args.data.is_file():
            print(f"skipped: {args.data} not found (the emotion test split is needed for this benchmark)")
            return 0
        else:
            model_dir = resolve_model_dir(ModelConfig())
            records = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines() if line.strip()]
        print(json.dumps(measure(model_dir, records, args)))
    return 0


def measure(model_dir: Path, records: list[dict], args) -> dict:
    labels = [name for _, name in sorted({(r["label_id"], r["label"]) for r in records})]
    rows = records[:args.rows]
    texts, gold = [r["text"] for r in rows], [r["label"] for r in rows]
    prompt = PromptConfig()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    model = load_model(model_dir, getattr(torch, args.dtype), torch.device("cpu")).eval()

    reference, reference_s = timed(lambda: [reference_generate_label(model, tokenizer, t, prompt, labels) for t in texts])
    cfg = EvalConfig(batch_size=args.generate_batch_size)
    pattern = label_pattern(labels)
    raw, generate_s = timed(lambda: generate_outputs(model, tokenizer, texts, LabelPrompt(prompt, labels), cfg, desc=None))
    generated = [extract_label(output, labels, pattern) for output in raw]
    log_probs, score_s = timed(lambda: LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, args.score_batch_size))
    scored = [labels[i] for i in log_probs.argmax(-1).tolist()]

    # Last: attaching the adapter changes `model` in place. Unmerged, then merged as the fine-tuned evaluation runs it.
    adapted = with_adapter(model, args.adapter)
    unmerged_raw, unmerged_s = timed(lambda: generate_outputs(adapted, tokenizer, texts, LabelPrompt(prompt, labels), cfg, desc=None))
    sample = [tokenizer.apply_chat_template(prompt_messages(t, prompt, labels), tokenize=True, add_generation_prompt=True,
                                            return_dict=False) for t in texts[:CHECK_ROWS]]
    with merged_for_eval(adapted, sample, cfg.merge_adapters, cfg.merge_tolerance) as merge:
        merged_raw, merged_s = timed(lambda: generate_outputs(adapted, tokenizer, texts, LabelPrompt(prompt, labels), cfg, desc=None))

    def accuracy(predicted: list[str]) -> float:
        return round(sum(p == g for p, g in zip(predicted, gold, strict=False)) / len(gold), 4)

    n = len(texts)
    return {
        "rows": n,
        "reference_rows_per_s": round(n / reference_s, 2),
        "generate_rows_per_s": round(n / generate_s, 2),
        "score_rows_per_s": round(n / score_s, 2),
        "ratio": round(reference_s / score_s, 2),
        "score_vs_generate": round(generate_s / score_s, 2),
        "adapter": str(args.adapter) if args.adapter else "seeded-random-b",
        "lora_unmerged_generate_rows_per_s": round(n / unmerged_s, 2),
        "lora_unmerged_vs_base_generate": round(generate_s / unmerged_s, 2),
        "lora_generate_rows_per_s": round(n / merged_s, 2),
        "lora_vs_base_generate": round(generate_s / merged_s, 2),
        "merged": merge["merged"],
        "merge_max_logit_diff": merge.get("max_logit_diff"),
        "merge_agreement": merge.get("agreement"),
        "merged_same_outputs": merged_raw == unmerged_raw,
        "agreement": round(sum(s == g for s, g in zip(scored, generated, strict=False)) / n, 4),
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
    }


if __name__ == "__main__":
    sys.exit(main())
