"""`lora:` and `train:`: the adapters and the training loop's settings, with time budgets (duration_seconds)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import field_validator, model_validator

from emotune.core.config.base import (
    Range,
    Section,
)

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
    target_parameters: str | list[str] | None = None
    """Weights that get LoRA besides `target_modules` (PEFT's `target_parameters`): `experts` = the routed experts of
    every mixture-of-experts layer of the language model, which transformers 5 keeps as one 3-D tensor per layer and
    projection where `all-linear` cannot reach them (Qwen2/3-MoE, Mixtral, Llama 4, gpt-oss, Gemma 4 26B-A4B); or a
    list of parameter names or their last dotted parts, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj];
    null = none (a mixture-of-experts run then says its routed experts stay frozen). PEFT's LoRA on a weight takes
    no dropout (set lora.dropout=0), no DoRA and only lora.init=default. Such an adapter is served by emotune and
    exported merged; vLLM and llama.cpp get the merged model, not the adapter."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r, so higher ranks keep learning."""
    use_dora: bool = False
    """DoRA: learn a magnitude per output feature on top of the LoRA direction (slower steps, sometimes
    better at low rank)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (e.g. [lm_head]); null = none. Costly for
    Gemma's 262k-entry embedding tables."""
    init: Literal["default", "pissa", "olora", "loftq"] = "default"
    """How the adapters start: `default` = B at zero (the model starts as the base); `pissa` = the top-r singular
    vectors of each weight (PiSSA), `olora` = its QR factors (OLoRA), `loftq` = the best rank-r part of what 4-bit
    NF4 rounding loses (LoftQ); those three subtract their start from the base weights, and the saved adapter is
    converted back onto the original base (rank 2r), so export and serving use the checkpoint as it is. With
    model.quantization=4bit, `loftq` is QLoRA + LoftQ: the 4-bit weights stay and the adapter is saved as trained,
    for that base (emotune.model.init_methods)."""
    pissa_iter: Annotated[int, Range(-1, also="-1 = the exact SVD")] = 16
    """PiSSA: iterations of the fast randomized SVD (LLaMA-Factory's `pissa_iter`); -1 = the exact (slow) SVD."""
    adapter: str | None = None
    """Train on from this adapter (a run folder, an export or an adapter folder trained with the same labels and
    prompt; LLaMA-Factory's `adapter_name_or_path`) instead of fresh adapters: its weights and LoRA settings (r,
    alpha, targets) are the start, and the run's "before" is that adapter's score, not the bare base's (run.json's
    `before` says which). null = fresh adapters."""
    layers: Annotated[list[int] | int | None, LAYER_COUNT] = None
    """Decoder layers that get adapters (PEFT's `layers_to_transform`, Axolotl's `peft_layers_to_transform`):
    null = every layer; a list of layer indices, counted from 0 = the layer nearest the embeddings (e.g. [12, 13,
    14]); or a count, as LLaMA-Factory's `freeze_trainable_layers` counts: N = the last N layers (the top ones,
    nearest the output), -N = the first N (the bottom ones, nearest the embeddings). Checked against the model's
    decoder layers (`num_hidden_layers`; the text model's for multimodal Gemma 3n / Gemma 4) before any weights
    load. Frozen layers below the lowest adapted one get no backward pass, so adapting only the top layers makes
    a training step cheaper. A classification head (task classify_head) is trained in full either way."""

    @field_validator("target_parameters", mode="before")
    @classmethod
    def _experts_or_names(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "experts":
            raise ValueError("must be `experts` (every routed expert weight of the language model), a list of weight "
                             "names such as [mlp.experts.gate_up_proj, mlp.experts.down_proj], or null (a single name "
                             "goes in a list: [" + value + "])")
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v.strip() for v in value)):
            raise ValueError("a list must name at least one weight, each a non-empty name such as mlp.experts.down_proj; "
                             "null adapts no weight beside lora.target_modules")
        return value

    @model_validator(mode="after")
    def _parameter_lora_limits(self) -> LoraSettings:
        if self.target_parameters is None:
            return self
        said = [what for what, wrong in (
            (f"lora.dropout={self.dropout} (set lora.dropout=0: dropout cannot be factored out of a weight's LoRA)",
             self.dropout != 0),
            ("lora.use_dora=true (set lora.use_dora=false)", self.use_dora),
            (f"lora.init={self.init} (set lora.init=default)", self.init != "default")) if wrong]
        if said:
            raise ValueError(f"`lora.target_parameters` ({self.target_parameters}) runs PEFT's LoRA on weights, which "
                             f"does not take {'; nor '.join(said)}; or set lora.target_parameters=null")
        return self

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


FREEZE_LAYERS = Range(-1000, 1000, also="not 0 (N = the last N layers, -N = the first N)")


