"""The three methods as small builders: full fine-tuning, LoRA, and QLoRA (LoRA on a 4/8-bit base).

``build_model`` picks one from ``cfg.method``. Whatever the method, the weights that train are fp32:
the low precision comes from ``torch.autocast`` in the loop, and fp16 *weights* would make the
GradScaler refuse to unscale their gradients.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from .._logs import bitsandbytes_loaded, import_bitsandbytes
from ..precision import active_autocast_dtype
from .loading import CAUSAL_LM, CLASSIFIERS, IMG_CLS, SEQ_CLS, ModelError, head_module_names, \
    linear_module_names, load_base_model

# the dtype bitsandbytes computes its 4-bit matmuls in, per resolved precision: it follows the
# autocast dtype so the quantised layers do not silently run in another precision than the rest
COMPUTE_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp8": torch.bfloat16}

_CHECKPOINT_KWARGS = {"use_reentrant": False}


def bnb_config(cfg, precision: str, skip_modules: list[str] | None = None):
    """The ``BitsAndBytesConfig`` for QLoRA: nf4 with double quantisation (4 bits) or LLM.int8 (8)."""
    from transformers import BitsAndBytesConfig

    if precision not in COMPUTE_DTYPE:
        raise ModelError(f"precision: expected a resolved precision {sorted(COMPUTE_DTYPE)}, got "
                         f"{precision!r}")
    if cfg.quant_bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=COMPUTE_DTYPE[precision],
                                  llm_int8_skip_modules=skip_modules)
    if cfg.quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    raise ModelError(f"quant_bits: must be 4 or 8, got {cfg.quant_bits!r}")


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (non-reentrant, so the loss and gradients are unchanged)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelError(f"gradient_checkpointing: {type(model).__name__} does not support it; set "
                         "gradient_checkpointing=False")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(_CHECKPOINT_KWARGS))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(_CHECKPOINT_KWARGS))


def apply_full(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Full fine-tuning: every parameter trains."""
    for p in model.parameters():
        p.requires_grad_(True)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    return model


def lora_config(cfg, model: torch.nn.Module, task: str):
    """The peft ``LoraConfig`` for ``cfg``; explicit target names are checked against ``model``.

    An image classifier gets no peft task type (peft has none for it; the plain ``PeftModel`` passes
    ``pixel_values`` through); its head trains whole like a text classifier's. ``all-linear`` adapts every Linear
    of the encoder (a ViT's query, key, value and dense layers), ``["query", "value"]`` only the attention's."""
    from peft import LoraConfig, TaskType

    heads = head_module_names(model) if task in CLASSIFIERS else []
    if isinstance(cfg.lora_targets, str):
        targets: str | list[str] = "all-linear"
    else:
        valid = linear_module_names(model) - set(heads)
        unknown = [t for t in cfg.lora_targets if t not in valid]
        if unknown:
            raise ModelError(f"lora_targets: {unknown} are not Linear modules of {cfg.model!r}; valid "
                             f"names are {sorted(valid)} (or 'all-linear')")
        targets = list(cfg.lora_targets)
    return LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
        target_modules=targets,
        # the classification head is new: it trains whole and is saved with the adapter
        exclude_modules=heads or None, modules_to_save=heads or None,
        task_type={SEQ_CLS: TaskType.SEQ_CLS, IMG_CLS: None}.get(task, TaskType.CAUSAL_LM),
    )


def new_token_ids(cfg, tokenizer, model: torch.nn.Module) -> list[int]:
    """The ids of the tokens this run added to the tokenizer (a chat template's markers,
    ``nbtrain.data.chat.ensure_chat_tokens``): those at or past the length of a fresh tokenizer for ``cfg.model``,
    and inside the model's embedding table. ``[]`` when none were added (plain text, or a tokenizer that already had
    the template's tokens, as Qwen's has ChatML's)."""
    if tokenizer is None or not hasattr(tokenizer, "__len__") or not hasattr(model, "get_input_embeddings"):
        return []
    emb = model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None)
    if rows is None:
        return []
    from .loading import load_tokenizer

    # The tokenizer as it loads, before the run added anything: cheap (the preset's is cached per process, a
    # checkpoint's was just read from its directory or the cache).
    base_len = len(load_tokenizer(cfg))
    return list(range(base_len, min(len(tokenizer), rows)))


