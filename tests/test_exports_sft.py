"""Exports of instruction / chat configs (issue 26): LLaMA-Factory stage sft with its dataset_info.json entry,
AutoTrain llm-sft, TRL's SFTConfig keywords, and the imports back."""

import json
import warnings

import pytest
import yaml

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.integrations import exports as ex
from nbtrain.integrations.exports import (from_autotrain_yaml, from_llamafactory_yaml, to_autotrain_yaml,
                                          to_llamafactory_yaml)

FORMATS = ("alpaca", "sharegpt", "messages", "prompt-completion")
TRAIN_ON = ("completion", "last", "all")


def _chat(tmp_path, fmt="messages", **kw):
    data = tmp_path / "data" / "chat.jsonl"
    return nbt.TrainConfig(data=str(data), data_format=fmt, precision="bf16", method="lora", output_dir="runs/sft",
                           max_seq_len=256, **kw)


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # our own export has no key nbtrain cannot read back
        return fn(*a, **kw)


# -----------------------------------------------------------------------------------------------------------
# LLaMA-Factory
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train_on", TRAIN_ON)
@pytest.mark.parametrize("fmt", FORMATS)
def test_llamafactory_sft_round_trip(tmp_path, fmt, train_on):
    cfg = _chat(tmp_path, fmt, train_on=train_on, chat_template="chatml", packing=True)
    path = tmp_path / "export" / "lf.yaml"
    to_llamafactory_yaml(cfg, path)
    doc = yaml.safe_load(path.read_text())
    assert doc["stage"] == "sft" and doc["template"] == "chatml" and doc["cutoff_len"] == 256
    assert (doc["train_on_prompt"], doc["mask_history"]) == (train_on == "all", train_on == "last")
    assert doc["packing"] is True and doc["neat_packing"] is True
    assert doc["dataset"] == "chat" and doc["dataset_dir"] == str(path.parent)
    info = json.loads((path.parent / "dataset_info.json").read_text())
    assert info == ex.llamafactory_dataset_info(cfg, str(path.parent))
    back = _quiet(from_llamafactory_yaml, path)
    _, notes = ex.llamafactory_config(cfg)
    assert set(notes) == set()   # everything of this config maps
    for f in ex.LLAMAFACTORY_FIELDS:
        assert getattr(back, f) == getattr(cfg, f), f


def test_llamafactory_pt_stays_pt_for_text_and_auto_files(tmp_path):
    for kw in (dict(data_format="text"), dict(data=str(tmp_path / "c.jsonl")), dict(data="builtin:python-docs")):
        doc, _ = ex.llamafactory_config(nbt.TrainConfig(**kw))
        assert doc["stage"] == "pt" and "template" not in doc and "train_on_prompt" not in doc, kw
    # a file under "auto": the header says how to export it as instruction data
    assert "set data_format to export" in to_llamafactory_yaml(nbt.TrainConfig(data=str(tmp_path / "c.jsonl")))
    # the builtin chat set is chat data under "auto"
    qa = nbt.TrainConfig(data="builtin:python-docs-qa")
    doc, notes = ex.llamafactory_config(qa)
    assert ex.chat_format(qa) == "messages" and doc["stage"] == "sft" and "data" in notes
    assert ex.llamafactory_dataset_info(qa)["python-docs-qa"]["file_name"] == "python-docs-qa.jsonl"
    with pytest.raises(ConfigError, match="plain text"):
        ex.llamafactory_dataset_info(nbt.TrainConfig(data_format="text"))


