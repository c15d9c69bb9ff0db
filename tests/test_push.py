"""`emotune push`: the folder and model card it uploads, a fake hub client in place of HfApi / HubApi (nothing
leaves the machine), and a refused upload without a token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

from conftest import LABELS, write_tiny_adapter
from emotune.cli import main
from emotune.core.rundir import RunDir
from emotune.deploy import hub
from emotune.deploy.model_card import model_card
from emotune.model.artifacts import find_artifact

COMPARISON = {"rows": 12, "metrics": {"accuracy": {"before": 0.25, "after": 0.75, "delta": 0.5},
                                      "macro_f1": {"before": 0.2, "after": 0.7, "delta": 0.5}},
              "intervals": {"accuracy": {"before": [0.1, 0.4], "after": [0.5, 0.9], "delta": {"delta": 0.5, "low": 0.2, "high": 0.8}},
                            "macro_f1": {"before": [0.1, 0.3], "after": [0.5, 0.85], "delta": {"delta": 0.5, "low": 0.2, "high": 0.7}}}}


class FakeClient:
    """Records what push asks of the hub; copies the folder, which is deleted after the upload."""

    calls: list = []

    def __init__(self, hub_name: str, token: str):
        self.calls.append(("init", hub_name, token))

    def create_repo(self, repo_id, private, exist_ok=True):
        self.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, folder_path, repo_id, commit_message):
        files = sorted(p.name for p in Path(folder_path).iterdir())
        readme = (Path(folder_path) / "README.md").read_text()
        self.calls.append(("upload_folder", repo_id, files, readme, commit_message))


@pytest.fixture
def run_dir(tiny_run_dir, tmp_path):
    import shutil

    run = tmp_path / "tiny"
    shutil.copytree(tiny_run_dir, run)
    (run / "comparison.json").write_text(json.dumps(COMPARISON))
    return run


@pytest.fixture
def fake(monkeypatch):
    FakeClient.calls = []
    monkeypatch.setattr(hub, "hub_client", FakeClient)
    return FakeClient


def _card(text: str) -> tuple[dict, str]:
    _, header, body = text.split("---", 2)
    return yaml.safe_load(header), body


def test_dry_run_writes_the_folder_with_a_model_card(run_dir, tmp_path, fake, capsys):
    out = tmp_path / "upload"
    assert main(["push", str(run_dir), "--to", "hf:me/tiny-emotion", "--dry-run", str(out)]) == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / "emotune.json").is_file()
    assert (out / "emotune_config.yaml").read_text() == (run_dir / "config.yaml").read_text()
    header, body = _card((out / "README.md").read_text())
    assert header["library_name"] == "peft" and header["pipeline_tag"] == "text-generation"
    assert "emotune" in header["tags"] and header["metrics"] == ["accuracy", "f1"] and header["license"] == "gemma"
    assert "base_model" not in header  # a local folder has no hub id to name
    assert "| accuracy | 0.250 [0.100, 0.400] | 0.750 [0.500, 0.900] | +0.500 | [0.200, 0.800] |" in body
    assert ", ".join(LABELS) in body and "PeftModel.from_pretrained" in body and "vllm serve" in body
    assert "ollama create" in body and "```yaml" in body
    assert fake.calls == []  # a dry run makes no client


def test_push_uploads_through_the_client_with_the_token(run_dir, fake, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    assert main(["push", str(run_dir), "--to", "hf:me/tiny-emotion", "--private"]) == 0
    assert fake.calls[0] == ("init", "hf", "hf_secret_value")
    assert fake.calls[1] == ("create_repo", "me/tiny-emotion", True)
    _, repo_id, files, readme, message = fake.calls[2]
    assert repo_id == "me/tiny-emotion" and "README.md" in files and "adapter_config.json" in files
    assert "hf_secret_value" not in readme and "hf_secret_value" not in capsys.readouterr().out


def test_push_merged_to_modelscope(run_dir, fake, monkeypatch):
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", "ms-token")
    assert main(["push", str(run_dir), "--to", "modelscope:me/tiny", "--merged"]) == 0
    assert fake.calls[0] == ("init", "modelscope", "ms-token")
    _, _, files, readme, _ = fake.calls[2]
    assert "config.json" in files and "model.safetensors" in files and "adapter_config.json" not in files
    assert _card(readme)[0]["library_name"] == "transformers"


def test_push_without_a_token_is_refused(run_dir, fake, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert main(["push", str(run_dir), "--to", "hf:me/tiny"]) == 2
    err = capsys.readouterr().err
    assert "No token" in err and "HF_TOKEN" in err and "Nothing was uploaded" in err
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    assert main(["push", str(run_dir), "--to", "modelscope:me/tiny"]) == 2
    assert "MODELSCOPE_API_TOKEN" in capsys.readouterr().err
    assert fake.calls == []


def test_bad_destination(run_dir, capsys):
    assert main(["push", str(run_dir), "--to", "github:me/tiny", "--dry-run", "x"]) == 2
    assert "hf:ORG/NAME" in capsys.readouterr().err
    (run_dir / "notes.txt").write_text("mine")
    assert main(["push", str(run_dir), "--to", "hf:me/tiny", "--dry-run", str(run_dir / "notes.txt")]) == 2
    assert "is a file. Give a new or empty folder" in capsys.readouterr().err
    assert main(["push", str(run_dir), "--to", "hf:me/tiny", "--dry-run", str(run_dir)]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("repo_id", ["me/tiny emotion", "me/-tiny", "me/tiny.", "me/ti--ny", "我/模型", "me/" + "x" * 97])
def test_a_repo_name_the_hub_would_refuse_is_refused_first_even_in_a_dry_run(run_dir, tmp_path, fake, capsys, repo_id):
    assert main(["push", str(run_dir), "--to", f"hf:{repo_id}", "--dry-run", str(tmp_path / "out")]) == 2
    assert "is not a repository name the Hugging Face hub accepts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and fake.calls == []


def test_embedded_base_names_the_released_model():
    from emotune.deploy.model_card import base_model_id, license_of

    assert base_model_id("embedded") == "google/gemma-3-270m"
    assert base_model_id("hf:Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert base_model_id("/no/such/folder") is None
    assert license_of("Qwen/Qwen2.5-0.5B-Instruct", "qwen2") == "apache-2.0"


def test_a_prompt_holding_a_code_fence_stays_inside_the_cards_code_block(tiny_model_dir, tmp_path):
    system = "Answer like this:\n```\n# Injected heading\n[click](https://example.com)\n````"
    run = write_tiny_adapter(tiny_model_dir, tmp_path / "run", overrides=(f"prompt.system_prompt={system}",))
    artifact = find_artifact(run / "adapter")
    card = model_card(artifact, RunDir(run), "hf", "me/tiny", False, (run / "config.yaml").read_text())
    tokens = MarkdownIt().parse(card.split("---", 2)[2])
    assert not [t for t in tokens if t.type == "inline" and "Injected" in t.content]  # no heading, no paragraph
    blocks = [t.content for t in tokens if t.type == "fence"]
    assert any(system in block for block in blocks)  # the prompt whole, inside one code block


def test_a_label_with_a_pipe_or_a_line_break_stays_one_cell_of_the_cards_table():
    """A label such as `anger|rage` made the model card's results row one column longer (the hub showed its numbers
    under the wrong headings), and a label with a line break ended the table; emotune compare's and a sweep's
    table.md did the same with line breaks. Each is one cell now."""
    from emotune.deploy.model_card import results_table
    row = {"before": 0.25, "after": 0.5, "delta": 0.25}
    lines = results_table({"metrics": {"anger|rage/f1": row, "line\nbreak/f1": row, "accuracy": row}, "rows": 4})
    tokens = MarkdownIt("commonmark").enable("table").parse("\n".join(lines))
    rows, inside = [], False
    for token in tokens:
        if token.type in ("tr_open", "tr_close"):
            inside = token.type == "tr_open"
            rows += [[]] if inside else []
        elif token.type == "inline" and inside:
            rows[-1].append(token.content)
    assert [len(r) for r in rows] == [5, 5, 5, 5]
    assert [r[0] for r in rows[1:]] == ["anger|rage/f1", "line<br>break/f1", "accuracy"]


def test_labels_are_shown_as_written_not_read_as_the_cards_markdown(tiny_model_dir, tmp_path):
    """The card listed the labels as raw Markdown: a label `<details>` opened an HTML element that hid the rest of
    the card on the hub, and one holding a line break and `# ...` became a heading. Each label is a code span now."""
    labels = ["<details>", "ok\n# Injected", "x`y", "joy"]
    run = write_tiny_adapter(tiny_model_dir, tmp_path / "run")
    meta = run / "adapter" / "emotune.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "labels": labels}))
    artifact = find_artifact(run / "adapter")
    card = model_card(artifact, RunDir(run), "hf", "me/tiny", False, None)
    blocks = MarkdownIt().parse(card.split("---", 2)[2])
    headings = [blocks[i + 1].content for i, t in enumerate(blocks) if t.type == "heading_open"]
    assert not [h for h in headings if "Injected" in h]
    tokens = [child for t in blocks for child in [t, *(t.children or [])]]
    assert not [t for t in tokens if t.type in ("html_block", "html_inline")]
    assert [t.content for t in tokens if t.type == "code_inline"][1:5] == ["<details>", "ok # Injected", "x`y", "joy"]


@pytest.mark.parametrize("merged", [False, True])
def test_the_cards_usage_keeps_a_local_base_path_one_argument(merged):
    """A base that is a local folder is named in the card's usage as written: a path with a space, a `"` or ``` broke
    the Python line (`from_pretrained("/data/my "best" model")`), split into several words in the vllm command, or
    closed the code block early. It is a string literal, a quoted shell word, inside a fence longer than its backticks."""
    import ast
    import shlex
    from types import SimpleNamespace

    from emotune.deploy.model_card import usage

    base = '/data/my "best" ```model``` $HOME'
    card = "\n".join(usage(SimpleNamespace(name="tiny"), "hf", "me/tiny", base, merged))
    blocks = {t.info: t.content for t in MarkdownIt().parse(card) if t.type == "fence"}
    calls = [n for n in ast.walk(ast.parse(blocks["python"])) if isinstance(n, ast.Call)]
    strings = [a.value for c in calls for a in c.args if isinstance(a, ast.Constant)]
    words = shlex.split(blocks["bash"])
    if merged:
        assert strings == ["me/tiny", "me/tiny"] and words[:3] == ["vllm", "serve", "me/tiny"]
    else:
        assert base in strings and words[:3] == ["vllm", "serve", base] and "tiny=me/tiny" in words


def test_the_cards_results_table_reads_an_sft_comparison():
    """sft's comparison.json holds each interval of a change flat (`{"delta", "low", "high"}`), classify's under
    "delta": the card read `"low" in delta` of a float and every sft run with a changed ROUGE-L failed its card with a
    TypeError."""
    from emotune.deploy.model_card import results_table
    from emotune.tasks.sft.report import compare

    def stage(score: float) -> dict:
        rows = [{"rouge_l": score + i / 100, "bleu": score, "exact_match": 0.0} for i in range(6)]
        return {"metrics": {"rows": 6, "loss": 1.0, "perplexity": 2.7, "rouge_l": score + 0.025, "bleu": score,
                            "sentence_bleu": score, "exact_match": 0.0, "per_kind": {}}, "rows": rows}

    comparison = json.loads(json.dumps(compare(stage(0.1), stage(0.3))))
    rouge = next(line for line in results_table(comparison) if line.startswith("| rouge_l |"))
    assert rouge.endswith("| +0.200 | [0.200, 0.200] |"), rouge


def _http_error(status: int):
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    request = httpx2.Request("POST", "https://huggingface.co/api/repos/create")
    return HfHubHTTPError(f"{status} Client Error for url {request.url} (token hf_secret_value)",
                          response=httpx2.Response(status, request=request))


def _network_error():
    import httpx2

    return httpx2.ConnectError("[Errno -2] Name or service not known")


@pytest.mark.parametrize(("step", "error", "said"), [
    ("create_repo", lambda: _http_error(401), "refused the token (401"),
    ("create_repo", lambda: _http_error(403), "write access to `me`"),
    ("create_repo", lambda: _http_error(429), "Wait a few minutes"),
    ("create_repo", _network_error, "could not be reached"),
    ("upload_folder", _network_error, "exists, but the upload did not finish"),
    ("upload_folder", lambda: _http_error(503), "Try again later"),
])
def test_a_hub_that_refuses_or_cannot_be_reached_is_a_message_not_a_traceback(run_dir, fake, monkeypatch, capsys,
                                                                              step, error, said):
    """The client's own exceptions (an HTTP status from the hub, a connection that failed before or during the upload)
    came out of `emotune push` as a traceback; each is one message saying what to do, the token never in it."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")

    def refuse(*args, **kwargs):
        raise error()

    monkeypatch.setattr(fake, step, refuse)
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert main(["push", str(run_dir), "--to", "hf:me/tiny-emotion"]) == 2
    err = capsys.readouterr().err
    assert said in err and "me/tiny-emotion" in err and "Traceback" not in err and "hf_secret_value" not in err
    assert ("Nothing was uploaded" in err) == (step == "create_repo")
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_login_the_hub_refuses_when_the_client_is_made_is_a_message(run_dir, monkeypatch, capsys):
    """ModelScope's client logs in as it is made (HubApi.login): a refused token or no network there was a traceback."""
    requests = pytest.importorskip("requests")

    def refusing_client(hub_name, token):
        response = requests.Response()
        response.status_code = 401
        raise requests.HTTPError("401 Client Error: Unauthorized for url: https://www.modelscope.cn/api/v1/login",
                                 response=response)

    monkeypatch.setattr(hub, "hub_client", refusing_client)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", "ms-secret")
    assert main(["push", str(run_dir), "--to", "modelscope:me/tiny"]) == 2
    err = capsys.readouterr().err
    assert "refused the token (401" in err and "MODELSCOPE_API_TOKEN" in err and "Nothing was uploaded" in err


