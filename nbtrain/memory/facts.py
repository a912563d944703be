"""Architecture facts: a model's shapes and parameters, read from its config alone.

The architecture is built on the ``meta`` device (exact parameter counts, no weights), and LoRA adapters are
applied there by peft with the same ``LoraConfig`` the trainer uses. ``parameter_bytes`` turns those counts into
the exact parts of the estimate: weights (in their stored dtype, with the fp32 master copy they hold under
autocast), gradients and the optimizer's state (by optimizer: ``optimizer_state_bytes``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..config import TrainConfig
from ..models.loading import head_module_names, meta_model
from ..models.methods import lora_config, quiet_peft
from ..precision import PRECISION_TABLE

NF4_BLOCK = 64                       # bitsandbytes' 4-bit block size
NF4_SECOND_BLOCK = 256               # block size of the double-quantised absmax
NF4_TABLES = 256 * 4 + 16 * 4 + 4    # per layer: second-level code, nf4 code, offset (fp32)
STEP_BYTES = 4                       # AdamW's per-tensor ``step`` (fp32 scalar)
# bitsandbytes' 8-bit optimizers (0.50): a tensor below MIN_8BIT_SIZE elements keeps fp32 states; the others keep
# uint8 states with one fp32 absmax per BNB_BLOCK elements per state, and share one 256-entry fp32 quantile map per
# state (signed for the first moment, unsigned for the second). Their ``step`` is a Python int.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
BNB_QMAP_BYTES = 256 * 4
ADAFACTOR_RMS_BYTES = 4              # transformers' Adafactor keeps each tensor's RMS as a 0-d fp32 tensor
NUM_LABELS = 2                       # a classifier's labels come from the data; its head is tiny either way

# leaf name of a Llama-style projection -> its role in the decoder layer
LLAMA_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
               "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


@dataclass(frozen=True)
class LinearFacts:
    """One ``nn.Linear`` of the model."""

    name: str          # qualified module name in the (un-wrapped) model
    leaf: str          # the last part of the name (``q_proj``)
    layer: Optional[int]   # the decoder layer it belongs to, None outside the layers
    n_in: int
    n_out: int
    weight: int        # weight elements
    bias: int          # bias elements


@dataclass(frozen=True)
class Architecture:
    """The shapes of a model, and every parameter it has."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int              # output width of the head: the vocabulary, or the number of labels
    tied: bool              # the output layer shares the input embedding's weight
    llama_like: bool        # the decoder layer is modelled op by op (else approximated with the same shapes)
    linears: tuple[LinearFacts, ...]
    head: Optional[str]     # module name of the output layer / classifier
    params: tuple[tuple[str, int, bool], ...]   # (name, numel, 2-D weight of a Linear) for every parameter
    total_params: int
    shapes: tuple[tuple[int, ...], ...] = ()     # each parameter's shape, in the order of ``params``


@dataclass(frozen=True)
class Adapters:
    """What LoRA trains: peft applied to the meta model with the trainer's LoraConfig."""

    adapted: dict[str, int]   # adapted Linear's name -> its adapter parameters
    others: dict[str, int]    # other trainable tensors (heads under modules_to_save) -> parameters
    n_tensors: int            # number of trainable tensors
    shapes: tuple[tuple[int, ...], ...] = ()   # each trainable tensor's shape


@dataclass(frozen=True)
class ParameterBytes:
    """The exact parts: what the parameters, their gradients and the optimizer's state take."""

    weights: int                 # every parameter in its stored dtype (master copy included)
    gradients: int
    optimizer: int
    trainable: int               # trainable parameters
    total: int                   # all parameters, adapters included
    adapted: dict[str, int]      # adapted Linear's name -> adapter parameters (empty for full fine-tuning)
    unquantized: frozenset[str]  # Linear modules QLoRA leaves in fp32 (empty unless QLoRA)
    master_weights: int = 0      # of ``weights``: the fp32 trainable weights autocast computes from (fp16/bf16/fp8)
    param_bytes: int = 4         # bytes per element of the floating-point weights and their gradients
    optimizer_name: str = "adamw"


def layer_index(name: str, n_layers: int) -> Optional[int]:
    """The decoder layer a parameter or module name belongs to (``model.layers.3.mlp`` -> 3), else None."""
    parts = name.split(".")
    for k, p in enumerate(parts[:-1]):
        if p.isdigit() and k > 0 and parts[k - 1] in ("layers", "layer", "h", "blocks", "block"):
            i = int(p)
            return i if i < n_layers else None
    return None


def _meta_model(model: str, task: str, num_labels: int) -> torch.nn.Module:
    # a Hub id fetches config.json only (no weights)
    return meta_model(model, task, num_labels, local_only=False)


def _config_stamp(model: str) -> Optional[float]:
    """The modification time of a local model's config.json, so that an edited config is read again."""
    f = Path(model).expanduser() / "config.json"
    return f.stat().st_mtime if f.is_file() else None


