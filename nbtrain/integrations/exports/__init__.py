"""Exports of a TrainConfig to the tools people run in production, and imports back. One module per format:

- ``training_args``: ``to_training_arguments(cfg)``, a ``transformers.TrainingArguments`` for the same run, with
  ``.peft_config`` (a ``peft.LoraConfig``) and ``.quantization_config`` (a ``BitsAndBytesConfig``) attached
  as attributes (None when the method does not use them); ``peft_and_quant_configs(cfg)`` returns the same
  pair; ``training_arguments_kwargs(cfg)`` the plain keywords.
- ``llamafactory``: ``to_llamafactory_yaml`` / ``read_llamafactory_yaml`` / ``from_llamafactory_yaml``
- ``autotrain``: ``to_autotrain_yaml`` / ``read_autotrain_yaml`` / ``from_autotrain_yaml``
- ``trl_sft``: ``sft_config_kwargs(cfg)``, the keywords of TRL's ``SFTConfig`` (TrainingArguments' plus
  ``max_length``, ``packing``, ``completion_only_loss``, ``assistant_only_loss``); ``sft_config`` adds notes.
- ``accelerate_config``: ``to_accelerate_config_yaml``, an ``accelerate launch --config_file`` for several
  processes.
- ``mapping``: what they share (tool names for nbtrain's optimizers and schedules, notes, YAML text, the reader).

The precision of every tensor: each format writes ``cfg.optimizer`` by its transformers name
(``mapping.OPTIM_NAMES``: adamw_torch (fused on CUDA in TrainingArguments), adamw_bnb_8bit, paged_adamw_8bit,
adafactor, sgd with optim_args "momentum=0.9" where the format has optim_args) and reads those names (and
transformers' aliases, ``OPTIM_IN``) back. bf16-pure is LLaMA-Factory's ``pure_bf16``, fp8 its ``fp8`` with
``fp8_backend: torchao`` and accelerate's ``mixed_precision: fp8`` with ``fp8_config: {backend: AO}``;
TrainingArguments has neither (bf16=False and a note), AutoTrain neither (mixed_precision bf16 and a note).
stochastic_rounding has a key in none of them: every export names it in its notes.

Instruction / chat data (``mapping.chat_format``: a named ``data_format``, or under ``"auto"`` what a run detects:
nbtrain's builtin chat set, or a local file's first row and its folder's ``dataset_info.json``; a dataset id under
``"auto"`` exports as plain text, with a note, since an export does not load it) exports as
LLaMA-Factory's ``stage: sft`` (with its ``dataset_info.json`` entry), AutoTrain's ``llm-sft`` and TRL's
SFTConfig. nbtrain's samples (``sample_prompts``, ``sample_every``, ``max_new_tokens``) have no equivalent in
any of them: each export names them in its notes.

Preference tuning (issue 38: objective dpo / orpo / simpo, ``mapping.pref_format`` for the data's layout) exports as
LLaMA-Factory's ``stage: dpo`` with ``pref_loss`` (sigmoid / orpo / simpo), ``pref_beta`` (ORPO's lambda there too),
``simpo_gamma`` and a ranking ``dataset_info.json`` entry (``"ranking": true``; TRL's prompt/chosen/rejected as
alpaca rows with ``query: null``); AutoTrain's ``llm-dpo`` (``dpo_beta``) and ``llm-orpo`` with the column mapping
``prompt_text_column`` / ``text_column`` (chosen) / ``rejected_text_column`` (SimPO has no AutoTrain task: refused);
and TRL's ``DPOConfig`` (``nbtrain export --to trl-dpo``; ORPO and SimPO as TRL's experimental ORPOConfig and
CPOConfig, named in the output). All three read back (``pref_fields_from_trl`` for TRL's keywords). What a format
cannot say (precompute_ref outside TRL, ORPO's lambda in AutoTrain, TRL's fixed column names, how each tool cuts long
rows) is in the notes; TrainingArguments and trl-sft have no preference loss (a note, and a refusal).

Online RL (objective grpo) exports as TRL's ``GRPOConfig`` only (``nbtrain export --to trl-grpo``, ``trl_grpo``):
num_generations, max_completion_length, temperature, top_p, epsilon, beta, loss_type, num_iterations and
reward_weights, with the rewards by name (``reward_funcs``; ``nbtrain.engine.rewards.parse_rewards`` makes them
functions). What GRPOConfig cannot carry (a sampler precision of its own, the sampler/trainer correction and its
records outside vLLM, functions that cannot be imported) is in the notes. LLaMA-Factory, AutoTrain, trl-sft and
trl-dpo have no GRPO: refused, pointing at trl-grpo.

Sharding (issue 28): sharding="fsdp" is TrainingArguments' (and so TRL's) ``fsdp`` + ``fsdp_config`` (FSDP2,
reshard_after_forward, each decoder layer wrapped, sharded checkpoints), the same keys in LLaMA-Factory's YAML
(read back, FSDP1 and offload / hybrid options named in the warning), and accelerate's ``distributed_type: FSDP``
with its ``fsdp_config``; AutoTrain has no FSDP (ddp, with a note; its deepspeed reads back as an error naming it).

Each export also returns (``*_config``) or writes (as YAML comments) its *notes*: the fields the other tool
cannot express or runs differently. The model: a pretrained preset is named by its Hub id
(``smollm2-135m-instruct``: ``HuggingFaceTB/SmolLM2-135M-Instruct``, and LLaMA-Factory's ``smollm2`` template under
``chat_template="auto"``), with a note that nbtrain trained its GGUF weights dequantized; a ``.gguf`` path stays a
path, with a note that the tool does not train from GGUF (``mapping.export_model``). Imports map every key they know; a key (or a value) with no nbtrain
equivalent is never dropped silently: ``read_*`` returns it in ``unmapped`` and ``from_*`` names it in a
``UserWarning``. A key that is missing takes the *tool's* default (what that tool would have run), not
nbtrain's.

The schedule is the same everywhere: nbtrain, the Trainer and the YAML tools build it with
``transformers.get_scheduler`` (``constant`` with warm-up is Hugging Face's ``constant_with_warmup``).
One difference stays: nbtrain decays every trainable parameter, the Trainer exempts biases and norm
weights (identical when ``weight_decay=0``, the default); for nbtrain's exact optimizer in a Trainer, pass
``Trainer(optimizers=nbtrain_optimizer_and_scheduler(cfg, model, total_steps))``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ...config import TrainConfig
from .accelerate_config import (
    ACCELERATE_FSDP_ENV,
    accelerate_config,
    accelerate_config_notes,
    to_accelerate_config_yaml,
)
from .autotrain import (
    AUTOTRAIN_FIELDS,
    autotrain_config,
    from_autotrain_yaml,
    read_autotrain_yaml,
    to_autotrain_yaml,
)
from .llamafactory import (
    LLAMAFACTORY_FIELDS,
    from_llamafactory_yaml,
    llamafactory_config,
    llamafactory_dataset_info,
    read_llamafactory_yaml,
    to_llamafactory_yaml,
)
from .mapping import (
    CHAT_BUILTINS,
    NBTRAIN_ONLY,
    OPTIM_IN,
    OPTIM_NAMES,
    PREF_FIELDS,
    SAMPLE_FIELDS,
    chat_format,
    export_model,
    hf_scheduler,
    pref_format,
    write_text,
)
from .training_args import (
    nbtrain_optimizer_and_scheduler,
    peft_and_quant_configs,
    to_training_arguments,
    training_arguments_kwargs,
    training_arguments_notes,
)
from .trl_dpo import (
    TRL_PREF_CLASSES,
    TRL_PREF_FIELDS,
    dpo_config,
    dpo_config_kwargs,
    pref_fields_from_trl,
    trl_pref_class,
)
from .trl_grpo import (
    TRL_GRPO_CLASS,
    TRL_GRPO_FIELDS,
    check_not_grpo,
    grpo_config,
    grpo_config_kwargs,
    grpo_reward_funcs,
)
from .trl_sft import TRL_SFT_FIELDS, sft_config, sft_config_kwargs

# the names ``export_text`` (and ``nbtrain export --to``) take for every config
EXPORT_FORMATS = ("training-args", "trl-sft", "llamafactory", "autotrain", "accelerate-config")
# the names that export preference tuning only (objective dpo / orpo / simpo; "lm" is refused there)
PREF_EXPORT_FORMATS = ("trl-dpo",)
# the names that export online RL only (objective grpo; every other objective is refused there)
GRPO_EXPORT_FORMATS = ("trl-grpo",)

__all__ = ["ACCELERATE_FSDP_ENV", "AUTOTRAIN_FIELDS", "CHAT_BUILTINS", "EXPORT_FORMATS", "GRPO_EXPORT_FORMATS",
           "LLAMAFACTORY_FIELDS", "NBTRAIN_ONLY", "OPTIM_IN", "OPTIM_NAMES", "PREF_EXPORT_FORMATS", "PREF_FIELDS",
           "SAMPLE_FIELDS", "TRL_PREF_CLASSES", "TRL_GRPO_CLASS", "TRL_GRPO_FIELDS", "TRL_PREF_FIELDS",
           "TRL_SFT_FIELDS", "accelerate_config", "accelerate_config_notes", "autotrain_config", "chat_format",
           "check_not_grpo", "dpo_config", "dpo_config_json", "dpo_config_kwargs", "export_text",
           "from_autotrain_yaml", "from_llamafactory_yaml", "grpo_config", "grpo_config_json", "grpo_config_kwargs",
           "grpo_reward_funcs", "hf_scheduler", "llamafactory_config", "llamafactory_dataset_info",
           "nbtrain_optimizer_and_scheduler", "peft_and_quant_configs", "pref_fields_from_trl", "pref_format",
           "read_autotrain_yaml", "read_llamafactory_yaml", "sft_config", "sft_config_json", "sft_config_kwargs",
           "to_accelerate_config_yaml", "to_autotrain_yaml", "to_llamafactory_yaml", "to_training_arguments",
           "training_arguments_json", "training_arguments_kwargs", "training_arguments_notes", "trl_pref_class"]


def training_arguments_json(cfg: TrainConfig) -> dict[str, Any]:
    """The TrainingArguments keywords, plus ``peft_config`` / ``quantization_config`` when the method uses
    them and ``notes`` (``training_arguments_notes``) when there are any, as JSON-friendly dicts."""
    lcfg, qcfg = peft_and_quant_configs(cfg)
    out: dict[str, Any] = {"training_arguments": training_arguments_kwargs(cfg)}
    model_name, model_notes = export_model(cfg, "from_pretrained")
    if model_notes:   # a preset with a Hub twin, or a GGUF file: the model to load beside the arguments
        out["model_name_or_path"] = model_name
    if lcfg is not None:
        out["peft_config"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in lcfg.to_dict().items()}
    if qcfg is not None:
        out["quantization_config"] = qcfg.to_dict()
    notes = training_arguments_notes(cfg)
    if notes:
        out["notes"] = notes
    return out


def sft_config_json(cfg: TrainConfig) -> dict[str, Any]:
    """TRL's SFTConfig keywords, plus ``peft_config`` / ``quantization_config`` when the method uses them and
    the ``notes``, as JSON-friendly dicts (``trl.SFTConfig(**out["sft_config"])``); objective="grpo" is refused."""
    check_not_grpo(cfg, "trl-sft")
    out = training_arguments_json(cfg)
    kw, notes = sft_config(cfg)
    out.pop("training_arguments")
    out.pop("notes", None)   # sft_config's notes include them
    return {"sft_config": kw, **out, "notes": notes}


def dpo_config_json(cfg: TrainConfig) -> dict[str, Any]:
    """TRL's preference config for ``cfg.objective`` (``trl_pref_class``): ``config_class`` and ``trainer_class``
    (trl.DPOConfig / trl.DPOTrainer for dpo; TRL's experimental ORPOConfig for orpo and CPOConfig for simpo), its
    keywords under ``dpo_config`` / ``orpo_config`` / ``cpo_config``, ``peft_config`` / ``quantization_config`` when
    the method uses them, and the ``notes``; objective="grpo" is refused."""
    check_not_grpo(cfg, "trl-dpo")
    cls, trainer, key = trl_pref_class(cfg)
    out = training_arguments_json(cfg)
    kw, notes = dpo_config(cfg)
    out.pop("training_arguments")
    out.pop("notes", None)   # dpo_config's notes include them
    return {"config_class": cls, "trainer_class": trainer, key: kw, **out, "notes": notes}


def grpo_config_json(cfg: TrainConfig) -> dict[str, Any]:
    """TRL's GRPOConfig for objective="grpo": ``config_class`` / ``trainer_class`` (trl.GRPOConfig /
    trl.GRPOTrainer), its keywords under ``grpo_config``, the rewards by name under ``reward_funcs`` (GRPOTrainer's
    argument; see the notes for making them functions), ``peft_config`` / ``quantization_config`` when the method
    uses them, and the ``notes``. Another objective is a ConfigError naming its export."""
    cls, trainer, key = TRL_GRPO_CLASS
    kw, notes = grpo_config(cfg)
    out = training_arguments_json(cfg)
    out.pop("training_arguments")
    out.pop("notes", None)   # grpo_config's notes include them
    return {"config_class": cls, "trainer_class": trainer, key: kw, "reward_funcs": grpo_reward_funcs(cfg), **out,
            "notes": notes}


def export_text(cfg: TrainConfig, to: str, path: Optional[str | os.PathLike] = None) -> str:
    """The text of one export by name (the ``nbtrain export`` command): training-args (JSON of the
    TrainingArguments keywords, plus peft_config / quantization_config), trl-sft (the same for TRL's SFTConfig,
    with notes), trl-dpo (TRL's DPOConfig, or ORPOConfig / CPOConfig for orpo / simpo: ``dpo_config_json``),
    trl-grpo (TRL's GRPOConfig for objective grpo: ``grpo_config_json``), llamafactory, autotrain,
    accelerate-config. Written to ``path`` when given."""
    if to == "training-args":
        return write_text(json.dumps(training_arguments_json(cfg), indent=2, default=str) + "\n", path)
    if to == "trl-sft":
        return write_text(json.dumps(sft_config_json(cfg), indent=2, default=str) + "\n", path)
    if to == "trl-dpo":
        return write_text(json.dumps(dpo_config_json(cfg), indent=2, default=str) + "\n", path)
    if to == "trl-grpo":
        return write_text(json.dumps(grpo_config_json(cfg), indent=2, default=str) + "\n", path)
    if to == "llamafactory":
        return to_llamafactory_yaml(cfg, path)
    if to == "autotrain":
        return to_autotrain_yaml(cfg, path)
    if to == "accelerate-config":
        return to_accelerate_config_yaml(cfg, path)
    names = EXPORT_FORMATS + PREF_EXPORT_FORMATS + GRPO_EXPORT_FORMATS
    raise ValueError(f"--to: {to!r}; choose {', '.join(names[:-1])} or {names[-1]}")
