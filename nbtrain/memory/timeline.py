"""The timeline of one training step: the memory at each phase of it, and the peak.

The step follows nbtrain's loop (``nbtrain.engine.loop``): fp32 master weights, the forward under
``torch.autocast`` (bf16/fp16) or plain fp32/tf32, the loss ``cross_entropy(logits.float(), shifted labels)``
outside autocast, ``backward()``, then AdamW and ``zero_grad(set_to_none=True)``.

Notation: B = micro_batch_size, T = max_seq_len, N = B*T tokens per micro-batch, h = hidden size, V = vocabulary
(or number of labels), s = autocast bytes (2 under bf16/fp16, 4 under fp32/tf32), C = loss_chunk_tokens.
A preference objective (dpo, orpo, simpo) runs each pair's chosen and rejected sequences in one forward: its
micro-batch has 2B rows (``forward_rows``), so N = 2B*T there. GRPO's update runs B completions of P + max_new_tokens
tokens (T = P + max_new_tokens there) with the head on the completion positions only; its rollouts are phases of
their own (``rollouts``).

Weights and optimizer state are there all the time; gradients (``set_to_none``) appear during backward, as the
activations they replace are freed. The peak is the largest phase: inside the last layer's forward, the end of
the forward, the loss backward, the output layer's backward, each decoder layer's backward, the embedding's
backward, and the optimizer step. With ``grad_accum_steps > 1`` the gradients of the earlier micro-batches are
there all through the last one. docs/memory-model.md explains each term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import TrainConfig
from .facts import NUM_LABELS, Architecture, architecture, layer_index, parameter_bytes
from ..precision import PRECISION_TABLE
from .rollouts import (RolloutParts, fp32_pass, padding_mask, prompt_length, reference_forward, repeats_kv,
                       sampling_parts)
from .sharding import fsdp_parts
from .trace import FP8_ALIGN, LayerTrace, LinearSpec, TracedTensor, layer_projections, trace_decoder_layer


@dataclass
class StepPeak:
    """The parts of the estimate in bytes, and the step's peak with the phase it happens in."""

    weights: int
    gradients: int
    optimizer: int
    activations: int   # everything saved for backward except logits/loss, at the loss backward
    logits: int        # logits + loss tensors at their peak
    peak: int          # timeline peak of tensor bytes
    phase: str
    trainable: int
    total: int
    notes: list[str]
    master_weights: int = 0   # of ``weights``: the fp32 master copy of the trainable weights (autocast precisions)
    run_tensors: int = 0      # what a CPU run's tracer counts (StepRecord.host_tensors_gib): see ``step_peak``
    param_bytes: int = 4      # the floating-point weights' (and gradients') element size
    gathered: int = 0         # FSDP: the gathered parameters (and unsharded gradients) at the peak's phase
    buckets: int = 0          # DDP: its gradient buckets (a second copy of the gradients, kept for the run)
    gathered_dtype: str = ""  # FSDP: the dtype the parameters are gathered in
    reference: int = 0        # DPO, full fine-tune: the frozen reference copy's weights (no gradients, no state)
    reference_forward: int = 0   # DPO: the reference forward's peak (no_grad) beyond what the step holds then
    rollouts: Optional[RolloutParts] = None   # GRPO: the rollouts' KV cache, sampling transient and tensors
    rollout_peak: int = 0     # GRPO: the rollouts' peak (sampling, or the fp32 pass): held parts included
    update_peak: int = 0      # GRPO: the update's peak (its forward, backward and optimizer step): held parts included
    phases: Optional[dict[str, int]] = None   # each phase's description -> its tensors beyond the held parts


@dataclass
class _Layers:
    """What the decoder layers keep for backward, and their short-lived tensors, from the trace."""

    per_token: list[int]     # bytes saved per token, by layer
    const: list[int]         # weight copies saved for backward, by layer
    cache: list[int]         # weight copies in autocast's cache, by layer
    fwd_extra: int           # short-lived tensors inside a layer's forward, per token
    mlp_grad: float          # the MLP's backward intermediates, per token
    attn_grad: int           # the attention's backward temporaries (math kernel), per token


@dataclass
class _Head:
    """The final norm, the output layer (or classifier) and the loss."""

    saved: int               # kept for backward: the final norm's input, the head's input, chunk targets
    logits: int              # the logits at the end of the forward (0 when chunked)
    loss_backward: int       # the loss's backward tensors at their peak
    logits_grad: int         # the logits' gradient (0 when chunked)
    chunk_forward: int       # the chunked loss's forward (its gradients too, when fused)
    backward: int            # the output layer's backward, beyond the activations and earlier gradients
    fused: bool              # the fused chunked path (nbtrain.engine.losses)
    loss_saved: int = 0      # what the loss saves for backward (log_softmax's output and the targets; the fused
                             # path's gradients): the part of ``loss_backward`` a saved-tensor tracer sees


