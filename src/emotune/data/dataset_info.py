"""LLaMA-Factory's `dataset_info.json`: named datasets in a folder, each with its file (or hub id), format,
column and tag names, and sample count.

    {"my_data": {"file_name": "my_data.json", "formatting": "sharegpt",
                 "columns": {"messages": "conversations"}, "tags": {"role_tag": "from", ...},
                 "num_samples": 500},
     "hub_data": {"hf_hub_url": "owner/name", "split": "train", "subset": "en"}}

Point data.source at the folder and name the entries in data.datasets (and data.eval_datasets for the
test split). Hub entries are downloaded like every other hub source (emotune.data.sources); their `folder`
and `subset` name a folder of the repository, where LLaMA-Factory's `load_dataset` takes a configuration by
that name (the Hugging Face hub's Parquet conversion keeps each configuration in its own folder). Preference
(`ranking`, and KTO's `kto_tag` when the rows are read) and multimodal entries are refused: the sft task trains on one
text answer per prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from emotune.core.config.sft import SftColumns, SftDataConfig, SftTags
from emotune.core.errors import UserError

INFO_FILE = "dataset_info.json"
REFUSED_COLUMNS = ("images", "videos", "audios", "chosen", "rejected")


@dataclass
class Entry:
    """One dataset to read: its files, format and names."""
    name: str
    files: list[Path]
    formatting: str  # alpaca | sharegpt | messages (an `openai` entry without tags: OpenAI's role names, as emotune reads them)
    columns: SftColumns
    tags: SftTags
    num_samples: int | None = None
    kto_tag: str | None = None
    """The column of KTO's true/false tags (the entry's `columns.kto_tag`): its rows are refused when read, as their
    answers tagged false are ones not to give (conversation_data._preference_problem)."""


def has_dataset_info(folder: Path) -> bool:
    """LLaMA-Factory's dataset_info.json, not the file of that name `datasets` writes beside its cache files (one
    dataset's description: its `builder_name`, `features` and `splits`)."""
    path = folder / INFO_FILE
    if not path.is_file():
        return False
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return True  # read_entries says what is wrong with it
    return not (isinstance(info, dict) and {"builder_name", "features", "splits"} <= set(info))


def read_entries(folder: Path, names: list[str], cfg: SftDataConfig, problems: list[str],
                 key: str = "data.datasets") -> list[Entry]:
    """The named entries of `folder/dataset_info.json`, resolved to local files; problems are appended, naming `key`,
    the config key that names them (data.datasets, or data.eval_datasets)."""
    path = folder / INFO_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as err:
        raise UserError(f"`{path}` is not readable JSON ({err}). Fix the file.") from None
    if not isinstance(info, dict):
        raise UserError(f"`{path}` must hold an object of named datasets, as LLaMA-Factory's does.")
    entries = []
    for name in names:
        if name not in info:
            problems.append(f"{key} names `{name}`, which `{path}` does not define (it defines: "
                            f"{', '.join(info) or 'nothing'})")
            continue
        entry = _entry(name, info[name], folder, cfg, problems)
        if entry is not None:
            entries.append(entry)
    return entries


def _entry(name: str, raw: dict, folder: Path, cfg: SftDataConfig, problems: list[str]) -> Entry | None:
    where = f"dataset_info.json entry `{name}`"
    if not isinstance(raw, dict):
        problems.append(f"{where} is not an object")
        return None
    if raw.get("ranking"):
        problems.append(f"{where} is a ranking (preference) dataset, for DPO/ORPO-style training; the sft task trains "
                        "on one answer per prompt. Name an SFT dataset instead, or register its chosen answers as an "
                        "alpaca/sharegpt dataset")
        return None
    wrong = _wrong_types(raw)
    if wrong:
        problems.append(f"{where}: {'; '.join(wrong)} (as LLaMA-Factory's dataset_info.json writes them)")
        return None
    columns = raw.get("columns") or {}
    refused = [c for c in REFUSED_COLUMNS if columns.get(c)]
    if refused:
        problems.append(f"{where} has {', '.join(refused)} columns, which the sft task does not train on (text "
                        "conversations only); remove them from the entry's columns or name another dataset")
        return None
    formatting = raw.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt", "openai"):
        problems.append(f"{where} has formatting {formatting!r}; LLaMA-Factory's formats are alpaca, sharegpt and openai")
        return None
    try:
        names = SftColumns(**{k: v for k, v in columns.items() if k in SftColumns.model_fields and v})
        tags = SftTags(**{k: v for k, v in (raw.get("tags") or {}).items() if k in SftTags.model_fields and v})
    except Exception as err:  # a tag that is not a string
        problems.append(f"{where} has invalid columns/tags ({str(err).splitlines()[0]})")
        return None
    files = _files(name, raw, folder, cfg, problems)
    if files is None:
        return None
    kto_tag = columns.get("kto_tag")
    if formatting == "openai":  # LLaMA-Factory's OpenAI-style messages: by the entry's tags where it gives them
        formatting = "sharegpt" if raw.get("tags") else "messages"
    return Entry(name, files, formatting, names, tags, raw.get("num_samples"), kto_tag if isinstance(kto_tag, str) else None)


