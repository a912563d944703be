"""Issue 26, the data side: chat / instruction formats, templates, answer masks, truncation, packing, the QA builtin."""

from __future__ import annotations

import json

import pytest
import torch

import nbtrain as nbt
from nbtrain.data import DataError, collate, load_data
from nbtrain.data import chat
from nbtrain.data.builtin import builtin_rows
from nbtrain.models.presets import preset_tokenizer

CONV = [  # multi-turn, with a system prompt: what alpaca's history and sharegpt's turns both become
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does `pass` do?"},
    {"role": "assistant", "content": "Nothing: it is a placeholder statement."},
    {"role": "user", "content": "And `break`?"},
    {"role": "assistant", "content": "It leaves the innermost for or while loop."},
]


def cfg_for(data, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return nbt.TrainConfig(model="tiny", data=str(data), precision="fp32", **kw)


@pytest.fixture
def tok():
    return preset_tokenizer("tiny")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def decoded_targets(tok, ex):
    return tok.decode([t for t in ex["labels"] if t != -100])


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------
def test_alpaca_with_system_input_and_history_becomes_the_conversation(tmp_path, tok):
    rows = [{"system": "You are terse.", "history": [["What does `pass` do?", "Nothing: it is a placeholder statement."]],
             "instruction": "And", "input": "`break`?", "output": "It leaves the innermost for or while loop."}]
    f = tmp_path / "a.json"
    f.write_text(json.dumps(rows), encoding="utf-8")
    b = load_data(cfg_for(f), tok)
    assert b.stats["data_format"] == "alpaca" and b.stats["chat_template"] == "chatml"
    expect, _ = chat.tokenize_conversations(tok, cfg_for(f), [CONV[:3] + [{"role": "user", "content": "And\n`break`?"},
                                                                         CONV[4]]], None)
    assert b.train[0] == expect[0]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_sharegpt_messages_and_prompt_completion_read_from_files(tmp_path, tok, suffix):
    import pandas as pd

    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CONV]
    cases = {
        "sharegpt": ({"conversations": share}, CONV),
        "messages": ({"messages": CONV}, CONV),
        "prompt-completion": ({"prompt": "What does `pass` do?", "completion": "Nothing."},
                              [{"role": "user", "content": "What does `pass` do?"},
                               {"role": "assistant", "content": "Nothing."}]),
    }
    for fmt, (row, conv) in cases.items():
        f = tmp_path / f"{fmt}.{suffix}"
        if suffix == "jsonl":
            write_jsonl(f, [row, row])
        else:
            pd.DataFrame([row, row]).to_parquet(f)
        b = load_data(cfg_for(f), tok)
        assert b.stats["data_format"] == fmt, fmt
        expect, _ = chat.tokenize_conversations(tok, cfg_for(f), [conv], None)
        assert b.train[0] == expect[0], fmt


def test_trl_conversational_prompt_completion_and_csv(tmp_path, tok):
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": CONV[:4], "completion": [CONV[4]]}])
    b = load_data(cfg_for(f), tok)
    assert decoded_targets(tok, b.train[0]).count("<|im_end|>") == 2   # both assistant turns of the prompt too
    c = tmp_path / "pc.csv"
    c.write_text("question,answer\nWhat does `pass` do?,Nothing.\nAnd break?,It leaves the loop.\n", encoding="utf-8")
    b = load_data(cfg_for(c, columns={"prompt": "question", "completion": "answer"}), tok)
    assert b.stats["data_format"] == "prompt-completion" and len(b.train) == 2
    assert decoded_targets(tok, b.train[1]) == "It leaves the loop.<|im_end|>\n"


def test_dataset_info_json_gives_formatting_columns_and_tags(tmp_path, tok):
    turns = [{"role": {"system": "system", "user": "asker", "assistant": "helper"}[m["role"]], "text": m["content"]}
             for m in CONV]
    write_jsonl(tmp_path / "chats.jsonl", [{"dialog": turns}] * 3)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {
        "file_name": "chats.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
        "tags": {"role_tag": "role", "content_tag": "text", "user_tag": "asker", "assistant_tag": "helper"}}}))
    for data in (tmp_path, tmp_path / "chats.jsonl"):   # the folder, and the file in it
        b = load_data(cfg_for(data), tok)
        assert b.stats["data_format"] == "sharegpt" and len(b.train) == 3
        expect, _ = chat.tokenize_conversations(tok, cfg_for(data), [CONV], None)
        assert b.train[0] == expect[0]


