"""Chat and instruction data: templates, the special tokens they need, and prompts rendered for generation.

``cfg.chat_template`` names a template: ``"auto"`` is the tokenizer's own (``tokenizer.chat_template``) when it has
one, else ChatML; ``"chatml"``, ``"llama3"`` and ``"alpaca"`` are built in (Jinja strings below); anything else is
a Jinja template used as given. The ``tiny`` preset's tokenizer has no template and no ChatML tokens:
``ensure_chat_tokens`` adds ``<|im_start|>`` / ``<|im_end|>`` to it as special tokens, only when chat is used, so
plain-text runs keep today's vocabulary bit for bit. A Jinja string gets the same treatment for the
``<|...|>`` markers it writes literally (``template_markers``), so they are single tokens and sampling can stop at
its end-of-turn marker (``end_of_turn_ids``).

Answer targets are each answer's content and its end marker, as the template draws them. Some templates write
text after the last message whatever ``add_generation_prompt`` says (Meta's first Llama 3 template appends the
assistant's header); ``dangling_tail`` finds that text once per template and it is never a target.
"""

from __future__ import annotations

import bisect
import json
import re
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


# the "<|name|>" markers of ChatML, Llama 3, Phi-3 and others: what a Jinja string writes as special tokens
_MARKER = re.compile(r"<\|[A-Za-z0-9_.:/-]+\|>")


def template_markers(jinja: str) -> tuple[str, ...]:
    """The ``<|...|>``-style markers a Jinja template writes literally (``<|im_start|>``, ``<|eot_id|>``, ...), in
    order of first appearance."""
    return tuple(dict.fromkeys(_MARKER.findall(jinja)))


def _needed_tokens(tokenizer, cfg: TrainConfig) -> tuple[str, ...]:
    name, jinja = resolve_template(tokenizer, cfg)
    if name == "custom":
        # a byte-split marker is not a marker: the model would have to learn to spell it, and sampling could not
        # stop at it
        return template_markers(jinja)
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


# probe contents: plain words no template trims or escapes, distinct in their last character so that no text
# after one of them can be mistaken for text after another
_PROBE = ("Quxa", "Zopb", "Qwic", "Zeld")
_TAILS: dict[tuple, str] = {}


def _probe_render(tokenizer, jinja: str, turns: int) -> str | None:
    conv = [{"role": ("user", "assistant")[i % 2], "content": _PROBE[i]} for i in range(turns)]
    try:
        return render(tokenizer, jinja, [conv])[0]
    except Exception:  # noqa: BLE001 - a template may refuse the probe (raise_exception): then nothing is known
        return None


def _marker_end(tokenizer, text: str, limit: int) -> int | None:
    """The end of the first end-of-turn-like marker in ``text`` that ends by ``limit``: a ``<|...|>`` marker or
    the tokenizer's EOS."""
    found = [(m.start(), m.end()) for m in _MARKER.finditer(text)]
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos and eos in text:
        at = text.index(eos)
        found.append((at, at + len(eos)))
    ends = [e for _, e in sorted(found) if e <= limit]
    return ends[0] if ends else None


def dangling_tail(tokenizer, jinja: str) -> str:
    """The text ``jinja`` writes after the last message of every conversation even without
    ``add_generation_prompt`` ("" for most templates; Meta's first Llama 3 template appends
    ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``). Found once per template from two probe
    conversations: after an answer that ends the conversation the template writes the end marker and this tail;
    after one that does not, the end marker and the next turn's header. The end marker is the text both share, up
    to its first ``<|...|>`` marker or EOS (a header opens with a marker too)."""
    key = (jinja, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None))
    if key in _TAILS:
        return _TAILS[key]
    tail = ""
    one, two = _probe_render(tokenizer, jinja, 2), _probe_render(tokenizer, jinja, 4)
    if one and two and _PROBE[1] in one and _PROBE[1] in two and _PROBE[2] in two:
        last = one[one.rindex(_PROBE[1]) + len(_PROBE[1]):]
        a = two.index(_PROBE[1]) + len(_PROBE[1])
        mid = two[a: two.index(_PROBE[2], a)]
        if last and not mid.startswith(last):
            shared = 0
            while shared < min(len(last), len(mid)) and last[shared] == mid[shared]:
                shared += 1
            end = _marker_end(tokenizer, last, shared)
            end = shared if end is None else end
            while end < shared and last[end].isspace():   # the newline a turn ends with (Phi-3's "<|end|>\n")
                end += 1
            tail = last[end:]
    _TAILS[key] = tail
    return tail