class TrainConfig(Section):
    finetuning: Literal["lora", "full", "freeze"] = "lora"
    """What training changes (LLaMA-Factory's `finetuning_type`): `lora` = LoRA adapters over the frozen base (the
    `lora` section), saved as an adapter; `full` = every weight of the language model (and a classification head),
    saved as a whole model folder in the run folder (`model/`); `freeze` = only the decoder layers and modules the
    `freeze_*` settings name, saved the same way. `full` and `freeze` keep fp32 copies of the trained weights while
    training (AdamW: about 16 bytes per trained parameter), so they suit small models; they take no quantized base
    and none of LoRA's own methods (LoRA+, PiSSA/OLoRA/LoftQ, DoRA, lora.adapter). docs/training.md compares them."""
    freeze_trainable_layers: Annotated[int, FREEZE_LAYERS] = 2
    """`finetuning: freeze`: the decoder layers that train, counted as LLaMA-Factory counts them: N = the last N
    layers (nearest the output), -N = the first N (nearest the embeddings). A count beyond the model's decoder layers
    is refused before any weights load."""
    freeze_trainable_modules: str | list[str] = "all"
    """`finetuning: freeze`: which modules inside those layers train: `all` = the whole layers, or names of a decoder
    layer's parts, e.g. [mlp, self_attn] (LLaMA-Factory's `freeze_trainable_modules`)."""
    freeze_extra_modules: list[str] | None = None
    """`finetuning: freeze`: modules outside the decoder layers that train too, named by their own name or full path,
    e.g. [embed_tokens, norm] (LLaMA-Factory's `freeze_extra_modules`); null = none. A classification head (task
    classify_head) trains either way: it starts untrained."""
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
    """Peak learning rate of the trained parameters (the LoRA adapters, or the weights `full` / `freeze` train)."""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule."""
    warmup_ratio: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """Share of steps spent warming the learning rate up."""
    warmup_steps: Annotated[int, Range(0)] = 0
    """Optimizer steps spent warming the learning rate up; when above 0 it replaces `warmup_ratio` (as in
    transformers' TrainingArguments, so a LLaMA-Factory file's `warmup_steps` means the same here)."""
    weight_decay: Annotated[float, Range(0)] = 0.0
    """Weight decay, on the trained weights except normalization weights and biases (as transformers' Trainer)."""
    adam_beta1: Annotated[float, Range(0, 1, high_open=True)] = 0.9
    """AdamW's first-moment decay (transformers' and LLaMA-Factory's `adam_beta1`); the AdamW optimizers only."""
    adam_beta2: Annotated[float, Range(0, 1, high_open=True)] = 0.999
    """AdamW's second-moment decay (`adam_beta2`; 0.95 is common for large models); the AdamW optimizers only."""
    adam_epsilon: Annotated[float, Range(0, low_open=True)] = 1e-8
    """AdamW's epsilon, added to the root of the second moment (`adam_epsilon`); the AdamW optimizers only."""
    max_length: Annotated[int, Range(1)] = 256
    """Longest tokenized prompt+completion; longer rows are truncated."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: far less memory,
    about 30% more arithmetic and a second forward's launches per pass. `true` / `false` = always / never.
    `auto` = decided when training starts, from the same free memory and per-token estimate as
    `max_tokens_per_pass=auto` (emotune.train.pass_size): off when, without it, an update needs no more forward
    passes than with it (a cap in the config: when its passes fit without it), on otherwise, and on where the free
    memory cannot be read, under FSDP and for models that do not support it (then off). The gradients are the same
    either way; the choice is printed and recorded in run.json (`stages.train.passes`), and out-of-memory recovery
    turns it on when a step runs out of memory."""
    max_tokens_per_pass: Annotated[int | Literal["auto"], Range(0, also="0 = no cap, or `auto`")] = "auto"
    """Most padded tokens (rows x longest row) in one forward/backward pass. The rows of each optimizer update
    (`batch_size` x `gradient_accumulation_steps` on each process) are sorted by length and cut into passes under
    this cap, across micro-batches, and their gradients summed before the step: the same update (the loss is
    divided by the update's completion tokens either way), in as few passes as the cap allows. `auto`: sized when
    training starts from the device's free memory (GPU: free device memory; CPU: available RAM) after the model
    and optimizer are set up, less the gradients and optimizer state, with half of the rest kept free as a margin,
    and the planner's per-token activation estimate for this model and settings (emotune.train.pass_size): a whole
    update in one pass when it fits, else the largest passes that fit. The cap, the free memory seen and the
    passes per update are printed and recorded in run.json. 0 = no cap: one pass per micro-batch, as gradient
    accumulation gives. On a CPU, larger passes leave more of glibc's heap behind (about 300 MB more peak for Gemma 3
    270M at batch 8, docs/benchmarks.md): 512 keeps the footprint of earlier versions."""
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
    foreach: Literal["auto", "off"] = "auto"
    """`auto`: PyTorch's optimizers (AdamW, SGD, Adafactor) and the gradient clipping work on all trained tensors in one
    call per operation (their `foreach` implementations) on every device, instead of one call per tensor, which is
    PyTorch's own default on a CPU; the same update (AdamW and SGD bit for bit, Adafactor within a rounding step:
    tests/test_optim.py). `adamw_torch_fused` and the
    8-bit optimizers keep their own kernels. `off`: PyTorch's defaults (a loop over the tensors on a CPU)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Regional compilation (emotune.train.compile): `torch.compile` of each decoder layer, the block a model repeats,
    so one compiled graph serves every layer of a kind; with gradient checkpointing and the LoRA adapters as they are.
    `auto` = on for CUDA and ROCm GPUs where Triton is importable, off on a CPU (there compiling takes tens of seconds
    per kind of layer, more than a short CPU run gains); `on` = also on a CPU (needs a C++ compiler); `off` = eager.
    When compiling fails (no C++ compiler or Triton, an error of the compiler), training says so once, runs eager and
    run.json records it."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adamw_8bit", "paged_adamw_8bit",
                   "paged_adamw_32bit"] = "adamw_torch"
    """Optimizer: PyTorch's AdamW (`adamw_torch_fused`: in one kernel), SGD or Adafactor; `adamw_8bit` =
    bitsandbytes' AdamW with 8-bit moments (a quarter of AdamW's state memory; CPU, CUDA and ROCm);
    `paged_adamw_8bit` = the same in paged GPU memory (GPU only); `paged_adamw_32bit` = bitsandbytes' AdamW with
    32-bit moments in paged GPU memory (the QLoRA paper's and many QLoRA notebooks' choice; GPU only).
    emotune.train.optim."""
    loraplus_lr_ratio: Annotated[float | None, Range(0, low_open=True, also="or null for off, e.g. 16")] = None
    """LoRA+: the LoRA B matrices learn at this many times `learning_rate` (the A matrices at `learning_rate`);
    null = off. The LoRA+ paper (and LLaMA-Factory's `loraplus_lr_ratio`) suggests 16."""
    loraplus_lr_embedding: Annotated[float, Range(0, low_open=True)] = 1e-6
    """LoRA+: the learning rate of LoRA adapters on embedding layers (PEFT's default)."""
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

    @field_validator("freeze_trainable_layers", mode="before")
    @classmethod
    def _some_layers(cls, value: Any) -> Any:
        if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
            raise ValueError(f"must be {FREEZE_LAYERS.describe(integer=True)}; 0 layers would train nothing")
        return value

    @field_validator("freeze_trainable_modules", "freeze_extra_modules", mode="before")
    @classmethod
    def _module_names(cls, value: Any) -> Any:
        """One name or a comma-separated list (LLaMA-Factory writes `mlp,self_attn`) is a list; `all` stays `all`."""
        if isinstance(value, str):
            names = [name.strip() for name in value.split(",") if name.strip()]
            if not names:
                raise ValueError("name at least one module (e.g. mlp), or `all`")
            return "all" if names == ["all"] else names
        if isinstance(value, list) and not value:
            raise ValueError("an empty list would train nothing; name modules (e.g. [mlp, self_attn]) or use `all`")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_words(cls, value: Any) -> Any:
        # `on`/`off` as the other switches take them; pydantic's own bool parsing covers true/false/yes/no/1/0
        return {"on": True, "off": False}.get(value.strip().lower(), value) if isinstance(value, str) else value

    @field_validator("shared_prefix", "foreach", "compile", mode="before")
    @classmethod
    def _bare_off_is_off(cls, value: Any) -> Any:
        # YAML reads a bare `off` as false and a bare `on` as true
        return "off" if value is False else "on" if value is True else value

    @field_validator("time_budget", mode="before")
    @classmethod
    def _a_duration(cls, value: Any) -> Any:
        if value is not None:
            duration_seconds(value)  # raises ValueError with what to write instead
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _adam_settings_for_adam(self) -> TrainConfig:
        changed = [f"train.{key}={getattr(self, key)}" for key, default in ADAM_DEFAULTS.items()
                   if getattr(self, key) != default]
        if changed and self.optim in ("sgd", "adafactor"):
            raise ValueError(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} AdamW's moments, and "
                             f"train.optim={self.optim} has none; leave {'it' if len(changed) == 1 else 'them'} at the "
                             "default or choose an AdamW optimizer (adamw_torch, adamw_torch_fused, adamw_8bit, ...)")
        return self

    @model_validator(mode="after")
    def _steps_or_budget(self) -> TrainConfig:
        if self.time_budget is not None and self.max_steps > 0:
            raise ValueError(f"`train.time_budget` ({self.time_budget}) and `train.max_steps` ({self.max_steps}) both say "
                             "how long to train; set one of them: train.max_steps=-1 to train by the budget, or "
                             "train.time_budget=null to run the steps")
        return self


ADAM_DEFAULTS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}  # TrainConfig's, torch's AdamW's


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
