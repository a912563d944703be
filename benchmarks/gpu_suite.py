"""Throughput suite: a bare torch.amp loop, nbtrain and transformers.Trainer on the same model and tokens.

On a CUDA machine, in one process and interleaved (each group runs bare -> nbtrain -> Trainer back to back,
so drift in the machine hits all of them), for fp32, tf32, bf16, fp16, LoRA and QLoRA, plus nbtrain with
the live dashboard on (html mode, headless) and one row per optimisation: chunked loss, packing vs
padding, fused AdamW / SDPA / no per-step host sync (as bare-loop ablations: nbtrain has them always on),
and torch.compile (its warm-up cost is in ``warmup_s``); and nbtrain under FSDP2 on one rank
(``nbtrain:bf16@fsdp``: sharding='fsdp' in a 1-rank process group this process creates, so the row measures what
FSDP itself costs against ``nbtrain:bf16``). ``--plan fsdp`` is that comparison alone, its rows in one group so
``--repeats`` interleaves them (written as ``gpu_suite_<device>_fsdp``).

Shape (GPU): a random-init model shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings; 494M parameters), batch 8 x seq 1024, SDPA, fused AdamW.
The model is drawn once (seed fixed), saved with a tokenizer to a temp directory, and every row loads that
directory: nbtrain as ``cfg.model=DIR``, the bare loop and the Trainer through nbtrain's own
``build_model`` (so full / LoRA / QLoRA are built identically). The tokenizer is the ``tiny`` preset's
2,048-token byte-level BPE (ids fit the 151,936-row embedding; the logits are still vocab-sized), the
text is ``builtin:python-docs`` packed into 1024-token blocks (no ``datasets`` needed), cut to a multiple
of the batch so no step is short. All three consume exactly nbtrain's batches (``load_data`` +
``iter_steps``; the Trainer gets them in that order through an IterableDataset and nbtrain's ``collate``),
and each row records whether the token stream it saw matched.

Timing: ``warmup`` steps excluded, then ``windows`` windows of ``per_window`` optimizer steps; the clock is
read with a device synchronisation only at window edges (at step end: after the optimizer step). Per row:
tokens/s (median of windows, and the mean = window tokens / window time, which a rare slow step such as a
dashboard redraw cannot hide behind), MFU = 6 x params x tokens/s / the GPU's dense peak for the precision
(LoRA/QLoRA rows use the same 6N, so their MFU is "model FLOPs" of the full model), peak memory allocated
during training, final loss. ``--repeats`` repeats the bf16 group in alternating order.

Writes ``gpu_suite_<device>.json`` and ``.md`` under ``--out`` (default benchmarks/results/) after every
row (so a timeout loses nothing), and a copy under $OUT when that variable is set. Every row catches its
own exception (e.g. bitsandbytes missing -> the QLoRA rows carry the error). A time budget skips rows that
would not fit (``--budget-s``, default 330 s on CUDA).

    python benchmarks/gpu_suite.py                 # full suite on CUDA (~5 min on an H200)
    python benchmarks/gpu_suite.py --quick         # bare/nbtrain/Trainer bf16, dashboard, chunked, LoRA, QLoRA
    python benchmarks/gpu_suite.py --rows 'nbtrain:bf16*,bare:bf16'    # names or fnmatch patterns
    python benchmarks/gpu_suite.py --list          # the rows and their order
    python benchmarks/gpu_suite.py --cpu           # the tiny preset on the CPU, CI-sized (~30-60 s on 2 cores)
    python benchmarks/gpu_suite.py --cpu --plan cuda --shape qwen-micro --seq-len 64 --warmup 1 --windows 2 \
        --per-window 1 --out /tmp/dry                # every GPU row's code path on a CPU (~1 min; tf32 rows error)
    python benchmarks/gpu_suite.py --plan fsdp --repeats 3     # nbtrain:bf16 vs FSDP on 1 rank, interleaved
    python benchmarks/gpu_suite.py --cpu --plan fsdp --shape qwen-micro --seq-len 64 --warmup 1 --windows 2 \
        --per-window 1 --out /tmp/dry                # the FSDP rows' code path on a CPU (gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fnmatch
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

_T_START = time.perf_counter()   # the budget counts the imports too
for _k, _v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
               ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"),
               ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
    os.environ.setdefault(_k, _v)
_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nbtrain as nbt  # noqa: E402
from nbtrain.data import collate, epoch_order, iter_steps, load_data  # noqa: E402
from nbtrain.engine.optimizers import adamw_fused  # noqa: E402
from nbtrain.hardware import resolve_precision  # noqa: E402
from nbtrain.precision import PRECISION_TABLE, global_torch_state  # noqa: E402
from nbtrain.models import build_model, count_params, load_tokenizer  # noqa: E402

_GIB = 2**30

# ---------------------------------------------------------------------------------------------------------------
# Shapes, profiles, peaks
# ---------------------------------------------------------------------------------------------------------------
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's architecture (its config.json), random init; 494,032,768 parameters with tied embeddings
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, hidden_act="silu", attention_dropout=0.0, use_sliding_window=False,
                         initializer_range=0.02),
    # a Qwen2 of the same kind (tied embeddings, grouped kv heads) small enough for a CPU test of this path
    "qwen-micro": dict(arch="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=4096, tie_word_embeddings=True,
                       max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
                       attention_dropout=0.0, use_sliding_window=False, initializer_range=0.02),
    # the `tiny` preset's own config (Llama, 4 x 128, 2,048 vocab, untied), saved as a directory the same way
    "tiny": dict(arch="tiny-preset"),
}


@dataclass(frozen=True)
class Profile:
    shape: str
    seq_len: int
    batch: int
    warmup: int            # optimizer steps excluded before the first window
    windows: int
    per_window: int        # optimizer steps per window
    slow_windows: int      # fp32 / tf32 rows: fewer, to fit the time budget
    slow_per_window: int
    budget_s: float        # 0: no budget


PROFILES = {
    "cuda": Profile("qwen2.5-0.5b", 1024, 8, warmup=3, windows=3, per_window=5, slow_windows=3,
                    slow_per_window=3, budget_s=330.0),
    "cpu": Profile("tiny", 128, 8, warmup=2, windows=3, per_window=5, slow_windows=3, slow_per_window=5,
                   budget_s=0.0),
}

TARGETS = dict(nbtrain_vs_bare=0.98, nbtrain_vs_trainer=1.0, dashboard_cost=0.02, bf16_opt_tokens_per_s=125_000,
               bf16_opt_peak_gib=16.0, qlora_vs_lora=0.6, cpu_nbtrain_vs_bare=0.97)


def peak_tflops(gpu_name: str) -> Optional[dict[str, float]]:
    """The dense data-sheet peaks of ``gpu_name`` (nbtrain.hardware.GPU_PEAK_TFLOPS, the table every run's MFU
    uses), or None for a GPU not in it."""
    from nbtrain.hardware import gpu_peak_tflops

    return gpu_peak_tflops(gpu_name) or None


# ---------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    name: str
    impl: str                      # "bare" | "nbtrain" | "trainer"
    precision: str
    method: str = "full"
    group: str = ""
    cfg: tuple = ()                # extra TrainConfig fields, as (key, value) pairs
    dashboard: bool = False
    fused: bool = True             # bare only: fused AdamW (as nbtrain: CUDA, and the CPU on torch >= 2.4)
    attn: str = "sdpa"             # bare only: attention implementation
    host_sync: bool = False        # bare only: read loss and grad norm to the host after every step
    slow: bool = False             # fp32/tf32: the shorter window profile
    est_s: float = 8.0             # rough H200 seconds incl. build; the budget guard uses it
    note: str = ""

    @property
    def overrides(self) -> dict:
        return dict(self.cfg)


def suite_rows(device: str) -> list[Row]:
    """Every row, in run order: groups interleave bare -> nbtrain -> Trainer on the same settings."""
    rows: list[Row] = []

    def group(name, precision, method="full", slow=False, est=8.0):
        for impl in ("bare", "nbtrain", "trainer"):
            rows.append(Row(f"{impl}:{name}", impl, precision, method, group=name, slow=slow,
                            est_s=est + (3 if impl == "trainer" else 0)))

    if device == "cuda":
        group("bf16", "bf16", est=7)
        rows.insert(2, Row("nbtrain:bf16+dashboard", "nbtrain", "bf16", group="bf16", dashboard=True, est_s=7,
                           note="LiveDashboard(mode='html', display=False)"))
        rows += [
            Row("nbtrain:bf16+chunked_loss", "nbtrain", "bf16", group="opt", cfg=(("chunked_loss", True),),
                est_s=7, note="cfg.chunked_loss=True"),
            Row("nbtrain:bf16+chunked_loss+lean", "nbtrain", "bf16", group="opt",
                cfg=(("chunked_loss", True), ("lean_layers", True)), est_s=7,
                note="cfg.lean_layers=True on top of chunked loss: MLP and norms recompute SiLU, product, normalised "
                     "input in backward"),
            Row("nbtrain:bf16+padding", "nbtrain", "bf16", group="opt", cfg=(("packing", False),), est_s=5,
                note="packing=False: one document per row, padded to the batch's longest (tok/s counts real tokens)"),
            Row("bare:bf16+host_sync", "bare", "bf16", group="opt", host_sync=True, est_s=7,
                note="loss.item() and grad_norm.item() after every step"),
            Row("bare:bf16-fused_adamw", "bare", "bf16", group="opt", fused=False, est_s=7,
                note="torch.optim.AdamW(fused=False): the foreach implementation"),
            Row("bare:bf16-sdpa", "bare", "bf16", group="opt", attn="eager", est_s=9,
                note="attn_implementation='eager' instead of SDPA"),
        ]
        group("lora", "bf16", "lora", est=7)
        group("qlora", "bf16", "qlora", est=9)
        group("fp16", "fp16", est=7)
        # before tf32/fp32: the compiled row speaks to a target, the slow precisions only to ratios
        rows.append(Row("nbtrain:bf16+chunked_loss+compile", "nbtrain", "bf16", group="compile",
                        cfg=(("chunked_loss", True), ("compile", True)), est_s=60,
                        note="cfg.compile=True (each decoder layer, one graph) on top of chunked loss; "
                             "warmup_s includes compilation"))
        group("tf32", "tf32", slow=True, est=9)
        group("fp32", "fp32", slow=True, est=12)
        # last, so the budget keeps the rows above where it binds (run them alone with --rows tensors).
        # issue 27: the precision of every tensor, each against nbtrain:bf16 (same model, batches, steps)
        rows += [
            Row("nbtrain:bf16-pure", "nbtrain", "bf16-pure", group="tensors", est_s=6,
                note="precision='bf16-pure': bf16 weights, gradients, AdamW state; no autocast"),
            Row("nbtrain:bf16-pure+sr", "nbtrain", "bf16-pure", group="tensors",
                cfg=(("stochastic_rounding", True),), est_s=7, note="bf16-pure + stochastic_rounding=True"),
            Row("nbtrain:fp8", "nbtrain", "fp8", group="tensors", est_s=8,
                note="precision='fp8': torchao Float8Linear (tensorwise) on the linears, lm_head in bf16"),
            Row("nbtrain:bf16+adamw_8bit", "nbtrain", "bf16", group="tensors", cfg=(("optimizer", "adamw_8bit"),),
                est_s=7, note="optimizer='adamw_8bit' (bitsandbytes)"),
            Row("nbtrain:bf16+paged_adamw_8bit", "nbtrain", "bf16", group="tensors",
                cfg=(("optimizer", "paged_adamw_8bit"),), est_s=7, note="optimizer='paged_adamw_8bit'"),
            Row("nbtrain:bf16+adafactor", "nbtrain", "bf16", group="tensors", cfg=(("optimizer", "adafactor"),),
                est_s=7, note="optimizer='adafactor' (transformers)"),
            Row("nbtrain:bf16+sgd", "nbtrain", "bf16", group="tensors", cfg=(("optimizer", "sgd"),), est_s=6,
                note="optimizer='sgd' (momentum 0.9)"),
        ]
        # issue 28, after the tensors rows: the full suite reaches it only when the budget allows; its side-by-side
        # reading comes from --plan fsdp (gpu_checks.sh PART=fsdp), which interleaves it with nbtrain:bf16
        rows.append(replace(FSDP_ROWS[0], group="fsdp"))
    elif device == "fsdp":
        # one group, the headline one, so run_order's repeats interleave every row (ABC CBA ...)
        rows += [Row("nbtrain:bf16", "nbtrain", "bf16", group="bf16", est_s=7), *FSDP_ROWS]
    else:
        group("fp32", "fp32", est=3)
        rows.insert(2, Row("nbtrain:fp32+dashboard", "nbtrain", "fp32", group="fp32", dashboard=True, est_s=3,
                           note="LiveDashboard(mode='html', display=False)"))
        rows += [
            Row("nbtrain:fp32+chunked_loss", "nbtrain", "fp32", group="opt", cfg=(("chunked_loss", True),),
                est_s=3, note="cfg.chunked_loss=True"),
            Row("nbtrain:fp32+chunked_loss+lean", "nbtrain", "fp32", group="opt",
                cfg=(("chunked_loss", True), ("lean_layers", True)), est_s=3, note="cfg.lean_layers=True"),
            Row("nbtrain:fp32+padding", "nbtrain", "fp32", group="opt", cfg=(("packing", False),), est_s=3,
                note="packing=False"),
        ]
        group("lora", "fp32", "lora", est=3)
    return rows


# sharding='fsdp' rows: run_nbtrain creates a 1-rank process group for them (FSDP over one GPU)
FSDP_ROWS = (
    Row("nbtrain:bf16@fsdp", "nbtrain", "bf16", group="bf16", cfg=(("sharding", "fsdp"),), est_s=8,
        note="sharding='fsdp' on 1 rank (FSDP2 fully_shard per layer + root, bf16 gather, fp32 reduce): FSDP's cost"),
    Row("nbtrain:bf16@fsdp+no_reshard", "nbtrain", "bf16", group="bf16",
        cfg=(("sharding", "fsdp"), ("reshard_after_forward", False)), est_s=8,
        note="reshard_after_forward=False: the gathered weights kept from forward to backward (one all-gather fewer)"),
)

MAIN_GROUPS = ("bf16", "fp16", "tf32", "fp32", "lora", "qlora")
QUICK = ("bare:bf16", "nbtrain:bf16", "nbtrain:bf16+dashboard", "trainer:bf16", "nbtrain:bf16+chunked_loss",
         "nbtrain:bf16+chunked_loss+lean",
         "nbtrain:lora", "nbtrain:qlora")
QUICK_CPU = ("bare:fp32", "nbtrain:fp32", "trainer:fp32", "nbtrain:fp32+dashboard")


def select_rows(rows: list[Row], patterns: Optional[str], quick: bool, device: str) -> list[Row]:
    if patterns:
        pats = [p.strip() for p in patterns.split(",") if p.strip()]
        return [r for r in rows if any(fnmatch.fnmatchcase(r.name, p) or r.group == p for p in pats)]
    if quick:
        keep = QUICK if device == "cuda" else QUICK_CPU
        return [r for r in rows if r.name in keep]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Model directory and data
# ---------------------------------------------------------------------------------------------------------------
def make_model_dir(shape: str, root: Path, device: str, seed: int = 0) -> tuple[str, int]:
    """Draw the random model once (seeded) and save it with its tokenizer; returns (dir, parameters)."""
    from transformers import AutoModelForCausalLM

    from nbtrain.models.presets import PRESETS, preset_tokenizer

    tok = preset_tokenizer("tiny")
    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    if arch == "tiny-preset":
        config = PRESETS["tiny"].make_config(tok, "causal-lm")
    else:
        from transformers import Qwen2Config

        config = Qwen2Config(**spec, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):   # drawing 494M normals is much faster on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    path = root / f"model-{shape}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    _free(device)
    return str(path), n_params


@dataclass
class DataPlan:
    subset: Optional[int]
    n_examples: int
    tokens: list[int]               # non-padding input tokens of each optimizer step 1..total
    padded: list[int]               # batch x width of each step (padding share)


def aligned_subset(cfg: nbt.TrainConfig, tok) -> Optional[int]:
    """The fewest documents whose packed blocks are an exact multiple of the batch, so that no optimizer step
    is short and the Trainer's batches of ``micro_batch_size`` line up with nbtrain's steps across epochs."""
    if not cfg.packing:
        return None
    full = load_data(cfg.replace(subset=None), tok)
    b, n_blocks = cfg.micro_batch_size, len(full.train)
    if n_blocks % b == 0:
        return None
    target = (n_blocks // b) * b
    if target == 0:
        raise RuntimeError(f"the text packs into only {n_blocks} blocks of {cfg.max_seq_len}; need at least {b}")
    # per-document token counts as packing sees them (whole documents, each followed by EOS unless it ends so)
    docs = load_data(cfg.replace(subset=None, packing=False, max_seq_len=131072), tok)
    if docs.stats["short_rows_dropped"] == 0:
        eos, total, n = tok.eos_token_id, 0, 0
        for ex in docs.train:
            ids = ex["input_ids"]
            total += len(ids) + (eos is not None and ids[-1] != eos)
            n += 1
            if total // cfg.max_seq_len >= target:
                break
        if len(load_data(cfg.replace(subset=n), tok).train) == target:
            return n
    lo, hi = 1, full.stats["documents"]   # fallback: the smallest subset reaching `target` blocks
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            got = len(load_data(cfg.replace(subset=mid), tok).train)
        except Exception:   # noqa: BLE001 - too few documents to make one block
            got = 0
        lo, hi = (mid + 1, hi) if got < target else (lo, mid)
    return lo if len(load_data(cfg.replace(subset=lo), tok).train) % b == 0 else None


def plan_data(cfg: nbt.TrainConfig, tok, total: int) -> DataPlan:
    data = load_data(cfg, tok)
    it = iter_steps(data.train, cfg.micro_batch_size, 1, cfg.seed, data.pad_token_id, data.task)
    tokens, padded = [], []
    for _ in range(total):
        _, (mb,) = next(it)
        tokens.append(mb.n_tokens)
        padded.append(int(mb.input_ids.numel()))
    return DataPlan(cfg.subset, len(data.train), tokens, padded)


# ---------------------------------------------------------------------------------------------------------------
# Timing: windows synchronised only at their edges
# ---------------------------------------------------------------------------------------------------------------
class Windows:
    def __init__(self, warmup: int, windows: int, per_window: int, tokens: list[int], device: str):
        self.edges = [warmup + i * per_window for i in range(windows + 1)]
        self.total = self.edges[-1]
        self.tokens = tokens
        self.device = device
        self.t_edge: dict[int, float] = {}
        self.t_start: Optional[float] = None
        self.t_call = time.perf_counter()

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def train_start(self) -> None:
        self.t_start = self._now()
        if self.edges[0] == 0:
            self.t_edge[0] = self.t_start

    def step_end(self, step: int) -> None:
        if step in self.edges and step not in self.t_edge:
            self.t_edge[step] = self._now()

    def summary(self) -> dict:
        missing = [e for e in self.edges if e not in self.t_edge]
        if missing:
            raise RuntimeError(f"the run ended before window edge(s) {missing} (of {self.total} steps)")
        rates, times, toks = [], [], []
        for a, b in zip(self.edges, self.edges[1:]):
            n = sum(self.tokens[a:b])   # steps a+1..b
            t = self.t_edge[b] - self.t_edge[a]
            rates.append(n / t)
            times.append(t)
            toks.append(n)
        return {"tokens_per_s": statistics.median(rates), "tokens_per_s_mean": sum(toks) / sum(times),
                "window_tokens_per_s": [round(r, 1) for r in rates],
                "step_time_s": statistics.median(times) / (self.edges[1] - self.edges[0]),
                "setup_s": (self.t_start or self.t_call) - self.t_call,
                "warmup_s": self.t_edge[self.edges[0]] - (self.t_start or self.t_call)}


# ---------------------------------------------------------------------------------------------------------------
# The three implementations
# ---------------------------------------------------------------------------------------------------------------
def _cosine(total: int):
    return lambda done: 0.5 * (1.0 + math.cos(math.pi * min(1.0, done / max(1, total))))


def run_bare(cfg: nbt.TrainConfig, row: Row, win: Windows, device: str) -> dict:
    """The loop a person writes by hand with torch.amp, on nbtrain's batches and nbtrain's model builder."""
    spec = PRECISION_TABLE[resolve_precision(cfg.precision)]
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok, None, spec.name, device)
    if row.attn != "sdpa":
        model.set_attn_implementation(row.attn)
    params = [p for p in model.parameters() if p.requires_grad]
    # fused where nbtrain (and the Trainer's adamw_torch_fused) use it: CUDA and, since torch 2.4, the CPU
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                            fused=(row.fused and adamw_fused(params, device)), foreach=None if row.fused else True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(win.total))
    scaler = torch.amp.GradScaler(device, enabled=spec.scaler)
    batches = iter_steps(data.train, cfg.micro_batch_size, 1, cfg.seed, data.pad_token_id, data.task)
    amp = dict(device_type=device, dtype=spec.autocast_dtype or torch.float32, enabled=spec.autocast_dtype is not None)
    model.train()
    last = None
    _reset_peak(device)
    win.train_start()
    for step in range(1, win.total + 1):
        _, (mb,) = next(batches)
        # pinned, as nbtrain does on CUDA: a pageable host-to-device copy would wait for the GPU
        mb = (mb.pin_memory() if device == "cuda" else mb).to(device, non_blocking=True)
        with torch.autocast(**amp):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), mb.labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        del logits   # as nbtrain: the logits are not held through backward
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last = loss.detach()
        del loss
        if row.host_sync:
            last.item(), norm.item()
        win.step_end(step)
    out = {"final_loss": float(last.item()), "peak_mem_gib": _peak(device), "same_tokens": True,
           "trainable_params": count_params(model)[0]}
    del model, opt, sched, params
    return out


class _TimerCallback:
    """nbtrain callback: window edges at step ends, and a check that the token stream is the planned one."""

    def __init__(self, win: Windows):
        self.win, self.mismatch = win, []

    def on_run_start(self, info) -> None:
        self.win.train_start()

    def on_step_end(self, rec) -> None:
        n = round(rec.tokens_per_s * rec.step_time_s)
        if rec.step <= len(self.win.tokens) and abs(n - self.win.tokens[rec.step - 1]) > 1:
            self.mismatch.append(rec.step)
        self.win.step_end(rec.step)


def engine_reads(field_name: str) -> bool:
    """Whether nbtrain's engine/models code mentions a config field (a field can land before its code does)."""
    import nbtrain.engine as eng
    import nbtrain.models as mdl

    srcs = []
    for pkg in (eng, mdl):
        for p in Path(pkg.__file__).parent.glob("*.py"):
            srcs.append(p.read_text(errors="ignore"))
    needle = f"cfg.{field_name}"
    return any(needle in s or f'"{field_name}"' in s for s in srcs)


