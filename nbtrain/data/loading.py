"""``load_data``: read the data a config names, split it, tokenize it, pack it.

``cfg.data`` is one of

* ``"builtin:<name>"``: an offline corpus from ``builtin.py``. Builtins have fixed columns, so
  ``text_column``/``label_column`` are not used for them.
* a local file: ``.txt``/``.text`` (one example per line), ``.csv``, ``.tsv``, ``.json`` (a list of
  records, or JSON lines), ``.jsonl``, ``.parquet``; or a directory holding files of one of these
  formats (searched recursively, hidden files skipped, sorted by path). Read with
  ``datasets.load_dataset("<format>", data_files=...)``. A text file has a single column, which
  stands for ``text_column`` whatever it is called.
* anything else is a dataset id on the Hugging Face Hub, ``"<id>"`` or ``"<id>:<config name>"``,
  read with ``datasets.load_dataset(id)``; its ``train`` split is used (or its first split).
  When the Hub cannot be reached it is read from the local datasets cache only, and the error
  says so.

Causal-LM rows in a chat / instruction format (``chat.detect_format``) are read by ``chat.py``, and rows with a
chosen and a rejected answer (TRL's prompt/chosen/rejected, LLaMA-Factory ranking data) by ``preference.py``;
``cfg.objective`` and the data must agree (a preference objective needs preference data, and objective "lm"
refuses it), else a ``DataError`` names the columns found and what is allowed.

Plain text then goes through, in this order:

1. rows whose text is missing, empty or only whitespace are dropped: they are not examples;
2. for sequence classification, labels become ids: integer labels are used as they are
   (``num_labels`` = largest + 1, names from a ``ClassLabel`` column when it has them), string
   labels are numbered in sorted order (``label_names`` keeps the strings);
3. ``subset``: the first N examples (documents) are kept;
4. the eval split: ``round(n * eval_fraction)`` examples (at least 1 when the fraction is above 0
   and n >= 2; always at least 1 left for training), chosen by
   ``torch.randperm(n, generator=torch.Generator().manual_seed(seed))``, so it depends on the seed
   only. Train and eval keep the file's order;
5. tokenization with the tokenizer's own special tokens (BOS/EOS as it adds them to plain text),
   truncated to ``max_seq_len``. Rows with no tokens are dropped, and causal-LM rows need at least
   2 tokens (one to predict from, one to predict);
6. causal LM with ``packing``: the documents of each split are concatenated, each followed by the
   tokenizer's EOS token (unless it already ends with it), and cut into blocks of exactly
   ``max_seq_len`` tokens; the short tail is dropped. Packing tokenizes whole documents (no
   truncation), since the blocks, not the documents, are what must fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import hub
from . import builtin, chat, preference, prompts
from .bundle import IMAGE_EXTS, DataBundle, DataError

if TYPE_CHECKING:
    from ..config import TrainConfig

CAUSAL_LM = "causal-lm"
CLASSIFICATION = "sequence-classification"
TASKS = (CAUSAL_LM, CLASSIFICATION)   # the text tasks; images go through images.py

# file suffix -> (datasets builder, extra load_dataset kwargs)
FILE_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".txt": ("text", {}),
    ".text": ("text", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"sep": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".parquet": ("parquet", {}),
}
_SUPPORTED = ", ".join(FILE_FORMATS)
_TOKENIZE_CHUNK = 4096


@dataclass
class _Rows:
    """Raw examples before tokenizing: texts, labels (classification), and where they came from."""

    texts: list[Any]
    labels: list[Any] | None
    label_names: list[str] | None
    where: str            # "file 'x.csv'", for error messages
    source: str           # for DataBundle.source
    text_column: str
    label_column: str
    fmt: str = "text"                 # or a chat / preference format: then ``records`` holds the rows
    records: list[dict] | None = None
    colmap: dict[str, str] | None = None
    tags: dict[str, str] | None = None
    parts: list[_Rows] | None = None  # several dataset_info entries, concatenated: each with its own format


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------
def load_data(cfg: TrainConfig, tokenizer) -> DataBundle:
    """Load, split and tokenize ``cfg.data`` for a text task; bad data raises ``DataError``. (``nbtrain.data.
    load_data`` takes image classification too: ``nbtrain.data.images.load_image_data``.)"""
    task = cfg.task
    if task not in TASKS:
        raise DataError(f"task: {task!r} is not supported here; allowed: {', '.join(TASKS)} (images: "
                        "nbtrain.data.load_data)")
    if tokenizer is None or not callable(tokenizer):
        raise DataError(f"tokenizer: expected a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    pad_token_id = _pad_token_id(tokenizer)

    rows = _read(cfg)
    if rows.fmt == prompts.PROMPT_FORMAT:
        return prompts.load_prompts(cfg, tokenizer, rows.parts or [rows], rows.source, pad_token_id, split_indices)
    if chat.is_preference(rows.fmt):
        return preference.load_preference(cfg, tokenizer, rows.parts or [rows], rows.source, pad_token_id,
                                          split_indices)
    if rows.fmt != "text":
        return _load_chat(cfg, tokenizer, rows, pad_token_id)
    texts, labels, label_names, n_blank = _clean(rows, task)
    if cfg.subset is not None:
        texts = texts[: cfg.subset]
        labels = labels[: cfg.subset] if labels is not None else None
    train_idx, eval_idx = split_indices(len(texts), cfg.eval_fraction, cfg.data_order_seed)

    def pick(idx: list[int]) -> tuple[list[str], list[int] | None]:
        return [texts[i] for i in idx], ([labels[i] for i in idx] if labels is not None else None)

    train_texts, train_labels = pick(train_idx)
    eval_texts, eval_labels = pick(eval_idx)
    packing = bool(cfg.packing) and task == CAUSAL_LM
    max_len = None if packing else cfg.max_seq_len
    min_len = 2 if task == CAUSAL_LM else 1
    train, train_short = _examples(tokenizer, train_texts, train_labels, max_len, min_len)
    evals, eval_short = _examples(tokenizer, eval_texts, eval_labels, max_len, min_len)
    stats: dict[str, Any] = {
        "rows": len(rows.texts),
        "blank_rows_dropped": n_blank,
        "documents": len(texts),
        "train_documents": len(train_texts),
        "eval_documents": len(eval_texts),
        "short_rows_dropped": train_short + eval_short,
        "packing": packing,
    }
    if packing:
        sep = _separator(tokenizer)
        stats["train_doc_tokens"] = sum(len(ex["input_ids"]) for ex in train)
        train = pack(train, cfg.max_seq_len, sep)
        evals = pack(evals, cfg.max_seq_len, sep)
    else:
        stats["rows_at_max_seq_len"] = sum(len(ex["input_ids"]) >= cfg.max_seq_len for ex in train + evals)

    if not train:
        why = (f"all {len(train_texts)} training documents together have fewer than max_seq_len="
               f"{cfg.max_seq_len} tokens, so packing made no block; lower max_seq_len or set "
               "packing=False" if packing else
               f"every training text tokenized to fewer than {min_len} token(s)")
        raise DataError(f"{rows.where}: no training examples left after tokenizing: {why}")
    num_labels = None
    if task == CLASSIFICATION:
        num_labels = len(label_names) if label_names else max(labels) + 1  # type: ignore[arg-type]
    return DataBundle(train=train, eval=evals, task=task, pad_token_id=pad_token_id,
                      num_labels=num_labels, label_names=label_names if task == CLASSIFICATION else None,
                      source=rows.source, stats=stats)


def _load_chat(cfg: TrainConfig, tokenizer, rows: _Rows, pad_token_id: int) -> DataBundle:
    """Chat / instruction rows -> checked conversations -> ``{"input_ids", "labels"}`` with the answer masks."""
    parts = rows.parts or [rows]
    for part in parts:
        assert part.records is not None
        if not part.records:
            raise DataError(f"{part.where}: no examples (0 rows)")
    # every row is checked before any is tokenized, so a bad row 900 fails before training, naming itself
    convs = [chat.to_messages(part.fmt, rec, i, part.colmap or {}, part.tags or {}, part.where)
             for part in parts for i, rec in enumerate(part.records or [])]
    if cfg.subset is not None:
        convs = convs[: cfg.subset]
    added = chat.ensure_chat_tokens(tokenizer, cfg)   # before tokenizing: the template's markers are single tokens
    train_idx, eval_idx = split_indices(len(convs), cfg.eval_fraction, cfg.data_order_seed)
    packing = bool(cfg.packing)
    train, tcounts = chat.tokenize_conversations(tokenizer, cfg, [convs[i] for i in train_idx], cfg.max_seq_len)
    evals, ecounts = chat.tokenize_conversations(tokenizer, cfg, [convs[i] for i in eval_idx], cfg.max_seq_len)
    if not train:
        raise DataError(f"{rows.where}: no training examples left: every conversation's answer lies beyond "
                        f"max_seq_len={cfg.max_seq_len} tokens; raise max_seq_len")
    stats: dict[str, Any] = {
        "rows": sum(len(part.records or []) for part in parts), "documents": len(convs),
        "train_documents": len(train_idx), "eval_documents": len(eval_idx),
        "data_format": ", ".join(dict.fromkeys(part.fmt for part in parts)),
        "chat_template": chat.describe_template(tokenizer, cfg), "chat_tokens_added": added,
        "train_on": cfg.train_on, "target_tokens": chat.target_count(train),
        "truncated_examples": tcounts["truncated_examples"] + ecounts["truncated_examples"],
        "dropped_no_answer": tcounts["dropped_no_answer"] + ecounts["dropped_no_answer"],
        "history_trimmed": tcounts["history_trimmed"] + ecounts["history_trimmed"],
        "packing": packing,
    }
    if packing:
        train = chat.pack_chat(train, cfg.max_seq_len)
        evals = chat.pack_chat(evals, cfg.max_seq_len)
        # what the data side gives: position ids that restart per example, and forward inputs without a padding
        # mask, from which transformers (>= 4.5x masking_utils) builds a block-diagonal mask for sdpa / eager
        stats["packed_attention"] = ("separate: position ids restart per example and, with no padding mask, the "
                                     "model masks attention between packed examples (plain and chunked loss)")
    return DataBundle(train=train, eval=evals, task=CAUSAL_LM, pad_token_id=pad_token_id, num_labels=None,
                      label_names=None, source=rows.source, stats=stats)


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Train and eval row indices (each in file order); the eval rows depend on ``seed`` and n only."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval_fraction: must be in [0, 1), got {eval_fraction!r}")
    n_eval = 0
    if eval_fraction > 0 and n >= 2:
        n_eval = min(n - 1, max(1, math.floor(n * eval_fraction + 0.5)))
    if n_eval == 0:
        return list(range(n)), []
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    is_eval = torch.zeros(n, dtype=torch.bool)
    is_eval[perm[:n_eval]] = True
    return torch.nonzero(~is_eval).flatten().tolist(), torch.nonzero(is_eval).flatten().tolist()


def pack(examples: list[dict], block_len: int, sep_token_id: int | None) -> list[dict]:
    """Concatenate documents, each followed by ``sep_token_id``, and cut into full blocks."""
    flat: list[int] = []
    for ex in examples:
        ids = ex["input_ids"]
        flat.extend(ids)
        if sep_token_id is not None and (not ids or ids[-1] != sep_token_id):
            flat.append(sep_token_id)
    return [{"input_ids": flat[i: i + block_len]}
            for i in range(0, len(flat) - block_len + 1, block_len)]


# ---------------------------------------------------------------------------------------------
# tokenizing
# ---------------------------------------------------------------------------------------------
def _pad_token_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise DataError("tokenizer: it has neither a pad token nor an EOS token to pad with; "
                        "set tokenizer.pad_token first")
    return int(pad)


def _separator(tokenizer) -> int | None:
    for name in ("eos_token_id", "sep_token_id"):
        tok = getattr(tokenizer, name, None)
        if tok is not None:
            return int(tok)
    return None


def _examples(tokenizer, texts: list[str], labels: list[int] | None, max_len: int | None,
              min_len: int) -> tuple[list[dict], int]:
    """Tokenized examples, and how many were dropped for having fewer than ``min_len`` tokens."""
    out: list[dict] = []
    for start in range(0, len(texts), _TOKENIZE_CHUNK):
        chunk = texts[start: start + _TOKENIZE_CHUNK]
        enc = tokenizer(chunk, add_special_tokens=True, truncation=max_len is not None,
                        max_length=max_len, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)
        for j, ids in enumerate(enc["input_ids"]):
            if len(ids) < min_len:
                continue
            ex: dict[str, Any] = {"input_ids": list(ids)}
            if labels is not None:
                ex["label"] = labels[start + j]
            out.append(ex)
    return out, len(texts) - len(out)


# ---------------------------------------------------------------------------------------------
# cleaning rows and labels
# ---------------------------------------------------------------------------------------------
def _clean(rows: _Rows, task: str) -> tuple[list[str], list[int] | None, list[str] | None, int]:
    if not rows.texts:
        raise DataError(f"{rows.where}: no examples (0 rows)")
    keep = [i for i, t in enumerate(rows.texts) if isinstance(t, str) and t.strip()]
    if not keep:
        raise DataError(f"{rows.where}: no examples: all {len(rows.texts)} texts in column "
                        f"{rows.text_column!r} are empty")
    texts = [rows.texts[i] for i in keep]
    if task != CLASSIFICATION:
        return texts, None, None, len(rows.texts) - len(keep)
    if rows.labels is None:
        raise DataError(f"{rows.where}: task='sequence-classification' needs labels, and this "
                        "data has none; use task='causal-lm' (or 'builtin:python-docs-topics' for a "
                        "labelled builtin)")
    raw = [rows.labels[i] for i in keep]
    ids, names = _label_ids(raw, keep, rows)
    return texts, ids, names, len(rows.texts) - len(keep)


def _label_ids(raw: list[Any], row_of: list[int], rows: _Rows) -> tuple[list[int], list[str] | None]:
    col = rows.label_column
    for v, r in zip(raw, row_of):
        if v is None:
            raise DataError(f"{rows.where}: label column {col!r} has no value in row {r}; "
                            "every example needs a label")
    if all(isinstance(v, str) for v in raw):
        names = sorted(set(raw))
        index = {n: i for i, n in enumerate(names)}
        ids = [index[v] for v in raw]
    elif all(isinstance(v, (int, float)) for v in raw):  # bools count as 0/1
        ids = []
        for v, r in zip(raw, row_of):
            if isinstance(v, float) and not v.is_integer() or int(v) < 0:
                raise DataError(f"{rows.where}: label column {col!r} has {v!r} in row {r}; labels "
                                "must be integers 0..K-1 or strings")
            ids.append(int(v))
        names = rows.label_names
        if names is not None and max(ids) >= len(names):
            names = None
    else:
        kinds = sorted({type(v).__name__ for v in raw})
        raise DataError(f"{rows.where}: label column {col!r} holds {', '.join(kinds)} values; "
                        "labels must be integers 0..K-1 or strings")
    if len(set(ids)) < 2:
        raise DataError(f"{rows.where}: label column {col!r} has only one distinct label "
                        f"({raw[0]!r}); sequence classification needs at least 2")
    return ids, names


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _read(cfg: TrainConfig) -> _Rows:
    data = cfg.data.strip()
    if data.startswith("builtin:"):
        name = data[len("builtin:"):]
        if name in builtin.IMAGE_BUILTINS:
            builtin.check_name(name)
            raise DataError(f"data: {data!r} holds images, not text; set task='image-classification' (task="
                            f"{cfg.task!r} needs a text dataset such as 'builtin:python-docs')")
        rows = builtin.builtin_rows(name)
        if cfg.task == CAUSAL_LM:
            if getattr(cfg, "objective", "lm") == "grpo" and rows and "prompt" in rows[0]:
                # the prompts alone (a preference set's answers become columns the rewards may read)
                return _Rows(texts=[], labels=None, label_names=None, where=f"data {data!r}",
                             source=builtin.builtin_source(name), text_column="prompt", label_column="label",
                             fmt=prompts.PROMPT_FORMAT, records=rows, colmap={}, tags={})
            fmt = "preference" if rows and "chosen" in rows[0] else "messages" if rows and "messages" in rows[0] \
                else prompts.PROMPT_FORMAT if rows and "prompt" in rows[0] else "text"
            preference.check_objective(fmt, list(rows[0]) if rows else [], cfg, f"data {data!r}")
        if rows and "chosen" in rows[0]:
            if cfg.task != CAUSAL_LM:
                raise DataError(f"data: {data!r} is preference data (prompt/chosen/rejected), for task='causal-lm' "
                                f"with objective='dpo', 'orpo' or 'simpo', not task={cfg.task!r}")
            return _Rows(texts=[], labels=None, label_names=None, where=f"data {data!r}",
                         source=builtin.builtin_source(name), text_column="chosen", label_column="label",
                         fmt="preference", records=rows, colmap={}, tags={})
        if rows and "messages" in rows[0]:
            if cfg.task != CAUSAL_LM:
                raise DataError(f"data: {data!r} is chat data (messages), for task='causal-lm', not {cfg.task!r}")
            return _Rows(texts=[], labels=None, label_names=None, where=f"data {data!r}",
                         source=builtin.builtin_source(name), text_column="messages", label_column="label",
                         fmt="messages", records=rows, colmap={}, tags={})
        has_labels = bool(rows) and "label" in rows[0]
        return _Rows(texts=[r["text"] for r in rows],
                     labels=[r["label"] for r in rows] if has_labels else None,
                     label_names=builtin.builtin_label_names(name), where=f"data {data!r}",
                     source=builtin.builtin_source(name), text_column="text", label_column="label")
    path = Path(data).expanduser()
    if path.exists():
        return _read_local(path, cfg)
    if _looks_like_path(data):
        raise DataError(f"data: {data!r} does not exist (no such file or directory); give a "
                        f"{_SUPPORTED} file, a directory of them, 'builtin:<name>' or a dataset id")
    return _read_hub(data, cfg)


def _looks_like_path(data: str) -> bool:
    # Hub ids are "name" or "owner/name"; anything else that is not on disk is a mistyped path
    return (Path(data).suffix.lower() in FILE_FORMATS or data.startswith(("/", ".", "~"))
            or data.count("/") >= 2 or "\\" in data or data.endswith("/"))


def _read_local(path: Path, cfg: TrainConfig) -> _Rows:
    if cfg.dataset_entry:
        return _read_entries(path, cfg)
    if path.is_dir():
        files = _data_files(path)
        info = chat.dataset_info(path) if cfg.task == CAUSAL_LM else None
        if info and info.get("file_name") and (path / info["file_name"]).is_file():
            files = [path / info["file_name"]]   # LLaMA-Factory's entry names the file
        if not files:
            if any(p.suffix.lower() in IMAGE_EXTS for p in path.rglob("*") if p.is_file()):
                raise DataError(f"data: directory '{path}' holds images, not text; set task='image-classification' "
                                f"(task={cfg.task!r} reads {_SUPPORTED} files)")
            raise DataError(f"data: directory '{path}' holds no data files; supported: {_SUPPORTED}")
        where = f"directory '{path}'"
    else:
        suffix = path.suffix.lower()
        if suffix not in FILE_FORMATS:
            raise DataError(f"data: file '{path}' has an unsupported type {suffix or '(no suffix)'!r}; "
                            f"supported: {_SUPPORTED}")
        files = [path]
        where = f"file '{path}'"
        info = chat.dataset_info(path) if cfg.task == CAUSAL_LM else None
    return _read_files(files, path, where, cfg, info)


def _data_files(folder: Path) -> list[Path]:
    """The data files under ``folder`` (recursively, hidden ones and dataset_info.json skipped), sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                  and p.suffix.lower() in FILE_FORMATS and p.name != "dataset_info.json")