def test_dataset_info_entry_alpaca_and_messages(tmp_path):
    alpaca = _chat(tmp_path, "alpaca", columns={"instruction": "question", "output": "answer", "system": "sys"})
    (name, entry), = ex.llamafactory_dataset_info(alpaca, str(tmp_path / "data")).items()
    assert name == "chat"
    assert entry == {"file_name": str(tmp_path / "data" / "chat.jsonl"), "formatting": "alpaca",
                     "columns": {"prompt": "question", "query": "input", "response": "answer", "system": "sys"}}
    rel = nbt.TrainConfig(data="data/chat.jsonl", data_format="messages", columns={"messages": "turns"})
    entry = ex.llamafactory_dataset_info(rel, "exports")["chat"]
    assert entry == {"file_name": "../data/chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "turns"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant", "system_tag": "system"}}
    share = ex.llamafactory_dataset_info(_chat(tmp_path, "sharegpt"))["chat"]
    assert share["formatting"] == "sharegpt" and share["columns"] == {"messages": "conversations"}
    assert (share["tags"]["role_tag"], share["tags"]["user_tag"], share["tags"]["assistant_tag"]) == \
        ("from", "human", "gpt")
    pc = ex.llamafactory_dataset_info(_chat(tmp_path, "prompt-completion"))["chat"]
    assert pc["columns"] == {"prompt": "prompt", "query": None, "response": "completion"}
    hub = ex.llamafactory_dataset_info(nbt.TrainConfig(data="org/chat", data_format="messages"))
    assert hub == {"org_chat": {**hub["org_chat"], "hf_hub_url": "org/chat"}} and "file_name" not in hub["org_chat"]


def test_dataset_info_is_merged_and_read_back_with_columns(tmp_path):
    cfg = _chat(tmp_path, "alpaca", columns={"instruction": "q", "output": "a", "history": "past"})
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "dataset_info.json").write_text(json.dumps({"other": {"file_name": "o.json"}}))
    path = tmp_path / "export" / "lf.yaml"
    to_llamafactory_yaml(cfg, path)
    info = json.loads((tmp_path / "export" / "dataset_info.json").read_text())
    assert set(info) == {"other", "chat"}   # the entry already there is kept
    back = _quiet(from_llamafactory_yaml, path)
    assert (back.data, back.data_format, back.columns) == (cfg.data, "alpaca", cfg.columns)


@pytest.mark.parametrize("template", ["auto", "llama3", "alpaca", "{% for m in messages %}{{ m.content }}{% endfor %}"])
def test_llamafactory_templates(tmp_path, template):
    cfg = _chat(tmp_path, chat_template=template)
    path = tmp_path / "lf.yaml"
    to_llamafactory_yaml(cfg, path)
    doc = yaml.safe_load(path.read_text())
    _, notes = ex.llamafactory_config(cfg)
    back = _quiet(from_llamafactory_yaml, path)
    if template in ("llama3", "alpaca"):
        assert doc["template"] == template and back.chat_template == template and not notes
    else:   # unset: LLaMA-Factory parses the tokenizer's template, nbtrain's "auto"
        assert "template" not in doc and back.chat_template == "auto"
        assert ("template" in notes) if template == "auto" else ("Jinja" in notes["chat_template"])


def test_unknown_llamafactory_template_is_named(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nstage: sft\ndataset: x/y\ntemplate: qwen\n"
                    "finetuning_type: lora\n")
    with pytest.raises(ConfigError, match="'qwen'") as e:
        from_llamafactory_yaml(path)
    assert e.value.field == "chat_template"
    assert _quiet(from_llamafactory_yaml, path, chat_template="auto").chat_template == "auto"   # chosen by name
    path.write_text("model_name_or_path: m\nstage: sft\ndataset: x/y\ntrain_on_prompt: true\nmask_history: true\n")
    with pytest.raises(ConfigError, match="train_on_prompt and mask_history"):
        from_llamafactory_yaml(path)


