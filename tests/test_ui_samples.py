"""Issue 26 in the Panel, without a browser: the data format shown as detected (with the chat template and what the
loss is on, in words), and the sample prompts' answers shown in the run area during and after a Train, and side by
side after a Compare."""

import html
import json

import pytest

import nbtrain as nbt
from nbtrain.ui.panel import Panel

TIMEOUT = 300
PROMPTS = ["What does the with statement do?", "def f("]


def small(**kw):
    base = dict(model="tiny", data="builtin:python-docs-qa", subset=16, max_seq_len=64, micro_batch_size=4,
                max_steps=3, eval_fraction=0.0, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


class Seen:
    """What the Panel's answers block held when each answer arrived (the Panel's callbacks run after its own)."""

    def __init__(self, panel):
        self.panel, self.blocks, self.records = panel, [], []

    def on_sample(self, rec):
        self.records.append(rec)
        self.blocks.append(self.panel.answers.value)


def _answers_at(samples, step):
    rows = samples[samples.step == step]
    return dict(zip(rows.prompt, rows.answer))


def test_train_shows_the_answers_during_and_after_the_run():
    panel = Panel(small(), debounce_s=0)
    seen = Seen(panel)
    panel.callbacks.append(seen)
    panel.controls["sample_prompts"].value = "\n".join(PROMPTS)
    panel.controls["sample_every"].value = "2"
    panel.controls["max_new_tokens"].value = 5
    assert panel.config.sample_prompts == tuple(PROMPTS) or list(panel.config.sample_prompts) == PROMPTS
    assert panel.answers.value == ""
    panel.train_button.click()
    result = panel.wait(TIMEOUT)
    assert result is not None and result is panel.result
    samples = result.samples
    assert sorted(set(samples.step)) == [2, 3] and set(samples.prompt) == set(PROMPTS)
    # during the run: each answer was in the block as it came
    assert len(seen.records) == 4
    for rec, block in zip(seen.records, seen.blocks):
        assert html.escape(rec.answer) in block and html.escape(rec.prompt) in block, block
    assert "step 2" in seen.blocks[1] and "step 3" in seen.blocks[3]
    # after it: the last step's answers, under the figure
    block = panel.answers.value
    assert "answers at step 3" in block
    for prompt, answer in _answers_at(samples, 3).items():
        assert html.escape(prompt) in block
        assert (html.escape(answer) if answer else "(empty)") in block
    assert panel.answers in panel.dashboard_area.children
    # a run without sample prompts shows no answers block
    panel.controls["sample_prompts"].value = ""
    panel.train_button.click()
    assert panel.wait(TIMEOUT) is not None
    assert panel.answers.value == "" and panel.answers not in panel.dashboard_area.children


def test_compare_shows_each_variants_answers_side_by_side():
    panel = Panel(small(max_steps=2, sample_prompts=PROMPTS, max_new_tokens=4), debounce_s=0)
    variants = [p for p in ("fp32", "bf16") if not panel.compare_choices[p].disabled]
    if len(variants) < 2:
        pytest.skip("needs two precisions this machine can run")
    for p, box in panel.compare_choices.items():
        box.value = p in variants
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp is not None and cmp is panel.comparison
    table = cmp.samples_table()
    assert list(table.columns) == variants and list(table.index) == PROMPTS
    shown = panel.comparison_table.value
    assert "answers side by side" in shown
    for v in variants:
        for prompt, answer in _answers_at(cmp.results[v].samples, 2).items():
            assert table.loc[prompt, v] == answer
            assert html.escape(answer) in shown
    assert panel.comparison_table in panel.summary_area.children
    assert panel.answers.value == ""   # not twice: the comparison's table holds them


def test_data_info_names_the_detected_format(tmp_path):
    panel = Panel(small(), debounce_s=0)
    info = panel.data_info
    assert "format: <b>messages</b> (detected from the columns)" in info.value
    assert "chat template: auto → chatml" in info.value and "loss on every assistant answer" in info.value
    panel.controls["train_on"].value = "last"
    assert "loss on the last assistant answer only" in info.value
    panel.controls["chat_template"].value = "llama3"
    assert "chat template: llama3" in info.value

    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Say hi", "input": "", "output": "hi"},
                                  {"instruction": "Say bye", "input": "", "output": "bye"}]))
    panel.controls["data"].value = str(alpaca)
    assert "format: <b>alpaca</b> (detected from the columns)" in info.value
    # the same detection as the run's loader
    assert nbt.TrainConfig(model="tiny", data=str(alpaca)).data_format == "auto"

    lines = tmp_path / "chat.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(3)))
    panel.controls["data"].value = str(lines)
    assert "format: <b>prompt-completion</b>" in info.value

    panel.controls["data"].value = "builtin:python-docs"
    assert "format: <b>plain text</b>" in info.value and "chat template" not in info.value

    # a named format the file does not have: said in red, naming the missing column
    panel.controls["data"].value = str(alpaca)
    panel.controls["data_format"].value = "sharegpt"
    assert "conversations" in info.value and "#c62828" in info.value.split("<br>")[-1]
    panel.controls["data_format"].value = "alpaca"
    assert "format: <b>alpaca</b> (as set)" in info.value

    # a classifier reads no chat formats: no format line
    panel.controls["data"].value = "builtin:python-docs-topics"
    panel.controls["task"].value = "sequence-classification"
    assert "format:" not in info.value
