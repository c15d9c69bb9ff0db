"""Cleaning, splitting and balancing: properties of the Arrow cleaning kernels (hypothesis) and the
counts each step reports."""

from __future__ import annotations

import unicodedata

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LABELS, make_rows, write_jsonl
from emotune.core.config.data import CleaningConfig, DataConfig
from emotune.data import load_data
from emotune.data.clean import clean_text, codes, conflicting_labels, first_occurrences, key_hashes, normalized_key, occurs_in

ALL_ON = CleaningConfig(urls="replace", mentions="replace", emoji="replace")
texts_strategy = st.lists(st.text(max_size=40) | st.sampled_from(
    ["e\u0301", "  a\t\nb ", "hi @bob!", "mail me@x.org", "see https://x.io/a?b=1 now", "😀👍🏽 ok", "a\x00b\u200bc",
     "\u3000全角\u00a0空格", "Ｆｕｌｌ ｗｉｄｔｈ", "x\x85y\x1cz"]), max_size=12)


def _clean(values: list[str], cfg: CleaningConfig = ALL_ON) -> list[str]:
    return clean_text(pa.array(values, pa.string()), cfg)[0].to_pylist()


@settings(max_examples=200, deadline=None)
@given(texts_strategy)
def test_cleaned_text_is_nfc_trimmed_single_spaced_and_free_of_control_chars(values):
    for out in _clean(values):
        assert unicodedata.is_normalized("NFC", out)
        assert out == " ".join(out.split())  # Python's idea of whitespace agrees with the RE2 class
        assert not any(unicodedata.category(c) == "Cc" for c in out)
        assert not any(c in out for c in "\u200b\ufeff\u202e\u00ad")


@settings(max_examples=200, deadline=None)
@given(texts_strategy, st.sampled_from(["keep", "replace", "drop"]), st.sampled_from(["keep", "replace", "drop"]),
       st.sampled_from(["keep", "replace", "drop"]))
def test_cleaning_is_idempotent(values, urls, mentions, emoji):
    cfg = CleaningConfig(urls=urls, mentions=mentions, emoji=emoji)
    once = _clean(values, cfg)
    assert _clean(once, cfg) == once


@settings(max_examples=200, deadline=None)
@given(texts_strategy)
def test_switched_off_steps_change_nothing(values):
    off = CleaningConfig(unicode_nfc=False, control_chars=False, whitespace=False)
    cleaned, changed = clean_text(pa.array(values, pa.string()), off)
    assert cleaned.to_pylist() == values and changed == {}


@settings(max_examples=200, deadline=None)
@given(texts_strategy)
def test_change_counts_match_the_rows_changed(values):
    cfg = CleaningConfig(unicode_nfc=False, control_chars=False)
    cleaned, changed = clean_text(pa.array(values, pa.string()), cfg)
    assert changed["whitespace"] == sum(a != b for a, b in zip(values, cleaned.to_pylist(), strict=False))


def test_urls_mentions_emoji_actions():
    text = "hey @anna see https://x.io/p?q=1 😀👍🏽 mail bob@mail.org"
    assert _clean([text], CleaningConfig(urls="replace", mentions="replace", emoji="replace")) == [
        "hey @user see <url> <emoji> mail bob@mail.org"]
    assert _clean([text], CleaningConfig(urls="drop", mentions="drop", emoji="drop")) == ["hey see mail bob@mail.org"]
    assert _clean([text], CleaningConfig()) == [text]


@settings(max_examples=200, deadline=None)
@given(texts_strategy)
def test_normalized_key_ignores_case_spacing_and_punctuation(values):
    keys = normalized_key(pa.array(values, pa.string())).to_pylist()
    variants = normalized_key(pa.array([f"  {v.upper()} !! " for v in values], pa.string())).to_pylist()
    for value, key, variant in zip(values, keys, variants, strict=False):
        if value.upper().lower() == value.lower():  # case round-trips (not e.g. 'ß' -> 'SS')
            assert key == variant
        assert normalized_key(pa.array([key], pa.string())).to_pylist() == [key]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "A!", "c", " b "]), max_size=30))
def test_first_occurrences_keep_exactly_one_row_per_key(values):
    keys = normalized_key(pa.array(values, pa.string()))
    kept = first_occurrences(key_hashes(pa.array(values, pa.string()), "normalized"))
    kept_keys = [keys[int(i)].as_py() for i in kept]
    assert sorted(set(kept_keys)) == sorted(kept_keys) == sorted(set(keys.to_pylist()))
    assert list(kept) == sorted(kept) and all(keys.to_pylist().index(k) == i for k, i in zip(kept_keys, kept, strict=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(LABELS[:3])), max_size=20))
def test_conflicting_labels_counts_texts_with_several_labels(rows):
    texts = pa.array([t for t, _ in rows], pa.string())
    labels = pa.chunked_array([pa.array([label for _, label in rows], pa.string())])
    expected = sum(len({label for t, label in rows if t == text}) > 1 for text in {t for t, _ in rows})
    assert conflicting_labels(key_hashes(texts, "exact"), codes(labels)) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=20), st.lists(st.sampled_from(["a", "b", "x"]), max_size=20))
def test_occurs_in_marks_exactly_the_shared_rows(evals, train):
    mask = occurs_in(key_hashes(pa.array(evals, pa.string()), "exact"), key_hashes(pa.array(train, pa.string()), "exact"))
    assert mask.tolist() == [e in train for e in evals]


