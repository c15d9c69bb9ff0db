"""Model sources (hub ids offline, mocked hub clients, local folders) and the chat-template fallback."""

from __future__ import annotations

import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers.utils import is_flash_attn_2_available

from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError
from emotune.model.attention import check_attention
from emotune.model.loading import GEMMA_CHAT_TEMPLATE, load_model, load_tokenizer, load_tokenizer_only, resolve_model_dir
from emotune.model.turns import stop_token_ids
from emotune.model.weight_files import check_weight_files


def test_hub_id_without_network_says_how_to_download(tmp_path):
    cfg = ModelConfig(source="google/gemma-4-E4B-it", cache_dir=str(tmp_path))
    with pytest.raises(UserError) as err:
        resolve_model_dir(cfg)
    message = str(err.value)
    assert "google/gemma-4-E4B-it" in message and "Download it first" in message and "model.source" in message
    assert "read as a hub id" not in message


def test_a_missing_folder_read_as_a_hub_id_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """`models/gemma-4` with `models/` here but no `gemma-4` in it was said to be a hub download that failed, as if
    the user had meant the hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for resolve in (resolve_model_dir, load_tokenizer_only):
        with pytest.raises(UserError, match=r"read as a hub id because there is no folder `models/gemma-4` \(a relative "
                                            rf"path is read from the folder emotune runs in, {re.escape(str(tmp_path))}\)"):
            resolve(ModelConfig(source="models/gemma-4", cache_dir=str(tmp_path / "cache")))


def test_hub_id_downloads_into_the_shared_hf_cache(tmp_path, monkeypatch, tiny_model_dir):
    calls = []

    def fake_hub_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **rest):
        calls.append(dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, **rest))
        return str(tiny_model_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub_download)
    monkeypatch.setattr("emotune.model.loading.user_cache_dir", lambda name: str(tmp_path / "user-cache" / name))
    assert resolve_model_dir(ModelConfig(source="hf:google/gemma-4-E4B-it", revision="main")) == Path(tiny_model_dir)
    # huggingface_hub's own default cache (HF_HUB_CACHE / HF_HOME), never a folder of emotune's
    assert calls[-1] == {"repo_id": "google/gemma-4-E4B-it", "revision": "main", "cache_dir": None}
    resolve_model_dir(ModelConfig(source="google/gemma-4-E4B-it", cache_dir=str(tmp_path)))
    assert calls[-1]["cache_dir"] == str(tmp_path / "hub") and "local_dir" not in calls[-1]


def _cache_snapshot(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """A model as huggingface_hub's cache holds it: refs/main naming the commit whose snapshot has the files."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_a_model_in_the_hf_cache_is_used_without_downloading(tmp_path, monkeypatch, tiny_model_dir):
    import huggingface_hub.constants

    from emotune.model.loading import load_tokenizer_only

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # any request would raise
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "shared"))  # as HF_HUB_CACHE sets it
    monkeypatch.setattr("emotune.model.loading.user_cache_dir", lambda name: str(tmp_path / "user-cache" / name))
    snapshot = _cache_snapshot(tmp_path / "shared", "acme/tiny", tiny_model_dir)
    assert resolve_model_dir(ModelConfig(source="acme/tiny")).resolve() == snapshot.resolve()
    assert load_tokenizer_only(ModelConfig(source="hf:acme/tiny")).convert_tokens_to_ids("joy") >= 0
    own = _cache_snapshot(tmp_path / "own" / "hub", "acme/tiny", tiny_model_dir)  # model.cache_dir's hub cache
    assert resolve_model_dir(ModelConfig(source="acme/tiny", cache_dir=str(tmp_path / "own"))).resolve() == own.resolve()
    with pytest.raises(UserError, match="Download it first"):
        resolve_model_dir(ModelConfig(source="acme/other"))
    assert not (tmp_path / "user-cache").exists()  # nothing written into emotune's own folder


