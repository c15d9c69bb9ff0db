"""emotune studio in a real headless Chromium (Debian's, driven by Playwright's Python API): start a tiny-model run
from the form and follow it (the training process paused mid-run so "mid-run" is certain: progress so far, a
reload, the event stream cut and resumed), open its report; compare two runs; classify a text and chat; translate a
LLaMA-Factory file; be refused without the token on a non-loopback bind. Every request a page makes must go to the
studio's loopback address, or the test fails. Screenshots go to the test's tmp folder
(EMOTUNE_STUDIO_SCREENSHOTS=docs/studio copies them there)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import uvicorn

from conftest import write_tiny_adapter
from emotune.cli import main
from emotune.core.rundir import RunDir
from emotune.studio.app import create_app
from emotune.studio.runs import history
from test_studio import LF_YAML, TOKEN, make_sweep

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LABELS = "[sadness, joy, love, anger, fear, surprise]"


@pytest.fixture
def browser():
    if not Path(CHROMIUM).is_file():
        message = "Debian's chromium is not installed (apt-get install chromium)"
        pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api") if os.environ.get("CI") != "true" else __import__(
        "playwright.sync_api", fromlist=["sync_playwright"])
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


def serve(app, host: str = "127.0.0.1"):
    """Run `app` with uvicorn on a free port of `host` in a thread; returns (port, stop)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=10)
    return port, stop


@pytest.fixture
def studio(tmp_path):
    """`emotune studio` on a free loopback port over tmp_path/runs, its queue running; each progress stream is cut
    after 1 s (as a proxy would), so the browser reconnects again and again."""
    app = create_app(tmp_path / "runs", poll_s=0.2, jobs_interval_s=0.5, stream_s=1.0, device="cpu")
    port, stop = serve(app)
    yield f"http://127.0.0.1:{port}", app
    stop()