def forward_rows(cfg: TrainConfig) -> int:
    """The rows one micro-batch's forward runs: a preference objective's B pairs are 2B sequences (each pair's
    chosen, then its rejected), every other objective's B examples (GRPO's: completions) are B rows."""
    pairs = getattr(cfg, "objective", "lm") in ("dpo", "orpo", "simpo")
    return 2 * cfg.micro_batch_size if pairs else cfg.micro_batch_size


def reference_copy(cfg: TrainConfig) -> bool:
    """Whether the run holds a frozen copy of the model as its reference: DPO, or GRPO with grpo_beta > 0, on a
    full fine-tune (DPO: without precompute_ref). LoRA/QLoRA use the same model with the adapters off; ORPO and
    SimPO have no reference."""
    objective = getattr(cfg, "objective", "lm")
    if cfg.method != "full":
        return False
    return (objective == "dpo" and not cfg.precompute_ref) or (objective == "grpo" and cfg.grpo_beta > 0)


def _trace_layers(cfg: TrainConfig, arch: Architecture, adapted: dict[str, int], autocast_bytes, device: str,
                  lean: bool, math_seq: int, param_bytes: int = 4, fp8_input_bytes: Optional[int] = None) -> _Layers:
    """Trace one representative layer, and the first, whose input may need no gradient."""
    full = cfg.method == "full"

    def layer_trace(idx: int, input_requires_grad: bool) -> tuple[LayerTrace, TracedTensor]:
        tr = LayerTrace(autocast_bytes, 1 if device == "cuda" else None, not full and cfg.lora_dropout > 0,
                        math_seq, quant_out_autocast=cfg.quant_bits == 4, lean=lean, param_bytes=param_bytes,
                        fp8_input_bytes=fp8_input_bytes)
        out = trace_decoder_layer(tr, TracedTensor(arch.hidden, param_bytes, input_requires_grad),
                                  layer_projections(arch, idx, cfg.method, adapted, cfg.lora_r), full, arch)
        return tr, out

    L = arch.layers
    embedding_requires_grad = full or cfg.gradient_checkpointing   # checkpointing marks its output
    first, _ = layer_trace(0, embedding_requires_grad)
    rest = layer_trace(min(1, L - 1), True)[0] if L > 1 else first
    return _Layers(per_token=[first.per_token] + [rest.per_token] * (L - 1),
                   const=[first.const] + [rest.const] * (L - 1),
                   cache=[first.cache] + [rest.cache] * (L - 1),
                   fwd_extra=rest.fwd_extra, mlp_grad=rest.mlp_grad * rest.mlp_live / 2, attn_grad=rest.attn_grad)


