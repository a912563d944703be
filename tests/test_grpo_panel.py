"""Issue 47, item 6: the Panel's GRPO controls, clicked from code without a browser. The objective choice offers
GRPO; its settings (rewards, generations per prompt, completion length, sampling, KL weight, loss averaging, the
sampler's precision, the mismatch correction) are on a GRPO tab and shown while GRPO is the objective; they build
a valid TrainConfig, and a bad value is said under its field. Choosing GRPO on a builtin made for another objective
moves Data to the builtin of prompts, and leaving GRPO puts it back."""

import html

import pytest

from nbtrain.config import ConfigError, TrainConfig
from nbtrain.data import BUILTINS

ipywidgets = pytest.importorskip("ipywidgets")

from nbtrain.ui.controls import (REWARD_EXAMPLES, SAMPLER_AS_TRAINING, Choice,  # noqa: E402 (after the importorskip)
                                 decode_weights, reward_codec, split_rewards)
from nbtrain.ui.form import (ANSWER_LABEL_GRPO, OBJECTIVE_HINTS, PROMPT_BUILTIN, SECTIONS,  # noqa: E402
                             grpo_step_words, missing_prompts, reward_words)
from nbtrain.ui.panel import Panel  # noqa: E402

from .test_ui_readable import cut_texts  # noqa: E402

HAVE_PROMPTS = PROMPT_BUILTIN[len("builtin:"):] in BUILTINS
needs_prompts = pytest.mark.skipif(not HAVE_PROMPTS, reason=f"{PROMPT_BUILTIN} is not a builtin here yet")
GRPO_FIELDS = SECTIONS["GRPO"]
SMALL = {"model": "tiny", "subset": 8, "max_seq_len": 48, "micro_batch_size": 4, "eval_fraction": 0.0,
         "precision": "fp32", "lr": 1e-3, "max_steps": 2}


def grpo(**kw) -> TrainConfig:
    data = PROMPT_BUILTIN if HAVE_PROMPTS else "builtin:python-docs"
    return TrainConfig(**{**SMALL, "data": data, "objective": "grpo", "reward": "length:16", **kw})


def long_answers(prompts, completions, **columns):
    """A reward a config can name by 'module:function' (importable from this test module)."""
    return [float(len(c)) for c in completions]


def shown(panel, field) -> bool:
    return panel.form.rows[field].layout.display != "none"


def click(choice: Choice, option: str) -> None:
    choice.buttons[option].value = True   # what a click on the toggle button does in the browser


def field_errors(panel) -> dict:
    """field -> message of the config's errors now (validate: the memory estimate's own marks left out)."""
    return {e["field"]: e["message"] for e in panel.form.validate()[1]}


def walk(w):
    yield w
    for child in getattr(w, "children", ()) or ():
        yield from walk(child)


def page(panel, title):
    return panel.tabs.children[panel.tabs.titles.index(title)]


# -- the controls -----------------------------------------------------------------------------------------------------
def test_the_objective_offers_grpo_and_a_tab_holds_its_settings():
    panel = Panel(debounce_s=0)
    picker = panel.controls["objective"]
    assert "grpo" in picker.options and picker.buttons["grpo"].description == "GRPO"
    assert picker.buttons["grpo"].tooltip == OBJECTIVE_HINTS["grpo"] and not picker.buttons["grpo"].disabled
    titles = panel.tabs.titles
    assert titles.index("GRPO") == titles.index("Objective") + 1
    assert GRPO_FIELDS == ("reward", "reward_weights", "num_generations", "temperature", "top_p", "grpo_beta",
                           "grpo_loss", "grpo_epsilon", "grpo_iterations", "sampler_precision", "is_correction",
                           "is_cap")
    grpo_page = list(walk(page(panel, "GRPO")))
    for f in GRPO_FIELDS:
        assert panel.form.rows[f] in grpo_page, f
        assert panel.form.section(f) == "GRPO"
    # the reward box offers each built-in kind, and says what goes there
    box = panel.controls["reward"]
    assert isinstance(box, ipywidgets.Combobox) and list(box.options) == REWARD_EXAMPLES
    assert not box.ensure_option   # any name may be typed
    assert "format:REGEX" in box.placeholder and "length:N" in panel.form.help["reward"].value
    assert dict(panel.controls["grpo_loss"].options) == {"dapo: all tokens": "dapo", "grpo: per completion": "grpo",
                                                         "dr_grpo: fixed length": "dr_grpo"}
    sampler = panel.controls["sampler_precision"]
    assert isinstance(sampler, Choice) and sampler.value == SAMPLER_AS_TRAINING
    assert sampler.buttons[SAMPLER_AS_TRAINING].description == "as training"
    assert "prompt" in dict(panel.controls["data_format"].options).values()


