"""The sft task's data: read → normalise → validate → clean → split → limit, all before anything is written.

Sources are those of the classification data (the packaged dataset, a file, a folder of split files, a
hub snapshot; the same readers), plus a folder holding LLaMA-Factory's dataset_info.json. Rows become
`Conversation`s (emotune.data.conversations); malformed rows are reported all at once with their row
numbers, or skipped and counted with data.skip_bad_rows=true. Duplicate and leakage checks compare whole
conversations (system prompt and every turn). A held-out split is stratified by dataset and kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa

from emotune.core.config.data import CleaningConfig
from emotune.core.config.sft import SftCleaningConfig, SftDataConfig
from emotune.core.errors import UserError, listed, raise_problems, read_from
from emotune.data import clean, gemini
from emotune.data import splits as split_ops
from emotune.data.conversations import (
    NO_ANSWER,
    TRL_COLUMNS,
    Conversation,
    chain_parents,
    detect_format,
    format_columns,
    has_parent_chains,
    named_as_configured,
    normalise,
    required_columns,
    with_json_turns,
)
from emotune.data.dataset_info import Entry, has_dataset_info, read_entries
from emotune.data.read import read_records
from emotune.data.sources import HUB_PREFIXES, SPLITS, download_hub_dataset, is_saved_dataset, saved_splits, split_files


@dataclass
class ConversationData:
    splits: dict[str, list[Conversation]]  # train / validation / test
    source: str
    report: dict = field(default_factory=dict)

    def kinds(self) -> list[str]:
        return sorted({c.kind for rows in self.splits.values() for c in rows if c.kind})


def embedded_instruct_dir() -> Path:
    return Path(str(resources.files("emotune").joinpath("datasets", "instruct")))


def load_conversations(cfg: SftDataConfig, seed: int) -> ConversationData:
    """Every split as validated, cleaned Conversations, or one UserError listing every problem."""
    entries = _entries(cfg)
    problems: list[str] = []
    skipped: dict[str, int] = {}
    pools: dict[str, list[Conversation]] = {}
    for split, entry in entries:
        rows = _read_entry(entry, cfg, seed, problems, skipped)
        pools.setdefault(split, []).extend(rows)
    raise_problems("The data", problems, "Fix those rows, or set data.skip_bad_rows=true to skip them (counted)."
                   if any("` rows " in p for p in problems) else "")
    for what, count in skipped.items():
        print(f"Note: skipped {count} malformed rows of {what} (data.skip_bad_rows=true).", flush=True)
    report: dict = {"source": cfg.source, "datasets": sorted({e.name for _, e in entries}),
                    "rows_read": {s: len(r) for s, r in pools.items()}, "skipped_bad_rows": skipped}
    pools, report["cleaning"] = _clean(pools, cfg)
    pools, report["split"] = _split(pools, cfg, seed)
    pools, report["cleaning"]["leakage"] = _remove_leakage(pools, cfg.cleaning.leakage)
    empty = [s for s in SPLITS if not pools[s]]
    raise_problems("The data", [f"the {s} split is empty after cleaning; give it rows, or switch off the step that "
                                "removed them (data.cleaning.leakage=keep, data.cleaning.duplicates=keep)" for s in empty])
    limits = {"train": cfg.train_limit, "validation": cfg.validation_limit, "test": cfg.test_limit}
    pools = {s: _limit(pools[s], limits[s], seed) for s in SPLITS}
    report["rows"] = {s: len(pools[s]) for s in SPLITS}
    return ConversationData(pools, cfg.source, report)


# --------------------------------------------------------------------------------------------------
# Sources: (split, entry) pairs; `all` is a pool still to be split


def _entries(cfg: SftDataConfig) -> list[tuple[str, Entry]]:
    from emotune.core.config.sft import SftColumns, SftTags

    def plain(name: str, files: list[Path]) -> Entry:
        return Entry(name, files, cfg.format, cfg.columns, cfg.tags)

    if cfg.source == "embedded":
        folder = embedded_instruct_dir()
        return [(s, Entry("embedded", [folder / f"{s}.jsonl"], "alpaca", SftColumns(), SftTags())) for s in SPLITS]
    folder = download_hub_dataset(cfg) if cfg.source.startswith(HUB_PREFIXES) else Path(cfg.source).expanduser()
    if folder.is_file():
        return [("all", plain(folder.name, [folder]))]
    if not folder.is_dir():
        raise UserError(f"data.source `{cfg.source}` does not exist{read_from(cfg.source)}. Give a JSON/JSONL/Parquet "
                        "file, a folder of split files, a folder with LLaMA-Factory's dataset_info.json, `embedded`, or a "
                        "hub dataset (hf:owner/name).")
    if is_saved_dataset(folder):  # before dataset_info.json: save_to_disk writes a file of that name too
        return [(split, plain(f"{split} ({folder.name})", [path])) for split, path in saved_splits(folder).items()]
    if has_dataset_info(folder):
        return _named_entries(folder, cfg)
    if cfg.datasets or cfg.eval_datasets:
        raise UserError(f"data.datasets names datasets, but `{folder}` has no dataset_info.json to find them in. Point "
                        "data.source at the folder that holds dataset_info.json, or set data.datasets=null.")
    return [(split, plain(f"{split} ({folder.name})", files)) for split, files in split_files(folder).items()]


def _named_entries(folder: Path, cfg: SftDataConfig) -> list[tuple[str, Entry]]:
    if not cfg.datasets:
        raise UserError(f"`{folder}` holds a dataset_info.json: name the datasets to train on, e.g. "
                        "data.datasets=[alpaca_en_demo] (several are mixed).")
    problems: list[str] = []
    train = read_entries(folder, cfg.datasets, cfg, problems)
    test = read_entries(folder, cfg.eval_datasets or [], cfg, problems, key="data.eval_datasets")
    raise_problems("The data", problems)
    return [("all" if not test else "train", e) for e in train] + [("test", e) for e in test]


def _read_entry(entry: Entry, cfg: SftDataConfig, seed: int, problems: list[str], skipped: dict[str, int]
                ) -> list[Conversation]:
    """One dataset's rows as Conversations (max_samples, then num_samples); bad rows go to `problems` or are skipped."""
    out: list[Conversation] = []
    for path in entry.files:
        found = _file_rows(path, entry, cfg)
        if isinstance(found, str):
            problems.append(found)
            continue
        column_names, rows = found
        fmt = entry.formatting if entry.formatting != "auto" else detect_format(column_names, rows, entry.columns)
        problem = _format_problem(path, fmt, column_names, entry)
        if problem:
            problems.append(problem)
            continue
        if fmt == "alpaca" and has_parent_chains(column_names, rows):
            rows, chain_problems = chain_parents(rows, entry.columns, cfg.input_separator)
            if chain_problems:
                problems += [f"`{path}` {problem}" for problem in chain_problems]
                continue
            print(f"Note: `{path}`: rows are chained by parent_id (H2O LLM Studio's conversations); each row is trained "
                  "with the turns of its parent rows before it, as its history (prompt.mask_history=true trains only "
                  "its own answer).", flush=True)
        bad: dict[str, list[int]] = {}
        for number, row in enumerate(rows, start=1):
            found = normalise(row, fmt, entry.columns, entry.tags, entry.name, input_separator=cfg.input_separator)
            if isinstance(found, str):
                bad.setdefault(found, []).append(number)
            else:
                out.append(found)
        prompts_only = _prompts_only_problem(path, column_names, bad, len(rows), entry)
        if prompts_only:
            problems.append(prompts_only)
            continue
        if bad and cfg.skip_bad_rows:
            skipped[f"`{path}`"] = sum(len(v) for v in bad.values())
        else:
            problems += [f"`{path}` rows {listed(numbers)}: {reason}" for reason, numbers in bad.items()]
    if cfg.max_samples is not None:
        out = out[:cfg.max_samples]
    return _resample(out, entry.num_samples, seed)