@contextlib.contextmanager
def one_rank_group(active: bool):
    """The environment a launcher gives one process (RANK=0, WORLD_SIZE=1, a free port), so nbtrain's
    init_distributed creates a 1-rank group and, for sharding='fsdp', an FSDPContext; the run's finish() destroys
    the group it created. The environment is put back afterwards, and a group an error left behind destroyed."""
    if not active:
        yield
        return
    import socket

    import torch.distributed as tdist

    if tdist.is_initialized():
        raise RuntimeError("a process group already exists: the 1-rank FSDP row needs its own")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if tdist.is_initialized():
            tdist.destroy_process_group()


def run_nbtrain(cfg: nbt.TrainConfig, row: Row, win: Windows, device: str) -> dict:
    timer = _TimerCallback(win)
    cbs: list = []
    if row.dashboard:
        from nbtrain.viz.dashboard import LiveDashboard

        cbs.append(LiveDashboard(mode="html", display=False))
    cbs.append(timer)   # last: a dashboard redraw of an edge step lands inside the window it ends
    sharded = getattr(cfg, "sharding", "none") == "fsdp"
    with one_rank_group(sharded):
        r = nbt.train(cfg, callbacks=cbs)
    s = r.summary
    if sharded and not any("FSDP" in n for n in s.get("notes") or []):
        raise RuntimeError(f"sharding='fsdp' asked, but the run was not sharded: {s.get('notes')}")
    if s.get("stopped_reason") not in ("max_steps",):
        raise RuntimeError(f"nbtrain stopped: {s.get('stopped_reason')} {s.get('notes')}")
    peaks = [v for v in r.history["vram_peak_gib"] if v is not None and v == v]
    out = {"final_loss": s["final_loss"], "peak_mem_gib": max(peaks) if peaks else None,
           "same_tokens": not timer.mismatch, "trainable_params": s["trainable_params"]}
    if row.dashboard:
        out["redraws"] = cbs[0].redraws
    if sharded:
        out["world_size"] = s.get("world_size")
    r.model = None
    del r
    return out


