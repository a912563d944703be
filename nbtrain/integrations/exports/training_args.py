"""``transformers.TrainingArguments`` for a TrainConfig, with the LoRA and bitsandbytes configs nbtrain builds.

The Trainer reads neither ``peft_config`` nor ``quantization_config``: pass them to ``from_pretrained`` /
``get_peft_model`` (or to TRL's ``SFTTrainer(peft_config=...)``). The schedule is the same on both sides
(``transformers.get_scheduler``); the Trainer's AdamW exempts biases and norm weights from weight decay,
nbtrain's decays every trainable parameter (identical when ``weight_decay=0``, the default). For nbtrain's
exact optimizer in a Trainer, pass ``Trainer(optimizers=nbtrain_optimizer_and_scheduler(cfg, model, total_steps))``.
``report_to`` maps name for name (the Trainer's own integrations); the Trainer's TensorBoard writes to
``output_dir/runs/<time>_<host>`` (or ``TENSORBOARD_LOGGING_DIR``), nbtrain's to ``output_dir/tensorboard``.

The optimizer is ``optim`` (``mapping.OPTIM_NAMES``; adamw is ``adamw_torch_fused`` on CUDA, as nbtrain fuses it
there; sgd adds ``optim_args="momentum=0.9"``). What TrainingArguments cannot say is in
``training_arguments_notes(cfg)`` (and the training-args export's ``notes``): precision="bf16-pure" is bf16=False
with the model loaded in bf16; precision="fp8" is bf16=False under ``accelerate launch`` with the accelerate-config
export (mixed_precision fp8, torchao); stochastic_rounding has no optim name (``nbtrain_optimizer_and_scheduler``
refuses it: build nbtrain's ``BF16StochasticAdamW`` by hand).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..._logs import deferred_bitsandbytes, defers_bitsandbytes

with deferred_bitsandbytes():   # transformers.training_args imports peft, and peft bitsandbytes: left unrun
    from transformers import TrainingArguments, get_scheduler

from ...config import TrainConfig
from ...hardware import default_device, resolve_precision
from ...models.loading import ModelError, head_module_names, meta_model
from ...models.methods import bnb_config, lora_config
from .mapping import (
    OPTIM_NAMES,
    export_model,
    SGD_MOMENTUM,
    SGD_OPTIM_ARGS,
    fsdp_layer_class,
    fsdp_notes,
    hf_fsdp_config,
    hf_fsdp_option,
    hf_scheduler,
    reshard_note,
)


def _checkpointing_arg(args_cls: Any = None) -> str:
    # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing (5.24 takes both, the old one
    # deprecated; 5.17 only the old one): the new name where this install's TrainingArguments has it
    names = set(getattr(args_cls or TrainingArguments, "__dataclass_fields__", {}))
    return "gradient_checkpointing" if "activation_checkpointing" not in names and "gradient_checkpointing" in names \
        else "activation_checkpointing"


def _fsdp_arg(cfg: TrainConfig, args_cls: Any = None):
    # transformers 5.2x takes fsdp=True and reads everything from fsdp_config (the option string is deprecated
    # there); older versions take the option string ("full_shard auto_wrap"), which this install's does not want
    cls = args_cls or TrainingArguments
    return True if hasattr(cls, "_apply_legacy_fsdp_to_config") else hf_fsdp_option(cfg)


def training_arguments_kwargs(cfg: TrainConfig, output_dir: Optional[str] = None,
                              **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of ``to_training_arguments`` (plain values, JSON-friendly)."""
    device = default_device()
    precision = resolve_precision(cfg.precision)
    kw: dict[str, Any] = dict(
        output_dir=output_dir or cfg.output_dir or "runs/hf",
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.micro_batch_size,   # nbtrain evaluates in micro batches too
        gradient_accumulation_steps=cfg.grad_accum_steps,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        # nbtrain: fused AdamW on CUDA; the other optimizers by their transformers names
        optim=("adamw_torch_fused" if device == "cuda" else "adamw_torch") if cfg.optimizer == "adamw"
        else OPTIM_NAMES[cfg.optimizer],
        lr_scheduler_type=hf_scheduler(cfg),
        warmup_steps=cfg.warmup_steps,
        # 0 disables clipping; transformers 5 still measures and logs grad_norm, as nbtrain does
        max_grad_norm=cfg.max_grad_norm or 0.0,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1,
        seed=cfg.seed,
        # the Trainer's data_seed orders the batches as nbtrain's does (None: the seed); nbtrain's also draws the
        # eval split, which the Trainer takes as given
        data_seed=cfg.data_seed,
        logging_strategy="steps",
        logging_steps=cfg.log_every,
        # a nan/inf loss must show as such (DESIGN rule 5); the Trainer's default hides it behind an average
        logging_nan_inf_filter=False,
        eval_strategy="steps" if cfg.eval_every else "no",
        save_strategy="steps" if cfg.save_every else "no",
        # nbtrain's report_to names are the Trainer's integration names; [] (none) is its "none"
        report_to=list(cfg.report_to) or "none",
    )
    if "trackio" in cfg.report_to and "project" in getattr(TrainingArguments, "__dataclass_fields__", {}):
        kw["project"] = "nbtrain"   # the trackio project nbtrain's own runs log to (the Trainer's: "huggingface")
    ckpt = _checkpointing_arg()
    kw[ckpt] = cfg.gradient_checkpointing
    if cfg.epochs is not None:
        kw["num_train_epochs"] = cfg.epochs   # the Trainer, like nbtrain, lets max_steps win when both are set
    if cfg.eval_every:
        kw["eval_steps"] = cfg.eval_every
    if cfg.save_every:
        kw["save_steps"] = cfg.save_every
    if cfg.sharding == "fsdp":
        kw["fsdp"] = _fsdp_arg(cfg)
        kw["fsdp_config"] = hf_fsdp_config(cfg, fsdp_layer_class(cfg))
        if cfg.gradient_checkpointing:
            # under FSDP the Trainer's own flag re-gathers each layer in backward a second time (transformers says
            # prefer FSDP's; transformers 4 refuses both at once): FSDP's checkpoint wrapper on each layer instead
            kw[ckpt] = False
            kw["fsdp_config"]["activation_checkpointing"] = True
    if cfg.gradient_checkpointing and kw[ckpt]:
        kw[f"{ckpt}_kwargs"] = {"use_reentrant": False}   # nbtrain's checkpointing style
    if cfg.optimizer == "sgd":
        kw["optim_args"] = SGD_OPTIM_ARGS   # the Trainer's SGD has no momentum unless told; nbtrain's has 0.9
    if precision in ("fp16", "bf16", "tf32"):
        kw[precision] = True
    elif precision in ("bf16-pure", "fp8"):
        # no autocast flag: bf16-pure loads bf16 weights instead; fp8 takes accelerate launch's mixed_precision fp8,
        # which bf16=True would override (the notes say both)
        kw["bf16"] = False
    if device == "cpu":
        kw["use_cpu"] = True
    if cfg.task == "image-classification":
        # the image column is turned into pixel_values by a transform, after the Trainer's column pruning
        kw["remove_unused_columns"] = False
    kw.update(overrides)
    return kw


