"""Issue 34, the server: limits checked before any work starts, admission for chat, disconnects and SIGTERM,
auth and host checks, slow clients, sampling edge cases, in-band stream errors, per-name adapter races, a
supervised worker, and model cards without paths. Every test drives the real app over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from emotune.cli import main
from emotune.core.config.build import dump_config
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.serve import check_auth
from emotune.serve.guards import uvicorn_config
from emotune.serve.vllm import vllm_environment
from test_serve import ADMIN_AUTH, AUTH
from test_serve_hardening import adapters_root, start  # noqa: F401 (a fixture, used by name)


@pytest.fixture(scope="module")
def served(tiny_model_dir, adapters_root):  # noqa: F811
    """The real uvicorn settings (slow-client guard included) with short timeouts."""
    engine, app = start(tiny_model_dir, adapters_root, max_chats=1, header_timeout_s=0.5, body_timeout_s=0.5,
                        max_input_chars=500, max_new_tokens=64, max_body_bytes=1_000_000,
                        max_prompt_chars=10_000)
    config = uvicorn_config(app, app.state.server.cfg, port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine, app.state.server
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served[0], timeout=30) as client:
        yield client


def error(response, status) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


def chat_body(**body):
    return {"model": "tiny", "messages": [{"role": "user", "content": "happy"}], "max_tokens": 2, **body}


# --------------------------------------------------------------------------------------------------
# 1. Limits before work


def test_five_thousand_labels_are_refused_at_once(http):
    labels = [f"label{i}" for i in range(5000)]
    started = time.perf_counter()
    response = http.post("/v1/classify", headers=AUTH, json={"model": "base", "input": "happy", "labels": labels})
    assert "serve.max_labels=64" in error(response, 422)
    assert time.perf_counter() - started < 5  # the request got no answer in 120 s


def test_labels_holding_too_many_tokens_together_are_refused(http):
    labels = [" ".join(["happy"] * 20) + f" x{i}" for i in range(30)]  # 30 labels, about 630 tokens
    assert "serve.max_label_tokens=512" in error(http.post("/v1/classify", headers=AUTH, json={
        "model": "base", "input": "happy", "labels": labels}), 422)


def test_labels_the_tokenizer_reads_alike_are_refused(http):
    """The base model scored request labels the tokenizer cannot tell apart (`喜悦` and `愤怒` both its unknown
    token; `joy` and `joy ` one word) as a tie, 0.5 each, and answered the first: an answer the text played no
    part in. Training refuses such labels."""
    for labels in (["喜悦", "愤怒"], ["joy", "joy "]):
        message = error(http.post("/v1/classify", headers=AUTH, json={"model": "base", "input": "happy", "labels": labels}), 422)
        assert "same tokens" in message and repr(labels[0]) in message


def test_too_many_messages_and_a_prompt_beyond_the_context_are_refused(http):
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "happy"} for i in range(65)]
    assert "serve.max_messages=64" in error(http.post("/v1/chat/completions", headers=AUTH,
                                                      json=chat_body(messages=many)), 422)
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(["happy"] * 80)} for i in range(9)]
    assert "context of 512 tokens" in error(http.post("/v1/chat/completions", headers=AUTH,
                                                      json=chat_body(messages=long)), 422)
    many_chars = [{"role": "user" if i % 2 == 0 else "assistant", "content": "happy " * 80} for i in range(25)]
    assert "serve.max_prompt_chars=10000" in error(http.post("/v1/chat/completions", headers=AUTH,
                                                            json=chat_body(messages=many_chars)), 422)
    assert "serve.max_new_tokens=64" in error(http.post("/v1/chat/completions", headers=AUTH,
                                                        json=chat_body(max_tokens=65)), 422)


def test_chat_goes_through_admission_control(served, http):
    engine, state = served[1], served[2]
    with ThreadPoolExecutor(1) as pool, engine.lock:  # the model is busy: the first chat waits for it
        first = pool.submit(http.post, "/v1/chat/completions", headers=AUTH, json=chat_body())
        deadline = time.time() + 10
        while state.admission.chats < 1 and time.time() < deadline:
            time.sleep(0.01)
        limited = http.post("/v1/chat/completions", headers=AUTH, json=chat_body())
        assert "serve.max_chats=1" in error(limited, 429) and limited.headers["retry-after"] == "1"
    assert first.result().status_code == 200
    assert state.admission.pending == 0 and state.admission.chats == 0


@pytest.mark.parametrize("path,body", [("/v1/classify", {"model": "tiny", "input": "happy"}),
                                       ("/v1/chat/completions", chat_body(max_tokens=8)),
                                       ("/v1/chat/completions", chat_body(max_tokens=8, stream=True))])
def test_a_client_that_disconnects_has_its_work_cancelled_before_it_runs(served, path, body):
    url, engine, state = served
    calls = []
    with engine.lock:  # the model thread is busy: the request waits, then its client gives up
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.5)) as client:
                client.post(path, headers=AUTH, json=body)
        deadline = time.time() + 10
        while state.admission.pending and time.time() < deadline:
            time.sleep(0.01)
        assert state.admission.pending == 0  # given up while the model was still busy
        original = engine.using
        engine.using = lambda name: calls.append(name) or original(name)
    try:
        time.sleep(0.5)  # the model thread is free: a job that was not cancelled would run now
    finally:
        del engine.using
    assert calls == []


SIGTERM_SCRIPT = textwrap.dedent("""
    import sys, time
    from emotune.core.config.eval import ServeConfig
    from emotune.core.config.load import load_config
    from emotune.serve import build_engine, create_app, run_server

    cfg = load_config(None, ["device=cpu", f"model.source={sys.argv[1]}"])
    engine, _ = build_engine(cfg, [])
    def stuck(*args):  # one model call that runs for minutes, like the issue's 5,000 labels
        with engine.lock, engine._busy():
            time.sleep(600)
    engine.classify = stuck
    serve = ServeConfig(port=int(sys.argv[2]), no_auth=True, shutdown_timeout_s=2)
    run_server(create_app(engine, serve), serve)
