"""GGUF export: the file read back with gguf's reader, loaded with transformers' GGUF loader and compared with the
Hugging Face model it came from; the LoRA adapter GGUF; `emotune export --format gguf` on a tiny run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from conftest import LABELS, write_tiny_adapter
from emotune.cli import main
from emotune.core.errors import UserError
from emotune.deploy.gguf_lora import write_lora_gguf
from emotune.deploy.gguf_write import read_emotune_keys, write_gguf
from gguf_models import tiny_gemma3, tiny_gemma3_multimodal, tiny_llama

META = {"name": "tiny", "task": "classify", "labels": LABELS, "system_prompt": "Classify.", "user_template": "Text: {text}"}
IDS = [[1, 40, 41, 42, 60, 61, 62, 80, 81, 100, 120, 7]]


def _fields(path):
    reader = GGUFReader(path)
    return reader, {key: field.contents() for key, field in reader.fields.items()
                    if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                                   "tokenizer.ggml.scores")}


def _logits_gap(model_dir, gguf_file) -> float:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        return (reference(ids).logits - loaded(ids).logits).abs().max().item()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-gguf"))


def test_llama_gguf_reads_back_and_loads_in_transformers(llama_dir, tmp_path):
    target = write_gguf(llama_dir, tmp_path / "tiny-f16.gguf", "f16", META)
    reader, fields = _fields(target)
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == 2 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 16
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "llama-bpe"
    assert fields["tokenizer.ggml.eos_token_id"] == 4 and fields["general.file_type"] == 1
    assert "<|start_header_id|>" in fields["tokenizer.chat_template"]
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[:2] == ["<|begin_of_text|>", "<|end_of_text|>"] and len(reader.fields["tokenizer.ggml.merges"].data) > 0
    assert read_emotune_keys(target) == {k: v for k, v in META.items() if k != "name"}
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert shapes["blk.0.attn_q.weight"] == [64, 64] and shapes["blk.0.attn_k.weight"] == [64, 32]  # ggml: [in, out]
    assert "output.weight" not in shapes  # tied to token_embd
    # transformers' reader undoes the q/k permutation: a missing or wrong one changes the logits by far more
    assert _logits_gap(llama_dir, target) < 2e-2


def test_qk_rows_are_permuted_for_llama_only(llama_dir, tmp_path):
    from safetensors.torch import load_file

    target = write_gguf(llama_dir, tmp_path / "tiny-f16.gguf", "f16", META)
    stored = {t.name: np.array(t.data) for t in GGUFReader(target).tensors}
    q = load_file(llama_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"].numpy()
    head = q[:16]  # head 0: rows 0..7 rotate with rows 8..15 in transformers; llama.cpp wants them interleaved
    assert np.allclose(stored["blk.0.attn_q.weight"][:16].astype(np.float32), head[[0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13,
                                                                                   6, 14, 7, 15]], atol=1e-3)


def test_qwen2_and_mistral_load_back(tmp_path):
    for model_type, arch in (("qwen2", "qwen2"), ("mistral", "llama")):
        folder = tiny_llama(tmp_path / model_type, model_type)
        target = write_gguf(folder, tmp_path / f"{model_type}.gguf", "f16", {**META, "name": f"tiny-{model_type}"})
        _, fields = _fields(target)
        assert fields["general.architecture"] == arch
        if model_type == "qwen2":
            assert fields["tokenizer.ggml.pre"] == "llama-bpe" and "<|im_start|>" in fields["tokenizer.chat_template"]
        else:
            assert "output.weight" in {t.name for t in GGUFReader(target).tensors}  # untied
        assert _logits_gap(folder, target) < 2e-2, model_type


def test_gemma3_norms_get_the_offset_and_the_model_loads_back(gemma3_dir, tmp_path):
    from safetensors.torch import load_file

    target = write_gguf(gemma3_dir, tmp_path / "gemma-f16.gguf", "f16", META)
    reader, fields = _fields(target)
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.attention.key_length"] == 256
    assert fields["gemma3.attention.sliding_window"] == 64
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    hf = load_file(gemma3_dir / "model.safetensors")
    for hf_name, name in (("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
                          ("model.layers.1.self_attn.q_norm.weight", "blk.1.attn_q_norm.weight"),
                          ("model.norm.weight", "output_norm.weight")):
        assert np.allclose(stored[name], hf[hf_name].numpy() + 1.0), name
    assert _logits_gap(gemma3_dir, target) < 2e-2


def test_multimodal_gemma3_exports_its_text_model(tmp_path):
    from transformers import AutoModelForImageTextToText

    folder = tiny_gemma3_multimodal(tmp_path / "mm")
    target = write_gguf(folder, tmp_path / "mm-f16.gguf", "f16", META)
    names = {t.name for t in GGUFReader(target).tensors}
    assert "blk.1.ffn_down.weight" in names and not any(n.startswith(("v.", "mm.")) for n in names)
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=target.name, dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (reference(input_ids=torch.tensor(IDS)).logits - loaded(torch.tensor(IDS)).logits).abs().max().item()
    assert gap < 2e-2


@pytest.mark.parametrize("quant,bound", [("q8_0", 0.1), ("q4_0", 1.0), ("bf16", 0.1)])
def test_quantized_files_hold_quantized_tensors(llama_dir, tmp_path, quant, bound):
    target = write_gguf(llama_dir, tmp_path / f"tiny-{quant}.gguf", quant, META)
    types = {t.name: t.tensor_type.name for t in GGUFReader(target).tensors}
    assert types["blk.0.ffn_up.weight"] == quant.upper() and types["blk.0.attn_norm.weight"] == "F32"
    assert _logits_gap(llama_dir, target) < bound


def test_unsupported_families_are_refused_by_name(tmp_path):
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8).save_pretrained(tmp_path / "gemma2")
    with pytest.raises(UserError, match="Gemma 2.*Supported: Gemma 4"):
        write_gguf(tmp_path / "gemma2", tmp_path / "x.gguf", "f16", META)


def test_gemma3_with_another_query_scale_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="query_pre_attn_scalar=256"):  # conftest's model: head_dim 16
        write_gguf(tiny_model_dir, tmp_path / "x.gguf", "f16", META)


@pytest.mark.parametrize(("model_type", "window"), [("mistral", dict(sliding_window=8)),
                                                   ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))])
def test_a_sliding_window_llama_cpp_would_not_apply_is_refused(model_type, window, tmp_path):
    """mistralai/Mistral-7B-v0.1 slides every layer's window (4,096 of a 32,768 context), Qwen2 with use_sliding_window
    the upper layers': the GGUF file carried no window and llama.cpp's llama and qwen2 graphs attend to the whole
    context, so past the window the exported model computed something else, without a word (here 8 of 256)."""
    folder = tiny_llama(tmp_path / model_type, model_type, **window)
    with pytest.raises(UserError, match="sliding window of 8 tokens"):
        write_gguf(folder, tmp_path / "x.gguf", "f16", META)


def test_word_level_tokenizer_is_refused(llama_dir, tmp_path):
    import shutil

    from conftest import build_tokenizer

    folder = tmp_path / "word-level"
    shutil.copytree(llama_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    build_tokenizer(folder)
    with pytest.raises(UserError, match="WordLevel"):
        write_gguf(folder, tmp_path / "x.gguf", "f16", META)


def test_export_refuses_a_word_level_tokenizer_before_merging(llama_dir, tmp_path):
    """`emotune export RUN --format gguf` on a base whose tokenizer llama.cpp cannot read: refused with exit 2 before
    the adapter export and the merged folder are written."""
    import shutil

    from conftest import build_tokenizer

    base = tmp_path / "word-level"
    shutil.copytree(llama_dir, base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).unlink()
    build_tokenizer(base)
    run = write_tiny_adapter(base, tmp_path / "run", r=4)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "gguf", "--out", str(out)]) == 2
    assert not out.exists()


def test_lora_adapter_gguf_round_trip(llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from emotune.deploy.gguf_arch import permute_rows

    run = write_tiny_adapter(llama_dir, tmp_path / "run", r=4)
    target = write_lora_gguf(run / "adapter", AutoConfig.from_pretrained(llama_dir), tmp_path / "lora.gguf", "tiny")
    reader = GGUFReader(target)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == 8.0
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    assert len(tensors) == 2 * 2 * 7  # 2 layers x 7 linear modules x (A, B)
    a, b = tensors["blk.1.attn_q.weight.lora_a"], tensors["blk.1.attn_q.weight.lora_b"]
    assert a.shape == (4, 64) and b.shape == (64, 4)  # numpy order: A [r, in], B [out, r]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir), run / "adapter")
    delta = peft.base_model.model.model.layers[1].self_attn.q_proj.get_delta_weight("default").detach().numpy()
    assert np.allclose(b @ a * (8.0 / 4), permute_rows(delta, 4), atol=1e-5)


def test_dora_adapter_gets_no_lora_gguf(llama_dir, tmp_path):
    from transformers import AutoConfig

    run = write_tiny_adapter(llama_dir, tmp_path / "run", r=4, use_dora=True)
    with pytest.raises(UserError, match="DoRA"):
        write_lora_gguf(run / "adapter", AutoConfig.from_pretrained(llama_dir), tmp_path / "lora.gguf", "tiny")


def test_export_format_gguf_and_ollama(llama_dir, tmp_path, capsys):
    run = write_tiny_adapter(llama_dir, tmp_path / "run", r=4)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "ollama", "--quant", "q8_0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("merged/config.json", "gguf/run-q8_0.gguf", "gguf/run-lora.gguf", "ollama/Modelfile", "ollama/run-q8_0.gguf"):
        assert (out / name).exists(), name
    assert "ollama create run -f" in printed
    modelfile = (out / "ollama" / "Modelfile").read_text()
    assert "FROM ./run-q8_0.gguf" in modelfile and "PARAMETER temperature 0" in modelfile
    keys = read_emotune_keys(out / "gguf" / "run-q8_0.gguf")
    assert keys["labels"] == LABELS and "{labels}" not in keys["system_prompt"]


def test_a_system_prompt_ollama_cannot_hold_is_refused_before_an_earlier_export_is_replaced(llama_dir, tmp_path,
                                                                                         capsys):
    out = tmp_path / "export"
    good = write_tiny_adapter(llama_dir, tmp_path / "good", r=4)
    assert main(["export", str(good), "--format", "ollama", "--quant", "q8_0", "--out", str(out)]) == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    bad = write_tiny_adapter(llama_dir, tmp_path / "bad", r=4, overrides=('prompt.system_prompt=say """yes"""',))
    capsys.readouterr()
    assert main(["export", str(bad), "--format", "ollama", "--quant", "q8_0", "--out", str(out), "--force"]) == 2
    assert "ends a Modelfile string" in capsys.readouterr().err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # the good export, Modelfile and all
    assert "good" in (out / "ollama" / "Modelfile").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # nothing half-written beside it


def test_a_gguf_write_that_fails_midway_leaves_the_earlier_export_whole(llama_dir, tmp_path, monkeypatch):
    """The GGUF file was written after the new adapter/ and merged/ had replaced the earlier export: a write that
    failed there (a full disk) left merged/ and a cut-off gguf/ in its place, the good GGUF file and Modelfile gone."""
    from emotune.deploy import gguf_write

    out = tmp_path / "export"
    good = write_tiny_adapter(llama_dir, tmp_path / "good", r=4)
    assert main(["export", str(good), "--format", "ollama", "--quant", "q8_0", "--out", str(out)]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def disk_full(writer, path, *args):
        path.write_bytes(b"GGUF" + bytes(64))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_write, "_stream", disk_full)
    other = write_tiny_adapter(llama_dir, tmp_path / "other", seed=1, r=4)
    with pytest.raises(OSError, match="No space left"):
        main(["export", str(other), "--format", "ollama", "--quant", "q8_0", "--out", str(out), "--force"])
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name]  # nothing half-written beside it


def test_k_quant_without_llama_cpp_prints_the_command(llama_dir, tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-quantize either
    run = write_tiny_adapter(llama_dir, tmp_path / "run", r=4)
    assert main(["export", str(run), "--format", "gguf", "--quant", "q4_k_m", "--out", str(tmp_path / "export")]) == 0
    printed = capsys.readouterr().out
    assert "llama-quantize" in printed and "run-f16.gguf" in printed and "Q4_K_M" in printed
    assert main(["export", str(run), "--format", "gguf", "--quant", "q3", "--out", str(tmp_path / "e2")]) == 2


def test_a_llama_quantize_that_fails_is_a_message_and_keeps_the_earlier_export(llama_dir, tmp_path, capsys, monkeypatch):
    """llama-quantize exiting non-zero (an older llama.cpp, an architecture it lacks) was a CalledProcessError
    traceback after the export had replaced the earlier one; now nothing is replaced and its own words are quoted."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    quantizer = bin_dir / "llama-quantize"
    quantizer.write_text("#!/bin/sh\necho \"llama_model_quantize: failed to quantize: unknown model architecture\" >&2\n"
                         "exit 1\n")
    quantizer.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    run = write_tiny_adapter(llama_dir, tmp_path / "run", r=4)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "gguf", "--quant", "q8_0", "--out", str(out)]) == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    capsys.readouterr()
    assert main(["export", str(run), "--format", "gguf", "--quant", "q4_k_m", "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "unknown model architecture" in err and "--quant q8_0" in err and "Traceback" not in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
