"""The GRPO export: TRL's GRPOConfig keywords through ``nbtrain export --to trl-grpo``, the rewards by name, the notes
on what GRPOConfig cannot carry, and the refusals of every export that has no GRPO. Nothing loads a model."""

import dataclasses
import json
import warnings

import pytest

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.integrations import exports as ex

REWARDS = ["length:16", "format:^\\d+$", "exact"]
# the notes every GRPO export carries, whatever the config
ALWAYS = {"reward", "mismatch", "max_seq_len"}


def module_reward(prompts, completions, **columns):
    """A reward a config can import again (tests is a package): 'tests.test_exports_grpo:module_reward'."""
    return [float(len(c)) for c in completions]


def _grpo(tmp_path=None, **kw):
    data = str(tmp_path / "data" / "prompts.jsonl") if tmp_path is not None else "builtin:prompts"
    kw = {"reward": REWARDS, "precision": "bf16", "method": "full", "output_dir": "runs/grpo", "micro_batch_size": 4,
          "data_format": "prompt", **kw}
    return nbt.TrainConfig(data=data, objective="grpo", **kw)


def _typical(tmp_path):
    # every mapped field away from its default, so a value cannot match by accident
    return _grpo(tmp_path, num_generations=8, micro_batch_size=4, grad_accum_steps=4, max_new_tokens=96,
                 temperature=0.7, top_p=0.9, grpo_epsilon=0.25, grpo_beta=0.04, grpo_loss="dr_grpo",
                 grpo_iterations=2, reward_weights=[0.5, 1.0, 2.0], lr=2e-6, max_steps=40, warmup_steps=3,
                 scheduler="linear", max_grad_norm=0.5, seed=7, gradient_checkpointing=True, log_every=5,
                 weight_decay=0.01)


def _training_args_fields():
    from transformers import TrainingArguments

    return set(TrainingArguments.__dataclass_fields__)


# -----------------------------------------------------------------------------------------------------------
# the keywords
# -----------------------------------------------------------------------------------------------------------
def test_keywords_of_a_typical_config(tmp_path):
    cfg = _typical(tmp_path)
    kw, notes = ex.grpo_config(cfg)
    assert kw == ex.grpo_config_kwargs(cfg)
    own = set(ex.TRL_GRPO_FIELDS)
    assert set(kw) <= _training_args_fields() | own
    assert own - {"vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max"} <= set(kw)
    assert (kw["num_generations"], kw["max_completion_length"], kw["temperature"], kw["top_p"]) == (8, 96, 0.7, 0.9)
    assert (kw["epsilon"], kw["beta"], kw["loss_type"], kw["num_iterations"]) == (0.25, 0.04, "dr_grpo", 2)
    assert kw["reward_weights"] == [0.5, 1.0, 2.0]
    # micro_batch_size counts completions on both sides
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (4, 4)
    assert kw["per_device_eval_batch_size"] == 8   # a whole group: GRPOConfig checks it when evaluating
    assert (kw["learning_rate"], kw["max_steps"], kw["warmup_steps"], kw["lr_scheduler_type"]) == \
        (2e-6, 40, 3, "linear")   # TRL's own lr default is 1e-6: written explicitly
    assert (kw["max_grad_norm"], kw["seed"], kw["logging_steps"], kw["weight_decay"]) == (0.5, 7, 5, 0.01)
    assert (kw["bf16"], kw["fp16"]) == (True, False)
    ckpt = "activation_checkpointing" if "activation_checkpointing" in kw else "gradient_checkpointing"
    assert kw[ckpt] is True   # TRL checkpoints by default: nbtrain's choice is written either way
    # what nbtrain runs, pinned where TRL's default could differ
    assert (kw["scale_rewards"], kw["use_bias_correction_kl"], kw["disable_dropout"]) == ("group", False, False)
    assert kw["remove_unused_columns"] is False   # the answer column reaches the rewards
    assert kw["output_dir"] == "runs/grpo"
    assert "objective" not in notes   # TrainingArguments' "no GRPO loss" note does not apply here
    json.dumps(kw)   # plain values


