"""A merged Hugging Face folder as one GGUF file for llama.cpp, LM Studio and Ollama.

`write_gguf(model_dir, target, quant, meta)` writes the text model's weights in `quant` (f16, bf16, q8_0, q4_0;
norms and other 1-D tensors stay f32, as llama.cpp's converter keeps them), the tokenizer (emotune.deploy.
gguf_vocab), the chat template, and emotune's own keys: the task, labels, system prompt and user template, so a
GGUF file alone says how to ask it. Tensors are read one at a time from the safetensors files and streamed to the
file, so a model needs its own size in memory once, not twice.

K-quants (q4_k_m ...) need llama.cpp's quantizer, which picks a type per tensor from their statistics:
`k_quant_command` names the call that turns the f16 file into one.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, get_tensor_name_map
from gguf.quants import quant_shape_to_byte_shape, quantize

from emotune.core.errors import UserError
from emotune.core.rundir import atomic_file
from emotune.deploy import gguf_arch
from emotune.deploy.gguf_vocab import build_vocab

QUANTS = {
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
K_QUANTS = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q3_k_m", "q2_k")
EMOTUNE_KEYS = ("task", "labels", "system_prompt", "user_template", "base_model")
# text-model tensors of multimodal checkpoints sit under these prefixes; the rest (vision tower, projector) is left out
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
SKIPPED_PREFIXES = tuple(prefix + part for prefix in ("model.", "") for part in (
    "vision_tower.", "multi_modal_projector.", "audio_tower.", "embed_vision.", "embed_audio."))


@dataclass
class Planned:
    source: str  # the name in the safetensors file
    name: str  # the GGUF tensor name
    qtype: GGMLQuantizationType


def check_quant(quant: str) -> None:
    if quant in K_QUANTS:
        return
    if quant not in QUANTS:
        raise UserError(f"--quant {quant} is not one emotune writes. Choose f16, bf16, q8_0 or q4_0 (written here), or a "
                        f"k-quant ({', '.join(K_QUANTS)}), which llama.cpp's quantizer makes from the f16 file.")


def write_gguf(model_dir: Path, target: Path, quant: str, meta: dict, vocab_dir: Path | None = None) -> Path:
    """`model_dir` (a merged Hugging Face folder) as `target`; `vocab_dir`: where the tokenizer came from when
    that is not `model_dir` (the base folder, whose own GGUF file holds the exact vocabulary)."""
    from transformers import AutoConfig, AutoTokenizer

    qtype, file_type = QUANTS[quant]
    config = AutoConfig.from_pretrained(model_dir)
    model_type, family, text = gguf_arch.family_of(config)
    gguf_arch.check_layout(model_type, text)  # before any weight is read
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"`{model_dir}` has no .safetensors weights; GGUF export reads a merged folder saved by emotune.")
    plan, vocab_size = _plan(files, family, text, qtype)
    vocab = build_vocab(vocab_dir or model_dir, tokenizer, vocab_size, family.vocab_model)
    if vocab_dir is not None and vocab.copied is None:
        vocab = build_vocab(model_dir, tokenizer, vocab_size, family.vocab_model)

    writer = GGUFWriter(path=None, arch=arch_name(family))
    writer.add_type("model")
    writer.add_name(str(meta.get("name") or model_dir.name))
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    gguf_arch.write_hparams(writer, model_type, family, text, vocab_size)
    vocab.write(writer)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
    _write_emotune_keys(writer, meta)
    freqs = gguf_arch.rope_freqs(model_type, text)
    with atomic_file(target) as partial:
        _stream(writer, partial, files, plan, family, text, freqs)
    return target


def arch_name(family: gguf_arch.Family) -> str:
    from gguf import MODEL_ARCH_NAMES

    return MODEL_ARCH_NAMES[family.arch]


def _text_name(name: str) -> str | None:
    """A checkpoint tensor's name in the text model, None for tensors that are not part of it."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix, replacement in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def _plan(files: list[Path], family: gguf_arch.Family, config, qtype: GGMLQuantizationType) -> tuple[list[Planned], int]:
    """Every text tensor's GGUF name and type, in file order, and the vocabulary size (embedding rows)."""
    from safetensors import safe_open

    names = get_tensor_name_map(family.arch, int(config.num_hidden_layers))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan, vocab_size, unknown = [], 0, []
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for source in handle.keys():
                text_name = _text_name(source)
                if text_name is None or (tied and text_name == "lm_head.weight"):
                    continue
                stem, suffix = _stem(text_name)
                mapped = names.get_name(stem)
                if mapped is None:
                    unknown.append(source)
                    continue
                shape = handle.get_slice(source).get_shape()
                if text_name == "model.embed_tokens.weight":
                    vocab_size = shape[0]
                plan.append(Planned(source, f"{mapped}.{suffix}", _tensor_type(mapped, shape, qtype)))
    if unknown:
        raise UserError(f"{len(unknown)} weights have no place in llama.cpp's {family.arch.name.lower()} layout "
                        f"(e.g. {unknown[:3]}); the checkpoint is not a plain model of this family. Export --merge instead.")
    return plan, vocab_size


