"""Chat templates without a system role: the system text goes before the first user message.

Gemma 2's template (google/gemma-2-2b-it, gemma-2-9b-it) raises `System role not supported`, and Mistral
7B Instruct v0.1/v0.2's raises `Conversation roles must alternate` on a system message; every classify prompt has
one (`prompt.system_prompt`), as have sft rows with a system field. Such a template is wrapped so that a system
message opens the first user message, separated by a blank line, which is what Gemma 3's own template does with
it (and what the common workaround for Gemma 2 does). The wrapped template is the one training renders, so it is
also the one saved beside the adapter and exported: serving and vLLM read the prompts the model was trained on.
A template that renders a system message, or that cannot render a plain user message either, is left as it is.
"""

from __future__ import annotations

from jinja2.exceptions import TemplateError

FOLD_MARK = "{#- emotune: no system role in this template; a system message opens the first user message -#}"
FOLD = FOLD_MARK + (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages | length > 1 and messages[1]['role'] == 'user' -%}"
    "{%- set messages = [{'role': 'user', 'content': messages[0]['content'] ~ '\\n\\n' ~ messages[1]['content']}]"
    " + messages[2:] -%}"
    "{%- else -%}"
    "{%- set messages = [{'role': 'user', 'content': messages[0]['content']}] + messages[1:] -%}"
    "{%- endif -%}"
    "{%- endif -%}"
)
PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def fold_system_role(tokenizer) -> bool:
    """Wrap `tokenizer.chat_template` when it refuses a system message but renders a user message; True if it did."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or template.startswith(FOLD_MARK) or _renders(tokenizer, PROBE):
        return False
    if not _renders(tokenizer, PROBE[1:]):
        return False  # it cannot render a plain exchange either: its own error says more than a wrapper would
    tokenizer.chat_template = FOLD + template
    if _renders(tokenizer, PROBE):
        return True
    tokenizer.chat_template = template
    return False


def _renders(tokenizer, messages: list[dict]) -> bool:
    try:
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        return False
    return True
