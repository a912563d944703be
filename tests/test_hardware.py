"""capabilities(): CPU for real, CUDA by patching torch.cuda's queries (checked for real in test_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

import nbtrain as nbt
from nbtrain import hardware


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(name, cc, total_gib, bf16):
        props = SimpleNamespace(name=name, major=cc[0], minor=cc[1], total_memory=int(total_gib * 2**30))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
        hardware._capabilities.cache_clear()
        return hardware._capabilities("cuda")

    yield install
    hardware._capabilities.cache_clear()


def test_ampere_or_newer_allows_everything_and_auto_is_bf16(fake_cuda):
    caps = fake_cuda("NVIDIA H200", (9, 0), 139.8, True)
    assert caps.device == "cuda" and caps.total_memory_gib == pytest.approx(139.8, abs=0.01)
    assert set(caps.allowed_precisions) == {"fp32", "tf32", "fp16", "bf16", "bf16-pure", "fp8"}
    assert caps.auto_precision == "bf16" and caps.tf32_supported and caps.fp16_fast
    # Hopper has float8 tensor cores: fp8 runs for speed, not emulated; every optimizer, paged too, runs on CUDA
    assert caps.fp8_native and "fp8" not in caps.notes
    assert set(caps.allowed_optimizers) == {"adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"}


def test_fp8_is_emulated_below_ada_and_refused_without_bf16(fake_cuda):
    a100 = fake_cuda("NVIDIA A100", (8, 0), 80.0, True)
    assert "fp8" in a100.allowed_precisions and not a100.fp8_native
    assert "emulated: numerics only, slower" in a100.notes["fp8"] and "8.0" in a100.notes["fp8"]
    old = fake_cuda("Tesla P100", (6, 0), 16.0, False)   # a GPU torch gives no bf16 at all
    assert "bf16-pure" in old.reasons and "fp8" in old.reasons


def test_turing_emulates_bf16_so_auto_is_fp16(fake_cuda):
    # real torch on a T4: is_bf16_supported() is True (emulated), compute capability 7.5, 15 GiB
    caps = fake_cuda("Tesla T4", (7, 5), 15.0, True)
    assert caps.bf16_supported and not caps.bf16_native
    assert caps.auto_precision == "fp16"                  # emulated bf16 is slower than fp16 with the GradScaler
    assert "bf16" in caps.allowed_precisions and "emulated" in caps.notes["bf16"] and "fp16" in caps.notes["bf16"]
    assert "Ampere" in caps.reasons["tf32"] and "7.5" in caps.reasons["tf32"]
    assert caps.fp16_fast and "fp16" not in caps.notes


def test_a_gpu_without_bf16_names_the_alternative(fake_cuda):
    caps = fake_cuda("Tesla P100", (6, 0), 16.0, False)
    assert caps.allowed_precisions == ("fp32", "fp16")   # no bf16: no bf16-pure, no fp8 (its other layers are bf16)
    assert "bf16" in caps.reasons and "fp16" in caps.reasons["bf16"]      # the reason names the alternative
    assert caps.auto_precision == "fp16"


def test_ampere_is_where_auto_turns_to_bf16(fake_cuda):
    assert fake_cuda("NVIDIA A100-SXM4-40GB", (8, 0), 40.0, True).auto_precision == "bf16"
    assert fake_cuda("NVIDIA GeForce RTX 2080", (7, 5), 8.0, True).auto_precision == "fp16"


def test_pascal_fp16_is_allowed_but_noted(fake_cuda):
    caps = fake_cuda("Tesla P100", (6, 0), 16.0, False)
    assert "fp16" in caps.allowed_precisions and "tensor cores" in caps.notes["fp16"]


def test_cpu_capabilities_and_reasons():
    caps = nbt.capabilities("cpu")
    assert caps.device == "cpu" and "fp32" in caps.allowed_precisions and "fp16" in caps.allowed_precisions
    assert "tf32" in caps.reasons and "fp16" in caps.notes or caps.fp16_fast
    assert caps.auto_precision in ("bf16", "fp32")
    assert caps.auto_precision == ("bf16" if caps.bf16_native else "fp32")


def test_qlora_gated_without_bitsandbytes(monkeypatch):
    monkeypatch.setattr(hardware, "_bitsandbytes_status", lambda device: (False, "bitsandbytes is not installed"))
    hardware._capabilities.cache_clear()
    try:
        caps = nbt.capabilities("cpu")
        assert "qlora" not in caps.allowed_methods and "method='lora'" in caps.reasons["qlora"]
        cfg = nbt.TrainConfig(method="qlora")   # loads and edits anywhere; a run or an estimate asks
        with pytest.raises(nbt.ConfigError, match="(?s)method.*bitsandbytes.*lora") as e:
            hardware.check_runnable(cfg)
        assert e.value.field == "method"
        assert hardware.check_runnable(cfg.replace(method="lora", precision="fp32")) == "fp32"
    finally:
        hardware._capabilities.cache_clear()


def test_check_runnable_names_the_precision_and_resolves_auto(fake_cuda):
    t4 = fake_cuda("Tesla T4", (7, 5), 15.0, True)
    cfg = nbt.TrainConfig(precision="tf32")
    with pytest.raises(nbt.ConfigError) as e:
        hardware.check_runnable(cfg, t4)
    assert e.value.field == "precision"
    assert str(e.value).startswith("precision: 'tf32' cannot run on this cuda (Tesla T4): ")
    assert t4.reasons["tf32"] in str(e.value)
    assert hardware.check_runnable(cfg.replace(precision="auto"), t4) == "fp16"   # auto resolved for that device
    assert hardware.check_runnable(cfg.replace(precision="fp16"), t4) == "fp16"
    h200 = fake_cuda("NVIDIA H200", (9, 0), 139.8, True)
    assert hardware.check_runnable(cfg, h200) == "tf32"
    assert hardware.check_runnable(cfg.replace(precision="auto"), h200) == "bf16"
    cpu = nbt.capabilities("cpu")
    with pytest.raises(nbt.ConfigError, match=r"precision: 'tf32' cannot run on this cpu \("):
        hardware.check_runnable(cfg, cpu)
