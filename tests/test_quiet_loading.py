"""Issue 46, item 6: library progress bars a person does not need are not drawn. Loading an already converted or
saved model from a local folder drew transformers' "Loading weights 272/272" bar once per run (six times in one
comparison); a download's own bars, and any other bar, still are."""

from __future__ import annotations

import pytest

import nbtrain as nbt
from nbtrain.models import loading


@pytest.fixture
def bars_on():
    """transformers' bars enabled (as in a notebook), whatever the test environment set."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    if not was:
        hf_logging.disable_progress_bar()


def test_loading_a_saved_model_from_a_folder_draws_no_loading_weights_bar(tmp_path, capsys, bars_on):
    from transformers.utils import logging as hf_logging

    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs")
    tok = loading.load_tokenizer(cfg)
    loading.load_base_model(cfg, tok, None, "cpu").save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    capsys.readouterr()
    local = cfg.replace(model=str(tmp_path / "m"))
    model = loading.load_base_model(local, loading.load_tokenizer(local), None, "cpu")
    assert model is not None
    err = capsys.readouterr().err
    assert "Loading weights" not in err, err
    # the hook is undone after the load: transformers' other bars (and this one elsewhere) draw as before
    assert hf_logging._tqdm_hook is None
    bar = hf_logging.tqdm(range(3), desc="Loading weights")
    assert not isinstance(bar, hf_logging.EmptyTqdm)
    bar.close()


def test_only_the_named_bar_is_quiet_and_a_hook_already_set_is_kept(bars_on):
    from transformers.utils import logging as hf_logging

    seen = []

    def mine(factory, args, kwargs):
        seen.append(kwargs.get("desc"))
        return factory(*args, **kwargs)

    hf_logging.set_tqdm_hook(mine)
    try:
        with loading._quiet_load_bars():
            quiet = hf_logging.tqdm(range(2), desc="Loading weights")
            other = hf_logging.tqdm(range(2), desc="Downloading")
            assert isinstance(quiet, hf_logging.EmptyTqdm) and not isinstance(other, hf_logging.EmptyTqdm)
            other.close()
        assert seen == ["Downloading"] and hf_logging._tqdm_hook is mine
    finally:
        hf_logging.set_tqdm_hook(None)
