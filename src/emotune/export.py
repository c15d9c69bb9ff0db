"""The export stage: the adapter with its label set and prompt, a merged full model, and the vLLM hand-off.

`emotune export RUN_DIR [--merge] [--out DIR] [--vllm]` writes into OUT (default RUN_DIR/export):

    adapter/    adapter weights and config, tokenizer with chat template, emotune.json (labels, prompt)
    merged/     (--merge) base + adapter folded into one Hugging Face model, tokenizer, generation config
    config.yaml the run's resolved config, so OUT can itself be served or exported again
    vllm/       (--vllm) serve_lora.sh, serve_merged.sh, client.py (output constrained to the label set)

The whole folder is written under a temporary name and renamed into place, so a failed export never
replaces a good one. This module also finds and loads what a run produced, for `predict` and `serve`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from emotune.config import ModelConfig, PromptConfig
from emotune.errors import UserError
from emotune.models import load_model, load_tokenizer, resolve_model_dir, stop_token_ids

ADAPTER_META = "emotune.json"  # written by train.save_adapter
# vLLM's --max-lora-rank only accepts these values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------------
# Finding what a run produced


@dataclass
class Artifact:
    """A servable classifier on disk: a LoRA adapter over a base model, or a merged full model."""

    name: str
    path: Path  # the adapter folder, or the merged model folder
    merged: bool
    meta: dict
    model_cfg: ModelConfig  # how to find the base model (unused for merged models)

    @property
    def labels(self) -> list[str]:
        return list(self.meta["labels"])

    @property
    def prompt(self) -> PromptConfig:
        return PromptConfig(system_prompt=self.meta["system_prompt_template"], user_template=self.meta["user_template"])


def find_artifact(target: str | Path, name: str | None = None) -> Artifact:
    """Accept a run folder, an export folder, an adapter folder or a merged model folder."""
    target = Path(target).expanduser()
    if not target.exists():
        raise UserError(f"`{target}` does not exist. Give a run folder (runs/<name>), an export folder, "
                        "or an adapter folder holding adapter_config.json.")
    candidates = [(target / "adapter", False), (target, False), (target / "merged", True), (target, True)]
    for folder, merged in candidates:
        marker = folder / ("config.json" if merged else "adapter_config.json")
        if marker.is_file() and (folder / ADAPTER_META).is_file():
            meta = _read_meta(folder / ADAPTER_META)
            return Artifact(name=name or _default_name(target), path=folder, merged=merged, meta=meta,
                            model_cfg=_model_cfg(target, folder, meta))
    raise UserError(f"`{target}` holds no emotune adapter or merged model (looked for adapter_config.json or "
                    f"config.json next to {ADAPTER_META}, in the folder and in adapter/ and merged/). "
                    "Point at a finished run folder (runs/<name>) or at the output of `emotune export`.")


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"`{path}` is not valid JSON ({err}). Re-export the run, or restore the file.") from None
    missing = [k for k in ("labels", "system_prompt_template", "user_template", "base_model") if k not in meta]
    if missing:
        raise UserError(f"`{path}` lacks {', '.join(missing)}. It was not written by emotune; re-export the run.")
    return meta


def _default_name(target: Path) -> str:
    folder = target.resolve()
    name = folder.parent.name if folder.name in ("adapter", "merged", "export") else folder.name
    # the name travels in URLs, JSON `model` fields and vLLM's name=path flags
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "adapter"


def _model_cfg(target: Path, folder: Path, meta: dict) -> ModelConfig:
    """The run's model section (source, cache, chat template) when its config.yaml is at hand."""
    for config_file in (target / "config.yaml", folder.parent / "config.yaml"):
        if config_file.is_file():
            raw = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
            return ModelConfig.model_validate(raw.get("model") or {"source": meta["base_model"]})
    return ModelConfig(source=meta["base_model"])


def load_artifact_model(artifact: Artifact, dtype: torch.dtype, device: torch.device):
    """The model (PEFT-wrapped for adapters) and tokenizer, ready for inference."""
    if artifact.merged:
        return load_model(artifact.path, dtype, device).eval(), load_tokenizer(artifact.path, ModelConfig())
    from peft import PeftModel

    base = load_model(resolve_model_dir(artifact.model_cfg), dtype, device)
    model = PeftModel.from_pretrained(base, artifact.path, adapter_name=artifact.name)
    return model.eval(), load_tokenizer(artifact.path, ModelConfig())


def adapter_config(adapter_dir: Path) -> dict:
    return json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))


