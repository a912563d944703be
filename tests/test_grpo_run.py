"""objective="grpo" through the loop on the tiny preset: the gradient against an independent float64 REINFORCE with a
group baseline, the ratio on a batch's first update, group-correct accumulation, resume (the sampling included),
repeatable completions, the mismatch in fp32, rewards that fail, and the reference and correction settings."""

from __future__ import annotations

import math

import pytest
import torch

import nbtrain as nbt
from nbtrain.engine import grpo_run
from nbtrain.engine.prepare import prepare
from nbtrain.engine.rewards import RewardError


def letters(prompts, completions, **columns):
    """A reward that varies inside a group even for an untrained model: how many e's and t's."""
    return [float(c.count("e") + c.count("t")) for c in completions]


BASE = dict(objective="grpo", reward=letters, data="builtin:prompts", model="tiny", precision="fp32",
            micro_batch_size=4, grad_accum_steps=2, num_generations=4, max_new_tokens=10, eval_fraction=0.0,
            lr=1e-3, max_steps=3, seed=3)


def cfg(**kw) -> nbt.TrainConfig:
    return nbt.TrainConfig(**{**BASE, **kw})


@pytest.fixture(scope="module")
def run3():
    return nbt.train(cfg())


def test_a_grpo_run_records_every_field(run3):
    h = run3.history
    assert list(h.step) == [1, 2, 3]
    for f in ("mismatch_mean", "mismatch_max", "mismatch_kl", "is_ratio_min", "is_ratio_mean", "is_ratio_max",
              "reward_mean", "reward_std", "completion_len_mean", "clip_ratio", "frac_zero_std"):
        assert h[f].notna().all() and all(math.isfinite(v) for v in h[f]), f
    # steps 1-3 are sampled steps: each side against an fp32 pass
    assert h.sampler_fp32_gap.notna().all() and h.trainer_fp32_gap.notna().all()
    ro = run3.rollouts
    assert len(ro) == 3 * 8 and list(ro.columns[:5]) == ["step", "group", "prompt", "completion", "completion_tokens"]
    assert {"letters", "reward", "advantage"} <= set(ro.columns)
    # the table's rewards are the records' means; advantages are centred per group
    for step, rows in ro.groupby("step"):
        assert rows.reward.mean() == pytest.approx(h.reward_mean[step - 1])
    for _, rows in ro.groupby("group"):
        assert abs(rows.advantage.sum()) < 1e-5
    assert (ro.completion_tokens >= 1).all() and (ro.completion_tokens <= 10).all()
    s = run3.summary
    assert s.objective == "grpo" and {"rollout_s", "rollout_tokens_per_s", "update_tokens_per_s"} <= set(s)
    # the sampling throughput is the sampled tokens over the sampling time (no assertion on the time itself)
    assert s.rollout_tokens_per_s * s.rollout_s == pytest.approx(int(ro.completion_tokens.sum()))


def test_the_table_holds_each_tokens_log_probs_and_they_give_the_steps_mismatch(run3):
    # the histograms of notebook 10 draw these: the same numbers the records' mismatch was computed from
    from nbtrain.engine.grpo import mismatch

    ro, h = run3.rollouts, run3.history
    assert list(ro.columns[-3:]) == ["sampler_logp", "trainer_logp", "variant"]
    for step, rows in ro.groupby("step"):
        assert [len(t) for t in rows.sampler_logp] == [len(t) for t in rows.trainer_logp] == list(rows.completion_tokens)
        s, t = torch.cat(list(rows.sampler_logp)), torch.cat(list(rows.trainer_logp))
        assert s.dtype == t.dtype == torch.float32 and (s <= 0).all() and (t <= 0).all()
        mm = mismatch(s, t, torch.ones_like(s))
        assert mm.mismatch_mean == pytest.approx(h.mismatch_mean[step - 1], rel=1e-6)
        assert mm.mismatch_max == pytest.approx(h.mismatch_max[step - 1], rel=1e-6)


def test_fp32_sampler_and_trainer_differ_only_by_the_decoding_arithmetic(run3):
    # fp32, no dropout: the KV-cached sampler and the one-forward trainer agree within float rounding
    assert run3.history.mismatch_mean.max() < 1e-4
    assert run3.history.trainer_fp32_gap.max() == 0.0   # the trainer's pass is the fp32 pass here