# --------------------------------------------------------------------------------------------------
# Steps through load_data, counted in the report


def _folder(tmp_path, train, validation=None, test=None):
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "validation.jsonl", validation or make_rows(2, seed=2))
    write_jsonl(tmp_path / "test.jsonl", test or make_rows(2, seed=3))
    return str(tmp_path)


def test_steps_are_counted_per_split(tmp_path):
    train = make_rows(4, seed=1)
    train += [{"text": "  ", "label": "joy"}, {"text": train[0]["text"].upper() + "!", "label": train[0]["label"]},
              {"text": train[1]["text"], "label": "anger" if train[1]["label"] != "anger" else "joy"},
              {"text": "see http://a.b @me now 😀", "label": "joy"}]
    test = make_rows(2, seed=3) + [{"text": train[2]["text"] + " ", "label": train[2]["label"]}]
    cfg = DataConfig(source=_folder(tmp_path, train, test=test),
                     cleaning=CleaningConfig(urls="drop", mentions="drop", emoji="drop"))
    data = load_data(cfg, seed=0)
    cleaning = data.report["cleaning"]
    assert cleaning["changed"]["urls"]["train"] == 1 and cleaning["changed"]["mentions"]["train"] == 1
    assert cleaning["changed"]["emoji"]["train"] == 1 and cleaning["changed"]["whitespace"]["test"] == 1
    assert cleaning["dropped"]["too_short"]["train"] == 1
    assert cleaning["dropped"]["duplicates"]["train"] == 2 and cleaning["conflicting_labels"]["train"] == 1
    assert cleaning["dropped"]["leakage"]["test"] == 1
    assert "see now" in data.splits["train"]["text"]
    assert data.report["rows"] == {"train": 25, "validation": 12, "test": 12}

    exact = load_data(cfg.model_copy(update={"cleaning": CleaningConfig(duplicates="exact", leakage="exact")}), seed=0)
    assert exact.report["cleaning"]["dropped"]["duplicates"]["train"] == 1  # the upper-case copy differs exactly


def test_long_rows_drop_or_truncate_at_the_token_limit(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train = make_rows(3, seed=1) + [{"text": "i am so happy today " * 5, "label": "joy"}]
    source = _folder(tmp_path, train)
    drop = load_data(DataConfig(source=source, cleaning=CleaningConfig(long_rows="drop", max_tokens=8)), 0, tokenizer)
    assert drop.report["cleaning"]["dropped"]["too_long"]["train"] == 1
    cut = load_data(DataConfig(source=source, cleaning=CleaningConfig(long_rows="truncate", max_tokens=8)), 0, tokenizer)
    assert cut.report["cleaning"]["truncated"]["train"] == 1
    assert "i am so happy today i am so" in cut.splits["train"]["text"]
    with pytest.raises(Exception, match="needs the model's tokenizer"):
        load_data(DataConfig(source=source, cleaning=CleaningConfig(long_rows="drop")), 0)


def test_limits_are_stratified_reproducible_per_split(tmp_path):
    cfg = DataConfig(source=_folder(tmp_path, make_rows(20, 1), make_rows(10, 2), make_rows(10, 3)),
                     train_limit=30, validation_limit=12, test_limit=18)
    data = load_data(cfg, seed=5)
    assert data.report["rows"] == {"train": 30, "validation": 12, "test": 18}
    assert all(set(n.values()) == {v} for n, v in zip(data.counts().values(), (5, 2, 3), strict=False))
    assert load_data(cfg, seed=5).splits["test"]["text"] == data.splits["test"]["text"]
    assert load_data(cfg, seed=6).splits["test"]["text"] != data.splits["test"]["text"]


def test_single_file_is_split_80_10_10_stratified(tmp_path):
    write_jsonl(tmp_path / "all.jsonl", make_rows(20, seed=1))
    data = load_data(DataConfig(source=str(tmp_path / "all.jsonl")), seed=0)
    assert data.report["rows"] == {"train": 96, "validation": 12, "test": 12}
    assert data.report["split"] == "stratified 80/10/10, seed 0"
    assert all(set(n.values()) == {v} for n, v in zip(data.counts().values(), (16, 2, 2), strict=False))


def _imbalanced(tmp_path):
    train = [r for r in make_rows(8, seed=1) if r["label"] != "surprise"] + make_rows(2, seed=9)[:4]
    return _folder(tmp_path, train)


def test_oversampling_balances_the_training_split_only(tmp_path):
    data = load_data(DataConfig(source=_imbalanced(tmp_path), balance="oversample"), seed=0)
    train_counts = data.counts()["train"]
    assert len(set(train_counts.values())) == 1
    assert data.report["balance"]["rows_added"] == sum(train_counts.values()) - data.report["rows_read"]["train"] + \
        data.report["cleaning"]["dropped"]["duplicates"]["train"]
    assert data.counts()["test"] == {label: 2 for label in LABELS}
    assert data.class_weights is None


def test_class_weights_are_exposed_for_the_trainer(tmp_path):
    data = load_data(DataConfig(source=_imbalanced(tmp_path), balance="class_weight"), seed=0)
    counts = data.counts()["train"]
    total = sum(counts.values())
    assert data.class_weights == {label: pytest.approx(total / (len(LABELS) * counts[label])) for label in LABELS}
    assert data.class_weights["surprise"] > data.class_weights["joy"]
    assert sum(counts.values()) == data.report["rows"]["train"]  # rows untouched