def _read_entries(folder: Path, cfg: TrainConfig) -> _Rows:
    """``cfg.dataset_entry``'s entries of ``folder/dataset_info.json``, each read with its own formatting and
    columns; several are concatenated in the order named (LLaMA-Factory's ``dataset: a,b``)."""
    if not folder.is_dir():
        raise DataError(f"dataset_entry: {cfg.dataset_entry!r} names entries of a LLaMA-Factory data folder's "
                        f"dataset_info.json, so data= must be that folder; '{folder}' is a file (leave "
                        "dataset_entry blank to read it alone)")
    if cfg.task != CAUSAL_LM:
        raise DataError(f"dataset_entry: LLaMA-Factory's dataset_info.json entries are causal-LM data; task="
                        f"{cfg.task!r} reads data= as a file or folder (leave dataset_entry blank)")
    parts = []
    for name in cfg.dataset_entry.split(","):
        entry = chat.dataset_info(folder, name)
        assert entry is not None
        fname = entry.get("file_name")
        if not fname:
            hub = entry.get("hf_hub_url") or entry.get("ms_hub_url") or entry.get("script_url")
            raise DataError(f"dataset_entry: entry {name!r} of '{folder / 'dataset_info.json'}' has no file_name"
                            + (f" (it is read from {hub!r}): give data={hub!r} with its data_format and columns"
                               if hub else ": nbtrain reads an entry's local file"))
        target = folder / fname
        files = [target] if target.is_file() else _data_files(target) if target.is_dir() else []
        if not files:
            raise DataError(f"dataset_entry: entry {name!r} names file_name {fname!r}, which is not in '{folder}'")
        parts.append(_read_files(files, target, f"dataset_info entry {name!r} ('{target}')", cfg, entry))
    if len(parts) == 1:
        return parts[0]
    text = [p.where for p in parts if p.fmt == "text"]
    if text:
        raise DataError(f"dataset_entry: {', '.join(text)} read as plain text; entries are concatenated only "
                        "as chat / instruction data (give them a formatting, or train on one entry)")
    return _Rows(texts=[], labels=None, label_names=None, where=f"directory '{folder}'",
                 source=" + ".join(p.source for p in parts), text_column=parts[0].text_column,
                 label_column=cfg.label_column, fmt=parts[0].fmt, records=[], parts=parts)


