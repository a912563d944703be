"""TRL's preference configs for a TrainConfig (``nbtrain export --to trl-dpo``): ``dpo_config(cfg)``, the keywords of
the TRL config class that runs ``cfg.objective``, with notes, and ``pref_fields_from_trl`` reading them back.

Which class (``trl_pref_class``): objective="dpo" is ``trl.DPOConfig`` (``beta``, ``loss_type="sigmoid"``,
``precompute_ref_log_probs``) for ``trl.DPOTrainer``. DPOConfig has no ORPO or SimPO loss, so those export as TRL's
experimental trainers' configs, named in the output and the notes: objective="orpo" is
``trl.experimental.orpo.ORPOConfig`` (``beta`` = λ, nbtrain's pref_beta) and objective="simpo" is
``trl.experimental.cpo.CPOConfig`` with ``loss_type="simpo"``, ``cpo_alpha=0.0`` (no NLL term: plain SimPO),
``beta`` and ``simpo_gamma``. objective="lm" is refused (``trl-sft`` exports it).

trl is not a dependency: nothing here imports it. The names are TRL's own (``trl/trainer/dpo_config.py``,
``trl/experimental/orpo/orpo_config.py``, ``trl/experimental/cpo/cpo_config.py``). Their defaults differ from
TrainingArguments' (bf16 on unless fp16, gradient checkpointing on, 10 logging steps, lr 1e-6) and from nbtrain
(dropout off: ``disable_dropout=True``), so every one of those is written explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

from ...config import ConfigError, TrainConfig
from ...hardware import resolve_precision
from .mapping import NBTRAIN_ONLY, non_default_notes, pref_format, pref_notes, sample_notes
from .training_args import training_arguments_kwargs, training_arguments_notes

# per objective: (the TRL config class, its trainer, the JSON key its keywords go under)
TRL_PREF_CLASSES = {
    "dpo": ("trl.DPOConfig", "trl.DPOTrainer", "dpo_config"),
    "orpo": ("trl.experimental.orpo.ORPOConfig", "trl.experimental.orpo.ORPOTrainer", "orpo_config"),
    "simpo": ("trl.experimental.cpo.CPOConfig", "trl.experimental.cpo.CPOTrainer", "cpo_config"),
}
# each config's own fields this export writes (besides TrainingArguments'): the names TRL's source declares
TRL_PREF_FIELDS = {
    "dpo": ("max_length", "beta", "loss_type", "precompute_ref_log_probs", "disable_dropout"),
    "orpo": ("max_length", "beta", "disable_dropout"),
    "simpo": ("max_length", "beta", "loss_type", "cpo_alpha", "simpo_gamma", "disable_dropout"),
}
_RENAMES = {"alpaca": "instruction (+ input) -> prompt", "sharegpt": "conversations -> prompt (a list of "
            "role/content messages), chosen/rejected -> a list holding the one assistant message"}


def trl_pref_class(cfg: TrainConfig) -> tuple[str, str, str]:
    """``(config class, trainer class, JSON key)`` of TRL for ``cfg.objective``; objective="lm" is a ConfigError."""
    if cfg.objective not in TRL_PREF_CLASSES:
        raise ConfigError(f"objective: {cfg.objective!r} has no preference loss; export it with --to trl-sft (TRL's "
                          f"SFTConfig), or set objective to one of {', '.join(TRL_PREF_CLASSES)}", field="objective")
    return TRL_PREF_CLASSES[cfg.objective]


def dpo_config_kwargs(cfg: TrainConfig, output_dir: Optional[str] = None, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of TRL's config for ``cfg.objective`` (``trl_pref_class``), plain JSON-friendly values."""
    return dpo_config(cfg, output_dir, **overrides)[0]