def test_an_interrupted_download_in_the_hf_cache_offline_says_hf_hub_offline(tmp_path, monkeypatch, tiny_model_dir):
    """A snapshot in the hub cache without its weights (a download cut off) with HF_HUB_OFFLINE set was taken as the
    model, then refused with "download or copy the model again, then run the same command", which offline never
    downloads. It names HF_HUB_OFFLINE and the cached folder."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = _cache_snapshot(tmp_path / "own" / "hub", "acme/tiny", tiny_model_dir)
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"lacks weights \(an interrupted download\), and HF_HUB_OFFLINE is set"):
        resolve_model_dir(ModelConfig(source="acme/tiny", cache_dir=str(tmp_path / "own")))


def test_modelscope_id_uses_modelscope_client(tmp_path, monkeypatch, tiny_model_dir):
    seen = {}
    fake = types.ModuleType("modelscope")

    def fake_ms_download(repo_id, revision=None, local_dir=None):
        seen["repo_id"] = repo_id
        return str(tiny_model_dir)

    fake.snapshot_download = fake_ms_download
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    cfg = ModelConfig(source="modelscope:google/gemma-4-E4B-it", cache_dir=str(tmp_path))
    assert resolve_model_dir(cfg) == Path(tiny_model_dir)
    assert seen["repo_id"] == "google/gemma-4-E4B-it"


def test_modelscope_client_failure_is_a_clear_error(tmp_path, monkeypatch):
    fake = types.ModuleType("modelscope")

    def fake_ms_download(repo_id, revision=None, local_dir=None):
        raise ConnectionError("Failed to resolve 'www.modelscope.cn'")

    fake.snapshot_download = fake_ms_download
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    with pytest.raises(UserError, match=r"modelscope download --model google/gemma-4-E4B-it"):
        resolve_model_dir(ModelConfig(source="modelscope:google/gemma-4-E4B-it", cache_dir=str(tmp_path)))


def test_an_interrupted_modelscope_download_is_resumed_not_taken_as_the_model(tmp_path, monkeypatch, tiny_model_dir):
    """A ModelScope download cut off after config.json left a folder that every later run took as the finished model
    (its own download folder holds config.json) and refused for its missing weights, saying to download again: running
    the same command never downloaded again. A folder without its weights is downloaded into (resumed) instead."""
    import shutil

    calls = []
    fake = types.ModuleType("modelscope")

    def cut_off_once(repo_id, revision=None, local_dir=None):
        calls.append(repo_id)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_model_dir / "config.json", Path(local_dir) / "config.json")
        if len(calls) == 1:
            raise ConnectionError("Connection reset by peer")
        shutil.copytree(tiny_model_dir, local_dir, dirs_exist_ok=True)
        return local_dir

    fake.snapshot_download = cut_off_once
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    cfg = ModelConfig(source="modelscope:acme/tiny", cache_dir=str(tmp_path))
    with pytest.raises(UserError, match="Connection reset"):
        resolve_model_dir(cfg)
    folder = resolve_model_dir(cfg)
    assert calls == ["acme/tiny", "acme/tiny"]
    load_model(folder, torch.float32, torch.device("cpu"))  # the whole model, weights and all
    assert resolve_model_dir(cfg) == folder and len(calls) == 2  # a finished download is used as it is


def _hub_error(kind: str, status: int):
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://huggingface.co/api/models/acme/tiny/revision/v2")
    return getattr(errors, kind)(f"{status} Client Error.\n\nMore details.", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(("kind", "status", "said"), [
    ("GatedRepoError", 403, "is a gated repository: its terms must be accepted once with your account on "
                            "https://huggingface.co/acme/tiny"),
    ("RevisionNotFoundError", 404, "has no revision `v2`. Fix model.revision"),
    ("RepositoryNotFoundError", 401, "check the spelling in model.source, or, if it is private or gated, log in"),
    ("HfHubHTTPError", 401, "refused the token this machine is logged in with (401)"),
    ("HfHubHTTPError", 429, "Wait a few minutes"),
])
def test_a_hub_that_refuses_the_download_says_why_and_the_fix(tmp_path, monkeypatch, kind, status, said):
    """A gated model, a revision or repository the hub does not have, a refused token: each was reported as `403 Client
    Error.` followed by "download it first where the hub is reachable", which the hub was. Each names its own fix."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise _hub_error(kind, status)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    cfg = ModelConfig(source="acme/tiny", revision="v2", cache_dir=str(tmp_path))
    for resolve in (resolve_model_dir, load_tokenizer_only):
        with pytest.raises(UserError) as err:
            resolve(cfg)
        assert said in str(err.value) and "where the hub is reachable" not in str(err.value)


