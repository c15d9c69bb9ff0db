"""The evaluation stage: the same prompts before and after training, two ways to read a label, then metrics.

`generate` is the reference recipe's method: chat template, greedy decoding with `max_new_tokens`,
a regex that takes the first label name in the output, INVALID when none matches. Batched with left
padding, which gives the same greedy tokens as one row at a time up to floating-point ties.

`score` reads the same prompt's exact probability of every label (`LabelScorer`) and predicts the most
likely one, so it can never emit an invalid label; its probabilities also give top-2 accuracy, log-loss
and calibration. Both sort rows by length to cut padding and halve the batch on out-of-memory.
"""

from __future__ import annotations

import copy
import csv
import json
import re
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from sklearn.metrics import (accuracy_score, confusion_matrix, f1_score, log_loss, precision_recall_fscore_support,
                             top_k_accuracy_score)
from tqdm.auto import tqdm

from emotune.config import EvalConfig, PromptConfig
from emotune.data import prompt_messages, system_prompt
from emotune.errors import UserError
from emotune.models import END_OF_TURN, stop_token_ids
from emotune.rundir import atomic_file, write_json

INVALID = "INVALID"
UNSPACED_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN")


@dataclass
class EvalResult:
    rows: list[dict]  # text, gold, predicted; generate: raw_output; score: p_<label> for every label
    metrics: dict


def label_pattern(labels: list[str]) -> re.Pattern[str]:
    """Whole-word, case-insensitive match of any label; longer names first so `joyful` never reads as `joy`.

    Scripts written without spaces (Chinese, Japanese, Thai, ...) have no word boundaries to test, so
    a label edge in such a script matches next to anything (`我觉得是喜悦。` -> 喜悦).
    """
    def bounded(label: str) -> str:
        before = "" if _unspaced(label[:1]) else r"(?<!\w)"
        after = "" if _unspaced(label[-1:]) else r"(?!\w)"
        return before + re.escape(label) + after

    alternatives = "|".join(bounded(label) for label in sorted(labels, key=len, reverse=True))
    return re.compile(rf"({alternatives})", re.IGNORECASE)


def _unspaced(char: str) -> bool:
    return bool(char) and unicodedata.name(char, "").startswith(UNSPACED_SCRIPTS)


def extract_label(output: str, labels: list[str], pattern: re.Pattern[str] | None = None) -> str:
    match = (pattern or label_pattern(labels)).search(output)
    if match is None:
        return INVALID
    found = match.group(1).casefold()
    return next(label for label in labels if label.casefold() == found)


def _is_out_of_memory(err: BaseException) -> bool:
    text = str(err).lower()
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def run_in_batches(order: list[int], batch_size: int, step, desc: str | None = None) -> None:
    """Call `step(rows)` on consecutive batches of `order`; out of memory halves the batch and retries it."""
    with tqdm(total=len(order), desc=desc, unit="row", disable=desc is None) as bar:
        start = 0
        while start < len(order):
            batch = order[start:start + batch_size]
            try:
                step(batch)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not _is_out_of_memory(err):
                    raise
                if batch_size == 1:
                    raise UserError("Evaluation ran out of memory with one row per batch. Use a smaller model, "
                                    "model.dtype=bfloat16, or a device with more memory.") from None
                batch_size = max(1, batch_size // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"Out of memory: retrying with eval batch size {batch_size}", flush=True)
                continue
            start += len(batch)
            bar.update(len(batch))


@torch.inference_mode()
def generate_outputs(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str],
                     cfg: EvalConfig, desc: str | None, batch_size: int | None = None) -> list[str]:
    """Greedy-decode up to `max_new_tokens` for every text; batches sorted by length to cut padding."""
    device = next(model.parameters()).device
    prompts = [tokenizer.apply_chat_template(prompt_messages(t, prompt, labels), tokenize=False, add_generation_prompt=True)
               for t in texts]
    outputs: list[str] = [""] * len(prompts)
    tokenizer.padding_side = "left"  # decoder-only batching: new tokens must follow the real prompt directly

    def step(batch: list[int]) -> None:
        # the chat template already holds <bos>; adding special tokens again would double it
        enc = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        generated = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, do_sample=False, num_beams=1,
                                   eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                   top_p=None, top_k=None, temperature=None)
        new_tokens = generated[:, enc["input_ids"].shape[1]:]
        for i, text in zip(batch, tokenizer.batch_decode(new_tokens, skip_special_tokens=True)):
            outputs[i] = text.strip()

    was_training = model.training
    model.eval()
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        run_in_batches(order, batch_size or (cfg.batch_size if cfg.batch_size != "auto" else 16), step, desc)
    finally:
        model.train(was_training)
    return outputs


