"""The new-run form, generated from the task's typed config: one input per leaf field with its docstring and default,
and the submitted form turned back into a config that is validated before anything starts.

A field left at its default is left out of the config, so the saved YAML says only what was chosen. Text fields
(`str` annotations) are taken as typed, so a prompt with a colon or a newline stays text; every other field is read
as YAML (`2`, `1e-4`, `true`, `null`, `[a, b]`), as `key=value` overrides are.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

from emotune.core.config.build import TASK_CONFIGS, _allowed_values, build_config, parse_yaml, yaml_text
from emotune.core.errors import UserError

# YAML aliases that repeat aliases make billions of values from a few hundred bytes; a form is at most 1 MiB, so a value
# larger than that once expanded is such a bomb (it held the studio's event loop for minutes, answering gigabytes)
MAX_VALUES, MAX_CHARS = 100_000, 1 << 20
PROBLEM_KEY = re.compile(r"^\s*- `([\w.\[\]]+)`")  # `  - `train.max_steps`: ...` in a raise_problems message
FORCED = ("task", "output_dir")  # set by the studio: the task picked above the form, the studio's runs folder


@dataclass
class Field:
    key: str
    default: str
    doc: str
    text: bool  # a string field: taken as typed
    multiline: bool
    choices: list[str]


def fields(task: str) -> list[Field]:
    """Every leaf field of the task's config class, in the order the class declares them."""
    return _walk(TASK_CONFIGS[task], "")


def _walk(model: type[BaseModel], prefix: str) -> list[Field]:
    found = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _walk(annotation, f"{prefix}{name}.")
            continue
        key = f"{prefix}{name}"
        if key in FORCED:
            continue
        default = shown(info.default)
        allowed = _allowed_values(info)
        doc = " ".join((info.description or "").split()) + (f" Allowed: {allowed}." if allowed else "")
        choices = [shown(c) for c in _literals(annotation)] if _only_choices(annotation) else []
        found.append(Field(key, default, doc, _is_text(annotation), "\n" in default, choices))
    return found