def dpo_config(cfg: TrainConfig, output_dir: Optional[str] = None,
               **overrides: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``(keywords of DPOConfig, ORPOConfig or CPOConfig, notes)``; notes name the class and what it cannot say."""
    cls, trainer, _ = trl_pref_class(cfg)
    kw = training_arguments_kwargs(cfg, output_dir)
    precision = resolve_precision(cfg.precision)
    # TRL turns bf16 on unless fp16 is set (see trl_sft); nbtrain keeps the model's dropout on while training, TRL
    # turns it off by default
    kw.update(bf16=precision == "bf16", fp16=precision == "fp16", max_length=cfg.max_seq_len, beta=cfg.pref_beta,
              disable_dropout=False)
    notes: dict[str, str] = training_arguments_notes(cfg)
    notes.pop("objective", None)   # TrainingArguments' note that it has no preference loss: this config has
    if cfg.objective == "dpo":
        kw.update(loss_type="sigmoid", precompute_ref_log_probs=cfg.precompute_ref)
    elif cfg.objective == "orpo":
        notes["objective"] = (f"objective='orpo' is {cls} for {trainer} (TRL's experimental ORPO; DPOConfig has no "
                              "ORPO loss): beta is nbtrain's pref_beta, ORPO's lambda")
    else:
        # CPOTrainer's simpo loss: -log sigmoid(beta (mean logp chosen - mean logp rejected) - gamma), nbtrain's;
        # cpo_alpha=0 leaves out CPO's NLL term
        kw.update(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=cfg.simpo_gamma)
        notes["objective"] = (f"objective='simpo' is {cls} for {trainer} (TRL's experimental CPO; DPOConfig has no "
                              "SimPO loss) with loss_type='simpo' and cpo_alpha=0.0, plain SimPO")
    notes.update(pref_notes(cfg, "TRL"))
    pref = pref_format(cfg)
    if pref in _RENAMES:
        notes["data_format"] = (f"data_format={pref!r}: TRL reads prompt/chosen/rejected rows; convert the {pref} "
                                f"ranking rows ({_RENAMES[pref]})")
    if cfg.columns:
        notes["columns"] = (f"columns={cfg.columns!r}: TRL reads fixed names (prompt, chosen, rejected); rename the "
                            "dataset's columns (datasets' rename_columns)")
    # keyed without a field: it says how TRL reads the rows, not a field that fails to round-trip
    notes["conversational"] = ("TRL applies the chat template to conversational rows only (prompt, chosen and "
                               "rejected as lists of role/content messages); plain-string rows are tokenized as they "
                               "are, while nbtrain renders the prompt as the user's turn and each answer as the "
                               "assistant's: convert plain rows to messages")
    notes["truncation"] = ("nbtrain cuts a prompt too long for max_seq_len from its left and keeps both answers whole; "
                           + ("DPOConfig's max_length cuts each sequence at its end (truncation_mode keep_start), the "
                              "answers first" if cfg.objective == "dpo" else
                              f"{cls.rsplit('.', 1)[1]} cuts the answers to fit max_length")
                           + "; rows that fit are the same")
    if cfg.chat_template != "auto":
        name = repr(cfg.chat_template) if cfg.chat_template in ("chatml", "llama3", "alpaca") else "a Jinja string"
        notes["chat_template"] = (f"chat_template {name}: set it as the tokenizer's chat_template before passing it "
                                  "as processing_class (TRL uses the tokenizer's own)")
    notes.update(sample_notes(cfg, f"TRL {cls.rsplit('.', 1)[1]}"))
    notes.update(non_default_notes(cfg, NBTRAIN_ONLY, f"is an nbtrain speed/memory option with no "
                                                      f"{cls.rsplit('.', 1)[1]} key (the same training without it)"))
    kw.update(overrides)
    return kw, notes


def pref_fields_from_trl(config_class: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(TrainConfig fields, unmapped)`` of the preference keywords of a TRL config (``config_class`` as
    ``trl_pref_class`` names it, or its bare name): objective, pref_beta, simpo_gamma, precompute_ref and
    max_seq_len. A missing key takes TRL's default; a loss or term nbtrain has not (another loss_type, label
    smoothing, CPO's NLL term) is in ``unmapped`` with why."""
    name = config_class.rsplit(".", 1)[-1]
    objective = {"DPOConfig": "dpo", "ORPOConfig": "orpo", "CPOConfig": "simpo"}.get(name)
    if objective is None:
        raise ConfigError(f"config_class: {config_class!r} is not a TRL preference config nbtrain reads (DPOConfig, "
                          "ORPOConfig, CPOConfig)", field="objective")
    kw = dict(kwargs)
    unmapped: dict[str, Any] = {}
    out: dict[str, Any] = {"objective": objective, "pref_beta": float(kw.pop("beta", 0.1))}
    if "max_length" in kw and kw["max_length"] is not None:
        out["max_seq_len"] = int(kw.pop("max_length"))
    if objective == "dpo":
        loss = kw.pop("loss_type", "sigmoid")
        if (loss if isinstance(loss, str) else ",".join(loss)) != "sigmoid":
            unmapped["loss_type"] = (loss, "nbtrain's dpo is the sigmoid loss")
        out["precompute_ref"] = bool(kw.pop("precompute_ref_log_probs", False))
    elif objective == "simpo":
        loss = kw.pop("loss_type", "sigmoid")
        alpha = float(kw.pop("cpo_alpha", 1.0))
        if loss != "simpo":
            unmapped["loss_type"] = (loss, "nbtrain reads CPOConfig as SimPO (loss_type='simpo') only")
        if alpha != 0.0:
            unmapped["cpo_alpha"] = (alpha, "CPO's NLL term on the chosen answer; nbtrain's simpo has none")
        out["simpo_gamma"] = float(kw.pop("simpo_gamma", 0.5))
    for key, off in (("label_smoothing", 0.0), ("ld_alpha", None), ("use_weighting", False),
                     ("sync_ref_model", False), ("loss_weights", None)):
        if key in kw and kw.pop(key) not in (off,):
            unmapped[key] = (kwargs[key], "a DPO variant nbtrain does not run")
    return out, unmapped
