"""What this device can run, and why not: ``capabilities()``; ``check_runnable(cfg)`` for one config."""

from __future__ import annotations

import functools
import importlib.util
import platform
from dataclasses import dataclass, field

import psutil
import torch

from .config import OPTIMIZERS, ConfigError, TrainConfig

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "bf16-pure", "fp8")
METHODS = ("full", "lora", "qlora")
# float8 tensor cores: Ada (8.9) and Hopper (9.0) and newer; elsewhere torchao emulates the fp8 matmuls
FP8_COMPUTE_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Capabilities:
    """What the current device supports, with a reason for everything it does not."""

    device: str                      # "cuda" or "cpu"
    name: str                        # GPU name or CPU model
    total_memory_gib: float          # device memory (host RAM on CPU)
    bf16_supported: bool
    bf16_native: bool                # fast (hardware) bf16, used by precision="auto"
    fp16_supported: bool
    fp16_fast: bool
    tf32_supported: bool
    bitsandbytes: bool
    allowed_precisions: tuple[str, ...]
    allowed_methods: tuple[str, ...]
    allowed_optimizers: tuple[str, ...] = OPTIMIZERS
    fp8_native: bool = False         # float8 tensor cores (compute capability 8.9+): fp8 runs for speed
    reasons: dict[str, str] = field(default_factory=dict)   # option -> why it is not allowed
    notes: dict[str, str] = field(default_factory=dict)     # option -> caveat (allowed but slow, ...)
    compute_capability: tuple[int, int] | None = None

    @property
    def auto_precision(self) -> str:
        """What ``precision="auto"`` resolves to here: bf16 only where it is native (a CUDA GPU of compute
        capability 8.0+, a CPU with bf16 instructions); else fp16 with the GradScaler on CUDA, fp32 on a CPU.
        torch calls bf16 supported on a T4 too, where it is emulated and slower than fp16."""
        if self.bf16_supported and self.bf16_native:
            return "bf16"
        if self.device == "cuda" and self.fp16_supported:
            return "fp16"
        return "fp32"

    @property
    def peak_tflops(self) -> dict[str, float]:
        """Dense peak TFLOP/s by compute dtype ("fp32", "tf32", "bf16", "fp16", "fp8"): a GPU's from its vendor's
        data sheet (``GPU_PEAK_TFLOPS``, matched by name; empty for a GPU not in it), a CPU's measured by a short
        GEMM probe per dtype on this process's threads (``cpu_peak_tflops``, once per process)."""
        if self.device == "cuda":
            return gpu_peak_tflops(self.name)
        return cpu_peak_tflops(torch.get_num_threads())

    def why_not(self, option: str) -> str | None:
        """The reason an option (a precision, method or optimizer name) cannot run here, or None."""
        return self.reasons.get(option)

    def _repr_html_(self) -> str:  # a small table in notebooks
        rows = "".join(
            f"<tr><td>{o}</td><td>{'yes' if o in self.allowed_precisions + self.allowed_methods else 'no'}"
            f"</td><td>{self.reasons.get(o) or self.notes.get(o, '')}</td></tr>"
            for o in PRECISIONS + METHODS + OPTIMIZERS
        )
        return (f"<b>{self.device}</b>: {self.name}, {self.total_memory_gib:.1f} GiB, auto → "
                f"{self.auto_precision}<table>{rows}</table>")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _bitsandbytes_status(device: str) -> tuple[bool, str | None]:
    """Whether bitsandbytes is installed. Only its presence is asked: importing it costs time and, on some CPUs,
    a Hub lookup (nbtrain._logs.import_bitsandbytes), which a run that needs no QLoRA or 8-bit optimizer must never
    pay; one that does imports it as it prepares, and a library that is there but does not load fails there, with
    the import's error under the field that asked for it."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False, "bitsandbytes is not installed (pip install bitsandbytes)"
    return True, None


def _torchao_status() -> str | None:
    """Why fp8 training cannot run here for want of torchao, or None. Only its presence is asked: importing it
    takes ~1 s, which every capabilities() would pay; a torchao that is there but broken fails when a fp8 run
    converts its layers, with the import's error."""
    if importlib.util.find_spec("torchao") is None:
        return "fp8 needs torchao: pip install 'nbtrain[fp8]' (or 'nbtrain[course]', which the course notebooks use)"
    return None


