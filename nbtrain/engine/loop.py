"""The training loop: one function, top to bottom (DESIGN rule 3), plus train() and start()."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch
import torch.nn.functional as F

from ..config import TrainConfig
from ..hardware import capabilities, default_device
from .callbacks import CallbackError, CallbackList, StopTraining
from .distributed import agree, all_reduce_sum, close_distributed, init_distributed, shard, wrap_ddp
from .doctor import grad_underflow_share
from .losses import chunked_loss_sum, split_for_chunked_loss
from .checkpoint import check_resumable, load_checkpoint, save_checkpoint, trainable_state
from .precision import PRECISION_TABLE, autocast, global_torch_state, make_scaler
from .records import STEP_FIELDS, EvalRecord, RunInfo, StepRecord
from .rng import RunRng
from .telemetry import device_memory_gib, host_rss_gib, reset_peak
from .threads import spawn


# ---------------------------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a run leaves: its history (one row per optimizer step), summary, model and tokenizer."""

    history: pd.DataFrame
    eval_history: pd.DataFrame
    summary: dict[str, Any]
    model: Any
    tokenizer: Any
    config: TrainConfig
    info: Optional[RunInfo] = None
    records: list[StepRecord] = field(default_factory=list, repr=False)

    def figure(self):
        """Loss, grad norm, loss scale and memory of this run as a plotly Figure."""
        from ..viz.figures import run_figure  # drawing lives in viz/, imported only when asked

        return run_figure(self.history, self.eval_history, self.info)

    def save(self, path, merged: bool = False) -> Path:
        """Write what a user would share: adapter (or full model), tokenizer and nbtrain.yaml."""
        from ..models import save_model

        return save_model(self.model, self.tokenizer, self.config, path, merged=merged)

    def diagnose(self):
        """Findings about precision trouble (overflow, nan, spikes, a stuck scale) with evidence and advice."""
        from .doctor import diagnose

        return diagnose(self.history, self.summary, self.config)

    def __repr__(self) -> str:
        s = self.summary
        return (f"TrainResult(steps={s.get('steps')}, final_loss={s.get('final_loss')}, "
                f"precision={s.get('precision_used')}, stopped_reason={s.get('stopped_reason')!r})")


def _frame(rows: list, columns: tuple[str, ...] | list[str]) -> pd.DataFrame:
    return pd.DataFrame([r.to_dict() for r in rows], columns=list(columns))


_EVAL_FIELDS = ("step", "eval_loss", "eval_tokens", "eval_accuracy", "eval_perplexity")


