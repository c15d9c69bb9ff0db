"""A model folder's weight files checked before they load: every shard its index lists is there, and every safetensors
file is as long as its header says (a download or copy cut short). transformers would otherwise stop halfway through
loading with a safetensors or OS error and a traceback, after the data was prepared and the run folder opened. A .gguf
model.source is read as a GGUF file before it is converted."""

from __future__ import annotations

import json
from pathlib import Path

from emotune.core.errors import UserError, first_line

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")
"""Weights in the other formats transformers reads; their files are left to it."""

AGAIN = "Download or copy the model again (the files must be complete), then run the same command."


def check_weight_files(model_dir: Path) -> None:
    """Refuse `model_dir` before its weights load when they cannot: no weight files at all, shards its index lists
    that are missing, or a safetensors file that is cut short or not safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = _indexed(index)
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    elif any((model_dir / name).is_file() for name in OTHER_WEIGHTS):
        return
    else:
        raise UserError(f"The model folder `{model_dir}` holds config.json but no weights ({SINGLE_FILE}, or the shards "
                        f"that {SAFETENSORS_INDEX} lists). {AGAIN}")
    for path in files:
        _check_readable(path)


def _indexed(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"`{index}` is not a shard index (a JSON object whose `weight_map` names each tensor's file). "
                        f"{AGAIN}")
    shards = sorted(set(weight_map.values()))
    missing = [name for name in shards if not (index.parent / name).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise UserError(f"The model folder `{index.parent}` lacks {len(missing)} of the {len(shards)} weight files that "
                        f"{SAFETENSORS_INDEX} lists ({shown}). {AGAIN}")
    return [index.parent / name for name in shards]


def damage(path: Path) -> str | None:
    """Why `path` is no readable safetensors file (safetensors' own words: cut short, a header that is not JSON, ...),
    None when its header reads and its data covers what the header lists. Reads the header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as err:  # noqa: BLE001 (safetensors raises its own error type for every kind of damage)
        return str(err)
    return None


def _check_readable(path: Path) -> None:
    why = damage(path)
    if why is not None:
        raise UserError(f"`{path}` ({path.stat().st_size:,} bytes) is not a complete safetensors file ({why}): a download "
                        f"or copy cut short, or another file under that name. {AGAIN}")


def check_loaded(model_dir: Path, info: dict) -> None:
    """Refuse weights that do not fill the model config.json describes (transformers' loading info): tensors of
    other shapes (a config edited, or weights of another size), or parameters the files lack, which transformers
    would leave at random values and the run would measure and train as if they were the model's."""
    mismatched = sorted(info.get("mismatched_keys") or [], key=lambda entry: entry[0])
    missing = sorted(info.get("missing_keys") or [])
    if not mismatched and not missing:
        return
    if mismatched:
        shown = "; ".join(f"{key}: {tuple(stored)} stored, {tuple(wanted)} in config.json"
                          for key, stored, wanted in mismatched[:3])
        what = (f"{len(mismatched)} tensors whose shapes are not what its config.json gives ({shown}"
                f"{', ...' if len(mismatched) > 3 else ''})")
    else:
        what = (f"no values for {len(missing)} of the parameters its config.json gives ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}), which would start at random")
    raise UserError(f"The weights in `{model_dir}` do not fit its config.json: they hold {what}. The config was edited "
                    "or belongs to another size of the model: put back the config.json that came with the weights, or "
                    "download or copy the model again, then run the same command.")


# GGUF architectures transformers' GGUF reader cannot rebuild: it reads Gemma 4's full-layer head size alone and fails
# on per-layer arrays (E2B's feed_forward_length), taking defaults for the sliding head size, layer pattern, shared
# KV layers and per-layer inputs (transformers 5.25, integrations/ggml.py)
UNREADABLE_GGUF = {"gemma4": "Gemma 4"}


def check_gguf_file(gguf: Path) -> None:
    """Refuse a .gguf model.source that is no GGUF file (cut short, another format: gguf's reader raised ValueError
    with a traceback), or of an architecture transformers cannot rebuild from one."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).fields.get("general.architecture")
    except (ValueError, OSError, IndexError) as err:  # bad magic, a header or tensor table cut short
        raise UserError(f"model.source `{gguf}` is not a readable GGUF file ({first_line(err)}): a download or copy cut "
                        f"short, or another format named .gguf. {AGAIN}") from None
    arch = field.contents() if field is not None else None
    if arch in UNREADABLE_GGUF:
        raise UserError(f"`{gguf.name}` is a {UNREADABLE_GGUF[arch]} GGUF file, which transformers cannot turn back into "
                        "the model it came from (its GGUF reader does not know this architecture's per-layer settings). "
                        "Point model.source at the merged Hugging Face folder the file was exported from (export/merged), "
                        "and run the .gguf with llama.cpp, LM Studio or Ollama.")
