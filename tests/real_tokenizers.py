"""Trained subword tokenizers with the properties of released families, built here from a few hundred words (no hub).

tests/conftest.py's tokenizer is word-level: every word one token, so it cannot show what subword tokenizers do at the
boundaries emotune cuts (the generation prompt / label / end-of-turn). These are trained with the `tokenizers`
library on a small corpus and wrapped in `PreTrainedTokenizerFast` with each family's released settings:
  llama2    meta-llama/Llama-2-7b-chat-hf tokenizer.json / tokenizer_config.json: SentencePiece BPE (Metaspace `▁`,
            prepend_scheme "first"), byte fallback (`<0x..>`), <unk>/<s>/</s> at ids 0-2, add_bos_token true, no pad
            token, `[INST] ... [/INST]` template whose answer is ` content </s>` (the template adds the space)
  qwen2.5   Qwen/Qwen2.5-0.5B-Instruct tokenizer.json: byte-level BPE (GPT-2's pre-tokenizer, no prefix space), no BOS,
            <|endoftext|> pads, <|im_end|> ends the turn (ChatML)
  gpt2      openai-community/gpt2: byte-level BPE, <|endoftext|> is BOS, EOS and UNK, no pad token, no chat template
  t5-uni    a Unigram SentencePiece model (Metaspace, prepend_scheme "always") with byte fallback, Gemma's turn tokens
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import CUES, FILLER, LABELS

LLAMA2_TEMPLATE = (  # meta-llama/Llama-2-7b-chat-hf tokenizer_config.json, as released
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
CHATML = (  # Qwen/Qwen2.5-0.5B-Instruct's framing, without its default system prompt
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

EXTRA_LABELS = ["pos", "positive", "neg", "negative", "neutral", "喜悦", "愤怒", "😱", "🙂"]
PROMPT_WORDS = ("You are an emotion classification assistant. Read the text and reply with exactly one word: the "
                "emotion it expresses. Labels: Classify the emotion of this text. Text: Answer: assistant user system "
                "model INST SYS")


def corpus() -> list[str]:
    words = FILLER + LABELS + [w for cues in CUES.values() for w in cues] + ["pos", "positive", "neg", "negative"]
    lines = [PROMPT_WORDS] * 20
    lines += [" ".join(words[i:i + 7]) for i in range(0, len(words), 3)] * 10
    lines += [f"{a} {b}, {c}." for a, b, c in zip(words, words[1:], words[2:], strict=False)] * 5
    return lines


def _save(tokenizer, fast, folder: Path, config: dict | None = None):
    fast.save_pretrained(folder)
    if config:
        path = folder / "tokenizer_config.json"
        saved = json.loads(path.read_text())
        saved.update(config)
        path.write_text(json.dumps(saved, indent=2))
    return folder


def sentencepiece_bpe(folder: Path, prepend_scheme: str = "first", template: str | None = LLAMA2_TEMPLATE,
                      add_bos: bool = True, add_eos: bool = False) -> Path:
    """Llama 2's tokenizer shape (see the module docstring); `add_eos` as Llama 2 users set it for training."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme, split=False)
    tok.normalizer = normalizers.Sequence([])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=["▁"],
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    saved = json.loads(tok.to_str())  # the byte tokens in the model's vocabulary, as Llama 2's (not added tokens)
    vocab = saved["model"]["vocab"]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    tok = Tokenizer.from_str(json.dumps(saved))
    single = ("<s>:0 " if add_bos else "") + "$A:0" + (" </s>:0" if add_eos else "")
    pair = single + " " + ("<s>:1 " if add_bos else "") + "$B:1" + (" </s>:1" if add_eos else "")
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    return _save(tok, fast, folder, {"add_bos_token": add_bos, "add_eos_token": add_eos, "legacy": False})


def byte_level_bpe(folder: Path, template: str | None = CHATML, eos: str = "<|im_end|>", pad: str | None = "<|endoftext|>",
                   bos: str | None = None, config: dict | None = None, normalizer=None) -> Path:
    """Qwen 2.5's tokenizer shape (GPT-2's byte-level BPE); `template=None, eos=pad=bos='<|endoftext|>'` is GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if normalizer is not None:  # NFKC: as many released tokenizers' normalizers (google/mt5's, xlm-roberta's) fold
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                                   additional_special_tokens=[t for t in specials if t not in (eos, pad, bos)])
    fast.chat_template = template
    return _save(tok, fast, folder, config)


def tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama over the folder's tokenizer (ids as the tokenizer numbers them)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
