"""GRPO's step (objective="grpo", nbtrain.engine.grpo_run): the rollouts' memory, and the update's reference.

A step has two phases with different peaks:

* the rollouts (no_grad, eval mode): each prompt's G completions sampled together with the KV cache
  (engine.rollout.sample_group: a prefill of G x P tokens, then one token at a time up to max_new_tokens), under
  the sampler precision's autocast, one prompt after the other, so one group's cache at a time; on sampled steps an
  fp32 teacher-forced pass of each micro-batch follows (the log-prob mismatch);
* the update: per micro-batch of B completions, one teacher-forced forward over prompt + completion rows with the
  head and the fp32 log-softmax on the T completion positions only (GrpoObjective.completion_logp), with grad,
  then backward; with grpo_beta > 0 a no_grad reference forward between them.

Notation: G = num_generations, P = the prompt length, T = max_new_tokens, L = P + T, B = micro_batch_size, V = the
vocabulary, h = hidden size, s = the compute dtype's bytes. Everything here is in bytes and counts what a phase
holds beyond the weights, the optimizer state and a reference copy (``timeline.step_peak`` adds those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import TrainConfig
from ..precision import PRECISION_TABLE
from .facts import Architecture

_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


@dataclass
class RolloutParts:
    """The rollouts' parts of a GRPO step, in bytes."""

    prompt: int            # P: the prompt length the estimate used
    new: int               # T: max_new_tokens
    kv_cache: int          # one group's KV cache at its longest: G x L x layers x kv_heads x head_dim x (K + V)
    sampling: int          # the sampling forward's transient at the rollouts' peak, beyond the full cache
    sampling_peak: int     # the sampling's peak: the cache, the transient and the rollout tensors
    tensors: int           # the rollout tensors kept for the step (ids, masks, log-probs, advantages)
    k_bytes: int           # the cache's K element size (RoPE's product: the residual's dtype)
    v_bytes: int           # its V element size (the v projection's output: the compute dtype)
    k_dtype: str           # their dtypes' names
    v_dtype: str
    cached_casts: int      # of ``sampling``: autocast's 16-bit casts of the trained weights, cached for the group
    sampler_precision: str


def prompt_length(cfg: TrainConfig, prompt_tokens: Optional[int]) -> int:
    """P: the longest prompt the data has (``prompt_tokens``, when the estimate was given the data), else
    max_seq_len, the longest a prompt can be (nbtrain.data.prompts cuts longer ones from the left)."""
    if prompt_tokens:
        return max(1, min(int(prompt_tokens), cfg.max_seq_len))
    return cfg.max_seq_len


def longest_prompt(data) -> Optional[int]:
    """The longest prompt in ``data`` (a DataBundle of prompts, or its list of examples), in tokens; None when it
    holds none."""
    rows = getattr(data, "train", data)
    lengths = [len(ex["input_ids"]) for ex in rows or () if isinstance(ex, dict) and "input_ids" in ex]
    return max(lengths) if lengths else None


def rollout_tensors(cfg: TrainConfig, L: int) -> int:
    """The rollout batch the step holds, per completion row: input_ids and attention_mask (L int64 each), positions
    and completion ids (T int64 each), the mask, the sampler's, the first update's and (sampled steps) the fp32
    pass's log-probs (T fp32 each), the advantage; and, while it is sampled, each group's completion ids, mask and
    log-probs (T int64 + 2 T fp32)."""
    T = cfg.max_new_tokens
    rows = cfg.micro_batch_size * cfg.grad_accum_steps
    return rows * (16 * L + 48 * T + 4)


def padding_mask(cfg: TrainConfig, arch: Architecture, L: int, s: int) -> int:
    """One layer's attention mask for a micro-batch of B right-padded rows (completions end at different lengths):
    SDPA turns transformers' (B, 1, L, L) boolean mask into an additive one in the query's dtype, kept per layer for
    backward (or made per layer under no_grad)."""
    return cfg.micro_batch_size * L * L * s


