"""Micro-batching: classify requests wait in a bounded queue and are scored together, one forward pass for many.

This is where the server's throughput comes from. The worker runs on the event loop and hands each batch to
the single model thread (`Engine.lock`), so scoring never blocks the loop.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import ServeConfig
from emotune.serve.engine import Engine
from emotune.serve.limits import Admission
from emotune.serve.metrics import Metrics


@dataclass
class Job:
    model: str
    texts: list[str]
    prompt: PromptConfig
    labels: list[str]
    future: asyncio.Future

    @property
    def key(self) -> tuple:
        return self.model, self.prompt.system_prompt, self.prompt.user_template, tuple(self.labels)


class MicroBatcher:
    """Bounded queue of classify jobs; the worker scores every job that arrived together in one call."""

    def __init__(self, engine: Engine, executor: Executor, metrics: Metrics, cfg: ServeConfig,
                 admission: Admission | None = None):
        self.engine, self.executor, self.metrics, self.cfg = engine, executor, metrics, cfg
        self.admission = admission or Admission(cfg, metrics)
        self.queue: asyncio.Queue[Job] = asyncio.Queue()

    @property
    def pending(self) -> int:
        """Texts (and chats) admitted and not finished."""
        return self.admission.pending

    async def submit(self, model: str, texts: list[str], prompt: PromptConfig, labels: list[str]) -> torch.Tensor:
        async with self.admission.admit(texts=len(texts)):
            job = Job(model, texts, prompt, labels, asyncio.get_running_loop().create_future())
            self.queue.put_nowait(job)
            try:
                return await job.future
            finally:
                job.future.cancel()  # a caller cancelled (its client went away): the batch leaves this job out

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect(loop)
            groups: dict[tuple, list[Job]] = defaultdict(list)
            for job in batch:
                groups[job.key].append(job)
            for jobs in groups.values():
                await self._score(loop, jobs)

    async def _collect(self, loop) -> list[Job]:
        """The first waiting job, plus whatever arrives within batch_wait_ms, up to max_batch_size texts."""
        batch = [await self.queue.get()]
        size, deadline = len(batch[0].texts), loop.time() + self.cfg.batch_wait_ms / 1000
        while size < self.cfg.max_batch_size:
            try:
                job = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            batch.append(job)
            size += len(job.texts)
        return [job for job in batch if not job.future.done()]  # skip clients that went away

    async def _score(self, loop, jobs: list[Job]) -> None:
        if not jobs:
            return
        texts = [t for job in jobs for t in job.texts]
        self.metrics.observe_batch(len(texts))
        try:
            probs = await self._classify(loop, jobs[0], texts)
        except Exception as err:  # noqa: BLE001 (any failure belongs to the request, not the worker)
            if len(jobs) == 1:
                return _fail(jobs[0], err)
            # One request's text can fail a whole batch that validation let through: score each request
            # alone, once, so only the request that fails by itself gets the error.
            self.metrics.inc("emotune_batch_retries_total")
            for job in jobs:
                await self._score_alone(loop, job)
            return
        start = 0
        for job in jobs:
            if not job.future.done():
                job.future.set_result(probs[start:start + len(job.texts)])
            start += len(job.texts)

    async def _score_alone(self, loop, job: Job) -> None:
        if job.future.done():
            return
        try:
            probs = await self._classify(loop, job, job.texts)
        except Exception as err:  # noqa: BLE001 (any failure belongs to the request, not the worker)
            return _fail(job, err)
        if not job.future.done():
            job.future.set_result(probs)

    def _classify(self, loop, job: Job, texts: list[str]):
        return loop.run_in_executor(self.executor, self.engine.classify, job.model, texts, job.prompt, job.labels,
                                    self.cfg.max_batch_size)


def _fail(job: Job, err: Exception) -> None:
    """The error goes to the request that caused it; the worker carries on with the next batch."""
    if not job.future.done():
        job.future.set_exception(err)
