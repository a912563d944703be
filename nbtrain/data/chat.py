"""Chat and instruction data: templates, the special tokens they need, and prompts rendered for generation.

``cfg.chat_template`` names a template: ``"auto"`` is the tokenizer's own (``tokenizer.chat_template``) when it has
one, else ChatML; ``"chatml"``, ``"llama3"`` and ``"alpaca"`` are built in (Jinja strings below); anything else is
a Jinja template used as given. The ``tiny`` preset's tokenizer has no template and no ChatML tokens:
``ensure_chat_tokens`` adds ``<|im_start|>`` / ``<|im_end|>`` to it as special tokens, only when chat is used, so
plain-text runs keep today's vocabulary bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
# an answer ends with the tokenizer's EOS token, which is what teaches the model to stop.
ALPACA = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
          "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
          "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}{% endfor %}")

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


__all__ = ["ALPACA", "CHATML", "LLAMA3", "TEMPLATES", "TEMPLATE_TOKENS", "conversation", "describe_template",
           "ensure_chat_tokens", "missing_chat_tokens", "prompt_ids", "render", "resolve_template"]
_ = Any
