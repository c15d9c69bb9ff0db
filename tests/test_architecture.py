"""The code's shape: docs/architecture.md lists every module and is what scripts/architecture.py writes from the
code; no module is over 500 lines; the import contracts (layers, no circles) hold."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _architecture():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_is_listed_in_the_architecture_document():
    arch = _architecture()
    text = arch.DOC.read_text(encoding="utf-8")
    missing = arch.missing_modules(text, arch.every_module())
    assert not missing, f"docs/architecture.md misses {missing}: run .venv/bin/python scripts/architecture.py"


def test_the_architecture_document_is_what_the_code_says():
    arch = _architecture()
    assert arch.DOC.read_text(encoding="utf-8") == arch.render(), \
        "docs/architecture.md is out of date: run .venv/bin/python scripts/architecture.py"


def test_the_listing_catches_a_module_left_out():
    """The check above has teeth: a module or package the document does not name is reported."""
    arch = _architecture()
    text = arch.render()
    assert arch.missing_modules(text, ["train/loop.py", "tasks/sft/__init__.py"]) == []
    assert arch.missing_modules(text.replace("`train/loop.py`", "`train/elsewhere.py`"), ["train/loop.py"]) == ["train/loop.py"]
    assert arch.missing_modules(text, ["train/new_module.py", "newpackage/__init__.py"]) == ["train/new_module.py",
                                                                                            "newpackage/__init__.py"]


def test_no_module_is_over_500_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "src" / "emotune").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


def test_import_contracts_hold():
    """Layers import only downwards and no package has an import circle (pyproject.toml [tool.importlinter])."""
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(linter), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
