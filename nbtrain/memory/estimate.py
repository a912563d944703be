"""One estimate: the step's peak (``timeline``) plus what lies outside the tensors, as a MemoryEstimate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import TrainConfig
from ..hardware import Capabilities, capabilities, default_device, resolve_precision
from ..models import check_lora_targets
from ..precision import PRECISION_TABLE
from .facts import NUM_LABELS, architecture
from .report import PART_ROWS, RANK_ROWS, REFERENCE_ROWS, ROLLOUT_ROWS, estimate_html, estimate_text
from .rollouts import kv_dtype
from .timeline import step_peak

GIB = 2**30
# Outside the tensors: the CUDA context with its kernels' modules and library handles (0.73-0.75 GiB measured on
# an H200 with CUDA 13, beside PyTorch's allocator), and the caching allocator's reserved-but-free blocks: 2-28%
# of the tensor peak over the benchmark grid (benchmarks/memory_check.py), 14% splits that range evenly.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
SLACK = {"cuda": 0.14, "cpu": 0.05}


@dataclass
class Advice:
    """One change of the out-of-memory flow: cumulative TrainConfig overrides and the estimate they give."""

    change: dict[str, Any]
    description: str
    total_gib: float
    fits: bool
    world_size: int = 1               # the processes it needs (sharding="fsdp" over several GPUs)


@dataclass
class MemoryEstimate:
    """The memory one training step of ``config`` needs, by part, with the peak and advice."""

    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float
    total_gib: float
    device: str
    device_total_gib: float
    fits: bool
    trainable_params: int
    total_params: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    advice: list[Advice]
    config: TrainConfig
    precision: str = "fp32"
    peak_phase: str = ""
    tensors_peak_gib: float = 0.0    # the timeline's peak without overhead: compare with max_memory_allocated
    notes: list[str] = field(default_factory=list)
    # The precision of every tensor. ``weights_gib`` is every parameter in its stored dtype; under the autocast
    # precisions (fp16, bf16, fp8) the fp32 trainable weights in it are the master copy the optimizer updates and
    # the forward casts from: ``master_weights_gib`` says how much of ``weights_gib`` that is (a share of it, not
    # added to the total). 0 under fp32/tf32 (the weights are what the forward reads: no second precision) and
    # bf16-pure (no fp32 copy at all). Autocast's 16-bit weight copies are activations (saved for backward).
    master_weights_gib: float = 0.0
    master_weights_bytes: int = 0
    optimizer: str = "adamw"         # the optimizer whose state ``optimizer_gib`` is
    weights_dtype: str = "fp32"      # the trainable weights' dtype (and their gradients'): "fp32" or "bf16"
    dtypes: dict[str, str] = field(default_factory=dict)   # part label -> the dtype(s) its tensors are in
    # what a CPU run records as StepRecord.host_tensors_gib: weights, optimizer state and the tensors saved for
    # backward (short-lived tensors are not seen), or weights + gradients + optimizer state at the optimizer step
    run_tensors_gib: float = 0.0
    # Several processes: every number above is one process's (rank 0's). sharding="fsdp" over world_size ranks
    # splits weights, gradients and optimizer state world_size ways and adds ``gathered_gib``: the groups gathered
    # in the peak's phase (the root, the running layer and the next one prefetched, a layer's unsharded gradients
    # before their reduce-scatter). sharding="none" with world_size > 1 is DDP: a whole copy per rank plus
    # ``buckets_gib``, its gradient buckets. world_size=1 is one process: nothing is sharded.
    world_size: int = 1
    sharding: str = "none"
    gathered_gib: float = 0.0
    buckets_gib: float = 0.0
    # the smallest world size (1, 2, 4, ... 512) at which this config under sharding="fsdp" fits this device's
    # memory per rank; None when none does (or fsdp cannot run this config: ``fsdp_refused`` says why)
    min_world_size: Optional[int] = None
    fsdp_refused: str = ""
    # objective="dpo", full fine-tune without precompute_ref: the frozen reference copy of the model, every
    # parameter in the trained weights' dtype (no gradients, no optimizer state), held all run and counted in the
    # total. 0 otherwise: LoRA/QLoRA's reference is the model with its adapters off, precompute_ref keeps log-probs
    # only, ORPO and SimPO have none (``notes`` says which).
    reference_weights_gib: float = 0.0
    reference_weights_bytes: int = 0
    # objective="grpo": the rollouts' parts, beside the update's (activations, logits + loss: B completions of
    # prompt_tokens + max_new_tokens, the head on the completion positions only). ``rollout_kv_cache``: one prompt's
    # G completions' KV cache at full length; ``sampling_forward``: the sampling forward's transient at the rollouts'
    # peak beyond that cache (its logits for G rows at one position, the fp32 log-probs drawn from, a layer's
    # tensors, autocast's cached casts of trained weights); ``rollout_tensors``: the rollout batch the step keeps.
    # ``rollout_peak_gib`` and ``update_peak_gib``: each phase's tensor peak (held parts included, no overhead); the
    # larger is ``tensors_peak_gib``. ``prompt_tokens``: the prompt length used (the data's longest, else
    # max_seq_len). All 0 for the other objectives.
    rollout_kv_cache_gib: float = 0.0
    rollout_kv_cache_bytes: int = 0
    sampling_forward_gib: float = 0.0
    rollout_tensors_gib: float = 0.0
    rollout_peak_gib: float = 0.0
    update_peak_gib: float = 0.0
    prompt_tokens: int = 0

    def table(self):
        """The parts as a DataFrame (part, GiB); the total is the step's peak, not their sum."""
        import pandas as pd   # pandas is only needed for this view

        rows = [(name, getattr(self, attr)) for name, attr in PART_ROWS]
        # several processes: FSDP's gathered groups, DDP's buckets, before the overhead when there are some
        rows[-2:-2] = [(name, getattr(self, attr)) for name, attr in RANK_ROWS if getattr(self, attr)]
        # GRPO's rollouts, after the update's logits, when there are some
        rows[5:5] = [(name, getattr(self, attr)) for name, attr in ROLLOUT_ROWS if getattr(self, attr)]
        # DPO's frozen reference copy, after the optimizer state (the parts held all run), when there is one
        rows[3:3] = [(name, getattr(self, attr)) for name, attr in REFERENCE_ROWS if getattr(self, attr)]
        return pd.DataFrame(rows, columns=["part", "GiB"])

    def versus(self, measured_peak_gib: float | Any) -> dict[str, float]:
        """The estimate beside a measurement: a GiB value, or a TrainResult. A value and a GPU run's peak VRAM
        (``peak_vram_gib``) are set beside the tensor peak. A CPU run has no device peak; its
        ``peak_host_tensors_gib`` is set beside ``run_tensors_gib``, the estimate of what that tracer counts
        (it sees no short-lived tensor, so it is below the tensor peak, by 11-22% on SmolLM2-135M at 4 x 256,
        docs/memory-model.md; the result then has ``tensors_peak_gib`` too)."""
        if hasattr(measured_peak_gib, "summary"):
            summary = measured_peak_gib.summary
            host = summary.get("peak_host_tensors_gib")
            if summary.get("peak_vram_gib") is None and host is not None:
                m = float(host)
                return {"estimated_gib": self.run_tensors_gib, "measured_gib": m,
                        "ratio": self.run_tensors_gib / m if m else math.inf,
                        "tensors_peak_gib": self.tensors_peak_gib}
            measured_peak_gib = summary.get("peak_vram_gib")
        if measured_peak_gib is None:
            raise ValueError("no measured peak: peak_vram_gib is None (a CPU run has no device peak) and there is "
                             "no peak_host_tensors_gib either")
        m = float(measured_peak_gib)
        return {"estimated_gib": self.tensors_peak_gib, "measured_gib": m,
                "ratio": self.tensors_peak_gib / m if m else math.inf}

    def __str__(self) -> str:
        return estimate_text(self)

    def _repr_html_(self) -> str:
        return estimate_html(self, details=True)


