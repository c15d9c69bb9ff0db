"""Tiny tokenizers that carry each model family's chat template and turn tokens, built locally (no hub).

The templates keep the released ones' turn framing exactly (what comes before and after each message, the
generation prompt, system handling); tool calling and multimodal branches are left out. Sources:
  gemma3   google/gemma-3-1b-it tokenizer_config.json (emotune's GEMMA_CHAT_TEMPLATE is the same framing)
  gemma4   google/gemma-4-E4B-it chat_template.jinja: `<|turn>role\\n ... <turn|>\\n`, and with thinking off the
           generation prompt also opens and closes an empty thought channel
  qwen2.5  Qwen/Qwen2.5-0.5B-Instruct tokenizer_config.json (default system prompt included)
  qwen3    Qwen/Qwen3-0.6B tokenizer_config.json (the last answer carries an empty <think> block)
  llama3   meta-llama/Llama-3.2-1B-Instruct tokenizer_config.json, generation_config.json (eos 128001/128008/128009)
  mistral  mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json (an answer ends with the EOS token)
  phi3     microsoft/Phi-3-mini-4k-instruct tokenizer_config.json (`<|end|>`; EOS `<|endoftext|>`)
  phi4     microsoft/phi-4 tokenizer_config.json (`<|im_start|>role<|im_sep|> ... <|im_end|>`)
  gemma2   google/gemma-2-2b-it tokenizer_config.json (also gemma-7b-it's): refuses a system message outright
  mixtral  mistralai/Mixtral-8x7B-Instruct-v0.1 tokenizer_config.json (also Mistral-7B-Instruct-v0.1/v0.2's shape):
           roles must alternate from a user message, so a system message is refused too
Templates without a system role are used as emotune loads them: wrapped by emotune.model.system_role.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GEMMA4 = (
    "{{- bos_token -}}"
    "{%- set loop_messages = messages -%}"
    "{%- if (enable_thinking is defined and enable_thinking) or messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|turn>system\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- messages[0]['content'] | trim -}}{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}"
    "{%- if role == 'model' -%}{{- message['content'].split('<channel|>')[-1] | trim -}}"
    "{%- else -%}{{- message['content'] | trim -}}{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|turn>model\\n' -}}"
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    "{%- endif -%}"
)
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.last or reasoning_content %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' "
    "+ content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
PHI4 = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
MIXTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ChatFamily:
    """One family's tokenizer as its released checkpoint configures it: special tokens, template, turn end."""

    name: str
    template: str | None
    specials: list[str]  # in id order, before the words
    bos: str | None
    eos: str
    pad: str
    turn_token: str | None  # what closes an assistant turn
    generation_eos: list[str] = field(default_factory=list)  # generation_config.json's eos ids, by token


def _gemma3_template() -> str:
    from emotune.model.loading import GEMMA_CHAT_TEMPLATE

    return GEMMA_CHAT_TEMPLATE


FAMILIES = [
    ChatFamily("gemma3", None, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
               "<pad>", "<end_of_turn>", ["<eos>", "<end_of_turn>"]),
    ChatFamily("gemma4", GEMMA4, ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
                                  "<|think|>"], "<bos>", "<eos>", "<pad>", "<turn|>", ["<eos>", "<turn|>"]),
    ChatFamily("qwen2.5", QWEN25, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"], None, "<|im_end|>",
               "<|endoftext|>", "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    ChatFamily("qwen3", QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"], None,
               "<|im_end|>", "<|endoftext|>", "<|im_end|>", ["<|im_end|>", "<|endoftext|>"]),
    ChatFamily("llama3", LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                  "<|eom_id|>", "<|eot_id|>", "<unk>"], "<|begin_of_text|>", "<|eot_id|>",
               "<|end_of_text|>", "<|eot_id|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    ChatFamily("mistral", MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>", "</s>", ["</s>"]),
    ChatFamily("phi3", PHI3, ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
               "<s>", "<|endoftext|>", "<|endoftext|>", "<|end|>", ["<|endoftext|>", "<|assistant|>", "<|end|>"]),
    ChatFamily("phi4", PHI4, ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>", "<unk>"], None, "<|im_end|>",
               "<|endoftext|>", "<|im_end|>", ["<|im_end|>"]),
    ChatFamily("gemma2", GEMMA2, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
               "<pad>", "<end_of_turn>", ["<eos>", "<end_of_turn>"]),
    ChatFamily("mixtral", MIXTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>", "</s>", ["</s>"]),
]
WORDS = ["joy", "sadness", "anger", "ful", "hi", "i", "am", "happy", "feel", "label", "one", "of", "the", "text", "system",
         "user", "assistant", "model", ":", ".", ",", "\n", "\n\n"]


def build_family_tokenizer(family: ChatFamily):
    """A word-level tokenizer with `family`'s special tokens (never split), template and EOS/BOS/PAD, as emotune's
    load_tokenizer leaves it (a template without a system role wrapped)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from emotune.model.system_role import fold_system_role

    vocab = {token: i for i, token in enumerate(family.specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    named = {family.bos, family.eos, family.pad, "<unk>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos, pad_token=family.pad,
                                   unk_token="<unk>", additional_special_tokens=[t for t in family.specials if t not in named])
    fast.chat_template = family.template if family.template is not None else _gemma3_template()
    fold_system_role(fast)
    return fast
