"""Gemma 4 GGUF export (emotune.deploy.gguf_gemma4): the file read back with gguf's reader against the Hugging Face
checkpoint it came from (every tensor, its shape and values, the hyperparameters llama.cpp reads, the tokenizer), the
multimodal checkpoint's text model, the adapter GGUF, and the configurations llama.cpp would compute differently.
llama.cpp itself runs these files in tests/test_gguf_llama_cpp.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader, TokenType

from conftest import LABELS, write_tiny_adapter
from emotune.core.errors import UserError
from emotune.deploy.gguf_lora import write_lora_gguf
from emotune.deploy.gguf_write import read_emotune_keys, write_gguf
from gguf_models import tiny_gemma4

META = {"name": "tiny", "task": "classify", "labels": LABELS, "system_prompt": "Classify.", "user_template": "Text: {text}"}
# transformers' names (text model, no prefix) -> llama.cpp's, for the tensors every Gemma 4 layer has
LAYER_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm", "layer_scalar": "layer_output_scale"}
KV_TENSORS = {"self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.k_norm": "attn_k_norm"}
PLE_TENSORS = {"per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm"}


@pytest.fixture(scope="module")
def e2b_dir(tmp_path_factory):
    return tiny_gemma4(tmp_path_factory.mktemp("gemma4-e2b"), "e2b")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return tiny_gemma4(tmp_path_factory.mktemp("gemma4-dense"), "dense")


def _read(path):
    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.") or k.endswith("_id")}
    return reader, fields, {t.name: np.array(t.data) for t in reader.tensors}


def _hf(folder) -> dict[str, np.ndarray]:
    """The checkpoint's text-model tensors under their text-model names."""
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    text = {k.replace("model.language_model.", "model."): v for k, v in weights.items() if "vision" not in k and "audio" not in k}
    return {k: v.float().numpy() for k, v in text.items()}


def _expected(hf: dict, n_layer: int, shared: int) -> dict[str, str]:
    """GGUF name -> checkpoint name of every tensor the export must hold (rope_freqs aside)."""
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if "lm_head.weight" in hf:
        expected["output.weight"] = "lm_head.weight"
    for hf_name, name in (("embed_tokens_per_layer", "per_layer_token_embd"),
                          ("per_layer_model_projection", "per_layer_model_proj"),
                          ("per_layer_projection_norm", "per_layer_proj_norm")):
        if f"model.{hf_name}.weight" in hf:
            expected[f"{name}.weight"] = f"model.{hf_name}.weight"
    for i in range(n_layer):
        tables = [LAYER_TENSORS] + ([KV_TENSORS] if i < n_layer - shared else []) + \
                 ([PLE_TENSORS] if "model.per_layer_model_projection.weight" in hf else [])
        for table in tables:
            for hf_name, name in table.items():
                source = f"model.layers.{i}.{hf_name}" + ("" if hf_name == "layer_scalar" else ".weight")
                if source in hf:  # v_proj is absent from full layers that reuse keys as values
                    expected[f"blk.{i}.{name}.weight"] = source
    return expected


def test_e2b_layout_reads_back_tensor_by_tensor(e2b_dir, tmp_path):
    target = write_gguf(e2b_dir, tmp_path / "g4-f16.gguf", "f16", META)
    reader, fields, tensors = _read(target)
    hf = _hf(e2b_dir)
    assert fields["general.architecture"] == "gemma4" and fields["general.file_type"] == 1
    expected = _expected(hf, 5, shared=2)
    assert set(tensors) == set(expected) | {"rope_freqs.weight"}
    assert "blk.3.attn_k.weight" not in tensors and "blk.2.attn_k.weight" in tensors  # layers 3, 4 reuse 1's and 2's KV
    for name, source in expected.items():
        assert tensors[name].shape == hf[source].shape, name  # numpy order: GGUF's ggml shape reversed
        # f16 weights to f16 precision; norms, scalars and everything 1-D as they are: Gemma 4's norm is x * w, no +1
        assert np.allclose(tensors[name].astype(np.float32), hf[source], atol=2e-3 * max(1.0, np.abs(hf[source]).max())), name
    assert tensors["per_layer_token_embd.weight"].shape == (556, 5 * 8)  # [vocab, layers x per-layer size]
    assert tensors["blk.3.ffn_up.weight"].shape == (192, 48) and tensors["blk.0.ffn_up.weight"].shape == (96, 48)
    # proportional RoPE on full layers: a quarter of the 16 frequency pairs of a 32-wide head turn
    assert tensors["rope_freqs.weight"].tolist() == [1.0] * 4 + [pytest.approx(1e30)] * 12


