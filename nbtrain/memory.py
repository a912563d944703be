"""Estimate the memory a TrainConfig needs, from the model's config alone: ``estimate_memory(cfg)``.

Nothing is loaded or run: the architecture is built on the ``meta`` device (exact parameter counts,
no weights), LoRA adapters are applied there by peft with the same ``LoraConfig`` the trainer uses,
and the rest is arithmetic. The model follows what nbtrain's loop does (``nbtrain.engine.loop``):
fp32 master weights, the forward under ``torch.autocast`` (bf16/fp16) or plain fp32/tf32, the loss
``cross_entropy(logits.float(), shifted labels)`` outside autocast, ``backward()``, then AdamW and
``zero_grad(set_to_none=True)``.

Notation: B = micro_batch_size, T = max_seq_len, N = B*T tokens per micro-batch, h = hidden size, a = heads*head_dim, kv = kv_heads*head_dim, i = intermediate size,
V = vocabulary (or number of labels), s = autocast bytes (2 under bf16/fp16, 4 under fp32/tf32).

Parts (bytes):

* weights: full/LoRA: 4 per parameter (adapters included). QLoRA: quantised Linear weights
  (every Linear of the decoder; not the embeddings, norms, output layer or a classifier head)
  take 4-bit nf4 with double quantisation: ceil(n/2) packed + ceil(n/64) 8-bit absmax (block 64)
  + 4*ceil(n/64/256) second-level absmax + 1,088 bytes of code tables and offset per layer
  (~0.127 bits/param beyond the 4); 8-bit: n int8 + 4*out_features row scales. Others: 4 bytes.
* gradients: 4 per trainable parameter (fp32, ``.grad``).
* optimizer: AdamW's exp_avg and exp_avg_sq, 8 bytes per trainable parameter, plus the 4-byte
  ``step`` tensor of each trainable tensor.
* activations: the tensors autograd saves for backward, traced op by op through a Llama-style
  decoder layer (RMSNorm -> q/k/v/o -> RoPE -> SDPA -> residual -> RMSNorm -> gate/up/down SiLU MLP;
  other architectures: the same layer with their sizes, noted). Full fine-tuning under bf16 autocast
  keeps ``26h + 4a + 4kv + 8i + 8 + 4*heads`` bytes per token per layer, under fp32
  ``24h + 8a + 8kv + 16i + 8 + 4*heads``; under autocast also a bf16 copy of every Linear weight whose
  input needs a gradient (2 bytes/param: the frozen LoRA base and the output layer too). LoRA adds,
  per adapted Linear, a dropout mask (1 byte/element on CUDA, the input's dtype on CPU), the adapter
  input's cast (s bytes/element) and r*s; QLoRA's 4-bit layers keep nothing but return their input's
  dtype (fp32 in the MLP). SDPA: q, k, v, out and the fp32 log-sum-exp (flash / cuDNN / efficient,
  linear in T), except fp32 with grouped kv heads on CUDA, where only the math kernel exists: scaled
  q, k and v repeated to all heads, and the heads*T*T softmax. Rows are full length (no padding mask).
  With gradient checkpointing each layer keeps only its fp32 input (4h per token) and is recomputed,
  one at a time, in backward. With ``lean_layers`` (nbtrain.models.lean) a trainable RMSNorm does not keep
  its normalised input (4h) and the MLP neither SiLU's output nor the product (2 x i x s each; what an
  adapter on the down projection keeps stays), its backward then holding three intermediates, not two.
* logits and loss: the logits N*V*s exist at the end of the forward (the loop keeps no reference to them
  past the loss); the loss (over all N rows: the loop shifts the labels, not the logits) adds an fp32 copy
  (under autocast) and
  log_softmax's output, its backward the two fp32 gradients: 12*N*V at the peak
  (often the largest single term for small models with big vocabularies). With ``chunked_loss`` only
  one chunk C = loss_chunk_tokens lives at a time. Fused (a plain linear head): the chunk's logits and their
  gradient, 4*C*V in fp32 (6*C*V plus bf16 copies of the weight and hidden states under autocast), and the
  gradients made in the forward (hidden states, and the weight when it trains), kept until backward scales
  them (a second copy). Recompute (any other head): 12*C*V in the chunk's backward, plus the selected fp32
  hidden states and their gradient.
* overhead: on CUDA the context and libraries outside PyTorch's allocator (0.75 GiB, measured on an
  H200) plus the caching allocator's reserved-but-free blocks (14% of the tensor peak); on CPU 5%.

The total is not the sum of the parts: it is the peak of a timeline of one training step. Weights
and optimizer state are always there; gradients (``set_to_none``) appear during backward, as the
activations they replace are freed. So the peak is the largest of: inside the last layer's forward
(without checkpointing: all layers' activations plus that layer's short-lived tensors, e.g. a LoRA adapter's
fp32 input copy and dropout output, large on the down projection), the end of the forward,
the loss backward (all activations + logits + 12*N*V), the output layer's backward, each decoder
layer's backward (remaining activations + gradients so far + that layer's transient, and its
recomputation under checkpointing), the embedding's backward, and the optimizer step. With
``grad_accum_steps > 1`` the gradients of the earlier micro-batches coexist with the activations.

Advice (only when the total does not fit) follows the out-of-memory flow: (1) lower
micro_batch_size and raise grad_accum_steps to keep the effective batch, (2) enable lean_layers
(Llama-style layers), gradient checkpointing, then the chunked loss (causal LM), (3) switch full -> LoRA
-> QLoRA, (4) shorten max_seq_len. A step is taken only when it lowers the estimate. Each item is cumulative:
its ``change`` holds all overrides so far, so ``cfg.replace(**advice[k].change)`` is the config whose
estimate ``advice[k].total_gib`` is; the list stops at the first that fits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .config import ConfigError, TrainConfig
from .hardware import capabilities, resolve_precision

GIB = 2**30
# Outside the tensors: the CUDA context with its kernels' modules and library handles (0.73-0.75 GiB measured on
# an H200 with CUDA 13, beside PyTorch's allocator), and the caching allocator's reserved-but-free blocks: 2-28%
# of the tensor peak over the benchmark grid (benchmarks/memory_check.py), 14% splits that range evenly.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
SLACK = {"cuda": 0.14, "cpu": 0.05}
NF4_BLOCK = 64                       # bitsandbytes' 4-bit block size
NF4_BLOCK2 = 256                     # block size of the double-quantised absmax
NF4_TABLES = 256 * 4 + 16 * 4 + 4    # per layer: second-level code, nf4 code, offset (fp32)
STEP_BYTES = 4                       # AdamW's per-tensor ``step`` (fp32 scalar)
NUM_LABELS = 2                       # a classifier's labels come from the data; its head is tiny either way

_LLAMA_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Advice:
    """One change of the out-of-memory flow: cumulative TrainConfig overrides and the estimate they give."""

    change: dict[str, Any]
    description: str
    total_gib: float
    fits: bool


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

    _ROWS = (("weights", "weights_gib"), ("gradients", "gradients_gib"), ("optimizer", "optimizer_gib"),
             ("activations", "activations_gib"), ("logits + loss", "logits_gib"), ("overhead", "overhead_gib"),
             ("total (peak)", "total_gib"))

    def table(self):
        """The parts as a DataFrame (part, GiB); the total is the step's peak, not their sum."""
        import pandas as pd

        return pd.DataFrame([(name, getattr(self, attr)) for name, attr in self._ROWS], columns=["part", "GiB"])

    def versus(self, measured_peak_gib: float | Any) -> dict[str, float]:
        """Estimated tensor peak beside a measured one (a GiB value, or a TrainResult's summary peak)."""
        if hasattr(measured_peak_gib, "summary"):
            measured_peak_gib = measured_peak_gib.summary.get("peak_vram_gib")
        if measured_peak_gib is None:
            raise ValueError("no measured peak: peak_vram_gib is None (a CPU run has no device peak)")
        m = float(measured_peak_gib)
        return {"estimated_gib": self.tensors_peak_gib, "measured_gib": m,
                "ratio": self.tensors_peak_gib / m if m else math.inf}

    def __str__(self) -> str:
        return format_estimate(self)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{name}</td><td style='text-align:right'>{getattr(self, attr):,.2f}</td></tr>"
                       for name, attr in self._ROWS)
        verdict = "fits" if self.fits else "does not fit"
        adv = ""
        if self.advice:
            items = "".join(f"<li>{a.description}: {a.total_gib:,.2f} GiB{' (fits)' if a.fits else ''}</li>"
                            for a in self.advice)
            adv = f"<p>To make it fit, in order:</p><ol>{items}</ol>"
        notes = "".join(f"<br><small>{n}</small>" for n in self.notes)
        return (f"<b>Memory estimate</b> ({self.precision}, {self.config.method}, micro batch "
                f"{self.config.micro_batch_size} x seq {self.config.max_seq_len})"
                f"<table><tr><th>part</th><th>GiB</th></tr>{rows}</table>"
                f"<p>{self.device}: {self.device_total_gib:,.1f} GiB, <b>{verdict}</b>; peak at "
                f"{self.peak_phase}.{notes}</p>{adv}")


