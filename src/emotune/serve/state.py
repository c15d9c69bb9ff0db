"""The state every route shares (engine, model thread, batcher, metrics, keys) and the checks a request passes.

The keys themselves are checked by the `RequireKey` middleware (emotune.serve.http), before any body is read."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from emotune.core.config.eval import ServeConfig
from emotune.model.text import context_length
from emotune.serve.batching import MicroBatcher
from emotune.serve.engine import Engine, Loaded
from emotune.serve.http import APIError, resolve_key, shown
from emotune.serve.limits import Admission
from emotune.serve.metrics import Metrics
from emotune.serve.modelthread import ANTICIPATE_S, ModelThread

log = logging.getLogger("emotune.serve")
RESTART_DELAY_S = 0.5
BYTE_SLACK = 64  # tokens a tokenizer may add beyond one per byte (a leading space marker, the end of turn after a label)


class Server:
    """State shared by the routes: engine, worker thread, batcher, metrics, keys."""

    def __init__(self, engine: Engine, cfg: ServeConfig):
        self.engine, self.cfg = engine, cfg
        self.api_key = resolve_key(cfg.api_key, "api_key")
        self.admin_key = resolve_key(cfg.admin_key, "admin_key")
        # every model call, in two lanes (emotune.serve.modelthread); chats over their share wait as long for the
        # next classify batch as the batcher waits to fill one, and a client's round trip
        self.model_thread = ModelThread(cfg.chat_share, anticipate_s=ANTICIPATE_S + cfg.batch_wait_ms / 1000)
        self.executor = self.model_thread.lane("scoring")  # classify batches, adapter loads and unloads
        self.chat_executor = self.model_thread.lane("generation")  # generations
        self.metrics = Metrics()
        self.admission = Admission(cfg, self.metrics)
        self.batcher = MicroBatcher(engine, self.executor, self.metrics, cfg, self.admission)
        self.context = context_length(getattr(engine, "model", None))  # prompt + reply must fit it
        self.in_flight = 0
        self.stopping = threading.Event()  # set at shutdown: generation stops at its next token
        self.name_locks: dict[str, list] = {}  # adapter loads and unloads: name -> [lock, holders and waiters]
        self.worker: asyncio.Task | None = None
        self.restarts = 0

    @asynccontextmanager
    async def name_lock(self, name: str):
        """One load or unload of an adapter name at a time; the lock lives while someone holds or waits for it, so
        names that were refused or never loaded (a DELETE of any name) leave nothing behind."""
        entry = self.name_locks.setdefault(name, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self.name_locks[name]

    # ---- the batcher's worker, supervised ----

    async def supervise(self) -> None:
        """Run the batcher's worker and start it again whenever it dies (until shutdown cancels this); the model
        thread is checked beside it and started again too (its queued calls wait for the new one)."""
        watch = asyncio.create_task(self._watch_model_thread())
        try:
            await self._supervise_worker()
        finally:
            watch.cancel()

    async def _watch_model_thread(self) -> None:
        while True:
            if self.model_thread.ensure_running():
                log.error("the model thread died; started it again")
                self.metrics.inc("emotune_model_thread_restarts_total")
            await asyncio.sleep(RESTART_DELAY_S)

    async def _supervise_worker(self) -> None:
        while True:
            self.worker = asyncio.create_task(self.batcher.run())
            try:
                await asyncio.shield(self.worker)
            except asyncio.CancelledError:
                self.worker.cancel()
                raise
            except Exception:  # noqa: BLE001 (whatever killed it is logged; the queue must keep moving)
                log.exception("the classify worker died; starting it again")
            self.restarts += 1
            self.metrics.inc("emotune_worker_restarts_total")
            await asyncio.sleep(RESTART_DELAY_S)

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) for /health: 503 while the worker is down or the server is stopping."""
        worker = "running" if self.worker is not None and not self.worker.done() else "restarting"
        busy_since = self.engine.busy_since
        model_thread = ("stopping" if self.stopping.is_set() else "restarting" if not self.model_thread.alive
                        else "busy" if busy_since is not None else "idle")
        ok = worker == "running" and model_thread not in ("stopping", "restarting")
        body = {"status": "ok" if ok else "unavailable", "models": list(self.engine.models), "queue": self.batcher.pending,
                "worker": worker, "worker_restarts": self.restarts, "model_thread": model_thread,
                "model_thread_restarts": self.model_thread.restarts,
                "busy_s": round(time.monotonic() - busy_since, 3) if busy_since is not None else 0.0}
        return (200 if ok else 503), body

    # ---- checks ----

    def loaded(self, name: str) -> Loaded:
        if name not in self.engine.models:
            raise APIError(404, f"The model `{shown(name)}` does not exist. Loaded: {', '.join(self.engine.models)} "
                                "(GET /v1/models).", "not_found_error")
        return self.engine.models[name]

    def check_text(self, text: str, what: str) -> None:
        if len(text) > self.cfg.max_input_chars:
            raise APIError(422, f"{what} has {len(text)} characters; the limit is serve.max_input_chars="
                                f"{self.cfg.max_input_chars}. Shorten it.")

    def check_context(self, loaded: Loaded, texts: list[str], prompt, labels: list[str]) -> None:
        """A text whose scoring prompt and longest label run past the model's context is a 422 naming it, as `predict`
        refuses it: a model with learned positions (GPT-2's 1,024) failed inside its forward (a 500), one with rotary
        positions scored it at positions it never saw. Texts as the model reads them (the run's cleaning); a head
        model cuts its texts at the length it trained with, so nothing is checked there."""
        if self.context is None or loaded.head is not None:
            return
        from emotune.data import prompt_messages
        from emotune.data.clean import clean_for_inference
        from emotune.eval.scoring import label_token_ids, prompt_token_ids

        if loaded.artifact is not None:
            texts = clean_for_inference(texts, loaded.artifact.meta.get("cleaning"))
        # a token covers at least one byte of what it reads, so only texts whose prompt and label come to more bytes
        # than the context can run past it: only those are tokenized (none at max_input_chars on Gemma's 32k), and the
        # request's hot path keeps one template rendering, not one per text
        rendered = loaded.tokenizer.apply_chat_template(prompt_messages("", prompt, labels), tokenize=False,
                                                        add_generation_prompt=True)
        bound = len(rendered.encode()) + max(len(label.encode()) for label in labels) + BYTE_SLACK
        suspects = [i for i, text in enumerate(texts) if bound + len(text.encode()) > self.context]
        if not suspects:
            return
        longest = max(len(ids) for ids in label_token_ids(loaded.tokenizer, prompt, labels))
        counted = prompt_token_ids(loaded.tokenizer, prompt, labels, [texts[i] for i in suspects])
        for i, ids in zip(suspects, counted, strict=True):
            if len(ids) + longest > self.context:
                raise APIError(422, f"input[{i}] with the prompt and the longest label comes to {len(ids) + longest:,} "
                                    f"tokens, more than the model's context of {self.context:,}. Shorten or split it.")

    def allowed_adapter_path(self, path: str) -> Path:
        """The resolved adapter folder, if it lies inside one of serve.adapter_dirs (links and `..` resolved)."""
        roots = [Path(d).expanduser().resolve() for d in self.cfg.adapter_dirs]
        try:
            given = Path(path).expanduser()
            candidates = [given.resolve()] if given.is_absolute() else [(root / given).resolve() for root in roots]
        except (OSError, RuntimeError) as err:  # `~nobody` (no such user), a name too long for the file system
            raise APIError(422, f"Adapter path `{path}` cannot be resolved: {err}.") from None
        inside = [c for c in candidates if any(c.is_relative_to(root) for root in roots)]
        where = f"serve.adapter_dirs ({', '.join(map(str, roots)) or 'none'})"
        if not inside:
            raise APIError(403, f"Adapter path `{path}` lies outside {where}.", "permission_error")
        try:
            found = next((c for c in inside if c.is_dir()), None)
        except OSError as err:  # a name longer than the file system takes (resolve() leaves it be)
            raise APIError(422, f"Adapter path `{path[:200]}` cannot be read: {err.strerror}.") from None
        if found is None:
            raise APIError(404, f"Adapter path `{path}` is not a folder inside {where}.", "not_found_error")
        return found
