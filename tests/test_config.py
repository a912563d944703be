"""TrainConfig: validation names the field; YAML round-trips exactly; every field has its help text; the
config is a pure value (what the device or the model allows is checked by check_runnable / check_lora_targets)."""

import ast
import os
from pathlib import Path

import pytest

import nbtrain as nbt
from nbtrain.config import ConfigError, TrainConfig, parse_override
from nbtrain.hardware import check_runnable, resolve_precision
from nbtrain.models import check_lora_targets

BAD = [
    (dict(precision="fp4"), "precision"),
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
    (dict(lora_targets="q_proj,,v_proj"), "lora_targets"),
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


def test_unknown_lora_target_fails_when_checked_not_at_construction():
    cfg = nbt.TrainConfig(method="lora", lora_targets=["q_proj", "nope"])   # the model is not asked here
    with pytest.raises(ConfigError, match="lora_targets.*nope") as e:
        check_lora_targets(cfg)
    assert e.value.field == "lora_targets" and "q_proj" in str(e.value) and "all-linear" in str(e.value)
    check_lora_targets(cfg.replace(lora_targets=["q_proj", "v_proj"]))      # known names pass
    check_lora_targets(cfg.replace(lora_targets="all-linear"))
    check_lora_targets(cfg.replace(method="full"))                           # full fine-tuning has no targets
    check_lora_targets(cfg.replace(model="no-such-org/no-such-model-xyz"))   # not cached: cannot tell, no error


class _PathLike:
    """An os.PathLike that is not a pathlib.Path (as some libraries hand out)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path


def test_path_fields_take_any_os_pathlike_and_store_the_string(tmp_path):
    """issue 25: TrainConfig(model=Path(...)) was refused with "Input should be a valid string"."""
    from nbtrain.config import PATH_FIELDS

    assert set(PATH_FIELDS) == {"model", "data", "output_dir", "resume_from"}
    for field in PATH_FIELDS:
        for value in (tmp_path / "x", _PathLike(tmp_path / "y")):
            cfg = nbt.TrainConfig(**{field: value})
            assert getattr(cfg, field) == os.fspath(value) and type(getattr(cfg, field)) is str
            assert cfg.to_dict()[field] == os.fspath(value)
            assert cfg.replace(**{field: value}) == cfg
            cfg.to_yaml(tmp_path / "c.yaml")
            assert f"{field}: {os.fspath(value)}" in (tmp_path / "c.yaml").read_text()
            assert nbt.TrainConfig.from_yaml(tmp_path / "c.yaml") == cfg
    with pytest.raises(ConfigError) as e:   # an empty path is still refused, naming the field
        nbt.TrainConfig(output_dir=_PathLike(" "))
    assert e.value.field == "output_dir"

    # a run of a config made of Paths: data read, outputs written where the Path says
    text = tmp_path / "train.txt"
    text.write_text("\n".join(f"line {i} of some plain text to learn" for i in range(40)))
    out = tmp_path / "out"
    r = nbt.train(nbt.TrainConfig(data=text, output_dir=out, max_steps=1, subset=8, max_seq_len=16,
                                  micro_batch_size=4, eval_fraction=0.0, precision="fp32"))
    assert r.summary["steps"] == 1 and r.config.data == str(text) and (out / "config.yaml").is_file()


def test_lora_targets_comma_separated():
    """issue 25: "module names, comma-separated" says the help, and LLaMA-Factory writes lora_target: a,b."""
    assert "comma-separated" in TrainConfig.model_fields["lora_targets"].description
    for given in ("q_proj,v_proj", " q_proj , v_proj ", ["q_proj", "v_proj"], ("q_proj", "v_proj")):
        assert nbt.TrainConfig(lora_targets=given).lora_targets == ["q_proj", "v_proj"], given
    assert nbt.TrainConfig(lora_targets="o_proj").lora_targets == ["o_proj"]
    assert nbt.TrainConfig(lora_targets=" all-linear ").lora_targets == "all-linear"   # the word stays a string
    assert nbt.TrainConfig(lora_targets=["all-linear"]).lora_targets == ["all-linear"]   # a list stays a list
    cfg = nbt.TrainConfig(method="lora", lora_targets="q_proj,v_proj")
    assert nbt.TrainConfig(**dict([parse_override("lora_targets=q_proj,v_proj")])) == \
        nbt.TrainConfig(lora_targets=["q_proj", "v_proj"])                              # nbtrain train --set
    assert "lora_targets:\n- q_proj\n- v_proj\n" in cfg.to_yaml()
    check_lora_targets(cfg.replace(model="tiny"))                                         # tiny has both
    for bad in ("q_proj,,v_proj", "q_proj,", ",", "", "  ", [], ["q_proj", " "], "all-linear,q_proj",
                ["all-linear", "q_proj"]):
        with pytest.raises(ConfigError) as e:
            nbt.TrainConfig(lora_targets=bad)
        assert e.value.field == "lora_targets" and "lora_targets" in str(e.value), bad
        assert repr(bad) in str(e.value)


def test_lora_targets_from_a_llamafactory_yaml(tmp_path):
    from nbtrain.integrations.exports import from_llamafactory_yaml, to_llamafactory_yaml

    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: tiny\nstage: pt\ndo_train: true\nfinetuning_type: lora\n"
                    "lora_target: q_proj,v_proj\ndataset: c4_demo\ncutoff_len: 64\n")
    back = from_llamafactory_yaml(path, data="builtin:python-docs")
    assert back.method == "lora" and back.lora_targets == ["q_proj", "v_proj"]
    cfg = nbt.TrainConfig(method="lora", lora_targets="q_proj,v_proj")
    to_llamafactory_yaml(cfg, tmp_path / "out.yaml")
    assert "lora_target: q_proj,v_proj" in (tmp_path / "out.yaml").read_text()
    assert from_llamafactory_yaml(tmp_path / "out.yaml").lora_targets == cfg.lora_targets


def test_precision_the_device_cannot_run_gives_reason_when_checked():
    caps = nbt.capabilities()
    for p, why in caps.reasons.items():
        if p in ("fp32", "tf32", "fp16", "bf16"):
            cfg = nbt.TrainConfig(precision=p)   # a config for another machine loads here
            with pytest.raises(ConfigError, match="precision") as e:
                check_runnable(cfg)
            assert e.value.field == "precision"
            assert why in str(e.value) and f"{p!r} cannot run on this {caps.device}" in str(e.value)


def test_auto_precision_resolves_per_rule():
    caps = nbt.capabilities()
    cfg = nbt.TrainConfig(precision="auto")
    expected = "bf16" if caps.bf16_supported and (caps.device == "cuda" or caps.bf16_native) else (
        "fp16" if caps.device == "cuda" else "fp32")
    assert resolve_precision(cfg.precision) == expected
    assert check_runnable(cfg) == expected
    assert check_runnable(cfg.replace(precision="fp32")) == "fp32"


def test_every_field_has_a_description():
    """The one source of each field's help text (the Panel shows it)."""
    missing = [name for name, f in TrainConfig.model_fields.items() if not (f.description or "").strip()]
    assert not missing


def test_config_module_imports_nothing_from_nbtrain():
    """config.py is the ground floor: stdlib, pydantic and yaml only (hardware and models import it)."""
    import nbtrain.config

    tree = ast.parse(Path(nbtrain.config.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("." if node.level else node.module.split(".")[0])
    assert "." not in roots and "nbtrain" not in roots
    assert roots - {"__future__", "os", "re", "pathlib", "typing"} == {"yaml", "pydantic"}
    assert not hasattr(TrainConfig, "resolved_precision")
    for name in ("to_training_arguments", "to_llamafactory_yaml", "to_autotrain_yaml", "from_llamafactory_yaml",
                 "from_autotrain_yaml"):
        assert not hasattr(TrainConfig, name), name   # exports are functions of nbtrain.integrations.exports


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
    p.write_text("precision: fp4\n")
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


def test_instruction_tuning_fields_are_checked_at_construction(tmp_path):
    """Issue 26's fields: an unknown template name is refused by name, never replaced; chat data and sample
    prompts need a causal LM."""
    cfg = TrainConfig(data_format="alpaca", chat_template="ChatML", train_on="last", sample_prompts="Hi?",
                      sample_every=5, columns={"output": " answer "})
    assert cfg.chat_template == "chatml" and cfg.sample_prompts == ["Hi?"] and cfg.columns == {"output": "answer"}
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert TrainConfig(chat_template=jinja).chat_template == jinja
    with pytest.raises(ConfigError, match="unknown chat template 'vicuna'") as e:
        TrainConfig(chat_template="vicuna")
    assert e.value.field == "chat_template"
    with pytest.raises(ConfigError, match="data_format") as e:
        TrainConfig(task="sequence-classification", data="builtin:python-docs-topics", data_format="messages")
    assert e.value.field == "data_format"
    with pytest.raises(ConfigError, match="sample_prompts"):
        TrainConfig(task="sequence-classification", data="builtin:python-docs-topics", sample_prompts=["x"])
    for bad in ({"": "x"}, {"output": 3}, ["output"]):
        with pytest.raises(ConfigError, match="columns"):
            TrainConfig(columns=bad)
    with pytest.raises(ConfigError, match="train_on"):
        TrainConfig(train_on="prompts")
    cfg.to_yaml(tmp_path / "c.yaml")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml") == cfg
