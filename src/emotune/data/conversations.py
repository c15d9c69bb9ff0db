"""Instruction rows in their three common formats, normalised into one conversation shape.

    alpaca     instruction, input, output (+ optional system, history of [instruction, answer] pairs)
    sharegpt   conversations: [{from: human|gpt|function_call|observation|system, value}], + system, tools
    messages   OpenAI-style messages: [{role: system|user|assistant|tool, content}]; also TRL's `prompt` and
               `completion` columns (each a text or a list of such messages), trained on the completion only

Column and tag names follow LLaMA-Factory's `columns` and `tags` (config: data.columns, data.tags), so a
dataset registered for LLaMA-Factory reads the same here. Every row becomes a `Conversation`: a system
prompt (or None), turns alternating user/assistant and ending with the assistant, and the row's kind. An Alpaca
row's instruction and input become one user turn, joined by data.input_separator (a blank line; one newline in a
translated LLaMA-Factory config, as LLaMA-Factory joins them).
Tool calls count as assistant turns and tool results as user turns (the results of parallel calls, one after
another, as one), both kept as plain text (LLaMA-Factory trains on tool calls the same way); a row's tool
descriptions are appended to its system prompt as text.

A malformed row is not an exception here: `normalise` returns the reason, and the caller reports every
bad row at once (or skips them, with data.skip_bad_rows).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from emotune.core.config.sft import INPUT_SEPARATOR, SftColumns, SftTags
from emotune.core.errors import listed
from emotune.data.roles import OPENAI_TAGS, SHAREGPT_TAGS, role_reader, role_sides, unknown_role

FORMATS = ("alpaca", "sharegpt", "messages")

# Reasons a row is refused; the keys group rows in the error message.
EMPTY_RESPONSE = "the response (last assistant turn) is empty"
EMPTY_PROMPT = "a user turn is empty"
EMPTY_ANSWER = ("an earlier assistant turn is empty (no text and no tool calls): it would train the model to answer that "
                "turn with nothing; give it its answer, or start the row after it")
NOT_ALTERNATING = "the turns do not alternate user/assistant, starting with the user and ending with the assistant"
NO_ANSWER = ("the conversation ends with a user turn, so it has no answer to train on (a prompt without its response, as in "
             "evaluation or reinforcement fine-tuning data); add the answer as a last assistant turn, or remove the row")
BAD_HISTORY = "`history` is not a list of [instruction, answer] pairs"
BAD_TURNS = "the turns are not a list of objects with a role and a text"
LATE_SYSTEM = ("a system turn comes after the first turn; a system prompt goes first (or in the row's `system` "
               "column)")
BAD_WEIGHT = "an assistant turn has a `weight` other than 0 or 1 (OpenAI's fine-tuning format allows only those)"
UNTRAINED_RESPONSE = ("the last assistant turn has weight 0 (or training: false): the response that evaluation measures would not be "
                      "trained on; give it weight 1 or remove the row")
MEDIA = ("the row holds images, audio or video (an `images`, `videos` or `audios` column, or a content part that is "
         "not text); the sft task trains on text conversations only, so remove them (or the row)")
LIST_RESPONSE = ("the response is a list, as in a ranking dataset's [chosen, rejected] pair; the sft task trains on "
                 "one text answer per prompt")
MEDIA_COLUMNS = ("images", "videos", "audios")
TEXT_PARTS = ("text", "input_text", "output_text")  # Chat Completions' text part; the Responses API's, as its logs hold
REFUSAL = "refusal"  # an OpenAI answer's refusal: its own key beside a null content, or a content part of that type
TOOL_BLOCKS = ("tool_use", "tool_result")  # Anthropic's content blocks of a tool's call and its result
THINKING_BLOCKS = ("thinking", "redacted_thinking")  # Anthropic's content blocks of an answer's reasoning
TRAINING_KEYS = ("training", "train")  # Axolotl's per-turn flag (message_field_training), by the names its docs use
BAD_TRAINING = "a turn's `training` (or `train`) flag is not true or false"
TRAINED_PROMPT = ("a system, user or tool turn is marked `training: true` (Axolotl's message_field_training); emotune "
                  "trains assistant turns only, so set it to false or remove it")
TRAIN_DETAIL = ("a turn has `train_detail` (Axolotl's character spans to train on); emotune trains whole assistant "
                "turns: remove it, and mark an answer not to train with \"training\": false")
TRL_COLUMNS = ("prompt", "completion")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # Qwen3/DeepSeek-R1, OpenAI, gpt-oss templates' names
REASONING = ("an assistant turn has its reasoning in a field of its own (`reasoning_content`, `reasoning` or `thinking`, "
             "or a `thinking` content block), "
             "which emotune would leave out, training the answers without it; write the reasoning into the content "
             "the way the model's chat template does (e.g. <think>...</think> before the answer), or remove the field "
             "to train the answers alone")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]
    """(role, text) pairs, role `user` or `assistant`, alternating, first user, last assistant."""
    system: str | None = None
    kind: str | None = None
    source: str = ""
    """The dataset the row came from (a dataset_info.json name, or the file), for mixing and stratifying."""
    untrained: tuple[int, ...] = ()
    """Assistant turns (0 = the first answer) not trained on: OpenAI's `"weight": 0`. Never the last one."""
    tools: str | None = None
    """The row's tool descriptions as text; they follow the system prompt."""

    def chat(self, default_system: str | None = None, turns: int | None = None) -> list[dict[str, str]]:
        """The chat-template messages: the system prompt (the row's, else `default_system`) with the row's tools after
        it, and the first `turns` turns (all by default)."""
        system = with_tools(self.system if self.system is not None else default_system, self.tools)
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
        parts = [with_tools(self.system, self.tools) or ""] + [f"{role}: {text}" for role, text in self.messages]
        return "\n\x1f".join(parts)

    def as_row(self) -> dict:
        return {"system": self.system, "kind": self.kind, "source": self.source,
                "messages": [{"role": r, "content": t} for r, t in self.messages], "untrained": list(self.untrained),
                "tools": self.tools}

    @classmethod
    def from_row(cls, row: dict) -> Conversation:
        return cls(tuple((m["role"], m["content"]) for m in row["messages"]), row.get("system"), row.get("kind"),
                   row.get("source") or "", tuple(row.get("untrained") or ()), row.get("tools"))


