"""The finish phase: undo the run's set-ups, the final evaluation, the summary, the outputs and ``on_run_end``."""

from __future__ import annotations

import gc
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Optional

import pandas as pd
import torch

from ..config import TrainConfig
from ..memory import oom_advice
from ..models import save_model
from .callbacks import CallbackError, StopTraining
from .doctor import diagnose, lost_updates_line
from .evaluate import evaluate
from .prepare import RunState, uncompile
from .records import STEP_FIELDS, EvalRecord, RunInfo, SampleRecord, StepRecord
from .sampling import Sampler, generate, sample_frame
from .telemetry import host_rss_gib

EVAL_FIELDS = ("step", "eval_loss", "eval_tokens", "eval_accuracy", "eval_perplexity")
# Keys a summary shows only when they have a value (classification has no perplexity, most runs no advice).
_ONLY_WHEN_SET = ("eval_accuracy", "eval_perplexity", "advice", "variant", "sample_s", "lost_updates_by_step",
                  "logprob_mismatch", "logprob_mismatch_steps", "reference", "rollout_s", "rollout_tokens_per_s",
                  "update_tokens_per_s", "mismatch_mean", "sampler_precision")


@dataclass(eq=False)
class RunSummary(Mapping):
    """What a run amounts to. Typed fields, read as attributes or, like a dict, by key (``summary["steps"]``);
    keys others add (``summary["x"] = ...``) are kept in ``extra``."""

    steps: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    peak_vram_gib: Optional[float] = None
    peak_host_rss_gib: Optional[float] = None
    peak_host_tensors_gib: Optional[float] = None
    final_loss: Optional[float] = None
    eval_loss: Optional[float] = None
    skipped_steps: int = 0
    nonfinite_steps: int = 0
    first_nonfinite_step: Optional[int] = None
    wall_s: float = 0.0
    stopped_reason: str = ""
    precision_used: str = ""
    device: str = ""
    trainable_params: int = 0
    total_params: int = 0
    eval_accuracy: Optional[float] = None
    eval_perplexity: Optional[float] = None
    data_hash: Optional[str] = None
    init_hash: Optional[str] = None
    micro_batch_size: Optional[int] = None
    grad_accum_steps: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    grad_fp16_underflow_share: Optional[float] = None
    # the share of sampled weight updates the weights' dtype could not hold (engine.doctor.LostUpdates), over the
    # measured steps; None where none was measured
    lost_updates: Optional[float] = None
    lost_updates_by_step: Optional[dict[int, float]] = None
    optimizer: str = "adamw"
    weights_dtype: str = "fp32"
    advice: Optional[list[str]] = None
    variant: Optional[str] = None
    world_size: int = 1
    sample_s: Optional[float] = None   # time spent answering the sample prompts (in wall_s, not in tokens_per_s)
    # FLOPs of one training token from the architecture (engine.flops): the model's, and with checkpointing's
    # recompute; mfu = model FLOPs per second over the devices' peak for the compute dtype (capabilities().peak_tflops)
    model_flops_per_token: Optional[float] = None
    hardware_flops_per_token: Optional[float] = None
    mfu: Optional[float] = None
    # preference objectives (engine.preference): the mean |log p_run - log p_fp32| per answer token of the policy,
    # over the sampled steps' batches (how far the run's dtype moves what DPO differences), on how many steps, and
    # how the DPO reference was held ("adapters off", "frozen copy", "precomputed")
    objective: str = "lm"
    logprob_mismatch: Optional[float] = None
    logprob_mismatch_steps: Optional[int] = None
    reference: Optional[str] = None
    # online RL (objective="grpo", engine.grpo_run): seconds spent sampling completions (inside wall_s and the steps'
    # step_time_s), sampled tokens per second of it, the updates' prompt + completion tokens per second of the rest,
    # the run's sampler/trainer mismatch (mean |delta log p| per completion token), the precision that sampled
    rollout_s: Optional[float] = None
    rollout_tokens_per_s: Optional[float] = None
    update_tokens_per_s: Optional[float] = None
    mismatch_mean: Optional[float] = None
    sampler_precision: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def _keys(self) -> list[str]:
        names = [f.name for f in fields(self) if f.name != "extra"]
        return [n for n in names if n not in _ONLY_WHEN_SET or getattr(self, n) is not None] + list(self.extra)

    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key == "extra" or key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key != "extra" and key in {f.name for f in fields(self)}:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (what summary.json holds)."""
        return dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunSummary":
        """The summary a dict describes (e.g. read back from summary.json or a launched worker)."""
        names = {f.name for f in fields(cls)} - {"extra"}
        out = cls(**{k: v for k, v in d.items() if k in names})
        out.extra.update({k: v for k, v in d.items() if k not in names})
        return out


@dataclass
class TrainResult:
    """What a run leaves: its history (one row per optimizer step), summary, model and tokenizer."""

    history: pd.DataFrame
    eval_history: pd.DataFrame
    summary: RunSummary
    model: Any
    tokenizer: Any
    config: TrainConfig
    info: Optional[RunInfo] = None
    records: list[StepRecord] = field(default_factory=list, repr=False)
    #: the sample prompts' answers (step, prompt, answer, new_tokens, seconds, variant); empty without prompts
    samples: pd.DataFrame = field(default_factory=lambda: sample_frame([]), repr=False)
    sample_records: list[SampleRecord] = field(default_factory=list, repr=False)
    chat: bool = False   # whether prompts get the chat template (chat / instruction data), for generate()
    #: online RL (objective="grpo"): one row per sampled completion (step, group, prompt, completion,
    #: completion_tokens, each reward by name, reward (the weighted total), advantage, variant); empty otherwise
    rollouts: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False)

    def generate(self, prompt: str, max_new_tokens: Optional[int] = None, system: Optional[str] = None) -> str:
        """The trained model's greedy answer to ``prompt``, the chat template applied for chat data, under the
        run's precision; ``max_new_tokens`` defaults to the config's."""
        if self.model is None:
            raise ValueError("generate: this result holds no model (compare() drops the models of seed runs and "
                             "of ones that could not leave the GPU)")
        if self.config.task != "causal-lm":
            raise ValueError(f"generate: a {self.config.task} model does not write answers; task='causal-lm' does")
        from ..precision import PRECISION_TABLE

        spec = PRECISION_TABLE.get(self.summary.get("precision_used"))
        answer, _ = generate(self.model, self.tokenizer, self.config, prompt, chat=self.chat, spec=spec,
                             max_new_tokens=max_new_tokens, system=system)
        return answer

    def figure(self):
        """Loss, grad norm, loss scale and memory of this run as a plotly Figure."""
        from ..viz.figures import run_figure  # drawing lives in viz/, imported only when asked

        return run_figure(self.history, self.eval_history, self.info)

    def save(self, path, merged: bool = False) -> Path:
        """Write what a user would share: adapter (or full model), tokenizer and nbtrain.yaml."""
        return save_model(self.model, self.tokenizer, self.config, path, merged=merged)

    def diagnose(self):
        """Findings about precision trouble (overflow, nan, spikes, a stuck scale) with evidence and advice."""
        return diagnose(self.history, self.summary, self.config)

    def __repr__(self) -> str:
        s = self.summary
        return (f"TrainResult(steps={s.get('steps')}, final_loss={s.get('final_loss')}, "
                f"precision={s.get('precision_used')}, stopped_reason={s.get('stopped_reason')!r})")


def frame(rows: list, columns: tuple[str, ...] | list[str]) -> pd.DataFrame:
    """Records as a DataFrame with exactly ``columns``."""
    return pd.DataFrame([r.to_dict() for r in rows], columns=list(columns))


def run_eval(st: RunState, step: int) -> None:
    """Evaluate on the held-out examples, keep the record and tell the callbacks."""
    if st.objective is not None and hasattr(st.objective, "evaluate"):   # a preference objective's own loss
        res = st.objective.evaluate(st.model, st.data.eval)
    else:
        res = evaluate(st.model, st.data.eval, st.data.task, st.data.pad_token_id, st.cfg.micro_batch_size,
                       st.spec, st.device, st.chunk_tokens)
    if res:
        rec = EvalRecord(step=step, variant=st.variant, **res)
        st.evals.append(rec)
        st.cbs.fire("on_eval", rec)


def undo(st: RunState, stopped_reason: str) -> None:
    """Whatever ended the run, leave the model usable: no half-accumulated gradients, no compiled layers, no lean
    layers, and after an out-of-memory stop no cached blocks."""
    st.optimizer.zero_grad(set_to_none=True)
    uncompile(st.compiled)
    if st.lean is not None:
        st.lean.undo()
    if stopped_reason == "out_of_memory":
        gc.collect()
        if st.device == "cuda":
            torch.cuda.empty_cache()


def weights_dtype(params: list[torch.Tensor]) -> str:
    """The trainable weights' dtype as a short name ("fp32", "bf16"; "fp32+bf16" when mixed)."""
    names = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
    kinds = sorted({names.get(str(p.dtype), str(p.dtype).removeprefix("torch.")) for p in params})
    return "+".join(kinds) if kinds else "-"


