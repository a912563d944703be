"""Issue 27, the engine side: precisions bf16-pure and fp8 through the one loop, every optimizer stepping and
resuming under fp32 / bf16 / fp16+scaler, stochastic rounding, and the doctor's lost-update count against an
independent one."""

import pytest
import torch

import nbtrain as nbt
from nbtrain import hardware
from nbtrain.engine import doctor
from nbtrain.engine.optimizers import BF16StochasticAdamW, optimizer_state_bytes, stochastic_round_bf16
from nbtrain.engine.prepare import prepare
from nbtrain.precision import PRECISION_TABLE, TENSOR_DTYPES, active_autocast_dtype

from .helpers import Collect

CPU_OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor", "sgd")


@pytest.fixture
def small():
    return nbt.TrainConfig(model="tiny", subset=32, max_seq_len=32, micro_batch_size=4, max_steps=3,
                           eval_fraction=0.0, precision="fp32", lr=1e-3, scheduler="constant")


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# -- the table -------------------------------------------------------------------------------------------------
def test_every_precision_is_a_table_row_with_its_tensor_dtypes():
    assert set(PRECISION_TABLE) == set(hardware.PRECISIONS) == set(TENSOR_DTYPES)
    pure, fp8 = PRECISION_TABLE["bf16-pure"], PRECISION_TABLE["fp8"]
    assert pure.autocast_dtype is None and pure.param_dtype == torch.bfloat16 and not pure.scaler
    assert fp8.fp8 and fp8.autocast_dtype == torch.bfloat16 and fp8.param_dtype == torch.float32
    assert TENSOR_DTYPES["bf16-pure"]["master weights"] == "none"


def test_config_refuses_what_does_not_compose():
    with pytest.raises(nbt.ConfigError) as e:
        nbt.TrainConfig(stochastic_rounding=True, precision="bf16")
    assert e.value.field == "stochastic_rounding" and "bf16-pure" in str(e.value)
    with pytest.raises(nbt.ConfigError) as e:
        nbt.TrainConfig(stochastic_rounding=True, precision="bf16-pure", optimizer="sgd")
    assert e.value.field == "stochastic_rounding" and "adamw" in str(e.value)
    with pytest.raises(nbt.ConfigError) as e:
        nbt.TrainConfig(precision="fp8", method="qlora")
    assert e.value.field == "precision" and "bitsandbytes" in str(e.value)
    with pytest.raises(nbt.ConfigError) as e:
        nbt.TrainConfig(optimizer="adam")
    assert e.value.field == "optimizer" and "adamw_8bit" in str(e.value)


def test_paged_optimizer_is_cuda_only_with_its_reason():
    caps = nbt.capabilities("cpu")
    assert "paged_adamw_8bit" not in caps.allowed_optimizers and "CUDA" in caps.why_not("paged_adamw_8bit")
    cfg = nbt.TrainConfig(optimizer="paged_adamw_8bit", precision="fp32")   # a GPU config loads anywhere
    with pytest.raises(nbt.ConfigError) as e:
        hardware.check_runnable(cfg, caps)
    assert e.value.field == "optimizer" and str(e.value).startswith("optimizer: 'paged_adamw_8bit' cannot run")


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    real = hardware.importlib.util.find_spec
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    hardware._capabilities.cache_clear()
    try:
        caps = nbt.capabilities("cpu")
        assert "fp8" not in caps.allowed_precisions and "nbtrain[fp8]" in caps.reasons["fp8"]
    finally:
        monkeypatch.undo()
        hardware._capabilities.cache_clear()
    assert "emulated: numerics only, slower" in nbt.capabilities("cpu").notes["fp8"]


# -- precisions through the loop ----------------------------------------------------------------------------------
class _Probe:
    """Records the autocast dtype inside the model's forward and the dtypes of what training holds."""

    def __init__(self):
        self.autocast = []

    def hook(self, module, args):
        self.autocast.append(active_autocast_dtype("cpu"))


