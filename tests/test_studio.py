"""emotune studio through its HTTP API (FastAPI's TestClient): the runs table, run pages, safe paths, progress events,
the token on a non-loopback bind and the Host/Origin guard."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from emotune.core import locks
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, run_lock, write_json, write_text
from emotune.studio import TOKEN_ENV, form, studio_token
from emotune.studio.app import create_app
from emotune.studio.jobs import JobQueue
from emotune.studio.runs import history, list_runs

LOCAL = "http://127.0.0.1:7860"
TOKEN = "a-long-random-studio-token"


def make_run(runs: Path, name: str, status: str = "finished", steps: int = 3, before: float = 0.2, after: float = 0.6) -> Path:
    """A run folder in the layout the pipeline writes: config.yaml, run.json, comparison.json, the training log."""
    root = runs / name
    write_text(root / "config.yaml", f"task: classify\nname: {name}\nmodel:\n  source: tiny-gemma\ndata:\n  source: emotion 情绪\n")
    outputs = ["comparison.json", "report.html"] if status == "finished" else []
    write_json(root / "run.json", {"task": "classify", "status": status, "outputs": outputs,
                                   "stages": {"baseline": {"status": "done", "seconds": 60}, "train": {"status": "done", "seconds": 30}}})
    if status == "finished":
        write_json(root / "comparison.json", {"metrics": {"macro_f1": {"before": before, "after": after, "delta": after - before}},
                                              "intervals": {"macro_f1": {"before": [before - 0.1, before + 0.1],
                                                                         "after": [after - 0.05, after + 0.05]}}})
        write_text(root / "report.html", "<html><body>report of " + name + "</body></html>")
    (root / "train").mkdir(exist_ok=True)
    (root / "train" / "log_history.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.0 - s / 10, "tokens_per_s": 100.0}) + "\n" for s in range(1, steps + 1)))
    return root


@pytest.fixture
def runs(tmp_path) -> Path:
    folder = tmp_path / "runs"
    make_run(folder, "alpha", before=0.25, after=0.75)
    make_run(folder, "beta", status="running", steps=2)
    (folder / "beta.partial").mkdir()  # a half-written folder is no run
    write_text(tmp_path / "secret.txt", "outside the runs folder")
    return folder


def client(runs: Path, **kwargs) -> TestClient:
    """The studio without its queue thread: tests move the queue on with `tick()`."""
    return TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None, **kwargs), base_url=LOCAL)


def test_runs_table_lists_every_run_with_before_after_and_minutes(runs):
    page = client(runs).get("/")
    assert page.status_code == 200
    assert 'href="/runs/alpha"' in page.text and 'href="/runs/beta"' in page.text and "partial" not in page.text
    assert "0.250 [0.15, 0.35] → 0.750 [0.70, 0.80]" in page.text and "emotion 情绪" in page.text
    rows = {r["name"]: r for r in client(runs).get("/api/runs").json()}
    assert rows["alpha"]["status"] == "finished" and rows["alpha"]["minutes"] == 1.5 and rows["alpha"]["after"] == 0.75
    assert rows["beta"]["status"] == "running" and rows["beta"]["after"] is None
    assert '<script src="/static/studio.js"' in page.text and "http" not in page.text.split("<body>")[0].replace(LOCAL, "")


def test_run_page_shows_config_report_artifacts_and_escapes(runs):
    config = runs / "alpha" / "config.yaml"
    write_text(config, config.read_text() + "prompt:\n  system: <script>alert(1)</script>\n")
    page = client(runs).get("/runs/alpha")
    assert page.status_code == 200
    assert 'href="/runs/alpha/files/report.html"' in page.text and "source: tiny-gemma" in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text and "<script>alert" not in page.text
    assert 'href="/runs/alpha/files/train/log_history.jsonl"' in page.text
    report = client(runs).get("/runs/alpha/files/report.html")
    assert report.text.startswith("<html><body>report of alpha")
    # a file of the run folder holds what its data and model wrote: served sandboxed, so even a page that slipped a
    # script past the escaping runs nothing and reaches no studio page (its CSRF token, the form that queues runs)
    assert report.headers["content-security-policy"] == "sandbox" and report.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/runs/nope", "/runs/alpha/files/nope.txt", "/runs/alpha/files/../../secret.txt",
                                  "/runs/alpha/files/..%2F..%2Fsecret.txt", "/runs/..%2Fsecret.txt/files/x",
                                  "/runs/alpha/files/train", "/runs/beta.partial", "/runs/alpha/files/link/secret.txt",
                                  "/runs/a%00b", "/runs/alpha/files/a%00b", "/runs/a%00b/events", "/runs/a%00b/try",
                                  "/sweeps/a%00b", "/compare?run=alpha&run=a%00b"])
def test_paths_outside_the_runs_folder_are_404(runs, path):
    (runs / "alpha" / "link").symlink_to(runs.parent)
    assert client(runs).get(path).status_code == 404


def parse_events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            events.append(fields)
    return events


def test_events_replay_the_history_and_only_what_was_missed(runs):
    events = parse_events(client(runs).get("/runs/alpha/events").text)
    assert [e.get("id") for e in events] == ["1", "2", "3", None]
    assert json.loads(events[0]["data"])["step"] == 1 and events[-1]["event"] == "end"
    assert json.loads(events[-1]["data"]) == {"status": "finished", "entries": 3}
    resumed = parse_events(client(runs).get("/runs/alpha/events", headers={"Last-Event-ID": "2"}).text)
    assert [e.get("id") for e in resumed] == ["3", None]
    for junk in ("9" * 5000, "-1", "x"):  # an id this stream never sent replays the whole log
        replayed = parse_events(client(runs).get("/runs/alpha/events", headers={"Last-Event-ID": junk}).text)
        assert [e.get("id") for e in replayed] == ["1", "2", "3", None], junk


def test_events_follow_a_running_run_until_it_ends(runs):
    """A running run's stream sends new log lines as training appends them, and ends when run.json says finished."""
    beta = runs / "beta"
    with client(runs).stream("GET", "/runs/beta/events") as stream:
        ids = []
        for line in stream.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
                if ids[-1] == 2:  # training goes on: one more step, a line being written, then the run finishes
                    with (beta / "train" / "log_history.jsonl").open("a") as handle:
                        handle.write(json.dumps({"step": 3, "loss": float("nan")}) + "\n" + '{"step": 4, "lo')
                if ids[-1] == 3:
                    write_json(beta / "run.json", {"task": "classify", "status": "failed", "stages": {}})
            if line.startswith("event: end"):
                break
    assert ids == [1, 2, 3]
    assert [e["step"] for e in history(RunDir(beta))] == [1, 2, 3]  # the half-written line is left out