def eval_methods(cfg: EvalConfig) -> list[str]:
    """The methods to run, the reference first: its numbers are the run's headline (`baseline/metrics.json`)."""
    return ["generate", "score"] if cfg.method == "both" else [cfg.method]


def evaluate(model, tokenizer, dataset: Dataset, labels: list[str], prompt: PromptConfig, cfg: EvalConfig,
             desc: str = "evaluate", method: str | None = None) -> EvalResult:
    """One method (default: the first of `eval.method`) over `dataset`: rows for predictions.csv, and metrics."""
    method = method or eval_methods(cfg)[0]
    started = time.perf_counter()
    texts, gold = list(dataset["text"]), list(dataset["label"])
    batch_size = choose_batch_size(model, tokenizer, texts, prompt, labels, cfg, method)
    if method == "score":
        log_probs = LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, batch_size, desc=f"{desc} (score)")
        probs = log_probs.softmax(-1)
        predicted = [labels[i] for i in probs.argmax(-1).tolist()]
        metrics = {**compute_metrics(gold, predicted, labels), **probability_metrics(gold, probs.numpy(), labels)}
        rows = [{"text": t, "gold": g, "predicted": p, **{f"p_{label}": round(float(q), 6) for label, q in zip(labels, row)}}
                for t, g, p, row in zip(texts, gold, predicted, probs.tolist())]
    else:
        raw = generate_outputs(model, tokenizer, texts, prompt, labels, cfg, f"{desc} (generate)", batch_size)
        pattern = label_pattern(labels)
        predicted = [extract_label(output, labels, pattern) for output in raw]
        metrics = compute_metrics(gold, predicted, labels)
        rows = [{"text": t, "gold": g, "raw_output": r, "predicted": p} for t, g, r, p in zip(texts, gold, raw, predicted)]
    seconds = time.perf_counter() - started
    metrics.update(method=method, batch_size=batch_size, seconds=round(seconds, 2),
                   rows_per_s=round(len(texts) / seconds, 2) if seconds else None)
    if method == "generate":
        metrics["max_new_tokens"] = cfg.max_new_tokens
    return EvalResult(rows=rows, metrics=metrics)


def evaluate_methods(model, tokenizer, dataset: Dataset, labels: list[str], prompt: PromptConfig, cfg: EvalConfig,
                     desc: str = "evaluate") -> dict[str, EvalResult]:
    return {m: evaluate(model, tokenizer, dataset, labels, prompt, cfg, desc, method=m) for m in eval_methods(cfg)}