def _flops_and_mfu(st: RunState, tokens_per_s: float):
    """(TokenFlops, mfu) of the run; (None, None) for an image model (its tokens are patches) or where the count
    fails: a metric never fails a run."""
    if st.cfg.task == "image-classification":
        return None, None
    try:
        from ..hardware import capabilities
        from .flops import mfu, token_flops

        flops = token_flops(st.model, st.cfg.max_seq_len, st.cfg.gradient_checkpointing)
        peak = capabilities(torch.device(st.device).type).peak_tflops
        return flops, mfu(flops.model, tokens_per_s, peak, st.precision, st.dist.world)
    except Exception:  # noqa: BLE001 - see the docstring
        return None, None


def summarize(st: RunState, stopped_reason: str, wall: float, underflow,
              sampler: Optional[Sampler] = None) -> RunSummary:
    """The run's summary from its records and what prepare() knew."""
    records, evals = st.records, st.evals
    peaks = [r.vram_peak_gib for r in records if r.vram_peak_gib is not None]
    tensor_peaks = [r.host_tensors_gib for r in records if r.host_tensors_gib is not None]
    n_in_tokens = sum(r.tokens_per_s * r.step_time_s for r in records)
    # answering sample prompts is no training: out of the throughput, stated on its own
    sample_s = sampler.seconds if sampler is not None and sampler.prompts else None
    train_wall = wall - (sample_s or 0.0)
    last_eval = evals[-1] if evals else None
    by_step, lost = st.lost.shares(), st.lost.share()
    # with each sampled step's lr: the sentence says where the largest share fell (at the schedule's end, lr ~ 0)
    line = lost_updates_line(st.precision, by_step, st.cfg.stochastic_rounding,
                             lrs={r.step: r.lr for r in records})
    if line and line not in st.notes:
        st.notes.append(line)
    tokens_per_s = n_in_tokens / train_wall if train_wall > 0 else 0.0
    flops, run_mfu = _flops_and_mfu(st, tokens_per_s)
    return RunSummary(
        steps=len(records), tokens=int(sum(r.tokens for r in records)),
        tokens_per_s=tokens_per_s,
        model_flops_per_token=flops.model if flops else None,
        hardware_flops_per_token=flops.hardware if flops else None, mfu=run_mfu,
        peak_vram_gib=max(peaks) if peaks else None,
        peak_host_rss_gib=max((r.host_rss_gib for r in records), default=host_rss_gib()),
        peak_host_tensors_gib=max(tensor_peaks) if tensor_peaks else None,
        final_loss=records[-1].loss if records else None,
        eval_loss=last_eval.eval_loss if last_eval else None,
        skipped_steps=sum(r.skipped for r in records), nonfinite_steps=sum(r.nonfinite for r in records),
        first_nonfinite_step=st.first_nonfinite, wall_s=wall, stopped_reason=stopped_reason,
        precision_used=st.precision, device=st.device,
        trainable_params=st.info.trainable_params, total_params=st.info.total_params,
        eval_accuracy=last_eval.eval_accuracy if last_eval else None,
        eval_perplexity=last_eval.eval_perplexity if last_eval else None,
        data_hash=st.data_hash.hex(), init_hash=st.init_hash,
        micro_batch_size=st.cfg.micro_batch_size, grad_accum_steps=st.cfg.grad_accum_steps, notes=st.notes,
        grad_fp16_underflow_share=float(underflow) if underflow is not None else None,
        lost_updates=lost, lost_updates_by_step=by_step or None, optimizer=st.cfg.optimizer,
        weights_dtype=weights_dtype(st.params),
        # The loop only records the out-of-memory stop; what to change comes from the estimator.
        advice=oom_advice(st.cfg, world_size=st.dist.world) if stopped_reason == "out_of_memory" else None,
        variant=st.variant, world_size=st.dist.world, sample_s=sample_s,
        **(st.objective.summary() if st.objective is not None else {}),
    )


