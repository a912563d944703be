"""TrainConfig: every knob of a run, validated at construction, YAML in and out.

A TrainConfig is a portable value: its checks are field types, ranges and rules between fields, never a
question about this machine or a model's files. What depends on those (can this device run tf32? does
the model have these LoRA targets?) is checked when a run or an estimate prepares:
``nbtrain.hardware.check_runnable`` and ``nbtrain.models.check_lora_targets``. So a config written for a
GPU loads, edits, estimates and exports anywhere."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

Precision = Literal["auto", "fp32", "tf32", "fp16", "bf16", "bf16-pure", "fp8"]
# the optimizers one name builds (nbtrain.engine.optimizers): torch's AdamW, bitsandbytes' 8-bit AdamW (paged: CUDA
# only), transformers' Adafactor, SGD with momentum 0.9
Optimizer = Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
Task = Literal["causal-lm", "sequence-classification", "image-classification"]
# builtin datasets of images; every other builtin is text (nbtrain.data.builtin lists them all)
IMAGE_BUILTINS = ("builtin:digits",)
Method = Literal["full", "lora", "qlora"]
Scheduler = Literal["constant", "linear", "cosine"]
NonFinitePolicy = Literal["skip", "stop", "continue"]
# experiment trackers report_to can name (nbtrain.integrations.trackers has one callback for each)
Tracker = Literal["tensorboard", "trackio", "mlflow", "wandb"]
# how rows of instruction / chat data are laid out (LLaMA-Factory's alpaca and sharegpt, OpenAI/TRL messages, TRL
# prompt-completion, TRL preference: prompt/chosen/rejected, TRL prompt-only: prompt, for GRPO); "text" is plain
# text, "auto" reads the format from the columns
DataFormat = Literal["auto", "text", "alpaca", "sharegpt", "messages", "prompt-completion", "preference", "prompt"]
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
CHAT_TEMPLATES = ("auto", "chatml", "llama3", "alpaca")   # or a literal Jinja template string
TrainOn = Literal["completion", "last", "all"]
# what the loss is: the next-token loss on the targets, a preference objective over (prompt, chosen, rejected), or
# GRPO's online RL on the model's own sampled completions of prompts, scored by reward functions
Objective = Literal["lm", "dpo", "orpo", "simpo", "grpo"]
GrpoLoss = Literal["grpo", "dr_grpo", "dapo"]
IsCorrection = Literal["none", "token_truncate"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
# how several processes hold the model: none (each a full copy, DDP) or fsdp (FSDP2 fully_shard: weights, gradients
# and optimizer state split over the ranks)
Sharding = Literal["none", "fsdp"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)
TRACKERS: tuple[str, ...] = get_args(Tracker)


# fields that name a file or a directory: an os.PathLike (pathlib.Path) is accepted and stored as its string
PATH_FIELDS = ("model", "data", "output_dir", "resume_from")
# The example configs ship inside the package, so a notebook opened on its own (Colab, a downloaded copy) and
# the command line find them by name: TrainConfig.example("tiny"), `nbtrain train tiny`.
EXAMPLES_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(ValueError):
    """A TrainConfig value, or a combination of values, that is not allowed. ``.field`` names it."""

    def __init__(self, message: str, field: str | None = None, errors: list[dict] | None = None):
        super().__init__(message)
        self.field = field
        self.errors = errors or [{"field": field, "message": message}]


_TARGETS_ALLOWED = "'all-linear', or module names separated by commas ('q_proj,v_proj') or in a list"


def _describe(err: dict) -> tuple[str, str]:
    loc = str(err["loc"][0]) if err.get("loc") else ""   # the field; deeper parts name union branches
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if not loc:  # a cross-field check: its message starts with the field(s) it is about
        head, sep, rest = msg.partition(": ")
        loc, msg = (head, rest) if sep and re.fullmatch(r"[a-z_/]+", head) else ("config", msg)
        return loc.split("/")[0], msg
    if err.get("type") == "extra_forbidden":
        msg = "is not a TrainConfig field (check the spelling; see TrainConfig.model_fields for the list)"
    inp = err.get("input")
    if "got " not in msg and err.get("type") != "extra_forbidden" and not isinstance(inp, dict):
        msg = f"{msg} (got {inp!r})"
    return loc, msg


class TrainConfig(BaseModel):
    """Everything a run needs. Bad values fail here, naming the field, the value and what is allowed.

    Each field's help text is its ``description`` (``TrainConfig.model_fields[name].description``)."""

    # no inf/nan in any float field: they pass every bound check and break the run only later
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    model: str = Field("tiny", description="preset name ('tiny'), a Hugging Face model id, or a local directory")
    task: Task = Field("causal-lm", description="next-token prediction, one label per text, or one label per "
                                                "image")
    data: str = Field("builtin:python-docs", description="builtin:<name>, a local file or directory (txt, csv, "
                      "json/jsonl, parquet), or a dataset id")
    text_column: str = Field("text", description="column with the text (files and dataset ids)")
    label_column: str = Field("label", description="column with the class label (classification only)")
    image_column: str = Field("image", description="column with the image (image classification from a dataset "
                                                   "id; an image folder's class subfolders give the labels)")
    max_seq_len: int = Field(128, ge=8, le=131072,
                             description="tokens per example; longer ones are cut (a.k.a. cutoff_len)")
    subset: Optional[int] = Field(None, ge=1, description="first N examples only (before the eval split); "
                                                          "blank = all")
    precision: Precision = Field("auto", description="auto (bf16 where native, else fp16 on CUDA, else fp32), "
                                                     "fp32, tf32 (Ampere+ GPUs), fp16 (with a GradScaler), bf16, "
                                                     "bf16-pure (weights, gradients and optimizer state in bf16, "
                                                     "no fp32 master) or fp8 (float8 matmuls in the linear layers)")
    micro_batch_size: int = Field(8, ge=1, le=4096,
                                  description="examples per forward/backward: drives activation memory")
    grad_accum_steps: int = Field(1, ge=1, le=4096,
                                  description="micro-batches whose gradients add up to one optimizer step")
    method: Method = Field("full", description="full (every weight trains), lora (small adapters on a frozen "
                                               "base) or qlora (LoRA on a 4/8-bit quantised base)")
    lora_r: int = Field(8, ge=1, le=4096, description="adapter rank: trainable parameters grow linearly with r")
    lora_alpha: float = Field(16, gt=0, description="adapter scale = alpha / r")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter input")
    lora_targets: Union[str, list[str]] = Field("all-linear", description="module names, comma-separated, or "
                                                                          "all-linear")
    quant_bits: int = Field(4, description="how the frozen base is stored (bitsandbytes): 4 (nf4) or 8 (int8)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward: less memory, "
                                                            "~30% slower")
    lr: float = Field(3e-4, gt=0, le=10, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's weight decay (decoupled for the AdamW "
                                                       "kinds and Adafactor)")
    optimizer: Optimizer = Field("adamw", description="adamw (torch, fused kernel on CUDA and CPU), adamw_8bit / paged_adamw_8bit "
                                 "(bitsandbytes: 8-bit state; paged is CUDA only), adafactor (factored second "
                                 "moment, no momentum) or sgd (momentum 0.9)")
    stochastic_rounding: bool = Field(False, description="bf16-pure only: round each weight update to bf16 "
                                      "stochastically, so small updates are kept on average")
    scheduler: Scheduler = Field("cosine", description="how the learning rate moves after warmup")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup from 0")
    max_steps: Optional[int] = Field(100, ge=1, description="optimizer steps to run; wins over epochs")
    epochs: Optional[float] = Field(None, gt=0, description="passes over the training set, when max steps is "
                                                            "blank")
    max_grad_norm: Optional[float] = Field(1.0, ge=0, description="clip the total gradient L2 norm; blank or 0 = "
                                                                  "off (still measured)")
    packing: bool = Field(False, description="concatenate texts and cut into max_seq_len blocks: no padding")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of examples held out for evaluation; "
                                                               "0 = none")
    eval_every: Optional[int] = Field(None, ge=1, description="evaluate every N optimizer steps; blank = only at "
                                                              "the end")
    log_every: int = Field(1, ge=1, description="print every N steps (every step is recorded)")
    seed: int = Field(0, ge=0, lt=2**32, description="initial weights and the run's other randomness (dropout, "
                                                     "sampling); also the data order while data seed is blank")
    data_seed: Optional[int] = Field(None, ge=0, lt=2**32, description="data order and eval split; blank = seed "
                                                                       "(as transformers' data_seed)")
    output_dir: Optional[str] = Field(None, description="write config, history and summary here")
    nonfinite: Optional[NonFinitePolicy] = Field(
        None, description="what a step with inf/nan does when no GradScaler skips it: skip, stop or continue "
                          "(blank: skip with a scaler, stop without)")
    chunked_loss: bool = Field(False, description="compute the loss chunk by chunk: the full fp32 logits never "
                                                  "exist (less memory)")
    loss_chunk_tokens: int = Field(1024, ge=16, description="target tokens per chunk of the chunked loss")
    lean_layers: bool = Field(False, description="Llama-style MLP and norms recompute cheap intermediates in "
                                                 "backward: same results, less memory")
    compile: bool = Field(False, description="torch.compile each layer: faster steps after a slow first one")
    auto_batch_size: bool = Field(False, description="find the largest micro batch that fits; accumulation keeps "
                                                     "the effective batch")
    save_every: Optional[int] = Field(None, ge=1, description="write a checkpoint (weights, optimizer, RNG, "
                                                              "history) every N steps into output_dir")
    resume_from: Optional[str] = Field(None, description="a checkpoint directory, or output_dir: continue that run "
                                                         "exactly")
    # -- several processes (torchrun / accelerate launch / nbt.launch) ---------------------------------------
    sharding: Sharding = Field("none", description="several processes: none (DDP: every rank holds the whole model) "
                               "or fsdp (FSDP2: weights, gradients and optimizer state sharded over the ranks); "
                               "one process: nothing to shard")
    reshard_after_forward: bool = Field(True, description="fsdp: free each layer's gathered weights after its "
                                        "forward and gather them again in backward (less memory, one more "
                                        "all-gather per layer)")
    # -- instruction tuning (causal LM on chat / instruction data) --------------------------------------------
    data_format: DataFormat = Field("auto", description="how rows are laid out: auto (from the columns), text, "
                                    "alpaca (instruction/input/output), sharegpt (conversations), messages "
                                    "(role/content), prompt-completion or preference (prompt/chosen/rejected, for "
                                    "objective dpo/orpo/simpo; LLaMA-Factory ranking entries and chosen/rejected "
                                    "columns are detected under auto)")
    columns: dict[str, str] = Field({}, description="the data's own column names for the format's, e.g. "
                                    "{instruction: question, output: answer} (LLaMA-Factory's dataset_info columns); "
                                    "blank = the format's names")
    dataset_entry: Optional[str] = Field(None, description="data= a LLaMA-Factory data folder: the entry of its "
                                         "dataset_info.json to train on (LLaMA-Factory's dataset:); several, "
                                         "comma-separated, are concatenated in that order; blank = the folder's "
                                         "only entry")
    chat_template: str = Field("auto", description="chat data: auto (the tokenizer's own), chatml, llama3, alpaca "
                               "(### Instruction / ### Response) or a Jinja template string")
    train_on: TrainOn = Field("completion", description="chat data: which tokens carry the loss: completion (every "
                              "assistant turn), last (the final assistant turn only) or all (prompts too)")
    sample_prompts: list[str] = Field([], description="prompts the model answers greedily while it trains "
                                      "(result.samples, the dashboard); blank = none")
    sample_every: Optional[int] = Field(None, ge=1, description="answer the sample prompts every N steps (and at "
                                        "the end); blank = at the end only")
    max_new_tokens: int = Field(64, ge=1, le=4096, description="tokens per sample answer (greedy), and per GRPO "
                                "completion (sampled)")
    # -- preference tuning (DPO, ORPO, SimPO) -------------------------------------------------------------------
    objective: Objective = Field("lm", description="lm (the next-token loss on the targets), dpo (the policy's "
                                 "log-prob ratios against a reference, chosen vs rejected), orpo (NLL of the chosen "
                                 "answer plus an odds-ratio penalty; no reference) or simpo (length-normalised "
                                 "margin; no reference); dpo/orpo/simpo need preference data (prompt, chosen, "
                                 "rejected); grpo (online RL: num_generations completions sampled per prompt, "
                                 "scored by reward, pushed up where they beat their group's mean) needs prompt data")
    pref_beta: float = Field(0.1, gt=0, le=100, description="dpo/simpo: beta, the reward scale; orpo: lambda, the "
                             "odds-ratio weight (as LLaMA-Factory's pref_beta)")
    simpo_gamma: float = Field(0.5, ge=0, le=100, description="simpo: the target reward margin gamma")
    precompute_ref: bool = Field(False, description="dpo, full fine-tune: compute the reference log-probs once "
                                 "before training instead of holding a frozen copy of the model (LoRA/QLoRA use "
                                 "the model with its adapters off either way)")
    # -- online RL (GRPO) ---------------------------------------------------------------------------------------
    reward: Any = Field(None, description="grpo: one or more reward functions: 'length:N' (closeness to N "
                        "completion tokens), 'format:REGEX' (1 where the completion matches), 'exact' / 'contains' "
                        "(against the data's answer column), 'module:function' (imported), or a Python function "
                        "f(prompts, completions, **columns) -> list[float]")
    reward_weights: Optional[list[float]] = Field(None, description="grpo: one weight per reward (blank: 1 each); "
                                                  "the total reward is the weighted sum")
    num_generations: int = Field(4, ge=2, le=256, description="grpo: completions sampled per prompt (G), the "
                                 "group whose mean reward is each one's baseline")
    temperature: float = Field(1.0, gt=0, le=10, description="grpo: sampling temperature of the completions (the "
                               "trainer scores them at the same temperature)")
    top_p: float = Field(1.0, gt=0, le=1, description="grpo: sample from the smallest set of tokens holding this "
                         "much probability; 1 = all")
    grpo_epsilon: float = Field(0.2, gt=0, lt=1, description="grpo: the clip range of the importance ratio, "
                                "1 +/- epsilon")
    grpo_beta: float = Field(0.0, ge=0, le=100, description="grpo: weight of the KL to the reference model (the "
                             "initial one; 0 = no reference, as TRL's default)")
    grpo_loss: GrpoLoss = Field("dapo", description="grpo: how the token losses are averaged (as TRL's loss_type): "
                                "grpo (per completion, then over completions), dr_grpo (over completions x "
                                "max_new_tokens) or dapo (over all the step's completion tokens)")
    grpo_iterations: int = Field(1, ge=1, le=64, description="grpo: optimizer steps on each batch of rollouts "
                                 "(TRL's num_iterations); above 1 the importance ratio leaves 1 and the clip acts")
    sampler_precision: Optional[Precision] = Field(None, description="grpo: the precision the completions are "
                                                   "sampled in; blank = the training precision")
    is_correction: IsCorrection = Field("none", description="grpo: correct the sampler/trainer mismatch: none, or "
                                        "token_truncate (each token's loss times min(p_trainer / p_sampler, "
                                        "is_cap), truncated importance sampling)")
    is_cap: float = Field(2.0, ge=1, le=1000, description="grpo, is_correction='token_truncate': the cap on the "
                          "importance weight")
    report_to: list[Tracker] = Field(
        [], description="log every step's record, the evals and the config to: tensorboard (output_dir/tensorboard, "
                        "else runs/<time>_<name>), trackio (its local store; trackio show), mlflow "
                        "(MLFLOW_TRACKING_URI, else mlflow's default store in the working folder), wandb (W&B; "
                        "files in output_dir/wandb; WANDB_MODE=offline keeps them local); each needs its package: "
                        "pip install 'nbtrain[trackers]'; blank = none")

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as e:
            errs = []
            for x in e.errors():   # one line per field: a union type reports each failed branch
                d = _describe(x)
                if d[0] not in [f for f, _ in errs]:
                    errs.append(d)
            lines = [f"{loc}: {msg}" for loc, msg in errs]
            first = errs[0][0] if errs else None
            raise ConfigError("Invalid TrainConfig:\n  " + "\n  ".join(lines), field=first,
                              errors=[{"field": f, "message": m} for f, m in errs]) from None

    # -- single-field checks -------------------------------------------------------------------
    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v, info: ValidationInfo):
        # pydantic reads True as 1 for int and float fields: micro_batch_size=True would become 1
        if isinstance(v, bool):
            kinds = set(get_args(cls.model_fields[info.field_name].annotation)) or \
                {cls.model_fields[info.field_name].annotation}
            if kinds & {int, float} and bool not in kinds:
                raise ValueError(f"must be a number, not a bool (got {v!r})")
        return v

    @field_validator(*PATH_FIELDS, mode="before")
    @classmethod
    def _path_like(cls, v):
        # Path("data/train.jsonl"), or any os.PathLike, is stored as its string: to_dict and to_yaml stay plain
        return os.fsdecode(v) if isinstance(v, os.PathLike) else v

    @field_validator("output_dir", "resume_from")
    @classmethod
    def _path_or_none(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError("must be a directory path or None, not an empty string")
        return v

    @field_validator("model", "data", "text_column", "label_column", "image_column")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not isinstance(v, str) or not v.strip():
            raise ValueError("must be a non-empty string")
        return v.strip()

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _targets_type(cls, v):
        if not isinstance(v, (str, list, tuple)):
            raise ValueError(f"must be {_TARGETS_ALLOWED}, got {v!r}")
        return list(v) if isinstance(v, tuple) else v

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, v):
        # "q_proj,v_proj" (LLaMA-Factory's lora_target, the Panel's text box) is the list ["q_proj", "v_proj"]
        items = v.split(",") if isinstance(v, str) else v
        if isinstance(v, str) and v.strip() == "all-linear":
            return "all-linear"
        if not items or not all(isinstance(t, str) and t.strip() for t in items):
            raise ValueError(f"must be {_TARGETS_ALLOWED}, with no empty name; got {v!r}")
        names = [t.strip() for t in items]
        if "all-linear" in names and len(names) > 1:
            raise ValueError(f"'all-linear' already means every linear layer: give it alone, or name the modules "
                             f"instead; got {v!r}")
        return names

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, v):
        # "tensorboard,mlflow" (the CLI's --set, a text box), a list or a tuple; None or "none" = no tracker
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
            return []
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise ValueError(f"must be tracker names ({', '.join(TRACKERS)}), a list of them or none; got {v!r}")
        names = [t.strip().lower() for t in items if t.strip()]
        unknown = [t for t in names if t not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker {', '.join(map(repr, unknown))}; choose from {', '.join(TRACKERS)} "
                             f"(or none), got {v!r}")
        return list(dict.fromkeys(names))   # each once, in the order given

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str) -> str:
        # a name nbtrain knows, or a Jinja template (it has a {{ ... }} or {% ... %}); an unknown name is refused,
        # never silently replaced
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"must be one of {', '.join(CHAT_TEMPLATES)} or a Jinja template string, got {v!r}")
        name = v.strip()
        if name.lower() in CHAT_TEMPLATES:
            return name.lower()
        if "{{" in v or "{%" in v:
            return v
        raise ValueError(f"unknown chat template {name!r}; choose from {', '.join(CHAT_TEMPLATES)} or give a Jinja "
                         "template string (with {{ ... }} / {% ... %})")

    @field_validator("dataset_entry", mode="before")
    @classmethod
    def _entries(cls, v):
        # "a,b" (LLaMA-Factory's dataset:, the CLI's --set) or a list of names; None or blank = none named
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) and t.strip() for t in items):
            raise ValueError(f"must name entries of the data folder's dataset_info.json, e.g. 'alpaca_en' or "
                             f"'alpaca_en,glaive' (no empty name); got {v!r}")
        return ",".join(t.strip() for t in items)

    @field_validator("sample_prompts", mode="before")
    @classmethod
    def _prompts(cls, v):
        # one prompt as a string, a list or tuple of them; None = none
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise ValueError(f"must be a prompt or a list of prompts (strings), got {v!r}")
        return [t for t in items if t.strip()]

    @field_validator("columns", mode="before")
    @classmethod
    def _columns(cls, v):
        if v is None:
            return {}
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(c, str) and k.strip() and c.strip()
                                              for k, c in v.items()):
            raise ValueError(f"must map the format's column names to the data's, e.g. {{'output': 'answer'}}; "
                             f"got {v!r}")
        return {k.strip(): c.strip() for k, c in v.items()}

    @field_validator("reward", mode="before")
    @classmethod
    def _reward(cls, v):
        # one reward (a name or a function) or a list of them, stored as a list; None = none
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        if not items:
            raise ValueError(f"give one or more reward functions ({REWARD_HELP})")
        for r in items:   # the names' syntax here; a 'module:function' is imported when a run prepares
            if not callable(r):
                reward_kind(r)
        return [r.strip() if isinstance(r, str) else r for r in items]

    @field_validator("quant_bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (4, 8):
            raise ValueError(f"must be 4 (nf4) or 8 (int8) for QLoRA, got {v!r}")
        return v

    # -- cross-field checks --------------------------------------------------------------------
    @model_validator(mode="after")
    def _cross(self) -> "TrainConfig":
        if self.max_steps is None and self.epochs is None:
            raise ValueError("max_steps/epochs: both are None; set at least one (max_steps wins when both are set)")
        if self.packing and self.task != "causal-lm":
            raise ValueError("packing: True only applies to task='causal-lm'; set packing=False for "
                             f"task={self.task!r}")
        if self.chunked_loss and self.task != "causal-lm":
            raise ValueError("chunked_loss: True only applies to task='causal-lm' (a classifier has no vocab-sized "
                             "logits)")
        images = self.task == "image-classification"
        if self.data in IMAGE_BUILTINS and not images:
            raise ValueError(f"data: {self.data!r} holds images; set task='image-classification' (or use a text "
                             f"dataset such as 'builtin:python-docs' for task={self.task!r})")
        if images and self.data.startswith("builtin:") and self.data not in IMAGE_BUILTINS:
            raise ValueError(f"data: {self.data!r} holds text, not images; task='image-classification' needs "
                             f"{' or '.join(map(repr, IMAGE_BUILTINS))}, a folder of class subfolders of images, "
                             "or a dataset id with an image column")
        if self.data_format not in ("auto", "text") and self.task != "causal-lm":
            raise ValueError(f"data_format: {self.data_format!r} is instruction / chat data, for task='causal-lm'; "
                             f"set data_format='auto' or 'text' for task={self.task!r}")
        if self.sample_prompts and self.task != "causal-lm":
            raise ValueError(f"sample_prompts: a {self.task} model does not write answers; sample prompts need "
                             "task='causal-lm'")
        if self.stochastic_rounding and self.precision != "bf16-pure":
            raise ValueError("stochastic_rounding: rounds bf16 weights, so it needs precision='bf16-pure' (the other "
                             f"precisions keep fp32 weights); got precision={self.precision!r}")
        if self.stochastic_rounding and self.optimizer != "adamw":
            raise ValueError("stochastic_rounding: implemented for optimizer='adamw' (torchao's bf16 "
                             f"stochastic-round AdamW does the same); got optimizer={self.optimizer!r}")
        if self.precision == "fp8" and self.method == "qlora":
            raise ValueError("precision: 'fp8' runs nn.Linear matmuls in float8; QLoRA's base layers are 4/8-bit "
                             "bitsandbytes layers with their own matmuls; use method='lora' or 'full' with fp8, or "
                             "precision='bf16' with QLoRA")
        if self.precision == "fp8" and self.lean_layers:
            raise ValueError("lean_layers: its MLP computes the down projection itself, which would bypass fp8's "
                             "float8 matmul there; set lean_layers=False with precision='fp8'")
        if self.objective in ("dpo", "orpo", "simpo"):
            self._check_preference()
        elif self.precompute_ref:
            raise ValueError("precompute_ref: reference log-probs are for objective='dpo'; got objective='lm'")
        if self.objective == "grpo":
            self._check_grpo()
        elif self.data_format == "prompt":
            raise ValueError(f"data_format: 'prompt' is prompts without answers, for objective='grpo' (online RL); "
                             f"got objective={self.objective!r}")
        elif self.reward is not None or self.reward_weights is not None:
            name = "reward" if self.reward is not None else "reward_weights"
            raise ValueError(f"{name}: rewards score sampled completions, for objective='grpo'; got "
                             f"objective={self.objective!r}")
        if self.sharding == "fsdp":
            self._check_fsdp()
        if self.save_every and not self.output_dir:
            raise ValueError(f"save_every: {self.save_every} needs output_dir to be set (checkpoints go to "
                             "output_dir/checkpoints)")
        return self

    def _check_preference(self) -> None:
        """What a preference objective needs: causal-LM preference data, one example per row (no packing)."""
        o = self.objective
        if self.task != "causal-lm":
            raise ValueError(f"objective: {o!r} trains a causal LM on (prompt, chosen, rejected); got "
                             f"task={self.task!r}; use objective='lm'")
        if self.packing:
            raise ValueError(f"packing: objective={o!r} compares each chosen answer with its rejected one, row by "
                             "row; set packing=False")
        if self.chunked_loss:
            raise ValueError(f"chunked_loss: objective={o!r} computes sequence log-probs on the answer tokens "
                             "only (the full logits never exist anyway); set chunked_loss=False")
        if self.data_format in ("text", "messages", "prompt-completion"):
            raise ValueError(f"data_format: {self.data_format!r} has no rejected answer; objective={o!r} needs "
                             "'preference' (prompt/chosen/rejected), 'alpaca' or 'sharegpt' with chosen/rejected, "
                             "or 'auto'")
        if self.precompute_ref and o != "dpo":
            raise ValueError(f"precompute_ref: objective={o!r} uses no reference model; only 'dpo' does")

    def _check_grpo(self) -> None:
        """What online RL needs: a causal LM, prompt data, rewards, and steps that hold whole groups."""
        if self.task != "causal-lm":
            raise ValueError(f"objective: 'grpo' samples completions from a causal LM; got task={self.task!r}")
        if self.reward is None:
            raise ValueError("reward: objective='grpo' needs one or more reward functions, e.g. reward='length:32', "
                             "reward=['format:^[0-9]+$', 'exact'] or a function f(prompts, completions, **columns)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"reward_weights: one weight per reward ({len(self.reward)}), got "
                             f"{len(self.reward_weights)}")
        for name, on in (("packing", self.packing), ("chunked_loss", self.chunked_loss),
                         ("precompute_ref", self.precompute_ref)):
            if on:
                raise ValueError(f"{name}: not with objective='grpo' (each completion is scored row by row on its "
                                 f"own tokens); set {name}=False")
        if self.data_format not in ("auto", "prompt"):
            raise ValueError(f"data_format: objective='grpo' reads prompts (TRL's prompt format: a 'prompt' column, "
                             f"plain text or messages); set data_format='prompt' or 'auto', got {self.data_format!r}")
        rows = self.micro_batch_size * self.grad_accum_steps
        if rows % self.num_generations:
            raise ValueError(f"num_generations: a step's {rows} completions (micro_batch_size x grad_accum_steps = "
                             f"{self.micro_batch_size} x {self.grad_accum_steps}) must hold whole groups of "
                             f"num_generations={self.num_generations}; make the product a multiple of it")
        if self.sample_prompts:
            raise ValueError("sample_prompts: objective='grpo' shows its own sampled completions (result.rollouts); "
                             "leave sample_prompts empty")

    def _check_fsdp(self) -> None:
        """What FSDP2 sharding does not compose with here, refused before anything loads, each with its reason."""
        refused = [
            ("method", self.method == "qlora", "QLoRA's 4/8-bit bitsandbytes weights are not sharded by "
                       "fully_shard here; use method='lora' (its frozen base is sharded too) or sharding='none'"),
            ("optimizer", self.optimizer in ("adamw_8bit", "paged_adamw_8bit"), f"{self.optimizer}'s bitsandbytes "
                          "kernels step whole tensors, not FSDP's shards; use optimizer='adamw' or 'sgd' (the "
                          "state is sharded anyway: 1/N of it per rank)"),
            ("optimizer", self.optimizer == "adafactor", "Adafactor's factored second moment averages over "
                           "each matrix's whole rows and columns, which a shard does not hold; use optimizer='adamw' "
                           "or 'sgd'"),
            ("stochastic_rounding", self.stochastic_rounding, "its bf16 rounding draws noise per element of whole "
                                    "tensors, not of FSDP's shards; use precision='bf16-pure' without it, or "
                                    "precision='bf16' (fp32 sharded masters lose no updates)"),
            ("objective", self.objective != "lm", "the preference objectives' reference forward (adapters off, "
                          "or a frozen copy) is not sharded here; use sharding='none'"),
            ("chunked_loss", self.chunked_loss, "the chunked loss calls the decoder and the output layer apart, "
                             "outside FSDP's root forward that gathers them; set chunked_loss=False"),
            ("auto_batch_size", self.auto_batch_size, "its probe runs the model before it is sharded, so it would "
                                "measure the wrong memory; set micro_batch_size yourself (estimate_memory(cfg, "
                                "world_size=N) says what fits)"),
        ]
        for name, bad, why in refused:
            if bad:
                raise ValueError(f"{name}: not with sharding='fsdp': {why}")

    # -- conveniences --------------------------------------------------------------------------
    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step: micro_batch_size x grad_accum_steps."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def data_order_seed(self) -> int:
        """The seed of the data order and the eval split: ``data_seed``, or ``seed`` when that is None."""
        return self.seed if self.data_seed is None else self.data_seed

    def replace(self, **changes: Any) -> "TrainConfig":
        """A validated copy with ``changes`` applied."""
        return type(self)(**{**self.model_dump(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field, in declaration order (a reward function as its 'module:function' reference,
        which loading imports again; one that cannot be imported as ``<name> (not importable)``)."""
        out = self.model_dump()
        if out.get("reward") is not None:
            out["reward"] = [r if isinstance(r, str) else reward_reference(r) for r in out["reward"]]
        return out

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The config as YAML text; also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "TrainConfig":
        """Load a config written by ``to_yaml`` (or by hand). Errors name the file."""
        p = Path(path)
        data = load_yaml_mapping(p, "TrainConfig fields")
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}", field=e.field, errors=e.errors) from None

    @classmethod
    def example(cls, name: str) -> "TrainConfig":
        """One of the example configs shipped with nbtrain, by name: "tiny" (the offline default), "minilm-lora",
        "qwen2.5-0.5b-qlora" (``example_configs()`` lists them)."""
        return cls.from_yaml(example_path(name))

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.to_dict().items() if v != type(self).model_fields[k].default}
        return "TrainConfig(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")"


REWARD_HELP = ("built-ins: length:N, format:REGEX, exact, contains; 'module:function'; or a function f(prompts, "
               "completions, **columns) -> list[float]")


def reward_kind(spec: Any) -> tuple[str, str]:
    """``(kind, argument)`` of a reward's name: ("length", "32"), ("format", REGEX), ("exact", ""), ("contains", ""),
    ("import", "module:function"). Raises ValueError saying what is wrong and what is allowed (the name's syntax
    only: a module is imported when a run prepares)."""
    if not isinstance(spec, str):
        raise ValueError(f"{spec!r} is neither a name nor a function ({REWARD_HELP})")
    spec = spec.strip()
    name, _, arg = spec.partition(":")
    if name == "length":
        if not re.fullmatch(r"\d+", arg.strip()) or int(arg) < 1:
            raise ValueError(f"{spec!r}: length:N takes a whole number of tokens N >= 1, e.g. 'length:32'")
        return "length", arg.strip()
    if name == "format":
        if not arg:
            raise ValueError(f"{spec!r}: format:REGEX needs a pattern, e.g. 'format:^<answer>.*</answer>$'")
        try:
            re.compile(arg)
        except re.error as e:
            raise ValueError(f"{spec!r}: not a regular expression ({e})") from None
        return "format", arg
    if spec in ("exact", "contains"):
        return spec, ""
    if spec.endswith("(not importable)"):
        raise ValueError(f"{spec!r} was a function this config cannot import again (a lambda, or one defined in a "
                         "notebook); pass the function itself, or put it in a module and name it 'module:function'")
    if arg and re.fullmatch(r"[A-Za-z_][\w.]*", name) and re.fullmatch(r"[A-Za-z_][\w.]*", arg):
        return "import", spec
    raise ValueError(f"unknown {spec!r} ({REWARD_HELP})")


def reward_reference(fn: Any) -> str:
    """'module:qualname' for a function a config can import again; '<name> (not importable)' otherwise (a lambda,
    a function defined in a notebook or inside another)."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    name = getattr(fn, "__name__", type(fn).__name__)
    if not mod or not qual or mod == "__main__" or "<" in qual:
        return f"{name} (not importable)"
    return f"{mod}:{qual}"


def example_configs() -> dict[str, Path]:
    """The example configs shipped with nbtrain: name -> YAML file."""
    return {p.stem: p for p in sorted(EXAMPLES_DIR.glob("*.yaml"))}


def example_path(name: str) -> Path:
    """The file of example config ``name`` ("tiny" or "tiny.yaml"); ValueError listing the examples otherwise."""
    examples = example_configs()
    stem = name[:-5] if name.endswith(".yaml") else name
    if stem not in examples:
        raise ValueError(f"no example config {name!r}; the examples shipped with nbtrain: {', '.join(examples)}")
    return examples[stem]


def config_file(spec: str | os.PathLike) -> Path:
    """A config given on the command line: a YAML file, or else the name of a shipped example ("tiny"). A name
    that is neither is an error naming both."""
    p = Path(spec)
    if p.is_file():
        return p
    try:
        return example_path(str(spec))
    except ValueError:
        raise FileNotFoundError(f"config file {str(spec)!r} does not exist, and it is not the name of an example "
                                f"config shipped with nbtrain ({', '.join(example_configs())})") from None


def load_yaml_mapping(path: str | os.PathLike, what: str = "keys") -> dict:
    """A YAML file that must hold a mapping; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of {what}, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``key=value`` from the command line; the value is read as YAML (numbers, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key not in TrainConfig.model_fields:
        raise ConfigError(f"--set {key}: not a TrainConfig field", field=key)
    try:   # safe_load: a !!python tag must never build objects from the command line
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.constructor.ConstructorError:
        raise ConfigError(f"--set {key}: YAML tags such as !!python/... are not allowed; give a plain value "
                          "(a number, a string, null, true/false or a [list])", field=key) from None
    except yaml.YAMLError as e:
        why = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"--set {key}: {raw!r} is not valid YAML ({why}); quote strings and close "
                          "lists, e.g. --set lora_targets=[q_proj,v_proj]", field=key) from None
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
        value = float(value)  # YAML 1.1 reads "1e-4" as a string
    return key, value
