"""The probe behind emotune.train.memory: one decoder layer of each kind, measured, not modelled.

The architecture cut to one decoder layer of each kind (sliding / full attention ...) with a small vocabulary, built
on the CPU with the adapters training attaches (or, for full and freeze fine-tuning, its weights marked and kept in
fp32 under autocast as training keeps them). Training-mode forward passes of `PROBE_ROWS` rows at `PROBE_LENGTHS`
count, through autograd's saved-tensor hooks, what each layer keeps for the backward pass; no-grad passes with a KV
cache measure the cache per token and the working memory of inference. A quadratic in the length through the 3
points carries each to any length (attention that materialises its weights grows with the square of the length, the
rest linearly). `TensorPeak` measures the peak of live tensors (the probe's inference, and bench/plan_accuracy.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationMixin

from emotune.core.config.train import LoraSettings, TrainConfig
from emotune.core.errors import UserError
from emotune.model import finetuning, lean_lora, lean_norm
from emotune.model.text import language_model

PROBE_ROWS = 2
PROBE_LENGTHS = (16, 32, 64)
PROBE_VOCAB = 256


@dataclass(frozen=True)
class Quadratic:
    """Bytes per row as a function of the row length: c + a·T + b·T² (never below 0)."""
    c: float = 0.0
    a: float = 0.0
    b: float = 0.0

    def __call__(self, length: int) -> float:
        return max(0.0, self.c + self.a * length + self.b * length * length)

    @classmethod
    def through(cls, lengths: tuple[int, ...], values: list[float]) -> Quadratic:
        c, a, b = torch.linalg.solve(torch.tensor([[1.0, t, t * t] for t in lengths], dtype=torch.float64),
                                     torch.tensor(values, dtype=torch.float64)).tolist()
        return cls(c, a, b)


def layer_kinds(text) -> list[str]:
    kinds = getattr(text, "layer_types", None)
    return list(kinds) if kinds and len(kinds) == text.num_hidden_layers else ["layer"] * text.num_hidden_layers


@dataclass
class Probe:
    saved: dict[str, Quadratic]
    outside: Quadratic
    working: Quadratic
    kv: dict[str, float]
    input_element: int
    """Bytes per element of a decoder layer's input while training (what a checkpointed layer keeps)."""
    above: dict[str, Quadratic] = field(default_factory=dict)
    """Full / freeze: what a trained layer keeps when trained layers lie below it (`saved`: the lowest one)."""
    passing: dict[str, Quadratic] = field(default_factory=dict)
    """Full / freeze: what a frozen layer keeps when the backward pass runs through it to trained layers below."""
    fixed: dict[str, float] = field(default_factory=dict)
    above_fixed: dict[str, float] = field(default_factory=dict)
    passing_fixed: dict[str, float] = field(default_factory=dict)
    """Full / freeze: what the layers of `saved`, `above` and `passing` keep once per pass, whatever its rows (the
    half-precision copies autocast makes of fp32 trained weights)."""


