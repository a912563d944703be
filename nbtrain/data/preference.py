"""Preference data (DPO, ORPO, SimPO): rows of a prompt with a chosen and a rejected answer -> tokenized pairs.

Formats, named by ``cfg.data_format`` or, under ``"auto"``, detected from the columns (both ``chosen`` and
``rejected`` there, after ``cfg.columns`` and a LLaMA-Factory ``dataset_info.json`` entry map them):

* ``"preference"``: TRL's preference format, columns ``prompt``, ``chosen``, ``rejected`` (optional ``system``).
  Plain: three strings (the prompt is one user turn). Conversational: ``prompt`` a list of ``{"role",
  "content"}`` messages ending with a user turn, ``chosen`` / ``rejected`` a list holding the one assistant
  message (or the message, or its text). Without a ``prompt`` column, conversational ``chosen`` / ``rejected``
  are whole conversations and the prompt is the messages they share (TRL's implicit prompt). AutoTrain's column
  mapping is ``columns={"prompt": <prompt_text_column>, "chosen": <text_column>, "rejected":
  <rejected_text_column>}``.
* ``"alpaca-ranking"``: LLaMA-Factory's alpaca with ``"ranking": true``: ``instruction`` (+ ``input``, joined
  with a newline), optional ``system`` and ``history``, and ``chosen`` / ``rejected`` strings. Its
  dataset_info columns ``prompt``/``query``/``chosen``/``rejected``/``system``/``history`` map as for alpaca.
* ``"sharegpt-ranking"``: LLaMA-Factory's sharegpt with ``"ranking": true``: ``conversations`` ending with a
  user turn, and ``chosen`` / ``rejected`` message objects (``{"from": "gpt", "value": ...}``, the entry's tags).

A named ``alpaca`` or ``sharegpt`` is its ranking variant when the entry says ``ranking`` or the rows have both
answers. Under ``objective="lm"`` a row set that also fits a single-answer format (UltraFeedback's ``messages``
beside ``chosen`` / ``rejected``) is read as that format. (``chat.detect_format`` tells these formats apart, beside
the single-answer ones.)

Each pair is tokenized through the chat template, as chat SFT data (``chat.py``): the prompt is the conversation
rendered up to and including the assistant's generation prompt, and each answer is the text the template writes
for the assistant turn after it (its content and end-of-turn marker, without a ``dangling_tail``). Prompt and
answers are tokenized apart (as TRL does, and as a prompt is tokenized when the model answers it), so the
chosen and rejected sequences share the prompt's tokens exactly. An example is ``{"input_ids": prompt + chosen,
"labels": [-100] * len(prompt) + chosen, "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] *
len(prompt) + rejected}`` (``batching.collate`` puts a batch's chosen rows, then its rejected rows, in one
MicroBatch). ``train_on`` does not apply: the targets are the final answer alone.

Longer than ``max_seq_len`` (prompt + the longer answer): the prompt is cut from its left and both answers are
kept whole (``prompts_cut_left``). When the longer answer alone leaves no room for a prompt token, the prompt
keeps its last token (the end of the generation prompt) and both answers are cut at the right to the rest
(``answers_cut``); a pair whose answers are then the same tokens is kept and counted
(``pairs_identical_after_cut``: its loss carries no preference). No row is dropped.

Bad rows (a missing or empty chosen or rejected answer, chosen equal to rejected, a prompt that does not end
with a user turn) are a ``DataError`` naming the file or entry, the row (counted from 0, as in the file) and the
field, before anything is tokenized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import chat
from .bundle import DataBundle, DataError

if TYPE_CHECKING:
    from ..config import TrainConfig

# the formats, their columns and the detection live in chat.py, beside the SFT formats it tells them from
PREF_FORMATS, PREF_COLUMNS, PREF_REQUIRED = chat.PREF_FORMATS, chat.PREF_COLUMNS, chat.PREF_REQUIRED
OBJECTIVES = ("dpo", "orpo", "simpo")   # the preference objectives of TrainConfig.objective
IGNORE_INDEX = chat.IGNORE_INDEX
_CHUNK = 1024
_ANSWER = "\x00nbtrain-answer"   # a stand-in output column, so alpaca's prompt is built by chat.to_messages itself


def check_objective(fmt: str, columns: list[str] | None, cfg: TrainConfig, where: str) -> None:
    """DataError when ``cfg.objective`` and the data disagree: a preference objective on data without chosen and
    rejected answers, or objective "lm" on preference data. ``columns``: the data's (None for plain text lines)."""
    objective = getattr(cfg, "objective", "lm")
    found = "one text per line (a plain text file)" if columns is None else f"columns {sorted(columns)}"
    if objective == "grpo" or fmt == "prompt":
        if objective != "grpo":
            raise DataError(f"{where}: this is prompt data ({found}): prompts without answers, for "
                            f"objective='grpo' (online RL), not objective={objective!r}")
        if fmt != "prompt":
            raise DataError(f"{where}: objective='grpo' needs prompt data (TRL's prompt format: a 'prompt' column, a "
                            f"string or role/content messages per row, other columns passed to the rewards); this "
                            f"has {found}. 'builtin:prompts' is such data")
        return
    if objective != "lm" and not chat.is_preference(fmt):
        what = "plain text" if fmt == "text" else f"{fmt} data (one answer per row)"
        raise DataError(f"{where}: objective={objective!r} needs preference data, a prompt with a chosen and a "
                        f"rejected answer; this is {what}, with {found}. Allowed: TRL's prompt/chosen/rejected "
                        "(plain or conversational), LLaMA-Factory ranking data (alpaca instruction/chosen/rejected, "
                        "sharegpt conversations/chosen/rejected), or map yours with columns={'prompt': ..., "
                        "'chosen': ..., 'rejected': ...} (AutoTrain's prompt_text_column, text_column, "
                        "rejected_text_column); 'builtin:python-docs-pref' is such data. Or set objective='lm'")
    if objective == "lm" and chat.is_preference(fmt):
        raise DataError(f"{where}: this is preference data ({chat.pref_format_words(fmt)}, {found}): each row "
                        "has a chosen and a rejected answer, and objective='lm' trains on one answer. Set "
                        "objective='dpo', 'orpo' or 'simpo'; or, for supervised tuning on the chosen answers, give a single-answer "
                        "format (e.g. data_format='prompt-completion' with columns={'completion': '<chosen column>'})")