def test_llamafactory_hand_written_sharegpt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({
        "glaive": {"file_name": "glaive.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}},
        "odd": {"file_name": "odd.json", "formatting": "sharegpt", "tags": {"user_tag": "me", "assistant_tag": "bot"}},
    }))
    (tmp_path / "a.yaml").write_text("model_name_or_path: m\nstage: sft\ndataset: glaive\ndataset_dir: data\n"
                                     "template: llama3\nmask_history: true\nneat_packing: true\n")
    cfg, unmapped = ex.read_llamafactory_yaml(tmp_path / "a.yaml")
    assert (cfg.data, cfg.data_format, cfg.columns) == ("data/glaive.json", "sharegpt", {})
    assert (cfg.chat_template, cfg.train_on, cfg.packing) == ("llama3", "last", True) and not unmapped
    (tmp_path / "b.yaml").write_text("model_name_or_path: m\nstage: sft\ndataset: odd\ndataset_dir: data\n")
    with pytest.warns(UserWarning, match="'me'"):   # roles nbtrain does not read: named, format left to auto
        cfg = from_llamafactory_yaml(tmp_path / "b.yaml")
    assert cfg.data_format == "auto" and cfg.chat_template == "auto" and cfg.train_on == "completion"


# -----------------------------------------------------------------------------------------------------------
# AutoTrain
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template,at_name", [("chatml", "chatml"), ("auto", "tokenizer")])
def test_autotrain_sft_round_trip(tmp_path, template, at_name):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text("")   # AutoTrain reads <path>/<split>.jsonl of a file that exists
    cfg = _chat(tmp_path, "messages", chat_template=template, train_on="all", columns={"messages": "turns"},
                packing=True, eval_fraction=0.0, max_steps=None, epochs=2.0)
    doc, notes = ex.autotrain_config(cfg)
    assert doc["task"] == "llm-sft" and doc["data"]["chat_template"] == at_name
    assert doc["data"]["column_mapping"] == {"text_column": "turns"} and doc["data"]["train_split"] == "chat"
    assert set(notes) == {"output_dir"}
    path = tmp_path / "at.yaml"
    to_autotrain_yaml(cfg, path)
    back = _quiet(from_autotrain_yaml, path)
    for f in ex.AUTOTRAIN_FIELDS:
        if f not in notes:
            assert getattr(back, f) == getattr(cfg, f), f


@pytest.mark.parametrize("train_on", TRAIN_ON)
@pytest.mark.parametrize("fmt", FORMATS)
def test_autotrain_sft_notes_what_it_cannot_say(tmp_path, fmt, train_on):
    cfg = _chat(tmp_path, fmt, train_on=train_on, chat_template="llama3", packing=True, eval_fraction=0.0,
                max_steps=None, epochs=1.0)
    doc, notes = ex.autotrain_config(cfg)
    assert doc["task"] == "llm-sft" and doc["data"]["chat_template"] == "tokenizer"
    assert "'llama3' has no AutoTrain name" in notes["chat_template"]
    assert ("data_format" in notes) == (fmt != "messages")
    # AutoTrain trains every token of the rendered chat: only train_on="all" maps
    assert ("train_on" in notes) == (train_on != "all")
    path = tmp_path / "at.yaml"
    to_autotrain_yaml(cfg, path)
    back = _quiet(from_autotrain_yaml, path)
    assert (back.data_format, back.train_on, back.chat_template) == ("messages", "all", "auto")


def test_autotrain_unknown_template_is_named(tmp_path):
    path = tmp_path / "at.yaml"
    path.write_text("task: llm-sft\nbase_model: m\nproject_name: p\nbackend: local\n"
                    "data:\n  path: org/chat\n  chat_template: zephyr\n  column_mapping:\n    text_column: messages\n")
    with pytest.raises(ConfigError, match="'zephyr'"):
        from_autotrain_yaml(path)
    with pytest.warns(UserWarning, match="warmup_ratio"):   # AutoTrain's default warm-up share, named
        cfg = from_autotrain_yaml(path, chat_template="chatml")
    assert (cfg.data_format, cfg.chat_template, cfg.train_on, cfg.columns) == ("messages", "chatml", "all", {})


# -----------------------------------------------------------------------------------------------------------
# TRL SFTConfig
# -----------------------------------------------------------------------------------------------------------
def _training_args_fields():
    from transformers import TrainingArguments

    return set(TrainingArguments.__dataclass_fields__)


