"""The activations of one decoder layer: a symbolic trace of the tensors autograd saves for backward.

Nothing runs: each op of a Llama-style decoder layer (RMSNorm -> q/k/v/o -> RoPE -> SDPA -> residual -> RMSNorm ->
gate/up/down SiLU MLP) records what PyTorch would keep for its backward, per token, with its dtype. Other
architectures are traced as the same layer with their sizes. docs/memory-model.md derives the per-token sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .facts import LLAMA_ROLES, Architecture

# torchao's float8 matmuls need both sizes of a weight divisible by 16 (nbtrain.models.tensors.FP8_ALIGN): others stay
FP8_ALIGN = 16


class TracedTensor:
    """A tensor of the trace: ``elems`` per token, ``size`` bytes per element, whether it requires grad."""

    __slots__ = ("elems", "size", "requires_grad")

    def __init__(self, elems: int, size: int, requires_grad: bool):
        self.elems, self.size, self.requires_grad = elems, size, requires_grad


@dataclass
class LinearSpec:
    """A projection of the layer and how it trains."""

    n_in: int
    n_out: int
    weight: int        # weight elements
    kind: str          # "trainable" | "frozen" | "quant"
    lora_r: int = 0    # 0: no adapter


class LayerTrace:
    """Saved tensors of one decoder layer (or the head) per token, plus token-independent weight copies."""

    def __init__(self, autocast_bytes: Optional[int], mask_bytes: Optional[int], dropout: bool,
                 math_seq: int = 0, quant_out_autocast: bool = True, lean: bool = False, param_bytes: int = 4,
                 fp8_input_bytes: Optional[int] = None):
        self.autocast_bytes = autocast_bytes   # autocast element size, None without autocast
        # the weights' element size (2 under bf16-pure): without autocast the compute dtype, and the residual's
        self.param_bytes = param_bytes
        # precision="fp8": torchao's Float8Linear saves its high-precision input (the autocast dtype on CUDA, where
        # it casts the input first; as it comes on the CPU, where its CUDA-only autocast check does not cast) and
        # no weight copy (the fp8 casts are made again in backward); 0: as it comes, None: no fp8 layers
        self.fp8_input_bytes = fp8_input_bytes
        self.lean = lean              # nbtrain.models.lean: norms and the MLP keep less (TrainConfig.lean_layers)
        self.quant_out_autocast = quant_out_autocast   # a quantised layer returns the autocast dtype (4-bit)
        self.mask_bytes = mask_bytes  # dropout mask bytes per element (None: the input's dtype)
        self.dropout = dropout
        self.math_seq = math_seq      # > 0: SDPA falls back to the math kernel (T x T scores) at this length
        self.attn_grad = 0            # bytes per token of the attention's backward temporaries (math kernel)
        self.saved: dict[int, TracedTensor] = {}
        self.const = 0                # weight copies saved for backward (bytes)
        self.cache = 0                # weight copies autocast caches for the forward (trainable leaves)
        self.fwd_extra = 0            # largest short-lived tensor set inside the forward, per token
        self.mlp_grad = 0             # bytes per token of one MLP-intermediate gradient
        self.mlp_live = 2             # MLP intermediates alive at once in its backward (gradients, recomputed)

    def save(self, t: TracedTensor) -> None:
        self.saved[id(t)] = t

    @property
    def per_token(self) -> int:
        """Bytes saved for backward per token."""
        return sum(t.elems * t.size for t in self.saved.values())

    def cast(self, x: TracedTensor) -> TracedTensor:
        """``x`` as autocast hands it to a matmul."""
        if self.autocast_bytes is None or x.size == self.autocast_bytes:
            return x
        return TracedTensor(x.elems, self.autocast_bytes, x.requires_grad)

    def linear(self, x: TracedTensor, spec: LinearSpec) -> TracedTensor:
        ac = self.autocast_bytes
        pb = self.param_bytes
        trainable = spec.kind == "trainable"
        fp8 = (self.fp8_input_bytes is not None and spec.kind != "quant" and not spec.n_in % FP8_ALIGN
               and not spec.n_out % FP8_ALIGN)
        if fp8:
            if x.requires_grad or trainable:   # saved whether or not the weight trains
                self.save(x if not self.fp8_input_bytes or x.size == self.fp8_input_bytes else
                          TracedTensor(x.elems, self.fp8_input_bytes, x.requires_grad))
            out = TracedTensor(spec.n_out, ac or pb, x.requires_grad or trainable)
        elif spec.kind == "quant":
            # bitsandbytes keeps only the packed weight for backward and returns its input's dtype; nbtrain
            # hands a 4-bit layer its input in the autocast dtype (models.methods.autocast_quantized_inputs)
            out = TracedTensor(spec.n_out, ac if ac and self.quant_out_autocast else x.size, x.requires_grad)
        else:
            x_in = self.cast(x)
            if trainable:
                self.save(x_in)
                if ac:
                    self.cache += 2 * spec.weight
            if x.requires_grad and ac:
                self.const += 2 * spec.weight   # the cast weight, for the input's gradient
            out = TracedTensor(spec.n_out, ac or pb, x.requires_grad or trainable)
        if not spec.lora_r:
            return out
        r = spec.lora_r
        # peft casts the input to the adapter's dtype (fp32; bf16 under bf16-pure), drops out, then lora_A and
        # lora_B; the cast copy and the dropout output live only while the adapter runs, beside the base output
        x_fp32 = x if x.size == pb else TracedTensor(x.elems, pb, x.requires_grad)
        x_dropped = x_fp32
        dropout_out = 0
        if self.dropout:
            if x_fp32.requires_grad:
                self.save(TracedTensor(x_fp32.elems, self.mask_bytes or x_fp32.size, False))
            x_dropped = TracedTensor(x_fp32.elems, pb, x_fp32.requires_grad)
            dropout_out = pb * x.elems if ac else 0   # without autocast lora_A keeps it (saved)
        # short-lived: the cast copy, then the dropout output, or lora_B's output and its scaled copy
        extra = ((pb * x.elems if x_fp32 is not x else 0) + max(dropout_out, 2 * spec.n_out * (ac or pb))
                 + (0 if id(x) in self.saved else x.elems * x.size))   # the input itself, held by the call
        self.fwd_extra = max(self.fwd_extra, extra)
        self.save(self.cast(x_dropped))
        self.save(TracedTensor(r, ac or pb, True))    # lora_A's output
        if ac:
            self.const += 2 * r * (spec.n_in + spec.n_out)
            self.cache += 2 * r * (spec.n_in + spec.n_out)
        return TracedTensor(spec.n_out, max(out.size, ac or pb), True)

    def rmsnorm(self, x: TracedTensor, trainable: bool) -> TracedTensor:
        # Llama's RMSNorm computes in fp32 and returns weight * normed.to(input dtype): the promoted dtype of the
        # weight and the input (bf16 under bf16-pure, else fp32)
        out_size = max(x.size, self.param_bytes)
        if not (x.requires_grad or trainable):
            return TracedTensor(x.elems, out_size, False)
        x_fp32 = x if x.size == 4 else TracedTensor(x.elems, 4, x.requires_grad)
        if x.requires_grad:
            self.save(x_fp32)
            self.save(TracedTensor(1, 4, True))              # rsqrt of the variance
        if trainable and not self.lean:   # lean: recomputed in backward from the input and the 1/rms
            normed = TracedTensor(x.elems, 4, x.requires_grad)
            self.save(normed if x.size == 4 else TracedTensor(x.elems, x.size, x.requires_grad))
        return TracedTensor(x.elems, out_size, x.requires_grad or trainable)

    def rope(self, q: TracedTensor) -> TracedTensor:
        # cos/sin have the residual's dtype (fp32, or bf16 under bf16-pure): q * cos promotes to it
        return TracedTensor(q.elems, max(q.size, self.param_bytes), q.requires_grad)

    def sdpa(self, q: TracedTensor, k: TracedTensor, v: TracedTensor, heads: int) -> TracedTensor:
        requires_grad = q.requires_grad or k.requires_grad or v.requires_grad
        size = self.autocast_bytes or self.param_bytes
        if self.math_seq:
            # the math kernel: scaled q, k and v repeated to every head, the softmax (heads x T per token);
            # its output is laid out by head, so the caller's transpose makes a copy for o_proj
            probs = heads * self.math_seq * size
            if requires_grad:
                for elems in (q.elems, q.elems, q.elems):
                    self.save(TracedTensor(elems, size, True))
                self.save(TracedTensor(probs, 1, True))
            self.fwd_extra = max(self.fwd_extra, 2 * probs)      # the scores, then the probabilities
            self.attn_grad = 2 * probs                           # their gradients in backward
            return TracedTensor(q.elems, size, requires_grad)
        q2, k2, v2 = self.cast(q), self.cast(k), self.cast(v)
        out = TracedTensor(q.elems, size, requires_grad)
        if requires_grad:
            for t in (q2, k2, v2, out):
                self.save(t)
            self.save(TracedTensor(heads, 4, False))         # log-sum-exp
        return out

    def mul(self, a: TracedTensor, b: TracedTensor) -> TracedTensor:
        if a.requires_grad:
            self.save(b)
        if b.requires_grad:
            self.save(a)
        return TracedTensor(a.elems, max(a.size, b.size), a.requires_grad or b.requires_grad)


def trace_decoder_layer(tr: LayerTrace, x: TracedTensor, projections: dict[str, LinearSpec],
                        norms_trainable: bool, arch: Architecture) -> TracedTensor:
    """One Llama-style decoder layer traced into ``tr``; returns its output (the next residual)."""
    xn = tr.rmsnorm(x, norms_trainable)
    q, k, v = tr.linear(xn, projections["q"]), tr.linear(xn, projections["k"]), tr.linear(xn, projections["v"])
    attn = tr.sdpa(tr.rope(q), tr.rope(k), v, arch.heads)
    o = tr.linear(attn, projections["o"])
    residual = TracedTensor(x.elems, max(x.size, o.size), x.requires_grad or o.requires_grad)
    xn2 = tr.rmsnorm(residual, norms_trainable)
    gate, up = tr.linear(xn2, projections["gate"]), tr.linear(xn2, projections["up"])
    if gate.requires_grad:
        tr.save(gate)                                # SiLU keeps its input
    tr.mlp_grad = gate.elems * gate.size             # gradients have their tensors' dtype
    act = TracedTensor(gate.elems, gate.size, gate.requires_grad)
    if not tr.lean:
        down = tr.linear(tr.mul(act, up), projections["down"])
        return TracedTensor(x.elems, max(residual.size, down.size), residual.requires_grad or down.requires_grad)
    # nbtrain.models.lean: SiLU(gate) * up keeps gate and up only; the SiLU is recomputed in backward
    if gate.requires_grad or up.requires_grad:
        tr.save(up)
    prod = TracedTensor(gate.elems, max(gate.size, up.size), gate.requires_grad or up.requires_grad)
    down_spec = projections["down"]
    if down_spec.kind == "trainable" and not down_spec.lora_r:
        # with a plain down projection in the same function: its input (the product) is not kept either, only
        # the weight's cast; its backward recomputes the product too (3 intermediates at most)
        tr.mlp_live = 3
        if tr.autocast_bytes:
            tr.const += 2 * down_spec.weight
        return TracedTensor(x.elems, max(residual.size, tr.autocast_bytes or tr.param_bytes), True)
    down = tr.linear(prod, down_spec)
    return TracedTensor(x.elems, max(residual.size, down.size), residual.requires_grad or down.requires_grad)


def layer_projections(arch: Architecture, layer: int, method: str, adapted: dict[str, int],
                      lora_r: int) -> dict[str, LinearSpec]:
    """The seven projections of decoder layer ``layer`` with how each one trains."""
    kind = {"full": "trainable", "lora": "frozen", "qlora": "quant"}[method]
    by_role = {}
    for lin in arch.linears:
        if lin.layer == layer and lin.leaf in LLAMA_ROLES:
            by_role[LLAMA_ROLES[lin.leaf]] = LinearSpec(lin.n_in, lin.n_out, lin.weight, kind,
                                                        lora_r if lin.name in adapted else 0)
    if len(by_role) < 7:  # not Llama-shaped: the same sizes, every projection treated alike
        h, a = arch.hidden, arch.heads * arch.head_dim
        kv, i = arch.kv_heads * arch.head_dim, arch.intermediate
        r = lora_r if method != "full" and adapted else 0
        shapes = {"q": (h, a), "k": (h, kv), "v": (h, kv), "o": (a, h), "gate": (h, i), "up": (h, i),
                  "down": (i, h)}
        by_role = {role: LinearSpec(n_in, n_out, n_in * n_out, kind, r) for role, (n_in, n_out) in shapes.items()}
    return by_role
