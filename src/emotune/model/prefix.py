"""Shared-prefix forward passes: the head of the prompt every row of a batch starts with, run once, with gradients.

A classification row is about 85 tokens, about 55 of which (the system prompt and the user template up to the
text; Gemma folds the system prompt into the first user turn) are the same in every row. Run whole, a batch of 8
rows computes those 55 tokens 8 times. A shared-prefix batch (emotune.train.batches.collate_after_prefix) carries them
once (`prefix_ids`) and each row's remainder, and the model sees it in two steps:

1. The prefix runs alone, with gradients, since LoRA on the attention and MLP layers changes its keys and values.
   Each attention layer's keys and values are kept (`_Capture`).
2. The rows run after it: each attention layer puts the prefix's keys and values before the rows' own, broadcast to
   the batch as a view (`_AfterPrefix`), under an explicit mask that lets a row token see the whole prefix and its
   own row up to itself; sliding-window layers also hide keys `sliding_window` or more positions behind it.
   Positions continue after the prefix and are counted from the mask, so right or left padding both work.

Every row's gradient reaches the prefix through the broadcast (its backward sums over the rows), so with LoRA
dropout 0 the update is the unshared batch's up to float rounding (tests/test_prefix.py). With dropout above 0 the
prefix draws one dropout mask for the whole forward pass instead of one per row (docs/training.md).

Both passes go through the model's own forward (PEFT's adapters, DDP's hooks, Gemma's logit soft-capping as usual);
the prefix pass projects no position onto the vocabulary. The one copy of the prefix's keys and values per row is
the concatenation attention needs, as whole rows would have them. FSDP2 is left out (emotune.train.batches.share_prefix).

Gradient checkpointing: transformers' checkpointed layers drop the cache (`GradientCheckpointingLayer`), because a
cache that appends would be appended to again when the backward pass replays the layer. The rows' cache only reads,
which is what the layers' `_can_checkpoint_with_cache` flag is for; it is set while the forwards run. The prefix
pass is not checkpointed: it is one row, whose activations cost less memory than recomputing them costs time.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from emotune.model.text import language_model, text_config, unwrapped

MASKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take an explicit mask per layer type (flash attention takes none)."""
LAYER_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}
"""The layer types whose masks `attention_masks` knows how to build."""