def format_estimate(est: MemoryEstimate) -> str:
    """The text table ``nbtrain estimate`` prints: the parts, the peak, the verdict and any advice."""
    cfg = est.config
    lines = [f"memory estimate: {cfg.model} {cfg.task}, {cfg.method}, {est.precision}, micro batch "
             f"{cfg.micro_batch_size} x accum {cfg.grad_accum_steps}, seq {cfg.max_seq_len}"
             f"{', gradient checkpointing' if cfg.gradient_checkpointing else ''}",
             f"  parameters: {est.total_params:,} ({est.trainable_params:,} trainable)", ""]
    width = max(len(n) for n, _ in est._ROWS)
    lines.append(f"  {'part':<{width}}  {'GiB':>9}")
    for name, attr in est._ROWS:
        if name.startswith("total"):
            lines.append(f"  {'-' * width}  {'-' * 9}")
        lines.append(f"  {name:<{width}}  {getattr(est, attr):>9.2f}")
    lines.append("")
    lines.append(f"  total: the step's peak, at {est.peak_phase}; not the sum of the parts, since")
    lines.append("  gradients are created in backward as the activations are freed")
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines.append(f"  {est.device}: {est.device_total_gib:.2f} GiB -> {verdict}")
    for n in est.notes:
        lines.append(f"  note: {n}")
    if est.advice:
        lines.append("")
        lines.append("  to make it fit (each step keeps the previous ones):")
        for k, a in enumerate(est.advice, 1):
            lines.append(f"  {k}. {a.description}: {a.total_gib:.2f} GiB{'  fits' if a.fits else ''}")
        last = est.advice[-1]
        sets = " ".join(f"--set {k}={v}" for k, v in last.change.items())
        lines.append(f"  {'use' if last.fits else 'closest'}: {sets}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The architecture, from the config only
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Linear:
    name: str          # qualified module name in the (un-wrapped) model
    leaf: str
    layer: Optional[int]
    n_in: int
    n_out: int
    weight: int        # weight elements
    bias: int


@dataclass(frozen=True)
class _Arch:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int              # output width of the head: the vocabulary, or the number of labels
    tied: bool
    llama_like: bool        # the decoder layer is modelled op by op (else approximated with the same shapes)
    linears: tuple[_Linear, ...]
    head: Optional[str]     # module name of the output layer / classifier
    params: tuple[tuple[str, int, bool], ...]   # (name, numel, 2-D weight of a Linear) for every parameter
    total_params: int


def _layer_index(name: str, n_layers: int) -> Optional[int]:
    parts = name.split(".")
    for k, p in enumerate(parts[:-1]):
        if p.isdigit() and k > 0 and parts[k - 1] in ("layers", "layer", "h", "blocks", "block"):
            i = int(p)
            return i if i < n_layers else None
    return None


def _meta_model(model: str, task: str, num_labels: int):
    from .models.loading import meta_model

    # a Hub id fetches config.json only (no weights)
    return meta_model(model, task, num_labels, local_only=False)


def _config_stamp(model: str) -> Optional[float]:
    f = Path(model).expanduser() / "config.json"
    return f.stat().st_mtime if f.is_file() else None


@functools.lru_cache(maxsize=32)
def _arch(model: str, task: str, num_labels: int, stamp: Optional[float]) -> _Arch:
    import torch

    m = _meta_model(model, task, num_labels)
    c = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
    hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0) or getattr(c, "d_model", 0))
    layers = int(getattr(c, "num_hidden_layers", 0) or getattr(c, "n_layer", 0) or getattr(c, "num_layers", 0))
    heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 1)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    inter = int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden)
    linears, seen = [], set()
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear):
            linears.append(_Linear(name, name.rsplit(".", 1)[-1], _layer_index(name, layers), mod.in_features,
                                   mod.out_features, mod.weight.numel(),
                                   mod.bias.numel() if mod.bias is not None else 0))
    lin_weights = {f"{lin.name}.weight" for lin in linears}
    params = []
    for name, p in m.named_parameters():   # tied parameters are yielded once
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append((name, p.numel(), name in lin_weights))
    out = m.get_output_embeddings() if task == "causal-lm" else None
    head = None
    if out is not None:
        head = next((n for n, mod in m.named_modules() if mod is out), None)
    else:
        from .models.loading import head_module_names

        names = head_module_names(m)
        head = next((lin.name for lin in linears if names and lin.name.split(".")[0] in names), None)
    head_out = next((lin.n_out for lin in linears if lin.name == head), int(getattr(c, "vocab_size", 0) or 0))
    emb = m.get_input_embeddings()
    tied = bool(out is not None and emb is not None and out.weight is emb.weight)
    layer_leaves = {lin.leaf for lin in linears if lin.layer is not None}
    llama_like = set(_LLAMA_ROLES) <= layer_leaves
    return _Arch(model_type=str(getattr(c, "model_type", type(m).__name__)), hidden=hidden, layers=layers,
                 heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=inter, vocab=head_out, tied=tied,
                 llama_like=llama_like, linears=tuple(linears), head=head, params=tuple(params),
                 total_params=sum(n for _, n, _ in params))