def _module_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def token_rows_target(model: torch.nn.Module, ids: list[int]) -> dict[str, list[int]] | None:
    """peft's ``trainable_token_indices`` for ``ids``: the input embedding and, when it is not tied to it, the output
    layer (a new token must be readable and writable: its input row and its output row both start untrained). A
    tied output layer follows the embedding (peft ties the two adapters)."""
    if not ids:
        return None
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = {_module_name(model, emb): list(ids)}
    tied = head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)
    if head is not None and not tied and isinstance(head, torch.nn.Linear):
        targets[_module_name(model, head)] = list(ids)
    if None in targets:
        return None
    return targets


def apply_lora(model: torch.nn.Module, cfg, task: str, new_ids: list[int] | None = None) -> torch.nn.Module:
    """LoRA adapters on the targets; the base is frozen (the head of a classifier trains).

    ``new_ids`` (a causal LM whose tokenizer gained tokens, see :func:`new_token_ids`): those rows of the input
    embedding and of an untied output layer train too (peft's ``trainable_token_indices``: only those rows, as a
    delta saved with the adapter); under plain LoRA they would stay at their initial values forever."""
    from peft import get_peft_model

    lcfg = lora_config(cfg, model, task)
    if new_ids and task == CAUSAL_LM:
        lcfg.trainable_token_indices = token_rows_target(model, new_ids)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
        # with a frozen embedding nothing before the first checkpointed block needs a gradient;
        # marking the embedding output keeps the recomputed blocks in the graph with any checkpoint style
        model.enable_input_require_grads()
    with quiet_peft(), _peft_without_bitsandbytes():
        return get_peft_model(model, lcfg)


@contextlib.contextmanager
def _peft_without_bitsandbytes():
    """peft's LoRA dispatch imports bitsandbytes whenever it is installed, to test each layer against its
    quantised classes. A model can hold such a layer only once bitsandbytes is imported (QLoRA imports it first),
    so until then peft is told it is absent: plain LoRA never imports it. peft's own cache is left alone; the lock
    keeps a concurrent QLoRA run's dispatch from seeing the patched answer."""
    with _PEFT_LOCK:
        try:
            from peft.tuners.lora import model as lora_model
        except ImportError:   # another peft layout: it imports what it imports
            lora_model = None
        if bitsandbytes_loaded() or lora_model is None:
            yield
            return
        names = [n for n in ("is_bnb_available", "is_bnb_4bit_available") if hasattr(lora_model, n)]
        saved = {n: getattr(lora_model, n) for n in names}
        for n in names:
            setattr(lora_model, n, _absent)
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(lora_model, n, f)


def _absent() -> bool:
    return False


_PEFT_LOCK = threading.RLock()


def method_notes(model: torch.nn.Module) -> list[str]:
    """What the method did that a user should read in the run notes: the new tokens' rows that train under LoRA."""
    pcfg = getattr(model, "peft_config", None)
    if not isinstance(pcfg, dict) or not pcfg:
        return []
    lcfg = pcfg.get(getattr(model, "active_adapter", None)) or next(iter(pcfg.values()))
    rows = getattr(lcfg, "trainable_token_indices", None)
    if not rows:
        return []
    if not isinstance(rows, dict):
        rows = {"input embedding": rows}
    ids = sorted({i for v in rows.values() for i in v})
    n = sum(p.numel() for name, p in model.named_parameters() if "trainable_tokens_delta" in name)
    where = " and ".join(rows)
    return [f"lora: the {len(ids)} token(s) added to the tokenizer (ids {ids[0]}-{ids[-1]}) train their rows of "
            f"{where} ({n:,} parameters; the other rows stay frozen): new tokens start "
            "untrained, and a frozen row could never learn them"]


