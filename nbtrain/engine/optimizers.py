"""Optimizers: one table name -> a small builder, each with the run's lr and weight decay (the schedule wraps
whichever it is). The loop steps them all alike: ``scaler.step(optimizer)`` skips any of them on inf/nan.

The precision of the optimizer's *state* comes from two places: the optimizer (8-bit states for the bitsandbytes
ones, Adafactor's factored second moment) and the weights' dtype (torch's AdamW and SGD keep their state in the
dtype of the weights, so bf16 under precision="bf16-pure"). ``BF16StochasticAdamW`` is AdamW for bf16 weights
whose updates are rounded stochastically (``stochastic_rounding=True``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .._logs import import_bitsandbytes
from ..config import TrainConfig

# SGD's momentum (the only one nbtrain offers; LLaMA-Factory's and the HF Trainer's "sgd" take the same default
# lr schedule and weight decay and add momentum through optim_args)
SGD_MOMENTUM = 0.9


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 up or down at random, with the chance of rounding up equal to how far ``x``
    lies towards the upper neighbour: ``E[round(x)] = x``, so updates smaller than bf16's spacing are kept on
    average instead of always lost.

    bf16 is the top 16 bits of fp32: adding a uniform random 16-bit integer to the low half and cutting it off
    carries into the kept bits with exactly that chance (sign and magnitude are stored apart, so this holds for
    negative values too)."""
    bits = x.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = (bits + noise) & -65536   # -65536 == 0xFFFF0000 as int32: clear the 16 bits bf16 does not keep
    return rounded.view(torch.float32).to(torch.bfloat16)   # exact: the cut bits are zero


class BF16StochasticAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, torch's defaults) for bf16 weights: each step
    computes in fp32 from the bf16 weight and states, and writes all three back to bf16 by stochastic rounding.
    The state stays bf16 (4 B per weight, as torch's AdamW on bf16 weights). Its random stream is its own,
    seeded from the run's seed, and is part of ``state_dict()`` so a resumed run rounds as the uninterrupted
    one would."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        first = next(p for g in self.param_groups for p in g["params"])
        self._generator = torch.Generator(device=first.device)
        self._generator.manual_seed(seed)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        g = self._generator
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad.float()
                w = p.float()
                m = state["exp_avg"].float().mul_(b1).add_(grad, alpha=1 - b1)
                v = state["exp_avg_sq"].float().mul_(b2).addcmul_(grad, grad, value=1 - b2)
                w.mul_(1 - lr * wd)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                # the moments too: a bf16 EMA rounded to nearest stops moving once (1 - beta) x its change is
                # below bf16's spacing (b2's 0.001 is, at 2^-8 relative spacing)
                p.copy_(stochastic_round_bf16(w, g))
                state["exp_avg"].copy_(stochastic_round_bf16(m, g))
                state["exp_avg_sq"].copy_(stochastic_round_bf16(v, g))
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["rounding_rng"] = self._generator.get_state()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        rng = state_dict.pop("rounding_rng", None)
        super().load_state_dict(state_dict)
        if rng is not None:
            self._generator.set_state(rng)


def _adamw(cfg: TrainConfig, params, device: str):
    if cfg.stochastic_rounding:
        return BF16StochasticAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=adamw_fused(params, device))


def adamw_fused(params, device: str) -> bool:
    """Whether torch's fused AdamW applies: floating-point params on CUDA or (torch >= 2.4) the CPU.

    On the CPU torch otherwise picks its per-tensor loop: on SmolLM2-135M one step of that is 4x the fused
    kernel's time (344 vs 81 ms for the full model's 272 tensors on this 2-core Xeon), about 12% of a full
    fine-tuning step. The Trainer's default (adamw_torch_fused) is fused too."""
    if device not in ("cuda", "cpu"):
        return False
    if not all(torch.is_floating_point(p) for p in params):
        return False
    if device == "cpu":
        # the CPU kernel has no DTensor (FSDP2 shard) rule in torch 2.13: "output with shape [] doesn't match the
        # broadcast shape [1]"; sharded runs keep the per-tensor loop there
        return hasattr(torch, "_fused_adamw_") and not any(type(p).__name__ == "DTensor" for p in params)
    return True


def _bnb(name: str):
    def build(cfg: TrainConfig, params, device: str):
        try:
            bnb = import_bitsandbytes()
        except Exception as e:   # not installed, or its native library does not load
            raise ImportError(f"optimizer: {cfg.optimizer!r} needs bitsandbytes (pip install bitsandbytes): "
                              f"{type(e).__name__}: {e}") from None
        # torch's AdamW defaults (betas 0.9/0.999, eps 1e-8); bitsandbytes' own weight decay default is 0.01
        return getattr(bnb.optim, name)(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return build


def _adafactor(cfg: TrainConfig, params, device: str):
    # The HF Trainer's optim="adafactor": the run's lr and schedule, not Adafactor's own relative step sizes
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, scale_parameter=False,
                     relative_step=False, warmup_init=False)


def _sgd(cfg: TrainConfig, params, device: str):
    return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM, weight_decay=cfg.weight_decay)


OPTIMIZER_BUILDERS: dict[str, Callable[[TrainConfig, list, str], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "adamw_8bit": _bnb("AdamW8bit"),
    "paged_adamw_8bit": _bnb("PagedAdamW8bit"),
    "adafactor": _adafactor,
    "sgd": _sgd,
}


def build_optimizer(cfg: TrainConfig, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names, over ``params``, with the run's lr and weight decay."""
    return OPTIMIZER_BUILDERS[cfg.optimizer](cfg, params, device)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state holds right now (0 before its first step): every tensor in it."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
    return total
