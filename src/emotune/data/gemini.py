"""Google's Gemini tuning rows (Vertex AI supervised tuning JSONL) as OpenAI-style messages rows.

    {"systemInstruction": {"role": "system", "parts": [{"text": ...}]},
     "contents": [{"role": "user", "parts": [{"text": ...}]}, {"role": "model", "parts": [{"text": ...}]}]}

`model` turns are answers; a `functionCall` part is the answer's tool call and a `functionResponse` part a tool's result,
both kept as their JSON as emotune keeps OpenAI's; media parts (`inlineData`, `fileData`) stay parts that are not text,
which the sft task refuses by name.
"""

from __future__ import annotations

import json

CONTENTS, SYSTEM_INSTRUCTION = "contents", "systemInstruction"
ROLES = {"model": "assistant", "function": "tool"}


def is_gemini(names: list[str], rows: list[dict]) -> bool:
    """A `contents` column of turns with `parts`, and no column the other formats read turns from."""
    if CONTENTS not in names or {"messages", "conversations"} & set(names):
        return False
    turns = (t for row in rows if isinstance(row.get(CONTENTS), list) for t in row[CONTENTS])
    first = next((t for t in turns if isinstance(t, dict)), {})
    return "parts" in first


def as_messages(rows: list[dict], system: str) -> list[dict]:
    """Each row with `messages` in place of `contents` and its `system` column (data.columns.system) in place of
    `systemInstruction` (its other columns, such as `tools`, as they are); a `contents` that is no list stays what it
    is, for the row to be refused."""
    out = []
    for row in rows:
        rest = {k: v for k, v in row.items() if k not in (CONTENTS, SYSTEM_INSTRUCTION)}
        turns = row.get(CONTENTS)
        messages = [_turn(t) if isinstance(t, dict) else t for t in turns] if isinstance(turns, list) else turns
        out.append({**rest, "messages": messages, **({system: row[SYSTEM_INSTRUCTION]} if SYSTEM_INSTRUCTION in row else {})})
    return out


def _turn(turn: dict) -> dict:
    parts = [p for p in turn.get("parts") or [] if isinstance(p, dict)]
    out = {"role": ROLES.get(turn.get("role"), turn.get("role")),
           "content": [_part(p) for p in parts if "functionCall" not in p]}
    calls = [p["functionCall"] for p in parts if "functionCall" in p]
    if calls:
        out["tool_calls"] = calls
    return out


def _part(part: dict) -> dict:
    if isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if "functionResponse" in part:
        return {"type": "text", "text": json.dumps(part["functionResponse"], ensure_ascii=False)}
    return {"type": next(iter(part), "unknown")}  # inlineData, fileData: media