def run_trainer(cfg: nbt.TrainConfig, row: Row, win: Windows, device: str, tmp: Path, sft: bool = False) -> dict:
    """transformers.Trainer with nbtrain's equivalent TrainingArguments, on nbtrain's batches in nbtrain's order;
    ``sft``: TRL's SFTTrainer (a Trainer subclass with its own loss and metrics) on the same batches, its dataset
    preparation skipped (the batches are tokenized and packed already) and checkpointing as in the config."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from nbtrain.integrations.exports import training_arguments_kwargs

    spec = PRECISION_TABLE[resolve_precision(cfg.precision)]
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok, None, spec.name, device)
    b = cfg.micro_batch_size
    if len(data.train) % b:
        raise RuntimeError(f"{len(data.train)} examples is not a multiple of the batch {b}: the Trainer's "
                           "batches would straddle nbtrain's epoch boundary")
    examples, seed = data.train, cfg.seed

    class InNbtrainOrder(torch.utils.data.IterableDataset):
        # nbtrain's epoch order, example by example; the DataLoader's batches of b are then nbtrain's steps
        def __iter__(self):
            epoch = 0
            while True:
                for i in epoch_order(len(examples), seed, epoch):
                    yield examples[i]
                epoch += 1

    seen: list[int] = []

    def collator(rows):
        mb = collate(rows, data.pad_token_id, data.task)
        seen.append(mb.n_tokens)
        return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "labels": mb.labels}

    peak: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _reset_peak(device)
            win.train_start()

        def on_step_end(self, args, state, control, **kw):
            win.step_end(state.global_step)
            if state.global_step == win.total and device == "cuda":
                peak["gib"] = torch.cuda.max_memory_allocated() / _GIB

    kw = training_arguments_kwargs(cfg, output_dir=str(tmp / "hf"), disable_tqdm=True, save_strategy="no",
                                   dataloader_num_workers=0, label_names=["labels"])
    kw["max_steps"] = win.total
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if sft:
                from trl import SFTConfig, SFTTrainer

                # SFTConfig turns bf16 and gradient checkpointing on by default (an fp32 row would train bf16, as
                # the first run of this arm did); nbtrain's config says what is on, as its trl-sft export writes
                kw = {"bf16": False, "fp16": False, **kw, "gradient_checkpointing": cfg.gradient_checkpointing,
                      "packing": False, "dataset_kwargs": {"skip_prepare_dataset": True}}
                kw.pop("activation_checkpointing", None)
                import datasets

                # SFTTrainer takes only a datasets.(Iterable)Dataset: the same stream, wrapped
                stream = datasets.IterableDataset.from_generator(lambda: iter(InNbtrainOrder()))
                trainer = SFTTrainer(model=model, args=SFTConfig(**kw), train_dataset=stream,
                                     data_collator=collator, processing_class=tok, callbacks=[Timer()])
            else:
                args = TrainingArguments(**kw)
                trainer = Trainer(model=model, args=args, train_dataset=InNbtrainOrder(), data_collator=collator,
                                  callbacks=[Timer()])
            trainer.remove_callback(PrinterCallback)   # disable_tqdm's replacement prints every log line
            trainer.train()
    finally:
        # TrainingArguments(tf32=...) sets TF32 through torch's new fp32_precision API (torch >= 2.9); reading
        # the legacy allow_tf32 flags afterwards (as nbtrain's global_torch_state does) then raises a
        # RuntimeError about mixed APIs. "none" puts it back to a fresh process's state, so later rows start clean.
        if hasattr(torch.backends, "fp32_precision"):
            torch.backends.fp32_precision = "none"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {"final_loss": losses[-1] if losses else None, "peak_mem_gib": peak.get("gib"),
           "same_tokens": seen[: win.total] == win.tokens[: win.total],
           "trainable_params": count_params(model)[0]}
    trainer.accelerator.free_memory()
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.lr_scheduler = None
    del trainer, model
    return out


# ---------------------------------------------------------------------------------------------------------------
# Driving the suite
# ---------------------------------------------------------------------------------------------------------------
def run_order(rows: list[Row], device: str, repeats: int) -> list[Row]:
    """The rows in run order; with repeats, the headline group's bare/nbtrain rows again right after it,
    in alternating order (ABC CBA), so the ratios that have tight targets get twice the windows."""
    order = list(rows)
    main_group = "bf16" if device == "cuda" else "fp32"
    again = [r for r in rows if r.group == main_group and r.impl != "trainer"]
    if again and repeats > 1:
        at = max(i for i, r in enumerate(order) if r.group == main_group) + 1
        order[at:at] = [r for rep in range(1, repeats) for r in (again[::-1] if rep % 2 else again)]
    return order


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / _GIB if device == "cuda" else None


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    import importlib.metadata as md

    for name in ("nbtrain", "transformers", "peft", "accelerate", "bitsandbytes", "tokenizers", "plotly", "trl"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = getattr(sys.modules.get(name), "__version__", None) or "missing"
    try:
        out["git_commit"] = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:   # noqa: BLE001
        out["git_commit"] = None
    return out


def _peak_key(precision: str) -> str:
    return "bf16" if precision == "bf16-pure" else precision


def aggregate(runs: list[dict], flops_per_token: float, peaks: Optional[dict]) -> list[dict]:
    """One row per name (repeats pooled), with ratios to the bare loop and the Trainer of its group."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["name"], []).append(r)
    rows = []
    for rs in by_name.values():
        ok = [r for r in rs if r.get("tokens_per_s")]
        base = {k: rs[0][k] for k in ("name", "impl", "group", "precision", "method", "options", "note")}
        if not ok:
            rows.append({**base, "error": rs[0].get("error") or rs[0].get("skipped"), "runs": len(rs)})
            continue
        windows = [w for r in ok for w in r["window_tokens_per_s"]]
        tps = statistics.median(windows)
        mean = sum(r["tokens_per_s_mean"] for r in ok) / len(ok)
        peak_mem = [r["peak_mem_gib"] for r in ok if r.get("peak_mem_gib") is not None]
        row = {**base, "tokens_per_s": round(tps, 1), "tokens_per_s_mean": round(mean, 1),
               "tokens_per_s_best": round(max(windows), 1),
               "window_tokens_per_s": windows,
               "spread": round((max(windows) - min(windows)) / tps, 4) if len(windows) > 1 else 0.0,
               # bf16-pure computes in bf16; fp8's MFU is against the fp8 peak (its head and attention are bf16)
               "mfu": (round(flops_per_token * tps / (peaks[_peak_key(base["precision"])] * 1e12), 4)
                       if peaks and _peak_key(base["precision"]) in peaks else None),
               "peak_mem_gib": round(max(peak_mem), 3) if peak_mem else None,
               "final_loss": ok[0]["final_loss"], "step_time_s": round(statistics.median(r["step_time_s"] for r in ok), 4),
               "warmup_s": round(statistics.median(r["warmup_s"] for r in ok), 2),
               "setup_s": round(statistics.median(r["setup_s"] for r in ok), 2),
               "same_tokens": all(r["same_tokens"] for r in ok), "trainable_params": ok[0]["trainable_params"],
               "padding_share": ok[0].get("padding_share"), "runs": len(rs)}
        for k in ("redraws", "field_unused", "world_size"):
            if any(k in r for r in ok):
                row[k] = next(r[k] for r in ok if k in r)
        rows.append(row)
    index = {r["name"]: r for r in rows}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        ref_group = r["group"] if r["group"] in MAIN_GROUPS else r["precision"]
        for ref in ("bare", "trainer"):
            other = index.get(f"{ref}:{ref_group}")
            if other and other.get("tokens_per_s") and other is not r:
                r[f"vs_{ref}"] = round(r["tokens_per_s"] / other["tokens_per_s"], 4)
                r[f"vs_{ref}_mean"] = round(r["tokens_per_s_mean"] / other["tokens_per_s_mean"], 4)
                if r.get("final_loss") is not None and other.get("final_loss") is not None:
                    r[f"loss_minus_{ref}"] = round(r["final_loss"] - other["final_loss"], 6)
    return rows


