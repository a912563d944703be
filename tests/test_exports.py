"""Exports to TrainingArguments / LLaMA-Factory / AutoTrain / accelerate, and imports back."""

import json
import warnings

import pytest
import torch
import yaml

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.hardware import resolve_precision
from nbtrain.integrations import exports as ex
from nbtrain.integrations.exports import (from_autotrain_yaml, from_llamafactory_yaml, to_autotrain_yaml,
                                          to_llamafactory_yaml, to_training_arguments, training_args)


def _config(**kw):
    """A TrainConfig for a TrainingArguments (built for this machine), or a skip when this machine cannot run
    its precision or method. The YAML exports need no such check: a config exports anywhere."""
    caps = nbt.capabilities()
    if kw.get("precision", "fp32") not in caps.allowed_precisions:
        pytest.skip(f"precision {kw['precision']} not available here")
    if kw.get("method", "full") not in caps.allowed_methods:
        pytest.skip(f"method {kw['method']} not available here")
    return nbt.TrainConfig(**kw)


# -----------------------------------------------------------------------------------------------------------
# TrainingArguments
# -----------------------------------------------------------------------------------------------------------
def test_training_arguments_fields():
    cfg = _config(precision="bf16", method="lora", lora_targets=["q_proj", "v_proj"], lora_r=4, lora_alpha=8,
                  micro_batch_size=2, grad_accum_steps=4, lr=2e-4, weight_decay=0.01, scheduler="constant",
                  warmup_steps=3, max_steps=30, max_grad_norm=None, seed=5, log_every=2, eval_every=10,
                  gradient_checkpointing=True, save_every=15, output_dir="runs/t", data_seed=9)
    args = to_training_arguments(cfg)
    assert args.data_seed == 9
    assert args.bf16 and not args.fp16
    assert args.use_cpu == (not torch.cuda.is_available())
    assert args.optim.value == ("adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert (args.learning_rate, args.weight_decay, args.seed, args.logging_steps) == (2e-4, 0.01, 5, 2)
    assert args.lr_scheduler_type.value == "constant_with_warmup" and args.warmup_steps == 3
    assert args.max_steps == 30 and args.max_grad_norm == 0.0   # None: no clipping (the norm is still logged)
    assert args.eval_strategy.value == "steps" and args.eval_steps == 10
    assert args.save_strategy.value == "steps" and args.save_steps == 15
    # whichever name this transformers takes (5.17: gradient_checkpointing only; 5.24: activation_ preferred)
    assert getattr(args, "activation_checkpointing", False) or args.gradient_checkpointing
    assert args.output_dir == "runs/t"
    assert args.report_to in ("none", [], ["none"])
    assert not args.logging_nan_inf_filter
    lora = args.peft_config
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (4, 8, 0.05)
    assert set(lora.target_modules) == {"q_proj", "v_proj"}
    assert args.quantization_config is None
    assert ex.peft_and_quant_configs(cfg)[0].r == 4


def test_training_arguments_checkpointing_name_follows_transformers(monkeypatch):
    """transformers 5.17 (the H200's) knows only gradient_checkpointing; later 5.x prefer activation_checkpointing.
    The kwargs use the name the installed TrainingArguments takes, so the Trainer builds under either."""
    import dataclasses

    from transformers import TrainingArguments

    @dataclasses.dataclass
    class Old:   # the fields of a transformers without the rename
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: dict = None

    assert training_args._checkpointing_arg(Old) == "gradient_checkpointing"
    new = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    assert training_args._checkpointing_arg() == new
    cfg = _config(gradient_checkpointing=True, max_steps=5)
    monkeypatch.setattr(training_args, "_checkpointing_arg", lambda: "gradient_checkpointing")
    kw = ex.training_arguments_kwargs(cfg)
    assert kw["gradient_checkpointing"] is True and kw["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert not any(k.startswith("activation_checkpointing") for k in kw)


def test_training_arguments_precision_epochs_and_qlora():
    cfg = _config(precision="fp16", method="qlora", quant_bits=4, max_steps=None, epochs=2.0, scheduler="cosine")
    args = to_training_arguments(cfg, output_dir="out/x", logging_steps=7)
    assert args.fp16 and not args.bf16
    assert args.max_steps == -1 and args.num_train_epochs == 2.0
    assert args.lr_scheduler_type.value == "cosine" and args.output_dir == "out/x" and args.logging_steps == 7
    q = args.quantization_config
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_compute_dtype == torch.float16
    full = to_training_arguments(_config(precision="fp32"))
    assert not (full.fp16 or full.bf16 or full.tf32) and full.peft_config is None
    assert full.quantization_config is None and full.output_dir == "runs/hf"
    auto = to_training_arguments(nbt.TrainConfig(precision="auto"))
    resolved = resolve_precision("auto")
    for p in ("fp16", "bf16"):
        assert bool(getattr(auto, p)) == (resolved == p)


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedules_match_hf(name, warmup):
    """nbtrain's schedule (the optimizer and scheduler it hands a Trainer) is the one the exported
    TrainingArguments make the Trainer build: transformers.get_scheduler on both sides, warm-up included."""
    from transformers import get_scheduler

    def lrs(sched, opt):
        out = []
        for _ in range(12):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    cfg = nbt.TrainConfig(scheduler=name, warmup_steps=warmup, max_steps=12, lr=1.0)
    model = torch.nn.Linear(2, 2)
    opt, sched = ex.nbtrain_optimizer_and_scheduler(cfg, model, cfg.max_steps)
    ours = lrs(sched, opt)
    kw = ex.training_arguments_kwargs(cfg)
    assert kw["warmup_steps"] == warmup
    hf_opt = torch.optim.SGD(model.parameters(), lr=kw["learning_rate"])
    theirs = lrs(get_scheduler(kw["lr_scheduler_type"], hf_opt, num_warmup_steps=kw["warmup_steps"],
                               num_training_steps=kw["max_steps"]), hf_opt)
    assert ours == pytest.approx(theirs, abs=1e-12)
    if warmup:   # the warm-up is really there (Hugging Face's "constant" would ignore it)
        assert ours[0] == 0.0 and ours[warmup] == pytest.approx(1.0)
    assert ex.training_arguments_kwargs(cfg)["lr_scheduler_type"] == \
        ("constant_with_warmup" if name == "constant" and warmup else name)


def test_exports_import_nothing_from_the_engine():
    """The exports describe the run with transformers' own pieces; they sit beside the engine, not above it."""
    import ast
    from pathlib import Path

    for path in Path(ex.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "engine" not in (node.module or "").split("."), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("nbtrain.engine") for a in node.names), path.name


def _nbtrain_micro_batches(cfg):
    """The tiny model and nbtrain's micro-batches for the first max_steps steps, built as train() builds them."""
    from nbtrain.data import iter_steps, load_data
    from nbtrain.models import build_model, load_tokenizer

    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok, data.num_labels, "fp32", "cpu")
    steps = iter_steps(data.train, cfg.micro_batch_size, cfg.grad_accum_steps, cfg.seed, data.pad_token_id,
                       data.task)
    return model, [mb.model_inputs() for _ in range(cfg.max_steps) for mb in next(steps)[1]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the comparison runs the tiny model on the CPU")
@pytest.mark.parametrize("accum,scheduler,nbtrain_optimizer", [(1, "cosine", False), (2, "constant", True)])
def test_trainer_from_training_arguments_matches_nbtrain(tmp_path, accum, scheduler, nbtrain_optimizer):
    """Loss, gradient norm and learning rate of the Trainer, step by step, equal nbtrain's (warm-up included),
    with the Trainer's own optimizer and schedule or with nbtrain's."""
    from transformers import Trainer

    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=32, micro_batch_size=4,
                          grad_accum_steps=accum, max_steps=3, eval_fraction=0.0, precision="fp32", lr=1e-3,
                          max_grad_norm=1.0, scheduler=scheduler, warmup_steps=2)
    ours = nbt.train(cfg).history
    model, batches = _nbtrain_micro_batches(cfg)

    class SameBatches(Trainer):
        def get_train_dataloader(self):   # nbtrain's micro-batches, in nbtrain's order
            return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    args = to_training_arguments(cfg, output_dir=str(tmp_path), disable_tqdm=True)
    optimizers = ex.nbtrain_optimizer_and_scheduler(cfg, model, cfg.max_steps) if nbtrain_optimizer else (None, None)
    trainer = SameBatches(model=model, args=args, optimizers=optimizers)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in logs] == [1, 2, 3]
    for row, (_, rec) in zip(logs, ours.iterrows()):
        assert row["loss"] == pytest.approx(rec["loss"], rel=1e-4)
        assert row["grad_norm"] == pytest.approx(rec["grad_norm"], rel=1e-4)
        assert row["learning_rate"] == pytest.approx(rec["lr"], rel=1e-6)