def test_defaults_and_precision(tmp_path):
    kw = ex.grpo_config_kwargs(_grpo(tmp_path, precision="fp32", reward="exact"))
    assert (kw["bf16"], kw["fp16"]) == (False, False)   # TRL turns bf16 on unless told
    assert (kw["num_generations"], kw["max_completion_length"], kw["loss_type"], kw["beta"]) == (4, 64, "dapo", 0.0)
    assert kw["reward_weights"] is None and kw["per_device_eval_batch_size"] == 4
    assert ex.grpo_config_kwargs(_grpo(tmp_path, precision="fp16"))["fp16"] is True
    assert ex.grpo_config_kwargs(_grpo(tmp_path), output_dir="elsewhere", seed=3)["output_dir"] == "elsewhere"


@pytest.mark.parametrize("correction", ["none", "token_truncate"])
def test_correction_keys(tmp_path, correction):
    kw, notes = ex.grpo_config(_grpo(tmp_path, is_correction=correction, is_cap=4.0))
    on = correction == "token_truncate"
    # written either way: TRL's own default (on, sequence_mask) would correct where nbtrain does not
    assert kw["vllm_importance_sampling_correction"] is on
    assert kw.get("vllm_importance_sampling_mode") == ("token_truncate" if on else None)
    assert kw.get("vllm_importance_sampling_clip_max") == (4.0 if on else None)
    assert ("is_correction" in notes) is on
    if on:
        assert "use_vllm=True" in notes["is_correction"] and "corrects nothing" in notes["is_correction"]
        assert "is_cap" not in notes
    else:
        assert "only applies to is_correction='token_truncate'" in notes["is_cap"]
    assert "is_cap" not in ex.grpo_config(_grpo(tmp_path))[1]   # the default cap: nothing to say


def test_reward_funcs_by_name(tmp_path):
    assert ex.grpo_reward_funcs(_grpo(tmp_path)) == REWARDS
    cfg = _grpo(tmp_path, reward=["contains", module_reward, "pkg.mod:score", lambda p, c, **k: [0.0] * len(c)])
    names = ex.grpo_reward_funcs(cfg)
    assert names[:3] == ["contains", "tests.test_exports_grpo:module_reward", "pkg.mod:score"]
    assert names[3].endswith("(not importable)")
    out = ex.grpo_config_json(cfg)
    assert out["reward_funcs"] == names and "reward_funcs" not in out["grpo_config"]


# -----------------------------------------------------------------------------------------------------------
# the notes: each present when its condition holds, absent when not
# -----------------------------------------------------------------------------------------------------------
def test_notes_of_a_plain_config(tmp_path):
    _, notes = ex.grpo_config(_grpo(tmp_path, reward=["format:^\\d+$", "exact"]))
    assert set(notes) == ALWAYS
    assert "parse_rewards" in notes["reward"] and "reward model" in notes["reward"]
    assert "[{'role': 'assistant'" in notes["reward"] and "__name__" in notes["reward"]
    assert "use_vllm=True" in notes["mismatch"] and "mismatch_mean" in notes["mismatch"]
    assert "keeps every prompt whole" in notes["max_seq_len"]


@pytest.mark.parametrize("key, on, off", [
    ("completion_tokens", {"reward": ["length:8", "exact"]}, {"reward": ["exact"]}),
    ("not_importable", {"reward": [lambda p, c, **k: [1.0] * len(c)]}, {"reward": [module_reward]}),
    ("sampler_precision", {"sampler_precision": "fp32"}, {"sampler_precision": "bf16"}),
    ("sampler_precision", {"sampler_precision": "fp16"}, {"sampler_precision": None}),
    ("is_correction", {"is_correction": "token_truncate"}, {"is_correction": "none"}),
    ("is_cap", {"is_cap": 5.0}, {"is_cap": 2.0}),
    ("columns", {"columns": {"prompt": "question"}}, {"columns": {}}),
    ("chat_template", {"chat_template": "chatml"}, {"chat_template": "auto"}),
    ("train_on", {"train_on": "all"}, {"train_on": "completion"}),
    ("pref_beta", {"pref_beta": 0.3}, {"pref_beta": 0.1}),
    ("sample_every", {"sample_every": 5}, {"sample_every": None}),
    ("compile", {"compile": True}, {"compile": False}),
])
def test_each_note_follows_its_condition(tmp_path, key, on, off):
    assert key in ex.grpo_config(_grpo(tmp_path, **on))[1]
    assert key not in ex.grpo_config(_grpo(tmp_path, **off))[1]


