"""Telemetry: what the device and the process do while a stage runs, sampled in the background.

While a stage that runs the model (baseline, train, fine-tuned evaluation) is under way, a daemon thread
reads its sources every `train.telemetry_interval` seconds and appends one JSON line per sample to the run
folder's telemetry.jsonl; at the end of the stage its summary (peak and mean of every field) goes into the
stage's entry in run.json, and the report plots the series.

Sources, each optional (`find_sources` looks for them once per command):

- PyTorch's caching allocator on a CUDA or ROCm GPU: memory allocated, reserved, and the peak allocated.
- The GPU itself: utilisation, temperature and power, per field through `torch.cuda.utilization` /
  `temperature` / `power_draw` where they work (they need NVML on NVIDIA, amdsmi on ROCm), else the vendor
  library directly: pynvml on NVIDIA, amdsmi on ROCm. amdsmi must match the installed ROCm; one that does not
  load, or a driver that refuses a query, only removes the fields it would have given.
- The process (psutil): resident memory and CPU use, on every device.

Whatever is missing is named in one note when the command starts, never an error. Every source is an
object with `fields` and `read()`, so tests pass fakes in (a fake `torch.cuda`, fake vendor modules).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from emotune.core.rundir import json_text

MiB = 2**20

UNITS = {"allocated_mb": "MiB", "reserved_mb": "MiB", "peak_allocated_mb": "MiB", "gpu_util_pct": "%",
         "gpu_temp_c": "°C", "gpu_power_w": "W", "rss_mb": "MiB", "cpu_pct": "% of one core"}


class Source(Protocol):
    name: str
    fields: tuple[str, ...]

    def read(self) -> dict[str, float]: ...


# --------------------------------------------------------------------------------------------------
# The sources


class Allocator:
    """PyTorch's caching allocator on one CUDA / ROCm device (`cuda` is `torch.cuda`, or a fake)."""
    name = "torch allocator"
    fields = ("allocated_mb", "reserved_mb", "peak_allocated_mb")

    def __init__(self, cuda, index: int):
        self.cuda, self.index = cuda, index

    def read(self) -> dict[str, float]:
        return {"allocated_mb": self.cuda.memory_allocated(self.index) / MiB,
                "reserved_mb": self.cuda.memory_reserved(self.index) / MiB,
                "peak_allocated_mb": self.cuda.max_memory_allocated(self.index) / MiB}


class Readings:
    """Fields read by a function each (`{field: read}`); a field whose read fails is dropped from then on."""

    def __init__(self, name: str, readers: dict):
        self.name, self.readers = name, dict(readers)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.readers)

    def read(self) -> dict[str, float]:
        values = {}
        for name, reader in list(self.readers.items()):
            try:
                value = reader()
            except Exception:  # a driver that stops answering must not stop a training run
                del self.readers[name]
                continue
            if value is not None:
                values[name] = float(value)
        return values


class Process:
    """This process's resident memory and CPU use (psutil)."""
    name = "process (psutil)"
    fields = ("rss_mb", "cpu_pct")

    def __init__(self, psutil_module):
        self.process = psutil_module.Process()
        self.process.cpu_percent(None)  # the first call starts the measurement and returns 0

    def read(self) -> dict[str, float]:
        return {"rss_mb": self.process.memory_info().rss / MiB, "cpu_pct": self.process.cpu_percent(None)}


GPU_FIELDS = {"gpu_util_pct": "utilisation", "gpu_temp_c": "temperature", "gpu_power_w": "power"}


def gpu_readings(cuda, index: int, hip: bool, modules: dict | None = None) -> tuple[Readings, list[str]]:
    """Utilisation, temperature and power of GPU `index`: each through `cuda`'s wrapper where it answers, else
    through the vendor library (pynvml; amdsmi on ROCm). Returns the readings and a note on what is missing."""
    wrappers = {"gpu_util_pct": lambda: cuda.utilization(index), "gpu_temp_c": lambda: cuda.temperature(index),
                # NVML reports milliwatts; amdsmi, and so torch on ROCm, watts
                "gpu_power_w": lambda: _watts(cuda.power_draw(index), hip)}
    readers = {name: read for name, read in wrappers.items() if _fails(read) is None}
    why = ""
    if len(readers) < len(wrappers):
        vendor, why = (_amdsmi_readers if hip else _nvml_readers)(cuda, index, modules)
        for name in wrappers:
            if name not in readers and name in vendor:
                problem = _fails(vendor[name])
                if problem is None:
                    readers[name] = vendor[name]
                else:
                    why = why or problem
    missing = [GPU_FIELDS[name] for name in wrappers if name not in readers]
    notes = [f"GPU {', '.join(missing)} not recorded ({why or 'the driver gave no value'})"] if missing else []
    return Readings("GPU sensors", {name: readers[name] for name in wrappers if name in readers}), notes