# -----------------------------------------------------------------------------------------------------------
# round trips
# -----------------------------------------------------------------------------------------------------------
LF_CASES = {
    "full-fp32-steps": (dict(precision="fp32", method="full", max_steps=50, output_dir="runs/a"), {"data"}),
    "lora-bf16-epochs": (dict(precision="bf16", method="lora", lora_targets=["q_proj", "v_proj"], lora_r=16,
                              lora_alpha=32, lora_dropout=0.1, max_steps=None, epochs=2.5, warmup_steps=10,
                              scheduler="linear", micro_batch_size=2, grad_accum_steps=4, eval_fraction=0.1,
                              eval_every=20, log_every=5, subset=300, packing=True, seed=7, weight_decay=0.01,
                              max_grad_norm=None, gradient_checkpointing=True, save_every=25, output_dir="runs/b",
                              data="org/corpus", max_seq_len=256), set()),
    "qlora8-fp16-both": (dict(precision="fp16", method="qlora", quant_bits=8, scheduler="constant", warmup_steps=3,
                              max_steps=40, epochs=3.0, lr=2e-4, lora_alpha=12.5, output_dir="runs/c",
                              data="corpus.jsonl"), set()),
    "qlora4-cosine": (dict(precision="bf16", method="qlora", quant_bits=4, lora_targets=["gate_proj", "up_proj",
                                                                                       "down_proj"],
                           scheduler="cosine", warmup_steps=5, max_steps=60, eval_fraction=0.0),
                      {"data", "output_dir"}),
    "lora-quant8-unused": (dict(precision="fp32", method="lora", quant_bits=8, output_dir="runs/d", data="x/y"),
                           {"quant_bits"}),
}


