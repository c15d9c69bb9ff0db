"""`eval:` and `serve:`: how a model is measured before and after, and how `emotune serve` serves it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import field_serializer, field_validator

from emotune.core.config.base import (
    Range,
    Section,
)


class MergedEvalSettings(Section):
    """How the fine-tuned evaluation runs the adapter; shared by every task's `eval` section."""

    merge_adapters: Literal["auto", "always", "never"] = "auto"
    """Evaluate the fine-tuned model with its LoRA adapter merged into the weights (about the base model's
    speed; unmerged adapters about halve `generate`'s). `auto` = merge, compare a few evaluated rows with the
    unmerged model first and keep the merge only when no logit moved by more than `merge_tolerance`
    (otherwise evaluate unmerged, with a note); `always` = merge whatever the check finds; `never` = unmerged,
    as trained. The decision and the measured difference go into the evaluation's metrics.json (`merge`)."""
    merge_tolerance: Annotated[float, Range(0)] = 1.0
    """Largest |logit difference| between the merged and the unmerged model on the checked rows that
    `merge_adapters=auto` accepts (logits the prediction is read from: the next token's, or a head's classes)."""


class EvalConfig(MergedEvalSettings):
    method: Literal["generate", "score", "both"] = "generate"
    """How a label is predicted: `generate` = the reference recipe (greedy decoding, then a regex picks the
    first label name in the output; INVALID when none matches); `score` = the exact probability of every
    label's tokens after the same prompt, highest wins (never invalid; adds top-2 accuracy, log-loss,
    calibration); `both` = run both, `generate` as the headline."""
    max_new_tokens: Annotated[int, Range(1)] = 4
    """Tokens generated per row by the `generate` method."""
    batch_size: Annotated[int | Literal["auto"], Range(1, also="or `auto`")] = "auto"
    """Rows per forward pass during evaluation; `auto` = as many as fit in 40% of free memory, at most 16
    (generate) / 32 (score) on CPU and 64 / 128 on GPUs. Out of memory halves it and retries."""
    split: Literal["test", "validation"] = "test"
    """Split measured before and after training."""


