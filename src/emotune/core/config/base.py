"""The config's building blocks: a numeric Range with its message, the Section every config section
derives from (unknown keys rejected, each field documented), and the names every section may check against."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

DEFAULT_SYSTEM_PROMPT = (
    "You are an emotion classification assistant. Read the text and reply with exactly one word, "
    "the emotion it expresses: {labels}. Reply with that word only."
)
DEFAULT_USER_TEMPLATE = "Classify the emotion of this text:\n\n{text}"


@dataclass(frozen=True)
class Range:
    """The values a number field accepts: `Annotated[int, Range(1)]`. `Section` checks it for every field.

    Bounds are inclusive unless `low_open`/`high_open`. `special` holds values outside the bounds that have a
    documented meaning (train.max_steps=-1); `also` finishes the sentence that states the range in messages
    ("or `auto`", "or null for all rows"). NaN and infinities are never in a range: no field gives them a meaning.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()
    also: str = ""
    counts: bool = False
    """Integers >= 1 are allowed too, as counts (a hold-out size: a share in the range or a number of rows)."""

    def allows(self, value: float) -> bool:
        if value in self.special or (self.counts and isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self, integer: bool) -> str:
        """How messages state the range: `a number in [0, 1)`, `an integer >= 1, or -1 to run ...`."""
        kind = "an integer" if integer else "a number"
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        if self.low is not None and self.high is not None:
            bounds = f"in {opening}{_plain(self.low)}, {_plain(self.high)}{closing}"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {_plain(self.low)}"
        elif self.high is not None:
            bounds = f"{'<' if self.high_open else '<='} {_plain(self.high)}"
        else:
            bounds = "(any finite one)"
        counted = ", or a whole number of rows >= 1 (an integer, e.g. 500)" if self.counts else ""
        return f"{kind} {bounds}" + (f", {self.also}" if self.also else "") + counted


HeldOut = Annotated[int | float, Range(0, 0.5, low_open=True, high_open=True, counts=True, also="e.g. 0.1")]
"""A hold-out size as scikit-learn's and `datasets`' train_test_split read one (and LLaMA-Factory's `val_size`,
Axolotl's `val_set_size`): a share of the rows in (0, 0.5), or a whole number of rows."""


RUN_NAME = re.compile(r"[\w.-]{1,100}")
# File systems hold 255 bytes per name, and emotune adds to a run's name (`.NAME.lock`, `NAME.previous`): 100 CJK
# characters are 300 bytes in UTF-8, which no file system takes, so a name is held to bytes as well as characters.
NAME_BYTES = 200


def is_run_name(value: str) -> bool:
    """A plain folder name emotune can make: RUN_NAME's characters, not `.` or `..`, at most NAME_BYTES in UTF-8."""
    return bool(RUN_NAME.fullmatch(value)) and value not in (".", "..") and len(value.encode("utf-8")) <= NAME_BYTES


# Names Windows gives its devices, with or without an extension (`nul.txt` too): no folder there can have one, so a run
# named so could not be made there, nor a run folder copied there (its config names it). Refused everywhere.
WINDOWS_DEVICES = frozenset({"con", "prn", "aux", "nul", *(f"{port}{n}" for port in ("com", "lpt") for n in "123456789")})


def windows_problem(name: str) -> str | None:
    """Why Windows cannot hold a folder named `name` (a device name; a `.` at the end, which it drops), else None."""
    if name.split(".")[0].lower() in WINDOWS_DEVICES:
        return (f"`{name}` is a device name on Windows (CON, PRN, AUX, NUL, COM1-9, LPT1-9, with any extension), where no "
                f"folder can have it, and a run folder may be made or copied there; choose another, e.g. "
                f"name={name.split('.')[0]}-run")
    if name.endswith("."):
        return (f"`{name}` ends in `.`, which Windows drops from a folder name, and a run folder may be made or copied "
                f"there; choose another, e.g. name={name.rstrip('.')}-1")
    return None


def shorten_name(name: str) -> str:
    """`name` cut to whole characters that fit RUN_NAME's 100 and NAME_BYTES (a derived name: from a file, a trial)."""
    name = name[:100]
    while len(name.encode("utf-8")) > NAME_BYTES:
        name = name[:-1]
    return name


def named_source(value: str) -> str:
    """A source (model or data) must name something: an empty one is the current folder to pathlib, so
    `data.source=` read whatever train.* files the working directory held, without a word."""
    if not value.strip():
        raise ValueError("is empty; name a file, a folder, a hub id or `embedded`")
    return value
DEVICE_NAME = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="wrap")
    @classmethod
    def _in_range(cls, value: Any, handler, info: ValidationInfo) -> Any:
        """Number fields: refuse true/false (YAML would make `true` a 1), NaN, infinities and values outside the
        field's `Range`, always with a message that states the range. Text fields: refuse a NUL character."""
        field = cls.model_fields[info.field_name]
        allowed = next((m for m in field.metadata if isinstance(m, Range)), None)
        if allowed is None:
            return _without_nul(handler(value))
        integer = float not in _number_types(field.annotation)
        expected = f"must be {allowed.describe(integer)}"
        if isinstance(value, bool):
            raise ValueError(f"{expected}; true/false is not a number")
        try:
            result = handler(value)
        except ValidationError:
            raise ValueError(expected) from None
        if isinstance(result, (int, float)) and not isinstance(result, bool) and not allowed.allows(result):
            raise ValueError(expected)
        if isinstance(result, float) and isinstance(value, int) and not isinstance(value, bool) and result != value:
            # an integer beyond 2**53 that a float field would round: refused, never taken as another number
            raise ValueError(f"{expected}; {value} has more digits than a number field holds exactly (it would read "
                             f"as {result:.17g})")
        return result


def _without_nul(value: Any) -> Any:
    """`value`, unless a text in it holds a NUL character (YAML's "\\0"): no path can hold one, so `output_dir: "runs\\0"`
    ended the run in Python's `ValueError: embedded null byte`."""
    texts = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
    if any(isinstance(text, str) and "\0" in text for text in texts):
        raise ValueError("holds a NUL character (\\0): no file path can hold one, and in any other text it is a slip (a "
                         "file read in the wrong encoding, a stray escape); remove it")
    return value


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _number_types(annotation: Any) -> set[type]:
    """int/float among a field's types (`int | None`, `int | Literal["auto"]`, `Annotated[...]`)."""
    if annotation in (int, float):
        return {annotation}
    return {t for arg in get_args(annotation) for t in _number_types(arg)}
