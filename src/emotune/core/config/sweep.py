"""`sweep:` and the grammar of its grid: each key's list of values or range (`loguniform(1e-5,1e-3)`), parsed
here so the config is validated before any sweep runs (emotune.sweep.space builds the trials from it)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import field_validator, model_validator

from emotune.core.config.base import (
    Range,
    Section,
)

SEARCH_MODES = ("random", "tpe")
RANGE_KINDS = ("loguniform", "uniform", "int")
SPEC = re.compile(r"\s*(?P<kind>[A-Za-z_]\w*)\s*\((?P<args>.*)\)\s*", re.S)
DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
# set by the sweep itself for every trial (its folder, and never replacing a finished trial)
RESERVED_KEYS = ("name", "output_dir", "overwrite")

@dataclass(frozen=True)
class Param:
    """One swept key: a list of override texts (`values`), or a range for the searches."""

    key: str
    values: tuple[str, ...] = ()
    kind: str = "values"  # "values", or one of RANGE_KINDS
    low: float = 0.0
    high: float = 0.0

    @property
    def is_range(self) -> bool:
        return self.kind != "values"


def override_text(value: Any) -> str:
    """A YAML value as the text of a `key=value` override that means the same value (`true`, `null`, `[a, b]`)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def split_values(text: str) -> list[str]:
    """`8,16,32` → ['8', '16', '32']; commas inside brackets, braces, parentheses or quotes do not split."""
    parts, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    parts.append(current.strip())
    if not all(parts):
        raise ValueError(f"`{text}` has an empty value between commas")
    return parts


def is_spec(text: str) -> bool:
    return isinstance(text, str) and SPEC.fullmatch(text) is not None


def parse_param(key: str, value: Any) -> Param:
    """The values or range of one key, as written in `sweep.grid` (a list, one value, or a range spec)."""
    if not isinstance(key, str) or not DOTTED_KEY.fullmatch(key):
        raise ValueError(f"`{key}` is not a dotted config key such as lora.r")
    if key in RESERVED_KEYS or key == "sweep" or key.startswith("sweep."):
        raise ValueError(f"`{key}` is set by the sweep itself for every trial and cannot be swept")
    if isinstance(value, dict):
        raise ValueError(f"`{key}`: give a list of values or a range, not a mapping")
    if isinstance(value, str) and is_spec(value):
        return _parse_spec(key, value)
    texts = [override_text(v) for v in (value if isinstance(value, list) else [value])]
    if not texts:
        raise ValueError(f"`{key}` has no values; give at least one, e.g. {key}=8,16")
    repeated = sorted({t for t in texts if texts.count(t) > 1})
    if repeated:
        raise ValueError(f"`{key}` lists {', '.join(repeated)} more than once")
    return Param(key, tuple(texts))


def _parse_spec(key: str, text: str) -> Param:
    match = SPEC.fullmatch(text)
    kind, args = match["kind"], split_values(match["args"]) if match["args"].strip() else []
    if kind == "choice":
        return parse_param(key, args)
    usage = "loguniform(low,high), uniform(low,high), int(low,high) or choice(a,b,...)"
    if kind not in RANGE_KINDS:
        raise ValueError(f"`{key}={text}`: `{kind}(...)` is not a range emotune knows; use {usage}")
    if len(args) != 2:
        raise ValueError(f"`{key}={text}`: {kind} takes two bounds, low and high, e.g. {kind}(1,4)")
    try:
        low, high = (int(a) for a in args) if kind == "int" else (float(a) for a in args)
    except ValueError:
        number = "integers" if kind == "int" else "numbers"
        raise ValueError(f"`{key}={text}`: the bounds of {kind} must be {number}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ValueError(f"`{key}={text}`: the low bound must be below the high bound, both finite")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"`{key}={text}`: loguniform needs a low bound above 0 (a log scale has no 0)")
    return Param(key, kind=kind, low=low, high=high)


def parse_grid(grid: dict[str, Any]) -> list[Param]:
    """Every key of `sweep.grid` parsed; all problems at once in one ValueError."""
    params, problems = [], []
    for key, value in grid.items():
        try:
            params.append(parse_param(key, value))
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))
    return params