def checks(rows: list[dict], device: str) -> list[dict]:
    idx = {r["name"]: r for r in rows if r.get("tokens_per_s")}
    out = []

    def add(what, value, target, ok, detail=""):
        out.append({"check": what, "value": value, "target": target, "pass": ok, "detail": detail})

    def ratio(a, b, key="tokens_per_s"):
        return round(idx[a][key] / idx[b][key], 4) if a in idx and b in idx else None

    if device == "cuda":
        for g in ("bf16", "fp16", "tf32", "fp32", "lora", "qlora"):
            v = ratio(f"nbtrain:{g}", f"bare:{g}")
            add(f"nbtrain / bare ({g})", v, f">= {TARGETS['nbtrain_vs_bare']}",
                None if v is None else v >= TARGETS["nbtrain_vs_bare"])
            v = ratio(f"nbtrain:{g}", f"trainer:{g}")
            add(f"nbtrain / Trainer ({g})", v, f">= {TARGETS['nbtrain_vs_trainer']}",
                None if v is None else v >= TARGETS["nbtrain_vs_trainer"])
        v = ratio("nbtrain:bf16+dashboard", "nbtrain:bf16", "tokens_per_s_mean")
        cost = None if v is None else round(1 - v, 4)
        add("dashboard cost (bf16, mean throughput)", cost, f"<= {TARGETS['dashboard_cost']}",
            None if cost is None else cost <= TARGETS["dashboard_cost"])
        opt = [idx[n] for n in ("nbtrain:bf16+chunked_loss+compile", "nbtrain:bf16+chunked_loss+lean",
                                "nbtrain:bf16+chunked_loss") if n in idx]
        # the fastest row within the memory target (both targets are for one configuration), else the fastest
        fits = [r for r in opt if r["peak_mem_gib"] is not None and r["peak_mem_gib"] <= TARGETS["bf16_opt_peak_gib"]]
        best = max(fits or opt, key=lambda r: r["tokens_per_s"]) if opt else None
        add("bf16 full with optimisations: tokens/s", best and best["tokens_per_s"],
            f">= {TARGETS['bf16_opt_tokens_per_s']:,}",
            None if best is None else best["tokens_per_s"] >= TARGETS["bf16_opt_tokens_per_s"],
            best["name"] if best else "")
        add("bf16 full with optimisations: peak GiB", best and best["peak_mem_gib"],
            f"<= {TARGETS['bf16_opt_peak_gib']}",
            None if best is None or best["peak_mem_gib"] is None else best["peak_mem_gib"] <= TARGETS["bf16_opt_peak_gib"],
            best["name"] if best else "")
        v = ratio("nbtrain:qlora", "nbtrain:lora")
        add("QLoRA / LoRA throughput (nbtrain)", v, f">= {TARGETS['qlora_vs_lora']}",
            None if v is None else v >= TARGETS["qlora_vs_lora"])
        for name in ("nbtrain:bf16-pure", "nbtrain:bf16-pure+sr", "nbtrain:fp8", "nbtrain:bf16+adamw_8bit",
                     "nbtrain:bf16+paged_adamw_8bit", "nbtrain:bf16+adafactor", "nbtrain:bf16+sgd"):
            v = ratio(name, "nbtrain:bf16")
            a, b = idx.get(name), idx.get("nbtrain:bf16")
            peaks_ab = [a["peak_mem_gib"], b["peak_mem_gib"]] if a and b else None
            add(f"{name.split(':', 1)[1]} / bf16 (nbtrain): tokens/s; peak GiB [it, bf16]", v,
                "(info; fp8 > 1 expected on Hopper)", None, f"peaks {peaks_ab}")
        q, lo = idx.get("nbtrain:qlora"), idx.get("nbtrain:lora")
        add("QLoRA peak < LoRA peak (nbtrain)", q and lo and [q["peak_mem_gib"], lo["peak_mem_gib"]], "<",
            None if not (q and lo) or None in (q["peak_mem_gib"], lo["peak_mem_gib"])
            else q["peak_mem_gib"] < lo["peak_mem_gib"])
    else:
        for g in ("fp32", "lora"):
            v = ratio(f"nbtrain:{g}", f"bare:{g}")
            add(f"nbtrain / bare ({g}, CPU)", v, f">= {TARGETS['cpu_nbtrain_vs_bare']}",
                None if v is None else v >= TARGETS["cpu_nbtrain_vs_bare"])
            v = ratio(f"nbtrain:{g}", f"trainer:{g}")
            add(f"nbtrain / Trainer ({g}, CPU)", v, "(info)", None)
            v = ratio(f"nbtrain:{g}", f"bare:{g}", "tokens_per_s_best")
            add(f"nbtrain / bare ({g}, CPU, best windows)", v, "(info: the least disturbed windows)", None)
        v = ratio("nbtrain:fp32+dashboard", "nbtrain:fp32", "tokens_per_s_mean")
        add("dashboard cost (fp32, mean throughput, CPU)", None if v is None else round(1 - v, 4), "(info)", None)
    base = idx.get("nbtrain:bf16")
    for name in (r.name for r in FSDP_ROWS):
        if name in idx and base:
            # one rank: no communication to hide, so this is FSDP's own cost (wrapping, gathers, DTensor steps)
            d = idx[name]["final_loss"] - base["final_loss"]
            add(f"{name.split(':', 1)[1]} / bf16 (nbtrain, 1 rank): tokens/s", ratio(name, "nbtrain:bf16"),
                "(info: FSDP's cost)", None,
                f"final loss minus bf16's {d:+.2e}; peaks [{idx[name]['peak_mem_gib']}, {base['peak_mem_gib']}] GiB")
    return out


