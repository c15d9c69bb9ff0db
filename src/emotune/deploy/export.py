"""The export stage: the adapter with its label set and prompt, a merged full model, and the vLLM hand-off.

`emotune export RUN_DIR [--merge] [--out DIR] [--vllm]` writes into OUT (default RUN_DIR/export):

    adapter/    adapter weights and config, tokenizer with chat template, emotune.json (task, labels, prompt)
    merged/     (--merge) base + adapter folded into one Hugging Face model, tokenizer, chat template, generation
                config (stopping on the template's end-of-turn token), a multimodal base's processor files;
                a classification-head model: its classifier (language model + `score`), see emotune.model.head
    config.yaml the run's resolved config, so OUT can itself be served or exported again
    vllm/       (--vllm) serve_lora.sh, serve_merged.sh, client.py (a classifier's output constrained to the
                label set; an sft model's a free-text chat reply under its system prompt)

A head model (task classify_head) has no vLLM hand-off: it answers with label probabilities, which
`emotune serve` and `emotune predict` give. Its merged folder loads with transformers'
`AutoModelForSequenceClassification` where the architecture has a sequence-classification class (Gemma 1–3)
and with `emotune.model.head.load_classifier` for every architecture (Gemma 3n and Gemma 4 need it).

The whole folder is written under a temporary name and renamed into place, so a failed export never
replaces a good one; an existing OUT is replaced only with --force. What a run produced is found and
loaded by emotune.model.artifacts.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from transformers.utils import FEATURE_EXTRACTOR_NAME, PROCESSOR_NAME, VIDEO_PROCESSOR_NAME

from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError
from emotune.core.rundir import RunDir, atomic_dir, check_folder_path
from emotune.deploy.quantized_merge import SAMPLE_TEXTS, merge_report
from emotune.model import quantization
from emotune.model.artifacts import META, PEFT_CONFIG, Artifact, find_artifact
from emotune.model.head import classifier_from_causal, encode_texts, load_classifier
from emotune.model.loading import load_model, load_tokenizer, resolve_model_dir
from emotune.model.turns import stop_token_ids

# vLLM's --max-lora-rank only accepts these values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a processor's own files; it also reads the tokenizer's files and chat_template.jinja, which the merged folder has
# from the adapter (FEATURE_EXTRACTOR_NAME is also transformers' IMAGE_PROCESSOR_NAME)
PROCESSOR_FILES = (PROCESSOR_NAME, FEATURE_EXTRACTOR_NAME, VIDEO_PROCESSOR_NAME)


# --------------------------------------------------------------------------------------------------
# What vLLM can load


def _earlier_export(folder: Path) -> bool:
    """A folder an earlier export wrote (adapter/ or merged/ in it), and not a run folder, which holds them too."""
    return (folder.is_dir() and not (folder / "run.json").exists()
            and ((folder / "adapter").is_dir() or (folder / "merged").is_dir()))


def adapter_config(adapter_dir: Path) -> dict:
    return json.loads((adapter_dir / PEFT_CONFIG).read_text(encoding="utf-8"))


def vllm_blockers(adapter_dir: Path) -> list[str]:
    """Why vLLM cannot hot-load the adapter in `adapter_dir` (empty when it can)."""
    config = adapter_config(adapter_dir)
    blockers = []
    if config.get("use_dora"):
        blockers.append("it is a DoRA adapter (use_dora=true)")
    if config.get("modules_to_save"):
        blockers.append(f"it trains whole modules besides LoRA (modules_to_save={config['modules_to_save']})")
    if config.get("peft_type", "LORA") != "LORA":
        blockers.append(f"it is a {config['peft_type']} adapter, not LoRA")
    from emotune.deploy.vllm_ready import adapted_modules, lora_blockers

    return blockers + lora_blockers(config, adapted_modules(adapter_dir, config))


def max_lora_rank(config: dict) -> int:
    """The smallest rank vLLM accepts that holds every rank in the adapter (rank_pattern included)."""
    rank = max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


# --------------------------------------------------------------------------------------------------
# Export


def export(run_dir: str | Path, out: str | Path | None = None, merge: bool = False, vllm: bool = False,
           dtype: str = "auto", force: bool = False, finish: Callable[[Path], None] | None = None) -> Path:
    """`finish(folder)`: what else the export holds (GGUF files, a Modelfile), written into the temporary folder
    before it takes OUT's place, so a failure there too leaves an earlier export as it was."""
    artifact = find_artifact(run_dir)
    trained_whole = artifact.merged and artifact.path == RunDir(run_dir).model  # train.finetuning full / freeze
    if artifact.merged and not trained_whole:
        raise UserError(f"`{run_dir}` holds a merged model only; export needs the adapter. Point at the run folder.")
    if vllm and artifact.has_head:
        raise UserError(f"`{run_dir}` holds a classification-head model (task {artifact.task}), which answers with label "
                        "probabilities rather than text, so the vLLM chat hand-off does not apply. Leave out --vllm: "
                        "serve it with `emotune serve` (/v1/classify) or classify with `emotune predict`; --merge "
                        "writes a folder transformers' AutoModelForSequenceClassification loads where the "
                        "architecture has that class (Gemma 1–3).")
    out = Path(out).expanduser() if out else default_out(run_dir, artifact)
    if artifact.path.resolve().is_relative_to(out.resolve()):
        raise UserError(f"--out `{out}` holds the adapter being exported, so replacing it would delete the source. "
                        "Choose another folder, e.g. the default RUN_DIR/export.")
    if out.resolve().is_relative_to(artifact.path.resolve()):
        raise UserError(f"--out `{out}` is inside the folder being exported ({artifact.path}), so the export would copy "
                        "itself into itself (without end) and change that folder. Choose a folder outside it, e.g. the "
                        "default RUN_DIR/export.")
    # an empty folder made for the export holds nothing to keep: it is written into as a new one (replaced on success)
    taken = out.exists() and not (out.is_dir() and not any(out.iterdir()))
    if taken and not force:
        raise UserError(f"`{out}` already exists (an earlier export?). Pass --force to replace it once the new export is "
                        "complete, or --out <another folder>.")
    if taken and not _earlier_export(out):  # --force replaces the folder whole: never a folder export did not write
        raise UserError(f"--out `{out}` exists and is not a folder `emotune export` wrote (no adapter/ or merged/, or it "
                        "is a run folder), and --force would replace it whole, deleting what it holds. Give a new folder, "
                        "e.g. --out exports/NAME.")
    check_folder_path(out, "the export folder (--out)", "Give --out a folder you can write to, e.g. --out exports/NAME.")
    if trained_whole:
        return _export_whole(artifact, out, vllm, dtype, merge, finish)
    blockers = vllm_blockers(artifact.path)
    if vllm and blockers and not merge:
        print(f"vLLM cannot hot-load this adapter: {'; '.join(blockers)}. Exporting the merged route "
              "(as if --merge was given); serve_merged.sh is the launch script.", flush=True)
        merge = True

    with atomic_dir(out) as partial:  # a failed export never replaces a good one
        exported = RunDir(partial)
        shutil.copytree(artifact.path, exported.adapter)
        exported.config.write_text(yaml.safe_dump({"model": artifact.model_cfg.model_dump(mode="json")}, sort_keys=False))
        if merge:
            merge_adapter(artifact, partial / "merged", dtype)
            if quantization.bits(artifact.model_cfg):  # trained on a quantized base: say what the merge changes
                parity = merge_parity_gap(run_dir, list(SAMPLE_TEXTS), merged_dir=partial / "merged")
                merge_report(artifact, partial / "merged", parity, _adapted(artifact, artifact.base_dir()))
        if vllm:
            write_vllm_handoff(artifact, partial, out, merged=merge, lora_route=not blockers)
        if finish is not None:
            finish(partial)
    print(f"Exported {artifact.name} to {out}" + (" (adapter + merged model)" if merge else " (adapter)"), flush=True)
    return out


