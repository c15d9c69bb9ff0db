"""Where the rows come from: the packaged dataset, a file, a folder of split files, a `save_to_disk`
folder, or a hub dataset whose data files (Parquet, else JSON/JSONL/CSV/TSV) are downloaded once and then
read like a local folder.

The packaged datasets are named `embedded:NAME` (`PACKAGED`); plain `embedded` is the English `emotion` set.

Every source ends as raw splits: one Arrow table per split (`train`, `validation`, `test`, or `all`
when the source is one file to be split) with the configured text and label columns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import pyarrow as pa
from datasets import ClassLabel, Features
from platformdirs import user_cache_dir

from emotune.core.config.data import DataConfig
from emotune.core.errors import UserError
from emotune.core.hub_errors import refused_download
from emotune.data.read import FORMATS, data_suffix, is_data_file, read_table

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"train": ("train", "training"), "validation": ("validation", "val", "valid", "dev", "eval", "evaluation"),
                 "test": ("test", "testing")}
SPLIT_FILE = re.compile(r"^(?P<split>[a-z]+)(?:[-_.].*)?$")  # train.csv, train-00000-of-00001.parquet
# the cache files `datasets` writes (~/.cache/huggingface/datasets/<name>/<config>/<version>/<hash>/): emotion-train.arrow,
# emotion-train-00000-of-00002.arrow
CACHE_FILE = re.compile(r"^.+-(?P<split>[a-z]+)(?:-\d{5}-of-\d{5})?$")
HUB_PREFIXES = ("hf:", "modelscope:")
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}  # never rows
EMBEDDED_LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]
# The labelled datasets shipped in emotune/datasets/, with their label order (the order of reports).
PACKAGED = {"emotion": EMBEDDED_LABELS, "emotion_zh": ["喜悦", "愤怒", "悲伤", "恐惧", "惊讶", "厌恶", "中性"]}
EMBEDDED = "embedded"
DOWNLOAD_DONE = ".emotune-download-complete"


@dataclass
class RawSplit:
    table: pa.Table  # the configured text and label columns, as read
    origin: str  # file(s) the rows came from, for messages
    class_names: list[str] | None = None  # names from a `ClassLabel` feature, if the source has one
    notes: list[str] = field(default_factory=list)  # worth a look, not errors (e.g. CSV fields that span lines)


def embedded_dataset_dir(name: str = "emotion") -> Path:
    return Path(str(resources.files("emotune").joinpath("datasets", name)))


def packaged_name(source: str) -> str | None:
    """The packaged dataset `source` names (`embedded` -> emotion, `embedded:emotion_zh` -> emotion_zh), None when
    it names none; an `embedded:` name that is not packaged is a UserError listing those that are."""
    if source == EMBEDDED:
        return "emotion"
    prefix, sep, name = source.partition(":")
    if not sep or prefix != EMBEDDED:
        return None
    if name not in PACKAGED:
        raise UserError(f"data.source `{source}`: emotune packages no dataset named {name!r}. Use one of "
                        f"{', '.join(f'{EMBEDDED}:{n}' for n in PACKAGED)} (plain `{EMBEDDED}` is {EMBEDDED}:emotion).")
    return name


def packaged_labels(source: str) -> list[str] | None:
    """The label order of the packaged dataset `source` names, None for any other source."""
    name = packaged_name(source)
    return list(PACKAGED[name]) if name else None


def read_source(cfg: DataConfig) -> dict[str, RawSplit]:
    """Read every split the source holds; the key `all` means one unsplit collection."""
    folder = _source_folder(cfg)
    if folder is None:
        path = Path(cfg.source).expanduser()
        return {"all": _read_files([path], cfg)}
    if is_saved_dataset(folder):
        return _read_saved_dataset(folder, cfg)
    out, problems = {}, []
    for split, paths in split_files(folder).items():
        try:
            out[split] = _read_files(paths, cfg)
        except UserError as err:  # report every unreadable split file at once
            problems.append(str(err))
    if problems:
        listed = "\n".join(["The data files have problems:", *(f"  - {p}" for p in problems)])
        raise UserError(problems[0] if len(problems) == 1 else listed)
    return out


def _source_folder(cfg: DataConfig) -> Path | None:
    packaged = packaged_name(cfg.source)
    if packaged:
        return embedded_dataset_dir(packaged)
    if cfg.source.startswith(HUB_PREFIXES):
        return download_hub_dataset(cfg)
    path = Path(cfg.source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return None
    raise UserError(f"data.source `{cfg.source}` does not exist. Give a file, a folder of split files, `embedded` "
                    f"(or {', '.join(f'{EMBEDDED}:{n}' for n in PACKAGED)}), "
                    "or a hub dataset such as hf:dair-ai/emotion or modelscope:AI-ModelScope/emotion.")


def split_files(folder: Path, require_train: bool = True) -> dict[str, list[Path]]:
    """Split name -> data files, found anywhere under `folder`; one folder's set is used, never a mix.
    `require_train=False` accepts a set without train files (a dataset_info entry may name a test split).

    Hub snapshots hold one folder per configuration (dair-ai/emotion: `split/` and `unsplit/`); the
    folder with the most splits wins, so the configuration with train/validation/test is chosen.
    """
    groups: dict[Path, dict[str, list[Path]]] = {}
    loose: dict[Path, list[Path]] = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and is_data_file(p)):
        if file.name.lower() in METADATA_FILES or any(part.startswith(".") for part in file.relative_to(folder).parts):
            continue  # hidden folders: download caches, .git
        split = _split_named(file.stem.lower(), SPLIT_FILE)
        if split is None and data_suffix(file) == ".arrow":
            split = _split_named(file.stem.lower(), CACHE_FILE)
        if split is None:
            loose.setdefault(file.parent, []).append(file)
        else:
            groups.setdefault(file.parent, {}).setdefault(split, []).append(file)
    if groups:
        best = max(groups, key=lambda parent: (len(groups[parent]), -len(parent.parts)))
        found = groups[best]
        if "train" not in found and require_train:
            raise UserError(f"data.source `{folder}` has {', '.join(sorted(found))} files but no train file. Name the "
                            f"files train.*, validation.* (or val./dev.) and test.* with one of the endings {', '.join(FORMATS)}.")
        return {split: found[split] for split in SPLITS if split in found}
    if len(loose) == 1 and len(next(iter(loose.values()))) == 1:
        return {"all": next(iter(loose.values()))}  # a folder with one data file: split it
    raise UserError(f"data.source `{folder}` holds no train file. Name the files train.*, validation.* (or val./dev.) "
                    f"and test.* with one of the endings {', '.join(FORMATS)}, or point data.source at one file.")


def _split_named(stem: str, pattern: re.Pattern) -> str | None:
    match = pattern.match(stem)
    return next((s for s, aliases in SPLIT_ALIASES.items() if match and match["split"] in aliases), None)


def _read_files(paths: list[Path], cfg: DataConfig) -> RawSplit:
    notes: list[str] = []
    tables = [_select_columns(read_table(path, cfg.encoding, cfg.text_column, cfg.label_column, notes), path, cfg, notes)
              for path in paths]
    origin = f"`{paths[0]}`" if len(paths) == 1 else f"`{paths[0]}` (+{len(paths) - 1} more shards)"
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except pa.ArrowException as err:
        raise UserError(f"The shards {origin} have different column types ({err}). Give them the same schema.") from None
    return RawSplit(table=table, origin=origin, class_names=_class_names(table), notes=notes)


def _select_columns(table: pa.Table, path: Path | str, cfg: DataConfig, notes: list[str]) -> pa.Table:
    """The text and label columns as `text` and `label`; a column named in other capitals or with spaces around the
    name (`Text`, `LABEL `, as spreadsheets write headers) is the configured one when no other column matches."""
    text_column, label_column = (column_named(table.column_names, c) for c in (cfg.text_column, cfg.label_column))
    renamed = [f"`{found}` as {wanted}" for found, wanted in ((text_column, cfg.text_column), (label_column, cfg.label_column))
               if found != wanted]
    if renamed:
        notes.append(f"`{path}`: read the column {' and '.join(renamed)} (the names differ in capitals or spaces only).")
    missing = [wanted for wanted, found in ((cfg.text_column, text_column), (cfg.label_column, label_column))
               if found not in table.column_names]
    if missing:
        raise UserError(f"`{path}` has no column {', '.join(repr(m) for m in missing)} (columns found: "
                        f"{', '.join(table.column_names) or 'none'}). " + (_headerless(table.column_names) or
                        "Set data.text_column / data.label_column to the right names."))
    repeated = [c for c in dict.fromkeys((text_column, label_column)) if table.column_names.count(c) > 1]
    if repeated:
        raise UserError(f"`{path}` has {table.column_names.count(repeated[0])} columns named `{repeated[0]}` (columns: "
                        f"{', '.join(table.column_names)}), so it is unclear which one to read. Rename or remove the "
                        "extra one in the header.")
    return table.select([text_column, label_column]).rename_columns(["text", "label"]).replace_schema_metadata(
        _label_metadata(table, label_column))


def column_named(names: list[str], wanted: str) -> str:
    """`wanted`, else the one name equal to it but for capitals and surrounding spaces, else `wanted` (missing)."""
    if wanted in names:
        return wanted
    close = [name for name in names if name.strip().casefold() == wanted.strip().casefold()]
    return close[0] if len(close) == 1 else wanted


def _headerless(names: list[str]) -> str | None:
    """The fix when the first line is no header: Excel's `sep=;` hint line, or a row (AG News', Yelp's and DBpedia's
    CSVs have no header), seen in a name that is a number or a sentence. None when the names look like names."""
    if names and names[0].lower().startswith("sep="):
        return (f"Its first line `{names[0]}` is Excel's delimiter hint, not the header: remove that line, so that "
                "the header comes first.")
    values = [name for name in names if name.strip().lstrip("-").replace(".", "", 1).isdigit() or len(name.split()) > 3]
    if not values:
        return None
    example = {2: "label,text", 3: "label,title,text"}.get(len(names), ",".join(f"col{i + 1}" for i in range(len(names))))
    return (f"The first line looks like a row, not a header ({', '.join(repr(v[:40]) for v in values)}): add a header "
            f"line naming the {len(names)} columns (e.g. `{example}`) and set data.text_column / data.label_column to "
            "the names given.")


def _class_names(table: pa.Table) -> list[str] | None:
    try:
        features = Features.from_arrow_schema(table.schema)
    except Exception:  # metadata written by another tool: no names to learn from it
        return None
    feature = features.get("label")
    return list(feature.names) if isinstance(feature, ClassLabel) else None


def _label_metadata(table: pa.Table, label_column: str) -> dict | None:
    """Keep a `ClassLabel` of the label column (stored in the schema by `datasets`) under its new name."""
    try:
        features = Features.from_arrow_schema(table.schema)
    except Exception:
        return None
    feature = features.get(label_column)
    if not isinstance(feature, ClassLabel):
        return None
    return Features({"label": feature}).arrow_schema.metadata


def is_saved_dataset(folder: Path) -> bool:
    """A folder `datasets`' save_to_disk wrote: a DatasetDict (dataset_dict.json) or one Dataset (state.json)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def saved_splits(folder: Path) -> dict[str, Path]:
    """Split -> the folder of each split a save_to_disk folder holds (`all` for one Dataset); splits of no known name
    are left out, and a folder without a train split is refused."""
    if (folder / "state.json").is_file():
        return {"all": folder}
    try:
        names = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"`{folder}/dataset_dict.json` is not the file save_to_disk writes. Save the dataset again.") from None
    found = {next((s for s, aliases in SPLIT_ALIASES.items() if str(n).lower() in aliases), None): folder / str(n)
             for n in names}
    found.pop(None, None)
    if "train" not in found:
        raise UserError(f"The saved dataset `{folder}` has splits {names} but no train split. Rename one to `train`.")
    return found