def _read_files(files: list[Path], path: Path, where: str, cfg: TrainConfig, info: dict | None) -> _Rows:
    """Rows of data files of one format (``path``: the file or folder given, for the source line)."""
    builders = {FILE_FORMATS[p.suffix.lower()][0] for p in files}
    kwargs_seen = {frozenset(FILE_FORMATS[p.suffix.lower()][1].items()) for p in files}
    if len(builders) > 1 or len(kwargs_seen) > 1:
        found = sorted({p.suffix.lower() for p in files})
        raise DataError(f"data: directory '{path}' mixes file formats ({', '.join(found)}); "
                        "put files of one format in it")
    desc = "file" if files == [path] else f"{len(files)} file{'s' * (len(files) != 1)}"
    builder, kwargs = FILE_FORMATS[files[0].suffix.lower()]
    try:
        ds = _load_dataset(where, builder, data_files=[str(f) for f in files], split="train", quiet=True,
                           **kwargs)
    except DataError:
        # pyarrow's parse errors count rows per block, not per file; find the bad line ourselves
        bad = _json_problem(files, name_file=len(files) > 1) if builder == "json" else None
        if bad:
            raise DataError(f"data: could not read {where}: {bad}") from None
        raise
    return _rows_from_dataset(ds, cfg, where, f"{path} ({builder} {desc}, {ds.num_rows} rows)",
                              single_text_column=builder == "text", info=info)


