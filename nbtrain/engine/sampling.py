"""Samples you can read: the model's greedy answers to ``cfg.sample_prompts`` while it trains, and after.

``Sampler`` answers every sample prompt at the steps ``sample_every`` names and at the end of a run; each answer
is a ``SampleRecord`` (``on_sample``, ``result.samples``). ``generate`` is one greedy answer, the one function
both use (and ``TrainResult.generate``). Greedy decoding draws no random numbers, and the generators are
forked around it anyway, so a run with samples has the losses of one without. The time spent answering is
given back to the step timer (no step's ``step_time_s`` holds it) and stated as ``summary["sample_s"]``.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Optional

import pandas as pd
import torch

from ..precision import autocast
from .records import SAMPLE_FIELDS, SampleRecord

CHAT_FORMATS = ("alpaca", "sharegpt", "messages", "prompt-completion")
# The end-of-turn markers of the templates nbtrain knows (chatml, llama3, gemma, phi-3): an answer stops at the
# first of them that the tokenizer has as one token, as it stops at EOS.
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def uses_chat(cfg, data=None) -> bool:
    """Whether prompts get the chat template: chat / instruction data (named, or detected by the data loader),
    not plain text."""
    if cfg.data_format == "text":
        return False
    if cfg.data_format in CHAT_FORMATS:
        return True
    stats = getattr(data, "stats", None) or {}
    detected = stats.get("data_format") or stats.get("format")
    if detected:
        return detected != "text"
    # auto without a word from the loader: chat examples carry their own answer masks ("labels")
    train = getattr(data, "train", None) or []
    return bool(train) and isinstance(train[0], dict) and "labels" in train[0]


def encode_prompt(tokenizer, cfg, prompt: str, chat: bool, system: Optional[str] = None) -> list[int]:
    """The tokens the model continues: the chat template's one-user-turn conversation up to the assistant's
    generation prompt (``data.chat.prompt_ids``) for chat data, else the prompt as plain text."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt: must be a non-empty string, got {prompt!r}")
    if chat:
        try:
            from ..data.chat import prompt_ids
        except ImportError:   # the chat module is not there yet: the plain prompt, as for text data
            prompt_ids = None
        if prompt_ids is not None:
            return list(prompt_ids(tokenizer, cfg, prompt, system=system))
    ids = list(tokenizer(prompt, add_special_tokens=True).input_ids)
    if not ids:   # a tokenizer without BOS and a prompt of nothing it knows: start from a special token
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start] if start is not None else []
    return ids


def stop_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end an answer: EOS (the tokenizer's and the model's generation config's) and the
    templates' end-of-turn markers the tokenizer has."""
    out: set[int] = set()
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    out.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
    vocab = tokenizer.get_vocab()
    out.update(int(vocab[m]) for m in _END_MARKERS if m in vocab)
    return out


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _forward_kwargs(model) -> tuple[str, dict]:
    """The KV cache's keyword (transformers 5 calls it ``cache``, 4 ``past_key_values``) and ``logits_to_keep``
    where the forward takes it (the prompt's logits are never needed whole)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(type(base).forward).parameters   # the class's: an instance's may be wrapped
    except (TypeError, ValueError):
        params = {}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return ("cache" if "cache" in params else "past_key_values"), extra


@contextlib.contextmanager
def _eager(compiled: list):
    """The compiled blocks run eagerly for the block: generation's growing shapes would recompile them."""
    saved = [(b, getattr(b, "_compiled_call_impl", None)) for b in compiled]
    for b, _ in saved:
        b._compiled_call_impl = None
    try:
        yield
    finally:
        for b, impl in saved:
            b._compiled_call_impl = impl


@torch.no_grad()
def greedy(model, ids: list[int], max_new_tokens: int, stops: set[int], spec=None) -> list[int]:
    """The tokens ``model`` appends to ``ids``, greedily (argmax each step, with its KV cache), up to
    ``max_new_tokens`` or a token of ``stops`` (included). Eval mode for the call, the previous mode after it;
    the forwards under ``spec``'s autocast; the random generators as they were."""
    device = _device_of(model)
    was_training = model.training
    model.eval()
    forks = [torch.cuda.current_device()] if device.type == "cuda" else []
    out: list[int] = []
    cache_kw, extra = _forward_kwargs(model)
    try:
        with torch.random.fork_rng(devices=forks), (autocast(spec, device.type) if spec else
                                                     contextlib.nullcontext()):
            x = torch.tensor([ids], dtype=torch.long, device=device)
            past = None
            for _ in range(max_new_tokens):
                res = model(input_ids=x, use_cache=True, **{cache_kw: past}, **extra)
                past = getattr(res, cache_kw, None)
                nxt = int(res.logits[0, -1].float().argmax())
                out.append(nxt)
                if nxt in stops:
                    break
                if past is None:   # a model without a cache: the whole sequence again
                    x = torch.tensor([ids + out], dtype=torch.long, device=device)
                else:
                    x = torch.tensor([[nxt]], dtype=torch.long, device=device)
    finally:
        model.train(was_training)
    return out


def generate(model, tokenizer, cfg, prompt: str, *, chat: bool, spec=None, max_new_tokens: Optional[int] = None,
             system: Optional[str] = None) -> tuple[str, int]:
    """``(answer, new tokens)``: ``model``'s greedy answer to ``prompt`` (chat template applied when ``chat``),
    at most ``max_new_tokens`` (default ``cfg.max_new_tokens``), decoded without special tokens."""
    n = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"max_new_tokens: must be a whole number >= 1, got {n!r}")
    ids = encode_prompt(tokenizer, cfg, prompt, chat, system=system)
    stops = stop_ids(tokenizer, model)
    if chat:   # the template's own end of turn, which a custom template may name differently from the known ones
        from ..data.chat import end_of_turn_ids

        stops |= end_of_turn_ids(tokenizer, cfg)
    new = greedy(model, ids, n, stops, spec)
    text_ids = new[:-1] if new and new[-1] in stops else new
    return tokenizer.decode(text_ids, skip_special_tokens=True).strip(), len(new)