def _file_rows(path: Path, entry: Entry, cfg: SftDataConfig) -> tuple[list[str], list[dict]] | str:
    """One file's column names and rows, read as the other tools that write them mean them (notes say how), or why the
    file as a whole is no sft data."""
    try:
        notes: list[str] = []
        column_names, rows = read_records(path, cfg.encoding, entry.columns.prompt, entry.columns.response, notes)
    except UserError as err:
        return str(err).rstrip(".")
    for note in notes:  # how the file was read where it could be read two ways (a `;`-separated .csv)
        print(f"Note: {note}", flush=True)
    if not rows:
        return f"`{path}` holds no rows; give it conversations, or remove it"
    repeated = _repeated_columns(column_names, entry)
    if repeated:
        return (f"`{path}` has {column_names.count(repeated)} columns named `{repeated}` (columns: "
                f"{', '.join(column_names)}), so it is unclear which one to read; rename or remove the extra one in "
                "the header")
    column_names, rows, renamed = named_as_configured(column_names, rows, entry.columns)
    if renamed:
        print(f"Note: `{path}`: " + ", ".join(f"`{a}` read as `{b}`" for a, b in renamed.items())
              + " (the same names but for capitals and spaces).", flush=True)
    if entry.formatting == "auto" and gemini.is_gemini(column_names, rows):
        rows = gemini.as_messages(rows, entry.columns.system)
        column_names = list(dict.fromkeys(key for row in rows for key in row))
        print(f"Note: `{path}`: read as Google's Gemini tuning rows (`contents` of user and model turns, "
              "`systemInstruction` as the system prompt).", flush=True)
    rows, decoded = with_json_turns(column_names, rows, entry.columns)
    if decoded:
        print(f"Note: `{path}`: " + ", ".join(f"`{n}`" for n in decoded) + " read from JSON text (as CSV files "
              "store lists).", flush=True)
    return _preference_problem(path, column_names, rows, entry.kto_tag) or (column_names, rows)


