"""Training rows as token ids, length-grouped global batches, and the completion-only loss.

Speed comes from the loss. A classifier's completion is a label plus the end-of-turn marker (2-4
tokens) after a prompt of about 70 tokens, and Gemma projects onto a 262,144-entry vocabulary: projecting
every position (what TRL's completion-only loss does, then masks) costs more than the 18 transformer
layers together. So the model projects only the positions that predict a completion token (a
boolean `logits_to_keep`, which transformers 5 supports). The objective is unchanged: the same
cross-entropy on the same completion tokens, summed and divided by their number.

A row carries one loss span (classification: the label at the end of the row) or several (a
conversation: every assistant turn). When a pass has more loss positions than `CHUNK_TOKENS` (long
responses), the projection and the cross-entropy run in chunks, each recomputed in the backward pass,
so the [positions, vocabulary] logits never exist at once; at or below it, one projection as before.

When every row starts with the same tokens (a classifier's system prompt and user-template head, about 55 of its
85 tokens), `share_prefix` switches the objective to batches that carry those tokens once
(`collate_after_prefix`): the model runs them once per forward pass and every row attends to them
(emotune.model.prefix). The loss and the update are the same (`train.shared_prefix`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from emotune.model.prefix import cannot_share, model_inputs
from emotune.model.text import SUSPENDABLE_SOFTCAP, soft_capped, softcap_field, softcap_suspended, text_config, unwrapped

CHUNK_TOKENS = 1024  # loss positions per projection chunk: 1 GiB of fp32 logits for a 262,144-entry vocabulary
SHARED_PREFIX_MIN_TOKENS = 16  # a shorter shared head is not worth a forward pass of its own


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    completion_start: int
    """Index of the first token that carries loss (classification: the first label token)."""
    weight: float = 1.0
    """Loss weight of this row's completion tokens (its label's class weight; 1 without balancing)."""
    spans: tuple[tuple[int, int], ...] | None = None
    """The [start, end) token ranges that carry loss, in order; None = one span from `completion_start` to
    the end of the row (classification)."""
    label: int | None = None
    """The class index, for a classification head (`task: classify_head`); None for language-model rows. A head row
    has one loss "token" (its last), so loss normalisation counts rows."""

    @property
    def loss_spans(self) -> tuple[tuple[int, int], ...]:
        return ((self.completion_start, len(self.input_ids)),) if self.spans is None else self.spans

    @property
    def completion_tokens(self) -> int:
        return sum(end - start for start, end in self.loss_spans)


def common_prefix_length(*sequences: list[int]) -> int:
    """How many leading tokens all `sequences` share (a prompt and its completed row; every rendered prompt of an
    evaluation, emotune.eval.scoring; every training row, `shared_prefix_length`)."""
    shortest = min(sequences, key=len)
    for i, token in enumerate(shortest):
        if any(seq[i] != token for seq in sequences):
            return i
    return len(shortest)


def epoch_batches(lengths: list[int], batch_rows: int, min_rows: int, seed: int, epoch: int,
                  group_by_length: bool) -> list[list[int]]:
    """Row indices of every global batch of one epoch, a pure function of (seed, epoch) so a resumed run
    continues the same order. Length grouping shuffles, sorts within groups of 16 batches, and
    shuffles the batches, so batch lengths are even yet the order stays random. A last batch with fewer
    than `min_rows` rows (one per process) is dropped."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if group_by_length:
        group = batch_rows * 16
        order = [i for start in range(0, len(order), group)
                 for i in sorted(order[start:start + group], key=lambda i: -lengths[i])]
    batches = [order[start:start + batch_rows] for start in range(0, len(order), batch_rows)]
    batches = [b for b in batches if len(b) >= min_rows]
    if group_by_length:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