def shown(value: Any) -> str:
    """A value as the form shows it: text as is, everything else as one line of YAML."""
    if isinstance(value, str):
        return value
    return yaml_text(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")


def _only_choices(annotation: Any) -> bool:
    """A field whose every value is one of its Literal choices (or null): a drop-down fits it."""
    from typing import Literal

    if get_origin(annotation) is Literal:
        return True
    args = get_args(annotation)
    return get_origin(annotation) in (Union, types.UnionType) and all(
        get_origin(a) is Literal or a is type(None) or a is bool for a in args)  # `bool | Literal["auto"]`


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return all(arg in (str, type(None)) for arg in get_args(annotation)) and str in get_args(annotation)
    return False


def _literals(annotation: Any) -> list[Any]:
    from typing import Literal

    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if annotation is bool:
        return [True, False]
    return [v for arg in get_args(annotation) for v in _literals(arg)]


def to_raw(task: str, submitted: dict[str, str], runs: Path) -> dict[str, Any]:
    """The config a submitted form asks for: the changed fields only, the task and the studio's runs folder."""
    raw: dict[str, Any] = {"task": task, "output_dir": str(runs)}
    for field in fields(task):
        value = submitted.get(field.key)
        if value is None or value.replace("\r\n", "\n") == field.default:
            continue
        value = value.replace("\r\n", "\n")
        parsed: Any = (None if value == "" and field.default == "null" else value) if field.text else _yaml(value)
        node = raw
        *parents, leaf = field.key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parsed
    return raw


def _yaml(text: str) -> Any:
    try:
        return parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        return text  # then the field's own validation names what it expected


def validate(task: str, raw: dict[str, Any], runs: Path) -> tuple[str | None, dict[str, list[str]]]:
    """(config YAML, {}) when the config is valid, else (None, {field key or "": [problems]}).

    A run name that is taken is a problem too: the studio starts new runs and never overwrites one from a form."""
    if task not in TASK_CONFIGS:
        return None, {"": [f"`task`: {task!r} is not a task emotune knows; choose one of {', '.join(TASK_CONFIGS)}"]}
    bombs = {f.key: [ALIAS_BOMB] for f in fields(task) if too_large(_at(raw, f.key))}
    if bombs:
        return None, bombs
    if raw.get("name") is None:  # left empty: named as LLaMA-Factory's web UI names its runs, by the time
        raw = {**raw, "name": f"{task}-{datetime.now():%Y%m%d-%H%M%S}"}
    name = raw.get("name")
    taken = {"name": [f"a run folder `{name}` exists already; choose another name (or overwrite=true to replace it)"]} \
        if isinstance(name, str) and name and _exists(runs / name) and not raw.get("overwrite") else {}
    try:
        cfg = build_config(dict(raw))
    except UserError as err:
        problems = _by_field(str(err), {f.key for f in fields(task)})
        return None, {**problems, "name": problems.get("name", []) + taken.get("name", [])} if taken else problems
    if taken or _exists(runs / cfg.name) and not cfg.overwrite:
        return None, taken or {"name": [f"a run folder `{cfg.name}` exists already; choose another name"]}
    from emotune.core.config.build import dump_config

    return dump_config(cfg), {}


def _exists(path: Path) -> bool:
    """Whether `path` exists; a name no file system holds (too long, a NUL byte) is not there, and the config's own
    checks say what is wrong with it."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


ALIAS_BOMB = (f"expands to more than {MAX_VALUES:,} values or {MAX_CHARS:,} characters (YAML aliases that repeat "
              "aliases); write the value out")


def too_large(value: Any) -> bool:
    """Whether `value` holds more than MAX_VALUES values or MAX_CHARS characters of text, counted without expanding
    it (shared references are counted each time, as a dump or a message would write them)."""
    count, chars, stack = 0, 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item
        elif isinstance(item, str):
            chars += len(item)
        if count > MAX_VALUES or chars > MAX_CHARS:
            return True
    return False


def _at(raw: dict[str, Any], key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _by_field(message: str, keys: set[str]) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {}
    for line in message.splitlines()[1:]:
        match = PROBLEM_KEY.match(line)
        if match is None:
            continue
        key = match[1] if match[1] in keys else ""
        problems.setdefault(key, []).append(line.strip().removeprefix("- "))
    return problems or {"": [message]}


def run_name(config_yaml: str) -> str:
    return yaml.safe_load(config_yaml)["name"]


def from_llamafactory(text: str) -> tuple[str, dict[str, str], dict[str, list[str]], str]:
    """A LLaMA-Factory or Axolotl training YAML's translation as a form: (the task it translates to, values by field
    key, problems, the translation as `emotune run` prints it). Values the studio sets itself (task, output_dir) are
    left out; a file that is neither gives no values and one problem saying why."""
    from emotune.core.config import axolotl, llamafactory

    task = llamafactory.translate({}).raw["task"]  # the task every LLaMA-Factory and Axolotl training file becomes
    try:
        file = parse_yaml(text) if text.strip() else None
    except yaml.YAMLError as err:
        return task, {}, {"": [f"The training file is not valid YAML: {err}"]}, ""
    if too_large(file):
        return task, {}, {"": [f"The training file {ALIAS_BOMB}."]}, ""
    if isinstance(file, dict) and llamafactory.is_llamafactory(file):
        translation, told = llamafactory.translate(file), llamafactory.describe
    elif isinstance(file, dict) and axolotl.is_axolotl(file):
        translation, told = axolotl.translate(file), axolotl.describe
    else:
        return task, {}, {"": ["This is not a LLaMA-Factory or Axolotl training config: it has no `model_name_or_path` "
                               "(nor `stage` and `finetuning_type`), nor `base_model` with `datasets`. Paste or pick "
                               "the YAML you pass to `llamafactory-cli train` or `axolotl train`."]}, ""
    known = {f.key for f in fields(task)}
    values = {key: shown(value) for key, value in _flatten(translation.raw, known).items() if key in known}
    problems = {"": list(translation.problems)} if translation.problems else {}
    return task, values, problems, told(translation, Path("the uploaded file"))


def _flatten(tree: dict[str, Any], leaves: set[str], prefix: str = "") -> dict[str, Any]:
    """{"train": {"max_steps": 2}} → {"train.max_steps": 2}; a dict that is itself a field's value stays whole."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in leaves:
            flat.update(_flatten(value, leaves, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