def _format_problem(path: Path, fmt: str | None, column_names: list[str], entry: Entry) -> str | None:
    """Why a file's columns fit no format the sft task reads (each kind of file that is no sft data named), or lack
    the format's own; None when they fit."""
    plain = column_names == ["text"] and entry.columns.response not in column_names
    if (fmt is None or plain) and "text" in column_names:
        return (f"`{path}` has a `text` column and no prompt or answer (columns found: "
                f"{', '.join(column_names)}): plain text for language modelling (TRL's text datasets, "
                "LLaMA-Factory's stage pt), which the sft task cannot split into a prompt and an answer. Give "
                "conversations (messages, prompt/completion or instruction/output columns)")
    if fmt is None and "segments" in column_names:
        return (f"`{path}` has a `segments` column: Axolotl's template-free input_output format (texts "
                "written with their own chat markup, each marked trained or not), which emotune cannot read "
                "as turns, as it renders every conversation with the model's chat template. Give the rows "
                "as messages ({\"messages\": [{\"role\": \"user\", ...}, {\"role\": \"assistant\", ...}]}) "
                "without the markup")
    if fmt is None and TRL_COLUMNS[0] in column_names:
        others = [n for n in column_names if n != TRL_COLUMNS[0]]
        return (f"`{path}` has a `prompt` column and no answers (no `completion` column; columns found: "
                f"{', '.join(column_names)}): TRL's prompt-only format, for GRPO, PPO or online DPO, which "
                "generate the answers; the sft task trains on written ones. Add each answer in a `completion` "
                "column" + (f", or name the column that holds it (e.g. data.columns.prompt=prompt "
                            f"data.columns.response={others[0]})" if others else ""))
    if fmt is None:
        return (f"`{path}` is in none of the formats alpaca (instruction/output columns), sharegpt "
                f"(conversations) or messages (messages, or prompt/completion; columns found: "
                f"{', '.join(column_names)}); set data.format and data.columns to match it")
    missing = [c for c in required_columns(fmt, entry.columns, column_names) if c not in column_names]
    if missing:
        return (f"`{path}` ({fmt} format) has no column {', '.join(map(repr, missing))} (columns found: "
                f"{', '.join(column_names)}); set data.columns (or the entry's `columns`) to its names")
    return None


def _repeated_columns(column_names: list[str], entry: Entry) -> str | None:
    """A column the formats read that the file's header names twice (CSV, TSV): its rows would keep the last one."""
    read = format_columns(entry.columns)
    return next((name for name in column_names if name in read and column_names.count(name) > 1), None)


