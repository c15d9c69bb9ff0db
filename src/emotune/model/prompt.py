"""Prompt format: the one place that decides what the model reads, for training and evaluation alike."""

from __future__ import annotations

from datasets import Dataset

from emotune.core.config.data import PromptConfig


def system_prompt(prompt: PromptConfig, labels: list[str]) -> str:
    return prompt.system_prompt.replace("{labels}", ", ".join(labels))


def prompt_messages(text: str, prompt: PromptConfig, labels: list[str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": system_prompt(prompt, labels)},
        {"role": "user", "content": prompt.user_template.replace("{text}", text)},
    ]


def to_prompt_completion(ds: Dataset, prompt: PromptConfig, labels: list[str]) -> Dataset:
    """TRL's conversational prompt-completion rows: the loss falls on the completion (the label) only."""
    return ds.map(
        lambda row: {
            "prompt": prompt_messages(row["text"], prompt, labels),
            "completion": [{"role": "assistant", "content": row["label"]}],
        },
        remove_columns=ds.column_names,
    )
