"""What translating another tool's training file into an emotune `task: sft` config shares, whichever the tool
(emotune.core.config.llamafactory, emotune.core.config.axolotl): the record of what became of each key, the tool's
keys given as `key=value` overrides, numbers written as text, the held-out share, and the printed table of
key -> emotune key with the keys ignored and the notes."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emotune.core.config.build import TASK_CONFIGS, _parse_value, _set_dotted
from emotune.core.config.run import RunConfigBase

# the `emotune config --from-...` option of each tool, by the article and name sort_unknown is given
FROM = {"a LLaMA-Factory": "llamafactory", "an Axolotl": "axolotl"}
NEAR_MISS = 0.85  # difflib's likeness above which a key the tool lacks is taken for a misspelling of one it has


@dataclass
class Translation:
    """What a tool's file becomes: the emotune config (before overrides) and what was done to each key."""

    raw: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)  # the emotune overrides left after the tool's own ones
    rows: list[tuple[str, str]] = field(default_factory=list)  # (the tool's key: value, emotune key: value)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    template: str | None = None
    given: set[str] = field(default_factory=set)  # the keys the file (or an override of the tool's key) sets
    settings: dict[str, Any] = field(default_factory=dict)  # every translated key: the file's value or the default
    origins: dict[str, tuple[str, ...]] = field(default_factory=dict)  # emotune key -> the tool's keys it came from

    def set(self, emotune_key: str, value: Any, *tool_keys: str, note: str = "") -> None:
        _set_dotted(self.raw, emotune_key, value)
        self.origins[emotune_key] = tuple(tool_keys)
        source = ", ".join(f"{k}: {show(self.settings.get(k))}" + ("" if k in self.given else " (default)")
                           for k in tool_keys)
        self.rows.append((source, f"{emotune_key}: {show(value)}" + (f"  ({note})" if note else "")))


def named_as_given(t: Translation, overrides) -> dict[str, str]:
    """How a problem names each emotune key the file set: `cutoff_len` (read as `train.max_length`), so that a value
    out of range is found in the file as written; a key an emotune override sets keeps its own name."""
    overridden = {item.partition("=")[0].strip() for item in overrides}
    return {key: " and ".join(f"`{k}`" for k in tool_keys) + f" (read as `{key}`)"
            for key, tool_keys in t.origins.items() if tool_keys and key not in overridden}


def split_overrides(file: dict[str, Any], overrides, known) -> tuple[dict[str, Any], list[str]]:
    """`max_steps=2` (a key of the tool's that emotune's top level lacks) changes the file; the rest are emotune's.
    A near miss of the tool's key (`lora_rnak=16`) goes to the file too, where sort_unknown names the key it misses
    (as an emotune key it would be told of emotune's sections, `did you mean lora?`)."""
    rest = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if sep and key not in RunConfigBase.model_fields and (key in known or _near_miss_of_the_tools(key, known)):
            file[key] = _parse_value(value)
        else:
            rest.append(item)
    return file, rest


def _near_miss_of_the_tools(key: str, known) -> bool:
    """A plain key (no section) close to one of the tool's keys and to none of emotune's top-level keys."""
    return ("." not in key and bool(difflib.get_close_matches(key, list(known), n=1, cutoff=NEAR_MISS))
            and not difflib.get_close_matches(key, list(RunConfigBase.model_fields), n=1, cutoff=NEAR_MISS))


# the words pydantic (Axolotl's schemas, emotune's own config) reads as true or false; a quoted `'false'` is text,
# and text is true to Python, so a translator that tests the value would read it as true
TRUE_WORDS = frozenset({"true", "yes", "on", "y", "t", "1"})
FALSE_WORDS = frozenset({"false", "no", "off", "n", "f", "0"})


def as_flag(value: Any) -> Any:
    """`'false'`, `'no'`, `'True'` as the true/false they say; any other value as it is."""
    if isinstance(value, str):
        word = value.strip().lower()
        return True if word in TRUE_WORDS else False if word in FALSE_WORDS else value
    return value


def numbers(t: Translation, defaults: dict[str, tuple[Any, str]], kinds: dict[str, type] | None = None) -> None:
    """YAML reads `1e-4` as text, and `'false'` (quoted) is text too; the tools' argument parsers make it the number or
    the true/false the field holds. A key's kind is its default's type, or `kinds[key]` where the default is None;
    a key the settings lack (a refused key the file leaves out) is skipped."""
    kinds = {key: type(default) for key, (default, _) in defaults.items()
             if isinstance(default, (bool, int, float))} | (kinds or {})
    for key, kind in kinds.items():
        value = t.settings.get(key)
        default = defaults.get(key, (None,))[0]
        if kind in (bool, int, float) and isinstance(value, (list, dict)):  # `max_steps: [10]`
            t.problems.append(f"`{key}`: {value!r} is not " + ("true or false" if kind is bool else "a number"))
            t.settings[key] = default
        elif value is None and key in t.settings and default is not None:
            t.settings[key] = default  # `max_steps:` left empty (or null) is the key unset, as Axolotl's examples write it
        elif kind is bool and isinstance(value, str):
            t.settings[key] = as_flag(value)
            if isinstance(t.settings[key], str):
                t.problems.append(f"`{key}`: {value!r} is not true or false")
                t.settings[key] = default
        elif kind is int and isinstance(value, float) and value.is_integer():
            t.settings[key] = int(value)  # `quantization_bit: 4.0`
        elif kind in (int, float) and isinstance(value, str):
            try:
                t.settings[key] = (float(value) if kind is float or "." in value or "e" in value.lower()
                                   else int(value))
            except ValueError:
                t.problems.append(f"`{key}`: {value!r} is not a number")
                t.settings[key] = default  # so the rest can go on and find the other problems


