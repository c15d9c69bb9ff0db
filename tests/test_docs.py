"""The README and docs/ describe the code as it is: real sub-commands, flags and config keys, links that
resolve, and none of a development log's residue (dates, commit hashes, development-machine paths).

The checks are plain functions over markdown text, so the last tests can feed them a bad sample and
see each one fail.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from emotune.cli import COMMANDS, build_parser
from emotune.core.config.build import TASK_CONFIGS, field_docs

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_COMMANDS = ["bash scripts/setup.sh && .venv/bin/emotune run configs/cpu.yaml",
                   "bash scripts/setup.sh && .venv/bin/python -m pytest -q"]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# `emotune run ...`, `.venv/bin/emotune run ...`, `-m emotune train ...`; not `emotune.cli` or `emotune's`
INVOCATION = re.compile(r"(?<![^\s/])emotune[ \t]+(?P<command>[a-z][\w-]*)(?P<rest>[^\n]*)")
COMMAND_END = re.compile(r"\s#|\s\|\s|&&|;")  # a shell comment, pipe or next command ends the arguments
SECTIONS = ("model", "data", "prompt", "lora", "train", "eval", "serve", "sweep")
DOTTED_KEY = re.compile(rf"(?<![\w./$-])(?P<key>(?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]\w*)+)(?![\w(])")
PROSE_ASSIGNMENT = re.compile(rf"(?<![\w./$-])(?P<key>(?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]\w*)+)=")
# `train.jsonl`, `data.md`, `lora.py` are files, not keys
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "csv", "tsv", "parquet", "txt", "yaml", "yml", "png", "html", "sh",
                 "safetensors", "bin", "gguf"}
EVAL_SHORTHANDS = {"adapter", "split"}  # `emotune eval CONFIG adapter=DIR split=NAME`
USAGE_PLACEHOLDER = "key=value"  # `emotune run CONFIG [key=value ...]`
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
HASH = re.compile(r"(?<!\w)(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")
DEV_PATH = re.compile(r"(?<![\w.])/work\b|(?<![\w.])/tmp\b|\.\./shared\b")
LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
BENCH_RUN = re.compile(r"bench/(?P<script>\w+)\.py(?P<rest>[^\n]*)")


# --------------------------------------------------------------------------------------------------
# Reading markdown


def fenced_blocks(text: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text)]


def without_fences(text: str) -> str:
    return FENCE.sub("", text)


def code_snippets(text: str) -> list[str]:
    """Every line of every fenced block (backslash continuations joined) and every inline code span."""
    lines = []
    for block in fenced_blocks(text):
        lines += block.replace("\\\n", " ").splitlines()
    return lines + INLINE_CODE.findall(without_fences(text))


def prose(text: str) -> str:
    return INLINE_CODE.sub("", without_fences(text))


def headings_slugs(text: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    slugs = set()
    for line in without_fences(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slugs.add(re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-"))
    return slugs


# --------------------------------------------------------------------------------------------------
# What the code accepts


def subcommand_options() -> dict[str, set[str]]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(sub._option_string_actions) for name, sub in subparsers.choices.items()}


def config_keys() -> set[str]:
    """Every leaf key and every section above one (`data.cleaning`), dotted, of every task's config class."""
    keys = set()
    for key, _, _ in (row for schema in TASK_CONFIGS.values() for row in field_docs(schema)):
        parts = key.split(".")
        keys.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return keys


OPTIONS = subcommand_options()
KEYS = config_keys()


# --------------------------------------------------------------------------------------------------
# The checks: each returns a list of problems, empty when the text is right


def command_problems(text: str) -> list[str]:
    """Sub-commands, their --flags and their key=value overrides, in every `emotune ...` command line."""
    problems = []
    for snippet in code_snippets(text):
        for match in INVOCATION.finditer(snippet):
            command, rest = match["command"], COMMAND_END.split(match["rest"])[0]
            if command not in COMMANDS:
                problems.append(f"`emotune {command}` is not a sub-command (they are: {', '.join(COMMANDS)})")
                continue
            for token in (t.strip("[](),'\"") for t in rest.split()):
                if token.startswith("--") and token.split("=")[0] not in OPTIONS[command]:
                    problems.append(f"`emotune {command}` has no option {token.split('=')[0]}")
                key = re.match(r"([A-Za-z_][\w.]*)=", token) if token != USAGE_PLACEHOLDER else None
                if key and key[1] not in KEYS and not (command == "eval" and key[1] in EVAL_SHORTHANDS):
                    problems.append(f"`{key[1]}` in `emotune {command} ...` is not a config key")
    return problems


def config_key_problems(text: str) -> list[str]:
    """Dotted config keys in code, and `section.key=value` in prose."""
    found = [m["key"] for s in code_snippets(text) for m in DOTTED_KEY.finditer(s)]
    found += [m["key"] for m in PROSE_ASSIGNMENT.finditer(prose(text))]
    return [f"`{key}` is not a config key (see `emotune config --fields`)"
            for key in dict.fromkeys(found) if key.rsplit(".", 1)[-1] not in FILE_SUFFIXES and key not in KEYS]


def residue_problems(text: str) -> list[str]:
    """Dates, commit-like hashes and development-machine paths, in prose and code alike."""
    problems = [f"date {m[0]}" for m in DATE.finditer(text)]
    problems += [f"commit-like hash {m[0]}" for m in HASH.finditer(text)]
    problems += [f"development-machine path {m[0]}" for m in DEV_PATH.finditer(text)]
    return problems