def check_estimable(cfg: TrainConfig) -> None:
    """What an estimate asks of a config before it starts: a TrainConfig whose explicit LoRA targets the model
    has (ConfigError otherwise). Whether this device can run its precision or method is not asked: an estimate
    is for any device."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"estimate_memory() takes a TrainConfig, got {type(cfg).__name__}")
    check_lora_targets(cfg)


def local_capabilities(device: str) -> Optional[Capabilities]:
    """This machine's capabilities for ``device``, or None when this machine has no such device to read."""
    return capabilities(device) if device in ("cpu", default_device()) else None


def estimate_precision(cfg: TrainConfig, device: str) -> str:
    """The precision to estimate ``cfg`` with on ``device``: "auto" as nbtrain resolves it there (bf16, the
    usual choice, for a CUDA device this machine does not have). A precision the device cannot run is estimated
    all the same (tf32 keeps fp32 tensors), so a config written for another machine estimates here."""
    if cfg.precision != "auto":
        return cfg.precision
    caps = local_capabilities(device)
    return resolve_precision("auto", caps) if caps is not None else "bf16"


def estimate_once(cfg: TrainConfig, device: str, device_total_gib: float, device_name: str,
                  target_fraction: Optional[float] = None, world_size: int = 1,
                  prompt_tokens: Optional[int] = None) -> MemoryEstimate:
    """The estimate of ``cfg`` on ``device`` with ``device_total_gib`` of memory, without advice, for one of
    ``world_size`` processes.

    ``target_fraction`` (causal LM): the share of positions that carry a target (``target_fraction(data)``
    for chat data, where only the answer tokens do); None: every position. ``prompt_tokens`` (objective="grpo"):
    the data's longest prompt; None: max_seq_len."""
    precision = estimate_precision(cfg, device)
    if cfg.task == "image-classification":   # a vision encoder: patches x hidden (or a traced CNN)
        from .vision import image_step_peak

        p = image_step_peak(cfg, precision, device, NUM_LABELS)
        if world_size > 1:
            p.notes.append(f"image-classification: estimated for one process (whole copy), not per rank of "
                           f"{world_size}")
            world_size = 1
    else:
        several = getattr(cfg, "objective", "lm") == "grpo" and world_size > 1
        if several:   # engine.grpo_run refuses several processes: its rollouts are sampled by the one model
            world_size = 1
        p = step_peak(cfg, precision, device, NUM_LABELS, target_fraction, world_size, prompt_tokens)
        if several:
            p.notes.append("grpo runs in one process (its rollouts are sampled by the one model): estimated for one")
    overhead = (CUDA_CONTEXT_BYTES if device == "cuda" else 0) + SLACK.get(device, 0.05) * p.peak
    total = p.peak + overhead
    dtypes = part_dtypes(cfg, precision, p.param_bytes, device)
    if p.gathered_dtype:
        dtypes["gathered"] = (f"{p.gathered_dtype} (the root, the running layer and the next; a layer's "
                              "gradients before their fp32 reduce-scatter)")
    if getattr(p, "buckets", 0):
        dtypes["ddp buckets"] = DTYPE_NAMES[p.param_bytes]
    reference = getattr(p, "reference", 0)
    if reference:
        dtypes["reference weights"] = f"{DTYPE_NAMES[p.param_bytes]} (frozen copy: no gradients, no optimizer state)"
    ro = getattr(p, "rollouts", None)
    if ro is not None:
        arch = architecture(cfg.model, cfg.task, NUM_LABELS)
        B = cfg.micro_batch_size
        dtypes["activations"] += f" (the update: {B} completions x ({ro.prompt} + {ro.new}) tokens)"
        dtypes["logits + loss"] += f" (the update: {ro.new} completion positions per row)"
        dtypes["rollout KV cache"] = kv_dtype(ro, cfg, arch)
        dtypes["sampling forward"] = (f"sampled in {ro.sampler_precision}: {cfg.num_generations} rows' logits at one "
                                      "position (logits_to_keep), their fp32 log-probs, a layer's tensors"
                                      + (", autocast's 16-bit casts of the trained weights" if ro.cached_casts
                                         else ""))
        dtypes["rollout tensors"] = "int64 ids and positions, fp32 masks, log-probs and advantages"
    return MemoryEstimate(
        world_size=int(world_size), sharding=cfg.sharding, gathered_gib=getattr(p, "gathered", 0) / GIB,
        buckets_gib=getattr(p, "buckets", 0) / GIB,
        reference_weights_gib=reference / GIB, reference_weights_bytes=reference,
        rollout_kv_cache_gib=ro.kv_cache / GIB if ro else 0.0, rollout_kv_cache_bytes=ro.kv_cache if ro else 0,
        sampling_forward_gib=ro.sampling / GIB if ro else 0.0, rollout_tensors_gib=ro.tensors / GIB if ro else 0.0,
        rollout_peak_gib=p.rollout_peak / GIB if ro else 0.0, update_peak_gib=p.update_peak / GIB if ro else 0.0,
        prompt_tokens=ro.prompt if ro else 0,
        master_weights_gib=p.master_weights / GIB, master_weights_bytes=p.master_weights, optimizer=cfg.optimizer,
        weights_dtype=DTYPE_NAMES[p.param_bytes], dtypes=dtypes,
        run_tensors_gib=p.run_tensors / GIB,
        weights_gib=p.weights / GIB, gradients_gib=p.gradients / GIB, optimizer_gib=p.optimizer / GIB,
        activations_gib=p.activations / GIB, logits_gib=p.logits / GIB, overhead_gib=overhead / GIB,
        total_gib=total / GIB, device=device_name, device_total_gib=float(device_total_gib),
        fits=total / GIB <= device_total_gib, trainable_params=p.trainable, total_params=p.total,
        weights_bytes=p.weights, gradients_bytes=p.gradients, optimizer_bytes=p.optimizer, advice=[], config=cfg,
        precision=precision, peak_phase=p.phase, tensors_peak_gib=p.peak / GIB, notes=p.notes)


