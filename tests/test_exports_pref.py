"""Exports and imports of preference tuning (issue 38.5): LLaMA-Factory stage dpo with a ranking dataset_info.json
entry, AutoTrain llm-dpo / llm-orpo with its column mapping, TRL's DPOConfig (ORPOConfig / CPOConfig for ORPO and
SimPO) through ``nbtrain export --to trl-dpo``, and what each format cannot say, named in the notes."""

import json
import warnings

import pytest
import yaml

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.integrations import exports as ex
from nbtrain.integrations.exports import (from_autotrain_yaml, from_llamafactory_yaml, read_autotrain_yaml,
                                          read_llamafactory_yaml, to_autotrain_yaml, to_llamafactory_yaml)

OBJECTIVES = ("dpo", "orpo", "simpo")
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "system_tag": "system"}
# per layout: the config's columns, and the ranking entry LLaMA-Factory must get for them
LAYOUTS = {
    "preference": ({"prompt": "question", "chosen": "good", "rejected": "bad"},
                   {"formatting": "alpaca", "ranking": True,
                    "columns": {"prompt": "question", "query": None, "chosen": "good", "rejected": "bad"}}),
    "alpaca": ({"instruction": "q", "chosen": "good", "rejected": "bad", "system": "sys"},
               {"formatting": "alpaca", "ranking": True,
                "columns": {"prompt": "q", "query": "input", "chosen": "good", "rejected": "bad", "system": "sys"}}),
    "sharegpt": ({"conversations": "turns", "chosen": "good", "rejected": "bad"},
                 {"formatting": "sharegpt", "ranking": True,
                  "columns": {"messages": "turns", "chosen": "good", "rejected": "bad"}, "tags": SHAREGPT_TAGS}),
}


def _pref(tmp_path, objective="dpo", fmt="preference", **kw):
    kw = {"columns": LAYOUTS[fmt][0], "precision": "bf16", "method": "lora", "output_dir": "runs/pref",
          "max_seq_len": 256, **kw}
    return nbt.TrainConfig(data=str(tmp_path / "data" / "pairs.jsonl"), data_format=fmt, objective=objective, **kw)


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # our own export has no key nbtrain cannot read back
        return fn(*a, **kw)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -----------------------------------------------------------------------------------------------------------
# LLaMA-Factory
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(LAYOUTS))
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_llamafactory_round_trip(tmp_path, objective, fmt):
    gamma = 0.8 if objective == "simpo" else 0.5   # simpo_gamma is written for simpo only
    cfg = _pref(tmp_path, objective, fmt, pref_beta=0.25, simpo_gamma=gamma, chat_template="chatml")
    path = tmp_path / "export" / "lf.yaml"
    to_llamafactory_yaml(cfg, path)
    doc = yaml.safe_load(path.read_text())
    want_loss = {"dpo": "sigmoid", "orpo": "orpo", "simpo": "simpo"}[objective]
    assert (doc["stage"], doc["pref_loss"], doc["pref_beta"]) == ("dpo", want_loss, 0.25)
    assert doc.get("simpo_gamma") == (0.8 if objective == "simpo" else None)
    assert "train_on_prompt" not in doc and "mask_history" not in doc   # the answers only: nothing to say
    assert doc["dataset"] == "pairs" and doc["template"] == "chatml" and doc["packing"] is False
    info = json.loads((path.parent / "dataset_info.json").read_text())
    assert info == {"pairs": {"file_name": str(tmp_path / "data" / "pairs.jsonl"), **LAYOUTS[fmt][1]}}
    _, notes = ex.llamafactory_config(cfg, str(path.parent))
    back = _quiet(from_llamafactory_yaml, path)
    assert (back.objective, back.pref_beta, back.simpo_gamma) == (objective, 0.25, gamma)
    assert (back.data, back.data_format, back.columns) == (cfg.data, fmt, cfg.columns)
    for f in ex.LLAMAFACTORY_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f
    assert ("conversational" in notes) == (fmt == "preference")   # TRL's message lists need converting
    assert set(notes) <= {"conversational"}


