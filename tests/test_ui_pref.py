"""The Panel's preference-tuning controls (issue 38), clicked from code without a browser: the Objective tab (lm /
dpo / orpo / simpo, beta labelled as ORPO's lambda under orpo, gamma under simpo, precompute_ref under dpo), the
values into and out of the TrainConfig, the config's errors under their fields, a builtin without preference pairs
flagged with a one-click fix, and the memory readout's reference copy."""

import html

import pytest

from nbtrain.config import OBJECTIVES, ConfigError, TrainConfig

ipywidgets = pytest.importorskip("ipywidgets")

from nbtrain.ui.controls import BETA_LABEL, ORPO_LAMBDA_LABEL, Choice  # noqa: E402 (after the importorskip)
from nbtrain.ui.form import OBJECTIVE_HINTS, PREF_BUILTIN  # noqa: E402
from nbtrain.ui.panel import SECTIONS, Panel  # noqa: E402

from .test_ui import wait_for  # noqa: E402

PREF = {"model": "tiny", "data": PREF_BUILTIN, "subset": 8, "max_seq_len": 48, "micro_batch_size": 2,
        "eval_fraction": 0.0, "precision": "fp32", "lr": 1e-3, "max_steps": 2}


def pref(**kw) -> TrainConfig:
    return TrainConfig(**{**PREF, "objective": "dpo", **kw})




def shown(panel, field) -> bool:
    return panel.form.rows[field].layout.display != "none"


def click(choice: Choice, option: str) -> None:
    choice.buttons[option].value = True   # what a click on the toggle button does in the browser


# -- the controls ---------------------------------------------------------------------------------------------------
def test_the_objective_tab_holds_the_controls_with_their_explanations():
    panel = Panel(debounce_s=0)
    assert SECTIONS["Objective"] == ("objective", "pref_beta", "simpo_gamma", "precompute_ref")
    assert "Objective" in panel.tabs.titles
    picker = panel.controls["objective"]
    assert isinstance(picker, Choice) and picker.options == OBJECTIVES and picker.value == "lm"
    for name in OBJECTIVES:
        assert picker.buttons[name].tooltip == OBJECTIVE_HINTS[name] and not picker.buttons[name].disabled
    assert "next-token" in panel.objective_info.value
    # the data dropdown lists the builtin with pairs, and the format dropdown the preference format
    assert PREF_BUILTIN in panel.controls["data"].options
    assert "preference" in dict(panel.controls["data_format"].options).values()


@pytest.mark.parametrize("objective,beta_label,gamma,precompute", [
    ("lm", None, False, False),
    ("dpo", BETA_LABEL, False, True),
    ("orpo", ORPO_LAMBDA_LABEL, False, False),
    ("simpo", BETA_LABEL, True, False),
])
def test_each_field_shows_only_where_it_applies(objective, beta_label, gamma, precompute):
    panel = Panel(pref(), debounce_s=0)
    click(panel.controls["objective"], objective)
    assert shown(panel, "pref_beta") == (beta_label is not None)
    if beta_label:
        assert panel.controls["pref_beta"].description == beta_label
    assert shown(panel, "simpo_gamma") == gamma
    assert shown(panel, "precompute_ref") == precompute
    assert f"<b>{objective}</b>" in panel.objective_info.value


def test_the_beta_label_follows_the_objective_back_and_forth():
    panel = Panel(pref(), debounce_s=0)
    beta = panel.controls["pref_beta"]
    click(panel.controls["objective"], "orpo")
    assert beta.description == ORPO_LAMBDA_LABEL and "λ" in beta.description and "ORPO" in beta.description
    click(panel.controls["objective"], "dpo")
    assert beta.description == BETA_LABEL and "β" in beta.description


