"""Reference-based scores for generated text (ROUGE-L, BLEU, exact match), correct for Chinese, Japanese, Korean.

BLEU is the `sacrebleu` package's; ROUGE-L is `rouge_score`'s rougeL F1 (the tests hold it to that package) with a
faster count of the longest common subsequence; this module chooses how text is split into tokens. `rouge_score`'s
default tokenizer keeps only `[a-z0-9]`, so every CJK character is dropped and a Chinese answer scores 0 against any
reference; here CJK characters are single tokens, and so are the characters (with their marks) of Thai, Lao, Khmer
and Myanmar, also written without spaces between words. A word keeps its combining marks (Hindi's vowel signs, Hebrew
points). Every score is a 0–1 fraction.
Intervals over these per-row scores come from `emotune.eval.stats` (`bootstrap_ci`, `paired_bootstrap_delta`).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import defaultdict

import numpy as np
import regex
from sacrebleu.metrics import BLEU

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ffff"
_KANA = "\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f"
_HANGUL = "\uac00-\ud7af\u1100-\u11ff\u3130-\u318f"
_CJK = _HAN + _KANA + _HANGUL
_SOUTHEAST_ASIAN = "\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u19e0-\u19ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff"
_UNSPACED = _CJK + _SOUTHEAST_ASIAN  # scripts written without spaces between words
# one character of an unspaced script with its combining marks (a grapheme cluster), or a run of other letters,
# digits and marks (`regex`'s \p classes: Python's `\w` lacks the marks, so `नमस्ते` fell apart into `नमस`, `त`)
_TOKEN = regex.compile(f"(?=[{_UNSPACED}])\\X|(?:(?![{_UNSPACED}])[\\p{{L}}\\p{{N}}\\p{{M}}])+")
_QUOTES_AND_PUNCT = "\"'`“”‘’「」『』《》〈〉()（）[]【】.,;:!?。，、；：！？…·~-—*"


class CJKTokenizer:
    """`rouge_score` tokenizer: each CJK character (Han, kana, Hangul syllable) and each Thai, Lao, Khmer or Myanmar
    character with its marks is one token; other scripts are lowercased runs of letters, digits and combining marks
    (no stemming). Punctuation and symbols are dropped."""

    def tokenize(self, text: str) -> list[str]:
        return _TOKEN.findall(unicodedata.normalize("NFKC", text).lower())


_TOKENIZER = CJKTokenizer()


def _same_length(first: list, second: list, names: str = "predictions and references") -> None:
    if len(first) != len(second):
        raise ValueError(f"The {names} must pair up, but their lengths differ: {len(first)} and {len(second)}.")


def rouge_l(predictions: list[str], references: list[str]) -> list[float]:
    """Per-row ROUGE-L F1 (0–1) of each prediction against its reference, with `CJKTokenizer`: `rouge_score`'s
    rougeL, its longest common subsequence counted by `lcs_length` (rouge_score's own table took a second per row of a
    4,000-token reply, minutes over a test split).

    A row whose prediction or reference has no tokens scores 0 (the `rouge_score` convention)."""
    _same_length(predictions, references)
    scores = []
    for pred, ref in zip(predictions, references, strict=False):
        got, wanted = _TOKENIZER.tokenize(pred), _TOKENIZER.tokenize(ref)
        common = lcs_length(got, wanted) if got and wanted else 0
        scores.append(2 * common / (len(got) + len(wanted)) if common else 0.0)  # = 2PR / (P + R)
    return scores


def lcs_length(first: list[str], second: list[str]) -> int:
    """Length of the longest common subsequence of two token lists, bit-parallel (Allison and Dix 1986; Hyyrö
    2004): one row of the dynamic-programming table is the bits of one integer, so each token of `second` costs a few
    operations on a len(first)-bit number instead of len(first) steps."""
    where: dict[str, int] = {}
    for i, token in enumerate(first):
        where[token] = where.get(token, 0) | (1 << i)
    ones = (1 << len(first)) - 1
    row = ones
    for token in second:
        matched = row & where.get(token, 0)
        row = ((row + matched) | (row - matched)) & ones
    return len(first) - row.bit_count()


def bleu_tokenize(references: list[str]) -> str:
    """The sacrebleu tokenizer for these references: `char` when any has kana (Japanese has no spaces and
    sacrebleu's `ja-mecab` needs MeCab) or Thai, Lao, Khmer or Myanmar (no spaces between words either), `zh`
    when any has Han characters (each one a token, other text as `13a`), else `13a` (which also suits Korean,
    whose words are space-separated)."""
    text = "".join(references)
    if re.search(f"[{_KANA}{_SOUTHEAST_ASIAN}]", text):
        return "char"
    return "zh" if re.search(f"[{_HAN}]", text) else "13a"


def _fraction(score: float) -> float:
    """sacrebleu's 0–100 score as 0–1 (its float arithmetic can land a hair above 100)."""
    return min(score / 100, 1.0)


def bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU as a 0–1 fraction (sacrebleu's 0–100 score / 100), tokenized by `bleu_tokenize`.

    Plain corpus BLEU needs 4-grams: a corpus whose every text is under 4 tokens scores 0 (use the mean of
    `sentence_bleu` for such short answers)."""
    _same_length(predictions, references)
    if not predictions:
        return 0.0
    return _fraction(BLEU(tokenize=bleu_tokenize(references)).corpus_score(predictions, [references]).score)


def sentence_bleu(prediction: str, reference: str) -> float:
    """One row's BLEU as a 0–1 fraction, with effective n-gram order so short texts are not zeroed by
    missing 4-grams; identical texts score 1 and texts sharing no token score 0."""
    metric = BLEU(tokenize=bleu_tokenize([reference]), effective_order=True)
    return _fraction(metric.sentence_score(prediction, [reference]).score)


def _normalise(text: str, strip: bool = True) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).split()).casefold()
    return text.strip(_QUOTES_AND_PUNCT + " ") if strip else text


def _parse_json(text: str) -> object | None:
    """A JSON object or array from `text` (a ```json fence around it allowed), else None."""
    fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, flags=re.DOTALL | re.IGNORECASE)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except (json.JSONDecodeError, ValueError):
        return None
    return value if isinstance(value, (dict, list)) else None


def _canonical(value: object) -> str:
    """Key order and spacing removed, types kept (`1` differs from `true` and from `1.0`)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def exact_match(prediction: str, reference: str) -> bool:
    """Whether the prediction says exactly the reference.

    When the reference is a JSON object or array and the prediction parses as one too (optionally inside a
    ```json fence), the parsed values are compared, so key order and spacing do not matter (types do: `1` is not `1.0`). Otherwise both
    texts are compared after NFKC, case folding, collapsing whitespace and stripping surrounding quotes,
    brackets and punctuation (`"Paris."` matches `paris`; `巴黎。` matches `巴黎`); a reference of punctuation alone
    (`?`) is compared without that stripping, so an empty reply does not match it."""
    expected = _parse_json(reference)
    if expected is not None:
        got = _parse_json(prediction)
        if got is not None:
            return _canonical(got) == _canonical(expected)
    if not _normalise(reference):  # an answer of punctuation alone (`?`, `...`): stripped, any reply would match it
        return _normalise(prediction, strip=False) == _normalise(reference, strip=False)
    return _normalise(prediction) == _normalise(reference)


def _means(rows: list[dict]) -> dict:
    n = len(rows)
    out: dict = {"n": n}
    for key in ("rouge_l", "bleu", "exact_match"):
        out[key] = float(np.mean([float(r[key]) for r in rows])) if n else 0.0
    if n and all("prediction" in r and "reference" in r for r in rows):
        out["corpus_bleu"] = bleu([r["prediction"] for r in rows], [r["reference"] for r in rows])
    else:
        out["corpus_bleu"] = None
    return out


def summarize(rows: list[dict], kind_key: str = "kind", corpus_bleu: float | None = None) -> dict:
    """Means over per-row scores, overall and per kind.

    Each row holds `rouge_l`, `bleu` (its sentence BLEU), `exact_match` and optionally `kind_key`,
    `prediction` and `reference`. Returns `{"n", "rouge_l", "bleu", "exact_match", "corpus_bleu",
    "per_kind": {kind: {same keys}}}`: `bleu` is the mean sentence BLEU; `corpus_bleu` is the value passed
    in, else computed from the rows' `prediction`/`reference` when every row has them, else None (also
    per kind). Rows without a kind (None or "") count only in the overall means. All values are 0–1 fractions."""
    overall = _means(rows)
    if corpus_bleu is not None:
        overall["corpus_bleu"] = corpus_bleu
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get(kind_key) not in (None, ""):  # "": a CSV cell of a row without a kind
            groups[str(row[kind_key])].append(row)
    overall["per_kind"] = {kind: _means(group) for kind, group in sorted(groups.items())}
    return overall