def _read_saved_dataset(folder: Path, cfg: DataConfig) -> dict[str, RawSplit]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as err:  # a damaged or foreign folder
        raise UserError(f"`{folder}` looks like a `save_to_disk` folder but could not be loaded "
                        f"({str(err).splitlines()[0][:300] if str(err) else type(err).__name__}). Save it again.") from None
    parts = {"all": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
    out, unused = {}, []
    for name, ds in parts.items():
        split = next((s for s, aliases in SPLIT_ALIASES.items() if name.lower() in aliases), "all" if name == "all" else None)
        if split is None:
            unused.append(name)  # e.g. an `unsupervised` split
            continue
        table = ds.flatten_indices().data.table if ds._indices is not None else ds.data.table
        notes: list[str] = []
        selected = _select_columns(table, f"{folder} [{name}]", cfg, notes)
        label = ds.features.get(column_named(list(ds.column_names), cfg.label_column))
        names = list(label.names) if isinstance(label, ClassLabel) else None
        out[split] = RawSplit(table=selected, origin=f"`{folder}` [{name}]", class_names=names, notes=notes)
    if "train" not in out and "all" not in out:
        raise UserError(f"The saved dataset `{folder}` has splits {list(parts)} but no train split. Rename one to `train`.")
    if unused:  # said, not silently left out
        next(iter(out.values())).notes.append(f"`{folder}`: split(s) {', '.join(map(repr, unused))} are not train, "
                                              "validation or test by any name emotune knows; they are not used.")
    return out


# --------------------------------------------------------------------------------------------------
# Hub datasets: the data files are downloaded once, then read like any local folder. From the Hugging Face
# hub the Parquet files only when the repository has them (the hub's own format; a repository may hold the
# same rows in two formats), else its JSON/JSONL/CSV/TSV files (many instruction datasets are one JSON file).

HF_PARQUET = ["*.parquet", "*.md"]
HF_OTHER_FORMATS = ["*.jsonl", "*.json", "*.csv", "*.tsv", "*.jsonl.gz", "*.json.gz", "*.csv.gz", "*.tsv.gz", "*.md"]


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path(user_cache_dir("emotune")) / "datasets"


def download_hub_dataset(cfg: DataConfig) -> Path:
    hub, _, repo_id = cfg.source.partition(":")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"data.source `{cfg.source}`: a hub dataset is written {hub}:owner/name, e.g. "
                        "hf:dair-ai/emotion or modelscope:AI-ModelScope/emotion.")
    if hub == "hf":  # refused before "Downloading ..." and a download command that would fail as well
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            raise UserError(f"data.source `{cfg.source}`: `{repo_id}` is not a dataset name the Hugging Face hub "
                            "accepts (OWNER/NAME of ASCII letters, digits, `-`, `_` and `.`, not starting or ending "
                            "with `-` or `.`, without `--` or `..`, at most 96 characters each). Fix data.source, e.g. "
                            "hf:dair-ai/emotion, or give a local folder.") from None
    local = cache_dir(cfg) / hub / (repo_id.replace("/", "--") + (f"@{cfg.revision}" if cfg.revision else ""))
    if (local / DOWNLOAD_DONE).is_file():
        return local
    folder = f"data/{repo_id.split('/')[-1]}"
    how = (f"Or download it where the hub is reachable (`hf download {repo_id} --repo-type dataset --local-dir {folder}`"
           if hub == "hf" else
           f"Or download it where ModelScope is reachable (`modelscope download --dataset {repo_id} --local_dir {folder}`")
    how += ", then copy the folder here) and set data.source to that folder."
    print(f"Downloading the {hub} dataset {repo_id} into {local} (once) ...", flush=True)
    try:
        if hub == "modelscope":
            _modelscope_download(repo_id, cfg.revision, local)
        else:
            from huggingface_hub import snapshot_download

            for patterns in (HF_PARQUET, HF_OTHER_FORMATS):
                snapshot_download(repo_id, repo_type="dataset", revision=cfg.revision, local_dir=str(local),
                                  allow_patterns=patterns)
                if _data_files(local):
                    break
    except UserError as err:
        raise UserError(f"{err} {how}") from None
    except Exception as err:  # offline, auth, not found: all end the same way for the user
        detail = str(err).strip().splitlines()[0][:300] if str(err).strip() else "no details"
        refused = refused_download(err, hub, repo_id, "data.source", cfg.revision)
        raise UserError(f"data.source `{cfg.source}`: could not download from the {hub} hub ({type(err).__name__}: "
                        f"{detail}). {refused or 'Check the name and the network.'} {how}") from None
    if not _data_files(local):
        raise UserError(f"data.source `{cfg.source}`: the download holds no data files ({', '.join(FORMATS)}; looked "
                        f"in {local}). Check the dataset name. {how}")
    (local / DOWNLOAD_DONE).write_text(cfg.source + "\n")
    return local


def _data_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and is_data_file(p)
            and p.name.lower() not in METADATA_FILES and not any(part.startswith(".") for part in p.relative_to(folder).parts)]


def _modelscope_download(repo_id: str, revision: str | None, local: Path) -> None:
    try:
        from modelscope import dataset_snapshot_download
    except ImportError:
        raise UserError(f"data.source `modelscope:{repo_id}` needs the `modelscope` package "
                        "(`pip install modelscope`, or `pip install emotune[modelscope]`).") from None
    kwargs = {"revision": revision} if revision else {}
    dataset_snapshot_download(repo_id, local_dir=str(local), **kwargs)