def training_arguments_notes(cfg: TrainConfig) -> dict[str, str]:
    """What the TrainingArguments of ``cfg`` cannot say, or say differently: {field: note}."""
    notes: dict[str, str] = {}
    model_name, model_notes = export_model(cfg, "from_pretrained")
    if model_notes:   # TrainingArguments names no model: the note says which one to load
        notes["model"] = f"load {model_name!r}: " + model_notes["model"]
    precision = resolve_precision(cfg.precision)
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if precision == "bf16-pure":
        notes["precision"] = ("precision='bf16-pure' has no TrainingArguments flag: bf16=False (no autocast), and load "
                              "the model in bf16, from_pretrained(..., dtype=torch.bfloat16) (torch_dtype= in "
                              "transformers 4), so weights, gradients and the optimizer state are bf16 with no fp32 "
                              "master (LLaMA-Factory's pure_bf16)"
                              + ("; with LoRA, get_peft_model(..., autocast_adapter_dtype=False) keeps the adapters "
                                 "bf16 (peft upcasts them to fp32 by default)" if cfg.method != "full" else ""))
    elif precision == "fp8":
        notes["precision"] = ("precision='fp8' has no TrainingArguments flag: bf16=False here, and launch the Trainer "
                              "with accelerate launch --config_file <nbtrain export --to accelerate-config> "
                              "(mixed_precision fp8, fp8_config backend AO: torchao float8 linears, bf16 autocast "
                              "elsewhere); bf16=True would override the launcher's fp8")
    notes.update(fsdp_notes(cfg, fsdp_layer_class(cfg) if cfg.sharding == "fsdp" else None, "the Trainer"))
    if cfg.sharding == "fsdp" and cfg.gradient_checkpointing:
        notes["gradient_checkpointing"] = ("gradient_checkpointing=True under FSDP is fsdp_config "
                                           "activation_checkpointing (FSDP's checkpoint wrapper on each layer), with "
                                           "the Trainer's own flag off")
    notes.update(reshard_note(cfg))
    if cfg.objective == "grpo":
        # keyed by the field: the Trainer neither samples completions nor scores them
        notes["objective"] = ("objective='grpo' has no TrainingArguments key: the Trainer trains the next-token loss "
                              "on fixed data; the rewards, num_generations and the GRPO loss are not written. Use "
                              "TRL's GRPOTrainer: nbtrain export --to trl-grpo")
    elif cfg.objective != "lm":
        # keyed by the field: none of the preference fields is in these arguments
        notes["objective"] = (f"objective={cfg.objective!r} has no TrainingArguments key: the Trainer trains the "
                              "next-token loss; pref_beta, simpo_gamma and precompute_ref are not written. Use TRL's "
                              "preference trainers: nbtrain export --to trl-dpo")
    if cfg.stochastic_rounding:
        notes["stochastic_rounding"] = (
            "stochastic_rounding=True has no optim name: the Trainer's AdamW on bf16 weights rounds to nearest "
            "(transformers' adamw_torch_8bit with optim_args bf16_stochastic_round=True rounds stochastically but "
            "keeps 8-bit states); pass Trainer(optimizers=(BF16StochasticAdamW(params, lr, weight_decay=..., "
            "seed=...), scheduler)) from nbtrain.engine.optimizers")
    return notes