def _head(cfg: TrainConfig, arch: Architecture, adapted: dict[str, int], unquantized: frozenset[str],
          autocast_bytes, lean: bool, device: str, target_fraction: Optional[float] = None,
          param_bytes: int = 4, weight_copies: bool = True, seq: Optional[int] = None,
          targets: Optional[int] = None) -> _Head:
    """Memory of the final norm, the output layer and the loss, for each path the loss can take.

    ``target_fraction`` (causal LM): the share of the B x (T - 1) positions that carry a target (chat data
    with completion-only loss: the answer tokens; padding); None or 1: every position. Below 1 the head runs on
    the target positions only (``nbtrain.engine.losses``: chunked, or the plain path's selection).
    ``seq`` and ``targets`` (GRPO's update): the rows' length instead of max_seq_len, and the positions the head
    runs on (B x max_new_tokens), gathered from the hidden states by index rows the batch already holds."""
    task, method, full = cfg.task, cfg.method, cfg.method == "full"
    h, V = arch.hidden, arch.vocab
    B, T = forward_rows(cfg), seq or cfg.max_seq_len
    N = B * T
    pb = param_bytes                      # the weights' (and, without autocast, the compute) element size
    s = autocast_bytes or pb
    head_linear = next((lin for lin in arch.linears if lin.name == arch.head), None)
    head_weight = head_linear.weight if head_linear else V * h
    head_trainable = full or task == "sequence-classification"
    chunked = cfg.chunked_loss and task == "causal-lm"
    positions = B * (T - 1)
    n_targets = B
    if task == "causal-lm":
        f = 1.0 if target_fraction is None else min(1.0, max(0.0, float(target_fraction)))
        n_targets = max(1, round(f * positions)) if targets is None else targets
    # the plain path selects the target positions before the head when some positions have none
    selected = task == "causal-lm" and not chunked and n_targets < positions
    tr = LayerTrace(autocast_bytes, 1 if device == "cuda" else None, False, lean=lean, param_bytes=pb)
    normed = tr.rmsnorm(TracedTensor(h, pb, True), full)
    norm_saved = tr.per_token * N
    logits_size = s
    if not chunked:
        logits_size = tr.linear(normed, LinearSpec(h, V, head_weight,
                                                   "trainable" if head_trainable else "frozen")).size
    if not weight_copies:   # FSDP gathers the weights in the compute dtype: autocast copies none of them
        tr.const = 0
    saved = tr.per_token * N + tr.const
    if selected:   # the head's saved input is the selected rows; the positions and their targets (int64)
        saved = (norm_saved + (tr.per_token * N - norm_saved) // N * n_targets + tr.const
                 + (16 * n_targets if targets is None else 0))
    # nbtrain.engine.losses fuses the loss into a plain linear head (no adapter on it, not quantized)
    head_adapted = bool(arch.head) and any(n == arch.head or n.startswith(arch.head + ".") for n in adapted)
    head_quantized = method == "qlora" and head_linear is not None and arch.head not in unquantized
    fused = chunked and head_linear is not None and not head_adapted and not head_quantized
    # the weight's gradient in the output layer's backward (its autocast copy's, then the fp32 one)
    weight_grad = head_weight * ((s + 4) if autocast_bytes else pb) if head_trainable else 0
    chunk_forward = 0
    loss_saved = 0
    if fused:
        # The fused path: each chunk's gradients (hidden states, and the weight when it trains) are made in the
        # forward and kept until backward, which multiplies them by the incoming scalar (a second copy).
        C = min(cfg.loss_chunk_tokens, n_targets)
        saved += (pb * h + 8) * n_targets             # the selected hidden states (fp32; bf16 under bf16-pure) and their targets
        # the weight's gradient is summed over the chunks in an fp32 buffer whatever the weight's dtype
        # (engine.losses._fused_chunks): under bf16-pure it is twice the bf16 weight, not its size
        w_grad = 4 * head_weight if head_trainable else 0
        keep = pb * h * n_targets + w_grad
        loss_saved = keep
        if autocast_bytes:
            # bf16 copies of the weight and the hidden states; a chunk's bf16 logits + fp32 copy, then its
            # bf16 gradient beside the fp32 one; later the bf16 gradient alone beside the chunk's bf16 weight
            # gradient before it is summed
            copies = 2 * head_weight + 2 * h * n_targets
            chunk = max(6 * C * V, 2 * C * V + (2 * head_weight if head_trainable else 0))
        elif pb < 4:    # bf16 weights (bf16-pure): no copies; bf16 logits, their fp32 copy, the bf16 gradient
            copies, chunk = 0, max(6 * C * V, 2 * C * V + (2 * head_weight if head_trainable else 0))
        else:    # fp32: the logits are made, turned into their gradient in place, and summed in place
            copies, chunk = 0, 4 * C * V
        chunk_forward = copies + keep + chunk
        logits = logits_grad = 0
        # ... and the backward's scaled copies: each saved gradient times the fp32 scalar is an fp32 product,
        # then cast to its tensor's dtype, one after the other (the hidden states' first). In fp32 the cast is the
        # product itself: twice what is kept. Under bf16-pure the product is fp32 beside its bf16 cast, and the
        # weight's is the large one (a 49k x 576 head: 6 bytes/param on top of the 4 kept)
        hn = h * n_targets
        if pb == 4:
            loss_backward = 2 * keep
        else:
            w_cast = pb * head_weight if head_trainable else 0
            loss_backward = keep + max(4 * hn + pb * hn, pb * hn + w_grad + w_cast)
        # the saved gradients gone; the hidden states' gradient meets the index/slice backward
        backward = (pb * head_weight if head_trainable else 0) + pb * h * n_targets + 2 * pb * h * N
    elif chunked:
        # nbtrain.engine.losses: the head and the loss chunk by chunk, each chunk recomputed in backward. Kept:
        # the selected hidden states (fp32) and targets; a chunk's backward holds its logits, log_softmax and
        # the two fp32 gradients, the head's bf16 weight copy, and the hidden states' gradient buffers
        C = min(cfg.loss_chunk_tokens, n_targets)
        saved += (pb * h + 8) * n_targets
        logits = logits_grad = 0
        copy = 2 * head_weight if autocast_bytes else 0
        loss_backward = 12 * C * V + 2 * pb * h * n_targets + copy
        if head_trainable and n_targets > C:   # the earlier chunks' weight gradient waits to be summed
            loss_backward += pb * head_weight
        chunk_forward = pb * h * N + (s + 8) * C * V + copy
        # one chunk's logits gradient and the weight's; the log_softmax tensors are gone by then
        backward = s * C * V + weight_grad + loss_backward - 12 * C * V
        if head_trainable and n_targets > C:   # ... and the sum is made out of place
            backward += 4 * head_weight
    elif selected:
        # nbtrain.engine.losses.selected_logits: the head and the loss over the n target rows only; in backward
        # the selection scatters their gradient into a zero tensor of every position's hidden state
        n = n_targets
        logits = n * V * logits_size
        loss_backward = 12 * n * V + 8 * n
        loss_saved = 4 * n * V + 8 * n
        logits_grad = n * V * logits_size
        # the selection's backward: index_select scatters into one zero tensor of every position; GRPO's gather
        # makes a zero tensor and scatter_add's result beside it, in the hidden states' dtype
        hidden_grad = 4 * h * N if targets is None else 2 * pb * h * N
        backward = logits_grad + (s + 4) * h * n + weight_grad + hidden_grad
    elif task == "causal-lm":
        # the loop shifts the labels (padded with -100), not the logits: the loss runs over all N rows
        logits = N * V * logits_size
        loss_backward = 12 * N * V + 8 * N     # log_softmax output, its two fp32 gradients, targets
        loss_saved = 4 * N * V + 8 * N         # log_softmax's output and the targets
        logits_grad = N * V * logits_size
        backward = logits_grad + (s + 4) * h * N + weight_grad
    else:
        logits = N * V * logits_size           # the head runs on every position, then pools
        loss_backward = 12 * B * V
        loss_saved = 4 * B * V + 8 * B
        logits_grad = logits
        backward = logits_grad + (s + 4) * h * N + weight_grad
    return _Head(saved=saved, logits=logits, loss_backward=loss_backward, logits_grad=logits_grad,
                 chunk_forward=chunk_forward, backward=backward, fused=fused, loss_saved=loss_saved)