def _preference_problem(path: Path, column_names: list[str], rows: list[dict], kto_tag: str | None = None) -> str | None:
    """Why a file of preference data (good and bad answers, for DPO/ORPO/KTO-style training) is no sft data; None when
    it is not one. `kto_tag`: the column a dataset_info.json entry names as its KTO tags."""
    names = set(column_names)
    for good, bad, kind in (("chosen", "rejected", "a preference dataset"),
                            ("preferred_output", "non_preferred_output", "OpenAI's preference (DPO) fine-tuning data")):
        if {good, bad} <= names:
            return (f"`{path}` is {kind} (columns `{good}` and `{bad}`), for DPO/ORPO-style training; the sft task "
                    f"trains on one answer per prompt. Give an SFT dataset, or keep only the {good} answers as its response")
    for tag in dict.fromkeys((kto_tag, "label", "kto_tag")):
        tags = [row.get(tag) for row in rows] if tag in names else []
        if not any(isinstance(value, bool) for value in tags):
            continue
        undesirable = sum(value is False for value in tags)
        what = ("TRL's KTO format: `prompt`, `completion` and a true/false `label`" if tag == "label" and
                {"prompt", "completion"} <= names else f"KTO data: a true/false `{tag}` column"
                + (" (the dataset_info.json entry's kto_tag)" if tag == kto_tag else ""))
        return (f"`{path}` is an unpaired preference dataset ({what}, saying whether each answer is a good one; "
                f"{undesirable} of its {len(rows)} rows are tagged false); the sft task would train on the bad answers "
                f"too (LLaMA-Factory's sft stage drops every tagged row). Keep the rows whose {tag} is true and remove "
                f"the `{tag}` column" + (", and the kto_tag from the entry's columns" if tag == kto_tag else ""))
    return None


def _prompts_only_problem(path: Path, column_names: list[str], bad: dict[str, list[int]], rows: int, entry: Entry
                          ) -> str | None:
    """Why a file whose every row ends with the user's turn and has fields beside its conversation is no sft data:
    OpenAI's reinforcement fine-tuning (RFT) files, whose other fields (`reference_answer`, ...) go to a grader; None
    when it is not one."""
    if list(bad) != [NO_ANSWER] or len(bad[NO_ANSWER]) != rows:
        return None
    columns = entry.columns
    own = {"messages", "functions", "parallel_tool_calls", columns.messages, columns.system, columns.tools, columns.kind}
    graded = [name for name in column_names if name not in own]
    if not graded:
        return None
    return (f"`{path}` holds prompts without answers: every row's conversation ends with a user turn, and its other "
            f"fields ({', '.join(f'`{n}`' for n in graded[:4])}) are for a grader, as in OpenAI's reinforcement "
            "fine-tuning (RFT) data. The sft task trains on written answers: give each row its answer as a last "
            "assistant turn (e.g. the reference answer, where it is the whole answer), or give an SFT dataset")


