"""Samples you can read (issue 26): greedy answers to sample prompts at sample_every steps and at the end,
on_sample, result.samples, result.generate, the step timer and the RNG untouched, the dashboard and compare()."""

import copy
import html
import time

import pytest
import torch

import nbtrain as nbt
from nbtrain.engine import sampling
from nbtrain.engine.records import SAMPLE_FIELDS, SampleRecord

PROMPTS = ["What does the with statement do?", "def f("]


def cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=32, micro_batch_size=4,
                max_steps=5, eval_fraction=0.0, precision="fp32", lr=1e-4, sample_prompts=PROMPTS,
                sample_every=2, max_new_tokens=6)
    return nbt.TrainConfig(**{**base, **kw})


class Samples:
    """Keeps on_sample's records, and a copy of the weights at each step's end (before that step's samples)."""

    def __init__(self):
        self.got, self.weights, self.model, self.modes = [], {}, None, {}

    def on_run_start(self, info):
        self.model = info.model

    def on_step_end(self, rec):
        self.weights[rec.step] = copy.deepcopy(self.model.state_dict())
        self.modes[rec.step] = self.model.training

    def on_sample(self, rec):
        self.got.append(rec)


def independent_answer(model, tokenizer, prompt, max_new_tokens):
    """Greedy decoding written out: the whole sequence through the forward each time, argmax, stop at EOS."""
    ids = tokenizer(prompt, add_special_tokens=True).input_ids
    new = []
    model.eval()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + new])).logits
            new.append(int(logits[0, -1].argmax()))
            if new[-1] == tokenizer.eos_token_id:
                break
    text = new[:-1] if new and new[-1] == tokenizer.eos_token_id else new
    return tokenizer.decode(text, skip_special_tokens=True).strip(), len(new)


@pytest.fixture(scope="module")
def sampled():
    cb = Samples()
    return nbt.train(cfg(), callbacks=[cb]), cb


def test_samples_at_sample_every_steps_and_the_end(sampled):
    res, cb = sampled
    df = res.samples
    assert list(df.columns)[:3] == ["step", "prompt", "answer"] and tuple(df.columns) == SAMPLE_FIELDS
    assert sorted(set(df.step)) == [2, 4, 5]
    assert all(list(df[df.step == s].prompt) == PROMPTS for s in (2, 4, 5))
    assert (df.new_tokens >= 1).all() and (df.new_tokens <= 6).all() and (df.seconds > 0).all()
    # on_sample got the same records, in order, and they are result.sample_records
    assert all(isinstance(r, SampleRecord) for r in cb.got)
    assert [r.to_dict() for r in cb.got] == df.to_dict("records") == [r.to_dict() for r in res.sample_records]
    # the model was back in train mode for the step after each sampling
    assert cb.modes[3] and cb.modes[5]
    assert res.summary["sample_s"] >= df.seconds.sum() > 0


def test_sample_every_dividing_max_steps_samples_the_last_step_once():
    res = nbt.train(cfg(max_steps=4, max_new_tokens=2))
    assert list(res.samples.step) == [2, 2, 4, 4]


def test_answers_equal_an_independent_greedy_loop(sampled):
    res, cb = sampled
    tok = res.tokenizer
    model = copy.deepcopy(res.model)
    for step in (2, 4, 5):
        model.load_state_dict(cb.weights[step])
        for rec in res.samples[res.samples.step == step].itertuples():
            assert (rec.answer, rec.new_tokens) == independent_answer(model, tok, rec.prompt, 6), (step, rec)
    # and the answers did change while the model trained (not one constant string)
    assert res.samples.answer.nunique() > 1


def test_generate_after_training(sampled):
    res, _ = sampled
    model = copy.deepcopy(res.model)
    for p in PROMPTS:
        assert res.generate(p) == res.samples[(res.samples.step == 5) & (res.samples.prompt == p)].answer.item()
        assert res.generate(p, max_new_tokens=3) == independent_answer(model, res.tokenizer, p, 3)[0]
    res.model.train()
    res.generate(PROMPTS[0], max_new_tokens=1)
    assert res.model.training   # generate() puts the mode back
    with pytest.raises(ValueError, match="max_new_tokens"):
        res.generate(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt"):
        res.generate("  ")


def test_without_prompts_nothing_is_sampled(tiny_cfg):
    res = nbt.train(tiny_cfg.replace(max_steps=2))
    assert res.samples.empty and tuple(res.samples.columns) == SAMPLE_FIELDS
    assert "sample_s" not in res.summary


def chat_cfg(**kw):
    return cfg(data="builtin:python-docs-qa", max_seq_len=64, max_steps=3, **kw)


def test_sampling_leaves_losses_and_the_callers_rng_alone():
    # chat data: the template's tokens are added with or without prompts, so the two runs' models are alike
    torch.manual_seed(123)
    before = torch.get_rng_state()
    plain = nbt.train(chat_cfg(sample_prompts=[]))
    sampled = nbt.train(chat_cfg())
    again = nbt.train(chat_cfg())
    assert torch.equal(torch.get_rng_state(), before)
    assert plain.history.loss.tolist() == sampled.history.loss.tolist() == again.history.loss.tolist()
    assert len(sampled.samples) == 4 and again.samples.answer.tolist() == sampled.samples.answer.tolist()
    assert plain.chat and sampled.chat   # generate() applies the template after a run without prompts too


def test_chat_prompts_get_the_template_and_stop_at_its_end_token(monkeypatch):
    from nbtrain.data.chat import prompt_ids

    res = nbt.train(chat_cfg(max_new_tokens=12, sample_prompts=PROMPTS[:1]))
    tok = res.tokenizer
    ids = prompt_ids(tok, res.config, PROMPTS[0])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert sampling.encode_prompt(tok, res.config, PROMPTS[0], chat=True) == ids
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in sampling.stop_ids(tok, res.model)
    # the independent loop on the templated prompt
    model = copy.deepcopy(res.model).eval()
    new = []
    with torch.no_grad():
        for _ in range(12):
            new.append(int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax()))
            if new[-1] in (end, tok.eos_token_id):
                break
    text = tok.decode(new[:-1] if new[-1] in (end, tok.eos_token_id) else new, skip_special_tokens=True).strip()
    last = res.samples.iloc[-1]
    assert (last.answer, last.new_tokens) == (text, len(new))
    assert res.generate(PROMPTS[0]) == text
    # an answer stops at the template's end token: force it as the second token
    orig = model.forward

    def forced(*a, **k):
        out = orig(*a, **k)
        out.logits[..., end] = 1e9 if forced.calls == 1 else out.logits[..., end]
        forced.calls += 1
        return out

    forced.calls = 0
    monkeypatch.setattr(model, "forward", forced)
    answer, n = sampling.generate(model, tok, res.config, PROMPTS[0], chat=True)
    assert n == 2 and "<|im_end|>" not in answer