def _fails(read) -> str | None:
    """Why `read()` gives no value, or None when it does."""
    try:
        return None if read() is not None else "the driver gave no value"
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _watts(value, hip: bool) -> float | None:
    if hip:  # torch returns 0 on ROCm when amdsmi reports neither average nor current power
        return float(value) if value else None
    return value / 1000


def _import(name: str, modules: dict | None):
    if modules is not None and name in modules:
        return modules[name]
    import importlib

    return importlib.import_module(name)


def _nvml_readers(cuda, index: int, modules: dict | None) -> tuple[dict, str]:
    try:
        pynvml = _import("pynvml", modules)
        pynvml.nvmlInit()
        handle = _nvml_handle(pynvml, cuda, index)
    except ModuleNotFoundError:
        return {}, "pynvml is not installed: pip install nvidia-ml-py"
    except Exception as err:  # no driver, no permission
        return {}, f"NVML: {type(err).__name__}: {err}"
    return {"gpu_util_pct": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "gpu_temp_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "gpu_power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000}, ""


def _nvml_handle(pynvml, cuda, index: int):
    """NVML numbers every GPU of the machine, PyTorch only the visible ones (CUDA_VISIBLE_DEVICES): match by UUID."""
    try:
        uuid = str(cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(index)


def _amdsmi_readers(cuda, index: int, modules: dict | None) -> tuple[dict, str]:
    try:
        amdsmi = _import("amdsmi", modules)
        amdsmi.amdsmi_init()
        handle = _amdsmi_handle(amdsmi, cuda, index)
    except ModuleNotFoundError:
        return {}, "amdsmi is not installed: install the amdsmi that matches your ROCm (see docs/troubleshooting.md)"
    except Exception as err:  # a library built for another ROCm fails to load or to initialise
        return {}, (f"amdsmi does not work with this ROCm ({type(err).__name__}: {err}); it must match the installed "
                    "ROCm version")

    def power() -> float | None:
        info = amdsmi.amdsmi_get_power_info(handle)
        value = next((info.get(k) for k in ("average_socket_power", "current_socket_power", "socket_power")
                      if isinstance(info.get(k), (int, float)) and info.get(k) < 2**31), None)
        return float(value) if value else None

    return {"gpu_util_pct": lambda: amdsmi.amdsmi_get_gpu_activity(handle)["gfx_activity"],
            "gpu_temp_c": lambda: amdsmi.amdsmi_get_temp_metric(handle, amdsmi.AmdSmiTemperatureType.EDGE,
                                                                amdsmi.AmdSmiTemperatureMetric.CURRENT),
            "gpu_power_w": power}, ""


def _amdsmi_handle(amdsmi, cuda, index: int):
    """amdsmi numbers every GPU of the machine, PyTorch only the visible ones (HIP_VISIBLE_DEVICES): match by PCI address."""
    try:
        props = cuda.get_device_properties(index)
        bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return amdsmi.amdsmi_get_processor_handle_from_bdf(bdf)
    except Exception:
        return amdsmi.amdsmi_get_processor_handles()[index]


@dataclass
class Sources:
    """What one command samples, found once, and the note that says what is missing."""
    sources: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        recorded = ", ".join(f for s in self.sources for f in s.fields) or "nothing"
        return f"Telemetry records {recorded}; " + "; ".join(self.notes) + "." if self.notes else None


def find_sources(device, cuda=None, hip: bool | None = None, modules: dict | None = None) -> Sources:
    """The sources available for `device` (a torch.device). `cuda`, `hip` and `modules` (name -> module, in place
    of importing psutil, pynvml, amdsmi) default to the real ones; tests pass fakes."""
    found = Sources()
    try:
        found.sources.append(Process(_import("psutil", modules)))
    except Exception as err:
        found.notes.append(f"process memory and CPU use not recorded (psutil: {type(err).__name__}: {err})")
    if device.type == "cuda":
        if cuda is None or hip is None:
            import torch

            cuda = torch.cuda if cuda is None else cuda
            hip = bool(getattr(torch.version, "hip", None)) if hip is None else hip
        index = device.index if device.index is not None else cuda.current_device()
        found.sources.append(Allocator(cuda, index))
        readings, notes = gpu_readings(cuda, index, hip, modules)
        if readings.fields:
            found.sources.append(readings)
        found.notes += notes
    return found


# --------------------------------------------------------------------------------------------------
# The sampler


class Sampler:
    """Reads `sources` every `interval` seconds on a daemon thread, appending each sample to `path` as a JSON
    line {time, elapsed_s, stage, field: value...}; `summary()` afterwards gives peak and mean per field."""

    def __init__(self, sources: list, interval: float, path: Path, stage: str):
        self.sources, self.interval, self.path, self.stage = sources, interval, Path(path), stage
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"emotune-telemetry-{stage}", daemon=True)
        self._started = 0.0

    def start(self) -> Sampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end of the stage, however short it was
        return self.summary()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        row = {"time": round(time.time(), 3), "elapsed_s": round(time.monotonic() - self._started, 3), "stage": self.stage}
        for source in self.sources:
            try:
                row.update({k: round(v, 2) for k, v in source.read().items()})
            except Exception:  # a source that breaks mid-run is left out of this sample, never stops the run
                continue
        self.samples.append(row)
        with self.path.open("a", encoding="utf-8") as handle:  # one whole line per sample; appended across stages
            handle.write(json_text(row, indent=None) + "\n")

    def summary(self) -> dict:
        fields = {}
        for name in UNITS:
            values = [s[name] for s in self.samples if isinstance(s.get(name), (int, float)) and math.isfinite(s[name])]
            if values:
                fields[name] = {"peak": round(max(values), 2), "mean": round(sum(values) / len(values), 2),
                                "unit": UNITS[name]}
        return {"interval_s": self.interval, "samples": len(self.samples), "fields": fields}


