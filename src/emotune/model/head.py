"""A linear classification head (`score`) on the last real token of the base model's language model.

transformers has `…ForSequenceClassification` for Gemma 1–3 (`Gemma3TextForSequenceClassification`, …)
but none for Gemma 3n or Gemma 4. Where the library has the class we build it (its module names,
`model` and `score`, are the ones a merged checkpoint needs for `AutoModelForSequenceClassification`);
otherwise emotune's own class holds the text model under the same names, built by the library's generic
recipe (`GenericForSequenceClassification`). Either way the forward is ours: the library pools at the last
token that is not `pad_token_id`, which is wrong whenever the pad id equals the end-of-sequence id and a
row ends with it; here the row's last real token comes from the attention mask, with left or right padding
alike.

The classifier is built around the already loaded causal model's language model (no second copy of
the weights): the causal model's output projection is simply not used.

After training: `load_classifier` loads a merged head model (emotune's loader, for every architecture);
`head_probabilities` is the inference used by evaluation, predict and serve; `causal_adapter` turns a head
adapter into LoRA on the causal model's own module names, so a server can hold it beside generative adapters
over one copy of the base weights.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, MODEL_MAPPING_NAMES

from emotune.core.errors import UserError
from emotune.model.lora import peft_renames
from emotune.model.text import float32_logits, language_model
from emotune.runtime.oom import run_in_batches

HEAD = "score"  # transformers' name for the head of decoder-only sequence classifiers
BODY = "model"  # where emotune's own classifier holds the language model (GenericForSequenceClassification.base_model_prefix)
PEFT_PREFIX = "base_model.model."  # what PEFT puts before module names in an adapter's weights file


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the position of the last 1 in the attention mask (the last real token), for any padding side."""
    width = attention_mask.shape[-1]
    return width - 1 - attention_mask.flip(-1).to(torch.int32).argmax(-1)


class MaskPooledHead:
    """Mixin: the forward of a sequence classifier that pools by the attention mask. The head runs in float32,
    whatever the dtype of its weights (emotune.model.text.float32_logits). The language model sits where the class
    it is mixed into keeps it (`base_model_prefix`: `model` for most, `transformer` for GPT-2 and Falcon)."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers 5 has no public switch for this. `PreTrainedModel.__init__` asks this classmethod whether
        # the fused MoE experts kernel (grouped_mm) may be used, and the default answer scans the source of the
        # class's *module* for `@use_experts_implementation` (transformers PR #42697). Our classes live in
        # emotune.model.head, so the scan would say no and a MoE body (Gemma 4 26B-A4B) loaded through `load_classifier`
        # would fall back to the eager experts loop. The answer belongs to the architecture: ask the transformers
        # class we derive from. Overriding this hook is the only way the library offers to classes defined
        # outside its own modules.
        library = next(c for c in cls.__mro__[1:] if c.__module__.startswith("transformers.models."))
        return library._can_set_experts_implementation()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        del labels, kwargs  # the loss is the task's (class weights); PEFT passes output_* flags we do not need
        body = getattr(self, self.base_model_prefix)
        if attention_mask is None:
            reference = input_ids if input_ids is not None else inputs_embeds[..., 0]
            attention_mask = torch.ones(reference.shape[:2], dtype=torch.long, device=reference.device)
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                      use_cache=False).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pooled = hidden[rows, last_token_index(attention_mask).to(hidden.device)]
        logits = float32_logits(getattr(self, HEAD), pooled)  # a merged head loaded in bf16 still scores in float32
        return SequenceClassifierOutputWithPast(logits=logits)


def library_class(config) -> type | None:
    """transformers' sequence-classification class for this architecture, None where it has none."""
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    return getattr(transformers, name, None) if name else None


def has_library_class(causal: PreTrainedModel) -> bool:
    return library_class(causal.config) is not None


def is_classifier(model) -> bool:
    """Whether `model` (possibly PEFT-wrapped) is a head classifier built here."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(inner, MaskPooledHead)


def classifier_class(config) -> type:
    """The mask-pooled classifier for `config`: transformers' class where the architecture has one (its name is
    kept, so save_pretrained records an architecture the Auto classes know), emotune's own otherwise."""
    library = library_class(config)
    if library is not None:
        return type(library.__name__, (MaskPooledHead, library), {"__module__": __name__})
    return _own_class(config)


def _own_class(config) -> type:
    """emotune's classifier for a text config without a library class: the library's generic recipe (the text
    model as `model`, a bias-free `score`) on the architecture's own PreTrainedModel."""
    body = getattr(transformers, MODEL_MAPPING_NAMES[config.model_type])
    family = next(c for c in body.__mro__ if c.__name__.endswith("PreTrainedModel") and c is not PreTrainedModel)
    name = "Emotune" + family.__name__.removesuffix("PreTrainedModel") + "ForSequenceClassification"
    # config_class: the family's is the multimodal config, but this class is built from (and loads) the text one
    return type(name, (MaskPooledHead, GenericForSequenceClassification, family),
                {"__module__": __name__, "config_class": type(config)})


def body_prefix(config) -> str:
    """The attribute under which the classifier for `config` holds its language model (its `base_model_prefix`)."""
    library = library_class(config)
    return library.base_model_prefix if library is not None else BODY


def _body(causal: PreTrainedModel) -> tuple:
    """(the classifier's config, the language model it wraps) for a loaded causal model: the causal model's own body
    where transformers has the classifier class (both keep it under the same `base_model_prefix`)."""
    if library_class(causal.config) is not None:
        return copy.deepcopy(causal.config), getattr(causal, body_prefix(causal.config))
    return copy.deepcopy(causal.config.get_text_config()), language_model(causal)