def nograd_layer(arch: Architecture, tokens: int, s: int, pb: int, adapted_mlp: bool, cast: int = 0,
                 mask: int = 0, repeat: bool = False, scores: int = 0) -> int:
    """One decoder layer's peak in a no_grad forward over ``tokens`` tokens, beside the model's input embeddings
    (held for the whole forward), the layer's input, its residual and its normed input (the residual's dtype, pb):
    the MLP's SiLU(gate), up and their product (s each, and an adapter's output beside its base's when the MLP has
    adapters), or the attention's q, k and v with RoPE's products (max(s, pb)) of q; autocast's copy of a
    projection's input (s < pb); one frozen weight's 16-bit cast (``cast``) and the layer's attention mask.
    ``repeat``: K and V repeated to every query head (grouped kv heads under a padding mask: transformers'
    repeat_kv); ``scores``: the length a math kernel's scores and probabilities span (fp32, per head)."""
    h, inter = arch.hidden, arch.intermediate
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    mlp = (4 if adapted_mlp else 3) * s * inter
    attn = s * (q + 2 * kv) + 3 * max(s, pb) * q + (2 * s * q if repeat else 0) + 8 * arch.heads * scores
    return tokens * (4 * pb * h + (s * h if s < pb else 0) + max(mlp, attn)) + cast + mask


def repeats_kv(arch: Architecture) -> bool:
    """Whether a padded batch's attention repeats K and V to every query head: grouped kv heads with a padding
    mask, where transformers' SDPA path calls repeat_kv rather than SDPA's own grouped-query mode."""
    return arch.kv_heads < arch.heads


def mlp_adapted(arch: Architecture, adapted: dict[str, int]) -> bool:
    """Whether LoRA adapts the MLP's gate or up projection."""
    return any(lin.leaf in ("gate_proj", "up_proj") and lin.name in adapted for lin in arch.linears)


def weight_cast(arch: Architecture, autocast_bytes: Optional[int]) -> int:
    """Autocast's 16-bit copy of the largest decoder weight: a frozen weight is cast at each call, one at a time."""
    if not autocast_bytes:
        return 0
    return 2 * max((lin.weight for lin in arch.linears if lin.layer is not None), default=0)


def logp_head_live(arch: Architecture, s: int, act_pb: int, rows: int, L: int, n: int, cast: int,
                   whole_logits: bool = False) -> int:
    """The head of GrpoObjective.completion_logp under no_grad: the decoder's hidden states (rows x L), gathered at
    the n completion positions, the head (its weight's 16-bit cast, ``cast``, while it runs), its s-byte logits,
    their fp32 copy (s < 4) and the division by the temperature, then log_softmax's output: (s + 8) x n x V at
    most. ``whole_logits``: a model called whole (the frozen reference copy) makes the logits of every position
    first, then gathers them."""
    h, V = arch.hidden, arch.vocab
    N = rows * L
    parts = act_pb * h * (N + n) + max(cast + s * n * V, (s + 8) * n * V)
    if not whole_logits:
        return parts
    return max(act_pb * h * N + cast + s * N * V, s * V * (N + n), (s + 8) * n * V)