def test_nan_loss_is_sent_as_null(runs):
    with (runs / "alpha" / "train" / "log_history.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 4, "loss": float("nan")}) + "\n")
    events = parse_events(client(runs).get("/runs/alpha/events", headers={"Last-Event-ID": "3"}).text)
    assert json.loads(events[0]["data"]) == {"step": 4, "loss": None}


@pytest.mark.parametrize(("flags", "says"), [(["--port", "99999"], "--port 99999 is not a TCP port"),
                                             (["--port", "-1"], "--port -1 is not a TCP port"),
                                             (["--runs", "{file}"], "is a file; give the folder"),
                                             (["--host", "0.0.0.0", "--token-file", "{binary}"], "is not UTF-8 text")])
def test_the_studio_refuses_a_port_a_runs_file_or_a_binary_token_file_before_it_starts(tmp_path, capsys, monkeypatch,
                                                                                       flags, says):
    """--port 99999 left uvicorn hanging (no server, no error); --port -1 ended with uvicorn's `Servname not
    supported`, exit 3; --runs naming a file served an empty studio; a token file in another encoding was a
    UnicodeDecodeError traceback."""
    from emotune.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("the studio started"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "binary").write_bytes(b"\xff\xfe" + b"\x00" * 40)
    argv = ["studio", "--runs", str(tmp_path), *(f.format(file=tmp_path / "file", binary=tmp_path / "binary") for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("emotune: error: ") and says in err


def test_host_and_origin_of_another_site_are_refused(runs):
    assert client(runs).get("/", headers={"Host": "evil.example"}).status_code == 421
    assert client(runs).get("/", headers={"Origin": "http://evil.example"}).status_code == 403


def test_non_loopback_studio_needs_the_token(runs, monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(UserError, match="needs a token"):
        studio_token("0.0.0.0", None)
    with pytest.raises(ValueError):
        create_app(runs, "0.0.0.0")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert studio_token("0.0.0.0", None) == TOKEN
    (tmp_path / "token").write_text("short\n")
    with pytest.raises(UserError, match="shorter than 16"):
        studio_token("0.0.0.0", str(tmp_path / "token"))
    remote = TestClient(create_app(runs, "0.0.0.0", TOKEN, jobs_interval_s=None), base_url="http://10.0.0.5:7860")
    refused = remote.get("/")
    assert refused.status_code == 401 and TOKEN not in refused.text
    assert remote.get("/runs/alpha/files/report.html").status_code == 401
    assert remote.post("/login", data={"token": "wrong" * 5}).status_code == 401
    assert remote.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert remote.get("/login", params={"token": TOKEN}).status_code == 200 and remote.get("/").status_code == 401
    assert remote.post("/login", data={"token": TOKEN}).status_code == 200  # follows the redirect, cookie set
    assert remote.get("/").status_code == 200
    page = remote.get("/runs/alpha")
    assert page.status_code == 200 and TOKEN not in page.text


def test_list_runs_of_a_missing_folder_is_empty(tmp_path):
    assert list_runs(tmp_path / "none") == []
    assert "No run folders" in client(tmp_path / "none").get("/").text


# --------------------------------------------------------------------------------------------------
# The form and the queue


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page)[1]


def test_form_has_every_config_field_with_doc_and_default(runs):
    page = client(runs).get("/new").text
    assert 'name="train.max_steps"' in page and 'name="lora.r"' in page and "default <code>" in page
    assert page.count('class="field') == len(form.fields("classify")) > 100
    assert 'name="output_dir"' not in page  # the studio's runs folder, always
    assert "Device to run on" in page
    assert client(runs).get("/new?task=nope").status_code == 404


def test_a_switch_with_auto_is_a_drop_down_of_its_three_values(runs, tmp_path):
    """`train.gradient_checkpointing: bool | "auto"`: a drop-down of true / false / auto with auto selected, and the
    choice comes back as the config's boolean."""
    page = client(runs).get("/new").text
    select = re.search(r'<select[^>]*name="train.gradient_checkpointing".*?</select>', page, re.S)
    assert select and re.findall(r"<option[^>]*>(\w+)</option>", select[0]) == ["true", "false", "auto"]
    assert "<option selected>auto</option>" in select[0]
    raw = form.to_raw("classify", {"train.gradient_checkpointing": "false"}, tmp_path)
    assert raw["train"] == {"gradient_checkpointing": False}


def test_invalid_form_shows_each_problem_beside_its_field_and_starts_nothing(runs):
    studio = client(runs)
    csrf = csrf_of(studio.get("/new").text)
    sent = studio.post("/new", data={"csrf": csrf, "task": "classify", "train.max_steps": "abc", "lora.r": "-3",
                                     "name": "alpha"}, follow_redirects=False)
    assert sent.status_code == 400
    for key, says in (("train.max_steps", "must be an integer"), ("lora.r", "must be an integer &gt;= 1"),
                      ("name", "exists already")):
        field = re.search(rf'<div class="field invalid"><label for="f-{re.escape(key)}">.*?</div>', sent.text, re.S)
        assert field and says in field[0], key
        assert 'value="abc"' in sent.text  # what was typed stays in the form
    assert studio.app.state.queue.jobs() == []


def test_a_form_that_is_not_utf8_is_refused_beside_its_field(runs):
    studio = client(runs)
    csrf = csrf_of(studio.get("/new").text)
    sent = studio.post("/new", content=f"csrf={csrf}&task=classify&name=".encode() + b"caf\xe9",
                       headers={"content-type": "application/x-www-form-urlencoded"}, follow_redirects=False)
    assert sent.status_code == 400
    field = re.search(r'<div class="field invalid"><label for="f-name">.*?</div>', sent.text, re.S)
    assert field and "plain folder name" in field[0]
    assert studio.app.state.queue.jobs() == []


def test_a_name_a_queued_job_holds_is_refused_beside_the_field(runs):
    studio = client(runs)
    assert submit(studio, name="gamma") == "/runs/gamma"
    csrf = csrf_of(studio.get("/new").text)
    again = studio.post("/new", data={"csrf": csrf, "task": "classify", "name": "gamma"}, follow_redirects=False)
    assert again.status_code == 400
    field = re.search(r'<div class="field invalid"><label for="f-name">.*?</div>', again.text, re.S)
    assert field and "job 1 (queued) will write the run folder `gamma`" in field[0]
    assert [j.name for j in studio.app.state.queue.jobs()] == ["gamma"]
    studio.post("/jobs/1/stop", data={"csrf": csrf})  # a job that ended frees its name
    assert submit(studio, name="gamma") == "/runs/gamma"


def test_a_chat_whose_messages_are_not_a_json_list_is_422_before_any_model(runs):
    studio = client(runs)
    csrf = csrf_of(studio.get("/new").text)
    for messages in ("[" * 100_000, "not json"):  # nested deeper than json.loads follows; not JSON at all
        sent = studio.post("/runs/alpha/chat", data={"csrf": csrf, "messages": messages})
        assert sent.status_code == 422 and "must be a JSON list" in sent.json()["error"]


def test_yaml_alias_bombs_in_a_form_field_or_a_pasted_llamafactory_file_are_refused(runs):
    """A few hundred bytes of aliases of aliases: nine to the sixth (531,441) values, or one 20,000-character name
    repeated 2,000 times. The studio expanded them into the page, the translation and the queued config."""
    studio = client(runs)
    csrf = csrf_of(studio.get("/new").text)
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)]
    nested, wide = f"[{', '.join(levels)}]", "[&a " + "q" * 20_000 + ", " + ", ".join(["*a"] * 2_000) + "]"
    pasted = f"model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nlora_target: {nested}\n"
    sent = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": pasted})
    assert sent.status_code == 400 and "expands to more than 100,000 values" in sent.text and len(sent.text) < 100_000
    sent = studio.post("/new", data={"csrf": csrf, "task": "classify", "lora.target_modules": wide}, follow_redirects=False)
    field = re.search(r'<div class="field invalid"><label for="f-lora.target_modules">.*?</div>', sent.text, re.S)
    assert sent.status_code == 400 and field and "YAML aliases that repeat aliases" in field[0]
    assert studio.app.state.queue.jobs() == []


def test_yaml_nested_thousands_of_levels_deep_in_a_form_field_or_a_pasted_file_is_refused(runs):
    """5,000 levels of `[` ran into Python's recursion limit: a 500 from the studio."""
    studio = client(runs)
    csrf = csrf_of(studio.get("/new").text)
    deep = "[" * 5_000 + "]" * 5_000
    pasted = f"model_name_or_path: m\nstage: sft\nfinetuning_type: lora\nlora_target: {deep}\n"
    sent = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": pasted})
    assert sent.status_code == 400 and "nests lists or mappings too deeply" in sent.text
    sent = studio.post("/new", data={"csrf": csrf, "task": "classify", "train.max_steps": deep}, follow_redirects=False)
    assert sent.status_code == 400 and 'class="field invalid"><label for="f-train.max_steps">' in sent.text
    assert studio.app.state.queue.jobs() == []


def test_a_run_whose_name_is_left_empty_is_named_after_its_task_and_time(runs):
    """The form's name field is empty by default: the valid form crashed on the missing name (a 500)."""
    studio = client(runs)
    sent = studio.post("/new", data={"csrf": csrf_of(studio.get("/new").text), "task": "classify"}, follow_redirects=False)
    assert sent.status_code == 303, sent.text[-500:]
    assert re.fullmatch(r"/runs/classify-\d{8}-\d{6}", sent.headers["location"])


def test_posts_need_the_csrf_token(runs):
    studio = client(runs)
    assert studio.post("/new", data={"task": "classify"}).status_code == 403
    assert studio.post("/new", data={"task": "classify", "csrf": "guess"}).status_code == 403
    assert studio.post("/jobs/1/stop", data={}).status_code == 403


def test_a_form_over_1_mib_is_refused_before_it_is_read_whole(runs):
    """A POST body is bounded before the app reads it: a declared length over 1 MiB is refused before a byte is read,
    and a body sent in chunks without a length is refused as soon as it passes 1 MiB (never held whole)."""
    import asyncio

    app = create_app(runs, poll_s=0.01, jobs_interval_s=None)
    chunk, reads, sent = b"x" * (256 << 10), [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": chunk, "more_body": len(reads) < 1000}  # 250 MiB if read whole

    async def send(message):
        sent.append(message)

    def post(headers: list) -> int:
        reads.clear(), sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/new", "raw_path": b"/new", "query_string": b"",
                 "headers": [(b"host", b"127.0.0.1:7860"), *headers], "client": ("127.0.0.1", 5000),
                 "server": ("127.0.0.1", 7860), "scheme": "http", "http_version": "1.1", "root_path": ""}
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"]

    assert post([(b"content-length", str(300 << 20).encode())]) == 413 and reads == []
    assert post([]) == 413 and len(reads) == 5  # 1.25 MiB read, then refused
    assert b"larger than 1 MiB" in b"".join(m.get("body", b"") for m in sent)
    studio = client(runs)  # a form within the limit still reaches the CSRF check
    assert studio.post("/new", data={"task": "classify", "text": "x" * 1000}).status_code == 403


def submit(studio: TestClient, **fields) -> str:
    csrf = csrf_of(studio.get("/new").text)
    sent = studio.post("/new", data={"csrf": csrf, "task": "classify", **fields}, follow_redirects=False)
    assert sent.status_code == 303, sent.text
    return sent.headers["location"]


def wait_for(check, timeout_s: float = 120.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("timed out")


@pytest.mark.slow
def test_queue_runs_jobs_one_at_a_time_in_order_and_a_new_studio_finds_them(runs, tmp_path):
    """Two runs that fail fast (their model folder is missing): FIFO, one at a time, states kept on disk."""
    studio = client(runs)
    missing = tmp_path / "no-model"
    assert submit(studio, name="first", **{"model.source": str(missing)}) == "/runs/first"
    submit(studio, name="second", **{"model.source": str(missing)})
    submit(studio, name="third", **{"model.source": str(missing)})
    queue = studio.app.state.queue
    assert "Job 1: <span id=\"job-status\">queued" in studio.get("/runs/first").text
    queue.tick()
    assert [j.status for j in queue.jobs()] == ["running", "queued", "queued"]
    queue.tick()
    assert [j.status for j in queue.jobs()][1:] == ["queued", "queued"]  # still one at a time
    cancelled = studio.post("/jobs/3/stop", data={"csrf": studio.app.state.csrf}, follow_redirects=False)
    assert cancelled.status_code == 303 and JobQueue(runs).jobs()[2].status == "stopped"
    wait_for(lambda: queue.tick() or queue.jobs()[0].status == "failed")
    assert "model.source" in queue.log(queue.jobs()[0]).read_text()  # the run's own error, in its log
    restarted = JobQueue(runs)  # a new studio process reads the same folder
    assert [j.status for j in restarted.jobs()] == ["failed", "running", "stopped"]
    wait_for(lambda: restarted.tick() or restarted.jobs()[1].status != "running")
    assert restarted.jobs()[1].status == "failed" and restarted.jobs()[1].exit_code is None  # followed, not its child
    queue_table = studio.get("/").text.split('id="jobs"')[1]
    assert queue_table.count("status-failed") == 2 and queue_table.count("status-stopped") == 1


@pytest.mark.slow
def test_one_job_per_device_first_in_first_out_on_each(runs, tmp_path):
    """Jobs on other devices run side by side; on one device they wait in the order queued."""
    studio = client(runs)
    missing = str(tmp_path / "no-model")
    submit(studio, name="cpu-a", **{"model.source": missing, "device": "cpu"})
    submit(studio, name="cpu-b", **{"model.source": missing, "device": "cpu"})
    submit(studio, name="gpu-1", **{"model.source": missing, "device": "cuda:1"})
    queue = studio.app.state.queue
    assert [j.device for j in queue.jobs()] == ["cpu", "cpu", "cuda:1"]
    queue.tick()
    assert [j.status for j in queue.jobs()] == ["running", "queued", "running"]
    assert "<td>cuda:1</td>" in studio.get("/").text
    wait_for(lambda: queue.tick() or all(j.status == "failed" for j in queue.jobs()))  # cpu-b after cpu-a, then ends


@pytest.mark.slow
def test_stop_from_the_page_ends_a_training_run_cleanly(tmp_path, tiny_overrides):
    """Stop mid-training: the run marks its stage failed, gives its folder's lock back, and the job says stopped."""
    runs = tmp_path / "runs"
    studio = client(runs)
    fields = dict(o.split("=", 1) for o in tiny_overrides if not o.startswith(("output_dir=", "name=")))
    # far more steps than the test waits for, so only the stop can end the run (a finished run says nothing of Stop)
    submit(studio, name="long", **{**fields, "train.max_steps": "100000", "train.eval_steps": "100000",
                                   "train.save_steps": "100000"})
    queue = studio.app.state.queue
    wait_for(lambda: queue.tick() or history(RunDir(runs / "long")), timeout_s=300)
    page = studio.get("/runs/long").text
    assert 'id="stop-1"' in page and "running" in page
    assert studio.post("/jobs/1/stop", data={"csrf": csrf_of(page)}, follow_redirects=False).status_code == 303
    wait_for(lambda: queue.tick() or queue.jobs()[0].status != "running", timeout_s=60)
    assert queue.jobs()[0].status == "stopped" and queue.jobs()[0].exit_code not in (0, None, -9)
    assert RunDir(runs / "long").status() == "failed" and not locks.is_held(run_lock(runs / "long"))
    assert len(history(RunDir(runs / "long"))) < 100000


def test_a_cut_stream_resumes_after_the_last_id_without_a_gap(runs):
    """stream_s=0: every stream ends after one look at the log, as a proxy cutting the connection would; each
    reconnect with Last-Event-ID gets only what came after, and the end once the run ended."""
    studio, beta, seen = client(runs, stream_s=0.0), runs / "beta", []

    def reconnect() -> list[dict]:
        events = parse_events(studio.get("/runs/beta/events", headers={"Last-Event-ID": str(len(seen))}).text)
        seen.extend(json.loads(e["data"])["step"] for e in events if e.get("event") == "progress")
        return events

    assert [e.get("event") for e in reconnect()] == ["progress", "progress"]  # cut: no end event, the run goes on
    assert reconnect() == []
    with (beta / "train" / "log_history.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    write_json(beta / "run.json", {"task": "classify", "status": "finished", "stages": {}})
    assert [e.get("event") for e in reconnect()] == ["progress", "end"]
    assert seen == [1, 2, 3]


def test_the_cjk_font_is_served_locally_and_asked_for_only_for_cjk_text(runs):
    page = client(runs).get("/").text
    assert 'src: url("/static/cjk.otf")' in page and "unicode-range: U+2E80" in page
    font = client(runs).get("/static/cjk.otf")
    assert font.status_code == 200 and font.content[:4] == b"OTTO" and len(font.content) > 1_000_000


LF_YAML = """model_name_or_path: {model}
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 4
dataset: emotion_alpaca
dataset_dir: {data}
template: gemma3
learning_rate: 3.0e-4
max_steps: 7
output_dir: saves/tiny-lf
"""


AXOLOTL_YAML = """base_model: {model}
datasets:
  - path: /data/chats.jsonl
    type: chat_template
adapter: lora
lora_r: 8
lora_alpha: 16
lora_target_linear: true
micro_batch_size: 2
learning_rate: 2e-4
"""


def test_a_llamafactory_yaml_fills_the_sft_form_with_its_translation(runs, tiny_model_dir):
    studio = client(runs)
    csrf = studio.app.state.csrf
    page = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": LF_YAML.format(
        model=tiny_model_dir, data="/data/lf")})
    assert page.status_code == 200
    assert 'name="task" value="sft"' in page.text and "The training file, translated" in page.text
    assert re.search(r'id="f-train\.learning_rate" name="train\.learning_rate" value="0\.0003"', page.text)
    assert re.search(r'id="f-train\.max_steps" name="train\.max_steps" value="7"', page.text)
    assert re.search(r'id="f-lora\.r" name="lora\.r" value="4"', page.text)
    assert f'value="{tiny_model_dir}"' in page.text and "learning_rate: 0.0003" in page.text  # the translation shown
    # LLaMA-Factory's one newline: a browser drops the line break right after <textarea>, so one more is written there
    assert 'name="data.input_separator" rows="3" cols="80">\n\n</textarea>' in page.text
    assert not list((runs / ".studio").glob("jobs/*.json")) if (runs / ".studio").exists() else True  # nothing queued
    refused = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": "task: classify\nname: x\n"})
    assert refused.status_code == 400 and "not a LLaMA-Factory or Axolotl training config" in refused.text
    broken = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": "model_name_or_path: [\n"})
    assert broken.status_code == 400 and "not valid YAML" in broken.text
    assert studio.post("/new/llamafactory", data={"llamafactory": LF_YAML}).status_code == 403  # CSRF
    axolotl = studio.post("/new/llamafactory", data={"csrf": csrf, "llamafactory": AXOLOTL_YAML.format(
        model=tiny_model_dir)})
    assert axolotl.status_code == 200 and "Axolotl config the uploaded file" in axolotl.text
    assert re.search(r'id="f-lora\.r" name="lora\.r" value="8"', axolotl.text)
    assert re.search(r'id="f-train\.batch_size" name="train\.batch_size" value="2"', axolotl.text)


def make_sweep(runs: Path, finished: list[Path]) -> Path:
    """A sweep folder as `emotune sweep` leaves it: sweep.json, trials.csv, best.yaml and the trials' run folders
    (copies of real finished runs)."""
    import shutil

    folder = runs / "lr-sweep"
    trials = []
    for i, run in enumerate(finished):
        shutil.copytree(run, folder / f"lr_{i}")
        trials.append({"name": f"lr_{i}", "status": "finished", "value": 0.5 + i / 10,
                       "overrides": [f"train.learning_rate={i + 1}e-3"]})
    trials.append({"name": "lr_9", "status": "running", "overrides": ["train.learning_rate=9e-3"]})
    write_json(folder / "sweep.json", {"plan": {"mode": "grid", "metric": "macro_f1"}, "trials": trials,
                                       "status": "running"})
    write_text(folder / "trials.csv", "trial,train.learning_rate,macro_f1,status\nlr_1,2e-3,0.6000000123,finished\n"
                                      "lr_0,1e-3,0.5,finished\n")
    write_text(folder / "best.yaml", "# The best trial\ntask: classify\n")
    return folder


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory, tiny_model_dir, data_dir) -> Path:
    """Two real tiny runs (emotune run, 2 steps each, different learning rates) in one runs folder."""
    from emotune.cli import main

    folder = tmp_path_factory.mktemp("studio") / "runs"
    for name, lr in (("first", "0.01"), ("second", "0.02")):
        assert main(["run", f"model.source={tiny_model_dir}", f"data.source={data_dir}", f"output_dir={folder}",
                     f"name={name}", "data.label_names=[sadness, joy, love, anger, fear, surprise]", "train.max_steps=2",
                     "train.batch_size=4", "train.gradient_accumulation_steps=1", "train.gradient_checkpointing=false",
                     "train.precision=fp32", "train.eval_steps=1", "train.save_steps=1", "train.logging_steps=1",
                     f"train.learning_rate={lr}", "eval.batch_size=5",
                     f"model.cache_dir={folder.parent / 'cache'}"]) == 0
    return folder


