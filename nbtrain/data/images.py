"""Images for ``task="image-classification"``: read, label, split and preprocess them into a ``DataBundle``.

``cfg.data`` is one of

* ``"builtin:digits"``: scikit-learn's 1,797 handwritten digits (8x8 grey, labels 0-9), offline;
* a local directory read as ``datasets``' ``imagefolder`` reads it: one subfolder per class, holding that class's
  images (``data/cat/1.png``, ``data/dog/7.jpg``); the label names are the subfolder names, numbered in sorted
  order. Reading image files needs Pillow (``pip install pillow``);
* a dataset id (``"<id>"`` or ``"<id>:<config>"``) with an image column (``image_column``, a ``datasets.Image``
  feature) and a label column (``label_column``: a ``ClassLabel``, integers 0..K-1 or strings).

Then, as for text: labels become ids, ``subset`` keeps the first N images, the eval split is
``split_indices(n, eval_fraction, seed)`` (the seed only), and each image is preprocessed once, before training:

* with the model's image processor (``transformers.AutoImageProcessor``, loaded from the model directory) when it
  has one: ``processor(images=..., return_tensors="pt")["pixel_values"]``;
* otherwise (the ``tiny-vit`` preset, or a model directory without ``preprocessor_config.json``) with
  ``TorchImageProcessor``, in plain torch: to the model's number of channels (grey repeated, RGB averaged), to
  ``[0, 1]``, resized (bilinear, antialiased) to ``size x size``, normalised with the mean and std.

An example is ``{"pixel_values": (C, H, W) float32, "label": int}``; ``collate`` stacks them into an ``ImageBatch``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from . import builtin, loading
from .bundle import IMAGE_EXTS, DataBundle, DataError
from .loading import _describe_feature, _load_dataset, _looks_like_path, _Rows, split_indices
from .loading import _label_ids as _text_label_ids

if TYPE_CHECKING:
    from ..config import TrainConfig

IMAGE_CLASSIFICATION = "image-classification"
PROCESSOR_CONFIG = "preprocessor_config.json"
_CHUNK = 256   # images per call of an image processor


# ---------------------------------------------------------------------------------------------
# the preset's image processor, in plain torch
# ---------------------------------------------------------------------------------------------
@dataclass
class TorchImageProcessor:
    """Resize to ``size x size`` (bilinear, antialiased), scale to [0, 1], normalise: in plain torch.

    What the ``tiny-vit`` preset uses, and any model directory without its own image processor. It accepts
    arrays (``H x W`` grey, ``H x W x C``; uint8 0..255, or floats in [0, 1]), torch tensors of the same shapes
    and PIL images. ``save_pretrained(dir)`` writes the equivalent ``ViTImageProcessor`` configuration, so
    ``AutoImageProcessor.from_pretrained(dir)`` loads a processor for the saved model."""

    size: int
    num_channels: int = 3
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    origin: str = "nbtrain"        # for people: where its settings came from
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if int(self.size) < 1 or self.num_channels not in (1, 3):
            raise DataError(f"image processor: size must be >= 1 and num_channels 1 or 3, got size={self.size}, "
                            f"num_channels={self.num_channels}")
        for name in ("image_mean", "image_std"):
            v = tuple(float(x) for x in getattr(self, name))
            if len(v) == 1:
                v = v * self.num_channels
            if len(v) != self.num_channels:
                raise DataError(f"image processor: {name} has {len(v)} values for {self.num_channels} channels")
            setattr(self, name, v)

    def preprocess(self, images: Sequence[Any]) -> torch.Tensor:
        """``(N, C, size, size)`` float32 pixel values of ``images``."""
        out = torch.empty(len(images), self.num_channels, self.size, self.size, dtype=torch.float32)
        # images of one shape go through together (all of them, for builtin:digits)
        groups: dict[tuple, list[int]] = {}
        tensors = [_chw(img, self.num_channels) for img in images]
        for i, t in enumerate(tensors):
            groups.setdefault(tuple(t.shape), []).append(i)
        mean = torch.tensor(self.image_mean).view(1, -1, 1, 1)
        std = torch.tensor(self.image_std).view(1, -1, 1, 1)
        for (_, h, w), idx in groups.items():
            x = torch.stack([tensors[i] for i in idx])
            if (h, w) != (self.size, self.size):
                x = torch.nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear",
                                                    align_corners=False, antialias=max(h, w) > self.size)
            out[idx] = (x - mean) / std
        return out

    def __call__(self, images, return_tensors: str = "pt", **_: Any) -> dict[str, torch.Tensor]:
        if not isinstance(images, (list, tuple)):
            images = [images]
        return {"pixel_values": self.preprocess(images)}

    def to_dict(self) -> dict[str, Any]:
        """The equivalent ``ViTImageProcessor`` settings (bilinear resize, rescale 1/255, normalise)."""
        return {"image_processor_type": "ViTImageProcessor", "do_resize": True,
                "size": {"height": self.size, "width": self.size}, "resample": 2, "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "do_convert_rgb": self.num_channels == 3}

    def save_pretrained(self, path, **_: Any) -> list[str]:
        """Write ``preprocessor_config.json`` (a ``ViTImageProcessor``'s) into ``path``."""
        out = Path(path).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        f = out / PROCESSOR_CONFIG
        f.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return [str(f)]

    def describe(self) -> str:
        mean = ", ".join(f"{m:g}" for m in self.image_mean)
        std = ", ".join(f"{s:g}" for s in self.image_std)
        return (f"{self.origin}: {self.num_channels} channel(s), resized to {self.size}x{self.size}, "
                f"normalised with mean ({mean}) and std ({std}) in plain torch")


def _chw(img: Any, channels: int) -> torch.Tensor:
    """One image as a ``(channels, H, W)`` float32 tensor in [0, 1]."""
    if type(img).__module__.startswith("PIL"):
        import numpy as np

        img = np.array(img.convert("RGB" if channels == 3 or img.mode not in ("L", "1", "I", "F")
                                   else "L"))
    t = img if isinstance(img, torch.Tensor) else torch.as_tensor(img)
    if t.dim() == 2:
        t = t[:, :, None]
    if t.dim() != 3 or t.shape[-1] not in (1, 2, 3, 4):
        raise DataError(f"image: expected H x W or H x W x C (C = 1, 3 or 4), got shape {tuple(t.shape)}")
    if t.shape[-1] in (2, 4):          # drop alpha
        t = t[..., :-1]
    x = t.permute(2, 0, 1).to(torch.float32)
    if not t.is_floating_point():
        x = x / 255.0
    if x.shape[0] != channels:
        if channels == 3:
            x = x.expand(3, -1, -1)
        else:   # ITU-R 601 luma, as PIL's convert("L")
            x = (x * torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)).sum(0, keepdim=True)
    return x.contiguous()