def sampling_parts(cfg: TrainConfig, arch: Architecture, precision: str, pb: int, P: int, cached: int,
                   adapted: dict[str, int], device: str) -> RolloutParts:
    """The rollouts of one step: one group's KV cache, the sampling forward's transient, the rollout tensors.

    ``cached``: autocast's 16-bit copies of the trained weights under the sampler's autocast (made once, kept until
    the group's autocast block ends); ``adapted``: LoRA's adapted projections.

    The group's cache ends holding P + T - 1 tokens (the last token drawn is never fed back); counted as L = P + T.
    """
    G, T, L = cfg.num_generations, cfg.max_new_tokens, P + cfg.max_new_tokens
    V, h = arch.vocab, arch.hidden
    sampler = cfg.sampler_precision or precision
    spec = PRECISION_TABLE.get(sampler, PRECISION_TABLE["fp32"])
    ac = spec.autocast_dtype.itemsize if spec.autocast_dtype is not None else None
    s = ac or pb
    # K is RoPE's product with cos/sin in the residual's dtype (the weights'): fp32 under autocast; V is the v
    # projection's output, in the compute dtype
    k_bytes, v_bytes = max(s, pb), s
    weights = "fp32" if pb == 4 else "bf16"
    v_dtype = _NAMES.get(str(spec.autocast_dtype), weights) if ac else weights
    k_dtype = "fp32" if k_bytes == 4 else v_dtype
    per_token = arch.layers * arch.kv_heads * arch.head_dim * (k_bytes + v_bytes)
    kv = G * L * per_token
    one_layer_k = G * L * arch.kv_heads * arch.head_dim * k_bytes
    full = cfg.method == "full"
    head_cast = 2 * V * h if ac and not full else 0   # a frozen head is cast again at every call
    # trained projections' casts are in the cache; frozen ones (LoRA's base) are cast per call
    cast = 0 if full else weight_cast(arch, ac)
    adapted_mlp = not full and mlp_adapted(arch, adapted)
    # the drawn token's log-probs (engine.rollout._filtered): the logits' fp32 copy (s < 4), / temperature,
    # log_softmax: (s + 8) x G x V with the logits; top_p < 1 sorts them too (values and int64 order), then cumsum
    # and scatter
    filtered = (8 + s) * G * V + (24 * G * V if cfg.top_p < 1 else 0)
    # fp32 with grouped kv heads on CUDA: SDPA's math kernel, which repeats K and V to every head (and makes the
    # prefill's P x P scores)
    math = device == "cuda" and ac is None and pb == 4 and arch.kv_heads < arch.heads
    repeat = G * L * arch.heads * arch.head_dim * (k_bytes + v_bytes) if math else 0
    # the prefill: G x P tokens through each layer while the cache fills (no padding: no mask), then the final
    # norm and the head on the last position only (logits_to_keep=1)
    prefill = G * P * per_token + max(nograd_layer(arch, G * P, s, pb, adapted_mlp, cast, repeat=math,
                                                   scores=P if math else 0),
                                      3 * pb * h * G * P + head_cast + s * G * V, filtered)
    # a decoding step: the previous step's logits and log-probs live until the new ones replace them; a layer's
    # cache grows by concatenation (its old K beside the new); then the new log-probs beside the previous ones
    previous = (4 + s) * G * V
    decode = kv + max(previous + max(one_layer_k + repeat + nograd_layer(arch, G, s, pb, adapted_mlp, cast),
                                     pb * h * G + head_cast + s * G * V),
                      4 * G * V + filtered)
    transient = cached + max(prefill, decode) - kv
    tensors = rollout_tensors(cfg, L)
    return RolloutParts(prompt=P, new=T, kv_cache=kv, sampling=transient, sampling_peak=kv + transient + tensors,
                        tensors=tensors, k_bytes=k_bytes, v_bytes=v_bytes, k_dtype=k_dtype, v_dtype=v_dtype,
                        cached_casts=cached, sampler_precision=sampler)


def reference_forward(cfg: TrainConfig, arch: Architecture, autocast_bytes: Optional[int], act_pb: int,
                      L: int) -> int:
    """The update's reference forward (grpo_beta > 0, no_grad, between the policy's forward and its backward):
    the B rows through the frozen copy (full fine-tune: called whole, so it makes every position's logits before
    gathering the completions') or the model with its adapters off (the completion positions only). Its weights
    are frozen: autocast casts them at each call (none is cached)."""
    B, T = cfg.micro_batch_size, cfg.max_new_tokens
    s = autocast_bytes or act_pb
    cast = 2 * arch.vocab * arch.hidden if autocast_bytes else 0
    layer = nograd_layer(arch, B * L, s, act_pb, False, weight_cast(arch, autocast_bytes),
                         padding_mask(cfg, arch, L, s), repeats_kv(arch))
    return max(layer, logp_head_live(arch, s, act_pb, B, L, B * T, cast, whole_logits=cfg.method == "full"))


def fp32_pass(cfg: TrainConfig, arch: Architecture, adapted: dict[str, int], L: int, lift: int) -> int:
    """The log-prob mismatch's fp32 teacher-forced pass (sampled steps, at rollout time, no_grad, eval mode):
    16-bit weights lifted to fp32 in place (``lift``), then each micro-batch's B rows to the completion tokens'
    log-probs, the head on the completion positions only."""
    B, T = cfg.micro_batch_size, cfg.max_new_tokens
    adapted_mlp = cfg.method != "full" and mlp_adapted(arch, adapted)
    layer = nograd_layer(arch, B * L, 4, 4, adapted_mlp, 0, padding_mask(cfg, arch, L, 4), repeats_kv(arch))
    return lift + max(layer, logp_head_live(arch, 4, 4, B, L, B * T, 0))


def kv_dtype(parts: RolloutParts, cfg: TrainConfig, arch: Architecture) -> str:
    """The KV cache's row of the report: its dtypes and its shape."""
    k, v = parts.k_dtype, parts.v_dtype
    kinds = f"K and V {k}" if k == v else f"K {k} (after RoPE) + V {v}"
    return (f"{kinds}: {cfg.num_generations} completions x ({parts.prompt} + {parts.new}) tokens x {arch.layers} "
            f"layers x {arch.kv_heads} kv heads x {arch.head_dim}")

