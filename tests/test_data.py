"""nbtrain.data: loading, splitting, tokenizing, packing, ordering and collation."""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
import string

import pytest
import torch

from nbtrain.config import TrainConfig
from nbtrain.data import (
    DataBundle,
    DataError,
    MicroBatch,
    builtin_label_names,
    builtin_names,
    builtin_rows,
    builtin_texts,
    collate,
    epoch_order,
    iter_steps,
    load_data,
    loading,
    steps_per_epoch,
)

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
PAD, BOS, EOS = 0, 1, 2


def _char_tokenizer(bos: bool, pad: bool):
    """One token per printable character: token counts in the tests are exact."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    kw = {"pad_token": "<pad>"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", **kw)


@pytest.fixture(scope="module")
def tok():
    """Adds BOS to plain text (like Llama), has a pad token."""
    return _char_tokenizer(bos=True, pad=True)


@pytest.fixture(scope="module")
def bare_tok():
    """No BOS, no pad token (like GPT-2)."""
    return _char_tokenizer(bos=False, pad=False)


_ID2CHAR = {i: t for i, t in enumerate(SPECIALS + CHARS)}


def decode(ids) -> str:
    return "".join(_ID2CHAR[i] for i in ids if i >= len(SPECIALS))


def cfg(data, **kw) -> TrainConfig:
    kw.setdefault("eval_fraction", 0.0)
    return TrainConfig(data=str(data), **kw)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ---------------------------------------------------------------------------------------------
# ordering and steps
# ---------------------------------------------------------------------------------------------
def _examples(n):
    # distinct contents and lengths 2..9 so that padding varies inside micro-batches
    return [{"input_ids": [100 + i] * (2 + i % 8)} for i in range(n)]


def test_same_examples_per_step_for_any_micro_batch_split():
    ex = _examples(37)
    runs = {}
    for micro, accum in [(8, 1), (2, 4), (1, 8), (3, 3)]:
        steps = list(itertools.islice(iter_steps(ex, micro, accum, seed=5, pad_token_id=PAD,
                                                 task="causal-lm"), 12))
        runs[(micro, accum)] = steps
        for _, mbs in steps:
            assert len(mbs) <= accum and all(len(mb) <= micro for mb in mbs)
            for mb in mbs:   # the indices really are the rows in the tensors
                for row, i in enumerate(mb.indices):
                    n = len(ex[i]["input_ids"])
                    assert mb.input_ids[row, :n].tolist() == ex[i]["input_ids"]
    ids = {k: [[i for mb in mbs for i in mb.indices] for _, mbs in v] for k, v in runs.items() if k != (3, 3)}
    assert ids[(8, 1)] == ids[(2, 4)] == ids[(1, 8)]
    epochs = {k: [e for e, _ in v] for k, v in runs.items() if k != (3, 3)}
    assert epochs[(8, 1)] == epochs[(2, 4)] == epochs[(1, 8)]
    # 37 examples in steps of 8: 5 steps per epoch, the last one holds 5
    assert [len(s) for s in ids[(8, 1)][:5]] == [8, 8, 8, 8, 5]
    assert [len(mbs) for _, mbs in runs[(2, 4)][:5]] == [4, 4, 4, 4, 3]
    assert [len(mb) for mb in runs[(2, 4)][4][1]] == [2, 2, 1]
    # each epoch visits every example once, in the seed's permutation for that epoch
    flat = [i for step in ids[(8, 1)] for i in step]
    assert flat[:37] == torch.randperm(37, generator=torch.Generator().manual_seed(5)).tolist()
    assert flat[37:74] == epoch_order(37, 5, 1) and sorted(flat[37:74]) == list(range(37))
    assert flat[:37] != flat[37:74]


def test_epoch_float_counts_examples_consumed():
    steps = list(itertools.islice(iter_steps(_examples(10), 2, 2, seed=0, pad_token_id=PAD,
                                             task="causal-lm"), 7))
    assert [e for e, _ in steps] == pytest.approx([0.4, 0.8, 1.0, 1.4, 1.8, 2.0, 2.4])
    assert steps[2][0] == 1.0
    assert steps_per_epoch(10, 2, 2) == 3 and steps_per_epoch(8, 2, 2) == 2 and steps_per_epoch(1, 4, 4) == 1


def test_start_step_resumes_exactly():
    ex = _examples(23)
    full = list(itertools.islice(iter_steps(ex, 2, 3, seed=9, pad_token_id=PAD, task="causal-lm"), 15))
    resumed = list(itertools.islice(iter_steps(ex, 2, 3, seed=9, pad_token_id=PAD, task="causal-lm",
                                               start_step=9), 6))
    for (e1, a), (e2, b) in zip(full[9:], resumed):
        assert e1 == e2
        assert [mb.indices for mb in a] == [mb.indices for mb in b]
        assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))


def test_iter_steps_rejects_bad_arguments():
    with pytest.raises(DataError, match="no examples"):
        iter_steps([], 2, 1, seed=0, pad_token_id=PAD, task="causal-lm")
    with pytest.raises(DataError, match="micro_batch_size"):
        iter_steps(_examples(3), 0, 1, seed=0, pad_token_id=PAD, task="causal-lm")
    with pytest.raises(DataError, match="task"):
        iter_steps(_examples(3), 1, 1, seed=0, pad_token_id=PAD, task="translation")


# ---------------------------------------------------------------------------------------------
# collation
# ---------------------------------------------------------------------------------------------
def test_collate_causal_pads_right_and_masks_labels():
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, EOS, 10, 11, EOS]}]
    mb = collate(rows, pad_token_id=EOS, task="causal-lm", indices=(4, 1, 2))
    assert mb.input_ids.dtype == torch.long and mb.input_ids.shape == (3, 5)
    assert mb.input_ids.tolist() == [[5, 6, 7, EOS, EOS], [8, EOS, EOS, EOS, EOS], [9, EOS, 10, 11, EOS]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    # padding is masked by position: the real EOS tokens (same id as pad here) stay targets
    assert mb.labels.tolist() == [[5, 6, 7, -100, -100], [8, -100, -100, -100, -100], [9, EOS, 10, 11, EOS]]
    assert mb.n_targets == int((mb.labels[:, 1:] != -100).sum()) == 2 + 0 + 4
    assert mb.n_tokens == int(mb.attention_mask.sum()) == 9
    assert mb.indices == (4, 1, 2) and len(mb) == 3


def test_collate_pads_to_longest_in_micro_batch_not_max_len():
    mb = collate([{"input_ids": [3, 4]}, {"input_ids": [5, 6, 7]}], pad_token_id=PAD, task="causal-lm")
    assert mb.input_ids.shape == (2, 3)


def test_collate_classification():
    rows = [{"input_ids": [5, 6], "label": 2}, {"input_ids": [7, 8, 9, 10], "label": 0}]
    mb = collate(rows, pad_token_id=PAD, task="sequence-classification")
    assert mb.labels.tolist() == [2, 0] and mb.labels.dtype == torch.long
    assert mb.n_targets == 2 and mb.n_tokens == 6
    assert mb.input_ids.tolist() == [[5, 6, PAD, PAD], [7, 8, 9, 10]]
    with pytest.raises(DataError, match="label"):
        collate([{"input_ids": [1, 2]}], pad_token_id=PAD, task="sequence-classification")


def test_micro_batch_to_returns_a_moved_copy():
    mb = collate([{"input_ids": [3, 4, 5]}, {"input_ids": [6, 7]}], pad_token_id=PAD, task="causal-lm")
    moved = mb.to("meta")
    assert isinstance(moved, MicroBatch) and moved is not mb
    assert moved.input_ids.device.type == "meta" and moved.labels.device.type == "meta"
    assert mb.input_ids.device.type == "cpu"
    assert (moved.n_targets, moved.n_tokens, moved.indices) == (mb.n_targets, mb.n_tokens, mb.indices)


# ---------------------------------------------------------------------------------------------
# load_data: files, splits, tokenizing, packing
# ---------------------------------------------------------------------------------------------
ROWS = [("the cat sat", "pets"), ("a dog ran far", "pets"), ("x = 1 + 2", "code"),
        ("for i in range(3): pass", "code"), ("rain again today", "weather"), ("sunny, 25 C", "weather")]


def _write_all_formats(tmp_path):
    import pandas as pd

    df = pd.DataFrame({"text": [t for t, _ in ROWS], "label": [lab for _, lab in ROWS]})
    paths = {
        "csv": tmp_path / "d.csv", "tsv": tmp_path / "d.tsv", "json": tmp_path / "d.json",
        "jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet", "txt": tmp_path / "d.txt",
    }
    df.to_csv(paths["csv"], index=False)
    df.to_csv(paths["tsv"], index=False, sep="\t")
    paths["json"].write_text(json.dumps(df.to_dict(orient="records")))
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in df.to_dict(orient="records")))
    df.to_parquet(paths["parquet"])
    write_lines(paths["txt"], [t for t, _ in ROWS])
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    write_lines(d / "a.txt", [t for t, _ in ROWS[:4]])
    write_lines(d / "sub" / "b.txt", [t for t, _ in ROWS[4:]])
    write_lines(d / ".hidden.txt", ["not an example"])
    paths["dir"] = d
    return paths


def test_every_format_and_a_directory_give_the_same_examples(tmp_path, tok):
    paths = _write_all_formats(tmp_path)
    for kind, path in paths.items():
        b = load_data(cfg(path), tok)
        assert isinstance(b, DataBundle) and b.task == "causal-lm" and b.eval == []
        assert [decode(ex["input_ids"]) for ex in b.train] == [t for t, _ in ROWS], kind
        assert all(ex["input_ids"][0] == BOS for ex in b.train), kind   # tokenizer's own BOS
        assert b.pad_token_id == PAD and str(path) in b.source
        if kind != "txt" and kind != "dir":
            c = load_data(cfg(path, task="sequence-classification"), tok)
            assert c.label_names == ["code", "pets", "weather"] and c.num_labels == 3, kind
            assert [ex["label"] for ex in c.train] == [1, 1, 0, 0, 2, 2], kind


def test_txt_is_one_example_per_non_empty_line(tmp_path, tok):
    p = write_lines(tmp_path / "t.txt", ["first line", "", "   ", "second line", "third"])
    b = load_data(cfg(p), tok)
    assert [decode(ex["input_ids"]) for ex in b.train] == ["first line", "second line", "third"]
    assert b.stats["blank_rows_dropped"] == 2


def test_subset_is_taken_before_the_split(tmp_path, tok):
    lines = [f"line number {i:03d}" for i in range(50)]
    p = write_lines(tmp_path / "t.txt", lines)
    b = load_data(cfg(p, subset=10, eval_fraction=0.2), tok)
    train = [decode(ex["input_ids"]) for ex in b.train]
    evals = [decode(ex["input_ids"]) for ex in b.eval]
    assert len(train) == 8 and len(evals) == 2
    assert sorted(train + evals) == lines[:10]
    assert train == sorted(train) and evals == sorted(evals)   # the split does not shuffle


def test_eval_split_depends_on_the_seed_only(tmp_path, tok):
    lines = [f"row {i:03d}" for i in range(40)]
    p = write_lines(tmp_path / "t.txt", lines)

    def eval_rows(**kw):
        return [decode(ex["input_ids"]) for ex in load_data(cfg(p, eval_fraction=0.25, **kw), tok).eval]

    base = eval_rows(seed=3)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:10]
    assert base == [lines[i] for i in sorted(perm.tolist())]
    assert eval_rows(seed=3, micro_batch_size=1, grad_accum_steps=8, max_seq_len=64) == base
    assert eval_rows(seed=4) != base


def test_eval_split_sizes():
    assert loading.split_indices(10, 0.0, 0) == (list(range(10)), [])
    assert len(loading.split_indices(2, 0.01, 0)[1]) == 1          # at least one eval example
    assert loading.split_indices(1, 0.5, 0) == ([0], [])            # and at least one to train on
    tr, ev = loading.split_indices(3, 0.9, 0)
    assert len(tr) == 1 and len(ev) == 2 and sorted(tr + ev) == [0, 1, 2]
    assert len(loading.split_indices(100, 0.05, 7)[1]) == 5


def test_truncation_and_one_enormous_line(tmp_path, tok):
    p = write_lines(tmp_path / "big.txt", ["short one", "abcdefghij" * 20_000])
    b = load_data(cfg(p, max_seq_len=16), tok)
    assert [len(ex["input_ids"]) for ex in b.train] == [10, 16]
    assert decode(b.train[1]["input_ids"]) == "abcdefghij" * 1 + "abcde"


def test_causal_rows_need_two_tokens(tmp_path, bare_tok):
    p = write_lines(tmp_path / "t.txt", ["a", "bc", "def"])
    b = load_data(cfg(p), bare_tok)
    assert [decode(ex["input_ids"]) for ex in b.train] == ["bc", "def"]
    assert b.stats["short_rows_dropped"] == 1
    # without a pad token, EOS pads
    assert b.pad_token_id == EOS == bare_tok.eos_token_id
    with pytest.raises(DataError, match="no training examples"):
        load_data(cfg(write_lines(tmp_path / "u.txt", ["a", "b"])), bare_tok)


def test_packing_makes_full_blocks_with_eos_between_documents(tmp_path, tok):
    p = write_lines(tmp_path / "t.txt", ["abc", "de", "fghij", "k"])
    b = load_data(cfg(p, max_seq_len=8, packing=True), tok)
    t = {c: 4 + CHARS.index(c) for c in "abcdefghijk"}
    stream = ([BOS, t["a"], t["b"], t["c"], EOS, BOS, t["d"], t["e"], EOS,
               BOS, t["f"], t["g"], t["h"], t["i"], t["j"], EOS])
    # 16 tokens -> two blocks of 8; "k" (3 tokens with BOS and EOS) is the short tail, dropped
    assert [ex["input_ids"] for ex in b.train] == [stream[:8], stream[8:]]
    assert all(len(ex["input_ids"]) == 8 for ex in b.train)
    # packing keeps whole documents: one longer than a block spans several blocks
    q = write_lines(tmp_path / "long.txt", ["x" * 30])
    blocks = load_data(cfg(q, max_seq_len=8, packing=True), tok).train
    assert len(blocks) == 4 and [len(x["input_ids"]) for x in blocks] == [8] * 4
    with pytest.raises(DataError, match="packing"):
        load_data(cfg(write_lines(tmp_path / "s.txt", ["ab"]), max_seq_len=64, packing=True), tok)


def test_packing_eval_is_packed_separately(tmp_path, tok):
    p = write_lines(tmp_path / "t.txt", [f"document {i} " + "z" * 20 for i in range(20)])
    b = load_data(cfg(p, max_seq_len=16, packing=True, eval_fraction=0.25), tok)
    assert b.stats["eval_documents"] == 5 and b.eval
    assert all(len(ex["input_ids"]) == 16 for ex in b.train + b.eval)
    ev_text = "".join(decode(ex["input_ids"]) for ex in b.eval)
    tr_text = "".join(decode(ex["input_ids"]) for ex in b.train)
    for i in range(20):
        assert (f"document {i} " in ev_text) + (f"document {i} " in tr_text) <= 1


# ---------------------------------------------------------------------------------------------
# classification labels
# ---------------------------------------------------------------------------------------------
def test_integer_labels_are_kept(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"sentence": f"text {i}", "y": i % 3}) + "\n" for i in range(9)))
    b = load_data(cfg(p, task="sequence-classification", text_column="sentence", label_column="y"), tok)
    assert [ex["label"] for ex in b.train] == [i % 3 for i in range(9)]
    assert b.num_labels == 3 and b.label_names is None


@pytest.mark.parametrize("labels, match", [
    ([0.5, 1.0, 0.0], "integers"),
    ([1, 1, 1], "only one distinct label"),
    ([0, None, 1], "row 1"),
    ([-1, 0, 1], "integers"),
])
def test_bad_labels(tmp_path, tok, labels, match):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": f"text {i}", "label": v}) + "\n" for i, v in enumerate(labels)))
    with pytest.raises(DataError, match=match):
        load_data(cfg(p, task="sequence-classification"), tok)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def test_missing_file_names_the_path(tmp_path, tok):
    missing = tmp_path / "nope" / "train.csv"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        load_data(cfg(missing), tok)
    with pytest.raises(DataError, match="does not exist"):
        load_data(cfg("data.jsonl"), tok)


def test_missing_columns_list_the_columns_present(tmp_path, tok):
    p = tmp_path / "d.csv"
    p.write_text("body,category\nhello there,a\ngood bye,b\n")
    with pytest.raises(DataError, match=r"text column 'text'.*\['body', 'category'\]"):
        load_data(cfg(p), tok)
    with pytest.raises(DataError, match=r"label column 'label'.*\['body', 'category'\]"):
        load_data(cfg(p, task="sequence-classification", text_column="body"), tok)
    with pytest.raises(DataError, match="needs labels"):
        load_data(cfg(write_lines(tmp_path / "t.txt", ["one", "two"]), task="sequence-classification"), tok)


def test_non_text_column(tmp_path, tok):
    p = tmp_path / "d.csv"
    p.write_text("text,label\n1,0\n2,1\n")
    with pytest.raises(DataError, match=r"text column 'text' holds int64 values, not text"):
        load_data(cfg(p), tok)
    q = tmp_path / "d.jsonl"
    q.write_text('{"text": ["a", "b"]}\n{"text": ["c"]}\n')
    with pytest.raises(DataError, match="not text"):
        load_data(cfg(q), tok)


@pytest.mark.parametrize("name, content", [
    ("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.csv", ""), ("header.csv", "text,label\n"),
    ("empty.jsonl", ""), ("blanks.csv", 'text\n""\n"  "\n'),
])
def test_empty_data(tmp_path, tok, name, content):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError) as err:
        load_data(cfg(p), tok)
    assert str(p) in str(err.value)
    assert re.search(r"no rows|0 rows|empty", str(err.value))


@pytest.mark.parametrize("name", ["junk.txt", "junk.csv", "junk.jsonl", "junk.parquet"])
def test_binary_junk_is_a_data_error(tmp_path, tok, name):
    p = tmp_path / name
    p.write_bytes(bytes(range(256)) * 20 + b"\xff\xfe\x00\x80" * 100)
    with pytest.raises(DataError) as err:
        load_data(cfg(p), tok)
    assert str(p) in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_unsupported_and_mixed_files(tmp_path, tok):
    p = tmp_path / "model.bin"
    p.write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match=r"unsupported type '.bin'.*\.csv"):
        load_data(cfg(p), tok)
    d = tmp_path / "mixed"
    d.mkdir()
    write_lines(d / "a.txt", ["hello"])
    (d / "b.csv").write_text("text\nhi\n")
    with pytest.raises(DataError, match="mixes file formats"):
        load_data(cfg(d), tok)
    e = tmp_path / "nothing"
    e.mkdir()
    with pytest.raises(DataError, match="no data files"):
        load_data(cfg(e), tok)


def test_unknown_builtin_lists_the_builtins(tok):
    with pytest.raises(DataError, match=r"unknown builtin.*builtin:python-docs.*builtin:python-docs-topics"):
        load_data(cfg("builtin:shakespeare"), tok)
    with pytest.raises(DataError, match="python-docs-topics"):
        load_data(cfg("builtin:python-docs", task="sequence-classification"), tok)


def test_unreachable_dataset_id_fails_fast_and_suggests_a_local_path(monkeypatch, tok):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(loading.hub, "hub_reachable", lambda timeout=3.0: False)
    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    with pytest.raises(DataError, match=r"'someone/no-such-dataset'.*offline.*local path"):
        load_data(cfg("someone/no-such-dataset"), tok)
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == before


# ---------------------------------------------------------------------------------------------
# builtins
# ---------------------------------------------------------------------------------------------
def test_python_docs_builtin_is_deterministic_paragraphs():
    texts = builtin_texts("python-docs")
    assert texts == builtin_texts("builtin:python-docs")
    assert len(texts) > 500 and len(set(texts)) == len(texts)
    assert all(len(t) >= 40 and "\n" not in t and "  " not in t and t == t.strip() for t in texts)
    # heading underlines are gone (tables keep their "|====|" rules)
    assert not any(re.match(r'[\w "]+ [*=]{5,}', t) for t in texts)
    assert set(builtin_names()) == {"python-docs", "python-docs-topics", "python-docs-qa", "python-docs-pref", "prompts",
                                  "digits"}   # digits: images


def test_builtin_load_from_a_cold_cache(tok):
    from nbtrain.data import builtin

    for cached in (builtin._topic_paragraphs, builtin._docs, builtin._topics):
        cached.cache_clear()   # the cold path (how long it takes is not asserted: no test asserts on a time)
    b = load_data(TrainConfig(), tok)
    assert len(b.train) > 500 and 0 < len(b.eval) < len(b.train) / 10
    assert b.source.startswith("builtin:python-docs")
    assert max(len(ex["input_ids"]) for ex in b.train) == 128


def test_topics_builtin_is_balanced_and_learnable(tok):
    rows = builtin_rows("python-docs-topics")
    names = builtin_label_names("python-docs-topics")
    assert names is not None and len(names) >= 2
    assert 300 <= len(rows) <= 3000
    counts = collections.Counter(r["label"] for r in rows)
    assert sorted(counts) == list(range(len(names)))
    assert min(counts.values()) >= 0.6 * len(rows) / len(names)
    first = collections.Counter(r["label"] for r in rows[:40])    # subsets are balanced too
    assert min(first.get(k, 0) for k in range(len(names))) >= 40 // len(names) - 1
    # a word-count naive Bayes, trained on 4/5 and tested on 1/5, beats chance by far
    def words(t):
        return re.findall(r"[a-z_]+", t.lower())

    train = [r for i, r in enumerate(rows) if i % 5]
    test = [r for i, r in enumerate(rows) if i % 5 == 0]
    bags = [collections.Counter() for _ in names]
    for r in train:
        bags[r["label"]].update(words(r["text"]))
    vocab = len(set().union(*bags))
    totals = [sum(b.values()) for b in bags]

    def predict(text):
        return max(range(len(names)), key=lambda g: sum(
            math.log((bags[g][w] + 1) / (totals[g] + vocab)) for w in words(text)))

    accuracy = sum(predict(r["text"]) == r["label"] for r in test) / len(test)
    assert accuracy > 2.0 / len(names)
    b = load_data(TrainConfig(task="sequence-classification", data="builtin:python-docs-topics"), tok)
    assert b.num_labels == len(names) and b.label_names == names
    assert {ex["label"] for ex in b.train} == set(range(len(names)))


def test_end_to_end_bundle_into_steps(tmp_path, tok):
    paths = _write_all_formats(tmp_path)
    b = load_data(cfg(paths["csv"], task="sequence-classification", eval_fraction=0.3), tok)
    assert len(b.train) == 4 and len(b.eval) == 2
    epoch, mbs = next(iter_steps(b.train, 3, 2, seed=0, pad_token_id=b.pad_token_id, task=b.task))
    assert epoch == 1.0 and [len(mb) for mb in mbs] == [3, 1]
    assert sum(mb.n_targets for mb in mbs) == 4
    assert all(int(mb.labels.max()) < b.num_labels for mb in mbs)
