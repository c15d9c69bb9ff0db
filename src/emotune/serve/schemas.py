"""Request and response bodies, OpenAI-compatible where OpenAI has the endpoint.

Every check that needs only the body lives here, so a bad request is answered 422 before it reaches the
model thread or a micro-batch (where it would fail other people's requests too).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from emotune.data.conversations import TEXT_PARTS, turn_text


def _utf8(value: str, what: str = "") -> str:
    """JSON may carry lone surrogates (`"\\ud800"`); no tokenizer or UTF-8 response can hold them. `what`: the
    text's name in the message, where it is not the field's own value."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what + ' ' if what else ''}holds a character that is not valid Unicode text ({err.reason} "
                         f"at position {err.start})") from None
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("holds a NUL character")
    return value


Text = Annotated[str, AfterValidator(_utf8)]
FailFast = Field(fail_fast=True)
"""On a list: validation stops at its first bad item. A body of 300,000 wrong items made as many errors (1.3 s to build
on the event loop, and a 13 MB answer); the client is told of the first, which is what it needs to fix."""
MAX_STOP_SEQUENCES = 4
Name = Annotated[str, AfterValidator(_utf8), AfterValidator(_no_nul)]


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "NAME", "input": "i am so happy today"},
        {"model": "base", "input": ["text one", "text two"], "labels": ["joy", "sadness"]}]})
    model: Name
    input: Text | Annotated[list[Text], FailFast]
    labels: Annotated[list[Text], FailFast] | None = None
    """Only for the base model, which has no label set of its own."""

    @field_validator("labels")
    @classmethod
    def _distinct_names(cls, labels: list[str] | None) -> list[str] | None:
        if labels is None:
            return None
        if any(not label.strip() for label in labels):
            raise ValueError("every label needs a name; an empty label would be scored like any other and could win")
        duplicates = sorted(label for label, count in Counter(labels).items() if count > 1)  # linear: 10^5 labels fit a body
        if duplicates:
            raise ValueError(f"labels {duplicates} appear more than once; give each label once")
        return labels


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None

    @field_validator("type")
    @classmethod
    def _text_parts_only(cls, value: str) -> str:
        """A part the model cannot read (an image, audio, a file) is refused: answering without it would answer
        another question than the one asked."""
        if value not in TEXT_PARTS:
            raise ValueError(f"a content part of type {value[:40]!r} is not read: emotune serves models that read text "
                             f"(parts of type {', '.join(TEXT_PARTS)}); send the text alone")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    """OpenAI's roles; any other is refused, since many chat templates write the role into the prompt as it is sent.
    `developer` (OpenAI's newer name for the system role) is read as `system`: no chat template knows it."""
    content: Text | Annotated[list[ContentPart], FailFast] | None
    """Required: a message without content has nothing for the template to render. Null only in an assistant
    message with `tool_calls`, whose JSON is then its text, as an sft run trained on it."""

    @field_validator("role")
    @classmethod
    def _system_by_its_newer_name(cls, value: str) -> str:
        return "system" if value == "developer" else value

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        """OpenAI content may be a list of parts; the text parts are what a text model reads."""
        if isinstance(value, list):
            return "".join(part.text or "" for part in value)
        return value

    @model_validator(mode="after")
    def _content_or_tool_calls(self):
        """An assistant's tool calls become its text (their JSON after its own), as an sft run's data reads them, so
        the limits on text count them too."""
        extra = self.model_extra or {}
        if self.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call")):
            calls = "tool_calls" if extra.get("tool_calls") else "function_call"
            self.content = _utf8(turn_text({"content": self.content, **extra}), f"`{calls}` (as JSON after the content)")
        if self.content is None:
            raise ValueError("a message needs its `content` (null only in an assistant message with `tool_calls`)")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    """A last chunk with empty `choices` and the request's `usage`, before `[DONE]` (OpenAI's)."""


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatRequest(BaseModel):
    # OpenAI clients send fields we accept and ignore
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"model": "NAME", "messages": [{"role": "user", "content": "i am so happy today"}], "max_tokens": 8}]})
    model: Name
    messages: Annotated[list[ChatMessage], FailFast]
    stream: StrictBool = False
    """Strict: `"yes"` or `1` is refused rather than read as true."""
    # numbers are strict, as OpenAI types them: `"5"` is refused rather than read as 5 (a JSON number is an int where
    # an int is asked, and an int or a float where a float is)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False, strict=True)
    n: int = Field(default=1, strict=True)
    """Choices to return; only 1 (the reply is greedy unless temperature > 0, and one choice per request)."""
    stop: Text | Annotated[list[Text], FailFast] | None = None
    """Up to 4 texts; the reply ends before the first of them (OpenAI's `stop`). Read as a list."""
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1, strict=True)
    """The range torch's generator takes."""
    stream_options: StreamOptions | None = None
    """Only with `stream: true` (OpenAI and vLLM refuse it otherwise: a client asking for a usage chunk would get none)."""
    logprobs: StrictBool | None = None
    """Only false: the reply carries no log-probabilities (refused rather than silently left out)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    """Only 0, as `logprobs`."""
    response_format: ResponseFormat | None = None
    """Only `{"type": "text"}`: nothing constrains the reply to JSON, so asking for it is refused."""
    tool_choice: str | dict | None = None
    """`auto` or `none`: the model is never made to call a tool (`tools` are shown to an sft adapter after its system
    prompt, as its data's tools column was, and not shown to other models)."""


    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed when `stream` is true; drop it, or set stream: true")
        return self

    @model_validator(mode="after")
    def _tools_are_text(self):
        """`tools` are written into an sft adapter's prompt as JSON: lone surrogates there would fail its tokenizer."""
        tools = (self.model_extra or {}).get("tools")
        if tools:
            _utf8(json.dumps(tools, ensure_ascii=False), "`tools` (as JSON)")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"holds {len(stops)} stop sequences; give at most {MAX_STOP_SEQUENCES}, as OpenAI allows")
        if any(not stop for stop in stops):
            raise ValueError("holds an empty stop sequence, which would end every reply before its first word")
        return stops


