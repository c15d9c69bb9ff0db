"""Backend, device and precision: what the machine can do, and the `emotune doctor` report.

ROCm builds of PyTorch expose AMD GPUs through the `torch.cuda` API and set `torch.version.hip`
(there is no `torch.hip` module), so "is this ROCm?" is a question about the build, not the device.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

from emotune.core.errors import UserError

# Consumer Radeon cards that ROCm does not officially list but that run with a gfx override.
# (gfx arch prefix -> HSA_OVERRIDE_GFX_VERSION value that users report working)
_GFX_OVERRIDES = {"gfx1031": "10.3.0", "gfx1032": "10.3.0", "gfx1034": "10.3.0", "gfx1035": "10.3.0",
                  "gfx1036": "10.3.0", "gfx1101": "11.0.0", "gfx1102": "11.0.0", "gfx1103": "11.0.0"}


@dataclass
class Precision:
    name: str  # "bf16" | "fp16" | "fp32"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.name]


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16: the name configs (`model.dtype`) and run records (emotune.json) use."""
    return str(dtype).removeprefix("torch.")


@dataclass
class GPU:
    index: int
    name: str
    memory_gib: float
    arch: str | None = None  # gfx arch on ROCm, compute capability on CUDA


@dataclass
class DoctorReport:
    backend: str  # "rocm" | "cuda" | "mps" | "cpu"
    torch_build: str
    gpus: list[GPU] = field(default_factory=list)
    bf16: bool = False
    fp16: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    hints: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "torch_build": self.torch_build,
            "device_count": len(self.gpus),
            "gpus": [vars(g) for g in self.gpus],
            "bf16": self.bf16,
            "fp16": self.fp16,
            "versions": self.versions,
            "hints": self.hints,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
        }


def detect_backend() -> str:
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


VISIBILITY = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpus() -> int:
    """GPUs PyTorch can use in this process (ROCm GPUs included), after the *_VISIBLE_DEVICES variables."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(preference: str = "auto", gpus: Callable[[], int] | None = None) -> torch.device:
    """The torch device for `device:` in the config; ROCm GPUs are `cuda` devices. `gpus` counts the visible
    GPUs (default `visible_gpus`, looked up when called, so tests can fake it). Checked before any weights load."""
    count = (gpus or visible_gpus)()
    mps = getattr(torch.backends, "mps", None)
    if preference == "auto":
        return torch.device("cuda" if count else "mps" if mps is not None and mps.is_available() else "cpu")
    if preference.startswith("cuda") and not count:
        raise UserError(f"`device: {preference}` was asked for but PyTorch sees no CUDA or ROCm GPU{_visibility()}. "
                        "Run `emotune doctor` to see why, or set device=auto to use what is there.")
    if preference.startswith("cuda:") and int(preference[5:]) >= count:
        raise UserError(f"`device: {preference}` was asked for but PyTorch sees {count} GPU(s), numbered from 0 to "
                        f"{count - 1}{_visibility()}. Pick one of them (device=cuda:0 ... cuda:{count - 1}), or make "
                        "the GPU visible (CUDA_VISIBLE_DEVICES on NVIDIA, HIP_VISIBLE_DEVICES on ROCm).")
    if preference == "mps" and (mps is None or not mps.is_available()):
        raise UserError("`device: mps` was asked for but MPS is not available. Set device=auto or device=cpu.")
    return torch.device(preference)


def _visibility() -> str:
    """The *_VISIBLE_DEVICES variables that are set, which decide what PyTorch sees and how GPUs are numbered."""
    found = [f"{name}={os.environ[name]!r}" for name in VISIBILITY if name in os.environ]
    return f" (with {', '.join(found)})" if found else ""


def make_current(device: torch.device) -> None:
    """Make a numbered GPU the current one, so that what libraries call plain `cuda` (Accelerate's device
    placement, autocast, the memory statistics) is this GPU, not GPU 0."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 instructions (AVX512-BF16 / AMX), so bf16 is fast, not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "mps":
        return True
    return cpu_supports_bf16()


def choose_precision(device: torch.device, requested: str = "auto") -> Precision:
    """bf16 where supported, fp16 on GPUs without bf16, fp32 otherwise; says why."""
    bf16 = bf16_supported(device)
    if requested == "bf16" and not bf16:
        raise UserError(f"`train.precision: bf16` was asked for but {device.type} here has no bf16 support. "
                        "Set train.precision=auto (or fp16 on a GPU, fp32 on a CPU).")
    if requested == "fp16" and device.type == "cpu":
        raise UserError("`train.precision: fp16` is not supported for training on a CPU. Set train.precision=auto or fp32.")
    if requested != "auto":
        return Precision(requested, "asked for in the config (train.precision)")
    if bf16:
        why = {"cuda": "the GPU supports bf16", "mps": "MPS supports bf16",
               "cpu": "this CPU has native bf16 instructions (AVX512-BF16/AMX)"}[device.type]
        return Precision("bf16", why)
    if device.type in ("cuda", "mps"):
        return Precision("fp16", f"the {device.type} device has no bf16; fp16 with loss scaling instead")
    return Precision("fp32", "this CPU has no native bf16, and fp16 is not supported for training on CPUs")


def package_versions() -> dict[str, str]:
    names = ["torch", "transformers", "peft", "trl", "datasets", "accelerate", "scikit-learn", "bitsandbytes", "emotune"]
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["python"] = platform.python_version()
    return versions