def test_llamafactory_notes_what_stage_dpo_cannot_say(tmp_path):
    cfg = _pref(tmp_path, "dpo", method="full", precompute_ref=True, simpo_gamma=0.9, train_on="all")
    path = tmp_path / "lf.yaml"
    text = to_llamafactory_yaml(cfg, path)
    _, notes = ex.llamafactory_config(cfg)
    assert "no LLaMA-Factory key" in notes["precompute_ref"] and "frozen copy" in notes["precompute_ref"]
    assert "only applies to objective='simpo'" in notes["simpo_gamma"]
    assert "final answers only" in notes["train_on"]
    assert "precompute_ref=True has no LLaMA-Factory key" in text   # as a comment in the file
    doc = yaml.safe_load(text)
    assert "simpo_gamma" not in doc and "train_on_prompt" not in doc
    back = _quiet(from_llamafactory_yaml, path)
    # what the notes name does not come back; the rest does
    assert (back.precompute_ref, back.simpo_gamma, back.train_on) == (False, 0.5, "completion")
    assert (back.objective, back.method) == ("dpo", "full")


def test_llamafactory_ranking_folder_by_dataset_entry(tmp_path):
    folder = tmp_path / "lf_data"
    rows = [{"instruction": "What does `pass` do?", "input": "", "chosen": "Nothing.", "rejected": "It loops."}]
    _write(folder / "pairs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    talk = [{"conversations": [{"from": "human", "value": "Hi?"}], "chosen": {"from": "gpt", "value": "Hello."},
             "rejected": {"from": "gpt", "value": "Go away."}}]
    _write(folder / "talk.json", json.dumps(talk))
    entries = {"pairs": {"file_name": "pairs.jsonl", "ranking": True,
                         "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                     "rejected": "rejected"}},
               "talk": {"file_name": "talk.json", "formatting": "sharegpt", "ranking": True,
                        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}}
    _write(folder / "dataset_info.json", json.dumps(entries))
    before = (folder / "dataset_info.json").read_text()
    for names in ("pairs", "pairs,talk"):
        cfg = nbt.TrainConfig(model="tiny", data=str(folder), dataset_entry=names, objective="orpo", pref_beta=0.3,
                              precision="fp32", output_dir="runs/lf")
        assert ex.llamafactory_dataset_info(cfg) == {n: entries[n] for n in names.split(",")}   # as they are
        path = tmp_path / "export" / f"{names.replace(',', '_')}.yaml"
        to_llamafactory_yaml(cfg, path)
        doc = yaml.safe_load(path.read_text())
        assert (doc["stage"], doc["pref_loss"], doc["pref_beta"]) == ("dpo", "orpo", 0.3)
        assert (doc["dataset"], doc["dataset_dir"]) == (names, str(folder))
        assert (folder / "dataset_info.json").read_text() == before   # the folder's own file is left alone
        assert not (path.parent / "dataset_info.json").exists()
        back = _quiet(from_llamafactory_yaml, path)
        assert (back.objective, back.pref_beta) == ("orpo", 0.3)
        if names == "pairs":   # one entry reads back as its file, with the entry's layout
            assert (back.data, back.data_format, back.dataset_entry) == (str(folder / "pairs.jsonl"), "alpaca", None)
        else:
            assert (back.data, back.dataset_entry, back.data_format) == (str(folder), "pairs,talk", "auto")


def test_llamafactory_hand_written_stage_dpo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "data" / "dataset_info.json", json.dumps({
        "dpo_en": {"file_name": "dpo_en.json", "formatting": "sharegpt", "ranking": True,
                   "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
        "plain": {"file_name": "plain.json", "columns": {"prompt": "instruction", "response": "output"}},
    }))
    base = "model_name_or_path: m\nstage: dpo\nfinetuning_type: lora\ndataset_dir: data\n"
    path = _write(tmp_path / "a.yaml", base + "dataset: dpo_en\npref_beta: 0.2\npref_loss: sigmoid\n"
                                               "pref_ftx: 0\ndpo_label_smoothing: 0.0\n")
    cfg, unmapped = read_llamafactory_yaml(path)
    assert (cfg.objective, cfg.pref_beta, cfg.data, cfg.data_format) == ("dpo", 0.2, "data/dpo_en.json", "sharegpt")
    assert not unmapped   # pref_ftx and label smoothing off: what nbtrain runs
    # missing keys take LLaMA-Factory's defaults: pref_loss sigmoid, pref_beta 0.1
    cfg = _quiet(from_llamafactory_yaml, _write(tmp_path / "b.yaml", base + "dataset: dpo_en\n"))
    assert (cfg.objective, cfg.pref_beta, cfg.simpo_gamma) == ("dpo", 0.1, 0.5)
    # what nbtrain does not run is named, never dropped
    path = _write(tmp_path / "c.yaml", base + "dataset: dpo_en\npref_ftx: 0.5\nref_model: other/model\n"
                                               "train_on_prompt: true\n")
    with pytest.warns(UserWarning, match="pref_ftx=0.5") as w:
        cfg = from_llamafactory_yaml(path)
    message = str(w[0].message)
    assert "ref_model='other/model'" in message and "train_on_prompt=True" in message
    assert cfg.objective == "dpo"
    # a loss nbtrain has not, and a dataset of the wrong kind for the stage, are errors naming the field
    with pytest.raises(ConfigError, match="pref_loss: 'ipo'") as e:
        from_llamafactory_yaml(_write(tmp_path / "d.yaml", base + "dataset: dpo_en\npref_loss: ipo\n"))
    assert e.value.field == "objective"
    with pytest.raises(ConfigError, match=r"stage dpo needs a preference dataset") as e:
        from_llamafactory_yaml(_write(tmp_path / "e.yaml", base + "dataset: plain\n"))
    assert e.value.field == "data"
    # without dataset_dir, the names are looked up where LLaMA-Factory looks: its default ./data
    no_dir = "model_name_or_path: m\nstage: dpo\nfinetuning_type: lora\n"
    cfg = _quiet(from_llamafactory_yaml, _write(tmp_path / "g.yaml", no_dir + "dataset: dpo_en\n"))
    assert (cfg.data, cfg.data_format) == ("data/dpo_en.json", "sharegpt")
    with pytest.raises(ConfigError, match=r"stage dpo needs a preference dataset"):
        from_llamafactory_yaml(_write(tmp_path / "h.yaml", no_dir + "dataset: plain\n"))
    with pytest.raises(ConfigError, match=r"\"ranking\": true\) trains with stage dpo"):
        from_llamafactory_yaml(_write(tmp_path / "f.yaml", base.replace("dpo", "sft") + "dataset: dpo_en\n"))


def test_llamafactory_objective_lm_has_no_preference_keys(tmp_path):
    for cfg in (nbt.TrainConfig(data="builtin:python-docs-qa"), nbt.TrainConfig(data="builtin:python-docs"),
                _pref(tmp_path, "dpo", "alpaca").replace(objective="lm", columns={})):
        doc, notes = ex.llamafactory_config(cfg)
        assert doc["stage"] in ("sft", "pt") and not {"pref_loss", "pref_beta", "simpo_gamma"} & set(doc)
        assert not set(ex.PREF_FIELDS) & set(notes)
    entry = ex.llamafactory_dataset_info(_pref(tmp_path, "dpo", "alpaca").replace(objective="lm", columns={}))
    assert "ranking" not in entry["pairs"] and entry["pairs"]["columns"]["response"] == "output"


# -----------------------------------------------------------------------------------------------------------
# AutoTrain
# -----------------------------------------------------------------------------------------------------------
def _at(tmp_path, objective, **kw):
    _write(tmp_path / "data" / "pairs.jsonl", "")   # AutoTrain reads <path>/<split>.jsonl of a file that exists
    return _pref(tmp_path, objective, max_steps=None, epochs=2.0, eval_fraction=0.0, **kw)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_autotrain_round_trip(tmp_path, objective):
    cfg = _at(tmp_path, objective, pref_beta=0.1 if objective == "orpo" else 0.3)
    doc, notes = ex.autotrain_config(cfg)
    assert doc["task"] == f"llm-{objective}"
    assert doc["data"]["column_mapping"] == {"prompt_text_column": "question", "text_column": "good",
                                             "rejected_text_column": "bad"}
    assert doc["data"]["chat_template"] == "tokenizer" and doc["data"]["train_split"] == "pairs"
    assert doc["params"]["block_size"] == 256 and doc["params"]["max_prompt_length"] == 128
    assert doc["params"].get("dpo_beta") == (0.3 if objective == "dpo" else None)   # llm-orpo does not read it
    assert set(notes) == {"output_dir", "conversational", "truncation"}
    path = tmp_path / "at.yaml"
    to_autotrain_yaml(cfg, path)
    back = _quiet(from_autotrain_yaml, path)
    assert (back.objective, back.pref_beta, back.data_format, back.columns) == \
        (objective, cfg.pref_beta, "preference", cfg.columns)
    for f in ex.AUTOTRAIN_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


def test_autotrain_notes_orpo_lambda_and_precompute(tmp_path):
    orpo = _at(tmp_path, "orpo", pref_beta=0.5)
    _, notes = ex.autotrain_config(orpo)
    assert "default beta 0.1" in notes["pref_beta"] and "not exported" in notes["pref_beta"]
    path = tmp_path / "orpo.yaml"
    to_autotrain_yaml(orpo, path)
    assert _quiet(from_autotrain_yaml, path).pref_beta == 0.1   # what AutoTrain would run
    dpo = _at(tmp_path, "dpo", method="full", precompute_ref=True, columns={})
    doc, notes = ex.autotrain_config(dpo)
    assert "no AutoTrain key" in notes["precompute_ref"]
    assert doc["data"]["column_mapping"] == {"prompt_text_column": "prompt", "text_column": "chosen",
                                             "rejected_text_column": "rejected"}
    alpaca = _at(tmp_path, "dpo", fmt="alpaca")
    doc, notes = ex.autotrain_config(alpaca)
    assert doc["data"]["column_mapping"]["prompt_text_column"] == "q" and "convert the alpaca" in notes["data_format"]


def test_autotrain_refuses_simpo(tmp_path):
    with pytest.raises(ConfigError, match="AutoTrain has no SimPO") as e:
        ex.autotrain_config(_at(tmp_path, "simpo"))
    assert e.value.field == "objective" and "trl-dpo" in str(e.value) and "llamafactory" in str(e.value)
    with pytest.raises(ConfigError, match="no SimPO"):
        ex.export_text(_at(tmp_path, "simpo"), "autotrain")


def test_autotrain_hand_written_dpo_and_orpo(tmp_path):
    # AutoTrain's own example (configs/llm_finetuning/llama3-8b-dpo-qlora.yml), trimmed
    text = ("task: llm-dpo\nbase_model: meta-llama/Meta-Llama-3-8B-Instruct\nproject_name: p\nlog: none\n"
            "backend: local\ndata:\n  path: mlabonne/orpo-dpo-mix-40k\n  train_split: train\n  valid_split: null\n"
            "  chat_template: chatml\n  column_mapping:\n    text_column: chosen\n    rejected_text_column: rejected\n"
            "    prompt_text_column: prompt\nparams:\n  block_size: 1024\n  model_max_length: 2048\n"
            "  max_prompt_length: 512\n  epochs: 3\n  batch_size: 2\n  lr: 3e-5\n  peft: true\n"
            "  quantization: int4\n  target_modules: all-linear\n  padding: right\n  optimizer: adamw_torch\n"
            "  scheduler: linear\n  gradient_accumulation: 4\n  mixed_precision: fp16\n  warmup_ratio: 0.0\n")
    path = _write(tmp_path / "dpo.yaml", text)
    cfg, unmapped = read_autotrain_yaml(path)
    assert (cfg.objective, cfg.pref_beta, cfg.data_format, cfg.columns) == ("dpo", 0.1, "preference", {})
    assert (cfg.method, cfg.quant_bits, cfg.precision, cfg.chat_template, cfg.max_seq_len) == \
        ("qlora", 4, "fp16", "chatml", 1024)
    assert not unmapped   # its prompt limit is half of block_size, what nbtrain's export writes
    # AutoTrain's default prompt limit (128) is another: named, never dropped
    short = _write(tmp_path / "short.yaml", text.replace("  max_prompt_length: 512\n", ""))
    with pytest.warns(UserWarning, match=r"params.max_prompt_length=128 \(AutoTrain's default; TRL cuts prompts"):
        from_autotrain_yaml(short)
    orpo = _write(tmp_path / "orpo.yaml",
                  text.replace("llm-dpo", "llm-orpo").replace("  lr:", "  dpo_beta: 0.3\n  lr:"))
    with pytest.warns(UserWarning, match=r"dpo_beta=0.3 \(llm-orpo does not pass dpo_beta on"):
        cfg = from_autotrain_yaml(orpo)
    assert (cfg.objective, cfg.pref_beta) == ("orpo", 0.1)
    raw = _write(tmp_path / "raw.yaml", text.replace("chat_template: chatml", "chat_template: null"))
    with pytest.warns(UserWarning, match="raw text, without a chat template"):
        assert from_autotrain_yaml(raw).chat_template == "auto"
    missing = _write(tmp_path / "missing.yaml", text.replace("    prompt_text_column: prompt\n", ""))
    with pytest.raises(ConfigError, match="prompt_text_column: missing") as e:
        from_autotrain_yaml(missing)
    assert e.value.field == "columns"


# -----------------------------------------------------------------------------------------------------------
# TRL: DPOConfig (ORPOConfig / CPOConfig)
# -----------------------------------------------------------------------------------------------------------
def _training_args_fields():
    from transformers import TrainingArguments

    return set(TrainingArguments.__dataclass_fields__)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_trl_config_keywords_and_read_back(tmp_path, objective):
    cfg = _pref(tmp_path, objective, method="full", precision="fp32", pref_beta=0.2,
                simpo_gamma=1.5 if objective == "simpo" else 0.5, precompute_ref=objective == "dpo", columns={})
    kw, notes = ex.dpo_config(cfg)
    assert kw == ex.dpo_config_kwargs(cfg)
    cls, trainer, key = ex.trl_pref_class(cfg)
    own = ex.TRL_PREF_FIELDS[objective]
    assert set(kw) <= _training_args_fields() | set(own) and set(own) <= set(kw)
    assert (kw["beta"], kw["max_length"], kw["bf16"], kw["fp16"]) == (0.2, 256, False, False)
    assert kw["disable_dropout"] is False   # nbtrain keeps the model's dropout while training; TRL turns it off
    assert kw["learning_rate"] == cfg.lr and kw["logging_steps"] == cfg.log_every   # TRL's own defaults differ
    if objective == "dpo":
        assert (cls, key) == ("trl.DPOConfig", "dpo_config")
        assert (kw["loss_type"], kw["precompute_ref_log_probs"]) == ("sigmoid", True) and "objective" not in notes
    elif objective == "orpo":
        assert cls == "trl.experimental.orpo.ORPOConfig" and "lambda" in notes["objective"]
    else:
        assert cls == "trl.experimental.cpo.CPOConfig"
        assert (kw["loss_type"], kw["cpo_alpha"], kw["simpo_gamma"]) == ("simpo", 0.0, 1.5)
        assert "cpo_alpha=0.0" in notes["objective"]
    back, unmapped = ex.pref_fields_from_trl(cls, kw)
    assert not unmapped
    assert (back["objective"], back["pref_beta"], back["max_seq_len"]) == (objective, 0.2, 256)
    assert back.get("precompute_ref", False) == cfg.precompute_ref
    assert back.get("simpo_gamma", 0.5) == cfg.simpo_gamma
    assert cfg.replace(**back) == cfg   # the preference fields come back whole
    from transformers import TrainingArguments

    TrainingArguments(**{k: v for k, v in kw.items() if k not in own})   # the rest builds


def test_trl_notes_and_what_does_not_read_back(tmp_path):
    cfg = _pref(tmp_path, "dpo", fmt="alpaca", chat_template="llama3")
    _, notes = ex.dpo_config(cfg)
    assert "convert the alpaca ranking rows" in notes["data_format"]
    assert "fixed names (prompt, chosen, rejected)" in notes["columns"]
    assert "'llama3'" in notes["chat_template"] and "keep_start" in notes["truncation"]
    # a loss or term nbtrain does not run is unmapped, with why
    _, unmapped = ex.pref_fields_from_trl("DPOConfig", {"beta": 0.1, "loss_type": "ipo", "label_smoothing": 0.1})
    assert set(unmapped) == {"loss_type", "label_smoothing"} and "sigmoid" in unmapped["loss_type"][1]
    _, unmapped = ex.pref_fields_from_trl("trl.experimental.cpo.CPOConfig", {"loss_type": "simpo"})
    assert set(unmapped) == {"cpo_alpha"}   # CPOConfig's default 1.0 adds an NLL term: not plain SimPO
    with pytest.raises(ConfigError, match="KTOConfig"):
        ex.pref_fields_from_trl("trl.KTOConfig", {})


def test_trl_sft_and_trl_dpo_refuse_the_other_objective(tmp_path):
    with pytest.raises(ConfigError, match="--to trl-dpo") as e:
        ex.sft_config(_pref(tmp_path, "dpo"))
    assert e.value.field == "objective"
    with pytest.raises(ConfigError, match="--to trl-sft") as e:
        ex.export_text(nbt.TrainConfig(data="builtin:python-docs-qa"), "trl-dpo")
    assert e.value.field == "objective"


def test_training_arguments_name_the_objective(tmp_path):
    cfg = _pref(tmp_path, "simpo", pref_beta=2.0)
    notes = ex.training_arguments_notes(cfg)
    assert "objective='simpo' has no TrainingArguments key" in notes["objective"] and "trl-dpo" in notes["objective"]
    assert "objective" in json.loads(ex.export_text(cfg, "training-args"))["notes"]
    assert "objective" not in ex.training_arguments_notes(nbt.TrainConfig())


# -----------------------------------------------------------------------------------------------------------
# the command
# -----------------------------------------------------------------------------------------------------------
def test_cli_export_trl_dpo(tmp_path, capsys):
    from nbtrain.cli import main

    src = tmp_path / "cfg.yaml"
    nbt.TrainConfig(data="builtin:python-docs-pref", objective="dpo", pref_beta=0.2, method="lora",
                    precision="fp32", max_seq_len=192).to_yaml(src)
    assert main(["export", str(src), "--to", "trl-dpo"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["config_class"], out["trainer_class"]) == ("trl.DPOConfig", "trl.DPOTrainer")
    assert (out["dpo_config"]["beta"], out["dpo_config"]["loss_type"], out["dpo_config"]["max_length"]) == \
        (0.2, "sigmoid", 192)
    assert out["peft_config"]["r"] == 8 and "truncation" in out["notes"]
    dest = tmp_path / "out" / "cpo.json"
    assert main(["export", str(src), "--to", "trl-dpo", "--set", "objective=simpo", "--set", "simpo_gamma=1.0",
                 "--out", str(dest)]) == 0
    written = json.loads(dest.read_text())
    assert written["config_class"] == "trl.experimental.cpo.CPOConfig" and written["cpo_config"]["simpo_gamma"] == 1.0
    assert "dpo_config" not in written
    capsys.readouterr()
    assert main(["export", str(src), "--to", "trl-dpo", "--set", "objective=lm"]) == 2   # refused, with the way out
    assert "--to trl-sft" in capsys.readouterr().err
    assert "trl-dpo" in ex.PREF_EXPORT_FORMATS and "trl-dpo" not in ex.EXPORT_FORMATS   # not for every config
    with pytest.raises(ValueError, match="trl-dpo"):
        ex.export_text(nbt.TrainConfig(), "trl-kto")
    assert main(["export", str(src), "--to", "autotrain", "--set", "objective=simpo"]) == 2
    assert "no SimPO" in capsys.readouterr().err