def markdown(res: dict) -> str:
    m = res["meta"]
    v = m["versions"]
    lines = [f"# nbtrain throughput suite — {m['device_name']} ({m['device']})", "",
             f"{m['date']} · shape {m['shape']} ({m['params'] / 1e6:.1f}M params) · batch {m['batch']} x seq "
             f"{m['seq_len']} · warm-up {m['warmup']} steps excluded · windows {m['windows']} (x{m['per_window']} steps;"
             f" fp32/tf32 {m['slow_windows']} x{m['slow_per_window']}) · median of windows"
             + (f" · {m['warm_pass']['row']} ran once, untimed, before the timed rows" if m.get("warm_pass") else ""),
             "", "versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val), "",
             f"wall {m.get('wall_s', 0):.0f} s; MFU = 6 x {m['params'] / 1e6:.0f}M x tokens/s / dense peak "
             f"({m['peak_tflops'] or 'unknown for this device'} TFLOP/s)", "",
             "| row | tokens/s (median) | tokens/s (mean) | MFU | peak GiB | final loss | vs bare | vs Trainer "
             "| warm-up s | setup s | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(x, fmt):
        return "" if x is None else format(x, fmt)

    for r in res["rows"]:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['name']} | | | | | | | | | | **{(r.get('error') or '')[:160]}** |")
            continue
        note = r.get("note") or ""
        if not r.get("same_tokens", True):
            note += " TOKEN STREAM DIFFERS"
        if r.get("field_unused"):
            note += f" (engine does not read {r['field_unused']} yet: default measured)"
        if r.get("padding_share"):
            note += f" padding {r['padding_share']:.0%}"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_mean']:,.0f} | {f(r['mfu'], '.1%')} "
                     f"| {f(r['peak_mem_gib'], '.2f')} | {f(r['final_loss'], '.4f')} | {f(r.get('vs_bare'), '.3f')} "
                     f"| {f(r.get('vs_trainer'), '.3f')} | {r['warmup_s']:.1f} | {r['setup_s']:.1f} | {note.strip()} |")
    lines += ["", "| check | value | target | pass |", "|---|---|---|---|"]
    for c in res["checks"]:
        p = {True: "yes", False: "**no**", None: "n/a"}[c["pass"]]
        lines.append(f"| {c['check']} | {c['value']} | {c['target']} | {p} {c['detail']} |")
    return "\n".join(lines) + "\n"


