"""What a sweep varies: each key's values or range, the trials of a grid or an ablation, and their names.

A sweep's keys are the dotted keys of `key=value` overrides; each trial is the base config with a few of
them set (`lora.r=8 train.learning_rate=1e-4`), run by a normal `emotune run` (emotune.sweep.runner). Values
are kept as the override text the command line would carry, so a trial is exactly a command line.

Ranges (`loguniform(1e-5,1e-3)`, `uniform(a,b)`, `int(a,b)`; `choice(a,b,c)` is a list) are only for
the `random` and `tpe` searches (emotune.sweep.search). The grammar of a key's
values and ranges lives with the sweep section of the config (emotune.core.config.sweep), which validates it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from emotune.core.config.base import shorten_name
from emotune.core.config.sweep import Param  # the grammar of sweep.grid

# short names in trial folder names; any other key is named by its last part
SHORT_NAMES = {"learning_rate": "lr", "batch_size": "bs", "gradient_accumulation_steps": "ga",
               "gradient_checkpointing": "gc", "max_length": "len", "num_train_epochs": "ep", "max_steps": "steps",
               "weight_decay": "wd", "warmup_ratio": "warmup", "lr_scheduler_type": "sched", "dropout": "drop",
               "target_modules": "modules", "use_rslora": "rslora", "use_dora": "dora"}


# --------------------------------------------------------------------------------------------------
# Trials


@dataclass(frozen=True)
class Trial:
    """One run of the sweep: its number, its folder name, and the overrides it adds to the base config."""

    index: int
    name: str
    params: tuple[tuple[str, str], ...] = ()  # (key, override text), in the order of the grid
    seed: int | None = None  # set when the sweep repeats trials over seeds
    extra: dict = field(default_factory=dict, compare=False)  # ablation: {"factor": key, "value": text}

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={text}" for key, text in self.params] + ([f"seed={self.seed}"] if self.seed is not None else [])

    @property
    def variant(self) -> tuple[tuple[str, str], ...]:
        """What the trial changes apart from its seed: trials of one variant differ only in the seed."""
        return self.params

    def as_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "params": dict(self.params), "seed": self.seed, **self.extra}

    @classmethod
    def from_dict(cls, data: dict) -> Trial:
        extra = {k: data[k] for k in ("factor", "value") if k in data}
        return cls(data["index"], data["name"], tuple(data["params"].items()), data.get("seed"), extra)


def trial_name(index: int, params: tuple[tuple[str, str], ...], seed: int | None = None, base: bool = False) -> str:
    """`trial-003-r16-lr2e-4`: readable, and the same for the same trial every time the sweep is planned."""
    keys = [key for key, _ in params]
    parts = ["base"] if base else [_name_part(key, text, keys) for key, text in params]
    parts += [f"seed{seed}"] if seed is not None else []
    name = "-".join([f"trial-{index:03d}", *parts])
    return shorten_name(name).rstrip("-.")


def _name_part(key: str, text: str, keys: list[str]) -> str:
    last = key.rsplit(".", 1)[-1]
    short = SHORT_NAMES.get(last, last)
    if sum(SHORT_NAMES.get(k.rsplit(".", 1)[-1], k.rsplit(".", 1)[-1]) == short for k in keys) > 1:
        short = key.replace(".", "_")  # train.batch_size and eval.batch_size both swept
    if len(text) > 8:
        try:
            text = f"{float(text):.3g}"  # a sampled learning rate, 0.000123456789 → 0.000123
        except ValueError:
            pass
    value = re.sub(r"[^\w.-]+", "-", text).strip("-.") or "x"
    return f"{short}{value}" if value[0].isdigit() or value[0] in "-." else f"{short}-{value}"


def _with_seeds(variants: list[tuple[tuple[tuple[str, str], ...], dict]], seeds: list[int] | None,
                base_first: bool = False) -> list[Trial]:
    trials = []
    for n, (params, extra) in enumerate(variants):
        for seed in seeds or [None]:
            base = base_first and n == 0
            trials.append(Trial(len(trials), trial_name(len(trials), params, seed, base), params, seed, extra))
    return trials


def grid_trials(params: list[Param], seeds: list[int] | None = None) -> list[Trial]:
    """Every combination of the values (the first key varies slowest), each with every seed."""
    combos = itertools.product(*[[(p.key, v) for v in p.values] for p in params])
    return _with_seeds([(tuple(combo), {}) for combo in combos], seeds)


def ablation_trials(params: list[Param], is_base: Callable[[str, str], bool], seeds: list[int] | None = None
                    ) -> list[Trial]:
    """The base config first, then one trial per listed value of each key with every other key at its base value;
    a value equal to the base config's (`is_base`) is the base trial itself and is not repeated."""
    variants = [((), {"factor": "", "value": "base"})]
    variants += [(((p.key, v),), {"factor": p.key, "value": v}) for p in params for v in p.values if not is_base(p.key, v)]
    return _with_seeds(variants, seeds, base_first=True)