def test_grpo_settings_show_only_while_grpo_is_the_objective():
    panel = Panel(grpo(), debounce_s=0)
    assert all(shown(panel, f) for f in GRPO_FIELDS)
    assert "completions a step" in html.unescape(panel.grpo_info.value)
    for objective in ("lm", "dpo", "orpo", "simpo"):
        panel.controls["reward"].value = ""   # a reward off grpo is an error (and keeps its row): cleared here
        click(panel.controls["objective"], objective)
        assert not any(shown(panel, f) for f in GRPO_FIELDS), objective
        assert "choose it on the Objective tab" in panel.grpo_info.value
        # and GRPO's settings never show a preference objective's beta
        click(panel.controls["objective"], "grpo")
        assert all(shown(panel, f) for f in GRPO_FIELDS) and not shown(panel, "pref_beta")
        panel.controls["reward"].value = "length:16"


def test_the_completion_length_moves_to_the_grpo_tab_under_its_grpo_label():
    panel = Panel(debounce_s=0)
    row, box = panel.form.rows["max_new_tokens"], panel.controls["max_new_tokens"]
    answer_label = box.description
    assert row in list(walk(page(panel, "Training"))) and row not in list(walk(page(panel, "GRPO")))
    click(panel.controls["objective"], "grpo")
    # in one place at a time: its error line is never shown twice
    assert row in list(walk(page(panel, "GRPO"))) and row not in list(walk(page(panel, "Training")))
    assert box.description == ANSWER_LABEL_GRPO and panel.form.section("max_new_tokens") == "GRPO"
    box.value = "abc"
    assert "must be a whole number" in panel.form.field_errors["max_new_tokens"].value
    assert ANSWER_LABEL_GRPO in panel.form.field_errors["max_new_tokens"].value
    panel.train_button.click()
    assert panel.run is None and panel.tabs.titles[panel.tabs.selected_index] == "GRPO"
    box.value = "32"
    click(panel.controls["objective"], "lm")
    assert row in list(walk(page(panel, "Training"))) and box.description == answer_label
    assert panel.form.section("max_new_tokens") == "Training"


def test_the_grpo_tab_reads_in_a_968px_output():
    panel = Panel(grpo(), debounce_s=0)
    assert cut_texts(panel) == []
    for f in GRPO_FIELDS:
        tip = panel.controls[f].label.tooltip if isinstance(panel.controls[f], Choice) else panel.controls[f].tooltip
        assert tip, f


# -- values into the config and back ----------------------------------------------------------------------------------
GRPO_CHANGES = {
    "reward": ("length:32 + exact", ["length:32", "exact"]),
    "reward_weights": ("", None),
    "num_generations": ("2", 2),
    "temperature": ("0.7", 0.7),
    "top_p": ("0.9", 0.9),
    "grpo_beta": ("0.04", 0.04),
    "grpo_loss": ("dr_grpo", "dr_grpo"),
    "grpo_epsilon": ("0.3", 0.3),
    "grpo_iterations": ("2", 2),
    "sampler_precision": ("bf16", "bf16"),
    "is_correction": ("token_truncate", "token_truncate"),
    "is_cap": ("3", 3.0),
    "max_new_tokens": ("24", 24),
}


@pytest.mark.parametrize("field", list(GRPO_CHANGES))
def test_setting_a_grpo_control_changes_that_field_only(field):
    base = grpo(reward_weights=[2.0]) if field == "reward_weights" else grpo()
    panel = Panel(base, debounce_s=0)
    value, expected = GRPO_CHANGES[field]
    panel.controls[field].value = value
    assert field_errors(panel) == {}
    cfg = panel.config
    assert getattr(cfg, field) == expected
    assert {k: v for k, v in cfg.to_dict().items() if k != field} == \
        {k: v for k, v in base.to_dict().items() if k != field}


