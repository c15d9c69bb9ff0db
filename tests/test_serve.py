"""`emotune serve` driven over real HTTP on 127.0.0.1: the official `openai` client and raw httpx requests."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import LABELS, write_tiny_adapter
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.eval.scoring import score_label_probs
from emotune.serve import build_engine, create_app
from server_harness import running

USER, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {USER}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def adapters_root(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    write_tiny_adapter(tiny_model_dir, root / "tiny", seed=0)
    write_tiny_adapter(tiny_model_dir, root / "second", seed=1)
    (root.parent / "outside").mkdir(exist_ok=True)
    write_tiny_adapter(tiny_model_dir, root.parent / "outside" / "sneaky", seed=2)
    return root


def serve_config(adapters_root, **changes) -> ServeConfig:
    values = dict(api_key=USER, admin_key=ADMIN, adapter_dirs=[str(adapters_root)], max_queue=16, max_inputs=20,
                  max_input_chars=500, max_body_bytes=20_000, max_new_tokens=16, batch_wait_ms=20)
    return ServeConfig(**{**values, **changes})


def start(adapters_root, **changes):
    cfg = load_config(None, ["device=cpu"])
    engine, _ = build_engine(cfg, [str(adapters_root / "tiny")])
    return engine, create_app(engine, serve_config(adapters_root, **changes))


@pytest.fixture(scope="module")
def server(adapters_root):
    engine, app = start(adapters_root)
    with running(app) as (url, uvicorn_server):
        yield url, engine, app


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=USER, max_retries=0)


def expected_probs(engine, name, texts):
    with engine.using(name) as loaded:
        artifact = loaded.artifact
        return score_label_probs(engine.model, loaded.tokenizer, texts, artifact.prompt, artifact.labels)


def test_health_models_and_metrics(http, client):
    assert http.get("/health").json()["status"] == "ok"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["base", "tiny"]
    assert http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "happy"}).status_code == 200
    metrics = http.get("/metrics", headers=AUTH)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'emotune_requests_total{endpoint="/v1/classify",status="200"}' in metrics.text
    assert "emotune_classified_texts_total" in metrics.text and "emotune_queue_texts 0" in metrics.text
    scoring = re.search(r'^emotune_model_thread_seconds_total\{lane="scoring"\} ([0-9.]+)$', metrics.text, re.MULTILINE)
    assert scoring and float(scoring.group(1)) > 0 and 'emotune_model_thread_calls_total{lane="generation"}' in metrics.text
    # Prometheus' text format throughout: comments, or `name{labels} value` (a debug dump once trailed it)
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+$|^# TYPE [a-z_]+ [a-z]+$')
    assert all(sample.match(line) for line in metrics.text.splitlines()), metrics.text


def test_classify_matches_direct_scoring(server, http):
    engine = server[1]
    texts = ["i am so happy today", "my friend was furious", "lonely and lost"]
    reply = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": texts})
    assert reply.status_code == 200
    data = reply.json()["data"]
    expected = expected_probs(engine, "tiny", texts)
    for row, probs in zip(data, expected.tolist(), strict=False):
        assert list(row["probs"]) == LABELS
        assert [row["probs"][label] for label in LABELS] == pytest.approx(probs, abs=1e-5)
        assert row["label"] == LABELS[max(range(len(LABELS)), key=probs.__getitem__)]
    single = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": texts[0]}).json()["data"]
    assert len(single) == 1 and single[0]["probs"] == pytest.approx(data[0]["probs"], abs=1e-5)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, http):
    engine, app = server[1], server[2]
    texts = [f"{w} today" for w in ("happy", "furious", "scared", "lonely", "wow", "adore", "great", "rage")]
    expected = expected_probs(engine, "tiny", texts)
    batches_before = app.state.server.metrics.counters[("emotune_batches_total", ())]

    def one(text):
        return http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": text}).json()["data"][0]["probs"]

    with ThreadPoolExecutor(8) as pool:
        engine.lock.acquire()  # hold the model so all eight requests queue up and are scored together
        try:
            futures = [pool.submit(one, t) for t in texts]
            deadline = time.time() + 30
            while app.state.server.batcher.pending < len(texts) and time.time() < deadline:
                time.sleep(0.01)
        finally:
            engine.lock.release()
        results = [f.result() for f in futures]
    for got, want in zip(results, expected.tolist(), strict=False):
        assert [got[label] for label in LABELS] == pytest.approx(want, abs=1e-5)
    batches = app.state.server.metrics.counters[("emotune_batches_total", ())] - batches_before
    assert batches < len(texts)


def test_base_model_needs_labels_and_differs_from_adapter(http):
    assert http.post("/v1/classify", headers=AUTH, json={"model": "base", "input": "happy"}).status_code == 422
    base = http.post("/v1/classify", headers=AUTH, json={"model": "base", "input": "happy", "labels": LABELS}).json()
    tuned = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "happy"}).json()
    assert base["data"][0]["probs"] != pytest.approx(tuned["data"][0]["probs"], abs=1e-4)
    assert http.post("/v1/classify", headers=AUTH,
                     json={"model": "tiny", "input": "x", "labels": ["a", "b"]}).status_code == 422


def test_chat_completions_streaming_and_not(client):
    messages = [{"role": "user", "content": "classify this text : i am happy"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    text = reply.choices[0].message.content
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 5

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed.strip() == text
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert len(chunks) >= 3  # role chunk, content, finish

    parts = [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"]}]}]
    assert client.chat.completions.create(model="tiny", messages=parts, max_tokens=5).choices[0].message.content == text


def test_vllm_client_example_runs_against_this_server(server, tiny_run_dir, tmp_path):
    """The exported client.py speaks plain OpenAI chat; here it talks to emotune's server (extra_body is ignored)."""
    import importlib.util

    from emotune.deploy.export import export

    out = export(tiny_run_dir, out=tmp_path / "export", vllm=True)
    spec = importlib.util.spec_from_file_location("client_example", out / "vllm" / "client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    answer = module.classify(openai.OpenAI(base_url=server[0] + "/v1", api_key=USER, max_retries=0), "i am happy")
    assert isinstance(answer, str)


def test_adapters_hot_load_and_unload(http, client, adapters_root):
    probe = {"input": "i am so happy today"}
    first = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", **probe}).json()["data"][0]["probs"]
    loaded = http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "second", "path": "second"})
    assert loaded.status_code == 201, loaded.text
    assert loaded.json()["labels"] == LABELS
    assert [m.id for m in client.models.list().data] == ["base", "tiny", "second"]
    second = http.post("/v1/classify", headers=AUTH, json={"model": "second", **probe}).json()["data"][0]["probs"]
    assert second != pytest.approx(first, abs=1e-4)
    # switching back gives the first adapter's numbers again
    again = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", **probe}).json()["data"][0]["probs"]
    assert again == pytest.approx(first, abs=1e-5)
    chat = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "happy"}], max_tokens=2)
    assert chat.model == "second"

    assert http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "second", "path": "second"}).status_code == 409
    assert http.delete("/v1/adapters/second", headers=ADMIN_AUTH).json()["deleted"] is True
    assert http.post("/v1/classify", headers=AUTH, json={"model": "second", **probe}).status_code == 404
    assert [m.id for m in client.models.list().data] == ["base", "tiny"]
    assert http.delete("/v1/adapters/second", headers=ADMIN_AUTH).status_code == 404


