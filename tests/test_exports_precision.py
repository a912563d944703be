"""The precision of every tensor in the exports (issue 27): every precision x every optimizer exports to each
format and reads back as itself where the format can say it, and where it cannot the notes name the field.
Fast: exports and imports only, no training."""

import json
import warnings

import pytest
import torch
import yaml

import nbtrain as nbt
from nbtrain.config import OPTIMIZERS, ConfigError
from nbtrain.hardware import PRECISIONS
from nbtrain.integrations import exports as ex
from nbtrain.integrations.exports import mapping

CASES = [(p, o) for p in PRECISIONS for o in OPTIMIZERS]
# transformers' names, checked against its OptimizerNames below
TRAINER_NAMES = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
                 "adafactor": "adafactor", "sgd": "sgd"}


def _cfg(precision, optimizer, **kw):
    base = dict(precision=precision, optimizer=optimizer, method="lora", output_dir="runs/x", data="org/corpus",
                max_steps=20, packing=True, eval_fraction=0.0)
    return nbt.TrainConfig(**{**base, **kw})


def test_the_names_are_transformers_own():
    from transformers.training_args import OptimizerNames

    from nbtrain.engine.optimizers import SGD_MOMENTUM

    names = {o.value for o in OptimizerNames}
    assert ex.OPTIM_NAMES == TRAINER_NAMES and set(ex.OPTIM_NAMES) == set(OPTIMIZERS)
    assert set(ex.OPTIM_NAMES.values()) <= names and set(ex.OPTIM_IN) <= names
    assert all(ex.OPTIM_IN[v] == k for k, v in ex.OPTIM_NAMES.items())
    assert mapping.SGD_MOMENTUM == SGD_MOMENTUM   # the exports cannot import the engine: the two must agree
    assert mapping.parse_optim_args(mapping.SGD_OPTIM_ARGS) == {"momentum": "0.9"}