def _gradients_by_position(arch: Architecture, full: bool, adapted: dict[str, int],
                           gradients: int, pb: int = 4) -> tuple[list[int], int, int, int]:
    """Gradient bytes by where backward creates them: (per decoder layer, output layer, embedding, others)."""
    L = arch.layers
    per_layer = [0] * L
    if not full:
        for name, n in adapted.items():
            idx = layer_index(name, L)
            if idx is not None:
                per_layer[idx] += pb * n
        return per_layer, gradients - sum(per_layer), 0, 0
    head_names = {f"{arch.head}.weight", f"{arch.head}.bias"} if arch.head else set()
    head = embedding = other = 0
    for name, n, _ in arch.params:   # tied weights appear once, under the embedding's name
        idx = layer_index(name, L)
        if idx is not None:
            per_layer[idx] += pb * n
        elif name in head_names:
            head += pb * n
        elif "embed" in name or name.endswith("wte.weight") or name.endswith("wpe.weight"):
            embedding += pb * n
        else:
            other += pb * n
    if arch.tied:
        head = embedding   # the output layer's backward creates the shared weight's gradient first
    return per_layer, head, embedding, other


def _reference_parts(cfg: TrainConfig, arch: Architecture, weight_bytes: int, layers: _Layers,
                     autocast_bytes: Optional[int], act_pb: int, rows: int, target_fraction: Optional[float],
                     notes: list[str]) -> tuple[int, int]:
    """A preference objective's reference: (the frozen copy's bytes, held all run; the reference forward's peak
    beyond what is held: ``no_grad_forward``), and its notes. Both 0 for objective="lm", ORPO and SimPO.

    The copy (DPO, full fine-tune, no precompute_ref) is every parameter in the trained weights' dtype:
    ``weight_bytes`` (p per parameter; no gradients, no optimizer state)."""
    objective = getattr(cfg, "objective", "lm")
    if objective == "lm":
        return 0, 0
    B = cfg.micro_batch_size
    notes.append(f"{objective}: each micro-batch runs its {B} pairs' chosen and rejected sequences in one forward: "
                 f"activations and logits for {rows} rows of up to {cfg.max_seq_len} tokens")
    if objective != "dpo":
        notes.append(f"{objective}: no reference model (no copy, no reference forward)")
        return 0, 0
    if cfg.precompute_ref:
        notes.append("dpo with precompute_ref: no reference copy and no reference forward in the step; the "
                     "reference log-probs (two floats per pair) are computed in one pass before training")
        return 0, 0
    if cfg.method != "full":
        notes.append(f"dpo with {cfg.method}: the reference is the same model with its adapters off: no copy; its "
                     "forward (no_grad) is counted")
    else:
        notes.append("dpo, full fine-tune: the reference is a frozen copy of the model in the trained weights' "
                     "dtype, no gradients or optimizer state (reference weights); precompute_ref=True drops it")
    return (weight_bytes if reference_copy(cfg) else 0), no_grad_forward(arch, layers, autocast_bytes, act_pb, rows,
                                                                         cfg.max_seq_len, target_fraction)


def _grpo_reference(cfg: TrainConfig, arch: Architecture, weight_bytes: int, autocast_bytes: Optional[int],
                    act_pb: int, seq: int, notes: list[str]) -> tuple[int, int]:
    """GRPO's reference (grpo_beta > 0): (the frozen copy's bytes, held all run: a full fine-tune's deepcopy of the
    model in the weights' dtype; the reference forward's peak beyond what the update holds then)."""
    if cfg.grpo_beta <= 0:
        notes.append("grpo: grpo_beta=0, no reference model (no copy, no reference forward)")
        return 0, 0
    forward = reference_forward(cfg, arch, autocast_bytes, act_pb, seq)
    if cfg.method != "full":
        notes.append(f"grpo with {cfg.method}: the reference is the same model with its adapters off: no copy; its "
                     "forward (no_grad) is counted")
        return 0, forward
    notes.append("grpo, full fine-tune, grpo_beta > 0: the reference is a frozen copy of the model in the trained "
                 "weights' dtype, no gradients or optimizer state (reference weights); called whole, its forward "
                 "makes the logits of every position of the rows before it gathers the completions'")
    return weight_bytes, forward


