"""`data:` and `prompt:` for the classification tasks: the source, cleaning, splits and the prompt a row is asked in."""

from __future__ import annotations

import codecs
import unicodedata
from typing import Annotated, Literal

from pydantic import field_validator, model_validator

from emotune.core.config.base import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_TEMPLATE,
    HeldOut,
    Range,
    Section,
    named_source,
)

TextAction = Literal["keep", "replace", "drop"]
MarkupAction = Literal["keep", "unwrap", "drop"]


class CleaningConfig(Section):
    """Each cleaning step can be switched off; every step's effect is counted in data_report.json."""

    unicode_nfc: bool = True
    """Normalise text to Unicode NFC, so the same word is always the same code points (run last, after
    the other text steps, so their removals cannot leave text un-normalised)."""
    control_chars: bool = True
    """Remove control and invisible format characters (NUL, C1 controls, zero-width space, bidi marks,
    BOM). Whitespace-like controls (tab, newline, ...) are left to `whitespace`."""
    whitespace: bool = True
    """Collapse every run of whitespace (newlines, tabs, non-breaking and ideographic spaces) into one
    space and trim both ends."""
    urls: TextAction = "keep"
    """URLs (`http://`, `https://`, `www.`): keep, replace with `<url>`, or drop from the text."""
    mentions: TextAction = "keep"
    """@mentions (names in any script, up to the next space or punctuation mark): keep, replace with `@user`, or
    drop from the text (e-mail addresses are untouched)."""
    emoji: TextAction = "keep"
    """Emoji (each run of them): keep, replace with `<emoji>`, or drop from the text."""
    unicode_nfkc: bool = False
    """Fold compatibility forms with Unicode NFKC, first of the text steps: full-width letters, digits and
    punctuation become ASCII (`ＡＰＰ２０２６！` -> `APP2026!`, also `，` -> `,`), so later steps and the
    tokenizer see one form. Off by default (it also rewrites ligatures, superscripts and the like)."""
    weibo_reposts: MarkupAction = "keep"
    """Weibo repost chains `我的话 //@name: 上一条 //@name: ...`: keep; `drop` the chain, keeping only the poster's own
    text before the first `//@name:` (a row that is only a chain becomes empty, and `min_chars` drops it); or
    `unwrap`: remove the `//@name:` markers and keep every text of the chain. Runs before `mentions`."""
    weibo_topics: MarkupAction = "keep"
    """Weibo topic tags `#话题#`: keep, `unwrap` (keep the topic's words, drop the two `#`), or `drop` the whole
    tag. A `#` right after an ASCII letter or digit (`C#`, `5#楼`) or without a closing `#` on the line is
    never a tag."""
    weibo_emoticons: MarkupAction = "keep"
    """Weibo emoticon codes such as `[哈哈]`, `[泪]`, `[doge]`: keep, `unwrap` (keep the word, `哈哈`), or `drop`.
    A code is 1-8 Chinese characters (or 2-8 letters) in brackets, possibly with digits after the first
    character; `[1]`, `[a]` and `[see note]` are not codes."""
    min_chars: Annotated[int, Range(0)] = 1
    """Drop rows whose cleaned text has fewer characters than this; 1 drops empty rows, 0 keeps them."""
    long_rows: Literal["keep", "drop", "truncate"] = "keep"
    """Rows longer than `max_tokens` tokens of the model's tokenizer: keep them, drop them, or cut them
    at the limit (loads the tokenizer only, never the weights)."""
    max_tokens: Annotated[int, Range(1)] = 192
    """Token limit for `long_rows`; keep it below train.max_length minus the prompt's own tokens."""
    duplicates: Literal["keep", "exact", "normalized"] = "normalized"
    """Repeated texts inside a split (the first is kept): `exact` = the same text after cleaning;
    `normalized` = also ignoring case, punctuation, symbols and spacing; `keep` = no check."""
    leakage: Literal["keep", "exact", "normalized"] = "normalized"
    """Validation and test rows whose text also occurs in train are removed from those splits, so they
    cannot inflate the measurement; matched `exact` or `normalized` as for `duplicates`; `keep` = no check."""


