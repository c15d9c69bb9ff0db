"""The merged export of a multimodal base (Gemma 4's Gemma4ForConditionalGeneration, the class `AutoModelForCausalLM`
loads for google/gemma-4-E4B-it) is a folder that loads elsewhere: processor, tokenizer, chat template and generation
config beside the weights, through AutoProcessor / AutoModelForImageTextToText and AutoModelForCausalLM.

The tiny base keeps the released checkpoint's structure, scaled from google/gemma-4-E4B-it's config.json:
text soft-cap 30, sliding and full layers with different head dims (256/512 there, 16/32 here), per-layer inputs,
KV-shared layers (18 of 42 there, 1 of 4 here), tied embeddings, a vision tower and an audio tower (transformers'
Gemma4VisionConfig/Gemma4AudioConfig shrunk); its processor is E4B's image processor (patch 16, pooling 3, 280 soft
tokens) and audio feature extractor, with the tokenizer's image/audio tokens, built locally. It keeps its own
builder beside tests/gemma_families.py's (which has no processor) because the export copies the processor's files."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from chat_families import GEMMA4
from conftest import write_tiny_adapter
from emotune.deploy.export import export, merge_parity_gap
from emotune.model.turns import turn_end

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>",
            "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
WORDS = ["i", "feel", "so", "happy", "sad", "angry", "today", "joy", "sadness", "love", "anger", "fear", "surprise",
         "classify", "the", "emotion", "of", "text", "reply", "with", "one", "word", ":", ".", ",", "\n", "\n\n"]
TEXTS = ["i feel so happy today", "so sad today", "angry angry"]
# E4B's processor_config.json, as the GPU check writes it (loaded by path: bench/ is not a package)
write_processor_config = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "gpu_check_multimodal.py"))[
    "write_processor_config"]


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    named = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens=named)
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIALS[4:] if t not in named.values()]})
    fast.chat_template = GEMMA4
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def gemma4_multimodal_dir(tmp_path_factory) -> Path:
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

    folder = tmp_path_factory.mktemp("tiny-gemma4-mm")
    tokenizer = _tokenizer(folder)
    write_processor_config(folder)  # transformers 5's one-file layout
    text = Gemma4TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, num_kv_shared_layers=1, sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=len(tokenizer), hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
        max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                              output_proj_dims=16)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image|>"), ("boi_token_id", "<|image>"), ("eoi_token_id", "<image|>"),
        ("audio_token_id", "<|audio|>"), ("boa_token_id", "<|audio>"), ("eoa_token_index", "<audio|>"),
        ("video_token_id", "<|video|>"))}
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict(), **ids)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    with torch.no_grad():  # hidden states as large as real checkpoints': the soft-cap then really bends the logits
        model.get_input_embeddings().weight.mul_(50.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def merged_export(gemma4_multimodal_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A classify adapter on the language model's layers (as training attaches it), exported merged in fp32."""
    root = tmp_path_factory.mktemp("mm-run")
    run = write_tiny_adapter(gemma4_multimodal_dir, root / "runs" / "mm", r=4, layers=[0, 1, 2, 3])
    out = export(run, out=root / "export", merge=True, dtype="float32")
    return run, out / "merged"


def test_the_merged_folder_carries_processor_tokenizer_template_and_generation_config(merged_export, gemma4_multimodal_dir):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    _, merged = merged_export
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "config.json", "model.safetensors"):
        assert (merged / name).is_file(), name
    assert json.loads((merged / "processor_config.json").read_text()) == json.loads(
        (gemma4_multimodal_dir / "processor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert tokenizer.chat_template == GEMMA4 and tokenizer.image_token == "<|image|>"
    generation = json.loads((merged / "generation_config.json").read_text())
    assert turn_end(tokenizer).token == "<turn|>"
    assert tokenizer.convert_tokens_to_ids("<turn|>") in generation["eos_token_id"]  # a chat turn's end stops generation
    image = AutoImageProcessor.from_pretrained(merged)
    assert type(image).__name__.startswith("Gemma4ImageProcessor") and image.max_soft_tokens == 280
    assert type(AutoFeatureExtractor.from_pretrained(merged)).__name__ == "Gemma4AudioFeatureExtractor"


def test_the_merged_folder_loads_as_image_text_to_text_and_causal_lm_with_the_adapter_s_logits(merged_export):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    run, merged = merged_export
    image_text = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32)
    causal = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert type(image_text).__name__ == type(causal).__name__ == "Gemma4ForConditionalGeneration"
    assert causal.config.get_text_config().final_logit_softcapping == 30.0
    # base + adapter (fp32, unmerged) against the saved merged folder on the model's own chat prompts
    assert merge_parity_gap(run, TEXTS, merged_dir=merged) < 1e-4
    base = AutoModelForCausalLM.from_pretrained(json.loads((run / "adapter" / "emotune.json").read_text())["base_model"],
                                                dtype=torch.float32)
    ids = torch.tensor([[2, 4, 20, 21, 22, 5]])
    assert (causal(ids).logits - base(ids).logits).abs().max() > 1e-3  # the adapter is in the merged weights


def test_the_merged_folder_loads_with_auto_processor_and_reads_an_image(merged_export):
    pytest.importorskip("torchvision", reason="Gemma4Processor's video processor needs torchvision, which does not "
                                              "load beside the CPU build of torch; the GPU check runs this")
    from PIL import Image
    from transformers import AutoProcessor

    _, merged = merged_export
    processor = AutoProcessor.from_pretrained(merged)
    assert type(processor).__name__ == "Gemma4Processor"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "classify the emotion"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=Image.new("RGB", (64, 48)), return_tensors="pt")
    assert (inputs["input_ids"] == processor.tokenizer.image_token_id).sum() > 0


@pytest.mark.slow  # two evaluations of the tiny multimodal model, both methods, about 20 s
def test_emotune_eval_measures_the_multimodal_merged_folder_like_its_adapter(merged_export, gemma4_multimodal_dir,
                                                                             tiny_overrides, capsys):
    from emotune.cli import main
    from test_merged_folder_eval import _results, _same

    run, merged = merged_export
    overrides = [*tiny_overrides, f"model.source={gemma4_multimodal_dir}", "eval.method=both", "eval.max_new_tokens=2"]
    assert main(["eval", *overrides, f"adapter={run}", "eval.merge_adapters=never"]) == 0
    assert main(["eval", *overrides, f"adapter={merged}"]) == 0
    assert f"Evaluating merged model {merged}" in capsys.readouterr().out
    from_merged = _results(merged.parent / "eval" / "test-merged")
    assert from_merged and "score/predictions.csv" in from_merged
    _same(from_merged, _results(run / "eval" / "test-finetuned"))