# ---------------------------------------------------------------------------------------------
# rows -> (prompt messages, chosen, rejected)
# ---------------------------------------------------------------------------------------------
def to_pair(fmt: str, rec: dict, row: int, colmap: dict[str, str], tags: dict[str, str],
            where: str) -> tuple[list[dict[str, str]], str, str]:
    """One row of preference data as ``(prompt messages, chosen text, rejected text)``, checked: the prompt
    alternates user, assistant, ... after an optional system message and ends with a user turn; both answers are
    present, non-empty and differ. A bad row is a ``DataError`` naming ``where``, the row and the field."""
    def get(name: str) -> Any:
        return rec.get(colmap.get(name, name))

    def name(c: str) -> str:
        return colmap.get(c, c)

    def system() -> list[dict[str, str]]:
        s = get("system")
        return [{"role": "system", "content": s}] if isinstance(s, str) and s.strip() else []

    role_key, content_key, roles = "role", "content", None
    if fmt == "preference":
        p, c, r = get("prompt"), get("chosen"), get("rejected")
        _present(c, row, name("chosen"), where)
        _present(r, row, name("rejected"), where)
        if p is None and "prompt" not in colmap:
            prompt, c, r = _implicit_prompt(c, r, row, name("chosen"), name("rejected"), where)
        elif isinstance(p, (list, tuple)):
            prompt = chat._turns(p, row, name("prompt"), where, "role", "content", None)
            if prompt[0]["role"] != "system":
                prompt = system() + prompt
        else:
            prompt = system() + [{"role": "user", "content": chat._text(p, row, name("prompt"), where)}]
        pfield = name("prompt")
    elif fmt == "alpaca-ranking":
        _present(get("chosen"), row, name("chosen"), where)
        _present(get("rejected"), row, name("rejected"), where)
        # LLaMA-Factory's alpaca prompt (instruction + input, system, history), built by the SFT reader itself
        msgs = chat.to_messages("alpaca", {**rec, _ANSWER: "."}, row, {**colmap, "output": _ANSWER}, tags, where)
        prompt, pfield = msgs[:-1], name("instruction")
        c, r = get("chosen"), get("rejected")
    elif fmt == "sharegpt-ranking":
        pfield = name("conversations")
        raw = get("conversations")
        role_key, content_key = tags.get("role_tag", "from"), tags.get("content_tag", "value")
        if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], dict) and role_key not in raw[0] \
                and "role" in raw[0] and "role_tag" not in tags:
            role_key, content_key = "role", "content"   # OpenAI-style turns in a sharegpt file
        roles = dict(chat.SHAREGPT_ROLES)
        for ours, tag in (("user", "user_tag"), ("assistant", "assistant_tag"), ("system", "system_tag")):
            if tag in tags:
                roles[tags[tag].lower()] = ours
        c, r = get("chosen"), get("rejected")
        _present(c, row, name("chosen"), where)
        _present(r, row, name("rejected"), where)
        prompt = chat._turns(raw, row, pfield, where, role_key, content_key, roles)
        if prompt[0]["role"] != "system":
            prompt = system() + prompt
    else:
        raise DataError(f"data_format: {fmt!r} is not a preference format; allowed: {', '.join(PREF_FORMATS)}")
    chosen = _answer(c, row, name("chosen"), where, role_key, content_key, roles)
    rejected = _answer(r, row, name("rejected"), where, role_key, content_key, roles)
    if chosen.strip() == rejected.strip():
        raise DataError(f"{where}: row {row}: fields {name('chosen')!r} and {name('rejected')!r} hold the same "
                        f"answer ({_short(chosen)}); a preference pair needs two different answers")
    if prompt[-1]["role"] != "user":
        raise DataError(f"{where}: row {row}: field {pfield!r} ends with a {prompt[-1]['role']} turn; the prompt "
                        "must end with a user turn, which the chosen and rejected answers answer")
    # the turns before it alternate: checked as the conversation the prompt opens, with an answer after it
    chat._check_alternation(prompt + [{"role": "assistant", "content": chosen}], row, pfield, where)
    return prompt, chosen, rejected


