"""Leaner activations for Llama-family layers: ``lean_layers(model)`` (``TrainConfig.lean_layers``).

Eager autograd keeps, per token and decoder layer, more than backward needs:

* the SwiGLU MLP ``down(silu(gate(x)) * up(x))`` keeps gate(x), silu(gate(x)), up(x) and their product, the
  down projection's input (4 x intermediate elements in the autocast dtype);
* an RMSNorm with a trainable weight keeps its fp32 input and its fp32 normalised input (2 x hidden fp32).

Here the MLP keeps gate(x) and up(x), and the norm its input and the per-row scale; what backward needs
beyond that (the SiLU, the product, the normalised input) is recomputed there by a few pointwise ops. The ops
and their order are those of eager autograd, so losses and gradients are equal bit for bit to the unchanged
model's (tests/test_lean.py). At Qwen2.5-0.5B's shape (bf16, 8 x 1024, full) nbtrain.memory estimates
4.9 GiB less.

The product and the down projection run as one autograd function when ``down_proj`` is a plain bias-free
``nn.Linear`` (full fine-tuning; a forward hook on it does not fire then). Otherwise (LoRA, QLoRA) only
``silu(gate) * up`` is one: the SiLU output is not kept, and the down projection keeps what it kept before.
A module class is taken only after its own forward and the lean one agree on a probe input, so a look-alike
with other arithmetic (Gemma's ``1 + weight`` norm, a GELU MLP) is left alone.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..precision import active_autocast_dtype

_silu_backward = torch.ops.aten.silu_backward


class _SiluMulDown(torch.autograd.Function):
    """``down(silu(g) * u)`` for a bias-free Linear ``down``; keeps g, u and the weight's cast only (eager also
    keeps silu(g) and the product, the down projection's input)."""

    @staticmethod
    def forward(ctx, g, u, wd, dtype):
        wd_ = wd if dtype is None else wd.to(dtype)   # the value autocast's cast would give
        out = F.linear((F.silu(g) * u).to(wd_.dtype), wd_)
        ctx.save_for_backward(g, u, wd_)
        ctx.wd_dtype = wd.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        g, u, wd_ = ctx.saved_tensors
        s = F.silu(g)                                     # recomputed: not kept since the forward
        go = grad_out.reshape(-1, grad_out.shape[-1])
        gwd = gg = gu = None
        if ctx.needs_input_grad[2]:   # first, while only the SiLU output is alive beside the weight's gradient
            p = (s * u).to(wd_.dtype).reshape(-1, g.shape[-1])
            gwd = go.t() @ p
            del p
            gwd = gwd.to(ctx.wd_dtype)
        gp = (go @ wd_).view(g.shape)
        # the product's backward, as eager's mul, each intermediate dropped after its last use
        if ctx.needs_input_grad[1]:
            gu = (gp * s).to(u.dtype)
        del s
        if ctx.needs_input_grad[0]:
            gs = (gp * u).to(g.dtype)
            del gp
            gg = _silu_backward(gs, g)
        return gg, gu, gwd, None


class _SiluMul(torch.autograd.Function):
    """``silu(g) * u`` keeping g and u only (eager also keeps silu(g))."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        gg = gu = None
        if ctx.needs_input_grad[0]:
            gg = _silu_backward((grad * u).to(g.dtype), g)
        if ctx.needs_input_grad[1]:
            gu = (grad * F.silu(g)).to(u.dtype)
        return gg, gu


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm keeping its input and the per-row 1/rms (eager also keeps the fp32 normalised input).

    Takes its input twice (``apply(x, x, w, eps)``) and returns the input's gradient in two parts, the product
    path first, then the square's: autograd then sums them into x's gradient in eager's order (after the
    residual branch's), so the result is equal bit for bit, not only to rounding."""

    @staticmethod
    def forward(ctx, x, x_again, w, eps):
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, r)
        return w * (xf * r).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, w, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        g_prod = g_sq = grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = (gy * (xf * r).to(x.dtype)).sum_to_size(w.shape).to(w.dtype)
        if ctx.needs_input_grad[0]:
            # eager autograd's formulas, in its order: mul, rsqrt (-0.5 * grad * result^3), mean, pow
            gn = (gy * w).to(x.dtype).to(torch.float32)
            g_prod = gn * r
            gr = (gn * xf).sum_to_size(r.shape)
            gsq = ((-0.5 * gr) * r.pow(3)).expand_as(xf) / xf.shape[-1]
            g_sq = gsq * (2.0 * xf)
            if x.dtype != torch.float32:   # eager sums the two in fp32, then casts once
                g_prod, g_sq = (g_prod + g_sq).to(x.dtype), None
        return g_prod, g_sq, grad_weight, None