def end_of_turn_ids(tokenizer, cfg: TrainConfig) -> set[int]:
    """The token that ends an answer under ``cfg.chat_template`` (``<|im_end|>``, ``<|eot_id|>``, EOS, or a custom
    template's own marker), as a set of ids: the first token the template writes after an answer's content, when
    it is a special token of ``tokenizer``. Empty when it is none (or the template refuses a probe)."""
    _, jinja = resolve_template(tokenizer, cfg)
    text = _probe_render(tokenizer, jinja, 2)
    if not text or _PROBE[1] not in text:
        return set()
    after = text[text.rindex(_PROBE[1]) + len(_PROBE[1]):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return set()
    first = tokenizer.convert_ids_to_tokens(int(ids[0]))
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    added = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
             if getattr(t, "special", False)}
    return {int(ids[0])} if first in special or first in added else set()


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
# preference data (rows with a chosen and a rejected answer; read by preference.py): TRL's prompt/chosen/rejected
# and LLaMA-Factory's ranking alpaca and sharegpt; each format's own column names, the required ones first
PREF_FORMATS = ("preference", "alpaca-ranking", "sharegpt-ranking")
PREF_COLUMNS: dict[str, tuple[str, ...]] = {
    "preference": ("chosen", "rejected", "prompt", "system"),
    "alpaca-ranking": ("instruction", "chosen", "rejected", "input", "system", "history"),
    "sharegpt-ranking": ("conversations", "chosen", "rejected", "system"),
}
PREF_REQUIRED: dict[str, tuple[str, ...]] = {
    "preference": ("chosen", "rejected"),
    "alpaca-ranking": ("instruction", "chosen", "rejected"),
    "sharegpt-ranking": ("conversations", "chosen", "rejected"),
}