def _present(v: Any, row: int, field: str, where: str) -> None:
    if v is None:
        raise DataError(f"{where}: row {row}: field {field!r} is missing; every row needs a chosen and a rejected "
                        "answer")


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def _answer(v: Any, row: int, field: str, where: str, role_key: str, content_key: str,
            roles: dict[str, str] | None) -> str:
    """An answer's text: a string, one assistant message, or a list holding one."""
    _present(v, row, field, where)
    if isinstance(v, str):
        if not v.strip():
            raise DataError(f"{where}: row {row}: field {field!r} is empty")
        return v
    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise DataError(f"{where}: row {row}: field {field!r} must be the answer's text or its assistant message, "
                        f"got {type(v).__name__}")
    if not v:
        raise DataError(f"{where}: row {row}: field {field!r} is empty (no message)")
    if isinstance(v[0], dict) and role_key not in v[0] and "role" in v[0]:
        role_key, content_key, roles = "role", "content", None
    msgs = chat._turns(v, row, field, where, role_key, content_key, roles)
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        got = ", ".join(m["role"] for m in msgs)
        raise DataError(f"{where}: row {row}: field {field!r} must hold one assistant message (the answer), got "
                        f"{len(msgs)} turn(s): {got}")
    if not msgs[0]["content"].strip():
        raise DataError(f"{where}: row {row}: field {field!r} is empty")
    return msgs[0]["content"]


