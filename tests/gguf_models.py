"""Tiny random models with tokenizers llama.cpp can read, for the GGUF tests (scaled-down released configs)."""

from __future__ import annotations

from pathlib import Path

from conftest import CUES, FILLER, LABELS

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
# Meta-Llama-3-8B-Instruct's released chat template (tokenizer_config.json)
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2-0.5B-Instruct's released chat template
CHATML_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                   "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                   "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def byte_level_tokenizer(folder: Path, specials: list[str], bos: str | None, eos: str, template: str):
    """A byte-level BPE (Llama 3 / Qwen style: Llama 3's split pattern) trained on the fixture words."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    words = FILLER + LABELS + [w for cues in CUES.values() for w in cues]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] + ["You are an emotion classifier. Text:"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def tiny_llama(folder: Path, model_type: str = "llama", **changes):
    """Scaled from meta-llama/Llama-3.2-1B-Instruct's config.json (GQA 32/8 heads -> 4/2, head_dim 64 -> 16, tied
    embeddings), with default RoPE (transformers' GGUF reader knows no rope_freqs). `qwen2`: Qwen2.5-0.5B-Instruct's
    shape (q/k/v biases, tied). `mistral`: Mistral-7B-v0.1's (untied). `changes`: config values to set beside
    (head_dim=32: Mistral Nemo's heads wider than hidden / heads; attention_bias=True)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    if model_type == "qwen2":  # transformers' Qwen2 tokenizer adds <|endoftext|> if it is missing
        tokenizer = byte_level_tokenizer(folder, QWEN_SPECIALS, None, "<|im_end|>", CHATML_TEMPLATE)
    else:
        tokenizer = byte_level_tokenizer(folder, LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM, dict(head_dim=16, tie_word_embeddings=True)),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
               "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=16, tie_word_embeddings=False))}
    config_class, model_class, extra = classes[model_type]
    torch.manual_seed(0)
    model = model_class(config_class(**shape, **{**extra, **changes}))
    with torch.no_grad():  # random norms and biases, so a layout mistake in them changes the output
        for name, weight in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                weight.copy_(torch.randn_like(weight) * 0.5 + (1.0 if "norm" in name else 0.0))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(10)  # peaked attention: at init scale it is nearly uniform and a q/k layout error hides
    model.save_pretrained(folder)
    return folder


def tiny_gemma3(folder: Path):
    """Scaled from google/gemma-3-270m's config.json (640 -> 32 hidden, 4/1 heads -> 2/1, 18 -> 2 layers), keeping
    head_dim 256 and query_pre_attn_scalar 256: llama.cpp scales queries by 1/sqrt(head_dim), transformers by
    query_pre_attn_scalar, and transformers' GGUF reader takes its default (256)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(folder, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                                     "<bos>", "<eos>", _gemma_template())
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              max_position_embeddings=512, sliding_window=64, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.copy_(torch.randn_like(weight) * 0.3)
    model.save_pretrained(folder)
    return folder


def _gemma_template() -> str:
    from emotune.model.loading import GEMMA_CHAT_TEMPLATE

    return GEMMA_CHAT_TEMPLATE


def tiny_gemma3_multimodal(folder: Path):
    """google/gemma-3-4b-it's layout (Gemma3ForConditionalGeneration: SigLIP tower, projector, language model) at
    the text size of tiny_gemma3 and a 1-layer 16-wide vision tower."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(folder, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                                     "<bos>", "<eos>", _gemma_template())
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                            max_position_embeddings=512, sliding_window=64)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=len(tokenizer) - 1)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "language_model" in name and "norm" in name:
                weight.copy_(torch.randn_like(weight) * 0.3)
    model.save_pretrained(folder)
    return folder


GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]


def gemma4_tokenizer(folder: Path):
    """A byte-fallback BPE shaped like google/gemma-4-E4B-it's tokenizer.json (GemmaTokenizer: spaces normalized to
    `▁`, <0x00>..<0xFF> byte pieces, merges), trained on the fixture words, with Gemma 4's chat template."""
    import json

    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    from chat_families import GEMMA4

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    words = FILLER + LABELS + [w for cues in CUES.values() for w in cues]
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] + ["You are an emotion classifier. Text:"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=GEMMA4_SPECIALS))
    model = json.loads(tok.to_str())["model"]
    pieces = [p for p, _ in sorted(model["vocab"].items(), key=lambda item: item[1]) if p not in GEMMA4_SPECIALS]
    order = GEMMA4_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokenizer = GemmaTokenizer(vocab={p: i for i, p in enumerate(order)}, merges=[tuple(m.split(" ")) for m in merges],
                               additional_special_tokens=GEMMA4_SPECIALS[5:])
    tokenizer.chat_template = GEMMA4
    tokenizer.save_pretrained(folder)
    return tokenizer


def _gemma4_text(vocab: int, tokenizer, layout: str) -> dict:
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if layout == "e2b":
        # google/gemma-4-E2B-it text_config: hidden 1,536, 35 layers (4 sliding : 1 full), the last 20 sharing the KV of
        # the sliding and full layer before them, 8 heads / 1 KV head, head dim 256 sliding / 512 full, per-layer inputs
        # 256, double-wide MLP in the shared layers, proportional RoPE (0.25) on full layers, soft-cap 30, tied.
        # Scaled: hidden 48, 5 layers (s s f | s f shared), 4 heads, head dim 16 / 32, per-layer 8, window 8.
        return dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=48, intermediate_size=96,
                    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                    hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=8,
                    max_position_embeddings=512, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                 "full_attention"], **ids)
    # the switches transformers' Gemma4TextConfig documents for the large dense layout: keys reused as values on full
    # layers (attention_k_eq_v) with their own KV head count, no per-layer embeddings, no shared KV layers, untied head
    return dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                hidden_size_per_layer_input=0, sliding_window=8, max_position_embeddings=512, final_logit_softcapping=30.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **ids)


def tiny_gemma4(folder: Path, layout: str = "e2b", multimodal: bool = False):
    """A random Gemma 4 text model (`Gemma4ForCausalLM`, or inside `Gemma4ForConditionalGeneration` with tiny vision
    and audio towers) with `gemma4_tokenizer`. Norms and layer scalars are random and the logits spread past the
    soft-cap, so a missing norm, scale or cap changes the output."""
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = gemma4_tokenizer(folder)
    text = _gemma4_text(len(tokenizer), tokenizer, layout)
    torch.manual_seed(0)
    if multimodal:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, position_embedding_size=64)
        audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                     output_proj_dims=32)
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=audio,
                                                            tie_word_embeddings=True, image_token_id=len(tokenizer) - 1))
    else:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "vision" in name or "audio" in name:
                continue
            if "norm" in name:
                weight.copy_(torch.randn_like(weight) * 0.3 + 1.0)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                weight.mul_(60)  # logits spread past the soft-cap of 30
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand_like(buffer) + 0.5)
    model.save_pretrained(folder)
    return folder
