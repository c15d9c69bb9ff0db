"""An sft model's prompts from a file in the format of its training data, each built as training built it.

`emotune predict RUN --file rows.jsonl` on a file without a text column reads it as the data layer reads an sft
run's data (emotune.data.conversations): Alpaca rows (instruction, input, system, history, output), ShareGPT
rows (conversations, system, tools) or OpenAI messages rows (messages or prompt/completion, tools), with the run's
data.columns, data.tags and data.input_separator from its saved config (where that is not at hand, as the adapter's
emotune.json records them). Each row becomes the `Conversation` training made of it, so its prompt is the one training
and evaluation read: the system prompt (the row's, with its tools after it, else the run's), then the turns up to the
last user turn (cleaned as training cleaned them, by the Generator that asks them). The reference answer, where the
row has one, is left out of the prompt and written beside the reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from emotune.core.config.sft import INPUT_SEPARATOR, SftColumns, SftTags
from emotune.core.errors import UserError, listed
from emotune.data import gemini
from emotune.data.conversations import (
    FORMATS,
    TRL_COLUMNS,
    chain_parents,
    detect_format,
    has_parent_chains,
    messages_column,
    named_as_configured,
    normalise,
    required_columns,
    turn_text,
    with_json_turns,
)
from emotune.data.roles import OPENAI_TAGS, side_of
from emotune.model.artifacts import META, Artifact

SAVED_SPLIT_COLUMNS = {"messages", "untrained", "source"}
"""A run's own prepared split (data/test.jsonl: Conversation.as_row), which holds the default column names whatever
the run's data.columns said."""
STAND_IN = "(reference)"
"""Put where a row has no reference answer, so that the data layer reads it as a training row; the prompt never
includes it."""


@dataclass(frozen=True)
class DataSettings:
    """How the run read its rows: data.format, data.columns, data.tags and data.input_separator."""

    format: str = "auto"
    columns: SftColumns = field(default_factory=SftColumns)
    tags: SftTags = field(default_factory=SftTags)
    input_separator: str = INPUT_SEPARATOR
    origin: str = "emotune's default column names (no data.columns saved with the target: not a run folder)"


@dataclass(frozen=True)
class RowPrompts:
    prompts: list[list[dict]]
    """Each row's chat messages up to its last user turn, its system prompt first where it has one."""
    references: list[str] | None
    """Each row's reference answer ("" where it has none), for a file that keeps them inside its turns; None where
    the reference is a column of its own (Alpaca's `output`, TRL's `completion`), kept as it is."""
    description: str
    """Which format and columns were read, to print."""


def data_settings(artifact: Artifact) -> DataSettings:
    """How the run read its rows: the data section of its saved config; else, where that is not at hand (an export,
    whose config.yaml holds the model section only, or an adapter folder alone), what the sft adapter's emotune.json
    records of it (`data`); else the defaults. Only keys that differ from the defaults count as set (the data layer
    treats a set data.columns.messages differently from the default one)."""
    config, recorded = artifact.config.get("data"), artifact.meta.get("data")
    if isinstance(config, dict):
        return _settings(config, "the run's data.columns and data.tags")
    if isinstance(recorded, dict):
        return _settings(recorded, f"the run's data.columns and data.tags as its {META} records them")
    return DataSettings()


def _settings(data: dict, origin: str) -> DataSettings:
    separator = data.get("input_separator")
    return DataSettings(format=data.get("format") if data.get("format") in FORMATS else "auto",
                        columns=SftColumns(**_changed(data.get("columns"), SftColumns())),
                        tags=SftTags(**_changed(data.get("tags"), SftTags())),
                        input_separator=separator if isinstance(separator, str) and separator else INPUT_SEPARATOR,
                        origin=origin)


def _changed(raw: object, default: SftColumns | SftTags) -> dict[str, str]:
    if not isinstance(raw, dict):
        return {}
    return {key: value for key, value in raw.items()
            if key in type(default).model_fields and isinstance(value, str) and value != getattr(default, key)}