def with_tools(system: str | None, tools: str | None) -> str | None:
    """The system prompt with the tool descriptions after it (a row's, or a chat request's `tools` as JSON)."""
    if not tools:
        return system
    return (system + "\n\n" if system else "") + "Tools available:\n" + tools


def format_columns(columns: SftColumns) -> dict[str, None]:
    """Every column name the sft formats read, in order: data.columns' own and the formats' fixed names."""
    return dict.fromkeys([*columns.model_dump().values(), "messages", "conversations", *TRL_COLUMNS])


def named_as_configured(names: list[str], rows: list[dict], columns: SftColumns
                        ) -> tuple[list[str], list[dict], dict[str, str]]:
    """Columns named as `columns` (data.columns) or the formats' own names say but for capitals and surrounding spaces
    (`Instruction`, `Output `, a spreadsheet's headers), read under those names, as a classifier's data.text_column
    finds `Text`: (names, rows, {file's name: name read as}). A name is taken only where the file has no column of
    that exact name and exactly one such close name."""
    wanted = format_columns(columns)
    renames: dict[str, str] = {}
    for name in wanted:
        if not isinstance(name, str) or name in names:
            continue
        close = [n for n in names if n.strip().casefold() == name.strip().casefold()]
        if len(close) == 1 and close[0] not in wanted and close[0] not in renames:
            renames[close[0]] = name
    if not renames:
        return names, rows, renames
    return ([renames.get(n, n) for n in names], [{renames.get(k, k): v for k, v in row.items()} for row in rows],
            renames)


def with_json_turns(names: list[str], rows: list[dict], columns: SftColumns) -> tuple[list[dict], list[str]]:
    """Rows whose turns (messages, conversations) or Alpaca history are JSON text, as a CSV file stores lists (pandas'
    to_csv, spreadsheets) and some Parquet files do, with those cells read as their lists: (rows, the columns read so).
    Such a column holds nothing else: a text there is no conversation, unlike an answer, which may be JSON."""
    wanted = [n for n in dict.fromkeys((columns.messages, "messages", "conversations", columns.history)) if n in names]
    decoded: dict[str, None] = {}
    out = rows
    for name in wanted:
        if not any(isinstance(row.get(name), str) and row[name].lstrip().startswith("[") for row in rows):
            continue
        out = [{**row, name: _json_list(row.get(name))} for row in out]
        decoded[name] = None
    return out, list(decoded)


def _json_list(value: object) -> object:
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return value
    try:
        found = json.loads(value)
    except ValueError:
        return value
    return found if isinstance(found, list) else value