# -----------------------------------------------------------------------------------------------------------
# LLaMA-Factory: every precision and every optimizer round-trips
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,optimizer", CASES)
def test_llamafactory_round_trip(tmp_path, precision, optimizer):
    cfg = _cfg(precision, optimizer)
    doc, notes = ex.llamafactory_config(cfg)
    assert "precision" not in notes and "optimizer" not in notes
    assert doc["optim"] == TRAINER_NAMES[optimizer]
    assert doc.get("optim_args") == ("momentum=0.9" if optimizer == "sgd" else None)
    assert doc.get("pure_bf16", False) == (precision == "bf16-pure")
    assert doc.get("fp8", False) == (precision == "fp8") and doc.get("fp8_backend") == \
        ("torchao" if precision == "fp8" else None)
    assert doc["bf16"] == (precision in ("bf16", "fp8")) and doc["fp16"] == (precision == "fp16")
    assert doc.get("tf32", False) == (precision == "tf32")
    assert ("fp8" in notes) == (precision == "fp8")
    path = tmp_path / "lf.yaml"
    ex.to_llamafactory_yaml(cfg, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing of our own export goes unmapped
        back = ex.from_llamafactory_yaml(path)
    assert (back.precision, back.optimizer) == (precision, optimizer)
    for f in ex.LLAMAFACTORY_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


def test_stochastic_rounding_is_named_by_every_export(tmp_path):
    cfg = _cfg("bf16-pure", "adamw", stochastic_rounding=True, method="full")
    for name, notes in (("llamafactory", ex.llamafactory_config(cfg)[1]), ("autotrain", ex.autotrain_config(cfg)[1]),
                        ("training-args", ex.training_arguments_notes(cfg)), ("trl", ex.sft_config(cfg)[1]),
                        ("accelerate", ex.accelerate_config_notes(cfg))):
        assert "stochastic_rounding" in notes, name
        assert "stochastic_rounding=True" in notes["stochastic_rounding"], name
    assert "stochastic_rounding" in ex.training_arguments_json(cfg)["notes"]
    assert "stochastic_rounding=True" in ex.to_llamafactory_yaml(cfg)   # the YAML's comments say it too
    path = tmp_path / "lf.yaml"
    ex.to_llamafactory_yaml(cfg, path)
    back = ex.from_llamafactory_yaml(path)
    assert (back.precision, back.optimizer, back.stochastic_rounding) == ("bf16-pure", "adamw", False)
    for name, notes in (("llamafactory", ex.llamafactory_config(cfg.replace(stochastic_rounding=False))[1]),
                        ("training-args", ex.training_arguments_notes(cfg.replace(stochastic_rounding=False)))):
        assert "stochastic_rounding" not in notes, name


def _lf_file(tmp_path, **keys):
    doc = yaml.safe_load(ex.to_llamafactory_yaml(nbt.TrainConfig(output_dir="runs/u", precision="fp32")))
    for k, v in keys.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("keys,precision,optimizer,unmapped", [
    (dict(optim=None), "fp32", "adamw", {}),                                      # the tool's default: AdamW
    (dict(optim="adamw_torch_fused"), "fp32", "adamw", {}),
    (dict(optim="adamw_8bit"), "fp32", "adamw_8bit", {}),                        # transformers' alias of bnb's
    (dict(optim="sgd", optim_args="momentum=0.9"), "fp32", "sgd", {}),
    (dict(optim="sgd"), "fp32", "adamw", {"optim": "sgd"}),                     # momentum 0 is not nbtrain's sgd
    (dict(optim="sgd", optim_args="momentum=0.9,nesterov=True"), "fp32", "adamw",
     {"optim": "sgd", "optim_args": "momentum=0.9,nesterov=True"}),
    (dict(optim="lion_8bit"), "fp32", "adamw", {"optim": "lion_8bit"}),
    (dict(optim="adafactor", optim_args="x=1"), "fp32", "adafactor", {"optim_args": "x=1"}),
    (dict(pure_bf16=True, bf16=False), "bf16-pure", "adamw", {}),
    (dict(pure_bf16=True, bf16=True), "bf16-pure", "adamw", {"bf16": True}),    # autocast over bf16 weights
    (dict(fp8=True, bf16=True, fp8_backend="torchao"), "fp8", "adamw", {}),
    (dict(fp8=True), "fp8", "adamw", {}),                                        # fp8_backend auto: torchao
    (dict(fp8=True, fp8_backend="te"), "fp8", "adamw", {"fp8_backend": "te"}),
    (dict(fp8=True, fp8_enable_fsdp_float8_all_gather=True), "fp8", "adamw",
     {"fp8_enable_fsdp_float8_all_gather": True}),
    (dict(fp8=True, tf32=True), "fp8", "adamw", {"tf32": True}),
    (dict(fp8=False, fp8_backend="te"), "fp32", "adamw", {}),                   # inert without fp8
])
def test_llamafactory_hand_written_precision_and_optim(tmp_path, keys, precision, optimizer, unmapped):
    cfg, got = ex.read_llamafactory_yaml(_lf_file(tmp_path, **keys))
    assert (cfg.precision, cfg.optimizer) == (precision, optimizer)
    assert got == unmapped
    if unmapped:
        with pytest.warns(UserWarning, match=next(iter(unmapped))):
            ex.from_llamafactory_yaml(_lf_file(tmp_path, **keys))


@pytest.mark.parametrize("keys,match", [
    (dict(pure_bf16=True, fp16=True), "pure_bf16 and fp16 are both true"),
    (dict(fp8=True, fp16=True), "fp8 and fp16 are both true"),
    (dict(pure_bf16=True, fp8=True), "pure_bf16 and fp8 are both true"),
])
def test_llamafactory_conflicting_precisions_fail(tmp_path, keys, match):
    path = _lf_file(tmp_path, **keys)
    with pytest.raises(ConfigError, match=match):
        ex.read_llamafactory_yaml(path)
    assert ex.read_llamafactory_yaml(path, precision="bf16")[0].precision == "bf16"   # an override decides


# -----------------------------------------------------------------------------------------------------------
# AutoTrain: fp16/bf16/none and the optimizer names; bf16-pure, fp8, tf32 and sgd are named in the notes
# -----------------------------------------------------------------------------------------------------------
AT_BACK = {"fp32": "fp32", "tf32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16", "fp8": "bf16"}


@pytest.mark.parametrize("precision,optimizer", CASES)
def test_autotrain_round_trip(tmp_path, precision, optimizer):
    cfg = _cfg(precision, optimizer, max_steps=None, epochs=1.0)
    doc, notes = ex.autotrain_config(cfg)
    params = doc["params"]
    assert params["optimizer"] == TRAINER_NAMES[optimizer]
    assert params["mixed_precision"] == {"fp32": "none", "tf32": "none"}.get(AT_BACK[precision], AT_BACK[precision])
    assert ("precision" in notes) == (AT_BACK[precision] != precision)
    assert ("optimizer" in notes) == (optimizer == "sgd")
    path = tmp_path / "at.yaml"
    ex.to_autotrain_yaml(cfg, path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        back = ex.from_autotrain_yaml(path)
    reported = " ".join(str(w.message) for w in rec if w.category is UserWarning)
    assert back.precision == AT_BACK[precision]
    if optimizer == "sgd":   # AutoTrain's sgd has no momentum: named, and nbtrain's default runs
        assert back.optimizer == "adamw" and "params.optimizer" in reported and "momentum" in reported
    else:
        assert back.optimizer == optimizer and not reported
    for f in ex.AUTOTRAIN_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


def test_autotrain_classification_carries_the_optimizer(tmp_path):
    cfg = nbt.TrainConfig(task="sequence-classification", method="full", precision="fp16", optimizer="adafactor",
                          max_steps=None, epochs=2.0, data="org/labels", output_dir="clf", eval_fraction=0.0)
    path = tmp_path / "at.yaml"
    ex.to_autotrain_yaml(cfg, path)
    assert yaml.safe_load(path.read_text())["params"]["optimizer"] == "adafactor"
    back, unmapped = ex.read_autotrain_yaml(path)
    assert (back.optimizer, back.precision, unmapped) == ("adafactor", "fp16", {})


def test_autotrain_hand_written_unknown_optimizer(tmp_path):
    path = tmp_path / "at.yaml"
    path.write_text("task: llm\nbase_model: tiny\ndata:\n  path: org/x\nparams:\n  optimizer: lion_32bit\n"
                    "  warmup_ratio: 0\n")
    cfg, unmapped = ex.read_autotrain_yaml(path)
    assert unmapped == {"params.optimizer": "lion_32bit"} and cfg.optimizer == "adamw"
    with pytest.warns(UserWarning, match="lion_32bit"):
        ex.from_autotrain_yaml(path)


# -----------------------------------------------------------------------------------------------------------
# TrainingArguments (and TRL's SFTConfig on top of it)
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,optimizer", CASES)
def test_training_arguments(precision, optimizer):
    from transformers import Trainer, TrainingArguments

    cfg = _cfg(precision, optimizer)
    kw = ex.training_arguments_kwargs(cfg)
    cuda = torch.cuda.is_available()
    assert kw["optim"] == (("adamw_torch_fused" if cuda else "adamw_torch") if optimizer == "adamw"
                           else TRAINER_NAMES[optimizer])
    assert kw.get("optim_args") == ("momentum=0.9" if optimizer == "sgd" else None)
    assert bool(kw.get("bf16")) == (precision == "bf16") and bool(kw.get("fp16")) == (precision == "fp16")
    assert bool(kw.get("tf32")) == (precision == "tf32")
    notes = ex.training_arguments_notes(cfg)
    if precision == "bf16-pure":
        assert kw["bf16"] is False and "dtype=torch.bfloat16" in notes["precision"]
        assert "autocast_adapter_dtype=False" in notes["precision"]   # method lora
    elif precision == "fp8":
        assert kw["bf16"] is False and "accelerate-config" in notes["precision"]
    else:
        assert "precision" not in notes
    sft, sft_notes = ex.sft_config(cfg)
    assert sft["bf16"] == (precision == "bf16") and sft["optim"] == kw["optim"]
    assert set(notes) <= set(sft_notes)
    if precision in ("fp16", "bf16", "tf32") and precision not in nbt.capabilities().allowed_precisions:
        return   # TrainingArguments checks the device for those flags
    args = TrainingArguments(**kw)
    cls, okw = Trainer.get_optimizer_cls_and_kwargs(args)
    if optimizer == "sgd":
        assert cls is torch.optim.SGD and okw["momentum"] == 0.9
    elif optimizer == "adafactor":
        assert cls.__name__ == "Adafactor" and not okw["scale_parameter"] and not okw["relative_step"]
        assert not okw.get("warmup_init", False)
    elif optimizer == "adamw":
        assert cls is torch.optim.AdamW and okw.get("fused", False) == cuda
    else:
        import bitsandbytes as bnb

        assert cls is bnb.optim.AdamW and okw["optim_bits"] == 8 and okw["is_paged"] == optimizer.startswith("paged")
        assert okw["betas"] == (0.9, 0.999) and okw["eps"] == 1e-8   # torch's defaults, as nbtrain's


def test_training_args_json_carries_the_notes():
    out = json.loads(ex.export_text(_cfg("fp8", "adamw"), "training-args"))
    assert out["training_arguments"]["bf16"] is False and "fp8" in out["notes"]["precision"]
    assert "notes" not in ex.training_arguments_json(_cfg("fp32", "adamw"))
    sft = json.loads(ex.export_text(_cfg("bf16-pure", "adamw"), "trl-sft"))
    assert sft["sft_config"]["bf16"] is False and "bf16-pure" in sft["notes"]["precision"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_nbtrain_optimizer_for_a_trainer_is_nbtrains(optimizer):
    from nbtrain.engine.optimizers import build_optimizer

    cfg = nbt.TrainConfig(optimizer=optimizer, lr=0.01, weight_decay=0.1)
    model = torch.nn.Linear(4, 4)
    try:
        ours = build_optimizer(cfg, list(model.parameters()), "cpu")
    except (ImportError, RuntimeError) as e:   # bitsandbytes' optimizers that cannot build on this machine
        pytest.skip(f"{optimizer}: {e}")
    opt, _ = ex.nbtrain_optimizer_and_scheduler(cfg, model, 10)
    assert type(opt) is type(ours)
    keys = ("weight_decay", "momentum", "scale_parameter", "relative_step", "warmup_init", "betas", "eps")
    assert {k: v for k, v in opt.defaults.items() if k in keys} == {k: v for k, v in ours.defaults.items() if k in keys}
    with pytest.raises(ValueError, match="BF16StochasticAdamW"):
        ex.nbtrain_optimizer_and_scheduler(cfg.replace(precision="bf16-pure", optimizer="adamw",
                                                       stochastic_rounding=True), model, 10)


# -----------------------------------------------------------------------------------------------------------
# accelerate: fp8 is mixed_precision fp8 with the torchao (AO) backend, and accelerate launch reads it so
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
def test_accelerate_config(tmp_path, monkeypatch, precision):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils.dataclasses import FP8BackendType

    cfg = nbt.TrainConfig(precision=precision)
    path = tmp_path / "acc.yaml"
    ex.to_accelerate_config_yaml(cfg, path)
    loaded = load_config_from_file(str(path))
    notes = ex.accelerate_config_notes(cfg)
    if precision != "fp8":
        assert loaded.mixed_precision == "no" and not loaded.fp8_config
        assert ("precision" in notes) == (precision == "bf16-pure")
        return
    assert loaded.mixed_precision == "fp8" and FP8BackendType(loaded.fp8_config["backend"]) is FP8BackendType.AO
    assert "precision" in notes and "AO" in path.read_text()
    # what accelerate launch hands the script, and what the exported TrainingArguments make of it
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env
    from transformers import TrainingArguments

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    _, env = prepare_simple_launcher_cmd_env(args)
    assert env["ACCELERATE_MIXED_PRECISION"] == "fp8" and env["ACCELERATE_FP8_BACKEND"] == "AO"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    targs = TrainingArguments(**ex.training_arguments_kwargs(cfg, output_dir=str(tmp_path)))
    assert targs.mixed_precision == "fp8"   # bf16=False leaves the launcher's fp8 in place