def _wrong_types(raw: dict) -> list[str]:
    """The entry's keys whose values have a type LLaMA-Factory's loader would not take, each with the type it takes."""
    wrong = [f"`{key}` must be {what}, not {type(raw[key]).__name__} {raw[key]!r:.60}"
             for key, kind, what in (("file_name", str, "a file or folder name"), ("formatting", str, "alpaca, sharegpt or openai"),
                                     ("columns", dict, "an object of column names"), ("tags", dict, "an object of tags"))
             if raw.get(key) is not None and not isinstance(raw[key], kind)]
    samples = raw.get("num_samples")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        wrong.append(f"`num_samples` must be a whole number of rows >= 1, not {samples!r:.60}")
    return wrong


def _files(name: str, raw: dict, folder: Path, cfg: SftDataConfig, problems: list[str]) -> list[Path] | None:
    from emotune.data.read import is_data_file
    from emotune.data.sources import download_hub_dataset, split_files

    where = f"dataset_info.json entry `{name}`"
    if raw.get("file_name"):
        path = folder / raw["file_name"]
        if path.is_dir():
            return sorted(p for p in path.rglob("*") if p.is_file() and is_data_file(p))
        if not path.is_file():
            problems.append(f"{where}: file `{path}` does not exist")
            return None
        return [path]
    hub = ("hf", raw["hf_hub_url"]) if raw.get("hf_hub_url") else ("modelscope", raw["ms_hub_url"]) if raw.get("ms_hub_url") else None
    if hub is None:
        problems.append(f"{where} has neither file_name nor hf_hub_url / ms_hub_url (script_url and cloud files are "
                        "not supported); download the data and give its file_name")
        return None
    source = SimpleNamespace(source=f"{hub[0]}:{hub[1]}", revision=raw.get("revision") or cfg.revision,
                             cache_dir=cfg.cache_dir)
    try:
        snapshot = download_hub_dataset(source)
    except UserError as err:  # the entry is what the user named; the hub source is emotune's spelling of its url
        local = hub[1].split("/")[-1]
        raise UserError(f"{where} ({'hf_hub_url' if hub[0] == 'hf' else 'ms_hub_url'}: {hub[1]}): {err} For this entry: "
                        f"put the downloaded folder in `{folder}` as `{local}` and give the entry \"file_name\": "
                        f"\"{local}\" in place of its hub url.") from None
    for key in ("folder", "subset"):  # LLaMA-Factory's data_dir and configuration name: folders of the repository
        if raw.get(key):
            inner = snapshot / str(raw[key])
            if not inner.is_dir():
                found = sorted(p.name for p in snapshot.iterdir() if p.is_dir() and not p.name.startswith("."))
                problems.append(f"{where}: the hub dataset {hub[1]} has no folder `{raw[key]}` (its `{key}`); "
                                f"folders found: {', '.join(found) or 'none'}")
                return None
            snapshot = inner
    found = split_files(snapshot, require_train=False)
    split = raw.get("split", "train")
    if split not in found and not (split == "train" and "all" in found):
        problems.append(f"{where}: the hub dataset {hub[1]} has no `{split}` split (found: {', '.join(found)})")
        return None
    return found.get(split) or found["all"]