DTYPE_NAMES = {4: "fp32", 2: "bf16"}                 # the floating-point weights' element size -> their dtype
_AUTOCAST_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def optimizer_state_dtype(optimizer: str, param_bytes: int) -> str:
    """The dtype(s) of ``optimizer``'s state when the trainable weights take ``param_bytes`` per element."""
    w = DTYPE_NAMES[param_bytes]
    return {"adamw": f"{w} exp_avg + exp_avg_sq",
            "adamw_8bit": "uint8 states + fp32 absmax per 256 (fp32 below 4096 elements)",
            "paged_adamw_8bit": "uint8 states + fp32 absmax per 256 (fp32 below 4096 elements), paged",
            "adafactor": "fp32, second moment factored (row + column)",
            "sgd": f"{w} momentum"}.get(optimizer, "?")


def part_dtypes(cfg: TrainConfig, precision: str, param_bytes: int, device: str = "cpu") -> dict[str, str]:
    """Each part's dtype(s) under ``precision`` (what the report shows beside the parts)."""
    w = DTYPE_NAMES[param_bytes]
    spec = PRECISION_TABLE.get(precision, PRECISION_TABLE["fp32"])
    compute = w if spec.autocast_dtype is None else _AUTOCAST_NAMES.get(str(spec.autocast_dtype), "16-bit")
    weights = w
    if cfg.method == "qlora":
        weights = f"{'nf4' if cfg.quant_bits == 4 else 'int8'} base + {w}"
    if spec.autocast_dtype is not None:
        weights += " (the master copy; the forward reads " + ("fp8 casts" if spec.fp8 else compute) + ")"
    acts = compute + (" + the fp8 layers' fp32 inputs (CPU)" if spec.fp8 and device != "cuda" else "")
    return {"weights": weights, "gradients": w, "optimizer": f"{cfg.optimizer}: "
            + optimizer_state_dtype(cfg.optimizer, param_bytes), "activations": acts,
            "logits + loss": f"{compute} logits, fp32 loss"}


