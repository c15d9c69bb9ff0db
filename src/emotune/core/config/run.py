"""The whole run's config: the sections every task shares (RunConfigBase), and `task: classify`'s own."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import field_validator

from emotune.core.config.base import (
    DEVICE_NAME,
    NAME_BYTES,
    Range,
    Section,
    is_run_name,
    windows_problem,
)
from emotune.core.config.data import DataConfig, PromptConfig
from emotune.core.config.eval import EvalConfig, ServeConfig
from emotune.core.config.model import ModelConfig
from emotune.core.config.sweep import SweepConfig
from emotune.core.config.train import LoraSettings, TrainConfig
from emotune.core.rundir import PARTIAL, PREVIOUS


class RunConfigBase(Section):
    """The sections every task shares. Each task's config class adds its own `data` and `prompt`."""

    task: str = "classify"
    """What the run fine-tunes the model for: `classify` = generative classification (the label is the
    assistant's answer; measured by decoding and by label scoring); `sft` = instruction tuning on
    conversations. The task decides which `data`, `prompt` and `eval` keys exist (TASK_CONFIGS)."""
    name: str | None = None
    """Run folder name under `output_dir`: letters, digits, `.`, `-` and `_` only, so it stays inside
    `output_dir`; at most 100 characters and 200 bytes in UTF-8 (what file systems take), not a Windows device
    name (CON, NUL, AUX, ...) nor ending in `.`; default: the config file's name (other characters become `-`), or
    `default`."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    overwrite: bool = False
    """Replace a finished run folder of the same name (otherwise emotune refuses). The old run is moved aside
    to `<name>.previous` only after the new run's config, data and model source validated, and deleted when
    the new run finishes."""
    seed: Annotated[int, Range(0, 2**32 - 1)] = 42
    """Seed for sampling, LoRA initialisation and data order (0 to 2**32 - 1, the seeds NumPy accepts)."""
    device: str = "auto"
    """Device to run on: `auto` (a GPU if PyTorch sees one, then MPS, then the CPU), `cpu`, `cuda` (the
    first visible GPU), `cuda:N` (GPU N, numbered after CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES /
    ROCR_VISIBLE_DEVICES), or `mps`. ROCm (AMD) GPUs are `cuda` in PyTorch. A GPU number beyond those
    visible is refused before any weights load. Under several processes (torchrun, accelerate launch)
    each process takes the GPU of its local rank, so leave it at `auto` or `cuda` there and choose the
    GPUs with the variables above."""
    model: ModelConfig = ModelConfig()
    lora: LoraSettings = LoraSettings()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    serve: ServeConfig = ServeConfig()
    sweep: SweepConfig = SweepConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / (self.name or "default")

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not DEVICE_NAME.fullmatch(value):
            raise ValueError("must be auto, cpu, cuda, cuda:N (a GPU number, e.g. cuda:1) or mps; ROCm (AMD) GPUs are "
                             "cuda in PyTorch")
        return value

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, value: str | None) -> str | None:
        # the run folder is output_dir/name and `overwrite` deletes it: a path here could point anywhere
        if value is not None and not is_run_name(value):
            raise ValueError(f"must be a plain folder name of letters, digits, `.`, `-` and `_` (at most 100 characters "
                             f"and {NAME_BYTES} bytes in UTF-8, where a Chinese character takes 3; no `/`, `\\`, spaces, "
                             "`.` or `..`), e.g. name=gemma-emotion-r16; put parent folders in output_dir")
        if value is not None and windows_problem(value):
            raise ValueError(windows_problem(value))
        if value is not None and value.endswith((PARTIAL, PREVIOUS)):
            # emotune's own names for a folder being written and an old run kept aside: overwriting the run `x`
            # deletes `x.previous`, and the studio lists neither
            raise ValueError(f"must not end in `{PARTIAL}` or `{PREVIOUS}`: emotune names its half-written folders and "
                             "the old runs it keeps aside so, and deletes them; choose another name")
        return value


class ClassifyConfig(RunConfigBase):
    """`task: classify`: a labelled text dataset; the label name is the assistant's answer."""

    task: Literal["classify"] = "classify"
    """What the run fine-tunes the model for: `classify` = generative classification (the label is the
    assistant's answer; measured by decoding and by label scoring). The task decides which `data` and
    `prompt` keys exist (TASK_CONFIGS)."""
    data: DataConfig = DataConfig()
    prompt: PromptConfig = PromptConfig()


RunConfig = RunConfigBase  # what generic code (pipeline, train, export) may rely on in any task's config