def test_bf16_pure_keeps_weights_grads_and_state_in_bf16_without_autocast(small):
    st = prepare(small.replace(precision="bf16-pure"))
    try:
        probe = _Probe()
        st.model.register_forward_pre_hook(probe.hook)
        assert all(p.dtype == torch.bfloat16 for p in st.model.parameters())
        from nbtrain.data import iter_steps
        from nbtrain.engine.losses import micro_loss_sum

        mb = next(iter_steps(st.data.train, 4, 1, 0, st.data.pad_token_id, st.data.task))[1][0]
        micro_loss_sum(st.model, mb, st.data.task, st.spec, "cpu").backward()
        st.optimizer.step()
        assert probe.autocast == [None]                        # no autocast: bf16 weights compute in bf16
        assert all(p.grad.dtype == torch.bfloat16 for p in st.params)
        states = [v for s in st.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert states and all(v.dtype == torch.bfloat16 for v in states)
        n = sum(p.numel() for p in st.params)
        assert optimizer_state_bytes(st.optimizer) == 4 * n + 4 * len(st.params)   # two bf16 moments + steps
    finally:
        st.restore.close()
    assert any("no fp32 master copy" in x for x in st.notes)


def test_fp8_converts_the_linears_but_not_the_output_layer_and_keeps_fp32_masters(small):
    from torchao.float8.float8_linear import Float8Linear

    r = nbt.train(small.replace(precision="fp8", max_steps=2))
    mods = dict(r.model.named_modules())
    converted = [n for n, m in mods.items() if isinstance(m, Float8Linear)]
    assert converted and "lm_head" not in converted and not isinstance(mods["lm_head"], Float8Linear)
    assert all(p.dtype == torch.float32 for p in r.model.parameters())
    notes = " ".join(r.summary["notes"])
    assert f"fp8: {len(converted)} linear layers" in notes and "emulated" in notes and "lm_head (output layer)" in notes
    assert r.summary["precision_used"] == "fp8" and r.summary["weights_dtype"] == "fp32"


def test_every_precision_starts_from_one_init_hash(small):
    hashes = set()
    for p in ("fp32", "bf16", "bf16-pure", "fp8"):
        st = prepare(small.replace(precision=p), hash_init=True)
        st.restore.close()
        hashes.add(st.init_hash)
    assert len(hashes) == 1


# -- every optimizer: step, skip and resume ---------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16"))
def test_every_optimizer_steps_under_each_precision(small, optimizer, precision):
    cfg = small.replace(optimizer=optimizer, precision=precision, max_steps=2, subset=16, max_seq_len=16)
    first = prepare(cfg)
    before = _weights(first.model)
    first.restore.close()
    r = nbt.train(cfg)
    assert r.summary["steps"] == 2 and r.summary["optimizer"] == optimizer and r.summary["skipped_steps"] == 0
    after = _weights(r.model)
    assert all(torch.isfinite(t).all() for t in after.values())
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    assert moved > len(before) // 2                          # the optimizer really stepped the weights
    assert (r.history.scale.notna().all()) == (precision == "fp16")


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
def test_a_scaler_skip_never_steps_any_optimizer(small, optimizer):
    cfg = small.replace(optimizer=optimizer, precision="fp16", max_steps=2, subset=16, max_seq_len=16)
    seen = {}

    class Watch:
        def on_run_start(self, info):
            model = info.model
            # inf in one weight's gradient at step 2: a backward hook on the embedding output scales it to inf
            calls = {"n": 0}

            def blow(grad):
                calls["n"] += 1
                return grad * float("inf") if calls["n"] == 2 else grad

            model.get_input_embeddings().weight.register_hook(blow)
            seen["model"] = model

        def on_step_end(self, rec):
            seen[rec.step] = (rec.skipped, _weights(seen["model"]))

    r = nbt.train(cfg, callbacks=[Watch()])
    assert r.history.skipped.tolist() == [False, True]
    w1, w2 = seen[1][1], seen[2][1]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)        # the skipped step changed no weight


@pytest.mark.parametrize("optimizer", ("adamw", "sgd"))
def test_resume_is_bitwise_in_fp32(small, tmp_path, optimizer):
    cfg = small.replace(optimizer=optimizer, max_steps=4, save_every=2, output_dir=str(tmp_path / "a"))
    full = nbt.train(cfg)
    ck = tmp_path / "a" / "checkpoints" / "step-000002"
    resumed = nbt.train(cfg.replace(output_dir=str(tmp_path / "b"), resume_from=str(ck)))
    assert resumed.history.loss.tolist() == full.history.loss.tolist()
    a, b = _weights(full.model), _weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("optimizer,precision", [("adamw_8bit", "fp32"), ("adafactor", "fp32"),
                                                 ("adamw", "bf16-pure")])
