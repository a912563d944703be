"""estimate_memory for objective="grpo" (issue 47 item 6): the rollouts' KV cache and sampling forward, the update's
activations on prompt + completion rows with the head on the completion positions only, a full fine-tune's
reference copy, each its own row; and both phases against traced GRPO steps.

The arithmetic tests run on the tiny preset. A sampling pass on tiny is traced here too (a few seconds); whole GRPO
steps are traced on a 2-layer copy of SmolLM2-135M-Instruct's architecture (slow), the way
tests/test_memory_real.py checks the other objectives."""

from __future__ import annotations

import pytest
import torch

import nbtrain as nbt
from nbtrain.engine.rollout import sample_group
from nbtrain.engine.telemetry import LiveTensorBytes
from nbtrain.memory import estimate_html, estimate_memory, estimate_text
from nbtrain.memory.facts import architecture
from nbtrain.memory.timeline import step_peak
from nbtrain.models import build_model, load_tokenizer
from nbtrain.models.tensors import apply_tensor_precision
from nbtrain.precision import PRECISION_TABLE

from .helpers import storage_bytes
from .test_memory_real import smollm2  # noqa: F401  (the fixture: the preset, and a 2-layer copy as a folder)

GIB = 2**30
SAMPLING = "the rollouts: sampling with the KV cache (no_grad)"


def _cfg(**kw) -> nbt.TrainConfig:
    base = dict(objective="grpo", reward="length:8", data="builtin:prompts", model="tiny", precision="fp32",
                micro_batch_size=8, num_generations=4, max_new_tokens=32, max_seq_len=64, eval_fraction=0.0,
                max_steps=100, seed=0)
    return nbt.TrainConfig(**{**base, **kw})


def _est(data=None, **kw):
    return estimate_memory(_cfg(**kw), device="cpu", device_total_gib=64, data=data)