def test_e2b_hyperparameters_are_what_llama_cpp_reads(e2b_dir, tmp_path):
    _, fields, _ = _read(write_gguf(e2b_dir, tmp_path / "g4-f16.gguf", "f16", META))
    g = {k.removeprefix("gemma4."): v for k, v in fields.items() if k.startswith("gemma4.")}
    assert g["block_count"] == 5 and g["embedding_length"] == 48 and g["attention.head_count"] == 4
    assert g["attention.head_count_kv"] == 1 and g["feed_forward_length"] == [96, 96, 96, 192, 192]
    assert (g["attention.key_length"], g["attention.key_length_swa"]) == (32, 16)
    assert (g["attention.value_length"], g["attention.value_length_swa"]) == (32, 16)
    assert (g["rope.dimension_count"], g["rope.dimension_count_swa"]) == (32, 16)
    assert (g["rope.freq_base"], g["rope.freq_base_swa"]) == (1_000_000.0, 10_000.0)
    assert g["attention.sliding_window"] == 8 and g["attention.sliding_window_pattern"] == [True, True, False, True, False]
    assert g["attention.shared_kv_layers"] == 2 and g["embedding_length_per_layer_input"] == 8
    assert g["final_logit_softcapping"] == 30.0 and g["vocab_size"] == 556
    assert read_emotune_keys(tmp_path / "g4-f16.gguf") == {k: v for k, v in META.items() if k != "name"}


def test_tokenizer_is_llama_cpps_gemma4_model(e2b_dir, tmp_path):
    from transformers import AutoTokenizer

    reader, fields, _ = _read(write_gguf(e2b_dir, tmp_path / "g4-f16.gguf", "f16", META))
    tokenizer = AutoTokenizer.from_pretrained(e2b_dir)
    model = json.loads((e2b_dir / "tokenizer.json").read_text())["model"]
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert tokens == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    assert reader.fields["tokenizer.ggml.merges"].contents() == [" ".join(m) for m in model["merges"]]
    by_text = dict(zip(tokens, types, strict=True))
    assert by_text["<0x41>"] == TokenType.BYTE and by_text["<bos>"] == TokenType.CONTROL
    assert by_text["<|channel>"] == TokenType.USER_DEFINED and by_text["<turn|>"] == TokenType.CONTROL
    assert fields["tokenizer.ggml.bos_token_id"] == 2 and fields["tokenizer.ggml.eot_token_id"] == tokens.index("<turn|>")
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert reader.fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert "<|turn>" in reader.fields["tokenizer.chat_template"].contents()


def test_dense_layout_keys_as_values_and_own_kv_heads(dense_dir, tmp_path):
    _, fields, tensors = _read(write_gguf(dense_dir, tmp_path / "dense-f16.gguf", "f16", META))
    hf = _hf(dense_dir)
    expected = _expected(hf, 4, shared=0)
    assert set(tensors) == set(expected) | {"rope_freqs.weight"}
    assert "blk.1.attn_v.weight" not in tensors and "blk.0.attn_v.weight" in tensors  # full layers reuse K as V
    assert tensors["blk.1.attn_k.weight"].shape == (32, 48) and tensors["blk.0.attn_k.weight"].shape == (32, 48)
    assert fields["gemma4.attention.head_count_kv"] == [2, 1, 2, 1]
    assert fields["gemma4.embedding_length_per_layer_input"] == 0 and "output.weight" in tensors  # untied head


def test_multimodal_checkpoint_exports_its_text_model(e2b_dir, tmp_path):
    folder = tiny_gemma4(tmp_path / "mm", "e2b", multimodal=True)
    _, fields, tensors = _read(write_gguf(folder, tmp_path / "mm-f16.gguf", "f16", META))
    _, _, text_only = _read(write_gguf(e2b_dir, tmp_path / "text-f16.gguf", "f16", META))
    assert fields["general.architecture"] == "gemma4" and set(tensors) == set(text_only)
    hf = _hf(folder)
    assert np.allclose(tensors["blk.4.inp_gate.weight"], hf["model.layers.4.per_layer_input_gate.weight"], atol=1e-3)


