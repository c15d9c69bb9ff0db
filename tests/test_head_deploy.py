"""Classification-head models after training: `emotune export` (the head with the adapter; a merged model that
transformers' AutoModelForSequenceClassification loads for Gemma 3 and emotune's loader for Gemma 4), `emotune
predict` (label and probabilities) and `emotune serve` (/v1/classify micro-batched, chat refused, a merged head
folder served alone), on tiny Gemma 3 and Gemma 4 text models."""

from __future__ import annotations

import csv
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import LABELS, write_tiny_adapter
from emotune.cli import main
from emotune.core.config.data import PromptConfig
from emotune.core.config.eval import ServeConfig
from emotune.core.config.load import load_config
from emotune.core.errors import UserError
from emotune.deploy.export import merge_parity_gap
from emotune.model.head import classifier_from_causal
from emotune.serve import build_engine, create_app
from server_harness import running

TEXTS = ["i am so happy today", "my friend was furious", "lonely and lost this morning", "wow"]
USER, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {USER}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def head_runs(tiny_model_dir, tiny_gemma4_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("head-runs")
    return {"gemma3": write_tiny_adapter(tiny_model_dir, root / "head3", seed=3, task="classify_head"),
            "gemma4": write_tiny_adapter(tiny_gemma4_dir, root / "head4", seed=4, task="classify_head")}


@pytest.fixture(scope="module")
def exports(head_runs, tmp_path_factory):
    """`emotune export --merge --dtype float32` of a head run, done once per run."""
    done = {}

    def export(arch: str):
        if arch not in done:
            out = tmp_path_factory.mktemp(f"export-{arch}") / "export"
            assert main(["export", str(head_runs[arch]), "--merge", "--dtype", "float32", "--out", str(out)]) == 0
            done[arch] = out
        return done[arch]
    return export


def reference_probs(run_dir, texts) -> torch.Tensor:
    """Base + adapter + head as training built them (PEFT over emotune's classifier), one unpadded text at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if run_dir not in _REFERENCES:
        meta = json.loads((run_dir / "adapter" / "emotune.json").read_text())
        base = AutoModelForCausalLM.from_pretrained(meta["base_model"], dtype=torch.float32)
        model = PeftModel.from_pretrained(classifier_from_causal(base, LABELS), run_dir / "adapter").eval()
        _REFERENCES[run_dir] = model, AutoTokenizer.from_pretrained(run_dir / "adapter")
    model, tokenizer = _REFERENCES[run_dir]
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([tokenizer(t)["input_ids"]])).logits.softmax(-1) for t in texts])


_REFERENCES: dict = {}  # run folder -> (model, tokenizer): each reference model is built once


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# --------------------------------------------------------------------------------------------------
# export


@pytest.mark.parametrize("arch", ["gemma3", "gemma4"])
def test_export_keeps_the_head_with_the_adapter_and_merges_it(head_runs, exports, arch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run, out = head_runs[arch], exports(arch)
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("score.weight") for k in saved) and any("lora_A" in k for k in saved)
    for folder in ("adapter", "merged"):
        meta = json.loads((out / folder / "emotune.json").read_text())
        assert meta["task"] == "classify_head" and meta["labels"] == LABELS
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["id2label"] == {str(i): label for i, label in enumerate(LABELS)}
    assert merge_parity_gap(run, TEXTS, merged_dir=out / "merged") < 1e-4  # emotune's loader, every architecture

    tokenizer = AutoTokenizer.from_pretrained(out / "merged")
    ids = [torch.tensor([tokenizer(t)["input_ids"]]) for t in TEXTS]
    if arch == "gemma3":  # transformers' own class loads the merged folder and gives the same logits
        auto = AutoModelForSequenceClassification.from_pretrained(out / "merged", dtype=torch.float32).eval()
        assert type(auto).__module__.startswith("transformers.models.gemma3")
        with torch.no_grad():
            got = torch.cat([auto(input_ids=i).logits.softmax(-1) for i in ids])
        assert (got - reference_probs(run, TEXTS)).abs().max() < 1e-4
        assert (got.max(-1).values > 0.5).any()  # the head is not a near-uniform one that any merge would match
    else:  # no sequence-classification class in transformers for Gemma 4: the docs send it to emotune's loader
        with pytest.raises(ValueError, match="Unrecognized configuration class"):
            AutoModelForSequenceClassification.from_pretrained(out / "merged")
        assert config["architectures"] == ["EmotuneGemma4ForSequenceClassification"]


def test_the_lora_matters_so_parity_is_not_trivial(head_runs):
    """The trained head on the language model without the LoRA answers differently: a merge that dropped the
    LoRA would fail the parity checks."""
    from transformers import AutoModelForCausalLM

    run = head_runs["gemma3"]
    source = json.loads((run / "adapter" / "emotune.json").read_text())["base_model"]
    head_only = classifier_from_causal(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), LABELS).eval()
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    with torch.no_grad():
        head_only.score.weight.copy_(next(v for k, v in saved.items() if k.endswith("score.weight")))
        probs = torch.cat([head_only(input_ids=torch.tensor([ids])).logits.softmax(-1)
                           for ids in head_only_ids(run, TEXTS)])
    assert (probs - reference_probs(run, TEXTS)).abs().max() > 1e-2
    assert merge_parity_gap(run, TEXTS) < 1e-4  # merged in memory


def head_only_ids(run, texts) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run / "adapter")
    return [tokenizer(t)["input_ids"] for t in texts]


def test_export_refuses_vllm_for_a_head_model(head_runs, tmp_path, capsys):
    assert main(["export", str(head_runs["gemma3"]), "--vllm", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "classification-head model" in err and "Leave out --vllm" in err and "emotune serve" in err
    assert not (tmp_path / "e").exists()


# --------------------------------------------------------------------------------------------------
# predict


@pytest.mark.parametrize("arch", ["gemma3", pytest.param("gemma4", marks=pytest.mark.slow)])
def test_predict_gives_the_head_label_and_probabilities(head_runs, arch, tmp_path, capsys):
    run = head_runs[arch]
    assert main(["predict", str(run), *TEXTS, "--batch-size", "3"]) == 0  # batched: padded rows, same answers
    lines = _json_lines(capsys.readouterr().out)
    expected = reference_probs(run, TEXTS)
    assert [line["text"] for line in lines] == TEXTS
    for line, want in zip(lines, expected.tolist(), strict=False):
        assert list(line["probs"]) == LABELS
        assert [line["probs"][label] for label in LABELS] == pytest.approx(want, abs=1e-5)
        assert line["label"] == LABELS[max(range(len(LABELS)), key=want.__getitem__)]

    source, out = tmp_path / "in.jsonl", tmp_path / "out.csv"
    source.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)), encoding="utf-8")
    assert main(["predict", str(run), "--file", str(source), "--out", str(out), "--text-column", "body"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["body"] for r in rows] == TEXTS and [r["id"] for r in rows] == ["0", "1", "2", "3"]
    for row, line in zip(rows, lines, strict=False):
        assert row["label"] == line["label"]
        assert [float(row[f"p_{label}"]) for label in LABELS] == pytest.approx(list(line["probs"].values()), abs=1e-5)


@pytest.mark.slow
def test_predict_with_a_merged_head_folder_equals_the_adapter(head_runs, exports, capsys):
    run, out = head_runs["gemma4"], exports("gemma4")
    capsys.readouterr()
    assert main(["predict", str(out / "merged"), *TEXTS]) == 0
    merged = _json_lines(capsys.readouterr().out)
    for line, want in zip(merged, reference_probs(run, TEXTS).tolist(), strict=False):
        assert [line["probs"][label] for label in LABELS] == pytest.approx(want, abs=1e-5)


def test_eval_refuses_a_head_adapter_for_other_tasks(head_runs, tiny_overrides, capsys):
    assert main(["eval", *tiny_overrides, f"adapter={head_runs['gemma3']}"]) == 2
    assert "is a classify_head adapter; `task: classify` measures" in capsys.readouterr().err
    # a merged head folder is measured (tests/test_merged_folder_eval.py)


# --------------------------------------------------------------------------------------------------
# serve: a head adapter beside a generative classifier, over one base model


@pytest.fixture(scope="module")
def server(head_runs, tiny_run_dir):
    cfg = load_config(None, ["device=cpu"])
    engine, _ = build_engine(cfg, [str(head_runs["gemma3"]), str(tiny_run_dir)])
    serve_cfg = ServeConfig(api_key=USER, admin_key=ADMIN, adapter_dirs=[str(head_runs["gemma3"].parent)],
                            batch_wait_ms=20, max_new_tokens=8)
    app = create_app(engine, serve_cfg)
    with running(app) as (url, _):
        yield url, engine, app


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], timeout=60, headers=AUTH) as client:
        yield client


def classify(http, model, texts) -> list[dict]:
    reply = http.post("/v1/classify", json={"model": model, "input": texts})
    assert reply.status_code == 200, reply.text
    return reply.json()["data"]


def test_classify_with_a_head_model_gives_its_probabilities(http, head_runs):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["head3"]["task"] == "classify_head" and cards["head3"]["labels"] == LABELS
    assert cards["head3"]["parent"] == "base"
    data = classify(http, "head3", TEXTS)
    for row, want in zip(data, reference_probs(head_runs["gemma3"], TEXTS).tolist(), strict=False):
        assert [row["probs"][label] for label in LABELS] == pytest.approx(want, abs=1e-5)
        assert row["label"] == LABELS[max(range(len(LABELS)), key=want.__getitem__)]
    refused = http.post("/v1/classify", json={"model": "head3", "input": "x", "labels": ["a", "b"]})
    assert refused.status_code == 422 and "`labels` can only be chosen for the base model" in refused.text


def test_the_head_adapter_leaves_the_other_models_as_they_were(http, tiny_run_dir, tiny_model_dir):
    """The generative adapter and the base answer as on a server without the head adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emotune.eval.scoring import score_label_probs
    from emotune.model.artifacts import find_artifact

    artifact = find_artifact(tiny_run_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_run_dir / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    plain = score_label_probs(base, tokenizer, TEXTS, PromptConfig(), LABELS)
    reply = http.post("/v1/classify", json={"model": "base", "input": TEXTS, "labels": LABELS}).json()["data"]
    assert torch.allclose(_probs(reply), plain, atol=1e-5)
    adapted = PeftModel.from_pretrained(base, tiny_run_dir / "adapter").eval()
    expected = score_label_probs(adapted, tokenizer, TEXTS, artifact.prompt, LABELS)
    assert torch.allclose(_probs(classify(http, "tiny", TEXTS)), expected, atol=1e-5)
    assert not torch.allclose(expected, plain, atol=1e-3)


def _probs(data: list[dict]) -> torch.Tensor:
    return torch.tensor([[row["probs"][label] for label in LABELS] for row in data])


def test_head_requests_are_micro_batched(server, http, head_runs):
    _, engine, app = server
    texts = [f"{w} today" for w in ("happy", "furious", "scared", "lonely", "wow", "adore")]
    expected = reference_probs(head_runs["gemma3"], texts).tolist()
    counters = app.state.server.metrics.counters
    batches_before = counters[("emotune_batches_total", ())]
    with ThreadPoolExecutor(len(texts)) as pool:
        engine.lock.acquire()  # hold the model so every request queues up and they are scored together
        try:
            futures = [pool.submit(classify, http, "head3", text) for text in texts]
            deadline = time.time() + 30
            while app.state.server.batcher.pending < len(texts) and time.time() < deadline:
                time.sleep(0.01)
        finally:
            engine.lock.release()
        results = [f.result()[0]["probs"] for f in futures]
    for got, want in zip(results, expected, strict=False):
        assert [got[label] for label in LABELS] == pytest.approx(want, abs=1e-5)
    assert counters[("emotune_batches_total", ())] - batches_before < len(texts)


def test_chat_is_refused_for_a_head_model(http):
    for stream in (False, True):
        reply = http.post("/v1/chat/completions", json={"model": "head3", "stream": stream,
                                                        "messages": [{"role": "user", "content": "hello"}]})
        assert reply.status_code == 422, reply.text
        message = reply.json()["error"]["message"]
        assert "`head3` is a classification-head model" in message and "/v1/classify" in message
    assert http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hello"}]}).status_code == 200


def test_a_head_adapter_hot_loads_and_unloads(http, head_runs):
    loaded = http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "again", "path": "head3"})
    assert loaded.status_code == 201, loaded.text
    assert loaded.json()["task"] == "classify_head" and loaded.json()["labels"] == LABELS
    assert classify(http, "again", TEXTS) == classify(http, "head3", TEXTS)
    assert http.delete("/v1/adapters/again", headers=ADMIN_AUTH).status_code == 200
    assert http.post("/v1/classify", json={"model": "again", "input": "x"}).status_code == 404
    assert [r["probs"] for r in classify(http, "head3", TEXTS[:1])][0] == pytest.approx(
        dict(zip(LABELS, reference_probs(head_runs["gemma3"], TEXTS[:1])[0].tolist(), strict=False)), abs=1e-5)