@pytest.fixture
def one_thread():
    """The rollouts decode a token at a time: small ops on which a second thread only contends (ten times slower
    on a loaded machine). The traced tensors are the same: what a kernel allocates inside is not traced."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the KV cache ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,sampler,k_bytes,v_bytes", [
    ("fp32", None, 4, 4),
    # under autocast the cache's K is RoPE's product with the fp32 cos/sin, V the bf16 projection's output
    ("bf16", None, 4, 2),
    ("bf16-pure", None, 2, 2),
    ("fp32", "bf16", 4, 2),      # sampled in bf16, trained in fp32: the sampler's dtype
])
def test_the_kv_cache_is_the_hand_formula(precision, sampler, k_bytes, v_bytes):
    a = architecture("tiny", "causal-lm")
    G, P, T = 8, 64, 48   # no data: the prompt is max_seq_len, the longest a prompt can be
    est = _est(precision=precision, sampler_precision=sampler, num_generations=G, max_new_tokens=T)
    assert est.rollout_kv_cache_bytes == G * (P + T) * a.layers * a.kv_heads * a.head_dim * (k_bytes + v_bytes)
    assert est.rollout_kv_cache_gib == pytest.approx(est.rollout_kv_cache_bytes / GIB)
    assert est.prompt_tokens == P and any("max_seq_len" in n for n in est.notes)
    # twice the group, twice the cache
    assert _est(precision=precision, sampler_precision=sampler, num_generations=2 * G, micro_batch_size=16,
                max_new_tokens=T).rollout_kv_cache_bytes == 2 * est.rollout_kv_cache_bytes


def test_the_prompt_length_is_the_datas_longest_prompt_when_given():
    data = [{"input_ids": [5] * 20, "prompt": "a", "columns": {}}, {"input_ids": [5] * 36, "prompt": "b",
                                                                       "columns": {}}]
    est = _est(data=data)
    assert est.prompt_tokens == 36 and any("the data's longest" in n for n in est.notes)
    a = architecture("tiny", "causal-lm")
    assert est.rollout_kv_cache_bytes == 4 * (36 + 32) * a.layers * a.kv_heads * a.head_dim * 8
    # without the data, max_seq_len: longer rows, more activations
    assert _est().activations_gib > est.activations_gib
    # a prompt longer than max_seq_len is cut to it when the data loads
    assert _est(data=data, max_seq_len=24).prompt_tokens == 24


# -- the reference --------------------------------------------------------------------------------------------------
def test_a_full_fine_tune_with_a_kl_term_holds_a_reference_copy():
    est, none = _est(grpo_beta=0.1), _est()
    assert est.reference_weights_bytes == est.weights_bytes > 0
    assert none.reference_weights_bytes == 0
    assert "reference weights" in set(est.table()["part"]) and "reference weights" not in set(none.table()["part"])
    # held all run: it is in both phases
    for name in ("rollout_peak_gib", "update_peak_gib"):
        assert getattr(est, name) - getattr(none, name) >= est.reference_weights_gib - 1e-12
    # no gradients and no optimizer state for it
    assert (est.gradients_bytes, est.optimizer_bytes) == (none.gradients_bytes, none.optimizer_bytes)
    p = step_peak(est.config, "fp32", "cpu", prompt_tokens=None)
    assert p.reference_forward > 0 and "the update: the reference forward" in " ".join(p.phases)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_and_qlora_use_the_model_with_its_adapters_off(method):
    est = _est(method=method, grpo_beta=0.1, precision="bf16")
    assert est.reference_weights_bytes == 0 and "reference weights" not in set(est.table()["part"])
    assert any("adapters off" in n for n in est.notes), est.notes
    p = step_peak(est.config, "bf16", "cpu")
    assert p.reference_forward > 0   # its forward is counted, its weights are the model's


# -- the update -----------------------------------------------------------------------------------------------------
def test_the_updates_activations_grow_with_the_micro_batch_and_the_new_tokens():
    base = step_peak(_cfg(), "fp32", "cpu")
    rows = step_peak(_cfg(micro_batch_size=16), "fp32", "cpu")
    longer = step_peak(_cfg(max_new_tokens=64), "fp32", "cpu")
    assert rows.activations > base.activations and longer.activations > base.activations
    # the head and its log-softmax run on the B x max_new_tokens completion positions: exactly linear in them...
    assert rows.logits == longer.logits == 2 * base.logits
    # ...and blind to the prompt (a longer prompt lengthens the rows, not the head's positions)
    prompt = step_peak(_cfg(max_seq_len=128), "fp32", "cpu")
    assert prompt.logits == base.logits and prompt.activations > base.activations
    # against objective="lm" on rows as long (8 x 96): its head runs on every position, GRPO's on 32 of them
    lm = step_peak(nbt.TrainConfig(model="tiny", micro_batch_size=8, max_seq_len=64 + 32, precision="fp32"),
                   "fp32", "cpu")
    assert base.logits < lm.logits / 2


# -- which phase peaks ----------------------------------------------------------------------------------------------
def test_the_peak_phase_says_rollouts_or_update():
    update = _est()
    assert update.peak_phase.startswith("the update: ")
    assert update.tensors_peak_gib == pytest.approx(max(update.rollout_peak_gib, update.update_peak_gib))
    # many long completions per prompt and a small update micro-batch: the group's KV cache is the peak
    rollouts = _est(num_generations=64, micro_batch_size=1, grad_accum_steps=64, max_new_tokens=1024)
    assert rollouts.peak_phase == SAMPLING
    assert rollouts.rollout_peak_gib > rollouts.update_peak_gib
    assert rollouts.tensors_peak_gib == pytest.approx(rollouts.rollout_peak_gib)


def test_the_rollouts_are_their_own_rows_in_the_table_text_and_html():
    est = _est(grpo_beta=0.1)
    table = est.table().set_index("part")["GiB"]
    assert list(table.index) == ["weights", "gradients", "optimizer", "reference weights", "activations",
                                 "logits + loss", "rollout KV cache", "sampling forward", "rollout tensors",
                                 "overhead", "total (peak)"]
    assert table["rollout KV cache"] == est.rollout_kv_cache_gib
    assert table["sampling forward"] == est.sampling_forward_gib
    text = estimate_text(est)
    for words in ("rollout KV cache", "sampling forward", "rollout tensors", "K and V fp32",
                  "grpo: 4 completions per prompt, 8 per update forward, prompt 64 + 32 new tokens",
                  "the rollouts peak at", "the step's peak is the update's"):
        assert words in text, words
    assert "chosen + rejected" not in text
    html = estimate_html(est, details=True)
    assert "rollout KV cache" in html and "the rollouts peak at" in html
    # the other objectives show none of it
    lm = estimate_memory(nbt.TrainConfig(model="tiny"), device="cpu", device_total_gib=64)
    assert not {"rollout KV cache", "sampling forward", "rollout tensors"} & set(lm.table()["part"])
    assert "rollouts" not in estimate_text(lm)


def test_several_processes_are_estimated_as_one():
    est = estimate_memory(_cfg(), device="cpu", device_total_gib=64, world_size=4)
    assert est.world_size == 1 and any("one process" in n for n in est.notes)


# -- traced: one group's sampling on tiny -------------------------------------------------------------------------
@pytest.mark.parametrize("method,precision", [("full", "fp32"), ("full", "bf16"), ("lora", "bf16")])
def test_sampling_a_group_on_tiny_matches_a_traced_one(method, precision, one_thread):
    """engine.rollout.sample_group on the model as prepare() builds it, every completion at full length (no stop
    token), against the estimate's KV cache and sampling forward. Full bf16 caches autocast's casts of its trained
    weights for the group; LoRA's frozen head is cast again at every step."""
    G, P, T = 8, 40, 48
    cfg = _cfg(method=method, precision=precision, num_generations=G, max_new_tokens=T, max_seq_len=P)
    torch.manual_seed(0)
    model = build_model(cfg, load_tokenizer(cfg), None, precision, "cpu")
    apply_tensor_precision(model, PRECISION_TABLE[precision], fp8_native=False)
    ignore = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    with LiveTensorBytes(ignore) as traced:
        out = sample_group(model, list(range(10, 10 + P)), G, T, spec=PRECISION_TABLE[precision],
                           generator=torch.Generator().manual_seed(0))
    assert out.lengths == [T] * G
    est = estimate_memory(cfg, device="cpu", device_total_gib=64)
    estimated = est.rollout_kv_cache_bytes + est.sampling_forward_gib * GIB
    assert estimated == pytest.approx(traced.peak, rel=0.05), (estimated / 2**20, traced.peak / 2**20)