def test_auto_keeps_plain_text_on_the_text_path(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "def f(): pass"}, {"text": "for x in y: pass"}])
    b = load_data(cfg_for(f), tok)
    assert "labels" not in b.train[0] and "data_format" not in b.stats
    assert len(tok) == 2048   # no chat tokens added for plain text


@pytest.mark.parametrize("conversation, words", [
    ([{"content": "hi"}, {"role": "assistant", "content": "x"}], ["row 1", "messages[0]", "no role"]),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
     ["row 1", "messages", "two user turns"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}], ["row 1", "messages[1].content",
                                                                                  "empty"]),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], ["row 1", "messages[1].role", "wizard",
                                                                               "unknown role"]),
    ([{"role": "user", "content": "a"}], ["row 1", "messages", "assistant"]),
])
def test_bad_rows_are_a_data_error_naming_row_and_field(tmp_path, tok, conversation, words):
    good = {"messages": CONV}
    f = write_jsonl(tmp_path / "bad.jsonl", [good, {"messages": conversation}, good])
    with pytest.raises(DataError) as e:
        load_data(cfg_for(f), tok)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_alpaca_empty_output_and_missing_column(tmp_path, tok):
    f = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "output": "a"}, {"instruction": "q", "output": ""}])
    with pytest.raises(DataError, match=r"row 1: field 'output' is empty"):
        load_data(cfg_for(f), tok)
    with pytest.raises(DataError, match=r"needs column\(s\) 'conversations'"):
        load_data(cfg_for(f, data_format="sharegpt"), tok)


# ---------------------------------------------------------------------------------------------
# masks, against an independent computation
# ---------------------------------------------------------------------------------------------
def _independent_targets(tok, jinja, conv, train_on):
    """Target positions by re-tokenizing the rendered prefixes before and through each assistant turn."""
    n = len(tok(chat.render(tok, jinja, [conv])[0], add_special_tokens=False)["input_ids"])
    if train_on == "all":
        return set(range(n))
    turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    if train_on == "last":
        turns = turns[-1:]
    out = set()
    for i in turns:
        a = len(tok(chat.render(tok, jinja, [conv[:i]], True)[0], add_special_tokens=False)["input_ids"])
        b = len(tok(chat.render(tok, jinja, [conv[: i + 1]])[0], add_special_tokens=False)["input_ids"])
        out |= set(range(a, b))
    return out


# llama3 is left out here: the tiny BPE merges the header's "\n\n" alone but splits it before a word, so its prefix
# re-tokenizes differently at that one boundary; the generation-tag check below covers llama3
@pytest.mark.parametrize("template", ["chatml", "alpaca"])
@pytest.mark.parametrize("train_on", ["completion", "last", "all"])
def test_masks_equal_retokenized_prefixes(tok, template, train_on):
    cfg = nbt.TrainConfig(model="tiny", chat_template=template, train_on=train_on)
    chat.ensure_chat_tokens(tok, cfg)
    jinja = chat.resolve_template(tok, cfg)[1]
    convs = [CONV, CONV[1:], CONV[:3], [CONV[1], {"role": "assistant", "content": "ok" * 30}]]
    exs, counts = chat.tokenize_conversations(tok, cfg, convs, None)
    assert counts == {"truncated_examples": 0, "dropped_no_answer": 0, "history_trimmed": 0}
    for conv, ex in zip(convs, exs):
        got = {j for j, t in enumerate(ex["labels"]) if t != -100}
        assert got == _independent_targets(tok, jinja, conv, train_on)
        assert all(ex["labels"][j] == ex["input_ids"][j] for j in got)


GENERATION = {   # the built-in templates with the assistant's content and end marker in {% generation %}
    "chatml": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
               "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
               "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"),
    "llama3": ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
               "\n\n{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|eot_id|>"
               "{% endgeneration %}{% else %}{{ message['content'] }}<|eot_id|>{% endif %}{% endfor %}"),
    "alpaca": ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
               "{% elif message['role'] == 'user' %}{% if not loop.first and messages[loop.index0 - 1]['role'] == "
               "'assistant' %}\n\n{% endif %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
               "{% else %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}"
               "{% endfor %}"),
}


