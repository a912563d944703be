"""Builtin datasets that need no network: the Python reference text shipped with CPython, and the handwritten
digits that ship with scikit-learn.

Both are made from ``pydoc_data.topics.topics`` (the text behind ``help("for")``), a dict from a
topic key such as ``"assignment"`` to a few pages of plain-text reference documentation.

``builtin:python-docs`` (causal LM)
    The topics in sorted key order, each cut into paragraphs at blank lines. reST heading
    underlines (``*****``, ``=====``) are removed, whitespace inside a paragraph is collapsed to
    single spaces, paragraphs shorter than 40 characters (headings, stray lines) are dropped, and a
    paragraph that appears under several topics (``"if"`` repeats part of ``"compound"``) is kept
    once, where it first appears. About 1,500 paragraphs on Python 3.11; the same list every time.

``builtin:python-docs-topics`` (sequence classification, columns ``text`` and ``label``)
    The same paragraphs, each labelled with the group of the topic key it came from:

    * 0 ``statements``: simple and compound statements and the execution model
      (``assignment``, ``import``, ``compound``, ``try``, ``execmodel``, ...);
    * 1 ``expressions``: expressions, operators, literals and names
      (``binary``, ``comparisons``, ``calls``, ``strings``, ``identifiers``, ...);
    * 2 ``data-model``: the data model and special methods
      (``types``, ``specialnames``, ``customization``, ``attribute-access``, ...);
    * 3 ``builtin-types``: methods and operations of the builtin types
      (``string-methods``, ``typesseq``, ``typesmapping``, ``formatstrings``, ``bltin-*``, ...).

    The ``pdb`` manual (``debugger``) and topic keys not listed in ``TOPIC_GROUPS`` (newer Pythons
    add some) are left out, as are paragraphs that occur under topics of two different groups
    (they could not be labelled). Every group is then cut to the size of the smallest one by
    taking evenly spaced paragraphs (so each keeps paragraphs from all of its topics), and the
    groups are interleaved (0, 1, 2, 3, 0, 1, ...) so that the first N examples (``subset``) are
    balanced too. About 950 examples, a quarter per label, on Python 3.11. The label shows in the
    wording: statements talk about statements and blocks, expressions about operators and operands,
    the data model about ``__dunder__`` methods, builtin types about ``str.``/``dict`` methods.

``builtin:python-docs-qa`` (instruction tuning, column ``messages``)
    Questions about the topics answered from the reference: for each topic (``debugger``, the pdb manual, and
    ``else``, which repeats ``if``, are left out) four phrasings of a question ("What does the `with` statement
    do?", "Explain ..."), each answered by the topic's opening prose (grammar lines with ``::=`` skipped): whole
    sentences up to about 240 characters, so a ChatML conversation fits in 128 tiny-preset tokens. A one-line
    system prompt comes first. Ordered phrasing by phrasing (all topics once, then again), so the first N rows
    cover many topics. About 300 rows; the same list every time.

``builtin:python-docs-pref`` (preference tuning: DPO, ORPO, SimPO; TRL's conversational ``prompt`` / ``chosen`` /
``rejected``)
    The rows of ``builtin:python-docs-qa``, in its order: the system prompt and the question are the prompt, the
    topic's answer is chosen, and the rejected answer is a plausible wrong one: another topic's answer, fluent
    reference prose that answers a different question. With the T topics in sorted key order, topic t is rejected
    with the answer of topic (t + T // 2) mod T (the next one after it whose answer differs, should two topics
    open alike), so every phrasing of a question gets the same rejected answer, the same list every time and in
    every process, and the rejected answer is never the chosen one.

``builtin:prompts`` (online RL: GRPO; TRL's conversational ``prompt`` and an ``answer`` column)
    Sums of two whole numbers 0-19, "What is 7 + 12?", after a system prompt asking for the number alone; the
    ``answer`` column holds the sum ("19") for the ``exact`` and ``contains`` rewards. All 400 pairs, in a fixed
    spread-out order (row i is pair (157 i) mod 400), so the first N rows mix small and large numbers; the same list
    every time.

``builtin:digits`` (image classification)
    scikit-learn's ``load_digits()``: 1,797 grey 8x8 images of handwritten digits (UCI's optical
    recognition set, 4-bit pixels 0..16) labelled 0-9, shipped inside the scikit-learn package, in its
    order (about 180 per label, interleaved, so the first N are balanced too). Read by
    ``nbtrain.data.images`` (``digits_images()``): pixels scaled to 0..255 as uint8.
"""

