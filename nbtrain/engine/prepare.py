"""The prepare phase: everything a run needs before its first step, gathered in one RunState.

Data, model, method (full / LoRA / QLoRA), the speed and memory set-ups (lean layers, chunked loss, compile,
auto batch size), optimizer, scheduler, scaler and resume. What this device can run and which LoRA targets the
model has are asked here, not when the config is built, so a config written for a GPU loads anywhere.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .._logs import defers_bitsandbytes
from .schedules import make_scheduler
from ..config import TrainConfig
from ..data import DataBundle, collate, load_data, steps_per_epoch
from ..data.chat import describe_template, ensure_chat_tokens
from ..hardware import capabilities, check_runnable, default_device
from ..models import build_model, check_lora_targets, count_params, load_tokenizer
from ..models.lean import lean_layers
from ..models.loading import source_notes
from ..models.methods import method_notes
from ..models.tensors import apply_tensor_precision
from ..precision import PRECISION_TABLE, PrecisionSpec, global_torch_state
from .callbacks import CallbackList
from .checkpoint import CheckpointError, check_resumable, load_checkpoint, load_shards
from .distributed import SingleProcess, init_distributed, layer_stack
from .doctor import LostUpdates
from .fingerprint import weights_hash
from .losses import ChunkedLossError, micro_loss_sum, split_for_chunked_loss
from .optimizers import build_optimizer
from .preference import make_objective
from .records import EvalRecord, RunInfo, StepRecord
from .rng import RunRng
from .telemetry import RunTensorBytes


@dataclass
class RunState:
    """What the step loop works on; prepare() builds it, the loop and finish() read and extend it."""

    cfg: TrainConfig
    device: str
    precision: str
    spec: PrecisionSpec
    dist: SingleProcess
    cbs: CallbackList
    rng: RunRng
    run_id: str
    tokenizer: Any
    data: DataBundle
    model: torch.nn.Module
    fwd_model: torch.nn.Module            # the model the forward calls (DDP's wrapper under several processes)
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    total_steps: int
    info: RunInfo
    nonfinite_policy: str
    host_tensors: RunTensorBytes          # the run's own tensors on the CPU (StepRecord.host_tensors_gib)
    lost: LostUpdates                     # the doctor's sampled count of updates the weights' dtype lost
    chunk_tokens: Optional[int] = None    # the chunked loss's tokens per chunk; None: the plain loss
    loss_parts: Any = None                # (decoder, head): the chunked loss, or the plain loss's target rows
    compiled: list = field(default_factory=list)
    lean: Any = None
    init_hash: Optional[str] = None
    variant: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    ckpt_dir: Optional[Path] = None
    stop_file: Optional[str] = None       # a launcher's way to ask every worker to stop
    # What the run has done so far (a resume starts from the checkpoint's).
    start_step: int = 0
    records: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    data_hash: bytes = b""
    prev_scale: Optional[float] = None
    first_nonfinite: Optional[int] = None
    objective: Any = None                 # engine.preference: the loss of each micro-batch (lm, dpo, orpo, simpo)
    # Puts back the process-wide torch flags the run's precision set (closed by finish(), or on an error).
    restore: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


@defers_bitsandbytes
def prepare(cfg: TrainConfig, callbacks=None, variant: Optional[str] = None, hash_init: bool = False,
            device: Optional[str] = None, perturb_init: Optional[tuple[float, int]] = None) -> RunState:
    """Build everything the loop needs; raises (ConfigError, DataError, ModelError, CheckpointError) before any
    step runs. The process-wide torch flags of the run's precision stay set until ``state.restore`` closes.
    ``perturb_init`` (scale, seed): the initial weights perturbed as :func:`perturb_weights` does (compare()'s
    rounding band)."""
    device = device or default_device()
    caps = capabilities(device)
    precision = check_runnable(cfg, caps)   # the device's question, asked when a run needs the answer
    check_lora_targets(cfg)
    if cfg.report_to:
        # report_to's tracker callbacks (integrations/trackers.py), made now so that a tracker whose package is
        # missing fails with its pip command before any data or model loads. Imported here, not at the top: the
        # trackers sit on a higher floor, and a run without report_to never loads them.
        from ..integrations.trackers import tracker_callbacks

        callbacks = [*(callbacks or []), *tracker_callbacks(cfg)]
    restore = contextlib.ExitStack()
    restore.enter_context(global_torch_state(PRECISION_TABLE[precision]))
    try:
        st = _build(cfg, callbacks, variant, hash_init, device, caps, precision, perturb_init)
    except BaseException:
        restore.close()
        raise
    st.restore = restore
    return st


def perturb_weights(model: torch.nn.Module, scale: float, seed: int) -> str:
    """Multiply every floating-point weight by (1 + u), u drawn uniformly in [-scale, scale] from a generator of its
    own (``seed``), as rounding each weight to a format of unit roundoff ``scale`` would move it; returns the note.
    Drawn on the CPU in float32, so the same seed moves the same weights alike on any device."""
    gen = torch.Generator().manual_seed(int(seed))
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                u = torch.rand(p.shape, generator=gen, dtype=torch.float32).mul_(2 * scale).sub_(scale)
                p.mul_(u.add_(1).to(p.device, p.dtype))
                n += p.numel()
    return f"initial weights perturbed: each of {n:,} times (1 + u), u uniform in ±{scale:.3g} (draw {seed})"


def _build(cfg, callbacks, variant, hash_init, device, caps, precision, perturb_init=None) -> RunState:
    spec = PRECISION_TABLE[precision]
    # Under torchrun / accelerate launch: one process per rank, the same loop; rank 0 alone observes and writes.
    notes: list[str] = []
    cfg = adopt_launcher_sharding(cfg, notes)
    dist = init_distributed(device, cfg.sharding, spec, cfg.reshard_after_forward)
    if cfg.sharding == "fsdp" and dist.world == 1 and not dist.sharded:
        notes.append("sharding='fsdp': one process, nothing to shard (runs as sharding='none'); launch several "
                     "with nbt.launch(cfg, num_processes=N), torchrun or accelerate launch")

    # Data first (fails fast on bad input). Whatever it draws at random is not the caller's: each run draws
    # from its own stream (data order has its own seeded generators).
    with RunRng(cfg.seed, device).active():
        tokenizer = load_tokenizer(cfg)
        data = load_data(cfg, tokenizer)
        if cfg.task == "causal-lm" and "chat_template" in data.stats:
            # the chat template's markers as single tokens (the loader added them before tokenizing; a second call
            # adds nothing); build_model then sizes the embeddings to len(tokenizer). Plain text, with or without
            # sample prompts (answered as plain text), keeps the tokenizer as it is, so its losses stay the same.
            added = ensure_chat_tokens(tokenizer, cfg) + list(data.stats.get("chat_tokens_added", []))
            if added:
                notes.append(f"chat template {describe_template(tokenizer, cfg)}: added special tokens "
                             f"{', '.join(added)} to the tokenizer; the embeddings grow to {len(tokenizer)} rows")
        notes.extend(getattr(data, "notes", None) or [])   # e.g. preference prompts cut from the left
        if data.stats.get("packed_attention"):   # which way packed chat examples were kept apart (issue 26.5)
            notes.append(f"packing: {data.stats['packed_attention']}")
        if data.stats.get("truncated_examples") or data.stats.get("dropped_no_answer"):
            notes.append(f"chat data: {data.stats['truncated_examples']} example(s) cut to max_seq_len={cfg.max_seq_len} "
                         f"at a turn or inside an answer, {data.stats['dropped_no_answer']} dropped (no answer token "
                         "left)")
        if data.stats.get("history_trimmed"):
            notes.append(f"chat data: {data.stats['history_trimmed']} conversation(s) longer than max_seq_len="
                         f"{cfg.max_seq_len} kept their last answer by dropping their earliest turns (train_on='last', "
                         "as LLaMA-Factory's mask_history)")
    # The run's stream, from a fresh seed so the initial weights do not depend on how much randomness data
    # loading used; initial weights, dropout and the batch-size probe draw from it alone, never from the
    # caller's or a concurrent run's.
    rng = RunRng(cfg.seed, device)
    # Sharded: the whole model is built on the CPU and each layer moves to the GPU as its shards when wrapped, so
    # no GPU ever holds all of it.
    build_on = "cpu" if dist.sharded else device
    with rng.active():
        model = build_model(cfg, tokenizer, data.num_labels, precision, build_on, label_names=data.label_names)
    notes.extend(source_notes(cfg.model))   # a GGUF model: what its weights were dequantized from
    notes.extend(method_notes(model))   # e.g. the added chat tokens' rows that train under LoRA
    if perturb_init is not None:
        notes.append(perturb_weights(model, *perturb_init))
    init_hash = weights_hash(model) if hash_init else None
    # bf16 weights (bf16-pure) or float8 linears (fp8) after the hash: every precision starts from one init
    notes.extend(apply_tensor_precision(model, spec, caps.fp8_native))
    params = [p for p in model.parameters() if p.requires_grad]
    trainable, total_params = count_params(model)

    lean = None
    if cfg.lean_layers:   # before the batch-size probe, which should measure what training will keep
        if cfg.compile:
            notes.append("lean_layers: not applied under compile=True (the compiled graph chooses what backward "
                         "keeps; lean's functions would be traced through for no further saving)")
        else:
            lean = lean_layers(model)
            notes.append(lean.describe())
    chunk_tokens = cfg.loss_chunk_tokens if cfg.chunked_loss and data.task == "causal-lm" else None
    if cfg.auto_batch_size:
        with rng.active():   # the probe's dropout draws are put back with the run's state
            cfg, note = auto_batch_size(cfg, model, params, data, spec, device, chunk_tokens)
        notes.append(note)
    fwd_model = dist.wrap(model)
    if dist.sharded:   # fully_shard replaced the parameters with sharded ones: the optimizer steps those
        params = [p for p in model.parameters() if p.requires_grad]
        notes.append(f"sharding: FSDP2 over {dist.world} process(es), {len(layer_stack(model))} layers + the root "
                     f"sharded, reshard_after_forward={cfg.reshard_after_forward}, parameters gathered in "
                     f"{str(dist.param_dtype or 'their own dtype').removeprefix('torch.')}, gradients reduced "
                     "in float32")
    loss_parts = None
    if chunk_tokens:
        if dist.world > 1:
            raise ValueError("chunked_loss: not supported with several processes yet (DDP must see the "
                             "whole forward); set chunked_loss=False")
        loss_parts = split_for_chunked_loss(model)   # fail before step 1 if the model cannot use it
    elif data.task == "causal-lm" and dist.world == 1 and not dist.sharded:
        # the plain loss runs the head on the target positions only (chat prompts and padding get no logits)
        # where the model splits into a decoder and an output layer; otherwise the model's own forward
        try:
            loss_parts = split_for_chunked_loss(model)
        except ChunkedLossError:
            loss_parts = None
    # The first steps pay the compile time; step_time_s shows it.
    compiled = compile_blocks(model) if cfg.compile else []

    optimizer = build_optimizer(cfg, params, device)
    per_epoch = steps_per_epoch(len(data.train), cfg.micro_batch_size, cfg.grad_accum_steps)
    if cfg.objective == "grpo":   # rows are completions, G per prompt, each batch of them used grpo_iterations times
        per_epoch = math.ceil(len(data.train) * cfg.num_generations / cfg.effective_batch_size) * cfg.grpo_iterations
    total_steps = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(cfg.epochs * per_epoch))
    # The HF Trainer's schedules, step for step (engine/schedules.py; transformers.optimization would import peft
    # and, through it, bitsandbytes into every run).
    scheduler = make_scheduler(cfg.scheduler, optimizer, cfg.warmup_steps, total_steps)
    scaler = dist.make_scaler(spec, device)   # disabled (a no-op) unless the precision needs loss scaling

    info = RunInfo(config=cfg, precision_used=precision, device=device, device_name=caps.name,
                   device_total_gib=caps.total_memory_gib, scaler_enabled=spec.scaler,
                   total_steps=total_steps, train_examples=len(data.train), eval_examples=len(data.eval),
                   trainable_params=trainable, total_params=total_params,
                   max_grad_norm=cfg.max_grad_norm, variant=variant, model=model,
                   **_flops_info(cfg, model, caps, precision, dist.world))
    st = RunState(
        cfg=cfg, device=device, precision=precision, spec=spec, dist=dist,
        cbs=CallbackList(callbacks if dist.rank == 0 else []), rng=rng,
        run_id=dist.broadcast(uuid.uuid4().hex[:8]),   # one id for the run on every rank (sharded checkpoints)
        tokenizer=tokenizer, data=data, model=model, fwd_model=fwd_model, params=params, optimizer=optimizer,
        scheduler=scheduler, scaler=scaler, total_steps=total_steps, info=info,
        nonfinite_policy=cfg.nonfinite or ("skip" if spec.scaler else "stop"),
        host_tensors=RunTensorBytes(device, model, optimizer, total_steps),
        lost=LostUpdates(params, total_steps),
        chunk_tokens=chunk_tokens, loss_parts=loss_parts, compiled=compiled, lean=lean, init_hash=init_hash,
        variant=variant, notes=notes, stop_file=os.environ.get("NBTRAIN_STOP_FILE"),
        # rank 0 writes checkpoints; sharded, every rank writes its shards
        ckpt_dir=Path(cfg.output_dir) / "checkpoints" if cfg.output_dir and (dist.rank == 0 or dist.sharded) else None,
        prev_scale=scaler.get_scale() if spec.scaler else None,
    )
    # before a resume loads trained weights: a DPO reference is the initial model
    st.objective = make_objective(st)
    if cfg.resume_from:
        resume(st, cfg.resume_from)
    return st


def _flops_info(cfg, model, caps, precision: str, world: int) -> dict:
    """RunInfo's model_flops_per_token and peak_tflops (the live MFU); empty for an image model or where either
    cannot be told: a metric never stops a run."""
    if cfg.task == "image-classification":
        return {}
    try:
        from .flops import compute_dtype, token_flops

        flops = token_flops(model, cfg.max_seq_len, cfg.gradient_checkpointing).model
        peak = caps.peak_tflops.get(compute_dtype(precision))
        return {"model_flops_per_token": flops, "peak_tflops": peak * world if peak else None}
    except Exception:  # noqa: BLE001 - see the docstring
        return {}


def adopt_launcher_sharding(cfg: TrainConfig, notes: list[str]) -> TrainConfig:
    """``accelerate launch`` with an FSDP config (``distributed_type: FSDP``) and a config that says
    sharding='none': the launcher's choice wins, said in the notes (the launcher is how a user picks it there)."""
    if cfg.sharding == "fsdp" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("true", "1"):
        return cfg
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", str(cfg.reshard_after_forward)).lower()
    new = cfg.replace(sharding="fsdp", reshard_after_forward=reshard not in ("false", "0", "no_shard"))
    notes.append("sharding='fsdp': from accelerate launch's FSDP config (ACCELERATE_USE_FSDP); nbtrain runs "
                 "FSDP2 (fully_shard) whatever fsdp_version says")
    return new