@pytest.mark.parametrize("merged", [False, True])
def test_a_classification_head_run_gets_a_card_of_its_own(tiny_model_dir, tmp_path, fake, capsys, merged):
    """`emotune push` of a task classify_head run failed with KeyError 'system_prompt_template': the card showed every
    classifier's prompt, and a head model has none. Its card says the text goes in as it is, and how to load a model
    that answers with probabilities (no vLLM / Ollama lines, which its export refuses)."""
    import ast

    run = write_tiny_adapter(tiny_model_dir, tmp_path / "run", task="classify_head")
    out = tmp_path / "upload"
    args = ["push", str(run), "--to", "hf:me/tiny-head", "--dry-run", str(out), *(["--merged"] if merged else [])]
    assert main(args) == 0
    header, body = _card((out / "README.md").read_text())
    assert header["pipeline_tag"] == "text-classification" and "text-classification" in header["tags"]
    assert "without a prompt" in body and "vllm serve" not in body and "ollama create" not in body
    blocks = [t.content for t in MarkdownIt().parse(body) if t.type == "fence" and t.info == "python"]
    assert len(blocks) == merged
    for block in blocks:
        tree = ast.parse(block)
        assert "AutoModelForSequenceClassification" in block
        assert [ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and n.targets[0].id == "labels"] == [LABELS]