def row_prompts(rows: pd.DataFrame, artifact: Artifact, path: Path) -> RowPrompts:
    """Every row's prompt, or one UserError naming the file's columns and the formats expected, or every bad row."""
    settings = data_settings(artifact)
    names = [str(c) for c in rows.columns]
    records = rows.astype(object).where(rows.notna(), None).to_dict("records")  # a JSONL row's missing key: None
    if SAVED_SPLIT_COLUMNS <= set(names):
        settings = DataSettings(origin="the column names of a run's prepared split (data/<split>.jsonl)")
    columns, tags = settings.columns, settings.tags
    names, records, _ = named_as_configured(names, records, columns)  # `Instruction` read as `instruction`, as training
    records, _ = with_json_turns(names, records, columns)  # turns a CSV file holds as JSON text, as training reads them
    if settings.format == "auto" and gemini.is_gemini(names, records):  # Gemini's tuning rows, as training reads them
        records = gemini.as_messages(records, columns.system)
        names = list(dict.fromkeys(key for row in records for key in row))
    fmt = _format(settings, names, records)
    if fmt is None:
        raise UserError(f"`{path}` has no `text` column and reads as none of the sft formats (columns found: "
                        f"{', '.join(names) or 'none'}). Give each prompt in a `text` column (or name its column "
                        "with --text-column NAME), or rows in an sft data format: "
                        f"alpaca (`{columns.prompt}`, with optional `{columns.query}`, `{columns.system}`, "
                        f"`{columns.history}` and the reference `{columns.response}`), sharegpt (`{columns.messages}`, "
                        f"a list of {tags.role_tag}/{tags.content_tag} turns, with optional `{columns.system}` and "
                        f"`{columns.tools}`) or messages (`messages` of role/content turns, or `prompt` and "
                        f"`completion`). Column names: {settings.origin}.")
    if fmt == "alpaca" and has_parent_chains(names, records):
        records, problems = chain_parents(records, columns, settings.input_separator)
        if problems:
            raise UserError(f"`{path}` {'; it '.join(problems)}.")
    prompts, references, bad = [], [], {}
    for number, record in enumerate(records, start=1):
        row, has_reference = _with_reference(record, fmt, columns, tags)
        found = normalise(row, fmt, columns, tags, path.name, input_separator=settings.input_separator)
        if isinstance(found, str):
            bad.setdefault(found, []).append(number)
            continue
        prompts.append(found.chat(artifact.sft_system_prompt, found.prompt_turns))
        references.append(found.response if has_reference else "")
    if bad:
        raise UserError(f"`{path}` was read as {fmt} rows, and some cannot be prompts: "
                        + "; ".join(f"row{'s' if len(numbers) > 1 else ''} {listed(numbers)}: {reason}"
                                    for reason, numbers in bad.items())
                        + ". Fix those rows or leave them out (a row may end with its user turn, or with the reference "
                        "answer, which is left out of the prompt); nothing was predicted.")
    inside = fmt != "alpaca" and not _trl(fmt, columns, names)
    return RowPrompts(prompts, references if inside else None, _description(path, fmt, names, settings))


def _format(settings: DataSettings, names: list[str], records: list[dict]) -> str | None:
    """The run's data.format where the file has its columns, else the one its columns read as; None: no format fits.
    A prediction file need not hold the reference, so an Alpaca file needs its instruction only."""
    columns = settings.columns
    fmt = settings.format if settings.format != "auto" else None
    if fmt is None or not _has_columns(fmt, columns, names):
        fmt = detect_format(names, records, columns)
    return fmt if fmt is not None and _has_columns(fmt, columns, names) else None


def _has_columns(fmt: str, columns: SftColumns, names: list[str]) -> bool:
    needed = [columns.prompt] if fmt == "alpaca" else required_columns(fmt, columns, names)
    return all(name in names for name in needed)


def _trl(fmt: str, columns: SftColumns, names: list[str]) -> bool:
    """TRL's prompt/completion columns, as the data layer reads them (emotune.data.conversations.normalise)."""
    return fmt == "messages" and columns.messages not in names and "messages" not in names and "prompt" in names


def _with_reference(row: dict, fmt: str, columns: SftColumns, tags: SftTags) -> tuple[dict, bool]:
    """The row with a reference answer the data layer can read (a stand-in where it has none or an empty one), and
    whether it had its own."""
    if fmt == "alpaca" or _trl(fmt, columns, list(row)):
        key = columns.response if fmt == "alpaca" else TRL_COLUMNS[1]
        value = row.get(key)
        if value is None or (isinstance(value, str) and not value.strip()):
            return {**row, key: STAND_IN}, False
        return row, True
    key = columns.messages if columns.messages in row else "messages"
    turns, tags = row.get(key), OPENAI_TAGS if fmt == "messages" else tags
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return row, False  # the data layer names what is wrong with it
    last_side = side_of(turns[-1], tags) if turns else None
    if last_side == "assistant" and turn_text(turns[-1], tags).strip():
        return row, True
    kept = turns[:-1] if last_side == "assistant" else turns  # an empty reference is none
    return {**row, key: [*kept, {tags.role_tag: tags.assistant_tag, tags.content_tag: STAND_IN}]}, False


def _description(path: Path, fmt: str, names: list[str], settings: DataSettings) -> str:
    columns = settings.columns
    if fmt == "alpaca":
        read = [columns.prompt, columns.query, columns.history, columns.system, columns.tools]
        joined = f"; instruction and input joined by {settings.input_separator!r}"
        reference = (f"the reference (`{columns.response}`) is kept beside the reply" if columns.response in names
                     else "the file holds no reference answers")
    else:
        trl = _trl(fmt, columns, names)
        read = [TRL_COLUMNS[0] if trl else messages_column(fmt, columns, names), "messages", columns.system, columns.tools]
        joined = ""
        reference = (f"the reference (`{TRL_COLUMNS[1]}`) is kept beside the reply" if trl
                     else "each conversation's closing answer, the reference, is written as `reference` beside the reply")
    used = ", ".join(f"`{c}`" for c in dict.fromkeys(read) if c in names)
    return (f"`{path.name}` has no `text` column: read as {fmt} rows with {settings.origin} (columns {used}{joined}). "
            "Each prompt is the row's system prompt with its tools (else the run's) and its turns up to the last user "
            f"turn, as training built it; {reference}, not in the prompt.")