def _stem(text_name: str) -> tuple[str, str]:
    """(module, parameter) of a tensor name; a bare parameter (Gemma 4's `layers.N.layer_scalar`) is the module's
    own name, stored in GGUF as `<name>.weight` as llama.cpp's converter stores it."""
    stem, _, suffix = text_name.rpartition(".")
    if suffix in ("weight", "bias"):
        return stem, suffix
    return text_name, "weight"


def _tensor_type(name: str, shape: list[int], qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    if len(shape) < 2:
        return GGMLQuantizationType.F32  # norms and biases: too small to matter, and llama.cpp reads them as f32
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0) and shape[-1] % 32:
        return GGMLQuantizationType.F16  # block quants need rows in whole blocks of 32
    if qtype == GGMLQuantizationType.Q4_0 and name == "token_embd":
        # the embedding is also the output layer when tied; llama-quantize keeps that layer above 4 bits too
        return GGMLQuantizationType.Q8_0
    return qtype


def _encode(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return quantize(data.astype(np.float32), qtype)


def _stream(writer: GGUFWriter, path: Path, files: list[Path], plan: list[Planned], family, config, freqs) -> None:
    from safetensors import safe_open

    for item in plan:
        shape = _shape_of(files, item.source)
        if item.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if item.qtype == GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(item.name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = quant_shape_to_byte_shape(shape, item.qtype)
            writer.add_tensor_info(item.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=item.qtype)
    if freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", freqs.shape, np.dtype(np.float32), freqs.nbytes)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    by_file = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            by_file.update({k: file for k in handle.keys()})
    for item in plan:
        with safe_open(by_file[item.source], framework="pt") as handle:
            data = handle.get_tensor(item.source).float().numpy()
        data = gguf_arch.transform(_text_name(item.source), data, family, config)
        writer.write_tensor_data(_encode(data, item.qtype))
    if freqs is not None:
        writer.write_tensor_data(freqs)
    writer.close()


def _shape_of(files: list[Path], source: str) -> tuple[int, ...]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as handle:
            if source in handle.keys():
                return tuple(handle.get_slice(source).get_shape())
    raise KeyError(source)


def _write_emotune_keys(writer: GGUFWriter, meta: dict) -> None:
    """emotune's own keys, so the file alone says how to ask it (read back by `read_emotune_keys`)."""
    for key in EMOTUNE_KEYS:
        value = meta.get(key)
        if isinstance(value, list):
            writer.add_array(f"emotune.{key}", [str(v) for v in value])
        elif value is not None:
            writer.add_string(f"emotune.{key}", str(value))


def read_emotune_keys(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {key.removeprefix("emotune."): field.contents() for key, field in reader.fields.items()
            if key.startswith("emotune.")}


def k_quant_command(f16_file: Path, target: Path, quant: str) -> list[str]:
    return [shutil.which("llama-quantize") or "llama-quantize", str(f16_file), str(target), quant.upper()]


def make_k_quant(f16_file: Path, target: Path, quant: str, announce: bool = True) -> bool:
    """Run llama.cpp's quantizer when it is here (the llama-quantize program, or llama-cpp-python's binding);
    otherwise print the command (unless not `announce`: the caller prints it) and return False."""
    import subprocess

    if shutil.which("llama-quantize"):
        done = subprocess.run(k_quant_command(f16_file, target, quant), capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1][:300]
            raise UserError(f"llama.cpp's llama-quantize ({shutil.which('llama-quantize')}) failed to make {quant} "
                            f"(exit {done.returncode}: {said}), so nothing was exported. Update llama.cpp, or export "
                            "with --quant q8_0 (or f16, bf16), which emotune writes without it.")
        return True
    try:
        import llama_cpp
    except ImportError:
        if announce:
            print("K-quants need llama.cpp's quantizer, which is not installed here. From the f16 file, run:\n  "
                  + shlex.join(k_quant_command(f16_file, target, quant)), flush=True)
        return False
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(LlamaFileType, f"MOSTLY_{quant.upper()}"))
    print(f"Quantizing {f16_file.name} to {quant} with llama.cpp ...", flush=True)
    if llama_cpp.llama_model_quantize(str(f16_file).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise UserError(f"llama.cpp's quantizer failed to write {target} from {f16_file}.")
    return True


def gguf_meta(artifact) -> dict:
    """emotune's keys for the GGUF file: what the model was trained to answer and how it is asked."""
    meta = {"name": artifact.name, "task": artifact.task, "base_model": artifact.meta.get("base_model")}
    if artifact.answers_freely:
        meta["system_prompt"] = artifact.sft_system_prompt
    else:
        from emotune.data import system_prompt

        meta.update(labels=artifact.labels, system_prompt=system_prompt(artifact.prompt, artifact.labels),
                    user_template=artifact.prompt.user_template)
    return meta
