"""Cleaning as Arrow compute kernels over batches of rows (RE2 regexes, Unicode normalisation) and
64-bit hashes for duplicate and leakage checks, so a million rows take seconds in flat memory and no
Python loop touches a row.

Text steps run in a fixed order: NFKC first, so the steps after it see one form of `#`, `@` and `[`; the
Weibo steps before `mentions`, which would otherwise rewrite the `@name` of a repost chain; NFC last,
because removing a character can put a combining mark next to a new base letter. Every step returns
what it changed, for the data report.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from emotune.core.config.data import CleaningConfig

# RE2 syntax (Arrow's regex engine): no look-arounds, \x{...} for code points.
CONTROL_CHARS = (r"[\x00-\x08\x0E-\x1B\x7F-\x84\x86-\x9F\x{AD}\x{200B}\x{200E}\x{200F}\x{202A}-\x{202E}"
                 r"\x{2060}-\x{2064}\x{2066}-\x{2069}\x{FEFF}\x{FFF9}-\x{FFFB}]")
WHITESPACE = r"[\s\p{Z}\x0B\x1C-\x1F\x85]+"  # everything Python's str.isspace() accepts
URL = r"(?i)(?:https?://|www\.)[^\s\p{Z}]+"
# Names in any script (`@anna`, `@小王`, `@熬夜冠军-小赵`). Not e-mail addresses: the @ must not follow a Latin letter,
# a digit or `_.+-@`; a Chinese character may come right before a mention, as there are no spaces in Chinese.
MENTION = r"(^|[^\p{Latin}\p{N}_.+@-])@[\p{L}\p{N}\p{M}_-]+"
EMOJI = (r"(?:[\x{1F000}-\x{1FAFF}\x{2600}-\x{27BF}\x{2B00}-\x{2BFF}\x{2300}-\x{23FF}\x{1F1E6}-\x{1F1FF}\x{3030}"
         r"\x{303D}\x{3297}\x{3299}\x{E0020}-\x{E007F}][\x{FE0F}\x{200D}\x{20E3}\x{1F3FB}-\x{1F3FF}]*)+")
PUNCTUATION = r"[\p{P}\p{S}]+"
# Weibo markup, in ASCII and full-width forms (without NFKC the text may hold either).
# A repost chain is the first `//@name:` and all that follows it: the reposted posts, newest first.
WEIBO_REPOST_MARKER = r"[\s\p{Z}]*[/／]{2}[@＠][^\s\p{Z}:：/／]{1,30}[:：][\s\p{Z}]*"
WEIBO_REPOST_CHAIN = r"(?s)" + WEIBO_REPOST_MARKER + ".*"
# `#topic#` on one line, no space just inside either `#`. The first branch consumes a `#` right after an ASCII
# letter or digit (C#, 5#楼) and gives it back unchanged (RE2 has no look-behind), so it never opens a tag.
WEIBO_TOPIC = r"([0-9A-Za-z][#＃])|[#＃]([^#＃\s\p{Z}]|[^#＃\s\p{Z}][^#＃\n]{0,48}[^#＃\s\p{Z}])[#＃]"
# `[哈哈]`, `[泪]`, `[笑cry]`, `[doge]`: Chinese first (1-8 characters), or 2-8 with an ASCII letter first.
WEIBO_EMOTICON = r"[\[［](\p{Han}[\p{Han}A-Za-z0-9]{0,7}|[A-Za-z][\p{Han}A-Za-z0-9]{1,7})[\]］]"
BATCH_ROWS = 65_536
PLACEHOLDERS = {"urls": "<url>", "mentions": "@user", "emoji": "<emoji>"}


def clean_text(texts: pa.Array | pa.ChunkedArray, cfg: CleaningConfig) -> tuple[pa.ChunkedArray, dict[str, int]]:
    """Apply the enabled text steps in order; return the texts and, per step, how many rows it changed."""
    steps = [
        ("control_chars", cfg.control_chars, lambda t: pc.replace_substring_regex(t, CONTROL_CHARS, "")),
        ("unicode_nfkc", cfg.unicode_nfkc, lambda t: pc.utf8_normalize(t, "NFKC")),
        ("weibo_reposts", cfg.weibo_reposts != "keep", lambda t: _reposts(t, cfg.weibo_reposts)),
        ("weibo_topics", cfg.weibo_topics != "keep",
         lambda t: pc.replace_substring_regex(t, WEIBO_TOPIC, r"\1\2" if cfg.weibo_topics == "unwrap" else r"\1")),
        ("weibo_emoticons", cfg.weibo_emoticons != "keep",
         lambda t: pc.replace_substring_regex(t, WEIBO_EMOTICON, r"\1" if cfg.weibo_emoticons == "unwrap" else "")),
        ("urls", cfg.urls != "keep", lambda t: pc.replace_substring_regex(t, URL, _replacement(cfg.urls, "urls"))),
        ("mentions", cfg.mentions != "keep",
         lambda t: pc.replace_substring_regex(t, MENTION, r"\1" + _replacement(cfg.mentions, "mentions"))),
        ("emoji", cfg.emoji != "keep", lambda t: pc.replace_substring_regex(t, EMOJI, _replacement(cfg.emoji, "emoji"))),
        ("whitespace", cfg.whitespace, collapse_whitespace),
        ("unicode_nfc", cfg.unicode_nfc, lambda t: pc.utf8_normalize(t, "NFC")),
    ]
    enabled = [(name, step) for name, on, step in steps if on]
    changed = {name: 0 for name, _ in enabled}
    out = []
    for batch in batches(texts):
        for name, step in enabled:
            cleaned = step(batch)
            changed[name] += int(pc.sum(pc.not_equal(batch, cleaned)).as_py() or 0)
            batch = cleaned
        out.append(batch)
    return pa.chunked_array(out, pa.string()), changed


TEXT_STEPS = ("unicode_nfc", "control_chars", "whitespace", "urls", "mentions", "emoji", "unicode_nfkc", "weibo_reposts",
              "weibo_topics", "weibo_emoticons")
"""The settings of `data.cleaning` that rewrite a text (the rest drop or cut rows): what emotune.json records."""


def text_steps(cfg: CleaningConfig) -> dict:
    """The text-rewriting settings of `cfg`, as emotune.json records them for predict and serve."""
    return {name: getattr(cfg, name) for name in TEXT_STEPS}


def clean_for_inference(texts: list[str], recorded: dict | None) -> list[str]:
    """`texts` sent to a trained model (predict, serve), rewritten by the text steps of the cleaning its training
    and evaluation rows went through (emotune.json's `cleaning`), so it reads them as it read those: by default
    control characters removed, whitespace collapsed, NFC. Row steps (min_chars, long_rows, duplicates) do not
    apply: every text gets an answer, an empty one too. None (a model recorded before this, or another tool's): as
    sent."""
    if not recorded or not texts:
        return texts
    known = {k: v for k, v in recorded.items() if k in TEXT_STEPS}  # a newer emotune's extra steps: skipped
    cleaned, _ = clean_text(pa.array(texts, pa.string()), CleaningConfig(**known))
    return cleaned.to_pylist()


def _reposts(texts: pa.Array, action: str) -> pa.Array:
    """`drop`: the poster's own text, before the chain; `unwrap`: every text, each `//@name:` marker between two
    texts made one space (a marker at the start is removed)."""
    if action == "drop":
        return pc.replace_substring_regex(texts, WEIBO_REPOST_CHAIN, "")
    texts = pc.replace_substring_regex(texts, "^" + WEIBO_REPOST_MARKER, "")
    return pc.replace_substring_regex(texts, WEIBO_REPOST_MARKER, " ")


def batches(values: pa.Array | pa.ChunkedArray, rows: int = BATCH_ROWS):
    """Slices of at most `rows` rows (zero-copy): every kernel's temporaries stay the size of one batch."""
    for start in range(0, len(values), rows):
        piece = values.slice(start, rows)
        yield piece.combine_chunks() if isinstance(piece, pa.ChunkedArray) else piece


def _replacement(action: str, step: str) -> str:
    return PLACEHOLDERS[step] if action == "replace" else ""


def collapse_whitespace(texts: pa.Array) -> pa.Array:
    return _trimmed(pc.replace_substring_regex(texts, WHITESPACE, " "))


def _trimmed(texts: pa.Array) -> pa.Array:
    return pc.utf8_trim(texts, " ")


def normalized_key(texts: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    """The text as a duplicate check sees it: compatibility forms, lower case, no punctuation or symbols,
    single spaces."""
    out = []
    for batch in batches(texts):
        folded = pc.utf8_lower(pc.utf8_normalize(batch, "NFKC"))
        out.append(_trimmed(pc.replace_substring_regex(pc.replace_substring_regex(folded, PUNCTUATION, " "), WHITESPACE, " ")))
    return pa.chunked_array(out, pa.string())


def key_hashes(texts: pa.Array | pa.ChunkedArray, how: str) -> np.ndarray:
    """A 64-bit hash of every row's match key (`exact` text or `normalized` key), batch by batch, so
    duplicate and leakage checks compare integers and never hold a second copy of the texts."""
    from pandas.util import hash_array

    out = [np.zeros(0, np.uint64)]
    for batch in batches(texts):
        keys = normalized_key(batch) if how == "normalized" else batch
        out.append(hash_array(keys.to_numpy(zero_copy_only=False), categorize=False))
    return np.concatenate(out)


def codes(values: pa.ChunkedArray) -> np.ndarray:
    """One small integer per distinct value (for label columns: a handful of distinct values)."""
    encoded = pc.dictionary_encode(values)
    chunks = [chunk.indices.to_numpy(zero_copy_only=False) for chunk in encoded.chunks]
    return np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)


def first_occurrences(keys: np.ndarray) -> np.ndarray:
    """Sorted indices of the first row of every distinct key."""
    _, firsts = np.unique(keys, return_index=True)
    return np.sort(firsts)


def conflicting_labels(keys: np.ndarray, label_codes: np.ndarray) -> int:
    """Distinct texts that carry more than one label (the first row's label is the one kept)."""
    order = np.lexsort((label_codes, keys))
    k, labels = keys[order], label_codes[order]
    same_key = k[1:] == k[:-1]
    key_id = np.concatenate([[0], np.cumsum(~same_key)])
    return len(np.unique(key_id[1:][same_key & (labels[1:] != labels[:-1])]))


def occurs_in(keys: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Boolean mask: which `keys` also occur in `reference`."""
    return np.isin(keys, reference)


def too_short(texts: pa.ChunkedArray, min_chars: int) -> pa.ChunkedArray:
    return pc.less(pc.utf8_length(texts), min_chars)


def token_lengths(texts: list[str], tokenizer, batch_size: int = 4096) -> np.ndarray:
    """Tokens per text with the model's tokenizer (no special tokens: those belong to the prompt)."""
    lengths = []
    for start in range(0, len(texts), batch_size):
        ids = tokenizer(texts[start:start + batch_size], add_special_tokens=False)["input_ids"]
        lengths.extend(len(i) for i in ids)
    return np.asarray(lengths, dtype=np.int64)


def truncate_to_tokens(texts: list[str], tokenizer, max_tokens: int) -> list[str]:
    """Each text cut after its `max_tokens`-th token: at the character offset a fast tokenizer reports,
    else by decoding the kept tokens (slow tokenizers have no offsets)."""
    out = []
    for start in range(0, len(texts), 4096):
        batch = texts[start:start + 4096]
        if not getattr(tokenizer, "is_fast", False):
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
            out.extend(tokenizer.decode(i[:max_tokens]).strip() for i in ids)
            continue
        enc = tokenizer(batch, add_special_tokens=False, truncation=True, max_length=max_tokens,
                        return_offsets_mapping=True)
        for text, offsets in zip(batch, enc["offset_mapping"], strict=False):
            end = max((o[1] for o in offsets), default=0)
            out.append(text[:end].rstrip())
    return out


def _chunked(values: pa.Array | pa.ChunkedArray) -> pa.ChunkedArray:
    return values if isinstance(values, pa.ChunkedArray) else pa.chunked_array([values])