def resume(st: RunState, path: str) -> None:
    """Continue the run a checkpoint came from: weights, optimizer, schedule, scaler, random stream, history."""
    ck = load_checkpoint(path)
    check_resumable(ck["config"], st.cfg, ck["path"], ck["world_size"], st.dist.world)
    if ck["shards"]:   # written by a sharded run, on any number of processes
        load_shards(st.model, st.optimizer, ck["shards"])
    elif st.dist.sharded:
        raise CheckpointError(f"cannot resume from {ck['path']} with sharding='fsdp': it was written by an "
                              "unsharded run (whole tensors in state.pt); resume it with sharding='none'")
    else:
        named = dict(st.model.named_parameters())
        for n, t in ck["model"].items():
            named[n].data.copy_(t)
        st.optimizer.load_state_dict(ck["optimizer"])
    st.scheduler.load_state_dict(ck["scheduler"])
    st.scaler.load_state_dict(ck["scaler"])
    st.rng.load_state_dict(ck["rng"])
    st.records = [StepRecord(**r) for r in ck["records"]]
    st.evals = [EvalRecord(**r) for r in ck["evals"]]
    st.start_step, st.prev_scale = ck["step"], ck["prev_scale"]
    st.data_hash, st.first_nonfinite = bytes.fromhex(ck["data_hash"]), ck["first_nonfinite"]
    st.lost.load_state_dict(ck.get("lost_updates", {}))
    if hasattr(st.objective, "load_state_dict"):
        st.objective.load_state_dict(ck.get("objective"))
    st.notes.extend(ck.get("notes", []))
    written = f" (written by {ck['world_size']} processes, read by {st.dist.world})" if ck["shards"] else ""
    st.notes.append(f"resumed from {ck['path']} at step {st.start_step}{written}")