class SweepConfig(Section):
    """`emotune sweep`: many runs of this config, each with a few keys changed (docs/sweeps.md). Every other command
    ignores this section."""

    mode: Literal["grid", "ablation", "random", "tpe"] = "grid"
    """`grid`: every combination of the listed values; `ablation`: the config as it is, then each listed value of
    each key with every other key as in the config (one factor at a time); `random` / `tpe`: `trials` trials drawn
    from the values and ranges by Optuna's random or TPE sampler (`--ablation`, `--search random|tpe`)."""
    grid: dict[str, Any] = {}
    """What varies: a dotted config key and its values, e.g. {lora.r: [8, 16, 32], train.learning_rate: [1e-4,
    2e-4]}; on the command line `--grid lora.r=8,16,32` (those keys replace the same keys here). For `random` and
    `tpe` a value may also be a range: `loguniform(1e-5,1e-3)`, `uniform(0,0.1)`, `int(1,4)` or `choice(a,b,c)`."""
    trials: Annotated[int | None, Range(1, also="or null (grid and ablation run every trial)")] = None
    """How many trials `random` and `tpe` run in all (re-running with a larger number continues the search);
    grid and ablation sweeps run every trial of their list."""
    seeds: Annotated[int, Range(1)] = 1
    """Run each grid or ablation trial with this many seeds (`seed`, `seed`+1, ...) and show mean ± sd (`--seeds`)."""
    metric: str | None = None
    """The after-training metric of comparison.json that ranks trials and that `random`/`tpe` optimise: for
    classify and classify_head e.g. `macro_f1` (the default), `accuracy`, `log_loss`; for sft `rouge_l` (the
    default), `perplexity`, `bleu`, ... (the headline method's)."""
    direction: Literal["auto", "maximize", "minimize"] = "auto"
    """Whether a higher or lower `metric` is better; `auto`: lower for loss, perplexity, log_loss, ece and
    invalid, higher for every other metric."""
    backend: Literal["local", "ray"] = "local"
    """Where trials run: `local` = on this machine, one trial per visible GPU at a time (each sees its GPU alone
    through CUDA_VISIBLE_DEVICES), one after another on a CPU; `ray` = as Ray Tune trials on a Ray cluster (needs
    the `ray` extra: pip install 'emotune[ray]'; the sweep folder must be on storage every node sees)."""
    ray_address: str | None = None
    """Address of the Ray cluster for `backend: ray`: `auto` on a node of a running cluster, or the head's
    `HOST:6379`; null = start a Ray instance on this machine."""
    ray_cpus_per_trial: Annotated[int, Range(1)] = 1
    """CPU cores Ray reserves for each trial (plus one GPU each where the cluster has GPUs)."""

    @field_validator("grid")
    @classmethod
    def _parsable(cls, value: dict[str, Any]) -> dict[str, Any]:
        parse_grid(value)  # raises ValueError naming every bad key at once
        return value

    @model_validator(mode="after")
    def _fits_the_mode(self) -> SweepConfig:
        ranges = [p.key for p in parse_grid(self.grid) if p.is_range]
        if self.mode in SEARCH_MODES:
            if self.trials is None:
                raise ValueError(f"sweep.mode={self.mode} draws trials at random: set sweep.trials (--trials N), the "
                                 "number of trials to run")
            if self.seeds > 1:
                raise ValueError(f"sweep.seeds={self.seeds} repeats the trials of grid and ablation sweeps; a "
                                 f"{self.mode} search runs each draw once, so set sweep.seeds=1")
        elif ranges:
            raise ValueError(f"{', '.join(ranges)}: a range is drawn from, so it needs sweep.mode=random or tpe "
                             f"(--search random|tpe); a {self.mode} sweep takes a list of values, e.g. lora.r=8,16,32")
        if self.seeds > 1 and "seed" in self.grid:
            raise ValueError("`seed` is in sweep.grid and sweep.seeds > 1 repeats every trial over seeds too; use one "
                             "of the two")
        return self
