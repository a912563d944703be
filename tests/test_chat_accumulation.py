"""Issue 26: token-correct accumulation on chat data, whose micro-batches hold very different numbers of answer tokens.

8 x 1, 2 x 4 and 1 x 8 must give the same loss per step and the same weights; a naive average of per-micro-batch
mean losses (the 2024 normalisation bug) must not, on the same data, or the test could not tell them apart.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain.data import iter_steps
from nbtrain.data.chat import target_count
from nbtrain.engine.prepare import prepare

WORDS = "loop class value list name scope frame call index key item slice tuple object method".split()


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    rows = []
    for i in range(16):
        # answers of 1 word or ~60 words, alternating, so each micro-batch of 2 holds 2 to ~120 answer tokens
        n = 1 if i % 4 < 2 else 60
        answer = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))
        rows.append({"messages": [{"role": "system", "content": "Answer."},
                                  {"role": "user", "content": f"Question {i} about {WORDS[i % len(WORDS)]}?"},
                                  {"role": "assistant", "content": answer}]})
    f = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return f


def cfg_for(f, micro, accum):
    return nbt.TrainConfig(model="tiny", data=str(f), precision="fp32", micro_batch_size=micro, grad_accum_steps=accum,
                           max_steps=2, eval_fraction=0.0, max_seq_len=160, lr=1e-3, scheduler="constant",
                           max_grad_norm=None, log_every=1000)


def init_weights(f):
    st = prepare(cfg_for(f, 8, 1))   # the engine's own initial weights (its seeded stream)
    try:
        return {n: p.detach().clone() for n, p in st.model.named_parameters()}
    finally:
        st.restore.close()


def update_gap(w, ref, w0):
    """||w - ref|| / ||ref - w0||: how far two runs' weights are apart, relative to how far training moved them."""
    num = sum(float((w[n] - ref[n]).double().pow(2).sum()) for n in ref)
    den = sum(float((ref[n] - w0[n]).double().pow(2).sum()) for n in ref)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def runs(chat_file):
    return {(m, a): nbt.train(cfg_for(chat_file, m, a)) for m, a in ((8, 1), (2, 4), (1, 8))}


def test_8x1_2x4_1x8_agree_on_loss_tokens_and_weights(runs, chat_file):
    ref = runs[(8, 1)]
    ref_w = {n: p.detach() for n, p in ref.model.named_parameters()}
    w0 = init_weights(chat_file)
    for key in ((2, 4), (1, 8)):
        r = runs[key]
        assert r.history.tokens.tolist() == ref.history.tokens.tolist()
        torch.testing.assert_close(torch.tensor(r.history.loss.tolist()), torch.tensor(ref.history.loss.tolist()),
                                   rtol=1e-5, atol=1e-5)
        w = {n: p.detach() for n, p in r.model.named_parameters()}
        # AdamW divides by sqrt(v): an element whose gradient is ~0 turns float rounding into up to ~lr / 10 of
        # movement, so elementwise the tolerance is 1e-4 (lr 1e-3); as a whole the runs agree to 1e-3 of the update
        for n in ref_w:
            torch.testing.assert_close(w[n], ref_w[n], rtol=1e-4, atol=1e-4, msg=f"{key} {n}")
        assert update_gap(w, ref_w, w0) < 1e-3


def test_step_tokens_are_answer_tokens(runs, chat_file):
    st = prepare(cfg_for(chat_file, 8, 1))
    try:
        total = target_count(st.data.train)   # two steps of 8 = one pass over the 16 examples
        inputs = sum(len(ex["input_ids"]) for ex in st.data.train)
    finally:
        st.restore.close()
    assert sum(runs[(8, 1)].history.tokens) == total == st.data.stats["target_tokens"]
    assert total < 0.8 * inputs   # prompts and padding are not counted


def _train_by_hand(cfg, naive: bool):
    """Two optimizer steps of ``cfg`` outside the engine: token-correct (sum / step tokens) or naive (the mean of
    each micro-batch's mean, averaged over the micro-batches)."""
    st = prepare(cfg)
    try:
        model, data = st.model, st.data
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                weight_decay=cfg.weight_decay)
        steps = iter_steps(data.train, cfg.micro_batch_size, cfg.grad_accum_steps, cfg.seed, data.pad_token_id,
                           "causal-lm")
        losses = []
        for _ in range(cfg.max_steps):
            _, micro = next(steps)
            total = sum(mb.n_targets for mb in micro)
            step_loss = 0.0
            for mb in micro:
                logits = model(**mb.forward_inputs()).logits
                s = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), mb.labels[:, 1:].flatten(),
                                    ignore_index=-100, reduction="sum")
                loss = s / mb.n_targets / len(micro) if naive else s / total
                loss.backward()
                step_loss += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        st.restore.close()


def test_a_naive_per_micro_batch_average_differs_measurably(runs, chat_file):
    cfg = cfg_for(chat_file, 2, 4)
    correct_losses, correct_w = _train_by_hand(cfg, naive=False)
    naive_losses, naive_w = _train_by_hand(cfg, naive=True)
    engine = runs[(2, 4)]
    # the hand loop reproduces the engine, so the difference below is the normalisation and nothing else
    torch.testing.assert_close(torch.tensor(correct_losses), torch.tensor(engine.history.loss.tolist()),
                               rtol=1e-5, atol=1e-5)
    engine_w = dict(engine.model.named_parameters())
    for n, w in correct_w.items():
        torch.testing.assert_close(w, engine_w[n].detach(), rtol=1e-4, atol=1e-5)
    # ... and the naive average gives another loss and other weights, far beyond the tolerance above
    assert abs(naive_losses[1] - correct_losses[1]) > 0.01
    gap = update_gap(naive_w, correct_w, init_weights(chat_file))
    assert gap > 0.05, gap     # vs < 1e-3 between 8 x 1, 2 x 4 and 1 x 8
