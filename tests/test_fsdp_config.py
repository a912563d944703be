"""Issue 28, the fast part: what sharding='fsdp' refuses and why, what one process does with it, the launcher's
choice, and resuming on another number of processes."""

import pytest

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.engine.checkpoint import CheckpointError, check_resumable
from nbtrain.engine.distributed import SingleProcess, init_distributed, layer_stack
from nbtrain.engine.prepare import adopt_launcher_sharding


@pytest.mark.parametrize("change, field, words", [
    ({"method": "qlora"}, "method", "QLoRA"),
    ({"optimizer": "adamw_8bit"}, "optimizer", "bitsandbytes"),
    ({"optimizer": "paged_adamw_8bit"}, "optimizer", "bitsandbytes"),
    ({"optimizer": "adafactor"}, "optimizer", "factored"),
    ({"precision": "bf16-pure", "stochastic_rounding": True}, "stochastic_rounding", "shards"),
    ({"chunked_loss": True}, "chunked_loss", "root forward"),
    ({"auto_batch_size": True}, "auto_batch_size", "before it is sharded"),
])
def test_fsdp_refuses_what_does_not_compose(change, field, words):
    with pytest.raises(ConfigError, match=words) as e:
        nbt.TrainConfig(sharding="fsdp", **change)
    assert e.value.field == field and "not with sharding='fsdp'" in str(e.value)
    nbt.TrainConfig(sharding="none", **change)   # the same settings without sharding are fine


@pytest.mark.parametrize("change", [{}, {"method": "lora"}, {"precision": "bf16"}, {"precision": "fp16"},
                                    {"precision": "bf16-pure"}, {"precision": "fp8"}, {"optimizer": "sgd"},
                                    {"gradient_checkpointing": True}, {"lean_layers": True}, {"compile": True},
                                    {"reshard_after_forward": False}])
def test_fsdp_accepts_what_composes(change):
    assert nbt.TrainConfig(sharding="fsdp", **change).sharding == "fsdp"


def test_sharding_values_are_checked():
    with pytest.raises(ConfigError) as e:
        nbt.TrainConfig(sharding="deepspeed")
    assert e.value.field == "sharding" and "fsdp" in str(e.value)


def test_one_process_has_nothing_to_shard(monkeypatch):
    """A plain single process with sharding='fsdp' runs unsharded (the no-op case) and says so."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert type(init_distributed("cpu", "fsdp")) is SingleProcess
    r = nbt.train(nbt.TrainConfig(model="tiny", subset=16, max_seq_len=32, max_steps=2, eval_fraction=0.0,
                                  precision="fp32", micro_batch_size=4, sharding="fsdp"))
    assert r.summary["world_size"] == 1 and r.summary["steps"] == 2
    assert any("one process, nothing to shard" in n for n in r.summary["notes"])


def test_accelerate_fsdp_launch_is_adopted(monkeypatch):
    cfg = nbt.TrainConfig()
    notes = []
    assert adopt_launcher_sharding(cfg, notes) is cfg and not notes
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    new = adopt_launcher_sharding(cfg, notes)
    assert new.sharding == "fsdp" and new.reshard_after_forward is False
    assert "ACCELERATE_USE_FSDP" in notes[0]
    with pytest.raises(ConfigError) as e:   # the launcher cannot make a config FSDP refuses run
        adopt_launcher_sharding(nbt.TrainConfig(method="qlora"), [])
    assert e.value.field == "method"


def test_resume_on_another_world_size_keeps_the_global_micro_batch():
    saved = nbt.TrainConfig(micro_batch_size=4).to_dict()
    check_resumable(saved, nbt.TrainConfig(micro_batch_size=8), "ck", saved_world=2, world=1)
    check_resumable(saved, nbt.TrainConfig(micro_batch_size=2), "ck", saved_world=2, world=4)
    check_resumable(saved, nbt.TrainConfig(micro_batch_size=4), "ck", saved_world=2, world=2)
    with pytest.raises(CheckpointError, match=r"4 x 2 processes.*use micro_batch_size=8"):
        check_resumable(saved, nbt.TrainConfig(micro_batch_size=4), "ck", saved_world=2, world=1)
    with pytest.raises(CheckpointError, match="micro_batch_size"):   # same world: the old rule
        check_resumable(saved, nbt.TrainConfig(micro_batch_size=8), "ck", saved_world=1, world=1)


def test_layer_stack_finds_the_decoder_layers():
    from nbtrain.models import build_model, load_tokenizer

    cfg = nbt.TrainConfig(model="tiny", method="lora")
    model = build_model(cfg, load_tokenizer(cfg), None, "fp32", "cpu")
    blocks = layer_stack(model)
    assert len(blocks) == model.get_base_model().config.num_hidden_layers
    assert len({type(b) for b in blocks}) == 1 and "DecoderLayer" in type(blocks[0]).__name__