def flags(refused: dict[str, tuple[Any, str]]) -> dict[str, type]:
    """The refused keys that are true/false (their harmless value is false), so `'false'` is read as false."""
    return {key: bool for key, (harmless_value, _) in refused.items() if harmless_value is False}


def harmless(value: Any, harmless_value: Any) -> bool:
    """The value changes nothing emotune does; YAML reads `1e-8` as text, which the parser makes a number."""
    if isinstance(harmless_value, float) and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return value is None or value is False or value == harmless_value


def sort_unknown(t: Translation, file: dict[str, Any], translated, ignored: dict[str, str], tool: str) -> None:
    """Each key not translated: a near miss of a known key is a problem (one setting silently left at its default);
    the rest are listed as ignored, with why."""
    known = [*translated, *ignored]
    emotune_keys = {key for schema in TASK_CONFIGS.values() for key in schema.model_fields}
    for key in file:
        if key in translated:
            continue
        if key in emotune_keys and key not in ignored:  # `train: {max_steps: 2}` was listed as ignored, and trained on
            override = f"{key}.KEY=VALUE" if isinstance(file[key], dict) else f"{key}={show(file[key])}"
            t.problems.append(f"`{key}` is emotune's key, not {tool} key, so this file does not read it: give it as an "
                              f"override (`{override}`), or save the translation with `emotune config "
                              f"--from-{FROM[tool]} FILE > run.yaml` and edit that")
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=NEAR_MISS) if key not in ignored else []
        if close:
            t.problems.append(f"`{key}` is not {tool} key; did you mean `{close[0]}`?")
        else:
            t.ignored.append((key, ignored.get(key, f"not {tool} key emotune translates")))


def held_out(t: Translation, key: str, zero_means: str) -> None:
    """A validation size: above 1 a count of rows, below it a share; 0 is the tool training on every row."""
    size = t.settings[key]
    number = isinstance(size, (int, float)) and not isinstance(size, bool)
    if number and 0 < size < 0.5:
        t.set("data.validation_size", float(size), key)
    elif number and size > 1:
        t.set("data.validation_size", int(size), key)
    elif number and size == 0:
        t.notes.append(f"{key}: 0 ({zero_means}): emotune still holds out data.validation_size of the training rows "
                       "to pick the adapter with the lowest validation loss.")
    else:
        t.problems.append(f"`{key}: {size}` is not supported: emotune holds out a share of the rows in (0, 0.5), "
                          f"e.g. {key}: 0.1, or a count of rows, e.g. {key}: 500")


def describe(t: Translation, path: Path, heading: str, first_notes: tuple[str, ...] = ()) -> str:
    """Each key's emotune equivalent, the keys ignored and why, and the notes: printed before a run."""
    width = min(max((len(source) for source, _ in t.rows), default=0), 48)  # a long path just pushes its row out
    lines = [heading]
    lines += [f"  {source:<{width}}  ->  {target}" for source, target in t.rows]
    if t.overrides:
        lines.append(f"Then the emotune overrides on top: {' '.join(t.overrides)}")
    if t.ignored:
        lines.append("Ignored keys:")
        lines += [f"  {key}: {why}" for key, why in t.ignored]
    lines.append("Notes:")
    lines += [f"  - {note}" for note in [*first_notes, *t.notes] if note]
    return "\n".join(lines)


def with_overrides(t: Translation) -> dict[str, Any]:
    """The translated config with the emotune overrides applied, as the run will see it."""
    raw = json.loads(json.dumps(t.raw))
    for item in t.overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip():
            _set_dotted(raw, key.strip(), _parse_value(value))
    return raw


def name_list(value: Any) -> list[str]:
    """Comma lists (`identity,alpaca_en_demo`), or a YAML list."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def show(value: Any) -> str:
    """A value as the translation prints it; text with a line break or a tab as JSON (`"\\n"`), on one line."""
    if isinstance(value, str) and any(c in value for c in "\n\r\t"):
        return json.dumps(value, ensure_ascii=False)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def warmup_share(t: Translation, key: str = "warmup_steps") -> bool:
    """transformers (5) reads a `warmup_steps` below 1 as a share of the training steps, as Axolotl's examples write
    it (`warmup_steps: 0.1`): set as train.warmup_ratio, and True; False for a number of steps."""
    value = t.settings[key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    if isinstance(value, float) and 0 < value < 1:
        t.set("train.warmup_ratio", value, key, note="below 1: a share of the steps, as transformers reads it")
        t.set("train.warmup_steps", 0, key)
        return True
    return False


def adam_settings(t: Translation) -> None:
    """transformers' `adam_beta1`, `adam_beta2` and `adam_epsilon` (both tools pass them to the trainer as they are;
    left out, transformers' defaults, which are emotune's) as train.adam_*."""
    for key in ("adam_beta1", "adam_beta2", "adam_epsilon"):
        t.set(f"train.{key}", t.settings[key], key)


def commented_yaml(t: Translation, description: str) -> str:
    """`emotune config --from-...`: the translated config (overrides applied) as YAML, `description` (the printed
    translation) above it as comments."""
    from emotune.core.config.build import yaml_text

    comments = "\n".join(f"# {line}" for line in description.splitlines())
    return comments + "\n" + yaml_text(with_overrides(t), sort_keys=False, width=100)