def choose_batch_size(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str], cfg: EvalConfig,
                      method: str) -> int:
    """`eval.batch_size`, or for `auto` the most rows that fit in 40% of free memory, capped (see EvalConfig).

    The estimate covers the KV cache, one layer's activations and the float32 logits at the projected
    positions for the longest prompt; out-of-memory still halves the batch (`run_in_batches`).
    """
    if cfg.batch_size != "auto":
        return cfg.batch_size
    device = next(model.parameters()).device
    cap = (32 if method == "score" else 16) if device.type == "cpu" else (128 if method == "score" else 64)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest = max((len(t) for t in texts), default=0) // 2 + len(system_prompt(prompt, labels)) // 2 + 64  # ≥ 1 token / 2 chars
    per_row = _bytes_per_row(config, longest, cfg.max_new_tokens, method, next(model.parameters()).element_size(), len(labels))
    free = _free_memory(device)
    fits = int(0.4 * free // per_row) if free else cap
    return max(1, min(cap, fits))


def _bytes_per_row(config, tokens: int, new_tokens: int, method: str, element: int, n_labels: int) -> int:
    hidden = getattr(config, "hidden_size", 4096)
    layers = getattr(config, "num_hidden_layers", 32)
    heads = getattr(config, "num_attention_heads", 32)
    kv = getattr(config, "num_key_value_heads", heads) * getattr(config, "head_dim", hidden // heads)
    tokens += new_tokens if method == "generate" else 2 * n_labels
    cache = 2 * layers * kv * tokens * element
    activations = tokens * (4 * hidden + 2 * getattr(config, "intermediate_size", 4 * hidden) + heads * tokens) * 4
    positions = (n_labels + 1) if method == "score" else 1
    logits = 3 * positions * getattr(config, "vocab_size", 32000) * 4
    return cache + activations + logits


def _free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available


def compute_metrics(gold: list[str], predicted: list[str], labels: list[str]) -> dict:
    """Accuracy, macro/weighted F1 over the label set, per-class scores, invalid count, confusion matrix.

    INVALID predictions count as wrong for every class; the confusion matrix has an INVALID column
    (and row, always zero, so the matrix stays square).
    """
    matrix_labels = [*labels, INVALID]
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=labels, zero_division=0)
    return {
        "rows": len(gold),
        "accuracy": float(accuracy_score(gold, predicted)),
        "macro_f1": float(f1_score(gold, predicted, labels=labels, average="macro", zero_division=0)),
        "weighted_f1": float(f1_score(gold, predicted, labels=labels, average="weighted", zero_division=0)),
        "invalid": sum(p == INVALID for p in predicted),
        "per_class": {
            label: {"precision": float(p), "recall": float(r), "f1": float(s), "support": int(n)}
            for label, p, r, s, n in zip(labels, precision, recall, f1, support)
        },
        "confusion_matrix": {
            "labels": matrix_labels,
            "matrix": confusion_matrix(gold, predicted, labels=matrix_labels).tolist(),
        },
    }


def probability_metrics(gold: list[str], probs: np.ndarray, labels: list[str], bins: int = 10) -> dict:
    """Top-2 accuracy, log-loss and expected calibration error of per-label probabilities [rows, labels]."""
    index = {label: i for i, label in enumerate(labels)}
    truth = np.array([index[g] for g in gold])
    classes = list(range(len(labels)))
    top2 = 1.0 if len(labels) <= 2 else float(top_k_accuracy_score(truth, probs, k=2, labels=classes))
    return {
        "top2_accuracy": top2,
        "log_loss": float(log_loss(truth, probs, labels=classes)),
        "ece": expected_calibration_error(truth, probs, bins),
        "ece_bins": bins,
    }


def expected_calibration_error(truth: np.ndarray, probs: np.ndarray, bins: int = 10) -> float:
    """Σ_b (rows in b / rows) · |accuracy(b) − mean confidence(b)| over equal-width bins of the top probability."""
    confidence = probs.max(1)
    correct = probs.argmax(1) == truth
    which = np.minimum((confidence * bins).astype(int), bins - 1)  # confidence 1.0 falls in the last bin
    ece = 0.0
    for b in range(bins):
        in_bin = which == b
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


def write_result(result: EvalResult, folder: Path) -> None:
    """metrics.json and predictions.csv, each written to a temporary name and renamed into place."""
    with atomic_file(folder / "predictions.csv") as tmp, tmp.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result.rows[0]) if result.rows else ["text", "gold", "raw_output", "predicted"])
        writer.writeheader()
        writer.writerows(result.rows)
    write_json(folder / "metrics.json", result.metrics)  # metrics last: its presence marks the stage as complete


def method_folder(folder: Path, method: str, methods: list[str]) -> Path:
    """The first method's results live in `folder` itself, any other method's in `folder/<method>/`."""
    return folder if method == methods[0] else folder / method


def write_results(results: dict[str, EvalResult], folder: Path) -> None:
    methods = list(results)
    for method in reversed(methods):  # the first method last: `folder/metrics.json` marks the stage complete
        write_result(results[method], method_folder(folder, method, methods))


