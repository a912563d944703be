"""compare(): fair by construction and checked, failing variants become rows, repeats, figure, HTML, CLI."""

import dataclasses
import math
import re
import statistics
import subprocess
import sys
import warnings

import pandas as pd
from pathlib import Path

import pytest
import torch

import nbtrain as nbt
from nbtrain.compare import ComparisonWarning, compare
from nbtrain.compare.run import _tokens_per_s

from .helpers import Collect, inject_inf

VARIANT_KEYS = ("variant", "precision_used", "device", "steps", "wall_s", "tokens_per_s", "speedup",
                "peak_vram_gib", "peak_host_rss_gib", "final_loss", "eval_loss", "eval_perplexity",
                "max_abs_loss_diff", "skipped_steps", "nonfinite_steps", "min_scale", "init_hash",
                "data_hash", "fair", "notes")


def small_cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=24, micro_batch_size=8,
                max_steps=3, eval_fraction=0.0, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


def row(cmp, name):
    return cmp.table.set_index("variant").loc[name]


@pytest.fixture(scope="module")
def fp_cmp():
    """fp32 vs bf16 with an eval split and a live dashboard attached (shared by several tests)."""
    from nbtrain.viz import LiveDashboard

    dash = LiveDashboard(mode="html", display=False)
    collect = Collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComparisonWarning)   # a fair comparison must not warn
        cmp = compare(small_cfg(eval_fraction=0.2, subset=40), precisions=("fp32", "bf16"),
                          callbacks=[dash, collect], warmup=False)
    return cmp, dash, collect


def test_same_init_and_data_across_precisions(fp_cmp):
    from nbtrain.data import load_data
    from nbtrain.engine import weights_hash
    from nbtrain.models import build_model, load_tokenizer

    cmp, _, _ = fp_cmp
    t = cmp.table
    assert list(t.variant) == ["fp32", "bf16"] and list(t.precision_used) == ["fp32", "bf16"]
    assert all(k in t.columns for k in VARIANT_KEYS)
    assert t.init_hash.nunique() == 1 and t.data_hash.nunique() == 1 and t.init_hash.notna().all()
    assert cmp.fair and t.fair.all()
    # The recorded init hash is the hash of a model freshly built from the seed, computed here independently.
    cfg = cmp.configs["fp32"]
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    torch.manual_seed(cfg.seed)
    assert weights_hash(build_model(cfg, tok, data.num_labels, "fp32", "cpu")) == t.init_hash[0]
    # Same data and weights: the first step's loss differs only by bf16 rounding.
    h32, h16 = cmp.results["fp32"].history, cmp.results["bf16"].history
    assert h16.loss[0] == pytest.approx(h32.loss[0], rel=1e-2)
    assert list(h16.tokens) == list(h32.tokens)
    ref, other = row(cmp, "fp32"), row(cmp, "bf16")
    assert ref.speedup == 1.0 and ref.max_abs_loss_diff == 0.0
    assert other.speedup == pytest.approx(other.tokens_per_s / ref.tokens_per_s)
    assert other.max_abs_loss_diff == pytest.approx((h16.loss - h32.loss).abs().max())
    assert other.max_abs_loss_diff > 0   # bf16 really is another precision
    assert other.eval_loss == pytest.approx(cmp.results["bf16"].summary["eval_loss"])
    assert other.eval_perplexity == pytest.approx(math.exp(other.eval_loss))
    assert (t.steps == 3).all() and (t.status == "max_steps").all()


def test_changed_seed_is_detected():
    with pytest.warns(ComparisonWarning, match=r"'seeded'.*seed differs"):
        cmp = compare(small_cfg(max_steps=2), variants={"base": {}, "seeded": dict(seed=1)}, warmup=False)
    r = row(cmp, "seeded")
    assert not cmp.fair and not r.fair
    assert row(cmp, "base").fair
    assert r.init_hash != row(cmp, "base").init_hash and r.data_hash != row(cmp, "base").data_hash
    assert "NOT FAIR" in r.notes and "seed" in r.notes
    assert r.max_abs_loss_diff > 1e-4          # the loss-diff column does show a real difference
    assert "NOT FAIR" in cmp.format_table()


