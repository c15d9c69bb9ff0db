"""Telemetry: the CPU sampler for real, the GPU sources with a fake torch.cuda and fake vendor libraries (injected
through sys.modules, as an installed pynvml or amdsmi would be found), and a tiny run's run.json and report."""

from __future__ import annotations

import json
import mmap
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

from emotune.cli import main
from emotune.runtime.telemetry import Sampler, find_sources, read_series, recording

MiB = 2**20
CUDA0 = torch.device("cuda", 0)


class FakeCuda:
    """torch.cuda's telemetry surface for one GPU. `wrappers=False`: utilization/temperature/power_draw fail as they
    do when torch found no NVML / amdsmi."""

    def __init__(self, wrappers: bool = True, power: float = 251_000):
        self.wrappers, self.power, self.allocated = wrappers, power, 300 * MiB

    def current_device(self):
        return 0

    def memory_allocated(self, index):
        return self.allocated

    def memory_reserved(self, index):
        return 512 * MiB

    def max_memory_allocated(self, index):
        return 400 * MiB

    def _wrapper(self, value):
        if not self.wrappers:
            raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.")
        return value

    def utilization(self, index):
        return self._wrapper(87)

    def temperature(self, index):
        return self._wrapper(61)

    def power_draw(self, index):
        return self._wrapper(self.power)

    def get_device_properties(self, index):
        return SimpleNamespace(uuid="5a3c9e1f-0000-4000-8000-000000000001", pci_domain_id=0, pci_bus_id=0x41,
                               pci_device_id=0)


def fake_pynvml(calls: list) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVML_TEMPERATURE_GPU = 0
    module.nvmlInit = lambda: calls.append("init")
    module.nvmlDeviceGetHandleByUUID = lambda uuid: calls.append(uuid) or "handle"
    module.nvmlDeviceGetHandleByIndex = lambda index: calls.append(index) or "handle"
    module.nvmlDeviceGetUtilizationRates = lambda handle: SimpleNamespace(gpu=55, memory=20)
    module.nvmlDeviceGetTemperature = lambda handle, sensor: 70
    module.nvmlDeviceGetPowerUsage = lambda handle: 300_000  # milliwatts
    return module


def fake_amdsmi(calls: list, init_error: Exception | None = None) -> types.ModuleType:
    module = types.ModuleType("amdsmi")

    def init():
        if init_error is not None:
            raise init_error
        calls.append("init")

    module.amdsmi_init = init
    module.AmdSmiTemperatureType = SimpleNamespace(EDGE="edge", JUNCTION="junction")
    module.AmdSmiTemperatureMetric = SimpleNamespace(CURRENT="current")
    module.amdsmi_get_processor_handle_from_bdf = lambda bdf: calls.append(bdf) or "gpu"
    module.amdsmi_get_processor_handles = lambda: ["gpu"]
    module.amdsmi_get_gpu_activity = lambda handle: {"gfx_activity": 93, "umc_activity": 40}
    module.amdsmi_get_temp_metric = lambda handle, kind, metric: 65
    module.amdsmi_get_power_info = lambda handle: {"average_socket_power": "N/A", "current_socket_power": 420}  # MI300
    return module


def read_all(found) -> dict:
    values = {}
    for source in found.sources:
        values.update(source.read())
    return values


def test_cpu_sampler_records_this_process_for_real(tmp_path):
    found = find_sources(torch.device("cpu"))
    assert [s.name for s in found.sources] == ["process (psutil)"] and found.note() is None
    path = tmp_path / "telemetry.jsonl"
    sampler = Sampler(found.sources, 0.02, path, "train").start()
    before = sampler.samples[0]["rss_mb"]
    block = mmap.mmap(-1, 64 * MiB)  # fresh pages (a heap could reuse memory it already holds), then touched
    block.write(b"\1" * (64 * MiB))
    deadline = time.monotonic() + 5
    while not any(s["rss_mb"] > before + 48 for s in sampler.samples) and time.monotonic() < deadline:
        time.sleep(0.02)
    summary = sampler.stop()
    block.close()
    assert summary["fields"]["rss_mb"]["peak"] > before + 48
    assert summary["fields"]["rss_mb"]["unit"] == "MiB" and "cpu_pct" in summary["fields"]
    assert not any(name.startswith(("gpu_", "allocated")) for name in summary["fields"])
    rows = read_series(path)
    assert len(rows) == summary["samples"] >= 3 and {r["stage"] for r in rows} == {"train"}
    assert [r["elapsed_s"] for r in rows] == sorted(r["elapsed_s"] for r in rows)


def test_torch_cuda_wrappers_give_utilisation_temperature_and_power():
    found = find_sources(CUDA0, cuda=FakeCuda(), hip=False)
    assert found.note() is None
    values = read_all(found)
    assert values["allocated_mb"] == 300 and values["reserved_mb"] == 512 and values["peak_allocated_mb"] == 400
    assert values["gpu_util_pct"] == 87 and values["gpu_temp_c"] == 61
    assert values["gpu_power_w"] == 251  # NVML's milliwatts


