"""Sharding in the exports (issue 28): sharding="fsdp" and reshard_after_forward export to each format and read back
where the format can say them; where it cannot, the notes (or the import's warning / error) name them. The
accelerate config really launches N ranks on this CPU machine with the FSDP environment nbtrain's worker reads."""

import json
import os
import sys
import warnings

import pytest
import torch
import yaml

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.integrations import exports as ex
from nbtrain.integrations.exports import mapping

from .helpers import run_process

SHARDINGS = [("none", True), ("fsdp", True), ("fsdp", False)]


def _cfg(sharding, reshard=True, **kw):
    base = dict(sharding=sharding, reshard_after_forward=reshard, method="lora", output_dir="runs/x",
                data="org/corpus", max_steps=20, packing=True, eval_fraction=0.0, precision="bf16")
    return nbt.TrainConfig(**{**base, **kw})


def _strict(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing of our own export goes unmapped
        return fn(*a, **kw)


def _hand_written_lf(tmp_path, **train):
    doc = {"model_name_or_path": "tiny", "stage": "pt", "do_train": True, "finetuning_type": "lora",
           "dataset": "org/corpus", "output_dir": "runs/x", **train}
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# -----------------------------------------------------------------------------------------------------------
# the layer nbtrain wraps, as the exports name it
# -----------------------------------------------------------------------------------------------------------
def test_layer_class_is_the_one_nbtrain_wraps():
    from nbtrain.engine.distributed import layer_stack
    from nbtrain.models.loading import meta_model

    blocks = layer_stack(meta_model("tiny", "causal-lm"))
    assert blocks and mapping.fsdp_layer_class(nbt.TrainConfig()) == type(blocks[0]).__name__ == "LlamaDecoderLayer"


def test_uncached_model_leaves_the_wrap_to_no_split_modules():
    cfg = _cfg("fsdp", model="someorg/not-cached-model")
    assert mapping.fsdp_layer_class(cfg) is None
    kw = ex.training_arguments_kwargs(cfg)
    assert "transformer_layer_cls_to_wrap" not in kw["fsdp_config"]
    assert "_no_split_modules" in ex.training_arguments_notes(cfg)["fsdp_config"]
    acc = ex.accelerate_config(cfg, 2)
    assert "fsdp_transformer_layer_cls_to_wrap" not in acc["fsdp_config"]
    assert "_no_split_modules" in ex.accelerate_config_notes(cfg)["sharding"]


# -----------------------------------------------------------------------------------------------------------
# TrainingArguments and TRL's SFTConfig
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_training_arguments(tmp_path, sharding, reshard):
    from transformers import TrainingArguments

    cfg = _cfg(sharding, reshard, precision="fp32")
    kw = ex.training_arguments_kwargs(cfg, output_dir=str(tmp_path))
    notes = ex.training_arguments_notes(cfg)
    if sharding == "none":
        assert "fsdp" not in kw and "fsdp_config" not in kw and "sharding" not in notes
        assert not TrainingArguments(**kw).fsdp
        return
    assert kw["fsdp"] in (True, "full_shard auto_wrap" if reshard else "shard_grad_op auto_wrap")
    assert kw["fsdp_config"] == {"version": 2, "reshard_after_forward": reshard,
                                 "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                 "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                 "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": False}
    json.dumps(kw)   # the training-args export is JSON
    # transformers 5 builds FSDP arguments on a CPU without a process group: what the Trainer hands accelerate
    plugin = TrainingArguments(**kw).fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is reshard
    assert plugin["state_dict_type"] == "SHARDED_STATE_DICT" and plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert "accelerate launch" in notes["sharding"] and "float32" not in notes["sharding"]   # fp32: same reduce


def test_training_arguments_bf16_names_the_reduce_dtype():
    assert "reduces gradients in the parameters' dtype" in ex.training_arguments_notes(_cfg("fsdp"))["sharding"]


def test_training_arguments_checkpointing_is_fsdps_own(tmp_path):
    from transformers import TrainingArguments

    cfg = _cfg("fsdp", gradient_checkpointing=True, precision="fp32")
    kw = ex.training_arguments_kwargs(cfg, output_dir=str(tmp_path))
    ckpt = "activation_checkpointing" if "activation_checkpointing_kwargs" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    assert kw[ckpt] is False and f"{ckpt}_kwargs" not in kw   # never both: the Trainer's would re-gather in backward
    assert kw["fsdp_config"]["activation_checkpointing"] is True
    assert TrainingArguments(**kw).fsdp_plugin_args["activation_checkpointing"] is True
    assert "gradient_checkpointing" in ex.training_arguments_notes(cfg)
    plain = ex.training_arguments_kwargs(cfg.replace(sharding="none"), output_dir=str(tmp_path))
    assert plain[ckpt] is True and plain[f"{ckpt}_kwargs"] == {"use_reentrant": False}


@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_training_arguments_keys_read_back(sharding, reshard):
    # no TrainingArguments importer exists; the reader LLaMA-Factory's import uses takes the same keys
    kw = ex.training_arguments_kwargs(_cfg(sharding, reshard))
    r = mapping.Reader({k: kw[k] for k in ("fsdp", "fsdp_config") if k in kw}, {}, "kwargs")
    mapping.sharding_in(r)
    assert r.kw["sharding"] == sharding and not r.unmapped and not r.doc
    assert r.kw.get("reshard_after_forward", True) is reshard


@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_trl_sft_config_carries_the_same_keys(sharding, reshard):
    cfg = _cfg(sharding, reshard)
    kw, notes = ex.sft_config(cfg)
    ta = ex.training_arguments_kwargs(cfg)
    assert kw.get("fsdp") == ta.get("fsdp") and kw.get("fsdp_config") == ta.get("fsdp_config")
    assert ("sharding" in notes) == (sharding == "fsdp")
    out = json.loads(ex.export_text(cfg, "trl-sft"))
    assert out["sft_config"].get("fsdp_config") == ta.get("fsdp_config")


# -----------------------------------------------------------------------------------------------------------
# LLaMA-Factory
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_llamafactory_round_trip(tmp_path, sharding, reshard):
    cfg = _cfg(sharding, reshard, gradient_checkpointing=True)
    doc, notes = ex.llamafactory_config(cfg)
    if sharding == "none":
        assert "fsdp" not in doc and "fsdp_config" not in doc and "sharding" not in notes
    else:
        assert doc["fsdp"] == ("full_shard" if reshard else "shard_grad_op") + " auto_wrap"
        assert doc["fsdp_config"]["version"] == 2 and doc["fsdp_config"]["reshard_after_forward"] is reshard
        assert doc["fsdp_config"]["state_dict_type"] == "SHARDED_STATE_DICT"
        assert "activation_checkpointing" not in doc["fsdp_config"]   # LLaMA-Factory checkpoints itself
        assert "FORCE_TORCHRUN=1" in notes["sharding"] and "accelerate-config" in notes["sharding"]
    path = tmp_path / "lf.yaml"
    ex.export_text(cfg, "llamafactory", path)
    back = _strict(ex.from_llamafactory_yaml, path)
    assert (back.sharding, back.reshard_after_forward) == (sharding, reshard)
    for f in ex.LLAMAFACTORY_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


def test_reshard_without_sharding_is_named(tmp_path):
    cfg = _cfg("none", False)
    for name, notes in (("llamafactory", ex.llamafactory_config(cfg)[1]), ("autotrain", ex.autotrain_config(cfg)[1]),
                        ("training-args", ex.training_arguments_notes(cfg)), ("trl", ex.sft_config(cfg)[1]),
                        ("accelerate", ex.accelerate_config_notes(cfg))):
        assert "reshard_after_forward=False" in notes["reshard_after_forward"], name


@pytest.mark.parametrize("train,reshard,named", [
    ({"fsdp": True, "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}, True, set()),
    ({"fsdp": True, "fsdp_config": {"version": 2}}, True, {"fsdp_config.state_dict_type"}),   # FULL by default
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                                                      "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}, False, set()),
    ({"fsdp": "shard_grad_op auto_wrap", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}},
     False, set()),
    # FSDP1: version 1, or none given (transformers 4's default); its strategy in reshard_after_forward
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1, "reshard_after_forward": "SHARD_GRAD_OP",
                                                      "state_dict_type": "SHARDED_STATE_DICT"}},
     False, {"fsdp_config.version"}),
    ({"fsdp": "full_shard auto_wrap", "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}, True,
     {"fsdp_config.version"}),
    ({"fsdp": "full_shard offload auto_wrap", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}},
     True, {"fsdp.offload"}),
    ({"fsdp": "hybrid_shard auto_wrap", "fsdp_config": {"version": 1, "state_dict_type": "SHARDED_STATE_DICT"}},
     True, {"fsdp.hybrid_shard", "fsdp_config.version"}),
    ({"fsdp": True, "fsdp_config": {"version": 2, "cpu_offload": True, "auto_wrap_policy": "SIZE_BASED_WRAP",
                                    "min_num_params": 1000, "cpu_ram_efficient_loading": True}},
     True, {"fsdp_config.cpu_offload", "fsdp_config.auto_wrap_policy", "fsdp_config.min_num_params",
            "fsdp_config.cpu_ram_efficient_loading", "fsdp_config.state_dict_type"}),
])
def test_llamafactory_hand_written_fsdp(tmp_path, train, reshard, named):
    path = _hand_written_lf(tmp_path, **train)
    cfg, unmapped = ex.read_llamafactory_yaml(path)
    assert (cfg.sharding, cfg.reshard_after_forward) == ("fsdp", reshard)
    assert set(unmapped) == named
    if named:
        with pytest.warns(UserWarning) as w:
            ex.from_llamafactory_yaml(path)
        message = str(w[0].message)
        assert all(k in message for k in named)
        if "fsdp_config.version" in named:
            assert "nbtrain runs FSDP2" in message