@pytest.mark.slow
def test_compare_two_runs_and_a_sweeps_trials(finished_runs):
    from emotune.report.compare import comparison_table

    studio = client(finished_runs)
    runs_page = studio.get("/").text
    assert 'name="run" value="first" form="compare"' in runs_page and 'action="/compare"' in runs_page
    page = studio.get("/compare", params=[("run", "first"), ("run", "second")])
    assert page.status_code == 200
    table = comparison_table([finished_runs / "first", finished_runs / "second"])
    assert "<section id=quality>" in page.text and "headline scores with 95% intervals" in page.text
    assert f"{table['rows'][1]['scores']['macro_f1']['value']:.3f}" in page.text and "reference" in page.text
    assert studio.get("/compare", params=[("run", "first")]).status_code == 400
    assert studio.get("/compare", params=[("run", "first"), ("run", "../first")]).status_code == 404

    sweep = make_sweep(finished_runs, [finished_runs / "first", finished_runs / "second"])
    try:
        assert 'href="/sweeps/lr-sweep"' in studio.get("/").text
        page = studio.get("/sweeps/lr-sweep").text
        assert "Trials table" in page and "<td>0.6</td>" in page and "train.learning_rate=9e-3" in page
        assert 'href="/sweeps/lr-sweep/files/lr_0/report.html"' in page and "best.yaml" in page
        assert studio.get("/sweeps/lr-sweep/files/lr_0/report.html").status_code == 200
        assert studio.get("/sweeps/lr-sweep/files/../first/config.yaml").status_code == 404
        trials = studio.get("/compare", params=[("run", "lr-sweep/lr_0"), ("run", "lr-sweep/lr_1")])
        assert trials.status_code == 200 and "lr_1" in trials.text
        assert studio.get("/compare", params=[("run", "lr-sweep/lr_9"), ("run", "first")]).status_code == 404
    finally:
        import shutil

        shutil.rmtree(sweep)


