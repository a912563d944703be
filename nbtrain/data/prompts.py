"""Prompt data for online RL (``objective="grpo"``): rows of a prompt, and any other columns the rewards read.

TRL's prompt format: a ``prompt`` column (``cfg.columns`` can map another name to it), either

* plain: a string, tokenized as it is (the tokenizer's own special tokens, as TRL does with a plain prompt), or
* conversational: a list of ``{"role", "content"}`` messages ending with a user turn, rendered with the chat template
  up to and including the assistant's generation prompt (``cfg.chat_template``, as chat SFT data).

Every other column of a row (an ``answer`` for the ``exact`` and ``contains`` rewards, or anything a reward function
of the user's reads) is kept and handed to the rewards, one value per completion. A prompt longer than
``max_seq_len`` tokens is cut from its left (it keeps its end, the generation prompt); the count is in the stats
and the notes. Bad rows (no prompt, an empty one, messages that do not end with a user turn) are a ``DataError``
naming the file or entry, the row (counted from 0) and the field, before anything is tokenized.

An example is ``{"input_ids": prompt tokens, "prompt": the row's prompt as given (string or messages), "columns":
{name: value}}``; the completions are sampled while training (``engine.grpo_run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import chat
from .bundle import DataBundle, DataError

if TYPE_CHECKING:
    from ..config import TrainConfig

PROMPT_FORMAT = "prompt"


def to_prompt(rec: dict, row: int, colmap: dict[str, str], where: str) -> tuple[Any, dict[str, Any]]:
    """One row as ``(prompt: str or checked messages, the other columns)``; a bad row is a ``DataError`` naming
    ``where``, the row and the field."""
    field = colmap.get("prompt", "prompt")
    raw = rec.get(field)
    if raw is None:
        raise DataError(f"{where}: row {row}: no {field!r}; objective='grpo' needs a prompt in every row (a string, "
                        "or a list of role/content messages ending with a user turn)")
    if isinstance(raw, str):
        if not raw.strip():
            raise DataError(f"{where}: row {row}: field {field!r} is empty; a prompt needs some text")
        prompt: Any = raw
    elif isinstance(raw, (list, tuple)):
        prompt = chat._turns(raw, row, field, where, "role", "content", None)
        if prompt[-1]["role"] != "user":
            raise DataError(f"{where}: row {row}: field {field!r} ends with a {prompt[-1]['role']} turn; a prompt "
                            "must end with a user turn, which the completions answer")
        chat._check_alternation(prompt + [{"role": "assistant", "content": "."}], row, field, where)
    else:
        raise DataError(f"{where}: row {row}: field {field!r} holds {type(raw).__name__}; a prompt is a string or "
                        "a list of role/content messages")
    columns = {k: v for k, v in rec.items() if k != field}
    return prompt, columns


def tokenize_prompts(tokenizer, cfg: TrainConfig, prompts: list[Any], max_len: int) -> tuple[list[list[int]], int]:
    """Each prompt's token ids (conversations through the chat template, plain text as it is) and how many were cut
    from the left to ``max_len``."""
    convs = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    out: list[list[int]] = [[] for _ in prompts]
    if convs:
        _, jinja = chat.resolve_template(tokenizer, cfg)
        texts = chat.render(tokenizer, jinja, [prompts[i] for i in convs], add_generation_prompt=True)
        for i, text in zip(convs, texts):
            out[i] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out[i] = list(tokenizer(p, add_special_tokens=True)["input_ids"])
    cut = 0
    for i, ids in enumerate(out):
        if len(ids) > max_len:
            out[i], cut = ids[-max_len:], cut + 1
    return out, cut


def load_prompts(cfg: TrainConfig, tokenizer, parts: list, source: str, pad_token_id: int,
                 split_indices: Callable[[int, float, int], tuple[list[int], list[int]]]) -> DataBundle:
    """Prompt rows (``parts``: the loader's rows of each file or entry) -> checked prompts -> the train / eval split
    -> tokenized prompts with their other columns."""
    for part in parts:
        if not part.records:
            raise DataError(f"{part.where}: no examples (0 rows)")
    rows = [to_prompt(rec, i, part.colmap or {}, part.where) for part in parts for i, rec in enumerate(part.records)]
    if cfg.subset is not None:
        rows = rows[: cfg.subset]
    added = chat.ensure_chat_tokens(tokenizer, cfg) if any(not isinstance(p, str) for p, _ in rows) else []
    ids, cut = tokenize_prompts(tokenizer, cfg, [p for p, _ in rows], cfg.max_seq_len)
    examples = [{"input_ids": t, "prompt": p, "columns": c} for t, (p, c) in zip(ids, rows)]
    train_idx, eval_idx = split_indices(len(examples), cfg.eval_fraction, cfg.data_order_seed)
    conversational = sum(not isinstance(p, str) for p, _ in rows)
    stats: dict[str, Any] = {
        "rows": sum(len(part.records) for part in parts), "documents": len(rows), "prompts": len(rows),
        "train_documents": len(train_idx), "eval_documents": len(eval_idx), "data_format": PROMPT_FORMAT,
        "conversational_prompts": conversational, "prompts_cut_left": cut, "packing": False,
        "columns": sorted({k for _, c in rows for k in c}),
    }
    if conversational:
        stats["chat_template"] = chat.describe_template(tokenizer, cfg)
        stats["chat_tokens_added"] = added
    notes = []
    if cut:
        notes.append(f"prompt data: {cut} prompt(s) longer than max_seq_len={cfg.max_seq_len} tokens were cut from "
                     "the left (each keeps its end, the generation prompt)")
    return DataBundle(train=[examples[i] for i in train_idx], eval=[examples[i] for i in eval_idx],
                      task="causal-lm", pad_token_id=pad_token_id, num_labels=None, label_names=None,
                      source=source, stats=stats, notes=notes)


__all__ = ["PROMPT_FORMAT", "load_prompts", "to_prompt", "tokenize_prompts"]