""")


@pytest.mark.slow  # a subprocess loads the model
def test_sigterm_stops_the_server_within_its_shutdown_timeout_whatever_runs(tiny_model_dir, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "serve_stuck.py"
    script.write_text(SIGTERM_SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        pool = ThreadPoolExecutor(1)
        pool.submit(httpx.post, url + "/v1/classify", json={"model": "base", "input": "happy", "labels": ["a", "b"]},
                    timeout=60)
        deadline = time.time() + 10
        while httpx.get(url + "/health", timeout=5).json()["model_thread"] != "busy" and time.time() < deadline:
            time.sleep(0.05)
        stopped = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=2 + 10)  # the shutdown timeout, and time to start and stop the interpreter
        assert time.perf_counter() - stopped < 2 + 10
        assert "Application shutdown complete" in process.stdout.read()
        pool.shutdown(wait=False)
    finally:
        if process.poll() is None:
            process.kill()


# --------------------------------------------------------------------------------------------------
# 2. Auth, hosts, slow clients


def test_keys_must_be_given_or_no_auth_declared_on_loopback(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is empty"):
        ServeConfig(api_key="")
    with pytest.raises(ValueError, match="is empty"):
        ServeConfig(api_key="env:")
    with pytest.raises(UserError, match="--no-auth"):
        check_auth(ServeConfig())
    with pytest.raises(UserError, match="loopback host only"):
        check_auth(ServeConfig(no_auth=True, host="0.0.0.0"))
    check_auth(ServeConfig(no_auth=True))
    monkeypatch.setenv("EMPTY_KEY", "  ")
    with pytest.raises(UserError, match="unset or empty"):
        check_auth(ServeConfig(api_key="env:EMPTY_KEY"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        check_auth(ServeConfig(api_key=f"file:{tmp_path / 'empty'}"))
    (tmp_path / "key").write_text("s3cret\n")
    check_auth(ServeConfig(api_key=f"file:{tmp_path / 'key'}"))


def test_a_key_is_never_printed_saved_or_put_on_a_command_line(capsys, tiny_run_dir):
    cfg = load_config(None, ["serve.admin_key=env:ADMIN"])
    cfg.serve.api_key = "s3cret-literal"  # as a YAML file may hold it
    dumped = dump_config(cfg)
    assert "s3cret-literal" not in dumped and "api_key: '***'" in dumped and "admin_key: env:ADMIN" in dumped
    assert "s3cret-literal" not in json.dumps(cfg.model_dump(mode="json"))
    assert main(["serve", str(tiny_run_dir), "serve.api_key=s3cret-literal"]) == 2
    assert "on the command line" in capsys.readouterr().err
    env = vllm_environment("s3cret-literal")
    assert env["VLLM_API_KEY"] == "s3cret-literal" and "VLLM_API_KEY" not in vllm_environment(None)


@pytest.mark.parametrize("headers,status", [({"Host": "evil.example"}, 421), ({"Host": "evil.example:8000"}, 421),
                                            ({"Origin": "http://evil.example"}, 403), ({"Origin": "null"}, 403),
                                            ({"Origin": "http://[::1"}, 403), ({"Host": "[::1"}, 421),  # unclosed `[`: 500
                                            ({"Host": "localhost:1", "Origin": "http://127.0.0.1:1"}, 200)])
def test_host_and_origin_must_name_this_server_dns_rebinding(http, headers, status):
    assert http.get("/v1/models", headers={**AUTH, **headers}).status_code == status


def test_a_client_too_slow_with_its_headers_is_disconnected_and_with_its_body_gets_408(served):
    host, port = served[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        started = time.perf_counter()
        assert slow.recv(100) == b""  # closed by the server
        assert time.perf_counter() - started < 3
    with socket.create_connection((host, int(port)), timeout=5) as slow:
        slow.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer user-key\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        assert b" 408 " in slow.recv(1000).split(b"\r\n")[0]


@pytest.mark.parametrize("declared", [b"100", b"999999999"])
def test_a_body_sent_without_the_key_is_not_read_or_waited_for(served, declared):
    """The body was read whole (held up to serve.max_body_bytes, waited for up to serve.body_timeout_s) before the key
    was checked: a caller without one got 408 for a body it held back, or 413 for one too large, not 401."""
    host, port = served[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sender:
        sender.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + declared + b"\r\n\r\n{\"model\"")  # and never the rest
        assert b" 401 " in sender.recv(1000).split(b"\r\n")[0]


def test_health_which_needs_no_key_reads_no_body(served):
    """/health is open to all and takes no body, but the body a caller declared was read and held (up to
    serve.max_body_bytes, waited for up to serve.body_timeout_s, then 408) all the same."""
    host, port = served[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sender:
        sender.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n{")  # the rest never
        assert b" 200 " in sender.recv(1000).split(b"\r\n")[0]


# --------------------------------------------------------------------------------------------------
# 3. No value reaches a 500; races; health; model cards


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 0.001, 2.0])
def test_extreme_temperatures_are_answered(http, temperature):
    response = http.post("/v1/chat/completions", headers=AUTH, json=chat_body(temperature=temperature, seed=1,
                                                                              top_p=1e-300))
    assert response.status_code == 200, response.text


def test_a_failure_inside_a_stream_is_an_error_event_and_counted_as_an_error(served, http, monkeypatch):
    engine = served[1]

    def broken(**kwargs):
        kwargs["streamer"].put(kwargs["input_ids"][:, :1])  # the prompt, which the streamer skips
        raise RuntimeError("the model broke mid-stream")

    monkeypatch.setattr(engine.model, "generate", broken)
    events = http.post("/v1/chat/completions", headers=AUTH, json=chat_body(stream=True)).text.split("\n\n")
    payloads = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert "error" in payloads[-1] and events[-2] == "data: [DONE]"
    monkeypatch.undo()
    counted = 'emotune_requests_total{endpoint="/v1/chat/completions",status="500"} 1'
    deadline = time.time() + 10  # counted once the response has ended, just after the client read its last event
    while counted not in http.get("/metrics", headers=AUTH).text and time.time() < deadline:
        time.sleep(0.05)
    assert counted in http.get("/metrics", headers=AUTH).text


def test_after_an_unforeseen_failure_the_clients_next_request_is_answered(served, http, monkeypatch):
    """Starlette raises an unforeseen error again after its 500, and uvicorn closes the connection: a kept-alive client
    (httpx, requests, the openai client) sent its next request into the closed socket and got a connection reset."""

    def broken(*args, **kwargs):
        raise RuntimeError("a failure nobody foresaw")

    import logging

    monkeypatch.setattr(served[2].metrics, "render", broken)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.name) if record.exc_info else None
    for name in ("emotune.serve", "uvicorn.error"):
        logging.getLogger(name).addHandler(handler)
    try:
        for _ in range(3):  # on one kept-alive client, as a real one sends them
            failed = http.get("/metrics", headers=AUTH)
            assert "a failure nobody foresaw" in error(failed, 500)
            assert failed.json()["error"]["type"] == "server_error"
            assert http.get("/v1/models", headers=AUTH).status_code == 200
    finally:
        for name in ("emotune.serve", "uvicorn.error"):
            logging.getLogger(name).removeHandler(handler)
    assert logged == ["emotune.serve"] * 3  # one traceback per failure: uvicorn logged each a second time


def test_concurrent_loads_and_deletes_of_one_adapter_are_serialised(served, http):
    body = {"name": "racer", "path": "rank8"}
    with ThreadPoolExecutor(2) as pool:
        loads = sorted(r.status_code for r in pool.map(lambda _: http.post("/v1/adapters", headers=ADMIN_AUTH,
                                                                                 json=body), range(2)))
        assert loads == [201, 409]
        deletes = sorted(r.status_code for r in pool.map(lambda _: http.delete("/v1/adapters/racer",
                                                                                   headers=ADMIN_AUTH), range(2)))
    assert deletes == [200, 404]
    for name in (f"never-loaded-{i}" for i in range(5)):  # each name's lock went with its 404 (they had stayed, one
        assert http.delete(f"/v1/adapters/{name}", headers=ADMIN_AUTH).status_code == 404  # per name, for good)
    assert http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "lost", "path": "nowhere"}).status_code == 404
    assert served[2].name_locks == {}


def test_health_reflects_the_worker_which_is_restarted_when_it_dies(served, http, monkeypatch):
    state = served[2]
    assert http.get("/health").json()["worker"] == "running"
    before = state.restarts
    collect = state.batcher._collect
    calls = []

    async def dies_once(loop):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the worker died")
        return await collect(loop)

    monkeypatch.setattr(state.batcher, "_collect", dies_once)
    for _ in range(2):  # the worker dies as it looks for the batch after the first; the second finds it restarted
        response = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "happy"}, timeout=30)
        assert response.status_code == 200
    assert state.restarts > before
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["worker"] == "running" and health["worker_restarts"] > before


def test_models_show_names_not_paths(http, adapters_root):  # noqa: F811
    cards = http.get("/v1/models", headers=AUTH).json()["data"]
    assert all(str(adapters_root) not in json.dumps(card) and "/" not in card["root"] for card in cards)


def test_docs_serving_lists_the_new_limits():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    for key in ("max_labels", "max_messages", "max_chats", "header_timeout_s", "--no-auth", "allowed_hosts"):
        assert key in text, key


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_whose_client_leaves_stops_at_its_next_token(served, monkeypatch, stream):
    from transformers import LogitsProcessor, LogitsProcessorList

    url, engine = served[0], served[1]
    generate, produced = engine.model.generate, []

    class Slow(LogitsProcessor):  # 50 ms a token: 40 tokens would take 2 s
        def __call__(self, input_ids, scores):
            time.sleep(0.05)
            return scores

    def slow_generate(logits_processor=(), **kwargs):  # each slice (serve.chat_slice_tokens) in full unless cancelled
        output = generate(**kwargs, logits_processor=LogitsProcessorList([*logits_processor, Slow()]),
                          min_new_tokens=kwargs["max_new_tokens"])
        produced.append(output.sequences.shape[1] - kwargs["input_ids"].shape[1])
        return output

    monkeypatch.setattr(engine.model, "generate", slow_generate)
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.4)) as client:
        if stream:  # the first event, then the client goes away
            with client.stream("POST", "/v1/chat/completions", headers=AUTH,
                               json=chat_body(max_tokens=40, stream=True)) as response:
                next(response.iter_bytes())
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/chat/completions", headers=AUTH, json=chat_body(max_tokens=40))
    started = _settled(produced, within_s=20 if not stream else 5)  # a stream may be cancelled before its first slice
    assert (started or stream) and sum(produced) < 20, produced  # 40 asked for


def _settled(produced: list[int], quiet_s: float = 1.0, within_s: float = 20) -> bool:
    """Wait until a generation has made tokens and no slice has started for `quiet_s` (it ended)."""
    deadline, seen, since = time.time() + within_s, -1, time.time()
    while time.time() < deadline:
        if len(produced) != seen:
            seen, since = len(produced), time.time()
        elif produced and time.time() - since > quiet_s:
            return True
        time.sleep(0.05)
    return False


def test_a_chat_whose_client_leaves_before_it_is_admitted_never_generates_in_full(served, monkeypatch):
    url, engine = served[0], served[1]
    generate, produced = engine.model.generate, []

    def slow_generate(logits_processor=(), **kwargs):
        from transformers import LogitsProcessor, LogitsProcessorList

        class Slow(LogitsProcessor):
            def __call__(self, input_ids, scores):
                time.sleep(0.05)
                return scores

        output = generate(**kwargs, logits_processor=LogitsProcessorList([*logits_processor, Slow()]),
                          min_new_tokens=kwargs["max_new_tokens"])
        produced.append(output.sequences.shape[1] - kwargs["input_ids"].shape[1])
        return output

    monkeypatch.setattr(engine.model, "generate", slow_generate)
    body = json.dumps(chat_body(max_tokens=40)).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as leaving:
        leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer user-key\r\n"
                        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                        + body)
        time.sleep(0.02)
    _settled(produced, within_s=5)
    assert sum(produced) < 20, produced


def test_a_chat_beyond_serve_max_chats_is_refused_before_it_is_rendered(served, http, monkeypatch):
    from emotune.serve import routes

    engine, state, rendered = served[1], served[2], []
    render = routes.chat_job
    monkeypatch.setattr(routes, "chat_job", lambda *args: rendered.append(1) or render(*args))
    with ThreadPoolExecutor(1) as pool, engine.lock:  # the first chat waits for the model
        first = pool.submit(http.post, "/v1/chat/completions", headers=AUTH, json=chat_body())
        deadline = time.time() + 10
        while state.admission.chats < 1 and time.time() < deadline:
            time.sleep(0.01)
        assert "serve.max_chats=1" in error(http.post("/v1/chat/completions", headers=AUTH, json=chat_body()), 429)
        assert len(rendered) == 1  # the refused one was never rendered nor its tokens counted
        assert "n=5" in error(http.post("/v1/chat/completions", headers=AUTH, json=chat_body(n=5)), 422)  # not 429
    assert first.result().status_code == 200 and state.admission.chats == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_whose_client_left_while_it_was_rendered_never_reaches_the_model(served, monkeypatch, stream):
    """On an idle model thread a generation submitted after its client left would start before the disconnect is
    seen (and run until its first token): the disconnect is looked for before the first step is submitted."""
    from emotune.serve import routes

    url, engine, state = served
    render, generated = routes.chat_job, []
    monkeypatch.setattr(routes, "chat_job", lambda *args: time.sleep(0.6) or render(*args))  # a long conversation
    monkeypatch.setattr(engine.model, "generate", lambda **kwargs: generated.append(1) or 1 / 0)
    body = json.dumps(chat_body(max_tokens=8, stream=stream)).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as leaving:
        leaving.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer user-key\r\n"
                        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                        + body)
        time.sleep(0.2)  # gone while the conversation is being rendered
    deadline = time.time() + 10
    while state.admission.chats and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert generated == [] and state.admission.chats == 0