@pytest.mark.parametrize("source", ["acme/my model", "acme/模型", "acme/x:main", "hf://acme/x"])
def test_a_source_that_is_no_hub_id_and_no_folder_says_so(tmp_path, source):
    with pytest.raises(UserError) as err:
        resolve_model_dir(ModelConfig(source=source, cache_dir=str(tmp_path)))
    assert "is not a hub id the hub accepts" in str(err.value) and "Fix model.source" in str(err.value)
    assert ("write hf:acme/x, without `//`" in str(err.value)) == source.startswith("hf://")


@pytest.mark.parametrize(("source", "said"), [
    ("https://huggingface.co/google/gemma-3-270m", "model.source: google/gemma-3-270m (a branch"),
    ("hf.co/google/gemma-3-270m/tree/main", "model.source: google/gemma-3-270m (a branch"),
    ("https://modelscope.cn/models/Qwen/Qwen3-0.6B/files", "model.source: modelscope:Qwen/Qwen3-0.6B (a branch"),
    ("google/gemma-3-270m@main", "Write model.source: google/gemma-3-270m and model.revision: main."),
    ("acme/multi/text-only", "If `acme/multi` is a hub repository and `text-only` a folder in it: a source is a whole "
                             "repository, so download it (`hf download acme/multi --local-dir models/multi`) and set "
                             "model.source to models/multi/text-only."),
])
def test_a_hub_page_address_or_an_id_with_a_revision_says_how_to_write_it(tmp_path, source, said):
    """A model page's address pasted as model.source was "neither an existing folder ... nor a hub id. Fix the path";
    `ORG/NAME@main` was "not a hub id". Each says the id to write, and that the revision has a field of its own."""
    for resolve in (resolve_model_dir, load_tokenizer_only):
        with pytest.raises(UserError) as err:
            resolve(ModelConfig(source=source, cache_dir=str(tmp_path)))
        assert said in str(err.value)


def test_another_modelscope_revision_is_downloaded_not_the_cached_one_reused(tmp_path, monkeypatch, tiny_model_dir):
    """emotune's ModelScope folder was one per repository: after model.revision v1 was downloaded, model.revision v2
    silently trained (and counted tokens) on v1's files. Each revision has its own folder, the tokenizer's too."""
    import json
    import shutil

    calls = []
    fake = types.ModuleType("modelscope")

    def download(repo_id, revision=None, local_dir=None, allow_patterns=None):
        calls.append((revision, "tokenizer" if allow_patterns else "model"))
        shutil.copytree(tiny_model_dir, local_dir, dirs_exist_ok=True)
        config = Path(local_dir) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "emotune_test_revision": revision}))
        return local_dir

    fake.snapshot_download = download
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    folders = {}
    for revision in ("v1", "v2", "v1"):
        cfg = ModelConfig(source="modelscope:acme/tiny", revision=revision, cache_dir=str(tmp_path))
        folders[revision] = resolve_model_dir(cfg)
        assert json.loads((folders[revision] / "config.json").read_text())["emotune_test_revision"] == revision
        load_tokenizer_only(cfg)
    assert folders["v1"] != folders["v2"]
    assert calls == [("v1", "model"), ("v2", "model")]  # v1's model folder is reused, and serves its tokenizer too
    for revision in ("v3", "v4", "v3"):  # the tokenizer alone (emotune data, plan): a folder per revision as well
        load_tokenizer_only(ModelConfig(source="modelscope:acme/tiny", revision=revision, cache_dir=str(tmp_path)))
    assert calls[2:] == [("v3", "tokenizer"), ("v4", "tokenizer")]


@pytest.mark.parametrize(("name", "content", "said"), [
    ("model.gguf", b"<!DOCTYPE html> a login page saved as a model", "is not a readable GGUF file (GGUF magic invalid)"),
    ("MODEL.GGUF", b"GGUF", "is not a readable GGUF file"),
    ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "It is a file: point model.source at the folder"),
])
def test_a_model_source_file_that_is_no_model_is_refused_naming_it(tmp_path, name, content, said):
    """A .gguf model.source that is no GGUF file (an HTML page, a cut-off download) came out of the run as gguf's
    `ValueError: GGUF magic invalid` traceback; an upper-case .GGUF, or the weights file itself, were "neither an existing
    folder, a .gguf file, nor a hub id", though they exist."""
    source = tmp_path / name
    source.write_bytes(content)
    for resolve in (resolve_model_dir, load_tokenizer_only):
        with pytest.raises(UserError, match=re.escape(said)):
            resolve(ModelConfig(source=str(source), cache_dir=str(tmp_path / "cache")))