def test_other_test_rows_are_refused_with_the_reason_and_can_be_shown_marked(finished_runs, tmp_path):
    import csv
    import shutil

    other = finished_runs / "fewer-rows"
    shutil.copytree(finished_runs / "second", other)
    try:
        path = other / "finetuned" / "predictions.csv"
        with path.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
        with path.open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows[:-1])
        studio = client(finished_runs)
        refused = studio.get("/compare", params=[("run", "first"), ("run", "fewer-rows")])
        assert refused.status_code == 400 and "other test rows" in refused.text and "mismatch=1" in refused.text
        shown = studio.get("/compare", params=[("run", "first"), ("run", "fewer-rows"), ("mismatch", "1")])
        assert shown.status_code == 200 and "not comparable" in shown.text
    finally:
        shutil.rmtree(other)


def test_try_classify_gives_the_models_probabilities(finished_runs, tiny_model_dir):
    from emotune.model.artifacts import find_artifact
    from emotune.serve.engine import Engine, base_config

    studio = client(finished_runs)
    csrf = studio.app.state.csrf
    assert 'href="/runs/first/try"' in studio.get("/runs/first").text
    page = studio.get("/runs/first/try")
    assert page.status_code == 200 and 'id="try-classify"' in page.text and "sadness, joy, love" in page.text
    text = "i feel so happy and free today"
    answer = studio.post("/runs/first/classify", data={"csrf": csrf, "text": text})
    assert answer.status_code == 200
    probs = {row["label"]: row["p"] for row in answer.json()["probs"]}
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5) and answer.json()["label"] == max(probs, key=probs.get)
    artifact = find_artifact(finished_runs / "first", name="first")
    engine = Engine(base_config([artifact], artifact.model_cfg, "cpu"), "cpu")  # as `emotune serve` loads it
    engine.add_adapter(artifact)
    expected = engine.classify("first", [text], artifact.prompt, artifact.labels, 1)[0].tolist()
    assert [probs[label] for label in artifact.labels] == pytest.approx(expected, abs=1e-5)  # as `emotune serve` scores
    assert studio.post("/runs/first/classify", data={"csrf": csrf, "text": " "}).status_code == 422
    assert studio.post("/runs/first/classify", data={"csrf": csrf, "text": "x" * 4001}).status_code == 422
    assert studio.post("/runs/first/classify", data={"text": text}).status_code == 403
    chat = studio.post("/runs/first/chat", data={"csrf": csrf, "messages": json.dumps([{"role": "user", "content": "hi"}])})
    assert chat.status_code == 422 and "answers with a label" in chat.json()["error"]