@pytest.mark.slow
def test_a_full_fine_tuning_run_is_pushed_as_its_whole_model(tiny_overrides, fake, tmp_path, capsys):
    """A train.finetuning full run has model/ and no adapter: `emotune push runs/NAME` (with or without --merged) was
    refused as "a merged model folder ... point at runs/<name>", which it was. It uploads model/ as the merged model,
    its card saying it was fine-tuned whole (no LoRA tag)."""
    from emotune.core.config.load import load_config
    from emotune.pipeline import run

    run(load_config(None, [*tiny_overrides, "train.finetuning=full"]))
    folder = tmp_path / "runs" / "tiny"
    for flags in ([], ["--merged"]):
        out = tmp_path / f"upload{len(flags)}"
        assert main(["push", str(folder), "--to", "hf:me/tiny-full", "--dry-run", str(out), *flags]) == 0
        assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
        header, body = _card((out / "README.md").read_text())
        assert header["library_name"] == "transformers" and "lora" not in header["tags"]
        assert "fully or freeze fine-tuned model" in body and "PeftModel" not in body


def test_private_into_an_existing_public_repository_is_refused(run_dir, monkeypatch, capsys):
    """`--private` to a repository that exists and is public: the hub ignores `private` for an existing repository,
    so the model went up publicly. The real client (a fake HfApi at the network boundary) refuses before uploading."""
    import huggingface_hub

    uploads = []

    class PublicRepoApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False, repo_type=None):
            return f"https://huggingface.co/{repo_id}"  # exists: returned as it is

        def repo_info(self, repo_id, repo_type=None):
            from types import SimpleNamespace

            return SimpleNamespace(private=False)

        def upload_folder(self, **kwargs):
            uploads.append(kwargs)

    monkeypatch.setattr(huggingface_hub, "HfApi", PublicRepoApi)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    assert main(["push", str(run_dir), "--to", "hf:me/tiny", "--private"]) == 2
    err = capsys.readouterr().err
    assert "already exists on the Hugging Face hub and is public" in err and "Nothing was uploaded" in err
    assert uploads == []
    assert main(["push", str(run_dir), "--to", "hf:me/tiny"]) == 0 and len(uploads) == 1  # public was asked for