def write(res: dict, out_dirs: list[Path], stem: str) -> list[Path]:
    paths = []
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.json").write_text(json.dumps(res, indent=2, default=str))
        (d / f"{stem}.md").write_text(markdown(res))
        paths.append(d / f"{stem}.json")
    return paths


def run(rows: list[Row], device: str, profile: Profile, out_dirs: list[Path], repeats: int = 1,
        budget_s: Optional[float] = None, peaks_override: Optional[dict] = None, verbose: bool = True,
        warm_pass: bool = True, stem: Optional[str] = None) -> dict:
    t0 = time.perf_counter()
    try:   # "Loading weights" bars, one per row, would bury the results
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:   # noqa: BLE001
        pass
    t_budget = _T_START if __name__ == "__main__" else t0   # as a script, the imports count against the budget
    budget = profile.budget_s if budget_s is None else budget_s
    name = torch.cuda.get_device_name() if device == "cuda" else nbt.capabilities("cpu").name
    peaks = peaks_override or (peak_tflops(name) if device == "cuda" else None)
    stem = stem or (f"gpu_suite_{device}" if device == "cuda" else "cpu_suite")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    tmp = Path(tempfile.mkdtemp(prefix="nbtrain-suite-"))
    model_dir, n_params = make_model_dir(profile.shape, tmp, device)
    base = nbt.TrainConfig(model=model_dir, data="builtin:python-docs", max_seq_len=profile.seq_len,
                           micro_batch_size=profile.batch, grad_accum_steps=1, packing=True, eval_fraction=0.0,
                           max_steps=1, lr=3e-4, scheduler="cosine", warmup_steps=0, max_grad_norm=1.0,
                           lora_r=16, lora_alpha=32, lora_targets="all-linear", seed=0, log_every=1)
    tok = load_tokenizer(base)
    subset = aligned_subset(base, tok)
    base = base.replace(subset=subset)
    plans: dict[tuple, DataPlan] = {}
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
            "device_name": name, "peak_tflops": peaks, "shape": profile.shape, "shape_config": SHAPES[profile.shape],
            "params": n_params, "flops_per_token": 6 * n_params, "batch": profile.batch, "seq_len": profile.seq_len,
            "warmup": profile.warmup, "windows": profile.windows, "per_window": profile.per_window,
            "slow_windows": profile.slow_windows, "slow_per_window": profile.slow_per_window,
            "repeats_bf16": repeats, "budget_s": budget, "data": base.data, "subset": subset,
            "threads": torch.get_num_threads(), "versions": _versions(), "targets": TARGETS,
            "setup_s": round(time.perf_counter() - t0, 1)}
    if verbose:
        print(f"[suite] {name}: {profile.shape} {n_params / 1e6:.1f}M params, data subset {subset}, "
              f"setup {meta['setup_s']} s", flush=True)
    order = run_order(rows, device, repeats)
    # the first row once more before the timed ones, discarded: what a process does once (lazy imports, kernel
    # and allocator set-up, the CPU clocking up) would otherwise be charged to whichever row runs first
    warm_pass = warm_pass and bool(order)
    if warm_pass:
        order = [order[0]] + order
    runs: list[dict] = []
    ratios: list[float] = []
    res: dict = {"meta": meta, "rows": [], "checks": [], "runs": runs}
    for i, row in enumerate(order):
        elapsed = time.perf_counter() - t_budget
        rec: dict = {"name": row.name, "impl": row.impl, "group": row.group, "precision": row.precision,
                     "method": row.method, "options": row.overrides, "note": row.note}
        # the estimates are for an H200; scale them by how the finished rows compared (compile: as written)
        scale = statistics.median(ratios) if ratios else 1.0
        need = row.est_s if row.overrides.get("compile") else row.est_s * scale
        if budget and elapsed + need > budget:
            rec["skipped"] = f"time budget: {elapsed:.0f} s used of {budget:.0f} s, row needs ~{need:.0f} s"
            if not (warm_pass and i == 0):   # the warm pass is no row of the results; its row is skipped next
                runs.append(rec)
            if verbose:
                print(f"[suite] skip {row.name}: {rec['skipped']}", flush=True)
            continue
        t_row = time.perf_counter()
        try:
            overrides = dict(row.overrides)
            unused = []
            for k in list(overrides):
                if k not in nbt.TrainConfig.model_fields:
                    unused.append(k)
                    overrides.pop(k)
                elif k in ("chunked_loss", "compile") and not engine_reads(k):
                    unused.append(k)
            if unused:
                rec["field_unused"] = ",".join(unused)
            nwin, per = ((profile.slow_windows, profile.slow_per_window) if row.slow
                         else (profile.windows, profile.per_window))
            total = profile.warmup + nwin * per
            cfg = base.replace(precision=row.precision, method=row.method, max_steps=total, **overrides)
            key = (cfg.packing, cfg.subset, cfg.max_seq_len)
            if key not in plans or len(plans[key].tokens) < total:
                plans[key] = plan_data(cfg, tok, total)
            plan = plans[key]
            rec["padding_share"] = round(1 - sum(plan.tokens[:total]) / sum(plan.padded[:total]), 4)
            win = Windows(profile.warmup, nwin, per, plan.tokens[:total], device)
            spec = PRECISION_TABLE[resolve_precision(cfg.precision)]
            _free(device)
            with global_torch_state(spec):   # restores tf32 flags a row (or TrainingArguments) may set
                if row.impl == "bare":
                    got = run_bare(cfg, row, win, device)
                elif row.impl == "nbtrain":
                    got = run_nbtrain(cfg, row, win, device)
                else:
                    got = run_trainer(cfg, row, win, device, tmp)
            rec.update(got)
            rec.update(win.summary())
        except BaseException as e:   # noqa: BLE001 - one row's failure must not lose the rest
            if isinstance(e, KeyboardInterrupt):
                rec["error"] = "interrupted"
                runs.append(rec)
                break
            msg = " / ".join(line.strip() for line in str(e).strip().splitlines()[:3])
            rec["error"] = f"{type(e).__name__}: {msg}"[:300]
            rec["traceback"] = traceback.format_exc()[-3000:]
        finally:
            _free(device)
            if row.overrides.get("compile"):
                try:
                    torch._dynamo.reset()
                except Exception:   # noqa: BLE001
                    pass
        rec["wall_s"] = round(time.perf_counter() - t_row, 2)
        if warm_pass and i == 0:
            meta["warm_pass"] = {"row": row.name, "wall_s": rec["wall_s"], "error": rec.get("error")}
            if verbose:
                print(f"[suite] warm pass ({row.name}, discarded): {rec['wall_s']} s", flush=True)
            continue
        if "error" not in rec and not row.overrides.get("compile"):
            ratios.append(rec["wall_s"] / row.est_s)
        runs.append(rec)
        if verbose:
            if "error" in rec:
                print(f"[suite] {row.name}: ERROR {rec['error']} ({rec['wall_s']} s)", flush=True)
            else:
                mem = f"{rec['peak_mem_gib']:.2f} GiB" if rec.get("peak_mem_gib") is not None else "-"
                loss = f"{rec['final_loss']:.4f}" if rec.get("final_loss") is not None else "-"
                print(f"[suite] {row.name}: {rec['tokens_per_s']:,.0f} tok/s (mean {rec['tokens_per_s_mean']:,.0f}),"
                      f" peak {mem}, loss {loss}, warm-up {rec['warmup_s']:.1f} s, row {rec['wall_s']} s", flush=True)
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        meta["wall_s_incl_imports"] = round(time.perf_counter() - t_budget, 1)
        res["rows"] = aggregate(runs, 6 * n_params, peaks)
        res["checks"] = checks(res["rows"], device)
        write(res, out_dirs, stem)   # partial results after every row
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    meta["wall_s_incl_imports"] = round(time.perf_counter() - t_budget, 1)
    res["rows"] = aggregate(runs, 6 * n_params, peaks)
    res["checks"] = checks(res["rows"], device)
    res["paths"] = [str(p) for p in write(res, out_dirs, stem)]
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU profile: the tiny preset, CI-sized")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA when available (--list --device cuda shows the GPU plan anywhere)")
    ap.add_argument("--plan", choices=("auto", "cuda", "cpu", "fsdp"), default="auto",
                    help="whose rows to run (auto: the device's); --plan cuda on a CPU runs the GPU rows' code paths "
                         "at a small shape before device time is spent on them; --plan fsdp: nbtrain:bf16 against "
                         "FSDP on 1 rank, interleaved by --repeats")
    ap.add_argument("--quick", action="store_true", help="fewer rows (see QUICK)")
    ap.add_argument("--rows", default=None, help="comma-separated row names, fnmatch patterns or group names")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--repeats", type=int, default=None, help="runs of the headline group (default: 2 on CUDA, 1 on CPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default: the profile's)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--per-window", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="skip rows that would end past this (0: none)")
    ap.add_argument("--peak-tflops", default=None, help="override the dense peaks, e.g. fp32=67,tf32=495,bf16=989,fp16=989")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --cpu: on shared cores, OpenMP threads that wait for "
                         "each other turn other processes' load into 10x swings; 1 thread measures overhead steadily)")
    ap.add_argument("--no-warm-pass", action="store_true",
                    help="do not run the first row once, untimed, before the timed rows")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)

    device = "cpu" if args.cpu else args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available() and not args.list:
        ap.error("--device cuda: no CUDA device here")
    if device == "cpu" and not args.cpu and args.device == "auto":
        print("[suite] no CUDA device: running the CPU profile (tiny preset)", flush=True)
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _main(args, device)
    finally:
        torch.set_num_threads(saved_threads)   # main() is also called from tests: leave the process as it was