def finish(st: RunState, step: int, stopped_reason: str, wall: float, underflow,
           cb_error: Optional[CallbackError] = None, sampler: Optional[Sampler] = None) -> TrainResult:
    """Final evaluation, the last samples, summary, outputs and ``on_run_end``; then a callback's error, with the
    result on it."""
    try:
        ended_well = stopped_reason not in ("interrupted", "out_of_memory", "callback_error", "reward_error")
        if sampler is not None and sampler.prompts and ended_well:
            before = sampler.seconds
            try:   # every rank answers (a sharded model's forward needs them all); rank 0 alone has callbacks
                sampler.final(step)
            except StopTraining:
                pass
            except CallbackError as e:
                cb_error = e
            # the loop's clock stopped before these answers: wall_s is the whole run, sample_s in it
            wall += sampler.seconds - before
        # sharded, every rank takes part in each forward (rank 0 alone has callbacks and keeps the record)
        if ended_well and st.data.eval and (st.dist.rank == 0 or st.dist.sharded):
            try:
                run_eval(st, step)
            except StopTraining:
                pass
            except CallbackError as e:
                cb_error = e
        model = st.model
        if st.dist.world > 1 or st.dist.sharded:
            # the model lives in the workers: rank 0 keeps it whole (consolidated from the shards under FSDP)
            model = consolidated_model(st)
            if model is not None and st.cfg.output_dir and ended_well:
                path = save_model(model, st.tokenizer, st.cfg, Path(st.cfg.output_dir) / FINAL_MODEL_DIR)
                st.notes.append(f"final model: {path} (save_pretrained{', adapter' if st.cfg.method != 'full' else ''}"
                                f"{', consolidated from the shards' if st.dist.sharded else ''})")
        summary = summarize(st, stopped_reason, wall, underflow, sampler)
        samples = sampler.records if sampler is not None else []
        result = TrainResult(history=frame(st.records, STEP_FIELDS), eval_history=frame(st.evals, EVAL_FIELDS),
                             summary=summary, model=model, tokenizer=st.tokenizer, config=st.cfg, info=st.info,
                             records=st.records, samples=sample_frame(samples), sample_records=list(samples),
                             chat=sampler.chat if sampler is not None else False,
                             rollouts=(st.objective.rollout_frame() if hasattr(st.objective, "rollout_frame")
                                       else pd.DataFrame()))
        if st.cfg.output_dir and st.dist.rank == 0:
            write_outputs(result, st.cfg.output_dir)
        # Every callback hears the end, even after one of them failed.
        errors = st.cbs.fire_all("on_run_end", result)
    finally:
        st.dist.close()
        st.restore.close()
    cb_error = cb_error or (errors[0] if errors else None)
    if cb_error is not None:
        cb_error.result = result
        raise cb_error
    return result


