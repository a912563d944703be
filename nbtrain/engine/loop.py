"""The training loop, top to bottom (DESIGN rule 3), between prepare() and finish(); plus train() and start().

Each optimizer step: autocast forward -> loss over the step's target tokens -> scaled backward, for every
micro-batch -> unscale -> measure the norm -> clip -> scaler step/update -> detect a skip -> scheduler on real
steps only -> zero grads -> one StepRecord. The optimizer is whichever the config names (engine/optimizers.py);
the weights' precision (bf16-pure, fp8) was applied to the model in prepare(), so the loop is the same for all. A disabled GradScaler and a single process (``SingleProcess``) are
the no-op cases of loss scaling and of distribution, so the loop asks neither "fp16?" nor "distributed?".
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Optional

import torch

from ..config import TrainConfig
from .callbacks import CallbackError, StopTraining
from .checkpoint import save_run
from .distributed import grad_norm
from .doctor import grad_underflow_share
from .fingerprint import chain_step
from .finish import TrainResult, finish, run_eval, undo
from .prepare import RunState, prepare
from .records import StepRecord
from .rewards import RewardError
from .sampling import Sampler
from .telemetry import device_memory_gib, host_rss_gib, reset_peak
from .threads import spawn


def _run(cfg: TrainConfig, callbacks=None, stop_event: Optional[threading.Event] = None, variant: Optional[str] = None,
         hash_init: bool = False, timing: Optional[str] = None, perturb_init=None) -> TrainResult:
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(cfg).__name__}")
    stop_event = stop_event or threading.Event()
    st = prepare(cfg, callbacks, variant=variant, hash_init=hash_init, perturb_init=perturb_init)
    st.info.timing = timing
    cfg, dist, device, optimizer, scaler = st.cfg, st.dist, st.device, st.optimizer, st.scaler
    objective = st.objective   # the loss of a micro-batch: next-token, DPO / ORPO / SimPO, or GRPO (engine.grpo_run)
    stopped_reason = "max_steps" if cfg.max_steps is not None else "epochs"
    cb_error: Optional[CallbackError] = None
    step, underflow = st.start_step, None
    sampler = Sampler(st)   # sample prompts' answers; without prompts it is never due
    st.model.train()
    optimizer.zero_grad(set_to_none=True)
    reset_peak(device)
    try:
        st.cbs.fire("on_run_start", st.info)
    except StopTraining:
        stop_event.set()
    except CallbackError as e:
        stop_event.set()
        stopped_reason, cb_error = "callback_error", e
    t_start = t_prev = time.perf_counter() - (st.records[-1].elapsed_s if st.records else 0.0)
    # The data's steps (every rank the same global order, each its share), or GRPO's rollouts, drawn from the model
    batches = objective.batches(st.start_step)
    try:
        while step < st.total_steps:
            # Every rank must leave the loop at the same step.
            if dist.agree(stop_event.is_set() or bool(st.stop_file and os.path.exists(st.stop_file))):
                stopped_reason = "callback_error" if cb_error else "stopped"
                break
            step += 1
            epoch, micro = next(batches)
            # The step's loss is normalised by ALL its target tokens (rule 4): counted up front, on the host,
            # from the collated batches, so no micro-batch needs a device read.
            n_targets = sum(mb.n_targets for mb in micro)
            n_units = sum(mb.loss_units for mb in micro)   # target tokens, or pairs for a preference objective
            n_pairs = sum(getattr(mb, "n_pairs", 0) for mb in micro)
            n_tokens = sum(mb.n_tokens for mb in micro)
            st.data_hash = chain_step(st.data_hash, micro, st.data.task)
            loss_acc = torch.zeros((), device=device)
            stats_acc = torch.zeros(objective.n_stats, device=device)   # preference: reward sums; lm: empty
            local = dist.shard(micro, st.data)
            st.host_tensors.begin_step(step)   # CPU run-tensor count on sampled steps only (it costs the loop)
            objective.begin_step(step)
            with st.rng.active():   # dropout draws from this run's stream only
                for i, mb in enumerate(local):
                    # Pinned host memory: the copy is queued without waiting for the GPU (a pageable one waits).
                    mb = (mb.pin_memory() if device == "cuda" else mb).to(device, non_blocking=True)
                    with dist.no_sync(st.fwd_model, last=i == len(local) - 1), st.host_tensors.micro():
                        loss, stats = objective.micro_loss(st.fwd_model, mb)
                        loss = loss / n_units
                        if mb.n_targets == 0:
                            # a rank left without rows in a short batch still joins the all-reduce
                            loss, stats = loss * 0.0, stats * 0.0
                        scaler.scale(dist.global_sum(loss)).backward()   # scale(): identity when disabled
                    loss_acc += loss.detach()
                    stats_acc += stats
                    del loss
            # Last micro-batch done: bring gradients back to their true scale before measuring them.
            scaler.unscale_(optimizer)
            if step == 1:   # one cheap sample (before clipping) for the doctor's fp16-underflow check
                underflow = grad_underflow_share(st.params)
            norm = dist.grad_norm(st.params, cfg.max_grad_norm)   # over every rank's shards under FSDP
            lr = optimizer.param_groups[0]["lr"]
            st.lost.before(step, lr)   # on sampled steps: the weights before the update, to count what it lost
            dist.all_reduce_sum(loss_acc)   # the step's loss over every rank's tokens
            if objective.n_stats:
                dist.all_reduce_sum(stats_acc)
            # SYNC POINT (one per step): loss, grad norm (and a preference step's reward sums) to the host. A
            # GradScaler step reads found_inf anyway, and without a scaler we must know finiteness before stepping.
            loss_v, norm_v, *stats_v = torch.cat([torch.stack([loss_acc.float(), norm.float().to(loss_acc.device)]),
                                                  stats_acc]).tolist()
            # a non-finite reward is a non-finite step (never averaged away); record_fields names it in the notes
            nonfinite = not all(math.isfinite(v) for v in (loss_v, norm_v, *stats_v))
            if nonfinite and st.first_nonfinite is None:
                st.first_nonfinite = step
            if st.spec.scaler:
                scaler.step(optimizer)                   # skips internally when the gradients hold inf/nan
                scaler.update()
                scale = scaler.get_scale()
                skipped = scale < st.prev_scale          # the scale only drops when the step was skipped
                st.prev_scale = scale
            else:
                scale = None
                skipped = nonfinite and st.nonfinite_policy != "continue"
                if not skipped:
                    optimizer.step()
            st.lost.after(skipped)
            if not skipped:
                st.scheduler.step()                      # real steps only: a skipped step does not advance the lr
            host_tensors = st.host_tensors.step_peak()   # before zero_grad: gradients and optimizer state together
            optimizer.zero_grad(set_to_none=True)

            now = time.perf_counter()
            alloc, reserved, peak = device_memory_gib(device)
            reset_peak(device)
            dt, t_prev = now - t_prev, now
            rec = StepRecord(
                step=step, epoch=epoch, micro_steps=len(micro), tokens=n_targets, loss=loss_v, lr=lr,
                grad_norm=norm_v, clipped=bool(cfg.max_grad_norm) and not nonfinite and norm_v > cfg.max_grad_norm,
                scale=scale, skipped=bool(skipped), nonfinite=nonfinite,
                vram_allocated_gib=alloc, vram_reserved_gib=reserved, vram_peak_gib=peak,
                host_rss_gib=host_rss_gib(), host_tensors_gib=host_tensors, step_time_s=dt,
                tokens_per_s=n_tokens / dt if dt > 0 else 0.0, elapsed_s=now - t_start, variant=st.variant,
                **objective.record_fields(stats_v, n_pairs, step),
            )
            st.records.append(rec)
            try:
                st.cbs.fire("on_step_end", rec)
                if nonfinite and st.nonfinite_policy == "stop":
                    stopped_reason = "nonfinite"
                    break
                if cfg.eval_every and step % cfg.eval_every == 0 and step < st.total_steps:
                    run_eval(st, step)
                if cfg.save_every and step % cfg.save_every == 0 and st.ckpt_dir is not None:
                    save_run(st, step)
                if sampler.due(step):   # answering is no step's time: the next step's clock starts after it
                    t_prev += sampler.run(step)
            except StopTraining:
                stop_event.set()   # every rank learns it at the next step's agreement
                stopped_reason = "stopped"
            except CallbackError as e:   # the run ends, and keeps all it has (raised after finish)
                stop_event.set()
                stopped_reason, cb_error = "callback_error", e
    except RewardError as e:   # a reward function failed: the run ends, keeps its records, and says which one
        stopped_reason, cb_error = "reward_error", e
        step -= 1   # it failed drawing this step's rollouts: the step never ran
    except KeyboardInterrupt:
        stopped_reason = "interrupted"
    except (torch.OutOfMemoryError, MemoryError) as e:
        stopped_reason = "out_of_memory"
        st.notes.append(f"out of memory at step {step}: {type(e).__name__}: {str(e)[:200]}")
    except BaseException:
        st.restore.close()   # an unexpected error still puts the process-wide torch flags back
        raise
    finally:
        undo(st, stopped_reason)
    return finish(st, step, stopped_reason, time.perf_counter() - t_start, underflow, cb_error, sampler)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, callbacks=None) -> TrainResult:
    """Train in this thread until done; Ctrl-C stops cleanly and still returns the result."""
    return _run(cfg, callbacks)


class Run:
    """A run in a background thread: ``stop()``, ``wait()`` and ``done``."""

    def __init__(self, cfg: TrainConfig, callbacks=None, **kwargs):
        self.config = cfg
        self._stop = threading.Event()
        self.result: Optional[TrainResult] = None
        self.error: Optional[BaseException] = None

        def target():
            try:
                self.result = _run(cfg, callbacks, stop_event=self._stop, **kwargs)
            except BaseException as e:  # handed to wait(), never lost in the thread
                self.result = getattr(e, "result", None)   # a failed callback's run keeps its result
                self.error = e

        # Heavy imports finish on this thread first; interpreter exit stops and joins the run.
        self._thread = spawn(target, "nbtrain-run", stop=self._stop.set, cfg=cfg)

    def stop(self) -> None:
        """Ask the run to end after the current step; history and model are kept."""
        self._stop.set()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> Optional[TrainResult]:
        """Block until the run ends and return its result (re-raises an error from the run)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self.error is not None:
            raise self.error
        return self.result

    def __repr__(self) -> str:
        return f"Run(done={self.done}, stopped={self._stop.is_set()})"


def start(cfg: TrainConfig, callbacks=None) -> Run:
    """Train in a background thread so the notebook stays responsive; returns a ``Run``."""
    return Run(cfg, callbacks)


__all__ = ["RunState", "Run", "TrainResult", "grad_norm", "start", "train"]
