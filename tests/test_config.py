"""TrainConfig: validation names the field; YAML round-trips exactly; capabilities gate precisions."""

import pytest

import nbtrain as nbt
from nbtrain.config import ConfigError, parse_override

BAD = [
    (dict(precision="fp8"), "precision"),
    (dict(task="translation"), "task"),
    (dict(method="dora"), "method"),
    (dict(lora_r=0), "lora_r"),
    (dict(quant_bits=3, method="qlora"), "quant_bits"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(grad_accum_steps=-2), "grad_accum_steps"),
    (dict(lr=0), "lr"),
    (dict(scheduler="step"), "scheduler"),
    (dict(max_steps=None, epochs=None), "max_steps"),
    (dict(eval_fraction=1.5), "eval_fraction"),
    (dict(lora_dropout=1.0), "lora_dropout"),
    (dict(packing=True, task="sequence-classification"), "packing"),
    (dict(max_seq_len=2), "max_seq_len"),
    (dict(model=""), "model"),
    (dict(lora_targets="attention"), "lora_targets"),
    (dict(learning_rate=1e-4), "learning_rate"),
    (dict(subset=0), "subset"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        nbt.TrainConfig(**kwargs)
    assert e.value.field == field
    assert field in str(e.value)
    value = next(iter(kwargs.values())) if field in kwargs else None
    if field in kwargs and field not in ("learning_rate",):
        assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_unknown_lora_target_fails_at_config_time():
    with pytest.raises(ConfigError, match="lora_targets.*nope"):
        nbt.TrainConfig(method="lora", lora_targets=["q_proj", "nope"])


def test_precision_the_device_cannot_run_gives_reason():
    caps = nbt.capabilities()
    for p, why in caps.reasons.items():
        if p in ("fp32", "tf32", "fp16", "bf16"):
            with pytest.raises(ConfigError, match="precision") as e:
                nbt.TrainConfig(precision=p)
            assert why in str(e.value)


def test_auto_precision_resolves_per_rule():
    caps = nbt.capabilities()
    cfg = nbt.TrainConfig(precision="auto")
    expected = "bf16" if caps.bf16_supported and (caps.device == "cuda" or caps.bf16_native) else (
        "fp16" if caps.device == "cuda" else "fp32")
    assert cfg.resolved_precision() == expected


def test_yaml_round_trip_exact(tmp_path):
    cfgs = [
        nbt.TrainConfig(),
        nbt.TrainConfig(precision="fp16", lr=3e-5, micro_batch_size=2, grad_accum_steps=4, subset=100,
                        method="lora", lora_targets=["q_proj", "v_proj"], lora_alpha=32, max_grad_norm=None,
                        epochs=2.5, eval_every=10, output_dir="runs/x", packing=True, nonfinite="skip"),
        nbt.TrainConfig(task="sequence-classification", data="builtin:python-docs-topics", scheduler="linear",
                        warmup_steps=5, weight_decay=0.01, eval_fraction=0.0, seed=123),
    ]
    for i, cfg in enumerate(cfgs):
        path = tmp_path / f"c{i}.yaml"
        cfg.to_yaml(path)
        back = nbt.TrainConfig.from_yaml(path)
        assert back == cfg and back.to_dict() == cfg.to_dict()
        assert back.to_yaml() == cfg.to_yaml()


def test_from_yaml_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("precision: fp8\n")
    with pytest.raises(ConfigError, match=r"(?s)bad\.yaml.*precision"):
        nbt.TrainConfig.from_yaml(p)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        nbt.TrainConfig.from_yaml(tmp_path / "missing.yaml")
    p.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        nbt.TrainConfig.from_yaml(p)


def test_replace_validates_and_copies():
    cfg = nbt.TrainConfig()
    assert cfg.replace(micro_batch_size=2).micro_batch_size == 2 and cfg.micro_batch_size == 8
    with pytest.raises(ConfigError, match="micro_batch_size"):
        cfg.replace(micro_batch_size=0)
    assert cfg.replace(grad_accum_steps=4).effective_batch_size == 32


def test_parse_override():
    assert parse_override("lr=1e-4") == ("lr", 1e-4)
    assert parse_override("max_grad_norm=null") == ("max_grad_norm", None)
    with pytest.raises(ConfigError, match="not a TrainConfig field"):
        parse_override("learning_rate=1")