class AdapterRequest(BaseModel):
    name: Name
    path: Name


# --------------------------------------------------------------------------------------------------
# Responses: declared so the OpenAPI document says what each route answers (and tests can check it)


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorBody(BaseModel):
    """Every 4xx and 5xx answer, OpenAI-style."""
    error: ErrorDetail


class Health(BaseModel):
    """200 with status ok, or 503 with status unavailable while the classify worker is being restarted or the
    server is stopping."""
    status: Literal["ok", "unavailable"]
    models: list[str]
    queue: int
    """Texts and chats admitted and not finished."""
    worker: Literal["running", "restarting"]
    """The classify worker (micro-batcher); restarted whenever it dies."""
    worker_restarts: int
    model_thread: Literal["idle", "busy", "stopping"]
    busy_s: float
    """How long the model call running now has run (0 when idle)."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    task: Literal["classify", "sft", "classify_head"] | None = None
    """A model's task: `classify` (/v1/classify and chat), `sft` (free-text chat only) or `classify_head` (/v1/classify
    only, through its classification head). The base does both of the first two."""
    labels: list[str] | None = None
    """The labels /v1/classify answers with (classify and classify_head models)."""
    merged: bool | None = None
    """Whether the model is a merged model folder (served in the base's place) rather than an adapter."""


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Classification(BaseModel):
    index: int
    label: str
    probs: dict[str, float]


class ClassifyUsage(BaseModel):
    texts: int


class ClassifyResponse(BaseModel):
    object: Literal["list"]
    model: str
    data: list[Classification]
    usage: ClassifyUsage


class ReplyMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class Choice(BaseModel):
    index: int
    message: ReplyMessage
    finish_reason: Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Deleted(BaseModel):
    id: str
    object: Literal["model"]
    deleted: bool
