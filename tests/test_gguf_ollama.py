"""Ollama Modelfiles: each family's Go template renders the same prompt as the model's chat template (BOS aside,
llama.cpp adds it), rendered by emotune.deploy.gotemplate; the Modelfile's fields."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chat_families import GEMMA4
from emotune.core.errors import UserError
from emotune.deploy.gotemplate import render
from emotune.deploy.ollama import TEMPLATES, modelfile_text
from emotune.model.loading import GEMMA_CHAT_TEMPLATE
from gguf_models import CHATML_TEMPLATE, LLAMA3_TEMPLATE

CONVERSATIONS = [
    [{"role": "system", "content": "You classify emotions: joy, anger."}, {"role": "user", "content": "Text: i am happy"}],
    [{"role": "user", "content": "Text: i am happy"}],  # CHATML's template adds its default system turn: not compared
    [{"role": "system", "content": "S"}, {"role": "user", "content": "one"}, {"role": "assistant", "content": "joy"},
     {"role": "user", "content": "two"}],
]
FAMILIES = {"gemma3_text": (GEMMA_CHAT_TEMPLATE, "<bos>"), "gemma4_text": (GEMMA4, "<bos>"),
            "llama": (LLAMA3_TEMPLATE, "<|begin_of_text|>"),
            "qwen2": (CHATML_TEMPLATE, "")}


def _jinja(template: str, messages: list[dict], bos: str) -> str:
    def raise_exception(message):
        raise ValueError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    text = environment.from_string(template).render(messages=messages, bos_token=bos, add_generation_prompt=True)
    return text.removeprefix(bos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_go_template_renders_what_the_chat_template_renders(family, conversation):
    messages = CONVERSATIONS[conversation]
    if family == "qwen2" and messages[0]["role"] != "system":
        pytest.skip("Qwen2's template inserts its own default system turn; emotune always sends one")
    jinja_template, bos = FAMILIES[family]
    go = render(TEMPLATES[family][0], {"Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]})
    assert go == _jinja(jinja_template, messages, bos)


def test_renderer_follows_go_semantics():
    assert render("a {{- if .X }} yes {{- else }} no {{- end }} b", {"X": ""}) == "a no b"
    assert render("{{ $v := 1 }}{{ range .L }}{{ $v = . }}{{ end }}{{ $v }}", {"L": [2, 3]}) == "3"
    assert render('{{ if and (eq .A "x") (not .B) }}ok{{ end }}', {"A": "x", "B": False}) == "ok"
    with pytest.raises(ValueError, match="unsupported"):
        render("{{ printf \"%s\" .A }}", {"A": "x"})


def test_modelfile_fields():
    text = modelfile_text("gemma3_text", "run-q8_0.gguf", "Reply with one of: joy, anger.", 4, greedy=True)
    lines = text.splitlines()
    assert lines[0] == "FROM ./run-q8_0.gguf"
    assert 'SYSTEM """Reply with one of: joy, anger."""' in lines
    assert 'PARAMETER stop "<end_of_turn>"' in lines
    assert "PARAMETER temperature 0" in lines and "PARAMETER num_predict 4" in lines
    assert text.count('TEMPLATE """') == 1 and "<start_of_turn>model" in text
    sft = modelfile_text("qwen2", "m.gguf", None, 256, greedy=False)
    assert "SYSTEM" not in sft and "temperature" not in sft and 'PARAMETER stop "<|im_end|>"' in sft
    with pytest.raises(UserError, match="ends a Modelfile string"):
        modelfile_text("llama", "m.gguf", 'say """', 4, greedy=True)