@functools.lru_cache(maxsize=64)
def _adapters(model: str, task: str, num_labels: int, stamp: Optional[float], lora_r: int,
              targets: tuple[str, ...] | str) -> tuple[dict[str, int], dict[str, int], int]:
    """({adapted Linear name: adapter params}, {name: params} of other trainable tensors (heads),
    number of trainable tensors), from peft applied to the meta model with the trainer's LoraConfig."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from .models.methods import lora_config

    cfg = TrainConfig.model_construct(model=model, task=task, lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                      lora_targets=targets if isinstance(targets, str) else list(targets))
    m = _meta_model(model, task, num_labels)
    for p in m.parameters():
        p.requires_grad_(False)
    pm = get_peft_model(m, lora_config(cfg, m, task))
    prefix = "base_model.model."
    adapted, others, n_tensors = {}, {}, 0
    lora_mods = {n for n, mod in pm.named_modules() if isinstance(mod, LoraLayer)}
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        n_tensors += 1
        owner = next((lm for lm in lora_mods if name.startswith(lm + ".lora_")), None)
        if owner is not None:
            key = owner[len(prefix):] if owner.startswith(prefix) else owner
            adapted[key] = adapted.get(key, 0) + p.numel()
        else:
            others[name] = p.numel()
    return adapted, others, n_tensors


def _quant_skip(model: str, task: str, num_labels: int, arch: _Arch) -> set[str]:
    """Linear modules bitsandbytes leaves unquantised, as transformers decides (output layer, heads)."""
    if task == "sequence-classification":
        from .models.loading import head_module_names

        keys = head_module_names(_meta_model(model, task, num_labels))
    else:
        try:
            from transformers.quantizers.base import get_keys_to_not_convert

            keys = get_keys_to_not_convert(_meta_model(model, task, num_labels))
        except Exception:  # an older transformers: the output layer is what it skips
            keys = [arch.head] if arch.head else []
    skip = set()
    for lin in arch.linears:
        if any(lin.name == k or lin.name.startswith(k + ".") or lin.name.endswith(k) for k in keys):
            skip.add(lin.name)
    return skip


def _nf4_bytes(n: int) -> int:
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + NF4_TABLES


# ---------------------------------------------------------------------------------------------------------------
# Activations: a symbolic trace of what autograd saves
# ---------------------------------------------------------------------------------------------------------------
class _T:
    """A tensor of the trace: ``elems`` per token, ``size`` bytes per element, requires grad or not."""

    __slots__ = ("elems", "size", "rg")

    def __init__(self, elems: int, size: int, rg: bool):
        self.elems, self.size, self.rg = elems, size, rg


@dataclass
class _Lin:
    n_in: int
    n_out: int
    weight: int
    kind: str          # "trainable" | "frozen" | "quant"
    lora_r: int = 0    # 0: no adapter


class _Trace:
    """Saved tensors of one decoder layer (or the head) per token, plus token-independent copies."""

    def __init__(self, ac: Optional[int], mask_bytes: Optional[int], dropout: bool, math_seq: int = 0,
                 quant_out_ac: bool = True, lean: bool = False):
        self.ac = ac                  # autocast element size, None without autocast
        self.lean = lean              # nbtrain.models.lean: norms and the MLP keep less (TrainConfig.lean_layers)
        self.quant_out_ac = quant_out_ac   # a quantised layer returns the autocast dtype (4-bit), else its input's
        self.mask_bytes = mask_bytes  # dropout mask bytes per element (None: the input's dtype)
        self.dropout = dropout
        self.math_seq = math_seq      # > 0: SDPA falls back to the math kernel (T x T scores) at this length
        self.attn_grad = 0            # bytes per token of the attention's backward temporaries (math kernel)
        self.saved: dict[int, _T] = {}
        self.const = 0                # weight copies saved for backward (bytes)
        self.cache = 0                # weight copies autocast caches for the forward (trainable leaves)
        self.fwd_extra = 0            # largest short-lived tensor set inside the forward, per token
        self.mlp_grad = 0             # bytes per token of one MLP-intermediate gradient
        self.mlp_live = 2             # MLP intermediates alive at once in its backward (gradients, recomputed)

    def save(self, t: _T) -> None:
        self.saved[id(t)] = t

    @property
    def per_token(self) -> int:
        return sum(t.elems * t.size for t in self.saved.values())

    def cast(self, x: _T) -> _T:
        return x if self.ac is None or x.size == self.ac else _T(x.elems, self.ac, x.rg)

    def linear(self, x: _T, spec: _Lin) -> _T:
        trainable = spec.kind == "trainable"
        if spec.kind == "quant":
            # bitsandbytes keeps only the packed weight for backward and returns its input's dtype; nbtrain
            # hands a 4-bit layer its input in the autocast dtype (models.methods.autocast_quantized_inputs)
            out = _T(spec.n_out, self.ac if self.ac and self.quant_out_ac else x.size, x.rg)
        else:
            xin = self.cast(x)
            if trainable:
                self.save(xin)
                if self.ac:
                    self.cache += 2 * spec.weight
            if x.rg and self.ac:
                self.const += 2 * spec.weight   # the cast weight, for the input's gradient
            out = _T(spec.n_out, self.ac or 4, x.rg or trainable)
        if not spec.lora_r:
            return out
        r = spec.lora_r
        # peft casts the input to the adapter's dtype (fp32), drops out, then lora_A and lora_B; the
        # fp32 copy and the dropout output live only while the adapter runs, beside the base output
        xl = x if x.size == 4 else _T(x.elems, 4, x.rg)
        xd = xl
        drop_out = 0
        if self.dropout:
            if xl.rg:
                self.save(_T(xl.elems, self.mask_bytes or xl.size, False))
            xd = _T(xl.elems, 4, xl.rg)
            drop_out = 4 * x.elems if self.ac else 0   # without autocast lora_A keeps it (saved)
        # short-lived: the fp32 copy, then the dropout output, or lora_B's output and its scaled copy
        extra = ((4 * x.elems if xl is not x else 0) + max(drop_out, 2 * spec.n_out * (self.ac or 4))
                 + (0 if id(x) in self.saved else x.elems * x.size))   # the input itself, held by the call
        self.fwd_extra = max(self.fwd_extra, extra)
        self.save(self.cast(xd))
        a_out = _T(r, self.ac or 4, True)
        self.save(a_out)
        if self.ac:
            self.const += 2 * r * (spec.n_in + spec.n_out)
            self.cache += 2 * r * (spec.n_in + spec.n_out)
        return _T(spec.n_out, max(out.size, self.ac or 4), True)

    def rmsnorm(self, x: _T, trainable: bool) -> _T:
        if not (x.rg or trainable):
            return _T(x.elems, 4, False)
        xf = x if x.size == 4 else _T(x.elems, 4, x.rg)
        if x.rg:
            self.save(xf)
            self.save(_T(1, 4, True))              # rsqrt of the variance
        if trainable and not self.lean:   # lean: recomputed in backward from the input and the 1/rms
            normed = _T(x.elems, 4, x.rg)
            self.save(normed if x.size == 4 else _T(x.elems, x.size, x.rg))
        return _T(x.elems, 4, x.rg or trainable)

    def rope(self, q: _T) -> _T:
        return _T(q.elems, max(q.size, 4), q.rg)   # cos/sin are fp32: q * cos promotes

    def sdpa(self, q: _T, k: _T, v: _T, heads: int) -> _T:
        rg = q.rg or k.rg or v.rg
        size = self.ac or 4
        if self.math_seq:
            # the math kernel: scaled q, k and v repeated to every head, the softmax (heads x T per token);
            # its output is laid out by head, so the caller's transpose makes a copy for o_proj
            probs = heads * self.math_seq * size
            if rg:
                for elems in (q.elems, q.elems, q.elems):
                    self.save(_T(elems, size, True))
                self.save(_T(probs, 1, True))
            self.fwd_extra = max(self.fwd_extra, 2 * probs)      # the scores, then the probabilities
            self.attn_grad = 2 * probs                           # their gradients in backward
            return _T(q.elems, size, rg)
        q2, k2, v2 = self.cast(q), self.cast(k), self.cast(v)
        out = _T(q.elems, size, rg)
        if rg:
            for t in (q2, k2, v2, out):
                self.save(t)
            self.save(_T(heads, 4, False))         # log-sum-exp
        return out

    def mul(self, a: _T, b: _T) -> _T:
        if a.rg:
            self.save(b)
        if b.rg:
            self.save(a)
        return _T(a.elems, max(a.size, b.size), a.rg or b.rg)


def _trace_layer(tr: _Trace, x: _T, lin: dict[str, _Lin], norms_trainable: bool, arch: _Arch) -> _T:
    """One Llama-style decoder layer; returns its output (the next residual)."""
    xn = tr.rmsnorm(x, norms_trainable)
    q, k, v = tr.linear(xn, lin["q"]), tr.linear(xn, lin["k"]), tr.linear(xn, lin["v"])
    attn = tr.sdpa(tr.rope(q), tr.rope(k), v, arch.heads)
    o = tr.linear(attn, lin["o"])
    r = _T(x.elems, max(x.size, o.size), x.rg or o.rg)
    xn2 = tr.rmsnorm(r, norms_trainable)
    g, u = tr.linear(xn2, lin["gate"]), tr.linear(xn2, lin["up"])
    if g.rg:
        tr.save(g)                                  # SiLU keeps its input
    tr.mlp_grad = g.elems * g.size                  # gradients have their tensors' dtype
    act = _T(g.elems, g.size, g.rg)
    if not tr.lean:
        d = tr.linear(tr.mul(act, u), lin["down"])
        return _T(x.elems, max(r.size, d.size), r.rg or d.rg)
    # nbtrain.models.lean: SiLU(gate) * up keeps gate and up only; the SiLU is recomputed in backward
    if g.rg or u.rg:
        tr.save(u)
    prod = _T(g.elems, max(g.size, u.size), g.rg or u.rg)
    down = lin["down"]
    if down.kind == "trainable" and not down.lora_r:
        # with a plain down projection in the same function: its input (the product) is not kept either, only
        # the weight's cast; its backward recomputes the product too (3 intermediates at most)
        tr.mlp_live = 3
        if tr.ac:
            tr.const += 2 * down.weight
        return _T(x.elems, max(r.size, tr.ac or 4), True)
    d = tr.linear(prod, down)
    return _T(x.elems, max(r.size, d.size), r.rg or d.rg)


def _layer_specs(arch: _Arch, layer: int, method: str, adapted: dict[str, int], r: int) -> dict[str, _Lin]:
    """The seven projections of decoder layer ``layer`` with how each one trains."""
    kind = {"full": "trainable", "lora": "frozen", "qlora": "quant"}[method]
    by_role = {}
    for lin in arch.linears:
        if lin.layer == layer and lin.leaf in _LLAMA_ROLES:
            by_role[_LLAMA_ROLES[lin.leaf]] = _Lin(lin.n_in, lin.n_out, lin.weight, kind,
                                                 r if lin.name in adapted else 0)
    if len(by_role) < 7:  # not Llama-shaped: the same sizes, every projection treated alike
        h, a, kvd, i = arch.hidden, arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.intermediate
        lr = r if method != "full" and adapted else 0
        shapes = {"q": (h, a), "k": (h, kvd), "v": (h, kvd), "o": (a, h), "gate": (h, i), "up": (h, i),
                  "down": (i, h)}
        by_role = {role: _Lin(n_in, n_out, n_in * n_out, kind, lr) for role, (n_in, n_out) in shapes.items()}
    return by_role


# ---------------------------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Parts:
    weights: int
    grads: int
    optim: int
    acts: int          # everything saved for backward except logits/loss, at the loss backward
    logits: int        # logits + loss tensors at their peak
    peak: int          # timeline peak of tensor bytes
    phase: str
    trainable: int
    total: int
    notes: list[str]


def _parts(cfg: TrainConfig, precision: str, device: str, num_labels: int) -> _Parts:
    task, method = cfg.task, cfg.method
    stamp = _config_stamp(cfg.model)
    arch = _arch(cfg.model, task, num_labels, stamp)
    notes: list[str] = []
    h, L = arch.hidden, arch.layers
    B, T = cfg.micro_batch_size, cfg.max_seq_len
    N = B * T
    ac = 2 if precision in ("bf16", "fp16") else None
    s = ac or 4

    # -- exact parts: parameters, gradients, optimizer state --------------------------------------------------
    params = {name: n for name, n, _ in arch.params}
    lin_by_weight = {f"{lin.name}.weight": lin for lin in arch.linears}
    adapted: dict[str, int] = {}
    if method == "full":
        trainable = arch.total_params
        n_tensors = len(arch.params)
        total = arch.total_params
        extra_params = 0
    else:
        targets = cfg.lora_targets if isinstance(cfg.lora_targets, str) else tuple(cfg.lora_targets)
        adapted, others, n_tensors = _adapters(cfg.model, task, num_labels, stamp, cfg.lora_r, targets)
        extra_params = sum(adapted.values()) + sum(others.values())   # heads under modules_to_save are copies
        trainable = extra_params
        total = arch.total_params + extra_params
    skip_quant: set = set()
    if method == "qlora":
        skip = skip_quant = _quant_skip(cfg.model, task, num_labels, arch)
        weights = 4 * extra_params
        for name, n in params.items():
            lin = lin_by_weight.get(name)
            if lin is None or lin.name in skip:
                weights += 4 * n
            elif cfg.quant_bits == 4:
                weights += _nf4_bytes(n)
            else:
                weights += n + 4 * lin.n_out
    else:
        weights = 4 * total
    grads = 4 * trainable
    optim = 8 * trainable + STEP_BYTES * n_tensors

    # -- activations: trace one representative layer (and the first, whose input may need no gradient) -------
    full = method == "full"
    ckpt = cfg.gradient_checkpointing
    mask = 1 if device == "cuda" else None
    r = cfg.lora_r
    if not arch.llama_like:
        notes.append(f"{arch.model_type}: activations approximated with a Llama-style layer of the same sizes")
    if method == "qlora" and cfg.quant_bits == 8:
        notes.append("8-bit layers' activations are approximated as the 4-bit layers' (measured for 4-bit only)")

    # nbtrain.models.lean applies to Llama-style layers, and not under compile (the estimate models eager layers)
    lean = cfg.lean_layers and not cfg.compile and arch.llama_like
    if cfg.lean_layers and not lean:
        notes.append("lean_layers: no effect here (" + ("not applied under compile=True" if cfg.compile
                     else f"{arch.model_type} has no Llama-style MLP and RMSNorm") + ")")
    # CUDA has no fused fp32 kernel for grouped-query attention (flash and cuDNN are 16-bit only, the
    # memory-efficient one rejects unequal q/kv heads): SDPA falls back to the math kernel (measured: torch 2.11)
    math_seq = T if device == "cuda" and ac is None and arch.kv_heads < arch.heads else 0
    if math_seq:
        notes.append("fp32 attention with grouped kv heads runs SDPA's math kernel on CUDA (T x T scores per "
                      "layer); bf16 avoids it")

    def layer_trace(idx: int, x_rg: bool) -> tuple[_Trace, _T]:
        tr = _Trace(ac, mask, method != "full" and cfg.lora_dropout > 0, math_seq, quant_out_ac=cfg.quant_bits == 4,
                    lean=lean)
        out = _trace_layer(tr, _T(h, 4, x_rg), _layer_specs(arch, idx, method, adapted, r), full, arch)
        return tr, out

    emb_rg = full or ckpt            # the embedding trains, or checkpointing marks its output
    tr0, out0 = layer_trace(0, emb_rg)
    tr1, _ = layer_trace(min(1, L - 1), True) if L > 1 else (tr0, out0)
    layer_tokens = [tr0.per_token] + [tr1.per_token] * (L - 1)
    layer_const = [tr0.const] + [tr1.const] * (L - 1)
    layer_cache = [tr0.cache] + [tr1.cache] * (L - 1)
    rope_bytes = 2 * arch.head_dim * 4 * T       # cos and sin, fp32, shared by all layers
    inputs = 3 * 8 * N                           # input_ids, attention_mask, labels (int64)
    fwd_extra, mlp_grad, attn_grad = tr1.fwd_extra, tr1.mlp_grad * tr1.mlp_live / 2, tr1.attn_grad

    # the head: final norm, then the output layer / classifier
    head_l = next((lin for lin in arch.linears if lin.name == arch.head), None)
    head_weight = head_l.weight if head_l else arch.vocab * h
    head_trainable = full or task == "sequence-classification"
    chunked = cfg.chunked_loss and task == "causal-lm"
    trh = _Trace(ac, mask, False, lean=lean)
    xf = trh.rmsnorm(_T(h, 4, True), full)
    if not chunked:
        logits_t = trh.linear(xf, _Lin(h, arch.vocab, head_weight, "trainable" if head_trainable else "frozen"))
    head_saved = trh.per_token * N + trh.const
    n_tgt = B * (T - 1) if task == "causal-lm" else B
    chunk_fwd = 0
    # nbtrain.engine.losses fuses the loss into a plain linear head (no adapter on it, not quantized)
    head_adapted = bool(arch.head) and any(n == arch.head or n.startswith(arch.head + ".") for n in adapted)
    head_quantized = method == "qlora" and head_l is not None and arch.head not in skip_quant
    fused = chunked and head_l is not None and not head_adapted and not head_quantized
    if fused:
        # The fused path: each chunk's gradients (hidden states, and the weight when it trains) are made in the
        # forward and kept until backward, which multiplies them by the incoming scalar (a second copy).
        C = min(cfg.loss_chunk_tokens, n_tgt)
        head_saved += (4 * h + 8) * n_tgt             # the selected fp32 hidden states and their targets
        keep = 4 * h * n_tgt + (4 * head_weight if head_trainable else 0)
        if ac:   # bf16 copies of the weight and the hidden states; a chunk's bf16 logits + fp32 copy, then its
            # bf16 gradient beside the fp32 one; later the bf16 gradient alone beside the chunk's bf16 weight
            # gradient before it is summed
            copies = 2 * head_weight + 2 * h * n_tgt
            chunk = max(6 * C * arch.vocab, 2 * C * arch.vocab + (2 * head_weight if head_trainable else 0))
        else:    # fp32: the logits are made, turned into their gradient in place, and summed in place
            copies, chunk = 0, 4 * C * arch.vocab
        chunk_fwd = copies + keep + chunk
        logits, grad_logits = 0, 0
        loss_bwd = 2 * keep                           # ... and the scaled copies the backward makes
    elif chunked:
        # nbtrain.engine.losses: the head and the loss chunk by chunk, each chunk recomputed in backward. Kept:
        # the selected hidden states (fp32) and targets; a chunk's backward holds its logits, log_softmax and
        # the two fp32 gradients, the head's bf16 weight copy, and the hidden states' gradient buffers
        C = min(cfg.loss_chunk_tokens, n_tgt)
        head_saved += (4 * h + 8) * n_tgt
        logits = 0
        copy = 2 * head_weight if ac else 0
        loss_bwd = 12 * C * arch.vocab + 2 * 4 * h * n_tgt + copy
        if head_trainable and n_tgt > C:   # the earlier chunks' weight gradient waits to be summed
            loss_bwd += 4 * head_weight
        grad_logits = 0
        chunk_fwd = 4 * h * N + (s + 8) * C * arch.vocab + copy
    elif task == "causal-lm":
        # the loop shifts the labels (padded with -100), not the logits: the loss runs over all N rows
        logits = N * arch.vocab * logits_t.size
        loss_bwd = 12 * N * arch.vocab + 8 * N   # log_softmax output, its two fp32 gradients, targets
        grad_logits = N * arch.vocab * logits_t.size
    else:
        logits = N * arch.vocab * logits_t.size  # the head runs on every position, then pools
        loss_bwd = 12 * B * arch.vocab
        grad_logits = logits

    # parameter gradients by where backward creates them
    head_names = {f"{arch.head}.weight", f"{arch.head}.bias"} if arch.head else set()
    if full:
        g_layer = [0] * L
        g_head = g_emb = g_other = 0
        for name, n, _ in arch.params:   # tied weights appear once, under the embedding's name
            li = _layer_index(name, L)
            if li is not None:
                g_layer[li] += 4 * n
            elif name in head_names:
                g_head += 4 * n
            elif "embed" in name or name.endswith("wte.weight") or name.endswith("wpe.weight"):
                g_emb += 4 * n
            else:
                g_other += 4 * n
        if arch.tied:
            g_head = g_emb   # the output layer's backward creates the shared weight's gradient first
    else:
        g_layer = [0] * L
        for name, n in adapted.items():
            li = _layer_index(name, L)
            if li is not None:
                g_layer[li] += 4 * n
        g_head = grads - sum(g_layer)
        g_emb = g_other = 0

    # -- the timeline -----------------------------------------------------------------------------------------
    G = grads
    accum = cfg.grad_accum_steps > 1
    G0 = G if accum else 0            # earlier micro-batches' gradients, present all through the last one
    if ckpt:
        kept = [4 * h * N] * L         # each checkpointed layer keeps only its fp32 input
    else:
        kept = [layer_tokens[k] * N + layer_const[k] for k in range(L)]
    acts = sum(kept) + rope_bytes + inputs + head_saved
    phases: dict[str, tuple[int, str]] = {}

    # end of the forward, still inside autocast, whose cache holds the trainable weights' bf16 copies
    cache_only = sum(layer_cache) if ckpt else 0
    phases["forward"] = (G0 + acts + cache_only + logits + chunk_fwd,
                         "the chunked loss's forward (its gradients made there)" if fused else "the end of the forward")
    if not ckpt:
        # inside the last layer's forward: its short-lived tensors (an adapter's fp32 input copy and dropout
        # output, the math kernel's scores) on top of everything the layers have kept
        phases["last layer"] = (G0 + acts - head_saved + cache_only + fwd_extra * N, "the last layer's forward")
    # nbtrain.engine.loop.micro_loss_sum keeps no reference to the logits: after the loss's forward only the
    # autograd graph holds what backward needs (log_softmax's output, not the logits)
    phases["loss"] = (G0 + acts + loss_bwd, "the loss backward (log_softmax)")
    # the output layer's backward: the logits' gradient, the hidden states' and the weight's (when it trains)
    gw = head_weight * ((s + 4) if ac else 4) if head_trainable else 0
    if fused:     # the saved gradients gone; the hidden states' gradient meets the index/slice backward
        gw_phase = G0 + acts + (4 * head_weight if head_trainable else 0) + 4 * h * n_tgt + 2 * 4 * h * N
    elif chunked:   # one chunk's logits gradient and the weight's; the log_softmax tensors are gone by then
        gw_phase = G0 + acts + s * C * arch.vocab + gw + loss_bwd - 12 * C * arch.vocab
        if head_trainable and n_tgt > C:   # ... and the sum is made out of place
            gw_phase += 4 * head_weight
    else:
        gw_phase = G0 + acts + grad_logits + (s + 4) * h * N + gw
    phases["head"] = (gw_phase, "the output layer's backward")
    # decoder layers, last to first: their activations go, their gradients come
    remaining = acts - head_saved
    g_so_far = g_head + g_other
    worst = (0, "")
    for k in reversed(range(L)):
        layer_act = layer_tokens[k] * N
        # inside the MLP's backward: the gradients of SiLU(gate) and up (or the attention's, if larger)
        t_bwd = max(2 * mlp_grad, attn_grad) * N
        if ckpt:                       # the layer is recomputed first, with its own short-lived tensors
            transient = layer_act + layer_const[k] - 4 * h * N + max(fwd_extra * N, t_bwd)
        else:
            transient = t_bwd
        transient += 4 * h * N         # the residual stream's gradient
        here = G0 + remaining + (0 if accum else g_so_far) + g_layer[k] + transient
        if here > worst[0]:
            worst = (here, f"layer {k}'s backward" + (" (recomputed)" if ckpt else ""))
        remaining -= kept[k]
        g_so_far += g_layer[k]
    phases["layers"] = worst
    # the input embedding's dense gradient; tied to the output layer it is summed with that one's
    emb_extra = 0
    if full and g_emb:
        emb_extra = 2 * g_emb if arch.tied else (g_emb if accum else 0)
    phases["embedding"] = (G + emb_extra, "the embedding's backward")
    phases["optimizer"] = (G, "the optimizer step")
    top, where = max(phases.values(), key=lambda v: v[0])
    head_part = max(chunk_fwd, loss_bwd) if fused else logits + loss_bwd
    return _Parts(weights=weights, grads=grads, optim=optim, acts=acts, logits=head_part,
                  peak=weights + optim + top, phase=where, trainable=trainable, total=total, notes=notes)


def _estimate(cfg: TrainConfig, device: str, device_total_gib: float, device_name: str) -> MemoryEstimate:
    precision = _precision(cfg, device)
    p = _parts(cfg, precision, device, NUM_LABELS)
    slack = SLACK.get(device, 0.05)
    overhead = (CUDA_CONTEXT_BYTES if device == "cuda" else 0) + slack * p.peak
    total = p.peak + overhead
    return MemoryEstimate(
        weights_gib=p.weights / GIB, gradients_gib=p.grads / GIB, optimizer_gib=p.optim / GIB,
        activations_gib=p.acts / GIB, logits_gib=p.logits / GIB, overhead_gib=overhead / GIB,
        total_gib=total / GIB, device=device_name, device_total_gib=float(device_total_gib),
        fits=total / GIB <= device_total_gib, trainable_params=p.trainable, total_params=p.total,
        weights_bytes=p.weights, gradients_bytes=p.grads, optimizer_bytes=p.optim, advice=[], config=cfg,
        precision=precision, peak_phase=p.phase, tensors_peak_gib=p.peak / GIB, notes=p.notes)


def _precision(cfg: TrainConfig, device: str) -> str:
    if cfg.precision != "auto":
        return cfg.precision
    try:
        return resolve_precision("auto", capabilities(device))
    except Exception:  # asked about CUDA on a machine without one: the usual auto choice there
        return "bf16"


def estimate_memory(cfg: TrainConfig, device_total_gib: float | None = None, *,
                    device: str | None = None) -> MemoryEstimate:
    """Estimate the memory one training step of ``cfg`` needs, from the model config alone.

    ``device_total_gib`` defaults to this device's memory (host RAM on CPU); ``device`` ("cuda" or
    "cpu", default: the one nbtrain would use) selects the device-specific terms. When it does not
    fit, ``advice`` lists cumulative changes, each with its new estimate, stopping at the first that fits.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"estimate_memory() takes a TrainConfig, got {type(cfg).__name__}")
    caps = None
    if device is None or device_total_gib is None:
        try:
            caps = capabilities(device)
        except Exception:
            caps = None
    dev = device or (caps.device if caps else "cpu")
    if device_total_gib is None:
        if caps is None or caps.device != dev:
            raise ValueError(f"device_total_gib: give the memory of the {dev} device to estimate for "
                             "(this machine has none to read)")
        device_total_gib = caps.total_memory_gib
    name = f"{dev} ({caps.name})" if caps is not None and caps.device == dev else dev
    est = _estimate(cfg, dev, device_total_gib, name)
    if not est.fits:
        est.advice = _advise(cfg, dev, device_total_gib, name)
    return est


