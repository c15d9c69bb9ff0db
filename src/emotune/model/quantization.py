"""Quantized base models (QLoRA): the base's linear layers in 4 or 8 bits through bitsandbytes, LoRA on top.

`model.quantization: 4bit` loads every linear layer of the base as a bitsandbytes `Linear4bit` (NF4 or FP4,
`model.quant_type`; the per-block scales quantized again with `model.double_quant`), `8bit` as LLM.int8()
`Linear8bitLt`, through transformers' `BitsAndBytesConfig`. The products run in the compute dtype, the dtype the
weights would load in unquantized (`model.dtype`, `auto` = the precision chosen for the device). The output
projection and the embeddings stay unquantized (transformers keeps the output layer out; embeddings are not
linear layers).

One PyPI wheel of bitsandbytes (0.50.2) carries the CUDA, ROCm and CPU libraries, so the same config runs on all
three. Where it cannot run it is refused before any weight loads (`check`): bitsandbytes missing, an MPS device,
a model folder already quantized by another method, or a GPU whose architecture the wheel's library does not
cover (found by quantizing a small tensor on the device, which is what fails there).

k-bit preparation (`prepare_for_training`) differs from PEFT's `prepare_model_for_kbit_training` on purpose: PEFT
casts every parameter it does not quantize to fp32, and Gemma 4 E4B's ~3.5 B embedding parameters (262,144 x
(2,560 + 42 x 256)) would then take ~14 GB, more than the quantized rest of the model. Here the embeddings keep
the compute dtype and only the norms go to fp32 (their few weights set the scale of every activation, as in
LLaMA-Factory's `upcast_layernorm`), handing their output on in the compute dtype as Gemma's norms do; gradient
checkpointing is emotune.model.lora's non-reentrant kind, which needs
no input that requires grad.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from emotune.core.config.model import ModelConfig
from emotune.core.errors import UserError, first_line

INSTALL = "pip install 'bitsandbytes>=0.50.2' (its PyPI wheel carries the CUDA, ROCm and CPU libraries), or `pip install emotune[qlora]`"


def import_bitsandbytes_offline() -> None:
    """Import bitsandbytes (when installed) with the Hugging Face hub offline, before PEFT imports it.

    On CPUs with AVX512-BF16, bitsandbytes 0.50 asks the hub at import for a compiled CPU kernel
    (`kernels-community/quantization-bitsandbytes`, bitsandbytes/backends/cpu/ops.py) and would run code
    downloaded from it; PEFT imports bitsandbytes whenever it is installed, so every command would try. emotune
    runs no code from the hub: offline, bitsandbytes uses its own CPU kernels (it says so in one log line)."""
    import sys

    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    import logging

    import huggingface_hub.constants as hub

    loggers = [logging.getLogger(name) for name in ("bitsandbytes", "kernels")]
    levels = [logger.level for logger in loggers]
    was, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    for logger in loggers:  # the kernel's absence is expected here, not worth two lines of warnings
        logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken install is reported by `check` when quantization is asked for)
        pass
    finally:
        hub.HF_HUB_OFFLINE = was
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def bits(cfg: ModelConfig) -> int | None:
    """4 or 8 for a quantized base, None for none."""
    return {"4bit": 4, "8bit": 8}.get(cfg.quantization)


def bnb_config(cfg: ModelConfig, compute_dtype: torch.dtype, model_dir: Path | None = None):
    """transformers' BitsAndBytesConfig for `model.quantization` (None when the base is not quantized); with the
    model's folder, its mixture-of-experts routers are kept unquantized (`kept_unquantized`)."""
    if bits(cfg) is None:
        return None
    from transformers import BitsAndBytesConfig

    kept = kept_unquantized(model_dir) if model_dir is not None else None
    skip = {"llm_int8_skip_modules": kept} if kept else {}
    if bits(cfg) == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.quant_type,
                              bnb_4bit_use_double_quant=cfg.double_quant, bnb_4bit_compute_dtype=compute_dtype, **skip)