def _resample(rows: list[Conversation], num_samples: int | None, seed: int) -> list[Conversation]:
    """LLaMA-Factory's num_samples: a seeded sample without replacement, or every row repeated plus a sample."""
    if not num_samples or not rows or num_samples == len(rows):
        return rows
    rng = np.random.default_rng(seed)
    index = rng.permutation(len(rows))[:num_samples % len(rows)]
    whole = list(range(len(rows))) * (num_samples // len(rows))
    return [rows[i] for i in whole + sorted(index.tolist())]


# --------------------------------------------------------------------------------------------------
# Cleaning, splitting, leakage, limits


CLEANED_ROLES = ("user", "assistant")
"""The turns cleaning rewrites: every user turn (tool results too) and every answer (tool calls too). The system prompt
and the tools after it are left as written."""


def turn_cleaning(cfg: SftCleaningConfig) -> CleaningConfig:
    """The text steps every turn of a conversation goes through: data.cleaning's NFC and control characters, whitespace
    as written (line breaks carry meaning in answers such as lists, JSON or code). An sft adapter's emotune.json
    records them (`cleaning`), for predict and serve to read their prompts as training read its rows."""
    return CleaningConfig(unicode_nfc=cfg.unicode_nfc, control_chars=cfg.control_chars, whitespace=False)


def clean_chats_for_inference(chats: list[list[dict]], recorded: dict | None) -> list[list[dict]]:
    """Chats (`{"role", "content"}` messages) sent to an sft model (predict, serve, the studio), each user and assistant
    turn's text rewritten by the steps its training rows went through (emotune.json's `cleaning`, `turn_cleaning`), as
    `_clean` rewrote those rows' turns; system turns as sent, as training left the system prompt. None (an adapter
    recorded before this, or another tool's): as sent."""
    if not recorded:
        return chats
    where = [(i, j) for i, chat in enumerate(chats) for j, turn in enumerate(chat)
             if turn.get("role") in CLEANED_ROLES and isinstance(turn.get("content"), str)]
    cleaned = iter(clean.clean_for_inference([chats[i][j]["content"] for i, j in where], recorded))
    out = [list(chat) for chat in chats]
    for i, j in where:
        out[i][j] = {**out[i][j], "content": next(cleaned)}
    return out


def _clean(pools: dict[str, list[Conversation]], cfg: SftDataConfig) -> tuple[dict[str, list[Conversation]], dict]:
    """Text steps on every turn (`turn_cleaning`), then duplicates inside each split (on the whole conversation)."""
    steps = turn_cleaning(cfg.cleaning)
    report: dict = {"changed_turns": {}, "duplicates": {}}
    out = {}
    for split, rows in pools.items():
        texts = [text for c in rows for _, text in c.messages]
        cleaned, changed = clean.clean_text(pa.array(texts, pa.string()), steps) if texts else ([], {})
        report["changed_turns"][split] = sum(changed.values()) if changed else 0
        values = iter(cleaned.to_pylist() if texts else [])
        rows = [replace(c, messages=tuple((role, next(values)) for role, _ in c.messages)) for c in rows]
        if cfg.cleaning.duplicates != "keep" and rows:
            firsts = clean.first_occurrences(_hashes(rows, cfg.cleaning.duplicates))
            report["duplicates"][split] = len(rows) - len(firsts)
            rows = [rows[i] for i in firsts]
        out[split] = rows
    return out, report


def _hashes(rows: list[Conversation], how: str) -> np.ndarray:
    return clean.key_hashes(pa.array([c.key() for c in rows], pa.string()), how)


def _strata(rows: list[Conversation]) -> pa.Table:
    """Row index and stratum (dataset and kind), in the shape the classification splitters take."""
    return pa.table({"label": [f"{c.source}|{c.kind or ''}" for c in rows], "index": list(range(len(rows)))})


def _take(rows: list[Conversation], table: pa.Table) -> list[Conversation]:
    return [rows[i] for i in table.column("index").to_pylist()]


def _split(pools: dict[str, list[Conversation]], cfg: SftDataConfig, seed: int) -> tuple[dict[str, list[Conversation]], str]:
    if "all" in pools:
        rows = pools.pop("all")
        if "test" in pools:  # eval_datasets given: train and validation from the pool
            pools["train"] = rows
        else:
            parts = split_ops.stratified_split(_strata(rows), cfg.validation_size, cfg.test_size, seed)
            return {s: _take(rows, parts[s]) for s in SPLITS}, f"stratified by dataset and kind, seed {seed}"
    carved = [s for s in SPLITS if s not in pools]
    train = pools["train"]
    tables = {s: _strata(r) for s, r in pools.items()}
    parts = split_ops.carve_missing(tables, cfg.validation_size, cfg.test_size, seed)
    out = {s: pools[s] if s in pools and s != "train" else _take(train, parts[s]) for s in SPLITS}
    return out, "as given" + (f"; {' and '.join(carved)} held out of train (stratified, seed {seed})" if carved else "")


def _remove_leakage(pools: dict[str, list[Conversation]], how: str) -> tuple[dict[str, list[Conversation]], dict]:
    if how == "keep" or not pools["train"]:
        return pools, {}
    seen = _hashes(pools["train"], how)
    out, removed = dict(pools), {}
    for split in ("validation", "test"):
        if not pools[split]:
            continue
        leaked = clean.occurs_in(_hashes(pools[split], how), seen)
        out[split] = [c for c, bad in zip(pools[split], leaked, strict=False) if not bad]
        removed[split] = int(leaked.sum())
    return out, removed


def _limit(rows: list[Conversation], limit: int | None, seed: int) -> list[Conversation]:
    return rows if limit is None or limit >= len(rows) else _take(rows, split_ops.limit(_strata(rows), limit, seed))