def test_a_gguf_file_transformers_cannot_read_back_is_refused_naming_it(tmp_path):
    """A well-formed GGUF file of an architecture (or tokenizer) transformers' GGUF reader does not know: converting
    it raised transformers' ValueError as a traceback, after "Converting ... (once)". Refused with its words and the
    fix, and no cache entry is left behind."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"transformers cannot turn this GGUF file back into a model \(ValueError: "):
        resolve_model_dir(ModelConfig(source=str(tmp_path / "odd.gguf"), cache_dir=str(tmp_path / "cache")))
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if p.is_dir()]


def test_bad_local_sources(tmp_path):
    with pytest.raises(UserError, match="without config.json"):
        resolve_model_dir(ModelConfig(source=str(tmp_path)))
    with pytest.raises(UserError, match="neither"):
        resolve_model_dir(ModelConfig(source=str(tmp_path / "missing" / "model")))


@pytest.mark.parametrize("kind", ["missing", "a data file", "a run folder", "an adapter folder"])
def test_the_tokenizer_alone_is_found_as_a_run_finds_the_model(tiny_model_dir, tmp_path, kind):
    """`emotune data` sent every source that is not a folder to the hub ("could not download its tokenizer from the hf
    hub (HFValidationError)" for a mistyped path), and read a run or adapter folder's tokenizer as a base's."""
    from emotune.model.loading import load_tokenizer_only

    source = {"missing": tmp_path / "models" / "gemma", "a data file": tmp_path / "d.jsonl",
              "a run folder": tmp_path / "run", "an adapter folder": tmp_path / "run" / "adapter"}[kind]
    (tmp_path / "d.jsonl").write_text('{"text": "x", "label": "joy"}\n')
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    expected = "neither `embedded`, an existing folder" if kind in ("missing", "a data file") else "not a base model"
    for load in (resolve_model_dir, load_tokenizer_only):
        with pytest.raises(UserError, match=expected):
            load(ModelConfig(source=str(source)))
    assert load_tokenizer_only(ModelConfig(source=str(tiny_model_dir))).chat_template


def test_missing_chat_template_falls_back_to_gemma_turns(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = None
    tok.save_pretrained(folder)
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    tokenizer = load_tokenizer(folder, ModelConfig(source=str(folder)))
    assert tokenizer.chat_template == GEMMA_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": "joy"}], tokenize=False)
    assert text == "<bos><start_of_turn>user\nbe brief\n\nhello<end_of_turn>\n<start_of_turn>model\njoy<end_of_turn>\n"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<start_of_turn>model\n")
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in stop_token_ids(tokenizer)


def test_generation_under_lora_projects_the_last_position_with_one_matmul(tiny_model_dir):
    """A frozen output projection (every LoRA model) must not take torch's batched-matmul path on the
    [rows, 1, hidden] last-position view: that path copies the weight once per row (40 s per batch of 16
    for Gemma's vocabulary on a CPU, the fine-tuned evaluation's 9x slowdown)."""
    from torch.profiler import ProfilerActivity, profile

    from emotune.core.config.data import PromptConfig
    from emotune.core.config.eval import EvalConfig
    from emotune.core.config.train import LoraSettings
    from emotune.eval.evaluate import LabelPrompt, generate_outputs
    from emotune.model.lora import attach_lora

    tokenizer = load_tokenizer(tiny_model_dir, ModelConfig(source=str(tiny_model_dir)))
    model = attach_lora(load_model(tiny_model_dir, torch.float32, torch.device("cpu")), LoraSettings(r=4))
    vocab = model.get_output_embeddings().weight.shape[0]
    assert not model.get_output_embeddings().weight.requires_grad
    texts = ["i feel sad today", "what a joy", "so angry right now and more words here"]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        asked = LabelPrompt(PromptConfig(), ["joy", "sadness"])
        generate_outputs(model, tokenizer, texts, asked, EvalConfig(max_new_tokens=2, batch_size=3), None)
    batched_head = [e.input_shapes for e in prof.events() if e.name == "aten::bmm" and vocab in sum(e.input_shapes, [])]
    projections = [e for e in prof.events() if e.name == "aten::linear" and e.input_shapes[1][:1] == [vocab]]
    assert projections and not batched_head


def test_a_gemma_tokenizer_drops_its_build_lists_and_encodes_and_saves_the_same(tmp_path):
    from transformers import AutoTokenizer, GemmaTokenizer

    pieces = ["▁", "f", "e", "l", "s", "a", "d", "j", "o", "y", "▁f", "ee", "▁fee", "▁feel", "▁s", "▁sa", "▁sad"]
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *pieces])}
    merges = [("▁", "f"), ("e", "e"), ("▁f", "ee"), ("▁fee", "l"), ("▁", "s"), ("▁s", "a"), ("▁sa", "d")]
    GemmaTokenizer(vocab=vocab, merges=merges).save_pretrained(tmp_path / "built")
    plain = AutoTokenizer.from_pretrained(tmp_path / "built")
    assert type(plain).__name__ == "GemmaTokenizer" and len(plain._merges) == len(merges)

    tokenizer = load_tokenizer(tmp_path / "built", ModelConfig(source=str(tmp_path / "built")))
    assert tokenizer._vocab == {} and tokenizer._merges == []
    text = "i feel sad joy"
    assert tokenizer(text)["input_ids"] == plain(text)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"]) == plain.convert_ids_to_tokens(plain(text)["input_ids"])
    tokenizer.save_pretrained(tmp_path / "saved")  # as the adapter folder gets it
    assert (tmp_path / "saved" / "tokenizer.json").read_text() == (tmp_path / "built" / "tokenizer.json").read_text()
    again = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert again(text)["input_ids"] == plain(text)["input_ids"] and len(again._merges) == len(merges)