def test_every_grpo_value_flows_into_the_config_and_the_saved_yaml(tmp_path):
    panel = Panel(debounce_s=0)
    c = panel.controls
    click(c["objective"], "grpo")
    c["reward"].value = "format:^[0-9]+$ + exact"
    c["reward_weights"].value = "0.5, 1"
    c["num_generations"].value = "8"
    c["micro_batch_size"].value = "4"
    c["grad_accum_steps"].value = "2"
    c["max_new_tokens"].value = "16"
    c["temperature"].value = "0.8"
    c["grpo_beta"].value = "0.04"
    c["grpo_loss"].value = "grpo"
    click(c["sampler_precision"], "bf16")
    c["data"].value = PROMPT_BUILTIN
    cfg = panel.config
    assert (cfg.objective, cfg.reward, cfg.reward_weights) == ("grpo", ["format:^[0-9]+$", "exact"], [0.5, 1.0])
    assert (cfg.num_generations, cfg.micro_batch_size * cfg.grad_accum_steps, cfg.max_new_tokens) == (8, 8, 16)
    assert (cfg.temperature, cfg.grpo_beta, cfg.grpo_loss, cfg.sampler_precision) == (0.8, 0.04, "grpo", "bf16")
    words = html.unescape(panel.grpo_info.value)
    assert "8 completions a step = 1 prompts × 8 generations" in words
    assert "KL to the initial model: a frozen copy" in words and "sampled in bf16" in words
    assert "1 where the completion matches ^[0-9]+$ + 1 where the completion equals the data's answer" in words
    panel.yaml_path.value = str(tmp_path / "grpo.yaml")
    panel.save_button.click()
    saved = TrainConfig.from_yaml(tmp_path / "grpo.yaml")
    assert saved == cfg
    # "as training" is None again
    click(c["sampler_precision"], SAMPLER_AS_TRAINING)
    assert panel.config.sampler_precision is None and "sampled in the training precision" in panel.grpo_info.value


@pytest.mark.parametrize("cfg", [
    grpo(),
    grpo(reward=["length:32", "format:^a{1,3}$"], reward_weights=[1.0, 0.25], num_generations=2, top_p=0.95),
    grpo(reward=["format:a + b"], grpo_beta=0.1, method="lora", sampler_precision="bf16"),
    grpo(reward="format:x,exact", is_correction="token_truncate", is_cap=4.0, grpo_iterations=3),
    grpo(reward=[long_answers, "exact"], grpo_loss="grpo", temperature=0.5, max_new_tokens=12),
], ids=["defaults", "weights", "plus-in-regex", "comma-in-regex", "function"])
def test_a_grpo_config_shown_in_the_panel_sets_the_controls_back(cfg, tmp_path):
    panel = Panel(cfg, debounce_s=0)
    assert field_errors(panel) == {} and panel.config == cfg
    assert panel.controls["objective"].buttons["grpo"].value and all(shown(panel, f) for f in GRPO_FIELDS)
    # a function stays the same function, shown by the name a config file would give it
    if callable(cfg.reward[0]):
        assert panel.config.reward[0] is long_answers
        assert "test_grpo_panel:long_answers" in panel.controls["reward"].value
        return
    cfg.to_yaml(tmp_path / "c.yaml")
    other = Panel(debounce_s=0)
    assert other.load_yaml(tmp_path / "c.yaml") == cfg and other.config == cfg


def test_a_notebook_function_reward_stays_a_function():
    def mine(prompts, completions, **columns):
        return [0.0] * len(completions)

    panel = Panel(grpo(reward=mine), debounce_s=0)
    assert panel.config.reward == [mine] and "(not importable)" in panel.controls["reward"].value
    panel.controls["temperature"].value = "0.5"      # another change keeps it
    assert panel.config.reward == [mine]
    panel.controls["reward"].value = "length:8"       # replaced by a name: the name
    assert panel.config.reward == ["length:8"]


