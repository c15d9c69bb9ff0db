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

    gguf_write.check_quant(quant)
    artifact = find_artifact(run_dir)
    if artifact.has_head:
        raise UserError(f"`{run_dir}` holds a classification-head model (task {artifact.task}): it answers with label "
                        "probabilities from a trained head that llama.cpp has no place for. Export it with --merge "
                        "(transformers) and serve it with `emotune serve`.")
    base_dir = artifact.base_dir()
    base_config = AutoConfig.from_pretrained(base_dir)
    model_type, family, text_config = gguf_arch.family_of(base_config)  # refuse before merging anything
    gguf_arch.check_layout(model_type, text_config)
    _check_vocabulary(base_dir, family, text_config)
    if ollama:
        from emotune.deploy.ollama import artifact_modelfile

        artifact_modelfile(artifact, model_type, "check.gguf")

    written = {}

    def write_formats(folder: Path) -> None:  # into the export's temporary folder: a failure keeps an earlier export
        written.update(_write_formats(artifact, folder, quant, base_dir, base_config, model_type, ollama))

    out = export(run_dir, out=out, merge=True, vllm=vllm, force=force, finish=write_formats)
    if written["k_quant"]:  # the quantizer is not here: its command, on the files where they now are
        f16_name, k_name = written["k_quant"]
        print("K-quants need llama.cpp's quantizer, which is not installed here. From the f16 file, run:\n  "
              + shlex.join(gguf_write.k_quant_command(out / "gguf" / f16_name, out / "gguf" / k_name, quant)), flush=True)
    if ollama:
        print("Create the Ollama model with:\n  " + shlex.join(["ollama", "create", artifact.name, "-f",
                                                               str(out / "ollama" / "Modelfile")]), flush=True)
    print(f"GGUF: {out / 'gguf' / written['model_file']}", flush=True)
    return out


def _write_formats(artifact, folder: Path, quant: str, base_dir: Path, base_config, model_type: str, ollama: bool) -> dict:
    """gguf/ (and ollama/) in `folder`, beside its merged/: the name of the model file written, and (f16 file, k-quant
    file) where a k-quant was asked for and llama.cpp's quantizer is not here."""
    from emotune.deploy import gguf_write

    gguf_dir = folder / "gguf"
    gguf_dir.mkdir(exist_ok=True)
    written_quant = "f16" if quant in gguf_write.K_QUANTS else quant
    model_file = gguf_dir / f"{artifact.name}-{written_quant}.gguf"
    print(f"Writing gguf/{model_file.name} ...", flush=True)
    gguf_write.write_gguf(folder / "merged", model_file, written_quant, gguf_write.gguf_meta(artifact), vocab_dir=base_dir)
    k_quant = None
    if quant in gguf_write.K_QUANTS:
        k_file = gguf_dir / f"{artifact.name}-{quant}.gguf"
        if gguf_write.make_k_quant(model_file, k_file, quant, announce=False):
            model_file = k_file
        else:
            k_quant = (model_file.name, k_file.name)
    if not artifact.merged:  # a full / freeze run has no adapter to write beside the model
        _write_lora(artifact, base_config, gguf_dir)
    if ollama:
        from emotune.deploy.ollama import write_modelfile

        write_modelfile(artifact, model_type, model_file, folder / "ollama")
    return {"model_file": model_file.name, "k_quant": k_quant}


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


