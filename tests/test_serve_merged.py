"""`emotune serve` on a merged model folder (`emotune export --merge`): loaded as predict loads it, served under
its own name with its own task, labels and system prompt, over HTTP through tests/server_harness.py."""

from __future__ import annotations

import shutil

import httpx
import pytest

from conftest import LABELS, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.deploy.predict import Classifier, Generator
from emotune.model.artifacts import find_artifact
from emotune.serve import build_engine, create_app
from server_harness import running

TEXTS = ["i am so happy today", "my friend was furious"]
ADMIN = "admin-key"
SYSTEM = "reply with one word"
pytestmark = pytest.mark.slow  # exports, two engines and two servers


def merged_folder(run_dir) -> str:
    """RUN/export/merged, where `emotune export --merge` puts it; served as RUN's name."""
    assert main(["export", str(run_dir), "--merge", "--dtype", "float32"]) == 0
    return str(run_dir / "export" / "merged")


def test_a_merged_classifier_is_served_under_its_name_with_its_labels(tiny_run_dir, tmp_path):
    run_dir = shutil.copytree(tiny_run_dir, tmp_path / "runs" / "tiny")
    merged = merged_folder(run_dir)
    with pytest.raises(UserError, match="Serve a merged model alone"):
        build_engine(load_config(None, ["device=cpu"]), [merged, str(shutil.copytree(tiny_run_dir, tmp_path / "other"))])
    engine, _ = build_engine(load_config(None, ["device=cpu"]), [merged])
    assert list(engine.models) == ["tiny"]
    expected = Classifier(find_artifact(tiny_run_dir), "cpu").probs(TEXTS)  # base + adapter, unmerged
    cfg = ServeConfig(admin_key=ADMIN, adapter_dirs=[str(tmp_path / "runs")])
    with running(create_app(engine, cfg)) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        card = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["task"], c["merged"], c["labels"], c["parent"]) for c in card] == [
            ("tiny", "classify", True, LABELS, None)]
        answer = http.post("/v1/classify", json={"model": "tiny", "input": TEXTS})
        assert answer.status_code == 200, answer.text
        for row, probs in zip(answer.json()["data"], expected.tolist(), strict=False):
            assert [row["probs"][label] for label in LABELS] == pytest.approx(probs, abs=1e-4)
            assert row["label"] == LABELS[max(range(len(LABELS)), key=probs.__getitem__)]
        assert http.post("/v1/classify", json={"model": "base", "input": "x", "labels": ["a", "b"]}).status_code == 404
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": TEXTS[0]}]})
        assert chat.status_code == 200, chat.text
        # an adapter trained on the original base does not fit the merged model
        admin = {"Authorization": f"Bearer {ADMIN}"}
        refused = http.post("/v1/adapters", headers=admin, json={"name": "again", "path": "tiny"})
        assert refused.status_code == 422 and "serves the merged model" in refused.json()["error"]["message"]
        assert http.delete("/v1/adapters/tiny", headers=admin).status_code == 422


def test_a_merged_sft_model_chats_under_its_system_prompt(tiny_model_dir, tmp_path):
    run_dir = write_tiny_adapter(tiny_model_dir, tmp_path / "runs" / "chat", seed=2, task="sft",
                                 overrides=(f"prompt.system_prompt={SYSTEM}", "model.dtype=float32"))
    engine, _ = build_engine(load_config(None, ["device=cpu"]), [merged_folder(run_dir)])
    expected = Generator(find_artifact(run_dir), "cpu").replies(TEXTS, 6)  # base + adapter, unmerged
    with running(create_app(engine, ServeConfig(max_new_tokens=16))) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as http:
        card = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["task"], c["merged"]) for c in card] == [("chat", "sft", True)]
        for text, reply in zip(TEXTS, expected, strict=False):
            answer = http.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 6,
                                                             "messages": [{"role": "user", "content": text}]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == reply
        refused = http.post("/v1/classify", json={"model": "chat", "input": "x"})
        assert refused.status_code == 422 and "`chat` is an sft model" in refused.json()["error"]["message"]