def classifier_from_causal(causal: PreTrainedModel, labels: list[str], seed: int = 0, init_std: float = 0.0
                           ) -> PreTrainedModel:
    """A classifier over `causal`'s language model (shared, not copied) with a fresh float32 `score` head.

    The head starts at zero (`init_std=0`): every class at 1/K and the loss at ln K. transformers' own
    initialisation (normal, std `initializer_range` = 0.02) is far too wide for Gemma, whose final hidden
    states have norms in the hundreds: the 270M model started at a loss of 8 for 7 classes, and training
    first had to undo that noise. `init_std > 0` draws a seeded normal head instead (tests use it to make
    the head's reading of a position visible)."""
    config, body = _body(causal)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.use_cache = False
    with torch.device("meta"):  # the library's constructor builds a language model; ours replaces it at no cost
        classifier = classifier_class(config)(config)
    setattr(classifier, classifier.base_model_prefix, body)
    hidden = config.get_text_config().hidden_size
    device = next(body.parameters()).device
    head = torch.nn.Linear(hidden, len(labels), bias=False, device=device, dtype=torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * init_std)
    setattr(classifier, HEAD, head)
    return classifier.to(device)


def load_classifier(folder: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """emotune's loader of a merged head model (`emotune export --merge`): every architecture, pooled by the mask.

    Gemma 1–3 folders also load with transformers' `AutoModelForSequenceClassification`, which gives the same
    logits for unpadded rows and for padded ones whose pad id is not a real token of the row."""
    config = AutoConfig.from_pretrained(folder)
    return classifier_class(config).from_pretrained(folder, dtype=dtype).to(device).eval()


# --------------------------------------------------------------------------------------------------
# Inference: texts in, probabilities over the labels out (evaluation, predict and serve alike)


def encode_texts(texts: list[str], tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[list[int]]:
    """The text's tokens (with the tokenizer's own special tokens, e.g. Gemma's <bos>), cut at `max_length`."""
    encoded = tokenizer(list(texts), add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    return [ids or [tokenizer.eos_token_id] for ids in encoded]


def pad_right(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and the attention mask the head pools by (the last real token of each row)."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.inference_mode()
def head_probabilities(model, tokenizer, texts: list[str], max_length: int, batch_size: int,
                       desc: str | None = None) -> torch.Tensor:
    """[rows, labels] softmax of the head's logits; rows sorted by length to cut padding."""
    device = next(model.parameters()).device
    ids = encode_texts(texts, tokenizer, max_length)
    probs = torch.zeros(len(texts), model.config.num_labels)

    def step(batch: list[int]) -> None:
        input_ids, attention_mask = pad_right([ids[i] for i in batch], tokenizer.pad_token_id, device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        probs[batch] = logits.float().softmax(-1).cpu()

    was_training = model.training
    model.eval()
    try:
        run_in_batches(sorted(range(len(texts)), key=lambda i: len(ids[i])), batch_size, step, desc)
    finally:
        model.train(was_training)
    return probs


# --------------------------------------------------------------------------------------------------
# Serving beside other adapters: a head adapter's LoRA on the causal model's own module names


def causal_adapter(causal: PreTrainedModel, adapter_dir: Path):
    """(LoRA config, LoRA weights, head weight) of a head adapter, with the LoRA named as in `causal`.

    A head adapter's modules are named as in the classifier, whose language model sits at its `base_model_prefix`
    (`model`, GPT-2's `transformer`); in the causal model it sits at the same name (text-only models, and every
    architecture with a library class) or deeper
    (`model.language_model` of a multimodal Gemma 3n / Gemma 4). Renamed, the LoRA joins the causal model's
    other adapters, and `classifier_from_causal(causal, ...)` with the head weight reads through it."""
    from peft import LoraConfig
    from peft.utils import load_peft_weights

    config = LoraConfig.from_pretrained(str(adapter_dir))
    weights = load_peft_weights(str(adapter_dir), device="cpu")
    head = weights.pop(f"{PEFT_PREFIX}{HEAD}.weight", None)
    if head is None:
        raise UserError(f"`{adapter_dir}` holds no trained `{HEAD}` head, so it is not a classification-head adapter "
                        "emotune wrote. Re-export the run that trained it.")
    _, body = _body(causal)
    where = next(name for name, module in causal.named_modules() if module is body)
    prefix = body_prefix(causal.config)

    def rename(key: str) -> str:
        name = key.removeprefix(PEFT_PREFIX)
        return PEFT_PREFIX + (where + name[len(prefix):] if name.startswith(prefix + ".") else name)

    weights = {rename(key): value for key, value in weights.items()}
    # exactly the modules the adapter holds LoRA for, as a regex PEFT full-matches (cf. lora.py's all-linear)
    targets = sorted({re.sub(r"\.lora_[A-Za-z_]+(?:\..*)?$", "", key.removeprefix(PEFT_PREFIX)) for key in weights
                      if ".lora_" in key})
    causal_config = copy.deepcopy(config)
    renamed = peft_renames(causal) & {t.rsplit(".", 1)[-1] for t in targets}  # a regex PEFT would rewrite: the names
    causal_config.target_modules = targets if renamed else rf"^(?:{'|'.join(map(re.escape, targets))})$"
    causal_config.layers_to_transform = causal_config.layers_pattern = None
    causal_config.exclude_modules = None
    causal_config.modules_to_save = [m for m in (config.modules_to_save or []) if m != HEAD] or None
    causal_config.task_type = "CAUSAL_LM"
    causal_config.inference_mode = True
    return causal_config, weights, head
