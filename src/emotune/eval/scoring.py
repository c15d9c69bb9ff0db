"""Label-likelihood scoring: the exact probability of every label's completion, never an invalid label.

`LabelScorer` reads log P(label | chat prompt) for every label in one forward pass per batch: labels share
their token prefixes (`LabelTrie`) and the prompt's shared head is computed once and its KV cache reused.
`run_in_batches` (emotune.runtime.oom) is the batching both scoring and generation use: out of memory halves the batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from emotune.core.config.data import PromptConfig
from emotune.core.errors import UserError
from emotune.data import prompt_messages
from emotune.model.prefix import MASKED_ATTENTION, attention_masks, other_layers, positions_from_mask
from emotune.model.text import float32_logits, language_model, logit_scale, logit_softcap, soft_capped, unwrapped
from emotune.model.turns import answer_opening, continuation_ids, encode_rendered, special_texts, turn_end
from emotune.runtime.oom import run_in_batches
from emotune.train.batches import common_prefix_length


def label_token_ids(tokenizer, prompt: PromptConfig, labels: list[str]) -> list[list[int]]:
    """Each label's completion tokens as the model sees them right after the generation prompt.

    Training teaches the completion `label` + the template's closing of an answer (Gemma 3: `<end_of_turn>\\n`, Gemma 4:
    `<turn|>\\n`, Llama 2: ` </s>`; emotune.model.turns.answer_end). When every label's own tokens begin its taught
    completion and no label's tokens are a prefix of another's, the events "the answer starts with label i" are
    disjoint and each is scored by the label's own tokens. Otherwise every label is scored by the completion training
    teaches, through the end-of-turn token (all of it where the template closes answers with plain text): when one
    label is a prefix of another (`joy` / `joyful` tokenized as `joy` + `ful`), `joy` means "joy, then stop"; when a
    label's last token merges with the closing (SentencePiece reads `positive </s>` as `ve▁` + `</s>`, not `ve`),
    the label's own tokens are ones training never teaches. The closing costs a few more vocabulary projections per
    label and row, which is why it is added only where it changes the answer. Tokens are cut from the label rendered
    in context, so tokenizers that merge across the boundary are handled.
    """
    ending = turn_end(tokenizer)
    end = ending.suffix or tokenizer.eos_token or ""  # answer_end: what training appends to the label
    bare = answer_token_ids(tokenizer, prompt, labels, labels)
    if not end:
        return bare
    taught = answer_token_ids(tokenizer, prompt, labels, [label + end for label in labels])
    ambiguous = any(i != j and b[:len(a)] == a for i, a in enumerate(bare) for j, b in enumerate(bare))
    merged = any(t[:len(b)] != b for b, t in zip(bare, taught, strict=True))
    if not (ambiguous or merged):
        return bare
    stop = ending.token_id if ending.token_id is not None else tokenizer.convert_tokens_to_ids(end) if end == tokenizer.eos_token else None
    return [_through(t, stop, len(b) if t[:len(b)] == b else 0) for b, t in zip(bare, taught, strict=True)]


def _through(ids: list[int], stop: int | None, start: int) -> list[int]:
    """`ids` up to and including the first `stop` at or after `start`; all of them when there is none."""
    return ids[:ids.index(stop, start) + 1] if stop is not None and stop in ids[start:] else ids


def answer_token_ids(tokenizer, prompt: PromptConfig, labels: list[str], answers: list[str]) -> list[list[int]]:
    """Each answer's tokens as the model reads them right after the generation prompt (the same for every text: the
    text sits inside the user turn, before the template closes it)."""
    probe = tokenizer.apply_chat_template(prompt_messages("x", prompt, labels), tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
    opening = answer_opening(tokenizer)  # Llama 2's ` ` before an answer: its models read `▁joy` after `[/INST]`
    return [continuation_ids(tokenizer, probe, prompt_ids, opening + answer) for answer in answers]


def prompt_token_ids(tokenizer, prompt: PromptConfig, labels: list[str], texts: list[str]) -> list[list[int]]:
    """Each text's scoring prompt (system prompt, user turn, generation prompt) as token ids. A special token's text
    typed inside a text (`<|im_end|>`, `<start_of_turn>`) is read as plain text, never as the token: otherwise a
    row could close its user turn and answer itself (`<|im_end|>\\n<|im_start|>assistant\\njoy`)."""
    asked = [prompt_messages(t, prompt, labels) for t in texts]
    rendered = [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for messages in asked]
    # the chat template already holds <bos>; adding special tokens again would double it
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    specials = special_texts(tokenizer).keys()
    for r, row in enumerate(ids):
        if specials & set(row):  # a special token's text in the row: re-read as predict and serve read the prompt
            ids[r] = encode_rendered(tokenizer, rendered[r], [m["content"] for m in asked[r]])
    return ids


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
    """The transformer body (hidden states), the output projection and the text model's final logit soft-cap (a
    multimodal wrapper keeps it in its text config), looking through a PEFT wrapper."""
    base = unwrapped(model)
    return language_model(base), base.get_output_embeddings(), logit_softcap(base)


class LabelScorer:
    """log P(label completion | chat prompt) for every label, exactly, in one forward pass per batch.

    The prompt's shared head (system prompt and the user template up to the text) is computed once and
    its KV cache reused by every batch. Each batch then feeds, per row, only the row-specific suffix
    followed by the label tree (`LabelTrie.paths`), under an attention mask that lets every path token see
    the prompt and its own path only. Rows are padded in the middle (between the head and the suffix);
    padding is masked and positions are set explicitly, and sliding windows are applied by position, so
    a row scores as it would alone. The vocabulary projection runs only at the end of each prompt and at
    the label-tree nodes, in float32 whatever the model's dtype (emotune.model.text.float32_logits), then
    the model's own final soft-cap and the log-softmax, also in float32.

    A model that takes no explicit positions (ALiBi: `positions_from_mask`), or has layers that are not attention
    (convolutions, linear attention: `other_layers`), scores whole rows instead: each prompt followed by each label,
    right-padded under a 2-D mask, one sequence per row and label.
    """

    def __init__(self, model, tokenizer, prompt: PromptConfig, labels: list[str], padding_side: str = "left"):
        self.model, self.tokenizer, self.prompt, self.labels = model, tokenizer, prompt, labels
        self.body, self.head, self.softcap = _body_and_head(model)
        self.scale = logit_scale(model)
        self.label_ids = label_token_ids(tokenizer, prompt, labels)
        self.trie = LabelTrie.build(self.label_ids)
        self.whole_rows = positions_from_mask(model) is not None or other_layers(model) is not None
        self.padding_side = padding_side
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._prefix: tuple[tuple[int, ...], object] | None = None

    def prompt_ids(self, texts: list[str]) -> list[list[int]]:
        return prompt_token_ids(self.tokenizer, self.prompt, self.labels, texts)

    def shared_prefix(self, ids: list[list[int]]) -> list[int]:
        """The token prefix every row shares (at least the prompt up to the text), leaving each row ≥ 1 token."""
        probes = self.prompt_ids(["x", "y"])
        length = min(common_prefix_length(*ids, *probes), min(len(seq) for seq in ids) - 1)
        return ids[0][:length]

    @torch.inference_mode()
    def log_probs(self, texts: list[str], batch_size: int = 16, desc: str | None = None) -> torch.Tensor:
        """[len(texts), len(labels)] float32 log-probabilities (not renormalised over the labels)."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids = self.prompt_ids(texts)
            prefix = [] if self.whole_rows else self.shared_prefix(ids)
            suffixes = [seq[len(prefix):] for seq in ids]
            out = torch.empty(len(texts), len(self.labels), dtype=torch.float32)

            def score(batch: list[int]) -> None:
                rows = [suffixes[i] for i in batch]
                out[batch] = self._score_whole_rows(rows) if self.whole_rows else self._score_batch(prefix, rows)

            run_in_batches(sorted(range(len(texts)), key=lambda i: len(suffixes[i])), batch_size, score, desc)
        finally:
            self.model.train(was_training)
        return out

    def _attention_mask(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """`allowed` [rows, queries, keys] in the form the model's attention takes, per layer type."""
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        if impl not in MASKED_ATTENTION:
            raise UserError(f"eval.method=score needs the `sdpa` or `eager` attention implementation (the model uses "
                            f"`{impl}`), because it passes its own attention mask. Set model.attn_implementation=sdpa "
                            "(eager for models without an sdpa path, such as Gemma 2's soft-capped attention), or "
                            "eval.method=generate.")
        return attention_masks(self.model.config, self.head.weight.dtype, allowed, query_pos, key_pos)

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
        # dtype long: with single-token labels the tree is empty, and an empty torch.tensor([]) is float32, which
        # would make every position float (harmless under RoPE, an index error in a learned position table: GPT-2)
        tree_pos = n_prefix + lengths[:, None] + torch.tensor(tree_depth, dtype=torch.long, device=device)
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
        logits = float32_logits(self.head, node_hidden)
        if self.scale != 1.0:  # Granite's / logits_scaling, Cohere's * logit_scale, as their forwards apply them
            logits = logits * self.scale
        node_logp = soft_capped(logits, self.softcap).log_softmax(-1)
        scores = torch.zeros(rows, len(self.labels), device=device)
        for i, steps in enumerate(self.trie.steps):
            for node, token in steps:
                scores[:, i] += node_logp[:, node, token]
        return scores.cpu()


    def _score_whole_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        """[rows, labels] log-probabilities from one sequence per row and label (prompt + label tokens), right-padded
        under a 2-D mask: no cache, no explicit positions, each sequence starting at position 0."""
        device = self.head.weight.device
        sequences = [(r, i, prompt + label) for r, prompt in enumerate(prompts) for i, label in enumerate(self.label_ids)]
        width = max(len(seq) for _, _, seq in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
        for s, (_, _, seq) in enumerate(sequences):
            input_ids[s, :len(seq)] = torch.tensor(seq, device=device)
            mask[s, :len(seq)] = 1
        hidden = self.body(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        # every label token is read at the position before it: (sequence, position, token)
        reads = [(s, len(prompts[r]) - 1 + k, token) for s, (r, i, _) in enumerate(sequences)
                 for k, token in enumerate(self.label_ids[i])]
        at = torch.tensor([[s, pos] for s, pos, _ in reads], device=device)
        logits = float32_logits(self.head, hidden[at[:, 0], at[:, 1]]) * self.scale
        token_logp = soft_capped(logits, self.softcap).log_softmax(-1)
        token_logp = token_logp[torch.arange(len(reads), device=device), torch.tensor([t for *_, t in reads], device=device)]
        scores = torch.zeros(len(sequences), device=device).index_add_(0, at[:, 0], token_logp)
        return scores.view(len(prompts), len(self.labels)).cpu()


def score_label_probs(model, tokenizer, texts: list[str], prompt: PromptConfig, labels: list[str],
                      batch_size: int = 16) -> torch.Tensor:
    """[len(texts), len(labels)] probabilities over the label set: softmax of each label's exact log-probability.

    The prompt is the one `generate` uses (chat template, generation prompt); each label is scored by its
    full token sequence, followed by the end-of-turn token when labels share a token prefix (see
    `label_token_ids`).
    """
    return LabelScorer(model, tokenizer, prompt, labels).log_probs(texts, batch_size).softmax(-1)