def default_out(run_dir: str | Path, artifact: Artifact) -> Path:
    """RUN/export; for an adapter folder given itself (RUN/adapter, a folder of PEFT files), never a folder inside it:
    its run's export/ where its parent is a run folder (a config.yaml), else `<adapter>-export` beside it."""
    if artifact.path.resolve() != Path(run_dir).expanduser().resolve():
        return RunDir(run_dir).export
    parent = artifact.path.parent
    return RunDir(parent).export if RunDir(parent).config.is_file() else parent / f"{artifact.path.name}-export"


def _export_whole(artifact: Artifact, out: Path, vllm: bool, dtype: str, merge: bool,
                  finish: Callable[[Path], None] | None) -> Path:
    """A fully or freeze-fine-tuned run (train.finetuning): its model folder is already what --merge makes, so it is
    written as merged/ (in `dtype`; auto = as trained and saved), with config.yaml and the merged vLLM route."""
    if merge:
        print("The run trained the model itself (train.finetuning full / freeze): there is no adapter to merge; its "
              "model is exported as merged/.", flush=True)
    with atomic_dir(out) as partial:
        if dtype == "auto":
            shutil.copytree(artifact.path, partial / "merged")
        else:
            from emotune.model.artifacts import load_artifact_model

            model, tokenizer = load_artifact_model(artifact, DTYPES[dtype], torch.device("cpu"))
            model.save_pretrained(partial / "merged", safe_serialization=True)
            tokenizer.save_pretrained(partial / "merged")
            shutil.copy2(artifact.path / META, partial / "merged" / META)
        RunDir(partial).config.write_text(yaml.safe_dump({"model": artifact.model_cfg.model_dump(mode="json")},
                                                         sort_keys=False))
        if vllm:
            write_vllm_handoff(artifact, partial, out, merged=True, lora_route=False)
        if finish is not None:
            finish(partial)
    print(f"Exported {artifact.name} to {out} (the fully or freeze-fine-tuned model, as merged/)", flush=True)
    return out