def test_note_texts(tmp_path):
    _, notes = ex.grpo_config(_grpo(tmp_path, reward=["length:8", lambda p, c, **k: [1.0] * len(c)],
                                    sampler_precision="fp32", columns={"prompt": "question"}))
    assert "completion_ids" in notes["completion_tokens"] and "KeyError" in notes["completion_tokens"]
    assert "<lambda> (not importable)" in notes["not_importable"] and "reward_funcs" in notes["not_importable"]
    assert "'fp32'" in notes["sampler_precision"] and "training precision ('bf16')" in notes["sampler_precision"]
    assert "named 'prompt'" in notes["columns"]
    assert "max_new_tokens" not in notes   # it is max_completion_length here, not a sample setting


def test_builtin_data_note(tmp_path):
    _, notes = ex.grpo_config(_grpo())
    assert "builtin_rows('builtin:prompts')" in notes["data"]
    assert "data" not in ex.grpo_config(_grpo(tmp_path))[1]   # a file of the user's: TRL reads it as it is


# -----------------------------------------------------------------------------------------------------------
# refusals
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective, way_out", [("lm", "--to trl-sft"), ("dpo", "--to trl-dpo"),
                                                ("simpo", "--to trl-dpo")])
def test_trl_grpo_refuses_other_objectives(objective, way_out):
    data = "builtin:python-docs-pref" if objective != "lm" else "builtin:python-docs-qa"
    cfg = nbt.TrainConfig(data=data, objective=objective)
    for call in (lambda: ex.grpo_config(cfg), lambda: ex.export_text(cfg, "trl-grpo")):
        with pytest.raises(ConfigError, match=way_out) as e:
            call()
        assert e.value.field == "objective" and f"{objective!r}" in str(e.value) and "'grpo'" in str(e.value)


@pytest.mark.parametrize("to, says", [("trl-sft", "SFTConfig"), ("trl-dpo", "DPOConfig"),
                                      ("llamafactory", "LLaMA-Factory, which has no GRPO"),
                                      ("autotrain", "AutoTrain, which has no GRPO")])
def test_exports_without_grpo_refuse_it(tmp_path, to, says):
    cfg = _grpo()
    dest = tmp_path / "out" / "cfg.yaml"
    with pytest.raises(ConfigError, match=says) as e:
        ex.export_text(cfg, to, dest)
    assert e.value.field == "objective" and "--to trl-grpo" in str(e.value) and "'grpo'" in str(e.value)
    assert not (tmp_path / "out").exists()   # nothing written, no dataset_info.json either


def test_format_functions_refuse_grpo():
    cfg = _grpo()
    for call in (ex.llamafactory_config, ex.llamafactory_dataset_info, ex.to_llamafactory_yaml, ex.autotrain_config,
                 ex.to_autotrain_yaml, ex.sft_config_json, ex.dpo_config_json):
        with pytest.raises(ConfigError, match="--to trl-grpo"):
            call(cfg)
    with pytest.raises(ConfigError, match="TRL's SFTConfig"):
        ex.check_not_grpo(cfg, "trl-sft")
    ex.check_not_grpo(nbt.TrainConfig(), "trl-sft")   # another objective passes


def test_training_args_and_accelerate_still_export():
    cfg = _grpo()
    notes = json.loads(ex.export_text(cfg, "training-args"))["notes"]
    assert "objective='grpo' has no TrainingArguments key" in notes["objective"] and "trl-grpo" in notes["objective"]
    assert "trl-dpo" not in notes["objective"]
    assert "distributed_type" in ex.export_text(cfg, "accelerate-config")   # a launcher, not a loss


# -----------------------------------------------------------------------------------------------------------
# the JSON, the command and a YAML round trip
# -----------------------------------------------------------------------------------------------------------
def test_json_layout():
    out = ex.grpo_config_json(_grpo(method="lora"))
    assert list(out)[:4] == ["config_class", "trainer_class", "grpo_config", "reward_funcs"]
    assert (out["config_class"], out["trainer_class"]) == ex.TRL_GRPO_CLASS[:2] == ("trl.GRPOConfig", "trl.GRPOTrainer")
    assert out["peft_config"]["r"] == 8 and "quantization_config" not in out and "training_arguments" not in out
    assert set(out["notes"]) >= ALWAYS
    assert "peft_config" not in ex.grpo_config_json(_grpo())