# -- traced: whole GRPO steps on SmolLM2's architecture ---------------------------------------------------------------
def _held(st) -> list:
    """What the step holds before it starts: the weights, the optimizer state, a reference copy."""
    out = [*st.model.parameters(), *st.model.buffers()]
    out += [t for s in st.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    ref = st.objective.ref_model
    if ref is not None:
        out += [*ref.parameters(), *ref.buffers()]
    return out


def _rollouts(st, gen) -> tuple[int, list]:
    """The rollouts of the generator's next step, traced: (the peak of every storage, the micro-batches)."""
    held = _held(st)
    with LiveTensorBytes({t.untyped_storage()._cdata for t in held}) as live:
        _, micro = next(gen)
    return storage_bytes(held) + live.peak, micro


def _update(st, micro) -> int:
    """The step's update as the loop runs it, traced: every micro-batch's forward and backward."""
    obj = st.objective
    kept = [getattr(mb, n) for mb in micro for n in mb._TENSORS] + list(obj.batch.fp32.values())
    held = _held(st) + kept
    units = sum(mb.loss_units for mb in micro)
    with LiveTensorBytes({t.untyped_storage()._cdata for t in held}) as live:
        obj.begin_step(2)
        for mb in micro:
            loss, _ = obj.micro_loss(st.model, mb.to("cpu"))
            (loss / units).backward()
            del loss
    return storage_bytes(held) + live.peak


def _estimate(cfg, st, batch: int):
    """The estimate with the data of the rollout batch: the prompts it samples (their longest sets the rows)."""
    examples = [st.data.train[i] for i in st.objective._prompt_indices(batch)]
    return estimate_memory(cfg, device="cpu", device_total_gib=64, data=examples)


@pytest.mark.slow
# full fp32 with beta 0 is this case without the frozen copy, whose bytes the estimate's test above checks untraced
@pytest.mark.parametrize("method,precision,beta", [("lora", "bf16", 0.0), ("full", "fp32", 0.1)])
def test_both_phases_of_a_grpo_step_on_a_shortened_smollm2(smollm2, method, precision, beta,  # noqa: F811
                                                           one_thread):
    """A step as the loop takes it, after one that made the optimizer state: step 2 (a sampled step: its rollouts
    end with the fp32 log-prob pass) traced in its two phases, then step 4's rollouts (no fp32 pass: the sampling
    with the KV cache alone). The weights keep their storages in these precisions (nothing is lifted to fp32), so
    the held tensors are counted once, beside what each phase makes."""
    from nbtrain.engine.prepare import prepare

    cfg = _cfg(model=smollm2[1], method=method, precision=precision, grpo_beta=beta, max_seq_len=128)
    st = prepare(cfg, device="cpu")
    try:
        obj = st.objective
        gen = obj.batches(0)
        _, micro = next(gen)   # step 1, untraced: the optimizer's state
        obj.begin_step(1)
        units = sum(mb.loss_units for mb in micro)
        for mb in micro:
            loss, _ = obj.micro_loss(st.model, mb)
            (loss / units).backward()
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)

        rollouts, micro = _rollouts(st, gen)                     # step 2's rollouts
        assert obj.batch.fp32, "step 2 is a sampled step"
        update = _update(st, micro)
        est = _estimate(cfg, st, 1)
        assert est.rollout_peak_gib * GIB == pytest.approx(rollouts, rel=0.05), (est.rollout_peak_gib,
                                                                                  rollouts / GIB)
        assert est.update_peak_gib * GIB == pytest.approx(update, rel=0.05), (est.update_peak_gib, update / GIB)
        assert est.peak_phase.startswith("the update: ")

        sampling, _ = _rollouts(st, obj.batches(3))               # step 4's rollouts: the sampling alone
        assert not obj.batch.fp32, "step 4 is not a sampled step"
        est = _estimate(cfg, st, 3)
        held = est.weights_gib + est.optimizer_gib + est.reference_weights_gib
        estimated = held + est.rollout_kv_cache_gib + est.sampling_forward_gib + est.rollout_tensors_gib
        assert estimated * GIB == pytest.approx(sampling, rel=0.05), (estimated, sampling / GIB)
    finally:
        st.restore.close()