FINAL_MODEL_DIR = "model"   # output_dir/model: a multi-process run's final model, in Hugging Face format


def consolidated_model(st: RunState):
    """Rank 0's whole model at the end of a multi-process run; None on the other ranks. Sharded (FSDP), every
    rank takes part in gathering the full state dict onto rank 0's CPU, which loads it into a fresh, unsharded
    copy of the model (the same build as prepare's): the model a single process would return."""
    if not st.dist.sharded:
        return st.model if st.dist.rank == 0 else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..models import build_model
    from ..models.tensors import apply_tensor_precision
    from .rng import RunRng

    full = get_model_state_dict(st.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if st.dist.rank != 0:
        return None
    with RunRng(st.cfg.seed, "cpu").active():   # its initial weights are overwritten; no one else's RNG moves
        plain = build_model(st.cfg, st.tokenizer, st.data.num_labels, st.precision, "cpu",
                            label_names=st.data.label_names)
    apply_tensor_precision(plain, st.spec, False)   # bf16-pure: bf16 weights, as trained
    plain.load_state_dict(full, strict=True)
    return plain.eval()


def write_outputs(result: TrainResult, output_dir) -> Path:
    """Write config.yaml, history.csv, eval_history.csv and summary.json under ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.config.to_yaml(out / "config.yaml")
    result.history.to_csv(out / "history.csv", index=False)
    result.eval_history.to_csv(out / "eval_history.csv", index=False)
    if len(result.samples):
        result.samples.to_csv(out / "samples.csv", index=False)
    (out / "summary.json").write_text(json.dumps(dict(result.summary), indent=2, default=str))
    return out