def preprocess(processor: Any, images: Sequence[Any]) -> torch.Tensor:
    """``(N, C, H, W)`` float32 pixel values of ``images`` through ``processor`` (nbtrain's or a transformers
    image processor)."""
    if isinstance(processor, TorchImageProcessor):
        return processor.preprocess(images)
    if not callable(processor):
        raise DataError(f"image processor: expected a transformers image processor, got "
                        f"{type(processor).__name__}")
    grey = len(getattr(processor, "image_mean", None) or (0, 0, 0)) == 1
    parts = []
    for s in range(0, len(images), _CHUNK):
        chunk = [_for_processor(img, grey) for img in images[s: s + _CHUNK]]
        try:
            out = processor(images=chunk, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - the processor's own errors name no file; say what failed
            raise DataError(f"image processor {type(processor).__name__}: could not preprocess the images: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        parts.append(out["pixel_values"].to(torch.float32))
    return torch.cat(parts)


def _for_processor(img: Any, grey: bool):
    """An image as a transformers image processor takes it: an ``H x W x C`` uint8 array (RGB, or one channel for a
    grey model), or a PIL image converted alike."""
    import numpy as np

    if type(img).__module__.startswith("PIL"):
        return img.convert("L" if grey else "RGB")
    x = _chw(img, 1 if grey else 3)
    return (x.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy().astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
@dataclass
class _Images:
    images: list[Any]
    labels: list[Any]
    label_names: list[str] | None
    where: str
    source: str
    label_column: str


def digits_images() -> tuple[list[torch.Tensor], list[int]]:
    """scikit-learn's digits: 1,797 ``8 x 8`` uint8 images (its 0..16 pixels scaled to 0..255) and labels 0-9."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError("data: 'builtin:digits' needs scikit-learn, which ships the digits with its package "
                        f"(pip install scikit-learn): {e}") from None
    d = load_digits()
    pixels = torch.from_numpy(d.images).mul(255.0 / 16.0).round().clamp(0, 255).to(torch.uint8)
    return list(pixels.unbind(0)), [int(t) for t in d.target]


def _read(cfg: TrainConfig) -> _Images:
    data = cfg.data.strip()
    if data.startswith("builtin:"):
        name = builtin.check_name(data)
        if name not in builtin.IMAGE_BUILTINS:
            raise DataError(f"data: {data!r} holds text, not images; task='image-classification' needs "
                            + ", ".join(f"'builtin:{n}'" for n in builtin.IMAGE_BUILTINS)
                            + ", a folder of class subfolders of images, or a dataset id with an image column")
        images, labels = digits_images()
        return _Images(images, labels, builtin.builtin_label_names(name), f"data {data!r}",
                       builtin.builtin_source(name), "label")
    path = Path(data).expanduser()
    if path.exists():
        return _read_folder(path, keep=cfg.subset)
    if _looks_like_path(data):
        raise DataError(f"data: {data!r} does not exist (no such directory); give a folder with one subfolder "
                        "of images per class, 'builtin:digits' or a dataset id")
    return _read_hub(data, cfg)


def _read_folder(path: Path, keep: int | None = None) -> _Images:
    where = f"image folder '{path}'"
    if not path.is_dir():
        raise DataError(f"data: '{path}' is a file; task='image-classification' reads a folder with one subfolder "
                        "of images per class (data/cat/1.png, data/dog/2.png), 'builtin:digits' or a dataset id")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTS
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"data: {where} holds no image files ({', '.join(sorted(IMAGE_EXTS))}); put each class's "
                        "images in a subfolder named after the class")
    loose = [p for p in files if p.parent == path]
    if loose:
        raise DataError(f"data: {where} has no class subfolders: {len(loose)} image(s) lie directly in it "
                        f"(e.g. '{loose[0].name}'); put each class's images in a subfolder named after the class "
                        "(data/cat/1.png, data/dog/2.png)")
    classes = sorted({p.parent.name for p in files})
    if len(classes) < 2:
        raise DataError(f"data: {where} has only one class subfolder ({classes[0]!r}); image classification needs "
                        "at least 2 classes")
    try:
        import PIL  # noqa: F401 - datasets' imagefolder decodes with Pillow
    except ImportError:
        raise DataError(f"data: reading {where} needs Pillow to decode the image files (pip install pillow)") \
            from None
    ds = _load_dataset(where, "imagefolder", data_dir=str(path), split="train", quiet=True)
    if "image" not in ds.features or "label" not in ds.features:
        raise DataError(f"data: {where}: imagefolder found columns {list(ds.column_names)}, not image and label; "
                        "put each class's images in a subfolder named after the class")
    names = list(getattr(ds.features["label"], "names", None) or classes)
    return _Images(images=_decode_all(ds, where, keep), labels=ds["label"], label_names=names, where=where,
                   source=f"{path} (imagefolder, {len(names)} classes, {ds.num_rows} images)", label_column="label")


def _decode_all(ds, where: str, keep: int | None) -> list[Any]:
    """Every image file of an imagefolder ``ds`` decoded now, before training, as text files are read: a file
    Pillow cannot read is a ``DataError`` naming it. The first ``keep`` images (all when None) are kept, decoded
    as ``datasets`` decodes them; the rest (beyond ``subset``) are only checked, and stand as None."""
    import datasets

    feature = ds.features["image"]
    files = ds.cast_column("image", datasets.Image(decode=False))["image"]
    out: list[Any] = []
    for i, f in enumerate(files):
        try:
            img = feature.decode_example(f)
        except Exception as e:  # noqa: BLE001 - Pillow's errors (UnidentifiedImageError, OSError, ...) vary
            why = str(e).splitlines()[0] if str(e) else ""
            raise DataError(f"data: {where}: cannot read image file '{f.get('path')}' ({type(e).__name__}: {why}); "
                            f"every file with an image extension ({', '.join(sorted(IMAGE_EXTS))}) in the class "
                            "subfolders must be an image Pillow can decode: replace or remove it") from None
        out.append(img if keep is None or i < keep else None)
    return out


def _read_hub(data: str, cfg: TrainConfig) -> _Images:
    import datasets

    # looked up in loading at call time: a test stands a local dataset in for the Hub there
    ds, split, where = loading.hub_dataset(data, hint="a folder with one subfolder of images per class, or "
                                              "'builtin:digits'.")
    features, columns = ds.features, list(ds.column_names)
    col = cfg.image_column
    if col not in features:
        found = [c for c, f in features.items() if isinstance(f, datasets.Image)]
        hint = (f" Its image column is {found[0]!r}: set image_column={found[0]!r}." if found else
                " It holds no image column: is it a text dataset? (task='image-classification' needs images)")
        raise DataError(f"{where}: no image column {col!r}; its columns are {columns}.{hint}")
    if not isinstance(features[col], datasets.Image):
        raise DataError(f"{where}: image column {col!r} holds {_describe_feature(features[col])}, not images "
                        "(a datasets.Image column); set image_column to a column of images")
    label_col = cfg.label_column
    if label_col not in features:
        raise DataError(f"{where}: no label column {label_col!r}; its columns are {columns}. Set label_column to "
                        "one of them (image classification needs labels).")
    lfeat = features[label_col]
    ok = isinstance(lfeat, datasets.ClassLabel) or (
        isinstance(lfeat, datasets.Value) and (lfeat.dtype in ("string", "large_string", "bool")
                                               or lfeat.dtype.startswith(("int", "uint"))))
    if not ok:
        raise DataError(f"{where}: label column {label_col!r} holds {_describe_feature(lfeat)}; labels must be "
                        "integers 0..K-1 or strings")
    names = list(lfeat.names) if isinstance(lfeat, datasets.ClassLabel) else None
    return _Images(images=ds[col], labels=ds.data.column(label_col).to_pylist(), label_names=names, where=where,
                   source=f"dataset {data!r}, split {split!r} ({ds.num_rows} images)", label_column=label_col)


def _decoded(images, i: int, where: str):
    """Image ``i`` of ``images``: a dataset's image column decodes it here, and a file it cannot decode is a
    ``DataError`` naming the row (an image folder's files were all decoded when it was read)."""
    try:
        return images[i]
    except Exception as e:  # noqa: BLE001 - the decoder's own errors (PIL's) name no row
        why = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"{where}: cannot decode image {i} ({type(e).__name__}: {why}); every image must be a file "
                        "Pillow can decode") from None


def _label_ids(rows: _Images) -> tuple[list[int], list[str] | None]:
    as_rows = _Rows(texts=[], labels=rows.labels, label_names=rows.label_names, where=rows.where,
                    source=rows.source, text_column="", label_column=rows.label_column)
    ids, names = _text_label_ids(list(rows.labels), list(range(len(rows.labels))), as_rows)
    return ids, names


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------
def load_image_data(cfg: TrainConfig, processor: Any) -> DataBundle:
    """Read, label, split and preprocess the images ``cfg.data`` names; bad data raises ``DataError``."""
    if processor is None:
        raise DataError("image processor: task='image-classification' needs the model's image processor "
                        "(nbtrain.models.load_tokenizer(cfg) gives it), got None")
    rows = _read(cfg)
    if not rows.images:
        raise DataError(f"{rows.where}: no examples (0 images)")
    labels, names = _label_ids(rows)
    images = rows.images
    n_rows = len(images)
    if cfg.subset is not None:
        images, labels = images[: cfg.subset], labels[: cfg.subset]
    train_idx, eval_idx = split_indices(len(images), cfg.eval_fraction, cfg.data_order_seed)
    keep = train_idx + eval_idx
    pixels = preprocess(processor, [_decoded(images, i, rows.where) for i in keep])
    if pixels.dim() != 4 or pixels.shape[0] != len(keep):
        raise DataError(f"image processor {type(processor).__name__}: gave pixel values of shape "
                        f"{tuple(pixels.shape)} for {len(keep)} images; expected (N, C, H, W)")
    examples = [{"pixel_values": pixels[k], "label": labels[i]} for k, i in enumerate(keep)]
    train, evals = examples[: len(train_idx)], examples[len(train_idx):]
    num_labels = len(names) if names else max(labels) + 1
    describe = getattr(processor, "describe", None)
    stats: dict[str, Any] = {
        "rows": n_rows,
        "documents": len(images),
        "train_documents": len(train),
        "eval_documents": len(evals),
        "image_shape": tuple(pixels.shape[1:]),
        "processor": describe() if callable(describe) else f"{type(processor).__name__} (transformers)",
        "pixel_bytes": pixels.numel() * pixels.element_size(),
    }
    if not train:
        raise DataError(f"{rows.where}: no training images left")
    return DataBundle(train=train, eval=evals, task=IMAGE_CLASSIFICATION, pad_token_id=0, num_labels=num_labels,
                      label_names=names, source=rows.source, stats=stats)

