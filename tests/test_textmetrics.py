"""Reference-based text scores: hand-computed values, CJK tokenization, JSON exact match (intervals: test_stats.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU

from emotune.eval.textmetrics import CJKTokenizer, bleu, bleu_tokenize, exact_match, rouge_l, sentence_bleu, summarize


def test_rouge_l_matches_the_hand_computed_lcs_f1():
    # LCS("the cat sat on the mat", "a cat was on the red mat") = "cat on the mat": P = 4/6, R = 4/7, F = 8/13
    scores = rouge_l(["the cat sat on the mat", "The Cat."], ["a cat was on the red mat", "the cat"])
    assert scores == pytest.approx([8 / 13, 1.0])


def test_rouge_l_scores_chinese_by_character_where_the_default_tokenizer_gives_zero():
    pred, ref = "今天天气很好", "今天的天气非常好"
    # LCS = 今天天气好 (5 characters): P = 5/6, R = 5/8, F = 5/7
    assert rouge_l([pred], [ref]) == pytest.approx([5 / 7])
    assert rouge_scorer.RougeScorer(["rougeL"]).score(ref, pred)["rougeL"].fmeasure == 0


def test_tokenizer_splits_cjk_characters_and_keeps_other_words_whole():
    assert CJKTokenizer().tokenize("Hello世界, café 3.5 こんにちは 안녕 ＡＢＣ") == [
        "hello", "世", "界", "café", "3", "5", "こ", "ん", "に", "ち", "は", "안", "녕", "abc"]


def test_words_keep_their_marks_and_thai_is_scored_by_character():
    """Python's `\\w` lacks combining marks, so Hindi words fell apart at every vowel sign (`नमस्ते` -> `नमस`, `त`)
    and Thai, written without spaces, was one token per phrase: a near-identical Thai answer scored BLEU 0."""
    tokenize = CJKTokenizer().tokenize
    assert tokenize("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]
    assert tokenize("שָׁלוֹם עולם") == ["שָׁלוֹם", "עולם"]
    assert tokenize("สวัสดี") == ["ส", "วั", "ส", "ดี"]  # each character with its vowel and tone marks
    # LCS(नमस्ते दुनिया, नमस्ते भारत) = नमस्ते: P = R = 1/2
    assert rouge_l(["नमस्ते दुनिया"], ["नमस्ते भारत"]) == pytest.approx([0.5])
    pred, ref = "วันนี้อากาศดีมาก", "วันนี้อากาศไม่ดี"
    assert bleu_tokenize([ref]) == "char" and 0 < sentence_bleu(pred, ref) < 1 and 0 < rouge_l([pred], [ref])[0] < 1


def test_rouge_l_refuses_unpaired_lists():
    with pytest.raises(ValueError, match="pair up"):
        rouge_l(["a", "b"], ["a"])


def test_bleu_is_one_for_identical_and_zero_for_disjoint_texts():
    same = ["the quick brown fox jumps over the lazy dog", "a b c d e"]
    assert bleu(same, same) == pytest.approx(1.0)
    assert bleu(["red green blue yellow"], ["one two three four"]) == 0.0
    assert sentence_bleu("yes", "yes") == pytest.approx(1.0)
    assert sentence_bleu("red green", "one two") == 0.0


def test_bleu_uses_sacrebleu_zh_tokenization_for_chinese_references():
    preds, refs = ["今天天气很好"], ["今天的天气非常好"]
    assert bleu_tokenize(refs) == "zh" and bleu_tokenize(["plain english"]) == "13a"
    assert bleu_tokenize(["今日はいい天気"]) == "char"
    expected = BLEU(tokenize="zh").corpus_score(preds, [refs]).score / 100
    assert bleu(preds, refs) == pytest.approx(expected) and expected > 0
    assert BLEU(tokenize="13a").corpus_score(preds, [refs]).score == 0  # what the default would give
    assert 0 < sentence_bleu(preds[0], refs[0]) < 1


def test_exact_match_normalises_case_space_quotes_and_punctuation():
    assert exact_match('  "Paris."  ', "paris")
    assert exact_match("巴黎。", "「巴黎」")
    assert exact_match("New   York", "new york")
    assert not exact_match("Paris, France", "Paris")


def test_exact_match_compares_parsed_json_when_both_parse():
    ref = '{"name": "Ada", "year": 1843}'
    assert exact_match('{"year":1843,"name":"Ada"}', ref)
    assert exact_match('```json\n{"name": "Ada", "year": 1843}\n```', ref)
    assert not exact_match('{"name": "Ada", "year": 1842}', ref)
    assert not exact_match('{"name": "Ada", "year": "1843"}', ref)
    assert not exact_match("name: Ada, year: 1843", ref)


def test_summarize_gives_overall_and_per_kind_means():
    rows = [
        {"kind": "qa", "rouge_l": 1.0, "bleu": 1.0, "exact_match": True, "prediction": "a b", "reference": "a b"},
        {"kind": "qa", "rouge_l": 0.5, "bleu": 0.0, "exact_match": False, "prediction": "x", "reference": "y"},
        {"kind": "json", "rouge_l": 0.0, "bleu": 0.5, "exact_match": True, "prediction": "c d e f", "reference": "c d e f"},
    ]
    out = summarize(rows)
    assert out["n"] == 3 and out["rouge_l"] == pytest.approx(0.5) and out["exact_match"] == pytest.approx(2 / 3)
    assert out["bleu"] == pytest.approx(0.5)
    assert out["corpus_bleu"] == pytest.approx(bleu(["a b", "x", "c d e f"], ["a b", "y", "c d e f"]))
    assert out["per_kind"]["qa"]["n"] == 2 and out["per_kind"]["qa"]["rouge_l"] == pytest.approx(0.75)
    assert out["per_kind"]["json"] == {"n": 1, "rouge_l": 0.0, "bleu": 0.5, "exact_match": 1.0,
                                       "corpus_bleu": pytest.approx(1.0)}
    assert summarize(rows, corpus_bleu=0.25)["corpus_bleu"] == 0.25
    bare = [{k: v for k, v in r.items() if k not in ("prediction", "reference", "kind")} for r in rows]
    assert summarize(bare)["corpus_bleu"] is None and summarize(bare)["per_kind"] == {}


def test_rows_of_data_without_kinds_make_no_nameless_kind():
    """sft's predictions.csv writes a row without a kind as an empty cell, and those rows formed a kind named "":
    data without a kind column got a nameless row in the report's "per kind" table and in `emotune compare`'s."""
    from emotune.data.conversations import Conversation
    from emotune.tasks.sft.eval import score_rows

    conversations = [Conversation((("user", f"question {i}"), ("assistant", "an answer")), kind=kind)
                     for i, kind in enumerate([None, None, "qa"])]
    rows = score_rows(conversations, ["an answer", "no", "an answer"])
    out = summarize([{**r, "prediction": r["output"]} for r in rows])
    assert out["n"] == 3 and list(out["per_kind"]) == ["qa"] and out["per_kind"]["qa"]["n"] == 1


def test_an_empty_reply_is_no_exact_match_of_an_answer_made_of_punctuation():
    """Both texts stripped of surrounding punctuation to "": an empty generation (or `!!!`) counted as an exact match
    of the reference answer `?`, `...` or `—`. Such an answer is compared as written, case and spacing aside."""
    assert not exact_match("", "?") and not exact_match("", "...") and not exact_match("!!!", "?")
    assert exact_match(" ? ", "?") and exact_match("...", "...") and exact_match("", "")
    assert exact_match("Paris.", "paris")  # words keep their normalisation


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "猫", "狗", "x1"]), max_size=40),
       st.lists(st.sampled_from(["a", "b", "c", "d", "猫", "狗", "x1"]), max_size=40))
def test_rouge_l_is_rouge_scores_rouge_l_with_the_same_tokens(prediction, reference):
    """rouge_l counts the longest common subsequence itself (bit-parallel); rouge_score's rougeL, with the same
    tokenizer, is the reference it must equal."""
    pred, ref = " ".join(prediction), " ".join(reference)
    expected = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=CJKTokenizer()).score(ref, pred)
    assert rouge_l([pred], [ref])[0] == pytest.approx(expected["rougeL"].fmeasure, abs=1e-12)


def test_rouge_l_of_a_long_reply_takes_milliseconds_not_a_second():
    """rouge_score's LCS table is filled cell by cell in Python: a 4,000-token reply against a 500-token reference took
    over a second, so scoring a test split of long generations (reasoning models, large eval.max_new_tokens) took
    many minutes before and again after training."""
    import random
    import time

    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    reply, reference = (" ".join(rng.choice(words) for _ in range(n)) for n in (4000, 500))
    started = time.perf_counter()
    rouge_l([reply] * 4, [reference] * 4)
    assert time.perf_counter() - started < 0.5