def test_try_is_refused_while_training_holds_the_device_and_training_waits_for_a_try(finished_runs):
    from emotune.studio.jobs import Job

    studio = client(finished_runs)
    csrf, queue, tryout = studio.app.state.csrf, studio.app.state.queue, studio.app.state.tryout
    queue.folder.mkdir(parents=True, exist_ok=True)
    try:
        queue._save(Job(1, "third", status="running", pid=None))
        refused = studio.post("/runs/first/classify", data={"csrf": csrf, "text": "a text"})
        assert refused.status_code == 409 and "Training job 1 (run `third`) holds the device" in refused.json()["error"]
        queue._save(Job(1, "third", status="finished"))
        assert studio.post("/runs/first/classify", data={"csrf": csrf, "text": "a text"}).status_code == 200
        assert tryout.engine is not None  # the model stays loaded for the next try
        with tryout.lock:  # a try is running: a queued job waits, and the model stays
            assert tryout.idle() is False
        assert tryout.idle() is True and tryout.engine is None  # no try: the model is unloaded before training
    finally:
        import shutil

        shutil.rmtree(finished_runs / ".studio")


def test_try_chat_streams_the_sft_models_greedy_reply(tmp_path, tiny_model_dir):
    from conftest import write_tiny_adapter
    from emotune.model.artifacts import find_artifact
    from emotune.serve.chat import render_conversation
    from emotune.serve.engine import Engine

    runs = tmp_path / "runs"
    write_tiny_adapter(tiny_model_dir, runs / "chatty", task="sft")
    studio = client(runs)
    csrf = studio.app.state.csrf
    assert 'id="try-chat"' in studio.get("/runs/chatty/try").text
    messages = [{"role": "user", "content": "Write one line about rain."}]
    pieces = []
    with studio.stream("POST", "/runs/chatty/chat", data={"csrf": csrf, "messages": json.dumps(messages),
                                                          "max_tokens": "20"}) as reply:
        assert reply.status_code == 200
        pieces = list(reply.iter_text())
    artifact = find_artifact(runs / "chatty", name="chatty")
    engine = Engine(artifact.model_cfg, "cpu")
    engine.add_adapter(artifact)
    loaded = engine.models["chatty"]
    ids = loaded.tokenizer(render_conversation(messages, loaded), return_tensors="pt", add_special_tokens=False)["input_ids"]
    with engine.using("chatty"):
        out = engine.model.generate(input_ids=ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=20,
                                    do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id)
    expected = loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert "".join(pieces).strip() == expected and expected  # the same words, in order, as one generate call
    assert studio.post("/runs/chatty/classify", data={"csrf": csrf, "text": "x"}).status_code == 422
    assert studio.post("/runs/chatty/chat", data={"csrf": csrf, "messages": "not json"}).status_code == 422
    assert studio.post("/runs/chatty/chat", data={"csrf": csrf, "messages": "[]"}).status_code == 422
    lone_surrogate = '[{"role": "user", "content": "happy \\ud800"}]'  # a 200 whose reply said "generation failed"
    assert studio.post("/runs/chatty/chat", data={"csrf": csrf, "messages": lone_surrogate}).status_code == 422
    bad_role = json.dumps([{"role": "tool", "content": "x"}])
    assert studio.post("/runs/chatty/chat", data={"csrf": csrf, "messages": bad_role}).status_code == 422
    assert studio.post("/runs/chatty/chat", data={"csrf": csrf, "messages": json.dumps(messages),
                                                  "max_tokens": "100000"}).status_code == 422
    assert studio.get("/runs/nope/try").status_code == 404


