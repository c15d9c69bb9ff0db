"""A linear classification head (`score`) on the last real token of the base model's language model.

transformers has `…ForSequenceClassification` for Gemma 1–3 (`Gemma3TextForSequenceClassification`, …)
but none for Gemma 3n or Gemma 4. Where the library has the class we build it (its module names,
`model` and `score`, are the ones a merged checkpoint needs for `AutoModelForSequenceClassification`);
otherwise emotune's own class holds the text model under the same names. Either way the forward is
ours: the library pools at the last token that is not `pad_token_id`, which is wrong whenever the pad id
equals the end-of-sequence id and a row ends with it; here the row's last real token comes from the
attention mask, with left or right padding alike.

The classifier is built around the already loaded causal model's language model (no second copy of
the weights): the causal model's output projection is simply not used.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

from emotune.batches import Example, LossParts, Objective

HEAD = "score"  # transformers' name for the head of decoder-only sequence classifiers


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the position of the last 1 in the attention mask (the last real token), for any padding side."""
    width = attention_mask.shape[-1]
    return width - 1 - attention_mask.flip(-1).to(torch.int32).argmax(-1)


class MaskPooledHead:
    """Mixin: the forward of a sequence classifier that pools by the attention mask. The head runs in float32."""

    base_model_prefix = "model"

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
        head = getattr(self, HEAD)
        logits = head(pooled.to(next(head.parameters()).dtype))
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


def _mask_pooled(base: type) -> type:
    # The library's name is kept so that save_pretrained records an architecture transformers' Auto classes know.
    return type(base.__name__, (MaskPooledHead, base), {"__module__": __name__})


def _own_class(causal: PreTrainedModel) -> type:
    """emotune's classifier for an architecture without a library one, on the architecture's PreTrainedModel."""
    family = next(c for c in type(causal).__mro__ if c.__name__.endswith("PreTrainedModel") and c is not PreTrainedModel)

    def __init__(self, config):
        family.__init__(self, config)
        self.model = None  # the language model is attached by `classifier_from_causal`
        self.score = torch.nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    name = "Emotune" + family.__name__.removesuffix("PreTrainedModel") + "ForSequenceClassification"
    # transformers decides from the source of the class's module whether it may set the experts (MoE) kernel;
    # ours is the family's, so take the family's answer.
    experts = family._can_set_experts_implementation()
    return type(name, (MaskPooledHead, family), {"__init__": __init__, "__module__": __name__,
                                                  "_can_set_experts_implementation_cached_value": experts})


def classifier_from_causal(causal: PreTrainedModel, labels: list[str], seed: int = 0) -> PreTrainedModel:
    """A classifier over `causal`'s language model (shared, not copied) with a fresh float32 `score` head."""
    library = library_class(causal.config)
    if library is not None:
        config, body, cls = copy.deepcopy(causal.config), causal.model, _mask_pooled(library)
    else:
        config, body, cls = copy.deepcopy(causal.config.get_text_config()), causal.get_decoder(), _own_class(causal)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    config.use_cache = False
    with torch.device("meta"):
        classifier = cls(config)
    setattr(classifier, classifier.base_model_prefix, body)
    hidden = config.get_text_config().hidden_size
    device = next(body.parameters()).device
    head = torch.nn.Linear(hidden, len(labels), bias=False, device=device, dtype=torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
    setattr(classifier, HEAD, head)
    return classifier.to(device)


# --------------------------------------------------------------------------------------------------
# The training objective: class-weighted cross-entropy on the head's logits, one "token" per row


def collate_rows(examples: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ids, the attention mask (which the head pools by), each row's class and loss weight."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, :len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[i, :len(e.input_ids)] = 1
    labels = torch.tensor([e.label for e in examples], dtype=torch.long)
    weights = torch.tensor([e.weight for e in examples], dtype=torch.float32)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device), "labels": labels.to(device),
            "row_weights": weights.to(device)}


def head_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossParts:
    """Σ_rows weight(class) · cross-entropy; the loop divides by the rows of the global step (each row counts one
    loss token), as the completion loss weighs each label token (data.balance=class_weight)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    per_row = F.cross_entropy(logits, batch["labels"], reduction="none")
    predicted = logits.detach().argmax(-1)
    return LossParts((per_row * batch["row_weights"]).sum(), int(batch["labels"].numel()),
                     (predicted == batch["labels"]).sum(), predicted, batch["labels"])


def class_metrics(predicted: torch.Tensor, gold: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Validation accuracy and macro-F1 over the whole label set (a class never predicted scores 0), as evaluation."""
    from sklearn.metrics import f1_score

    gold_, predicted_ = gold.tolist(), predicted.tolist()
    return {"eval_accuracy": sum(g == p for g, p in zip(gold_, predicted_)) / max(len(gold_), 1),
            "eval_macro_f1": float(f1_score(gold_, predicted_, labels=list(range(num_labels)), average="macro",
                                            zero_division=0))}


SELECT = {"macro_f1": "eval_macro_f1", "accuracy": "eval_accuracy", "loss": "eval_loss"}


def head_objective(select: str, num_labels: int) -> Objective:
    """The head's loss, SEQ_CLS adapters with `score` trained in full, and the adapter kept by `select`."""
    return Objective(collate=collate_rows, loss=head_loss, select=SELECT[select], higher_is_better=select != "loss",
                     row_metrics=partial(class_metrics, num_labels=num_labels), lora_task_type="SEQ_CLS",
                     modules_to_save=(HEAD,))
