"""Trying a run's model from its page: classify a text (per-label probabilities) or chat with an sft adapter, the
reply streamed as it is generated.

The studio holds at most one run's model at a time (the base model with that run's adapter, loaded as
`emotune serve` loads it: emotune.serve.engine), and one request runs at a time. The device belongs to training
first: while a studio job trains, trying is refused with a message saying so, and the queue starts a job only once
no try is running, unloading the tried model first so its memory is free for training.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from emotune.core.config.data import PromptConfig
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir
from emotune.model.artifacts import Artifact, find_artifact
from emotune.model.finite import nonfinite_rows, not_finite_message
from emotune.serve.chat import Generation, render_conversation
from emotune.serve.engine import Engine, base_config

MAX_TEXT_CHARS = 4_000  # one text to classify, or one chat message (as `emotune serve` bounds them)
MAX_MESSAGES = 32
MAX_NEW_TOKENS = 256
SLICE_TOKENS = 8  # a chat reply is generated and sent this many tokens at a time


class Refused(Exception):
    """A try that cannot run now or cannot run at all; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Reply:
    """A chat reply being generated: text pieces in order, then None (an exception instead when generation failed);
    set `cancel` to stop it early (the browser left)."""

    def __init__(self):
        self.pieces: queue.Queue = queue.Queue()
        self.cancel = threading.Event()