def test_the_same_seed_gives_the_same_completions(run3):
    again = nbt.train(cfg())
    assert list(again.rollouts.completion) == list(run3.rollouts.completion)
    assert list(again.history.loss) == list(run3.history.loss)
    other = nbt.train(cfg(seed=4, max_steps=1))
    assert list(other.rollouts.completion) != list(run3.rollouts.completion[:8])


def _first_step_grads(c: nbt.TrainConfig):
    """The loop's objective on its first rollout batch: the gradient of the step's loss, and the rollouts."""
    st = prepare(c)
    try:
        obj = st.objective
        _, micro = next(obj.batches(0))
        obj.begin_step(1)
        units = sum(mb.loss_units for mb in micro)
        for mb in micro:
            loss, _ = obj.micro_loss(st.model, mb.to(st.device))
            (loss / units).backward()
        grads = {n: p.grad.detach().clone() for n, p in st.model.named_parameters() if p.grad is not None}
        return st, micro, grads
    finally:
        st.restore.close()


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo"])
def test_the_gradient_is_reinforce_with_a_group_baseline_in_float64(kind):
    c = cfg(grpo_loss=kind, max_new_tokens=8)
    st, micro, grads = _first_step_grads(c)
    assert grads
    # independently: a float64 copy of the initial model, each completion scored alone (no padding, no KV cache)
    model = nbt.train(c.replace(max_steps=1, lr=1e-12)).model   # same init; lr ~ 0 leaves it where it started
    model = model.double().eval()
    rows = [(mb.input_ids[r], mb.attention_mask[r], mb.completion_ids[r], mb.mask[r]) for mb in micro
            for r in range(len(mb))]
    ro = st.objective.rows
    rewards = torch.tensor([row["reward"] for row in ro], dtype=torch.float64).reshape(-1, c.num_generations)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)).reshape(-1)
    adv = torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))
    model.zero_grad()
    total_tokens = sum(int(m.sum()) for _, _, _, m in rows)
    for (ids, attn, comp, mask), a in zip(rows, adv):
        n = int(mask.sum())
        seq = ids[attn.bool()].unsqueeze(0)
        logits = model(input_ids=seq).logits[0].double()
        p = seq.shape[1] - n
        logp = torch.log_softmax(logits[p - 1:p - 1 + n] / c.temperature, -1).gather(1, comp[:n, None]).squeeze(1)
        if kind == "grpo":
            obj = -(a * logp).sum() / n / len(rows)
        elif kind == "dr_grpo":
            obj = -(a * logp).sum() / (len(rows) * c.max_new_tokens)
        else:
            obj = -(a * logp).sum() / total_tokens
        obj.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(ref) == set(grads)
    num = math.sqrt(sum(float((grads[n].double() - ref[n]).pow(2).sum()) for n in ref))
    den = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in ref))
    assert den > 0 and num / den < 1e-5, (num, den)


def test_the_ratio_is_one_on_a_batchs_first_update_and_moves_on_the_next(monkeypatch):
    seen = []
    real = grpo_run.grpo_terms

    def spy(logp, old, *a, **kw):
        seen.append(torch.exp(logp.detach() - old))
        return real(logp, old, *a, **kw)

    monkeypatch.setattr(grpo_run, "grpo_terms", spy)
    r = nbt.train(cfg(grpo_iterations=2, max_steps=2, lr=5e-2, grad_accum_steps=1, micro_batch_size=8))
    assert len(seen) == 2
    assert torch.equal(seen[0], torch.ones_like(seen[0]))          # step 1: the trainer's own log-probs are old
    assert not torch.allclose(seen[1], torch.ones_like(seen[1]))   # step 2: same rollouts, moved weights
    h = r.history
    assert h.clip_ratio[0] == 0.0
    assert list(r.rollouts.step.unique()) == [1]                    # one rollout batch for both steps
    # the mismatch belongs to the batch: both of its steps report it
    assert h.mismatch_mean[0] == h.mismatch_mean[1]


def test_accumulation_is_group_correct_8x1_equals_2x4():
    a = nbt.train(cfg(micro_batch_size=8, grad_accum_steps=1, max_steps=2))
    b = nbt.train(cfg(micro_batch_size=2, grad_accum_steps=4, max_steps=2))
    assert list(a.rollouts.completion[:8]) == list(b.rollouts.completion[:8])
    assert b.history.micro_steps[0] == 4 and a.history.micro_steps[0] == 1
    for f in ("loss", "grad_norm", "reward_mean", "mismatch_mean"):
        assert b.history[f][0] == pytest.approx(a.history[f][0], rel=1e-5, abs=1e-7), f
    assert b.history.grad_norm[1] == pytest.approx(a.history.grad_norm[1], rel=1e-4)