def test_telemetry_samples_are_streamed_beside_the_log_without_ids(runs):
    beta = runs / "beta"
    sample = {"time": 1.0, "elapsed_s": 0.5, "stage": "train", "rss_mb": 812.25, "cpu_pct": 190.0, "gpu_util_pct": 97.0}
    write_text(beta / "telemetry.jsonl", json.dumps(sample) + "\n")
    assert "812.2 MiB" in client(runs).get("/runs/beta").text  # the latest sample on the page at load
    write_json(beta / "run.json", {"task": "classify", "status": "finished", "stages": {}})
    events = parse_events(client(runs).get("/runs/beta/events").text)
    telemetry = [e for e in events if e.get("event") == "telemetry"]
    assert len(telemetry) == 1 and "id" not in telemetry[0]  # a reconnect's Last-Event-ID stays the log position
    assert json.loads(telemetry[0]["data"]) == {"stage": "train", "values": {
        "rss_mb": [812.25, "MiB"], "cpu_pct": [190.0, "% of one core"], "gpu_util_pct": [97.0, "%"]}}


HOSTILE_RUNS = {  # file contents emotune never writes, as a crash, an old version or a hand edit leaves them
    "list-json": {"run.json": "[1, 2]", "config.yaml": "- a\n- b\n"},
    "nan-metrics": {"run.json": '{"status": "finished", "outputs": [], "stages": {"train": {"seconds": NaN}}}',
                    "comparison.json": '{"metrics": {"macro_f1": {"before": NaN, "after": Infinity}}}'},
    "infinite-seconds": {"run.json": '{"status": "x", "stages": {"train": {"seconds": 1e400}}}'},
    "text-seconds": {"run.json": '{"status": "x", "stages": {"train": {"seconds": "10"}}}'},
    "stages-list": {"run.json": '{"stages": [1]}'},
    "status-object": {"run.json": '{"status": {"a": 1}, "task": ["x"], "outputs": 5}'},
    "outputs-null": {"run.json": '{"status": "finished", "outputs": [null, 3]}'},
    "model-text": {"config.yaml": "model: hello\ndata: [1]\ntrain: 5\n"},
    "metrics-list": {"run.json": "{}", "comparison.json": '{"metrics": [1], "intervals": [2]}'},
    "interval-list": {"run.json": "{}", "comparison.json":
                      '{"metrics": {"macro_f1": {"before": 1, "after": 2}}, "intervals": {"macro_f1": [1]}}'},
    "config-not-utf8": {"config.yaml": b"\xff\xfe: [\n"},
    "log-not-utf8": {"run.json": "{}", "train/log_history.jsonl": b"\xff\xfe\x00garbage\n"},
}