def merge_adapter(artifact: Artifact, target: Path, dtype: str = "auto") -> Path:
    """Fold the adapter into the base weights in fp32, then save in `dtype` (auto = the base's own dtype).
    A head adapter merges into its classifier: the language model with the LoRA folded in, and the trained head."""
    base_dir = artifact.base_dir()
    native = _saved_dtype(base_dir) if dtype == "auto" else DTYPES[dtype]
    merged = _adapted(artifact, base_dir).merge_and_unload()
    tokenizer = load_tokenizer(artifact.path, ModelConfig())
    if not artifact.has_head:
        # vLLM and transformers stop on generation_config's eos ids; a chat turn ends with the template's own token
        merged.generation_config.eos_token_id = stop_token_ids(tokenizer, merged.generation_config)
        merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.to(native)
    merged.save_pretrained(target, safe_serialization=True)
    copy_processor_files(base_dir, target)
    tokenizer.save_pretrained(target)  # after the processor files: the trained chat template is the one that stays
    shutil.copy2(artifact.path / META, target / META)
    return target


def copy_processor_files(base_dir: Path, target: Path) -> list[str]:
    """The base's image, video and audio preprocessing next to the merged weights, so that a multimodal base's merged
    folder loads with AutoProcessor and AutoModelForImageTextToText elsewhere. The files are copied as they are (building
    the processor would need every modality's optional dependency, torchvision for Gemma 4's video processor)."""
    copied = []
    for name in PROCESSOR_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, target / name)
            copied.append(name)
    return copied


def _adapted(artifact: Artifact, base_dir: Path):
    """The base with the adapter, in fp32 on the CPU: a causal model, or a head adapter's classifier."""
    from peft import PeftModel

    base = load_model(base_dir, torch.float32, torch.device("cpu"))
    if artifact.has_head:
        base = classifier_from_causal(base, artifact.labels)
    return PeftModel.from_pretrained(base, artifact.path)


def _saved_dtype(model_dir: Path) -> torch.dtype:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name), torch.float32)