def attention_masks(config, dtype: torch.dtype, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """`allowed` [rows, queries, keys] in the form the model's attention takes: one mask per layer type, where a
    sliding-window layer also hides keys `sliding_window` or more positions behind the query, and a chunked layer
    (Llama 4) the keys outside the query's chunk of `attention_chunk_size` positions (by position, not index, so rows
    padded in the middle are masked as if each stood alone); boolean for sdpa, additive for eager.
    A config without `layer_types` but with a `sliding_window` (Mistral v0.1, Phi-3) slides every layer, as its
    model does.
    Used by label scoring (emotune.eval.scoring) and by shared-prefix training."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = sorted(set(getattr(text, "layer_types", None) or []))
    window = getattr(text, "sliding_window", None)
    chunk = getattr(text, "attention_chunk_size", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"

    def as_mask(keep: torch.Tensor) -> torch.Tensor:
        keep = keep[:, None]
        if eager:
            return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)
        return keep

    if not layer_types:  # one mask for every layer; Mistral v0.1 and Phi-3 slide it in every layer (sliding_window set)
        return as_mask(allowed & (query_pos[:, :, None] - key_pos[:, None, :] < window) if window else allowed)
    masks = {}
    for kind in layer_types:
        keep = allowed
        if kind == "sliding_attention" and window:
            keep = allowed & (query_pos[:, :, None] - key_pos[:, None, :] < window)
        elif kind == "chunked_attention" and chunk:  # Llama 4: a query sees the keys of its own chunk of positions
            keep = allowed & (query_pos[:, :, None] // chunk == key_pos[:, None, :] // chunk)
        masks[kind] = as_mask(keep)
    return masks


def positions_from_mask(model) -> str | None:
    """Why `model` cannot take explicit positions and per-layer masks, in a phrase; None when it can.

    ALiBi models add a position bias counted from the running sum of the 2-D attention mask, not from
    `position_ids`: Falcon with `alibi` set (tiiuae/falcon-rw-1b), MPT (`attn_config.alibi`), BLOOM. Falcon's
    forward refuses the explicit masks with a traceback; BLOOM's and MPT's take no `position_ids` at all. Rows after
    a shared prefix, or padded in the middle as label scoring pads them, would see other positions than alone, so
    these models run whole rows, right-padded under a 2-D mask, where the running sum counts each row's own
    positions."""
    inner = unwrapped(model)
    text = text_config(inner.config)
    attention = getattr(text, "attn_config", None)
    alibi = attention.get("alibi") if isinstance(attention, dict) else getattr(attention, "alibi", False)
    if getattr(text, "alibi", False) or alibi:
        return "the model's ALiBi position bias is counted from the attention mask, not from explicit positions"
    if "position_ids" not in inspect.signature(language_model(inner).forward).parameters:
        return "the model's forward takes no position_ids"
    return None


def cannot_share(model) -> str | None:
    """Why `model` cannot run rows after a shared prefix, in a phrase; None when it can."""
    config = _unwrapped(model).config
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in MASKED_ATTENTION:
        return f"the model's attention implementation `{impl}` takes no explicit mask (sdpa and eager do)"
    if (fixed := positions_from_mask(model)) is not None:
        return fixed
    return other_layers(model)


def other_layers(model) -> str | None:
    """Why `model`'s layers cannot take the per-layer masks `attention_masks` builds, in a phrase; None when they can.
    Layers of other types than attention (`layer_types`: LFM2's short convolutions `conv`, the `linear_attention` of
    Qwen3-Next, Jamba and the Mamba hybrids) carry a state from one token to the next instead of looking keys up by
    mask, so rows after a shared prefix, or label paths side by side after one prompt, would run through each
    other's state: such models run whole rows.
    GPT-Neo names its layers in `attention_layers` (`global`, `local`): its local layers cut their window from a fixed
    causal buffer by index, not by position, so label paths side by side after one prompt (whose indices run past
    their positions) lost prompt keys within the window; they run whole rows too."""
    config = _unwrapped(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = set(getattr(text, "layer_types", None) or []) - LAYER_KINDS
    other |= set(getattr(text, "attention_layers", None) or []) - {"global"}
    if other:
        return f"the model has layer types ({', '.join(sorted(other))}) whose masks emotune does not build"
    return None


@contextmanager
def model_inputs(model, batch: dict[str, torch.Tensor]):
    """The keyword arguments of `model`'s forward for `batch`. A whole-row batch: ids and mask. A batch after a
    shared prefix (`prefix_ids`): the prefix is run first, and the rows get its cache, their positions after it and
    the masks. A context, because checkpointed layers may keep the cache only while the forward runs."""
    if "prefix_ids" not in batch:
        yield {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
        return
    modules = list(_unwrapped(model).modules())
    checkpointed = [m for m in modules if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    # GPT-2's model drops the cache itself before its layers see it when checkpointing is on (`cache if not
    # (self.gradient_checkpointing and self.training) else None`): its own flag is off while the rows run (the
    # layers keep theirs, so they are still checkpointed, and read the prefix's cache)
    dropping = [m for m in modules if not isinstance(m, GradientCheckpointingLayer)
                and vars(m).get("gradient_checkpointing") is True]
    with _layers_set(checkpointed, "_can_checkpoint_with_cache", True), _layers_set(dropping, "gradient_checkpointing", False):
        with _layers_set(checkpointed, "gradient_checkpointing", False):
            cache = _run_prefix(model, batch["prefix_ids"])
        yield {"input_ids": batch["input_ids"], "cache": cache, "use_cache": False,
               **_row_positions_and_masks(model, batch["attention_mask"], batch["prefix_ids"].shape[1])}


def _run_prefix(model, prefix_ids: torch.Tensor) -> Cache:
    """The prefix's keys and values in every attention layer, as a cache the rows read."""
    n = prefix_ids.shape[1]
    pos = torch.arange(n, device=prefix_ids.device)[None]
    capture = Cache(layer_class_to_replicate=_Capture)
    model(input_ids=prefix_ids, position_ids=pos, cache=capture, use_cache=False,
          attention_mask=_masks(model, pos[:, :, None] >= pos[:, None, :], pos, pos),
          logits_to_keep=torch.zeros_like(prefix_ids, dtype=torch.bool))  # no vocabulary projection
    return Cache(layers=[_AfterPrefix(layer.keys, layer.values) for layer in capture.layers])


def _row_positions_and_masks(model, attention_mask: torch.Tensor, n_prefix: int) -> dict:
    """Positions counted from the mask after the prefix; every row token may see the prefix, and the real tokens
    of its row at or before its own position."""
    rows = attention_mask.shape[0]
    valid = attention_mask.bool()
    device = valid.device
    query_pos = n_prefix + (valid.long().cumsum(1) - 1).clamp(min=0)
    key_pos = torch.cat([torch.arange(n_prefix, device=device).expand(rows, -1), query_pos], 1)
    key_valid = torch.cat([torch.ones((rows, n_prefix), dtype=torch.bool, device=device), valid], 1)
    allowed = key_valid[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
    return {"position_ids": query_pos, "attention_mask": _masks(model, allowed, query_pos, key_pos)}


def _masks(model, allowed, query_pos, key_pos):
    inner = _unwrapped(model)
    return attention_masks(inner.config, inner.get_input_embeddings().weight.dtype, allowed, query_pos, key_pos)


def _unwrapped(model):
    return getattr(model, "module", model)  # DDP


class _Capture(DynamicLayer):
    """The prefix pass's cache layer: keeps the keys and values it is given, and attends over those alone."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
            self.device = key_states.device
        return key_states, value_states


class _AfterPrefix(DynamicLayer):
    """The rows' cache layer: the prefix's keys and values (one row, broadcast to the batch without a copy) before the
    rows' own. It only reads, so a replay under gradient checkpointing computes the same."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = keys is not None  # None: a layer that reuses another's keys (Gemma 3n/4 KV sharing)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows = key_states.shape[0]
        return (torch.cat([self.keys.expand(rows, -1, -1, -1), key_states], -2),
                torch.cat([self.values.expand(rows, -1, -1, -1), value_states], -2))


@contextmanager
def _layers_set(layers: list[torch.nn.Module], name: str, value):
    """`name` = `value` on each layer while the block runs; then each layer's own value, or its class's, again."""
    own = [vars(layer).get(name, _CLASS_VALUE) for layer in layers]
    for layer in layers:
        setattr(layer, name, value)
    try:
        yield
    finally:
        for layer, before in zip(layers, own, strict=False):
            if before is _CLASS_VALUE:
                delattr(layer, name)
            else:
                setattr(layer, name, before)


_CLASS_VALUE = object()