def test_attn_implementation_reaches_the_model(tiny_model_dir):
    for choice, expected in (("eager", "eager"), ("sdpa", "sdpa"), ("auto", "sdpa")):
        model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"), choice)
        assert model.config._attn_implementation == expected, choice


def test_an_attention_kernel_that_cannot_run_is_refused_with_every_reason(tiny_model_dir, tmp_path):
    cfg = ModelConfig(source=str(tiny_model_dir), attn_implementation="flash_attention_2")
    for ok in ("auto", "eager", "sdpa"):
        check_attention(cfg.model_copy(update={"attn_implementation": ok}), tiny_model_dir, torch.device("cpu"),
                        torch.float32)
    with pytest.raises(UserError) as cpu:
        check_attention(cfg, tiny_model_dir, torch.device("cpu"), torch.float32)
    assert "CUDA and ROCm GPUs only" in str(cpu.value) and "bf16 or fp16" in str(cpu.value)
    assert "model.attn_implementation=sdpa" in str(cpu.value)
    if not is_flash_attn_2_available():  # a GPU machine without the package: said, with how to install it
        with pytest.raises(UserError, match="the flash-attn package"):
            check_attention(cfg, tiny_model_dir, torch.device("cuda"), torch.bfloat16)

    # a model class transformers does not implement it for (Gemma 3's image-text model), from config.json alone
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    Gemma3Config(text_config=Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16),
                 vision_config=SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14),
                 mm_tokens_per_image=4).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="Gemma3ForConditionalGeneration does not support Flash Attention 2"):
        check_attention(cfg, tmp_path, torch.device("cuda"), torch.bfloat16)


def test_a_refused_attention_kernel_stops_the_run_before_it_starts(tiny_overrides, tmp_path, capsys):
    from emotune.cli import main

    assert main(["train", *tiny_overrides, "model.attn_implementation=flash_attention_2"]) == 2
    assert "model.attn_implementation=flash_attention_2 cannot be used here" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# google/gemma-4-E4B-it's text_config: sliding-window layers of head dim 256, full-attention layers of 512; the rest
# is shrunk, as only config.json is read
E4B_HEAD_DIMS = dict(head_dim=256, global_head_dim=512, num_attention_heads=8, num_key_value_heads=2)


def _gemma4_configs(folder, text_only: bool, **dims):
    from transformers import Gemma4Config, Gemma4TextConfig

    text = Gemma4TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=64,
                            hidden_size_per_layer_input=8, **dims)
    (text if text_only else Gemma4Config(text_config=text.to_dict())).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("text_only", [True, False], ids=["gemma4_text", "gemma4-multimodal"])