def new_page(browser, outside: list[str]):
    """A page whose every request to anything but a loopback address is aborted and recorded."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})

    def check(route):
        url = route.request.url
        if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1") and not url.startswith(("data:", "blob:")):
            outside.append(url)
            return route.abort()
        return route.continue_()
    page.route("**/*", check)
    return page


def shot(page, tmp_path: Path, name: str, full_page: bool = False) -> None:
    page.screenshot(path=tmp_path / f"studio-{name}.png", full_page=full_page)
    if os.environ.get("EMOTUNE_STUDIO_SCREENSHOTS"):  # refresh docs/studio/'s pictures: set it to that folder
        shutil.copy(tmp_path / f"studio-{name}.png", os.environ["EMOTUNE_STUDIO_SCREENSHOTS"])


def tiny_run(folder: Path, name: str, model: Path, data: Path, lr: str) -> None:
    assert main(["run", f"model.source={model}", f"data.source={data}", f"output_dir={folder}", f"name={name}",
                 f"data.label_names={LABELS}", "train.max_steps=2", "train.batch_size=4",
                 "train.gradient_accumulation_steps=1", "train.gradient_checkpointing=false", "train.precision=fp32",
                 "train.eval_steps=1", "train.save_steps=1", "train.logging_steps=1", f"train.learning_rate={lr}",
                 "eval.batch_size=5", f"model.cache_dir={folder.parent / 'cache'}"]) == 0


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_start_a_run_from_the_form_and_follow_it_to_its_report(browser, studio, tiny_model_dir, data_dir, tmp_path):
    url, app = studio
    outside: list[str] = []
    page = new_page(browser, outside)
    page.goto(f"{url}/new")
    fields = {"name": "tiny", "model.source": str(tiny_model_dir), "data.source": str(data_dir),
              "data.label_names": LABELS, "train.max_steps": "30", "train.batch_size": "4",
              "train.gradient_accumulation_steps": "1", "train.gradient_checkpointing": "false",
              "train.precision": "fp32", "train.eval_steps": "10", "train.save_steps": "10", "train.logging_steps": "1",
              "train.learning_rate": "0.01", "eval.batch_size": "5", "model.cache_dir": str(tmp_path / "cache")}
    page.fill("#f-train\\.max_steps", "not a number")
    page.click("#new-run button[type=submit]")
    assert "must be an integer" in page.inner_text(".field.invalid")  # beside its field, nothing queued
    assert app.state.queue.jobs() == []
    page.eval_on_selector_all("details", "all => all.forEach(d => d.open = true)")
    for key, value in fields.items():
        selector = f"#f-{key.replace('.', chr(92) + '.')}"
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)
    shot(page, tmp_path, "new-run")
    page.click("#new-run button[type=submit]")
    page.wait_for_url(f"{url}/runs/tiny")

    # pause the training process as soon as it has logged a step: the page is then certainly mid-run
    run = RunDir(tmp_path / "runs" / "tiny")
    wait_for(lambda: len(history(run)) >= 1, 300, "the first logged step")
    pid = app.state.queue.job_for("tiny").pid
    os.killpg(pid, signal.SIGSTOP)
    try:
        so_far = len(history(run))
        assert 1 <= so_far < 30
        page.wait_for_function(f"document.querySelectorAll('#history tbody tr').length === {so_far}", timeout=60_000)
        page.reload()  # mid-run: the history so far is sent again
        page.wait_for_function(f"document.querySelectorAll('#history tbody tr').length === {so_far}", timeout=60_000)
        # the stream is cut every second: the browser reconnects with Last-Event-ID, and nothing is sent twice
        page.wait_for_function("Number(document.getElementById('progress').dataset.connections) >= 3", timeout=60_000)
        assert page.locator("#history tbody tr").count() == so_far
        assert page.inner_text("#status") == "running"
        shot(page, tmp_path, "run-live", full_page=True)
    finally:
        os.killpg(pid, signal.SIGCONT)
    page.wait_for_function("document.getElementById('progress').dataset.ended === 'true'", timeout=400_000)
    steps = [int(s) for s in page.locator("#history tbody tr td:first-child").all_inner_texts()]
    logged = history(run)
    assert steps == [e["step"] for e in logged] and max(steps) == 30  # every entry once, in order: no gap, no repeat
    assert int(page.locator("#progress").get_attribute("data-connections")) >= 3
    assert int(page.locator("#progress").get_attribute("data-telemetry") or 0) >= 1  # device samples arrived live
    page.reload()
    shot(page, tmp_path, "run", full_page=True)
    assert page.inner_text("#status") == "finished"
    page.click("#report")
    page.wait_for_load_state()
    assert "emotune report: tiny" in page.content() and "finished (started" in page.content()
    page.goto(url)
    assert page.locator("#runs tbody tr").count() == 1 and "finished" in page.inner_text("#runs")
    shot(page, tmp_path, "runs")
    assert outside == []


@pytest.mark.slow
def test_compare_two_runs_try_them_and_translate_a_llamafactory_file(browser, studio, tiny_model_dir, data_dir,
                                                                      tmp_path):
    url, app = studio
    runs = tmp_path / "runs"
    tiny_run(runs, "first", tiny_model_dir, data_dir, "0.01")
    tiny_run(runs, "second", tiny_model_dir, data_dir, "0.03")
    make_sweep(runs, [runs / "first", runs / "second"])
    write_tiny_adapter(tiny_model_dir, runs / "chatty", task="sft")
    outside: list[str] = []
    page = new_page(browser, outside)
    page.goto(url)
    page.check("input[value='first']")
    page.check("input[value='second']")
    page.click("#compare button")
    page.wait_for_selector("#quality table")
    assert page.locator("#quality tr").count() == 3  # header, the reference, the second run
    assert "reference" in page.inner_text("#quality") and page.locator("#figure img").count() == 1
    assert page.evaluate("document.querySelector('#figure img').naturalWidth") > 100
    shot(page, tmp_path, "compare", full_page=True)

    page.goto(f"{url}/sweeps/lr-sweep")
    assert "Trials table" in page.inner_text("body")
    shot(page, tmp_path, "sweep", full_page=True)

    page.goto(f"{url}/runs/first")
    page.click("#try")
    page.fill("#try-text", "i am so glad we met, what a lovely day")
    page.click("#try-classify button")
    page.wait_for_function("document.getElementById('try-classify').dataset.done === '1'", timeout=120_000)
    probabilities = [float(p) for p in page.locator("#probs td.num").all_inner_texts()]
    assert len(probabilities) == 6 and abs(sum(probabilities) - 1) < 1e-3 and probabilities == sorted(probabilities, reverse=True)
    shot(page, tmp_path, "try-classify")

    page.goto(f"{url}/runs/chatty/try")
    page.fill("#try-text", "说说下雨天。")  # Chinese renders with the studio's own font, fetched from the studio
    page.fill("input[name=max_tokens]", "12")
    page.click("#try-chat button")
    page.wait_for_function("document.getElementById('try-chat').dataset.done === '1'", timeout=120_000)
    assert page.locator(".message").count() == 2 and page.locator(".message b").all_inner_texts() == ["user", "assistant"]
    page.wait_for_function("[...document.fonts].some(f => f.family.includes('emotune CJK') && f.status === 'loaded')",
                           timeout=30_000)
    assert page.evaluate("[...document.fonts].some(f => f.family.includes('emotune CJK') && f.status === 'loaded')")
    shot(page, tmp_path, "try-chat")

    lf_file = tmp_path / "lora_sft.yaml"
    lf_file.write_text(LF_YAML.format(model=tiny_model_dir, data=data_dir), encoding="utf-8")
    page.goto(f"{url}/new")
    page.click("#llamafactory summary")
    page.set_input_files("#llamafactory-file", str(lf_file))
    page.wait_for_function("document.getElementById('llamafactory-text').value.includes('stage: sft')")
    page.click("#llamafactory button")
    page.wait_for_selector("#translation")
    assert page.input_value("#f-train\\.max_steps") == "7" and page.input_value("#f-lora\\.r") == "4"
    shot(page, tmp_path, "llamafactory")
    assert outside == []


@pytest.mark.slow
def test_a_studio_bound_beyond_loopback_refuses_without_its_token(browser, tmp_path):
    (tmp_path / "runs").mkdir()
    port, stop = serve(create_app(tmp_path / "runs", "0.0.0.0", TOKEN, jobs_interval_s=None), host="0.0.0.0")
    try:
        outside: list[str] = []
        page = new_page(browser, outside)
        response = page.goto(f"http://127.0.0.1:{port}/")
        assert response.status == 401 and "needs its token" in page.inner_text("body") and TOKEN not in page.content()
        assert page.goto(f"http://127.0.0.1:{port}/new").status == 401
        shot(page, tmp_path, "login")
        page.fill("#token", "a-wrong-token-of-some-length")
        page.click("button[type=submit]")
        assert "Wrong token" in page.inner_text("body")
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(f"http://127.0.0.1:{port}/")
        assert "run folder(s)" in page.inner_text("body") and TOKEN not in page.content()
        assert outside == []
    finally:
        stop()
