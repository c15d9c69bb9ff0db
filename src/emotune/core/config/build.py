"""Building a config: defaults < YAML < key=value, validated all at once against the task's class
(TASK_CONFIGS); YAML reading with duplicate keys refused; the resolved config and its field docs printed."""

from __future__ import annotations

import difflib
import re
import reprlib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from emotune.core.config.base import (
    Range,
    _number_types,
    shorten_name,
    windows_problem,
)
from emotune.core.config.head import ClassifyHeadConfig
from emotune.core.config.run import ClassifyConfig, RunConfigBase
from emotune.core.config.sft import SftConfig
from emotune.core.errors import UserError, raise_problems

# The config class of every task, keyed on `task`. A new task adds its class here and its module to
# emotune.tasks.TASKS.
TASK_CONFIGS: dict[str, type[RunConfigBase]] = {"classify": ClassifyConfig, "sft": SftConfig,
                                                "classify_head": ClassifyHeadConfig}


def build_config(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), path: str | Path | None = None,
                 problems: list[str] | None = None, check=None, written: dict[str, Any] | None = None,
                 named: dict[str, str] | None = None) -> RunConfigBase:
    """Apply the overrides to `raw` and validate it against its task's class; `problems` found before (by a
    translation) and those of `check(raw)` (run after the overrides) are reported with the others, all at once.
    `written` is `raw` as written (read_yaml_as_written): text fields take their values from it (see restore_text).
    `named`: how a problem names a key another tool's file set (emotune.core.config.translation.named_as_given)."""
    problems = list(problems or [])
    written = dict(written or {})
    typed_text: dict[tuple[str, ...], str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"`{item}`: overrides are written key=value, e.g. train.max_steps=2")
            continue
        try:
            _set_dotted(raw, key.strip(), _parse_value(value))
        except DuplicateKeyError as err:
            problems.append(f"`{item}`: {err}")
            continue
        _set_dotted(written, key.strip(), _as_written(value))
        typed_text[tuple(key.strip().split("."))] = value
    if check is not None:
        problems += check(raw)
    schema = _task_config(raw, problems)
    problems += _unknown_keys(raw, schema)
    restore_text(raw, written, typed_text, schema)
    if path is not None and "name" not in raw:
        raw["name"] = _name_from_file(Path(path))
    try:
        cfg = schema.model_validate(_known_only(raw, schema))
    except ValidationError as err:
        problems += [_as_named(_describe(e), named or {}) for e in err.errors()]
    if problems:  # unknown keys and bad values, all at once
        raise_problems("The configuration", problems, "Fix them in the YAML file or the key=value overrides and run again.")
    return cfg


def _as_named(problem: str, named: dict[str, str]) -> str:
    key = problem[1:].partition("`")[0] if problem.startswith("`") else None
    return named[key] + problem[len(key) + 2:] if key in named else problem


def _task_config(raw: dict[str, Any], problems: list[str]) -> type[RunConfigBase]:
    """The config class of the task the config asks for (`task`, default `classify`)."""
    task = raw.get("task", "classify")
    if isinstance(task, str) and task in TASK_CONFIGS:
        return TASK_CONFIGS[task]
    problems.append(f"`task`: {task!r} is not a task emotune knows; choose one of {', '.join(TASK_CONFIGS)}")
    raw.pop("task")
    return ClassifyConfig


