"""GRPO's rollouts (engine/rollout.py) on the tiny model: the sampler's log-probs recorded on its own path (KV cache,
its precision, the distribution it drew from) against the trainer's teacher-forced ones for the same tokens. In
fp32 with dropout off they differ only by the decoding arithmetic (below 1e-4 nats per token); the same seed gives
the same completions; a stop token ends a completion."""

import pytest
import torch

from nbtrain.config import TrainConfig
from nbtrain.engine.grpo import mismatch
from nbtrain.engine.rollout import _filtered, sample_group, teacher_forced_logp
from nbtrain.models import build_model, load_tokenizer
from nbtrain.precision import PRECISION_TABLE


@pytest.fixture(scope="module")
def tiny():
    cfg = TrainConfig(model="tiny", max_seq_len=64, precision="fp32")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "fp32", "cpu")
    model.eval()   # dropout off: the trainer's pass is the sampler's arithmetic, batched
    return model, tok.encode("def add(a, b):\n    return")


def draw(model, prompt, seed, **kw):
    kw = {"max_new_tokens": 12, **kw}
    return sample_group(model, prompt, 4, generator=torch.Generator().manual_seed(seed), **kw)


def test_fp32_sampler_and_trainer_agree_below_1e_4_nats(tiny):
    model, prompt = tiny
    r = draw(model, prompt, 0)
    trainer = teacher_forced_logp(model, r)
    m = mismatch(r.sampler_logp, trainer, r.mask)
    assert m.mismatch_mean < 1e-4 and m.mismatch_max < 1e-3, m
    assert 0.999 < m.is_ratio_min <= m.is_ratio_max < 1.001
    assert r.completion_ids.shape == (4, 12) and r.sampler_logp.dtype == torch.float32


def test_bf16_sampling_is_a_measurable_mismatch(tiny):
    model, prompt = tiny
    r = draw(model, prompt, 0, spec=PRECISION_TABLE["bf16"])
    bf16 = mismatch(r.sampler_logp, teacher_forced_logp(model, r), r.mask)   # trained in fp32
    fp32 = draw(model, prompt, 0)
    same = mismatch(fp32.sampler_logp, teacher_forced_logp(model, fp32), fp32.mask)
    assert bf16.mismatch_mean > 10 * max(same.mismatch_mean, 1e-7), (bf16, same)


def test_the_same_seed_gives_the_same_completions(tiny):
    model, prompt = tiny
    a, b, c = draw(model, prompt, 7), draw(model, prompt, 7), draw(model, prompt, 8)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logp, b.sampler_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert model.training is False   # the mode it had


def test_a_stop_token_ends_a_completion_and_counts(tiny):
    model, prompt = tiny
    r = draw(model, prompt, 0, stops=set(range(100_000)), pad_id=0)   # every token stops: one token each
    assert r.lengths == [1, 1, 1, 1] and r.completion_ids.shape[1] == 1
    free = draw(model, prompt, 0, max_new_tokens=6)
    some = next(iter(free.completion_ids[0, 1:2].tolist()))
    cut = draw(model, prompt, 0, max_new_tokens=6, stops={some}, pad_id=0)
    row = cut.completion_ids[0].tolist()
    k = row.index(some)
    assert cut.lengths[0] == k + 1 and all(t == 0 for t in row[k + 1:])
    assert (cut.sampler_logp[0, k + 1:] == 0).all() and (cut.mask[0, k + 1:] == 0).all()


def test_top_p_keeps_the_nucleus_and_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = _filtered(logits, 1.0, 0.75).exp()[0]
    assert kept.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])   # 0.5 + 0.3 reach 0.75; renormalized
    assert _filtered(logits, 1.0, 1e-6).exp()[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    sharp = _filtered(logits, 0.5, 1.0).exp()[0]
    assert sharp[0] > 0.5 and sharp.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="temperature: must be > 0"):
        sample_group(None, [1], 2, 3, temperature=0)