# -- errors under their fields ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup,field,needle", [
    (dict(reward=""), "reward", "needs one or more reward functions"),
    (dict(reward="length:abc"), "reward", "length:N takes a whole number"),
    (dict(reward="format:(unclosed"), "reward", "not a regular expression"),
    (dict(reward="nonsense"), "reward", "unknown"),
    (dict(reward_weights="1, 2"), "reward_weights", "one weight per reward"),
    (dict(reward_weights="heavy"), "reward_weights", "numbers separated by commas"),
    (dict(num_generations="3"), "num_generations", "whole groups"),
    (dict(num_generations="1"), "num_generations", "greater than or equal to 2"),
    (dict(num_generations="four"), "num_generations", "whole number"),
    (dict(temperature="0"), "temperature", "greater than 0"),
    (dict(temperature="warm"), "temperature", "must be a number"),
    (dict(top_p="1.5"), "top_p", "less than or equal to 1"),
    (dict(grpo_beta="-1"), "grpo_beta", "greater than or equal to 0"),
    (dict(max_new_tokens="0"), "max_new_tokens", "greater than or equal to 1"),
    (dict(data_format="preference"), "data_format", "reads prompts"),
    (dict(packing=True), "packing", "not with objective='grpo'"),
    (dict(sample_prompts="What is 2 + 2?"), "sample_prompts", "leave sample_prompts empty"),
])
def test_an_invalid_grpo_value_is_said_under_its_field(setup, field, needle):
    panel = Panel(grpo(), debounce_s=0)
    for name, value in setup.items():
        panel.controls[name].value = value
    assert field in field_errors(panel), field_errors(panel)
    line = html.unescape(panel.form.field_errors[field].value)
    assert needle in line and panel.form.label(field) in line      # named by the label it shows
    assert panel.controls[field].layout.border
    with pytest.raises(ConfigError):
        _ = panel.config
    panel.train_button.click()
    assert panel.run is None and "not started" in panel.status.value
    assert html.escape(panel.form.label(field)) in panel.status.value
    assert panel.tabs.titles[panel.tabs.selected_index] == panel.form.section(field)


def test_a_sampler_precision_this_machine_cannot_run_is_greyed_and_an_error():
    panel = Panel(grpo(), debounce_s=0)
    reasons = panel.caps.reasons
    sampler = panel.controls["sampler_precision"]
    for p, button in sampler.buttons.items():
        assert button.disabled == (p in reasons), p
    bad = next((p for p in sampler.options if p in reasons), None)
    if bad is None:
        pytest.skip("this machine runs every precision")
    sampler.value = bad   # from code: the button cannot be clicked
    assert "cannot run on this" in field_errors(panel)["sampler_precision"]


def test_a_reward_left_under_another_objective_stays_shown_to_clear():
    panel = Panel(grpo(), debounce_s=0)
    click(panel.controls["objective"], "lm")
    assert "for objective='grpo'" in field_errors(panel)["reward"]
    assert shown(panel, "reward") and not shown(panel, "num_generations")
    panel.controls["reward"].value = ""
    assert "reward" not in field_errors(panel) and not shown(panel, "reward")


# -- the data ---------------------------------------------------------------------------------------------------------
@needs_prompts
def test_choosing_grpo_moves_a_builtin_to_the_prompts_and_leaving_puts_it_back():
    panel = Panel(debounce_s=0)
    data = panel.controls["data"]
    before = data.value
    assert before.startswith("builtin:") and before != PROMPT_BUILTIN
    click(panel.controls["objective"], "grpo")
    assert data.value == PROMPT_BUILTIN
    for where in (panel.objective_info, panel.grpo_info):
        assert f"Data set to {PROMPT_BUILTIN} for GRPO (was {before})" in html.unescape(where.value)
    assert "prompt" in panel.data_info.value and "sums of two numbers" in panel.data_info.value
    panel.controls["reward"].value = "exact"
    assert field_errors(panel) == {} and panel.config.data == PROMPT_BUILTIN
    assert panel.prompt_data_button.layout.display == "none"
    click(panel.controls["objective"], "lm")
    assert data.value == before and "set back" in panel.objective_info.value


@needs_prompts
def test_data_the_user_chose_is_never_moved():
    panel = Panel(debounce_s=0)
    data = panel.controls["data"]
    data.value = "someorg/somedata"    # a dataset id: theirs
    click(panel.controls["objective"], "grpo")
    assert data.value == "someorg/somedata" and not panel.form.data_moved
    click(panel.controls["objective"], "lm")
    # moved, then edited: the edit stays when grpo is left
    data.value = "builtin:python-docs"
    click(panel.controls["objective"], "grpo")
    data.value = "builtin:python-docs-qa"
    assert not panel.form.data_moved and "Data set" not in panel.objective_info.value
    # a builtin without prompts under grpo: flagged, with one click to the prompts
    assert "holds no prompts" in html.unescape(panel.objective_info.value)
    button = panel.prompt_data_button
    assert button.layout.display != "none" and PROMPT_BUILTIN in button.description
    button.click()
    assert data.value == PROMPT_BUILTIN and button.layout.display == "none"
    click(panel.controls["objective"], "lm")
    assert data.value == PROMPT_BUILTIN   # chosen by the user: it stays (lm flags it under Data)


