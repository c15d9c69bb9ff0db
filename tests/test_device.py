"""Backend detection, precision choice and doctor hints, with torch's attributes faked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from emotune.core.errors import UserError
from emotune.runtime import device


def fake_gpu(monkeypatch, *, hip=None, cuda="12.8", bf16=True, name="GPU", arch="gfx942", major=9, minor=0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    props = SimpleNamespace(name=name, total_memory=192 * 2**30, gcnArchName=f"{arch}:sramecc+:xnack-", major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None if hip else cuda, raising=False)


def test_rocm_detected_from_torch_version_hip(monkeypatch):
    fake_gpu(monkeypatch, hip="6.4.1", name="AMD Instinct MI300X")
    report = device.doctor()
    assert report.backend == "rocm"
    assert report.torch_build == "ROCm 6.4.1"
    assert [g.arch for g in report.gpus] == ["gfx942", "gfx942"]
    assert report.gpus[0].memory_gib == 192.0
    assert any("bitsandbytes" in h for h in report.hints)
    assert device.resolve_device("auto").type == "cuda"  # ROCm GPUs are torch.cuda devices


def test_consumer_radeon_gets_gfx_override_hint(monkeypatch):
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    fake_gpu(monkeypatch, hip="6.4.1", name="AMD Radeon RX 6700 XT", arch="gfx1031")
    hints = device.doctor().hints
    assert any("HSA_OVERRIDE_GFX_VERSION=10.3.0" in h for h in hints)


def test_cuda_without_bf16_uses_fp16(monkeypatch):
    fake_gpu(monkeypatch, bf16=False, name="Tesla T4", major=7, minor=5)
    report = device.doctor()
    assert report.backend == "cuda" and report.gpus[0].arch == "sm_75"
    precision = device.choose_precision(torch.device("cuda"))
    assert precision.name == "fp16" and "no bf16" in precision.reason
    assert any("fp16" in h for h in report.hints)


def test_cpu_precision_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    assert device.choose_precision(torch.device("cpu")).name == "bf16"
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)
    assert device.choose_precision(torch.device("cpu")).name == "fp32"
    with pytest.raises(UserError, match="train.precision"):
        device.choose_precision(torch.device("cpu"), "bf16")
    with pytest.raises(UserError, match="fp16"):
        device.choose_precision(torch.device("cpu"), "fp16")


def test_cpu_only_torch_on_gpu_machine_gets_install_hint(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "_pci_gpu_vendors", lambda: {"amd"})
    report = device.doctor()
    assert report.backend in ("cpu", "mps")
    if report.backend == "cpu":
        assert any("ROCm build" in h for h in report.hints)


def test_asking_for_missing_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="emotune doctor"):
        device.resolve_device("cuda")


def test_doctor_cli_prints_report(capsys):
    from emotune.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out and "transformers" in out
    assert main(["doctor", "--json"]) == 0
    assert '"backend"' in capsys.readouterr().out


def test_a_numbered_gpu_is_chosen_and_checked(monkeypatch):
    fake_gpu(monkeypatch, hip="6.4.1")  # two GPUs
    assert device.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match="sees 2 GPU"):
        device.resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA or ROCm GPU"):
        device.resolve_device("cuda:0")


def test_a_gpu_number_is_checked_against_the_visible_count_and_names_the_visibility_variables(monkeypatch):
    assert device.resolve_device("cuda:1", gpus=lambda: 2) == torch.device("cuda:1")
    assert device.resolve_device("auto", gpus=lambda: 2) == torch.device("cuda")  # a ROCm GPU too: torch.cuda
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,3")
    with pytest.raises(UserError, match=r"sees 2 GPU\(s\), numbered from 0 to 1 \(with HIP_VISIBLE_DEVICES='2,3'\)"):
        device.resolve_device("cuda:2", gpus=lambda: 2)
    with pytest.raises(UserError, match="no CUDA or ROCm GPU"):
        device.resolve_device("cuda", gpus=lambda: 0)


def test_device_cuda_n_is_a_config_value_refused_before_any_weights_load(tiny_overrides, tmp_path, monkeypatch, capsys):
    from emotune.cli import main
    from emotune.core.config.load import load_config

    assert load_config(None, ["device=cuda:1"]).device == "cuda:1"
    for wrong in ("cuda1", "rocm", "gpu:0"):
        with pytest.raises(UserError, match="must be auto, cpu, cuda, cuda:N"):
            load_config(None, [f"device={wrong}"])
    monkeypatch.setattr(device, "visible_gpus", lambda: 2)  # as on a machine with two GPUs
    assert main(["train", *tiny_overrides, "device=cuda:2"]) == 2
    assert "sees 2 GPU(s)" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # refused before the run folder, data or model
