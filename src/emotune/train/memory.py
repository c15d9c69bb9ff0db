"""The memory model behind `emotune plan`: what training and evaluation hold, from a model's config alone.

No weights are loaded. Two weightless views of the model answer what a formula would have to guess:

- The whole model built on PyTorch's `meta` device (shapes, no storage), with PEFT's adapters attached as
  training attaches them: the exact bytes of the frozen weights in the planned dtype, and PEFT's own count
  of what is trained (`all-linear` resolved as in training, DoRA magnitudes, `modules_to_save` copies, the
  adapters kept in float32).
- A probe (emotune.train.probe): the same architecture cut to one decoder layer of each kind with a small
  vocabulary, built on the CPU with the same adapters, whose training-mode passes count what each layer keeps
  for the backward pass and whose no-grad passes measure the KV cache and the working memory of inference.

Full and freeze fine-tuning (`train.finetuning`) mark the meta-device model and the probe as training marks the real
one (emotune.model.finetuning): the trained weights in fp32 under autocast, the probe's layers trained (and, for the
frozen layers the backward pass runs through, measured frozen too), the frozen layers below the lowest trained one
keeping nothing.

What our loop adds on top is modelled from its code: the gradients and AdamW's two moments of the trained
parameters only, and the optimizer step's temporaries; one forward pass at a time (`train.max_tokens_per_pass`
cuts an update into passes, the gradient is summed across them; `pass_bytes`, one pass's share, sizes its `auto`);
the vocabulary projection only at the loss positions, in checkpointed chunks of `batches.CHUNK_TOKENS` beyond that many
(emotune.train.batches.completion_loss); with gradient checkpointing, each layer's input kept and one layer
recomputed at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.config.train import LoraSettings, TrainConfig
from emotune.core.errors import UserError
from emotune.model import finetuning, quantization
from emotune.model.text import SUSPENDABLE_SOFTCAP, softcap_field
from emotune.train.batches import CHUNK_TOKENS
from emotune.train.probe import Quadratic, layer_kinds, run_probe


@dataclass(frozen=True)
class Workload:
    """What a task trains and evaluates, in the memory model's terms (each task's `memory_workload`)."""
    loss_tokens_per_row: int | None
    """Positions per training row projected onto the vocabulary; None = up to every token of the row."""
    vocabulary_loss: bool = True
    """False: the loss reads a classification head, not the vocabulary."""
    head_outputs: int = 0
    """A head trained in full besides the adapters: hidden size x this many float32 parameters."""
    evaluations: dict[str, Evaluation] = field(default_factory=dict)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation method: its batch and what one row holds."""
    rows: int
    """Rows per batch: the configured eval batch, or the `auto` cap (auto takes fewer when they do not fit)."""
    auto: bool
    prompt_tokens: int
    new_tokens: int = 0
    """Tokens generated after the prompt (0: one forward pass)."""
    projected: int = 1
    """Positions per row projected onto the vocabulary (0: none)."""
    cache: str = "none"
    """The KV cache it keeps: `model` (the model's own: sliding layers keep their window), `full` (every
    layer keeps every token, as label scoring's cache does) or `none`."""


@dataclass(frozen=True)
class Architecture:
    """The facts about one model and adapter setting that the estimate needs; see `describe`."""
    parameters: int
    trainable: int
    frozen_bytes: int
    trainable_bytes: int
    optimizer_bytes: int
    weight_bytes_per_element: int
    hidden: int
    vocab: int
    layers: list[Quadratic]
    """Per decoder layer: bytes it saves for the backward pass, per row."""
    outside: Quadratic
    """Saved outside the decoder layers (embeddings, final norm), per row."""
    checkpoint_bytes_per_token: int
    """What one checkpointed layer keeps of its input, per token."""
    working: Quadratic
    """Inference working memory beyond weights and cache, per row."""
    kv_per_token: list[tuple[float, int | None]]
    """Per decoder layer: KV-cache bytes per token, and its sliding window (None: every token)."""
    plain_head: bool
    softcap: float | None
    dequantized_bytes: int = 0
    """A quantized base (model.quantization): the largest layer's weight dequantized for its product."""
    whole: bool = False
    """Full or freeze fine-tuning (`train.finetuning`): the trained parameters are the model's own weights, held in
    fp32 while training (`trainable_bytes`) and in their own dtype for evaluation (`trained_rest_bytes`)."""
    trained_rest_bytes: int = 0
    """Full / freeze: the trained weights in the model's dtype, as evaluation and the saved model hold them."""
    optimizer_step_bytes: int = 0
    """What the optimizer's step allocates for a moment beyond its state (`_optimizer_step_bytes`)."""
    layer_fixed: list[float] = field(default_factory=list)
    """Per decoder layer: bytes it saves once per pass whatever its rows (full / freeze under autocast; else 0)."""
    outside_fixed: int = 0
    """Saved outside the layers once per pass: autocast's copy of a trained output layer."""

    @property
    def trained_part(self) -> str:
        return "trained weights (fp32)" if self.whole and self.weight_bytes_per_element < 4 else \
            "trained weights" if self.whole else "adapters"


