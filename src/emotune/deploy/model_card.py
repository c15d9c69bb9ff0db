"""The model card (README.md) of a pushed adapter or merged model.

YAML header as the hubs read it (base_model, license, library_name, pipeline_tag, tags, datasets, metrics), then
what the model does, the before/after table with 95 % bootstrap intervals from the run's comparison.json, the
exact resolved config, and how to load it with transformers + PEFT, vLLM and Ollama.
"""

from __future__ import annotations

import json
import re
import shlex

import yaml

from emotune.core.rundir import read_json
from emotune.report.table import markdown_cell

EMBEDDED_BASE = "google/gemma-3-270m"  # the packaged GGUF is a conversion of it (its NOTICE names the source)
# the licence of each family's released weights, as the hub names it; "other" where it differs by model
LICENSES = {"gemma": "gemma", "llama": "llama3", "qwen": "apache-2.0", "mistral": "apache-2.0"}


def base_model_id(source: str | None) -> str | None:
    """The hub id of the base model, None for a local folder or file."""
    from emotune.model.loading import looks_like_hub_id

    if not source:
        return None
    if source == "embedded":
        return EMBEDDED_BASE
    if source.startswith(("hf:", "modelscope:")):
        return source.split(":", 1)[1]
    return source if looks_like_hub_id(source) else None


def license_of(base_id: str | None, model_type: str | None) -> str:
    text = f"{base_id or ''} {model_type or ''}".lower()
    return next((value for key, value in LICENSES.items() if key in text), "other")


def header(artifact, base_id: str | None, model_type: str | None, merged: bool, dataset: str | None) -> dict:
    classify = not artifact.answers_freely
    data = {"license": license_of(base_id, model_type), "library_name": "transformers" if merged else "peft",
            "pipeline_tag": "text-classification" if artifact.has_head else "text-generation",
            "tags": ["emotune", *([] if artifact.merged else ["lora"]),  # a full / freeze run's model has no LoRA
                     *(["text-classification"] if classify else ["text-generation"]), *(["merged"] if merged else [])],
            "metrics": ["accuracy", "f1"] if classify else ["rouge"]}
    if base_id:
        data["base_model"] = base_id
    if dataset:
        data["datasets"] = [dataset]
    return data


def model_card(artifact, run, hub: str, repo_id: str, merged: bool, config_text: str | None) -> str:
    config = yaml.safe_load(config_text) if config_text else {}
    source = (config.get("model") or {}).get("source") or artifact.meta.get("base_model")
    base_id = base_model_id(source)
    data_source = str((config.get("data") or {}).get("source") or "")
    dataset = data_source.split(":", 1)[1] if data_source.startswith(("hf:", "modelscope:")) else None
    model_type = _model_type(artifact)
    lines = ["---", yaml.safe_dump(header(artifact, base_id, model_type, merged, dataset), sort_keys=False).strip(), "---", "",
             f"# {repo_id.split('/')[-1]}", ""]
    classify = not artifact.answers_freely
    what = ("fully or freeze fine-tuned model (train.finetuning)" if artifact.merged else
            "merged model (base + LoRA folded in)" if merged else "LoRA adapter")
    lines.append(f"A {what} trained with [emotune](https://pypi.org/project/emotune/) on {inline_code(str(base_id or source))}"
                 f" ({'a classifier that answers with one label' if classify else 'instruction tuning'}).")
    if artifact.has_head:  # no prompt: the text itself goes in, a trained head gives one probability per label
        lines += ["", f"Labels: {', '.join(map(inline_code, artifact.labels))}.", "",
                  "Input: the text itself, without a prompt; a trained classification head answers with one "
                  "probability per label (task classify_head)."]
    elif classify:
        prompt = f"{_system_prompt(artifact)}\n\n{artifact.prompt.user_template}"
        lines += ["", f"Labels: {', '.join(map(inline_code, artifact.labels))}.", "",
                  "Prompt (system, then the user template):", "",
                  *fenced(prompt, "text")]
    lines += ["", f"License: the base model's terms ({header(artifact, base_id, model_type, merged, dataset)['license']}); "
              "check them on the base model's page before use.", ""]
    lines += results_table(read_json(run.comparison_json))
    if config_text:
        lines += ["## Training config (exact, resolved)", "", *fenced(config_text.strip(), "yaml"), ""]
    lines += (head_usage if artifact.has_head else usage)(artifact, hub, repo_id, base_id or str(source), merged)
    return "\n".join(lines) + "\n"