@pytest.mark.parametrize("name", HOSTILE_RUNS)
def test_a_run_folder_with_hostile_content_shows_blanks_not_a_500(runs, name):
    for file, content in HOSTILE_RUNS[name].items():
        path = runs / name / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    studio = TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None, stream_s=0.1), base_url=LOCAL,
                        raise_server_exceptions=False)
    table = studio.get("/")
    assert table.status_code == 200 and f'href="/runs/{name}"' in table.text and 'href="/runs/alpha"' in table.text
    rows = {r["name"]: r for r in studio.get("/api/runs").json()}  # strict JSON: no NaN nor infinity in it
    assert rows["alpha"]["after"] == 0.75 and isinstance(rows[name]["status"], str)
    assert rows[name]["after"] in (None, 2.0) and rows[name]["minutes"] in (None, 0.0)
    page = studio.get(f"/runs/{name}")
    assert page.status_code == 200 and f"Run {name}" in page.text
    assert studio.get(f"/runs/{name}/events").status_code == 200


def test_a_sweep_folder_with_hostile_content_shows_blanks_not_a_500(runs):
    sweep = runs / "odd-sweep"
    sweep.mkdir()
    write_text(sweep / "sweep.json", '{"plan": [1], "trials": [{"name": "<i>t</i>", "value": NaN, "overrides": 5}], '
                                     '"status": {"a": 1}}')
    (sweep / "trials.csv").write_bytes(b"\xff\xfe,a\n1,2\n")
    (sweep / "best.yaml").write_bytes(b"lr: \xff\n")
    studio = TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None), base_url=LOCAL, raise_server_exceptions=False)
    page = studio.get("/sweeps/odd-sweep")
    assert page.status_code == 200 and "&lt;i&gt;t&lt;/i&gt;" in page.text and "<i>t" not in page.text
    assert "<code>5</code>" in page.text and "lr: \ufffd" in page.text
    write_text(sweep / "sweep.json", '{"plan": {}, "trials": {"a": 1}}')
    assert studio.get("/sweeps/odd-sweep").status_code == 200 and studio.get("/").status_code == 200


