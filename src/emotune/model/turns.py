"""Where an assistant turn ends, read from the tokenizer's own chat template instead of one family's strings.

Every family closes an assistant turn its own way: Gemma 3 with `<end_of_turn>`, Gemma 4 with `<turn|>`,
Qwen and Phi-4 with `<|im_end|>`, Llama 3 with `<|eot_id|>`, Phi-3 with `<|end|>`, Mistral with the EOS
token `</s>`. Training learns whatever the template writes after the answer, so the same closing is what
label scoring appends to a label, what generation stops on and what an exported model's generation
config lists. `turn_end` renders a one-exchange conversation whose answer is a marker and reads the text
after the marker; its first token, when the tokenizer treats it as a single special or added token, is the
end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass

# An answer no template trims or rewrites (no whitespace, no thinking tags), found again in the rendering.
MARKER = "emotuneAnswerMarker"


@dataclass(frozen=True)
class TurnEnd:
    """How the chat template closes an assistant turn."""

    suffix: str
    """Everything the template writes after the assistant's content (`<turn|>\\n`, `<|im_end|>\\n`, `</s>`);
    empty when the tokenizer has no chat template or it could not be rendered."""
    token: str | None
    """The token that ends the turn (the suffix's first token), None when that is not one special or added
    token of the vocabulary (a template that closes turns with plain text, or none at all)."""
    token_id: int | None
    """`token`'s id, None with it."""


def turn_end(tokenizer) -> TurnEnd:
    """How `tokenizer`'s chat template ends an assistant turn (see the module docstring)."""
    suffix = _rendered_suffix(tokenizer)
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    first = next((i for i in ids if tokenizer.decode([i]).strip()), None)
    if first is None or not _is_single_special(tokenizer, first):
        return TurnEnd(suffix, None, None)
    return TurnEnd(suffix, tokenizer.convert_ids_to_tokens(first), first)


def end_of_turn_text(tokenizer) -> str:
    """The text a completion ends with, as training saw it: the end-of-turn token, else the EOS token, else ''."""
    return turn_end(tokenizer).token or tokenizer.eos_token or ""


def stop_text(tokenizer) -> str:
    """The text generation stops at where the chat template closes an answer with plain text only (the fallback Gemma
    format on a tokenizer without `<end_of_turn>`: `<end_of_turn>` as 6 ordinary tokens; an `### End` template):
    training teaches that text and no token after it, so no stop token ever follows. '' where a token ends the turn."""
    ending = turn_end(tokenizer)
    return ending.suffix.strip() if ending.token is None else ""


def answer_end(tokenizer) -> str:
    """What a trained answer ends with: everything the chat template writes after an assistant's content
    (`<end_of_turn>\\n`, `<turn|>\\n`, `</s>`), else the EOS token, else ''."""
    return turn_end(tokenizer).suffix or tokenizer.eos_token or ""


def answer_opening(tokenizer) -> str:
    """The whitespace a chat template writes between its generation prompt and an answer's content: Llama 2's and
    Mistral v0.3's templates end the prompt at `[/INST]` and write an answer as ` ` + content, so their models read
    `▁joy`, not `joy`, after it. '' for templates that open the answer in the generation prompt itself, and for any
    opening that is more than whitespace (Qwen3's empty <think> block is left out, as scoring's prompt asks without it)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    asked = [{"role": "user", "content": "hi"}]
    try:
        prompt = tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
        answered = tokenizer.apply_chat_template([*asked, {"role": "assistant", "content": MARKER}], tokenize=False,
                                                 add_generation_prompt=False)
    except Exception:  # noqa: BLE001 (as _rendered_suffix: a template that cannot render a plain exchange)
        return ""
    if not (isinstance(prompt, str) and isinstance(answered, str)) or MARKER not in answered:
        return ""
    before = answered[:answered.rfind(MARKER)]
    opening = before[len(prompt):] if before.startswith(prompt) else ""
    return opening if not opening.strip() else ""


def continuation_ids(tokenizer, prompt_text: str, prompt_ids: list[int], text: str) -> list[int]:
    """`text`'s tokens as the model reads them right after `prompt_text` (tokenized as `prompt_ids`): cut from the
    tokenization of both together, so a tokenizer that would merge across the boundary is read as it runs; `text`
    alone where the joined tokenization changes the prompt's own tokens."""
    full = tokenizer(prompt_text + text, add_special_tokens=False)["input_ids"]
    if full[:len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
        return list(full[len(prompt_ids):])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids generation stops on: the tokenizer's EOS, the chat template's end-of-turn token, and the
    model's generation config EOS ids (Llama 3 lists `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`)."""
    ids: list[int] = []
    configured = getattr(generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, (list, tuple)) else [configured]
    for token_id in (tokenizer.eos_token_id, turn_end(tokenizer).token_id, *configured):
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids


def _rendered_suffix(tokenizer) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return ""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARKER}]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 (jinja2 and the template's own raise_exception: a template that cannot render a
        return ""      # plain exchange has no turn end to read, and the EOS token remains the stop)
    at = rendered.rfind(MARKER) if isinstance(rendered, str) else -1
    return rendered[at + len(MARKER):] if at >= 0 else ""


def _is_single_special(tokenizer, token_id: int) -> bool:
    """Whether `token_id` is a token the tokenizer never splits: a special token or an added token."""
    if token_id in set(tokenizer.all_special_ids):
        return True
    return token_id in getattr(tokenizer, "added_tokens_decoder", {})


def special_texts(tokenizer) -> dict[int, str]:
    """The tokenizer's special tokens (added tokens it never splits), id to text."""
    return {i: token.content for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}


def encode_rendered(tokenizer, rendered: str, contents: list[str]) -> list[int]:
    """`rendered` (a chat template's output) as token ids, with a special token's text typed inside one of the
    messages' `contents` (`<|im_end|>`, `</s>`, found in order in `rendered`) read as plain text, never as the token:
    otherwise a message could close its own turn and open another. Tokens elsewhere are the tokenizer's own."""
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    specials = special_texts(tokenizer)
    if not specials.keys() & set(ids) or not getattr(tokenizer, "is_fast", False):  # a slow tokenizer has no offsets
        return ids
    spans, at = [], 0
    for content in contents:
        text = content.strip() if isinstance(content, str) else ""
        found = rendered.find(text, at) if text and any(s in text for s in specials.values()) else -1
        if found >= 0:
            spans.append((found, found + len(text)))
            at = found + len(text)
    if not spans:
        return ids
    offsets = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return plain_text_specials(tokenizer, rendered, ids, offsets, specials, spans)


def plain_text_specials(tokenizer, rendered: str, ids: list[int], offsets, specials: dict[int, str],
                        spans: list[tuple[int, int]]) -> list[int]:
    """`ids` with every special token read from its own text inside one of `spans` (characters of `rendered`)
    replaced by that text's plain tokens (a byte-fallback token `<0xE5>` read from `喜` stays)."""
    out: list[int] = []
    for token, (start, end) in zip(ids, offsets, strict=True):
        if token in specials and rendered[start:end] == specials[token] and any(a <= start and end <= b for a, b in spans):
            out += tokenizer(rendered[start:end], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        else:
            out.append(token)
    return out


class RenderedChat(str):
    """A chat template's output that keeps its messages' contents, so that whatever tokenizes it reads special-token
    text inside a message as `encode_rendered` does (`ids`)."""

    contents: tuple[str, ...] = ()

    def ids(self, tokenizer) -> list[int]:
        return encode_rendered(tokenizer, str(self), list(self.contents))


def rendered_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> RenderedChat:
    rendered = RenderedChat(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
    rendered.contents = tuple(m.get("content") for m in messages if isinstance(m.get("content"), str))
    return rendered


def chat_ids(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """`messages` through the chat template as token ids (`encode_rendered`: special-token text inside a message is
    plain text)."""
    return rendered_chat(tokenizer, messages, generation_prompt).ids(tokenizer)