@needs_prompts
def test_a_config_shown_with_grpo_keeps_its_data():
    cfg = grpo(data=PROMPT_BUILTIN)
    panel = Panel(TrainConfig(), debounce_s=0)
    panel.config = cfg
    assert panel.controls["data"].value == PROMPT_BUILTIN and not panel.form.data_moved


# -- pieces -----------------------------------------------------------------------------------------------------------
def test_reward_names_split_on_plus_and_on_commas_that_separate_names():
    assert split_rewards("length:32 + exact") == ["length:32", "exact"]
    assert split_rewards("length:32, exact") == ["length:32", "exact"]
    assert split_rewards("format:^a{1,3}$") == ["format:^a{1,3}$"]      # a comma inside a regex
    assert split_rewards("format:^[0-9]+$") == ["format:^[0-9]+$"]      # a plus inside a regex
    assert split_rewards('["format:a + b", "exact"]') == ["format:a + b", "exact"]
    assert split_rewards("  ") == []
    codec = reward_codec()
    for v in (None, ["length:32"], ["length:32", "exact"], ["format:x,exact"], ["format:a + b", "exact"],
              [long_answers]):
        assert codec.decode(codec.encode(v)) == v, v
    assert decode_weights("") is None and decode_weights("1, 0.5") == [1.0, 0.5]
    with pytest.raises(ValueError, match="numbers separated by commas"):
        decode_weights("1, x")


def test_the_words_for_rewards_and_a_step():
    assert reward_words(["length:32", "contains"]) == ("closeness to 32 completion tokens + 1 where the completion "
                                                       "contains the data's answer")
    assert reward_words(["length:x"]) == "" and reward_words(None) == ""
    assert grpo_step_words(4, 2, 4, 0.0, "full", None) == ("8 completions a step = 2 prompts × 4 generations · no "
                                                          "reference model (KL weight β 0) · sampled in the training "
                                                          "precision")
    assert "adapters off" in grpo_step_words(4, 1, 2, 0.1, "lora", "fp16")
    assert "not whole groups" in grpo_step_words(3, 1, 2, 0.0, "full", None)
    assert missing_prompts("lm", "builtin:python-docs") == ""
    assert "holds no prompts" in missing_prompts("grpo", "builtin:python-docs")
    assert "holds no prompts" in missing_prompts("grpo", "builtin:python-docs-pref")   # pairs are not prompts
    assert missing_prompts("grpo", "my/file.jsonl") == ""
    if HAVE_PROMPTS:
        assert missing_prompts("grpo", PROMPT_BUILTIN) == ""


# -- a run ------------------------------------------------------------------------------------------------------------
@needs_prompts
def test_train_runs_the_grpo_the_panel_shows():
    from .test_ui import wait_for

    panel = Panel(TrainConfig(**SMALL), debounce_s=0)
    click(panel.controls["objective"], "grpo")
    c = panel.controls
    c["reward"].value = "length:4"
    c["max_new_tokens"].value = "6"
    c["max_steps"].value = "1"
    c["temperature"].value = "0.9"
    assert field_errors(panel) == {}
    panel.train_button.click()
    wait_for(lambda: panel.result is not None and not panel.runner.busy(), 240, "the run to finish")
    result = panel.result
    assert (result.config.objective, result.config.reward, result.config.temperature) == ("grpo", ["length:4"], 0.9)
    row = result.history.iloc[-1]
    assert row["reward_mean"] == row["reward_mean"] and row["completion_len_mean"] <= 6
    # the Panel's live figure drew the run's GRPO panels
    drawn = {tr.meta["panel"] for tr in panel.dashboard.figure.data if isinstance(tr.meta, dict)}
    assert {"reward", "completion_len", "clip_ratio", "mismatch"} <= drawn