def detect_format(column_names: list[str], rows: list[dict], columns: SftColumns) -> str | None:
    """`alpaca`, `sharegpt` or `messages` from the columns a file has and the keys of its first turn (None: none of them
    fits). The first turn of any row: a first row with no turns (empty, null) made a whole OpenAI file ShareGPT."""
    for name in dict.fromkeys((columns.messages, "messages", "conversations")):
        if name in column_names:
            turns = (row.get(name) for row in rows)
            first = next((t for turn_list in turns if isinstance(turn_list, list) for t in turn_list
                          if isinstance(t, dict)), {})
            return "messages" if "role" in first and "from" not in first else "sharegpt"
    if set(TRL_COLUMNS) <= set(column_names) and columns.response not in TRL_COLUMNS:
        return "messages"
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
    name = messages_column(fmt, columns, column_names)
    if fmt == "messages" and name not in column_names and set(TRL_COLUMNS) <= set(column_names):
        return list(TRL_COLUMNS)
    return [name]


def normalise(row: dict, fmt: str, columns: SftColumns, tags: SftTags, source: str, *,
              input_separator: str = INPUT_SEPARATOR) -> Conversation | str:
    """The row as a Conversation, or the reason it is refused; an Alpaca row's instruction and input are joined by
    `input_separator` (data.input_separator)."""
    if any(row.get(column) and not _is_missing(row.get(column)) for column in MEDIA_COLUMNS):
        return MEDIA
    if fmt == "alpaca":
        found = _alpaca(row, columns, input_separator)
    elif fmt == "messages" and columns.messages not in row and "messages" not in row and "prompt" in row:
        found = _prompt_completion(row, row.get(columns.system))
    else:
        name = columns.messages if columns.messages in row else "messages"
        found = _turns(row.get(name), OPENAI_TAGS if fmt == "messages" else tags, row.get(columns.system))
    if isinstance(found, str):
        return found
    system, messages, untrained = found
    tools = _text(row.get(columns.tools) if row.get(columns.tools) is not None or fmt != "messages" else
                  row.get("functions"))  # OpenAI's older function-calling format: `functions` beside `function_call`
    tools = tools if tools.strip() not in ("", "[]") else None
    problem = _check(messages)
    if problem:
        return problem
    if untrained and untrained[-1] == sum(role == "assistant" for role, _ in messages) - 1:
        return UNTRAINED_RESPONSE
    kind = row.get(columns.kind)
    return Conversation(tuple(messages), system or None, None if _is_missing(kind) else str(kind), source,
                        tuple(untrained), tools)


Turns = tuple[str | None, list[tuple[str, str]], list[int]]  # system prompt, (role, text) turns, untrained answers


def _alpaca(row: dict, columns: SftColumns, separator: str) -> Turns | str:
    messages: list[tuple[str, str]] = []
    history = [] if _is_missing(row.get(columns.history)) else row.get(columns.history) or []
    if not isinstance(history, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in history):
        return BAD_HISTORY
    for question, answer in history:
        messages += [("user", _text(question)), ("assistant", _text(answer))]
    messages.append(("user", _instruction_and_input(row, columns, separator)))
    response = row.get(columns.response)
    if isinstance(response, list):
        return LIST_RESPONSE
    messages.append(("assistant", _text(response)))
    return _system_text(row.get(columns.system)) or None, messages, []


def _instruction_and_input(row: dict, columns: SftColumns, separator: str) -> str:
    """An Alpaca row's user message: its instruction and its input joined by `separator`; either alone when the other
    is empty."""
    return separator.join(p for p in (_text(row.get(columns.prompt)), _text(row.get(columns.query))) if p.strip())


