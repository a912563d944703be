"""Chat and instruction data: templates, the special tokens they need, and prompts rendered for generation.

``cfg.chat_template`` names a template: ``"auto"`` is the tokenizer's own (``tokenizer.chat_template``) when it has
one, else ChatML; ``"chatml"``, ``"llama3"`` and ``"alpaca"`` are built in (Jinja strings below); anything else is
a Jinja template used as given. The ``tiny`` preset's tokenizer has no template and no ChatML tokens:
``ensure_chat_tokens`` adds ``<|im_start|>`` / ``<|im_end|>`` to it as special tokens, only when chat is used, so
plain-text runs keep today's vocabulary bit for bit.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bundle import DataError

if TYPE_CHECKING:
    from ..config import TrainConfig

# ChatML (Qwen, many others). Every turn is "<|im_start|>ROLE\nCONTENT<|im_end|>\n".
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama 3's header / end-of-turn layout (content as given: nbtrain does not trim it).
LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{{ message['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Stanford Alpaca's prompt. The "### Response:" header ends every user turn, so the generation prompt is built in;
# an answer ends with the tokenizer's EOS token, which is what teaches the model to stop. The blank line between an
# answer and the next instruction belongs to the instruction, so an answer's tokens are its content and EOS only.
ALPACA = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
          "{% elif message['role'] == 'user' %}{% if not loop.first and messages[loop.index0 - 1]['role'] == "
          "'assistant' %}\n\n{% endif %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
          "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama3": LLAMA3, "alpaca": ALPACA}
# the special tokens each built-in template writes, which a tokenizer must have as single tokens
TEMPLATE_TOKENS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "alpaca": (),
}


def resolve_template(tokenizer, cfg: TrainConfig) -> tuple[str, str]:
    """``(name, jinja)`` of the template ``cfg.chat_template`` picks for ``tokenizer``: name is "chatml", "llama3",
    "alpaca", "tokenizer" (its own) or "custom" (a Jinja string from the config)."""
    choice = (cfg.chat_template or "auto").strip()
    if choice == "auto":
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own.strip():
            return "tokenizer", own
        if isinstance(own, dict) and own.get("default"):   # tokenizers with several named templates
            return "tokenizer", own["default"]
        return "chatml", CHATML
    if choice.lower() in TEMPLATES:
        return choice.lower(), TEMPLATES[choice.lower()]
    return "custom", cfg.chat_template


def _needed_tokens(tokenizer, cfg: TrainConfig) -> tuple[str, ...]:
    name, _ = resolve_template(tokenizer, cfg)
    return TEMPLATE_TOKENS.get(name, ())


def missing_chat_tokens(tokenizer, cfg: TrainConfig) -> list[str]:
    """The special tokens the chosen template writes that ``tokenizer`` does not have as single tokens."""
    vocab = tokenizer.get_vocab()
    return [t for t in _needed_tokens(tokenizer, cfg) if t not in vocab]


def ensure_chat_tokens(tokenizer, cfg: TrainConfig) -> list[str]:
    """Add to ``tokenizer`` (as special tokens, so they are never split) the tokens the chosen template needs and it
    lacks; returns what was added (``[]`` when nothing was). The model's embeddings must then grow to
    ``len(tokenizer)``."""
    missing = missing_chat_tokens(tokenizer, cfg)
    if missing:
        # add_tokens(special_tokens=True): never split, never normalised; the same call in transformers 4 and 5
        # (add_special_tokens' keyword for keeping the existing extras was renamed between them)
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    return missing


def render(tokenizer, jinja: str, conversations: list[list[dict]], add_generation_prompt: bool = False) -> list[str]:
    """The conversations rendered to text with the Jinja template (the tokenizer's ``bos_token`` / ``eos_token``
    are available to it, as in ``apply_chat_template``)."""
    if not conversations:
        return []
    out = tokenizer.apply_chat_template(conversations, chat_template=jinja, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
    return list(out)


def conversation(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """A one-user-turn conversation, with a system message first when ``system`` is given."""
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def prompt_ids(tokenizer, cfg: TrainConfig, prompt: str, system: str | None = None) -> list[int]:
    """The token ids a model is given to answer ``prompt``: a one-user-turn conversation rendered with
    ``cfg.chat_template`` up to and including the assistant's generation prompt. Call ``ensure_chat_tokens`` first
    (``prepare`` does); a tokenizer without the template's special tokens is refused rather than splitting them."""
    missing = missing_chat_tokens(tokenizer, cfg)
    if missing:
        raise ValueError(f"chat_template: the tokenizer lacks the template's special tokens {missing}; call "
                         "nbtrain.data.chat.ensure_chat_tokens(tokenizer, cfg) first (and resize the model's "
                         "embeddings)")
    _, jinja = resolve_template(tokenizer, cfg)
    text = render(tokenizer, jinja, [conversation(prompt, system)], add_generation_prompt=True)[0]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def describe_template(tokenizer, cfg: TrainConfig) -> str:
    """A short name for the run notes and stats: "chatml", "llama3", "alpaca", "tokenizer" or "custom"."""
    return resolve_template(tokenizer, cfg)[0]


