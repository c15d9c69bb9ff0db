"""Do the exported GGUF files answer as the merged model does? One JSON line per comparison.

    python bench/gguf_agreement.py RUN_DIR [--quants f16 q8_0 q4_0] [--limit N] [--engines emotune llama.cpp]

For the run's test split (the first N rows with --limit), greedy answers with the run's own prompt from:
- the merged model (RUN_DIR/export/merged, written by `emotune export RUN_DIR --format gguf` when missing), the
  reference;
- each GGUF through emotune's own evaluation (`model.source=` the .gguf: transformers' GGUF reader, as `emotune eval
  CONFIG model.source=FILE.gguf` runs it);
- each GGUF through llama.cpp (llama-cpp-python, when installed), and the adapter GGUF applied to the base model's
  GGUF (`lora_path`) against the merged f16 GGUF.
Each line: engine, model, rows, agreement (share of labels equal to the reference's), macro_f1 of its labels against
the gold labels, and the reference's macro_f1; for every row whose label differs (`flips`): the row, both labels, and
the merged model's margin at the answer's first token (log-probability of its top token minus the runner-up's, in
nats) with that margin's rank among all rows (0: the closest call), so a flip can be told from a tie.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from emotune.core.config.load import load_config
from emotune.core.config.model import ModelConfig
from emotune.core.replies import extract_label, label_pattern
from emotune.core.rundir import RunDir
from emotune.data import prompt_messages
from emotune.data.prepare import prepare_data
from emotune.deploy.gguf_export import export_gguf
from emotune.deploy.gguf_write import gguf_meta, write_gguf
from emotune.eval.evaluate import LabelPrompt, compute_metrics, evaluate
from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir


def emotune_answers(model_dir: Path, cfg, dataset, labels: list[str], method: str) -> list[tuple[str, str]]:
    """(label, raw reply) per row, as `emotune eval` gets them: generate (greedy; the reply is the generated text) or
    score (the label of highest probability; the reply is the rounded probabilities)."""
    model = load_model(model_dir, torch.float32, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    eval_cfg = cfg.eval.model_copy(update={"method": method})
    result = evaluate(model, tokenizer, dataset, LabelPrompt(cfg.prompt, labels), eval_cfg, desc=model_dir.name)
    if method == "score":
        return [(row["predicted"], "") for row in result.rows]
    return [(row["predicted"], row["raw_output"]) for row in result.rows]


def prompt_text(tokenizer, cfg, labels: list[str], text: str) -> str:
    return tokenizer.apply_chat_template(prompt_messages(text, cfg.prompt, labels), tokenize=False, add_generation_prompt=True)


def first_token_margins(model_dir: Path, cfg, labels: list[str], texts: list[str]) -> list[float]:
    """Per row, how far the merged model's first answer token leads the runner-up (log-probabilities, nats)."""
    model = load_model(model_dir, torch.float32, torch.device("cpu")).eval()
    tokenizer = load_tokenizer(model_dir, ModelConfig())
    margins = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(prompt_text(tokenizer, cfg, labels, text), add_special_tokens=False, return_tensors="pt").input_ids
            top = model(input_ids=ids).logits[0, -1].float().log_softmax(-1).topk(2).values
            margins.append(float(top[0] - top[1]))
    return margins


def llama_cpp_labels(gguf_file: Path, tokenizer, cfg, labels: list[str], texts: list[str], lora: Path | None = None) -> list[str]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_file), lora_path=str(lora) if lora else None, n_ctx=1024, n_threads=2, seed=0,
                verbose=False)
    pattern = label_pattern(labels)
    predicted = []
    for text in texts:
        prompt = prompt_text(tokenizer, cfg, labels, text)
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)  # the template already starts with BOS
        reply = llm.create_completion(prompt=tokens, max_tokens=cfg.eval.max_new_tokens, temperature=0.0, top_k=1)
        predicted.append(extract_label(reply["choices"][0]["text"], labels, pattern))
    return predicted


