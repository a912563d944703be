"""TRL's ``GRPOConfig`` for a TrainConfig of objective="grpo" (``nbtrain export --to trl-grpo``): ``grpo_config(cfg)``,
the keywords ``trl.GRPOConfig(**kw)`` takes, with notes, and ``grpo_reward_funcs(cfg)``, the rewards by name.

The mapping: num_generations is ``num_generations``, max_new_tokens ``max_completion_length``, temperature and top_p
keep their names, grpo_epsilon is ``epsilon`` (symmetric: no ``epsilon_high``), grpo_beta ``beta``, grpo_loss
``loss_type`` (grpo / dr_grpo / dapo mean the same in both), grpo_iterations ``num_iterations``, reward_weights
``reward_weights``; the TrainingArguments part is ``training_args``' (micro_batch_size is
``per_device_train_batch_size``, which counts completions in TRL too). The rest is pinned to what nbtrain runs:
``scale_rewards="group"`` (advantages divided by the group's std), ``use_bias_correction_kl=False`` (nbtrain's KL
term is the plain k3, not times the importance ratio), ``disable_dropout=False``, ``remove_unused_columns=False`` (the
data's other columns go to the rewards), and the sampler/trainer correction under its vLLM names
(``vllm_importance_sampling_correction``; with token_truncate ``vllm_importance_sampling_mode`` and
``vllm_importance_sampling_clip_max`` = is_cap), which TRL applies only with ``use_vllm=True``. TRL's defaults for
``steps_per_generation`` (gradient_accumulation_steps) and ``generation_batch_size`` (one optimizer step's
completions) are nbtrain's rollout batch, reused for num_iterations optimizer steps, so they are not written.

``reward_funcs`` (GRPOTrainer's argument, not a config field) are nbtrain's reward names (``cfg.to_dict()``: a
function as its ``module:qualname``): the notes say how to make them TRL's functions. Other objectives are refused
(``--to trl-sft`` / ``--to trl-dpo``), and ``check_not_grpo`` refuses GRPO for the exports that train another loss.

trl is not a dependency: nothing here imports it. The names are TRL 1.16's own (``trl/trainer/grpo_config.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from ...config import ConfigError, TrainConfig, reward_kind
from ...hardware import resolve_precision
from .mapping import NBTRAIN_ONLY, non_default_notes, sample_notes
from .training_args import training_arguments_kwargs, training_arguments_notes

# (the TRL config class, its trainer, the JSON key its keywords go under)
TRL_GRPO_CLASS = ("trl.GRPOConfig", "trl.GRPOTrainer", "grpo_config")
# GRPOConfig's own fields this export writes (besides TrainingArguments'): the names TRL's source declares
TRL_GRPO_FIELDS = ("num_generations", "max_completion_length", "temperature", "top_p", "epsilon", "beta",
                   "loss_type", "num_iterations", "reward_weights", "scale_rewards", "use_bias_correction_kl",
                   "disable_dropout", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                   "vllm_importance_sampling_clip_max")
# the exports that train another loss, and the TRL class each would have written
_OTHER_TRL = {"trl-sft": "SFTConfig", "trl-dpo": "DPOConfig"}


def check_not_grpo(cfg: TrainConfig, to: str) -> None:
    """Raise a ConfigError (field objective) when ``cfg`` is objective="grpo" and ``to`` is an export that trains
    another loss (trl-sft, trl-dpo), pointing at ``--to trl-grpo``."""
    if cfg.objective == "grpo":
        what = f"TRL's {_OTHER_TRL[to]}" if to in _OTHER_TRL else f"--to {to}"
        raise ConfigError(f"objective: 'grpo' is online RL (completions sampled and scored by rewards), which {what} "
                          "does not run; export it with --to trl-grpo (TRL's GRPOConfig)", field="objective")


def grpo_reward_funcs(cfg: TrainConfig) -> list[str]:
    """The rewards of ``cfg`` by name, as ``cfg.to_dict()`` writes them: built-ins ("length:32", "format:REGEX",
    "exact", "contains"), "module:function", and a function that cannot be imported as "<name> (not importable)"."""
    return list(cfg.to_dict()["reward"] or [])


def grpo_config_kwargs(cfg: TrainConfig, output_dir: Optional[str] = None, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of ``trl.GRPOConfig`` for ``cfg`` (plain values, JSON-friendly)."""
    return grpo_config(cfg, output_dir, **overrides)[0]