@pytest.mark.parametrize("template", sorted(GENERATION))
def test_masks_equal_return_assistant_tokens_mask_with_a_generation_template(tok, template):
    cfg = nbt.TrainConfig(model="tiny", chat_template=template)
    chat.ensure_chat_tokens(tok, cfg)
    for conv in (CONV, CONV[1:3]):
        exs, _ = chat.tokenize_conversations(tok, cfg, [conv], None)
        out = tok.apply_chat_template(conv, chat_template=GENERATION[template], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert list(out["input_ids"]) == exs[0]["input_ids"]
        assert [int(m) for m in out["assistant_masks"]] == [int(t != -100) for t in exs[0]["labels"]]
        assert sum(out["assistant_masks"]) > 10


def test_the_text_path_differs_the_chat_path_trains_answers_only(tmp_path, tok):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])
    ex = load_data(cfg_for(f), tok).train[0]
    assert decoded_targets(tok, ex) == ("Nothing: it is a placeholder statement.<|im_end|>\n"
                                        "It leaves the innermost for or while loop.<|im_end|>\n")
    last = load_data(cfg_for(f, train_on="last"), tok).train[0]
    assert decoded_targets(tok, last) == "It leaves the innermost for or while loop.<|im_end|>\n"
    assert all(t != -100 for t in load_data(cfg_for(f, train_on="all"), tok).train[0]["labels"])


# ---------------------------------------------------------------------------------------------
# truncation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", ["alpaca", "llama3"])   # their markers are several tokens long
def test_truncation_cuts_at_turns_or_inside_answers_never_in_a_marker(tok, template):
    cfg = nbt.TrainConfig(model="tiny", chat_template=template)
    chat.ensure_chat_tokens(tok, cfg)
    jinja = chat.resolve_template(tok, cfg)[1]
    full, _ = chat.tokenize_conversations(tok, cfg, [CONV], None)
    n = len(full[0]["input_ids"])
    turn_ends, inside = set(), set()
    for i in (2, 4):
        a = chat.render(tok, jinja, [CONV[:i]], True)[0]
        turn_ends.add(chat.render(tok, jinja, [CONV[: i + 1]])[0])
        inside |= {a + CONV[i]["content"][:k] for k in range(1, len(CONV[i]["content"]))}
    kept_some = 0
    for max_len in range(4, n):
        exs, counts = chat.tokenize_conversations(tok, cfg, [CONV], max_len)
        assert counts["truncated_examples"] + counts["dropped_no_answer"] == 1
        if not exs:
            continue
        kept_some += 1
        ids = exs[0]["input_ids"]
        assert len(ids) <= max_len and ids == full[0]["input_ids"][: len(ids)]
        text = tok.decode(ids)
        assert text in turn_ends or text in inside, (max_len, text[-40:])
    assert kept_some > 5


def test_an_example_whose_answer_is_cut_away_is_dropped_and_counted(tmp_path, tok):
    long_q = {"role": "user", "content": "word " * 200}
    rows = [{"messages": CONV}, {"messages": [long_q, {"role": "assistant", "content": "yes"}]}]
    f = write_jsonl(tmp_path / "m.jsonl", rows)
    b = load_data(cfg_for(f, max_seq_len=40), tok)
    assert b.stats["dropped_no_answer"] == 1 and b.stats["truncated_examples"] == 1 and len(b.train) == 1
    assert b.stats["target_tokens"] == chat.target_count(b.train) > 0


# ---------------------------------------------------------------------------------------------
# collate and packing
# ---------------------------------------------------------------------------------------------
def test_collate_pads_labels_and_counts_shifted_targets():
    a = {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}
    b = {"input_ids": [5, 9], "labels": [5, 9]}   # its first label is never a target (nothing predicts it)
    mb = collate([a, b], 0, "causal-lm")
    assert mb.labels.tolist() == [[-100, -100, 7, 8], [5, 9, -100, -100]]
    assert mb.n_targets == 3 and mb.n_tokens == 6
    plain = collate([{"input_ids": [5, 6, 7]}], 0, "causal-lm")
    assert plain.labels.tolist() == [[5, 6, 7]] and plain.n_targets == 2 and plain.position_ids is None


def test_packing_keeps_labels_restarts_positions_and_separates_examples(tmp_path, tok):
    rows = [{"messages": CONV}, {"messages": CONV[1:3]}, {"messages": [CONV[1], CONV[4]]}]
    f = write_jsonl(tmp_path / "m.jsonl", rows)
    plain = load_data(cfg_for(f, max_seq_len=256), tok)
    packed = load_data(cfg_for(f, max_seq_len=256, packing=True), tok)
    assert len(packed.train) == 1 and "packed_attention" in packed.stats
    block = packed.train[0]
    assert block["input_ids"] == sum((ex["input_ids"] for ex in plain.train), [])
    assert block["labels"] == sum(([-100] + ex["labels"][1:] for ex in plain.train), [])
    assert block["position_ids"] == sum((list(range(len(ex["input_ids"]))) for ex in plain.train), [])
    assert chat.target_count(packed.train) == chat.target_count(plain.train)

    # the packed forward equals each example run alone: no example attends to another
    torch.manual_seed(0)
    from nbtrain.models.presets import build_preset_model

    model = build_preset_model("tiny", tok, "causal-lm").eval()
    mb = collate(packed.train + [{"input_ids": [5, 6], "labels": [5, 6], "position_ids": [0, 1]}],
                 packed.pad_token_id, "causal-lm")
    with torch.no_grad():
        logits = model(**mb.forward_inputs()).logits[0]
        at = 0
        for ex in plain.train:
            alone = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
            torch.testing.assert_close(logits[at: at + len(ex["input_ids"])], alone, atol=1e-4, rtol=1e-4)
            at += len(ex["input_ids"])


