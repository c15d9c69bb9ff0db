"""LLaMA-Factory's `template` key, checked against the chat template an emotune run will use.

emotune renders turns with the model's own chat template (Gemma's turn format when the tokenizer has none,
emotune.model.loading), never with LLaMA-Factory's templates. So a file's `template` is checked: its name must be one
of LLaMA-Factory's, and where emotune knows the token that opens a user turn in that template family, the
model's own template must use it too; otherwise the two tools would train on different text.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

# LLaMA-Factory's template names (register_template calls in src/llamafactory/data/template.py).
TEMPLATES = frozenset("""
    custom alpaca bailing bailing_v2 breeze chatglm3 chatml chatml_de cohere cpm4 dbrx deepseek deepseek3 deepseekr1
    hy3 deepseekcoder default dots_ocr empty ernie ernie_nothink ernie_vl exaone falcon falcon_h1 fewshot gemma gemma2
    gemma3 gemma3n gemma4 gemma4n glm4 glm4_moe glm4v glm4_5v glm_ocr glm4_7 glmz1 gpt_oss granite3 granite3_vision
    granite4 index hunyuan hunyuan_small hy_dense_1_8b hy_dense_7b intern2 intern_vl intern_s1 keye_vl kimi_vl lfm2
    lfm2_vl llama2 llama2_zh llama3 llama4 mllama moonlight moss_vl llava llava_next llava_next_llama3
    llava_next_mistral llava_next_qwen llava_next_yi llava_next_video llava_next_video_mistral llava_next_video_yi mimo
    mimo_v2 mimo_vl minicpm_v minicpm_v_4_6 minicpm_o minimax1 minimax2 ministral mistral mistral_small ministral3 olmo
    openchat openchat-3.6 opencoder paligemma paligemma_chat phi phi_small phi4 phi4_mini pixtral qwen qwen3
    qwen3_nothink qwen2_audio qwen2_omni qwen3_omni qwen3_omni_nothink qwen2_vl qwen3_vl qwen3_vl_nothink qwen3_5
    qwen3_5_nothink qwen3_6 sailor seed_coder seed_oss smollm smollm2 solar starchat telechat2 vicuna video_llava
    xuanyuan yi yi_vl youtu youtu_vl yuan zephyr aeva""".split())
# The token that opens a user turn in a template family (its `format_user` there), looked for in the model's
# own chat template. emotune trains with that template, so a file naming another family would not match.
GEMMA_TURN = "<start_of_turn>"  # also emotune's own format for tokenizers without a template (models.py)
MARKERS: dict[str, tuple[str, ...]] = {
    GEMMA_TURN: ("gemma", "gemma2", "gemma3", "gemma3n", "paligemma_chat"),
    "<|turn>": ("gemma4", "gemma4n"),
    "<|im_start|>": ("chatml", "chatml_de", "qwen", "qwen3", "qwen3_nothink", "qwen2_vl", "qwen3_vl", "qwen3_vl_nothink",
                     "qwen3_5", "qwen3_5_nothink", "qwen3_6", "qwen2_audio", "qwen2_omni", "qwen3_omni",
                     "qwen3_omni_nothink", "yi", "smollm", "smollm2", "intern2", "intern_vl", "intern_s1", "lfm2",
                     "falcon_h1", "mimo", "mimo_v2", "opencoder"),
    "<|start_header_id|>": ("llama3",),
    "<|header_start|>": ("llama4",),
    "[INST]": ("mistral", "ministral", "mistral_small", "ministral3", "pixtral", "llama2", "llama2_zh"),
    # a ChatML model's template passed these unchecked ("not compared"), though they write other turns
    "<｜User｜>": ("deepseek3", "deepseekr1"),
    "<|im_sep|>": ("phi4",),
    "<|user|>": ("phi", "phi_small", "phi4_mini", "glm4", "zephyr"),
}
FAMILY = {name: marker for marker, names in MARKERS.items() for name in names}

def template_check(name: str | None, raw: dict[str, Any]) -> tuple[list[str], str]:
    """(problems, a note) for LLaMA-Factory's `template` against the model's own chat template in `raw`."""
    if name is None:
        return [], ("template: unset: LLaMA-Factory then parses the tokenizer's chat template, which emotune uses "
                    "too (Gemma's turn format when it has none, where LLaMA-Factory uses `empty`).")
    if not isinstance(name, str) or name not in TEMPLATES:  # `template: {a: 1}` is no name either
        close = difflib.get_close_matches(str(name), sorted(TEMPLATES), n=1)
        return [f"`template: {name}` is not a LLaMA-Factory template" + (f"; did you mean {close[0]}?" if close else "")], ""
    marker = FAMILY.get(name)
    model = raw.get("model")
    own, readable = _own_chat_template(model if isinstance(model, dict) else {})
    if not readable:
        return [], f"template: {name} recorded; not checked here (the model is not a local folder): emotune trains " \
                   "with the model's own chat template."
    if own is None:
        if marker == GEMMA_TURN:
            return [], f"template: {name}: the tokenizer has no chat template; emotune's Gemma turn format is the same."
        return [f"`template: {name}`: the model's tokenizer has no chat template, and the one format emotune builds "
                "itself is Gemma's (template: gemma3); use that, or give the model's template as a Jinja file with "
                "model.chat_template=FILE"], ""
    if marker is None:
        return [], f"template: {name} recorded; emotune trains with the model's own chat template (not compared)."
    if marker in own:
        return [], f"template: {name} matches the model's own chat template ({marker} turns), which emotune uses."
    fits = sorted(n for n, m in FAMILY.items() if m in own)
    return [f"`template: {name}` writes {marker} turns, which the model's own chat template does not use; emotune "
            "trains with the model's template, so the two tools would train on different text. Name the model's "
            f"template{' (' + ', '.join(fits[:4]) + ')' if fits else ''}, or give model.chat_template=FILE"], ""


def _own_chat_template(model: dict[str, Any]) -> tuple[str | None, bool]:
    """(the chat template the run will use, whether it could be read without downloading anything)."""
    if model.get("chat_template"):
        path = Path(str(model["chat_template"])).expanduser()
        return (path.read_text(encoding="utf-8"), True) if path.is_file() else (None, False)
    folder = Path(str(model.get("source", ""))).expanduser()
    if not folder.is_dir():
        return None, False
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8"), True
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None, True
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        template = "\n".join(str(item.get("template", "")) for item in template if isinstance(item, dict))
    return (template if isinstance(template, str) and template else None), True
