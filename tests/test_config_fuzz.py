"""Every number field of the schema, given bools, NaN, infinities, negative and out-of-range values, ends in a
UserError that names the field and states its allowed range, or is accepted unchanged where the value is allowed
(and, if negative, documented, like train.max_steps=-1). The fields are found by walking the schema, so a new
field is fuzzed without touching this file. No weights load: each case is one `load_config` call.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from emotune.core.config import base, build, run
from emotune.core.config.base import Range
from emotune.core.config.load import load_config
from emotune.core.errors import UserError


def _number_fields(model: type[BaseModel], prefix: str = "") -> dict[str, tuple[Range | None, bool, str]]:
    """dotted key -> (its Range, whether it holds integers, its docstring)."""
    out = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.update(_number_fields(annotation, f"{prefix}{name}."))
            continue
        types = base._number_types(annotation)
        if types:
            allowed = next((m for m in info.metadata if isinstance(m, Range)), None)
            out[f"{prefix}{name}"] = (allowed, float not in types, info.description or "")
    return out


# every task's sections too; a key is loaded under the first task whose config has it
SCHEMAS = {"classify": run.RunConfig, **build.TASK_CONFIGS}
TASK_OF = {}
FIELDS = {}
for _task, _schema in SCHEMAS.items():
    for _key, _spec in _number_fields(_schema).items():
        FIELDS.setdefault(_key, _spec)
        TASK_OF.setdefault(_key, _task)


def _load(key: str, text: str):
    return load_config(None, [f"task={TASK_OF[key]}", f"{key}={text}"])
BAD_WORDS = ["true", "false", ".nan", "nan", "NaN", ".inf", "inf", "-.inf", "-inf", "1e999"]
NUMBERS = [-1_000_000_000, -2, -1, -0.5, -0.0, 0, 0.5, 1, 1.5, 65_536, 2**32, 1e12, 1e300,
           2**53 + 1, -(2**63) - 1]  # integers a float field cannot hold exactly (hypothesis found 2**53 + 1)


def test_the_walk_finds_the_number_fields():
    assert {"seed", "train.batch_size", "train.warmup_ratio", "lora.dropout", "data.test_limit", "serve.port",
            "train.max_tokens_per_pass", "data.cleaning.min_chars"} <= set(FIELDS)


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_every_number_field_has_a_range_its_default_satisfies(key):
    allowed, _, _ = FIELDS[key]
    assert allowed is not None, f"{key} has no Range: give it Annotated[..., Range(...)]"
    default = _default(key)
    assert not isinstance(default, (int, float)) or allowed.allows(default), f"{key}: default {default} is out of range"


def _default(key: str):
    node = SCHEMAS[TASK_OF[key]]()
    for part in key.split("."):
        node = getattr(node, part, None)
    return node


def _check(key: str, text: str) -> None:
    """`key=text` is refused with the field and its range named, or accepted unchanged and documented."""
    allowed, integer, doc = FIELDS[key]
    try:
        cfg = _load(key, text)
    except UserError as err:
        message = str(err)
        assert f"`{key}`: must be {allowed.describe(integer)}" in message, message
        assert re.search(r"\d", allowed.describe(integer)), "the range names no bound"
        return
    value = build._parse_value(text)
    assert not isinstance(value, bool), f"{key}={text}: a bool was accepted as a number"
    value = value if isinstance(value, int) else float(value)  # ints beyond 2**53 stay exact
    assert math.isfinite(value), f"{key}={text}: a non-finite value was accepted"
    got = _loaded(cfg, key)
    assert got == value and (not integer or float(got).is_integer()), f"{key}={text}: accepted as {got!r}"
    if value < 0:  # documented as itself (`-1 = ...`), or as a family (lora.layers' `-N = the first N`)
        assert f"{int(value)} =" in doc or f"{int(value)} to" in doc or "-N =" in doc, \
            f"{key}={text}: negative value accepted undocumented"


def _loaded(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_bool_nan_inf_negative_and_out_of_range_values(key):
    for text in BAD_WORDS:
        _check(key, text)
    allowed, _, _ = FIELDS[key]
    for documented in allowed.special:  # e.g. train.max_steps=-1 must stay accepted
        assert _loaded(_load(key, repr(documented)), key) == documented
    edges = [b + d for b in (allowed.low, allowed.high) if b is not None for d in (-1, -0.001, 0, 0.001, 1)]
    for number in NUMBERS + edges:
        _check(key, repr(number))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(FIELDS)),
       value=st.one_of(st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True)))
def test_random_numbers_are_refused_clearly_or_accepted_unchanged(key, value):
    _check(key, repr(value))
