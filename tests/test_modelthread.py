"""The model thread's two lanes: a classify call waits for at most the generation already running, chats still get
their share while classify work never stops, and a call cancelled before its turn never runs."""

from __future__ import annotations

import threading
import time

import pytest

from emotune.serve.modelthread import ModelThread


def _job(order: list[str], name: str, seconds: float):
    def run():
        time.sleep(seconds)
        order.append(name)
    return run


def _blocked(thread: ModelThread) -> threading.Event:
    """Hold the model thread until the returned event is set (an instant classify call once released)."""
    gate = threading.Event()
    thread.lane("scoring").submit(gate.wait)
    time.sleep(0.05)  # the worker has taken the gate and waits on it
    return gate


def test_a_classify_call_waits_for_at_most_the_one_generation_already_running():
    thread, order = ModelThread(chat_share=0.5), []
    gate = _blocked(thread)
    chats = [thread.lane("generation").submit(_job(order, f"chat{i}", 0.1)) for i in range(4)]
    classify = thread.lane("scoring").submit(_job(order, "classify", 0.01))
    gate.set()
    classify.result(timeout=10)
    for future in chats:
        future.result(timeout=10)
    thread.shutdown()
    assert order.index("classify") <= 1, order  # first come, first served would put it after all four chats


def test_chats_get_their_share_while_classify_work_never_stops():
    thread, order = ModelThread(chat_share=0.5), []
    gate = _blocked(thread)
    classify = [thread.lane("scoring").submit(_job(order, f"classify{i}", 0.02)) for i in range(30)]
    chats = [thread.lane("generation").submit(_job(order, f"chat{i}", 0.02)) for i in range(3)]
    gate.set()
    for future in classify + chats:
        future.result(timeout=10)
    thread.shutdown()
    last_chat = max(order.index(f"chat{i}") for i in range(3))
    assert last_chat < len(order) - 10, order  # the chats ran among the classify calls, not after all of them


def test_a_call_cancelled_before_its_turn_never_runs_and_shutdown_drops_the_queue():
    thread, order = ModelThread(chat_share=0.5), []
    gate = _blocked(thread)
    cancelled = thread.lane("generation").submit(_job(order, "cancelled", 0))
    kept = thread.lane("scoring").submit(_job(order, "kept", 0))
    assert cancelled.cancel()
    gate.set()
    kept.result(timeout=10)
    gate = _blocked(thread)
    dropped = thread.lane("scoring").submit(_job(order, "dropped", 0))
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    thread.thread.join(timeout=10)
    assert order == ["kept"] and dropped.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.lane("generation").submit(_job(order, "late", 0))


def test_errors_reach_the_caller_and_the_thread_goes_on():
    thread = ModelThread(chat_share=0.5)
    failing = thread.lane("generation").submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    assert thread.lane("scoring").submit(lambda: 42).result(timeout=10) == 42
    with pytest.raises(ValueError, match="unknown lane"):
        thread.lane("admin")
    thread.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_dead_model_thread_is_started_again_and_its_queue_kept():
    thread = ModelThread(chat_share=0.5)
    original = thread.pick

    def broken():
        thread.pick = original
        raise RuntimeError("the scheduler itself failed")

    thread.pick = broken
    with thread.ready:
        thread.ready.notify()  # wake the worker: it calls the broken pick and dies
    thread.thread.join(timeout=10)
    assert not thread.alive
    queued = thread.lane("scoring").submit(lambda: "ran")  # a submit restarts it
    assert queued.result(timeout=10) == "ran" and thread.alive and thread.restarts == 1
    thread.shutdown()
    assert not thread.ensure_running()  # never after shutdown


def test_chats_over_their_share_leave_the_gaps_between_classify_batches_to_the_next_batch():
    """Classify batches come with gaps (the answered clients' next requests, the batcher's wait); a chat taking the
    model in every gap would get about half of it whatever chat_share says."""
    thread, stop = ModelThread(chat_share=0.2), threading.Event()

    def classify_client():  # a 20 ms batch, then 5 ms until the next one is submitted
        while not stop.is_set():
            thread.lane("scoring").submit(time.sleep, 0.02).result(timeout=10)
            time.sleep(0.005)

    def chat_flood():  # there is always a 20 ms chat slice waiting
        pending = []
        while not stop.is_set():
            pending = [f for f in pending if not f.done()]
            while len(pending) < 2:
                pending.append(thread.lane("generation").submit(time.sleep, 0.02))
            time.sleep(0.002)

    workers = [threading.Thread(target=classify_client), threading.Thread(target=chat_flood)]
    for worker in workers:
        worker.start()
    time.sleep(3)
    stop.set()
    for worker in workers:
        worker.join(timeout=10)
    thread.shutdown(cancel_futures=True)
    share = thread.seconds["generation"] / sum(thread.seconds.values())
    assert share < 0.32, thread.seconds  # one chat slice per gap would be about 0.5