# -- values into the config and back --------------------------------------------------------------------------------
def test_values_flow_into_the_config_and_the_saved_yaml(tmp_path):
    panel = Panel(pref(), debounce_s=0)
    c = panel.controls
    click(c["objective"], "simpo")
    c["pref_beta"].value = "2.5"
    c["simpo_gamma"].value = "1.25"
    cfg = panel.config
    assert (cfg.objective, cfg.pref_beta, cfg.simpo_gamma, cfg.precompute_ref) == ("simpo", 2.5, 1.25, False)
    click(c["objective"], "dpo")
    c["precompute_ref"].value = True
    assert (panel.config.objective, panel.config.precompute_ref) == ("dpo", True)
    panel.yaml_path.value = str(tmp_path / "pref.yaml")
    panel.save_button.click()
    saved = TrainConfig.from_yaml(tmp_path / "pref.yaml")
    assert saved == panel.config and (saved.objective, saved.pref_beta, saved.precompute_ref) == ("dpo", 2.5, True)


@pytest.mark.parametrize("cfg", [
    pref(pref_beta=0.3, precompute_ref=True),
    pref(method="lora", lora_r=4),
    pref(objective="orpo", pref_beta=0.25),
    pref(objective="simpo", pref_beta=2.0, simpo_gamma=0.8),
    pref(data_format="preference"),
], ids=lambda c: f"{c.objective}-{c.method}-{c.precompute_ref}-{c.data_format}")
def test_a_config_shown_in_the_panel_sets_the_controls_back(cfg, tmp_path):
    panel = Panel(cfg, debounce_s=0)
    assert panel.config == cfg and panel.errors == []
    c = panel.controls
    assert c["objective"].value == cfg.objective and c["objective"].buttons[cfg.objective].value
    assert float(c["pref_beta"].value) == cfg.pref_beta and float(c["simpo_gamma"].value) == cfg.simpo_gamma
    assert c["precompute_ref"].value == cfg.precompute_ref
    # and through a YAML file into a panel that showed something else
    cfg.to_yaml(tmp_path / "c.yaml")
    other = Panel(debounce_s=0)
    assert other.load_yaml(tmp_path / "c.yaml") == cfg and other.config == cfg
    assert shown(other, "pref_beta") and shown(other, "simpo_gamma") == (cfg.objective == "simpo")


# -- errors under their fields ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup,field,needle", [
    (dict(packing=True), "packing", "packing=False"),
    (dict(chunked_loss=True), "chunked_loss", "chunked_loss=False"),
    (dict(data_format="text"), "data_format", "no rejected answer"),
    (dict(pref_beta="0"), "pref_beta", "greater than 0"),
    (dict(pref_beta="abc"), "pref_beta", "must be a number"),
    (dict(simpo_gamma="-1"), "simpo_gamma", "greater than or equal to 0"),
])
def test_an_invalid_combination_shows_the_configs_error_under_its_field(setup, field, needle):
    panel = Panel(pref(), debounce_s=0)
    for name, value in setup.items():
        panel.controls[name].value = value
    assert any(e["field"] == field for e in panel.errors), panel.errors
    assert needle in html.unescape(panel.form.field_errors[field].value)
    assert panel.controls[field].layout.border
    with pytest.raises(ConfigError):
        _ = panel.config
    panel.train_button.click()
    label = html.escape(panel.form.label(field))   # the status names the field by its label
    assert panel.run is None and "not started" in panel.status.value and label in panel.status.value


def test_precompute_ref_off_dpo_is_an_error_and_stays_shown_to_untick():
    panel = Panel(pref(precompute_ref=True), debounce_s=0)
    click(panel.controls["objective"], "orpo")
    box = panel.controls["precompute_ref"]
    assert panel.errors[0]["field"] == "precompute_ref"
    assert "uses no reference model" in html.unescape(panel.form.field_errors["precompute_ref"].value)
    assert shown(panel, "precompute_ref") and not box.disabled   # ticked where it does not apply: clickable
    box.value = False
    assert panel.errors == [] and panel.config.objective == "orpo" and not panel.config.precompute_ref
    assert not shown(panel, "precompute_ref") and box.disabled