def test_rocm_power_from_torch_is_already_in_watts():
    assert read_all(find_sources(CUDA0, cuda=FakeCuda(power=180), hip=True))["gpu_power_w"] == 180


def test_nvml_answers_when_the_torch_wrappers_do_not(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(calls))
    found = find_sources(CUDA0, cuda=FakeCuda(wrappers=False), hip=False)
    values = read_all(found)
    assert (values["gpu_util_pct"], values["gpu_temp_c"], values["gpu_power_w"]) == (55, 70, 300)
    assert "GPU-5a3c9e1f-0000-4000-8000-000000000001" in calls  # matched by UUID, not by a possibly shifted index
    assert found.note() is None


def test_amdsmi_answers_on_rocm(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(calls))
    values = read_all(find_sources(CUDA0, cuda=FakeCuda(wrappers=False), hip=True))
    assert (values["gpu_util_pct"], values["gpu_temp_c"], values["gpu_power_w"]) == (93, 65, 420)
    assert "0000:41:00.0" in calls  # matched by PCI address (HIP_VISIBLE_DEVICES renumbers)


def test_an_amdsmi_built_for_another_rocm_leaves_memory_and_one_note(monkeypatch, tmp_path):
    class AmdSmiLibraryException(Exception):
        pass

    error = AmdSmiLibraryException("Error code: 34 | AMDSMI_STATUS_DRIVER_NOT_LOADED")
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi([], init_error=error))
    found = find_sources(CUDA0, cuda=FakeCuda(wrappers=False), hip=True)
    assert [s.name for s in found.sources] == ["process (psutil)", "torch allocator"]
    note = found.note()
    assert note.count("not recorded") == 1 and "utilisation, temperature, power" in note
    assert "AMDSMI_STATUS_DRIVER_NOT_LOADED" in note and "must match the installed ROCm" in note
    with recording(found, 0.01, tmp_path / "t.jsonl", "baseline", into=(entry := {})):
        time.sleep(0.03)
    assert entry["telemetry"]["fields"]["allocated_mb"]["peak"] == 300


def test_no_vendor_library_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if not installed
    note = find_sources(CUDA0, cuda=FakeCuda(wrappers=False), hip=False).note()
    assert "pip install nvidia-ml-py" in note


def test_a_sensor_that_stops_answering_is_dropped_and_the_rest_go_on(tmp_path):
    cuda = FakeCuda()
    found = find_sources(CUDA0, cuda=cuda, hip=False)
    cuda.temperature = lambda index: (_ for _ in ()).throw(RuntimeError("GPU is lost"))
    with recording(found, 0.01, tmp_path / "t.jsonl", "train", into=(entry := {})):
        time.sleep(0.03)
    fields = entry["telemetry"]["fields"]
    assert "gpu_temp_c" not in fields and fields["gpu_util_pct"]["peak"] == 87 and "rss_mb" in fields


def test_the_summary_is_kept_when_the_stage_fails(tmp_path):
    found = find_sources(torch.device("cpu"))
    entry = {}
    with pytest.raises(torch.OutOfMemoryError), recording(found, 0.01, tmp_path / "t.jsonl", "train", into=entry):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert entry["telemetry"]["samples"] >= 2


@pytest.mark.slow  # a whole run: baseline, training, fine-tuned evaluation, report
def test_a_run_records_telemetry_into_run_json_and_the_report(tiny_overrides, tmp_path, capsys):
    assert main(["run", *tiny_overrides, "train.telemetry_interval=0.05"]) == 0
    assert "train telemetry (" in capsys.readouterr().out
    run_dir = tmp_path / "runs" / "tiny"
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    for name in ("baseline", "train", "finetuned"):
        summary = stages[name]["telemetry"]
        assert summary["samples"] >= 2 and summary["fields"]["rss_mb"]["peak"] > 0
    assert "telemetry" not in stages["data"]
    rows = read_series(run_dir / "telemetry.jsonl")
    assert {r["stage"] for r in rows} == {"baseline", "train", "finetuned"}
    assert (run_dir / "report" / "telemetry.png").stat().st_size > 1000
    page = (run_dir / "report.html").read_text()
    assert "<h2>Telemetry</h2>" in page and "rss_mb" in page


def test_telemetry_off_records_nothing(tiny_overrides, tmp_path):
    assert main(["train", *tiny_overrides, "train.telemetry_interval=0"]) == 0
    run_dir = tmp_path / "runs" / "tiny"
    assert not (run_dir / "telemetry.jsonl").exists()
    assert "telemetry" not in json.loads((run_dir / "run.json").read_text())["stages"]["train"]