def test_cli_export_trl_grpo(tmp_path, capsys):
    from nbtrain.cli import main

    src = tmp_path / "cfg.yaml"
    _grpo(reward=["length:8", "exact"], reward_weights=[0.5, 1.0], num_generations=2, grpo_loss="grpo").to_yaml(src)
    assert main(["export", str(src), "--to", "trl-grpo"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward_funcs"] == ["length:8", "exact"]
    kw = out["grpo_config"]
    assert (kw["num_generations"], kw["loss_type"], kw["reward_weights"]) == (2, "grpo", [0.5, 1.0])
    assert "completion_tokens" in out["notes"]
    dest = tmp_path / "out" / "grpo.json"
    assert main(["export", str(src), "--to", "trl-grpo", "--set", "temperature=0.5", "--set",
                 "is_correction=token_truncate", "--out", str(dest)]) == 0
    assert f"wrote {dest}" in capsys.readouterr().out
    written = json.loads(dest.read_text())
    assert written["grpo_config"]["temperature"] == 0.5
    assert written["grpo_config"]["vllm_importance_sampling_mode"] == "token_truncate"
    for to in ("trl-sft", "trl-dpo", "llamafactory", "autotrain"):   # refused, with the way out
        assert main(["export", str(src), "--to", to]) == 2
        err = capsys.readouterr().err
        assert "objective" in err and "--to trl-grpo" in err
    lm = tmp_path / "lm.yaml"
    nbt.TrainConfig(data="builtin:python-docs-qa").to_yaml(lm)
    assert main(["export", str(lm), "--to", "trl-grpo"]) == 2
    err = capsys.readouterr().err
    assert "objective: 'lm'" in err and "--to trl-sft" in err
    assert "trl-grpo" in ex.GRPO_EXPORT_FORMATS and "trl-grpo" not in ex.EXPORT_FORMATS
    with pytest.raises(SystemExit):
        main(["export", str(src), "--to", "trl-nope"])
    assert "'trl-grpo'" in capsys.readouterr().err   # argparse lists the choices
    with pytest.raises(ValueError, match="trl-grpo"):
        ex.export_text(nbt.TrainConfig(), "trl-ppo")


def test_yaml_round_trip(tmp_path):
    cfg = _grpo(tmp_path, reward=["length:8", module_reward, "format:^<a>.*</a>$"], reward_weights=[1.0, 0.2, 3.0],
                sampler_precision="fp32", is_correction="token_truncate", is_cap=3.5, grpo_iterations=3,
                num_generations=2, temperature=0.8)
    path = tmp_path / "cfg.yaml"
    cfg.to_yaml(path)
    back = nbt.TrainConfig.from_yaml(path)
    assert back.reward == ["length:8", "tests.test_exports_grpo:module_reward", "format:^<a>.*</a>$"]
    assert ex.grpo_config_json(back) == ex.grpo_config_json(cfg)
    assert ex.export_text(back, "trl-grpo") == ex.export_text(cfg, "trl-grpo")


# -----------------------------------------------------------------------------------------------------------
# TRL itself, where it is installed: the names are GRPOConfig's
# -----------------------------------------------------------------------------------------------------------
def test_trl_builds_the_config(tmp_path):
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(ex.TRL_GRPO_FIELDS) <= fields
    for cfg in (_typical(tmp_path), _grpo(tmp_path, is_correction="token_truncate", precision="fp32",
                                           micro_batch_size=2, grad_accum_steps=2, eval_every=5)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)   # no deprecated name
            args = trl.GRPOConfig(**ex.grpo_config_kwargs(cfg, output_dir=str(tmp_path / "out")))
        assert (args.num_generations, args.loss_type, args.num_iterations) == \
            (cfg.num_generations, cfg.grpo_loss, cfg.grpo_iterations)
        assert args.gradient_checkpointing is cfg.gradient_checkpointing and args.scale_rewards == "group"