def compile_blocks(model, **compile_kwargs) -> list[torch.nn.Module]:
    """torch.compile, in place, each block of the model's largest stack of identical blocks (its decoder or
    encoder layers); the whole model when it has no such stack. Returns what was compiled, for ``uncompile``.

    Per block rather than the whole model: one compiled graph serves every layer (compile time does not grow
    with depth), parameter names and saving are unchanged, the chunked loss (which calls the decoder, not the
    model's forward) and DDP run the same compiled layers, and transformers' mask logic stays eager, so an
    unpadded batch still reaches SDPA as ``is_causal`` (flash) -- traced, it would build an explicit mask.
    """
    blocks = layer_stack(model) or [model]
    for block in blocks:
        block.compile(**compile_kwargs)
    return blocks


def uncompile(blocks: list[torch.nn.Module]) -> None:
    """Undo ``compile_blocks``: the model a run returns runs eagerly (generation would recompile per shape)."""
    for block in blocks:
        if hasattr(block, "_compiled_call_impl"):
            block._compiled_call_impl = None


def auto_batch_size(cfg: TrainConfig, model, params, data, spec, device,
                    chunk_tokens: Optional[int]) -> tuple[TrainConfig, str]:
    """Largest micro batch (a divisor of the effective batch) whose forward+backward on the longest rows fits."""
    eff = cfg.effective_batch_size
    longest = sorted(range(len(data.train)), key=lambda i: -len(data.train[i].get("input_ids", ())))
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