def test_llamafactory_fsdp_checkpointing_and_off(tmp_path):
    path = _hand_written_lf(tmp_path, disable_gradient_checkpointing=True, fsdp="full_shard auto_wrap",
                            fsdp_config={"version": 2, "activation_checkpointing": True,
                                         "state_dict_type": "SHARDED_STATE_DICT"})
    cfg = _strict(ex.from_llamafactory_yaml, path)
    assert cfg.gradient_checkpointing and cfg.sharding == "fsdp"   # FSDP's checkpoint wrapper recomputes as well
    path = _hand_written_lf(tmp_path, fsdp="", fsdp_config={"version": 2})
    cfg, unmapped = ex.read_llamafactory_yaml(path)
    assert cfg.sharding == "none" and set(unmapped) == {"fsdp_config"}
    with pytest.warns(UserWarning, match="fsdp is off: the Trainer ignores it"):
        ex.from_llamafactory_yaml(path)
    path = _hand_written_lf(tmp_path, fsdp="no_shard")
    assert _strict(ex.from_llamafactory_yaml, path).sharding == "none"   # FSDP1's NO_SHARD is data parallel


def test_llamafactory_fsdp_refusals_still_apply(tmp_path):
    path = _hand_written_lf(tmp_path, quantization_bit=4, fsdp=True, fsdp_config={"version": 2})
    with pytest.raises(ConfigError, match="sharding='fsdp'"):
        ex.read_llamafactory_yaml(path)
    cfg, _ = ex.read_llamafactory_yaml(path, sharding="none")
    assert cfg.method == "qlora" and cfg.sharding == "none"


