"""The packaged general-ability probe (forgetting check): format, balance, duplicates and fair options.

The checks live in `probe_problems`, which returns a list of problems for any list of rows; the real file
must have none, and hand-made broken rows must each be caught, so the checks cannot pass vacuously.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import emotune

PROBE = Path(emotune.__file__).parent / "datasets" / "probe" / "probe.jsonl"
KEYS = {"id", "lang", "topic", "question", "choices", "answer"}
LANGS = ("en", "zh")
TOPICS = {"geography", "science", "arithmetic_units", "common_sense", "language", "history", "technology"}
MIN_PER_LANG = 120
NEAR_DUP = 0.7


def load_rows(path: Path = PROBE) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def normalise(text: str) -> str:
    """Lowercase, punctuation and symbols to spaces, whitespace collapsed."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def trigrams(text: str) -> set[str]:
    s = normalise(text)
    return {s[i : i + 3] for i in range(max(1, len(s) - 2))}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def row_problems(row: dict) -> list[str]:
    rid = row.get("id")
    if set(row) != KEYS:
        return [f"{rid}: keys {sorted(row)}"]
    out = []
    if not isinstance(rid, str) or not re.fullmatch(r"(en|zh)-\d{3}", rid):
        out.append(f"{rid}: bad id")
    if row["lang"] not in LANGS or not str(rid).startswith(f"{row['lang']}-"):
        out.append(f"{rid}: bad lang {row['lang']!r}")
    if row["topic"] not in TOPICS:
        out.append(f"{rid}: bad topic {row['topic']!r}")
    if not isinstance(row["question"], str) or not row["question"].strip():
        out.append(f"{rid}: empty question")
    elif row["lang"] == "zh" and not re.search(r"[\u4e00-\u9fff]", row["question"]):
        out.append(f"{rid}: zh question without Chinese characters")
    choices = row["choices"]
    if not isinstance(choices, list) or len(choices) != 4:
        return out + [f"{rid}: need a list of 4 choices"]
    if not all(isinstance(c, str) and c.strip() and c == c.strip() for c in choices):
        return out + [f"{rid}: empty, padded or non-string choice"]
    folded = [c.lower() for c in choices]
    if len(set(folded)) != 4:
        out.append(f"{rid}: choices not distinct")
    for a, b in itertools.permutations(folded, 2):
        if a != b and b.startswith(a):
            out.append(f"{rid}: choice {a!r} is a prefix of {b!r}")
    answer = row["answer"]
    if type(answer) is not int or not 0 <= answer <= 3:  # bool is not an answer
        out.append(f"{rid}: answer {answer!r} not an int in 0..3")
    return out


def probe_problems(rows: list[dict]) -> list[str]:
    out = [p for row in rows for p in row_problems(row)]
    if out:
        return out
    ids = Counter(r["id"] for r in rows)
    out += [f"duplicate id {i}" for i, n in ids.items() if n > 1]
    for lang in LANGS:
        mine = [r for r in rows if r["lang"] == lang]
        if len(mine) < MIN_PER_LANG:
            out.append(f"{lang}: only {len(mine)} questions")
            continue
        positions = Counter(r["answer"] for r in mine)
        for pos in range(4):
            share = positions[pos] / len(mine)
            if not 0.20 <= share <= 0.30:
                out.append(f"{lang}: answer position {pos} is correct {share:.0%} of the time")
        topics = Counter(r["topic"] for r in mine)
        for topic in sorted(TOPICS):
            if topics[topic] < 15:
                out.append(f"{lang}: only {topics[topic]} {topic} questions")
    norms = Counter(normalise(r["question"]) for r in rows)
    out += [f"duplicate question {q!r}" for q, n in norms.items() if n > 1]
    grams = [trigrams(r["question"]) for r in rows]
    for i, j in itertools.combinations(range(len(rows)), 2):
        score = jaccard(grams[i], grams[j])
        if score >= NEAR_DUP:
            out.append(f"near-duplicate {rows[i]['id']} / {rows[j]['id']} (trigram Jaccard {score:.2f})")
    return out


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return load_rows()


def test_probe_file_is_packaged_utf8_jsonl_with_a_datasheet():
    assert PROBE.is_file()
    assert (PROBE.parent / "DATASHEET.md").is_file()
    text = PROBE.read_text(encoding="utf-8")
    assert "\\u" not in text, "write with ensure_ascii=False"
    assert all(line.strip() for line in text.splitlines())


def test_probe_has_no_problems(rows):
    assert probe_problems(rows) == []


def test_probe_counts(rows):
    per_lang = Counter(r["lang"] for r in rows)
    assert per_lang["en"] >= MIN_PER_LANG and per_lang["zh"] >= MIN_PER_LANG
    assert {r["topic"] for r in rows if r["lang"] == "en"} == TOPICS
    assert {r["topic"] for r in rows if r["lang"] == "zh"} == TOPICS


def _break(rows: list[dict], how: str) -> list[dict]:
    bad = copy.deepcopy(rows)
    first = bad[0]
    if how == "extra key":
        first["source"] = "x"
    elif how == "missing key":
        del first["topic"]
    elif how == "three choices":
        first["choices"] = first["choices"][:3]
    elif how == "empty choice":
        first["choices"][1] = " "
    elif how == "repeated choice":
        first["choices"][1] = first["choices"][0]
    elif how == "prefix choice":
        first["choices"][1] = first["choices"][0] + " extra"
    elif how == "answer out of range":
        first["answer"] = 4
    elif how == "answer as string":
        first["answer"] = "1"
    elif how == "answer as bool":
        first["answer"] = True
    elif how == "bad topic":
        first["topic"] = "sports"
    elif how == "duplicate id":
        bad[1]["id"] = first["id"]
        bad[1]["lang"] = first["lang"]
    elif how == "duplicate question":
        bad[1]["question"] = "  " + first["question"].upper() + "!"
    elif how == "near-duplicate question":
        bad[1]["question"] = first["question"].rstrip("?？") + " today?"
    elif how == "too few zh":
        bad = [r for r in bad if r["lang"] != "zh" or int(r["id"][3:]) <= 100]
    elif how == "position skew":
        for r in bad:
            if r["lang"] == "en" and r["answer"] != 0:
                c = r["choices"]
                c[0], c[r["answer"]] = c[r["answer"]], c[0]
                r["answer"] = 0
    else:  # pragma: no cover
        raise ValueError(how)
    return bad


@pytest.mark.parametrize(
    "how",
    [
        "extra key",
        "missing key",
        "three choices",
        "empty choice",
        "repeated choice",
        "prefix choice",
        "answer out of range",
        "answer as string",
        "answer as bool",
        "bad topic",
        "duplicate id",
        "duplicate question",
        "near-duplicate question",
        "too few zh",
        "position skew",
    ],
)
def test_checks_catch_broken_rows(rows, how):
    assert probe_problems(_break(rows, how)), f"{how} was not caught"