# ---------------------------------------------------------------------------------------------------------------
# Advice: the out-of-memory flow
# ---------------------------------------------------------------------------------------------------------------
def _try(cfg: TrainConfig, change: dict[str, Any], dev: str, total: float, name: str) -> Optional[MemoryEstimate]:
    try:
        new = cfg.replace(**change)
    except (ConfigError, ValueError):   # not allowed here (e.g. QLoRA without bitsandbytes)
        return None
    return _estimate(new, dev, total, name)


def _advise(cfg: TrainConfig, dev: str, total: float, name: str) -> list[Advice]:
    advice: list[Advice] = []
    change: dict[str, Any] = {}
    current = _estimate(cfg, dev, total, name).total_gib

    def first_fit(steps: list[tuple[dict[str, Any], str]]) -> bool:
        """Take the first candidate that fits, else the smallest one if it helps; True once it fits."""
        nonlocal current
        tried = []
        for step, desc in steps:
            est = _try(cfg, {**change, **step}, dev, total, name)
            if est is not None:
                tried.append((step, desc, est))
                if est.fits:
                    break
        if not tried:
            return False
        step, desc, est = next((t for t in tried if t[2].fits), min(tried, key=lambda t: t[2].total_gib))
        if est.total_gib >= current:
            return False
        change.update(step)
        current = est.total_gib
        advice.append(Advice(dict(change), desc, est.total_gib, est.fits))
        return est.fits

    # 1. a smaller micro-batch and more accumulation, so the effective batch stays the same
    mb = cfg.micro_batch_size
    smaller = [d for d in range(mb - 1, 0, -1) if mb % d == 0]
    if first_fit([({"micro_batch_size": d, "grad_accum_steps": cfg.grad_accum_steps * (mb // d)},
                   f"micro_batch_size {mb} -> {d}, grad_accum_steps {cfg.grad_accum_steps} -> "
                   f"{cfg.grad_accum_steps * (mb // d)} (same effective batch {cfg.effective_batch_size})")
                  for d in smaller]):
        return advice
    # 2. lean layers: the MLP and the norms recompute their cheap intermediates (a few % of the time, where
    # checkpointing costs ~30%); no change for other architectures or under compile, so first_fit skips it there
    if not cfg.lean_layers and first_fit(
            [({"lean_layers": True}, "lean_layers on (MLP and norms recompute SiLU, product, normalised input; "
                                     "same results)")]):
        return advice
    # 2b. gradient checkpointing: keep each layer's input only, recompute the rest in backward
    if not cfg.gradient_checkpointing and first_fit(
            [({"gradient_checkpointing": True}, "gradient_checkpointing on (~30% more compute)")]):
        return advice
    # 2c. the loss chunk by chunk (nbtrain's chunked_loss): the vocabulary-sized logits never exist whole
    if cfg.task == "causal-lm" and not cfg.chunked_loss and first_fit(
            [({"chunked_loss": True}, f"chunked_loss on (the output layer and loss {cfg.loss_chunk_tokens} "
                                      "tokens at a time; same loss)")]):
        return advice
    # 3. full -> LoRA -> QLoRA
    order = ["full", "lora", "qlora"]
    for method in order[order.index(cfg.method) + 1:]:
        desc = {"lora": f"method {cfg.method} -> lora (rank-{cfg.lora_r} adapters, frozen base)",
                "qlora": f"method -> qlora (frozen {cfg.quant_bits}-bit base, rank-{cfg.lora_r} adapters)"}[method]
        if first_fit([({"method": method}, desc)]):
            return advice
    # 4. shorter sequences
    seqs, t = [], cfg.max_seq_len
    while t > 8:
        t = max(8, t // 2)
        seqs.append(t)
    first_fit([({"max_seq_len": t}, f"max_seq_len {cfg.max_seq_len} -> {t} (longer texts are truncated)")
               for t in seqs])
    return advice