def test_accumulation_variants_match_within_1e5():
    variants = {"micro8": dict(micro_batch_size=8), "micro2x4": dict(micro_batch_size=2, grad_accum_steps=4),
                "micro1x8": dict(micro_batch_size=1, grad_accum_steps=8)}
    cmp = compare(small_cfg(subset=40, max_seq_len=32), variants=variants, warmup=False)
    t = cmp.table.set_index("variant")
    assert list(t.grad_accum) == [1, 4, 8]
    ref = cmp.results["micro8"].history
    assert ref.tokens.nunique() > 1        # rows of different lengths: naive averaging would differ
    for name in variants:
        expect = (cmp.results[name].history.loss - ref.loss).abs().max()
        assert t.loc[name, "max_abs_loss_diff"] == pytest.approx(expect, abs=1e-12)
        assert t.loc[name, "max_rel_loss_diff"] <= 1e-5, name
    # Same weights, and the same examples in every step however they are cut into micro-batches.
    assert t.init_hash.nunique() == 1 and t.data_hash.nunique() == 1 and cmp.fair


def test_fp16_overflow_shows_skips_and_scale_drop(monkeypatch):
    from nbtrain.viz import find_trace

    inject_inf(monkeypatch, on_forward_calls={5})   # fp32 runs forwards 1-3, so 5 is fp16's step 2
    cmp = compare(small_cfg(subset=24), precisions=("fp32", "fp16"), warmup=False)
    fp16, fp32 = row(cmp, "fp16"), row(cmp, "fp32")
    assert (fp16.skipped_steps, fp16.nonfinite_steps, fp16.first_nonfinite_step) == (1, 1, 2)
    h = cmp.results["fp16"].history
    assert fp16.min_scale == h.scale.min() == h.scale[0] / 2
    assert fp16.status == "max_steps" and "skipped by the GradScaler" in fp16.notes
    fp16_note = nbt.capabilities().notes.get("fp16")
    if fp16_note:
        assert fp16_note in fp16.notes        # e.g. "slower than fp32" on a CPU without fp16 hardware
    assert fp32.skipped_steps == 0 and math.isnan(fp32.min_scale)
    fig = cmp.figure()
    assert list(find_trace(fig, "scale", "skipped", run="fp16").x) == [2]
    assert len(find_trace(fig, "scale", "skipped", run="fp32").x) == 0
    scale = list(find_trace(fig, "scale", "scale", run="fp16").y)
    assert scale[1] == scale[0] / 2


def _patch_build(monkeypatch, failures):
    """build_model that misbehaves as ``failures[cfg.lr]`` says: ("build", exc) raises while building,
    ("forward", n, exc) raises in the n-th forward, ("inf", n) makes the n-th forward's logits inf."""
    import nbtrain.engine.prepare as prepare

    original = prepare.build_model

    def build(cfg, *args, **kwargs):
        how = failures.get(cfg.lr)
        if how and how[0] == "build":
            raise how[1]
        model = original(cfg, *args, **kwargs)
        if how:
            calls = {"n": 0}

            def hook(module, inputs, output):
                calls["n"] += 1
                if calls["n"] == how[1]:
                    if how[0] == "inf":
                        output.logits = output.logits * math.inf
                    else:
                        raise how[2]
                return output

            model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(prepare, "build_model", build)


