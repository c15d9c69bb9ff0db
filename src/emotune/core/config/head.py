"""`task: classify_head`: the head's settings and its evaluation."""

from __future__ import annotations

from typing import Annotated, Literal

from emotune.core.config.base import (
    Range,
    Section,
)
from emotune.core.config.data import DataConfig, PromptConfig
from emotune.core.config.eval import MergedEvalSettings
from emotune.core.config.run import RunConfigBase

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
