"""Issue 36.6 (and the export bit of 36.3): chat data as LLaMA-Factory users have it. Templates that write text after
the last message, Jinja strings on a tokenizer without their markers, data folders of several dataset_info entries,
train_on="last" on long conversations, exports of auto-detected chat data, and exports that name the real model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

import nbtrain as nbt
from nbtrain.config import ConfigError
from nbtrain.data import DataError, load_data
from nbtrain.data import chat
from nbtrain.engine.sampling import generate
from nbtrain.integrations import exports as ex
from nbtrain.models.presets import preset_tokenizer

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does `pass` do?"},
    {"role": "assistant", "content": "Nothing: it is a placeholder statement."},
    {"role": "user", "content": "And `break`?"},
    {"role": "assistant", "content": "It leaves the innermost for or while loop."},
]
# Meta's first published Llama 3 Instruct template: the assistant's header after the last message, always
META_LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
# a template of markers no built-in list knows
OWN_MARKERS = ("{% for m in messages %}<|turn|>{{ m['role'] }}\n{{ m['content'] }}<|turn_over|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}")


@pytest.fixture
def tok():
    return preset_tokenizer("tiny")


def cfg_for(data, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return nbt.TrainConfig(model="tiny", data=str(data), precision="fp32", **kw)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def targets(ex_):
    return [t for t in ex_["labels"] if t != -100]


def ids(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------
# templates that write text after the last message
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train_on", ["completion", "last"])
def test_meta_llama3_template_targets_each_answer_and_its_eot_never_the_dangling_header(tok, train_on):
    cfg = nbt.TrainConfig(model="tiny", chat_template=META_LLAMA3, train_on=train_on)
    chat.ensure_chat_tokens(tok, cfg)
    (ex_,), counts = chat.tokenize_conversations(tok, cfg, [CONV], None)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    want = ids(tok, CONV[4]["content"]) + [eot]
    if train_on == "completion":
        want = ids(tok, CONV[2]["content"]) + [eot] + want
    assert targets(ex_) == want
    # the rendered text still ends with the header the template appends; none of it is a target
    header = ids(tok, "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ex_["input_ids"][-len(header):] == header and ex_["labels"][-len(header):] == [-100] * len(header)
    assert counts["truncated_examples"] == counts["dropped_no_answer"] == 0
    assert chat.dangling_tail(tok, META_LLAMA3) == "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_an_eos_written_after_the_last_message_is_not_a_target(tok):
    # Phi-3's template: EOS after the last message unless a generation prompt follows
    phi3 = ("{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
    cfg = nbt.TrainConfig(model="tiny", chat_template=phi3)
    chat.ensure_chat_tokens(tok, cfg)
    (ex_,), _ = chat.tokenize_conversations(tok, cfg, [CONV[1:]], None)
    assert tok.decode(targets(ex_)) == ("Nothing: it is a placeholder statement.<|end|>\n"
                                        "It leaves the innermost for or while loop.<|end|>\n")
    assert ex_["input_ids"][-1] == tok.eos_token_id and ex_["labels"][-1] == -100


def test_templates_without_a_dangling_tail_keep_their_targets(tok):
    for name in ("chatml", "llama3", "alpaca"):
        cfg = nbt.TrainConfig(model="tiny", chat_template=name)
        chat.ensure_chat_tokens(tok, cfg)
        assert chat.dangling_tail(tok, chat.resolve_template(tok, cfg)[1]) == "", name
    (ex_,), _ = chat.tokenize_conversations(tok, nbt.TrainConfig(model="tiny"), [CONV], None)
    assert tok.decode(targets(ex_)) == ("Nothing: it is a placeholder statement.<|im_end|>\n"
                                        "It leaves the innermost for or while loop.<|im_end|>\n")


# ---------------------------------------------------------------------------------------------
# a Jinja string on a tokenizer without its markers
# ---------------------------------------------------------------------------------------------
class _SaysOnly(torch.nn.Module):
    """A model whose every next token is ``token``."""

    def __init__(self, token: int, vocab: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.token, self.vocab = token, vocab

    def forward(self, input_ids, use_cache=False, past_key_values=None):
        logits = torch.zeros(1, input_ids.shape[1], self.vocab)
        logits[..., self.token] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=None)


@pytest.mark.parametrize("jinja, end", [(chat.CHATML, "<|im_end|>"), (OWN_MARKERS, "<|turn_over|>")])
def test_a_jinja_template_gets_its_markers_as_tokens_and_answers_stop_at_its_end(tok, jinja, end):
    cfg = nbt.TrainConfig(model="tiny", chat_template=jinja, max_new_tokens=20)
    assert chat.resolve_template(tok, cfg)[0] == "custom"
    assert len(ids(tok, end)) > 1   # split into pieces before
    added = chat.ensure_chat_tokens(tok, cfg)
    assert set(added) == set(chat.template_markers(jinja)) and end in added
    end_id = tok.convert_tokens_to_ids(end)
    assert ids(tok, end) == [end_id] and chat.end_of_turn_ids(tok, cfg) == {end_id}
    (ex_,), _ = chat.tokenize_conversations(tok, cfg, [CONV[1:3]], None)
    assert targets(ex_)[-2:] == [end_id, ids(tok, "\n")[0]]
    # sampling stops at the template's end of turn, as it does at EOS
    answer, n_new = generate(_SaysOnly(end_id, len(tok)), tok, cfg, "What does `pass` do?", chat=True)
    assert (answer, n_new) == ("", 1)


def test_a_chat_run_on_a_jinja_string_grows_the_embeddings_for_its_markers(tmp_path):
    from nbtrain.engine.prepare import prepare

    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}] * 4)
    st = prepare(cfg_for(f, chat_template=OWN_MARKERS, max_steps=1))
    try:
        assert len(st.tokenizer) == 2050 == st.model.get_input_embeddings().num_embeddings
        assert any("<|turn_over|>" in n for n in st.notes)
    finally:
        st.restore.close()


# ---------------------------------------------------------------------------------------------
# a LLaMA-Factory data folder of several entries
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def lf_folder(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "qa.jsonl", [{"q": f"Question {i}?", "a": f"Answer {i}."} for i in range(3)])
    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CONV]
    write_jsonl(d / "talk.jsonl", [{"conversations": share}] * 2)
    (d / "dataset_info.json").write_text(json.dumps({
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "q", "response": "a"}},
        "talk": {"file_name": "talk.jsonl", "formatting": "sharegpt"},
    }))
    return d


def test_a_data_folder_of_several_entries_needs_dataset_entry(lf_folder, tok):
    with pytest.raises(DataError) as e:
        load_data(cfg_for(lf_folder), tok)
    assert "dataset_entry" in str(e.value) and "qa, talk" in str(e.value)
    with pytest.raises(DataError, match=r"dataset_entry: 'nope' is not an entry .* its entries: qa, talk"):
        load_data(cfg_for(lf_folder, dataset_entry="nope"), tok)
    with pytest.raises(DataError, match="dataset_entry: .* data= must be that folder"):
        load_data(cfg_for(lf_folder / "qa.jsonl", dataset_entry="qa"), tok)
    with pytest.raises(ConfigError) as e:
        nbt.TrainConfig(dataset_entry=["qa", " "])
    assert e.value.field == "dataset_entry"
    assert nbt.TrainConfig(dataset_entry=" qa , talk").dataset_entry == "qa,talk"


def test_dataset_entry_reads_one_entry_or_concatenates_several(lf_folder, tok):
    one = load_data(cfg_for(lf_folder, dataset_entry="qa"), tok)
    assert one.stats["data_format"] == "alpaca" and len(one.train) == 3
    qa0 = [{"role": "user", "content": "Question 0?"}, {"role": "assistant", "content": "Answer 0."}]
    assert one.train[0] == chat.tokenize_conversations(tok, cfg_for(lf_folder), [qa0], None)[0][0]
    both = load_data(cfg_for(lf_folder, dataset_entry="talk,qa"), tok)
    assert both.stats["data_format"] == "sharegpt, alpaca" and both.stats["rows"] == 5
    talk = chat.tokenize_conversations(tok, cfg_for(lf_folder), [CONV], None)[0][0]
    assert both.train[:2] == [talk, talk] and both.train[2:] == one.train


def test_dataset_entry_round_trips_through_llamafactory(lf_folder, tmp_path):
    before = (lf_folder / "dataset_info.json").read_text()
    cfg = cfg_for(lf_folder, dataset_entry="qa,talk", chat_template="chatml", train_on="last")
    path = tmp_path / "export" / "lf.yaml"
    ex.to_llamafactory_yaml(cfg, path)
    doc = yaml.safe_load(path.read_text())
    assert (doc["stage"], doc["dataset"], doc["dataset_dir"]) == ("sft", "qa,talk", str(lf_folder))
    assert (lf_folder / "dataset_info.json").read_text() == before and not (path.parent / "dataset_info.json").exists()
    back = ex.from_llamafactory_yaml(path)
    assert (back.data, back.dataset_entry, back.data_format, back.train_on) == (str(lf_folder), "qa,talk", "auto",
                                                                               "last")


# ---------------------------------------------------------------------------------------------
# train_on="last" under truncation
# ---------------------------------------------------------------------------------------------
def _long_conversation(n: int) -> list[dict]:
    msgs = [CONV[0]]
    for i in range(n):
        msgs += [{"role": "user", "content": f"Question number {i}: what does statement {i} do?"},
                 {"role": "assistant", "content": f"Statement {i} does something rather long to explain. " * 3}]
    return msgs + [{"role": "user", "content": "Last?"}, {"role": "assistant", "content": "Yes."}]


def test_train_on_last_drops_the_earliest_turns_to_keep_the_last_answer(tok):
    conv = _long_conversation(4)
    keep2 = [conv[0]] + conv[-6:]   # the system message, the last two exchanges before the final one, and it
    cfg = nbt.TrainConfig(model="tiny", train_on="last")
    chat.ensure_chat_tokens(tok, cfg)
    (alone,), _ = chat.tokenize_conversations(tok, cfg, [keep2], None)
    max_len = len(alone["input_ids"]) + 5   # room for those, not for one more exchange
    (got,), counts = chat.tokenize_conversations(tok, cfg, [conv], max_len)
    assert got == alone and counts == {"truncated_examples": 0, "dropped_no_answer": 0, "history_trimmed": 1}
    assert tok.decode(targets(got)) == "Yes.<|im_end|>\n"
    # train_on="completion" still cuts at a turn (LLaMA-Factory without mask_history keeps the first turns)
    (first,), counts = chat.tokenize_conversations(tok, cfg.replace(train_on="completion"), [conv], max_len)
    assert counts["history_trimmed"] == 0 and counts["truncated_examples"] == 1
    assert "Statement 0" in tok.decode(targets(first)) and "Yes." not in tok.decode(targets(first))


def test_train_on_last_trimming_is_counted_in_the_run_notes(tmp_path):
    from nbtrain.engine.prepare import prepare

    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": _long_conversation(6)}, {"messages": CONV}])
    st = prepare(cfg_for(f, train_on="last", max_seq_len=96, max_steps=1))
    try:
        assert st.data.stats["history_trimmed"] == 1 and len(st.data.train) == 2
        assert any("1 conversation(s) longer than max_seq_len=96 kept their last answer" in n for n in st.notes)
    finally:
        st.restore.close()


# ---------------------------------------------------------------------------------------------
# exports of auto-detected chat data, and of the real model
# ---------------------------------------------------------------------------------------------
def test_exports_detect_the_format_of_an_auto_file_as_a_run_does(tmp_path, tok):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say hi.", "output": "Hi."}] * 2)
    cfg = nbt.TrainConfig(data=str(alpaca))   # data_format="auto"
    assert load_data(cfg, tok).stats["data_format"] == "alpaca"   # what the run does
    doc, _ = ex.llamafactory_config(cfg)
    assert doc["stage"] == "sft" and doc["train_on_prompt"] is False
    assert ex.llamafactory_dataset_info(cfg)["a"]["formatting"] == "alpaca"
    assert ex.autotrain_config(cfg)[0]["task"] == "llm-sft"
    assert ex.sft_config_kwargs(cfg)["assistant_only_loss"] is True
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "def f(): pass"}])
    assert ex.llamafactory_config(nbt.TrainConfig(data=str(text)))[0]["stage"] == "pt"
    # a dataset id is not loaded by an export: plain text, and the header says so
    assert "cannot be read here" in ex.to_llamafactory_yaml(nbt.TrainConfig(data="org/chat"))


def test_exports_name_the_hub_model_of_the_smollm2_preset_and_its_template():
    cfg = nbt.TrainConfig(model="smollm2-135m-instruct", data="builtin:python-docs-qa", method="full")
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    doc, notes = ex.llamafactory_config(cfg)
    assert (doc["model_name_or_path"], doc["template"]) == (hub, "smollm2") and "template" not in notes
    assert "chat_template" not in notes    # "auto" is written as the model's LLaMA-Factory template, not a Jinja string
    assert "Q4_1" in notes["model"] and "dequantized" in notes["model"]
    at, at_notes = ex.autotrain_config(cfg)
    assert at["base_model"] == hub and "Q4_1" in at_notes["model"]
    assert ex.training_arguments_json(cfg)["model_name_or_path"] == hub
    assert hub in ex.sft_config(cfg)[1]["model"] and hub in ex.training_arguments_notes(cfg)["model"]
    # LLaMA-Factory's smollm2 reads back as the model's own template
    back, _ = _read_back(doc)
    assert (back.model, back.chat_template) == (hub, "auto")
    # tiny stays as it was: its own name, no template (the tokenizer's), no model note
    doc, notes = ex.llamafactory_config(cfg.replace(model="tiny"))
    assert doc["model_name_or_path"] == "tiny" and "template" not in doc and "model" not in notes
    assert "model_name_or_path" not in ex.training_arguments_json(cfg.replace(model="tiny"))


def _read_back(doc):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lf.yaml"
        path.write_text(yaml.safe_dump(doc))
        return ex.read_llamafactory_yaml(path)


def test_a_gguf_model_is_named_by_its_path_with_a_note(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "m.Q8_0.gguf").write_bytes(b"GGUF")
    for model in (str(folder / "m.Q8_0.gguf"), str(folder)):
        doc, notes = ex.llamafactory_config(nbt.TrainConfig(model=model, data="builtin:python-docs-qa"))
        assert doc["model_name_or_path"] == model
        assert "cannot train from GGUF" in notes["model"] and "m.Q8_0.gguf" in notes["model"]