def size_text(n: float | None) -> str:
    """Bytes for people: `1.5 GiB`, `320.0 MiB`, `12 B`; `—` for unknown (the plan's table, pass sizing's line)."""
    if n is None:
        return "—"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------------------------
# The estimate


def training_parts(arch: Architecture, work: Workload, rows: int, length: int, checkpointing: bool,
                   host_copies: bool) -> dict[str, int]:
    """Peak bytes of one training step, by part, for a forward pass of `rows` rows of `length` tokens.

    The parts add up to the peak. The backward pass starts with the loss (the vocabulary projection's
    buffers) and then walks the layers (each layer's gradients; under checkpointing, the layer's activations
    rebuilt first); the two never coexist, so the larger of them is the last part. The optimizer's step comes
    after the pass, its activations freed: where its temporaries are larger than the pass's parts (full
    fine-tuning), they replace them."""
    parts = {"weights": arch.frozen_bytes, arch.trained_part: arch.trainable_bytes, "gradients": arch.trainable_bytes,
             "optimizer state": arch.optimizer_bytes}
    if arch.dequantized_bytes:
        parts[DEQUANTIZED] = arch.dequantized_bytes
    passing = _pass_parts(arch, work, rows, length, checkpointing)
    parts.update(passing if sum(passing.values()) >= arch.optimizer_step_bytes else {STEP: arch.optimizer_step_bytes})
    if host_copies:  # the best adapter (or trained weights) so far, and the copy a checkpoint writes (in host memory)
        parts["trained weight copies (host)" if arch.whole else "adapter copies (host)"] = 2 * arch.trainable_bytes
    return parts


def _pass_parts(arch: Architecture, work: Workload, rows: int, length: int, checkpointing: bool) -> dict[str, int]:
    """What one forward/backward pass holds at its peak: the activations kept for the backward pass, and the larger
    of the loss's buffers and one layer's backward."""
    fixed = arch.layer_fixed or [0.0] * len(arch.layers)
    saved = [rows * q(length) + f for q, f in zip(arch.layers, fixed, strict=True)]
    if checkpointing:  # each layer's input kept; one layer's activations rebuilt at a time in the backward
        keep = [rows * length * arch.checkpoint_bytes_per_token if q != Quadratic() else 0 for q in arch.layers]
        busy = [(1 + BACKWARD_SHARE) * s for s in saved]
    else:
        keep, busy = saved, [BACKWARD_SHARE * s for s in saved]
    kept = sum(keep)
    layer_backward, freed = 0.0, 0.0
    for i in reversed(range(len(saved))):  # the backward walks down: what the layers above kept is freed by then
        layer_backward = max(layer_backward, busy[i] - freed)
        freed += keep[i]
    loss = loss_bytes(arch, work, rows, length)
    return {"activations": int(kept + rows * arch.outside(length) + arch.outside_fixed),
            **({LOSS: loss} if loss >= layer_backward else {LAYER_BACKWARD: int(layer_backward)})}


def pass_bytes(arch: Architecture, work: Workload, rows: int, length: int, checkpointing: bool) -> int:
    """What one forward/backward pass of `rows` rows of `length` tokens adds to a step's peak beyond the parts every
    step holds whatever its passes (weights, adapters, gradients, optimizer state, a dequantized layer): the
    activations kept for the backward pass and the larger of the loss's buffers and one layer's backward.
    emotune.train.pass_size sizes `train.max_tokens_per_pass=auto` with it."""
    return sum(_pass_parts(arch, work, rows, length, checkpointing).values())


