"""Prompt format: the one place that decides what the model reads, for training and evaluation alike."""

from __future__ import annotations

from datasets import Dataset

from emotune.core.config.data import PromptConfig

LIST_SEPARATORS = (",", "，", "、")  # ASCII, full-width and ideographic commas


def label_list(labels: list[str]) -> str:
    """The labels as the system prompt lists them: comma-separated, each in double quotes when any label holds a
    comma, which would otherwise read as two labels (`joy, really` among `anger, joy, really, fear`)."""
    if any(sep in label for label in labels for sep in LIST_SEPARATORS):
        return ", ".join(f'"{label}"' for label in labels)
    return ", ".join(labels)


def system_prompt(prompt: PromptConfig, labels: list[str]) -> str:
    return prompt.system_prompt.replace("{labels}", label_list(labels))


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