def line(engine: str, model: str, predicted: list[str], reference: list[str], gold: list[str], labels: list[str],
         replies: tuple[list[str], list[str]] | None = None, margins: list[float] | None = None) -> None:
    """`agreement`: equal labels; `reply_agreement` (emotune engine): equal raw replies, which also counts two
    different invalid answers as a disagreement; `flips`: [row, reference label, label, margin, margin rank]."""
    agreement = sum(p == r for p, r in zip(predicted, reference, strict=True)) / len(reference)
    found = {"engine": engine, "model": model, "rows": len(reference), "agreement": round(agreement, 4),
             "macro_f1": round(compute_metrics(gold, predicted, labels)["macro_f1"], 4),
             "reference_macro_f1": round(compute_metrics(gold, reference, labels)["macro_f1"], 4),
             "reference_invalid": sum(r not in labels for r in reference)}
    if margins:
        ranked = sorted(margins)
        found["flips"] = [[i, r, p, round(margins[i], 3), ranked.index(margins[i])]
                          for i, (p, r) in enumerate(zip(predicted, reference, strict=True)) if p != r]
    if replies:
        found["reply_agreement"] = round(sum(a == b for a, b in zip(*replies, strict=True)) / len(reference), 4)
    print(json.dumps(found), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--quants", nargs="+", default=["f16", "q8_0"])
    parser.add_argument("--limit", type=int, help="the first N test rows only")
    parser.add_argument("--method", default="generate", choices=["generate", "score"],
                        help="emotune's path: greedy answers (the reference recipe) or label probabilities")
    parser.add_argument("--engines", nargs="+", default=["emotune", "llama.cpp"], choices=["emotune", "llama.cpp"])
    args = parser.parse_args()
    run = RunDir(args.run_dir)
    cfg = load_config(str(run.config), [])
    from emotune.model.artifacts import find_artifact

    artifact = find_artifact(run.root)
    if not (run.export / "merged" / "config.json").is_file():
        export_gguf(run.root, None, "f16", ollama=False, force=True)
    folder = run.export / "gguf"
    files = {}
    for quant in args.quants:
        files[quant] = folder / f"{artifact.name}-{quant}.gguf"
        if not files[quant].is_file():
            write_gguf(run.export / "merged", files[quant], quant, gguf_meta(artifact), vocab_dir=resolve_model_dir(artifact.model_cfg))
    data = prepare_data(cfg)
    labels = artifact.labels
    dataset = data.splits["test"]
    if args.limit:
        dataset = dataset.select(range(min(args.limit, len(dataset))))
    gold, texts = list(dataset["label"]), list(dataset["text"])
    merged_answers = emotune_answers(run.export / "merged", cfg, dataset, labels, args.method)
    reference = [label for label, _ in merged_answers]
    margins = first_token_margins(run.export / "merged", cfg, labels, texts)
    if "emotune" in args.engines:
        with tempfile.TemporaryDirectory() as cache:
            for quant, path in files.items():
                converted = resolve_model_dir(ModelConfig(source=str(path), cache_dir=cache))
                answers = emotune_answers(converted, cfg, dataset, labels, args.method)
                line(f"emotune ({args.method})", quant, [label for label, _ in answers], reference, gold, labels,
                     ([reply for _, reply in answers], [reply for _, reply in merged_answers]) if args.method == "generate" else None,
                     margins)
    if "llama.cpp" in args.engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(json.dumps({"engine": "llama.cpp", "skipped": "llama-cpp-python is not installed (pip install 'emotune[gguf]')"}))
            return 0
        tokenizer = load_tokenizer(run.export / "merged", ModelConfig())
        for quant, path in files.items():
            line("llama.cpp", quant, llama_cpp_labels(path, tokenizer, cfg, labels, texts), reference, gold, labels, margins=margins)
        base_file = folder / "base-f16.gguf"
        if not base_file.is_file():
            write_gguf(resolve_model_dir(artifact.model_cfg), base_file, "f16", {"name": "base"})
        lora = folder / f"{artifact.name}-lora.gguf"
        merged_f16 = llama_cpp_labels(files.get("f16") or next(iter(files.values())), tokenizer, cfg, labels, texts)
        line("llama.cpp", "base-f16 + lora (vs merged f16 gguf)", llama_cpp_labels(base_file, tokenizer, cfg, labels, texts, lora),
             merged_f16, gold, labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