def link_problems(text: str, source: Path) -> list[str]:
    """Relative links resolve to a file; anchors into markdown files name a heading there."""
    problems = []
    for match in LINK.finditer(without_fences(text)):
        target = match["target"]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve()
        if path and not file.is_file():
            problems.append(f"link {target}: {path} does not exist")
            continue
        if anchor and (not path or file.suffix == ".md"):
            if anchor not in headings_slugs(file.read_text(encoding="utf-8") if path else text):
                problems.append(f"link {target}: no heading #{anchor} in {file.name if path else source.name}")
    return problems


def bench_problems(text: str) -> list[str]:
    """Every `bench/<script>.py --flag` names a script that exists and a flag it defines."""
    problems = []
    for snippet in code_snippets(text):
        for match in BENCH_RUN.finditer(snippet):
            script = ROOT / "bench" / f"{match['script']}.py"
            if not script.is_file():
                problems.append(f"bench/{match['script']}.py does not exist")
                continue
            source = script.read_text(encoding="utf-8")
            for flag in re.findall(r"(?<!\S)--[a-z][\w-]*", COMMAND_END.split(match["rest"])[0]):
                if f'"{flag}"' not in source:
                    problems.append(f"bench/{match['script']}.py has no option {flag}")
    return problems


# --------------------------------------------------------------------------------------------------
# The repository's documents


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_document_matches_the_code(path):
    text = path.read_text(encoding="utf-8")
    problems = (command_problems(text) + config_key_problems(text) + residue_problems(text)
                + link_problems(text, path) + bench_problems(text))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_documents_mention_commands_and_keys():
    """The checks above have something to check: the documents are found and name commands and keys."""
    texts = [p.read_text(encoding="utf-8") for p in DOC_FILES]
    assert len(DOC_FILES) > 1
    assert {m["command"] for t in texts for s in code_snippets(t) for m in INVOCATION.finditer(s)} == set(COMMANDS)
    assert len({m["key"] for t in texts for s in code_snippets(t) for m in DOTTED_KEY.finditer(s)}) > 30


def test_readme_is_a_short_guide_that_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = [line for line in fenced_blocks(text)[0].splitlines() if line.strip()]
    assert first_block == README_COMMANDS
    assert README_COMMANDS[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_every_benchmark_script_is_documented():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for script in sorted((ROOT / "bench").glob("*.py")):
        assert f"bench/{script.name}" in text


# --------------------------------------------------------------------------------------------------
# The checks themselves catch what they are for, and let correct text through


BAD = """\
# Notes

Run `emotune frobnicate configs/cpu.yaml`, then `emotune run configs/cpu.yaml --fast train.max_stepz=3`
or `emotune eval configs/cpu.yaml adapter=runs/cpu colour=red`. Set `lora.rank` or data.balance=weighted.

```bash
emotune export runs/cpu --merged   # a flag export does not have
python bench/eval_speed.py --rowz 4
python bench/no_such_bench.py
```

Measured 2026-12-02 on commit 53b4367 (deadbeefcafe0123deadbeefcafe0123deadbeef), data in
../shared/datasets and /work/main/runs. See [data](no-such-file.md) and [there](#no-such-heading).
"""

GOOD = """\
# Notes

## A heading

Run `emotune run configs/cpu.yaml train.max_steps=10 name=smoke` or
`emotune eval configs/cpu.yaml adapter=runs/cpu split=validation eval.method=score`; see
`data.cleaning.*`, `train.jsonl`, `src/emotune/train/loop.py`, `model.to("cuda")` and [above](#a-heading).
emotune's loop, `emotune.cli`, `emotune: error: ...`, `emotune COMMAND --help` are not commands.

```bash
torchrun --nproc_per_node 4 -m emotune train CONFIG train.fsdp=true   # DDP flags belong to torchrun
emotune config --fields | grep serve.
PYTHONPATH=src python bench/train_speed.py --seed 1 --data PATH/train.jsonl
{"rows": 1000000, "seconds": 31.21, "identical_batch_rel_diff": 3e-06, "files": "train-00000-of-00002"}
```
"""


def test_the_checks_find_every_kind_of_problem(tmp_path):
    source = tmp_path / "bad.md"
    problems = (command_problems(BAD) + config_key_problems(BAD) + residue_problems(BAD)
                + link_problems(BAD, source) + bench_problems(BAD))
    expected = ["`emotune frobnicate` is not a sub-command", "`emotune run` has no option --fast",
                "`train.max_stepz` in `emotune run ...` is not a config key",
                "`colour` in `emotune eval ...` is not a config key", "`emotune export` has no option --merged",
                "`lora.rank` is not a config key",
                "date 2026-12-02", "commit-like hash 53b4367",
                "commit-like hash deadbeefcafe0123deadbeefcafe0123deadbeef", "development-machine path ../shared",
                "development-machine path /work", "link no-such-file.md: no-such-file.md does not exist",
                "link #no-such-heading: no heading #no-such-heading in bad.md",
                "bench/eval_speed.py has no option --rowz", "bench/no_such_bench.py does not exist"]
    for message in expected:
        assert any(p.startswith(message) for p in problems), f"not found: {message}\nfound: {problems}"


def test_a_wrong_value_is_not_a_wrong_key():
    """`data.balance=weighted` names a real key; the schema, not this test, rejects the value."""
    assert not config_key_problems("Set data.balance=weighted.")
    assert config_key_problems("Set data.balanse=weighted.") == ["`data.balanse` is not a config key (see `emotune config --fields`)"]


def test_the_checks_pass_correct_text(tmp_path):
    source = tmp_path / "good.md"
    source.write_text(GOOD, encoding="utf-8")
    problems = (command_problems(GOOD) + config_key_problems(GOOD) + residue_problems(GOOD)
                + link_problems(GOOD, source) + bench_problems(GOOD))
    assert problems == []