def _implicit_prompt(c: Any, r: Any, row: int, cfield: str, rfield: str,
                     where: str) -> tuple[list[dict[str, str]], list[dict], list[dict]]:
    """TRL's implicit prompt: whole conversations in chosen and rejected; the prompt is the messages they share."""
    if not (isinstance(c, (list, tuple)) and isinstance(r, (list, tuple))):
        raise DataError(f"{where}: row {row}: no prompt column 'prompt', and {cfield!r} / {rfield!r} are not "
                        "conversations (lists of messages) whose shared first turns could be the prompt; give a "
                        "prompt column, or map yours with columns={'prompt': '<your column>'}")
    cm = chat._turns(c, row, cfield, where, "role", "content", None)
    rm = chat._turns(r, row, rfield, where, "role", "content", None)
    k = 0
    while k < min(len(cm), len(rm)) - 1 and cm[k] == rm[k]:
        k += 1
    if k == 0:
        raise DataError(f"{where}: row {row}: no prompt column 'prompt', and {cfield!r} and {rfield!r} share no "
                        "first turns to take as the prompt")
    return cm[:k], list(c)[k:], list(r)[k:]


# ---------------------------------------------------------------------------------------------
# tokenizing
# ---------------------------------------------------------------------------------------------
def tokenize_pairs(tokenizer, cfg: TrainConfig, pairs: list[tuple[list[dict], str, str]], max_len: int | None,
                   row0: int = 0) -> tuple[list[dict], dict[str, int]]:
    """``(one example per pair, counts)``: the example contract of the module doc, cut to ``max_len`` as it says.
    Call ``chat.ensure_chat_tokens`` first, so the template's markers are single tokens."""
    _, jinja = chat.resolve_template(tokenizer, cfg)
    tail = chat.dangling_tail(tokenizer, jinja)
    out: list[dict] = []
    counts = {"prompts_cut_left": 0, "answers_cut": 0, "pairs_identical_after_cut": 0}
    for start in range(0, len(pairs), _CHUNK):
        chunk = pairs[start: start + _CHUNK]
        prompts = [p for p, _, _ in chunk]
        befores = chat.render(tokenizer, jinja, prompts, add_generation_prompt=True)
        throughs = chat.render(tokenizer, jinja, [p + [{"role": "assistant", "content": a}]
                                                  for p, c, r in chunk for a in (c, r)])
        answers = [_answer_text(befores[k // 2], throughs[k], chunk[k // 2][1 + k % 2], tail, row0 + start + k // 2)
                   for k in range(len(throughs))]
        p_ids = tokenizer(befores, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answers, add_special_tokens=False)["input_ids"]
        for k in range(len(chunk)):
            out.append(_example(list(p_ids[k]), list(a_ids[2 * k]), list(a_ids[2 * k + 1]), max_len, counts))
    return out, counts


def _answer_text(before: str, through: str, content: str, tail: str, row: int) -> str:
    """What the template writes for the assistant turn after the prompt: ``through`` less ``before``."""
    if tail and through.endswith(tail):
        through = through[: len(through) - len(tail)]
    if through.startswith(before):
        return through[len(before):]
    at = through.rfind(content)   # a template that rewrites earlier turns: the answer's content and what follows
    if at < 0:
        raise DataError(f"chat_template: the template does not write assistant turns verbatim (row {row}), so the "
                        "answer's tokens cannot be found; use chatml, llama3 or alpaca")
    return through[at:]


def _example(prompt: list[int], chosen: list[int], rejected: list[int], max_len: int | None,
             counts: dict[str, int]) -> dict:
    longest = max(len(chosen), len(rejected))
    if max_len is not None and len(prompt) + longest > max_len:
        keep = max(1, max_len - longest)   # the prompt's last tokens: its end (the generation prompt) stays
        if keep < len(prompt):
            prompt = prompt[-keep:]
            counts["prompts_cut_left"] += 1
        room = max_len - len(prompt)
        if longest > room:
            chosen, rejected = chosen[:room], rejected[:room]
            counts["answers_cut"] += 1
            counts["pairs_identical_after_cut"] += chosen == rejected
    mask = [IGNORE_INDEX] * len(prompt)
    return {"input_ids": prompt + chosen, "labels": mask + chosen,
            "rejected_input_ids": prompt + rejected, "rejected_labels": mask + rejected}


# ---------------------------------------------------------------------------------------------
# the bundle
# ---------------------------------------------------------------------------------------------
def load_preference(cfg: TrainConfig, tokenizer, parts: list, source: str, pad_token_id: int,
                    split_indices: Callable[[int, float, int], tuple[list[int], list[int]]]) -> DataBundle:
    """Preference rows (``parts``: the loader's rows of each file or dataset_info entry, with ``fmt``,
    ``records``, ``colmap``, ``tags``, ``where``) -> checked pairs -> the train / eval split (``split_indices``:
    the loader's, as for every other kind of data) -> tokenized pairs."""
    for part in parts:
        if not part.records:
            raise DataError(f"{part.where}: no examples (0 rows)")
    # every row is checked before any is tokenized, so a bad row 900 fails before training, naming itself
    pairs = [to_pair(part.fmt, rec, i, part.colmap or {}, part.tags or {}, part.where)
             for part in parts for i, rec in enumerate(part.records)]
    if cfg.subset is not None:
        pairs = pairs[: cfg.subset]
    added = chat.ensure_chat_tokens(tokenizer, cfg)   # before tokenizing: the template's markers are single tokens
    train_idx, eval_idx = split_indices(len(pairs), cfg.eval_fraction, cfg.data_order_seed)
    train, tc = tokenize_pairs(tokenizer, cfg, [pairs[i] for i in train_idx], cfg.max_seq_len)
    evals, ec = tokenize_pairs(tokenizer, cfg, [pairs[i] for i in eval_idx], cfg.max_seq_len)
    counts = {k: tc[k] + ec[k] for k in tc}
    stats: dict[str, Any] = {
        "rows": sum(len(part.records) for part in parts), "documents": len(pairs), "pairs": len(pairs),
        "train_documents": len(train_idx), "eval_documents": len(eval_idx),
        "data_format": ", ".join(dict.fromkeys(part.fmt for part in parts)),
        "chat_template": chat.describe_template(tokenizer, cfg), "chat_tokens_added": added,
        "train_on": "answer", "target_tokens": chat.target_count(train),
        "rejected_target_tokens": chat.target_count([{"labels": ex["rejected_labels"]} for ex in train]),
        **counts, "packing": False,
    }
    notes = []
    if counts["prompts_cut_left"]:
        notes.append(f"preference data: {counts['prompts_cut_left']} pair(s) longer than max_seq_len="
                     f"{cfg.max_seq_len} had their prompt cut from the left; both answers kept whole")
    if counts["answers_cut"]:
        same = counts["pairs_identical_after_cut"]
        notes.append(f"preference data: {counts['answers_cut']} pair(s) had an answer longer than max_seq_len="
                     f"{cfg.max_seq_len} allows: the prompt kept its last token and both answers were cut at the "
                     "right" + (f"; {same} of them have the same answer tokens after the cut (no preference "
                                "signal)" if same else "") + "; raise max_seq_len to keep them whole")
    return DataBundle(train=train, eval=evals, task="causal-lm", pad_token_id=pad_token_id, num_labels=None,
                      label_names=None, source=source, stats=stats, notes=notes)


__all__ = ["OBJECTIVES", "PREF_COLUMNS", "PREF_FORMATS", "PREF_REQUIRED", "check_objective", "load_preference",
           "to_pair", "tokenize_pairs"]