# ---------------------------------------------------------------------------------------------
# formats: rows -> conversations (lists of {"role", "content"})
# ---------------------------------------------------------------------------------------------
CHAT_FORMATS = ("alpaca", "sharegpt", "messages", "prompt-completion")
# each format's own column names (what cfg.columns maps from); the first ones are required
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output", "input", "system", "history"),
    "sharegpt": ("conversations", "system"),
    "messages": ("messages",),
    "prompt-completion": ("prompt", "completion"),
}
REQUIRED: dict[str, tuple[str, ...]] = {"alpaca": ("instruction", "output"), "sharegpt": ("conversations",),
                                        "messages": ("messages",), "prompt-completion": ("prompt", "completion")}
# LLaMA-Factory's dataset_info.json column keys -> ours
_LF_COLUMNS = {"alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                          "history": "history"},
               "sharegpt": {"messages": "conversations", "system": "system"}}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "bot": "assistant", "chatgpt": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


def dataset_info(path: Path) -> dict | None:
    """The LLaMA-Factory ``dataset_info.json`` entry for a data file or directory, when its folder has one:
    ``{"formatting", "columns", "tags", "file_name"}``. A folder of several entries picks the one naming the file (or,
    for a directory, the only entry)."""
    folder = path if path.is_dir() else path.parent
    info_file = folder / "dataset_info.json"
    if not info_file.is_file():
        return None
    try:
        info = json.loads(info_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data: '{info_file}' is not valid JSON ({e})") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise DataError(f"data: '{info_file}' must map dataset names to entries (objects with file_name, "
                        "formatting, columns, tags)")
    entries = list(info.values())
    if path.is_file():
        hits = [e for e in entries if e.get("file_name") == path.name]
    else:
        hits = [e for e in entries if e.get("file_name") and (folder / e["file_name"]).exists()]
        hits = hits if len(hits) == 1 else (entries if len(entries) == 1 else [])
    return hits[0] if hits else None


def columns_from_info(entry: dict, fmt: str) -> dict[str, str]:
    """LLaMA-Factory ``columns`` of ``entry`` as ``{our column name: the data's}``."""
    cols = entry.get("columns") or {}
    table = _LF_COLUMNS.get(fmt, {})
    return {table.get(k, k): v for k, v in cols.items() if isinstance(v, str)}


def detect_format(column_names: list[str], cfg: TrainConfig, info: dict | None = None,
                  where: str = "data") -> tuple[str, dict[str, str], dict[str, str]]:
    """``(format, {format column: data column}, sharegpt tags)`` for data with these columns; format "text" means
    the plain-text path. ``cfg.data_format`` names it, else ``dataset_info.json``'s ``formatting``, else the
    columns decide (messages, conversations, instruction+output, prompt+completion; otherwise text)."""
    fmt = cfg.data_format
    tags: dict[str, str] = {}
    colmap: dict[str, str] = {}
    if info is not None:
        lf = str(info.get("formatting", "alpaca")).lower()
        if lf not in ("alpaca", "sharegpt"):
            raise DataError(f"{where}: dataset_info.json formatting {lf!r} is not supported; allowed: alpaca, sharegpt")
        if fmt == "auto":
            fmt = lf
        colmap.update(columns_from_info(info, lf))
        tags = {k: v for k, v in (info.get("tags") or {}).items() if isinstance(v, str)}
    colmap.update(cfg.columns)
    if fmt == "text":
        return "text", colmap, tags
    have = set(column_names)

    def col(name: str) -> str:
        return colmap.get(name, name)

    if fmt == "auto":
        fmt = next((f for f in ("messages", "sharegpt", "alpaca", "prompt-completion")
                    if all(col(c) in have for c in REQUIRED[f])), "text")
        if fmt == "text":
            return "text", colmap, tags
    if fmt not in CHAT_FORMATS:
        raise DataError(f"data_format: {fmt!r} is not a chat format; allowed: {', '.join(CHAT_FORMATS)}")
    missing = [c for c in REQUIRED[fmt] if col(c) not in have]
    if missing:
        names = ", ".join(f"{c!r}" + (f" (mapped to {col(c)!r})" if col(c) != c else "") for c in missing)
        raise DataError(f"{where}: data_format {fmt!r} needs column(s) {names}; its columns are "
                        f"{sorted(have)}. Map yours with columns={{'{missing[0]}': '<your column>'}}")
    return fmt, {c: col(c) for c in FORMAT_COLUMNS[fmt] if col(c) in have}, tags


def _text(v: Any, row: int, field: str, where: str, allow_empty: bool = False) -> str:
    if v is None and allow_empty:
        return ""
    if not isinstance(v, str):
        raise DataError(f"{where}: row {row}: field {field!r} must be a string, got "
                        f"{'nothing' if v is None else type(v).__name__}")
    if not allow_empty and not v.strip():
        raise DataError(f"{where}: row {row}: field {field!r} is empty")
    return v


def _turns(raw: Any, row: int, field: str, where: str, role_key: str, content_key: str,
           role_map: dict[str, str] | None) -> list[dict[str, str]]:
    """A list of turn dicts -> messages, each role checked (and mapped, for sharegpt)."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise DataError(f"{where}: row {row}: field {field!r} must be a non-empty list of turns, got "
                        f"{'nothing' if raw is None else type(raw).__name__}")
    out = []
    for t, turn in enumerate(raw):
        at = f"{field}[{t}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where}: row {row}: {at} must be an object with {role_key!r} and {content_key!r}")
        role = turn.get(role_key)
        if role is None:
            raise DataError(f"{where}: row {row}: {at} has no role (key {role_key!r}); allowed roles: "
                            f"{', '.join(role_map or ROLES)}")
        mapped = (role_map or {r: r for r in ROLES}).get(str(role).lower() if role_map else role)
        if mapped is None:
            raise DataError(f"{where}: row {row}: {at}.{role_key} is {role!r}, an unknown role; allowed: "
                            f"{', '.join(role_map or ROLES)}")
        out.append({"role": mapped, "content": _text(turn.get(content_key), row, f"{at}.{content_key}", where,
                                                     allow_empty=mapped != "assistant")})
    return out


def _check_alternation(msgs: list[dict], row: int, field: str, where: str) -> list[dict]:
    body = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
    for t, m in enumerate(body):
        want = "user" if t % 2 == 0 else "assistant"
        if m["role"] != want:
            got = "a second system message" if m["role"] == "system" else f"two {m['role']} turns in a row" \
                if t and body[t - 1]["role"] == m["role"] else f"a {m['role']} turn first"
            raise DataError(f"{where}: row {row}: field {field!r} has {got} (turn {t + len(msgs) - len(body)}); turns "
                            "must alternate user, assistant, ... after an optional system message")
    if not body or body[-1]["role"] != "assistant":
        raise DataError(f"{where}: row {row}: field {field!r} does not end with an assistant turn (the answer to "
                        "train on)")
    return msgs


def to_messages(fmt: str, rec: dict, row: int, colmap: dict[str, str], tags: dict[str, str],
                where: str) -> list[dict[str, str]]:
    """One row of ``fmt`` data as a checked conversation (DataError naming the row and field when it is bad)."""
    def get(name: str) -> Any:
        return rec.get(colmap.get(name, name))

    def system() -> list[dict]:
        s = get("system")
        return [{"role": "system", "content": s}] if isinstance(s, str) and s.strip() else []

    if fmt == "alpaca":
        col = colmap.get("instruction", "instruction")
        inst = _text(get("instruction"), row, col, where, allow_empty=True)
        extra = _text(get("input"), row, colmap.get("input", "input"), where, allow_empty=True)
        prompt = "\n".join(p for p in (inst, extra) if p.strip())   # LLaMA-Factory joins them with a newline
        if not prompt.strip():
            raise DataError(f"{where}: row {row}: field {col!r} is empty (and there is no input)")
        msgs = system()
        hist = get("history")
        hcol = colmap.get("history", "history")
        if hist is not None:
            if not isinstance(hist, (list, tuple)):
                raise DataError(f"{where}: row {row}: field {hcol!r} must be a list of [prompt, answer] pairs")
            for h, pair in enumerate(hist):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise DataError(f"{where}: row {row}: {hcol}[{h}] must be a [prompt, answer] pair")
                msgs += [{"role": "user", "content": _text(pair[0], row, f"{hcol}[{h}][0]", where)},
                         {"role": "assistant", "content": _text(pair[1], row, f"{hcol}[{h}][1]", where)}]
        msgs += [{"role": "user", "content": prompt},
                 {"role": "assistant", "content": _text(get("output"), row, colmap.get("output", "output"), where)}]
        return msgs
    if fmt == "sharegpt":
        field = colmap.get("conversations", "conversations")
        role_key, content_key = tags.get("role_tag", "from"), tags.get("content_tag", "value")
        raw = get("conversations")
        if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], dict) and role_key not in raw[0] \
                and "role" in raw[0] and "role_tag" not in tags:
            role_key, content_key = "role", "content"   # OpenAI-style turns in a sharegpt file
        roles = dict(SHAREGPT_ROLES)
        for ours, tag in (("user", "user_tag"), ("assistant", "assistant_tag"), ("system", "system_tag")):
            if tag in tags:
                roles[tags[tag].lower()] = ours
        msgs = _turns(raw, row, field, where, role_key, content_key, roles)
        if msgs[0]["role"] != "system":
            msgs = system() + msgs
        return _check_alternation(msgs, row, field, where)
    if fmt == "messages":
        field = colmap.get("messages", "messages")
        return _check_alternation(_turns(get("messages"), row, field, where, "role", "content", None), row, field,
                                  where)
    if fmt == "prompt-completion":
        p, c = get("prompt"), get("completion")
        pcol, ccol = colmap.get("prompt", "prompt"), colmap.get("completion", "completion")
        if isinstance(p, (list, tuple)) or isinstance(c, (list, tuple)):   # TRL's conversational variant
            msgs = _turns(p, row, pcol, where, "role", "content", None) + \
                _turns(c, row, ccol, where, "role", "content", None)
            return _check_alternation(msgs, row, f"{pcol} + {ccol}", where)
        return [{"role": "user", "content": _text(p, row, pcol, where)},
                {"role": "assistant", "content": _text(c, row, ccol, where)}]
    raise DataError(f"data_format: {fmt!r} is not a chat format; allowed: {', '.join(CHAT_FORMATS)}")


# ---------------------------------------------------------------------------------------------
# tokenizing with answer masks
# ---------------------------------------------------------------------------------------------
IGNORE_INDEX = -100
_CHUNK = 2048


def tokenize_conversations(tokenizer, cfg: TrainConfig, convs: list[list[dict]], max_len: int | None,
                           ) -> tuple[list[dict], dict[str, int]]:
    """``({"input_ids", "labels"} per kept conversation, counts)``.

    The conversation is rendered with the template and tokenized once with character offsets; a token is a target
    when it starts inside an assistant turn's span, which runs from the end of the rendered prefix before that turn
    (with the generation prompt) to the end of the prefix through it (its content and end marker), as the template
    itself draws them. ``train_on``: "completion" every assistant turn, "last" the final one, "all" every token.
    Longer than ``max_len``: cut at the latest turn end, or inside an answer's content, never inside a template
    marker; a conversation left with no answer token is dropped (``dropped_no_answer``)."""
    _, jinja = resolve_template(tokenizer, cfg)
    out: list[dict] = []
    counts = {"truncated_examples": 0, "dropped_no_answer": 0}
    for start in range(0, len(convs), _CHUNK):
        chunk = convs[start: start + _CHUNK]
        fulls = render(tokenizer, jinja, chunk)
        turns = [(c, i) for c, conv in enumerate(chunk) for i, m in enumerate(conv) if m["role"] == "assistant"]
        befores = render(tokenizer, jinja, [chunk[c][:i] for c, i in turns], add_generation_prompt=True)
        throughs = render(tokenizer, jinja, [chunk[c][: i + 1] for c, i in turns])
        enc = tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)
        spans: list[list[tuple[int, int, int, int]]] = [[] for _ in chunk]   # (start, end, content0, content1)
        cursor = [0] * len(chunk)
        for (c, i), before, through in zip(turns, befores, throughs):
            full, content = fulls[c], chunk[c][i]["content"]
            if full.startswith(before) and full.startswith(through):
                s, e = len(before), len(through)
            else:   # a template whose prefixes are not prefixes of the whole (it rewrites earlier turns)
                s = full.find(content, cursor[c])
                if s < 0:
                    raise DataError(f"chat_template: the template does not write assistant turns verbatim (row "
                                    f"{start + c}), so their tokens cannot be found; use chatml, llama3 or alpaca")
                e = s + len(content)
            c0 = full.find(content, s, e) if content else s
            c0 = s if c0 < 0 else c0
            spans[c].append((s, e, c0, min(e, c0 + len(content))))
            cursor[c] = e
        for c, (ids, offsets) in enumerate(zip(enc["input_ids"], enc["offset_mapping"])):
            ex = _mask(list(ids), [tuple(o) for o in offsets], spans[c], cfg.train_on, max_len, counts)
            if ex is not None:
                out.append(ex)
    return out, counts


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans, train_on: str, max_len: int | None,
          counts: dict[str, int]) -> dict | None:
    starts = [s for s, _ in offsets]
    n = len(ids)
    target = [train_on == "all"] * n
    content = [-1] * n          # which assistant turn's content a token is in (-1: none)
    ends = []                   # token index at which each assistant turn ends (a clean cut)
    for k, (s, e, c0, c1) in enumerate(spans):
        a, b = bisect.bisect_left(starts, s), bisect.bisect_left(starts, e)
        if train_on == "completion" or (train_on == "last" and k == len(spans) - 1):
            for j in range(a, b):
                target[j] = True
        for j in range(bisect.bisect_left(starts, c0), bisect.bisect_left(starts, c1)):
            content[j] = k
        ends.append(b)
    cut = n
    if max_len is not None and n > max_len:
        # the latest clean cut: the end of a whole turn, or between two tokens of one answer's content
        cut = max([b for b in ends if b <= max_len]
                  + [j for j in range(1, max_len + 1) if content[j - 1] >= 0 and content[j] == content[j - 1]]
                  + [0])
    if not any(target[j] for j in range(1, cut)) or not any(content[j] >= 0 for j in range(1, cut)):
        counts["dropped_no_answer"] += 1
        return None
    if cut < n:
        counts["truncated_examples"] += 1
    return {"input_ids": ids[:cut], "labels": [t if target[j] else IGNORE_INDEX for j, t in enumerate(ids[:cut])]}


def target_count(examples: list[dict]) -> int:
    """Positions the shifted loss counts (labels[1:] that are not -100), over ``examples``."""
    return sum(sum(1 for t in ex["labels"][1:] if t != IGNORE_INDEX) for ex in examples)


def pack_chat(examples: list[dict], block_len: int) -> list[dict]:
    """Chat examples packed whole, in order, into blocks of at most ``block_len`` tokens (an example never spans two
    blocks, so its answer mask stays whole). ``position_ids`` restart at 0 for each example, and the first label of
    each is -100, so no token is predicted from the end of the example before it."""
    blocks: list[dict] = []
    cur: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        ids = ex["input_ids"]
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > block_len:
            blocks.append(cur)
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += ids
        cur["labels"] += [IGNORE_INDEX] + list(ex["labels"][1:])
        cur["position_ids"] += list(range(len(ids)))
    if cur["input_ids"]:
        blocks.append(cur)
    return blocks


__all__ = ["ALPACA", "CHATML", "CHAT_FORMATS", "LLAMA3", "TEMPLATES", "TEMPLATE_TOKENS", "conversation",
           "dataset_info", "describe_template", "detect_format", "ensure_chat_tokens", "missing_chat_tokens",
           "pack_chat", "prompt_ids", "render", "resolve_template", "target_count", "to_messages",
           "tokenize_conversations"]
