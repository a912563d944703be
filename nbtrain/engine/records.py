"""StepRecord, the one payload of a run, and the small records around it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional


@dataclass
class StepRecord:
    """One optimizer step. Field order is part of the public contract (see docs/architecture.md)."""

    step: int
    epoch: float
    micro_steps: int
    tokens: int
    loss: float
    lr: float
    grad_norm: float
    clipped: bool
    scale: Optional[float]
    skipped: bool
    nonfinite: bool
    vram_allocated_gib: Optional[float]
    vram_reserved_gib: Optional[float]
    vram_peak_gib: Optional[float]
    host_rss_gib: float
    # kw_only keeps this position in the field order while records built without it (older checkpoints and
    # streams, the HF Trainer callback) stay valid: None there, as on an accelerator
    host_tensors_gib: Optional[float] = field(default=None, kw_only=True)
    step_time_s: float
    tokens_per_s: float
    elapsed_s: float
    # preference objectives (TRL's names; None for objective="lm"): the step's mean implicit rewards of the chosen
    # and the rejected answers, their mean difference, and the share of pairs whose chosen reward is the larger
    reward_chosen: Optional[float] = field(default=None, kw_only=True)
    reward_rejected: Optional[float] = field(default=None, kw_only=True)
    reward_margin: Optional[float] = field(default=None, kw_only=True)
    reward_accuracy: Optional[float] = field(default=None, kw_only=True)
    # online RL (objective="grpo"; None otherwise). The sampler's log-probs of the tokens it drew against the
    # trainer's teacher-forced ones for the same tokens, over the step's completion tokens: the mean and largest
    # |delta log p| (nats), the k3 estimate of KL(sampler || trainer), and the importance ratio p_trainer / p_sampler;
    # on sampled steps each side against an fp32 teacher-forced pass (mean |delta log p|). Then the step's rewards
    # (mean and std of the total), mean completion length in tokens, the share of tokens whose ratio the clip held,
    # and the share of groups whose rewards were all equal (advantage 0)
    mismatch_mean: Optional[float] = field(default=None, kw_only=True)
    mismatch_max: Optional[float] = field(default=None, kw_only=True)
    mismatch_kl: Optional[float] = field(default=None, kw_only=True)
    is_ratio_min: Optional[float] = field(default=None, kw_only=True)
    is_ratio_mean: Optional[float] = field(default=None, kw_only=True)
    is_ratio_max: Optional[float] = field(default=None, kw_only=True)
    sampler_fp32_gap: Optional[float] = field(default=None, kw_only=True)
    trainer_fp32_gap: Optional[float] = field(default=None, kw_only=True)
    reward_mean: Optional[float] = field(default=None, kw_only=True)
    reward_std: Optional[float] = field(default=None, kw_only=True)
    completion_len_mean: Optional[float] = field(default=None, kw_only=True)
    clip_ratio: Optional[float] = field(default=None, kw_only=True)
    frac_zero_std: Optional[float] = field(default=None, kw_only=True)
    variant: Optional[str] = None  # set by compare(): which variant produced this record

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord) if f.name != "variant")


@dataclass
class EvalRecord:
    """An evaluation on the held-out split, after optimizer step ``step``."""

    step: int
    eval_loss: float
    eval_tokens: int
    eval_accuracy: Optional[float] = None   # sequence classification only
    eval_perplexity: Optional[float] = None  # causal LM only
    variant: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunInfo:
    """What ``on_run_start`` receives: enough to label and size a live view before step 1."""

    config: Any
    precision_used: str
    device: str
    device_name: str
    device_total_gib: float
    scaler_enabled: bool
    total_steps: int
    train_examples: int
    eval_examples: int
    trainable_params: int
    total_params: int
    max_grad_norm: Optional[float]
    variant: Optional[str] = None
    model: Any = field(default=None, repr=False, compare=False)  # to observe (e.g. snapshot weights), never to change
    # for a live MFU: one training token's model FLOPs (engine.flops) and the peak TFLOP/s of every process's device
    # for the run's compute dtype; None where unknown
    model_flops_per_token: Optional[float] = None
    peak_tflops: Optional[float] = None
    # set by compare(): which of the comparison's runs this is and whether its speed counts ("repeat 1 of 1",
    # "drawn live, untimed"), for the live lines beside its tok/s; None outside a comparison
    timing: Optional[str] = None


@dataclass
class SampleRecord:
    """A sample prompt's greedy answer at optimizer step ``step`` (``on_sample``; a row of ``result.samples``)."""

    step: int
    prompt: str
    answer: str
    new_tokens: int                # tokens generated (the stop token included when one ended the answer)
    seconds: float                 # wall time of this answer (not counted in any step's step_time_s)
    variant: Optional[str] = None  # set by compare(): which variant answered

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SampleRecord))