def _main(args, device: str) -> dict:
    profile = PROFILES[device]
    changes = {k: v for k, v in (("shape", args.shape), ("seq_len", args.seq_len), ("warmup", args.warmup),
                                 ("windows", args.windows), ("per_window", args.per_window)) if v is not None}
    if changes:
        profile = Profile(**{**profile.__dict__, **changes,
                             **({"slow_windows": changes["windows"]} if "windows" in changes else {}),
                             **({"slow_per_window": changes["per_window"]} if "per_window" in changes else {})})
    plan = device if args.plan == "auto" else args.plan
    rows = select_rows(suite_rows(plan), args.rows, args.quick, plan)
    repeats = args.repeats if args.repeats is not None else (2 if device == "cuda" and not args.quick else 1)
    if args.list or not rows:
        if not rows:
            print(f"[suite] no row matches {args.rows!r}; the rows are:")
        order = run_order(rows, device, repeats) if rows else suite_rows(plan)
        for r in order:
            print(f"{r.name:40s} group={r.group:8s} ~{r.est_s:.0f}s  {r.note}")
        print(f"{len(order)} runs, ~{sum(r.est_s for r in order):.0f} s estimated (H200) plus ~20 s setup")
        return {}
    peaks = None
    if args.peak_tflops:
        peaks = {k: float(v) for k, v in (kv.split("=") for kv in args.peak_tflops.split(","))}
    outs = [Path(args.out)] if args.out else []
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]))
    stem = None
    if plan == "fsdp":   # its own files: a full suite's results in the same folder stay
        stem = f"gpu_suite_{device}_fsdp" if device == "cuda" else "cpu_suite_fsdp"
    res = run(rows, device, profile, outs, repeats=repeats, budget_s=args.budget_s, peaks_override=peaks,
              warm_pass=not args.no_warm_pass, stem=stem)
    print()
    print(markdown(res))
    for p in res.get("paths", []):
        print(f"wrote {p} (+ .md)")
    return res


if __name__ == "__main__":
    main()