# The gradients a layer's backward pass holds at once, as a share of what the layer saved in its forward pass:
# 0.46 measured on Gemma 3 layers (tests/test_plan.py measures the whole estimate against real steps).
BACKWARD_SHARE = 0.5
DEQUANTIZED = "one layer dequantized (4/8-bit base)"
LOSS = "backward: vocabulary projection"
LAYER_BACKWARD = "backward: one layer"
STEP = "optimizer step: temporaries"
STEADY = ("weights", "adapters", "trained weights", "trained weights (fp32)", "gradients", "optimizer state", DEQUANTIZED)


def loss_bytes(arch: Architecture, work: Workload, rows: int, length: int) -> int:
    """The loss's buffers in the backward pass: the float32 log-softmax of the loss positions and two gradients of
    that size (12 bytes per position and vocabulary entry, measured in both dtypes; a final soft-cap adds the tanh
    kept for the backward pass, in the logits' dtype); chunked, one chunk's and the kept hidden states and their
    gradient (bench/plan_accuracy.py at a 16,384-entry vocabulary: 12 bytes per chunk entry in fp32 and bf16, 16
    with the cap; the logits' own copy was counted as well before, 1.31-1.47 times the measured peak)."""
    if not work.vocabulary_loss:
        return rows * work.head_outputs * 4 * 3
    positions = rows * (length if work.loss_tokens_per_row is None else min(length, work.loss_tokens_per_row))
    if arch.plain_head and positions > CHUNK_TOKENS:  # the cap applied inside the chunk, in float32
        return (2 * positions * arch.hidden * arch.weight_bytes_per_element
                + CHUNK_TOKENS * arch.vocab * (12 + (4 if arch.softcap else 0)))
    # the model's own forward caps the logits in their dtype and keeps the tanh for the backward pass
    return positions * arch.vocab * (12 + (arch.weight_bytes_per_element if arch.softcap else 0))


def evaluation_parts(arch: Architecture, ev: Evaluation, rows: int | None = None) -> dict[str, int]:
    """Peak bytes of one evaluation batch (the fine-tuned model: adapters unmerged), by part."""
    rows = ev.rows if rows is None else rows
    total = ev.prompt_tokens + ev.new_tokens
    projected = rows * ev.projected
    per_position = arch.vocab * (arch.weight_bytes_per_element + 8)
    logits = (projected * arch.hidden * arch.weight_bytes_per_element + CHUNK_TOKENS * per_position
              if arch.plain_head and projected > CHUNK_TOKENS else projected * per_position)
    weights = {"weights": arch.frozen_bytes + arch.trained_rest_bytes} if arch.whole else \
        {"weights": arch.frozen_bytes, "adapters": arch.trainable_bytes}
    return {**weights,
            "KV cache": int(rows * kv_bytes(arch, total, ev.cache)),
            "working memory": int(rows * arch.working(ev.prompt_tokens)), "vocabulary projection": int(logits),
            **({DEQUANTIZED: arch.dequantized_bytes} if arch.dequantized_bytes else {})}


def kv_bytes(arch: Architecture, tokens: int, cache: str) -> float:
    if cache == "none":
        return 0.0
    return sum(per_token * (min(tokens, window) if window and cache == "model" else tokens)
               for per_token, window in arch.kv_per_token)


