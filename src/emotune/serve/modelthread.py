"""The model thread: every model call runs on one thread, taken from two lanes so chats cannot starve classification.

A chat completion holds the model for its whole generation, and a classify batch for one forward pass. With one
first-come queue, a burst of chats puts every classify request behind all of them. Here classify batches and
adapter loads wait in the `classify` lane and generations in the `chat` lane. The thread takes whichever lane has
work; when both have, chats get the model only while their share of its recent busy time is under
`serve.chat_share` (time decays with a half-life of `HALF_LIFE_S`), so a classify request waits for at most the one
generation already running, and chats still get their share while classify traffic never stops.

`ModelThread.lane(name)` is a `concurrent.futures.Executor` for `loop.run_in_executor`; a future cancelled before
its turn never runs (a client that left).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future

LANES = ("classify", "chat")
HALF_LIFE_S = 10.0


class ModelThread:
    """One worker thread over the lanes' queues."""

    def __init__(self, chat_share: float, name: str = "emotune-model"):
        self.chat_share = chat_share
        self.queues: dict[str, deque] = {lane: deque() for lane in LANES}
        self.busy = dict.fromkeys(LANES, 0.0)  # decayed seconds of model time per lane
        self.stamp = time.monotonic()
        self.ready = threading.Condition()
        self.closed, self.name, self.restarts = False, name, 0
        self.thread = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._work, name=self.name, daemon=True)
        thread.start()
        return thread

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def ensure_running(self) -> bool:
        """Start the thread again if it died (not after shutdown); True when it had to. Queued calls stay queued."""
        with self.ready:
            if self.closed or self.thread.is_alive():
                return False
            self.restarts += 1
            self.thread = self._start()
            return True

    def lane(self, name: str) -> Lane:
        if name not in self.queues:
            raise ValueError(f"unknown lane {name!r}; lanes: {', '.join(LANES)}")
        return Lane(self, name)

    def submit(self, lane: str, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        with self.ready:
            if self.closed:
                raise RuntimeError("the model thread is shut down")
            self.queues[lane].append((future, fn, args, kwargs))
            self.ready.notify()
        self.ensure_running()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self.ready:
            self.closed = True
            if cancel_futures:
                for queue in self.queues.values():
                    while queue:
                        queue.popleft()[0].cancel()
            self.ready.notify()
        if wait:
            self.thread.join()

    def pick(self) -> str | None:
        """The lane whose job runs next (called with `ready` held): the only one with work, else chat while its
        share of the recent model time is under chat_share."""
        waiting = [lane for lane in LANES if self.queues[lane]]
        if len(waiting) < 2:
            return waiting[0] if waiting else None
        self._decay()
        total = sum(self.busy.values())
        share = self.busy["chat"] / total if total > 0 else 0.0
        return "chat" if share < self.chat_share else "classify"

    def _decay(self) -> None:
        now = time.monotonic()
        factor = math.pow(0.5, (now - self.stamp) / HALF_LIFE_S)
        self.busy = {lane: seconds * factor for lane, seconds in self.busy.items()}
        self.stamp = now

    def _work(self) -> None:
        while True:
            with self.ready:
                while (lane := self.pick()) is None and not self.closed:
                    self.ready.wait()
                if lane is None:  # closed and nothing left
                    return
                future, fn, args, kwargs = self.queues[lane].popleft()
            if not future.set_running_or_notify_cancel():
                continue
            started = time.monotonic()
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 (the caller's future carries it)
                future.set_exception(err)
            else:
                future.set_result(result)
            with self.ready:
                self._decay()
                self.busy[lane] += time.monotonic() - started


class Lane(Executor):
    """One lane of the model thread as an Executor (what `loop.run_in_executor` takes)."""

    def __init__(self, thread: ModelThread, name: str):
        self.thread, self.name = thread, name

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self.thread.submit(self.name, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.thread.shutdown(wait=wait, cancel_futures=cancel_futures)