@torch.inference_mode()
def merge_parity_gap(target: str | Path, texts: list[str], merged_dir: str | Path | None = None) -> float:
    """Largest |logit difference| between base+adapter and the merged model, both in fp32 on the CPU.

    `merged_dir` is a saved merged folder (saved in fp32 to compare like with like); without it the
    adapter is merged in memory. The inputs are the model's own: a generative model's chat prompts for `texts`
    (Artifact.chat_prompt), a head model's texts as it classifies them (its label logits)."""
    artifact = find_artifact(target)
    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(artifact.path, ModelConfig())
    base_dir = artifact.base_dir()
    adapted = _adapted(artifact, base_dir).eval()
    if merged_dir is None:
        merged = _adapted(artifact, base_dir).merge_and_unload().eval()
    else:
        merged = (load_classifier if artifact.has_head else load_model)(Path(merged_dir), torch.float32, cpu).eval()
    if artifact.has_head:
        inputs = [torch.tensor([ids]) for ids in encode_texts(texts, tokenizer, artifact.max_length)]
    else:
        inputs = [tokenizer(artifact.chat_prompt(tokenizer, t), return_tensors="pt", add_special_tokens=False)["input_ids"]
                  for t in texts]
    return max((adapted(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item() for ids in inputs)


# --------------------------------------------------------------------------------------------------
# vLLM hand-off


def vllm_base_reference(model_cfg: ModelConfig) -> tuple[str, list[str]]:
    """What `vllm serve` should load as the base: a hub id as is, everything else as its local folder."""
    from emotune.model.loading import HUB_PREFIXES, looks_like_hub_id

    source = model_cfg.source
    if source.startswith("hf:") or (not source.startswith(HUB_PREFIXES) and looks_like_hub_id(source)):
        repo = source.removeprefix("hf:")
        return repo, (["--revision", model_cfg.revision] if model_cfg.revision else [])
    return str(resolve_model_dir(model_cfg).resolve()), []


def vllm_lora_args(artifact: Artifact, adapter_path: str, base: str, extra: list[str]) -> list[str]:
    rank = max_lora_rank(adapter_config(artifact.path))
    from emotune.deploy.vllm_ready import max_model_len_args

    return ["serve", base, *extra, "--enable-lora", "--lora-modules", f"{artifact.name}={adapter_path}",
            "--max-lora-rank", str(rank), "--max-loras", "4", "--generation-config", "auto", *max_model_len_args(artifact)]


def vllm_merged_args(artifact: Artifact, merged_path: str) -> list[str]:
    from emotune.deploy.vllm_ready import max_model_len_args

    return ["serve", merged_path, "--served-model-name", artifact.name, "--generation-config", "auto",
            *max_model_len_args(artifact)]


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
        # the path as a quoted literal: a newline in a folder name would end the comment and run what followed
        f'EXPORT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")/.." && pwd)"  # written at {str(export_dir)!r}\n'
        f'exec vllm {quoted} "$@"\n',
        encoding="utf-8")
    path.chmod(0o755)


_CLEANING_CODE = '''CLEANING = {cleaning!r}  # the text steps the training rows went through (emotune.json's `cleaning`)


def clean(text: str) -> str:
    """The text as the model's training rows were cleaned, where emotune is installed beside this client (its
    `clean_for_inference`, as `emotune serve` and `predict` clean); vLLM itself receives a text as sent."""
    try:
        from emotune.data.clean import clean_for_inference
    except ImportError:
        return text
    return clean_for_inference([text], CLEANING)[0]
'''
"""The exported clients' cleaning: vLLM, llama.cpp and Ollama send a text to the model as given, so a client that
should ask as `emotune serve` does cleans first (docs/deploy.md)."""


def _client_example(artifact: Artifact) -> str:
    if artifact.answers_freely:
        return _chat_client_example(artifact)
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
{_CLEANING_CODE.format(cleaning=artifact.meta.get("cleaning"))}

def classify(client: OpenAI, text: str, legacy: bool = False) -> str:
    constraint = {{"guided_choice": LABELS}} if legacy else {{"structured_outputs": {{"choice": LABELS}}}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{{"role": "system", "content": SYSTEM_PROMPT}},
                  {{"role": "user", "content": USER_TEMPLATE.replace("{{text}}", clean(text))}}],
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


def _chat_client_example(artifact: Artifact) -> str:
    """An sft model answers in free text: plain chat under the system prompt it was trained with, no constraint."""
    return f'''"""Chat with the vLLM server started by serve_lora.sh or serve_merged.sh (also works with `emotune serve`).

Written by `emotune export --vllm`. Usage: python client.py "your instruction" [--base-url URL] [--stream]
The system prompt is the one the model was trained with (None: it was trained without one).
"""

import argparse

from openai import OpenAI

MODEL = {artifact.name!r}
SYSTEM_PROMPT = {artifact.sft_system_prompt!r}
{_CLEANING_CODE.format(cleaning=artifact.meta.get("cleaning"))}

def chat(client: OpenAI, text: str, max_tokens: int = 256, stream: bool = False) -> str:
    messages = ([{{"role": "system", "content": SYSTEM_PROMPT}}] if SYSTEM_PROMPT else []) + [
        {{"role": "user", "content": clean(text)}}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=max_tokens,
                                           stream=stream)
    if not stream:
        return reply.choices[0].message.content
    pieces = []
    for chunk in reply:
        piece = (chunk.choices[0].delta.content or "") if chunk.choices else ""
        print(piece, end="", flush=True)
        pieces.append(piece)
    print()
    return "".join(pieces)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("text")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stream", action="store_true", help="print the reply as it is generated")
    args = parser.parse_args()
    answer = chat(OpenAI(base_url=args.base_url, api_key=args.api_key), args.text, args.max_tokens, args.stream)
    if not args.stream:
        print(answer)
'''
