"""Preference objectives in the engine (issue 38.1, 38.3, 38.4): DPO's ln 2 at step 1, pair-correct accumulation,
ORPO and SimPO against an independent computation, non-finite rewards, the log-prob mismatch, the reference held
three ways and a resumed DPO run.

The data here is hand-made token ids (the engine's contract: prompt + answer ids with -100 on the prompt), so these
tests hold whatever the loaders do; tests/test_preference_data.py covers the formats and the builtin."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import nbtrain as nbt
import nbtrain.engine.prepare as prepare_mod
from nbtrain.data import iter_steps
from nbtrain.data.bundle import DataBundle

LN2 = math.log(2)
BASE = dict(model="tiny", data="builtin:python-docs", max_steps=3, micro_batch_size=4, eval_fraction=0.0, lr=1e-3,
            precision="fp32", seed=0)


def pairs(n: int = 16, seed: int = 0) -> list[dict]:
    """``n`` preference examples of random ids: a prompt of 3-7 tokens, answers of 2-5 (lengths differ, so rows
    are padded and the mean-per-token objectives see different counts)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(5, 200) for _ in range(rng.randrange(3, 8))]
        chosen = [rng.randrange(5, 200) for _ in range(rng.randrange(2, 6))]
        rejected = [rng.randrange(5, 200) for _ in range(rng.randrange(2, 6))]
        out.append({"input_ids": prompt + chosen, "labels": [-100] * len(prompt) + chosen,
                    "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected})
    return out


@pytest.fixture
def fake_pairs(monkeypatch):
    """Every run in the test trains on 12 hand-made pairs (and evaluates on 4)."""
    ex = pairs()

    def load(cfg, tok):
        return DataBundle(train=ex[:12], eval=ex[12:], task="causal-lm", pad_token_id=0, num_labels=None,
                          label_names=None, source="hand-made pairs")

    monkeypatch.setattr(prepare_mod, "load_data", load)
    return ex


def run(**kw) -> nbt.TrainResult:
    return nbt.train(nbt.TrainConfig(**{**BASE, **kw}))


@pytest.mark.parametrize("kw", [dict(method="lora", lora_dropout=0.1), dict(method="full"),
                                dict(method="full", precompute_ref=True)],
                         ids=["lora-adapters-off", "full-frozen-copy", "full-precomputed"])
def test_dpo_loss_is_ln2_at_step_1(fake_pairs, kw):
    """Policy = reference at step 1 whichever way the reference is held, so every pair's margin is 0."""
    r = run(objective="dpo", **kw)
    h = r.history
    assert h.loss[0] == pytest.approx(LN2, abs=1e-7)
    assert h.reward_margin[0] == 0.0 and h.reward_chosen[0] == 0.0 and h.reward_accuracy[0] == 0.0
    assert h.loss[2] != pytest.approx(LN2, abs=1e-5)   # it trains: the margins move off 0
    assert r.summary["objective"] == "dpo"
    assert r.summary["reference"] == {"lora": "adapters off", "full": "frozen copy"}[kw["method"]] \
        if not kw.get("precompute_ref") else r.summary["reference"] == "precomputed"
    assert any("DPO reference" in n for n in r.summary["notes"])


def test_dpo_full_frozen_copy_and_precomputed_agree(fake_pairs):
    """The two full-fine-tune references are the same model: the same losses and rewards step by step."""
    a, b = run(objective="dpo"), run(objective="dpo", precompute_ref=True)
    for col in ("loss", "reward_chosen", "reward_rejected", "reward_accuracy"):
        assert a.history[col].tolist() == pytest.approx(b.history[col].tolist(), abs=1e-6), col
    assert a.summary["eval_loss"] == pytest.approx(b.summary["eval_loss"], abs=1e-6)


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_accumulation_is_pair_correct(fake_pairs, objective):
    """micro 8 x 1 = 2 x 4 = 1 x 8: the same pairs per step, each counted once in the step's mean (12 pairs: step 2
    is a short one of 4, split 2 x 2 and 1 x 4)."""
    runs = [run(objective=objective, micro_batch_size=m, grad_accum_steps=8 // m) for m in (8, 2, 1)]
    ref = runs[0].history
    for r in runs[1:]:
        for col in ("loss", "grad_norm", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
            assert r.history[col].tolist() == pytest.approx(ref[col].tolist(), rel=1e-5, abs=1e-6), col


def _independent_logps(model, ex: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence sums, answer-token counts) in float64 from the model's full logits, sequence by sequence,
    unpadded: no code shared with the engine."""
    sums, counts = [], []
    for ids, labels in [(e["input_ids"], e["labels"]) for e in ex] + \
                       [(e["rejected_input_ids"], e["rejected_labels"]) for e in ex]:
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logp = logits.log_softmax(-1)
        total, n = 0.0, 0
        for t in range(1, len(ids)):
            if labels[t] != -100:
                total += float(logp[t - 1, labels[t]])
                n += 1
        sums.append(total)
        counts.append(n)
    return torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)


class StepOneCheck:
    """At run start (initial weights), the loss of step 1's pairs by the independent computation."""

    def __init__(self, ex, formula):
        self.ex, self.formula, self.expected = ex, formula, None

    def on_run_start(self, info):
        cfg = info.config
        _, (mb,) = next(iter_steps(self.ex[:12], cfg.micro_batch_size, 1, cfg.seed, 0, "causal-lm"))
        with torch.no_grad():
            sums, counts = _independent_logps(info.model, [self.ex[i] for i in mb.indices])
        self.expected = float(self.formula(sums, counts, cfg).mean())


def _orpo(sums, counts, cfg):
    p = len(sums) // 2
    mean = sums / counts
    c, r = mean[:p], mean[p:]
    # the odds p / (1 - p) of each answer's mean per-token probability, written out directly
    odds_c, odds_r = torch.exp(c) / (1 - torch.exp(c)), torch.exp(r) / (1 - torch.exp(r))
    ratio = torch.log(odds_c / odds_r)
    return -c + cfg.pref_beta * -torch.log(torch.sigmoid(ratio))


def _simpo(sums, counts, cfg):
    p = len(sums) // 2
    mean = sums / counts
    return -torch.log(torch.sigmoid(cfg.pref_beta * (mean[:p] - mean[p:]) - cfg.simpo_gamma))


@pytest.mark.parametrize("objective,formula,beta", [("orpo", _orpo, 0.5), ("simpo", _simpo, 2.0)])
def test_orpo_and_simpo_match_an_independent_computation(fake_pairs, objective, formula, beta):
    """ORPO = NLL(chosen) + lambda * (-log sigmoid(log odds ratio)); SimPO = -log sigmoid(beta * margin - gamma),
    both on mean per-token log-probs, recomputed from full logits without the engine's code."""
    check = StepOneCheck(fake_pairs, formula)
    r = nbt.train(nbt.TrainConfig(**{**BASE, "objective": objective, "pref_beta": beta, "max_steps": 1}),
                  callbacks=[check])
    assert r.history.loss[0] == pytest.approx(check.expected, rel=1e-5)
    assert check.expected > 0


def test_nonfinite_reward_is_named_and_follows_the_policy(fake_pairs, monkeypatch):
    """A NaN reference log-prob on step 2: the step is non-finite (never averaged into a finite mean), its rewards
    are NaN, the notes name it; nonfinite='skip' skips the update and the run goes on, the default (no scaler)
    stops."""
    from nbtrain.engine import preference

    orig = preference.PreferenceObjective._reference_sums
    calls = {"n": 0}

    def poisoned(self, mb):
        calls["n"] += 1
        out = orig(self, mb)
        if calls["n"] == 2:
            out = out.clone()
            out[0] = float("nan")
        return out

    monkeypatch.setattr(preference.PreferenceObjective, "_reference_sums", poisoned)
    r = run(objective="dpo", nonfinite="skip")
    h = r.history
    assert h.nonfinite.tolist() == [False, True, False] and h.skipped.tolist() == [False, True, False]
    assert math.isnan(h.reward_chosen[1]) and math.isnan(h.reward_accuracy[1])
    assert any("preference reward was not finite" in n for n in r.summary["notes"])
    calls["n"] = 0
    r2 = run(objective="dpo")
    assert r2.summary["stopped_reason"] == "nonfinite" and len(r2.history) == 2


def test_logprob_mismatch_is_zero_in_fp32_and_positive_in_bf16(fake_pairs, monkeypatch):
    """fp32 recomputed in fp32 is the same computation, so an fp32 run runs no extra forward for it (the premise
    checked: two such forwards agree bit for bit); bf16 autocast moves the log-probs, and bf16-pure's weights are
    lifted to fp32 for the check and put back bit for bit."""
    from nbtrain.data import collate
    from nbtrain.engine import preference
    from nbtrain.precision import PRECISION_TABLE

    forwards = []
    real = preference.sequence_logps
    monkeypatch.setattr(preference, "sequence_logps", lambda *a, **k: forwards.append(1) or real(*a, **k))
    fp32 = run(objective="dpo", method="lora")
    assert fp32.summary["logprob_mismatch"] == 0.0 and fp32.summary["logprob_mismatch_steps"] == 3
    in_fp32 = len(forwards)
    mb = collate(fake_pairs[:2], 0, "causal-lm", indices=(0, 1))
    fp32.model.eval()
    with torch.no_grad():
        once, again = (real(fp32.model, mb, PRECISION_TABLE["fp32"], "cpu", keep_tokens=True)[2] for _ in range(2))
    assert torch.equal(once, again)
    forwards.clear()
    bf16 = run(objective="dpo", method="lora", precision="bf16")
    assert len(forwards) - in_fp32 == 3 * 2            # only bf16 runs two more on each of its 3 sampled steps
    assert 0 < bf16.summary["logprob_mismatch"] < 1
    pure = run(objective="dpo", precision="bf16-pure", max_steps=2)
    assert pure.summary["logprob_mismatch"] > 0
    assert all(p.dtype == torch.bfloat16 for p in pure.model.parameters() if p.is_floating_point())
    assert run(max_steps=1).summary.get("logprob_mismatch") is None   # lm: not measured, not shown


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_measuring_the_mismatch_leaves_the_run_as_it_was(fake_pairs, monkeypatch, precision):
    """The sampled steps' extra forwards (or, in fp32, none) change nothing the run does: with LoRA dropout on, the
    losses, rewards and final weights equal those of a run that does not measure at all (train mode and the random
    stream are as they were: an fp32 run once came out of its shortcut in eval mode and trained without dropout)."""
    from nbtrain.engine import preference

    kw = dict(objective="dpo", method="lora", lora_dropout=0.1, precision=precision)
    measured = run(**kw)
    monkeypatch.setattr(preference.PreferenceObjective, "_measure_mismatch", lambda self, mb: None)
    plain = run(**kw)
    cols = ["loss", "reward_chosen", "reward_rejected", "grad_norm"]
    assert measured.history[cols].equals(plain.history[cols])
    assert measured.summary["logprob_mismatch_steps"] == 3
    for (n, a), (_, b) in zip(measured.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), n


def test_preference_eval_and_lm_records(fake_pairs):
    """Evaluation scores the held-out pairs with the run's objective (loss per pair, ranking accuracy)."""
    r = run(objective="simpo")
    assert r.summary["eval_loss"] > 0 and 0 <= r.summary["eval_accuracy"] <= 1
    assert r.eval_history.eval_tokens.iloc[-1] == 4
    lm = nbt.train(nbt.TrainConfig(**{**BASE, "max_steps": 1}))
    assert lm.history.reward_margin.isna().all() and lm.summary["objective"] == "lm"


def test_resumed_full_dpo_keeps_the_initial_reference(fake_pairs, tmp_path):
    """A resumed full-fine-tune DPO run is the uninterrupted run: its reference is the initial model, not the
    checkpoint's trained weights."""
    whole = run(objective="dpo", max_steps=4)
    first = run(objective="dpo", max_steps=4, output_dir=str(tmp_path / "a"), save_every=2)
    assert first.history.loss.tolist() == pytest.approx(whole.history.loss.tolist(), abs=1e-7)
    resumed = run(objective="dpo", max_steps=4, output_dir=str(tmp_path / "b"),
                  resume_from=str(tmp_path / "a" / "checkpoints" / "step-000002"))
    assert resumed.history.loss.tolist() == pytest.approx(whole.history.loss.tolist(), abs=1e-6)
    assert resumed.history.reward_margin.tolist() == pytest.approx(whole.history.reward_margin.tolist(), abs=1e-6)


def test_pair_losses_units():
    """The three losses on hand values: DPO's zero margin is ln 2; SimPO's gamma shifts it; ORPO is finite for
    mean log-probs near 0 (the log(1 - e^x) of a near-certain answer)."""
    from nbtrain.engine.preference import pair_losses

    sums = torch.tensor([-2.0, -4.0, -3.0, -1.0])
    counts = torch.tensor([2.0, 4.0, 3.0, 1.0])
    loss, c, r = pair_losses("dpo", 0.1, 0.0, sums, counts, sums.clone())
    assert loss.tolist() == pytest.approx([LN2, LN2]) and c.tolist() == [0, 0]
    loss, c, r = pair_losses("simpo", 1.0, 0.5, sums, counts)
    assert loss.tolist() == pytest.approx([-math.log(1 / (1 + math.exp(0.5)))] * 2)
    loss, _, _ = pair_losses("orpo", 0.1, 0.0, torch.tensor([-1e-7, -5.0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(loss).all()
    with pytest.raises(ValueError, match="objective"):
        pair_losses("lm", 0.1, 0.0, sums, counts)
    assert F.logsigmoid(torch.tensor(0.0)).item() == pytest.approx(-LN2)


def test_the_run_tensor_count_holds_the_reference_copy(fake_pairs):
    """On the CPU the run's own tensors (host_tensors_gib) include the frozen copy: a full DPO run with a copy holds
    exactly one model's weights more than the same run with precomputed log-probs (which compute the same losses)."""
    copy_run = run(objective="dpo")
    pre_run = run(objective="dpo", precompute_ref=True)
    model_bytes = sum(p.numel() * p.element_size() for p in copy_run.model.parameters())
    model_bytes += sum(b.numel() * b.element_size() for b in copy_run.model.buffers())
    extra = (copy_run.summary["peak_host_tensors_gib"] - pre_run.summary["peak_host_tensors_gib"]) * 2**30
    assert extra == pytest.approx(model_bytes, rel=0.02)