# ---------------------------------------------------------------------------------------------------------------
# Pieces the loop calls
# ---------------------------------------------------------------------------------------------------------------
def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Sum (not mean) of the per-target losses in fp32, so a step can divide by its own token count."""
    if task == "causal-lm":
        # Shift the labels, not the logits: slicing the logits would copy all of them (GBs for big vocabularies).
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, reduction="sum")
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def micro_loss_sum(model, mb, task: str, spec, device: str, chunk_tokens: Optional[int] = None,
                   parts=None, compiled: bool = False) -> torch.Tensor:
    """Sum of one micro-batch's per-target losses in fp32, the forward under autocast.

    Nothing here reads a device value back (the model's own mask logic may: transformers checks the mask on
    the host in eager mode). ``chunk_tokens`` (causal LM): the chunked loss, with ``parts`` its (decoder, head)
    and ``compiled`` its per-chunk softmax gradient compiled. The logits are not kept past the loss: backward
    needs only what the autograd graph holds.
    """
    mask = mb.attention_mask
    with autocast(spec, device):
        if chunk_tokens and task == "causal-lm":
            return chunked_loss_sum(model, mb.input_ids, mask, mb.labels, chunk_tokens, parts=parts,
                                    n_targets=mb.n_targets, compiled=compiled)
        logits = model(input_ids=mb.input_ids, attention_mask=mask).logits
    return loss_sum(logits, mb.labels, task)


def compile_blocks(model, **compile_kwargs) -> list[torch.nn.Module]:
    """torch.compile, in place, each block of the model's largest stack of identical blocks (its decoder or
    encoder layers); the whole model when it has no such stack. Returns what was compiled, for ``uncompile``.

    Per block rather than the whole model: one compiled graph serves every layer (compile time does not grow
    with depth), parameter names and saving are unchanged, the chunked loss (which calls the decoder, not the
    model's forward) and DDP run the same compiled layers, and transformers' mask logic stays eager, so an
    unpadded batch still reaches SDPA as ``is_causal`` (flash) -- traced, it would build an explicit mask.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    best, best_n = None, 0
    for mod in base.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 and len({type(m) for m in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = mod, n
    blocks = list(best) if best is not None else [model]
    for block in blocks:
        block.compile(**compile_kwargs)
    return blocks


def uncompile(blocks: list[torch.nn.Module]) -> None:
    """Undo ``compile_blocks``: the model a run returns runs eagerly (generation would recompile per shape)."""
    for block in blocks:
        if hasattr(block, "_compiled_call_impl"):
            block._compiled_call_impl = None


def make_scheduler(optimizer, name: str, warmup: int, total: int):
    """Linear warm-up, then constant, linear or cosine decay to zero at ``total`` real steps."""
    def factor(done: int) -> float:
        if warmup and done < warmup:
            return (done + 1) / (warmup + 1)
        if name == "constant":
            return 1.0
        progress = min(1.0, (done - warmup) / max(1, total - warmup))
        if name == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _grad_norm(params: list[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
    """Total L2 norm of the (already unscaled) gradients; clips in place when max_norm is set."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.nn.utils.clip_grad_norm_(params, float("inf"))


def weights_hash(model: torch.nn.Module) -> str:
    """A short hash of every parameter and buffer, to prove two runs started from the same weights."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(list(model.state_dict().items()), key=lambda kv: kv[0]):
        if not isinstance(t, torch.Tensor):
            continue
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def evaluate(model, examples: list[dict], task: str, pad_token_id: int, batch_size: int,
             spec, device: str, chunk_tokens: Optional[int] = None) -> dict[str, float]:
    """Mean loss per target token (and accuracy for classification) on ``examples``.

    ``chunk_tokens`` (causal LM): the loss chunk by chunk, as in training with ``chunked_loss``, so that an
    evaluation never needs the full logits a chunked training run was set up to avoid.
    """
    from ..data import iter_steps

    if not examples:
        return {}
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=device, dtype=torch.float64)
    total_targets = 0
    correct = torch.zeros((), device=device, dtype=torch.long)
    n_batches = math.ceil(len(examples) / batch_size)
    # iter_steps with accum 1 gives micro-batches; order is irrelevant for a mean.
    it = iter_steps(examples, batch_size, 1, 0, pad_token_id, task)
    try:
        for _ in range(n_batches):
            _, (mb,) = next(it)
            mb = mb.to(device)
            if task == "causal-lm":   # the training step's loss, chunked when it is
                total_loss += micro_loss_sum(model, mb, task, spec, device, chunk_tokens).double()
            else:                     # the logits are needed for the accuracy
                with autocast(spec, device):
                    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                total_loss += loss_sum(logits, mb.labels, task).double()
                correct += (logits.argmax(-1) == mb.labels).sum()
            total_targets += mb.n_targets
    finally:
        model.train(was_training)
    out = {"eval_loss": total_loss.item() / max(1, total_targets), "eval_tokens": total_targets}
    if task == "causal-lm":
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
    else:
        out["eval_accuracy"] = correct.item() / max(1, total_targets)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------
def _run(cfg: TrainConfig, callbacks=None, stop_event: Optional[threading.Event] = None,
         variant: Optional[str] = None, hash_init: bool = False) -> TrainResult:
    from ..data import load_data, iter_steps, steps_per_epoch
    from ..models import build_model, count_params, load_tokenizer
    from ..models.lean import lean_layers

    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(cfg).__name__}")
    stop_event = stop_event or threading.Event()
    device = default_device()
    # Under torchrun / accelerate launch: one process per rank, the same loop; rank 0 alone observes and writes.
    dist_ctx = init_distributed(device)
    rank, world = (dist_ctx.rank, dist_ctx.world) if dist_ctx else (0, 1)
    cbs = CallbackList(callbacks if rank == 0 else [])
    stop_file = os.environ.get("NBTRAIN_STOP_FILE")
    caps = capabilities(device)
    precision = cfg.resolved_precision()
    spec = PRECISION_TABLE[precision]
    policy = cfg.nonfinite or ("skip" if spec.scaler else "stop")

    run_id = uuid.uuid4().hex[:8]   # names this run's temporary files
    cb_error: Optional[CallbackError] = None

    with global_torch_state(spec):
        # Data first (fails fast on bad input). Whatever it draws at random is not the caller's: each run
        # draws from its own stream (data order has its own seeded generators).
        with RunRng(cfg.seed, device).active():
            tokenizer = load_tokenizer(cfg)
            data = load_data(cfg, tokenizer)
        # The run's stream, from a fresh seed so the initial weights do not depend on how much randomness data
        # loading used; initial weights, dropout and the batch-size probe draw from it alone, never from the
        # caller's or a concurrent run's.
        rng = RunRng(cfg.seed, device)
        with rng.active():
            model = build_model(cfg, tokenizer, data.num_labels, precision, device, label_names=data.label_names)
        init_hash = weights_hash(model) if hash_init else None
        params = [p for p in model.parameters() if p.requires_grad]
        trainable, total_params = count_params(model)
        notes: list[str] = []
        lean = None
        if cfg.lean_layers:   # before the batch-size probe, which should measure what training will keep
            if cfg.compile:
                notes.append("lean_layers: not applied under compile=True (the compiled graph chooses what backward "
                             "keeps; lean's functions would be traced through for no further saving)")
            else:
                lean = lean_layers(model)
                notes.append(lean.describe())
        chunked = cfg.chunked_loss and data.task == "causal-lm"
        if cfg.auto_batch_size:
            with rng.active():   # the probe's dropout draws are put back with the run's state
                cfg, note = _auto_batch_size(cfg, model, params, data, spec, device,
                                             cfg.loss_chunk_tokens if chunked else None)
            notes.append(note)
        fwd_model = wrap_ddp(model, dist_ctx) if dist_ctx else model
        loss_parts = None
        if chunked:
            if dist_ctx:
                raise ValueError("chunked_loss: not supported with several processes yet (DDP must see the "
                                 "whole forward); set chunked_loss=False")
            loss_parts = split_for_chunked_loss(model)   # fail before step 1 if the model cannot use it
        # The first steps pay the compile time; step_time_s shows it.
        compiled = compile_blocks(model) if cfg.compile else []
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      fused=(device == "cuda"))
        spe = steps_per_epoch(len(data.train), cfg.micro_batch_size, cfg.grad_accum_steps)
        total_steps = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(cfg.epochs * spe))
        scheduler = make_scheduler(optimizer, cfg.scheduler, cfg.warmup_steps, total_steps)
        scaler = make_scaler(spec, device)   # disabled (a no-op) unless the precision needs loss scaling
        prev_scale = scaler.get_scale() if spec.scaler else None
        records: list[StepRecord] = []
        evals: list[EvalRecord] = []
        data_hash = b""
        first_nonfinite: Optional[int] = None
        start_step = 0
        if cfg.resume_from:
            ck = load_checkpoint(cfg.resume_from)
            check_resumable(ck["config"], cfg, ck["path"])
            notes.extend(ck.get("notes", []))
            named = dict(model.named_parameters())
            for n, t in ck["model"].items():
                named[n].data.copy_(t)
            optimizer.load_state_dict(ck["optimizer"])
            scheduler.load_state_dict(ck["scheduler"])
            scaler.load_state_dict(ck["scaler"])
            rng.load_state_dict(ck["rng"])
            records = [StepRecord(**r) for r in ck["records"]]
            evals = [EvalRecord(**r) for r in ck["evals"]]
            start_step, prev_scale = ck["step"], ck["prev_scale"]
            data_hash, first_nonfinite = bytes.fromhex(ck["data_hash"]), ck["first_nonfinite"]
            notes.append(f"resumed from {ck['path']} at step {start_step}")

        info = RunInfo(config=cfg, precision_used=precision, device=device, device_name=caps.name,
                       device_total_gib=caps.total_memory_gib, scaler_enabled=spec.scaler,
                       total_steps=total_steps, train_examples=len(data.train), eval_examples=len(data.eval),
                       trainable_params=trainable, total_params=total_params,
                       max_grad_norm=cfg.max_grad_norm, variant=variant, model=model)
        stopped_reason = "max_steps" if cfg.max_steps is not None else "epochs"
        eval_bs = cfg.micro_batch_size
        ckpt_dir = Path(cfg.output_dir) / "checkpoints" if cfg.output_dir and rank == 0 else None

        def run_eval(step: int) -> None:
            res = evaluate(model, data.eval, data.task, data.pad_token_id, eval_bs, spec, device,
                           cfg.loss_chunk_tokens if chunked else None)
            if res:
                rec = EvalRecord(step=step, variant=variant, **res)
                evals.append(rec)
                cbs.fire("on_eval", rec)

        model.train()
        optimizer.zero_grad(set_to_none=True)
        reset_peak(device)
        stop_requested = False
        try:
            cbs.fire("on_run_start", info)
        except StopTraining:
            stop_requested = True
            stopped_reason = "stopped"
        except CallbackError as e:
            stop_requested, stopped_reason, cb_error = True, "callback_error", e
        t_start = t_prev = time.perf_counter() - (records[-1].elapsed_s if records else 0.0)
        # Every rank walks the same global order; global micro-batches of micro x world rows, each rank takes
        # its share, so N processes x micro m see exactly the examples of 1 process x micro N*m.
        batches = iter_steps(data.train, cfg.micro_batch_size * world, cfg.grad_accum_steps, cfg.seed,
                             data.pad_token_id, data.task, start_step=start_step)
        step = start_step
        underflow = None
        try:
            while step < total_steps and not stop_requested:
                stop_now = stop_event.is_set() or bool(stop_file and os.path.exists(stop_file))
                if world > 1:
                    stop_now = agree(stop_now, dist_ctx)   # every rank must leave the loop at the same step
                if stop_now:
                    stopped_reason = "stopped"
                    break
                step += 1
                epoch, micro = next(batches)
                # The step's loss is normalised by ALL its target tokens (rule 4): count them up front, on the
                # host, from the collated batches, so no micro-batch needs a device read.
                n_targets = sum(mb.n_targets for mb in micro)
                n_tokens = sum(mb.n_tokens for mb in micro)
                loss_acc = torch.zeros((), device=device)
                # Fairness fingerprint: the real (unpadded) token ids of this step, independent of how the step
                # is cut into micro-batches; chained as bytes (not a hashlib object) so it survives a checkpoint.
                step_ids = b"".join(mb.input_ids[mb.attention_mask.bool()].numpy().tobytes() for mb in micro)
                if data.task != "causal-lm":   # class labels are data too
                    step_ids += b"".join(mb.labels.numpy().tobytes() for mb in micro)
                data_hash = hashlib.blake2b(data_hash + step_ids, digest_size=8).digest()
                local = micro if world == 1 else [shard(mb, data, rank, world) for mb in micro]
                with rng.active():   # dropout draws from this run's stream only
                    for i, mb in enumerate(local):
                        # Pinned host memory: the copy is queued without waiting for the GPU (a pageable one waits).
                        mb = (mb.pin_memory() if device == "cuda" else mb).to(device, non_blocking=True)
                        # DDP: all-reduce gradients only on the step's last micro-batch.
                        sync = world == 1 or i == len(local) - 1
                        with contextlib.nullcontext() if sync else fwd_model.no_sync():
                            loss = micro_loss_sum(fwd_model, mb, data.task, spec, device,
                                                  cfg.loss_chunk_tokens if chunked else None, loss_parts,
                                                  cfg.compile) / n_targets
                            if mb.n_targets == 0:
                                loss = loss * 0.0   # a rank left without rows in a short batch still joins the all-reduce
                            # DDP averages gradients over ranks; x world makes that the global sum. scale() is the
                            # identity when the scaler is disabled.
                            scaler.scale(loss * world if world > 1 else loss).backward()
                        loss_acc += loss.detach()
                        del loss
                # Last micro-batch done: bring gradients back to their true scale before measuring them.
                scaler.unscale_(optimizer)
                if step == 1:   # one cheap sample (before clipping) for the doctor's fp16-underflow check
                    underflow = grad_underflow_share(params)
                norm = _grad_norm(params, cfg.max_grad_norm)
                lr = optimizer.param_groups[0]["lr"]
                if world > 1:
                    all_reduce_sum(loss_acc)   # the step's loss over every rank's tokens
                # SYNC POINT (one per step): loss and grad norm to the host. A GradScaler step reads found_inf
                # anyway, and without a scaler we must know finiteness before stepping.
                loss_v, norm_v = torch.stack([loss_acc.float(), norm.float().to(loss_acc.device)]).tolist()
                nonfinite = not (math.isfinite(loss_v) and math.isfinite(norm_v))
                if nonfinite and first_nonfinite is None:
                    first_nonfinite = step
                if spec.scaler:
                    scaler.step(optimizer)               # skips internally when the gradients hold inf/nan
                    scaler.update()
                    scale = scaler.get_scale()
                    skipped = scale < prev_scale         # the scale only drops when the step was skipped
                    prev_scale = scale
                else:
                    scale = None
                    skipped = nonfinite and policy != "continue"
                    if not skipped:
                        optimizer.step()
                if not skipped:
                    scheduler.step()                     # real steps only: a skipped step does not advance the lr
                optimizer.zero_grad(set_to_none=True)

                now = time.perf_counter()
                alloc, reserved, peak = device_memory_gib(device)
                reset_peak(device)
                dt = now - t_prev
                t_prev = now
                rec = StepRecord(
                    step=step, epoch=epoch, micro_steps=len(micro), tokens=n_targets, loss=loss_v, lr=lr,
                    grad_norm=norm_v,
                    clipped=bool(cfg.max_grad_norm) and not nonfinite and norm_v > cfg.max_grad_norm,
                    scale=scale, skipped=bool(skipped), nonfinite=nonfinite,
                    vram_allocated_gib=alloc, vram_reserved_gib=reserved, vram_peak_gib=peak,
                    host_rss_gib=host_rss_gib(), step_time_s=dt, tokens_per_s=n_tokens / dt if dt > 0 else 0.0,
                    elapsed_s=now - t_start, variant=variant,
                )
                records.append(rec)
                try:
                    cbs.fire("on_step_end", rec)
                    if nonfinite and policy == "stop":
                        stopped_reason = "nonfinite"
                        break
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                        run_eval(step)
                    if cfg.save_every and step % cfg.save_every == 0:
                        save_checkpoint(ckpt_dir, step, {
                            "step": step, "model": trainable_state(model), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "rng": rng.state_dict(), "prev_scale": prev_scale, "data_hash": data_hash.hex(),
                            "first_nonfinite": first_nonfinite, "records": [r.to_dict() for r in records],
                            "evals": [r.to_dict() for r in evals], "config": cfg.to_dict()}, cfg.to_yaml(),
                            run_id=run_id)
                except StopTraining:
                    if world == 1:
                        stopped_reason = "stopped"
                        break
                    stop_event.set()   # the other ranks learn it at the next step's agreement
                except CallbackError as e:   # the run ends here, and keeps all it has (raised after finish)
                    stopped_reason, cb_error = "callback_error", e
                    break
        except KeyboardInterrupt:
            stopped_reason = "interrupted"
        except (torch.OutOfMemoryError, MemoryError) as e:
            stopped_reason = "out_of_memory"
            notes.append(f"out of memory at step {step}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            # Whatever ended the run, leave the model usable: no half-accumulated gradients, no cached blocks,
            # no compiled layers.
            optimizer.zero_grad(set_to_none=True)
            uncompile(compiled)
            if lean is not None:
                lean.undo()
            if stopped_reason == "out_of_memory":
                import gc

                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
        wall = time.perf_counter() - t_start
        if stopped_reason not in ("interrupted", "out_of_memory", "callback_error") and data.eval and rank == 0:
            try:
                run_eval(step)
            except StopTraining:
                pass
            except CallbackError as e:
                cb_error = e

        summary = _summary(records, evals, stopped_reason, precision, device, wall, trainable, total_params,
                           first_nonfinite)
        summary["data_hash"] = data_hash.hex()
        summary["init_hash"] = init_hash
        summary["micro_batch_size"] = cfg.micro_batch_size
        summary["grad_accum_steps"] = cfg.grad_accum_steps
        summary["notes"] = notes
        summary["grad_fp16_underflow_share"] = float(underflow) if underflow is not None else None
        if stopped_reason == "out_of_memory":
            summary["advice"] = _oom_advice(cfg)
        if variant is not None:
            summary["variant"] = variant
        result = TrainResult(history=_frame(records, STEP_FIELDS), eval_history=_frame(evals, _EVAL_FIELDS),
                             summary=summary, model=model, tokenizer=tokenizer, config=cfg, info=info,
                             records=records)
        summary["world_size"] = world
        if cfg.output_dir and rank == 0:
            write_outputs(result, cfg.output_dir)
        try:
            # Every callback hears the end, even after one of them failed.
            errors = cbs.fire_all("on_run_end", result)
        finally:
            if dist_ctx:
                close_distributed(dist_ctx)
        cb_error = cb_error or (errors[0] if errors else None)
        if cb_error is not None:
            cb_error.result = result
            raise cb_error
        return result


def _auto_batch_size(cfg: TrainConfig, model, params, data, spec, device,
                     chunk_tokens: Optional[int]) -> tuple[TrainConfig, str]:
    """Largest micro batch (a divisor of the effective batch) whose forward+backward on the longest rows fits."""
    from ..data import collate

    eff = cfg.effective_batch_size
    longest = sorted(range(len(data.train)), key=lambda i: -len(data.train[i]["input_ids"]))
    rng = torch.get_rng_state()  # the trials must not shift dropout randomness of the real run
    tried = []
    chosen = None
    for m in [d for d in range(eff, 0, -1) if eff % d == 0]:
        rows = [data.train[longest[i % len(longest)]] for i in range(m)]
        mb = collate(rows, data.pad_token_id, data.task).to(device)
        try:   # the same forward and loss as the run's (chunked or not)
            micro_loss_sum(model, mb, data.task, spec, device, chunk_tokens).backward()
            chosen = m
        except (torch.OutOfMemoryError, MemoryError):
            tried.append(m)
        finally:
            for p in params:
                p.grad = None
            if device == "cuda":
                torch.cuda.empty_cache()
        if chosen:
            break
    torch.set_rng_state(rng)
    if chosen is None:
        raise torch.OutOfMemoryError(f"auto_batch_size: even micro_batch_size=1 does not fit "
                                     f"(max_seq_len={cfg.max_seq_len}); shorten max_seq_len or use LoRA/QLoRA")
    new = cfg.replace(micro_batch_size=chosen, grad_accum_steps=eff // chosen, auto_batch_size=False)
    note = (f"auto_batch_size: micro_batch_size={chosen} x grad_accum_steps={eff // chosen} "
            f"(effective batch {eff} kept; {tried or 'no'} sizes ran out of memory)")
    return new, note


def _oom_advice(cfg: TrainConfig) -> list[str]:
    """The out-of-memory flow as concrete changes, from estimate_memory(), asked for a 25% cut."""
    try:
        from ..memory import estimate_memory

        est = estimate_memory(cfg)
        target = min(est.total_gib, est.device_total_gib) * 0.75
        return [a.description for a in estimate_memory(cfg, device_total_gib=target).advice]
    except Exception as e:  # advice is a courtesy; never let it mask the real stop reason
        return [f"(no estimate available: {type(e).__name__}: {e}) lower micro_batch_size and raise "
                "grad_accum_steps, enable gradient_checkpointing, or switch to method='lora'/'qlora'"]


def _summary(records, evals, stopped_reason, precision, device, wall, trainable, total_params, first_nonfinite):
    peaks = [r.vram_peak_gib for r in records if r.vram_peak_gib is not None]
    n_in_tokens = sum(r.tokens_per_s * r.step_time_s for r in records)
    s: dict[str, Any] = {
        "steps": len(records),
        "tokens": int(sum(r.tokens for r in records)),
        "tokens_per_s": n_in_tokens / wall if wall > 0 else 0.0,
        "peak_vram_gib": max(peaks) if peaks else None,
        "peak_host_rss_gib": max((r.host_rss_gib for r in records), default=host_rss_gib()),
        "final_loss": records[-1].loss if records else None,
        "eval_loss": evals[-1].eval_loss if evals else None,
        "skipped_steps": sum(r.skipped for r in records),
        "nonfinite_steps": sum(r.nonfinite for r in records),
        "first_nonfinite_step": first_nonfinite,
        "wall_s": wall,
        "stopped_reason": stopped_reason,
        "precision_used": precision,
        "device": device,
        "trainable_params": trainable,
        "total_params": total_params,
    }
    if evals and evals[-1].eval_accuracy is not None:
        s["eval_accuracy"] = evals[-1].eval_accuracy
    if evals and evals[-1].eval_perplexity is not None:
        s["eval_perplexity"] = evals[-1].eval_perplexity
    return s


def write_outputs(result: TrainResult, output_dir) -> Path:
    """Write config.yaml, history.csv, eval_history.csv and summary.json under ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.config.to_yaml(out / "config.yaml")
    result.history.to_csv(out / "history.csv", index=False)
    result.eval_history.to_csv(out / "eval_history.csv", index=False)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, default=str))
    return out


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