@contextmanager
def recording(sources: Sources | None, interval: float, path: Path, stage: str, into: dict | None = None
              ) -> Iterator[Sampler | None]:
    """Sample while the block runs (nothing when `interval` is 0 or there is no source); the summary is put in
    `into["telemetry"]` at the end, also when the block fails (an out-of-memory stage is when it matters most)."""
    if not interval or sources is None or not sources.sources:
        yield None
        return
    sampler = Sampler(sources.sources, interval, path, stage).start()
    try:
        yield sampler
    finally:
        summary = sampler.stop()
        if into is not None:
            into["telemetry"] = summary


def describe(summary: dict) -> str:
    """One line for the terminal: the peak (and mean) of each field."""
    parts = [f"{name} peak {v['peak']:g} mean {v['mean']:g}" for name, v in summary.get("fields", {}).items()]
    return f"telemetry ({summary.get('samples', 0)} samples every {summary.get('interval_s')} s): " + ", ".join(parts)


def read_series(path: Path) -> list[dict]:
    """The samples in `path`; a line cut short by a crash, or one that is no sample (no stage, time or field the plot
    draws), is skipped."""
    rows = []
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if _is_sample(row):
                rows.append(row)
    return rows


def _is_sample(row) -> bool:
    return (isinstance(row, dict) and isinstance(row.get("stage"), str)
            and isinstance(row.get("elapsed_s"), (int, float)) and any(name in row for name in UNITS))


# --------------------------------------------------------------------------------------------------
# The plot


PANELS = (("memory (MiB)", ("rss_mb", "allocated_mb", "reserved_mb", "peak_allocated_mb")),
          ("CPU use (% of one core)", ("cpu_pct",)), ("GPU utilisation (%)", ("gpu_util_pct",)),
          ("GPU temperature (°C)", ("gpu_temp_c",)), ("GPU power (W)", ("gpu_power_w",)))


def figure(rows: list[dict]):
    """Each recorded quantity over the run's time (stages one after another), stage starts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(title, [f for f in names if any(f in r for r in rows)]) for title, names in PANELS]
    panels = [(title, names) for title, names in panels if names]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, squeeze=False)
    x, starts, offset, last = [], [], 0.0, None
    for row in rows:  # stages (and resumed attempts) laid end to end: each starts where the last sample was
        if last is None or row["stage"] != last["stage"] or row["elapsed_s"] < last["elapsed_s"]:
            offset = (x[-1] if x else 0.0) - row["elapsed_s"]
            starts.append((offset + row["elapsed_s"], row["stage"]))
        x.append(offset + row["elapsed_s"])
        last = row
    for ax, (title, names) in zip(axes[:, 0], panels, strict=False):
        for name in names:
            points = [(t, r[name]) for t, r in zip(x, rows, strict=False) if name in r]
            ax.plot(*zip(*points, strict=False), label=name, linewidth=1.2)
        for start, stage in starts:
            ax.axvline(start, color="#999", linewidth=0.8, linestyle=":")
            ax.annotate(stage, (start, 1), xycoords=("data", "axes fraction"), fontsize=7, va="top", color="#555")
        ax.set_ylabel(title, fontsize=8)
        if len(names) > 1:
            ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds (stages end to end)")
    fig.tight_layout()
    return fig