@defers_bitsandbytes
def to_training_arguments(cfg: TrainConfig, output_dir: Optional[str] = None, **overrides: Any):
    """A ``transformers.TrainingArguments`` for ``cfg``; ``overrides`` are passed on as-is.

    Attributes ``peft_config`` and ``quantization_config`` carry the LoRA / bitsandbytes configs (None
    when unused), ``notes`` what the arguments cannot say (``training_arguments_notes``). ``precision="auto"`` is resolved for this machine; the weight-decay difference is in
    the module docstring. fp16 on a CPU: accelerate makes no GradScaler there, unlike nbtrain's loop, so
    only CUDA runs compare on fp16.
    """
    args = TrainingArguments(**training_arguments_kwargs(cfg, output_dir, **overrides))
    args.peft_config, args.quantization_config = peft_and_quant_configs(cfg)
    args.notes = training_arguments_notes(cfg)
    return args


def peft_and_quant_configs(cfg: TrainConfig):
    """``(peft.LoraConfig or None, transformers.BitsAndBytesConfig or None)`` exactly as nbtrain builds them."""
    if cfg.method == "full":
        return None, None
    try:   # the architecture (no weights) lets nbtrain check target names and find a classifier's head
        arch = meta_model(cfg.model, cfg.task)
    except ModelError:
        arch = None
    if arch is not None:
        lcfg = lora_config(cfg, arch, cfg.task)
    else:   # a Hub model that is not cached: the same config, unchecked; peft finds the classifier head itself
        from peft import LoraConfig, TaskType  # peft loads only for an export that needs it

        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                          target_modules=cfg.lora_targets if isinstance(cfg.lora_targets, str)
                          else list(cfg.lora_targets),
                          task_type={"sequence-classification": TaskType.SEQ_CLS,
                                     "image-classification": None}.get(cfg.task, TaskType.CAUSAL_LM))
    qcfg = None
    if cfg.method == "qlora":
        # a classifier's head stays unquantised (it is trained in full), for text and images alike
        skip = (head_module_names(arch) if arch is not None
                and cfg.task in ("sequence-classification", "image-classification") else None)
        qcfg = bnb_config(cfg, resolve_precision(cfg.precision), skip)
    return lcfg, qcfg


def nbtrain_optimizer_and_scheduler(cfg: TrainConfig, model, total_steps: int):
    """nbtrain's optimizer (``cfg.optimizer``, built as nbtrain builds it: weight decay on every trainable
    parameter, AdamW fused on CUDA, SGD with momentum 0.9, Adafactor at the run's lr) and its schedule
    (``transformers.get_scheduler``, as the Trainer builds it), for ``Trainer(optimizers=...)`` when the Trainer
    must run nbtrain's optimizer exactly. stochastic_rounding is refused (the exports import nothing from nbtrain's
    engine): pass nbtrain.engine.optimizers.BF16StochasticAdamW yourself."""
    if cfg.stochastic_rounding:
        raise ValueError("stochastic_rounding: build nbtrain's optimizer with nbtrain.engine.optimizers."
                         "BF16StochasticAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed) and "
                         "pass it with transformers.get_scheduler to Trainer(optimizers=...)")
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        fused = bool(params) and params[0].device.type == "cuda"
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    elif cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, scale_parameter=False, relative_step=False,
                        warmup_init=False)
    else:   # bitsandbytes' 8-bit AdamW (paged or not) with torch's defaults, as nbtrain builds it
        from ..._logs import import_bitsandbytes

        bnb = import_bitsandbytes()
        cls = bnb.optim.PagedAdamW8bit if cfg.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        opt = cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, get_scheduler(hf_scheduler(cfg), opt, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=total_steps)