def auto_eval_rows(arch: Architecture, ev: Evaluation, free: int) -> int:
    """The batch `eval.batch_size: auto` takes: the cap, or fewer when 40% of the memory left after the weights
    does not hold them (as emotune.eval.evaluate.choose_batch_size decides)."""
    if not ev.auto:
        return ev.rows
    weights = arch.frozen_bytes + (arch.trained_rest_bytes if arch.whole else arch.trainable_bytes)
    one = sum(evaluation_parts(arch, ev, rows=1).values()) - weights
    left = free - weights
    return max(1, min(ev.rows, int(0.4 * left // max(one, 1)))) if left > 0 else 1


# --------------------------------------------------------------------------------------------------
# The model's facts: the meta-device model and the probe


def describe(config, lora: LoraSettings, optim: str, dtype: torch.dtype, work: Workload,
             attn_implementation: str | None = None, lean: tuple[bool, bool] = (True, True),
             model_cfg: ModelConfig | None = None, train: TrainConfig | None = None) -> Architecture:
    """The facts of `config` (a transformers config) trained with `lora` and `optim` in weights of `dtype`; `lean`:
    whether the LoRA layers and Gemma's norms run emotune.model.lean_lora's and lean_norm's forwards, as training runs
    them with `train.lean_lora` and `train.lean_norm`; `model_cfg`: its `quantization` (the weights' storage);
    `train`: its `finetuning` (full and freeze train the model's own weights, marked as training marks them:
    emotune.model.finetuning; LoRA otherwise)."""
    from peft import get_peft_model

    from emotune.model.lora import lora_config
    from emotune.model.text import causal_lm_class

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    whole = train if train is not None and train.finetuning in finetuning.WHOLE else None
    try:
        with torch.device("meta"):
            model = causal_lm_class(config).from_config(config, dtype=dtype)
        if whole is None:
            # the initialisation changes values, not shapes: PiSSA's and OLoRA's factorisations cannot run on meta
            adapted = get_peft_model(model, lora_config(lora.model_copy(update={"init": "default"}), model),
                                     autocast_adapter_dtype=True)
        else:
            adapted = model
            finetuning.mark(model, whole)
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"emotune plan could not build {type(config).__name__} from its config "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else 'no details'}). Check "
                        "model.source and lora.target_modules.") from None
    trained = [p for p in adapted.parameters() if p.requires_grad]
    rest = sum(p.numel() * p.element_size() for p in trained)  # full / freeze: the trained weights as stored
    if whole is not None:
        finetuning.upcast_trained(adapted)  # on the meta device: fp32 shapes, no storage
        trained = [p for p in adapted.parameters() if p.requires_grad]
    head = work.head_outputs * text.hidden_size  # a classification head, float32
    trainable_bytes = sum(p.numel() * p.element_size() for p in trained) + 4 * head
    model_cfg = model_cfg or ModelConfig()
    if quantization.bits(model_cfg):  # a 4/8-bit base layer is PEFT's bitsandbytes LoRA class: never the lean forward
        lean = (False, lean[1])
    frozen = quantization.stored_weight_bytes(adapted, model_cfg)
    try:
        probe = run_probe(text, lora, dtype, attn_implementation, lean, whole)
    except UserError:
        raise
    except Exception as err:  # a config the one-layer probe cannot rebuild or run
        raise UserError(f"emotune plan could not measure a decoder layer of {type(config).__name__} "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else 'no details'}); "
                        "the run itself does not need the plan (train.max_tokens_per_pass=auto then runs one pass per "
                        "micro-batch).") from None
    kinds = layer_kinds(text)
    shared_from = text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", 0) or 0)
    window = getattr(text, "sliding_window", None)
    element = torch.empty((), dtype=dtype).element_size()
    first, trained_layers = _layers_in_backward(adapted) if whole is not None else (0, None)

    def kept(i: int, kind: str) -> tuple[Quadratic, float]:
        if i < first:  # a frozen layer below every trained weight is outside the backward pass: it keeps nothing
            return Quadratic(), 0.0
        if trained_layers is None or i == first:
            return probe.saved[kind], probe.fixed.get(kind, 0.0)
        if i in trained_layers:
            return probe.above[kind], probe.above_fixed[kind]
        return probe.passing[kind], probe.passing_fixed[kind]

    per_layer = [kept(i, kind) for i, kind in enumerate(kinds)]
    output = adapted.get_output_embeddings()
    weight = getattr(output, "weight", None)
    # autocast's half-precision copy of a trained output layer, kept for its backward once per pass
    head_copy = weight.numel() * element if whole is not None and element < 4 and weight is not None \
        and weight.requires_grad else 0
    return Architecture(
        parameters=sum(p.numel() for p in adapted.parameters()) + head, trainable=sum(p.numel() for p in trained) + head,
        frozen_bytes=frozen, trainable_bytes=trainable_bytes,
        optimizer_bytes=_optimizer_bytes(optim, trained) + (8 * head if optim != "sgd" else 0),
        weight_bytes_per_element=element, hidden=text.hidden_size, vocab=text.vocab_size,
        layers=[q for q, _ in per_layer], layer_fixed=[f for _, f in per_layer], outside_fixed=head_copy,
        outside=probe.outside,
        checkpoint_bytes_per_token=probe.input_element * (text.hidden_size
                                                          + (getattr(text, "hidden_size_per_layer_input", 0) or 0)),
        working=probe.working,
        kv_per_token=[(probe.kv[kind] if i < shared_from else 0.0, window if kind.startswith("sliding") else None)
                      for i, kind in enumerate(kinds)],
        plain_head=_plain_head(adapted) and softcap_field(text) in (None, SUSPENDABLE_SOFTCAP),
        softcap=getattr(text, softcap_field(text) or SUSPENDABLE_SOFTCAP, None),
        dequantized_bytes=quantization.dequantized_layer_bytes(adapted, model_cfg),
        whole=whole is not None, trained_rest_bytes=rest if whole is not None else 0,
        optimizer_step_bytes=_optimizer_step_bytes(optim, trained, train is None or train.foreach == "auto"))