def _turns(turns, tags: SftTags, system: object) -> Turns | str:
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return BAD_TURNS
    side = role_sides(tags)
    system_side, user_side, assistant_side = ({r for r, s in side.items() if s == want}
                                              for want in ("system", "user", "assistant"))
    system_text = _system_text(system) or None
    results = {tags.observation_tag, *(("function",) if tags is OPENAI_TAGS else ()),
               *(("tool",) if tags == SHAREGPT_TAGS else ())}  # a tool's result
    role_of = role_reader(side, tags.role_tag)
    messages: list[tuple[str, str]] = []
    untrained: list[int] = []
    for i, turn in enumerate(turns):
        role = role_of(turn)
        kinds = {p.get("type", "text") for p in _parts(turn.get(tags.content_tag)) if isinstance(p, dict)}
        if any(turn.get(key) for key in REASONING_KEYS) or kinds & set(THINKING_BLOCKS):
            return REASONING
        if kinds - {*TEXT_PARTS, REFUSAL, *TOOL_BLOCKS}:
            return MEDIA
        text = turn_text(turn, tags)
        # a key given as null is a key not given: columnar files (Parquet, Arrow, save_to_disk, the hub) give every turn
        # every key any turn has, null where it had none
        flag = next((turn[k] for k in TRAINING_KEYS if turn.get(k) is not None), None)
        if turn.get("train_detail") is not None:
            return TRAIN_DETAIL
        if flag is not None and not isinstance(flag, bool):
            return BAD_TRAINING
        if flag and role not in assistant_side:
            return TRAINED_PROMPT
        if role in system_side and i == 0:
            system_text = text or system_text
        elif role in system_side:
            return LATE_SYSTEM
        elif role in results and i > 0 and role_of(turns[i - 1]) in results:
            # the results of parallel tool calls, one turn each (OpenAI's format): one user turn, in their order
            messages[-1] = ("user", "\n".join(t for t in (messages[-1][1], text) if t))
        elif role in user_side:
            messages.append(("user", text))
        elif role in assistant_side:
            weight = 1 if turn.get("weight") is None else turn["weight"]
            if weight not in (0, 1) or isinstance(weight, bool):
                return BAD_WEIGHT
            if weight == 0 or flag is False:
                untrained.append(sum(r == "assistant" for r, _ in messages))
            messages.append(("assistant", text))
        else:
            return unknown_role(turn, tags)
    return system_text, messages, untrained


def _prompt_completion(row: dict, system: object) -> Turns | str:
    """TRL's prompt-completion row: the prompt's turns (a text is one user turn) and the completion's (a text is one
    assistant turn). As TRL trains on the completion only, the answers inside the prompt carry no loss."""
    prompt, completion = row.get("prompt"), row.get("completion")
    prompt = prompt if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt)}]
    completion = completion if isinstance(completion, list) else [{"role": "assistant", "content": _text(completion)}]
    found = _turns(prompt + completion, OPENAI_TAGS, system)
    if isinstance(found, str):
        return found
    system_text, messages, untrained = found
    in_prompt = sum(isinstance(t, dict) and t.get("role") == "assistant" for t in prompt)
    return system_text, messages, sorted(set(untrained) | set(range(in_prompt)))


def turn_text(turn: dict, tags: SftTags = OPENAI_TAGS) -> str:
    """A turn's text; OpenAI content parts are joined (a refusal part's text too, and an Anthropic tool_result block's
    content), a refusal given beside a null content is the text, and its tool calls (`tool_calls`, the older
    `function_call`, Anthropic's tool_use blocks) are kept as their JSON, after the text when the turn has both."""
    content, used = turn.get(tags.content_tag), []
    if isinstance(content, list) or _is_part(content):  # [{"type": "text", "text": ...}, ...], or one such part
        parts = [p for p in _parts(content) if isinstance(p, dict)]
        used = [p for p in parts if p.get("type") == TOOL_BLOCKS[0]]  # Anthropic's tool_use: a call, after the text
        content = "".join(p.get("text") or p.get(REFUSAL) or (turn_text(p) if p.get("type") == TOOL_BLOCKS[1] else "")
                          for p in parts if p.get("type") != TOOL_BLOCKS[0])  # a tool_result: its content's text
    if _is_missing(content) and isinstance(turn.get(REFUSAL), str):
        content = turn[REFUSAL]
    calls = [json.dumps(turn[key], ensure_ascii=False) for key in ("tool_calls", "function_call") if turn.get(key)]
    calls += [json.dumps(call, ensure_ascii=False) for call in used]
    return "\n".join(part for part in (_text(content), *calls) if part)


def _system_text(value: object) -> str:
    """A row's own system prompt as text: a text, or its text blocks as other tools write them (Anthropic's and
    Bedrock's [{"text": ...}], one OpenAI-style message, Gemini's {"parts": [...]}), which read as their JSON before."""
    if isinstance(value, dict) and ("content" in value or "parts" in value):  # one message: its content or parts
        value = value.get("content", value.get("parts"))
    blocks = value if isinstance(value, list) else [value] if isinstance(value, dict) else None
    if blocks and all(isinstance(b, dict) and isinstance(b.get("text"), str) for b in blocks):
        return "".join(b["text"] for b in blocks)
    return _text(value)


