"""Atomic checkpoints: trainable weights, optimizer, scheduler, GradScaler, RNG, data position, history.

A checkpoint is a directory ``step-000123`` holding ``state.pt``, ``config.yaml`` and ``meta.json`` (with the
SHA-256 of ``state.pt``). A sharded run's (FSDP) also holds ``shards/``: the weights and optimizer state as
``torch.distributed.checkpoint`` wrote them, each rank its own shards (``meta.json`` lists every file's SHA-256);
it resumes on any number of processes, one included, since DCP re-shards on load. It is written under a temporary name and renamed into place, so a crash mid-write
never leaves a directory that looks complete; a truncated or altered ``state.pt`` fails its checksum with a
clear message, and a folder of checkpoints resumes from the newest one that verifies, saying which it skipped.

``state.pt`` holds tensors and plain data only and is read with ``torch.load(weights_only=True)``: the
checksum proves integrity, not origin (whoever can write ``state.pt`` can write ``meta.json``), so loading a
checkpoint must never run code from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch

if TYPE_CHECKING:
    from ..config import TrainConfig

FORMAT = 2   # 1: pickled python/numpy RNG state and bytes, only readable with weights_only=False

# What a state must hold, and the type the loop relies on, so a bad file fails here and not as a KeyError later.
_REQUIRED: dict[str, tuple[type, ...]] = {
    "step": (int,), "model": (dict,), "optimizer": (dict,), "scheduler": (dict,), "scaler": (dict,),
    "rng": (dict,), "prev_scale": (float, int, type(None)), "data_hash": (str,),
    "first_nonfinite": (int, type(None)), "records": (list,), "evals": (list,), "config": (dict,),
}

# Config fields that shape the run: a checkpoint continues only a run with the same values.
RESUME_KEYS = ("model", "task", "data", "subset", "max_seq_len", "micro_batch_size", "grad_accum_steps",
               "method", "lora_r", "lora_alpha", "lora_targets", "quant_bits", "seed", "data_seed", "packing",
               "eval_fraction", "text_column", "label_column", "scheduler", "warmup_steps", "lr", "precision", "max_grad_norm",
               "weight_decay", "optimizer", "stochastic_rounding")

_STEP_RE = re.compile(r"step-(\d+)")
_TMP_RE = re.compile(r"\.tmp-step-\d+-(\d+)(?:-.*)?")   # group 1: the writer's pid (format 1 names too)

# Temp dirs being written by this process (resolved paths). A leftover with our pid that is not here is dead.
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters that train (the adapter and head for LoRA): small, and all a resume needs."""
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# Plain data: what weights_only=True can read back
# ---------------------------------------------------------------------------------------------------------------
_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def _is_plain(x: Any) -> bool:
    try:
        _plain(x, "")
        return True
    except CheckpointError:
        return False


def _plain(x: Any, where: str) -> Any:
    """``x`` as tensors and builtin containers/scalars only; raises CheckpointError naming ``where`` otherwise."""
    t = type(x)
    if t in (torch.Tensor, torch.nn.Parameter, torch.Size) or t in _SCALARS:
        return x
    if t.__module__ == "numpy" and hasattr(x, "item") and getattr(x, "shape", None) == ():
        return x.item()   # a numpy scalar would pickle as a numpy global
    for base in (bool, int, float, str):   # subclasses (IntEnum, str enums) pickle by their class
        if isinstance(x, base):
            return base(x)
    if isinstance(x, dict):
        return {_plain(k, f"{where} key"): _plain(v, f"{where}[{k!r}]") for k, v in x.items()}
    if t in (list, tuple, set):
        return t(_plain(v, f"{where}[{i}]") for i, v in enumerate(x))
    raise CheckpointError(f"cannot save checkpoint: {where} is a {t.__module__}.{t.__qualname__}, which could "
                          "only be read back by unpickling code; store tensors and plain data")


def _plain_state(state: dict[str, Any]) -> dict[str, Any]:
    sched = state.get("scheduler")
    if isinstance(sched, dict) and isinstance(sched.get("lr_lambdas"), list):
        # LambdaLR keeps a callable object's __dict__ (None for a function); load_state_dict skips None entries,
        # and the factor is rebuilt from the config anyway.
        sched = {**sched, "lr_lambdas": [v if _is_plain(v) else None for v in sched["lr_lambdas"]]}
        state = {**state, "scheduler": sched}
    return _plain(state, "state")


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        return psutil.pid_exists(pid)
    except Exception:   # cannot tell: keep the directory
        return True