def vllm_blockers(config: dict) -> list[str]:
    """Why vLLM cannot hot-load this adapter (empty when it can)."""
    blockers = []
    if config.get("use_dora"):
        blockers.append("it is a DoRA adapter (use_dora=true)")
    if config.get("modules_to_save"):
        blockers.append(f"it trains whole modules besides LoRA (modules_to_save={config['modules_to_save']})")
    if config.get("peft_type", "LORA") != "LORA":
        blockers.append(f"it is a {config['peft_type']} adapter, not LoRA")
    return blockers


def max_lora_rank(config: dict) -> int:
    """The smallest rank vLLM accepts that holds every rank in the adapter (rank_pattern included)."""
    rank = max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


# --------------------------------------------------------------------------------------------------
# Export


def export(run_dir: str | Path, out: str | Path | None = None, merge: bool = False, vllm: bool = False,
           dtype: str = "auto") -> Path:
    artifact = find_artifact(run_dir)
    if artifact.merged:
        raise UserError(f"`{run_dir}` holds a merged model only; export needs the adapter. Point at the run folder.")
    out = Path(out).expanduser() if out else Path(run_dir) / "export"
    if artifact.path.resolve().is_relative_to(out.resolve()):
        raise UserError(f"--out `{out}` holds the adapter being exported, so replacing it would delete the source. "
                        "Choose another folder, e.g. the default RUN_DIR/export.")
    blockers = vllm_blockers(adapter_config(artifact.path))
    if vllm and blockers and not merge:
        print(f"vLLM cannot hot-load this adapter: {'; '.join(blockers)}. Exporting the merged route "
              "(as if --merge was given); serve_merged.sh is the launch script.", flush=True)
        merge = True

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shutil.copytree(artifact.path, partial / "adapter")
    (partial / "config.yaml").write_text(yaml.safe_dump({"model": artifact.model_cfg.model_dump(mode="json")}, sort_keys=False))
    if merge:
        merge_adapter(artifact, partial / "merged", dtype)
    if vllm:
        write_vllm_handoff(artifact, partial, out, merged=merge, lora_route=not blockers)
    _replace(partial, out)
    print(f"Exported {artifact.name} to {out}" + (" (adapter + merged model)" if merge else " (adapter)"), flush=True)
    return out


def _replace(partial: Path, out: Path) -> None:
    """Swap the finished folder in; the previous export is removed only once the new one is in place."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)


def merge_adapter(artifact: Artifact, target: Path, dtype: str = "auto") -> Path:
    """Fold the adapter into the base weights in fp32, then save in `dtype` (auto = the base's own dtype)."""
    from peft import PeftModel

    base_dir = resolve_model_dir(artifact.model_cfg)
    base = load_model(base_dir, torch.float32, torch.device("cpu"))
    native = _saved_dtype(base_dir) if dtype == "auto" else DTYPES[dtype]
    merged = PeftModel.from_pretrained(base, artifact.path).merge_and_unload()
    tokenizer = load_tokenizer(artifact.path, ModelConfig())
    # vLLM and transformers stop on generation_config's eos ids; a chat turn ends with <end_of_turn>
    merged.generation_config.eos_token_id = stop_token_ids(tokenizer)
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.to(native)
    merged.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    shutil.copy2(artifact.path / ADAPTER_META, target / ADAPTER_META)
    return target


def _saved_dtype(model_dir: Path) -> torch.dtype:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name), torch.float32)


@torch.inference_mode()
def merge_parity_gap(target: str | Path, texts: list[str], merged_dir: str | Path | None = None) -> float:
    """Largest |logit difference| between base+adapter and the merged model, both in fp32 on the CPU.

    `merged_dir` is a saved merged folder (saved in fp32 to compare like with like); without it the
    adapter is merged in memory. The prompts are the classifier's own chat prompts for `texts`.
    """
    from peft import PeftModel

    from emotune.data import prompt_messages

    artifact = find_artifact(target)
    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(artifact.path, ModelConfig())
    prompts = [tokenizer.apply_chat_template(prompt_messages(t, artifact.prompt, artifact.labels), tokenize=False,
                                             add_generation_prompt=True) for t in texts]
    base_dir = resolve_model_dir(artifact.model_cfg)
    adapted = PeftModel.from_pretrained(load_model(base_dir, torch.float32, cpu), artifact.path).eval()
    if merged_dir is not None:
        merged = load_model(Path(merged_dir), torch.float32, cpu).eval()
    else:
        merged = PeftModel.from_pretrained(load_model(base_dir, torch.float32, cpu), artifact.path).merge_and_unload().eval()
    gap = 0.0
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        gap = max(gap, (adapted(**enc).logits - merged(**enc).logits).abs().max().item())
    return gap