# -----------------------------------------------------------------------------------------------------------
# AutoTrain: no FSDP there
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_autotrain(tmp_path, sharding, reshard):
    cfg = _cfg(sharding, reshard, max_steps=None, epochs=1)
    doc, notes = ex.autotrain_config(cfg)
    assert doc["params"]["distributed_backend"] == "ddp"
    assert ("sharding" in notes) == (sharding == "fsdp")
    assert ("reshard_after_forward" in notes) == (not reshard)
    if sharding == "fsdp":
        assert "no FSDP" in notes["sharding"] and "sharding='none'" in notes["sharding"]
    path = tmp_path / "at.yaml"
    ex.export_text(cfg, "autotrain", path)
    back = _strict(ex.from_autotrain_yaml, path)
    assert back.sharding == "none"
    for f in ex.AUTOTRAIN_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


def test_autotrain_classification_has_no_backend_key():
    doc, notes = ex.autotrain_config(_cfg("fsdp", task="sequence-classification", method="full", packing=False,
                                          max_steps=None, epochs=1))
    assert "distributed_backend" not in doc["params"] and "DDP" in notes["sharding"]


@pytest.mark.parametrize("backend", ["deepspeed", "fsdp"])
def test_autotrain_other_backends_are_an_error(tmp_path, backend):
    cfg = _cfg("none", max_steps=None, epochs=1)
    doc, _ = ex.autotrain_config(cfg)
    doc["params"]["distributed_backend"] = backend
    path = tmp_path / "at.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="distributed_backend") as e:
        ex.read_autotrain_yaml(path)
    assert ("ZeRO-3" in str(e.value)) == (backend == "deepspeed")
    # the user chooses with an override; the warning still names the backend
    with pytest.warns(UserWarning, match=backend):
        back = ex.from_autotrain_yaml(path, sharding="fsdp")
    assert back.sharding == "fsdp"
    doc["params"].pop("distributed_backend")   # AutoTrain's default is ddp
    path.write_text(yaml.safe_dump(doc))
    assert _strict(ex.from_autotrain_yaml, path).sharding == "none"