class Sampler:
    """Answers the run's sample prompts at the steps ``sample_every`` names and at the end; a no-op without
    prompts (``due`` is False), so a run without them pays nothing."""

    def __init__(self, st):
        self.st = st
        self.prompts = list(st.cfg.sample_prompts or [])
        self.every = st.cfg.sample_every
        self.chat = uses_chat(st.cfg, st.data)   # for result.generate() too, with or without prompts
        self.seconds = 0.0           # all answering so far (summary["sample_s"])
        self.records: list[SampleRecord] = []
        self.last_step: Optional[int] = None

    def due(self, step: int) -> bool:
        """Whether step ``step`` is a sampling step (``sample_every`` divides it)."""
        return bool(self.prompts) and bool(self.every) and step % self.every == 0

    def run(self, step: int) -> float:
        """Answer every prompt at ``step``: records kept, ``on_sample`` fired for each. Returns the seconds spent
        (answers and their callbacks), which the caller takes out of the step timer. StopTraining /
        CallbackError from a callback propagate, the time counted."""
        if not self.prompts or step == self.last_step:
            return 0.0
        st = self.st
        t0 = time.perf_counter()
        self.last_step = step
        fresh = []
        try:
            with _eager(st.compiled):
                for prompt in self.prompts:
                    t1 = time.perf_counter()
                    answer, n_new = generate(st.model, st.tokenizer, st.cfg, prompt, chat=self.chat, spec=st.spec)
                    fresh.append(SampleRecord(step=step, prompt=prompt, answer=answer, new_tokens=n_new,
                                              seconds=time.perf_counter() - t1, variant=st.variant))
            self.records.extend(fresh)
            # on_sample's callbacks (a dashboard drawing the answers) are sampling's cost too, not a step's.
            for rec in fresh:
                st.cbs.fire("on_sample", rec)
        finally:
            spent = time.perf_counter() - t0
            self.seconds += spent
        return spent

    def final(self, step: int) -> None:
        """The answers at the end of the run (unless this step was just sampled)."""
        if step > 0:
            self.run(step)


def sample_frame(records: list) -> pd.DataFrame:
    """Sample records as a DataFrame: step, prompt, answer first, then new_tokens, seconds, variant."""
    return pd.DataFrame([r.to_dict() for r in records], columns=list(SAMPLE_FIELDS))


def side_by_side(samples: pd.DataFrame, step: Optional[int] = None, own_last: bool = False) -> pd.DataFrame:
    """Prompt rows x variant columns of answers at one step: ``step``, else the last step every variant
    sampled (each variant's own last step when they share none, or with ``own_last``: a live view of runs that
    are at different steps). ``.attrs["steps"]``: variant -> the step shown."""
    if samples is None or samples.empty:
        out = pd.DataFrame(index=pd.Index([], name="prompt"))
        out.attrs["steps"] = {}
        return out
    df = samples.copy()
    df["variant"] = df["variant"].fillna("run")
    variants = list(dict.fromkeys(df["variant"]))
    if step is None:
        common = set.intersection(*(set(df.loc[df.variant == v, "step"]) for v in variants))
        steps = {v: max(common) for v in variants} if common and not own_last else \
            {v: int(df.loc[df.variant == v, "step"].max()) for v in variants}
    else:
        steps = {v: int(step) for v in variants}
    prompts = list(dict.fromkeys(df["prompt"]))
    cols = {}
    for v in variants:
        at = df[(df.variant == v) & (df.step == steps[v])].drop_duplicates("prompt", keep="last")
        cols[v] = at.set_index("prompt")["answer"].reindex(prompts)
    out = pd.DataFrame(cols, index=pd.Index(prompts, name="prompt"))
    out.attrs["steps"] = steps
    return out


__all__ = ["CHAT_FORMATS", "Sampler", "encode_prompt", "generate", "greedy", "sample_frame", "side_by_side",
           "stop_ids", "uses_chat"]