def run_probe(text, lora: LoraSettings, dtype: torch.dtype, attn_implementation: str | None = None,
              lean: tuple[bool, bool] = (True, True), whole: TrainConfig | None = None) -> Probe:
    """One layer of each kind, measured at `PROBE_LENGTHS` (see the module docstring); `whole`: full / freeze
    fine-tuning's settings, trained as training trains them (its weights in fp32 under autocast in a half dtype)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from emotune.model.lora import lora_config

    small, kinds = _one_layer_of_each_kind(text)
    attn = attn_implementation if attn_implementation in ("sdpa", "eager") else None  # flash kernels need a GPU
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(small, dtype=dtype, attn_implementation=attn)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        # a vision-language checkpoint's text model with no causal class of its own (Qwen2.5-VL's `qwen2_5_vl_text`)
        model = _TextCausalLM.build(small, dtype, attn)
    model.config.use_cache = False
    autocast = None
    if whole is None:
        # The probe keeps one layer of each kind, so lora.layers' indices mean nothing here: every probe layer is
        # adapted, which bounds what a frozen layer below the adapters keeps for backward (nothing) from above.
        # The initialisation (PiSSA's, OLoRA's factorisations) changes values, not what training keeps.
        adapted = get_peft_model(model, lora_config(lora.model_copy(update={"layers": None, "init": "default"}), model),
                                 autocast_adapter_dtype=True)
    else:
        adapted = model
    layers = _decoder_layers(model, len(kinds))
    owned = {StorageWeakRef(t.untyped_storage()) for t in [*adapted.parameters(), *adapted.buffers()]}
    working, kv = [], []
    batches = [_probe_batch(length, small.vocab_size) for length in PROBE_LENGTHS]
    for length, (ids, mask) in zip(PROBE_LENGTHS, batches, strict=True):  # evaluation: the weights as stored
        peak, cache = _inference_bytes(adapted, owned, ids, mask)
        working.append((peak - sum(cache)) / PROBE_ROWS)
        kv.append([c / (PROBE_ROWS * length) for c in cache])
    passing = None
    if whole is not None:
        if dtype in (torch.float16, torch.bfloat16):  # emotune.runtime.device.mixed_precision(always=True)
            autocast = dtype
        # a frozen layer (its weights as stored) the backward pass runs through to trained layers below it (freeze
        # with the lowest layers trained): the gradient flows into the layers' input, nothing of the layer trains
        adapted.requires_grad_(False)
        adapted.get_input_embeddings().requires_grad_(True)
        passing = _probe_saved(_Subject(adapted, layers, owned, kinds), batches, autocast, per_pass=True)
        adapted.requires_grad_(False)
        # every probe layer trains as a trained layer of the run does (the layers below the lowest trained one,
        # which keep nothing, are left out by `describe`)
        finetuning.mark(adapted, whole.model_copy(update={"freeze_trainable_layers": len(kinds)}))
        finetuning.upcast_trained(adapted)
        owned = {StorageWeakRef(t.untyped_storage()) for t in [*adapted.parameters(), *adapted.buffers()]}
    elif lean[0]:
        lean_lora.install(adapted)
    if lean[1]:  # as training installs it: after the trained weights are marked
        lean_norm.install(adapted)
    element = [torch.empty((), dtype=dtype).element_size()]
    # LoRA: what a layer keeps grows with its rows. Full / freeze under autocast also keep the half-precision copies
    # of the fp32 trained weights, once per pass whatever its rows: measured apart (`fixed`), with one row as well.
    lowest = _probe_saved(_Subject(adapted, layers, owned, kinds), batches, autocast, element, per_pass=whole is not None)
    cache_by_kind = {kind: kv[-1][i] if i < len(kv[-1]) else 0.0 for i, kind in enumerate(kinds)}
    above = None
    if whole is not None:
        # `lowest` is a trained layer with nothing trained below it; measured again with the gradient flowing on into
        # the layers' input: a trained layer above another
        adapted.get_input_embeddings().requires_grad_(True)
        above = _probe_saved(_Subject(adapted, layers, owned, kinds), batches, autocast, per_pass=True)
    return Probe(lowest.rows, lowest.outside, Quadratic.through(PROBE_LENGTHS, working), cache_by_kind, element[0],
                 above.rows if above else {}, passing.rows if passing else {}, lowest.fixed,
                 above.fixed if above else {}, passing.fixed if passing else {})


@dataclass
class _Kept:
    rows: dict[str, Quadratic]
    """Per row, by kind of layer."""
    fixed: dict[str, float]
    """Per pass whatever its rows, by kind of layer."""
    outside: Quadratic


@dataclass
class _Subject:
    """The probe model as measured: its decoder layers, the storages it owns (weights, buffers: not counted) and the
    kind of each layer."""
    model: torch.nn.Module
    layers: list[torch.nn.Module]
    owned: set
    kinds: list[str]


def _probe_saved(subject: _Subject, batches, autocast: torch.dtype | None, element: list[int] | None = None,
                 per_pass: bool = False) -> _Kept:
    """Bytes each probe layer keeps for the backward pass, as a quadratic in the length per row, by kind; with
    `per_pass`, the longest batch again with one row, and what does not grow with the rows (2·one row − two rows)
    taken apart."""
    model, layers, owned, kinds = subject.model, subject.layers, subject.owned, subject.kinds
    counts: dict[int | None, list[float]] = {i: [] for i in [*range(len(kinds)), None]}
    for ids, mask in batches:
        for i, count in _saved_bytes(model, layers, owned, ids, mask, autocast, element).items():
            counts[i].append(count)
    fixed = dict.fromkeys(counts, 0.0)
    if per_pass:
        ids, mask = batches[-1]
        single = _saved_bytes(model, layers, owned, ids[:1], mask[:1], autocast)
        fixed = {i: max(0.0, (PROBE_ROWS * single[i] - counts[i][-1]) / (PROBE_ROWS - 1)) for i in counts}
    rows = {i: [(c - fixed[i]) / PROBE_ROWS for c in values] for i, values in counts.items()}
    return _Kept({kind: Quadratic.through(PROBE_LENGTHS, rows[i]) for i, kind in enumerate(kinds)},
                 {kind: fixed[i] for i, kind in enumerate(kinds)}, Quadratic.through(PROBE_LENGTHS, rows[None]))


class _TextCausalLM(torch.nn.Module, GenerationMixin):
    """The text model of a vision-language checkpoint whose text config has no causal-LM class (Qwen2-VL's, Qwen2.5-VL's,
    Qwen3-VL's): transformers' base text model with an output layer, as the checkpoint's own forward runs it on text
    alone (its vision tower takes no part then); only the probe builds it."""

    def __init__(self, body: torch.nn.Module, config) -> None:
        super().__init__()
        self.model, self.config = body, config
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                       dtype=body.get_input_embeddings().weight.dtype)

    @classmethod
    def build(cls, config, dtype: torch.dtype, attn: str | None) -> _TextCausalLM:
        from transformers import AutoModel

        try:
            body = AutoModel.from_config(config, dtype=dtype, attn_implementation=attn)
        except ValueError as err:
            raise UserError(f"emotune plan measures one decoder layer of each kind as a text-only model, and "
                            f"transformers has no model class for `{config.model_type}` alone. Training, evaluation "
                            "and serving are not affected; to see the memory a run needs, run it with "
                            "train.max_steps=2 and read the peak memory it logs (train/log_history.json, "
                            "peak_memory_mb).") from err
        return cls(body, config)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def get_decoder(self) -> torch.nn.Module:
        return self.model

    def forward(self, input_ids, attention_mask=None, use_cache: bool = False, logits_to_keep: int = 0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden),
                                      past_key_values=getattr(out, "past_key_values", None))


def _one_layer_of_each_kind(text) -> tuple[object, list[str]]:
    """A copy of the text config with the first layer of each kind only, a small vocabulary and no KV sharing."""
    kinds = layer_kinds(text)
    keep = sorted({kinds.index(kind) for kind in kinds})
    n = text.num_hidden_layers
    values = text.to_dict()
    for name, value in list(values.items()):
        if isinstance(value, list) and len(value) == n:
            values[name] = [value[i] for i in keep]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict):  # per-layer overrides (Gemma 4's wider full-attention heads) move with their layer
        values["per_layer_config"] = {str(new).zfill(len(str(key))): per_layer[key] for new, old in enumerate(keep)
                                      for key in per_layer if int(key) == old}
    values.update(num_hidden_layers=len(keep), pad_token_id=None)
    for name in ("vocab_size", "vocab_size_per_layer_input"):
        if name in values:
            values[name] = min(values[name], PROBE_VOCAB)
    if values.get("num_kv_shared_layers"):
        values["num_kv_shared_layers"] = 0
    small, kept = type(text).from_dict(values), [kinds[i] for i in keep]
    if layer_kinds(small) != kept:  # the kinds come from a pattern repeated over the layers (RecurrentGemma's
        for name, value in values.items():  # block_types): the kept layers' entries of the repeated pattern
            if isinstance(value, list) and 0 < len(value) < n and all(isinstance(v, str) for v in value):
                values[name] = [value[i % len(value)] for i in keep]
        small = type(text).from_dict(values)
    if layer_kinds(small) != kept:
        raise UserError(f"emotune plan could not cut {type(text).__name__} to one decoder layer of each kind "
                        f"({', '.join(kept)}); the run itself does not need the plan.")
    return small, kept


def _decoder_layers(model, count: int) -> list[torch.nn.Module]:
    decoder = language_model(model)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == count:
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    if not lists:
        raise UserError(f"emotune plan could not find the decoder layers of {type(model).__name__}.")
    return list(lists[0])


def _probe_batch(length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second shorter (right-padded, as `batches.collate` pads), so the mask is a real one."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (PROBE_ROWS, length), generator=generator)
    mask = torch.ones(PROBE_ROWS, length, dtype=torch.long)
    mask[1:, length - length // 4:] = 0
    return ids, mask


def _saved_bytes(model, layers: list[torch.nn.Module], owned: set, ids, mask, autocast: torch.dtype | None = None,
                 element: list[int] | None = None) -> dict[int | None, int]:
    """Bytes autograd keeps for the backward pass, by decoder layer (None: outside the layers); `autocast`: the
    forward under autocast to that dtype; `element[0]` is set to the element size of the first layer's input."""
    where: list[int | None] = [None]

    def entering(i: int, args: tuple, kwargs: dict) -> None:
        where[0] = i
        hidden = args[0] if args else kwargs.get("hidden_states")
        if i == 0 and element is not None and isinstance(hidden, torch.Tensor):
            element[0] = hidden.element_size()

    counts: dict[int | None, int] = {i: 0 for i in [*range(len(layers)), None]}
    seen: set = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in owned and key not in seen:
            seen.add(key)
            counts[where[0]] += tensor.untyped_storage().nbytes()
        return tensor

    hooks = [h for i, layer in enumerate(layers)
             for h in (layer.register_forward_pre_hook(lambda _, args, kwargs, i=i: entering(i, args, kwargs),
                                                       with_kwargs=True),
                       layer.register_forward_hook(lambda *_: where.__setitem__(0, None)))]
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            output = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        del output
    finally:
        for hook in hooks:
            hook.remove()
    return counts


@torch.inference_mode()
def _inference_bytes(model, owned: set, ids, mask) -> tuple[int, list[int]]:
    """(peak bytes of tensors alive during a no-grad forward with a KV cache, the cache's bytes per layer)."""
    model.eval()
    with TensorPeak() as tracker:
        output = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    # a model whose output has no cache field (RecurrentGemma keeps its fixed-size state inside its layers, counted in
    # the peak) raises AttributeError on transformers' deprecated `past_key_values` alias: no per-layer cache then
    cache = [sum(t.untyped_storage().nbytes() for t in vars(layer).values() if isinstance(t, torch.Tensor))
             for layer in getattr(getattr(output, "past_key_values", None), "layers", [])]
    return tracker.peak, cache


class TensorPeak(TorchDispatchMode):
    """The peak bytes of tensors created while it is active (on `device`), alive at the same time.

    Every operator's outputs pass through `__torch_dispatch__`; each new storage is counted once until the
    storage is freed (views and in-place results share an input's storage and are not new). Tensors that
    existed before (the weights) are not counted: add them yourself."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device, self.live, self.peak = device, 0, 0
        self._alive: dict[StorageWeakRef, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing new was allocated
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device:
                if StorageWeakRef(tensor.untyped_storage()) not in inputs:
                    self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = StorageWeakRef(storage)
        if key in self._alive:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._freed(key, size))

    def _freed(self, key: StorageWeakRef, size: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= size
