"""pyproject.toml: each dependency once, and only what `src/` imports at run time among the dependencies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_each_runtime_dependency_is_listed_once():
    names = [_name(r) for r in PROJECT["dependencies"]]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_trl_is_a_benchmark_extra_not_a_runtime_dependency():
    assert "trl" not in [_name(r) for r in PROJECT["dependencies"]]
    assert "trl" in [_name(r) for r in PROJECT["optional-dependencies"]["bench"]]
    importing = [str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                 if re.search(r"^\s*(import trl|from trl\b)", p.read_text(encoding="utf-8"), re.M)]
    assert importing == []


def test_doctor_versions_tolerate_trl_absent(monkeypatch):
    from importlib import metadata

    from emotune.runtime import device

    real = metadata.version

    def without_trl(name):
        if name == "trl":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(device.metadata, "version", without_trl)
    assert device.package_versions()["trl"] == "not installed"


def test_train_speed_bench_names_the_extra_when_trl_is_missing(monkeypatch, capsys):
    import importlib.util
    import runpy
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["bench/train_speed.py", "--rows", "1"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "bench" / "train_speed.py"), run_name="__main__")
    assert 'pip install -e ".[bench]"' in str(exit_info.value.code)
