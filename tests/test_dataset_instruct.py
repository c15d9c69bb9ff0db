"""The embedded instruction-tuning dataset (datasets/instruct): format, coverage, and no (near-)duplicates."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest

import emotune

FOLDER = Path(emotune.__file__).parent / "datasets" / "instruct"
SPLITS = ("train", "validation", "test")
KINDS = {"rewrite", "summarize", "extract_json", "translate", "factual", "classify_reason"}
KEYS = {"instruction", "input", "output", "kind", "lang"}
NEAR = 0.7  # character-trigram Jaccard at or above this is a near-duplicate


def _load() -> dict[str, list[dict]]:
    splits = {}
    for name in SPLITS:
        lines = (FOLDER / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        splits[name] = [json.loads(line) for line in lines]
    return splits


def _normalise(text: str) -> str:
    """NFKC, lowercase, and drop whitespace, punctuation and symbols."""
    text = unicodedata.normalize("NFKC", text).lower()
    return "".join(ch for ch in text if not ch.isspace() and unicodedata.category(ch)[0] not in "PS")


def _trigrams(text: str) -> frozenset[str]:
    text = unicodedata.normalize("NFKC", text).lower()
    return frozenset(text[i:i + 3] for i in range(len(text) - 2))


def _near_duplicates(texts: list[str], threshold: float = NEAR) -> list[tuple[float, int, int]]:
    """Pairs (jaccard, i, j) with trigram Jaccard >= threshold.

    Sorted by trigram-set size: J(A, B) <= |A| / |B| for |A| <= |B|, so once the larger set is more than
    |A| / threshold, no later set can reach the threshold with A.
    """
    grams = [_trigrams(t) for t in texts]
    order = sorted(range(len(texts)), key=lambda k: len(grams[k]))
    found = []
    for pos, i in enumerate(order):
        a = grams[i]
        for j in order[pos + 1:]:
            b = grams[j]
            if len(a) < threshold * len(b):
                break
            inter = len(a & b)
            union = len(a) + len(b) - inter
            if union and inter / union >= threshold:
                found.append((inter / union, i, j))
    return found


@pytest.fixture(scope="module")
def splits():
    return _load()


def test_files_and_row_format(splits):
    assert (FOLDER / "DATASHEET.md").is_file()
    for name, rows in splits.items():
        for r in rows:
            assert set(r) == KEYS, (name, r)
            assert all(isinstance(r[k], str) for k in KEYS), (name, r)
            assert r["lang"] in {"en", "zh"}, r
            assert r["kind"] in KINDS, r
            assert r["instruction"].strip() and r["output"].strip(), r


def test_sizes_and_coverage(splits):
    assert sum(len(rows) for rows in splits.values()) >= 600
    assert len(splits["test"]) >= 100
    assert len(splits["validation"]) >= 50
    for name, rows in splits.items():
        assert {r["kind"] for r in rows} == KINDS, name
    for lang in ("en", "zh"):
        assert {r["kind"] for r in splits["test"] if r["lang"] == lang} == KINDS, lang
    every = [r for rows in splits.values() for r in rows]
    share_zh = sum(r["lang"] == "zh" for r in every) / len(every)
    assert 0.4 <= share_zh <= 0.6


def test_extract_json_outputs_are_json_objects(splits):
    rows = [r for rows in splits.values() for r in rows if r["kind"] == "extract_json"]
    assert rows
    for r in rows:
        value = json.loads(r["output"])
        assert isinstance(value, dict) and value, r
        assert "\n" not in r["output"], r  # one compact line


def test_classify_reason_outputs_have_label_and_reason(splits):
    for rows in splits.values():
        for r in rows:
            if r["kind"] == "classify_reason":
                sep = " — " if r["lang"] == "en" else "——"
                label, _, reason = r["output"].partition(sep)
                assert label.strip() and reason.strip(), r


def test_no_exact_duplicates_after_normalisation(splits):
    seen = {}
    for name, rows in splits.items():
        for r in rows:
            key = _normalise(r["instruction"] + r["input"])
            assert key not in seen, f"{name} row duplicates a {seen.get(key)} row: {r['instruction']!r} {r['input']!r}"
            seen[key] = name


def test_no_near_duplicates_within_or_across_splits(splits):
    every = [r for rows in splits.values() for r in rows]
    texts = [r["instruction"] + " " + r["input"] for r in every]
    pairs = _near_duplicates(texts)
    assert not pairs, [(round(j, 3), texts[a], texts[b]) for j, a, b in pairs[:5]]


def test_near_duplicate_check_catches_a_planted_pair():
    texts = ["Translate into Chinese. The library closes at eight o'clock on weekdays.",
             "Translate into Chinese. The library closes at nine o'clock on weekdays.",
             "What is the capital of Australia?"]
    assert [(a, b) for _, a, b in _near_duplicates(texts)] in ([(0, 1)], [(1, 0)])
    assert _normalise("Hello,  World!") == _normalise("hello world")