def _remove_leftovers(root: Path) -> None:
    """Remove temp dirs of killed writes: another process's whose pid is gone, or ours that no write owns."""
    me = os.getpid()
    for d in root.glob(".tmp-step-*"):
        m = _TMP_RE.fullmatch(d.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == me:
            with _LIVE_LOCK:   # held across the removal: a write registers its name before creating it
                if str(d) not in _LIVE:
                    shutil.rmtree(d, ignore_errors=True)
        elif not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _register(path: Path) -> Path:
    """Claim a temp path for this write; a suffix keeps two writers with the same run_id apart."""
    with _LIVE_LOCK:
        cand, n = path, 1
        while str(cand) in _LIVE:
            n += 1
            cand = path.with_name(f"{path.name}-{n}")
        _LIVE.add(str(cand))
    return cand


def _release(*paths: Path) -> None:
    with _LIVE_LOCK:
        for p in paths:
            _LIVE.discard(str(p))


def _commit(tmp: Path, final: Path, aside: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (same step written again) is moved aside first."""
    for _ in range(10):   # another writer of the same step may slip in between; each round is atomic
        if final.exists():
            try:
                os.replace(final, aside)
            except FileNotFoundError:
                pass      # that writer moved it already
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, final)   # the rename is the commit point
            return
        except OSError:
            if not final.exists():
                raise
    raise CheckpointError(f"checkpoint {str(final)!r}: could not be written (another writer keeps replacing it)")


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any], config_yaml: str, *,
                    run_id: str | None = None, shards: dict[str, Any] | None = None, dist=None,
                    world_size: int = 1) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``directory`` atomically; returns its path.

    ``run_id`` names this run's temp files (a fresh id when None), so concurrent writers never share one.
    ``shards`` (with ``dist``, the run's distributed context): sharded state every rank calls this with and
    writes its part of into ``shards/``; rank 0 writes the rest and commits the directory once all have written.
    ``world_size``: how many processes the run had (a resume keeps its global batch).
    """
    lead = dist is None or dist.rank == 0
    root = Path(directory)
    if lead:
        root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()   # one spelling per folder for the live-write registry, whatever the cwd or links
    clean = _plain_state(state)   # fail before writing anything that could not be resumed
    run_id = re.sub(r"[^A-Za-z0-9_]", "_", run_id) if run_id else uuid.uuid4().hex[:12]
    final = root / f"step-{step:06d}"
    tmp = aside = None
    try:
        if lead:
            tmp = _register(root / f".tmp-step-{step:06d}-{os.getpid()}-{run_id}")
            aside = _register(tmp.with_name(tmp.name + "-old"))
            _remove_leftovers(root)
            for mine in (tmp, aside):   # ours by registration: leftovers of an earlier failed write
                shutil.rmtree(mine, ignore_errors=True)
            tmp.mkdir()
        if shards is not None:
            tmp = Path(dist.broadcast(str(tmp) if lead else None))   # the same temp dir on every rank
            import torch.distributed.checkpoint as dcp

            dcp.save(shards, checkpoint_id=str(tmp / SHARDS_DIR))   # collective: returns once every rank wrote
        if lead:
            torch.save(clean, tmp / "state.pt")
            (tmp / "config.yaml").write_text(config_yaml)
            meta = {"step": step, "sha256": _sha256(tmp / "state.pt"), "format": FORMAT}
            meta["world_size"] = dist.world if dist is not None else world_size
            if shards is not None:
                meta["shards"] = _shard_sums(tmp / SHARDS_DIR)
            (tmp / "meta.json").write_text(json.dumps(meta))
            _commit(tmp, final, aside)
    except BaseException:
        if lead and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lead and tmp is not None:
            _release(tmp, aside)
    if dist is not None and shards is not None:
        dist.barrier()   # no rank goes on (or reads it) before rank 0 has committed it
    return final


SHARDS_DIR = "shards"


def _shard_sums(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} of a sharded checkpoint's files."""
    return {f.name: _sha256(f) for f in sorted(folder.iterdir()) if f.is_file()}


# ---------------------------------------------------------------------------------------------------------------
# Finding and reading
# ---------------------------------------------------------------------------------------------------------------
def _problem(p: Path) -> tuple[str | None, dict]:
    """(what is wrong with checkpoint ``p`` or None, its meta)."""
    if not p.is_dir():
        return "it does not exist or is not a directory", {}
    meta_file, state_file = p / "meta.json", p / "state.pt"
    if not meta_file.is_file() or not state_file.is_file():
        return "it is incomplete: needs meta.json and state.pt", {}
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        return f"meta.json is unreadable: {e}", {}
    if not isinstance(meta, dict) or _sha256(state_file) != meta.get("sha256"):
        return "state.pt is truncated or corrupt: checksum mismatch", {}
    if isinstance(meta.get("shards"), dict):
        folder = p / SHARDS_DIR
        have = _shard_sums(folder) if folder.is_dir() else {}
        bad = sorted(n for n, h in meta["shards"].items() if have.get(n) != h)
        if bad:
            return f"{SHARDS_DIR}/{bad[0]} is missing, truncated or corrupt: checksum mismatch", {}
    return None, meta


def verify(path: str | os.PathLike) -> dict:
    """Check a checkpoint directory; returns its meta or raises CheckpointError saying what is wrong."""
    p = Path(path)
    problem, meta = _problem(p)
    if problem:
        hint = "; resume from an earlier checkpoint" if "checksum" in problem else ""
        raise CheckpointError(f"checkpoint {str(p)!r}: {problem}{hint}")
    return meta


def _candidates(root: Path) -> list[Path]:
    found = [(int(m.group(1)), d) for d in root.glob("step-*") if (m := _STEP_RE.fullmatch(d.name))]
    return [d for _, d in sorted(found, key=lambda x: x[0], reverse=True)]   # by number: 7+ digits sort right


def _newest_valid(root: Path) -> tuple[Path | None, dict, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that verifies, its meta, and the newer ones skipped with why."""
    skipped = []
    for cand in _candidates(root):
        problem, meta = _problem(cand)
        if problem is None:
            return cand, meta, skipped
        skipped.append((cand, problem))
    return None, {}, skipped


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``directory`` that verifies, or None."""
    return _newest_valid(Path(directory))[0]


def _resolve(path: str | os.PathLike) -> tuple[Path, dict, list[str]]:
    """(checkpoint, its meta, notes on newer ones skipped); each verified once, as hashing a big one is slow."""
    p = Path(path)
    if (p / "meta.json").exists() or (p / "state.pt").exists():
        return p, verify(p), []
    for root in (p, p / "checkpoints"):
        if root.is_dir():
            found, meta, skipped = _newest_valid(root)
            if found is not None:
                notes = [f"checkpoint {bad.name} is corrupt ({why}); resumed from {found.name} instead"
                         for bad, why in skipped]
                return found, meta, notes
    raise CheckpointError(f"resume_from={str(p)!r}: no valid checkpoint there (expected a step-NNNNNN "
                          "directory written by save_every, or a folder holding them)")


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a folder of them (its newest valid one). Raises CheckpointError."""
    return _resolve(path)[0]


def _unsupported(e: Exception) -> str:
    m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    return f"it references {m.group(1)}" if m else f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Verify and load a checkpoint's state (on the CPU) without running code from it.

    Adds ``path`` (the checkpoint used) and ``notes`` (newer checkpoints skipped as corrupt; empty normally).
    """
    p, meta, notes = _resolve(path)
    fmt = meta.get("format")
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint {str(p)!r} has format {fmt!r} (an older nbtrain's, which can only be "
                              f"read by unpickling code); this nbtrain reads format {FORMAT}: start a fresh run")
    try:
        state = torch.load(p / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:   # weights_only refusals are UnpicklingError; a bad zip is a RuntimeError
        if "Weights only load failed" in str(e) or "WeightsUnpickler" in str(e):
            raise CheckpointError(f"checkpoint {str(p)!r}: refusing to unpickle code from state.pt "
                                  f"({_unsupported(e)}); a checkpoint holds tensors and plain data only, so this "
                                  "one is from an older nbtrain or was crafted. Do not load it with "
                                  "weights_only=False unless you made it yourself") from None
        raise CheckpointError(f"checkpoint {str(p)!r} could not be read: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300] if str(e) else ''}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(p)!r}: state.pt holds a {type(state).__name__}, not a state dict")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {str(p)!r}: state.pt lacks {', '.join(missing)}")
    wrong = [f"{k} ({type(state[k]).__name__})" for k, types in _REQUIRED.items()
             if not isinstance(state[k], types) or (types == (int,) and isinstance(state[k], bool))]
    if isinstance(state["rng"], dict) and not isinstance(state["rng"].get("torch"), torch.Tensor):
        wrong.append("rng['torch'] (needs the generator state tensor)")
    if wrong:
        raise CheckpointError(f"checkpoint {str(p)!r}: state.pt has the wrong type for {', '.join(wrong)}")
    state["path"] = str(p)
    state["notes"] = notes
    # a sharded run's weights and optimizer state are in shards/ (read by load_shards), not in state.pt
    state["shards"] = str(p / SHARDS_DIR) if isinstance(meta.get("shards"), dict) else None
    state["world_size"] = meta.get("world_size")
    return state


def check_resumable(saved: dict, cfg: "TrainConfig", path: str, saved_world: int | None = None,
                    world: int = 1) -> None:
    """A checkpoint continues only the run it came from: the fields that shape the run must match. On another
    number of processes (``saved_world`` -> ``world``), the micro-batch over all of them must: 2 processes x
    micro 4 continue as 1 x micro 8."""
    def norm(k: str, v: Any) -> Any:
        if k == "max_grad_norm" and not v:
            return None   # None and 0 both mean no clipping
        return v

    keys = RESUME_KEYS
    if saved_world and saved_world != world:
        keys = tuple(k for k in RESUME_KEYS if k != "micro_batch_size")
        mb = saved.get("micro_batch_size")
        if isinstance(mb, int) and mb * saved_world != cfg.micro_batch_size * world:
            need = mb * saved_world / world
            fix = f"micro_batch_size={int(need)}" if need == int(need) else f"a process count dividing {mb * saved_world}"
            raise CheckpointError(f"cannot resume from {path}: its run took micro-batches of {mb * saved_world} rows "
                                  f"(micro_batch_size {mb} x {saved_world} processes); this one takes "
                                  f"{cfg.micro_batch_size} x {world}: use {fix} to continue it")
    diff = [k for k in keys if norm(k, saved.get(k)) != norm(k, getattr(cfg, k))]
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs config {getattr(cfg, k)!r}" for k in diff)
        raise CheckpointError(f"cannot resume from {path}: the config differs in {detail}")


def _shard_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # the trainable weights only, as an unsharded checkpoint holds (a LoRA run's adapters and head)
    return StateDictOptions(ignore_frozen_params=True)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's trainable weights and the optimizer's state keyed by parameter name: each rank's own shards
    under FSDP, whole tensors otherwise (what ``torch.distributed.checkpoint`` saves and loads into)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _shard_options()
    return {"model": get_model_state_dict(model, options=opts),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=opts)}


def load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Load a sharded checkpoint's ``shards/`` into ``model`` and ``optimizer``, however many processes wrote it
    and however many read it (DCP re-shards; one plain process reads whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    target = sharded_state(model, optimizer)
    try:
        dcp.load(target, checkpoint_id=folder)
    except Exception as e:
        raise CheckpointError(f"checkpoint {folder!r}: the sharded weights do not fit this run's model "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
    opts = _shard_options()
    set_model_state_dict(model, target["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, target["optimizer"], options=opts)


def save_run(st, step: int) -> Path:
    """Checkpoint a run (a ``RunState``) after ``step``: what a resume needs to continue it exactly. Sharded
    (FSDP), every rank calls it and writes its shards."""
    sharded = st.dist.sharded
    state = {"step": step, "model": {} if sharded else trainable_state(st.model),
             "optimizer": {} if sharded else st.optimizer.state_dict(),
             "scheduler": st.scheduler.state_dict(), "scaler": st.scaler.state_dict(), "rng": st.rng.state_dict(),
             "prev_scale": st.prev_scale, "data_hash": st.data_hash.hex(), "first_nonfinite": st.first_nonfinite,
             "records": [r.to_dict() for r in st.records], "evals": [r.to_dict() for r in st.evals],
             "config": st.cfg.to_dict(), "lost_updates": st.lost.state_dict(),
             # GRPO: the rollout batch in use and the rollout table (plain data and tensors)
             "objective": st.objective.state_dict() if hasattr(st.objective, "state_dict") else {}}
    if sharded:
        return save_checkpoint(st.ckpt_dir, step, state, st.cfg.to_yaml(), run_id=st.run_id,
                               shards=sharded_state(st.model, st.optimizer), dist=st.dist)
    return save_checkpoint(st.ckpt_dir, step, state, st.cfg.to_yaml(), run_id=st.run_id, world_size=st.dist.world)