def test_precompute_ref_is_greyed_with_why_under_lora():
    panel = Panel(pref(), debounce_s=0)
    box = panel.controls["precompute_ref"]
    assert not box.disabled and "unavailable" not in box.tooltip
    assert "frozen copy" in panel.objective_info.value
    click(panel.controls["method"], "lora")
    assert box.disabled and box.tooltip.startswith("unavailable") and "no copy to replace" in box.tooltip
    assert "unavailable" in panel.form.help["precompute_ref"].value
    assert "adapters off" in panel.objective_info.value
    click(panel.controls["method"], "full")
    box.value = True
    assert "computed once before training" in panel.objective_info.value


# -- the data --------------------------------------------------------------------------------------------------------
def test_a_builtin_without_pairs_is_flagged_and_one_click_sets_the_pref_builtin():
    panel = Panel(pref(data="builtin:python-docs"), debounce_s=0)
    button = panel.pref_data_button
    assert panel.controls["data"].layout.border                        # the data field is marked
    assert any(e["field"] == "data" for e in panel.errors)
    assert "no preference pairs" in html.unescape(panel.objective_info.value)
    assert PREF_BUILTIN in html.unescape(panel.data_info.value)
    assert button.layout.display != "none" and PREF_BUILTIN in button.description
    panel.train_button.click()                                          # a run would fail on the data: refused
    assert panel.run is None and "not started" in panel.status.value and "(Data)" in panel.status.value
    button.click()
    assert panel.controls["data"].value == PREF_BUILTIN
    assert panel.errors == [] and button.layout.display == "none"
    assert "preference" in panel.data_info.value
    assert panel.config == pref()


def test_objective_lm_on_pairs_is_flagged_and_no_pref_builtin_is_offered():
    panel = Panel(pref(), debounce_s=0)
    click(panel.controls["objective"], "lm")
    assert any(e["field"] == "data" for e in panel.errors)
    assert "objective" in html.unescape(panel.data_info.value)
    assert panel.pref_data_button.layout.display == "none"
    click(panel.controls["objective"], "orpo")
    assert panel.errors == []


# -- memory ----------------------------------------------------------------------------------------------------------
def test_the_memory_readout_counts_the_reference_copy_where_there_is_one():
    memory = pytest.importorskip("nbtrain.memory")
    panel = Panel(pref(), debounce_s=0)
    est = memory.estimate_memory(panel.config)
    assert panel.memory_estimate == est and est.reference_weights_bytes == est.weights_bytes > 0
    assert "reference weights" in panel.memory.value
    click(panel.controls["method"], "lora")
    assert panel.memory_estimate.reference_weights_bytes == 0 and "reference weights" not in panel.memory.value
    click(panel.controls["method"], "full")
    panel.controls["precompute_ref"].value = True
    assert panel.memory_estimate.reference_weights_bytes == 0 and "reference weights" not in panel.memory.value
    panel.controls["precompute_ref"].value = False
    click(panel.controls["objective"], "simpo")
    assert panel.memory_estimate == memory.estimate_memory(panel.config)
    assert panel.memory_estimate.reference_weights_bytes == 0


# -- a run ---------------------------------------------------------------------------------------------------------
def test_train_runs_the_objective_the_panel_shows():
    panel = Panel(pref(subset=4, max_steps=1, max_seq_len=32), debounce_s=0)
    click(panel.controls["objective"], "orpo")
    panel.controls["pref_beta"].value = "0.2"
    panel.train_button.click()
    wait_for(lambda: panel.result is not None and not panel.runner.busy(), 240, "the run to finish")
    result = panel.result
    assert result.config.objective == "orpo" and result.config.pref_beta == 0.2
    row = result.history.iloc[-1]
    assert row["reward_margin"] == pytest.approx(row["reward_chosen"] - row["reward_rejected"])