# ---------------------------------------------------------------------------------------------
# templates, tokens, prompts
# ---------------------------------------------------------------------------------------------
def test_ensure_chat_tokens_and_prompt_ids(tok):
    cfg = nbt.TrainConfig(model="tiny")
    with pytest.raises(ValueError, match="ensure_chat_tokens"):
        chat.prompt_ids(tok, cfg, "hi")
    assert chat.ensure_chat_tokens(tok, cfg) == ["<|im_start|>", "<|im_end|>"]
    assert chat.ensure_chat_tokens(tok, cfg) == [] and len(tok) == 2050
    ids = chat.prompt_ids(tok, cfg, "What does `with` do?", system="Be brief.")
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does `with` do?"
                               "<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    alpaca = chat.prompt_ids(tok, cfg.replace(chat_template="alpaca"), "q")
    assert tok.decode(alpaca) == "### Instruction:\nq\n\n### Response:\n"
    custom = cfg.replace(chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert tok.decode(chat.prompt_ids(tok, custom, "q")) == "[user] q\n[assistant] "


def test_auto_uses_the_tokenizers_own_template(tok):
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    cfg = nbt.TrainConfig(model="tiny")
    assert chat.resolve_template(tok, cfg)[0] == "tokenizer" and chat.ensure_chat_tokens(tok, cfg) == []
    assert tok.decode(chat.prompt_ids(tok, cfg, "q")) == "<<q>>"


def test_a_chat_run_sizes_tinys_embeddings_to_the_grown_tokenizer():
    from nbtrain.engine.prepare import prepare

    st = prepare(nbt.TrainConfig(model="tiny", data="builtin:python-docs-qa", subset=16, max_steps=1,
                                 precision="fp32", eval_fraction=0.0))
    try:
        assert len(st.tokenizer) == 2050
        assert st.model.get_input_embeddings().num_embeddings == 2050 == st.model.config.vocab_size
        assert any("<|im_start|>" in n for n in st.notes)
        assert st.data.stats["target_tokens"] > 0
    finally:
        st.restore.close()


# ---------------------------------------------------------------------------------------------
# builtin:python-docs-qa
# ---------------------------------------------------------------------------------------------
def test_python_docs_qa_is_deterministic_messages_of_a_few_hundred_rows():
    rows = builtin_rows("python-docs-qa")
    assert 200 <= len(rows) <= 600 and rows == builtin_rows("python-docs-qa")
    roles = {tuple(m["role"] for m in r["messages"]) for r in rows}
    assert roles == {("system", "user", "assistant")}
    qs = {r["messages"][1]["content"]: r["messages"][2]["content"] for r in rows}
    assert qs["What does the `with` statement do?"].startswith('The "with" statement is used to wrap')
    from nbtrain.data import BUILTINS

    assert "python-docs-qa" in BUILTINS


def test_tiny_learns_the_answer_format_of_python_docs_qa():
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs-qa", max_steps=60, micro_batch_size=4,
                          max_seq_len=112, lr=3e-3, warmup_steps=5, precision="fp32", eval_fraction=0.0,
                          log_every=1000)
    h = nbt.train(cfg).history
    first, last = h.loss.iloc[:5].mean(), h.loss.iloc[-5:].mean()
    assert last < first - 2.0, (first, last)      # answer-token loss: ~7.6 at init, ~4.6 after 60 steps
    assert (h.tokens < 4 * 112).all()             # answer tokens only, not every input token


def test_a_packed_chat_run_says_how_its_examples_were_kept_apart():
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs-qa", subset=32, max_seq_len=256, packing=True,
                          micro_batch_size=2, max_steps=1, eval_fraction=0.0, precision="fp32")
    notes = nbt.train(cfg).summary["notes"]
    assert any(n.startswith("packing: separate: position ids restart per example") for n in notes), notes
    plain = nbt.train(cfg.replace(packing=False)).summary["notes"]
    assert not any(n.startswith("packing:") for n in plain)
