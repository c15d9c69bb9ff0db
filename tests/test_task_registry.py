"""A task is one folder behind one protocol: the registry holds the three real tasks, each implements every hook
of emotune.tasks.protocol.Task, a task added by `register` is found like the others, and task names stay inside
the task folders and the registry everywhere the move has reached so far."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from emotune.core.config.build import TASK_CONFIGS
from emotune.core.errors import UserError
from emotune.tasks import TASKS, register, task_named, unregister
from emotune.tasks.protocol import Task, missing_hooks

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "emotune"
TASK_NAME = re.compile(r"""["'](?:classify|classify_head|sft)["']""")
# Modules outside tasks/ that still name a task, each a file format or a vocabulary rather than a branch of
# behaviour (to shrink, never to grow): the config holds each task's class and its `task` literal, and LLaMA-Factory's
# `stage: sft`; the adapter folder format lists the keys each task's adapter carries; the server's API schema
# lists the tasks a loaded adapter may report.
STILL_NAMING_TASKS = {
    "core/config/build.py", "core/config/head.py", "core/config/llamafactory.py", "core/config/run.py",
    "core/config/sft.py", "model/artifacts.py", "serve/schemas.py",
}


def test_every_registered_task_implements_the_protocol():
    assert set(TASKS) == {"classify", "classify_head", "sft"}
    for name, task in TASKS.items():
        assert isinstance(task, Task) and missing_hooks(task) == [], name
        assert task.DEFAULT_METRIC in task.COMPARED_METRICS and set(task.SWEEP_COLUMNS) <= set(task.COMPARED_METRICS)


def test_register_adds_a_complete_task_and_refuses_an_incomplete_one():
    complete = types.ModuleType("complete")
    for hook in Task.__annotations__:
        setattr(complete, hook, getattr(TASKS["classify"], hook))
    register("complete", complete)
    try:
        assert task_named("complete") is complete and TASK_CONFIGS["complete"] is complete.CONFIG
    finally:
        unregister("complete")
    assert "complete" not in TASKS and "complete" not in TASK_CONFIGS
    incomplete = types.ModuleType("incomplete")
    incomplete.load_data = complete.load_data
    with pytest.raises(ValueError, match="lacks CONFIG, data_fingerprint, saved_fingerprint"):
        register("incomplete", incomplete)
    assert "incomplete" not in TASKS


def test_an_unknown_task_is_a_user_error():
    with pytest.raises(UserError, match="Unknown task `nope`: emotune knows classify, classify_head, sft"):
        task_named("nope")


def test_no_task_name_outside_the_task_folders_and_the_registry():
    naming = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
              if p.relative_to(PACKAGE).parts[0] != "tasks" and TASK_NAME.search(p.read_text(encoding="utf-8"))}
    assert not naming - STILL_NAMING_TASKS, f"task names outside tasks/: {sorted(naming - STILL_NAMING_TASKS)}; ask the task"
    assert not STILL_NAMING_TASKS - naming, f"{sorted(STILL_NAMING_TASKS - naming)} no longer name a task: drop them here"