def read_metrics(folder: Path, methods: list[str]) -> dict[str, dict] | None:
    """{method: metrics} when every method's metrics.json exists in `folder` (and matches its method), else None."""
    found = {}
    for method in methods:
        path = method_folder(folder, method, methods) / "metrics.json"
        if not path.is_file():
            return None
        metrics = json.loads(path.read_text(encoding="utf-8"))
        if metrics.get("method", "generate") != method:
            return None
        found[method] = metrics
    return found


# --------------------------------------------------------------------------------------------------
# Scoring: the exact probability of every label's completion, never an invalid label.


def label_token_ids(tokenizer, prompt: PromptConfig, labels: list[str]) -> list[list[int]]:
    """Each label's completion tokens as the model sees them right after the generation prompt.

    Training teaches the completion `label<end_of_turn>`. When no label's tokens are a prefix of another's,
    the events "the answer starts with label i" are disjoint and each is scored by the label's own tokens.
    When one is a prefix of another (`joy` / `joyful` tokenized as `joy` + `ful`), every label is scored with
    its end-of-turn token, so `joy` means "joy, then stop". The end-of-turn token costs one more vocabulary
    projection per label and row, which is why it is added only where it changes the answer. Tokens are
    cut from the label rendered in context, so tokenizers that merge across the boundary are handled.
    """
    probe = tokenizer.apply_chat_template(prompt_messages("x", prompt, labels), tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    end = END_OF_TURN if END_OF_TURN in tokenizer.get_vocab() else (tokenizer.eos_token or "")

    def completion(text: str) -> list[int]:
        full = tokenizer(probe + text, add_special_tokens=False)["input_ids"]
        if full[:len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
            return full[len(prompt_ids):]
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # merged into the prompt: take it alone

    bare = [completion(label) for label in labels]
    ambiguous = any(i != j and b[:len(a)] == a for i, a in enumerate(bare) for j, b in enumerate(bare))
    return [completion(label + end) for label in labels] if ambiguous and end else bare


@dataclass(frozen=True)
class LabelTrie:
    """Where each label token's log-probability is read, with label prefixes shared.

    Node 0 is the end of the prompt; node k > 0 is a proper prefix of some label's tokens. `paths` are the
    longest such prefixes: feeding each path after the prompt yields the hidden state of every node on it,
    so the vocabulary projection runs once per node, however many labels share it.
    """

    steps: list[list[tuple[int, int]]]  # per label: (node, next token) for every token of the label
    paths: list[list[int]]  # token sequences fed after the prompt
    node_at: list[tuple[int, int]]  # for node k > 0: (path index, position in path)

    @classmethod
    def build(cls, sequences: list[list[int]]) -> LabelTrie:
        nodes: dict[tuple[int, ...], int] = {(): 0}
        steps = []
        for seq in sequences:
            label_steps = []
            for k, token in enumerate(seq):
                node = nodes.setdefault(tuple(seq[:k]), len(nodes))
                label_steps.append((node, token))
            steps.append(label_steps)
        inner = [prefix for prefix in nodes if prefix]
        paths = [list(p) for p in inner if not any(len(q) > len(p) and q[:len(p)] == p for q in inner)]
        node_at = [(0, 0)] * len(nodes)
        for prefix, node in nodes.items():
            if prefix:
                m = next(i for i, path in enumerate(paths) if tuple(path[:len(prefix)]) == prefix)
                node_at[node] = (m, len(prefix) - 1)
        return cls(steps=steps, paths=paths, node_at=node_at[1:])

    @property
    def n_nodes(self) -> int:
        return 1 + len(self.node_at)


def _body_and_head(model):
    """The transformer body (hidden states) and the output projection, looking through a PEFT wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings(), getattr(base.config, "final_logit_softcapping", None)


def _common_prefix(sequences: list[list[int]]) -> int:
    shortest = min(sequences, key=len)
    for i, token in enumerate(shortest):
        if any(seq[i] != token for seq in sequences):
            return i
    return len(shortest)


class LabelScorer:
    """log P(label completion | chat prompt) for every label, exactly, in one forward pass per batch.

    The prompt's shared head (system prompt and the user template up to the text) is computed once and
    its KV cache reused by every batch. Each batch then feeds, per row, only the row-specific suffix
    followed by the label tree (`LabelTrie.paths`), under an attention mask that lets every path token see
    the prompt and its own path only. Rows are padded in the middle (between the head and the suffix);
    padding is masked and positions are set explicitly, and sliding windows are applied by position, so
    a row scores as it would alone. The vocabulary projection runs only at the end of each prompt and at
    the label-tree nodes.
    """

    def __init__(self, model, tokenizer, prompt: PromptConfig, labels: list[str], padding_side: str = "left"):
        self.model, self.tokenizer, self.prompt, self.labels = model, tokenizer, prompt, labels
        self.body, self.head, self.softcap = _body_and_head(model)
        self.trie = LabelTrie.build(label_token_ids(tokenizer, prompt, labels))
        self.padding_side = padding_side
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layer_types = sorted(set(getattr(config, "layer_types", None) or []))
        self.sliding_window = getattr(config, "sliding_window", None)
        self._prefix: tuple[tuple[int, ...], object] | None = None

    def prompt_ids(self, texts: list[str]) -> list[list[int]]:
        rendered = [self.tokenizer.apply_chat_template(prompt_messages(t, self.prompt, self.labels), tokenize=False,
                                                       add_generation_prompt=True) for t in texts]
        # the chat template already holds <bos>; adding special tokens again would double it
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def shared_prefix(self, ids: list[list[int]]) -> list[int]:
        """The token prefix every row shares (at least the prompt up to the text), leaving each row ≥ 1 token."""
        probes = self.prompt_ids(["x", "y"])
        length = min(_common_prefix([*ids, *probes]), min(len(seq) for seq in ids) - 1)
        return ids[0][:length]

    @torch.inference_mode()
    def log_probs(self, texts: list[str], batch_size: int = 16, desc: str | None = None) -> torch.Tensor:
        """[len(texts), len(labels)] float32 log-probabilities (not renormalised over the labels)."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids = self.prompt_ids(texts)
            prefix = self.shared_prefix(ids)
            suffixes = [seq[len(prefix):] for seq in ids]
            out = torch.empty(len(texts), len(self.labels), dtype=torch.float32)

            def score(batch: list[int]) -> None:
                out[batch] = self._score_batch(prefix, [suffixes[i] for i in batch])

            run_in_batches(sorted(range(len(texts)), key=lambda i: len(suffixes[i])), batch_size, score, desc)
        finally:
            self.model.train(was_training)
        return out

    def _attention_mask(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """`allowed` [rows, queries, keys] in the form the model's attention takes, per layer type."""
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise UserError(f"eval.method=score needs the `sdpa` or `eager` attention implementation (the model uses "
                            f"`{impl}`), because it passes its own attention mask. Load the model with sdpa.")

        def as_mask(keep: torch.Tensor) -> torch.Tensor:
            keep = keep[:, None]
            if impl == "eager":
                return torch.zeros(keep.shape, dtype=self.head.weight.dtype, device=keep.device).masked_fill(
                    ~keep, torch.finfo(self.head.weight.dtype).min)
            return keep

        if not self.layer_types:
            return as_mask(allowed)
        masks = {}
        for kind in self.layer_types:
            keep = allowed
            if kind == "sliding_attention" and self.sliding_window:
                keep = allowed & (query_pos[:, :, None] - key_pos[:, None, :] < self.sliding_window)
            masks[kind] = as_mask(keep)
        return masks

    def _prefix_cache(self, prefix: list[int]):
        """KV cache of the shared head; a plain cache (no sliding truncation) so every layer keeps every key."""
        from transformers import DynamicCache

        if self._prefix is None or self._prefix[0] != tuple(prefix):
            cache = DynamicCache()
            if prefix:
                device = self.head.weight.device
                pos = torch.arange(len(prefix), device=device)[None]
                allowed = pos[:, :, None] >= pos[:, None, :]
                self.body(input_ids=torch.tensor([prefix], device=device), position_ids=pos,
                          attention_mask=self._attention_mask(allowed, pos, pos), cache=cache, use_cache=True)
            self._prefix = (tuple(prefix), cache)
        return copy.deepcopy(self._prefix[1])

    def _score_batch(self, prefix: list[int], suffixes: list[list[int]]) -> torch.Tensor:
        device = self.head.weight.device
        rows, width, n_prefix = len(suffixes), max(len(s) for s in suffixes), len(prefix)
        paths = self.trie.paths
        tree_tokens = [token for path in paths for token in path]
        tree_group = [m + 1 for m, path in enumerate(paths) for _ in path]  # group 0: prompt; m + 1: path m
        tree_depth = [j for path in paths for j in range(len(path))]
        path_start = [sum(len(p) for p in paths[:m]) for m in range(len(paths))]

        lengths = torch.tensor([len(s) for s in suffixes], device=device)
        input_ids = torch.full((rows, width + len(tree_tokens)), self.pad_id, dtype=torch.long, device=device)
        valid = torch.zeros((rows, width), dtype=torch.bool, device=device)
        for r, suffix in enumerate(suffixes):
            span = slice(width - len(suffix), width) if self.padding_side == "left" else slice(0, len(suffix))
            input_ids[r, span] = torch.tensor(suffix, device=device)
            valid[r, span] = True
        input_ids[:, width:] = torch.tensor(tree_tokens, dtype=torch.long, device=device)

        # Positions as if each row stood alone: the suffix follows the head, each path follows its row's suffix.
        suffix_pos = n_prefix + (valid.long().cumsum(1) - 1).clamp(min=0)
        tree_pos = n_prefix + lengths[:, None] + torch.tensor(tree_depth, device=device)
        query_pos = torch.cat([suffix_pos, tree_pos], 1)
        key_pos = torch.cat([torch.arange(n_prefix, device=device).expand(rows, -1), query_pos], 1)
        group = torch.tensor([0] * width + tree_group, device=device)
        key_group = torch.cat([torch.zeros(n_prefix, dtype=torch.long, device=device), group])
        key_valid = torch.cat([torch.ones((rows, n_prefix), dtype=torch.bool, device=device), valid,
                               torch.ones((rows, len(tree_tokens)), dtype=torch.bool, device=device)], 1)
        same_branch = (key_group[None, :] == 0) | (key_group[None, :] == group[:, None])  # [queries, keys]
        allowed = key_valid[:, None, :] & same_branch[None] & (key_pos[:, None, :] <= query_pos[:, :, None])

        cache = self._prefix_cache(prefix)
        cache.batch_repeat_interleave(rows)
        hidden = self.body(input_ids=input_ids, position_ids=query_pos, cache=cache, use_cache=True,
                           attention_mask=self._attention_mask(allowed, query_pos, key_pos)).last_hidden_state

        last = torch.full_like(lengths, width - 1) if self.padding_side == "left" else lengths - 1
        columns = [last] + [torch.full_like(lengths, width + path_start[m] + j) for m, j in self.trie.node_at]
        node_hidden = hidden[torch.arange(rows, device=device)[:, None], torch.stack(columns, 1)]  # [rows, nodes, hidden]
        logits = self.head(node_hidden).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        node_logp = logits.log_softmax(-1)
        scores = torch.zeros(rows, len(self.labels), device=device)
        for i, steps in enumerate(self.trie.steps):
            for node, token in steps:
                scores[:, i] += node_logp[:, node, token]
        return scores.cpu()


def score_label_probs(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str],
                      batch_size: int = 16) -> torch.Tensor:
    """[len(texts), len(labels)] probabilities over the label set: softmax of each label's exact log-probability.

    The prompt is the one `generate` uses (chat template, generation prompt); each label is scored by its
    full token sequence, followed by the end-of-turn token when labels share a token prefix (see
    `label_token_ids`).
    """
    return LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, batch_size).softmax(-1)