# -----------------------------------------------------------------------------------------------------------
# accelerate: the config, what accelerate launch makes of it, and a real launch on this CPU machine
# -----------------------------------------------------------------------------------------------------------
def _launch_args(path):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("sharding,reshard", SHARDINGS)
def test_accelerate_config(tmp_path, sharding, reshard):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg = _cfg(sharding, reshard)
    path = tmp_path / "acc.yaml"
    ex.export_text(cfg, "accelerate-config", path)   # the default process count
    several = torch.cuda.device_count() > 1   # the default process count is the GPUs, else 1
    assert load_config_from_file(str(path)).distributed_type.value == \
        ("FSDP" if sharding == "fsdp" else "MULTI_GPU" if several else "NO")
    ex.to_accelerate_config_yaml(cfg, path, num_processes=2)
    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == 2 and loaded.mixed_precision == "no"   # nbtrain applies the precision itself
    args = _launch_args(path)
    if sharding == "none":
        assert loaded.distributed_type.value == "MULTI_GPU" and not loaded.fsdp_config
        assert args.multi_gpu and not args.use_fsdp and not args.cpu   # torchrun, on a CPU machine too
        return
    assert loaded.distributed_type.value == "FSDP"
    assert loaded.fsdp_config == {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                  "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                  "fsdp_reshard_after_forward": reshard, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                  "fsdp_offload_params": False, "fsdp_cpu_ram_efficient_loading": False,
                                  "fsdp_activation_checkpointing": False}
    assert args.use_fsdp and not args.cpu
    args.main_process_port = 0   # a free one: the check does not collide with anything running here
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == str(reshard).lower()
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == \
        "LlamaDecoderLayer"
    assert set(ex.ACCELERATE_FSDP_ENV) <= set(env)
    assert "sharding" in ex.accelerate_config_notes(cfg)


_DUMP = ("import json, os\n"
         "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'ACCELERATE_USE_FSDP', "
         "'FSDP_VERSION', 'FSDP_RESHARD_AFTER_FORWARD')\n"
         # a file per rank: two ranks printing to one pipe at once can interleave their lines
         "open(f\"env-{os.environ['RANK']}.json\", 'w').write(json.dumps({k: os.environ.get(k) for k in keys}))\n")


@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_accelerate_launch_starts_every_rank_on_cpu(tmp_path, sharding):
    cfg = _cfg(sharding, reshard=False)
    ex.to_accelerate_config_yaml(cfg, tmp_path / "acc.yaml", num_processes=2)
    (tmp_path / "dump.py").write_text(_DUMP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = run_process([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "acc.yaml",
                       "--main_process_port", "0", "dump.py"], 180, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("env-*.json"))]
    assert sorted(r["RANK"] for r in ranks) == ["0", "1"]
    assert all(r["WORLD_SIZE"] == "2" and r["MASTER_ADDR"] for r in ranks)
    if sharding == "fsdp":
        assert all((r["ACCELERATE_USE_FSDP"], r["FSDP_VERSION"], r["FSDP_RESHARD_AFTER_FORWARD"]) ==
                   ("true", "2", "false") for r in ranks)
    else:
        assert all(r["ACCELERATE_USE_FSDP"] is None for r in ranks)


def test_export_text_every_format_with_fsdp(tmp_path):
    cfg = _cfg("fsdp", max_steps=None, epochs=1)
    for to in ex.EXPORT_FORMATS:
        text = ex.export_text(cfg, to, tmp_path / f"{to}.out")
        assert "fsdp" in text.lower(), to
