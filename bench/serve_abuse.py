"""`emotune serve` under abuse: 8 well-behaved classify clients, with and without an abuser beside them.

    python bench/serve_abuse.py [--seconds 10] [--rounds 3] [--rate 20] [--model embedded|small|FOLDER]

Starts `emotune serve` on 127.0.0.1 (a subprocess, the packaged model by default, with an API and an admin
key from its environment) over one adapter. 8 clients send one-text /v1/classify requests back to back in
windows of `--seconds`, `--rounds` times without and with the abuse, alternating (so that a load change on a
shared machine falls on both): during the second of each pair an abuser in its own process fires every case of
issue 34 in turn at about `--rate` requests/s for the same time: 5,000 labels, labels with too many tokens, too
many messages, a 230,000-character conversation (on the packaged model's 32k context serve.max_prompt_chars
refuses it before its tokens are counted; the context check itself is tested on the tiny model), a huge
max_tokens, temperature 1e-300, no key, a wrong key, a foreign Host, a foreign Origin, headers that never end, a
body that never comes, an oversized body, too many inputs, n=5, a chat whose client leaves at once (its
generation must stop), and concurrent loads and deletes of one adapter name. Each case has the answers it may
get; a 2xx where a refusal was due is a `wrong_acceptance`. Prints one JSON line: requests, 5xx (anyone's),
wrong acceptances, the good clients' p99 without and with the abuse, and the seconds the model thread spent on
classify work and on chats (adapter loads included) in each condition (`model_s_*`, from /metrics). Targets loopback only and stops by
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import LABELS, Connection, build_run, launch_server, stop_server  # noqa: E402

CLIENTS = 8
KEY, ADMIN = "bench-user-key", "bench-admin-key"
TEXTS = ["i am so happy today", "this makes me furious", "i miss you so much", "what a surprise",
         "i am scared of the dark", "i adore this little dog", "nothing went right today", "wow, just wow"]
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 2, 2


def start_server(run_dir: Path, log: Path, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    settings = ["serve.api_key=env:EMOTUNE_BENCH_KEY", "serve.admin_key=env:EMOTUNE_BENCH_ADMIN",
                f"serve.adapter_dirs=[{run_dir.parent}]", f"serve.header_timeout_s={HEADER_TIMEOUT_S}",
                f"serve.body_timeout_s={BODY_TIMEOUT_S}", *extra]
    return launch_server(run_dir, log, settings, env={"EMOTUNE_BENCH_KEY": KEY, "EMOTUNE_BENCH_ADMIN": ADMIN}, wait_s=600)


# --------------------------------------------------------------------------------------------------
# The well-behaved clients


class KeyedConnection(Connection):
    async def post(self, path: str, payload: dict, timeout: float = 300) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(payload).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        return await asyncio.wait_for(self._response(), timeout)


async def good_clients(url: str, seconds: float) -> dict:
    latencies: list[float] = []
    counts = {"requests": 0, "ok": 0, "5xx": 0, "other": 0}
    stop_at = time.perf_counter() + seconds

    async def client(seed: int) -> None:
        rng, connection = random.Random(seed), KeyedConnection(url)
        while time.perf_counter() < stop_at:
            counts["requests"] += 1
            started = time.perf_counter()
            try:
                status, body = await connection.post("/v1/classify", {"model": "bench", "input": rng.choice(TEXTS)})
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                connection.close()
                counts["other"] += 1
                continue
            if status == 200 and json.loads(body)["data"][0]["label"] in LABELS:
                counts["ok"] += 1
                latencies.append(time.perf_counter() - started)
            else:
                counts["5xx" if status >= 500 else "other"] += 1
        connection.close()

    await asyncio.gather(*(client(i) for i in range(CLIENTS)))
    return {**counts, "latencies": latencies}


def merged(windows: list[dict]) -> dict:
    """The windows of one condition together: counts summed, p99 over every latency."""
    latencies = sorted(t for w in windows for t in w["latencies"])
    total = {key: sum(w[key] for w in windows) for key in ("requests", "ok", "5xx", "other")}
    p99 = 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None
    lanes = {lane: round(sum(w.get("model_s", {}).get(lane, 0.0) for w in windows), 1) for lane in ("scoring", "generation")}
    return {**total, "p99_ms": p99, "model_s": lanes}


# --------------------------------------------------------------------------------------------------
# The abuser (its own process)


async def raw(url: str, head: bytes, body: bytes = b"", wait_s: float = 60.0) -> int | None:
    """Send `head` + `body` on a fresh connection; the status answered, or None when the server closed it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        line = await asyncio.wait_for(reader.readline(), wait_s)
        return int(line.split()[1]) if line else None
    finally:
        writer.close()


