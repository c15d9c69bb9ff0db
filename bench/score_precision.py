"""Label scores in float32: exact top-1 ties in bf16, and what the float32 projection costs.

    PYTHONPATH=src python bench/score_precision.py [--rows 240] [--batch-size 16] [--smoke]

The packaged Gemma 3 270M (`model.source=embedded`) scores the packaged emotion test split (240 rows, 6 labels, the
default prompt) three ways in one process:
- `bf16`: the weights in bfloat16, the scorer as it is (the label positions projected and soft-maxed in float32);
- `bf16_projection`: the same weights, the label positions projected in bfloat16 and upcast after (the scorer
  before issue 28);
- `fp32`: the weights in float32.
A row ties when its two largest label probabilities are exactly equal (the argmax then falls to label order).

`--smoke`: a 2-layer random Gemma 3 and 12 synthetic rows in a temporary folder, to check the script runs.

Prints one JSON line: rows, ties_bf16, ties_bf16_projection, ties_fp32, ties_bf16_not_fp32 (rows tied in bf16
but not in fp32: bf16 rounding's ties; the float32 projection keeps this 0), seconds_bf16, seconds_bf16_projection
and projection_cost (seconds_bf16 / seconds_bf16_projection, measured side by side, alternating, best of
`--repeats`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from emotune.core.config.data import PromptConfig
from emotune.core.config.model import ModelConfig
from emotune.data.sources import PACKAGED, embedded_dataset_dir
from emotune.eval import scoring
from emotune.eval.scoring import LabelScorer
from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir


def tied_rows(probs: torch.Tensor) -> set[int]:
    """Rows whose two largest probabilities are exactly equal."""
    top = probs.topk(2, dim=-1).values
    return {int(i) for i in torch.nonzero(top[:, 0] == top[:, 1]).flatten()}


@contextmanager
def projected_in_model_dtype():
    """The scorer as it was before issue 28: the label positions projected in the weights' dtype, upcast after."""
    with mock.patch.object(scoring, "float32_logits", lambda head, hidden: head(hidden).float()):
        yield


def timed_probs(model, tokenizer, texts: list[str], labels: list[str], batch_size: int) -> tuple[torch.Tensor, float]:
    scorer = LabelScorer(model, tokenizer, PromptConfig(), labels)
    started = time.perf_counter()
    probs = scorer.log_probs(texts, batch_size).softmax(-1)
    return probs, time.perf_counter() - started


def measure(folder: Path, texts: list[str], labels: list[str], batch_size: int, repeats: int) -> dict:
    tokenizer = load_tokenizer(folder, ModelConfig())
    cpu = torch.device("cpu")
    bf16 = load_model(folder, torch.bfloat16, cpu)
    seconds = {"bf16": [], "bf16_projection": []}
    for _ in range(repeats):  # alternating, so a busy machine slows both alike
        probs_bf16, took = timed_probs(bf16, tokenizer, texts, labels, batch_size)
        seconds["bf16"].append(took)
        with projected_in_model_dtype():
            probs_old, took = timed_probs(bf16, tokenizer, texts, labels, batch_size)
        seconds["bf16_projection"].append(took)
    del bf16
    probs_fp32, _ = timed_probs(load_model(folder, torch.float32, cpu), tokenizer, texts, labels, batch_size)
    ties = {name: tied_rows(p) for name, p in (("bf16", probs_bf16), ("bf16_projection", probs_old), ("fp32", probs_fp32))}
    best = {name: min(values) for name, values in seconds.items()}
    return {"rows": len(texts), **{f"ties_{name}": len(rows) for name, rows in ties.items()},
            "ties_bf16_not_fp32": len(ties["bf16"] - ties["fp32"]),
            "ties_bf16_projection_not_fp32": len(ties["bf16_projection"] - ties["fp32"]),
            "seconds_bf16": round(best["bf16"], 2), "seconds_bf16_projection": round(best["bf16_projection"], 2),
            "projection_cost": round(best["bf16"] / best["bf16_projection"], 3)}


def _smoke_folder(root: Path) -> tuple[Path, list[str], list[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from conftest import LABELS, build_tokenizer, make_rows

    tokenizer = build_tokenizer(root)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(root)
    return root, [row["text"] for row in make_rows(2, seed=3)], LABELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            folder, texts, labels = _smoke_folder(Path(tmp))
        else:
            folder = resolve_model_dir(ModelConfig(source="embedded"))
            rows = [json.loads(line) for line in (embedded_dataset_dir("emotion") / "test.jsonl").read_text().splitlines()]
            texts = [row["text"] for row in rows][:args.rows]
            labels = list(PACKAGED["emotion"])
        print(json.dumps(measure(folder, texts, labels, args.batch_size, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