def no_grad_forward(arch: Architecture, layers: _Layers, autocast_bytes: Optional[int], act_pb: int, rows: int,
                    T: int, target_fraction: Optional[float]) -> int:
    """The peak of a forward under no_grad to the answer tokens' log-probs, beyond the weights: nothing is saved
    for backward and each layer's tensors go as the next runs, so at most one layer's (its intermediates,
    autocast's casts of its weights, its input and output) for the ``rows``, or the head's (nbtrain.engine.
    preference.sequence_logps: the answer positions' logits, their fp32 copy and cross_entropy's log_softmax,
    beside the hidden states and autocast's cast of the head)."""
    h, V = arch.hidden, arch.vocab
    N = rows * T
    s = autocast_bytes or act_pb
    layer_live = (max(layers.per_token) + layers.fwd_extra) * N + max(layers.const) + 2 * act_pb * h * N
    positions = rows * (T - 1)
    f = 1.0 if target_fraction is None else min(1.0, max(0.0, float(target_fraction)))
    n_targets = max(1, round(f * positions))
    logit_rows = n_targets if n_targets < positions else N   # the answer positions only, when some are not
    head_live = (logit_rows * V * (s + 4 + (4 if s < 4 else 0)) + act_pb * h * N
                 + (V * h * autocast_bytes if autocast_bytes else 0))
    return max(layer_live, head_live)


