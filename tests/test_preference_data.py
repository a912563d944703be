"""Issue 38, the data side: preference pairs (TRL, LLaMA-Factory ranking, AutoTrain columns), their tokens and
masks, bad rows, the left cut, the objective check, the eval split, builtin:python-docs-pref, and collation."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import nbtrain as nbt
from nbtrain.data import DataError, collate, load_data
from nbtrain.data import builtin, chat
from nbtrain.data.builtin import QA_SYSTEM, builtin_names, builtin_rows
from nbtrain.data.loading import peek_format, split_indices
from nbtrain.models.presets import preset_tokenizer

from .test_chat_data import cfg_for as chat_cfg_for
from .test_chat_data import write_jsonl

SYS = "You are terse."
Q1, A1 = "What does `pass` do?", "Nothing: it is a placeholder statement."
Q2 = "And `break`?"
GOOD, BAD = "It leaves the innermost for or while loop.", "It raises SyntaxError at once."


def cfg_for(data, **kw):
    """test_chat_data's config, with a preference objective unless named."""
    kw.setdefault("objective", "dpo")
    return chat_cfg_for(data, **kw)


@pytest.fixture
def tok():
    return preset_tokenizer("tiny")


def lf_folder(folder, rows, entry):
    """A LLaMA-Factory data folder: the rows in data.json and dataset_info.json's entry "pairs" for them."""
    folder.mkdir()
    (folder / "data.json").write_text(json.dumps(rows), encoding="utf-8")
    (folder / "dataset_info.json").write_text(json.dumps({"pairs": {"file_name": "data.json", **entry}}))
    return folder


def sft_example(tok, conv):
    """The chat SFT example of a whole conversation (template chatml), tokenized the chat.py way: an independent
    account of the prompt's and the answer's tokens (the tiny BPE splits at ChatML's newlines, so tokenizing the
    prompt and the answer apart gives the same ids)."""
    cfg = nbt.TrainConfig(model="tiny", train_on="last")   # an earlier answer in the prompt is no target
    chat.ensure_chat_tokens(tok, cfg)
    exs, _ = chat.tokenize_conversations(tok, cfg, [conv], None)
    return exs[0]


def expected_pair(tok, prompt):
    chosen = sft_example(tok, prompt + [{"role": "assistant", "content": GOOD}])
    rejected = sft_example(tok, prompt + [{"role": "assistant", "content": BAD}])
    return {"input_ids": chosen["input_ids"], "labels": chosen["labels"],
            "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"]}


def n_prompt(ex):
    return next(j for j, t in enumerate(ex["labels"]) if t != -100)


