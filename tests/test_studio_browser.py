"""emotune studio in a real headless Chromium (Debian's, driven by Playwright's Python API): start a tiny-model run
from the form, watch its progress advance, reload mid-run, follow it to the end and open its report. Every request
a page makes must go to the studio's loopback address. Screenshots go to the test's tmp folder."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import uvicorn

from emotune.core.rundir import RunDir
from emotune.studio.app import create_app
from emotune.studio.runs import history

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


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


@pytest.fixture
def studio(tmp_path):
    """`emotune studio` on a free loopback port, over tmp_path/runs, with its job queue running."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(tmp_path / "runs", poll_s=0.2, jobs_interval_s=0.5),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def loopback_only(page, seen: list[str]) -> None:
    """Abort and record every request to anything but the studio's loopback address."""
    def check(route):
        url = route.request.url
        if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1") and not url.startswith(("data:", "blob:")):
            seen.append(url)
            return route.abort()
        return route.continue_()
    page.route("**/*", check)


@pytest.mark.slow
def test_start_a_run_from_the_form_and_follow_it_to_its_report(browser, studio, tiny_model_dir, data_dir, tmp_path):
    outside: list[str] = []
    page = browser.new_page()
    loopback_only(page, outside)
    page.goto(f"{studio}/new")
    fields = {"name": "tiny", "model.source": str(tiny_model_dir), "data.source": str(data_dir),
              "data.label_names": "[sadness, joy, love, anger, fear, surprise]", "train.max_steps": "8",
              "train.batch_size": "4", "train.gradient_accumulation_steps": "1", "train.gradient_checkpointing": "false",
              "train.precision": "fp32", "train.eval_steps": "4", "train.save_steps": "4", "train.logging_steps": "1",
              "train.learning_rate": "0.01", "eval.batch_size": "5", "model.cache_dir": str(tmp_path / "cache")}
    page.fill("#f-train\\.max_steps", "not a number")
    page.click("button[type=submit]")
    assert "must be an integer" in page.inner_text(".field.invalid")  # beside its field, nothing queued
    page.eval_on_selector_all("details", "all => all.forEach(d => d.open = true)")
    for key, value in fields.items():
        selector = f"#f-{key.replace('.', chr(92) + '.')}"
        if page.eval_on_selector(selector, "e => e.tagName") == "SELECT":
            page.select_option(selector, value)
        else:
            page.fill(selector, value)
    page.screenshot(path=tmp_path / "studio-new-run.png", full_page=False)
    page.click("button[type=submit]")
    page.wait_for_url(f"{studio}/runs/tiny")
    page.wait_for_selector("#history tbody tr", timeout=300_000)  # the first logged step arrived live
    seen = page.locator("#history tbody tr").count()
    page.reload()  # mid-run: the history so far is sent again, then the stream goes on
    page.wait_for_function(f"document.querySelectorAll('#history tbody tr').length >= {seen}", timeout=60_000)
    page.wait_for_function("document.getElementById('progress').dataset.ended === 'true'", timeout=400_000)
    steps = [int(s) for s in page.locator("#history tbody tr td:first-child").all_inner_texts()]
    logged = history(RunDir(tmp_path / "runs" / "tiny"))
    assert steps == [e["step"] for e in logged] and max(steps) == 8  # every entry once, in order: no gap, no repeat
    assert seen < len(steps)  # the page saw the run part-way, then more arrived live
    page.reload()
    page.screenshot(path=tmp_path / "studio-run.png", full_page=True)
    assert page.inner_text("#status") == "finished"
    page.click("#report")
    page.wait_for_load_state()
    assert "tiny" in page.content()
    page.goto(studio)
    assert page.locator("#runs tbody tr").count() == 1 and "finished" in page.inner_text("#runs")
    page.screenshot(path=tmp_path / "studio-runs.png", full_page=False)
    assert outside == []
    if os.environ.get("EMOTUNE_STUDIO_SCREENSHOTS"):  # refresh docs/studio/'s pictures: set it to that folder
        for shot in tmp_path.glob("studio-*.png"):
            shutil.copy(shot, os.environ["EMOTUNE_STUDIO_SCREENSHOTS"])