def request(method: str, path: str, payload=None, headers: dict | None = None, host: str = "127.0.0.1",
            key: str | None = KEY, length: int | None = None) -> tuple[bytes, bytes]:
    body = b"" if payload is None else json.dumps(payload).encode()
    fields = {"Host": host, "Content-Type": "application/json", "Content-Length": str(len(body) if length is None else length),
              "Connection": "close",
              **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return f"{method} {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode() \
        + b"\r\n", body


def chat(**body) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": "i am so happy today"}], "max_tokens": 4, **body}


def cases() -> dict[str, tuple[tuple[bytes, bytes], set[int | None]]]:
    """Each case: the request, and the answers it may get (None: the server closed the connection)."""
    refused = {422}
    long_message = " ".join(["happy"] * 600)  # 3,600 characters (under serve.max_input_chars), 600 tokens or more
    return {
        "labels_5000": (request("POST", "/v1/classify", {"model": "base", "input": "happy",
                                                          "labels": [f"l{i}" for i in range(5000)]}), refused),
        "label_tokens": (request("POST", "/v1/classify", {"model": "base", "input": "happy",
                                                           "labels": [" ".join(["joy"] * 40) + str(i) for i in range(60)]}),
                         refused),
        "messages_500": (request("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"}] * 500)),
                         refused),
        "conversation_230k_chars": (request("POST", "/v1/chat/completions", chat(messages=[
            {"role": "user" if i % 2 == 0 else "assistant", "content": long_message} for i in range(64)])), refused),
        "max_tokens_huge": (request("POST", "/v1/chat/completions", chat(max_tokens=10**9)), refused),
        "temperature_1e-300": (request("POST", "/v1/chat/completions", chat(temperature=1e-300, max_tokens=1)), {200, 429}),
        "no_key": (request("GET", "/v1/models", key=None), {401}),
        "wrong_key": (request("POST", "/v1/classify", {"model": "bench", "input": "x"}, key="guess"), {401}),
        "foreign_host": (request("GET", "/v1/models", host="evil.example"), {421}),
        "foreign_origin": (request("GET", "/v1/models", headers={"Origin": "http://evil.example"}), {403}),
        "oversized_body": (request("POST", "/v1/classify", {"model": "bench", "input": "x" * 2_000_000}), {413}),
        "inputs_5000": (request("POST", "/v1/classify", {"model": "bench", "input": ["hi"] * 5000}), refused),
        "n_5": (request("POST", "/v1/chat/completions", chat(n=5)), refused),
    }


async def abuse(url: str, seconds: float, rate: float, only: list[str] | None = None) -> dict:
    fixed = cases()
    names = [n for n in (*fixed, "slow_headers", "slow_body", "leaves_at_once", "adapter_race") if not only or n in only]
    race = asyncio.Lock()  # one race at a time: overlapping races would see each other's loads
    stats = {"requests": 0, "5xx": 0, "wrong_acceptances": 0, "unexpected": 0, "by_case": {name: {} for name in names}}
    tasks = []

    def note(name: str, status, allowed: set) -> None:
        """`status`: the HTTP status, None (the server closed the connection), or words for what went wrong."""
        stats["by_case"][name][str(status)] = stats["by_case"][name].get(str(status), 0) + 1
        code = status if isinstance(status, int) else 0
        stats["5xx"] += code >= 500
        stats["wrong_acceptances"] += 200 <= code < 300 and code not in allowed
        stats["unexpected"] += status not in allowed  # refused, but not as this case should be (or no answer)

    async def fire(name: str) -> None:
        stats["requests"] += 1
        try:
            if name in fixed:
                (head, body), allowed = fixed[name]
                return note(name, await raw(url, head, body), allowed)
            if name == "slow_headers":  # never ends its headers: closed after serve.header_timeout_s
                return note(name, await raw(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                            wait_s=HEADER_TIMEOUT_S + 10), {None})
            if name == "slow_body":  # promises 100 bytes and sends 8: 408 after serve.body_timeout_s
                head, _ = request("POST", "/v1/classify", length=100)
                return note(name, await raw(url, head, b'{"model"', wait_s=BODY_TIMEOUT_S + 10), {408})
            if name == "leaves_at_once":  # asks for 64 tokens and leaves after 50 ms: the generation must stop
                head, body = request("POST", "/v1/chat/completions", chat(max_tokens=64))
                try:
                    await raw(url, head, body, wait_s=0.05)
                except asyncio.TimeoutError:
                    pass
                return note(name, None, {None})
            if race.locked():  # the last race is still running: its loads wait for the model thread like any work
                return note(name, "skipped: the previous race still runs", {"skipped: the previous race still runs"})
            async with race:
                await adapter_race(url, note)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as err:
            note(name, f"no answer ({type(err).__name__})", set())

    stop_at, i = time.perf_counter() + seconds, 0
    while time.perf_counter() < stop_at:
        tasks.append(asyncio.create_task(fire(names[i % len(names)])))
        i += 1
        await asyncio.sleep(1 / rate)
    _, late = await asyncio.wait(tasks, timeout=60)  # answers still missing a minute after the abuse: counted, not awaited
    for task in late:
        task.cancel()
    stats["unanswered_after_60s"] = len(late)
    return stats


