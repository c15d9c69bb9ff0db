"""The model thread: every model call runs on one thread, taken from two lanes so chats cannot starve classification.

A chat completion holds the model for a slice of its reply at a time (emotune.serve.chat), a classify batch for one
forward pass. With one first-come queue, a burst of chats puts every classify request behind all of them. Here classify batches wait in the
`scoring` lane, generations and adapter loads in the `generation` lane. The thread takes whichever lane has
work; when both have, chats get the model only while their share of its recent busy time is under
`serve.chat_share` (time decays with a half-life of `HALF_LIFE_S`), so a classify request waits for at most the one
slice already running, and chats still get their share while classify traffic never stops.

Classify traffic comes in batches with gaps between them: the clients a batch answered send their next requests,
and the batcher collects them for serve.batch_wait_ms before it submits the next batch. Were a waiting chat to take
the model in every such gap, chats would get one turn per batch whatever their share (measured: 68 % of the model
thread at chat_share 0.2 under bench/serve_abuse.py's leaving chats). So while chats are over their share, the
thread keeps the model free for `anticipate_s` after a classify batch, for the next one; with no classify traffic
chats get the whole model after that wait.

`ModelThread.lane(name)` is a `concurrent.futures.Executor` for `loop.run_in_executor`; a future cancelled before
its turn never runs (a client that left).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future

LANES = ("scoring", "generation")
HALF_LIFE_S = 10.0
ANTICIPATE_S = 0.05
"""How long after a classify batch chats over their share wait for the next batch: a client's next request arrives
within milliseconds of its answer on loopback, tens of them on a loaded machine; one slice of a chat takes longer."""


class ModelThread:
    """One worker thread over the lanes' queues."""

    def __init__(self, chat_share: float, name: str = "emotune-model", anticipate_s: float = ANTICIPATE_S):
        self.chat_share, self.anticipate_s = chat_share, anticipate_s
        self.scoring_ended = -math.inf  # time.monotonic() when the last classify call ended
        self.hold_until: float | None = None  # the model kept free for classify work until then (pick)
        self.queues: dict[str, deque] = {lane: deque() for lane in LANES}
        self.busy = dict.fromkeys(LANES, 0.0)  # decayed seconds of model time per lane
        self.seconds = dict.fromkeys(LANES, 0.0)  # all the model time per lane since start (/metrics)
        self.jobs = dict.fromkeys(LANES, 0)
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
        """The lane whose job runs next (called with `ready` held): chat while its share of the recent model time
        is under chat_share, else classify work when there is some. None: nothing to do, or (`hold_until` set) chats
        over their share wait for the classify batch due after the last one."""
        self.hold_until = None
        waiting = [lane for lane in LANES if self.queues[lane]]
        if "generation" not in waiting:
            return waiting[0] if waiting else None
        self._decay()
        total = sum(self.busy.values())
        share = self.busy["generation"] / total if total > 0 else 0.0
        if share < self.chat_share:
            return "generation"
        if "scoring" in waiting:
            return "scoring"
        due = self.scoring_ended + self.anticipate_s
        if time.monotonic() < due and not self.closed:  # classify traffic goes on: its next batch is on its way
            self.hold_until = due
            return None
        return "generation"

    def _decay(self) -> None:
        now = time.monotonic()
        factor = math.pow(0.5, (now - self.stamp) / HALF_LIFE_S)
        self.busy = {lane: seconds * factor for lane, seconds in self.busy.items()}
        self.stamp = now

    def _work(self) -> None:
        while True:
            with self.ready:
                while (lane := self.pick()) is None and not self.closed:
                    self.ready.wait(None if self.hold_until is None else max(0.0, self.hold_until - time.monotonic()))
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
                ended = time.monotonic()
                spent = ended - started
                self.busy[lane] += spent
                if lane == "scoring":
                    self.scoring_ended = ended
                self.seconds[lane] += spent
                self.jobs[lane] += 1


class Lane(Executor):
    """One lane of the model thread as an Executor (what `loop.run_in_executor` takes)."""

    def __init__(self, thread: ModelThread, name: str):
        self.thread, self.name = thread, name

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self.thread.submit(self.name, fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.thread.shutdown(wait=wait, cancel_futures=cancel_futures)