def _known_only(raw: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    known = {}
    for key, value in raw.items():
        if key not in model.model_fields:
            continue
        annotation = model.model_fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
            value = _known_only(value, annotation)
        known[key] = value
    return known


def _name_from_file(path: Path) -> str:
    """The default run name: the config file's name, made a plain folder name (see RunConfig.name)."""
    name = shorten_name(re.sub(r"[^\w.-]+", "-", path.stem).strip("-")).strip(".") or "default"
    return name if windows_problem(name) is None else shorten_name(name.split(".")[0] + "-run")


DATA_ENDINGS = (".csv", ".tsv", ".jsonl", ".parquet", ".txt", ".arrow")  # never a config, always a data.source


class DuplicateKeyError(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word, so a setting written twice silently loses one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` then overriding one key is how YAML merges are meant to be used
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not None:
                where = f"line {line}" if first == line else f"lines {first} and {line}"
                raise DuplicateKeyError(f"key `{key}` appears twice ({where}); YAML would keep only the last one, so "
                                        "remove one of them")
            seen[key] = line
        return super().construct_mapping(node, deep)


class TooDeepError(yaml.YAMLError):
    pass


def parse_yaml(text: str, loader: type = _UniqueKeyLoader) -> Any:
    """PyYAML reads nested collections recursively: thousands of levels (`[[[[...]]]]`) end in Python's recursion
    limit, which is said as a YAML error here, not a RecursionError's traceback."""
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 (SafeLoader or BaseLoader: no constructors of objects)
    except RecursionError:
        raise TooDeepError("it nests lists or mappings too deeply to read (thousands of levels); a config needs a "
                           "few") from None


def read_yaml(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path` (duplicate keys refused, naming both lines), or a UserError saying what is wrong."""
    if path.is_dir():
        saved = path / "config.yaml"
        hint = (f"; it looks like a run folder, whose config is `{saved}` (pass that to resume or repeat the run)"
                if saved.is_file() else "")
        raise UserError(f"Config file `{path}` is a folder{hint}. Pass the path of a YAML file, e.g. configs/cpu.yaml.")
    if not path.is_file():
        what = "is not a regular file (a device, a pipe or a socket)" if path.exists() else "does not exist"
        raise UserError(f"Config file `{path}` {what}. Pass the path of a YAML file, e.g. configs/cpu.yaml.")
    if path.suffix.lower() in DATA_ENDINGS:
        raise UserError(f"`{path}` is a data file, not a config. Give it as data.source after a config, e.g. "
                        f"emotune run configs/cpu-own-data.yaml data.source={path}")
    try:
        data = parse_yaml(read_yaml_text(path))
    except (DuplicateKeyError, TooDeepError) as err:
        raise UserError(f"Config file `{path}`: {err}.") from None
    except yaml.YAMLError as err:
        raise UserError(f"Config file `{path}` is not valid YAML: {err}. Fix the syntax at the position shown.") from None
    except UnicodeDecodeError:
        raise UserError(f"Config file `{path}` is not UTF-8 text (nor UTF-16 or UTF-32 with a byte-order mark). Save it "
                        "as UTF-8.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        data_file = " (rows of data? give a data file as data.source=FILE)" if isinstance(data, list) else ""
        raise UserError(f"Config file `{path}` must hold a mapping of sections (model:, data:, ...), not a "
                        f"{type(data).__name__}{data_file}.")
    return data


BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
        (b"\xfe\xff", "utf-16"))


def read_yaml_text(path: Path) -> str:
    """A YAML file's text: UTF-8 (a byte-order mark dropped), or UTF-16/32 where a byte-order mark says so, as YAML
    allows and as Windows tools write it (PowerShell's `>` writes UTF-16)."""
    raw = path.read_bytes()
    encoding = next((name for bom, name in BOMS if raw.startswith(bom)), "utf-8-sig")
    return raw.decode(encoding)


def read_yaml_as_written(path: Path) -> dict[str, Any]:
    """The YAML mapping in `path` with every scalar as the text written (`yes`, `1.0` and `007` stay text); call it
    after read_yaml, which has already refused what is not a valid mapping."""
    try:
        data = parse_yaml(read_yaml_text(path), yaml.BaseLoader)
    except (yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_written(text: str) -> Any:
    try:
        return parse_yaml(text, yaml.BaseLoader) if text.strip() else ""
    except yaml.YAMLError:
        return text


def restore_text(raw: dict[str, Any], written: dict[str, Any], typed: dict[tuple[str, ...], str],
                 model: type[BaseModel], where: tuple[str, ...] = ()) -> None:
    """Give text fields the text that was written. YAML turns `yes`/`no`/`on`/`off` into booleans and `123`, `0.10`
    into numbers, so `data.label_names: [yes, no]` or `name: 2024` would fail as "not a valid string" (or lose the
    spelling); where a field holds text (str, list[str], dict[str, str]), such values get their written spelling
    back. A key=value override (`typed`: path -> the text after `=`) of a text field is taken as typed whenever YAML
    read something else into it, so `prompt.user_template=Review: {text}` is that text, not a mapping."""
    for key, value in raw.items():
        info = model.model_fields.get(key) if isinstance(key, str) else None
        if info is None:
            continue
        path, original = (*where, key), written.get(key) if isinstance(written, dict) else None
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if isinstance(value, dict):
                restore_text(value, original if isinstance(original, dict) else {}, typed, annotation, path)
            continue
        shapes = _text_shapes(annotation)
        if "text" in shapes and path in typed and not _fits(value, shapes):
            raw[key] = typed[path].strip()
        elif shapes:
            raw[key] = _respelled(value, original, shapes)


def _respelled(value: Any, original: Any, shapes: set[str]) -> Any:
    if "text" in shapes and isinstance(value, (bool, int, float)) and isinstance(original, str):
        return original
    if "list" in shapes and isinstance(value, list) and isinstance(original, list) and len(value) == len(original):
        return [_respelled(v, o, {"text"}) for v, o in zip(value, original, strict=True)]
    if "dict" in shapes and isinstance(value, dict) and isinstance(original, dict) and len(value) == len(original):
        pairs = zip(value.items(), original.items(), strict=True)
        return {_respelled(k, ok, {"text"}): _respelled(v, ov, {"text"}) for (k, v), (ok, ov) in pairs}
    return value


def _fits(value: Any, shapes: set[str]) -> bool:
    """Whether YAML's reading of a value is already one of the shapes the field takes (or null)."""
    return (value is None or isinstance(value, str) or (isinstance(value, list) and "list" in shapes)
            or (isinstance(value, dict) and "dict" in shapes))


def _text_shapes(annotation: Any) -> set[str]:
    """Which of `text` (str), `list` (list[str]) and `dict` (dict[str, str]) a field's type takes; none where it also
    takes a number or a boolean, which YAML's reading then decides."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    shapes: set[str] = set()
    for option in options:
        origin, args = get_origin(option), get_args(option)
        if option in (int, float, bool):
            return set()
        if option is str or (origin is Annotated and args[0] is str):
            shapes.add("text")
        elif origin is list and args == (str,):
            shapes.add("list")
        elif origin is dict and args == (str, str):
            shapes.add("dict")
    return shapes


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML so `2`, `1e-4`, `true`, `null` and `[a, b]` get their types."""
    try:
        return parse_yaml(text) if text.strip() else ""
    except DuplicateKeyError:
        raise
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


# Other tools' names for emotune's keys (transformers' TrainingArguments, PEFT, Axolotl, TRL, H2O LLM Studio), for the message that
# refuses them at the top level of an emotune config: a LLaMA-Factory file is translated whole instead.
OTHER_TOOLS_NAMES = {
    "per_device_train_batch_size": "train.batch_size", "micro_batch_size": "train.batch_size",
    "num_epochs": "train.num_train_epochs", "lr_scheduler": "train.lr_scheduler_type", "optimizer": "train.optim",
    "sequence_len": "train.max_length", "max_seq_length": "train.max_length", "cutoff_len": "train.max_length",
    "base_model": "model.source", "model_name_or_path": "model.source", "lora_r": "lora.r", "lora_rank": "lora.r",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules",
    "lora_target": "lora.target_modules", "datasets": "data.source", "dataset": "data.source",
    "dataset_name": "data.source", "val_set_size": "data.validation_size", "bf16": "train.precision",
    "fp16": "train.precision", "load_in_4bit": "model.quantization", "load_in_8bit": "model.quantization",
    "adapter": "train.finetuning", "llm_backbone": "model.source", "experiment_name": "name",
    "output_directory": "output_dir", "problem_type": "task",
}


def _unknown_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    problems = []
    fields = model.model_fields
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"`{dotted}` is not a config key{_closest(str(key), model, prefix)}")
            continue
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if isinstance(value, dict):
                problems += _unknown_keys(value, annotation, f"{dotted}.")
            else:
                problems.append(f"`{dotted}` is a section; give its keys, e.g. {dotted}.{next(iter(annotation.model_fields))}=...")
    return problems


def _closest(key: str, model: type[BaseModel], prefix: str) -> str:
    """What the user probably meant: another tool's name for a key, a key of a section written at the top level
    (`learning_rate` for `train.learning_rate`), or the closest spelling here."""
    fields = model.model_fields
    if not prefix:
        sections = {name: info.annotation for name, info in fields.items()
                    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
        inside = next((f"{name}.{key}" for name, section in sections.items() if key in section.model_fields), None)
        meant = OTHER_TOOLS_NAMES.get(key) or inside
        if meant is not None:
            return (f"; did you mean `{meant}` (keys of a section go under it: {meant.split('.')[0]}: ...)?" if "." in meant
                    else f"; did you mean `{meant}`?")
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
    return f"; did you mean `{prefix}{close[0]}`?" if close else f"; valid keys here: {', '.join(fields)}"


# what a message quotes of a wrong value: YAML aliases make a few hundred bytes a list of 10^8 items, whose whole repr
# the message (and the studio's form page) would hold
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 2, 8, 8, 200, 200


def _describe(error: dict[str, Any]) -> str:
    where = ".".join(str(p) for p in error["loc"] if not str(p).startswith("function-after")) or "config"
    message = error["msg"].removeprefix("Value error, ")
    got = error.get("input")
    shown = "" if isinstance(got, (dict, BaseModel)) else f" (got {_QUOTE.repr(got)})"
    if error["type"] == "string_type" and isinstance(got, (dict, list)):
        # `user_template: {text}` is a YAML mapping; the braces of a template need quotes in YAML
        kind, key = "mapping" if isinstance(got, dict) else "list", str(error["loc"][-1])
        example = "'Review: {text}'" if key.endswith("template") else "'the text'"
        shown = (f" (YAML read a {kind} there, where one text belongs: give each item as a text, quoting one that holds "
                 "brackets, braces or `: `)" if isinstance(error["loc"][-1], int) else
                 f" (YAML read a {kind} there: put the value in quotes, e.g. {key}: {example})")
    elif error["type"] == "list_type" and isinstance(got, str):
        shown = f" (got {_QUOTE.repr(got)}; write a list in brackets, e.g. {where}=[{got}] or {where}=[a, b])"
    return f"`{where}`: {message}{shown}"


def dump_config(cfg: RunConfigBase) -> str:
    return yaml_text(cfg.model_dump(mode="json"), sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Text of nothing but whitespace with a line break (data.input_separator's "\\n\\n") is written in double quotes,
    `"\\n\\n"`, as one line a reader can see; PyYAML's own choice is a single-quoted scalar over several lines, which
    reads back the same but shows as blank lines."""


def _represent_text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = '"' if "\n" in value and not value.strip() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_text)


def yaml_text(data, **options) -> str:
    """`data` as YAML that reads back as `data`, Chinese and other scripts written as they are. PyYAML writes a NEL
    (U+0085, what "…" becomes when a cp1252 file is read as Latin-1) raw inside a quoted string, which reading folds
    into a space: a prompt in the saved config.yaml was then another prompt. Such data is written with escapes."""
    text = yaml.dump(data, Dumper=_Dumper, allow_unicode=True, **options)
    return text if yaml.safe_load(text) == data else yaml.dump(data, Dumper=_Dumper, allow_unicode=False, **options)


def field_docs(model: type[BaseModel] = ClassifyConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every leaf field, for `emotune config --fields`."""
    rows = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += field_docs(annotation, f"{prefix}{name}.")
        else:
            doc = " ".join((info.description or "").split())
            allowed = _allowed_values(info)
            rows.append((f"{prefix}{name}", repr(info.default), f"{doc} Allowed: {allowed}." if allowed else doc))
    return rows


def _allowed_values(info: Any) -> str:
    """What a field accepts, in words: its `Range`, or its choices (`Literal` values), else "" (free text, bools)."""
    allowed = next((m for m in info.metadata if isinstance(m, Range)), None)
    if allowed is not None:
        return allowed.describe(integer=float not in _number_types(info.annotation))
    choices = _literal_values(info.annotation)
    if not choices:
        return ""
    listed = ", ".join(f"`{c}`" for c in choices)
    return f"a list of any of {listed}" if get_origin(info.annotation) is list else f"one of {listed}"


def _literal_values(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [value for arg in get_args(annotation) for value in _literal_values(arg)]