def _error(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == status and body["error"]["message"]
    return body["error"]["message"]


def test_a_text_past_the_models_context_is_a_422_naming_it(http):
    """A text whose prompt and longest label run past the model's context (the tiny model's 512 positions; the
    word-level tokenizer reads each comma as a token) was scored at positions the model never had; a model with
    learned positions (GPT-2's 1,024) failed inside its forward, a 500. predict refuses such texts too."""
    for model, extra in (("tiny", {}), ("base", {"labels": LABELS})):
        request = {"model": model, "input": ["fine", "," * 499], **extra}
        message = _error(http.post("/v1/classify", headers=AUTH, json=request), 422)
        assert "input[1]" in message and "context of 512" in message
    assert http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "," * 300}).status_code == 200


def test_auth_errors(server, http):
    _error(http.get("/v1/models"), 401)
    _error(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    _error(http.post("/v1/classify", json={"model": "tiny", "input": "x"}), 401)
    _error(http.post("/v1/adapters", headers=AUTH, json={"name": "x", "path": "second"}), 401)
    _error(http.delete("/v1/adapters/tiny", headers=AUTH), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()


def test_adapter_paths_stay_inside_adapter_dirs(http, adapters_root):
    outside = adapters_root.parent / "outside" / "sneaky"
    assert "adapter_dirs" in _error(http.post("/v1/adapters", headers=ADMIN_AUTH,
                                              json={"name": "s1", "path": "../outside/sneaky"}), 403)
    _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "s2", "path": str(outside)}), 403)
    (adapters_root / "link").symlink_to(outside, target_is_directory=True)
    _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "s3", "path": "link"}), 403)
    _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "s4", "path": "absent"}), 404)
    _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "../x", "path": "second"}), 422)
    _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "base", "path": "second"}), 422)
    (adapters_root / "empty").mkdir()
    assert "no emotune adapter" in _error(http.post("/v1/adapters", headers=ADMIN_AUTH,
                                                    json={"name": "s5", "path": "empty"}), 422)