def grpo_config(cfg: TrainConfig, output_dir: Optional[str] = None,
                **overrides: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``(GRPOConfig keywords, notes)``; notes name what GRPOConfig cannot carry (or TRL runs differently). Another
    objective is a ConfigError naming the export that has it."""
    if cfg.objective != "grpo":
        other = "--to trl-sft (TRL's SFTConfig)" if cfg.objective == "lm" else \
            "--to trl-dpo (TRL's DPOConfig, ORPOConfig or CPOConfig)"
        raise ConfigError(f"objective: {cfg.objective!r} samples no completions and has no rewards; --to trl-grpo "
                          f"exports objective='grpo' only. Export this config with {other}, or set "
                          "objective='grpo' with a reward", field="objective")
    kw = training_arguments_kwargs(cfg, output_dir)
    precision = resolve_precision(cfg.precision)
    g = cfg.num_generations
    kw.update(
        # TRL turns bf16 on unless fp16 is set (see trl_sft)
        bf16=precision == "bf16", fp16=precision == "fp16",
        # GRPOConfig checks that an evaluation batch holds whole groups; the training one is the config's own check
        per_device_eval_batch_size=-(-cfg.micro_batch_size // g) * g,
        remove_unused_columns=False,
        num_generations=g, max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        epsilon=cfg.grpo_epsilon, beta=cfg.grpo_beta, loss_type=cfg.grpo_loss, num_iterations=cfg.grpo_iterations,
        reward_weights=None if cfg.reward_weights is None else [float(w) for w in cfg.reward_weights],
        scale_rewards="group", use_bias_correction_kl=False, disable_dropout=False,
        # TRL's default (on, sequence_mask) would correct where nbtrain does not: said either way
        vllm_importance_sampling_correction=cfg.is_correction != "none",
    )
    if cfg.is_correction == "token_truncate":
        kw.update(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cfg.is_cap)
    notes: dict[str, str] = training_arguments_notes(cfg)
    notes.pop("objective", None)   # TrainingArguments' note that it has no GRPO loss: this config has
    notes.update(_reward_notes(cfg))
    notes.update(_sampler_notes(cfg, precision))
    notes["max_seq_len"] = (f"max_seq_len={cfg.max_seq_len} has no GRPOConfig key: nbtrain cuts a longer prompt from "
                            "its left (keeping the generation prompt); GRPOTrainer keeps every prompt whole, so cut "
                            "or drop long prompts in the dataset; completions stop at max_completion_length in both")
    if cfg.columns:
        notes["columns"] = (f"columns={cfg.columns!r}: TRL reads the prompt from a column named 'prompt' and hands "
                            "every other column to the rewards under its own name (exact / contains read 'answer'); "
                            "rename the dataset's columns (datasets' rename_columns)")
    if cfg.chat_template != "auto":
        name = repr(cfg.chat_template) if cfg.chat_template in ("chatml", "llama3", "alpaca") else "a Jinja string"
        notes["chat_template"] = (f"chat_template {name}: set it as the tokenizer's chat_template before passing it "
                                  "as processing_class (TRL renders conversational prompts with the tokenizer's own)")
    if cfg.data.startswith("builtin:"):
        notes["data"] = (f"data={cfg.data!r} is an nbtrain builtin: train_dataset=datasets.Dataset.from_list("
                         f"nbtrain.data.builtin.builtin_rows({cfg.data!r})), TRL's prompt format as it is")
    notes.update(non_default_notes(cfg, ("train_on", "pref_beta", "simpo_gamma"),
                                   "does not apply to objective='grpo' (the loss is on the sampled completions, "
                                   "weighted by their advantages); not written"))
    notes.update({k: v for k, v in sample_notes(cfg, "TRL GRPOConfig").items() if k != "max_new_tokens"})
    notes.update(non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no GRPOConfig key "
                                                      "(the same training without it)"))
    kw.update(overrides)
    return kw, notes


def _reward_notes(cfg: TrainConfig) -> dict[str, str]:
    names = grpo_reward_funcs(cfg)
    notes = {"reward": (
        "reward_funcs are nbtrain's reward names, not functions (GRPOTrainer loads a string in reward_funcs as a "
        "reward model from the Hub): rewards = nbtrain.engine.rewards.parse_rewards(reward_funcs) gives Reward "
        "objects whose .fn is f(prompts, completions, **columns), TRL's own signature, unweighted (the weights are "
        "GRPOConfig's reward_weights). TRL hands a conversational prompt's completions over as [{'role': "
        "'assistant', 'content': text}] lists and nbtrain's rewards read text: pass each as def f(prompts, "
        "completions, completion_ids, **kw): return r.fn(prompts, [c[-1]['content'] if isinstance(c, list) else "
        "c for c in completions], completion_tokens=[len(i) for i in completion_ids], **kw), with f.__name__ = "
        "r.name (TRL logs each reward under its function's name)")}
    kinds = [reward_kind(n)[0] for n in names if not n.endswith("(not importable)")]
    if "length" in kinds:
        notes["completion_tokens"] = (
            "the length:N reward counts tokens from a completion_tokens column that TRL does not pass (it passes "
            "completion_ids, the token ids of each completion, its stop token included, as nbtrain counts): the "
            "wrapper's completion_tokens=[len(i) for i in completion_ids] gives it; unwrapped, it raises "
            "KeyError('completion_tokens')")
    lost = [n for n in names if n.endswith("(not importable)")]
    if lost:
        notes["not_importable"] = (
            f"reward {', '.join(repr(n) for n in lost)}: a function nothing can import again (a lambda, or one "
            "defined in a notebook or inside another); pass the function itself to GRPOTrainer(reward_funcs=...), "
            "or put it in a module and name it 'module:function'")
    return notes


def _sampler_notes(cfg: TrainConfig, precision: str) -> dict[str, str]:
    notes = {"mismatch": (
        "nbtrain's per-step sampler/trainer records (mismatch_mean / max / kl, is_ratio_min / mean / max) have no "
        "GRPOConfig key: TRL logs sampling/sampling_logp_difference and sampling/importance_sampling_ratio only with "
        "use_vllm=True and vllm_importance_sampling_correction on; without vLLM it keeps no sampler log-probs")}
    sampler = resolve_precision(cfg.sampler_precision) if cfg.sampler_precision is not None else precision
    if sampler != precision:
        notes["sampler_precision"] = (
            f"sampler_precision={cfg.sampler_precision!r} has no GRPOConfig key: GRPOTrainer samples with the model "
            f"it trains, in the training precision ({precision!r}), unless use_vllm=True, where vLLM samples in its "
            "own dtype")
    if cfg.is_correction == "token_truncate":
        notes["is_correction"] = (
            f"is_correction='token_truncate' is written as vllm_importance_sampling_correction=True, mode "
            f"'token_truncate', clip_max={cfg.is_cap}, which TRL applies only with use_vllm=True; without vLLM "
            "GRPOTrainer samples with the model it trains and corrects nothing (its importance ratio is against its "
            "own teacher-forced log-probs)")
    else:
        notes.update(non_default_notes(cfg, ("is_cap",), "only applies to is_correction='token_truncate'; not "
                                                         "written"))
    return notes