def kept_unquantized(model_dir: Path) -> list[str] | None:
    """What a quantized load leaves unquantized when the model's routers hold linear layers (Gemma 4 26B-A4B's
    `router.proj`): transformers' own list (the output layer and what is tied to it) and those routers, whose few
    weights decide which experts every token takes, so rounding them to 4 bits would change the routing itself.
    None for other models: transformers' own list then applies as it is (a list given replaces it)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    from emotune.model.text import routers

    model = _meta_model(model_dir)
    found = routers(model) if model is not None else []
    return sorted({*get_keys_to_not_convert(model), *found}) if found else None


def describe(cfg: ModelConfig, compute_dtype: torch.dtype) -> str:
    """One line saying how the base is stored: printed at load, written into run.json."""
    if bits(cfg) is None:
        return "not quantized"
    kind = (f"4-bit {cfg.quant_type.upper()}" + (" + double quantization" if cfg.double_quant else "")
            if bits(cfg) == 4 else "8-bit LLM.int8()")
    return (f"{kind} linear layers (bitsandbytes), computing in {str(compute_dtype).removeprefix('torch.')}; "
            "embeddings and output layer unquantized, norms in fp32 while training")


def check(cfg: ModelConfig, model_dir: Path | None, device: torch.device, compute_dtype: torch.dtype,
          use_dora: bool = False) -> None:
    """Refuse, before any weight loads, a quantized base that cannot run here, with every reason and what to do."""
    if bits(cfg) is None:
        return
    problems = []
    what = f"model.quantization={cfg.quantization}"
    if use_dora and bits(cfg) == 8 and device.type == "cpu":
        # PEFT's DoRA dequantizes the weight, after which bitsandbytes' CPU int8 product finds no scales
        # (AttributeError in MatMul8bitFp.forward, bitsandbytes 0.50.2)
        problems.append("DoRA (lora.use_dora=true) over 8-bit layers fails on the CPU in bitsandbytes 0.50.2; use "
                        "model.quantization=4bit with DoRA, or plain LoRA over 8 bits")
    if device.type == "mps":
        problems.append("bitsandbytes has no Apple MPS backend: train on a CUDA or ROCm GPU or on the CPU "
                        "(device=cpu), or set model.quantization=none")
    if model_dir is not None:
        problems += _already_quantized(model_dir) or _nothing_to_quantize(model_dir)
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append(f"the bitsandbytes package is not installed: {INSTALL}")
    elif not problems:
        problem = _device_probe(cfg, device, compute_dtype)
        if problem:
            problems.append(problem)
    if problems:
        raise UserError(f"{what} cannot be used here: {'; '.join(problems)}.")
    if model_dir is not None:
        note = _unquantized_experts(model_dir, compute_dtype)
        if note:
            print(note, flush=True)


def _meta_model(model_dir: Path):
    """An empty (meta-device) copy of the model built from config.json, None when it cannot be built here."""
    from transformers import AutoConfig

    from emotune.model.text import causal_lm_class

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            return causal_lm_class(config).from_config(config)
    except Exception:  # noqa: BLE001 (loading reports an unreadable model itself)
        return None


def _unquantized_experts(model_dir: Path, compute_dtype: torch.dtype) -> str | None:
    """A mixture-of-experts model's routed experts are 3-D weights, which bitsandbytes does not quantize (transformers
    replaces linear layers only): say how much of the base stays in the compute dtype, so 4 bits is not read as a
    quarter of the model. None for other models."""
    from emotune.model.text import expert_weights

    model = _meta_model(model_dir)
    names = set(expert_weights(model)) if model is not None else set()
    if not names:
        return None
    experts = sum(p.numel() for name, p in model.named_parameters() if name in names)
    total = sum(p.numel() for p in model.parameters())
    size = experts * torch.empty((), dtype=compute_dtype).element_size() / 2**30
    return (f"Note: {type(model).__name__}'s routed experts ({experts:,} of its {total:,} parameters, "
            f"{100 * experts / total:.0f}%; {size:.2f} GiB in {str(compute_dtype).removeprefix('torch.')}) stay unquantized: bitsandbytes "
            "quantizes linear layers only, and transformers keeps the experts as 3-D weights. `emotune plan` counts "
            "them so.")


def _nothing_to_quantize(model_dir: Path) -> list[str]:
    """A model none of whose layers transformers' bitsandbytes integration replaces: it takes layers whose type is
    exactly `torch.nn.Linear`, and GPT-2's Conv1D (`replace_with_bnb_linear`), so Falcon's `FalconLinear` (a subclass)
    stayed in the compute dtype and the 'quantized' run trained an unquantized base at full size, saying only '0
    weights quantized'. Read from an empty (meta-device) copy built from config.json."""
    from transformers.pytorch_utils import Conv1D

    model = _meta_model(model_dir)
    if model is None:
        return []
    output = model.get_output_embeddings()
    linear = [m for m in model.modules() if m is not output and (type(m) is torch.nn.Linear or isinstance(m, Conv1D))]
    if linear:
        return []
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output})
    return [f"transformers' bitsandbytes integration quantizes layers of type torch.nn.Linear (and GPT-2's Conv1D) "
            f"only, and {type(model).__name__}'s are {', '.join(kinds) or 'none'}, so nothing would be quantized and "
            "the base would train at full size; set model.quantization=none (LoRA over the unquantized base)"]


