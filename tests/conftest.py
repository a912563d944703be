import os

import pytest
import torch

from .helpers import Collect, retry_port, run_process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (make test: three workers on two cores) each worker and what it starts (kernels, torchrun
# ranks) computes on one thread: two threads each would only contend (and OpenMP's spinning burns the other core).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(max(1, 2 // WORKERS))


# The longest files first (seconds of one worker in a full run from empty caches, 2026-12-07): with
# --no-loadscope-reorder (the Makefile) xdist hands out files in collection order, so the long ones start at once
# on the workers and the short ones fill in at the end, instead of one long file running alone while the others idle.
# test_real_model and test_memory_real start together: one converts SmolLM2 (once per run, under a lock) while the
# other waits. test_fsdp starts the torchrun start-up (conftest.fsdp_worker_runs, ~55 s) third, so that
# test_real_model's one FSDP test (at its end) finds it made; test_memory_fsdp, its other reader, goes last
# (started together, one worker would wait on the other's lock).
LONGEST_FIRST = ("test_real_model",         # 170
                 "test_memory_real",        # 168
                 "test_fsdp",               # 164, the start-up included
                 "test_notebook_alone",     # 127: a clean environment from the built wheel, then notebook 01
                 "test_browser_results",    # 123
                 "test_browser",            # 111
                 "test_isolation",          # 98
                 "test_memory_grpo",        # 81
                 "test_benchmarks",         # 66
                 "test_browser_first_point",  # 66
                 "test_distributed",        # 59
                 "test_docs_site",          # 58: one notebook executed, the site built, three pages in Chromium
                 "test_browser_layout",     # 57
                 "test_gguf_ranks",         # 53: two torchrun ranks, rank 1 converting a 2-layer SmolLM2
                 "test_ui",                 # 52
                 "test_notebooks")          # 40: notebook A2's other CPU branch, a wrong claim
LAST = ("test_memory_fsdp",)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        if module in LAST:
            return len(LONGEST_FIRST) + 1
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)   # stable: within a file, and among the others, the order is unchanged
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cfg():
    """A fast causal-LM config on the builtin text: fp32, variable-length rows, no eval."""
    import nbtrain as nbt

    return nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=64, max_seq_len=48,
                           micro_batch_size=8, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3)


@pytest.fixture
def collect():
    return Collect()


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    """A small Qwen2 whose output layer dominates (vocab 32,000 x hidden 64, tied): the chunked loss's terms
    are most of the step's memory, so the estimate of them (and, on chat data, of the answer rows only) is what this
    model tests (test_memory.py, test_chat_memory.py)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nbtrain.models.presets import preset_tokenizer

    tok = preset_tokenizer("tiny")
    path = tmp_path_factory.mktemp("bigvocab")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32000, tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


SMOLLM2 = "smollm2-135m-instruct"


def smollm2_ready() -> str:
    """Why the SmolLM2 preset cannot load here ("" when it can): its wheel or the gguf package is missing."""
    import importlib.util

    from nbtrain.models import ModelError, resolve_source

    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (pip install gguf)"
    try:
        resolve_source(SMOLLM2)
    except ModelError as e:
        return str(e)
    return ""


@pytest.fixture(scope="session")
def smollm2():
    """The pretrained preset's name, its GGUF converted to the cache first (once per machine: ~20-30 s, under a
    file lock two xdist workers share); skips, saying why, when the wheel is not installed."""
    why = smollm2_ready()
    if why:
        pytest.skip(why)
    from nbtrain.models import local_source, resolve_source

    local_source(resolve_source(SMOLLM2))
    return SMOLLM2


@pytest.fixture(scope="session")
def fsdp_worker_runs(tmp_path_factory):
    """Every 2-process scenario of tests/fsdp_worker.py (FSDP and DDP on gloo) from one torchrun start-up: rank 0's
    records and final weights by scenario name, and ``_dir``, the folder they ran in (tests/test_fsdp.py,
    tests/test_memory_fsdp.py)."""
    import os
    import sys
    from pathlib import Path

    import torch

    # Under xdist the two modules that use it may run on two workers at once: the first to get here runs torchrun
    # into a folder both see (the workers' common temp root), the other waits on the lock and reads what it left.
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "fsdp-worker-runs"
    with FileLock(str(out) + ".lock", timeout=1200):
        if not (out / "DONE").is_file():
            out.mkdir(exist_ok=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

            def start(port):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                       "127.0.0.1", "--master_port", str(port), str(Path(__file__).with_name("fsdp_worker.py")),
                       str(out)]
                proc = run_process(cmd, 900, env=env)
                return proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:], proc

            ok, output, _ = retry_port(start)
            assert ok, output
            (out / "DONE").write_text("")
    runs = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    runs["_dir"] = out
    return runs


_STARTED: list = []


def pytest_sessionstart(session):
    import time

    _STARTED.append(time.time())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the run: this machine's tiny fp32 throughput (the demo's config, 12 steps, one thread), printed beside
    the suite's time so that suite times on different machines can be compared. Printed, never asserted."""
    if hasattr(config, "workerinput") or config.getoption("collectonly"):
        return
    import time

    import nbtrain as nbt
    from nbtrain.cli import demo_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        r = nbt.train(demo_config().replace(precision="fp32", max_steps=12, subset=200, eval_fraction=0.0))
        tps = r.summary["tokens_per_s"]
    except Exception as e:   # a broken build says so here as well as in the failures above
        terminalreporter.write_line(f"machine probe failed: {e!r}")
        return
    finally:
        torch.set_num_threads(threads)
    wall = f"suite {time.time() - _STARTED[0]:.0f} s; " if _STARTED else ""
    terminalreporter.write_line(f"this machine: {wall}tiny fp32 {tps:,.0f} tok/s (the demo's config, 12 steps, "
                                f"1 thread; probe {time.perf_counter() - t0:.1f} s)")