@pytest.mark.parametrize("train_on", TRAIN_ON)
@pytest.mark.parametrize("fmt", FORMATS + ("text",))
def test_sft_config_kwargs(tmp_path, fmt, train_on):
    cfg = nbt.TrainConfig(data=str(tmp_path / "d.jsonl"), data_format=fmt, train_on=train_on, precision="fp32",
                          max_seq_len=512, packing=True)
    kw, notes = ex.sft_config(cfg)
    assert kw == ex.sft_config_kwargs(cfg)
    # every key is a TrainingArguments field or one of SFTConfig's own (trl is not installed: its source's names)
    assert set(kw) <= _training_args_fields() | set(ex.TRL_SFT_FIELDS)
    assert kw["max_length"] == 512 and kw["packing"] is True
    assert kw["bf16"] is False and kw["fp16"] is False   # TRL would turn bf16 on for an fp32 run
    assert kw["learning_rate"] == cfg.lr and kw["logging_steps"] == cfg.log_every   # TRL's own defaults differ
    answers_only = train_on != "all"
    if fmt == "prompt-completion":
        assert kw["completion_only_loss"] is answers_only and kw["assistant_only_loss"] is False
    elif fmt == "text":
        assert kw["dataset_text_field"] == "text" and kw["packing_strategy"] == "wrapped"
        assert "completion_only_loss" not in kw and "assistant_only_loss" not in kw
        assert ("train_on" in notes) == (train_on != "completion")   # changes nothing on plain text: said
    else:
        assert kw["assistant_only_loss"] is answers_only and "completion_only_loss" not in kw
        assert ("train_on" in notes) == (train_on == "last")   # TRL has no last-turn-only loss
        assert ("data_format" in notes) == (fmt != "messages")
    from transformers import TrainingArguments

    TrainingArguments(**{k: v for k, v in kw.items() if k not in ex.TRL_SFT_FIELDS})   # the rest builds


def test_export_text_trl_sft(tmp_path):
    cfg = nbt.TrainConfig(data="builtin:python-docs-qa", method="lora", precision="bf16", chat_template="chatml")
    out = json.loads(ex.export_text(cfg, "trl-sft", tmp_path / "sft.json"))
    assert out == json.loads((tmp_path / "sft.json").read_text())
    assert out["sft_config"]["assistant_only_loss"] is True and out["sft_config"]["bf16"] is True
    assert out["peft_config"]["r"] == 8 and "chatml" in out["notes"]["chat_template"]
    assert "trl-sft" in ex.EXPORT_FORMATS


# -----------------------------------------------------------------------------------------------------------
# samples: no tool has them, every export says so
# -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["messages", "text"])
def test_notes_name_the_sample_fields(tmp_path, fmt):
    cfg = _chat(tmp_path, fmt, sample_prompts=["What does `with` do?"], sample_every=10, max_new_tokens=32)
    exports = {"llamafactory": ex.llamafactory_config(cfg)[1], "autotrain": ex.autotrain_config(cfg)[1],
               "trl": ex.sft_config(cfg)[1]}
    for name, notes in exports.items():
        assert set(ex.SAMPLE_FIELDS) <= set(notes), name
        assert "no" in notes["sample_prompts"] and "equivalent" in notes["sample_prompts"], name
    # and in the written YAML, as comments
    assert "sample_prompts=" in to_llamafactory_yaml(cfg) and "max_new_tokens=32" in to_autotrain_yaml(cfg)
    # a config without samples has no such notes
    plain = _chat(tmp_path, fmt)
    assert not set(ex.SAMPLE_FIELDS) & set(ex.llamafactory_config(plain)[1])


def test_cli_exports_trl_sft(tmp_path, capsys):
    from nbtrain.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    nbt.TrainConfig(data="builtin:python-docs-qa", data_format="messages", train_on="completion").to_yaml(cfg_path)
    assert main(["export", str(cfg_path), "--to", "trl-sft"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.dumps(out).count("assistant_only_loss") >= 1
