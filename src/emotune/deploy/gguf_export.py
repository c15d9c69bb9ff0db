"""`emotune export RUN --format gguf|ollama --quant Q`: the merged model as GGUF, the LoRA as an adapter GGUF,
and for Ollama a Modelfile.

The export folder gets, beside what `emotune export --merge` writes (adapter/, merged/, config.yaml):

    gguf/<name>-<quant>.gguf   the merged model (emotune.deploy.gguf_write); k-quants made from <name>-f16.gguf
    gguf/<name>-lora.gguf      the LoRA alone, for llama.cpp's --lora over the base model's GGUF (plain LoRA only)
    ollama/Modelfile           (--format ollama) FROM the merged GGUF, with the chat template, stop tokens, system
                               prompt and parameters; `ollama create` is printed

The merged folder is made by emotune.deploy.export (one merge for every format), then converted.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from emotune.core.errors import UserError

FORMATS = ("hf", "gguf", "ollama")


def export_gguf(run_dir: str | Path, out: str | Path | None, quant: str, ollama: bool, force: bool,
                vllm: bool = False) -> Path:
    from transformers import AutoConfig

    from emotune.deploy import gguf_arch, gguf_write
    from emotune.deploy.export import export
    from emotune.model.artifacts import find_artifact
    from emotune.model.loading import resolve_model_dir

    gguf_write.check_quant(quant)
    artifact = find_artifact(run_dir)
    if artifact.has_head:
        raise UserError(f"`{run_dir}` holds a classification-head model (task {artifact.task}): it answers with label "
                        "probabilities from a trained head that llama.cpp has no place for. Export it with --merge "
                        "(transformers) and serve it with `emotune serve`.")
    base_dir = resolve_model_dir(artifact.model_cfg)
    base_config = AutoConfig.from_pretrained(base_dir)
    model_type, family, text_config = gguf_arch.family_of(base_config)  # refuse before merging anything
    gguf_arch.check_layout(model_type, text_config)
    _check_vocabulary(base_dir, family, text_config)
    if ollama:
        from emotune.deploy.ollama import artifact_modelfile

        artifact_modelfile(artifact, model_type, "check.gguf")

    out = export(run_dir, out=out, merge=True, vllm=vllm, force=force)
    folder = out / "gguf"
    folder.mkdir(exist_ok=True)
    meta = gguf_write.gguf_meta(artifact)
    written_quant = "f16" if quant in gguf_write.K_QUANTS else quant
    model_file = folder / f"{artifact.name}-{written_quant}.gguf"
    print(f"Writing {model_file} ...", flush=True)
    gguf_write.write_gguf(out / "merged", model_file, written_quant, meta, vocab_dir=base_dir)
    if quant in gguf_write.K_QUANTS:
        k_file = folder / f"{artifact.name}-{quant}.gguf"
        if gguf_write.make_k_quant(model_file, k_file, quant):
            model_file = k_file
    if not artifact.merged:  # a full / freeze run has no adapter to write beside the model
        _write_lora(artifact, base_config, folder)
    if ollama:
        from emotune.deploy.ollama import write_modelfile

        modelfile = write_modelfile(artifact, model_type, model_file, out / "ollama")
        print("Create the Ollama model with:\n  " + shlex.join(["ollama", "create", artifact.name, "-f", str(modelfile)]),
              flush=True)
    print(f"GGUF: {model_file}", flush=True)
    return out


def _check_vocabulary(base_dir: Path, family, text_config) -> None:
    """Build the vocabulary the GGUF file will hold (from the base model's tokenizer) once before the merge, so a
    tokenizer llama.cpp cannot read (a WordLevel one, an unnamed split pattern) is refused before anything is written."""
    from transformers import AutoTokenizer

    from emotune.deploy.gguf_vocab import build_vocab

    build_vocab(base_dir, AutoTokenizer.from_pretrained(base_dir), text_config.vocab_size, family.vocab_model)


def _write_lora(artifact, base_config, folder: Path) -> Path | None:
    from emotune.deploy.gguf_lora import write_lora_gguf

    target = folder / f"{artifact.name}-lora.gguf"
    try:
        write_lora_gguf(artifact.path, base_config, target, artifact.name)
    except UserError as err:  # the merged GGUF is the product; the adapter file is a bonus some adapters cannot be
        print(f"No LoRA adapter GGUF: {err}", flush=True)
        return None
    print(f"LoRA adapter GGUF: {target} (apply over the base model's GGUF with llama.cpp's --lora)", flush=True)
    return target