def test_failing_variants_become_rows_and_others_run(monkeypatch):
    _patch_build(monkeypatch, {
        2e-3: ("build", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")),
        3e-3: ("forward", 2, RuntimeError("boom in the forward")),
        4e-3: ("forward", 2, torch.OutOfMemoryError("out of memory in step 2")),
        5e-3: ("inf", 1),
    })
    variants = {"ok": {}, "oom_build": dict(lr=2e-3), "crash": dict(lr=3e-3), "oom_step": dict(lr=4e-3),
                "diverges": dict(lr=5e-3), "after": dict(lr=6e-3)}
    cmp = compare(small_cfg(max_steps=2), variants=variants, warmup=False)
    t = cmp.table.set_index("variant")
    assert list(t.index) == list(variants)
    assert t.loc["oom_build", "status"] == "out_of_memory"
    assert "OutOfMemoryError" in t.loc["oom_build", "notes"]
    assert math.isnan(t.loc["oom_build", "final_loss"]) and pd.isna(t.loc["oom_build", "steps"])
    assert t.loc["crash", "status"] == "error" and "boom in the forward" in t.loc["crash", "notes"]
    assert "RuntimeError" in cmp.errors["crash"] and "Traceback" in cmp.errors["crash"]
    # Out of memory inside the loop: the run ends with its history and a reason.
    assert t.loc["oom_step", "status"] == "out_of_memory" and t.loc["oom_step", "steps"] == 1
    assert "out of memory at step 2" in t.loc["oom_step", "notes"]
    assert "oom_step" in cmp.results
    # fp32 has no GradScaler: a non-finite step stops the run, which is kept with the bad step named.
    assert t.loc["diverges", "status"] == "nonfinite" and t.loc["diverges", "first_nonfinite_step"] == 1
    assert "diverged: stopped at step 1" in t.loc["diverges", "notes"]
    assert not math.isfinite(cmp.results["diverges"].history.loss[0])
    assert t.loc["after", "status"] == "max_steps" and t.loc["after", "steps"] == 2
    assert set(cmp.results) == {"ok", "oom_step", "diverges", "after"}
    text = cmp.format_table()
    assert "boom in the forward" in text and "diverged" in text


def test_unsupported_variants_give_the_reason(monkeypatch):
    import nbtrain.hardware as hardware

    caps = nbt.capabilities()
    no_bnb = dataclasses.replace(caps, reasons={**caps.reasons, "qlora": "bitsandbytes is not installed"})
    monkeypatch.setattr(hardware, "capabilities", lambda *a, **k: no_bnb)
    variants = {"fp32": {}, "tf32": dict(precision="tf32"), "qlora": dict(method="qlora")}
    if "tf32" not in caps.reasons:
        variants["tf32"] = dict(precision="tf32", micro_batch_size=0)   # invalid everywhere
    cmp = compare(small_cfg(max_steps=1), variants=variants, warmup=False)
    t = cmp.table.set_index("variant")
    assert list(cmp.results) == ["fp32"]
    assert t.loc["qlora", "status"] == "unsupported"
    assert "bitsandbytes is not installed" in t.loc["qlora", "notes"]
    assert t.loc["tf32", "status"] == "unsupported"
    if "tf32" in caps.reasons:
        assert caps.reasons["tf32"] in t.loc["tf32", "notes"] and t.loc["tf32", "precision_used"] == "tf32"
    assert math.isnan(t.loc["tf32", "tokens_per_s"]) and t.fair.isna()["tf32"]
    assert t.loc["qlora", "micro_batch"] == 8 and t.loc["qlora", "method"] == "qlora"   # as requested
    assert cmp.fair                       # rows that did not run do not make it unfair
    fig = cmp.figure()
    assert "not run: tf32" in fig.layout.title.text and "qlora" in fig.layout.title.text


def test_interrupt_ends_the_comparison_with_the_rows_so_far():
    class CtrlC:
        def on_step_end(self, rec):
            if rec.variant == "fp32" and rec.step == 1:
                raise KeyboardInterrupt

    cmp = compare(small_cfg(max_steps=3), precisions=("fp32", "bf16"), callbacks=[CtrlC()], warmup=False)
    t = cmp.table.set_index("variant")
    assert t.loc["fp32", "status"] == "interrupted" and t.loc["fp32", "steps"] == 1
    assert t.loc["bf16", "status"] == "not_run" and "interrupted" in t.loc["bf16", "notes"]
    assert list(cmp.results) == ["fp32"]


def test_misspelt_override_fails_before_any_run(monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("no run may start")

    monkeypatch.setattr("nbtrain.engine.loop._run", no_run)
    with pytest.raises(nbt.ConfigError, match="micro_batch"):
        compare(small_cfg(), variants={"a": dict(micro_batch=2)})
    with pytest.raises(ValueError, match="each precision once"):
        compare(small_cfg(), precisions=("fp32", "fp32"))


def test_repeats_interleave_and_report_medians(monkeypatch):
    import nbtrain.engine.loop as loop

    calls = []
    original = loop._run

    def spy(cfg, callbacks=None, **kw):
        res = original(cfg, callbacks, **kw)
        calls.append((kw.get("variant"), callbacks is not None, res))
        return res

    monkeypatch.setattr(loop, "_run", spy)
    collect = Collect()
    runs = []
    collect.on_run_start = lambda info: runs.append(info.variant)
    cmp = compare(small_cfg(max_steps=2), precisions=("fp32", "bf16"), repeats=2, callbacks=[collect])
    assert [(v, cb) for v, cb, _ in calls] == [("fp32", True), ("bf16", True),     # the recorded pass, untimed
                                                ("fp32", False), ("bf16", False), ("bf16", False),
                                                ("fp32", False)]     # then A B, B A: rotated
    assert cmp.run_order == [["fp32", "bf16"], ["bf16", "fp32"]]
    assert list(cmp.table.order) == ["1, 2", "2, 1"]
    assert runs == ["fp32", "bf16"]           # callbacks see the kept (first) repeat only
    assert {r.variant for r in collect.records} == {"fp32", "bf16"} and len(collect.records) == 4
    for name in ("fp32", "bf16"):
        mine = [res for v, _, res in calls if v == name]
        assert cmp.results[name] is mine[0] and len(mine) == 3   # recorded, then 2 timed
        # the timed repeats only, each without its first step (what a process or precision does once)
        tps = [_tokens_per_s(m, True) for m in mine[1:]]
        walls = [m.summary["wall_s"] for m in mine[1:]]
        r = row(cmp, name)
        assert r.tokens_per_s == pytest.approx(statistics.median(tps))
        assert r.wall_s == pytest.approx(statistics.median(walls))
        assert r.tokens_per_s_spread == pytest.approx(max(tps) - min(tps)) and r.repeats == 2
    assert "medians of 2 interleaved repeats" in cmp.format_table()


def test_live_dashboard_overlays_each_variant(fp_cmp):
    from nbtrain.viz import find_traces

    cmp, dash, collect = fp_cmp
    assert collect.info.variant == "bf16"   # the last on_run_start
    assert list(dash.runs) == ["fp32", "bf16"]
    assert [r.variant for r in collect.records] == ["fp32"] * 3 + ["bf16"] * 3
    colors = set()
    for name in ("fp32", "bf16"):
        traces = find_traces(dash.figure, run=name, panel="loss", kind="loss_ema")
        assert traces and len(traces[0].y) == 3
        colors.add(traces[0].line.color)
    assert len(colors) == 2


def test_figure_and_self_contained_html(fp_cmp, tmp_path):
    from nbtrain.viz.figures import find_traces, iter_runs

    cmp, _, _ = fp_cmp
    fig = cmp.figure()
    assert list(iter_runs(fig)) == ["fp32", "bf16"]
    for panel in ("loss", "loss_diff", "grad_norm", "scale", "memory"):
        assert {t.meta["run"] for t in find_traces(fig, panel=panel)} >= {"fp32", "bf16"}, panel
    bars = find_traces(fig, panel="throughput")[0]
    assert list(bars.x) == ["fp32", "bf16"]
    assert list(bars.y) == pytest.approx(list(cmp.table.tokens_per_s))

    path = cmp.to_html(tmp_path / "report.html")
    doc = path.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\bsrc\s*=", doc, re.I)        # nothing loaded from the network
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?https?:", doc, re.I)
    assert len(doc) > 1_000_000 and "Plotly.newPlot" in doc            # plotly.js is inlined
    for name in ("fp32", "bf16"):
        for panel in ("loss", "loss_diff", "grad_norm", "scale", "memory"):
            assert re.search(r'"meta":\{"run":"%s","panel":"%s"' % (name, panel), doc), (name, panel)
    assert "max_seq_len: 24" in doc and torch.__version__ in doc and cmp.table.init_hash[0] in doc
    assert "fair:" in doc


def test_text_and_notebook_views(fp_cmp):
    cmp, _, _ = fp_cmp
    text = cmp.format_table()
    verdicts, lines = text.splitlines()[:2], text.splitlines()[3:]
    assert verdicts == [cmp.verdicts["fp32"].text, cmp.verdicts["bf16"].text]   # the answers first, then the table
    assert lines[0].split()[:2] == ["variant", "precision_used"]   # status left out: every run completed
    assert lines[1].split()[0] == "fp32" and lines[2].split()[0] == "bf16"
    assert "fair:" in text and "micro_batch" not in lines[0]   # settings all variants share are left out
    assert "fair: every variant started from the same weights and saw the same batches as 'fp32'" in text
    html = cmp._repr_html_()
    assert "<table" in html and "bf16" in html and "fair:" in html
    assert "plotly" not in html.lower()


def test_public_name_is_the_function_after_the_module_is_imported():
    # `import nbtrain.compare` (the CLI does it) binds the submodule as nbtrain.compare; the package must
    # still hand out the function, or `nbt.compare(cfg)` fails with "'module' object is not callable".
    code = ("import inspect, nbtrain.compare, nbtrain as nbt; "
            "assert inspect.isfunction(nbt.compare), nbt.compare; assert nbt.compare.__name__ == 'compare'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_compare_prints_the_table(tmp_path, capsys):
    from nbtrain.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    small_cfg(subset=64).to_yaml(cfg_path)
    html_path = tmp_path / "r.html"
    assert main(["compare", str(cfg_path), "--precisions", "fp32,bf16", "--subset", "24", "--max-steps", "2",
                 "--html", str(html_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("fp32: the reference") and lines[1].startswith("bf16: ")   # the verdicts
    assert [ln.split()[0] for ln in lines[3:6]] == ["variant", "fp32", "bf16"]
    assert f"wrote {html_path}" in out and html_path.stat().st_size > 1_000_000


@pytest.mark.slow
def test_demo_writes_three_row_table_and_report(tmp_path, capsys):
    from nbtrain.cli import main

    report = tmp_path / "demo-report.html"
    assert main(["demo", "--max-steps", "2", "--html", str(report)]) == 0
    out = capsys.readouterr().out
    firsts = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    rows = [w for w in firsts if w in ("fp32", "bf16", "fp16")]
    assert rows[:3] == ["fp32", "bf16", "fp16"]
    assert report.stat().st_size > 1_000_000
    from nbtrain.cli import REAL_MODEL_NOTEBOOK

    last = out.strip().splitlines()[-1]   # it ends by naming the real-model notebook, which is there
    assert REAL_MODEL_NOTEBOOK in last and "smollm2-135m-instruct" in last
    assert (Path(__file__).resolve().parents[1] / REAL_MODEL_NOTEBOOK).is_file()


def test_cli_progress_bar_draws_once_per_step_with_that_steps_loss(capsys):
    """The command line's bar: one redraw per step at most (a piped log gets one line per step, not two), and
    the postfix drawn with a step is that step's loss; skipped steps are flagged."""
    from types import SimpleNamespace

    from nbtrain.cli import ProgressBar

    bar = ProgressBar()
    bar.on_run_start(SimpleNamespace(variant=None, total_steps=50, precision_used="fp16"))
    bar.bar.mininterval = 0   # every step is allowed a redraw: the test counts redraws, not time
    for step in range(1, 51):
        bar.on_step_end(SimpleNamespace(step=step, loss=10.0 - step / 10, tokens_per_s=1000.0, skipped=step == 50,
                                        nonfinite=False))
    bar.on_run_end(None)
    err = capsys.readouterr().err
    draws = [d for d in err.replace("\r", "\n").splitlines() if "step" in d]
    assert len(draws) <= 50 + 2                  # one per step, plus the opening and closing draws
    assert "50/50" in draws[-1] and "loss=5.0000" in draws[-1] and "SKIPPED" in draws[-1]
    assert any("10/50" in d and "loss=9.0000" in d for d in draws)