def test_an_sft_models_card_does_not_promise_the_greedy_modelfile_of_a_classifier(tiny_model_dir, tmp_path):
    """The card said every Modelfile sets `temperature 0`; an sft model's is written without it (it answers freely),
    so the card described a file it does not get."""
    from emotune.deploy.ollama import artifact_modelfile

    for task in ("sft", "classify"):
        artifact = find_artifact(write_tiny_adapter(tiny_model_dir, tmp_path / task, task=task) / "adapter")
        card = model_card(artifact, RunDir(tmp_path / task), "hf", "me/tiny", False, None)
        greedy = "PARAMETER temperature 0" in artifact_modelfile(artifact, "gemma3_text", "m.gguf")
        assert ("temperature 0" in card) == greedy == (task == "classify")


def test_a_modelscope_upload_that_cannot_connect_does_not_name_huggingfaces_offline_switch():
    """The message named HF_HUB_OFFLINE for ModelScope too, a switch its client does not read."""
    said = {name: hub.upload_failure(name, "me/tiny", ConnectionError("Name or service not known"), False, None)
            for name in ("hf", "modelscope")}
    assert "could not be reached" in said["modelscope"] and "HF_HUB_OFFLINE" not in said["modelscope"]
    assert "HF_HUB_OFFLINE set" in said["hf"]