def _already_quantized(model_dir: Path) -> list[str]:
    """A folder whose config.json says its weights are quantized already (GPTQ, AWQ, a bitsandbytes save, ...)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    method = (config.get("quantization_config") or {}).get("quant_method")
    if not method:
        return []
    return [f"the model folder {model_dir} holds weights quantized already ({method}); bitsandbytes quantizes "
            "full-precision weights only, so point model.source at the unquantized checkpoint (bf16/fp16/fp32 "
            "safetensors) or set model.quantization=none to train on these weights as transformers loads them"]


def nf4_problem(device: torch.device) -> str | None:
    """Why bitsandbytes cannot round to NF4 on `device` (not installed, no kernels for it), or None."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"the bitsandbytes package is not installed: {INSTALL}"
    if device.type == "mps":
        return "bitsandbytes has no Apple MPS backend"
    import_bitsandbytes_offline()
    return _device_probe(ModelConfig(quantization="4bit", double_quant=False), device, torch.float32)


def _device_probe(cfg: ModelConfig, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """Quantize and dequantize a small tensor on `device`: a GPU architecture the library was not built for fails
    here (ROCm: `invalid device function`), in a second instead of after loading the weights."""
    try:
        import bitsandbytes.functional as F
        from bitsandbytes import cextension
    except Exception as err:  # noqa: BLE001 (a broken install fails in many ways; all end the same for the user)
        return f"bitsandbytes does not import ({type(err).__name__}: {first_line(err)}); reinstall it: {INSTALL}"
    if device.type == "cuda" and type(cextension.lib).__name__ == "ErrorHandlerMockBNBNativeLibrary":
        return (f"bitsandbytes found no {cextension.BNB_BACKEND} library for this GPU and its torch build "
                f"(torch {torch.__version__}); upgrade it: {INSTALL}")
    try:
        sample = torch.randn(64, 64, device=device, dtype=compute_dtype)
        if bits(cfg) == 4:
            packed, state = F.quantize_4bit(sample, quant_type=cfg.quant_type, compress_statistics=cfg.double_quant)
            back = F.dequantize_4bit(packed, state)
        else:
            packed, scales, _ = F.int8_vectorwise_quant(sample)
            back = F.int8_vectorwise_dequant(packed, scales)
        ok = bool(torch.isfinite(back).all()) and float((back.float() - sample.float()).abs().max()) < 1.0
    except Exception as err:  # noqa: BLE001 (the kernels' own error says what is missing)
        name = _device_name(device)
        return (f"bitsandbytes cannot run {bits(cfg)}-bit kernels on {name} ({type(err).__name__}: {first_line(err)}); "
                f"its library does not cover this device: upgrade bitsandbytes ({INSTALL}), or set model.quantization=none")
    if not ok:
        return f"a {bits(cfg)}-bit round trip on {_device_name(device)} came back wrong; set model.quantization=none"
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type.upper()
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", None)
    return f"{torch.cuda.get_device_name(device)}" + (f" ({arch})" if arch else "")


def keep_trainable_layout(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' 4-bit layers in the layout its autograd functions differentiate; returns how many were
    repacked back.

    On CPUs with AVX512-BF16, `Linear4bit.forward` repacks its weight for a faster inference kernel the first time
    it runs in eval mode without gradients (an evaluation, a validation), and from then on every product, in
    training too, goes through that kernel, which has no backward (`bitsandbytes::gemv_4bit: an autograd kernel
    was not registered`): the gradients below it would be silently wrong. So the repacking is switched off, and a
    weight repacked already is converted back."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    repacked = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
            repacked += 1
    return repacked


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether `model` (or the model a PEFT model wraps) was loaded with quantized weights."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(inner, "is_quantized", False)) or getattr(inner, "hf_quantizer", None) is not None


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in type(module).__name__.lower()


def prepare_for_training(model: torch.nn.Module) -> dict[str, int]:
    """Freeze the quantized base and cast only its norms to fp32 (embeddings stay in the compute dtype).

    Returns the parameter counts by how they are stored, for the message printed at start."""
    counts = {"quantized": 0, "fp32 norms": 0, "unquantized": 0}
    keep_trainable_layout(model)
    seen: set[int] = set()  # tied weights (Gemma's embeddings and output layer) are one parameter
    for module in model.modules():
        upcast = False
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            param.requires_grad_(False)
            if not param.is_floating_point():  # Params4bit / Int8Params: packed integers
                counts["quantized"] += _logical_numel(param)
            elif _is_norm(module):
                param.data = param.data.float()
                counts["fp32 norms"] += param.numel()
                upcast = True
            else:
                counts["unquantized"] += param.numel()
        if upcast and not getattr(module, "_emotune_returns_input_dtype", False):
            module.register_forward_hook(_output_in_input_dtype, with_kwargs=True)
            module._emotune_returns_input_dtype = True
    return counts


def _output_in_input_dtype(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """A norm in fp32 returns the dtype of its input (the compute dtype), as Gemma's norms do themselves. Llama's,
    Qwen's, Mistral's, OLMo's and SmolLM3's return `weight * x.to(input dtype)`, which an fp32 weight promotes to fp32:
    the output layer, a mixture-of-experts router and its 3-D experts then multiplied fp32 activations by
    compute-dtype weights ('expected m1 and m2 to have the same dtype'); bitsandbytes' layers cast, they do not."""
    given = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if given is None or not isinstance(output, torch.Tensor) or output.dtype == given.dtype:
        return output
    return output.to(given.dtype)


def _logical_numel(param: torch.Tensor) -> int:
    """The weight's own element count: a 4-bit parameter stores two per byte, its quant_state knows the shape."""
    state = getattr(param, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None else param.numel()


def describe_preparation(counts: dict[str, int]) -> str:
    return (f"Quantized base prepared for training: {counts['quantized']:,} weights quantized, {counts['unquantized']:,} "
            f"unquantized (embeddings and the rest, in the compute dtype), {counts['fp32 norms']:,} norm weights in fp32")


# --------------------------------------------------------------------------------------------------
# What a quantized base holds, for `emotune plan` (on a model built on the meta device, adapters attached)


def _quantized_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers transformers quantizes: every frozen one but the output layer (the adapters' own A and B
    are linear layers too, and stay as they are)."""
    from emotune.model.text import routers

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = inner.get_output_embeddings()
    kept = {id(m) for name in routers(model) for m in model.get_submodule(name).modules()}  # kept_unquantized
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output
            and not m.weight.requires_grad and id(m) not in kept]


def stored_weight_bytes(model: torch.nn.Module, cfg: ModelConfig) -> int:
    """Bytes of `model`'s frozen weights and buffers as they are held while training with `cfg.quantization`:
    4-bit = half a byte per weight plus one scale per block of 64 (fp32, or 8 bits with double quantization plus
    an fp32 scale per 256 of those); 8-bit = one byte plus an fp32 scale per output row; norms in fp32."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    frozen += sum(b.numel() * b.element_size() for b in model.buffers())
    if bits(cfg) is None:
        return frozen
    for layer in _quantized_linears(model):
        n = layer.weight.numel()
        if bits(cfg) == 4:
            scales = n / 64 * (1 + 4 / 256) if cfg.double_quant else n / 64 * 4
            stored = n / 2 + scales
        else:
            stored = n + 4 * layer.weight.shape[0]
        frozen += int(stored) - n * layer.weight.element_size()
    norms = [p for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False) if not p.requires_grad]
    return frozen + sum(p.numel() * (4 - p.element_size()) for p in norms)


def dequantized_layer_bytes(model: torch.nn.Module, cfg: ModelConfig) -> int:
    """The largest quantized layer's weight dequantized into the compute dtype: bitsandbytes builds it for each
    product (forward and backward), one layer at a time."""
    if bits(cfg) is None:
        return 0
    return max((m.weight.numel() * m.weight.element_size() for m in _quantized_linears(model)), default=0)