async def adapter_race(url: str, note) -> None:
    """Two concurrent loads of one name (201 + 409), then two concurrent deletes of it (200 + 404)."""
    load = request("POST", "/v1/adapters", {"name": "racer", "path": "bench"}, key=ADMIN)
    delete = request("DELETE", "/v1/adapters/racer", key=ADMIN)
    for (head, body), expected in ((load, [201, 409]), (delete, [200, 404])):
        statuses = await asyncio.gather(raw(url, head, body), raw(url, head, body))
        for status in statuses:
            note("adapter_race", status, set(expected))
        if sorted(statuses) != expected:  # both accepted, or both refused: the race was not serialised
            note("adapter_race", f"not serialised {statuses}", set())


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    parser.add_argument("--rounds", type=int, default=3, help="windows without and with the abuse, alternating")
    parser.add_argument("--rate", type=float, default=20.0, help="abuser requests per second")
    parser.add_argument("--model", default="embedded", help="embedded (the packaged model), small, or a model folder")
    parser.add_argument("--log", help="keep the server's log in this file")
    parser.add_argument("--cases", help="comma-separated case names to fire (default: every case)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a serve setting, e.g. serve.chat_share=0.2")
    parser.add_argument("--abuser", help=argparse.SUPPRESS)  # the abuser process: the server's URL
    args = parser.parse_args()
    only = args.cases.split(",") if args.cases else None
    if args.abuser:
        print(json.dumps(asyncio.run(abuse(args.abuser, args.seconds, args.rate, only))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = build_run(args.model, Path(tmp))
        process, url = start_server(run_dir, Path(args.log) if args.log else Path(tmp) / "server.log", args.set)
        try:
            asyncio.run(good_clients(url, 3))  # warm-up
            calm, busy, abused = measure(url, args)
        finally:
            stop_server(process)
    calm, busy = merged(calm), merged(busy)
    ratio = busy["p99_ms"] / calm["p99_ms"] if busy["p99_ms"] and calm["p99_ms"] else None
    counted = ("requests", "5xx", "wrong_acceptances", "unexpected", "unanswered_after_60s")
    abuse_total = {key: sum(a[key] for a in abused) for key in counted}
    by_case: dict[str, dict[str, int]] = {}
    for a in abused:
        for case, answers in a["by_case"].items():
            for answer, n in answers.items():
                by_case.setdefault(case, {})[answer] = by_case.get(case, {}).get(answer, 0) + n
    print(json.dumps({"bench": "serve_abuse", "model": args.model, "seconds": args.seconds, "rounds": args.rounds,
                      "rate": args.rate, "requests": calm["requests"] + busy["requests"] + abuse_total["requests"],
                      "5xx": calm["5xx"] + busy["5xx"] + abuse_total["5xx"],
                      "wrong_acceptances": abuse_total["wrong_acceptances"],
                      "good_p99_ms_without_abuse": round(calm["p99_ms"], 1), "good_p99_ms_with_abuse": round(busy["p99_ms"], 1),
                      "p99_ratio": round(ratio, 2) if ratio else None, "good_ok": [calm["ok"], busy["ok"]],
                      "model_s_without_abuse": calm["model_s"], "model_s_with_abuse": busy["model_s"],
                      "good_other": calm["other"] + busy["other"], "abuse_unexpected": abuse_total["unexpected"],
                      "abuse_unanswered_after_60s": abuse_total["unanswered_after_60s"],
                      "abuse_requests": abuse_total["requests"], "abuse_by_case": by_case}))


def measure(url: str, args) -> tuple[list[dict], list[dict], list[dict]]:
    """Windows without and with the abuser, alternating, so that a load change on a shared machine falls on both;
    each window notes the model thread's seconds per lane it saw (from /metrics)."""
    calm, busy, abused = [], [], []
    for _ in range(args.rounds):
        before = model_seconds(url)
        calm.append({**asyncio.run(good_clients(url, args.seconds)), "model_s": since(before, model_seconds(url))})
        abuser = subprocess.Popen([sys.executable, __file__, "--abuser", url, "--seconds", str(args.seconds),
                                   "--rate", str(args.rate), *(["--cases", args.cases] if args.cases else [])],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(1)  # the abuser's interpreter starting
        before = model_seconds(url)
        window = asyncio.run(good_clients(url, args.seconds))
        busy.append({**window, "model_s": since(before, model_seconds(url))})
        abused.append(json.loads(abuser.communicate(timeout=args.seconds + 120)[0]))
    return calm, busy, abused


def model_seconds(url: str) -> dict[str, float]:
    """The model thread's seconds per lane since the server started (emotune_model_thread_seconds_total)."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    found = re.findall(r'^emotune_model_thread_seconds_total\{lane="(\w+)"\} ([0-9.]+)$', text, re.MULTILINE)
    return {lane: float(value) for lane, value in found}


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {lane: round(after[lane] - before.get(lane, 0.0), 2) for lane in after}

if __name__ == "__main__":
    main()
