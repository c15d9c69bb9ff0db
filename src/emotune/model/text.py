"""The text model inside whatever class loaded: its config, its language model, what its forward does to the logits
after the output projection (a scale, a final soft-cap), and exact float32 logits.

`AutoModelForCausalLM` loads Gemma 3 4B+, Gemma 3n and Gemma 4 as their multimodal wrappers
(`Gemma4ForConditionalGeneration`), whose top-level config holds `text_config` and none of the text model's
attributes: `final_logit_softcapping` (30 in every released Gemma 4 checkpoint) read from the top level is None.
Every text-model attribute emotune reads goes through `text_config`, so the wrapper and the text class of the same
weights compute the same (tests/test_equivalence.py).

Label scores are read in float32 whatever the weights' dtype: a bf16 projection rounds every logit to 8 bits of
mantissa, and labels then tie exactly at the top (issue 28: 1.9 % of rows of a fine-tuned Gemma 3 270M). Upcast,
a bf16 hidden state and bf16 weight row multiply exactly in float32, so `float32_logits` gives the logits of the
bf16 model as float32 arithmetic computes them; it runs only at the few positions a score reads.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from emotune.core.errors import UserError

VOCAB_ROWS_PER_UPCAST = 16_384
"""Weight rows upcast to float32 at a time: 16,384 x hidden 2,560 is 168 MB, where the whole Gemma 4 E4B
vocabulary (262,144 rows) would be 2.7 GB held at once."""


def text_config(config):
    """The config of the text model: `config.text_config` of a multimodal wrapper, `config` itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(model) -> int | None:
    """The model's context window (its text config's max_position_embeddings), or None when the config does not say."""
    config = getattr(model, "config", None)
    value = getattr(text_config(config), "max_position_embeddings", None) if config is not None else None
    return value if isinstance(value, int) and value > 0 else None


def causal_lm_class(config):
    """The auto class that loads `config`'s model with its output layer, as a causal LM: `AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for vision-language checkpoints transformers maps there only (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, Mistral 3, LLaVA, Idefics 3, PaliGemma: `AutoModelForCausalLM` refuses their configs). Either class's
    forward takes text alone and returns next-token logits, and the language model sits behind `get_decoder()`, as in
    Gemma 3's multimodal wrapper that both classes load.

    Encoder and encoder-decoder models are refused by name: transformers' causal classes load BERT-like encoders
    (`BertLMHeadModel`, `RobertaForCausalLM`) and BART's decoder alone, which would train and score without an error
    and compute something else (a BERT attends in both directions, so every position sees the answer it predicts)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False) or (
            model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)):
        kind = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "an encoder-only (masked-LM)"
        raise UserError(f"{_named(config)} is {kind} model (`{model_type}`), and emotune fine-tunes decoder-only language "
                        "models: every task reads the answer from next-token logits (classify, sft) or from the last "
                        "token's hidden state (classify_head). Use a decoder-only instruction-tuned model (Qwen, Llama, "
                        "Gemma, Mistral, SmolLM ...); for a BERT-style classifier use transformers' "
                        "AutoModelForSequenceClassification with its Trainer instead.")
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if model_type in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise UserError(f"{_named(config)} is a `{model_type}` model, which transformers {_version()} cannot load as a causal "
                    "language model (neither AutoModelForCausalLM nor AutoModelForImageTextToText knows it), and "
                    "emotune fine-tunes decoder-only language models. Use a decoder-only instruction-tuned model, or "
                    "upgrade transformers if this architecture is newer than it.")


def _named(config) -> str:
    return f"The model `{config.name_or_path}`" if getattr(config, "name_or_path", "") else "The model"


def _version() -> str:
    import transformers

    return transformers.__version__


def unwrapped(model):
    """The transformers model under DDP (`module`) and PEFT (`get_base_model`) wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def language_model(model) -> torch.nn.Module:
    """The module that turns ids into the last hidden states: transformers' `get_decoder()`, except where its lookup
    falls back to the causal model itself. Llama4ForCausalLM names `language_model` as its base_model_prefix but keeps
    the decoder at `model`, so `get_decoder()` returns the whole causal model (logits, no hidden states); the
    language model is then the child that holds the input embeddings."""
    decoder = model.get_decoder()
    if decoder is not model or model.get_output_embeddings() is None:
        return decoder
    embeddings = model.get_input_embeddings()
    return next((child for child in model.children() if any(m is embeddings for m in child.modules())), decoder)