from __future__ import annotations

import functools
import re
import sys

from .bundle import DataError

MIN_PARAGRAPH_CHARS = 40

TOPIC_LABELS = ("statements", "expressions", "data-model", "builtin-types")

# topic key -> index into TOPIC_LABELS
TOPIC_GROUPS: dict[str, int] = {
    **dict.fromkeys((
        "assert", "assignment", "async", "augassign", "break", "class", "compound", "continue",
        "del", "dynamic-features", "else", "exceptions", "execmodel", "for", "function", "global",
        "if", "import", "match", "naming", "nonlocal", "pass", "raise", "return", "try", "type",
        "typealias", "while", "with", "yield"), 0),
    **dict.fromkeys((
        "atom-identifiers", "atom-literals", "attribute-references", "await", "binary", "bitwise",
        "booleans", "calls", "comparisons", "conversions", "dict", "exprlists", "floating",
        "identifiers", "imaginary", "in", "integers", "lambda", "lists", "numbers",
        "operator-summary", "power", "shifting", "slicings", "strings", "subscriptions", "unary"),
        1),
    **dict.fromkeys((
        "attribute-access", "callable-types", "context-managers", "customization", "id-classes",
        "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames", "types"), 2),
    **dict.fromkeys((
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object", "bltin-type-objects",
        "formatstrings", "string-methods", "truth", "typesfunctions", "typesmapping",
        "typesmethods", "typesmodules", "typesseq", "typesseq-mutable"), 3),
}

BUILTINS: dict[str, str] = {
    "python-docs": "paragraphs of the Python reference (pydoc_data.topics), for causal LM",
    "python-docs-topics": "the same paragraphs labelled statements / expressions / data-model / "
                          "builtin-types, for sequence classification",
    "python-docs-qa": "questions about Python's reference answered from it (pydoc_data.topics), chat messages "
                      "with a system prompt, for instruction tuning",
    "python-docs-pref": "the same questions with the right answer chosen and another topic's answer rejected "
                        "(prompt/chosen/rejected), for preference tuning (dpo, orpo, simpo)",
    "prompts": "400 sums of two numbers 0-19 as chat prompts with their answer (prompt/answer), for online RL "
               "(grpo)",
    "digits": "1,797 handwritten digits, 8x8 grey images labelled 0-9 (scikit-learn's load_digits), for "
              "image classification",
}
IMAGE_BUILTINS = ("digits",)   # builtins of images (the rest are text); TrainConfig knows them as IMAGE_BUILTINS

_UNDERLINE = re.compile(r"^[ \t]*([*=\-~^\"#+`'])\1{2,}[ \t]*$", re.MULTILINE)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def check_name(name: str) -> str:
    """``name`` without its ``builtin:`` prefix; DataError naming the builtins when there is no such one."""
    return _check_name(name)


def _text_name(name: str) -> str:
    name = _check_name(name)
    if name in IMAGE_BUILTINS:
        raise DataError(f"data: 'builtin:{name}' holds images, not text; use it with task='image-classification'")
    return name


def _check_name(name: str) -> str:
    name = name.removeprefix("builtin:")
    if name not in BUILTINS:
        raise DataError(f"data: unknown builtin dataset {name!r}; the builtins are "
                        + ", ".join(f"'builtin:{n}' ({d})" for n, d in BUILTINS.items()))
    return name