class ServeConfig(Section):
    host: str = "127.0.0.1"
    """Address `emotune serve` listens on; 0.0.0.0 exposes it to the network (set api_key then)."""
    port: Annotated[int, Range(0, 65535, also="0 picks a free port")] = 8000
    """TCP port of `emotune serve`."""
    engine: Literal["native", "vllm"] = "native"
    """`native`: emotune's own server (PyTorch, any device). `vllm`: hand the adapters to `vllm serve`
    (needs vllm installed; no /v1/classify there)."""
    api_key: str | None = None
    """Bearer key every request must send (`Authorization: Bearer KEY`): `env:NAME` reads it from the environment
    variable NAME, `file:PATH` from the file PATH; a key written out in a YAML file works too, but is never
    printed or saved (records show `***`), and one given on the command line is refused (the process list shows
    it). null = no key, which needs `--no-auth` (serve.no_auth=true) and a loopback host."""
    admin_key: str | None = None
    """Bearer key for loading and unloading adapters (POST/DELETE /v1/adapters); null = those endpoints
    are off. `env:NAME` and `file:PATH` as for api_key."""
    no_auth: bool = False
    """Serve without serve.api_key (`--no-auth`): allowed on a loopback host only (127.0.0.1, ::1, localhost)."""
    allowed_hosts: list[str] = []
    """Host names clients may address the server by (the `Host` and `Origin` headers), besides the address it
    listens on; on a loopback host only loopback names are accepted whatever this says, which stops DNS
    rebinding. Empty on a non-loopback host = any name."""
    adapter_dirs: list[str] = ["runs"]
    """Folders adapters may be loaded from at run time (POST /v1/adapters); paths outside them, after
    resolving links and `..`, are refused."""
    max_batch_size: Annotated[int, Range(1)] = 32
    """Most texts scored in one forward pass; concurrent classify requests are micro-batched up to it."""
    batch_wait_ms: Annotated[float, Range(0)] = 5.0
    """How long the first request of a micro-batch waits for others to join it."""
    max_queue: Annotated[int, Range(1)] = 256
    """Most texts waiting to be classified; beyond it requests are answered 503 at once."""
    max_inputs: Annotated[int, Range(1)] = 64
    """Most texts in one /v1/classify request (422 beyond)."""
    max_input_chars: Annotated[int, Range(1)] = 4000
    """Longest text, or chat message, accepted (422 beyond)."""
    max_body_bytes: Annotated[int, Range(1)] = 1_000_000
    """Largest request body accepted (413 beyond)."""
    max_new_tokens: Annotated[int, Range(1)] = 256
    """Most tokens one chat completion may generate (`max_tokens` above it is 422)."""
    max_labels: Annotated[int, Range(2)] = 64
    """Most `labels` one /v1/classify request to the base model may name (422 beyond); scoring grows with it."""
    max_label_tokens: Annotated[int, Range(1)] = 512
    """Most tokens all of one request's `labels` may hold together (422 beyond)."""
    max_messages: Annotated[int, Range(1)] = 64
    """Most messages in one chat completion request (422 beyond)."""
    max_prompt_chars: Annotated[int, Range(1)] = 64_000
    """Most characters in all of one chat request's messages together, with its `tools` as JSON where the model reads
    them (an sft adapter) (422 beyond). Checked before the conversation is rendered and its tokens counted, which for a
    long one costs more than answering it."""
    max_chats: Annotated[int, Range(1)] = 8
    """Most chat completions waiting or generating at once; beyond it requests are answered 429 at once, with
    Retry-After (each also takes a place in serve.max_queue, the queue classification waits in)."""
    chat_slice_tokens: Annotated[int, Range(1)] = 8
    """Tokens a chat reply generates on the model thread at a time; classify work waiting for the model runs
    between two slices (the reply's KV cache is kept), so it waits for one slice rather than a whole reply."""
    prefill_slice_tokens: Annotated[int, Range(1)] = 64
    """Prompt tokens a chat's prefill (the forward pass over its prompt, before the first reply token) runs on
    the model thread at a time, the KV cache kept between chunks: classify work waiting for the model runs
    between two chunks instead of after a prompt of up to the model's whole context. Models whose cache does not
    give the same result in chunks (recurrent or linear-attention layers) are prefilled in one pass."""
    chat_share: Annotated[float, Range(0, 1, low_open=True)] = 0.2
    """While classify requests wait, the most of the model thread's recent time chat completions get (a
    generation holds the model until it ends, a classify batch for one forward pass); with no classify request
    waiting, chats get all of it. Lower it to keep classification fast under heavy chat traffic
    (emotune.serve.modelthread)."""
    header_timeout_s: Annotated[float, Range(0.1)] = 10.0
    """How long a client may take to send a request's headers; slower connections are closed."""
    body_timeout_s: Annotated[float, Range(0.1)] = 30.0
    """How long a client may take to send a request's body (408 beyond)."""
    shutdown_timeout_s: Annotated[float, Range(0)] = 30.0
    """On shutdown (Ctrl-C, SIGTERM), how long requests in flight may take to finish; then the server stops,
    whatever is still running."""

    @field_validator("api_key", "admin_key")
    @classmethod
    def _usable_key(cls, value: str | None) -> str | None:
        if value is not None and not value.removeprefix("env:").removeprefix("file:").strip():
            raise ValueError("is empty, which would let anyone in: give a key as env:NAME or file:PATH, or leave "
                             "api_key out and pass --no-auth (loopback hosts only)")
        return value

    @field_serializer("api_key", "admin_key")
    def _redacted(self, value: str | None) -> str | None:
        """Records (config.yaml, the printed config, reports) name where a key comes from, never the key."""
        return value if value is None or value.startswith(("env:", "file:")) else "***"
