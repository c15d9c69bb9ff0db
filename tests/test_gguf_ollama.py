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


def ollama_parse(text: str) -> list[tuple[str, str]]:
    """(command, value) pairs as Ollama reads a Modelfile: a port of ParseFile's state machine in ollama/ollama
    parser/parser.go (a value's `\"\"\"` string ends at the first line break after which it unquotes; a rune
    outside a state change is kept only where Go's strconv.IsPrint accepts it)."""
    import unicodedata

    def unquote(s: str) -> tuple[str, bool]:
        if s[:3] == '"""':
            return (s[3:-3], True) if len(s) >= 6 and s[-3:] == '"""' else ("", False)
        if s[:1] == '"':
            return (s[1:-1], True) if len(s) >= 2 and s[-1] == '"' else ("", False)
        return s, True

    def printable(ch: str) -> bool:
        return ch == " " or unicodedata.category(ch)[0] in "LMNPS"

    commands, state, buffer, name = [], "nil", "", ""
    for ch in text:
        if state == "nil":
            state, keep = ("comment", False) if ch == "#" else ("nil", False) if ch in " \t\r\n" else ("name", True)
        elif state == "name":
            if ch.isascii() and ch.isalpha():
                keep = True
            else:
                assert ch in " \t", f"invalid command at {ch!r}"
                name, buffer, state, keep = buffer.lower(), "", "value", False
                if name == "parameter":
                    state = "parameter"
            if state != "name":
                continue
        elif state == "parameter":
            if ch in " \t":
                name, buffer, state = buffer, "", "value"
                continue
            keep = True
        elif state == "comment":
            state, keep = ("nil", False) if ch in "\r\n" else ("comment", False)
        else:  # value
            if ch in " \t\r\n":
                value, ok = unquote(buffer.strip(" \t\r\n"))
                if not ok or ch in " \t":
                    buffer += ch
                    continue
                commands.append((name, value))
                buffer, state = "", "nil"
                continue
            keep = True
        if keep and printable(ch):
            buffer += ch
    if state == "value":
        value, ok = unquote(buffer.strip(" \t\r\n"))
        assert ok, "unexpected end of the file"
        commands.append((name, value))
    return commands


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_modelfile_strings_read_back_as_written(family):
    """Every field Ollama reads back is what emotune meant: quotes (a prompt ending in `"`, starting with `""`),
    backslashes, `{{ }}`, line breaks of every kind, tabs and Chinese text come through the Modelfile unchanged."""
    system = '"Joy", "anger" or "a\\\\b"?\n\tAnswer {{ .Content }} 只回答一个词\r\nthen\rstop."'
    commands = dict(ollama_parse(modelfile_text(family, "run-f16.gguf", system, 4, greedy=True)))
    assert commands["system"] == system and commands["template"] == TEMPLATES[family][0]
    assert commands["from"] == "./run-f16.gguf" and commands["stop"] == TEMPLATES[family][1][-1]


def test_a_system_prompt_ollama_would_change_is_refused_by_name():
    """A Chinese prompt with an ideographic space, a label with a no-break space or an emoji joined by U+200D: Ollama's
    parser silently leaves those characters out of the SYSTEM string, so `ollama run` sent the model another prompt
    than the one it was trained and measured with. The export is refused, naming each character and the fix."""
    for system, named in (("回答：　喜悦或愤怒", "U+3000 (IDEOGRAPHIC SPACE)"), ("joy or\u00a0anger", "U+00A0 (NO-BREAK SPACE)"),
                          ("❤️\u200d🔥 or joy", "U+200D (ZERO WIDTH JOINER)")):
        assert ollama_parse(f'FROM x\nSYSTEM """{system}"""\n')[1][1] != system  # what Ollama would have sent
        with pytest.raises(UserError, match=r"Ollama's Modelfile parser leaves out") as err:
            modelfile_text("qwen2", "m.gguf", system, 4, greedy=True)
        assert named in str(err.value) and "prompt.system_prompt" in str(err.value)