class DataConfig(Section):
    source: str = "embedded"
    """Labelled data: `embedded` (the packaged English emotion dataset, also `embedded:emotion`),
    `embedded:emotion_zh` (the packaged Chinese 7-class dataset: 喜悦 愤怒 悲伤 恐惧 惊讶 厌恶 中性); a folder of split files (`train.*`,
    `validation.*`/`val.*`/`dev.*`, `test.*`, shards like `train-00000-of-00002.parquet` too); a folder
    saved with `datasets`' `save_to_disk`; one file that is split by `validation_size`/`test_size`; or a hub
    dataset, `hf:dair-ai/emotion` or `modelscope:AI-ModelScope/emotion` (its Parquet files, else its JSON/JSONL/CSV/TSV
    files, downloaded once into `cache_dir`). Files: CSV, TSV, JSONL, JSON, Parquet, or TXT with one `text;label` per line,
    also gzip-, bz2- or xz-compressed (train.jsonl.gz)."""
    text_column: str = "text"
    """Column holding the text to classify."""
    label_column: str = "label"
    """Column holding the label: a name, or an integer id into `label_names`."""
    label_names: list[str] | None = None
    """Label names in id order. Required for integer labels without a `ClassLabel`; for name labels it
    fixes the order (and so the order in reports). Default: the dataset's `ClassLabel` names, else the
    names found, sorted."""
    label_aliases: dict[str, str] = {}
    """Other spellings of a label, mapped to its name, e.g. {happy: joy, 开心: 喜悦}. Case and
    surrounding whitespace never matter (`Joy `, `JOY` and `joy` are one label)."""
    encoding: str = "utf-8"
    """Text encoding of CSV, TSV, JSON, JSONL and TXT files, e.g. `latin-1`, `cp1252`, `gbk`."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for `hf:` and `modelscope:` sources; null = the default branch."""
    cache_dir: str | None = None
    """Where hub datasets are downloaded; default: `datasets/` in the user cache dir (`~/.cache/emotune`)."""
    validation_size: HeldOut = 0.1
    """Rows held out for validation when the source has no validation split: a share of them (0.1) or a count (500),
    as scikit-learn's and `datasets`' train_test_split read `test_size`."""
    test_size: HeldOut = 0.1
    """Rows held out for testing when the source has no test split: a share of them (0.1) or a count (500)."""
    train_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many training rows (stratified, seeded sample); null = all."""
    validation_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many validation rows (stratified, seeded sample); null = all."""
    test_limit: Annotated[int | None, Range(1, also="or null for all rows")] = None
    """Use at most this many test rows (stratified, seeded sample); null = all."""
    balance: Literal["none", "oversample", "class_weight"] = "none"
    """Class balancing of the training split: `oversample` repeats rows of smaller classes (seeded) up to
    the largest class; `class_weight` leaves the rows alone and computes per-class loss weights
    (n / (classes x n_class), in data_report.json) that weight each training row's completion loss."""
    cleaning: CleaningConfig = CleaningConfig()
    _named = field_validator("source")(named_source)

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        return known_encoding(value)

    @model_validator(mode="after")
    def _text_is_not_the_label(self) -> DataConfig:
        """One column as both gave every text its own label ("labels [...] have no training rows"), or trained
        the model to repeat the label it was shown."""
        if self.text_column == self.label_column:
            raise ValueError(f"data.text_column and data.label_column name the same column `{self.text_column}`; "
                             "point each at its own column")
        return self

    @field_validator("label_names")
    @classmethod
    def _distinct_names(cls, names: list[str] | None) -> list[str] | None:
        """Labels are matched ignoring case, surrounding whitespace and Unicode form, so `joy` and `Joy ` are one
        label, and so are `café` composed and `cafe` + a combining accent."""
        if names is None:
            return None
        if any(not name.strip() for name in names):
            raise ValueError("holds an empty name; every label needs one")
        keys = [unicodedata.normalize("NFC", name.strip()).casefold() for name in names]
        twice = sorted({name for name, key in zip(names, keys, strict=True) if keys.count(key) > 1})
        if twice:
            raise ValueError(f"names {twice} as more than one label, but case and surrounding whitespace never "
                             "matter; give each label once")
        return names


def known_encoding(value: str) -> str:
    try:
        codecs.lookup(value)
    except LookupError:
        raise ValueError("is not an encoding Python knows; use e.g. utf-8, latin-1, cp1252 or gbk") from None
    return value


class PromptConfig(Section):
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System prompt shared by training and both evaluations. `{labels}` is replaced by the data's
    label names, comma-separated (each in double quotes when a name holds a comma)."""
    user_template: str = DEFAULT_USER_TEMPLATE
    """User turn; `{text}` is replaced by the row's text."""

    @field_validator("user_template")
    @classmethod
    def _has_text(cls, value: str) -> str:
        if "{text}" not in value:
            raise ValueError("must contain `{text}`, where the row's text goes")
        return value


# lora.layers as a count: any model's layers fit these bounds; the model's own count is checked before weights load.