def architecture(model: str, task: str, num_labels: int = NUM_LABELS) -> Architecture:
    """The shapes and parameters of ``model`` built for ``task`` (cached while its config.json is unchanged)."""
    return _architecture(model, task, num_labels, _config_stamp(model))


@functools.lru_cache(maxsize=32)
def _architecture(model: str, task: str, num_labels: int, stamp: Optional[float]) -> Architecture:
    m = _meta_model(model, task, num_labels)
    c = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
    hidden = int(getattr(c, "hidden_size", 0) or getattr(c, "n_embd", 0) or getattr(c, "d_model", 0))
    layers = int(getattr(c, "num_hidden_layers", 0) or getattr(c, "n_layer", 0) or getattr(c, "num_layers", 0))
    heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 1)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden)
    linears = []
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear):
            linears.append(LinearFacts(name, name.rsplit(".", 1)[-1], layer_index(name, layers), mod.in_features,
                                       mod.out_features, mod.weight.numel(),
                                       mod.bias.numel() if mod.bias is not None else 0))
    linear_weights = {f"{lin.name}.weight" for lin in linears}
    params, shapes, seen = [], [], set()
    for name, p in m.named_parameters():   # tied parameters are yielded once
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append((name, p.numel(), name in linear_weights))
        shapes.append(tuple(p.shape))
    out = m.get_output_embeddings() if task == "causal-lm" else None
    if out is not None:
        head = next((n for n, mod in m.named_modules() if mod is out), None)
    else:
        names = head_module_names(m)
        head = next((lin.name for lin in linears if names and lin.name.split(".")[0] in names), None)
    head_out = next((lin.n_out for lin in linears if lin.name == head), int(getattr(c, "vocab_size", 0) or 0))
    try:
        emb = m.get_input_embeddings()
    except NotImplementedError:   # a CNN image classifier (ConvNeXt) has no input embedding
        emb = None
    tied = bool(out is not None and emb is not None and out.weight is emb.weight)
    layer_leaves = {lin.leaf for lin in linears if lin.layer is not None}
    return Architecture(model_type=str(getattr(c, "model_type", type(m).__name__)), hidden=hidden, layers=layers,
                        heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
                        vocab=head_out, tied=tied, llama_like=set(LLAMA_ROLES) <= layer_leaves,
                        linears=tuple(linears), head=head, params=tuple(params),
                        total_params=sum(n for _, n, _ in params), shapes=tuple(shapes))


def adapters(model: str, task: str, num_labels: int, lora_r: int, targets: tuple[str, ...] | str) -> Adapters:
    """What LoRA of rank ``lora_r`` on ``targets`` trains in ``model`` (cached like ``architecture``)."""
    return _adapters(model, task, num_labels, _config_stamp(model), lora_r, targets)


@functools.lru_cache(maxsize=64)
def _adapters(model: str, task: str, num_labels: int, stamp: Optional[float], lora_r: int,
              targets: tuple[str, ...] | str) -> Adapters:
    from peft import get_peft_model          # peft is heavy: loaded only when an adapter is counted
    from peft.tuners.lora import LoraLayer

    cfg = TrainConfig.model_construct(model=model, task=task, lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                      lora_targets=targets if isinstance(targets, str) else list(targets))
    m = _meta_model(model, task, num_labels)
    for p in m.parameters():
        p.requires_grad_(False)
    with quiet_peft():
        pm = get_peft_model(m, lora_config(cfg, m, task))
    prefix = "base_model.model."
    adapted, others, n_tensors, shapes = {}, {}, 0, []
    lora_modules = {n for n, mod in pm.named_modules() if isinstance(mod, LoraLayer)}
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        n_tensors += 1
        shapes.append(tuple(p.shape))
        owner = next((lm for lm in lora_modules if name.startswith(lm + ".lora_")), None)
        if owner is not None:
            key = owner[len(prefix):] if owner.startswith(prefix) else owner
            adapted[key] = adapted.get(key, 0) + p.numel()
        else:
            others[name] = p.numel()
    return Adapters(adapted, others, n_tensors, tuple(shapes))


def unquantized_linears(model: str, task: str, num_labels: int, arch: Architecture) -> frozenset[str]:
    """Linear modules bitsandbytes leaves unquantised, as transformers decides (output layer, heads)."""
    if task in ("sequence-classification", "image-classification"):   # nbtrain skips the classifier's new head
        keys = head_module_names(_meta_model(model, task, num_labels))
    else:
        try:
            from transformers.quantizers.base import get_keys_to_not_convert   # optional: newer transformers

            keys = get_keys_to_not_convert(_meta_model(model, task, num_labels))
        except Exception:  # an older transformers: the output layer is what it skips
            keys = [arch.head] if arch.head else []
    return frozenset(lin.name for lin in arch.linears
                     if any(lin.name == k or lin.name.startswith(k + ".") or lin.name.endswith(k) for k in keys))


