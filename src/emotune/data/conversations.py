"""Instruction rows in their three common formats, normalised into one conversation shape.

    alpaca     instruction, input, output (+ optional system, history of [instruction, answer] pairs)
    sharegpt   conversations: [{from: human|gpt|function_call|observation|system, value}], + system, tools
    messages   OpenAI-style messages: [{role: system|user|assistant|tool, content}]

Column and tag names follow LLaMA-Factory's `columns` and `tags` (config: data.columns, data.tags), so a
dataset registered for LLaMA-Factory reads the same here. Every row becomes a `Conversation`: a system
prompt (or None), turns alternating user/assistant and ending with the assistant, and the row's kind.
Tool calls count as assistant turns and tool results as user turns, both kept as plain text (LLaMA-Factory
trains on tool calls the same way); a row's tool descriptions are appended to its system prompt as text.

A malformed row is not an exception here: `normalise` returns the reason, and the caller reports every
bad row at once (or skips them, with data.skip_bad_rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from emotune.core.config.sft import SftColumns, SftTags

FORMATS = ("alpaca", "sharegpt", "messages")
OPENAI_TAGS = SftTags(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant",
                      observation_tag="tool", function_tag="function_call", system_tag="system")

# Reasons a row is refused; the keys group rows in the error message.
EMPTY_RESPONSE = "the response (last assistant turn) is empty"
EMPTY_PROMPT = "a user turn is empty"
NOT_ALTERNATING = "the turns do not alternate user/assistant, starting with the user and ending with the assistant"
BAD_HISTORY = "`history` is not a list of [instruction, answer] pairs"
BAD_TURNS = "the turns are not a list of objects with a role and a text"
UNKNOWN_ROLE = "a turn has a role that is none of the configured tags (data.tags)"


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]
    """(role, text) pairs, role `user` or `assistant`, alternating, first user, last assistant."""
    system: str | None = None
    kind: str | None = None
    source: str = ""
    """The dataset the row came from (a dataset_info.json name, or the file), for mixing and stratifying."""

    def chat(self, default_system: str | None = None, turns: int | None = None) -> list[dict[str, str]]:
        """The chat-template messages: the system prompt (the row's, else `default_system`) and the first
        `turns` turns (all by default)."""
        system = self.system if self.system is not None else default_system
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": role, "content": text} for role, text in self.messages[:turns]]

    @property
    def prompt_turns(self) -> int:
        """Turns before the last answer: the evaluation's prompt."""
        return len(self.messages) - 1

    @property
    def response(self) -> str:
        return self.messages[-1][1]

    def key(self) -> str:
        """The whole conversation as one string, for duplicate and leakage checks."""
        parts = [self.system or ""] + [f"{role}: {text}" for role, text in self.messages]
        return "\n\x1f".join(parts)

    def as_row(self) -> dict:
        return {"system": self.system, "kind": self.kind, "source": self.source,
                "messages": [{"role": r, "content": t} for r, t in self.messages]}

    @classmethod
    def from_row(cls, row: dict) -> Conversation:
        return cls(tuple((m["role"], m["content"]) for m in row["messages"]), row.get("system"), row.get("kind"),
                   row.get("source") or "")


def detect_format(column_names: list[str], first_row: dict | None, columns: SftColumns) -> str | None:
    """`alpaca`, `sharegpt` or `messages` from the columns a file has (None: none of them fits)."""
    for name in dict.fromkeys((columns.messages, "messages", "conversations")):
        if name in column_names:
            turns = (first_row or {}).get(name) or []
            first = next((t for t in turns if isinstance(t, dict)), {})
            return "messages" if "role" in first and "from" not in first else "sharegpt"
    if columns.prompt in column_names or columns.response in column_names:
        return "alpaca"
    return None


def messages_column(fmt: str, columns: SftColumns, column_names: list[str]) -> str:
    """The turns' column: data.columns.messages, or `messages` for the OpenAI format when it was not set."""
    if fmt == "messages" and "messages" not in columns.model_fields_set and columns.messages not in column_names:
        return "messages"
    return columns.messages


def required_columns(fmt: str, columns: SftColumns, column_names: list[str]) -> list[str]:
    if fmt == "alpaca":
        return [columns.prompt, columns.response]
    return [messages_column(fmt, columns, column_names)]


def normalise(row: dict, fmt: str, columns: SftColumns, tags: SftTags, source: str) -> Conversation | str:
    """The row as a Conversation, or the reason it is refused."""
    if fmt == "alpaca":
        found = _alpaca(row, columns)
    else:
        name = columns.messages if columns.messages in row else "messages"
        found = _turns(row.get(name), OPENAI_TAGS if fmt == "messages" else tags, row.get(columns.system))
    if isinstance(found, str):
        return found
    system, messages = found
    tools = _text(row.get(columns.tools))
    if tools and tools.strip() not in ("", "[]"):
        system = (system + "\n\n" if system else "") + "Tools available:\n" + tools
    problem = _check(messages)
    if problem:
        return problem
    kind = row.get(columns.kind)
    return Conversation(tuple(messages), system or None, None if kind is None else str(kind), source)


def _alpaca(row: dict, columns: SftColumns) -> tuple[str | None, list[tuple[str, str]]] | str:
    messages: list[tuple[str, str]] = []
    history = row.get(columns.history) or []
    if not isinstance(history, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in history):
        return BAD_HISTORY
    for question, answer in history:
        messages += [("user", _text(question)), ("assistant", _text(answer))]
    prompt = _text(row.get(columns.prompt))
    query = _text(row.get(columns.query))
    messages.append(("user", "\n\n".join(p for p in (prompt, query) if p.strip())))
    messages.append(("assistant", _text(row.get(columns.response))))
    return _text(row.get(columns.system)) or None, messages


def _turns(turns, tags: SftTags, system: object) -> tuple[str | None, list[tuple[str, str]]] | str:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return BAD_TURNS
    user_side, assistant_side = {tags.user_tag, tags.observation_tag}, {tags.assistant_tag, tags.function_tag}
    system_text = _text(system) or None
    messages = []
    for i, turn in enumerate(turns):
        role = turn.get(tags.role_tag)
        text = _content(turn, tags)
        if role == tags.system_tag and i == 0:
            system_text = text or system_text
        elif role in user_side:
            messages.append(("user", text))
        elif role in assistant_side:
            messages.append(("assistant", text))
        else:
            return UNKNOWN_ROLE
    return system_text, messages


def _content(turn: dict, tags: SftTags) -> str:
    """A turn's text; OpenAI content parts are joined, and tool calls without text are kept as their JSON."""
    content = turn.get(tags.content_tag)
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    if not content and turn.get("tool_calls"):
        content = json.dumps(turn["tool_calls"], ensure_ascii=False)
    return _text(content)


def _check(messages: list[tuple[str, str]]) -> str | None:
    roles = [role for role, _ in messages]
    if not roles or len(roles) % 2 or any(role != ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles)):
        return NOT_ALTERNATING
    if not messages[-1][1].strip():
        return EMPTY_RESPONSE
    if any(not text.strip() for role, text in messages if role == "user"):
        return EMPTY_PROMPT
    return None


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)  # tools given as a list, a number as an answer