def peek_format(cfg: TrainConfig) -> str | None:
    """The format a run would read ``cfg.data`` as (a chat format or "text"), from a local file's first row and
    the folder's ``dataset_info.json``, as the loader detects it; ``cfg.data_format`` when it names one. None when
    that cannot be told without loading: a dataset id, a path not on this machine, an unreadable file. Bad data
    (a format named but its columns missing) raises ``DataError``, as the run would."""
    if cfg.data_format != "auto" or cfg.task != CAUSAL_LM:
        return cfg.data_format if cfg.task == CAUSAL_LM else "text"
    data = cfg.data.strip()
    if data.startswith("builtin:"):
        rows = builtin.builtin_rows(data[len("builtin:"):])
        return "preference" if rows and "chosen" in rows[0] else "messages" if rows and "messages" in rows[0] \
            else "text"
    path = Path(data).expanduser()
    if not path.exists():
        return None
    if cfg.dataset_entry:
        names = cfg.dataset_entry.split(",")
        entry = chat.dataset_info(path, names[0]) if path.is_dir() else None
        target = path / str((entry or {}).get("file_name", ""))
        files = [target] if entry and target.is_file() else _data_files(target) if entry and target.is_dir() else []
    else:
        entry = chat.dataset_info(path)
        files = [path] if path.is_file() else _data_files(path)
        if entry and entry.get("file_name") and (path / entry["file_name"]).is_file():
            files = [path / entry["file_name"]]
    if not files:
        return None
    try:
        columns = _first_row_columns(files[0])
    except (OSError, ValueError):
        return None
    if columns is None:
        return "text"
    return chat.detect_format(list(columns), cfg, entry, f"file '{files[0]}'")[0]


