"""Write docs/architecture.md from the code: the layers in the order of pyproject.toml's import contract, each
with its package's docstring as its paragraph and every module with the first sentence of its own docstring.

    .venv/bin/python scripts/architecture.py          # rewrite docs/architecture.md
    .venv/bin/python scripts/architecture.py --check  # exit 1 when the file is not what the code says
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "emotune"
DOC = ROOT / "docs" / "architecture.md"

INTRO = """# Architecture

<!-- Written by scripts/architecture.py from the code (package and module docstrings, the import contract in
pyproject.toml); edit those, then run `.venv/bin/python scripts/architecture.py`. -->

emotune is one package, `src/emotune/`, in layers. A layer imports only from the layers below it, and no two
modules of one package import each other in a circle: `.venv/bin/lint-imports` checks both (the contracts are
`[tool.importlinter]` in pyproject.toml; function-level imports count). A run is a list of stages
(`data → baseline → train → finetuned → report`, `pipeline.py`); what a stage does for a particular task comes
from that task's folder in `tasks/` ([tasks.md](tasks.md)); every file a run writes has its name in
`core/rundir.py`.

The layers, top to bottom:
"""


def layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [name.removeprefix("emotune.") for name in contract["layers"]]


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def first_sentence(text: str) -> str:
    paragraph = first_paragraph(text)
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    return (sentence if len(sentence) <= 240 else sentence[:239].rsplit(" ", 1)[0] + " …") or "(no docstring)"


def modules(layer: str) -> list[Path]:
    """The layer's module file, or every module of its package (its __init__ first)."""
    path = PACKAGE.joinpath(*layer.split("."))
    if path.with_suffix(".py").is_file():
        return [path.with_suffix(".py")]
    return sorted(path.rglob("*.py"), key=lambda p: (p.parent != path or p.name != "__init__.py", str(p)))


def render() -> str:
    out = [INTRO]
    for layer in layers():
        files = modules(layer)
        is_package = files[0].name == "__init__.py"
        title = f"`{layer}/`" if is_package else f"`{layer}.py`"
        out.append(f"\n## {title}\n\n{first_paragraph(docstring(files[0])) or '(no docstring)'}\n")
        if is_package:
            out.append("")
            for file in files[1:]:
                if file.name == "__init__.py" and file.parent == PACKAGE.joinpath(*layer.split(".")):
                    continue
                name = file.relative_to(PACKAGE).as_posix()
                out.append(f"- `{name}` — {first_sentence(docstring(file))}")
            out.append("")
    out.append("\n## The packaged datasets\n\n`datasets/` holds the packaged datasets (`emotion`, `emotion_zh`, "
               "`instruct`, `probe`), each with a `DATASHEET.md`.\n")
    return "\n".join(out).replace("\n\n\n", "\n\n").rstrip("\n") + "\n"


def every_module() -> list[str]:
    """Every module file under src/emotune/, as its path relative to it."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def missing_modules(text: str, names: list[str]) -> list[str]:
    """The modules of `names` the document `text` does not name (a package by its folder, `tasks/sft/`)."""
    return [m for m in names if m != "__init__.py" and f"`{m}`" not in text
            and f"`{m.removesuffix('/__init__.py')}/`" not in text]


if __name__ == "__main__":
    text = render()
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if DOC.read_text(encoding="utf-8") == text else 1)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)} ({len(text.splitlines())} lines)")