def test_flash_attention_is_refused_for_gemma4_s_512_wide_heads_naming_what_works(tmp_path, text_only):
    folder = _gemma4_configs(tmp_path, text_only, **E4B_HEAD_DIMS)  # config.json only: no weight is read
    cfg = ModelConfig(source=str(folder), attn_implementation="flash_attention_2")
    with pytest.raises(UserError) as refused:
        check_attention(cfg, folder, torch.device("cuda"), torch.bfloat16)
    message = str(refused.value)
    assert "head dim 512 in 1 of its layers (layer 1 first)" in message and "up to 256" in message
    assert "model.attn_implementation=sdpa" in message and "eager" in message
    for ok in ("sdpa", "eager", "auto"):  # what the message names does pass the same check
        check_attention(cfg.model_copy(update={"attn_implementation": ok}), folder, torch.device("cuda"), torch.bfloat16)


def test_head_dims_within_flash_attention_s_limit_are_not_refused_for_their_width(tmp_path):
    from transformers import AutoConfig

    from emotune.model.attention import flash_attention_problem, head_dims

    folder = _gemma4_configs(tmp_path, True, head_dim=128, global_head_dim=256, num_attention_heads=2, num_key_value_heads=1)
    assert head_dims(AutoConfig.from_pretrained(folder)) == {128: [0], 256: [1]}
    assert flash_attention_problem(AutoConfig.from_pretrained(folder)) is None
    from transformers import LlamaConfig

    assert head_dims(LlamaConfig(hidden_size=4096, num_attention_heads=32, num_hidden_layers=2)) == {128: [0, 1]}


def test_sdpa_refused_by_a_multimodal_class_names_auto_which_picks_per_part(tmp_path):
    """Gemma 4 E4B's audio tower has no SDPA path, so transformers refuses sdpa for the whole multimodal class; auto
    (transformers' choice per part: SDPA for the text model) is what works, and the message says so."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig

    text = Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, global_head_dim=32, vocab_size_per_layer_input=64,
                            hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"])
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                              output_proj_dims=16)
    Gemma4Config(text_config=text.to_dict(), audio_config=audio.to_dict()).save_pretrained(tmp_path)
    cfg = ModelConfig(source=str(tmp_path), attn_implementation="sdpa")
    with pytest.raises(UserError) as refused:
        check_attention(cfg, tmp_path, torch.device("cpu"), torch.float32)
    assert "Gemma4AudioModel does not support" in str(refused.value)
    assert "Set model.attn_implementation=auto (or eager) instead" in str(refused.value)
    with pytest.raises(UserError, match=r"Set model.attn_implementation=auto \(or eager\)"):  # flash: not sdpa either
        check_attention(cfg.model_copy(update={"attn_implementation": "flash_attention_2"}), tmp_path, torch.device("cuda"),
                        torch.bfloat16)
    check_attention(cfg.model_copy(update={"attn_implementation": "auto"}), tmp_path, torch.device("cpu"), torch.float32)


def test_a_hub_repository_of_pytorch_weights_only_downloads_them(tmp_path, monkeypatch, tiny_model_dir):
    """A repository with `pytorch_model.bin` and no safetensors (older checkpoints and many fine-tunes) came down as
    config and tokenizer alone, since the download asks for `*.safetensors` weights, and the run then said the folder
    had no weights and to download it again, which came down the same. transformers reads such weights; they come
    down when the repository has no safetensors."""
    import fnmatch

    import huggingface_hub
    from safetensors.torch import load_file

    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo)
    torch.save(load_file(repo / "model.safetensors"), repo / "pytorch_model.bin")
    (repo / "model.safetensors").unlink()
    snapshot, asked = tmp_path / "snapshot", []

    def fake_hub_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **rest):
        asked.append(allow_patterns)
        snapshot.mkdir(exist_ok=True)
        for file in repo.iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_hub_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the fake client is the hub here
    folder = resolve_model_dir(ModelConfig(source="acme/old-model", cache_dir=str(tmp_path / "cache")))
    assert (folder / "pytorch_model.bin").is_file() and len(asked) == 2
    check_weight_files(folder)
    shutil.rmtree(snapshot)
    repo.joinpath("model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes())
    resolve_model_dir(ModelConfig(source="acme/old-model", cache_dir=str(tmp_path / "cache2")))
    assert len(asked) == 3  # a repository with safetensors: its .bin files are never fetched