def _is_part(content: object) -> bool:
    """One OpenAI content part given alone, not in a list: {"type": "text", "text": ...}."""
    return isinstance(content, dict) and "type" in content


def _parts(content: object) -> list:
    return content if isinstance(content, list) else [content] if _is_part(content) else []


def _check(messages: list[tuple[str, str]]) -> str | None:
    roles = [role for role, _ in messages]
    if not roles or any(role != ("user" if i % 2 == 0 else "assistant") for i, role in enumerate(roles)):
        return NOT_ALTERNATING
    if len(roles) % 2:
        return NO_ANSWER
    if not messages[-1][1].strip():
        return EMPTY_RESPONSE
    if any(not text.strip() for role, text in messages if role == "user"):
        return EMPTY_PROMPT
    if any(not text.strip() for role, text in messages if role == "assistant"):
        return EMPTY_ANSWER
    return None


def _text(value: object) -> str:
    if _is_missing(value):
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)  # tools given as a list, a number as an answer


def _is_missing(value: object) -> bool:
    """None, or NaN: pandas' missing value, which Python's json writes as `NaN` (json.dumps of a DataFrame's records)."""
    return value is None or (isinstance(value, float) and value != value)


# H2O LLM Studio's chained conversations: one row per turn, `parent_id` naming the row (by `id`) whose turn comes before
PARENT_COLUMN, ID_COLUMN = "parent_id", "id"


def has_parent_chains(column_names: list[str], rows: list[dict]) -> bool:
    return PARENT_COLUMN in column_names and any(_id(row.get(PARENT_COLUMN)) for row in rows)


def chain_parents(rows: list[dict], columns: SftColumns, input_separator: str = INPUT_SEPARATOR
                  ) -> tuple[list[dict], list[str]]:
    """Each alpaca row with its ancestors' (prompt, answer) pairs as its history, oldest first, as H2O LLM Studio builds
    a chained row's conversation (every row is a sample of its own; an ancestor's instruction and input joined by
    `input_separator`, as the row's own are); problems name the rows, without the file."""
    by_id: dict[str, dict] = {}
    for row in rows:
        key = _id(row.get(ID_COLUMN))
        if key is None:
            return rows, [f"has a `{PARENT_COLUMN}` column (H2O LLM Studio's chained conversations) but rows without "
                          f"an `{ID_COLUMN}` for it to name; give every row its `{ID_COLUMN}`"]
        if key in by_id:
            return rows, [f"has the `{ID_COLUMN}` {key!r} twice, so a `{PARENT_COLUMN}` naming it is ambiguous; give "
                          "each row its own id"]
        by_id[key] = row
    if any(row.get(columns.history) for row in rows):
        return rows, [f"has both `{PARENT_COLUMN}` chains and a `{columns.history}` column; give the earlier turns "
                      "one way, not both"]
    out, missing, cycles = [], [], []
    for number, row in enumerate(rows, start=1):
        pairs, seen, parent = [], {_id(row.get(ID_COLUMN))}, _id(row.get(PARENT_COLUMN))
        while parent is not None:
            if parent not in by_id:
                missing.append(number)
                break
            if parent in seen:
                cycles.append(number)
                break
            seen.add(parent)
            earlier = by_id[parent]
            question = _instruction_and_input(earlier, columns, input_separator)
            pairs.insert(0, [question, _text(earlier.get(columns.response))])
            parent = _id(earlier.get(PARENT_COLUMN))
        out.append({**row, columns.history: pairs})
    problems = [f"rows {listed(missing)}: the `{PARENT_COLUMN}` names an `{ID_COLUMN}` no row has (a row of the "
                "chain is missing); add it or remove those rows"] if missing else []
    problems += [f"rows {listed(cycles)}: the `{PARENT_COLUMN}` chain comes back to a row it passed (a loop); fix "
                 "the ids"] if cycles else []
    return out, problems


def _id(value: object) -> str | None:
    """An id as text (`7` and `7.0`, as a column with empty cells reads, are one id); None when empty."""
    if value is None or (isinstance(value, float) and value != value) or str(value).strip() in ("", "None", "nan"):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value).strip()
    whole = re.fullmatch(r"([+-]?\d+)\.0*", text)  # `7.0`: pandas writes the ids of a column with empty cells so
    return whole[1] if whole else text
