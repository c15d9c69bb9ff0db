"""The task registry: the table from `task` to the module that implements it (one line per task).

Each task is one folder here (`classify/`, `classify_head/`, `sft/`) whose `task.py` implements the Task protocol
(emotune.tasks.protocol: data, training batches, evaluation, comparison, report sections). Generic code asks
`task_for(cfg)` or `task_named(name)` and nothing task-specific; a new task is a new folder, a line in TASKS and
its config class in emotune.core.config.build.TASK_CONFIGS. Tests may add a task with `register` (its config
class too), never by importing a module.
"""

from __future__ import annotations

from types import ModuleType

from emotune.core.config.build import TASK_CONFIGS
from emotune.core.errors import UserError
from emotune.tasks.classify import task as classify
from emotune.tasks.classify_head import task as classify_head
from emotune.tasks.protocol import missing_hooks
from emotune.tasks.sft import task as sft

DEFAULT_TASK = "classify"  # what a run.json written before `task` existed was
TASKS: dict[str, ModuleType] = {
    "classify": classify,
    "sft": sft,
    "classify_head": classify_head,
}


def task_named(name: str) -> ModuleType:
    """The task called `name`; a clear error for a name no task has (a run folder from another version)."""
    if name not in TASKS:
        raise UserError(f"Unknown task `{name}`: emotune knows {', '.join(sorted(TASKS))}. A run folder or adapter "
                        "written by a newer emotune needs that version.")
    return TASKS[name]


def task_for(cfg) -> ModuleType:
    return task_named(cfg.task)


def register(name: str, task: ModuleType) -> None:
    """Add a task under `name` with its config class (tests add their own tasks this way, explicitly), after
    checking it implements the protocol; `unregister` takes it away again."""
    missing = missing_hooks(task)
    if missing:
        raise ValueError(f"task `{name}` ({task.__name__}) lacks {', '.join(missing)} of the Task protocol")
    TASKS[name] = task
    TASK_CONFIGS[name] = task.CONFIG


def unregister(name: str) -> None:
    TASKS.pop(name, None)
    TASK_CONFIGS.pop(name, None)