@functools.lru_cache(maxsize=1)
def _topic_paragraphs() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(topic key, its paragraphs) in sorted key order; paragraphs not yet deduplicated."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some minimal Python builds leave pydoc_data out
        raise DataError("data: the builtin datasets need the 'pydoc_data' module of the Python "
                        f"standard library, which this Python lacks ({e}); use a local file") from None
    out = []
    for key in sorted(topics):
        text = _UNDERLINE.sub("", topics[key])
        paras = (" ".join(block.split()) for block in _BLANK_LINE.split(text))
        out.append((key, tuple(p for p in paras if len(p) >= MIN_PARAGRAPH_CHARS)))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _docs() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for _, paras in _topic_paragraphs():
        for p in paras:
            seen.setdefault(p, None)
    return tuple(seen)


@functools.lru_cache(maxsize=1)
def _topics() -> tuple[tuple[str, int], ...]:
    groups_of: dict[str, set[int]] = {}
    order: dict[str, None] = {}
    for key, paras in _topic_paragraphs():
        group = TOPIC_GROUPS.get(key)
        if group is None:
            continue
        for p in paras:
            groups_of.setdefault(p, set()).add(group)
            order.setdefault(p, None)
    by_group: list[list[str]] = [[] for _ in TOPIC_LABELS]
    for p in order:
        if len(groups_of[p]) == 1:
            by_group[next(iter(groups_of[p]))].append(p)
    size = min(len(g) for g in by_group)
    picked = [[g[(i * len(g)) // size] for i in range(size)] for g in by_group]
    return tuple((picked[g][i], g) for i in range(size) for g in range(len(TOPIC_LABELS)))


QA_SYSTEM = "You answer questions about Python from its reference manual, briefly."
QA_MAX_CHARS = 240
_QA_SKIP = ("debugger", "else")
_STATEMENTS = {"assert", "break", "class", "continue", "del", "for", "global", "if", "import", "nonlocal", "pass",
               "raise", "return", "try", "while", "with", "yield"}
_QA_NAMES = {"bltin-code-objects": "code objects", "bltin-ellipsis-object": "the Ellipsis object",
             "bltin-null-object": "the None object", "bltin-type-objects": "type objects",
             "typesfunctions": "function objects", "typesmapping": "mapping types", "typesmethods": "method objects",
             "typesmodules": "module objects", "typesseq": "sequence types", "typesseq-mutable": "mutable sequences",
             "execmodel": "the execution model", "augassign": "augmented assignment", "formatstrings":
             "format strings", "specialattrs": "special attributes", "specialnames": "special method names",
             "exprlists": "expression lists", "id-classes": "reserved classes of identifiers", "in": "the `in` operator",
             "lambda": "lambda expressions", "await": "the `await` expression", "async": "coroutines"}


def _qa_subject(key: str) -> str:
    if key in _STATEMENTS:
        return f"the `{key}` statement"
    return _QA_NAMES.get(key, key.replace("-", " "))


def _qa_answer(paras: tuple[str, ...]) -> str:
    """The topic's opening prose: whole sentences (grammar skipped) up to about QA_MAX_CHARS characters."""
    sentences: list[str] = []
    for p in paras:
        if "::=" in p:
            continue
        sentences += [x for x in re.split(r"(?<=[.!?])\s+", p) if x]
        if sum(map(len, sentences)) >= QA_MAX_CHARS:
            break
    out = ""
    for x in sentences:
        if out and len(out) + 1 + len(x) > QA_MAX_CHARS:
            break
        out = f"{out} {x}" if out else x
    out = out[:QA_MAX_CHARS].strip()
    return out[:-1] + "." if out.endswith(":") else out


@functools.lru_cache(maxsize=1)
def _qa_topics() -> tuple[tuple[str, str, str], ...]:
    """``(key, subject, answer)`` of each topic the QA sets ask about, in sorted key order."""
    out = []
    for key, paras in _topic_paragraphs():
        if key in _QA_SKIP or not paras:
            continue
        answer = _qa_answer(paras)
        if answer:
            out.append((key, _qa_subject(key), answer))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _qa_rows() -> tuple[tuple[int, str, str], ...]:
    """``(topic index into _qa_topics(), question, answer)``, phrasing by phrasing."""
    phrasings = ("What does the Python reference say about {s}?", "Explain {s} in Python.",
                 "What is {s}?", "Tell me briefly about {s}.")
    out = []
    for f in phrasings:
        for t, (key, subject, answer) in enumerate(_qa_topics()):
            q = f"What does {subject} do?" if f == "What is {s}?" and key in _STATEMENTS else f.format(s=subject)
            out.append((t, q, answer))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _qa() -> tuple[tuple[str, str], ...]:
    return tuple((q, a) for _, q, a in _qa_rows())


@functools.lru_cache(maxsize=1)
def _pref() -> tuple[tuple[str, str, str], ...]:
    """``(question, chosen, rejected)``: each QA row with another topic's answer as the rejected one."""
    answers = [a for _, _, a in _qa_topics()]
    n = len(answers)
    rejected_of = []
    for t, a in enumerate(answers):
        # half way round the sorted topics: a fixed, far-off topic; stepping on past one that opens alike keeps
        # chosen != rejected (there is always one: the answers are not all equal)
        j = (t + n // 2) % n
        for _ in range(n):
            if answers[j].strip() != a.strip():
                break
            j = (j + 1) % n
        rejected_of.append(answers[j])
    return tuple((q, a, rejected_of[t]) for t, q, a in _qa_rows())


PROMPTS_SYSTEM = "Answer with the number only."


def _sums() -> tuple[tuple[int, int], ...]:
    # 157 is coprime with 400: every pair once, neighbours far apart
    return tuple(divmod((157 * i) % 400, 20) for i in range(400))


def builtin_names() -> list[str]:
    """Names of the builtin datasets (use them as ``data="builtin:<name>"``)."""
    return list(BUILTINS)


def builtin_texts(name: str) -> list[str]:
    """The texts of a builtin dataset (``"python-docs"`` or ``"python-docs-topics"``), in order."""
    name = _text_name(name)
    if name == "python-docs":
        return list(_docs())
    if name == "python-docs-qa":
        return [f"{q}\n{a}" for q, a in _qa()]
    if name == "prompts":   # as plain text, a question and its answer
        return [f"What is {a} + {b}? {a + b}" for a, b in _sums()]
    if name == "python-docs-pref":   # as plain text, a question and its right answer (the QA set's texts)
        return [f"{q}\n{a}" for q, a, _ in _pref()]
    return [t for t, _ in _topics()]


def builtin_rows(name: str) -> list[dict]:
    """A builtin dataset as rows: ``{"text": str}``, plus ``"label": int`` for the labelled one; ``{"messages":
    [system, user, assistant]}`` for ``python-docs-qa``; ``{"prompt": [system, user], "chosen": [assistant],
    "rejected": [assistant]}`` for ``python-docs-pref``; ``{"prompt": [system, user], "answer": str}`` for
    ``prompts``."""
    name = _text_name(name)
    if name == "prompts":
        return [{"prompt": [{"role": "system", "content": PROMPTS_SYSTEM},
                            {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
                for a, b in _sums()]
    if name == "python-docs-pref":
        return [{"prompt": [{"role": "system", "content": QA_SYSTEM}, {"role": "user", "content": q}],
                 "chosen": [{"role": "assistant", "content": c}],
                 "rejected": [{"role": "assistant", "content": r}]} for q, c, r in _pref()]
    if name == "python-docs-qa":
        return [{"messages": [{"role": "system", "content": QA_SYSTEM}, {"role": "user", "content": q},
                              {"role": "assistant", "content": a}]} for q, a in _qa()]
    if name == "python-docs":
        return [{"text": t} for t in _docs()]
    return [{"text": t, "label": g} for t, g in _topics()]


def builtin_label_names(name: str) -> list[str] | None:
    """Label names of a builtin dataset (index = label id), or None when it has no labels."""
    name = _check_name(name)
    if name == "digits":
        return [str(d) for d in range(10)]
    return list(TOPIC_LABELS) if name == "python-docs-topics" else None


def builtin_source(name: str) -> str:
    """A one-line description of a builtin dataset, for ``DataBundle.source``."""
    name = _check_name(name)
    if name in IMAGE_BUILTINS:
        try:
            from sklearn import __version__ as version
        except ImportError:
            version = "not installed"
        return f"builtin:{name} ({BUILTINS[name]}; scikit-learn {version})"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"builtin:{name} ({BUILTINS[name]}; Python {py})"