def rank_share(batch: list[int], rank: int, world_size: int) -> list[int]:
    """This process's contiguous share of a global batch (contiguous, so similar lengths stay together).
    Shares differ by at most one row, so a batch of at least `world_size` rows leaves no process empty."""
    return batch[rank * len(batch) // world_size:(rank + 1) * len(batch) // world_size]


def forward_passes(batch: list[int], lengths: list[int], world_size: int, max_tokens: int,
                   max_rows: int = 0) -> list[list[list[int]]]:
    """Each process's share of a global batch, cut into forward passes: rows sorted longest first, each
    pass as many rows as fit `max_tokens` padded tokens (rows x its longest row; a longer row goes
    alone) and at most `max_rows` rows. The gradient is summed over the passes before the optimizer
    step, so the update is the same; what shrinks is the memory one pass allocates. Every process gets
    the same number of passes, since under FSDP each pass gathers weights collectively: the most any
    share needs, at most the fewest rows any share has. `max_tokens` and `max_rows` 0: no limit (both 0:
    one pass per share). Returns [process][pass] -> rows."""
    shares = [rank_share(batch, rank, world_size) for rank in range(world_size)]
    return _cut_shares(shares, lengths, max_tokens, max_rows)


def update_passes(micro_batches: list[list[int]], lengths: list[int], world_size: int, max_tokens: int,
                  max_rows: int = 0) -> list[list[list[int]]]:
    """Each process's forward passes for one optimizer update of `micro_batches` (global batches, the
    accumulation's). With a token cap the process's rows of the whole update (its share of every
    micro-batch: the rows it would have run micro-batch by micro-batch) are sorted longest first and cut
    under the cap, so an update that fits runs as one pass and rows of similar length share a pass
    (`forward_passes`' cut, over the update). Without one (`max_tokens` 0), each micro-batch is cut on
    its own, at least one pass each: gradient accumulation as configured. The loss is normalised by the
    update's completion tokens either way (emotune.train.loop), so the update is the same.
    Returns [process][pass] -> rows."""
    if not max_tokens:
        cut = [forward_passes(b, lengths, world_size, 0, max_rows) for b in micro_batches]
        return [[p for micro in cut for p in micro[rank]] for rank in range(world_size)]
    shares = [[i for b in micro_batches for i in rank_share(b, rank, world_size)] for rank in range(world_size)]
    return _cut_shares(shares, lengths, max_tokens, max_rows)


def epoch_updates(batches: list[list[int]], micro_per_step: int) -> list[list[list[int]]]:
    """An epoch's global batches grouped into optimizer updates of `micro_per_step` micro-batches each, the
    incomplete last group left out (the loop's updates run on into the next epoch); all of them as one group
    when the epoch has fewer batches than an update."""
    full = [batches[k:k + micro_per_step] for k in range(0, len(batches) - micro_per_step + 1, micro_per_step)]
    return full or [batches]


def _cut_shares(shares: list[list[int]], lengths, max_tokens: int, max_rows: int) -> list[list[list[int]]]:
    shares = [sorted(share, key=lambda i: -lengths[i]) for share in shares]
    if not max_tokens and not max_rows:
        return [[share] for share in shares]
    cut = [_greedy_passes(share, lengths, max_tokens, max_rows) for share in shares]
    count = min(max(len(p) for p in cut), min(len(s) for s in shares))
    return [_exactly(passes, count, lengths) for passes in cut]


def _greedy_passes(rows: list[int], lengths: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    passes, start = [], 0
    while start < len(rows):
        take = max(1, max_tokens // max(lengths[rows[start]], 1)) if max_tokens else len(rows)  # the first is the longest
        take = min(take, max_rows) if max_rows else take
        passes.append(rows[start:start + take])
        start += take
    return passes


def _exactly(passes: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the largest passes in two (keeping each under its cap) or merge the smallest neighbours until
    there are `count` passes."""
    passes = [list(p) for p in passes]
    while len(passes) < count:
        i = max(range(len(passes)), key=lambda k: (len(passes[k]) > 1, len(passes[k]) * lengths[passes[k][0]]))
        half = (len(passes[i]) + 1) // 2
        passes[i:i + 1] = [passes[i][:half], passes[i][half:]]
    while len(passes) > count:
        i = min(range(len(passes) - 1), key=lambda k: len(passes[k]) + len(passes[k + 1]))
        passes[i:i + 2] = [passes[i] + passes[i + 1]]
    return passes


def truncated(example: Example, max_length: int) -> Example:
    """`example` cut to its first `max_length` tokens, its loss spans cut with it (none left: an empty span,
    and the row teaches nothing). A classification-head row keeps its label, read at its new last token."""
    if len(example.input_ids) <= max_length:
        return example
    if example.label is not None:
        return Example(example.input_ids[:max_length], max_length - 1, example.weight, label=example.label)
    spans = tuple((start, min(end, max_length)) for start, end in example.loss_spans if start < max_length)
    spans = spans or ((max_length, max_length),)
    return Example(example.input_ids[:max_length], spans[0][0], example.weight, spans)


def collate(examples: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ids and mask, the positions that predict a completion token, and those tokens. Built as Python
    lists and made tensors once each: a batch costs five tensor creations, not a few operator calls per row."""
    width = max(len(e.input_ids) for e in examples)
    ids, mask, predicts, targets, token_weights = [], [], [], [], []
    for e in examples:
        n = len(e.input_ids)
        row = [*e.input_ids, *[pad_id] * (width - n)]
        flags = [False] * width
        for start, end in e.loss_spans:
            span = slice(max(start - 1, 0), end - 1)
            flags[span] = [end > start] * len(range(*span.indices(width)))
        # Position t predicts token t+1; row-major order, the order in which the model returns the kept logits.
        kept = [row[t + 1] for t in range(width - 1) if flags[t]]
        ids.append(row), mask.append([1] * n + [0] * (width - n)), predicts.append(flags)
        targets += kept
        token_weights += [e.weight] * len(kept)
    return {"input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=device),
            "predicts": torch.tensor(predicts, dtype=torch.bool, device=device),
            "targets": torch.tensor(targets, dtype=torch.long, device=device),
            "token_weights": torch.tensor(token_weights, dtype=torch.float32, device=device)}


def collate_after_prefix(examples: list[Example], pad_id: int, device: torch.device,
                         prefix: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """`collate` of the rows without their shared `prefix`, plus the prefix's ids (`prefix_ids`, [1, n]), which the
    model runs once for the whole batch (emotune.model.prefix). A batch with a row that does not start with the prefix, or
    would predict a loss token inside it, is collated whole."""
    n = len(prefix)
    if not all(shared_prefix_length([e]) >= n and tuple(e.input_ids[:n]) == prefix for e in examples):
        return collate(examples, pad_id, device)
    rest = [replace(e, input_ids=e.input_ids[n:], completion_start=e.completion_start - n,
                    spans=None if e.spans is None else tuple((start - n, end - n) for start, end in e.spans))
            for e in examples]
    batch = collate(rest, pad_id, device)
    batch["prefix_ids"] = torch.tensor([prefix], dtype=torch.long, device=device)
    return batch


def shared_prefix_length(rows: list[Example]) -> int:
    """Tokens every row starts with, up to the first position that predicts a loss token (position t predicts token
    t + 1, and its logits come from the row's own pass), leaving every row at least one token."""
    last = [min([start - 1 for start, end in r.loss_spans if end > start] + [len(r.input_ids) - 1]) for r in rows]
    return max(0, min(common_prefix_length(*[r.input_ids for r in rows]), *last))


@dataclass
class LossParts:
    loss_sum: torch.Tensor
    """Summed cross-entropy over the completion tokens (keeps the graph)."""
    tokens: int
    correct: torch.Tensor
    """Completion tokens the model already predicts (argmax), for the validation accuracy."""
    predicted: torch.Tensor | None = None
    """Per-row predicted class (classification head), so validation can compute macro-F1; None otherwise."""
    gold: torch.Tensor | None = None


@dataclass(frozen=True)
class Objective:
    """What the training loop optimises and which adapter it keeps; the task supplies it (`task.objective`).

    The default is the language-model objective every generative task uses: `completion_loss` on the
    rows' spans, the adapter with the lowest validation loss kept, PEFT's CAUSAL_LM adapters."""
    collate: Callable[[list[Example], int, torch.device], dict] = collate
    loss: Callable[[torch.nn.Module, dict], LossParts] | None = None
    """None = `completion_loss` (looked up in emotune.train.loop when called)."""
    select: str = "eval_loss"
    """The validation metric that picks the kept adapter and drives early stopping."""
    higher_is_better: bool = False
    row_metrics: Callable[[torch.Tensor, torch.Tensor], dict] | None = None
    """Extra validation metrics from every row's (predicted, gold) class, e.g. eval_macro_f1; None: none."""
    lora_task_type: str = "CAUSAL_LM"
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full and saved with the adapter, besides `lora.modules_to_save` (a classifier's head)."""
    can_share_prefix: bool = False
    """Whether `loss` takes batches after a shared prefix (`collate_after_prefix`): the completion loss does; a
    classification head's reads whole rows."""
    prefix: tuple[int, ...] = ()
    """The tokens every row starts with, run once per forward pass (set by `share_prefix`); () = whole rows."""

    def better(self, value: float, best: float | None) -> bool:
        """Whether `value` beats the best so far. A NaN best (a validation loss that came out NaN) is none: every
        comparison with it is false, which kept its adapter and counted every later evaluation towards early stopping;
        and a checkpoint stores it as null, so a resumed run must judge it as an uninterrupted one does."""
        return best is None or math.isnan(best) or (value > best if self.higher_is_better else value < best)


LANGUAGE_MODEL = Objective(can_share_prefix=True)


def share_prefix(objective: Objective, rows: list[Example], setting: str, model,
                 sharded: bool = False) -> tuple[Objective, dict]:
    """`objective` with shared-prefix batches when the rows (training and validation) share a head worth running once
    and `setting` (`train.shared_prefix`) is `auto`, else unchanged; and the choice (`used`, `tokens`,
    `mean_row_tokens`, `reason`), to print and record in run.json. `sharded`: training under FSDP2, which gathers a
    layer's weights for its backward when the gradient reaches the layer's output, while the prefix's keys and values
    take theirs from inside the layer; so FSDP runs whole rows."""
    n = shared_prefix_length(rows) if rows else 0
    why_not = ("train.shared_prefix=off" if setting == "off" else
               "the task's loss reads whole rows" if not objective.can_share_prefix else
               "FSDP2 expects each layer's gradient through its output" if sharded else
               f"the rows share {n} leading tokens, fewer than {SHARED_PREFIX_MIN_TOKENS}"
               if n < SHARED_PREFIX_MIN_TOKENS else cannot_share(model))
    choice = {"used": why_not is None, "tokens": n,
              "mean_row_tokens": round(sum(len(r.input_ids) for r in rows) / max(len(rows), 1), 1)}
    if why_not is not None:
        return objective, {**choice, "reason": why_not}
    ids = tuple(rows[0].input_ids[:n])
    shared = replace(objective, prefix=ids, collate=partial(collate_after_prefix, prefix=ids))
    return shared, {**choice, "reason": "every row starts with these tokens"}


def describe_shared_prefix(choice: dict) -> str:
    if choice["used"]:
        return (f"Shared prefix: every row starts with the same {choice['tokens']} tokens (rows average "
                f"{choice['mean_row_tokens']:g}); they run once per forward pass, every row attending to them "
                "(train.shared_prefix=auto).")
    return f"Shared prefix: not used ({choice['reason']}); every row runs whole."


def completion_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int = CHUNK_TOKENS) -> LossParts:
    """Cross-entropy on the completion tokens, projecting only the positions that predict them.

    A boolean `logits_to_keep` makes the model gather exactly those hidden states (flattened, so the
    projection is one plain matrix product) before its output layer. The model's own forward runs,
    not its body alone, so DDP's gradient hooks, PEFT's adapters and Gemma's final logit soft-capping
    apply as usual. More than `chunk_tokens` positions: `chunked_loss` instead of one projection."""
    head = _plain_head(model)
    with model_inputs(model, batch) as inputs:  # a batch after a shared prefix runs the prefix first
        if head is not None and int(batch["targets"].numel()) > chunk_tokens and _cap_suspendable(model):
            return _chunked_completion_loss(model, head, inputs, batch, chunk_tokens)
        logits = model(**inputs, logits_to_keep=batch["predicts"]).logits.float()
    targets = batch["targets"]
    per_token = F.cross_entropy(logits, targets, reduction="none")
    # data.balance=class_weight: each completion token counts with its row's class weight
    loss_sum = (per_token * batch["token_weights"]).sum() if "token_weights" in batch else per_token.sum()
    correct = (logits.detach().argmax(-1) == targets).sum()
    return LossParts(loss_sum, targets.numel(), correct)


def _cap_suspendable(model: torch.nn.Module) -> bool:
    """Whether the model's forward can run without its final soft-cap (none, or Gemma's, read as None); RecurrentGemma
    caps by dividing by its `logits_soft_cap`, so with the head passed through it capped the hidden states: it takes
    the one-projection path."""
    return softcap_field(text_config(unwrapped(model).config)) in (None, SUSPENDABLE_SOFTCAP)


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output projection when it is a bias-free nn.Linear (not a LoRA or modules_to_save wrapper)."""
    inner = getattr(model, "module", model)  # DDP
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if getter else None
    return head if type(head) is torch.nn.Linear and head.bias is None else None


def _chunked_completion_loss(model, head: torch.nn.Linear, inputs: dict, batch: dict[str, torch.Tensor],
                             chunk_tokens: int) -> LossParts:
    """The model's forward with the output projection passed through (it returns the kept hidden states),
    then `chunked_loss`. The final logit soft-capping (Gemma 2-4, read from the text config, where a multimodal
    wrapper keeps it) is suspended in the forward and applied inside the chunks instead."""
    original = head.forward
    head.forward = lambda hidden: hidden  # the model's forward returns the kept hidden states as its "logits"
    try:
        with softcap_suspended(model) as softcap:
            hidden = model(**inputs, logits_to_keep=batch["predicts"]).logits
    finally:
        head.forward = original
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return chunked_loss(hidden, head.weight, batch["targets"], batch.get("token_weights"), chunk_tokens, softcap)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None,
                 chunk_tokens: int = CHUNK_TOKENS, softcap: float | None = None) -> LossParts:
    """Summed cross-entropy of `hidden @ weight.T` against `targets`, `chunk_tokens` rows at a time.

    Each chunk is checkpointed: its logits are freed after the forward and recomputed in the backward, so
    at most one chunk's [chunk_tokens, vocabulary] logits (and their gradient) exist at any time."""
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, targets.numel(), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        weights = token_weights[piece] if token_weights is not None else None
        chunk_loss, chunk_correct = checkpoint(_chunk_loss, hidden[piece], weight, targets[piece], weights, softcap,
                                               use_reentrant=False)
        loss_sum = loss_sum + chunk_loss
        correct += chunk_correct
    return LossParts(loss_sum, targets.numel(), correct)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor | None,
                softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = soft_capped(F.linear(hidden, weight).float(), softcap)
    per_token = F.cross_entropy(logits, targets, reduction="none")
    loss = (per_token * token_weights).sum() if token_weights is not None else per_token.sum()
    return loss, (logits.detach().argmax(-1) == targets).sum()
