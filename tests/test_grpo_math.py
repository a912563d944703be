"""GRPO's arithmetic (engine/grpo.py) against hand-computed values and an independent float64 REINFORCE gradient:
the advantages, each normalization as TRL's GRPOConfig defines it, the clip, the k3 KL, accumulation that keeps
the step's loss whatever the micro-batches, and the sampler/trainer mismatch statistics."""

import math

import pytest
import torch

from nbtrain.engine.grpo import GRPO_LOSSES, group_advantages, grpo_terms, k3, loss_units, mismatch


def test_advantages_are_group_relative_and_a_flat_group_gets_zero():
    adv, flat = group_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3)
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])   # mean 2, unbiased std 1; no signal
    assert flat == 0.5
    unscaled, _ = group_advantages(torch.tensor([0.0, 4.0]), 2, scale=False)
    assert unscaled.tolist() == [-2.0, 2.0]
    with pytest.raises(ValueError, match="num_generations: 5 rewards do not split into groups of 2"):
        group_advantages(torch.zeros(5), 2)


MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize("kind,expected", [("grpo", (-1 + 2) / 2),          # per-completion means, then their mean
                                           ("dr_grpo", (-2 + 6) / (2 * 3)),  # token sum / (completions x max len)
                                           ("dapo", (-2 + 6) / 5)])           # token sum / completion tokens
def test_each_normalization_matches_the_hand_computed_value(kind, expected):
    logp = torch.log(torch.full((2, 3), 0.5))
    t = grpo_terms(logp, logp, torch.tensor([1.0, -2.0]), MASK, kind=kind)   # ratio 1: the loss is -A per token
    assert float(t.loss_sum) / loss_units(kind, MASK, max_completion_len=3) == pytest.approx(expected)
    assert int(t.clipped_tokens) == 0 and int(t.tokens) == 5


def test_the_clip_holds_a_ratio_only_on_the_side_that_would_gain():
    one = torch.ones(1, 1)
    up = grpo_terms(torch.log(one * 1.5), torch.zeros(1, 1), torch.tensor([1.0]), one, kind="dapo")
    assert float(up.loss_sum) == pytest.approx(-1.2) and int(up.clipped_tokens) == 1   # 1.5 held at 1 + 0.2
    down = grpo_terms(torch.log(one * 1.5), torch.zeros(1, 1), torch.tensor([-1.0]), one, kind="dapo")
    assert float(down.loss_sum) == pytest.approx(1.5) and int(down.clipped_tokens) == 0   # a loss is never clipped
    wide = grpo_terms(torch.log(one * 1.5), torch.zeros(1, 1), torch.tensor([1.0]), one, kind="dapo", epsilon_high=0.6)
    assert float(wide.loss_sum) == pytest.approx(-1.5)   # DAPO's clip-higher leaves it


def test_k3_is_an_unbiased_kl_estimate_that_is_never_negative():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    per_sample = k3(q.log(), p.log())
    assert (per_sample >= 0).all()
    assert float((p * per_sample).sum()) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)  # E_p = KL


def test_the_gradient_equals_an_independent_float64_reinforce_with_group_baseline():
    # a linear softmax policy over 5 tokens; 2 prompts x 3 completions x 4 tokens, fixed samples
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(6, 4, 6, dtype=torch.float64, generator=gen)            # a state per completion token
    y = torch.randint(0, 5, (6, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]],
                        dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0, 1.5], dtype=torch.float64)
    adv, _ = group_advantages(rewards, 3)
    logp = torch.log_softmax(x @ w.T, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    for kind in GRPO_LOSSES:
        w.grad = None
        t = grpo_terms(logp, logp.detach(), adv, mask, kind=kind)   # one update: ratio 1, no clip active
        (t.loss_sum / loss_units(kind, mask, max_completion_len=4)).backward(retain_graph=True)
        # by hand: d log softmax(W x)[y] / dW = (onehot(y) - softmax(W x)) x^T, weighted by -A / the normalizer
        probs = torch.softmax(x @ w.detach().T, dim=-1)
        score = torch.nn.functional.one_hot(y, 5).double() - probs                      # (6, 4, 5)
        per_token = torch.einsum("ctk,ctd->ctkd", score, x)                             # (6, 4, 5, 6)
        n_tok = mask.sum(dim=1)
        weight = {"grpo": 1 / (n_tok * 6), "dr_grpo": torch.full((6,), 1 / (6 * 4), dtype=torch.float64),
                  "dapo": torch.full((6,), 1 / float(mask.sum()), dtype=torch.float64)}[kind]
        expected = -torch.einsum("c,ct,ctkd->kd", adv * weight, mask, per_token)
        assert torch.allclose(w.grad, expected, rtol=1e-5, atol=1e-12), kind


@pytest.mark.parametrize("kind", GRPO_LOSSES)
def test_accumulation_is_group_correct(kind):
    # the same 8 rollouts as one micro-batch of 8 and as 4 of 2: the step's loss and gradient agree
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(8, 5, generator=gen, requires_grad=True)
    old = torch.randn(8, 5, generator=gen) * 0.1 - 1.5
    mask = (torch.rand(8, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    adv, _ = group_advantages(torch.randn(8, generator=gen), 4)

    def step(micro):
        theta.grad = None
        logp = torch.nn.functional.logsigmoid(theta) - 1.0
        units = sum(loss_units(kind, mask[i:i + micro], 5) for i in range(0, 8, micro))
        total = 0.0
        for i in range(0, 8, micro):
            sl = slice(i, i + micro)
            loss = grpo_terms(logp[sl], old[sl], adv[sl], mask[sl], kind=kind, beta=0.1,
                              ref_logp=old[sl] + 0.05).loss_sum / units
            loss.backward(retain_graph=True)
            total += float(loss.detach())
        return total, theta.grad.clone()

    whole, parts = step(8), step(2)
    assert whole[0] == pytest.approx(parts[0], rel=1e-6)
    assert torch.allclose(whole[1], parts[1], rtol=1e-5, atol=1e-8)


def test_mismatch_statistics():
    s = torch.tensor([[-1.0, -2.0, -3.0]])
    same = mismatch(s, s, torch.ones(1, 3))
    assert (same.mismatch_mean, same.mismatch_max, same.mismatch_kl) == (0.0, 0.0, 0.0)
    assert (same.is_ratio_min, same.is_ratio_mean, same.is_ratio_max) == (1.0, 1.0, 1.0)
    t = s + torch.tensor([[0.1, -0.2, 5.0]])
    m = mismatch(s, t, torch.tensor([[1.0, 1.0, 0.0]]))   # the masked token's 5 nats do not count
    assert m.mismatch_mean == pytest.approx(0.15) and m.mismatch_max == pytest.approx(0.2)
    assert m.is_ratio_min == pytest.approx(math.exp(-0.2)) and m.is_ratio_max == pytest.approx(math.exp(0.1))
    assert m.mismatch_kl == pytest.approx(((math.exp(0.1) - 1 - 0.1) + (math.exp(-0.2) - 1 + 0.2)) / 2)
    assert math.isnan(mismatch(s, t, torch.zeros(1, 3)).mismatch_mean)


def test_an_unknown_loss_is_named():
    with pytest.raises(ValueError, match=r"grpo_loss: must be one of \('grpo', 'dr_grpo', 'dapo'\), got 'bnpo'"):
        loss_units("bnpo", MASK, 3)