@pytest.mark.parametrize("name", ["x" * 300, "a\x00b"])
def test_a_run_name_no_file_system_holds_is_refused_beside_its_field(runs, name):
    studio = TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None), base_url=LOCAL, raise_server_exceptions=False)
    page = studio.post("/new", data={"csrf": csrf_of(studio.get("/new").text), "name": name}, follow_redirects=False)
    assert page.status_code == 400 and re.search(r'class="field invalid"><label for="f-name">', page.text)
    assert not (runs / ".studio" / "jobs").exists() and studio.get("/").status_code == 200


@pytest.mark.parametrize("line", ["template: {a: 1}", "template: [llama3]", "lora_rank: {a: 1}"])
def test_a_pasted_llamafactory_yaml_with_a_mapping_for_a_name_or_number_is_a_problem_not_a_500(runs, line):
    studio = TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None), base_url=LOCAL, raise_server_exceptions=False)
    text = f"model_name_or_path: x\nstage: sft\nfinetuning_type: lora\ndataset: alpaca_en_demo\n{line}\n"
    page = studio.post("/new/llamafactory", data={"csrf": csrf_of(studio.get("/new").text), "llamafactory": text})
    assert page.status_code == 200 and 'id="translation"' in page.text
    key = line.split(":")[0]
    assert key in page.text.split('id="translation"')[1] and studio.get("/").status_code == 200


def test_job_files_that_hold_no_jobs_state_are_left_out_and_the_queue_goes_on(runs):
    jobs = runs / ".studio" / "jobs"
    jobs.mkdir(parents=True)
    for number, state in enumerate(['{"name": "alpha"}', '{"id": 2, "name": 5}', '{"id": 3, "name": "alpha", "status": 5}',
                                    '{"id": 4, "name": "../x", "status": "running", "pid": 1}', '{"id": "5", "name": "a"}'], 1):
        write_text(jobs / f"{number}.json", state)
    write_json(jobs / "6.json", {"id": 6, "name": "alpha", "status": "finished", "from_a_newer_studio": True})
    app = create_app(runs, poll_s=0.01, jobs_interval_s=None)
    studio = TestClient(app, base_url=LOCAL, raise_server_exceptions=False)
    table = studio.get("/")
    assert table.status_code == 200 and re.findall(r"<tr><td>(\d+)</td>", table.text) == ["6"]
    assert studio.get("/runs/alpha").status_code == 200 and "Job 6" in studio.get("/runs/alpha").text
    app.state.queue.tick()  # the worker thread's step: it raised, and the thread died with it
    assert [j.id for j in app.state.queue.jobs()] == [6]


def test_a_link_in_a_run_folder_to_a_file_outside_it_is_not_listed(runs, tmp_path):
    (runs / "alpha" / "secret.txt").symlink_to(tmp_path / "secret.txt")
    (runs / "alpha" / "notes.txt").symlink_to(runs / "alpha" / "report.html")  # a link inside the run folder stays
    page = client(runs).get("/runs/alpha")
    assert page.status_code == 200 and "secret.txt" not in page.text and 'href="/runs/alpha/files/notes.txt"' in page.text
    assert client(runs).get("/runs/alpha/files/secret.txt").status_code == 404


def test_a_telemetry_reading_that_is_nan_is_sent_as_null_which_a_browser_parses(runs):
    beta = runs / "beta"
    write_text(beta / "telemetry.jsonl", '{"time": 1.0, "stage": "train", "rss_mb": 800.0, "gpu_util_pct": NaN}\n')
    with (beta / "train" / "log_history.jsonl").open("a") as handle:
        handle.write('{"step": 3, "loss": 1.0, "per_class": {"joy": NaN}}\n')
    write_json(beta / "run.json", {"task": "classify", "status": "finished", "stages": {}})
    events = parse_events(client(runs).get("/runs/beta/events").text)

    def strict(text: str):  # as JSON.parse reads it: NaN is no JSON
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in an event's data"))
    telemetry = [strict(e["data"]) for e in events if e.get("event") == "telemetry"]
    assert telemetry == [{"stage": "train", "values": {"rss_mb": [800.0, "MiB"], "gpu_util_pct": [None, "%"]}}]
    assert strict([e for e in events if e.get("id") == "3"][0]["data"])["per_class"] == {"joy": None}


@pytest.mark.parametrize("peft_config", ["{}", '{"base_model_name_or_path": 5}', "not json"])
def test_an_adapter_whose_config_names_no_base_model_is_409_with_the_reason_not_a_500(runs, peft_config):
    write_text(runs / "alpha" / "adapter" / "adapter_config.json", peft_config)
    studio = TestClient(create_app(runs, poll_s=0.01, jobs_interval_s=None, device="cpu"), base_url=LOCAL,
                        raise_server_exceptions=False)
    page = studio.get("/runs/alpha/try")
    assert page.status_code == 409 and "the base model" in page.text
    csrf = csrf_of(studio.get("/new").text)
    answer = studio.post("/runs/alpha/classify", data={"csrf": csrf, "text": "hi"})
    assert answer.status_code == 409 and "the base model" in answer.json()["error"]