def _layers_in_backward(model: torch.nn.Module) -> tuple[int, set[int]]:
    """Full / freeze fine-tuning: the lowest decoder layer the backward pass runs through (0 when anything below the
    layers trains: the embeddings, Gemma's per-layer inputs), and the layers holding a trained weight."""
    from emotune.model.lora import decoder_layers_path

    layers = model.get_submodule(decoder_layers_path(model))
    trained = {i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())}
    inside = {id(p) for layer in layers for p in layer.parameters()}
    below = any(p.requires_grad and id(p) not in inside for p in model.get_input_embeddings().parameters()) or any(
        p.requires_grad for name, m in model.named_modules()
        if name.endswith(("embed_tokens_per_layer", "per_layer_model_projection")) for p in m.parameters())
    return (0 if below or not trained else min(trained)), trained


def _optimizer_bytes(optim: str, params: list[torch.nn.Parameter]) -> int:
    """The optimizer's state for `params` (emotune.train.loop._optimizer): AdamW keeps two moments in each parameter's
    dtype, Adafactor a row and a column factor per matrix, SGD without momentum nothing."""
    if optim == "sgd":
        return 0
    if optim == "adafactor":
        return sum((p.shape[-2] + p.shape[-1]) * p.element_size() if p.dim() >= 2 else p.numel() * p.element_size()
                   for p in params)
    if optim in ("adamw_8bit", "paged_adamw_8bit"):  # bitsandbytes: two uint8 moments with an fp32 scale per 256
        # entries; tensors under 4,096 entries (min_8bit_size) keep fp32 moments
        return sum(int(2 * p.numel() * (1 + 4 / 256)) if p.numel() >= 4096 else 8 * p.numel() for p in params)
    return sum(2 * p.numel() * p.element_size() for p in params)


def _optimizer_step_bytes(optim: str, params: list[torch.nn.Parameter], foreach: bool) -> int:
    """The temporaries of one optimizer step (emotune.train.optim): PyTorch's AdamW divides by the square roots of
    the second moments, one tensor the size of each parameter, all at once in its foreach implementation
    (`train.foreach`), one parameter at a time otherwise; Adafactor's update, a parameter at a time; bitsandbytes'
    8-bit AdamW and plain SGD update in place. Negligible for adapters, a copy of the model for full fine-tuning."""
    sizes = [p.numel() * p.element_size() for p in params] or [0]
    if optim in ("adamw_torch", "adamw"):
        return sum(sizes) if foreach else max(sizes)
    if optim == "adafactor":
        return max(sizes)
    return 0


def _plain_head(model) -> bool:
    """Whether the output projection stays a bias-free nn.Linear under the adapters; the loss is chunked then unless the
    model's soft-cap cannot be suspended (RecurrentGemma's: emotune.train.batches.completion_loss)."""
    head = model.get_output_embeddings()
    return type(head) is torch.nn.Linear and head.bias is None