def _host_memory_gib() -> float:
    return psutil.virtual_memory().total / 2**30


# Dense (no structured sparsity) peak TFLOP/s from NVIDIA's data sheets, SXM parts unless named: the tensor-core
# figures for tf32 / bf16 / fp16 / fp8, the CUDA-core figure for fp32. Longer names first (e.g. "H100 PCIe").
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.9},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H100": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0, "fp8": 733.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
    "A10G": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},
}


def gpu_peak_tflops(name: str) -> dict[str, float]:
    """The data-sheet peaks of the GPU called ``name`` (e.g. "NVIDIA H200"); ``{}`` when it is not in the table."""
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return dict(GPU_PEAK_TFLOPS[key])
    return {}


@functools.lru_cache(maxsize=None)
def cpu_peak_tflops(threads: int) -> dict[str, float]:
    """This CPU's matmul TFLOP/s per dtype on ``threads`` threads, measured: the best of a few square GEMMs after a
    warm-up (fp32 and bf16 at 1024; fp16 at 512 where the CPU has fp16 hardware, else fp32's), ~0.3 s in all."""
    import time

    out: dict[str, float] = {}
    # Its own generator: a run calls this as it prepares, outside its lock on the global RNG, so a draw from the
    # global generator here would take numbers from whichever concurrent run holds it (its initial weights).
    gen = torch.Generator().manual_seed(0)
    # Without fp16 hardware fp16's linears are emulated with fp32 GEMMs (precision.emulated_fp16_linears): fp32's
    # peak is theirs, and torch's own fp16 GEMM, a scalar loop there, is not probed.
    fp16_hw = bool(_cpu_flags() & {"amx_fp16"})
    shapes = [("fp32", torch.float32, 1024), ("bf16", torch.bfloat16, 1024)] + (
        [("fp16", torch.float16, 512)] if fp16_hw else [])
    for key, dtype, n in shapes:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        out[key] = 2.0 * n**3 / best / 1e12
    out["tf32"] = out["fp32"]   # no tf32 on a CPU: fp32 matmuls
    if not fp16_hw:
        out["fp16"] = out["fp32"]
    return out


