"""Request bodies, OpenAI-compatible where OpenAI has the endpoint."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


class ClassifyRequest(BaseModel):
    model: str
    input: str | list[str]
    labels: list[str] | None = None
    """Only for the base model, which has no label set of its own."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        """OpenAI content may be a list of parts; the text parts are what a text model reads."""
        if isinstance(value, list):
            return "".join(part.get("text", "") for part in value if part.get("type") == "text")
        return value or ""


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we accept and ignore
    model: str
    messages: list[ChatMessage]
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None


class AdapterRequest(BaseModel):
    name: str
    path: str