def nf4_bytes(n: int) -> int:
    """Bytes of an n-element weight in 4-bit nf4 with double quantisation (bitsandbytes' layout)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_SECOND_BLOCK) + NF4_TABLES


def optimizer_state_bytes(optimizer: str, shapes: Sequence[tuple[int, ...]], param_bytes: int = 4) -> int:
    """Bytes of the state ``optimizer`` keeps for trainable tensors of ``shapes`` whose dtype takes
    ``param_bytes`` per element, after its first step (what ``nbtrain.engine.optimizers.optimizer_state_bytes``
    reads from the live optimizer).

    * adamw (torch, and BF16StochasticAdamW): exp_avg and exp_avg_sq in the weights' dtype, plus a 4-byte fp32
      ``step`` per tensor: 8 B/param in fp32, 4 B under bf16-pure.
    * adamw_8bit / paged_adamw_8bit (bitsandbytes): tensors below ``BNB_MIN_8BIT_SIZE`` elements keep two fp32
      states (8 B/param); the others two uint8 states (2 B/param) and one fp32 absmax per ``BNB_BLOCK`` elements
      each; plus the two shared quantile maps once.
    * adafactor (transformers, no first moment as nbtrain builds it): a matrix keeps its second moment factored,
      one fp32 value per row and per column (``shape[:-1]`` and ``shape[-1:]``); a vector keeps it whole, fp32.
      Always fp32: it upcasts 16-bit gradients. Its ``RMS`` of each weight is a 0-d fp32 tensor, ``step`` an int.
    * sgd (momentum): one buffer in the weights' dtype (4 B/param, 2 under bf16-pure).
    """
    if optimizer == "adamw":
        return sum(2 * param_bytes * math.prod(s) + STEP_BYTES for s in shapes)
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        total, quantized = 0, False
        for s in shapes:
            n = math.prod(s)
            if n < BNB_MIN_8BIT_SIZE:
                total += 8 * n
            else:
                quantized = True
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
        return total + (2 * BNB_QMAP_BYTES if quantized else 0)
    if optimizer == "adafactor":
        return sum((4 * (math.prod(s[:-1]) + s[-1]) if len(s) >= 2 else 4 * math.prod(s)) + ADAFACTOR_RMS_BYTES
                   for s in shapes)
    if optimizer == "sgd":
        return sum(param_bytes * math.prod(s) for s in shapes)
    raise ValueError(f"optimizer: no memory model for {optimizer!r}")


def parameter_bytes(cfg: TrainConfig, arch: Architecture, num_labels: int = NUM_LABELS,
                    precision: str = "fp32") -> ParameterBytes:
    """Weights, gradients and optimizer state of ``cfg``'s method and optimizer on ``arch`` under ``precision``,
    exactly.

    Weights take ``param_bytes`` per parameter (adapters included): 4 (fp32), or 2 under precision="bf16-pure",
    whose weights are bf16 (``PrecisionSpec.param_dtype``); except QLoRA's quantised Linear weights (every
    Linear of the decoder): 4-bit nf4 (``nf4_bytes``), or 8-bit: one int8 per element plus a 4-byte scale per
    row. Under the autocast precisions (fp16, bf16, fp8) the fp32 trainable weights are the master copy
    (``master_weights``, a share of ``weights``, not added to it): the forward reads 16-bit (or fp8) casts of them.
    Gradients take ``param_bytes`` per trainable parameter; the optimizer state is ``optimizer_state_bytes``.
    """
    spec = PRECISION_TABLE.get(precision, PRECISION_TABLE["fp32"])
    pb = spec.param_dtype.itemsize
    adapted: dict[str, int] = {}
    if cfg.method == "full":
        trainable = total = arch.total_params
        shapes = arch.shapes or tuple((n,) for _, n, _ in arch.params)
        adapter_params = 0
    else:
        targets = cfg.lora_targets if isinstance(cfg.lora_targets, str) else tuple(cfg.lora_targets)
        lora = adapters(cfg.model, cfg.task, num_labels, cfg.lora_r, targets)
        adapted, shapes = lora.adapted, lora.shapes
        # heads under modules_to_save are copies: they add to the total
        adapter_params = sum(lora.adapted.values()) + sum(lora.others.values())
        trainable = adapter_params
        total = arch.total_params + adapter_params
    unquantized: frozenset[str] = frozenset()
    if cfg.method == "qlora":
        unquantized = unquantized_linears(cfg.model, cfg.task, num_labels, arch)
        linear_by_weight = {f"{lin.name}.weight": lin for lin in arch.linears}
        weights = pb * adapter_params
        for name, n, _ in arch.params:
            lin = linear_by_weight.get(name)
            if lin is None or lin.name in unquantized:
                weights += pb * n
            elif cfg.quant_bits == 4:
                weights += nf4_bytes(n)
            else:
                weights += n + 4 * lin.n_out
    else:
        weights = pb * total
    master = 4 * trainable if spec.autocast_dtype is not None and pb == 4 else 0
    return ParameterBytes(weights=weights, gradients=pb * trainable,
                          optimizer=optimizer_state_bytes(cfg.optimizer, shapes, pb), trainable=trainable,
                          total=total, adapted=adapted, unquantized=unquantized, master_weights=master,
                          param_bytes=pb, optimizer_name=cfg.optimizer)
