"""GGUF checkpoints (llama.cpp's file format) as nbtrain models.

transformers reads a GGUF file (``from_pretrained(folder, gguf_file=name)``, with the ``gguf`` package) and
dequantizes its weights to fp32, which takes ~20 s for a 135M model and cannot be saved back
("quantized with gguf and is not serializable"). nbtrain does that once per file: it copies the dequantized state
into a model built from the config (without the config's ``quantization_config``) and saves it, with the
tokenizer, as an ordinary safetensors folder under the cache, keyed by the file's SHA-256. Every later run,
process or FSDP worker loads that folder in seconds, and everything that takes a model folder (LoRA, QLoRA,
exports, the memory estimate) works on it unchanged. The folder is written by hand, not with the model's
``save_pretrained`` (which writes nothing on a torch.distributed rank other than 0, and any rank may convert first),
and its marker is written only once the folder is complete; a folder whose marker vouches for missing files (left by
an older nbtrain) is converted again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".gguf"
MARKER = "nbtrain-gguf.json"      # written last: a folder without it is an interrupted conversion
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"   # shards: what save_pretrained wrote for a model over 50 GB
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
INSTALL = "pip install gguf"
_lock = threading.Lock()
_hashes: dict[tuple[str, int, int], str] = {}


class GGUFError(ValueError):
    """A GGUF file that cannot be read or converted (models.ModelError wraps it with the config field)."""


def cache_root() -> Path:
    """Where converted models live: ``$NBTRAIN_CACHE``, else ``$XDG_CACHE_HOME/nbtrain``, else ``~/.cache/nbtrain``."""
    if os.environ.get("NBTRAIN_CACHE"):
        return Path(os.environ["NBTRAIN_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "nbtrain"


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` in a folder that has no config.json;
    None when it names neither (a model folder, or not a path at all). A folder with several is an error that
    lists them."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.resolve() if p.suffix.lower() == SUFFIX else None
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
        if len(files) > 1:
            names = ", ".join(f.name for f in files)
            raise GGUFError(f"model {str(path)!r}: the folder holds {len(files)} GGUF files ({names}); "
                            f"pass one of them as model='{p / files[0].name}'")
        if files:
            return files[0].resolve()
    return None


def file_hash(path: Path) -> str:
    """SHA-256 of the file (hex), remembered per (path, size, mtime) for the process."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _hashes:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def cached_dir(path: Path) -> Path:
    """The folder the dequantized copy of GGUF file ``path`` lives in (whether or not it exists yet)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:60]
    return cache_root() / "gguf" / f"{stem}-{file_hash(path)[:16]}"


def is_converted(path: Path) -> bool:
    """Whether ``path`` has a complete cached copy (its marker, and the files the marker vouches for)."""
    return _complete(cached_dir(path))


def _complete(folder: Path) -> bool:
    return (folder / MARKER).is_file() and not _missing(folder)


def _missing(folder: Path, tensors: set[str] | None = None) -> list[str]:
    """What converted folder ``folder`` lacks, e.g. ["no config.json", "no model.safetensors"]; empty when it is
    complete (and, given ``tensors``, its weights hold all of them). Cheap, as it runs on every load: it reads
    config.json and the weights' headers, never the weights."""
    problems = []
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append("no config.json")
    except (OSError, ValueError):
        problems.append("an unreadable config.json")
    if (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    elif (folder / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((folder / WEIGHTS_INDEX).read_text(encoding="utf-8"))
            files = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            files = []
            problems.append(f"an unreadable {WEIGHTS_INDEX}")
    else:
        files = []
        problems.append(f"no {WEIGHTS}")
    names: set[str] = set()
    for f in files:
        if not (folder / f).is_file():
            problems.append(f"no {f}")
            continue
        found = _tensor_names(folder / f)
        if not found:
            problems.append(f"a truncated or unreadable {f}")
        names |= found or set()
    lost = sorted(tensors - names) if tensors is not None and names else []
    if lost:
        problems.append(f"{len(lost)} tensors missing from the weights (e.g. {lost[0]})")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return problems


def _tensor_names(file: Path) -> set[str] | None:
    """The tensor names in safetensors file ``file``'s header; None when the file is shorter than its header says
    (an interrupted write) or is not safetensors."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= size - 8:
                return None
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return set(header) if 8 + n + end <= size else None


@dataclass(frozen=True)
class GGUFInfo:
    """What a converted GGUF file was: its path, hash, and the storage types of its tensors."""

    source: str
    sha256: str
    quant: str                      # the type most of its weights are stored in, e.g. "Q4_1"
    tensor_types: dict[str, int]    # elements per GGUF storage type, e.g. {"Q4_1": 106168320, "Q8_0": ...}
    architecture: str

    def describe(self) -> str:
        """One line for the run notes: what the weights were dequantized from."""
        total = sum(self.tensor_types.values()) or 1
        parts = ", ".join(f"{t} {_share(n, total)}" for t, n in
                          sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        return (f"model: weights dequantized to fp32 from the GGUF file {Path(self.source).name} "
                f"({self.quant}; elements by storage type: {parts}), not the original unquantized weights; "
                f"converted once to {cached_dir(Path(self.source))}")


def _share(n: int, total: int) -> str:
    pct = 100 * n / total
    return f"{pct:.0f}%" if pct >= 1 or n == 0 else "<1%"


def info(path: Path) -> GGUFInfo:
    """The GGUFInfo of a converted file (read from its cache folder; converts it first if needed)."""
    d = ensure_converted(path)
    data = json.loads((d / MARKER).read_text(encoding="utf-8"))
    return GGUFInfo(source=str(path), sha256=data["sha256"], quant=data["quant"],
                    tensor_types=dict(data["tensor_types"]), architecture=data["architecture"])


def require_gguf(what: str) -> None:
    """GGUFError with the install command when the ``gguf`` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"model {what!r} is a GGUF file: reading it needs the gguf package, which is not installed "
                        f"here; install it with `{INSTALL}`")


def _storage_types(path: Path) -> tuple[str, dict[str, int]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else "?"
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
    return str(arch), counts


def _main_quant(counts: dict[str, int]) -> str:
    quantized = {k: v for k, v in counts.items() if k not in ("F32", "F16", "BF16", "F64")}
    pool = quantized or counts
    return max(pool, key=pool.get) if pool else "?"


def read_config(path: Path):
    """The transformers config of GGUF file ``path`` (metadata only, no weights), or GGUFError naming what
    transformers can read."""
    require_gguf(str(path))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError) as e:
        raise _arch_error(path, e) from None


def _arch_error(path: Path, err: Exception) -> GGUFError:
    import transformers

    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES as known
    except ImportError:
        known = []
    known = [k for k in known if k not in ("general", "tokenizer")]   # metadata sections, not architectures
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return GGUFError(f"model {str(path)!r}: transformers {transformers.__version__} cannot read this GGUF file "
                     f"({first}). It reads these architectures from GGUF: {', '.join(sorted(known))}; for another "
                     "one, pass the model's Hugging Face folder (config.json and safetensors) instead")


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    """Exclusive across processes (two FSDP workers, two notebooks) and threads, for one conversion."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with _lock, open(lock_path, "a+") as fh:
        try:
            import fcntl
        except ImportError:  # Windows: threads are still serialised
            yield
            return
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_converted(path: Path) -> Path:
    """The cached safetensors folder of GGUF file ``path``, converting it first when there is none or the one
    there is incomplete."""
    path = Path(path)
    target = cached_dir(path)
    if _complete(target):
        return target
    # a marker over missing files (an older nbtrain, converting on a distributed rank other than 0, wrote only the
    # tokenizer): converted again below, replacing the folder
    stale = _missing(target) if (target / MARKER).is_file() else []
    try:
        require_gguf(str(path))
    except GGUFError:
        if stale:
            raise GGUFError(f"model {str(path)!r}: the cached copy in {target} is incomplete ({', '.join(stale)}) "
                            "and cannot be converted again here: the gguf package is not installed. Delete that "
                            f"folder, install the package with `{INSTALL}`, and run again") from None
        raise
    with _file_lock(target.with_name(target.name + ".lock")):
        if _complete(target):   # another process converted it while this one waited
            return target
        try:
            _convert(path, target)
        except (GGUFError, OSError) as e:
            if stale:
                raise GGUFError(f"model {str(path)!r}: the cached copy in {target} is incomplete "
                                f"({', '.join(stale)}) and converting it again failed ({e}); delete that folder "
                                "and run again") from e
            raise
    return target


def _dequantize(path: Path):
    """(tokenizer, model, marker data) of GGUF file ``path``: the model fp32, built from its config so that it
    saves (the GGUF-loaded one does not). The ~20 s part of a conversion."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read_config(path)   # an architecture transformers cannot read: the message that names the ones it can
    kwargs = {"gguf_file": path.name}
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    except (ValueError, KeyError) as e:
        raise _arch_error(path, e) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    arch, counts = _storage_types(path)
    meta = {"source": str(path), "sha256": file_hash(path), "quant": _main_quant(counts),
            "tensor_types": counts, "architecture": arch}
    return tok, plain, meta


def _convert(path: Path, target: Path) -> None:
    tok, model, meta = _dequantize(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        tensors = _save_model(model, tmp)
        tok.save_pretrained(tmp)
        problems = _missing(tmp, tensors)
        if problems:
            raise GGUFError(f"model {str(path)!r}: converting it to {target} left {', '.join(problems)}, so nothing "
                            f"was cached; check the free space under {target.parent} and run again")
        (tmp / MARKER).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if target.exists():   # an interrupted or incomplete conversion: nothing in it is trusted
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_model(model, folder: Path) -> set[str]:
    """What ``model.save_pretrained(folder)`` writes (config.json, generation_config.json, the weights without the
    tied copies), on any rank: save_pretrained writes none of it on a torch.distributed rank other than 0. Returns
    the names of the tensors written."""
    from safetensors.torch import save_file

    model.config.dtype = str(model.dtype).split(".")[-1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)
    state = _state_to_save(model)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / WEIGHTS), metadata={"format": "pt"})
    return set(state)


def _state_to_save(model) -> dict:
    """``model``'s state dict as save_pretrained writes it: one name per tied tensor (the one loading expects),
    and in the checkpoint's names where transformers renames weights on load."""
    state = model.state_dict()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:   # another transformers: keep the first name of each storage (embed_tokens before lm_head)
        seen, kept = set(), {}
        for k, v in state.items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key not in seen:
                seen.add(key)
                kept[k] = v
        state = kept
    else:
        state = remove_tied_weights_from_state_dict(state, model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)
