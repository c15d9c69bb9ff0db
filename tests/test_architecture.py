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


MAX_PARAMETERS = 8  # from this many on, the parameters that travel together become a small dataclass
# Functions that still take that many (to shrink, never to grow): the training loop's stages, its memory planner and
# out-of-memory recovery, which pass the loop's state around piece by piece.
STILL_LONG = {
    "train/loop.py:train", "train/loop.py:_setup", "train/loop.py:_loop", "train/loop.py:_validate_and_track",
    "train/loop.py:_save", "train/memory.py:describe", "train/passes.py:calibration", "train/passes.py:replan",
    "train/recovery.py:Recovery.__init__",
}


def _long_signatures(source: str, module: str) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", [])
        for item in body if isinstance(body, list) else []:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = item.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                count = len(names) + bool(args.vararg) + bool(args.kwarg) - (names[:1] in (["self"], ["cls"]))
                if count >= MAX_PARAMETERS:
                    owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                    found.add(f"{module}:{owner}{item.name}")
    return found


def test_no_function_takes_eight_or_more_parameters():
    package = ROOT / "src" / "emotune"
    found = set().union(*(_long_signatures(p.read_text(encoding="utf-8"), p.relative_to(package).as_posix())
                          for p in package.rglob("*.py")))
    assert not found - STILL_LONG, f"{sorted(found - STILL_LONG)} take {MAX_PARAMETERS}+ parameters: group them in a dataclass"
    assert not STILL_LONG - found, f"{sorted(STILL_LONG - found)} no longer do: drop them from STILL_LONG"
    assert _long_signatures("def f(a, b, c, d, e, f, g, h=1):\n    pass\n", "m.py") == {"m.py:f"}
    assert _long_signatures("class C:\n    def g(self, a, b, c, d, e, f, g):\n        pass\n", "m.py") == set()
