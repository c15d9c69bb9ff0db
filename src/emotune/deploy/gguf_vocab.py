"""The tokenizer as llama.cpp reads it from GGUF metadata: vocabulary, scores or merges, token types, special ids.

Three sources, most faithful first:
- the base model's own GGUF file (the packaged default is one): its `tokenizer.*` fields are copied as they are;
- a SentencePiece `tokenizer.model` (Gemma, Llama 2, Mistral folders from the hub): pieces, scores and types;
- `tokenizer.json`: a byte-level BPE (Llama 3, Qwen) becomes llama.cpp's `gpt2` model with its merges and the
  pre-tokenizer named by its split pattern; a byte-fallback BPE converted from SentencePiece (what transformers
  saves for Gemma) becomes the `llama` model, each piece scored by the rank of the first merge that makes it,
  which is the order SentencePiece's scores put them in. Gemma 4's (the same kind of file) becomes llama.cpp's own
  `gemma4` model instead, as its converter writes it: a BPE over raw UTF-8 with `▁` for spaces, ranked by the merges.
The embedding rows beyond the tokenizer's vocabulary (padding to a multiple of 64 or 128) get `[PAD<i>]` entries
of type UNUSED, as llama.cpp's converter writes them, so the token list matches the embedding matrix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter, TokenType

from emotune.core.errors import UserError

# The split patterns of the byte-level BPE pre-tokenizers llama.cpp knows by name (its `tokenizer.ggml.pre`)
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}
SPECIAL_IDS = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<turn|>", "</s>")
# Gemma 4's thinking-channel and tool-call markers: llama.cpp's chat parser reads them from the detokenized text, so
# they are typed USER_DEFINED (printed) rather than CONTROL (dropped from the output)
GEMMA4_PRINTED_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                                   "<tool_response|>", '<|"|>'})


@dataclass
class Vocab:
    """What `write` puts under `tokenizer.ggml.*`."""

    model: str  # llama.cpp's tokenizer model: `llama` (SentencePiece-style), `gpt2` (byte-level BPE) or `gemma4`
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unknown, padding, eot
    add_bos: bool = False
    add_space_prefix: bool | None = None
    copied: dict | None = None  # fields copied from the base's own GGUF file: (key -> (value, type, subtype))

    def write(self, writer: GGUFWriter) -> None:
        if self.copied:
            for key, (value, vtype, subtype) in self.copied.items():
                writer.add_key_value(key, value, vtype, sub_type=subtype)
            if "eot" in self.special_ids and "tokenizer.ggml.eot_token_id" not in self.copied:
                writer.add_eot_token_id(self.special_ids["eot"])
            return
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unknown": writer.add_unk_token_id,
                  "padding": writer.add_pad_token_id, "eot": writer.add_eot_token_id}
        for name, token_id in self.special_ids.items():
            adders[name](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(False)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)


def build_vocab(model_dir: Path, tokenizer, vocab_size: int, byte_fallback_model: str = "") -> Vocab:
    """The tokenizer of `model_dir` (loaded as `tokenizer`) for an embedding matrix of `vocab_size` rows;
    `byte_fallback_model`: the llama.cpp tokenizer model the family's byte-fallback BPE is written as (`gemma4`),
    "" for the SentencePiece-style `llama` model."""
    source_gguf = _source_gguf(model_dir)
    if source_gguf is not None:
        vocab = _from_gguf(source_gguf, vocab_size)
    elif byte_fallback_model == "gemma4" and (model_dir / "tokenizer.json").is_file():
        vocab = _gemma4_from_tokenizer_json(json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8")),
                                            tokenizer, vocab_size)
    elif (model_dir / "tokenizer.model").is_file():
        vocab = _from_sentencepiece(model_dir / "tokenizer.model", tokenizer, vocab_size)
    elif (model_dir / "tokenizer.json").is_file():
        vocab = _from_tokenizer_json(json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8")), tokenizer,
                                     vocab_size)
    else:
        raise UserError(f"`{model_dir}` has neither tokenizer.model nor tokenizer.json, so its vocabulary cannot be "
                        "written into the GGUF file. Export from a base model folder that has its tokenizer files.")
    vocab.special_ids.update(_special_ids(tokenizer))
    return vocab


def _source_gguf(model_dir: Path) -> Path | None:
    """The GGUF file a converted base folder came from (emotune.model.loading writes emotune_source.json beside it)."""
    record = model_dir / "emotune_source.json"
    if not record.is_file():
        return None
    path = Path(json.loads(record.read_text(encoding="utf-8")).get("gguf", ""))
    return path if path.is_file() else None


def _from_gguf(path: Path, vocab_size: int) -> Vocab:
    reader = GGUFReader(path)
    copied = {}
    for key, reader_field in reader.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        vtype = reader_field.types[0]
        subtype = reader_field.types[-1] if vtype == GGUFValueType.ARRAY else None
        copied[key] = (reader_field.contents(), vtype, subtype)
    tokens = copied["tokenizer.ggml.tokens"][0]
    if len(tokens) != vocab_size:
        raise UserError(f"The base model's GGUF file `{path}` has {len(tokens)} tokens but the model's embedding has "
                        f"{vocab_size} rows, so its tokenizer does not fit this model. Export from the base's own folder.")
    return Vocab(model=copied["tokenizer.ggml.model"][0], pre=str(copied.get("tokenizer.ggml.pre", ("default",))[0]),
                 tokens=list(tokens), types=[], copied=copied)


def _token_type(token: str, token_id: int, added: dict[int, bool]) -> int:
    if token_id in added:
        return TokenType.CONTROL if added[token_id] else TokenType.USER_DEFINED
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return TokenType.BYTE
    return TokenType.NORMAL


def _padded(tokens: list[str], types: list[int], scores: list[float] | None, vocab_size: int) -> None:
    if len(tokens) > vocab_size:
        raise UserError(f"The tokenizer has {len(tokens)} tokens but the model's embedding only {vocab_size} rows; the "
                        "tokenizer does not belong to this model. Export with the base model's own tokenizer.")
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(TokenType.UNUSED)
        if scores is not None:
            scores.append(-1000.0)


def _added(tokenizer) -> dict[int, tuple[str, bool]]:
    """Added tokens by id: (text, special). They are matched whole, never split."""
    return {i: (t.content, bool(t.special)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}


def _adds_space_prefix(tokenizer) -> bool:
    """Whether SentencePiece-style tokenization puts `▁` before the first word (Llama 2, Mistral; not Gemma)."""
    pieces = tokenizer.tokenize("a")
    return bool(pieces) and pieces[0].startswith("\u2581")


def _from_sentencepiece(path: Path, tokenizer, vocab_size: int) -> Vocab:
    from sentencepiece import SentencePieceProcessor

    processor = SentencePieceProcessor(model_file=str(path))
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        tokens.append(processor.id_to_piece(i))
        scores.append(processor.get_score(i))
        types.append(TokenType.UNKNOWN if processor.is_unknown(i) else TokenType.CONTROL if processor.is_control(i)
                     else TokenType.UNUSED if processor.is_unused(i) else TokenType.BYTE if processor.is_byte(i)
                     else TokenType.NORMAL)
    for token_id, (text, special) in sorted(_added(tokenizer).items()):
        while token_id >= len(tokens):  # added after the SentencePiece model (e.g. chat markers)
            tokens.append(f"[PAD{len(tokens)}]")
            scores.append(-1000.0)
            types.append(TokenType.UNUSED)
        tokens[token_id] = text
        types[token_id] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    _padded(tokens, types, scores, vocab_size)
    return Vocab(model="llama", pre="default", tokens=tokens, types=types, scores=scores,
                 add_bos=bool(getattr(tokenizer, "add_bos_token", True)), add_space_prefix=_adds_space_prefix(tokenizer))


def _from_tokenizer_json(spec: dict, tokenizer, vocab_size: int) -> Vocab:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"The tokenizer is a {model.get('type')} tokenizer; llama.cpp reads BPE and SentencePiece "
                        "vocabularies only, so it cannot go into a GGUF file. Export a model whose tokenizer is one of those.")
    added = _added(tokenizer)
    vocab = {**model["vocab"], **{text: i for i, (text, _) in added.items()}}
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    types = [_token_type(text, i, {i: special for i, (_, special) in added.items()}) for i, text in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if model.get("byte_fallback"):  # SentencePiece converted to BPE (Gemma): the llama model, scored by merge rank
        scores = _scores_from_merges(tokens, merges)
        _padded(tokens, types, scores, vocab_size)
        return Vocab(model="llama", pre="default", tokens=tokens, types=types, scores=scores,
                     add_bos=bool(getattr(tokenizer, "add_bos_token", True)), add_space_prefix=_adds_space_prefix(tokenizer))
    _padded(tokens, types, None, vocab_size)
    return Vocab(model="gpt2", pre=_pre_tokenizer_name(spec), tokens=tokens, types=types, merges=merges,
                 add_bos=bool(getattr(tokenizer, "add_bos_token", False)))


def _gemma4_from_tokenizer_json(spec: dict, tokenizer, vocab_size: int) -> Vocab:
    """llama.cpp's `gemma4` tokenizer: the pieces (with `▁` for spaces) and merges as they are, byte pieces <0xXX>."""
    vocab = _from_tokenizer_json(spec, tokenizer, vocab_size)
    if vocab.model != "llama":  # not a byte-fallback BPE: llama.cpp's gemma4 tokenizer would split it differently
        raise UserError("This Gemma 4 tokenizer is not a byte-fallback BPE (Gemma 4's own tokenizer.json is one), so "
                        "llama.cpp's gemma4 tokenizer would not reproduce it. Export with the base model's own tokenizer.")
    types = [TokenType.USER_DEFINED if token in GEMMA4_PRINTED_TOKENS else kind
             for token, kind in zip(vocab.tokens, vocab.types, strict=True)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    # add_bos: llama.cpp prepends <bos> for the gemma4 tokenizer whatever the file says; say so in the file too
    return Vocab(model="gemma4", pre="gemma4", tokens=vocab.tokens, types=types, scores=vocab.scores, merges=merges,
                 add_bos=True, add_space_prefix=False)


def _scores_from_merges(tokens: list[str], merges: list[str]) -> list[float]:
    """SentencePiece merges the adjacent pair whose joined piece scores highest; BPE merges in rank order. A piece
    made by merge k gets score -k, so llama.cpp's SentencePiece tokenizer joins pieces in the merges' order."""
    rank = {}
    for k, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), k)
    return [-float(rank[t]) if t in rank else 0.0 for t in tokens]


def _pre_tokenizer_name(spec: dict) -> str:
    patterns = []
    stack = [spec.get("pre_tokenizer") or {}]
    while stack:
        node = stack.pop()
        stack.extend(node.get("pretokenizers", []))
        pattern = (node.get("pattern") or {}).get("Regex")
        if pattern:
            patterns.append(pattern)
    for pattern in patterns:
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    if not patterns and (spec.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        return "gpt-2"
    raise UserError(f"The tokenizer splits text with a pattern llama.cpp has no name for ({patterns[:1]}), so "
                    f"llama.cpp would pre-tokenize differently from training. Known: {sorted(set(PRE_TOKENIZERS.values()))}.")


def _special_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for name, attribute in SPECIAL_IDS.items():
        token_id = getattr(tokenizer, f"{attribute}_id", None)
        if token_id is not None:
            ids[name] = int(token_id)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in vocab and vocab[token] != ids.get("eos"):
            ids["eot"] = vocab[token]
            break
    return ids