def dataset_info(path: Path, entry: str | None = None) -> dict | None:
    """The LLaMA-Factory ``dataset_info.json`` entry for a data file or directory, when its folder has one:
    ``{"formatting", "columns", "tags", "file_name"}``. ``entry`` names it (``cfg.dataset_entry``); else a file
    takes the entry naming it, and a directory its only entry, or the only one whose file is there. A directory
    whose entries leave the choice open is a ``DataError`` that lists them."""
    folder = path if path.is_dir() else path.parent
    info_file = folder / "dataset_info.json"
    if not info_file.is_file():
        if entry is not None:
            raise DataError(f"dataset_entry: {entry!r} names an entry of a LLaMA-Factory dataset_info.json, and "
                            f"'{folder}' has none; give data= the folder that holds it, or leave dataset_entry blank")
        return None
    try:
        info = json.loads(info_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data: '{info_file}' is not valid JSON ({e})") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise DataError(f"data: '{info_file}' must map dataset names to entries (objects with file_name, "
                        "formatting, columns, tags)")
    if entry is not None:
        if entry not in info:
            raise DataError(f"dataset_entry: {entry!r} is not an entry of '{info_file}'; its entries: "
                            f"{', '.join(info) or '(none)'}")
        return info[entry]
    entries = list(info.values())
    if path.is_file():
        hits = [e for e in entries if e.get("file_name") == path.name]
        return hits[0] if hits else None
    if len(entries) <= 1:
        return entries[0] if entries else None
    here = [e for e in entries if e.get("file_name") and (folder / e["file_name"]).exists()]
    if len(here) == 1:   # only one of them is a file in this folder (the others are Hub datasets): no choice
        return here[0]
    raise DataError(f"data: '{folder}' is a LLaMA-Factory data folder whose dataset_info.json has {len(entries)} "
                    f"entries ({', '.join(info)}); name the one to train on with dataset_entry= (several, "
                    "comma-separated, are concatenated)")


def columns_from_info(entry: dict, fmt: str) -> dict[str, str]:
    """LLaMA-Factory ``columns`` of ``entry`` as ``{our column name: the data's}``."""
    cols = entry.get("columns") or {}
    table = _LF_COLUMNS.get(fmt, {})
    return {table.get(k, k): v for k, v in cols.items() if isinstance(v, str)}


def detect_format(column_names: list[str], cfg: TrainConfig, info: dict | None = None,
                  where: str = "data") -> tuple[str, dict[str, str], dict[str, str]]:
    """``(format, {format column: data column}, sharegpt tags)`` for data with these columns; format "text" means
    the plain-text path. ``cfg.data_format`` names it, else ``dataset_info.json``'s ``formatting``, else the
    columns decide (messages, conversations, instruction+output, prompt+completion; otherwise text). Rows with
    chosen and rejected answers give a preference format (``PREF_FORMATS``: "preference", "alpaca-ranking",
    "sharegpt-ranking"; see ``_detect_preference``)."""
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
    if getattr(cfg, "objective", "lm") == "grpo" or fmt == "prompt":
        # online RL reads the prompts; every other column goes to the reward functions
        field = colmap.get("prompt", "prompt")
        if field not in column_names:
            raise DataError(f"{where}: objective='grpo' needs a {field!r} column (TRL's prompt format: a string or "
                            f"role/content messages per row); its columns are {sorted(column_names)}. Map yours with "
                            "columns={'prompt': '<your column>'}")
        return "prompt", {**{c: c for c in column_names}, "prompt": field}, tags
    pref = _detect_preference(column_names, cfg, fmt, info, colmap, tags, where)
    if pref is not None:   # prompt / chosen / rejected rows (preference.py reads them)
        return pref
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


def is_preference(fmt: str | None) -> bool:
    """Whether ``fmt`` (a format ``detect_format`` gives) is preference data."""
    return fmt in PREF_FORMATS


def pref_format_words(pf: str) -> str:
    """A preference format in words, for messages."""
    return {"preference": "data_format 'preference' (TRL's prompt/chosen/rejected)",
            "alpaca-ranking": "LLaMA-Factory's alpaca ranking data",
            "sharegpt-ranking": "LLaMA-Factory's sharegpt ranking data"}[pf]


def _detect_preference(column_names: list[str], cfg: Any, fmt: str, info: dict | None, colmap: dict[str, str],
                       tags: dict[str, str], where: str) -> tuple[str, dict[str, str], dict[str, str]] | None:
    """``(preference format, {format column: data column}, tags)`` when rows with these columns are preference
    data, else None. ``fmt`` is the format named or taken from ``dataset_info.json`` ("auto" when neither): a named
    alpaca / sharegpt is its ranking variant when the entry says ``ranking`` or the rows have both answers; under
    "auto" both ``chosen`` and ``rejected`` columns make it preference data. ``cfg.objective``, when ``cfg`` has
    one, breaks a tie: under "lm", rows that also fit a single-answer format are read as that format."""
    have = set(column_names)

    def col(name: str) -> str:
        return colmap.get(name, name)

    both = col("chosen") in have and col("rejected") in have
    lm = getattr(cfg, "objective", None) == "lm"

    def sft_fits(formats: tuple[str, ...]) -> bool:
        return any(all(col(c) in have for c in REQUIRED[f]) for f in formats)

    ranking = bool(info and info.get("ranking"))
    if fmt == "preference":
        pf = "preference"
    elif fmt in ("alpaca", "sharegpt"):
        if not (ranking or both) or (lm and not ranking and sft_fits((fmt,))):
            return None
        pf = f"{fmt}-ranking"
    elif fmt == "auto":
        if not both or (lm and sft_fits(CHAT_FORMATS)):
            return None
        pf = ("sharegpt-ranking" if col("conversations") in have else
              "alpaca-ranking" if col("instruction") in have else "preference")
    else:
        return None
    missing = [c for c in PREF_REQUIRED[pf] if col(c) not in have]
    if missing:
        names = ", ".join(f"{c!r}" + (f" (mapped to {col(c)!r})" if col(c) != c else "") for c in missing)
        raise DataError(f"{where}: {pref_format_words(pf)} needs column(s) {names}; its columns are "
                        f"{sorted(have)}. Map yours with columns={{'{missing[0]}': '<your column>'}}")
    return pf, {c: col(c) for c in PREF_COLUMNS[pf] if col(c) in have}, tags


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
    (with the generation prompt) to the end of the prefix through it (its content and end marker, without the
    template's ``dangling_tail``), as the template itself draws them. ``train_on``: "completion" every assistant
    turn, "last" the final one, "all" every token.
    Longer than ``max_len``: with ``train_on="last"`` the earliest whole exchanges (user turn and answer) are
    dropped first, the system message kept while it fits, as LLaMA-Factory's ``mask_history`` keeps the last turn
    (``history_trimmed``). Then: cut at the latest turn end, or inside an answer's content, never inside a template
    marker; a conversation left with no answer token is dropped (``dropped_no_answer``)."""
    _, jinja = resolve_template(tokenizer, cfg)
    tail = dangling_tail(tokenizer, jinja)
    out: list[dict] = []
    counts = {"truncated_examples": 0, "dropped_no_answer": 0, "history_trimmed": 0}
    for start in range(0, len(convs), _CHUNK):
        chunk = convs[start: start + _CHUNK]
        for c, enc in enumerate(_encode(tokenizer, jinja, tail, chunk, start)):
            trimmed = False
            if cfg.train_on == "last" and max_len is not None and len(enc[0]) > max_len:
                shorter = _trim_history(tokenizer, jinja, tail, chunk[c], max_len, start + c)
                if shorter is not None:
                    enc, trimmed = shorter, True
            ex = _mask(enc[0], enc[1], enc[2], cfg.train_on, max_len, counts)
            if ex is not None:
                out.append(ex)
                counts["history_trimmed"] += trimmed
    return out, counts


def _encode(tokenizer, jinja: str, tail: str, chunk: list[list[dict]], row0: int) -> list[tuple]:
    """``(ids, offsets, answer spans)`` of each conversation; a span is (start, end, content start, content end)
    in characters of the rendered text."""
    fulls = render(tokenizer, jinja, chunk)
    turns = [(c, i) for c, conv in enumerate(chunk) for i, m in enumerate(conv) if m["role"] == "assistant"]
    befores = render(tokenizer, jinja, [chunk[c][:i] for c, i in turns], add_generation_prompt=True)
    throughs = render(tokenizer, jinja, [chunk[c][: i + 1] for c, i in turns])
    enc = tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
                    return_token_type_ids=False, verbose=False)
    spans: list[list[tuple[int, int, int, int]]] = [[] for _ in chunk]
    cursor = [0] * len(chunk)
    for (c, i), before, through in zip(turns, befores, throughs):
        if tail and through.endswith(tail):
            # what the template writes after any last message (a header with no answer) is not this answer's end
            through = through[: len(through) - len(tail)]
        full, content = fulls[c], chunk[c][i]["content"]
        if full.startswith(before) and full.startswith(through):
            s, e = len(before), len(through)
        else:   # a template whose prefixes are not prefixes of the whole (it rewrites earlier turns)
            s = full.find(content, cursor[c])
            if s < 0:
                raise DataError(f"chat_template: the template does not write assistant turns verbatim (row "
                                f"{row0 + c}), so their tokens cannot be found; use chatml, llama3 or alpaca")
            e = s + len(content)
        c0 = full.find(content, s, e) if content else s
        c0 = s if c0 < 0 else c0
        spans[c].append((s, e, c0, min(e, c0 + len(content))))
        cursor[c] = e
    return [(list(ids), [tuple(o) for o in offsets], spans[c])
            for c, (ids, offsets) in enumerate(zip(enc["input_ids"], enc["offset_mapping"]))]


def _trim_history(tokenizer, jinja: str, tail: str, conv: list[dict], max_len: int, row: int) -> tuple | None:
    """The conversation with its earliest exchanges dropped: the longest such that fits ``max_len`` (the system
    message kept), else the last exchange alone (without the system message), to be cut like any long example.
    None when there is no history to drop."""
    system = [m for m in conv[:1] if m["role"] == "system"]
    body = conv[len(system):]
    # an exchange starts at a user turn that follows an answer; the last one holds the final answer
    starts = [j for j in range(1, len(body)) if body[j]["role"] == "user" and body[j - 1]["role"] == "assistant"]
    if not starts:
        return None
    candidates = [system + body[j:] for j in starts] + ([body[starts[-1]:]] if system else [])
    encoded = _encode(tokenizer, jinja, tail, candidates, row)
    return next((e for e in encoded if len(e[0]) <= max_len), encoded[-1])


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


__all__ = ["ALPACA", "CHATML", "CHAT_FORMATS", "LLAMA3", "PREF_COLUMNS", "PREF_FORMATS", "PREF_REQUIRED", "TEMPLATES",
           "TEMPLATE_TOKENS", "conversation", "dangling_tail", "dataset_info", "describe_template", "detect_format",
           "end_of_turn_ids", "ensure_chat_tokens", "is_preference", "missing_chat_tokens", "pack_chat",
           "pref_format_words", "prompt_ids", "render", "resolve_template", "target_count", "template_markers",
           "to_messages", "tokenize_conversations"]
