"""`task: sft`: its data (columns, tags, cleaning), prompt and evaluation sections."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import field_validator

from emotune.core.config.base import (
    HeldOut,
    Range,
    Section,
    named_source,
)
from emotune.core.config.data import known_encoding
from emotune.core.config.eval import MergedEvalSettings
from emotune.core.config.run import RunConfigBase

# --------------------------------------------------------------------------------------------------
# task: sft (instruction tuning on conversations)

SftFormat = Literal["auto", "alpaca", "sharegpt", "messages"]
INPUT_SEPARATOR = "\n\n"
"""data.input_separator's default: a blank line between an Alpaca row's instruction and its input."""
LLAMAFACTORY_INPUT_SEPARATOR = "\n"
"""LLaMA-Factory's join of the instruction and the input (AlpacaDatasetConverter: `"\\n".join(query)`)."""
SEPARATOR_EXAMPLES = ('"\\n\\n" (a blank line, the default) or "\\n" (one newline, as LLaMA-Factory joins them), in double '
                      'quotes: YAML and key=value overrides read escapes only there')


def input_separator_text(value: object) -> object:
    """data.input_separator must be text that separates something. `\\n` unquoted or in single quotes is a backslash
    and an `n` to YAML (and to a key=value override), which would have joined every instruction and input with it."""
    if not isinstance(value, str):
        raise ValueError(f"must be text, what joins an Alpaca row's instruction and its input: {SEPARATOR_EXAMPLES}")
    if not value:
        raise ValueError("is empty, which runs an Alpaca row's instruction and input together (`Translate to "
                         f"FrenchGood morning`); give what joins them: {SEPARATOR_EXAMPLES}")
    escape = re.search(r"\\[nrt]", value)
    if escape:
        raise ValueError(f"holds `{escape[0]}` as two characters, a backslash and a letter, as YAML reads it unquoted or "
                         "in single quotes and as a key=value override reads it unquoted; for a line break write it "
                         'in double quotes: input_separator: "\\n" in YAML, \'data.input_separator="\\n"\' on the command '
                         "line")
    return value


class SftColumns(Section):
    """Which column holds what, as LLaMA-Factory's `columns` in dataset_info.json (the same names)."""

    prompt: str = "instruction"
    """Alpaca: the instruction."""
    query: str = "input"
    """Alpaca: the input appended to the instruction (after data.input_separator); may be empty or absent."""
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
    _named = field_validator("source")(named_source)
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
    validation_size: HeldOut = 0.1
    """Rows held out for validation when the source has no validation split: a share of them (0.1) or a count (500),
    as scikit-learn's and `datasets`' train_test_split read `test_size`."""
    test_size: HeldOut = 0.1
    """Rows held out for testing when the source has no test split, a share (0.1) or a count (500); stratified by
    dataset and kind."""
    max_samples: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Read at most this many rows of each dataset (the first ones, as LLaMA-Factory does); null = all."""
    train_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many training rows (stratified by kind, seeded); null = all."""
    validation_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many validation rows (stratified by kind, seeded); null = all."""
    test_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many test rows (stratified by kind, seeded); null = all."""
    input_separator: str = INPUT_SEPARATOR
    """What joins an Alpaca row's instruction and its input into one user message (and, in H2O LLM Studio's
    parent_id chains, those of the earlier rows); a row without input is its instruction alone. Default: a blank
    line, "\\n\\n". A translated LLaMA-Factory config sets "\\n", the one newline LLaMA-Factory joins them with,
    so its rows are those LLaMA-Factory trains on. In YAML write it in double quotes (input_separator: "\\n");
    on the command line, quote it too: 'data.input_separator="\\n"'."""
    _input_separator = field_validator("input_separator", mode="before")(input_separator_text)
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
