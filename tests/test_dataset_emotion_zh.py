"""The packaged Chinese emotion dataset (datasets/emotion_zh): format, labels, size, and no (near-)duplicates."""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path

import pytest

import emotune

FOLDER = Path(emotune.__file__).parent / "datasets" / "emotion_zh"
SPLITS = ("train", "validation", "test")
LABELS = {"喜悦", "愤怒", "悲伤", "恐惧", "惊讶", "厌恶", "中性"}
NEAR_DUPLICATE_JACCARD = 0.6


def normalize(text: str) -> str:
    """NFKC, lowercase, and drop whitespace, punctuation, symbols and control characters."""
    text = unicodedata.normalize("NFKC", text).lower()
    return "".join(ch for ch in text if unicodedata.category(ch)[0] not in "PSZC")


def bigrams(text: str) -> frozenset[str]:
    return frozenset(text[i : i + 2] for i in range(len(text) - 1)) if len(text) > 1 else frozenset([text])


def near_duplicate_pairs(texts: list[str], threshold: float = NEAR_DUPLICATE_JACCARD) -> list[tuple[float, int, int]]:
    """Every pair (i < j) whose character-bigram sets, after `normalize`, have Jaccard similarity >= threshold.

    An inverted index from bigram to texts counts the shared bigrams of each pair that shares any, so only
    those pairs are scored.
    """
    grams = [bigrams(normalize(t)) for t in texts]
    index: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(grams):
        for gram in g:
            index[gram].append(i)
    pairs = []
    for i, g in enumerate(grams):
        shared: Counter[int] = Counter()
        for gram in g:
            shared.update(j for j in index[gram] if j > i)
        for j, inter in shared.items():
            jaccard = inter / (len(g) + len(grams[j]) - inter)
            if jaccard >= threshold:
                pairs.append((jaccard, i, j))
    return pairs


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    out = {}
    for name in SPLITS:
        lines = (FOLDER / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
        out[name] = [json.loads(line) for line in lines]
    return out


def test_files_are_utf8_json_lines_with_text_and_label_only():
    for name in SPLITS:
        raw = (FOLDER / f"{name}.jsonl").read_text(encoding="utf-8")
        assert raw.endswith("\n")
        for n, line in enumerate(raw.splitlines(), 1):
            row = json.loads(line)
            assert isinstance(row, dict) and set(row) == {"text", "label"}, f"{name}:{n}"
            assert isinstance(row["text"], str) and row["text"].strip() == row["text"] and row["text"], f"{name}:{n}"
            assert "\\u" not in line, f"{name}:{n} is ASCII-escaped; write with ensure_ascii=False"
    assert (FOLDER / "DATASHEET.md").is_file()


def test_label_set_size_and_every_label_in_every_split(splits):
    rows = [r for part in splits.values() for r in part]
    assert {r["label"] for r in rows} == LABELS
    assert len(rows) >= 1000
    for name, part in splits.items():
        assert {r["label"] for r in part} == LABELS, name
    counts = Counter(r["label"] for r in rows)
    assert min(counts.values()) >= 150 and max(counts.values()) - min(counts.values()) <= 20, counts
    assert len(splits["train"]) > len(splits["test"]) > len(splits["validation"])


def test_no_duplicates_after_normalization(splits):
    texts = [normalize(r["text"]) for part in splits.values() for r in part]
    dupes = [t for t, c in Counter(texts).items() if c > 1]
    assert not dupes, f"duplicates within or across splits: {dupes[:5]}"


def test_no_near_duplicates_anywhere(splits):
    texts = [r["text"] for part in splits.values() for r in part]
    pairs = near_duplicate_pairs(texts)
    shown = [(round(s, 2), texts[i], texts[j]) for s, i, j in sorted(pairs, reverse=True)[:5]]
    assert not pairs, f"{len(pairs)} near-duplicate pairs (char-bigram Jaccard >= {NEAR_DUPLICATE_JACCARD}): {shown}"


def test_near_duplicate_check_catches_a_planted_pair():
    texts = ["外卖超时一个半小时，打开一看汤全洒了", "外卖超时一个半小时打开一看汤全都洒了！", "明天上午九点开会"]
    assert [(i, j) for _, i, j in near_duplicate_pairs(texts)] == [(0, 1)]
    assert normalize("ＡＰＰ　２０２６！") == normalize("app 2026")


def test_datasheet_states_the_actual_counts(splits):
    sheet = (FOLDER / "DATASHEET.md").read_text(encoding="utf-8")
    header = next(line for line in sheet.splitlines() if line.startswith("| split"))
    order = [c.strip() for c in header.strip("|").split("|")][1:-1]
    assert set(order) == LABELS
    for name, part in splits.items():
        line = next(line for line in sheet.splitlines() if re.match(rf"\|\s*{name}\s*\|", line))
        cells = [int(c.strip().replace(",", "")) for c in line.strip("|").split("|")[1:]]
        counts = Counter(r["label"] for r in part)
        assert cells == [counts[label] for label in order] + [len(part)], name