def step_peak(cfg: TrainConfig, precision: str, device: str, num_labels: int = NUM_LABELS,
              target_fraction: Optional[float] = None, world_size: int = 1,
              prompt_tokens: Optional[int] = None) -> StepPeak:
    """The parts of one training step of ``cfg`` under ``precision`` on ``device``, and its peak, for one of
    ``world_size`` processes (sharding="fsdp": rank 0's shards and gathered groups, ``sharding``; "none": DDP,
    a whole copy per rank and its gradient buckets). micro_batch_size is per process, so activations are too.

    ``target_fraction``: see ``_head`` (the share of positions with a target; None: all of them).
    ``prompt_tokens`` (GRPO): the longest prompt of the data; None: max_seq_len, the longest a prompt can be."""
    arch = architecture(cfg.model, cfg.task, num_labels)
    params = parameter_bytes(cfg, arch, num_labels, precision)
    notes: list[str] = []
    h, L = arch.hidden, arch.layers
    T = cfg.max_seq_len
    grpo = getattr(cfg, "objective", "lm") == "grpo"
    prompt = 0
    if grpo:   # the update's rows: a prompt and its completion, right-padded to P + max_new_tokens
        prompt = prompt_length(cfg, prompt_tokens)
        T = prompt + cfg.max_new_tokens
        if not prompt_tokens:
            source = ("max_seq_len, the longest a prompt can be (estimate_memory(cfg, data=...) uses the data's "
                      "longest)")
        elif prompt < prompt_tokens:
            source = "max_seq_len (the data's longer prompts are cut to it)"
        else:
            source = "the data's longest"
        notes.append(f"grpo: prompts of {prompt} tokens: {source}")
    rows = forward_rows(cfg)
    N = rows * T
    spec = PRECISION_TABLE.get(precision, PRECISION_TABLE["fp32"])
    # the precision table: autocast's element size (None: no autocast; tf32 keeps fp32 tensors), the weights'
    # (bf16-pure: 2, and no autocast, so no weight copies), and fp8's Float8Linear layers
    autocast_bytes = spec.autocast_dtype.itemsize if spec.autocast_dtype is not None else None
    pb = params.param_bytes
    fp8_input_bytes = None
    if spec.fp8:
        fp8_input_bytes = autocast_bytes if device == "cuda" else 0
        notes.append("fp8: approximate; torchao's Float8Linear layers (the decoder's linears with sizes divisible "
                     f"by {FP8_ALIGN}) keep their {'bf16' if device == 'cuda' else 'fp32 (CPU: not cast)'} input "
                     "for backward and no weight copy; their short-lived float8 casts (1 byte per input element "
                     "and per weight) are not counted; the output layer runs under bf16 autocast")
    full = cfg.method == "full"
    ckpt = cfg.gradient_checkpointing
    fs = None
    act_pb = pb   # the element size of the weights the forward reads
    if cfg.sharding == "fsdp" and world_size > 1:
        # FSDP's MixedPrecisionPolicy gathers the weights in autocast's dtype: the forward reads 16-bit weights
        # (the residual stream and the adapters' inputs are 16-bit too, as under bf16-pure) and autocast casts
        # nothing, so no weight copies are saved or cached
        act_pb = autocast_bytes or pb
        fs = fsdp_parts(cfg, arch, params, act_pb, world_size, num_labels)

    # -- activations ------------------------------------------------------------------------------------------
    if not arch.llama_like:
        notes.append(f"{arch.model_type}: activations approximated with a Llama-style layer of the same sizes")
    if cfg.method == "qlora" and cfg.quant_bits == 8:
        notes.append("8-bit layers' activations are approximated as the 4-bit layers' (measured for 4-bit only)")
    # nbtrain.models.lean applies to Llama-style layers, and not under compile (the estimate models eager layers)
    lean = cfg.lean_layers and not cfg.compile and arch.llama_like
    if cfg.lean_layers and not lean:
        notes.append("lean_layers: no effect here (" + ("not applied under compile=True" if cfg.compile
                     else f"{arch.model_type} has no Llama-style MLP and RMSNorm") + ")")
    # CUDA has no fused fp32 kernel for grouped-query attention (flash and cuDNN are 16-bit only, the
    # memory-efficient one rejects unequal q/kv heads): SDPA falls back to the math kernel (measured: torch 2.11)
    math_seq = T if device == "cuda" and autocast_bytes is None and pb == 4 and arch.kv_heads < arch.heads else 0
    if grpo:   # padded rows: repeat_kv makes the heads equal, and the memory-efficient kernel takes fp32 with a mask
        math_seq = 0
    if math_seq:
        notes.append("fp32 attention with grouped kv heads runs SDPA's math kernel on CUDA (T x T scores per "
                     "layer); bf16 avoids it")
    layers = _trace_layers(cfg, arch, params.adapted, autocast_bytes, device, lean, math_seq, act_pb,
                           fp8_input_bytes)
    rope_bytes = 2 * arch.head_dim * act_pb * T  # cos and sin in the residual's dtype, shared by all layers
    # input_ids, attention_mask, labels (int64); GRPO's rows are among its rollout tensors
    inputs = 0 if grpo else 3 * 8 * N
    head = _head(cfg, arch, params.adapted, params.unquantized, autocast_bytes, lean, device, target_fraction,
                 act_pb, weight_copies=fs is None, seq=T if grpo else None,
                 targets=rows * cfg.max_new_tokens if grpo else None)
    if fs is not None:
        layers.const = [0] * L
        layers.cache = [0] * L
    # GRPO's rows are right-padded (completions end at different lengths): each layer's SDPA keeps its additive
    # attention mask for backward, and with grouped kv heads K and V repeated to every query head (repeat_kv)
    padded = 0
    if grpo:
        s_attn = autocast_bytes or act_pb
        padded = padding_mask(cfg, arch, T, s_attn)
        if repeats_kv(arch):
            padded += 2 * (arch.heads - arch.kv_heads) * arch.head_dim * s_attn * N
    if ckpt:
        kept = [act_pb * h * N] * L    # each checkpointed layer keeps only its input (the residual's dtype)
    else:
        kept = [layers.per_token[k] * N + layers.const[k] + padded for k in range(L)]
    acts = sum(kept) + rope_bytes + inputs + head.saved
    ref_layers = layers
    if getattr(cfg, "objective", "lm") == "dpo" and not cfg.precompute_ref and cfg.method != "full":
        # LoRA/QLoRA's reference runs with its adapters off: the base layer's tensors, not the adapters'
        ref_layers = _trace_layers(cfg.replace(method="full"), arch, {}, autocast_bytes, device, lean, math_seq,
                                   act_pb, fp8_input_bytes)
    mismatch = 0
    rollouts = None
    if grpo:
        reference, ref_forward = _grpo_reference(cfg, arch, params.weights, autocast_bytes, act_pb, T, notes)
        # the sampler's autocast caches its casts of the trained weights (leaves that require grad, no_grad or
        # not) until the group's autocast block ends: the layers' trace under it says which, and the head's
        sampler = cfg.sampler_precision or precision
        s_spec = PRECISION_TABLE.get(sampler, PRECISION_TABLE["fp32"])
        s_ac = s_spec.autocast_dtype.itemsize if s_spec.autocast_dtype is not None else None
        trained = _trace_layers(cfg, arch, params.adapted, s_ac, device, lean, 0, pb)
        cached = sum(trained.cache) + (2 * arch.vocab * h if s_ac and full else 0)
        rollouts = sampling_parts(cfg, arch, precision, pb, prompt, cached, params.adapted, device)
        lift = (4 - pb) * (params.total if cfg.method != "qlora" else params.trainable)
        mismatch = fp32_pass(cfg, arch, params.adapted, T, lift)
        notes.append(f"grpo: the rollouts sample {cfg.num_generations} completions of a prompt at once with the KV "
                     f"cache (no_grad, {rollouts.sampler_precision}), one prompt after the other; the update runs "
                     f"{rows} completions per micro-batch, each {prompt} + {cfg.max_new_tokens} tokens, the head "
                     f"and its fp32 log-softmax on the {cfg.max_new_tokens} completion positions only")
    else:
        reference, ref_forward = _reference_parts(cfg, arch, params.weights, ref_layers, autocast_bytes, act_pb,
                                                  rows, target_fraction, notes)
    if getattr(cfg, "objective", "lm") != "lm" and not grpo:
        # summary["logprob_mismatch"] (sampled steps, before the step's first micro-batch, no gradients yet): the
        # policy's forward in the run's precision, then in fp32 with 16-bit weights lifted to fp32 in place
        # (bf16-pure: 2 more bytes per parameter while it runs); QLoRA's packed weights are not floating: not lifted
        fp32_layers = _trace_layers(cfg.replace(method="full"), arch, {}, None, device, lean, math_seq, 4, None)
        lift = (4 - pb) * (params.total if cfg.method != "qlora" else params.trainable)
        mismatch = lift + no_grad_forward(arch, fp32_layers, None, 4, rows, T, target_fraction)

    # -- the timeline -----------------------------------------------------------------------------------------
    weights, optimizer, grads = params.weights, params.optimizer, params.gradients
    # FSDP's gathered groups by phase (0 without FSDP): each group (a layer, the root: embeddings, final norm,
    # head) for its forward and again for its backward (a layer with the one before it, prefetched). nbtrain
    # passes reshard_after_forward to the root too (engine.distributed.FSDPContext.wrap), so with it the root is
    # freed when the model's forward returns, through the loss, and gathered again for the head's backward;
    # without it every group stays gathered from its forward until its backward.
    g_root = g_fwd = g_last = g_head = g_loss = 0
    keep_all = False
    if fs is not None:
        weights, optimizer, grads = fs.weights, fs.optimizer, fs.gradients
        keep_all = not cfg.reshard_after_forward
        held = sum(fs.layers) if keep_all else 0
        g_root = fs.root
        g_fwd = g_head = g_root + held
        g_loss = held + (g_root if keep_all else 0)
        g_last = g_root + (held if keep_all else fs.layers[-1])
    accum = cfg.grad_accum_steps > 1
    earlier_grads = grads if accum else 0   # earlier micro-batches' gradients, present all through the last one
    phases: dict[str, tuple[int, str]] = {}
    # end of the forward, still inside autocast, whose cache holds the trainable weights' bf16 copies
    cache_only = sum(layers.cache) if ckpt else 0
    phases["forward"] = (earlier_grads + acts + cache_only + head.logits + head.chunk_forward + g_fwd,
                         "the chunked loss's forward (its gradients made there)" if head.fused
                         else "the end of the forward")
    if not ckpt:
        # inside the last layer's forward: its short-lived tensors (an adapter's fp32 input copy and dropout
        # output, the math kernel's scores) on top of everything the layers have kept
        phases["last layer"] = (earlier_grads + acts - head.saved + cache_only + layers.fwd_extra * N + g_last,
                                "the last layer's forward")
    # nbtrain.engine.loop.micro_loss_sum keeps no reference to the logits: after the loss's forward only the
    # autograd graph holds what backward needs (log_softmax's output, not the logits)
    phases["loss"] = (earlier_grads + acts + head.loss_backward + g_loss,
                      "the loss backward (the fused head's gradients scaled)" if head.fused
                      else "the loss backward (log_softmax)")
    # the output layer's backward: the logits' gradient, the hidden states' and the weight's (when it trains)
    phases["head"] = (earlier_grads + acts + head.backward + g_head, "the output layer's backward")
    # decoder layers, last to first: their activations go, their gradients come
    layer_grads, head_grads, embedding_grads, other_grads = _gradients_by_position(arch, full, params.adapted,
                                                                                   params.gradients, pb)
    layer_new = list(layer_grads)   # what a layer's backward adds while it runs
    if fs is not None:
        # the root's unsharded gradients wait for its reduce-scatter at the end of the backward; a layer's are
        # reduce-scattered (through an fp32 copy) as its backward ends, leaving its shard
        head_grads, other_grads = fs.root_trainable * fs.compute_bytes, 0
        layer_new = [fs.grad_transient(n) for n in fs.layer_trainable]
        layer_grads = list(fs.layer_grad_shards)
    remaining = acts - head.saved
    grads_so_far = head_grads + other_grads
    worst, worst_gathered = (0, ""), 0
    for k in reversed(range(L)):
        layer_act = layers.per_token[k] * N + padded
        # inside the MLP's backward: the gradients of SiLU(gate) and up (or the attention's, if larger)
        backward_temps = max(2 * layers.mlp_grad, layers.attn_grad) * N
        if ckpt:                       # the layer is recomputed first, with its own short-lived tensors
            transient = layer_act + layers.const[k] - act_pb * h * N + max(layers.fwd_extra * N, backward_temps)
        else:
            transient = backward_temps
        transient += act_pb * h * N    # the residual stream's gradient
        gathered = 0
        if fs is not None:             # this layer, and the one before it prefetched (all of them not resharded)
            gathered = g_root + (sum(fs.layers[:k + 1]) if keep_all else sum(fs.layers[max(0, k - 1):k + 1]))
            if accum:                  # the root's unsharded gradients are not in ``earlier_grads``
                gathered += head_grads
        here = earlier_grads + remaining + (0 if accum else grads_so_far) + layer_new[k] + transient + gathered
        if here > worst[0]:
            worst = (here, f"layer {k}'s backward" + (" (recomputed)" if ckpt else ""))
            worst_gathered = gathered + (layer_new[k] if fs is not None else 0)
        remaining -= kept[k]
        grads_so_far += layer_grads[k]
    phases["layers"] = worst
    # the input embedding's dense gradient; tied to the output layer it is summed with that one's
    embedding_extra = 0
    if fs is not None:   # the root's gradients, unsharded and in the fp32 reduce-scatter copy, beside its weights
        embedding_extra = g_root + fs.grad_transient(fs.root_trainable)
    elif full and embedding_grads:
        embedding_extra = 2 * embedding_grads if arch.tied else (embedding_grads if accum else 0)
    if ref_forward:
        # TRL's and LLaMA-Factory's order: the policy's forward first, then the reference's under no_grad while
        # the policy's saved tensors (and its loss's log_softmax) wait for backward. Run before the policy's
        # forward it would sit on less; this is the larger of the two orders.
        phases["reference"] = (earlier_grads + acts + head.loss_saved + cache_only + ref_forward,
                               "the reference forward (no_grad, the policy's activations held)")
    if mismatch:
        phases["mismatch"] = (mismatch, "the log-prob mismatch's fp32 forward (sampled steps)")
    phases["embedding"] = (grads + embedding_extra, "the embedding's backward")
    phases["optimizer"] = (grads, "the optimizer step")
    # DDP (several processes, no sharding): the Reducer keeps a bucket copy of every gradient for the whole run
    # (gradient_as_bucket_view=False, torch's default and nbtrain's)
    buckets = params.gradients if cfg.sharding != "fsdp" and world_size > 1 else 0
    rollout_peak = update_peak = 0
    if rollouts is not None:
        # GRPO: the rollouts come first, with no gradients and no activations; the rollout batch they make stays
        # through the update
        update = {k: (v + rollouts.tensors, f"the update: {d}") for k, (v, d) in phases.items() if k != "mismatch"}
        drawn = {"rollouts": (rollouts.sampling_peak, "the rollouts: sampling with the KV cache (no_grad)")}
        if mismatch:
            drawn["mismatch"] = (mismatch + rollouts.tensors,
                                 "the rollouts: the log-prob mismatch's fp32 pass (sampled steps, no_grad)")
        phases = {**drawn, **update}
        rollout_peak = weights + optimizer + reference + max(v for v, _ in drawn.values())
        update_peak = weights + optimizer + reference + max(v for v, _ in update.values())
    peak_phase = max(phases, key=lambda k: phases[k][0])
    top, where = phases[peak_phase]
    # the gathered groups (and unsharded gradients) in the peak's phase: the report's "gathered" part
    gathered_at_peak = {"forward": g_fwd, "last layer": g_last, "loss": g_loss, "head": g_head,
                        "layers": worst_gathered, "embedding": embedding_extra if fs is not None else 0,
                        }.get(peak_phase, 0)
    head_part = max(head.chunk_forward, head.loss_backward) if head.fused else head.logits + head.loss_backward
    # What nbtrain's CPU run tracer (engine.telemetry.RunTensorBytes, StepRecord.host_tensors_gib) counts: the
    # weights and optimizer state (and the earlier micro-batches' gradients) with every tensor saved for backward,
    # or all of them with the gradients at the optimizer step. It sees no short-lived tensor (the loss backward's,
    # a layer's backward temporaries), and of a checkpointed layer only its input (torch's checkpoint saves its
    # positional inputs for backward; RoPE's cos and sin come as keyword arguments, and what the layer saves is
    # packed by checkpoint's own hooks). Under FSDP it counts the groups gathered when each tensor is saved (the
    # largest of: the last layer's forward, the head's, the loss's); nothing is prefetched in the forward on the
    # CPU, and the backward (where groups are gathered again) saves nothing. DDP's buckets are not the run's
    # tensors to it.
    run_saved = acts - (rope_bytes if ckpt else 0) + head.loss_saved
    forward_peak = earlier_grads + run_saved + g_loss
    if fs is not None:   # the last layer's forward (the head's tensors not yet saved), the head's (the root's)
        forward_peak = max(forward_peak, earlier_grads + run_saved - head.saved - head.loss_saved + g_last,
                           earlier_grads + run_saved - head.loss_saved + g_fwd)
    # the reference copy is held for the whole run, beside the trained weights (a tensor of the run's own)
    run_tensors = weights + optimizer + reference + max(forward_peak, grads)
    return StepPeak(weights=weights, gradients=grads, optimizer=optimizer, activations=acts,
                    logits=head_part, peak=weights + optimizer + reference + top + buckets, phase=where,
                    trainable=params.trainable, total=params.total, notes=notes,
                    master_weights=fs.master_weights if fs is not None else params.master_weights,
                    run_tensors=run_tensors, param_bytes=pb, gathered=gathered_at_peak, buckets=buckets,
                    reference=reference, reference_forward=ref_forward, rollouts=rollouts,
                    rollout_peak=rollout_peak, update_peak=update_peak,
                    phases={d: v for v, d in phases.values()},
                    gathered_dtype=({2: "bf16" if precision in ("bf16", "bf16-pure", "fp8") else "fp16", 4: "fp32"}
                                    [fs.compute_bytes] if fs is not None else ""))