# ---------------------------------------------------------------------------------------------
# formats: the same content gives the same tokens
# ---------------------------------------------------------------------------------------------
def single_turn_sources(tmp_path):
    """(name, cfg kwargs) of one single-turn pair (system, question, good, bad) in every format, two rows each."""
    conv_prompt = [{"role": "system", "content": SYS}, {"role": "user", "content": Q1}]
    trl_plain = {"system": SYS, "prompt": Q1, "chosen": GOOD, "rejected": BAD}
    trl_conv = {"prompt": conv_prompt, "chosen": [{"role": "assistant", "content": GOOD}],
                "rejected": [{"role": "assistant", "content": BAD}]}
    out = [("trl-plain", dict(data=write_jsonl(tmp_path / "plain.jsonl", [trl_plain] * 2))),
           ("trl-conversational", dict(data=write_jsonl(tmp_path / "conv.jsonl", [trl_conv] * 2))),
           ("trl-named", dict(data=write_jsonl(tmp_path / "named.jsonl", [trl_plain] * 2),
                              data_format="preference"))]
    # AutoTrain: prompt_text_column, text_column, rejected_text_column, as a CSV
    csv = tmp_path / "autotrain.csv"
    csv.write_text(f"sys,prompt_text,text,rejected_text\n{SYS},{Q1},{GOOD},{BAD}\n{SYS},{Q1},{GOOD},{BAD}\n",
                   encoding="utf-8")
    out.append(("autotrain", dict(data=csv, columns={"prompt": "prompt_text", "chosen": "text",
                                                     "rejected": "rejected_text", "system": "sys"})))
    alpaca = lf_folder(tmp_path / "lf_alpaca", [{"q": Q1, "s": SYS, "good": GOOD, "bad": BAD}] * 2, {
        "ranking": True, "columns": {"prompt": "q", "system": "s", "chosen": "good", "rejected": "bad"}})
    out.append(("lf-alpaca", dict(data=alpaca)))
    share = {"conversations": [{"from": "human", "value": Q1}], "system": SYS,
             "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD}}
    out.append(("lf-sharegpt", dict(data=lf_folder(tmp_path / "lf_share", [share] * 2, {
        "formatting": "sharegpt", "ranking": True,
        "columns": {"messages": "conversations", "system": "system", "chosen": "chosen", "rejected": "rejected"}}))))
    return conv_prompt, out


def test_every_format_gives_the_same_tokens_for_the_same_pair(tmp_path, tok):
    prompt, sources = single_turn_sources(tmp_path)
    want = expected_pair(tok, prompt)
    formats = {}
    for name, kw in sources:
        b = load_data(cfg_for(**kw), tok)
        assert len(b.train) == 2 and b.eval == [], name
        assert b.train[0] == want, name
        assert b.stats["chat_template"] == "chatml", name
        formats[name] = b.stats["data_format"]
    assert formats == {"trl-plain": "preference", "trl-conversational": "preference", "trl-named": "preference",
                       "autotrain": "preference", "lf-alpaca": "alpaca-ranking", "lf-sharegpt": "sharegpt-ranking"}
    # what a run would read it as, without tokenizing (exports, the Panel)
    assert peek_format(cfg_for(sources[0][1]["data"])) == "preference"
    assert peek_format(cfg_for(tmp_path / "lf_alpaca")) == "alpaca-ranking"


def test_multi_turn_prompts_alpaca_history_sharegpt_and_trls_implicit_prompt(tmp_path, tok):
    prompt = [{"role": "system", "content": SYS}, {"role": "user", "content": Q1},
              {"role": "assistant", "content": A1}, {"role": "user", "content": Q2}]
    want = expected_pair(tok, prompt)
    good, bad = {"role": "assistant", "content": GOOD}, {"role": "assistant", "content": BAD}
    sources = {
        "trl": write_jsonl(tmp_path / "trl.jsonl", [{"prompt": prompt, "chosen": [good], "rejected": [bad]}] * 2),
        # no prompt column: chosen and rejected are whole conversations sharing their first turns
        "implicit": write_jsonl(tmp_path / "implicit.jsonl", [{"chosen": prompt + [good],
                                                               "rejected": prompt + [bad]}] * 2),
        # LLaMA-Factory alpaca: history pairs, instruction + input joined by a newline, as its SFT reader does
        "alpaca": lf_folder(tmp_path / "a", [{"instruction": "And", "input": "`break`?", "system": SYS,
                                              "history": [[Q1, A1]], "chosen": GOOD, "rejected": BAD}] * 2,
                            {"ranking": True}),
        "sharegpt": lf_folder(tmp_path / "s", [{"conversations": [
            {"from": "system", "value": SYS}, {"from": "human", "value": Q1}, {"from": "gpt", "value": A1},
            {"from": "human", "value": Q2}], "chosen": {"from": "gpt", "value": GOOD},
            "rejected": {"from": "gpt", "value": BAD}}] * 2, {"formatting": "sharegpt", "ranking": True}),
    }
    alpaca_prompt = prompt[:3] + [{"role": "user", "content": "And\n`break`?"}]
    for name, data in sources.items():
        b = load_data(cfg_for(data), tok)
        assert b.train[0] == (expected_pair(tok, alpaca_prompt) if name == "alpaca" else want), name
        # the earlier answer A1 is prompt: no target in it
        ex = b.train[0]
        assert tok.decode([t for t in ex["labels"] if t != -100]) == GOOD + "<|im_end|>\n", name


def test_labels_are_minus_100_exactly_on_the_prompt_and_the_prompt_is_shared(tok):
    b = load_data(cfg_for("builtin:python-docs-pref", subset=12, max_seq_len=512), tok)
    rows = builtin_rows("python-docs-pref")[:12]
    cfg = cfg_for("builtin:python-docs-pref")
    for ex, row in zip(b.train, rows):
        # the prompt as the model gets it when it answers the question (sampling's own function)
        p = chat.prompt_ids(tok, cfg, row["prompt"][1]["content"], system=QA_SYSTEM)
        for ids, labels, answer in ((ex["input_ids"], ex["labels"], row["chosen"][0]["content"]),
                                    (ex["rejected_input_ids"], ex["rejected_labels"], row["rejected"][0]["content"])):
            assert ids[: len(p)] == p and len(labels) == len(ids)
            assert labels[: len(p)] == [-100] * len(p)
            assert labels[len(p):] == ids[len(p):] and -100 not in labels[len(p):]
            assert tok.decode(ids[len(p):]) == answer + "<|im_end|>\n"
    assert b.stats["target_tokens"] == sum(len(ex["labels"]) - n_prompt(ex) for ex in b.train)
    assert b.train_tokens == sum(len(ex["input_ids"]) + len(ex["rejected_input_ids"]) for ex in b.train)


# ---------------------------------------------------------------------------------------------
# bad rows
# ---------------------------------------------------------------------------------------------
OK = {"prompt": Q1, "chosen": GOOD, "rejected": BAD}


@pytest.mark.parametrize("bad, words", [
    ({"prompt": Q1, "rejected": BAD}, ["row 1", "'chosen'", "missing"]),
    ({"prompt": Q1, "chosen": GOOD, "rejected": None}, ["row 1", "'rejected'", "missing"]),
    ({"prompt": Q1, "chosen": "   ", "rejected": BAD}, ["row 1", "'chosen'", "empty"]),
    ({"prompt": Q1, "chosen": GOOD, "rejected": GOOD + " "}, ["row 1", "'chosen' and 'rejected'", "same answer"]),
    ({"prompt": "", "chosen": GOOD, "rejected": BAD}, ["row 1", "'prompt'", "empty"]),
])
def test_bad_plain_rows_are_a_data_error_naming_file_row_and_field(tmp_path, tok, bad, words):
    f = write_jsonl(tmp_path / "pairs.jsonl", [OK, bad, OK])
    with pytest.raises(DataError) as e:
        load_data(cfg_for(f), tok)
    for w in words + ["pairs.jsonl"]:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("chosen, rejected, words", [
    ([], [{"role": "assistant", "content": BAD}], ["row 1", "'chosen'", "empty"]),
    ([{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": ""}], ["row 1", "'rejected[0].content'",
                                                                                         "empty"]),
    ([{"role": "user", "content": GOOD}], [{"role": "assistant", "content": BAD}], ["row 1", "'chosen'",
                                                                                     "one assistant message"]),
    ([{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": GOOD}], ["row 1", "same answer"]),
])
def test_bad_conversational_rows_name_the_row(tmp_path, tok, chosen, rejected, words):
    prompt = [{"role": "user", "content": Q1}]
    ok = {"prompt": prompt, "chosen": [{"role": "assistant", "content": GOOD}],
          "rejected": [{"role": "assistant", "content": BAD}]}
    f = write_jsonl(tmp_path / "conv.jsonl", [ok, {"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    with pytest.raises(DataError) as e:
        load_data(cfg_for(f), tok)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_ranking_rows_name_the_entry_and_row(tmp_path, tok):
    row = {"instruction": Q1, "chosen": GOOD, "rejected": BAD}
    folder = lf_folder(tmp_path / "lf", [row, row, {"instruction": Q1, "chosen": GOOD, "rejected": ""}],
                       {"ranking": True})
    with pytest.raises(DataError, match=r"dataset_info entry 'pairs' .*row 2: field 'rejected' is empty"):
        load_data(cfg_for(folder, dataset_entry="pairs"), tok)
    share = lf_folder(tmp_path / "s", [{"conversations": [{"from": "human", "value": Q1}, {"from": "gpt", "value": A1}],
                                        "chosen": {"from": "gpt", "value": GOOD},
                                        "rejected": {"from": "gpt", "value": BAD}}],
                      {"formatting": "sharegpt", "ranking": True})
    with pytest.raises(DataError, match=r"row 0: field 'conversations' ends with a assistant turn"):
        load_data(cfg_for(share), tok)
    nocol = lf_folder(tmp_path / "n", [{"instruction": Q1, "output": GOOD}], {"ranking": True})
    with pytest.raises(DataError, match=r"needs column\(s\) 'chosen', 'rejected'"):
        load_data(cfg_for(nocol), tok)


# ---------------------------------------------------------------------------------------------
# too long for max_seq_len: the prompt is cut from the left, the answers kept
# ---------------------------------------------------------------------------------------------
def test_a_long_prompt_is_cut_from_the_left_and_both_answers_stay_whole(tmp_path, tok):
    long_q = " ".join(f"word{i}" for i in range(120)) + " " + Q1
    rows = [{"prompt": long_q, "chosen": GOOD, "rejected": BAD}, OK]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    whole = load_data(cfg_for(f, max_seq_len=4096), tok).train
    assert len(whole[0]["input_ids"]) > 300 and whole[0]["input_ids"][:5] != whole[1]["input_ids"][:5]
    b = load_data(cfg_for(f, max_seq_len=64), tok)
    ex, full = b.train[0], whole[0]
    n_good, n_bad = len(full["labels"]) - n_prompt(full), len(full["rejected_labels"]) - n_prompt(full)
    keep = 64 - max(n_good, n_bad)
    assert n_prompt(ex) == keep and max(len(ex["input_ids"]), len(ex["rejected_input_ids"])) == 64
    # the prompt's last tokens (its end: the question and the generation prompt), the answers exactly as uncut
    assert ex["input_ids"] == full["input_ids"][n_prompt(full) - keep:]
    assert ex["rejected_input_ids"] == full["rejected_input_ids"][n_prompt(full) - keep:]
    assert ex["labels"][keep:] == full["labels"][n_prompt(full):]
    assert b.train[1] == whole[1]   # the short pair is untouched
    assert b.stats["prompts_cut_left"] == 1 and b.stats["answers_cut"] == 0
    assert any("prompt cut from the left" in n and "1 pair" in n for n in b.notes), b.notes


def test_an_answer_longer_than_max_seq_len_is_cut_at_the_right_and_the_row_kept(tmp_path, tok):
    long_a = " ".join(f"step{i}" for i in range(80))
    rows = [{"prompt": Q1, "chosen": long_a + " done.", "rejected": BAD},
            {"prompt": Q1, "chosen": long_a + " yes.", "rejected": long_a + " no."}, OK]
    f = write_jsonl(tmp_path / "longa.jsonl", rows)
    whole = load_data(cfg_for(f, max_seq_len=4096), tok).train
    b = load_data(cfg_for(f, max_seq_len=32), tok)
    assert len(b.train) == 3   # no row dropped
    for ex, full in zip(b.train[:2], whole[:2]):
        assert n_prompt(ex) == 1 and ex["input_ids"][0] == full["input_ids"][n_prompt(full) - 1]
        assert len(ex["input_ids"]) == 32
        assert ex["input_ids"][1:] == full["input_ids"][n_prompt(full): n_prompt(full) + 31]
    assert b.train[0]["rejected_input_ids"][1:] == whole[0]["rejected_input_ids"][n_prompt(whole[0]):]   # short
    assert b.train[1]["input_ids"] == b.train[1]["rejected_input_ids"]   # the answers differ after the cut only
    assert b.stats["answers_cut"] == 2 and b.stats["pairs_identical_after_cut"] == 1
    assert any("cut at the right" in n and "1 of them have the same answer tokens" in n for n in b.notes), b.notes


# ---------------------------------------------------------------------------------------------
# objective and data must agree
# ---------------------------------------------------------------------------------------------
def test_objective_lm_refuses_preference_data_naming_its_columns(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [OK, OK])
    for data in (f, "builtin:python-docs-pref"):
        with pytest.raises(DataError) as e:
            load_data(cfg_for(data, objective="lm"), tok)
        msg = str(e.value)
        assert "objective='lm'" in msg and "'chosen'" in msg and "'rejected'" in msg and "'dpo'" in msg, msg
    with pytest.raises(DataError, match="preference data .* for task='causal-lm'"):
        load_data(nbt.TrainConfig(model="tiny", data="builtin:python-docs-pref", task="sequence-classification"), tok)


@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
def test_a_preference_objective_refuses_data_without_chosen_and_rejected(tmp_path, tok, objective):
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": Q1, "output": GOOD}] * 2)
    txt = tmp_path / "t.txt"
    txt.write_text("def f(): pass\nfor x in y: pass\n", encoding="utf-8")
    cases = {sft: "['instruction', 'output']", "builtin:python-docs-qa": "['messages']",
             "builtin:python-docs": "['text']", txt: "plain text file"}
    for data, found in cases.items():
        with pytest.raises(DataError) as e:
            load_data(cfg_for(data, objective=objective), tok)
        msg = str(e.value)
        assert f"objective={objective!r}" in msg and found in msg and "chosen" in msg and "rejected" in msg, msg
        assert "builtin:python-docs-pref" in msg   # what is allowed, with an example at hand


def test_rows_with_both_a_conversation_and_a_pair_follow_the_objective(tmp_path, tok):
    # UltraFeedback-binarized-like rows: messages (SFT) beside prompt/chosen/rejected
    conv = [{"role": "user", "content": Q1}, {"role": "assistant", "content": GOOD}]
    f = write_jsonl(tmp_path / "uf.jsonl", [{"prompt": Q1, "messages": conv, "chosen": GOOD, "rejected": BAD}] * 2)
    assert load_data(cfg_for(f, objective="lm"), tok).stats["data_format"] == "messages"
    b = load_data(cfg_for(f), tok)
    assert b.stats["data_format"] == "preference" and "rejected_input_ids" in b.train[0]


# ---------------------------------------------------------------------------------------------
# the eval split
# ---------------------------------------------------------------------------------------------
def test_the_eval_split_holds_preference_examples_chosen_by_the_seed(tok):
    cfg = cfg_for("builtin:python-docs-pref", subset=20, eval_fraction=0.25, seed=3)
    b = load_data(cfg, tok)
    train_idx, eval_idx = split_indices(20, 0.25, 3)
    assert len(b.eval) == len(eval_idx) == 5 and len(b.train) == 15
    everything = load_data(cfg.replace(eval_fraction=0.0), tok).train
    assert b.eval == [everything[i] for i in eval_idx] and b.train == [everything[i] for i in train_idx]
    assert all("rejected_input_ids" in ex for ex in b.eval)
    assert b.stats["eval_documents"] == 5 and b.stats["pairs"] == 20


# ---------------------------------------------------------------------------------------------
# builtin:python-docs-pref
# ---------------------------------------------------------------------------------------------
def _rows_digest() -> str:
    return hashlib.sha256(json.dumps(builtin_rows("python-docs-pref"), sort_keys=True).encode()).hexdigest()


def test_python_docs_pref_is_qa_with_another_topics_answer_rejected():
    rows, qa = builtin_rows("python-docs-pref"), builtin_rows("python-docs-qa")
    assert "python-docs-pref" in builtin_names() and "python-docs-pref" in builtin.BUILTINS
    assert len(rows) == len(qa)
    answers = {m["messages"][2]["content"] for m in qa}
    rejected_of: dict[str, set[str]] = {}
    for row, q in zip(rows, qa):
        assert row["prompt"] == q["messages"][:2]                   # system + user
        assert row["chosen"] == [q["messages"][2]]                  # the right answer
        (rej,) = row["rejected"]
        assert rej["role"] == "assistant" and rej["content"] != row["chosen"][0]["content"]
        assert rej["content"] in answers                            # another topic's answer
        rejected_of.setdefault(row["chosen"][0]["content"], set()).add(rej["content"])
    # every phrasing of a topic's question gets the same rejected answer; the topics' rejected answers vary
    assert all(len(v) == 1 for v in rejected_of.values())
    assert len({next(iter(v)) for v in rejected_of.values()}) > len(rejected_of) // 2


def test_python_docs_pref_is_the_same_in_every_process():
    digest = _rows_digest()
    for cached in (builtin._topic_paragraphs, builtin._qa_topics, builtin._qa_rows, builtin._pref):
        cached.cache_clear()
    assert _rows_digest() == digest
    code = ("import hashlib, json; from nbtrain.data.builtin import builtin_rows; print(hashlib.sha256(json.dumps("
            "builtin_rows('python-docs-pref'), sort_keys=True).encode()).hexdigest())")
    # another process, with another string hash seed (set iteration order): the same rows
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == digest


def test_python_docs_pref_loads_as_preference_data(tok):
    cfg = cfg_for("builtin:python-docs-pref")
    assert peek_format(cfg) == "preference"
    b = load_data(cfg, tok)
    assert len(b.train) == len(builtin_rows("python-docs-pref")) and b.stats["data_format"] == "preference"
    assert all(ex["input_ids"] != ex["rejected_input_ids"] for ex in b.train)
    assert all(len(ex["input_ids"]) <= 128 and len(ex["rejected_input_ids"]) <= 128 for ex in b.train)


# ---------------------------------------------------------------------------------------------
# collation
# ---------------------------------------------------------------------------------------------
def test_collate_puts_the_chosen_rows_then_the_rejected_rows_sharing_each_prompt(tok):
    b = load_data(cfg_for("builtin:python-docs-pref", subset=8), tok)
    exs = b.train[:3]
    mb = collate(exs, b.pad_token_id, "causal-lm", indices=[0, 1, 2])
    assert mb.n_pairs == 3 and len(mb) == 6 and mb.loss_units == 3
    for i, ex in enumerate(exs):
        p = n_prompt(ex)
        chosen, rejected = mb.input_ids[i].tolist(), mb.input_ids[i + 3].tolist()
        assert chosen[: len(ex["input_ids"])] == ex["input_ids"]
        assert rejected[: len(ex["rejected_input_ids"])] == ex["rejected_input_ids"]
        assert chosen[:p] == rejected[:p] and chosen[p:] != rejected[p:]
        assert (mb.labels[i, :p] == -100).all() and (mb.labels[i + 3, :p] == -100).all()
        assert (mb.labels[i, p] != -100) and (mb.labels[i + 3, p] != -100)