def _gpus(backend: str) -> list[GPU]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        if backend == "rocm":
            arch = getattr(props, "gcnArchName", None)
            arch = arch.split(":")[0] if arch else None
        else:
            arch = f"sm_{props.major}{props.minor}"
        gpus.append(GPU(i, props.name, round(props.total_memory / 2**30, 1), arch))
    return gpus


def _pci_gpu_vendors() -> set[str]:
    """GPU vendors visible on the PCI bus or through vendor tools, to catch a CPU-only torch on a GPU box."""
    vendors = set()
    if shutil.which("nvidia-smi") or os.path.exists("/proc/driver/nvidia"):
        vendors.add("nvidia")
    if shutil.which("rocm-smi") or shutil.which("amd-smi") or os.path.exists("/dev/kfd"):
        vendors.add("amd")
    if shutil.which("lspci") and not vendors:
        try:
            out = subprocess.run(["lspci"], capture_output=True, text=True, timeout=5).stdout.lower()
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if "vga" in line or "3d controller" in line or "display" in line:
                if "nvidia" in line:
                    vendors.add("nvidia")
                if "amd" in line or "advanced micro devices" in line or "radeon" in line:
                    vendors.add("amd")
    return vendors


def doctor() -> DoctorReport:
    backend = detect_backend()
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU-only"
    report = DoctorReport(backend=backend, torch_build=build, versions=package_versions())
    if backend in ("cuda", "rocm"):
        report.gpus = _gpus(backend)
        report.bf16 = torch.cuda.is_bf16_supported()
        report.fp16 = True
    elif backend == "mps":
        report.bf16 = report.fp16 = True
    else:
        report.bf16 = cpu_supports_bf16()
    report.hints = _hints(report)
    return report


def _hints(report: DoctorReport) -> list[str]:
    hints = []
    if report.backend == "cpu":
        vendors = _pci_gpu_vendors()
        if "amd" in vendors:
            hints.append("An AMD GPU is present but this PyTorch build cannot use it. Install a ROCm build: "
                         "pip install torch --index-url https://download.pytorch.org/whl/rocm6.4 (match your ROCm version).")
        if "nvidia" in vendors:
            hints.append("An NVIDIA GPU is present but this PyTorch build cannot use it. Install a CUDA build: "
                         "pip install torch --index-url https://download.pytorch.org/whl/cu128 (match your driver).")
        if not report.bf16:
            hints.append("This CPU has no native bf16: training runs in fp32, which is slower and uses twice the memory.")
    if report.backend == "rocm":
        for gpu in report.gpus:
            override = _GFX_OVERRIDES.get(gpu.arch or "")
            if override and not os.environ.get("HSA_OVERRIDE_GFX_VERSION"):
                hints.append(f"GPU {gpu.index} ({gpu.name}, {gpu.arch}) is a consumer Radeon that ROCm does not list; "
                             f"if kernels fail to load, export HSA_OVERRIDE_GFX_VERSION={override} before running.")
        hints.append("ROCm: QLoRA (model.quantization=4bit) and the 8-bit optimizers run through bitsandbytes, whose PyPI "
                     "wheel (0.50.2 or newer) carries ROCm 6.4-7.2 libraries: pip install emotune[qlora].")
    if report.backend in ("cuda", "rocm") and not report.bf16:
        hints.append("This GPU has no bf16: emotune trains in fp16 with loss scaling; Gemma is known to overflow in fp16, "
                     "so watch for non-finite losses.")
    return hints


def format_report(report: DoctorReport) -> str:
    lines = [f"backend      {report.backend} (torch build: {report.torch_build})"]
    if report.gpus:
        lines.append(f"devices      {len(report.gpus)}")
        for gpu in report.gpus:
            lines.append(f"  [{gpu.index}] {gpu.name}  {gpu.memory_gib} GiB  arch {gpu.arch or '?'}")
    else:
        lines.append(f"devices      CPU ({os.cpu_count()} cores)")
    lines.append(f"precision    bf16 {'yes' if report.bf16 else 'no'}, fp16 {'yes' if report.fp16 else 'no'}")
    lines.append("versions     " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    for hint in report.hints:
        lines.append(f"hint         {hint}")
    return "\n".join(lines)


def mixed_precision(precision: Precision, model: torch.nn.Module, always: bool = False):
    """(autocast context, grad scaler). Weights already stored in the training dtype need no autocast:
    Gemma's norms and softmax upcast to fp32 themselves, PEFT keeps the adapters in fp32 and casts at
    their boundary, and autocast on a CPU would re-cast every weight on every forward. `always`: full / freeze
    fine-tuning, whose fp32 trained weights sit beside (or are) the model's own layers, so autocast. fp16 always
    gets a scaler, because its gradients underflow without one."""
    if precision.name == "fp32":
        return nullcontext(), None
    device = next(model.parameters()).device.type
    frozen = next((p for p in model.parameters() if not p.requires_grad and p.is_floating_point()), None)  # not 4/8-bit
    plain = not always and frozen is not None and frozen.dtype == precision.dtype
    autocast = nullcontext() if plain else torch.autocast(device, dtype=precision.dtype)
    scaler = torch.amp.GradScaler(device) if precision.name == "fp16" else None
    return autocast, scaler