@pytest.mark.parametrize("iterations,save_at", [(1, 2), (3, 2)])
def test_resume_equals_an_uninterrupted_run_sampling_included(tmp_path, iterations, save_at):
    full = nbt.train(cfg(max_steps=4, grpo_iterations=iterations))
    out = tmp_path / "run"
    # the same config (and so the same schedule), checkpointed at save_at; resumed from there
    nbt.train(cfg(max_steps=4, grpo_iterations=iterations, output_dir=str(out), save_every=save_at))
    ck = out / "checkpoints" / f"step-{save_at:06d}"
    assert ck.is_dir()
    resumed = nbt.train(cfg(max_steps=4, grpo_iterations=iterations, output_dir=str(tmp_path / "again"),
                            resume_from=str(ck)))
    assert list(resumed.history.step) == [1, 2, 3, 4]
    for f in ("loss", "grad_norm", "reward_mean", "mismatch_mean", "clip_ratio"):
        assert list(resumed.history[f]) == pytest.approx(list(full.history[f]), rel=1e-6, abs=1e-9), f
    assert list(resumed.rollouts.completion) == list(full.rollouts.completion)
    # every completion's token log-probs too, those of the batch the checkpoint was inside included
    for col in ("sampler_logp", "trainer_logp"):
        assert all(torch.equal(a, b) for a, b in zip(resumed.rollouts[col], full.rollouts[col])), col


def test_a_reward_that_fails_stops_the_run_naming_it_and_keeps_the_steps_before():
    calls = []

    def flaky(prompts, completions, **columns):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("no luck")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="reward 'flaky' raised ZeroDivisionError: no luck") as e:
        nbt.train(cfg(reward=flaky))
    assert list(e.value.result.history.step) == [1]
    assert e.value.result.summary.stopped_reason == "reward_error"

    def short(prompts, completions, **columns):
        return [1.0]

    with pytest.raises(RewardError, match="reward 'short': returned 1 values for 8 completions"):
        nbt.train(cfg(reward=short, max_steps=1))


def test_builtin_rewards_read_the_answer_column_and_the_token_count():
    r = nbt.train(cfg(reward=["length:5", "contains"], reward_weights=[1.0, 2.0], max_steps=1))
    ro = r.rollouts
    assert list(ro["length:5"]) == [max(0.0, 1 - abs(n - 5) / 5) for n in ro.completion_tokens]
    assert set(ro["contains"]) <= {0.0, 1.0}
    assert list(ro.reward) == pytest.approx(list(ro["length:5"] + 2 * ro["contains"]))


@pytest.mark.parametrize("extra", [
    dict(method="lora", grpo_beta=0.2, lora_dropout=0.0),   # the reference: adapters off
    dict(grpo_beta=0.2),                                    # the reference: a frozen copy
])
def test_a_kl_to_the_reference_with_beta(extra):
    r = nbt.train(cfg(max_steps=2, lr=2e-2, **extra))
    assert r.summary.reference in ("adapters off", "frozen copy")
    assert all(math.isfinite(v) for v in r.history.loss)


def test_sampling_in_bf16_for_fp32_training_shows_a_larger_mismatch(run3):
    r = nbt.train(cfg(sampler_precision="bf16"))
    assert r.summary.sampler_precision == "bf16" and r.summary.precision_used == "fp32"
    assert r.history.mismatch_mean.min() > 10 * run3.history.mismatch_mean.max()
    assert any("sampled in bf16, trained in fp32" in n for n in r.summary.notes)


def test_token_truncated_importance_sampling_weighs_the_tokens(monkeypatch):
    seen = []
    real = grpo_run.grpo_terms

    def spy(*a, **kw):
        seen.append(kw.get("token_weights"))
        return real(*a, **kw)

    monkeypatch.setattr(grpo_run, "grpo_terms", spy)
    nbt.train(cfg(sampler_precision="bf16", is_correction="token_truncate", is_cap=1.001, max_steps=1))
    w = torch.cat([x[x > 0] for x in seen])
    assert w.max() <= 1.001 + 1e-6 and w.min() < 1.0 and (w == 1.001).any()
