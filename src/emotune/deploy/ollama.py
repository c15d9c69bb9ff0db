"""An Ollama Modelfile for the exported GGUF: the turn format as a Go template, stop tokens, system prompt, parameters.

Ollama renders the prompt itself from TEMPLATE (Go's text/template over `.Messages`), so each family's template
reproduces what the model's chat template gives for the same conversation, with the BOS token left out (llama.cpp
adds it, as `tokenizer.ggml.add_bos_token` says). Gemma 3 has no system role: the system text opens the first user
turn, as Gemma 3's own template does; Gemma 4 has one. tests/test_gguf_ollama.py renders both and compares them.

For a classifier the SYSTEM line is the prompt emotune trained with and `temperature 0` makes the answer the
greedy one emotune measured; the user message is the user template with the text filled in
(`ollama run NAME "Text: i feel great"` for the default template).
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

from emotune.core.errors import UserError

GEMMA = """\
{{- $system := "" }}
{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = .Content }}{{ end }}{{ end }}
{{- $first := true }}
{{- range .Messages }}
{{- if eq .Role "user" }}<start_of_turn>user
{{ if and $first $system }}{{ $system }}

{{ end }}{{ .Content }}<end_of_turn>
{{ $first = false }}
{{- else if eq .Role "assistant" }}<start_of_turn>model
{{ .Content }}<end_of_turn>
{{ end }}
{{- end }}<start_of_turn>model
"""

# google/gemma-4-E4B-it's framing with thinking off: a system role of its own, the model's turn opened with an empty
# thought channel (what its chat template's generation prompt writes)
GEMMA4 = """\
{{- range .Messages }}
{{- if eq .Role "system" }}<|turn>system
{{ .Content }}<turn|>
{{ else if eq .Role "user" }}<|turn>user
{{ .Content }}<turn|>
{{ else if eq .Role "assistant" }}<|turn>model
{{ .Content }}<turn|>
{{ end }}
{{- end }}<|turn>model
<|channel>thought
<channel|>"""

LLAMA3 = """\
{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

CHATML = """\
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

MISTRAL = """\
{{- $system := "" }}
{{- range .Messages }}{{ if eq .Role "system" }}{{ $system = .Content }}{{ end }}{{ end }}
{{- $first := true }}
{{- range .Messages }}
{{- if eq .Role "user" }}[INST] {{ if and $first $system }}{{ $system }}

{{ end }}{{ .Content }} [/INST]{{ $first = false }}
{{- else if eq .Role "assistant" }}{{ .Content }}</s>
{{- end }}
{{- end }}"""

# model type -> (Go template, stop tokens)
TEMPLATES = {
    "gemma3_text": (GEMMA, ["<end_of_turn>"]),
    "gemma4_text": (GEMMA4, ["<turn|>"]),
    "llama": (LLAMA3, ["<|eot_id|>", "<|start_header_id|>"]),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "</s>"]),
    "qwen2": (CHATML, ["<|im_end|>", "<|im_start|>"]),
    "qwen3": (CHATML, ["<|im_end|>", "<|im_start|>"]),
}


def modelfile_text(model_type: str, gguf_name: str, system: str | None, max_new_tokens: int, greedy: bool) -> str:
    if model_type not in TEMPLATES:
        raise UserError(f"No Ollama template for model type `{model_type}`; supported: {sorted(TEMPLATES)}.")
    template, stops = TEMPLATES[model_type]
    lines = [f"FROM ./{gguf_name}", "", f'TEMPLATE """{template}"""', ""]
    if system:
        if '"""' in system:
            raise UserError('The system prompt contains """, which ends a Modelfile string. Remove it from '
                            "prompt.system_prompt (or from the label names it lists) and train again.")
        dropped = dropped_by_ollama(system)
        if dropped:
            names = ", ".join(f"U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')})" for ch in dropped)
            raise UserError(f"The system prompt holds {names}, which Ollama's Modelfile parser leaves out of a string "
                            "(it keeps letters, marks, numbers, punctuation, symbols, spaces, tabs and line breaks), so "
                            "Ollama would send the model another prompt than the one it was trained with. Replace them in "
                            "prompt.system_prompt (or in the label names it lists), e.g. a no-break or ideographic space "
                            "with a plain space, and train again.")
        lines += [f'SYSTEM """{system}"""', ""]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    if greedy:
        lines += ["PARAMETER temperature 0", "PARAMETER top_k 1"]
    lines += [f"PARAMETER num_predict {max_new_tokens}", ""]
    return "\n".join(lines)


def dropped_by_ollama(text: str) -> list[str]:
    """The characters of `text` that Ollama's Modelfile parser drops from a string (parser/parser.go: a value keeps
    spaces, tabs and line breaks, and any other rune only where Go's strconv.IsPrint accepts it: the Unicode categories
    L, M, N, P and S). No-break and ideographic spaces, zero-width joiners (in emoji) and control characters are not."""
    return sorted({ch for ch in text if ch not in " \t\r\n" and unicodedata.category(ch)[0] not in "LMNPS"})


def artifact_modelfile(artifact, model_type: str, gguf_name: str) -> str:
    """The Modelfile of `artifact`'s model. Called once before anything is exported too, so a model type without a
    template or a system prompt the file cannot hold is refused before the merge, not after it replaced a good export."""
    from emotune.deploy.gguf_write import gguf_meta
    from emotune.deploy.predict import trained_max_new_tokens

    return modelfile_text(model_type, gguf_name, gguf_meta(artifact).get("system_prompt"),
                          trained_max_new_tokens(artifact), greedy=not artifact.answers_freely)


def write_modelfile(artifact, model_type: str, gguf_file: Path, folder: Path) -> Path:
    """ollama/Modelfile beside a link to the GGUF file (Ollama resolves FROM relative to the Modelfile)."""
    text = artifact_modelfile(artifact, model_type, gguf_file.name)
    folder.mkdir(exist_ok=True)
    link = folder / gguf_file.name
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path("..") / gguf_file.parent.name / gguf_file.name)
    target = folder / "Modelfile"
    target.write_text(text, encoding="utf-8")
    return target