@pytest.mark.parametrize("case", list(LF_CASES))
def test_llamafactory_round_trip(tmp_path, case):
    kw, expected_notes = LF_CASES[case]
    cfg = nbt.TrainConfig(**kw)   # any precision and method: a config exports on any machine
    doc, notes = ex.llamafactory_config(cfg)
    assert set(notes) == expected_notes
    path = tmp_path / "lf.yaml"
    text = to_llamafactory_yaml(cfg, path)
    assert yaml.safe_load(path.read_text()) == doc == yaml.safe_load(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # our own export has no key nbtrain cannot read back
        back = from_llamafactory_yaml(path)
    for f in ex.LLAMAFACTORY_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f
    # what LLaMA-Factory needs to run it the same way
    assert doc["stage"] == "pt" and doc["do_train"] is True and doc["packing"] == cfg.packing
    assert doc["disable_gradient_checkpointing"] == (not cfg.gradient_checkpointing)
    assert doc["finetuning_type"] == ("full" if cfg.method == "full" else "lora")
    assert ("quantization_bit" in doc) == (cfg.method == "qlora")


AT_CASES = {
    "llm-full-fp32-epochs": (dict(precision="fp32", method="full", max_steps=None, epochs=3.0, output_dir="my-run",
                                  text_column="body", seed=3, data="org/corpus"), {"packing", "eval_fraction"}),
    "llm-lora-bf16": (dict(precision="bf16", method="lora", lora_targets=["q_proj", "v_proj"], max_steps=None,
                           epochs=1.0, micro_batch_size=2, grad_accum_steps=4, scheduler="cosine",
                           max_grad_norm=None, gradient_checkpointing=True, lora_r=32, lora_alpha=64,
                           output_dir="lora-run", data="org/corpus", packing=True, log_every=3,
                           eval_fraction=0.0), set()),
    "llm-qlora8-fp16": (dict(precision="fp16", method="qlora", quant_bits=8, scheduler="constant", max_steps=None,
                             epochs=2.0, lr=1e-4, output_dir="q8", data="org/c:cfg", packing=True,
                             eval_fraction=0.0), set()),
    "llm-steps": (dict(precision="fp32", method="lora", max_steps=80, warmup_steps=8, output_dir="runs/steps",
                       data="org/corpus", packing=True, eval_fraction=0.0),
                  {"max_steps", "epochs", "warmup_steps", "output_dir"}),
}


@pytest.mark.parametrize("case", list(AT_CASES) + ["classification-local-file"])
def test_autotrain_round_trip(tmp_path, case):
    if case == "classification-local-file":
        data = tmp_path / "data" / "train.csv"
        data.parent.mkdir()
        data.write_text("text,y\nhello,0\nworld,1\n")
        kw = dict(task="sequence-classification", precision="fp16", method="full", max_steps=None, epochs=4.0,
                  label_column="y", data=str(data), max_seq_len=64, output_dir="clf", eval_fraction=0.0)
        expected_notes = set()
    else:
        kw, expected_notes = AT_CASES[case]
    cfg = nbt.TrainConfig(**kw)
    doc, notes = ex.autotrain_config(cfg)
    assert set(notes) == expected_notes
    path = tmp_path / "at.yaml"
    to_autotrain_yaml(cfg, path)
    assert yaml.safe_load(path.read_text()) == doc
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        back = from_autotrain_yaml(path)
    reported = [str(w.message) for w in rec if w.category is UserWarning]
    # only a warm-up (exported as a ratio of steps AutoTrain cannot count) comes back reported, not mapped
    assert len(reported) == ("warmup_steps" in notes)
    assert all("params.warmup_ratio" in m for m in reported)
    for f in ex.AUTOTRAIN_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f
    params = doc["params"]
    if cfg.task == "causal-lm":
        assert doc["task"] == "llm" and params["peft"] == (cfg.method != "full")
        assert params["quantization"] == {"qlora": f"int{cfg.quant_bits}"}.get(cfg.method, "none")
    else:
        assert doc["task"] == "text_multi_class_classification"
        assert doc["data"] == {"path": str(data.parent), "train_split": "train", "valid_split": None,
                               "column_mapping": {"text_column": "text", "target_column": "y"}}
    if case == "llm-steps":
        assert back.max_steps is None and params["warmup_ratio"] == pytest.approx(0.1)


def test_export_refuses_what_the_tool_cannot_run():
    clf = nbt.TrainConfig(task="sequence-classification", method="lora")
    with pytest.raises(ConfigError, match="LLaMA-Factory"):
        to_llamafactory_yaml(clf)
    with pytest.raises(ConfigError, match="AutoTrain"):
        to_autotrain_yaml(clf)


# -----------------------------------------------------------------------------------------------------------
# imports of files written by people (the tools' defaults apply; nothing is dropped silently)
# -----------------------------------------------------------------------------------------------------------
def test_llamafactory_unknown_key_warns_and_is_returned(tmp_path):
    cfg = nbt.TrainConfig(output_dir="runs/u")
    path = tmp_path / "lf.yaml"
    doc = yaml.safe_load(to_llamafactory_yaml(cfg))
    doc.update(foo_bar=1, use_dora=True)
    path.write_text(yaml.safe_dump(doc))
    with pytest.warns(UserWarning, match="foo_bar") as rec:
        back = from_llamafactory_yaml(path, lr=0.01)
    assert any("use_dora" in str(w.message) for w in rec)
    assert back.lr == 0.01 and back.output_dir == "runs/u"
    _, unmapped = ex.read_llamafactory_yaml(path)
    assert unmapped == {"foo_bar": 1, "use_dora": True}


def test_llamafactory_hand_written_file_takes_the_tools_defaults(tmp_path):
    path = tmp_path / "pt.yaml"
    path.write_text(
        "model_name_or_path: tiny\nstage: pt\ndo_train: true\nfinetuning_type: lora\nlora_rank: 8\n"
        "lora_target: all\ndataset: my_corpus\ncutoff_len: 64\nmax_samples: 100\npreprocessing_num_workers: 16\n"
        "output_dir: saves/x\nlogging_steps: 10\nsave_steps: 500\nper_device_train_batch_size: 1\n"
        "gradient_accumulation_steps: 8\nlearning_rate: 1.0e-4\nmax_steps: 200\nlr_scheduler_type: cosine\n"
        "warmup_ratio: 0.1\nbf16: true\n")
    cfg, unmapped = ex.read_llamafactory_yaml(path)
    assert unmapped == {"preprocessing_num_workers": 16}
    assert (cfg.method, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == ("lora", 8, 16, 0.0)   # alpha: 2 x rank
    assert cfg.lora_targets == "all-linear" and cfg.precision == "bf16" and cfg.lr == 1e-4
    assert cfg.warmup_steps == 20 and cfg.max_steps == 200 and cfg.epochs is None   # ceil(0.1 x 200)
    assert cfg.packing and cfg.gradient_checkpointing                             # LLaMA-Factory's defaults for pt
    assert (cfg.save_every, cfg.subset, cfg.max_seq_len, cfg.log_every) == (500, 100, 64, 10)
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.seed) == (1, 8, 42)


def test_llamafactory_dataset_info_and_sft(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(
        {"docs": {"file_name": "docs.jsonl", "columns": {"prompt": "content"}}}))
    (tmp_path / "sft.yaml").write_text("model_name_or_path: tiny\nstage: sft\ndataset: docs\ndataset_dir: data\n"
                                       "finetuning_type: full\nlr_scheduler_type: constant\nwarmup_steps: 4\n")
    cfg, unmapped = ex.read_llamafactory_yaml(tmp_path / "sft.yaml")
    # stage sft is instruction data: an entry without formatting is LLaMA-Factory's alpaca, prompt -> instruction
    assert cfg.data == "data/docs.jsonl" and cfg.task == "causal-lm"
    assert (cfg.data_format, cfg.columns, cfg.train_on) == ("alpaca", {"instruction": "content"}, "completion")
    assert set(unmapped) == {"warmup_steps"}   # "constant" ignores warm-up
    assert cfg.scheduler == "constant" and cfg.warmup_steps == 0 and not cfg.packing
    assert cfg.epochs == 3.0 and cfg.max_steps is None                 # transformers' default: 3 epochs
    (tmp_path / "dpo.yaml").write_text("model_name_or_path: tiny\nstage: dpo\ndataset: docs\n")
    with pytest.raises(ConfigError, match="stage"):
        ex.read_llamafactory_yaml(tmp_path / "dpo.yaml")
    (tmp_path / "two.yaml").write_text("model_name_or_path: tiny\nstage: pt\ndataset: a,b\n")
    with pytest.raises(ConfigError, match="several datasets"):
        ex.read_llamafactory_yaml(tmp_path / "two.yaml")
    assert ex.read_llamafactory_yaml(tmp_path / "two.yaml", data="a")[0].data == "a"


def test_autotrain_hand_written_file(tmp_path):
    path = tmp_path / "at.yaml"
    path.write_text(
        "task: llm-sft\nbase_model: tiny\nproject_name: my-proj\nlog: tensorboard\nbackend: local\n"
        "data:\n  path: org/chat\n  train_split: train\n  valid_split: null\n  chat_template: null\n"
        "  column_mapping:\n    text_column: text\n"
        "params:\n  block_size: 64\n  model_max_length: 128\n  epochs: 2\n  batch_size: 2\n  lr: 3e-5\n"
        "  peft: true\n  quantization: int4\n  target_modules: all-linear\n  padding: right\n"
        "  optimizer: paged_adamw_8bit\n  scheduler: linear\n  gradient_accumulation: 8\n"
        "  mixed_precision: bf16\n  merge_adapter: true\n  unsloth: true\n"
        "hub:\n  username: someone\n  token: hf_secret\n  push_to_hub: true\n")
    with pytest.warns(UserWarning, match="params.unsloth") as rec:
        cfg = from_autotrain_yaml(path)
    message = next(str(w.message) for w in rec if "params.unsloth" in str(w.message))
    assert all(w.filename == __file__ for w in rec)   # the warning points at the caller's line
    assert "params.unsloth" in message and "hf_secret" not in message
    _, unmapped = ex.read_autotrain_yaml(path)
    assert set(unmapped) == {"log", "params.merge_adapter", "params.unsloth",
                             "params.warmup_ratio", "hub.username", "hub.token", "hub.push_to_hub"}
    assert (cfg.method, cfg.quant_bits, cfg.precision, cfg.lr) == ("qlora", 4, "bf16", 3e-5)   # "3e-5" is a str
    assert cfg.optimizer == "paged_adamw_8bit"   # nbtrain has it (issue 27); it was unmapped before
    assert (cfg.max_seq_len, cfg.epochs, cfg.max_steps, cfg.lora_r, cfg.lora_alpha) == (64, 2.0, None, 16, 32)
    assert cfg.gradient_checkpointing and cfg.output_dir == "my-proj" and cfg.data == "org/chat"


# -----------------------------------------------------------------------------------------------------------
# accelerate and the command line
# -----------------------------------------------------------------------------------------------------------
def test_accelerate_config_loads_in_accelerate(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = nbt.TrainConfig(precision="fp32")
    ex.to_accelerate_config_yaml(cfg, tmp_path / "one.yaml")
    one = load_config_from_file(str(tmp_path / "one.yaml"))
    assert one.mixed_precision == "no" and one.distributed_type.value == "NO"
    assert one.num_processes == max(1, torch.cuda.device_count())
    ex.to_accelerate_config_yaml(cfg, tmp_path / "four.yaml", num_processes=4)
    four = load_config_from_file(str(tmp_path / "four.yaml"))
    assert four.num_processes == 4
    # several processes without CUDA: MULTI_GPU + use_cpu (accelerate starts one process for MULTI_CPU)
    assert four.distributed_type.value == "MULTI_GPU" and four.use_cpu == (not torch.cuda.is_available())


def test_cli_export(tmp_path, capsys):
    from nbtrain.cli import main

    src = tmp_path / "cfg.yaml"
    nbt.TrainConfig(method="lora", precision="fp32", output_dir="runs/cli").to_yaml(src)
    out = tmp_path / "lf.yaml"
    assert main(["export", str(src), "--to", "llamafactory", "--out", str(out), "--set", "lr=0.002"]) == 0
    back = from_llamafactory_yaml(out)
    assert back.lr == 0.002 and back.method == "lora"
    capsys.readouterr()
    assert main(["export", str(src), "--to", "training-args"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["training_arguments"]["per_device_train_batch_size"] == 8
    assert printed["peft_config"]["r"] == 8 and "quantization_config" not in printed
    from transformers import TrainingArguments

    assert TrainingArguments(**printed["training_arguments"]).max_steps == 100
    assert main(["export", str(src), "--to", "autotrain"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["params"]["peft"] is True
    assert main(["export", str(src), "--to", "accelerate-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["mixed_precision"] == "no"
    assert main(["export", str(tmp_path / "missing.yaml"), "--to", "autotrain"]) == 2


def test_nbtrain_only_speed_and_memory_options_are_noted():
    """chunked_loss, loss_chunk_tokens, compile and lean_layers have no key in either YAML format: each export
    names them in its notes rather than dropping them silently."""
    cfg = nbt.TrainConfig(precision="bf16", method="lora", output_dir="runs/x", data="org/corpus", packing=True,
                          eval_fraction=0.0, chunked_loss=True, loss_chunk_tokens=512, compile=True, lean_layers=True)
    for export in (ex.llamafactory_config, ex.autotrain_config):
        _, notes = export(cfg)
        assert set(ex.NBTRAIN_ONLY) <= set(notes), export.__name__
        assert "lean_layers=True is an nbtrain speed/memory option" in notes["lean_layers"]
    assert not set(ex.NBTRAIN_ONLY) & set(ex.llamafactory_config(nbt.TrainConfig(output_dir="runs/x"))[1])


def test_training_args_for_an_image_classifier_keep_the_head_and_the_image_column():
    """QLoRA of an image classifier leaves its head unquantised, as nbtrain's own run does, and the Trainer
    keeps the image column for the transform that makes pixel values."""
    import nbtrain as nbt
    from nbtrain.integrations.exports.training_args import peft_and_quant_configs, training_arguments_kwargs

    cfg = nbt.TrainConfig(model="tiny-vit", task="image-classification", data="builtin:digits", method="qlora")
    assert training_arguments_kwargs(cfg)["remove_unused_columns"] is False
    lcfg, qcfg = peft_and_quant_configs(cfg)
    assert qcfg.llm_int8_skip_modules and "classifier" in qcfg.llm_int8_skip_modules
    assert lcfg.task_type is None