def target_fraction(data, max_seq_len: int) -> float:
    """The share of a ``max_seq_len`` batch's B x (T - 1) positions that carry a target in ``data`` (a
    DataBundle, or its list of training examples): chat examples count their answer tokens (``labels`` not
    -100 after the shift); plain text gets logits at every position (its padding too: nbtrain.engine.losses
    selects target rows for chat data only), so it counts 1."""
    rows = getattr(data, "train", data)
    if not rows or max_seq_len < 2:
        return 1.0
    targets = sequences = 0
    for ex in rows:
        # a preference example is two rows of the forward: prompt + chosen ("labels"), prompt + rejected
        for key in ("labels", "rejected_labels") if "rejected_input_ids" in ex else ("labels",):
            labels = ex.get(key)
            sequences += 1
            if labels is None:
                targets += max_seq_len - 1
            else:
                targets += sum(1 for y in labels[1:max_seq_len] if y != -100)
    return targets / (sequences * (max_seq_len - 1))


@dataclass(frozen=True)
class Target:
    """The device an estimate is for."""

    device: str                       # "cuda" or "cpu": selects the device-specific terms
    total_gib: float                  # its memory
    name: str                         # as shown: "cuda (NVIDIA H200)", or the bare device
    caps: Optional[Capabilities]      # this machine's capabilities when it is this machine's device
    target_fraction: Optional[float] = None   # the share of positions with a target (None: all)
    prompt_tokens: Optional[int] = None       # objective="grpo": the data's longest prompt (None: max_seq_len)


def target(device: str | None, device_total_gib: float | None,
           target_fraction: Optional[float] = None, prompt_tokens: Optional[int] = None) -> Target:
    """The device to estimate for: ``device`` (default: the one nbtrain would use here) with
    ``device_total_gib`` (default: its memory, which must then be this machine's)."""
    dev = device or default_device()
    caps = local_capabilities(dev)
    # the machine's name is shown when the estimate is about this machine (its device or its memory)
    name = f"{dev} ({caps.name})" if caps is not None and (device is None or device_total_gib is None) else dev
    if device_total_gib is None:
        if caps is None:
            raise ValueError(f"device_total_gib: give the memory of the {dev} device to estimate for "
                             "(this machine has none to read)")
        device_total_gib = caps.total_memory_gib
    return Target(dev, float(device_total_gib), name, caps, target_fraction, prompt_tokens)