@functools.lru_cache(maxsize=None)
def _capabilities(device: str) -> Capabilities:
    reasons: dict[str, str] = {}
    notes: dict[str, str] = {}
    cc = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        cc = (props.major, props.minor)
        name = props.name
        total = props.total_memory / 2**30
        bf16 = bool(torch.cuda.is_bf16_supported())
        bf16_native = bf16 and cc >= (8, 0)
        fp16 = True
        fp16_fast = cc >= (7, 0)
        tf32 = cc >= (8, 0)
        if not bf16:
            reasons["bf16"] = f"{name} (compute capability {cc[0]}.{cc[1]}) has no bf16 support; use fp16"
        elif not bf16_native:
            notes["bf16"] = "emulated on this GPU (slow); fp16 with the GradScaler is faster"
        if not tf32:
            reasons["tf32"] = (f"tf32 needs an Ampere or newer GPU (compute capability 8.0+), this is "
                               f"{cc[0]}.{cc[1]}; use fp32 or fp16")
        if not fp16_fast:
            notes["fp16"] = "no tensor cores on this GPU: fp16 saves memory but not time"
    else:
        name = _cpu_name()
        total = _host_memory_gib()
        flags = _cpu_flags()
        bf16 = True  # torch's CPU autocast runs bf16 everywhere; only its speed depends on the CPU
        bf16_native = bool(flags & {"avx512_bf16", "amx_bf16"}) or platform.machine() in ("arm64", "aarch64")
        fp16 = True
        fp16_fast = bool(flags & {"amx_fp16"})
        tf32 = False
        reasons["tf32"] = "tf32 is a tensor-core format of NVIDIA GPUs (Ampere+); on a CPU use fp32 or bf16"
        if not bf16_native:
            notes["bf16"] = "this CPU has no bf16 instructions: bf16 works but is slower than fp32"
        if not fp16_fast:
            notes["fp16"] = ("this CPU has no fp16 hardware: fp16's linear layers are emulated (inputs and outputs "
                             "rounded to fp16, the arithmetic in fp32): fp16's numbers and its GradScaler, not its "
                             "speed")
    fp8_native = device == "cuda" and cc is not None and cc >= FP8_COMPUTE_CAPABILITY
    if not bf16 and device == "cuda":
        reasons["bf16-pure"] = reasons["bf16"]
        reasons["fp8"] = f"{name} has no bf16 support, which fp8 runs its other layers in"
    elif _torchao_status() is not None:
        reasons["fp8"] = _torchao_status()
    elif not fp8_native:
        where = f"compute capability {cc[0]}.{cc[1]}" if cc else "a CPU"
        notes["fp8"] = (f"emulated: numerics only, slower ({where} has no float8 tensor cores; they need "
                        f"{FP8_COMPUTE_CAPABILITY[0]}.{FP8_COMPUTE_CAPABILITY[1]}+, e.g. an H100)")
    if "bf16" in notes and "bf16-pure" not in reasons:
        notes["bf16-pure"] = notes["bf16"]
    bnb_ok, bnb_why = _bitsandbytes_status(device)
    if not bnb_ok:
        reasons["qlora"] = f"{bnb_why}; use method='lora' instead"
        reasons["adamw_8bit"] = f"{bnb_why}; use optimizer='adamw' or 'adafactor' instead"
    if device != "cuda":
        reasons["paged_adamw_8bit"] = ("paged optimizer state moves between GPU and host memory through CUDA "
                                       "unified memory: CUDA only; on a CPU use optimizer='adamw_8bit'")
    elif not bnb_ok:
        reasons["paged_adamw_8bit"] = reasons["adamw_8bit"]
    allowed_p = tuple(p for p in PRECISIONS if p not in reasons)
    allowed_m = tuple(m for m in METHODS if m not in reasons)
    allowed_o = tuple(o for o in OPTIMIZERS if o not in reasons)
    return Capabilities(
        device=device, name=name, total_memory_gib=round(total, 2), bf16_supported=bf16,
        bf16_native=bf16_native, fp16_supported=fp16, fp16_fast=fp16_fast, tf32_supported=tf32,
        bitsandbytes=bnb_ok, allowed_precisions=allowed_p, allowed_methods=allowed_m,
        allowed_optimizers=allowed_o, fp8_native=fp8_native, reasons=reasons, notes=notes, compute_capability=cc,
    )


def default_device() -> str:
    """The device nbtrain trains on: the first CUDA GPU when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def capabilities(device: str | None = None) -> Capabilities:
    """What ``device`` (default: the one nbtrain would use) can run, and the reason for what it cannot."""
    return _capabilities(device or default_device())


def resolve_precision(precision: str, caps: Capabilities | None = None) -> str:
    """Turn ``"auto"`` into a concrete precision name for this device; other names pass through."""
    caps = caps or capabilities()
    return caps.auto_precision if precision == "auto" else precision


def check_runnable(cfg: TrainConfig, caps: Capabilities | None = None) -> str:
    """The precision ``cfg`` runs with on this device (``"auto"`` resolved); raises ConfigError (field
    ``precision`` or ``method``) with the reason when this device cannot run its precision or method.

    A TrainConfig never asks this at construction (a GPU config loads anywhere); a run or an estimate
    asks it when it prepares."""
    caps = caps or capabilities()
    if cfg.precision != "auto" and cfg.precision in caps.reasons:
        raise ConfigError(f"precision: {cfg.precision!r} cannot run on this {caps.device} ({caps.name}): "
                          f"{caps.reasons[cfg.precision]}", field="precision")
    if cfg.method in caps.reasons:
        raise ConfigError(f"method: {cfg.method!r} cannot run here: {caps.reasons[cfg.method]}", field="method")
    if cfg.optimizer in caps.reasons:
        raise ConfigError(f"optimizer: {cfg.optimizer!r} cannot run on this {caps.device}: "
                          f"{caps.reasons[cfg.optimizer]}", field="optimizer")
    return resolve_precision(cfg.precision, caps)