@pytest.mark.parametrize("path", ["a" * 300, "a/" + "b" * 5000, "~nobody-such-user/x"])
def test_an_adapter_path_the_file_system_cannot_take_is_422_not_500(http, path):
    """A name longer than the file system takes (255 bytes a component) passes resolve() and failed is_dir(): 500."""
    assert "Adapter path" in _error(http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "s6", "path": path}), 422)
    assert http.get("/v1/models", headers=AUTH).status_code == 200


def test_request_errors(http, client):
    assert "does not exist" in _error(http.post("/v1/classify", headers=AUTH, json={"model": "nope", "input": "x"}), 404)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert "max_input_chars" in _error(http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "a" * 501}), 422)
    assert "max_inputs" in _error(http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["a"] * 21}), 422)
    _error(http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": []}), 422)
    _error(http.post("/v1/classify", headers=AUTH, json={"model": "tiny"}), 422)
    _error(http.post("/v1/classify", headers={**AUTH, "Content-Type": "application/json"}, content=b"{not json"), 400)
    assert "max_body_bytes" in _error(http.post("/v1/classify", headers=AUTH,
                                                json={"model": "tiny", "input": ["a" * 400] * 60}), 413)
    chunked = http.post("/v1/classify", headers={**AUTH, "Content-Type": "application/json"},
                        content=iter([b'{"model": "tiny", "input": "', b"a" * 30_000, b'"}']))
    _error(chunked, 413)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10_000)
    _error(http.post("/v1/chat/completions", headers=AUTH, json={"model": "tiny", "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}), 422)  # roles must alternate
    _error(http.get("/v1/nothing-here", headers=AUTH), 404)


def test_full_queue_answers_503_and_recovers(server, http):
    engine, app = server[1], server[2]
    batcher = app.state.server.batcher
    with ThreadPoolExecutor(1) as pool:
        with engine.lock:  # the model is busy: the first request sits in the queue
            first = pool.submit(http.post, "/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["happy"] * 10})
            deadline = time.time() + 30
            while batcher.pending < 10 and time.time() < deadline:
                time.sleep(0.01)
            with httpx.Client(base_url=server[0], timeout=30) as other:
                full = other.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["sad"] * 10})
            assert "max_queue" in _error(full, 503)
        assert first.result().status_code == 200
    assert http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["sad"] * 10}).status_code == 200


def test_more_texts_than_the_queue_ever_holds_is_422_not_a_503_to_retry(server, http):
    """serve_config's max_inputs (20) is above its max_queue (16): 17 texts passed max_inputs and were answered 503
    `Retry shortly` (with Retry-After) on an idle server, every time, so a client retried forever."""
    assert server[2].state.server.batcher.pending == 0
    refused = http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["happy"] * 17})
    message = _error(refused, 422)
    assert "serve.max_queue=16" in message and "at most 16" in message and "Retry-After" not in refused.headers
    assert http.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": ["happy"] * 16}).status_code == 200


def test_graceful_shutdown_finishes_requests_in_flight(adapters_root):
    engine, app = start(adapters_root, admin_key=None)
    with running(app) as (url, uvicorn_server):
        # without an admin key, adapter management is off for everyone
        off = httpx.post(url + "/v1/adapters", headers=AUTH, json={"name": "second", "path": "second"})
        assert "admin_key" in _error(off, 403)
        result = {}

        def call():
            with httpx.Client(base_url=url, timeout=60) as c:
                result["reply"] = c.post("/v1/classify", headers=AUTH, json={"model": "tiny", "input": "happy"})

        with engine.lock:
            caller = threading.Thread(target=call)
            caller.start()
            deadline = time.time() + 30
            while app.state.server.batcher.pending < 1 and time.time() < deadline:
                time.sleep(0.01)
            uvicorn_server.should_exit = True  # what SIGTERM / Ctrl-C do
            time.sleep(0.3)
        caller.join(timeout=60)
    assert result["reply"].status_code == 200
    assert result["reply"].json()["data"][0]["label"] in LABELS
