"""llama.cpp itself (llama-cpp-python, the optional `[gguf]` extra) runs the exported files: the merged GGUF gives
the Hugging Face model's logits, and the adapter GGUF over the base GGUF gives the merged model's. Skipped where
llama-cpp-python is not installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import write_tiny_adapter
from emotune.deploy.gguf_lora import write_lora_gguf
from emotune.deploy.gguf_write import write_gguf
from gguf_models import tiny_gemma3, tiny_gemma4, tiny_llama

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")
IDS = [1, 40, 41, 42, 60, 61, 62, 80, 81, 100, 120, 7]


def _llama_cpp_logits(gguf_file, lora=None) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(gguf_file), lora_path=str(lora) if lora else None, n_ctx=64, logits_all=True,
                          verbose=False, n_threads=1)
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)])


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


BUILDERS = {"llama": tiny_llama, "gemma3": tiny_gemma3,
            # Mistral Nemo's layout (heads of 128 in a hidden size of 5,120 / 32 heads = 160) and a Llama with q/k/v biases
            "mistral-wide-heads": lambda f: tiny_llama(f, "mistral", head_dim=32),
            "llama-attention-bias": lambda f: tiny_llama(f, attention_bias=True), "gemma4-e2b": lambda f: tiny_gemma4(f, "e2b"),
            "gemma4-dense": lambda f: tiny_gemma4(f, "dense"), "gemma4-multimodal": lambda f: tiny_gemma4(f, "e2b", True)}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_llama_cpp_matches_transformers(family, tmp_path):
    """Every position's next-token logits, over 12 tokens (past Gemma's scaled sliding windows of 8 and, for the
    E2B layout, through the layers that reuse earlier layers' keys and values)."""
    from transformers import AutoModelForCausalLM

    folder = BUILDERS[family](tmp_path / "m")
    target = write_gguf(folder, tmp_path / "m-f16.gguf", "f16", {"name": "tiny"})
    reference = _hf_logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    gap = np.abs(_llama_cpp_logits(target) - reference).max()
    # f16 weights: within 1 % of the logits' spread (Gemma 4's tiny models: ~0.02 of ~8; the same model exported
    # with all RoPE frequencies turning on its full layers is off by 0.3)
    assert gap < min(5e-2, max(1e-2 * reference.std(), 2e-3)), f"{family}: largest logit gap {gap:.4f}, spread {reference.std():.2f}"


def test_llama_cpp_tokenizes_gemma4_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = tiny_gemma4(tmp_path / "m", "e2b")
    target = write_gguf(folder, tmp_path / "m-f16.gguf", "f16", {"name": "tiny"})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llm = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
    for text in ("i feel happy today, so happy", "Text: the anger\n\nlabel: joy", "<|turn>user\nhi é 😀<turn|>\n"):
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == tokenizer(text, add_special_tokens=False).input_ids, text
    assert llm.tokenize(b"hi", add_bos=True)[0] == tokenizer.bos_token_id


@pytest.mark.parametrize("family", ["llama", "gemma4-e2b"])
def test_adapter_gguf_over_base_equals_merged(family, tmp_path):
    from transformers import AutoConfig

    folder = BUILDERS[family](tmp_path / "base")
    # Gemma 4: decoder layers only (llama.cpp applies no adapter to the per-layer input projection); layer 3 reuses KV
    run = write_tiny_adapter(folder, tmp_path / "run", r=4, **({"layers": [0, 3]} if family.startswith("gemma4") else {}))
    from emotune.cli import main

    assert main(["export", str(run), "--format", "gguf", "--out", str(tmp_path / "export")]) == 0
    base = write_gguf(folder, tmp_path / "base-f16.gguf", "f16", {"name": "base"})
    lora = write_lora_gguf(run / "adapter", AutoConfig.from_pretrained(folder), tmp_path / "lora.gguf", "run")
    merged = _llama_cpp_logits(tmp_path / "export" / "gguf" / "run-f16.gguf")
    assert np.abs(_llama_cpp_logits(base, lora) - merged).max() < 5e-2
    assert np.abs(_llama_cpp_logits(base) - merged).max() > 5e-2  # the adapter matters