def fenced(text: str, language: str) -> list[str]:
    """`text` as a Markdown code block whose fence is longer than any run of backticks in it (CommonMark's rule), so
    a prompt holding ``` cannot close the block early and have the rest read as the card's own Markdown."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + language, text, fence]


def inline_code(text: str) -> str:
    """`text` as a Markdown code span, on one line, its backtick fence longer than any run of backticks in it: a label
    is shown as written, never read as the card's own Markdown or HTML (`<details>` hid the rest of the card,
    `# ...` after a line break became a heading)."""
    flat = " ".join(text.split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def _system_prompt(artifact) -> str:
    from emotune.data import system_prompt

    return system_prompt(artifact.prompt, artifact.labels)


def _model_type(artifact) -> str | None:
    try:

        return read_json(artifact.base_dir() / "config.json").get("model_type")
    except Exception:  # the base is not on this machine: the card goes without it, the upload is unaffected
        return None


def results_table(comparison: dict | None) -> list[str]:
    """Before/after per metric with the 95 % intervals of comparison.json (absent: said so)."""
    if not comparison or "metrics" not in comparison:
        return ["## Results", "", "No comparison.json in the run folder: the run was not measured before and after.", ""]
    intervals = comparison.get("intervals") or {}
    rows = ["## Results (test split, before vs after fine-tuning)", "",
            "| metric | before | after | change | 95 % interval of the change |", "|---|---|---|---|---|"]
    for name, row in comparison["metrics"].items():
        if not isinstance(row, dict) or "after" not in row:
            continue
        band = intervals.get(name) or {}
        before, after = _with_interval(row.get("before"), band.get("before")), _with_interval(row.get("after"), band.get("after"))
        # classify nests the change's interval under "delta"; sft's band is that interval itself
        delta = band["delta"] if isinstance(band.get("delta"), dict) else band
        change = f"[{delta['low']:.3f}, {delta['high']:.3f}]" if "low" in delta else ""
        rows.append(f"| {markdown_cell(name)} | {before} | {after} | {row.get('delta', 0):+.3f} | {change} |")
    rows += ["", f"Rows: {comparison.get('rows', '?')}; intervals: seeded percentile bootstrap over the test rows.", ""]
    return rows


def _with_interval(value, band) -> str:
    if not isinstance(value, (int, float)):
        return "" if value is None else str(value)
    return f"{value:.3f} [{band[0]:.3f}, {band[1]:.3f}]" if isinstance(band, (list, tuple)) and len(band) == 2 else f"{value:.3f}"


def usage(artifact, hub: str, repo_id: str, base: str, merged: bool) -> list[str]:
    """How to load the model. `base` may be a local path (a base that is no hub id), so it is a Python string literal
    and a shell word as written: a path with a space, a quote or ``` in it stays one argument inside its code block."""
    prefix = "modelscope:" if hub == "modelscope" else ""
    load = (f"model = AutoModelForCausalLM.from_pretrained({json.dumps(repo_id)})" if merged else
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({json.dumps(base)}), {json.dumps(repo_id)})")
    vllm = (f"vllm serve {shlex.quote(repo_id)} --generation-config auto" if merged else
            f"vllm serve {shlex.quote(base)} --enable-lora --lora-modules {shlex.quote(f'{artifact.name}={repo_id}')} "
            "--generation-config auto")
    python = "\n".join(["from transformers import AutoModelForCausalLM, AutoTokenizer"
                        + ("" if merged else "\nfrom peft import PeftModel"),
                        load, f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(repo_id)})"])
    # a classifier's Modelfile answers greedily, as it was measured; an sft model's samples (ollama.modelfile_text)
    parameters = ("system prompt, stop tokens" if getattr(artifact, "answers_freely", False)
                  else "system prompt, stop tokens, temperature 0")
    return ["## How to use", "", "transformers" + ("" if merged else " + PEFT") + ":", "", *fenced(python, "python"), "",
            f"emotune: `emotune predict` / `emotune serve` on a downloaded copy (`{prefix}{repo_id}`).", "",
            "vLLM:", "", *fenced(vllm, "bash"), "",
            "llama.cpp / Ollama: `emotune export RUN --format ollama --quant q8_0` writes the GGUF file and a Modelfile "
            f"({parameters}); then `ollama create NAME -f Modelfile`.", ""]


def head_usage(artifact, hub: str, repo_id: str, base: str, merged: bool) -> list[str]:
    """How to load a classification-head model: it answers with label probabilities, not text, so neither vLLM's chat
    route nor llama.cpp / Ollama applies (`emotune export` refuses both for it)."""
    prefix = "modelscope:" if hub == "modelscope" else ""
    lines = ["## How to use", "",
             f"emotune: `emotune predict` / `emotune serve` (`/v1/classify`) on a downloaded copy (`{prefix}{repo_id}`) "
             "give the label and its probabilities.", ""]
    if merged:
        python = "\n".join(["from transformers import AutoModelForSequenceClassification, AutoTokenizer",
                            f"model = AutoModelForSequenceClassification.from_pretrained({json.dumps(repo_id)})",
                            f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(repo_id)})",
                            f"labels = {json.dumps(list(artifact.labels), ensure_ascii=False)}  # in the head's order"])
        lines += ["transformers (architectures with a sequence-classification class, Gemma 1–3; every architecture "
                  "loads with `emotune.model.head.load_classifier`):", "", *fenced(python, "python"), ""]
    lines += ["vLLM, llama.cpp and Ollama serve generated text, so they do not apply to this model.", ""]
    return lines
