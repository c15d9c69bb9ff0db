"""classify_head's training objective: class-weighted cross-entropy on the head's logits, one "token" per row;
SEQ_CLS adapters with the `score` head trained in full, the adapter kept by validation accuracy, macro-F1 or loss."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from emotune.model.head import HEAD, pad_right
from emotune.train.batches import Example, LossParts, Objective


def collate_rows(examples: list[Example], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded ids, the attention mask (which the head pools by), each row's class and loss weight."""
    input_ids, attention_mask = pad_right([e.input_ids for e in examples], pad_id, device)
    labels = torch.tensor([e.label for e in examples], dtype=torch.long)
    weights = torch.tensor([e.weight for e in examples], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels.to(device),
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
    """Validation accuracy and macro-F1 over the labels the rows hold or the head predicts (a class never predicted
    scores 0; one neither held nor predicted has no F1), as evaluation."""
    from sklearn.metrics import f1_score

    gold_, predicted_ = gold.tolist(), predicted.tolist()
    seen = set(gold_) | set(predicted_)
    return {"eval_accuracy": sum(g == p for g, p in zip(gold_, predicted_, strict=False)) / max(len(gold_), 1),
            "eval_macro_f1": float(f1_score(gold_, predicted_, labels=[k for k in range(num_labels) if k in seen] or None,
                                            average="macro", zero_division=0))}


SELECT = {"macro_f1": "eval_macro_f1", "accuracy": "eval_accuracy", "loss": "eval_loss"}


def head_objective(select: str, num_labels: int) -> Objective:
    """The head's loss, SEQ_CLS adapters with `score` trained in full, and the adapter kept by `select`."""
    return Objective(collate=collate_rows, loss=head_loss, select=SELECT[select], higher_is_better=select != "loss",
                     row_metrics=partial(class_metrics, num_labels=num_labels), lora_task_type="SEQ_CLS",
                     modules_to_save=(HEAD,))
