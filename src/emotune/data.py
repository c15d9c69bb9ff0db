"""Labelled data: load → validate → split → limit → format as prompt-completion chat rows.

Every split comes out as a `datasets.Dataset` with two string columns, `text` and `label`; the
label set is fixed here once and shared by the prompt, training and both evaluations.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import datasets
from datasets import ClassLabel, Dataset
from sklearn.model_selection import train_test_split

from emotune.config import DataConfig, PromptConfig
from emotune.errors import UserError

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "val", "valid", "dev"), "test": ("test",)}
FORMATS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
EMBEDDED_LABELS = ["sadness", "joy", "love", "anger", "fear", "surprise"]


@dataclass
class LabeledData:
    splits: dict[str, Dataset]
    labels: list[str]
    source: str

    def counts(self) -> dict[str, dict[str, int]]:
        return {name: {label: ds["label"].count(label) for label in self.labels} for name, ds in self.splits.items()}


def embedded_dataset_dir() -> Path:
    return Path(str(resources.files("emotune").joinpath("datasets", "emotion")))


def load_data(cfg: DataConfig, seed: int) -> LabeledData:
    """Load and validate every split; raise one UserError naming the file, column and fix."""
    if cfg.source == "embedded":
        files = _split_files(embedded_dataset_dir())
        label_names = cfg.label_names or EMBEDDED_LABELS
    else:
        path = Path(cfg.source).expanduser()
        if path.is_dir():
            files = _split_files(path)
            if "train" not in files:
                raise UserError(f"data.source `{path}` has no train file. Name the files train.*, validation.* "
                                f"(or val./dev.) and test.* with one of the endings {', '.join(FORMATS)}.")
        elif path.is_file():
            files = {"all": path}
        else:
            raise UserError(f"data.source `{cfg.source}` does not exist. Give a file, a folder of split files, or `embedded`.")
        label_names = cfg.label_names

    raw = {split: _read_file(file, cfg) for split, file in files.items()}
    label_names = label_names or _names_from_features(raw) or sorted({str(v).strip() for ds in raw.values() for v in ds["label"]})
    raw = {split: _labels_to_names(ds, label_names, files[split], cfg) for split, ds in raw.items()}

    if "all" in raw:
        splits = _stratified_split(raw.pop("all"), cfg, seed)
    else:
        splits = dict(raw)
        if "test" not in splits or "validation" not in splits:
            splits.update(_carve_missing(splits, cfg, seed))

    limits = {"train": cfg.train_limit, "validation": cfg.validation_limit, "test": cfg.test_limit}
    splits = {name: _limit(ds, limits[name], seed) for name, ds in splits.items()}
    _validate_splits(splits, label_names)
    return LabeledData(splits=splits, labels=label_names, source=cfg.source)


def _split_files(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for file in sorted(folder.iterdir()):
        if file.suffix.lower() not in FORMATS:
            continue
        for split, aliases in SPLIT_ALIASES.items():
            if file.stem.lower() in aliases and split not in found:
                found[split] = file
    return found


def _read_file(path: Path, cfg: DataConfig) -> Dataset:
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise UserError(f"data.source `{path}`: unsupported file type `{path.suffix}`. Use one of {', '.join(FORMATS)}.")
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as err:  # the datasets builders raise many types; the user needs the file and the cause
        raise UserError(f"Could not read `{path}` as {builder.upper()}: {str(err).splitlines()[0][:300]}. "
                        "Check that the file is valid and its ending matches its format.") from None
    missing = [c for c in (cfg.text_column, cfg.label_column) if c not in ds.column_names]
    if missing:
        raise UserError(f"`{path}` has no column {', '.join(repr(m) for m in missing)} (columns found: "
                        f"{', '.join(ds.column_names)}). Set data.text_column / data.label_column to the right names.")
    ds = ds.select_columns([cfg.text_column, cfg.label_column])
    if cfg.text_column != "text":
        ds = ds.rename_column(cfg.text_column, "text")
    if cfg.label_column != "label":
        ds = ds.rename_column(cfg.label_column, "label")
    return ds


def _names_from_features(raw: dict[str, Dataset]) -> list[str] | None:
    for ds in raw.values():
        feature = ds.features.get("label")
        if isinstance(feature, ClassLabel):
            return list(feature.names)
    return None


def _labels_to_names(ds: Dataset, names: list[str], path: Path, cfg: DataConfig) -> Dataset:
    """Map integer ids to names and check every label is known; text and label become clean strings."""
    values = ds["label"]
    is_int = all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None)
    if is_int and values:
        bad = sorted({v for v in values if v is None or not 0 <= v < len(names)}, key=str)
        if bad:
            raise UserError(f"`{path}` column `{cfg.label_column}` holds integer ids {bad[:10]} outside 0..{len(names) - 1} "
                            f"for the {len(names)} label names {names}. Set data.label_names to the full list of names in id order.")
        return ds.map(lambda row: {"label": names[row["label"]], "text": _text(row["text"])},
                      features=datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("string")}))
    known = set(names)
    unknown = sorted({str(v).strip() for v in values if str(v).strip() not in known})
    if unknown:
        examples = [f"{row['label']!r}: {str(row['text'])[:60]!r}" for row in ds.select(range(min(len(ds), 2000)))
                    if str(row["label"]).strip() in unknown][:3]
        raise UserError(f"`{path}` column `{cfg.label_column}` has labels {unknown[:10]} that are not in the label set {names} "
                        f"(e.g. {'; '.join(examples)}). Fix those rows, or set data.label_names to include them.")
    return ds.map(lambda row: {"label": str(row["label"]).strip(), "text": _text(row["text"])},
                  features=datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("string")}))


def _text(value: object) -> str:
    return "" if value is None else str(value).strip()


def _stratified_split(ds: Dataset, cfg: DataConfig, seed: int) -> dict[str, Dataset]:
    index = list(range(len(ds)))
    held = cfg.validation_size + cfg.test_size
    train_idx, rest_idx = _safe_split(index, ds["label"], held, seed)
    rest_labels = [ds["label"][i] for i in rest_idx]
    val_idx, test_idx = _safe_split(rest_idx, rest_labels, cfg.test_size / held, seed)
    return {"train": ds.select(train_idx), "validation": ds.select(val_idx), "test": ds.select(test_idx)}


def _carve_missing(splits: dict[str, Dataset], cfg: DataConfig, seed: int) -> dict[str, Dataset]:
    """Hold out a missing validation or test split from train (stratified)."""
    train = splits["train"]
    out = {}
    for name, size in (("test", cfg.test_size), ("validation", cfg.validation_size)):
        if name in splits:
            continue
        keep, held = _safe_split(list(range(len(train))), train["label"], size, seed)
        out[name] = train.select(held)
        train = train.select(keep)
    out["train"] = train
    return out


def _safe_split(index: list[int], labels: list[str], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    counts = {label: labels.count(label) for label in set(labels)}
    stratify = labels if min(counts.values()) >= 2 else None  # stratify needs two rows per label
    return train_test_split(index, test_size=fraction, random_state=seed, stratify=stratify)


def _limit(ds: Dataset, limit: int | None, seed: int) -> Dataset:
    if limit is None or limit >= len(ds):
        return ds
    labels = ds["label"]
    counts = {label: labels.count(label) for label in set(labels)}
    stratify = labels if min(counts.values()) >= 2 and limit >= len(counts) else None
    keep, _ = train_test_split(list(range(len(ds))), train_size=limit, random_state=seed, stratify=stratify)
    return ds.select(sorted(keep))


def _validate_splits(splits: dict[str, Dataset], labels: list[str]) -> None:
    problems = []
    for name in SPLITS:
        ds = splits.get(name)
        if ds is None or len(ds) == 0:
            problems.append(f"the {name} split is empty; give it rows or raise data.{name}_limit")
            continue
        empty = sum(1 for t in ds["text"] if not t)
        if empty:
            problems.append(f"the {name} split has {empty} rows with empty text; remove them")
    if "train" in splits and len(splits["train"]):
        present = set(splits["train"]["label"])
        missing = [label for label in labels if label not in present]
        if missing:
            problems.append(f"labels {missing} have no training rows; add rows or drop them from data.label_names")
    if len(labels) < 2:
        problems.append(f"a classifier needs at least two labels, found {labels}")
    if problems:
        raise UserError("The data has problems: " + "; ".join(problems) + ".")


# --------------------------------------------------------------------------------------------------
# Prompt format: the one place that decides what the model reads, for training and evaluation alike.


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