class Tryout:
    """One run's model at a time, for the run pages' Try it form. `training()` names the job holding the device, or
    None (the studio passes its queue's)."""

    def __init__(self, training: Callable[[], str | None], device: str = "auto"):
        self.training, self.device = training, device
        self.lock = threading.Lock()  # one model call at a time; held for a whole chat reply
        self.engine: Engine | None = None
        self.artifact: Artifact | None = None
        self.key: tuple | None = None  # (adapter path, its modification time): a retrained run loads afresh

    def artifact_of(self, run: RunDir) -> Artifact:
        """The run's adapter, or Refused 409 when the run has none yet."""
        try:
            return find_artifact(run.root, name=run.root.name)
        except UserError as err:
            raise Refused(409, f"Run `{run.root.name}` has no trained model to try yet: {err}") from None

    def classify(self, run: RunDir, text: str) -> list[tuple[str, float]]:
        """The label probabilities of `text`, highest first."""
        _check_text(text, "text")
        with self._turn():
            artifact = self._load(run)
            if artifact.answers_freely:
                raise Refused(422, f"Run `{run.root.name}` is an {artifact.task} model: it answers in free text, so it "
                                   "has no labels to classify into. Chat with it instead.")
            prompt = PromptConfig() if artifact.has_head else artifact.prompt  # a head reads the bare text
            probs = self.engine.classify(artifact.name, [text], prompt, artifact.labels, 1)
            if nonfinite_rows(probs):  # the weights were finite when they loaded: an overflow on this text
                raise Refused(500, not_finite_message(f"The model `{artifact.name}`", "this text",
                                                      self.engine.dtype_of(self.engine.models[artifact.name])))
            probs = probs[0].tolist()
        return sorted(zip(artifact.labels, probs, strict=True), key=lambda pair: -pair[1])

    def chat(self, run: RunDir, messages: list[dict], max_tokens: int) -> Reply:
        """Start the reply to `messages` on a thread of its own; its pieces of text arrive in `Reply.pieces` as they
        are generated. Everything is checked before it starts, so a refusal is an error answer, not a broken stream.
        The thread holds the studio's one try until the reply ends or `Reply.cancel` is set."""
        _check_messages(messages)
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise Refused(422, f"max_tokens={max_tokens} is outside 1..{MAX_NEW_TOKENS}.")
        self._claim()
        try:
            artifact = self._load(run)
            if not artifact.answers_freely:
                raise Refused(422, f"Run `{run.root.name}` is a {artifact.task} model: it answers with a label, not a "
                                   "conversation. Classify a text with it instead.")
            try:
                prompt = render_conversation(messages, self.engine.models[artifact.name])
            except Exception as err:  # the template's own refusal (roles that do not alternate, ...)
                raise Refused(422, str(getattr(err, "message", err))) from None
            reply = Reply()
            threading.Thread(target=self._generate, args=(artifact.name, prompt, max_tokens, reply),
                             name="emotune-studio-chat", daemon=True).start()
            return reply
        except BaseException:
            self.lock.release()
            raise

    def _generate(self, name: str, prompt: str, max_tokens: int, reply: Reply) -> None:
        job = {"id": f"studio-{uuid.uuid4().hex[:12]}", "created": int(time.time()), "model": name, "prompt": prompt,
               "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": [],
               "cancel": reply.cancel, "stopping": threading.Event()}
        generation, sent = Generation(self.engine, job, SLICE_TOKENS), 0
        try:
            while not reply.cancel.is_set():
                done = generation.step()
                text = generation.reply()[0] if done else generation.text
                if len(text) > sent:
                    reply.pieces.put(text[sent:])
                    sent = len(text)
                if done:
                    break
        except Exception as err:  # noqa: BLE001 - handed to the page, which shows it in place of the reply
            reply.pieces.put(err)
        finally:
            reply.pieces.put(None)
            self.lock.release()

    def unload(self) -> None:
        """Free the model (the queue calls it before a training job starts)."""
        self.engine = self.artifact = self.key = None
        _free_device_memory()

    def idle(self) -> bool:
        """Unload and return True when no try is running; False (nothing done) when one is."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.engine is not None:
                self.unload()
            return True
        finally:
            self.lock.release()

    # ----------------------------------------------------------------------------------------------

    def _claim(self) -> None:
        busy = self.training()
        if busy:
            raise Refused(409, f"{busy} holds the device, so no model can be tried now. Try again when it has ended, "
                               "or stop it from its page.")
        if not self.lock.acquire(blocking=False):
            raise Refused(409, "Another try is running (one at a time, to keep the device's memory for one model). "
                               "Send it again in a moment.")

    @contextmanager
    def _turn(self):
        self._claim()
        try:
            yield
        finally:
            self.lock.release()

    def _load(self, run: RunDir) -> Artifact:
        artifact = self.artifact_of(run)
        key = (str(artifact.path), _mtime(artifact.path))
        if self.key != key:
            self.unload()
            engine = Engine(base_config([artifact], artifact.model_cfg, self.device), self.device,
                            merged=artifact if artifact.merged else None)
            try:  # weights holding NaN, or a tokenizer, head or layers that do not fit the base: refused as `emotune
                engine.check_finite(artifact.name) if artifact.merged else engine.add_adapter(artifact)  # serve` does
            except UserError as err:
                raise Refused(422, str(err)) from None
            self.engine, self.artifact, self.key = engine, artifact, key
        return self.artifact


def _check_text(text: str, what: str) -> None:
    if not text.strip():
        raise Refused(422, f"`{what}` is empty; type a text.")
    if len(text) > MAX_TEXT_CHARS:
        raise Refused(422, f"`{what}` holds {len(text)} characters; the limit is {MAX_TEXT_CHARS}. Shorten it.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate (`"\ud800"` in the posted JSON): no tokenizer reads it
        raise Refused(422, f"`{what}` holds a character that is not valid Unicode text (position {err.start}).") from None


def _check_messages(messages: list[dict]) -> None:
    if not messages or len(messages) > MAX_MESSAGES:
        raise Refused(422, f"The conversation holds {len(messages)} messages; send 1 to {MAX_MESSAGES}.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant") \
                or not isinstance(message.get("content"), str):
            raise Refused(422, f"messages[{i}] must be {{\"role\": \"user\" | \"assistant\" | \"system\", "
                               "\"content\": text}.")
        _check_text(message["content"], f"messages[{i}].content")


def _mtime(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.iterdir() if p.is_file()), default=0.0)


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