def logit_scale(model) -> float:
    """What the model's own forward multiplies the output projection's logits by (1 for most families): Granite
    divides them by `logits_scaling`, Cohere (Command R) multiplies them by `logit_scale`. Code that projects hidden
    states itself (label scoring) applies it as the model does."""
    config = text_config(unwrapped(model).config)
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None):
        scale *= float(config.logit_scale)
    return scale


SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Where configs keep the final logit soft-cap: Gemma 2-4's `final_logit_softcapping`, RecurrentGemma's
`logits_soft_cap` (google/recurrentgemma-2b: 30), xLSTM's `output_logit_soft_cap`."""
SUSPENDABLE_SOFTCAP = "final_logit_softcapping"
"""The one field a forward reads None from as "no cap" (Gemma's); RecurrentGemma's divides by its cap unconditionally."""


def softcap_field(config) -> str | None:
    """The name of the field that holds `config`'s final logit soft-cap, None where it has none."""
    return next((field for field in SOFTCAP_FIELDS if getattr(config, field, None)), None)


def logit_softcap(model) -> float | None:
    """The text model's final logit soft-cap (`tanh(logits / cap) * cap`), None where it has none."""
    config = text_config(unwrapped(model).config)
    field = softcap_field(config)
    return getattr(config, field) if field else None


@contextmanager
def softcap_suspended(model):
    """Within the block the model's own forward applies no final soft-cap; yields the cap to apply instead.

    Gemma's forward reads the cap from its text config at every call (the wrapper's forward from
    `config.get_text_config()`), so the attribute is set to None there and given back afterwards. Set past the
    config's own `__setattr__`: Gemma 3n's strict config refuses None for the field, which its forward still reads
    as "no cap"."""
    config = text_config(unwrapped(model).config)
    if softcap_field(config) not in (None, SUSPENDABLE_SOFTCAP):
        raise ValueError(f"{type(config).__name__}'s soft-cap cannot be suspended (see SUSPENDABLE_SOFTCAP)")
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        yield None
        return
    object.__setattr__(config, "final_logit_softcapping", None)
    try:
        yield cap
    finally:
        object.__setattr__(config, "final_logit_softcapping", cap)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


def float32_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)` computed in float32 whatever the dtype of the head's weights, gradients kept.

    A plain linear head (every causal LM's output layer, a classifier's `score`) multiplies the upcast hidden
    states by its weight upcast `VOCAB_ROWS_PER_UPCAST` rows at a time. A wrapper with floating-point weights
    (PEFT's LoRA or modules_to_save around the head) runs its own forward with every weight upcast. A quantized
    head (integer weights) keeps its own arithmetic, upcast after: no float32 copy of its weights exists."""
    hidden = hidden.float()
    params = dict(head.named_parameters())
    if all(p.dtype == torch.float32 for p in params.values()):
        return head(hidden).float()
    if type(head) is torch.nn.Linear:
        return _linear_float32(hidden, head.weight, head.bias)
    if all(p.is_floating_point() for p in params.values()):
        upcast = {name: p.float() for name, p in params.items()}
        return torch.func.functional_call(head, upcast, (hidden,), strict=False).float()
    dtype = next((p.dtype for p in params.values() if p.is_floating_point()), torch.bfloat16)
    return head(hidden.to(dtype)).float()


def _linear_float32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    pieces = [F.linear(hidden, rows.float()) for rows in weight.split(VOCAB_ROWS_PER_UPCAST)]
    logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces, -1)
    return logits if bias is None else logits + bias.float()


def is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Router")


def routers(model: torch.nn.Module) -> list[str]:
    """The names of the mixture-of-experts routers that hold a linear layer (Gemma 4's, DBRX's and AFMoE's
    `router.proj`; Llama 4's and PhiMoE's routers are one)."""
    return [name for name, module in model.named_modules()
            if name and is_router(module) and any(isinstance(m, torch.nn.Linear) for m in module.modules())]


def expert_weights(model: torch.nn.Module) -> list[str]:
    """The names of the language model's routed expert weights: the 3-D tensors of its experts modules (transformers 5's
    `Qwen3MoeExperts.gate_up_proj`, `MixtralExperts.down_proj`), one per layer and projection."""
    decoder = language_model(model)
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return [f"{prefix}.{name}".lstrip(".") for name, param in decoder.named_parameters()
            if param.ndim == 3 and "Expert" in type(decoder.get_submodule(name.rpartition(".")[0])).__name__]