def _first_row_columns(f: Path) -> tuple[str, ...] | None:
    """The columns of a data file's first row; None for a plain text file."""
    suffix = f.suffix.lower()
    if FILE_FORMATS.get(suffix, ("text",))[0] == "text":
        return None
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return tuple(pq.read_schema(f).names)
    if suffix in (".csv", ".tsv"):
        import csv

        with f.open(newline="", encoding="utf-8") as fh:
            return tuple(next(csv.reader(fh, delimiter="\t" if suffix == ".tsv" else ","), []))
    with f.open(encoding="utf-8") as fh:   # JSON lines: the first line is the first row
        first = next((ln for ln in fh if ln.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:   # a JSON document over several lines (a list of records)
        row = json.loads(f.read_text(encoding="utf-8"))
    if isinstance(row, list):
        row = row[0] if row else {}
    return tuple(row) if isinstance(row, dict) else ()


def _read_hub(data: str, cfg: TrainConfig) -> _Rows:
    ds, split, where = hub_dataset(data)
    return _rows_from_dataset(ds, cfg, where, f"dataset {data!r}, split {split!r} ({ds.num_rows} rows)",
                              single_text_column=False)


def hub_dataset(data: str, hint: str = "") -> tuple[Any, str, str]:
    """``(dataset, split, where)`` of a dataset id: its ``train`` split (or its first), from the Hub or, when the
    Hub cannot be reached, from the local datasets cache only. ``hint`` ends the offline error (what to give
    instead)."""
    import datasets

    name, _, config_name = data.partition(":")
    where = f"dataset {data!r}"
    offline = bool(datasets.config.HF_HUB_OFFLINE) or hub.hub_offline()
    try:
        with hub.offline_mode(offline):
            dd = _load_dataset(where, name, config_name or None)
    except DataError:
        if offline:
            raise DataError(
                f"data: {data!r} is not a local file or directory, and it could not be loaded "
                "offline as a Hugging Face dataset id (the Hub is not reachable and it is not in the "
                "local datasets cache). Give a local path instead: " + (hint or f"a {_SUPPORTED} file or a "
                "directory of them (or 'builtin:python-docs').")) from None
        raise
    if isinstance(dd, datasets.DatasetDict):
        if not dd:
            raise DataError(f"{where}: has no splits")
        split = "train" if "train" in dd else next(iter(dd))
        ds = dd[split]
    else:
        split, ds = "train", dd
    return ds, split, where


def _rows_from_dataset(ds, cfg: TrainConfig, where: str, source: str,
                       single_text_column: bool, info: dict | None = None) -> _Rows:
    import datasets

    features = ds.features
    columns = list(ds.column_names)
    if single_text_column and cfg.task == CAUSAL_LM:
        preference.check_objective("text", None, cfg, where)
    if single_text_column and cfg.data_format not in ("auto", "text"):
        raise DataError(f"{where}: a text file holds plain text, one example per line, not data_format="
                        f"{cfg.data_format!r}; give a json, jsonl, csv or parquet file for chat data")
    if not single_text_column and cfg.task == CAUSAL_LM:
        fmt, colmap, tags = chat.detect_format(columns, cfg, info, where)
        preference.check_objective(fmt, columns, cfg, where)
        if fmt != "text":
            keep = sorted(set(colmap.values()))
            records = ds.select_columns(keep).to_list()
            first = "prompt" if fmt == prompts.PROMPT_FORMAT else (chat.REQUIRED.get(fmt) or chat.PREF_REQUIRED[fmt])[0]
            return _Rows(texts=[], labels=None, label_names=None, where=where, source=source,
                         text_column=colmap.get(first, ""), label_column=cfg.label_column,
                         fmt=fmt, records=records, colmap=colmap, tags=tags)
    text_col = columns[0] if single_text_column else cfg.text_column
    if text_col not in features:
        images = [c for c, f in features.items() if isinstance(f, datasets.Image)]
        hint = (f" It holds images (column {images[0]!r}): for those set task='image-classification'."
                if images else "")
        if cfg.task == CAUSAL_LM and not hint:
            hint = (" For chat / instruction data give columns messages, conversations, instruction + output or "
                    "prompt + completion (or map yours with columns={...} and name data_format).")
        raise DataError(f"{where}: no text column {text_col!r}; its columns are {columns}. "
                        f"Set text_column to one of them.{hint}")
    feat = features[text_col]
    column = ds.data.column(text_col)
    if len(column) and column.null_count == len(column):
        # a reader infers a number type for a column with no values at all; say that it is empty
        raise DataError(f"{where}: no examples: text column {text_col!r} is empty in all {len(column)} rows")
    if not (isinstance(feat, datasets.Value) and feat.dtype in ("string", "large_string")):
        raise DataError(f"{where}: text column {text_col!r} holds {_describe_feature(feat)}, not text; "
                        "text_column must name a column of strings")
    texts = column.to_pylist()
    labels = label_names = None
    label_col = cfg.label_column
    if cfg.task == CLASSIFICATION:
        if label_col not in features:
            raise DataError(f"{where}: no label column {label_col!r}; its columns are {columns}. "
                            "Set label_column to one of them (sequence classification needs labels).")
        lfeat = features[label_col]
        ok = isinstance(lfeat, datasets.ClassLabel) or (
            isinstance(lfeat, datasets.Value)
            and (lfeat.dtype in ("string", "large_string", "bool")
                 or lfeat.dtype.startswith(("int", "uint", "float"))))
        if not ok:
            raise DataError(f"{where}: label column {label_col!r} holds {_describe_feature(lfeat)}; "
                            "labels must be integers 0..K-1 or strings")
        labels = ds.data.column(label_col).to_pylist()
        if isinstance(lfeat, datasets.ClassLabel):
            label_names = list(lfeat.names)
    return _Rows(texts=texts, labels=labels, label_names=label_names, where=where, source=source,
                 text_column=text_col, label_column=label_col)


def _json_problem(files: list[Path], name_file: bool) -> str | None:
    """The first line that does not parse in JSON / JSON-lines ``files``, and why; None if all parse."""
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        at = f"file '{f}' " if name_file else ""
        try:
            json.loads(text)
            continue   # one JSON document (a list of records): it parses, so the problem is elsewhere
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                return f"{at}line {e.lineno} is not valid JSON: {e.msg} (column {e.colno})"
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return (f"{at}line {n} is not valid JSON: {e.msg} (column {e.colno}); JSON lines "
                        "need one complete record per line")
    return None


def _describe_feature(feat) -> str:
    dtype = getattr(feat, "dtype", None)
    return f"{dtype} values" if isinstance(dtype, str) else f"{type(feat).__name__} values ({feat})"


def _load_dataset(where: str, *args, quiet: bool = False, **kwargs):
    """``datasets.load_dataset`` with its failures turned into a ``DataError`` naming ``where``."""
    import logging

    import datasets
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()  # a bar per tiny local file is noise in a notebook
    # datasets logs a parser failure before raising it; the DataError below already says it once
    ds_logger = logging.getLogger("datasets")
    saved_level = ds_logger.level
    if quiet:
        ds_logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(*args, **kwargs)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets wraps parser errors in many types; all mean "unreadable"
        raise DataError(f"data: could not read {where}: {_root_cause(e)}") from None
    finally:
        ds_logger.setLevel(saved_level)
        if not was_disabled:
            enable_progress_bars()


def _root_cause(e: BaseException) -> str:
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    names = {type(c).__name__ for c in chain}
    text = " ".join(str(c) for c in chain)
    if any(isinstance(c, UnicodeDecodeError) for c in chain):
        return "it is not UTF-8 text (a binary file?)"
    if "magic bytes" in text or "ArrowInvalid" in names and "parquet" in text.lower():
        return "it is not a valid parquet file"
    if (names & {"EmptyDataError", "SchemaInferenceError", "StopIteration"}
            or "corresponds to no data" in text):
        return "it holds no rows (empty file?)"
    # datasets' own wrappers ("An error occurred while generating the dataset") hide the parser's words
    first = next((c for c in chain if str(c) and not type(c).__module__.startswith("datasets")),
                 next((c for c in chain if str(c)), e))
    msg = str(first).strip().splitlines()[0] if str(first).strip() else ""
    return f"{type(first).__name__}: {msg[:300]}" if msg else type(first).__name__