# --------------------------------------------------------------------------------------------------
# vLLM hand-off


def vllm_base_reference(model_cfg: ModelConfig) -> tuple[str, list[str]]:
    """What `vllm serve` should load as the base: a hub id as is, everything else as its local folder."""
    from emotune.models import HUB_PREFIXES, looks_like_hub_id

    source = model_cfg.source
    if source.startswith("hf:") or (not source.startswith(HUB_PREFIXES) and looks_like_hub_id(source)):
        repo = source.removeprefix("hf:")
        return repo, (["--revision", model_cfg.revision] if model_cfg.revision else [])
    return str(resolve_model_dir(model_cfg).resolve()), []


def vllm_lora_args(artifact: Artifact, adapter_path: str, base: str, extra: list[str]) -> list[str]:
    rank = max_lora_rank(adapter_config(artifact.path))
    return ["serve", base, *extra, "--enable-lora", "--lora-modules", f"{artifact.name}={adapter_path}",
            "--max-lora-rank", str(rank), "--max-loras", "4", "--generation-config", "auto"]


def vllm_merged_args(artifact: Artifact, merged_path: str) -> list[str]:
    return ["serve", merged_path, "--served-model-name", artifact.name, "--generation-config", "auto"]


def write_vllm_handoff(artifact: Artifact, folder: Path, final: Path, merged: bool, lora_route: bool) -> None:
    vllm_dir = folder / "vllm"
    vllm_dir.mkdir()
    final_abs = final.expanduser().resolve()
    if lora_route:
        base, extra = vllm_base_reference(artifact.model_cfg)
        args = vllm_lora_args(artifact, "$EXPORT/adapter", base, extra)
        # the base folder may lack the chat template the adapter was trained with; pass the adapter's own
        if (artifact.path / "chat_template.jinja").is_file():
            args += ["--chat-template", "$EXPORT/adapter/chat_template.jinja"]
        _write_script(vllm_dir / "serve_lora.sh", final_abs, args,
                      f"Base model + hot-loaded LoRA adapter; requests use model={artifact.name!r}.")
    if merged:
        _write_script(vllm_dir / "serve_merged.sh", final_abs, vllm_merged_args(artifact, "$EXPORT/merged"),
                      f"The merged model; requests use model={artifact.name!r}.")
    (vllm_dir / "client.py").write_text(_client_example(artifact), encoding="utf-8")


def _write_script(path: Path, export_dir: Path, args: list[str], what: str) -> None:
    # $EXPORT paths stay expandable (double quotes); everything else is quoted literally
    quoted = " ".join(f'"{a}"' if "$EXPORT" in a else shlex.quote(a) for a in args)
    path.write_text(
        "#!/usr/bin/env bash\n"
        f"# {what}\n"
        "# Written by `emotune export --vllm`. Extra vLLM flags are passed through: ./serve_*.sh --port 8001\n"
        "set -euo pipefail\n"
        f'EXPORT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")/.." && pwd)"  # written at {export_dir}\n'
        f'exec vllm {quoted} "$@"\n',
        encoding="utf-8")
    path.chmod(0o755)


def _client_example(artifact: Artifact) -> str:
    from emotune.data import system_prompt

    return f'''"""Classify with the vLLM server started by serve_lora.sh or serve_merged.sh; the output is one label.

Written by `emotune export --vllm`. Usage: python client.py "i feel wonderful today" [--base-url URL]
vLLM >= 0.11 takes `structured_outputs: {{"choice": [...]}}`; older versions take `guided_choice: [...]`
(removed in 0.12), which --legacy sends instead.
"""

import argparse

from openai import OpenAI

MODEL = {artifact.name!r}
LABELS = {artifact.labels!r}
SYSTEM_PROMPT = {system_prompt(artifact.prompt, artifact.labels)!r}
USER_TEMPLATE = {artifact.prompt.user_template!r}


def classify(client: OpenAI, text: str, legacy: bool = False) -> str:
    constraint = {{"guided_choice": LABELS}} if legacy else {{"structured_outputs": {{"choice": LABELS}}}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{{"role": "system", "content": SYSTEM_PROMPT}},
                  {{"role": "user", "content": USER_TEMPLATE.replace("{{text}}", text)}}],
        temperature=0.0,
        max_tokens=8,
        extra_body=constraint,
    )
    return reply.choices[0].message.content


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("text")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--legacy", action="store_true", help="vLLM < 0.11: send guided_choice")
    args = parser.parse_args()
    print(classify(OpenAI(base_url=args.base_url, api_key=args.api_key), args.text, args.legacy))
'''