# --------------------------------------------------------------------------------------------------
# serve: a merged head model alone


@pytest.mark.slow
def test_a_merged_head_folder_is_served_alone(head_runs, exports, tiny_run_dir):
    run, out = head_runs["gemma4"], exports("gemma4")
    cfg = load_config(None, ["device=cpu"])
    with pytest.raises(UserError, match="Serve a merged model alone"):
        build_engine(cfg, [str(out / "merged"), str(tiny_run_dir)])
    engine, _ = build_engine(cfg, [str(out / "merged")])
    serve_cfg = ServeConfig(api_key=USER, admin_key=ADMIN, adapter_dirs=[str(tiny_run_dir.parent)])
    with running(create_app(engine, serve_cfg)) as (url, _), httpx.Client(base_url=url, timeout=60,
                                                                           headers=AUTH) as http:
        cards = http.get("/v1/models").json()["data"]
        name = out.parent.name  # OUT/merged is named after the folder holding the export, as RUN/export/merged after RUN
        assert [(c["id"], c["task"], c["parent"], c["merged"]) for c in cards] == [(name, "classify_head", None, True)]
        for row, want in zip(classify(http, name, TEXTS), reference_probs(run, TEXTS).tolist(), strict=False):
            assert [row["probs"][label] for label in LABELS] == pytest.approx(want, abs=1e-5)
        chat = http.post("/v1/chat/completions", json={"model": name, "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 422 and "classification-head model" in chat.text
        refused = http.post("/v1/adapters", headers=ADMIN_AUTH, json={"name": "tiny", "path": "tiny"})
        assert refused.status_code == 422 and "serves the merged model" in refused.json()["error"]["message"]
        assert http.post("/v1/classify", json={"model": "base", "input": "x", "labels": LABELS}).status_code == 404


@pytest.mark.slow
def test_the_engine_puts_a_head_adapter_on_a_multimodal_base(tmp_path):
    """Gemma 4 as its checkpoints come (multimodal): the classifier holds the language model at `model`, the causal
    model at `model.language_model`, so the head adapter's LoRA is renamed to join the causal model's adapters."""
    from conftest import build_tokenizer
    from emotune.core.config.model import ModelConfig
    from emotune.model.artifacts import find_artifact
    from emotune.serve.engine import Engine
    from test_lora import _tiny_gemma4_multimodal

    folder = tmp_path / "gemma4-multimodal"
    build_tokenizer(folder)
    _tiny_gemma4_multimodal().save_pretrained(folder)
    run = write_tiny_adapter(folder, tmp_path / "mm", seed=5, task="classify_head")
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any(k.startswith("base_model.model.model.layers.") for k in saved)  # the classifier's names
    engine = Engine(ModelConfig(source=str(folder), dtype="float32"), "cpu")  # as the fp32 reference
    engine.add_adapter(find_artifact(run))
    assert any(".language_model.layers." in name and "lora_A" in name for name, _ in engine.model.named_parameters())
    probs = engine.classify("mm", TEXTS, PromptConfig(), LABELS, batch_size=3)
    assert torch.allclose(probs, reference_probs(run, TEXTS), atol=1e-5)


def test_a_gpt2_head_adapter_serves_and_merges_like_training_built_it(tiny_gpt2_dir, tmp_path, capsys):
    """GPT-2 keeps its language model at `transformer` (its base_model_prefix, in the causal model and in transformers'
    classifier alike) and its projections are Conv1D: the head adapter's LoRA covers them, the engine puts it on the
    causal model under the same names, and the merged folder predicts the same probabilities."""
    from emotune.core.config.model import ModelConfig
    from emotune.model.artifacts import find_artifact
    from emotune.serve.engine import Engine

    run = write_tiny_adapter(tiny_gpt2_dir, tmp_path / "gpt2", seed=6, task="classify_head")
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any(k.startswith("base_model.model.transformer.h.") and ".c_attn.lora_A" in k for k in saved)
    expected = reference_probs(run, TEXTS)
    engine = Engine(ModelConfig(source=str(tiny_gpt2_dir), dtype="float32"), "cpu")
    engine.add_adapter(find_artifact(run))
    assert torch.allclose(engine.classify("gpt2", TEXTS, PromptConfig(), LABELS, batch_size=3), expected, atol=1e-5)
    out = tmp_path / "export"
    assert main(["export", str(run), "--merge", "--dtype", "float32", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["predict", str(out / "merged"), *TEXTS]) == 0
    for line, want in zip(_json_lines(capsys.readouterr().out), expected.tolist(), strict=True):
        assert [line["probs"][label] for label in LABELS] == pytest.approx(want, abs=1e-5)