def test_optimizer_state_round_trips_exactly_through_a_checkpoint(small, tmp_path, optimizer, precision):
    from nbtrain.engine.checkpoint import load_checkpoint

    kw = dict(stochastic_rounding=True) if precision == "bf16-pure" else {}
    cfg = small.replace(optimizer=optimizer, precision=precision, max_steps=4, save_every=2,
                        output_dir=str(tmp_path / "a"), **kw)
    full = nbt.train(cfg)
    ck = load_checkpoint(str(tmp_path / "a" / "checkpoints" / "step-000002"))
    st = prepare(cfg.replace(output_dir=None, save_every=None))
    try:
        st.optimizer.load_state_dict(ck["optimizer"])
        again = st.optimizer.state_dict()
    finally:
        st.restore.close()
    saved = ck["optimizer"]

    def same(a, b):   # bitsandbytes nests its quantization state (state1, absmax1, qmap1) one dict deeper
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    assert saved["state"] and same(saved["state"], again["state"])
    assert same(saved.get("rounding_rng"), again.get("rounding_rng"))
    resumed = nbt.train(cfg.replace(output_dir=str(tmp_path / "b"),
                                    resume_from=str(tmp_path / "a" / "checkpoints" / "step-000002")))
    assert resumed.history.loss.tolist() == full.history.loss.tolist()   # the rounding stream is resumed too
    a, b = _weights(full.model), _weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_changing_the_optimizer_on_resume_is_refused(small, tmp_path):
    cfg = small.replace(max_steps=2, save_every=2, output_dir=str(tmp_path / "a"))
    nbt.train(cfg)
    with pytest.raises(nbt.CheckpointError, match="optimizer: checkpoint 'adamw' vs config 'sgd'"):
        nbt.train(cfg.replace(optimizer="sgd", output_dir=str(tmp_path / "b"),
                              resume_from=str(tmp_path / "a" / "checkpoints")))


# -- stochastic rounding -------------------------------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    g = torch.Generator().manual_seed(0)
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    step = 2.0 ** -7                                   # bf16's spacing in [1, 2)
    for frac in (0.1, 0.37, 0.5):
        x = torch.full((200_000,), 1.0 + frac * step)
        r = stochastic_round_bf16(x, g).float()
        assert set(r.unique().tolist()) <= {float(lo), float(lo) + step}
        assert r.mean().item() == pytest.approx(float(x[0]), abs=step * 0.01)
        assert (r > 1.0).float().mean().item() == pytest.approx(frac, abs=0.01)
    neg = stochastic_round_bf16(torch.full((100_000,), -(1.0 + 0.25 * step)), g).float()
    assert neg.mean().item() == pytest.approx(-(1.0 + 0.25 * step), abs=step * 0.01)
    # nearest rounding loses this update every time
    assert (torch.full((10,), 1.0 + 0.25 * step).to(torch.bfloat16).float() == 1.0).all()


def test_stochastic_adamw_follows_fp32_adamw_where_nearest_rounding_stalls():
    torch.manual_seed(0)
    w0 = torch.rand(65536) + 2.0                       # weights in [2, 3): bf16's spacing there is 2^-6
    direction = torch.randint(0, 2, (65536,)).float() * 2 - 1   # each weight's gradient leans one way
    grads = [direction + 0.5 * torch.randn(65536) for _ in range(50)]

    def run(opt_cls, dtype, **kw):
        p = torch.nn.Parameter(w0.to(dtype).clone())
        opt = opt_cls([p], lr=1e-4, **kw)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        return p.detach().float()

    ref = run(torch.optim.AdamW, torch.float32, weight_decay=0.0)
    start = w0.to(torch.bfloat16).float()
    nearest = run(torch.optim.AdamW, torch.bfloat16, weight_decay=0.0)
    sr = run(BF16StochasticAdamW, torch.bfloat16, weight_decay=0.0, seed=1)
    moved_ref = (ref - w0).abs().mean()
    assert (nearest == start).float().mean() > 0.99           # every 1e-4 update is lost to nearest rounding
    # stochastic rounding moves the weights as far as fp32 does, in fp32's direction, on average
    along = ((sr - start) * torch.sign(ref - w0)).mean()
    assert along == pytest.approx(float(moved_ref), rel=0.1)


# -- lost updates ------------------------------------------------------------------------------------------------
def _one_step_independent_count(cfg):
    """Step 1 by hand on prepare()'s state: which weights with a gradient did the optimizer leave unchanged?"""
    from nbtrain.data import iter_steps
    from nbtrain.engine.losses import micro_loss_sum

    st = prepare(cfg)
    try:
        lost = doctor.LostUpdates(st.params, 1, samples_per_tensor=10**9)   # every element: no sampling
        _, micro = next(iter_steps(st.data.train, cfg.micro_batch_size, 1, cfg.seed, st.data.pad_token_id,
                                   st.data.task))
        n = sum(mb.n_targets for mb in micro)
        for mb in micro:
            (micro_loss_sum(st.model, mb, st.data.task, st.spec, "cpu") / n).backward()
        before = [p.detach().clone() for p in st.params]
        meant = [p.grad != 0 for p in st.params]
        lost.before(1, st.optimizer.param_groups[0]["lr"])
        st.optimizer.step()
        lost.after(False)
        unchanged = sum(int(((p.detach() == b) & m).sum()) for p, b, m in zip(st.params, before, meant))
        counted = sum(int(m.sum()) for m in meant)
    finally:
        st.restore.close()
    return lost.shares()[1], unchanged / counted