@contextlib.contextmanager
def quiet_peft():
    """Hide peft's use of a transformers attribute deprecated in 5.x; the notice is not for users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def prepare_qlora(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """Freeze a quantised base and make it trainable through adapters (peft's k-bit preparation)."""
    from peft import prepare_model_for_kbit_training

    # checkpointing is left to apply_lora, the same way as for plain LoRA
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _quantized_input_hook(module, args, kwargs):
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        dt = active_autocast_dtype(x.device.type)
        if dt is not None and x.dtype != dt:
            return (x.to(dt), *args[1:]), kwargs
    return None


def autocast_quantized_inputs(model: torch.nn.Module) -> int:
    """Under autocast, hand each 4-bit layer its input in the autocast dtype, as autocast does for an
    ``nn.Linear``. bitsandbytes computes in its compute dtype (the autocast dtype here) but returns the
    input's dtype, so with the fp32 residual stream every activation after a 4-bit layer (the whole MLP, q/k/v)
    was fp32: QLoRA held twice LoRA's activation memory. The matmul itself is unchanged. Returns the count."""
    if not bitsandbytes_loaded():   # no 4-bit layer can exist before it is imported
        return 0
    from bitsandbytes.nn import Linear4bit
    n = 0
    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.register_forward_pre_hook(_quantized_input_hook, with_kwargs=True)
            n += 1
    return n


def _keep_cpu_4bit_layout(model: torch.nn.Module) -> None:
    # On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit layer the first time it runs in eval
    # mode without grad, keeping its scales and computing in bf16 from then on. Evaluation would then
    # silently run in another precision than training (and the config); keep the standard layout.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def cast_trainable_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Cast every trainable parameter that is not fp32 to fp32 (autocast does the low precision)."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def name_labels(model: torch.nn.Module, label_names) -> None:
    """Set ``config.id2label`` / ``label2id`` from the data's label names (id i is ``label_names[i]``),
    so that a saved classifier maps its outputs back to "neg" / "pos" instead of LABEL_0 / LABEL_1."""
    names = [str(n) for n in label_names]
    if len(names) != model.config.num_labels:
        raise ModelError(f"label_names: {len(names)} names for a head with {model.config.num_labels} labels")
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}


def build_model(cfg, tokenizer, num_labels: int | None, precision: str, device: str,
                label_names=None) -> torch.nn.Module:
    """The model for ``cfg`` on ``device``, in train mode, with ``cfg.method`` applied.

    ``precision`` is the resolved name (fp32, tf32, fp16, bf16); it sets the compute dtype of the
    4-bit layers under QLoRA. ``label_names`` (a classifier's, from ``DataBundle.label_names``) name
    the labels in the model config. Seed torch before calling: the initialisation of new weights (the
    whole ``tiny`` preset, a classification head) draws from the global RNG. The forward takes
    ``input_ids`` and ``attention_mask`` (an image classifier: ``pixel_values``) and returns ``.logits``; the
    caller computes the loss.
    """
    task = cfg.task
    if task not in (CAUSAL_LM, *CLASSIFIERS):
        raise ModelError(f"task: must be {CAUSAL_LM!r}, {SEQ_CLS!r} or {IMG_CLS!r}, got {task!r}")
    if cfg.method == "qlora":
        try:   # here, before transformers' quantizer imports it its own way (with the Hub kernel lookup)
            import_bitsandbytes()
        except Exception as e:   # not installed, or its native library does not load
            raise ModelError(f"method: 'qlora' needs bitsandbytes (pip install bitsandbytes), which does not load "
                             f"here: {type(e).__name__}: {e}; use method='lora'") from None
        skip = None
        if task in CLASSIFIERS:   # the new head stays unquantised (it trains whole)
            from .loading import meta_model

            skip = head_module_names(meta_model(cfg.model, task, num_labels, local_only=False))
        model = load_base_model(cfg, tokenizer, num_labels, device, bnb_config(cfg, precision, skip))
    elif cfg.method in ("full", "lora"):
        model = load_base_model(cfg, tokenizer, num_labels, device)
    else:
        raise ModelError(f"method: must be 'full', 'lora' or 'qlora', got {cfg.method!r}")

    if task == SEQ_CLS and model.config.pad_token_id is None:
        # the head reads the last non-pad token; without a pad id it refuses batches larger than 1
        model.config.pad_token_id = tokenizer.pad_token_id
    if task in CLASSIFIERS and label_names:
        name_labels(model, label_names)
    if task == CAUSAL_LM:
        # the loop never generates; a KV cache would only cost memory during training
        model.config.use_cache = False

    if cfg.method == "full":
        model = apply_full(model, cfg)
    elif cfg.method == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        new_ids = new_token_ids(cfg, tokenizer, model) if task == CAUSAL_LM else []
        model = apply_lora(model, cfg, task, new_ids)
    else:
        _keep_cpu_4bit_layout(model)
        autocast_quantized_inputs(model)
        new_ids = new_token_ids(cfg, tokenizer, model) if task == CAUSAL_LM else []
        model = prepare_qlora(model, cfg)
        model = apply_lora(model, cfg, task, new_ids)
    cast_trainable_fp32(model)
    return model.train()