def test_sampling_time_is_in_no_step_and_not_in_tokens_per_s(monkeypatch):
    slow = 0.3
    original = sampling.greedy

    def slow_greedy(*args, **kwargs):
        time.sleep(slow)
        return original(*args, **kwargs)

    monkeypatch.setattr(sampling, "greedy", slow_greedy)
    res = nbt.train(cfg(sample_prompts=PROMPTS[:1], max_new_tokens=2))
    h = res.history
    assert len(res.samples) == 3
    # Between two steps' ends the clock ran elapsed_s's difference; step_time_s must hold all of it but the
    # samples taken in between (after steps 2 and 4): exact bookkeeping, whatever the machine's load.
    gap = (h.elapsed_s.diff() - h.step_time_s).tolist()[1:]   # gap[i]: between steps i+1 and i+2
    assert gap[1] >= slow and gap[3] >= slow, gap
    assert abs(gap[0]) < 0.05 and abs(gap[2]) < 0.05, gap
    assert res.summary["sample_s"] >= 3 * slow
    assert res.summary["wall_s"] >= res.summary["sample_s"] + h.step_time_s.sum() * 0.99
    # tokens/s counts the training time only: the input tokens over wall time less sampling time
    tokens = (h.tokens_per_s * h.step_time_s).sum()
    train_s = res.summary["wall_s"] - res.summary["sample_s"]
    assert res.summary["tokens_per_s"] == pytest.approx(tokens / train_s, rel=1e-6)


def test_the_dashboard_shows_the_latest_answers(monkeypatch, capsys):
    from nbtrain.viz.dashboard import LiveDashboard

    from .test_ui_trust import _fake_display

    shown = _fake_display(monkeypatch)
    dash = LiveDashboard(mode="html")
    res = nbt.train(cfg(max_steps=3, max_new_tokens=3), callbacks=[dash])
    assert [r.to_dict() for r in dash.samples] == res.samples.to_dict("records")
    assert len(shown) == 3   # status, figure, and the answers' block under them
    block = shown[2].last["text/html"]
    last = res.samples[res.samples.step == 3]
    assert "latest answers at step 3" in block
    for a in last.answer:
        assert html.escape(a) in block
    # text mode prints each answer as it comes
    text = LiveDashboard(mode="text")
    nbt.train(cfg(max_steps=2, max_new_tokens=2, sample_every=None), callbacks=[text])
    err = capsys.readouterr().err
    assert f"step 2 · {PROMPTS[0]!r} ->" in err and f"{PROMPTS[1]!r} ->" in err


def test_compare_shows_answers_side_by_side(tmp_path):
    cmp = nbt.compare(cfg(max_steps=3, max_new_tokens=4), precisions=("fp32", "bf16"), warmup=False)
    df = cmp.samples
    assert set(df.variant) == {"fp32", "bf16"} and sorted(set(df.step)) == [2, 3]
    table = cmp.samples_table()
    assert list(table.columns) == ["fp32", "bf16"] and list(table.index) == PROMPTS
    assert table.attrs["steps"] == {"fp32": 3, "bf16": 3}
    for v in ("fp32", "bf16"):
        mine = cmp.results[v].samples
        for p in PROMPTS:
            assert table.loc[p, v] == mine[(mine.step == 3) & (mine.prompt == p)].answer.item()
        # compare keeps models: generate works on its results
        assert cmp.results[v].generate(PROMPTS[0], max_new_tokens=4) == table.loc[PROMPTS[0], v]
    summary = cmp.summary_html()
    assert "answers side by side at step 3" in summary and cmp._repr_html_() == cmp.summary_html(details=True)
    report = cmp.to_html(tmp_path / "report.html").read_text()
    for a in df.answer:
        assert html.escape(a) in summary or df[df.answer == a].step.iloc[0] != 3
        assert html.escape(a) in report
    assert "Sample answers" in report


def test_side_by_side_picks_the_last_common_step():
    recs = [SampleRecord(s, p, f"{v}{s}{p}", 1, 0.1, v) for v, steps in (("a", (2, 4, 5)), ("b", (2, 4)))
            for s in steps for p in ("x", "y")]
    t = sampling.side_by_side(sampling.sample_frame(recs))
    assert t.attrs["steps"] == {"a": 4, "b": 4} and t.loc["x", "a"] == "a4x" and t.loc["y", "b"] == "b4y"
    live = sampling.side_by_side(sampling.sample_frame(recs), own_last=True)
    assert live.attrs["steps"] == {"a": 5, "b": 4} and live.loc["x", "a"] == "a5x"
    assert sampling.side_by_side(sampling.sample_frame([])).empty