@pytest.mark.parametrize("precision,lr", [("bf16-pure", 1e-5), ("fp32", 1e-5), ("bf16-pure", 1e-3)])
def test_lost_update_share_matches_an_independent_count(small, precision, lr):
    measured, independent = _one_step_independent_count(small.replace(precision=precision, lr=lr))
    assert measured == independent
    if precision == "bf16-pure" and lr == 1e-5:
        assert measured > 0.5                                   # most small updates vanish in bf16 weights
    if precision == "fp32":
        assert measured < 0.01


def test_the_runs_sampled_share_is_close_to_the_full_count_and_is_reported(small):
    cfg = small.replace(precision="bf16-pure", lr=1e-5, max_steps=2)
    _, independent = _one_step_independent_count(cfg)
    r = nbt.train(cfg)
    s = r.summary
    assert set(s["lost_updates_by_step"]) == {1, 2}
    assert s["lost_updates_by_step"][1] == pytest.approx(independent, abs=0.03)   # a strided sample of each tensor
    worst = max(s["lost_updates_by_step"], key=lambda k: (s["lost_updates_by_step"][k], -k))
    line = f"{s['lost_updates_by_step'][worst]:.0%} of updates lost at step {worst}"   # the largest share first
    assert any(n.startswith(line) and "stochastic_rounding=True" in n for n in s["notes"])
    kinds = {f.kind: f for f in doctor.diagnose(r.history, s, cfg)}
    assert "lost_updates" in kinds and "stochastic_rounding=True" in kinds["lost_updates"].advice
    fp32 = nbt.train(cfg.replace(precision="fp32", lr=1e-3))
    assert fp32.summary["lost_updates"] < doctor.LOST_UPDATES_REPORTED
    assert not any("updates lost" in n for n in fp32.summary["notes"])
    assert "lost_updates" not in {f.kind for f in doctor.diagnose(fp32.history, fp32.summary, cfg)}


def test_warmup_step_at_lr_zero_and_skipped_steps_are_not_counted(small):
    r = nbt.train(small.replace(precision="bf16-pure", warmup_steps=2, max_steps=3, scheduler="linear"))
    assert 1 not in r.summary["lost_updates_by_step"]           # lr 0: nothing was meant to move
    assert nbt.train(small.replace(max_steps=1, lr=1e-3)).summary["lost_updates"] is not None


def test_bf16_pure_loses_progress_at_a_small_lr_and_stochastic_rounding_recovers_it(small):
    cfg = small.replace(subset=64, max_seq_len=48, max_steps=16, lr=1e-5)
    runs = {k: nbt.train(cfg.replace(**kw)).history.loss for k, kw in
            {"bf16": dict(precision="bf16"), "pure": dict(precision="bf16-pure"),
             "sr": dict(precision="bf16-pure", stochastic_rounding=True)}.items()}
    progress = {k: float(h.iloc[0] - h.iloc[-4:].mean()) for k, h in runs.items()}
    assert progress["bf16"] > 0
    assert progress["pure"] < 0.6 * progress["bf16"]            # lost updates: the loss falls behind
    assert progress["sr"] > 0.8 * progress["bf16"]              # stochastic rounding closes most of the gap


def test_a_resumed_run_keeps_the_lost_updates_measured_before(small, tmp_path):
    cfg = small.replace(precision="bf16-pure", lr=1e-5, max_steps=4, save_every=2, output_dir=str(tmp_path / "a"))
    full = nbt.train(cfg)
    resumed = nbt.train(cfg.replace(output_dir=str(tmp_path / "b"),
                                    resume_from=str(tmp_path / "a" / "checkpoints" / "step-000002")))
    assert resumed.summary["lost_updates_by_step"] == full.summary["lost_updates_by_step"]


def test_records_and_collect_are_unchanged_by_the_new_precisions(small):
    c = Collect()
    nbt.train(small.replace(precision="bf16-pure", max_steps=2), callbacks=[c])
    assert [r.step for r in c.records] == [1, 2] and all(r.scale is None for r in c.records)


def test_fp8_with_lora_converts_the_frozen_base_not_the_adapters(small):
    from torchao.float8.float8_linear import Float8Linear

    r = nbt.train(small.replace(precision="fp8", method="lora", max_steps=2))
    mods = dict(r.model.named_modules())
    converted = [n for n, m in mods.items() if isinstance(m, Float8Linear)]
    assert converted and all(n.endswith("base_layer") for n in converted)
    assert not any(isinstance(m, Float8Linear) for n, m in mods.items() if "lora_" in n)
    assert r.history.loss.notna().all() and r.summary["stopped_reason"] == "max_steps"