def test_q8_0_quantizes_matrices_and_keeps_norms(e2b_dir, tmp_path):
    types = {t.name: t.tensor_type.name for t in GGUFReader(write_gguf(e2b_dir, tmp_path / "q8.gguf", "q8_0", META)).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_output.weight"] == "Q8_0"  # rows of 96, 64
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.layer_output_scale.weight"] == "F32"
    assert types["blk.0.ffn_up.weight"] == "F16"  # rows of 48 are not whole blocks of 32


def _refused(tmp_path, **changes):
    """write_gguf on a folder holding only a changed E2B config: refused before any weight or tokenizer is read."""
    from transformers import Gemma4TextConfig

    from gguf_models import _gemma4_text

    class Ids:
        pad_token_id, bos_token_id, eos_token_id = 0, 2, 1

    folder = tmp_path / "config-only"
    Gemma4TextConfig(**{**_gemma4_text(300, Ids, "e2b"), **changes}).save_pretrained(folder)
    with pytest.raises(UserError) as err:
        write_gguf(folder, tmp_path / "x.gguf", "f16", META)
    return str(err.value)


def test_layouts_llama_cpp_computes_differently_are_refused(tmp_path):
    # transformers reads shared KV from the last earlier layer of each type; llama.cpp from the two layers just before
    # the shared block: tests/families.py's 6-layer E4B scaling (s s f s | s f shared) puts a sliding layer last
    message = _refused(tmp_path, num_hidden_layers=6, num_kv_shared_layers=2, use_double_wide_mlp=False,
                       layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    assert "KV-sharing" in message and "layer 2 for sliding" in message
    assert "mixture-of-experts" in _refused(tmp_path, enable_moe_block=True, num_experts=4, top_k_experts=2,
                                            moe_intermediate_size=16)
    assert "vocab_size_per_layer_input" in _refused(tmp_path, vocab_size_per_layer_input=200)
    assert "scaling factor 8" in _refused(tmp_path, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": 8.0}})
    assert "hidden_activation=silu" in _refused(tmp_path, hidden_activation="silu")


def test_lora_adapter_gguf_of_decoder_layers(e2b_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    run = write_tiny_adapter(e2b_dir, tmp_path / "run", r=4, layers=[0, 3])
    target = write_lora_gguf(run / "adapter", AutoConfig.from_pretrained(e2b_dir), tmp_path / "lora.gguf", "tiny")
    reader = GGUFReader(target)
    assert reader.fields["general.architecture"].contents() == "gemma4"
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    # layer 0 has its own K/V; layer 3 reuses layer 1's, so it has no k/v projections to adapt
    assert {n.rsplit(".", 2)[0] for n in tensors} == {
        *(f"blk.0.{m}" for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj")),
        *(f"blk.3.{m}" for m in ("attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "inp_gate", "proj"))}
    a, b = tensors["blk.3.ffn_up.weight.lora_a"], tensors["blk.3.ffn_up.weight.lora_b"]
    assert a.shape == (4, 48) and b.shape == (192, 4)  # the double-wide MLP of a shared layer
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(e2b_dir), run / "adapter")
    delta = peft.base_model.model.model.layers[3].mlp.up_proj.get_delta_weight("default").detach().numpy()
    assert np.allclose(b @ a * (8.0 / 4), delta, atol=1e-5)


def test_adapter_on_the_per_layer_projection_is_refused(e2b_dir, tmp_path):
    from transformers import AutoConfig

    run = write_tiny_adapter(e2b_dir, tmp_path / "run", r=4)  # all-linear: includes model.per_layer_model_projection
    with pytest.raises(UserError, match="per_layer_model_projection"):
        write_lora_gguf(run / "adapter", AutoConfig.from_pretrained(e2b_dir), tmp_path / "lora.gguf", "tiny")


def test_gemma4_gguf_as_model_source_is_refused_clearly(e2b_dir, tmp_path):
    """transformers' GGUF reader (5.x) rebuilds a Gemma 4 config from key_length alone: it fails on the per-layer
    arrays and would otherwise take the defaults for the sliding head size, layer pattern and per-layer inputs."""
    from emotune.core.config.load import load_config
    from emotune.model.loading import load_tokenizer_only, resolve_model_dir

    target = write_gguf(e2b_dir, tmp_path / "g4-f16.gguf", "f16", META)
    cfg = load_config(None, [f"model.source={target}", f"model.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(UserError, match="merged"):
        resolve_model_dir(cfg.model)
    with pytest.raises(UserError, match="merged"):
        load_tokenizer_only(cfg.model)


def test_export_command_writes_gemma4_gguf_and_modelfile(e2b_dir, tmp_path, capsys):
    from emotune.cli import main

    run = write_tiny_adapter(e2b_dir, tmp_path / "run", r=4)
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "ollama", "--quant", "f16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    _, fields, tensors = _read(out / "gguf" / "run-f16.gguf")
    assert fields["general.architecture"] == "gemma4" and "per_layer_token_embd.weight" in tensors
    # the merged model differs from the base by the adapter: the export folded it in
    assert not np.allclose(tensors["blk.0.attn_q.weight"].astype(np.float32), _hf(e2b_dir)["model.layers.0.self_attn.q_proj.weight"],
                           atol=1e-3)
    assert "No LoRA adapter GGUF" in printed and "per_layer_model_projection" in printed  # all-linear reaches it
    modelfile = (out / "ollama" / "Modelfile").read_text()
    assert "<|turn>model" in modelfile and 'PARAMETER stop "<turn|>"' in modelfile
