"""Loading a config file: emotune's own YAML, or a LLaMA-Factory or Axolotl training YAML translated first; key=value
overrides on top. The one entry point every command uses (emotune.core.config.build does the building)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emotune.core.config import axolotl, llamafactory
from emotune.core.config.build import build_config, read_yaml, read_yaml_as_written
from emotune.core.config.llamafactory_files import axolotl_lead, h2o_lead, launcher_lead
from emotune.core.config.run import RunConfigBase
from emotune.core.errors import UserError

# --------------------------------------------------------------------------------------------------
# Loading: defaults < YAML < key=value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfigBase:
    """Build the resolved config, or raise one UserError listing every problem.

    A LLaMA-Factory training YAML (flat keys such as `model_name_or_path` and `stage`) is translated into a
    `task: sft` config first (emotune.core.config.llamafactory), and so is an Axolotl one (`base_model` and `datasets`,
    emotune.core.config.axolotl); the overrides then apply on top of the translation."""
    raw: dict[str, Any] = {}
    written: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(Path(path))
        llamafactory.refuse_v1(raw, path)
        if llamafactory.is_llamafactory(raw):
            return llamafactory.load(raw, Path(path), overrides)
        if axolotl.is_axolotl(raw):
            return axolotl.load(raw, Path(path), overrides)
        launcher = launcher_lead(raw, path)
        if launcher:  # a launcher's file: its keys are no training settings, so no line per key follows
            raise UserError(launcher[0])
        written = read_yaml_as_written(Path(path))
    lead = (axolotl_lead(raw, path) or h2o_lead(raw, path)) if path is not None else []
    return build_config(raw, overrides, path, lead, written=written)