def _norm_forward(self, hidden_states):
    if torch.is_grad_enabled() and self.weight.requires_grad:
        return _RMSNorm.apply(hidden_states, hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)    # nothing to save: the class's own forward


def _mlp_forward(self, x):
    if not torch.is_grad_enabled():
        return type(self).forward(self, x)
    g, u = self.gate_proj(x), self.up_proj(x)
    if self._nbtrain_lean_fused:
        return _SiluMulDown.apply(g, u, self.down_proj.weight, active_autocast_dtype(g.device.type))
    return self.down_proj(_SiluMul.apply(g, u))


def _is_norm(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float))


def _is_mlp(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), torch.nn.Module) for a in ("gate_proj", "up_proj", "down_proj",
                                                                          "act_fn"))


def _plain(lin: torch.nn.Module) -> bool:
    return type(lin) is torch.nn.Linear and lin.bias is None and lin.weight.is_floating_point()


def _probe(m: torch.nn.Module, width: int, lean_forward) -> bool:
    """Do the class's forward and the lean one agree on a small input (dropout off, no RNG drawn)?"""
    w = next(m.parameters())
    if w.device.type == "meta":
        return False
    dtype = w.dtype if w.is_floating_point() else torch.float32
    x = torch.linspace(-2.0, 2.0, 3 * width, device=w.device, dtype=dtype).reshape(3, width).requires_grad_()
    was = m.training
    m.eval()
    try:
        with torch.enable_grad():
            ref = type(m).forward(m, x)
            got = lean_forward(m, x)
        return ref.shape == got.shape and torch.allclose(ref.float(), got.float(), rtol=1e-5, atol=1e-6)
    except Exception:   # a look-alike whose forward takes other arguments: not ours to change
        return False
    finally:
        m.train(was)


@dataclass
class LeanLayers:
    """What ``lean_layers`` changed; ``undo()`` gives every module its class's forward back."""

    mlps: list = field(default_factory=list)
    fused: int = 0                       # of the MLPs, those whose down projection runs in the function
    norms: list = field(default_factory=list)
    skipped: list = field(default_factory=list)   # class names that looked alike but computed otherwise

    def undo(self) -> None:
        for m in self.mlps + self.norms:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_nbtrain_lean_fused", None)
        self.mlps, self.norms, self.fused = [], [], 0

    def describe(self) -> str:
        if not (self.mlps or self.norms):
            return "lean_layers: no Llama-style SwiGLU MLP or RMSNorm found; nothing changed"
        s = (f"lean_layers: {len(self.mlps)} MLPs ({self.fused} with their down projection) and "
             f"{len(self.norms)} RMSNorms keep less for backward")
        return s + (f"; left alone: {', '.join(sorted(set(self.skipped)))}" if self.skipped else "")


def lean_layers(model: torch.nn.Module) -> LeanLayers:
    """Make the model's SwiGLU MLPs and trainable RMSNorms recompute cheap intermediates in backward instead
    of keeping them (in place; equal results; ``.undo()`` restores). Call after the method (LoRA) is applied:
    which MLPs take their down projection in depends on whether it is still a plain ``nn.Linear``."""
    out = LeanLayers()
    verdict: dict[tuple, bool] = {}
    for m in model.modules():
        if "forward" in m.__dict__:
            continue          # already lean, or someone else's instance-level forward
        if _is_mlp(m):
            fused = _plain(m.down_proj)
            key = (type(m), type(m.act_fn), fused)    # one class may hold several activations
            if key not in verdict:
                m._nbtrain_lean_fused = fused
                verdict[key] = _probe(m, m.gate_proj.in_features if hasattr(m.gate_proj, "in_features")
                                      else m.gate_proj.weight.shape[-1], _mlp_forward)
                del m._nbtrain_lean_fused
            if verdict[key]:
                m._nbtrain_lean_fused = fused
                m.forward = types.MethodType(_mlp_forward, m)
                out.mlps.append(m)
                out.fused += fused
            else:
                out.skipped.append(type(m).__name__)
        elif _is_norm(m) and m.weight.requires_grad:   # a frozen weight: eager keeps no more than this
            key = (type(m), None)
            if key not in verdict:
                verdict[key] = _probe(m, m.weight.shape[0],
                                      lambda n, x: _RMSNorm.apply(x, x, n.weight, n.variance_epsilon))
            if verdict[key]:
                m.forward = types.MethodType(_norm_forward, m)
                out.norms.append(m)
            else:
                out.skipped.append(type(m).__name__)
    return out
